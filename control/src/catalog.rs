//! The control-plane catalog: tenants, principals, segments and their
//! versions, grants, policies, the audit log and cache residency.
//!
//! One code path for Postgres (production) and SQLite (embedded default)
//! through sqlx's `Any` driver. All times are milliseconds since the Unix
//! epoch, stored as `BIGINT`; booleans are stored as `0`/`1`.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::migrate::Migrator;
use sqlx::{AnyPool, Row};

static PG_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/postgres");
static SQLITE_MIGRATIONS: Migrator = sqlx::migrate!("../migrations/sqlite");

/// Errors returned by the catalog.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The object does not exist, or the caller may not see it.
    #[error("{0} not found")]
    NotFound(String),
    /// The request conflicts with existing state.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The input is invalid.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// A database error.
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// A migration error.
    #[error("migration error: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A request field is invalid: (field, message).
    #[error("{1}")]
    InvalidField(&'static str, String),
    /// A request field is over its size limit: (field, message).
    #[error("{1}")]
    TooLarge(&'static str, String),
    /// An idempotency key was reused with a different request.
    #[error("{0}")]
    IdempotencyMismatch(String),
}

impl CatalogError {
    /// The same error, naming `field` when it is an [`CatalogError::Invalid`].
    pub fn for_field(self, field: &'static str) -> CatalogError {
        match self {
            CatalogError::Invalid(m) => CatalogError::InvalidField(field, m),
            other => other,
        }
    }

    /// The request field the error is about, if it names one.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            CatalogError::InvalidField(f, _) | CatalogError::TooLarge(f, _) => Some(f),
            _ => None,
        }
    }
}

/// Default of [`CatalogLimits::max_content_bytes`]: 1 MiB.
pub const DEFAULT_MAX_SEGMENT_BYTES: usize = 1 << 20;
/// Default of [`CatalogLimits::idempotency_ttl_ms`]: 24 hours.
pub const DEFAULT_IDEMPOTENCY_TTL_MS: i64 = 24 * 3600 * 1000;
/// Longest segment name, bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest idempotency key, bytes.
pub const MAX_IDEMPOTENCY_KEY_BYTES: usize = 255;
/// Default page size of [`Catalog::list_segments`] callers.
pub const DEFAULT_LIST_LIMIT: usize = 100;
/// Largest page of [`Catalog::list_segments`].
pub const MAX_LIST_LIMIT: usize = 1000;

/// Size and lifetime limits of the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CatalogLimits {
    /// Largest content of one segment version, bytes (beyond: `TooLarge`, a 413).
    pub max_content_bytes: usize,
    /// How long an idempotency key is remembered, milliseconds.
    pub idempotency_ttl_ms: i64,
}

impl Default for CatalogLimits {
    fn default() -> Self {
        CatalogLimits {
            max_content_bytes: DEFAULT_MAX_SEGMENT_BYTES,
            idempotency_ttl_ms: DEFAULT_IDEMPOTENCY_TTL_MS,
        }
    }
}

/// Result alias for catalog operations.
pub type CatalogResult<T> = Result<T, CatalogError>;

/// Which database the catalog runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Postgres (production).
    Postgres,
    /// SQLite (embedded default).
    Sqlite,
}

/// Role of a principal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A tenant user: sees its own segments, shared ones and those granted to it.
    Tenant,
    /// An operator: manages policies and may act on every tenant's segments.
    Operator,
}

impl Role {
    /// The role's name as stored and as written in tokens.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Tenant => "tenant",
            Role::Operator => "operator",
        }
    }
}

impl FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Role, String> {
        match s {
            "tenant" => Ok(Role::Tenant),
            "operator" => Ok(Role::Operator),
            other => Err(format!(
                "unknown role {other:?} (expected \"tenant\" or \"operator\")"
            )),
        }
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Hex SHA-256 of a segment's content: the content hash stored per version.
pub fn content_hash(content: &str) -> String {
    hex::encode(Sha256::digest(content.as_bytes()))
}

/// A segment with its current version.
///
/// Addressing: a segment has an id chosen by its owner, unique among the
/// owner's live segments (another tenant may use the same id; a deleted id may
/// be used again), and an opaque global `address` (`~` and 32 hex digits)
/// assigned at creation and never reused. A tenant addresses its own segments
/// by id or address, and segments of other tenants it may read (public,
/// granted) by address only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Segment {
    /// The id the viewer addresses the segment by: the owner's id for the
    /// owner and for operators (see [`Segment::view_for`]), the address for
    /// other tenants.
    pub id: String,
    /// Opaque global address (`~` + 32 hex digits).
    pub address: String,
    /// Owning tenant; shown only to the owner and to operators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_tenant: Option<String>,
    /// Human-readable name (defaults to the owner's id; other tenants then see
    /// the address here, see [`Segment::view_for`]).
    pub name: String,
    /// Explicitly public: every tenant may read it and it may use the shared
    /// cache namespace.
    pub public: bool,
    /// Current version number (1-based).
    pub current_version: i64,
    /// Content hash of the current version.
    pub content_hash: String,
    /// Content length in bytes of the current version.
    pub byte_len: i64,
    /// Token counts of the current version per model.
    pub tokens: BTreeMap<String, i64>,
    /// Creation time (ms).
    pub created_at: i64,
    /// Time of the last update (ms).
    pub updated_at: i64,
}

impl Segment {
    /// The segment as `tenant` may see it: unchanged for its owner and for
    /// operators; for another tenant `id` is the address, `owner_tenant` is
    /// hidden, and a `name` equal to the owner's id (the default name) reads
    /// as the address too.
    pub fn view_for(mut self, tenant: &str, operator: bool) -> Segment {
        if !operator && self.owner_tenant.as_deref() != Some(tenant) {
            if self.name == self.id {
                self.name = self.address.clone();
            }
            self.id = self.address.clone();
            self.owner_tenant = None;
        }
        self
    }

    /// The id `viewer` addresses this segment by in listings (its own id for
    /// the owner, else the address).
    pub fn view_id(&self, viewer: &str) -> String {
        if self.owner_tenant.as_deref() == Some(viewer) {
            self.id.clone()
        } else {
            self.address.clone()
        }
    }
}

/// Answer of [`Catalog::create_segment_idempotent`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Created {
    /// The segment as created (for a replay: as recorded at creation).
    pub segment: Segment,
    /// True when this is the recorded answer to an earlier request with the
    /// same idempotency key.
    pub replayed: bool,
}

/// One page of [`Catalog::list_segments`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentPage {
    /// Segments of this page (full records: apply [`Segment::view_for`]).
    pub items: Vec<Segment>,
    /// Cursor (`after`) of the next page; `None` on the last page.
    pub next: Option<String>,
}

/// One version of a segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SegmentVersion {
    /// Segment address.
    pub segment_id: String,
    /// Version number.
    pub version: i64,
    /// Hex SHA-256 of the content.
    pub content_hash: String,
    /// Content length in bytes.
    pub byte_len: i64,
    /// Who created this version (token subject).
    pub created_by: String,
    /// Creation time (ms).
    pub created_at: i64,
    /// When a newer version replaced it (ms), if it did.
    pub superseded_at: Option<i64>,
}

/// Input for creating a segment.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NewSegment {
    /// Segment id, unique among the owner's live segments; must be 1..=128
    /// characters of `[A-Za-z0-9._:-]`.
    pub id: String,
    /// Human-readable name (defaults to the id), at most [`MAX_NAME_BYTES`] bytes.
    #[serde(default)]
    pub name: Option<String>,
    /// Content of version 1.
    pub content: String,
    /// Token counts per model.
    #[serde(default)]
    pub tokens: BTreeMap<String, i64>,
    /// Explicitly public (shared) segment.
    #[serde(default)]
    pub public: bool,
}

/// The version of one segment a request will use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotEntry {
    /// Segment address.
    pub segment_id: String,
    /// Version pinned for this request.
    pub version: i64,
    /// Content hash of that version.
    pub content_hash: String,
    /// Owning tenant.
    pub owner_tenant: String,
    /// Whether the segment is explicitly public.
    pub public: bool,
}

/// One audit-log row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AuditEntry {
    /// Row id.
    pub id: i64,
    /// Time (ms).
    pub at: i64,
    /// Who acted (token subject, or `system`).
    pub actor: String,
    /// Tenant involved, if any.
    pub tenant: Option<String>,
    /// Action, e.g. `segment.update`, `policy.fault`.
    pub action: String,
    /// Target object, e.g. a segment or policy id.
    pub target: String,
    /// JSON details.
    pub detail: String,
}

/// Which audit rows [`Catalog::audit_log_filtered`] returns (every set field must match).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditFilter {
    /// Only this action, e.g. `policy.activate`.
    pub action: Option<String>,
    /// Only rows by this actor (token subject, or `system`).
    pub actor: Option<String>,
    /// Only rows at or after this time (ms since the Unix epoch).
    pub since_ms: Option<i64>,
    /// Only rows before this time (ms since the Unix epoch).
    pub until_ms: Option<i64>,
}

/// A stored policy module.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PolicyRecord {
    /// Row id.
    pub id: i64,
    /// Policy name.
    pub name: String,
    /// Kind: `eviction`, `admission`, `invalidation` or `isolation`.
    pub kind: String,
    /// Hex SHA-256 of the module.
    pub module_sha256: String,
    /// Parameters (JSON object).
    pub params: String,
    /// Version number among policies of the same name.
    pub version: i64,
    /// Uploader.
    pub created_by: String,
    /// Upload time (ms).
    pub created_at: i64,
    /// Whether it is the active policy of its kind.
    pub active: bool,
    /// The Wasm module (not serialized in listings).
    #[serde(skip)]
    pub module: Vec<u8>,
}

/// A residency report row: which worker holds which cache entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Residency {
    /// Worker id.
    pub worker: String,
    /// Cache key (isolation key + segment version).
    pub cache_key: String,
    /// Segment id.
    pub segment_id: String,
    /// Segment version.
    pub version: i64,
    /// Tenant namespace, `None` for the shared namespace.
    pub tenant: Option<String>,
    /// Bytes held.
    pub bytes: i64,
    /// Last use (ms).
    pub last_use: i64,
}

/// A group of tenants. A grant to the group lets every member read the segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Group {
    /// Group id (same rules as tenant ids).
    pub id: String,
    /// Human-readable name (defaults to the owner's id; other tenants then see
    /// the address here, see [`Segment::view_for`]).
    pub name: String,
    /// Member tenants, sorted.
    pub members: Vec<String>,
    /// Who created it (token subject).
    pub created_by: String,
    /// Creation time (ms).
    pub created_at: i64,
}

/// The catalog over a Postgres or SQLite pool.
#[derive(Clone, Debug)]
pub struct Catalog {
    pool: AnyPool,
    backend: Backend,
    limits: CatalogLimits,
    pub(crate) events: crate::residency::Events,
}

/// Whether `r` has the form of a segment address: `~` and 32 lowercase hex digits.
pub fn is_address(r: &str) -> bool {
    r.len() == 33
        && r.starts_with('~')
        && r[1..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A soft-deleted segment ([`Catalog::deleted_segment`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeletedSegment {
    /// Its address.
    pub address: String,
    /// Its id in its owner's namespace.
    pub id: String,
    /// Owner tenant.
    pub owner_tenant: String,
    /// Whether it was public.
    pub public: bool,
    /// Deletion time (ms since the Unix epoch).
    pub deleted_at: i64,
}

/// A fresh segment address.
fn new_address() -> String {
    format!("~{}", hex::encode(rand::random::<[u8; 16]>()))
}

/// Checks a segment reference: an address or a segment id.
pub fn validate_ref(what: &str, r: &str) -> CatalogResult<()> {
    if is_address(r) {
        Ok(())
    } else {
        validate_id(what, r)
    }
}

fn validate_name(name: &str) -> CatalogResult<()> {
    if name.len() > MAX_NAME_BYTES {
        return Err(CatalogError::InvalidField(
            "name",
            format!(
                "'name' is {} bytes, over the limit of {MAX_NAME_BYTES}",
                name.len()
            ),
        ));
    }
    validate_text("name", name).map_err(|e| e.for_field("name"))
}

fn validate_idempotency_key(k: &str) -> CatalogResult<()> {
    if k.is_empty()
        || k.len() > MAX_IDEMPOTENCY_KEY_BYTES
        || !k.bytes().all(|b| (0x20..0x7f).contains(&b))
    {
        return Err(CatalogError::InvalidField(
            "Idempotency-Key",
            format!(
                "the Idempotency-Key header must be 1..={MAX_IDEMPOTENCY_KEY_BYTES} printable ASCII characters"
            ),
        ));
    }
    Ok(())
}

/// Checks a segment or tenant id: 1..=128 characters of `[A-Za-z0-9._:-]`.
pub fn validate_id(what: &str, id: &str) -> CatalogResult<()> {
    if id.is_empty() || id.len() > 128 {
        return Err(CatalogError::Invalid(format!(
            "{what} must be 1..=128 characters"
        )));
    }
    if id == "." || id == ".." {
        // Not addressable in a URL path: clients normalise them away.
        return Err(CatalogError::Invalid(format!(
            "{what} must not be \".\" or \"..\""
        )));
    }
    if !id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))
    {
        return Err(CatalogError::Invalid(format!(
            "{what} {id:?} may only contain letters, digits, '.', '_', ':' and '-'"
        )));
    }
    Ok(())
}

/// Refuses text the backends disagree on: Postgres cannot store a NUL
/// character in a `TEXT` column (the insert would fail as a database error,
/// a 500), while SQLite would.
pub fn validate_text(what: &str, text: &str) -> CatalogResult<()> {
    if text.contains('\0') {
        return Err(CatalogError::Invalid(format!(
            "{what} must not contain NUL characters"
        )));
    }
    Ok(())
}

fn validate_tokens(tokens: &BTreeMap<String, i64>) -> CatalogResult<()> {
    for (m, t) in tokens {
        if m.is_empty() || m.len() > 200 {
            return Err(CatalogError::Invalid(
                "model name must be 1..=200 characters".into(),
            ));
        }
        validate_text("model name", m)?;
        if *t < 0 {
            return Err(CatalogError::Invalid(format!(
                "token count for {m:?} is negative"
            )));
        }
    }
    Ok(())
}

impl Catalog {
    /// Connects to `url` (`postgres://…` or `sqlite://…`; a plain path is
    /// taken as a SQLite file, created if missing) and applies migrations.
    pub async fn connect(url: &str) -> CatalogResult<Catalog> {
        Self::connect_in_schema(url, None).await
    }

    /// Like [`Catalog::connect`], but on Postgres creates `schema` if needed
    /// and uses it as the search path of every connection (used to isolate
    /// test runs). Ignored for SQLite.
    pub async fn connect_in_schema(url: &str, schema: Option<&str>) -> CatalogResult<Catalog> {
        sqlx::any::install_default_drivers();
        let (url, backend) = normalize_url(url)?;
        let mut opts = AnyPoolOptions::new().acquire_timeout(Duration::from_secs(10));
        if backend == Backend::Sqlite {
            opts = opts.max_connections(4).after_connect(|conn, _meta| {
                Box::pin(async move {
                    sqlx::query("PRAGMA busy_timeout = 10000")
                        .execute(&mut *conn)
                        .await?;
                    sqlx::query("PRAGMA foreign_keys = ON")
                        .execute(&mut *conn)
                        .await?;
                    Ok(())
                })
            });
        } else {
            opts = opts.max_connections(8);
            if let Some(schema) = schema {
                validate_id("schema", schema)?;
                if !schema
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
                {
                    return Err(CatalogError::Invalid("schema must be [A-Za-z0-9_]".into()));
                }
                let setup = AnyPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await?;
                sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                    .execute(&setup)
                    .await?;
                setup.close().await;
                let sp = format!("SET search_path TO {schema}");
                opts = opts.after_connect(move |conn, _meta| {
                    let sp = sp.clone();
                    Box::pin(async move {
                        sqlx::query(&sp).execute(&mut *conn).await?;
                        Ok(())
                    })
                });
            }
        }
        let pool = opts.connect(&url).await?;
        if backend == Backend::Sqlite {
            sqlx::query("PRAGMA journal_mode = WAL")
                .execute(&pool)
                .await?;
        }
        let channel = match backend {
            Backend::Postgres => {
                let schema: String = sqlx::query("SELECT CAST(current_schema() AS TEXT)")
                    .fetch_one(&pool)
                    .await?
                    .get(0);
                crate::residency::channel_for(&schema)
            }
            Backend::Sqlite => crate::residency::channel_for("sqlite"),
        };
        let cat = Catalog {
            pool,
            backend,
            limits: CatalogLimits::default(),
            events: crate::residency::Events::new(&url, channel),
        };
        cat.migrate().await?;
        Ok(cat)
    }

    /// Applies the migrations of this backend (idempotent).
    pub async fn migrate(&self) -> CatalogResult<()> {
        match self.backend {
            Backend::Postgres => PG_MIGRATIONS.run(&self.pool).await?,
            Backend::Sqlite => SQLITE_MIGRATIONS.run(&self.pool).await?,
        }
        Ok(())
    }

    /// The same catalog with other limits.
    pub fn with_limits(mut self, limits: CatalogLimits) -> Catalog {
        self.limits = limits;
        self
    }

    /// The limits in force.
    pub fn limits(&self) -> CatalogLimits {
        self.limits
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The underlying pool.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Versions of the migrations applied, in order.
    pub async fn applied_migrations(&self) -> CatalogResult<Vec<i64>> {
        let rows = sqlx::query(
            "SELECT version FROM _sqlx_migrations WHERE success = TRUE ORDER BY version",
        )
        .fetch_all(&self.pool)
        .await;
        // SQLite stores booleans as integers; `TRUE` is accepted by both.
        Ok(rows?.iter().map(|r| r.get::<i64, _>(0)).collect())
    }

    // ---- tenants and principals -------------------------------------------------

    /// Creates the tenant if it does not exist yet.
    pub async fn ensure_tenant(&self, id: &str, name: &str) -> CatalogResult<()> {
        validate_id("tenant id", id)?;
        sqlx::query("INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING")
            .bind(id)
            .bind(name)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Lists tenant ids.
    pub async fn tenants(&self) -> CatalogResult<Vec<String>> {
        let rows = sqlx::query("SELECT id FROM tenants ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    /// Records a principal (token subject) of a tenant with a role, creating
    /// the tenant if needed. Re-registering updates the role.
    pub async fn upsert_principal(&self, tenant: &str, sub: &str, role: Role) -> CatalogResult<()> {
        self.ensure_tenant(tenant, tenant).await?;
        if sub.is_empty() || sub.len() > 256 {
            return Err(CatalogError::Invalid(
                "subject must be 1..=256 characters".into(),
            ));
        }
        validate_text("subject", sub)?;
        sqlx::query(
            "INSERT INTO principals (sub, tenant_id, role, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (tenant_id, sub) DO UPDATE SET role = excluded.role",
        )
        .bind(sub)
        .bind(tenant)
        .bind(role.as_str())
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The role recorded for a principal, if any.
    pub async fn principal_role(&self, tenant: &str, sub: &str) -> CatalogResult<Option<Role>> {
        let row = sqlx::query("SELECT role FROM principals WHERE tenant_id = $1 AND sub = $2")
            .bind(tenant)
            .bind(sub)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.and_then(|r| r.get::<String, _>(0).parse().ok()))
    }

    // ---- segments ----------------------------------------------------------------

    /// Creates a segment owned by `owner` with version 1. `Conflict` when
    /// `owner` already has a live segment with that id (ids of other tenants
    /// and of deleted segments are free).
    pub async fn create_segment(
        &self,
        owner: &str,
        actor: &str,
        seg: &NewSegment,
    ) -> CatalogResult<Segment> {
        Ok(self
            .create_segment_idempotent(owner, actor, seg, None)
            .await?
            .segment)
    }

    /// Like [`Catalog::create_segment`], with an optional client idempotency
    /// key (1..=255 printable ASCII characters, scoped to `owner`). The first
    /// create with a key records the answer in the same transaction as the
    /// segment; a retry with the same key and the same request within the
    /// configured lifetime ([`CatalogLimits::idempotency_ttl_ms`]) gets that
    /// answer again (`replayed: true`) instead of a conflict, even if the
    /// segment changed or was deleted since. The same key with a different
    /// request is [`CatalogError::IdempotencyMismatch`].
    pub async fn create_segment_idempotent(
        &self,
        owner: &str,
        actor: &str,
        seg: &NewSegment,
        idempotency_key: Option<&str>,
    ) -> CatalogResult<Created> {
        validate_id("segment id", &seg.id).map_err(|e| e.for_field("id"))?;
        validate_tokens(&seg.tokens).map_err(|e| e.for_field("tokens"))?;
        validate_text("content", &seg.content).map_err(|e| e.for_field("content"))?;
        self.check_content_size(&seg.content)?;
        if let Some(name) = &seg.name {
            validate_name(name)?;
        }
        if let Some(k) = idempotency_key {
            validate_idempotency_key(k)?;
        }
        self.ensure_tenant(owner, owner).await?;
        let now = now_ms();
        let name = seg.name.clone().unwrap_or_else(|| seg.id.clone());
        let request_hash = hex::encode(Sha256::digest(
            serde_json::to_vec(seg).expect("a NewSegment always serialises"),
        ));
        if idempotency_key.is_some() {
            // Expired records are forgotten first (bounded lifetime), also when
            // this create fails.
            sqlx::query("DELETE FROM segment_idempotency WHERE created_at < $1")
                .bind(now - self.limits.idempotency_ttl_ms)
                .execute(&self.pool)
                .await?;
        }
        let mut tx = self.pool.begin().await?;
        if let Some(k) = idempotency_key {
            // Claim the key; a concurrent create with the same key waits on the
            // claim and then sees the record it committed.
            let claimed = sqlx::query(
                "INSERT INTO segment_idempotency (tenant_id, idem_key, request_hash, response, created_at) \
                 VALUES ($1, $2, $3, '', $4) ON CONFLICT (tenant_id, idem_key) DO NOTHING",
            )
            .bind(owner)
            .bind(k)
            .bind(&request_hash)
            .bind(now)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if claimed == 0 {
                let row = sqlx::query(
                    "SELECT request_hash, response FROM segment_idempotency \
                     WHERE tenant_id = $1 AND idem_key = $2",
                )
                .bind(owner)
                .bind(k)
                .fetch_one(&mut *tx)
                .await?;
                let (hash, response): (String, String) = (row.get(0), row.get(1));
                if hash != request_hash {
                    return Err(CatalogError::IdempotencyMismatch(format!(
                        "Idempotency-Key {k:?} was already used with a different request"
                    )));
                }
                let segment: Segment = serde_json::from_str(&response).map_err(|e| {
                    CatalogError::Db(sqlx::Error::Decode(
                        format!("stored idempotent response: {e}").into(),
                    ))
                })?;
                return Ok(Created {
                    segment,
                    replayed: true,
                });
            }
        }
        let address = new_address();
        let res = sqlx::query(
            "INSERT INTO segments (id, local_id, owner_tenant, name, public, current_version, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, 1, $6, $6) ON CONFLICT DO NOTHING",
        )
        .bind(&address)
        .bind(&seg.id)
        .bind(owner)
        .bind(&name)
        .bind(seg.public as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if res.rows_affected() == 0 {
            return Err(CatalogError::Conflict(format!(
                "segment {:?} already exists",
                seg.id
            )));
        }
        insert_version(&mut tx, &address, 1, &seg.content, &seg.tokens, actor, now).await?;
        insert_audit(
            &mut tx,
            actor,
            Some(owner),
            "segment.create",
            &seg.id,
            &serde_json::json!({
                "address": address, "version": 1,
                "content_hash": content_hash(&seg.content), "public": seg.public,
            }),
        )
        .await?;
        let segment = Segment {
            id: seg.id.clone(),
            address: address.clone(),
            owner_tenant: Some(owner.to_string()),
            name,
            public: seg.public,
            current_version: 1,
            content_hash: content_hash(&seg.content),
            byte_len: seg.content.len() as i64,
            tokens: seg.tokens.clone(),
            created_at: now,
            updated_at: now,
        };
        if let Some(k) = idempotency_key {
            sqlx::query(
                "UPDATE segment_idempotency SET response = $1 WHERE tenant_id = $2 AND idem_key = $3",
            )
            .bind(serde_json::to_string(&segment).expect("a Segment always serialises"))
            .bind(owner)
            .bind(k)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Created {
            segment,
            replayed: false,
        })
    }

    fn check_content_size(&self, content: &str) -> CatalogResult<()> {
        let max = self.limits.max_content_bytes;
        if content.len() > max {
            return Err(CatalogError::TooLarge(
                "content",
                format!(
                    "'content' is {} bytes, over the limit of {max} bytes per segment",
                    content.len()
                ),
            ));
        }
        Ok(())
    }

    /// Replaces the content of a segment (by address): creates version
    /// `current + 1` and marks the previous version superseded, atomically.
    /// Returns the new current state.
    pub async fn update_segment(
        &self,
        address: &str,
        actor: &str,
        content: &str,
        tokens: &BTreeMap<String, i64>,
    ) -> CatalogResult<Segment> {
        self.update_segments(
            actor,
            &[(address.to_string(), content.to_string(), tokens.clone())],
        )
        .await?;
        self.get_segment(address).await
    }

    /// Updates several segments (by address) in one transaction: a snapshot
    /// sees either all of the new versions or none of them. Returns the new
    /// version numbers.
    pub async fn update_segments(
        &self,
        actor: &str,
        updates: &[(String, String, BTreeMap<String, i64>)],
    ) -> CatalogResult<Vec<i64>> {
        for (_, content, t) in updates {
            validate_tokens(t).map_err(|e| e.for_field("tokens"))?;
            validate_text("content", content).map_err(|e| e.for_field("content"))?;
            self.check_content_size(content)?;
        }
        // Lock rows in a fixed order to avoid deadlocks between concurrent batches.
        let mut order: Vec<usize> = (0..updates.len()).collect();
        order.sort_by(|&a, &b| updates[a].0.cmp(&updates[b].0));
        let now = now_ms();
        let mut versions = vec![0i64; updates.len()];
        let mut tx = self.pool.begin().await?;
        for i in order {
            let (id, content, tokens) = &updates[i];
            // The UPDATE takes the row lock (Postgres) / write lock (SQLite) first,
            // so concurrent updaters of one segment serialize here.
            let row = sqlx::query(
                "UPDATE segments SET current_version = current_version + 1, updated_at = $1 \
                 WHERE id = $2 AND deleted_at IS NULL RETURNING current_version, owner_tenant, local_id",
            )
            .bind(now)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
            let Some(row) = row else {
                return Err(CatalogError::NotFound(format!("segment {id:?}")));
            };
            let v: i64 = row.get(0);
            let owner: String = row.get(1);
            let local: String = row.get(2);
            sqlx::query("UPDATE segment_versions SET superseded_at = $1 WHERE segment_id = $2 AND version = $3")
                .bind(now)
                .bind(id)
                .bind(v - 1)
                .execute(&mut *tx)
                .await?;
            insert_version(&mut tx, id, v, content, tokens, actor, now).await?;
            insert_audit(
                &mut tx,
                actor,
                Some(&owner),
                "segment.update",
                &local,
                &serde_json::json!({
                    "address": id, "version": v,
                    "content_hash": content_hash(content), "superseded": v - 1,
                }),
            )
            .await?;
            versions[i] = v;
        }
        let events: Vec<crate::residency::CatalogEvent> = updates
            .iter()
            .zip(&versions)
            .map(|((id, _, _), &v)| crate::residency::CatalogEvent::Segment {
                address: id.clone(),
                version: v,
                deleted: false,
            })
            .collect();
        for e in &events {
            self.notify_in(&mut tx, e).await?;
        }
        tx.commit().await?;
        for e in events {
            self.publish(e);
        }
        Ok(versions)
    }

    /// Soft-deletes a segment (by address): its current version is superseded
    /// and lookups miss. Its owner may create a new segment with the same id
    /// (it gets a new address).
    pub async fn delete_segment(&self, address: &str, actor: &str) -> CatalogResult<()> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(
            "UPDATE segments SET deleted_at = $1, updated_at = $1 WHERE id = $2 AND deleted_at IS NULL \
             RETURNING current_version, owner_tenant, local_id",
        )
        .bind(now)
        .bind(address)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Err(CatalogError::NotFound(format!("segment {address:?}")));
        };
        let v: i64 = row.get(0);
        let owner: String = row.get(1);
        let local: String = row.get(2);
        sqlx::query(
            "UPDATE segment_versions SET superseded_at = $1 WHERE segment_id = $2 AND version = $3",
        )
        .bind(now)
        .bind(address)
        .bind(v)
        .execute(&mut *tx)
        .await?;
        insert_audit(
            &mut tx,
            actor,
            Some(&owner),
            "segment.delete",
            &local,
            &serde_json::json!({"address": address, "version": v}),
        )
        .await?;
        let event = crate::residency::CatalogEvent::Segment {
            address: address.to_string(),
            version: v,
            deleted: true,
        };
        self.notify_in(&mut tx, &event).await?;
        tx.commit().await?;
        self.publish(event);
        Ok(())
    }

    /// One page of the live segments `viewer` may read (every live segment
    /// when `all`, for operators), in one statement: state, current version
    /// and token counts. A tenant's page is ordered by the id it addresses the
    /// segments by (its own segments by their id, then the others by address);
    /// an operator's by `owner/id`; byte order in both. The page starts after
    /// the cursor `after` and holds at most `limit` items (clamped to
    /// 1..=[`MAX_LIST_LIMIT`]); `next` is the cursor of the following page,
    /// `None` on the last one.
    pub async fn list_segments(
        &self,
        viewer: &str,
        all: bool,
        after: Option<&str>,
        limit: usize,
    ) -> CatalogResult<SegmentPage> {
        let limit = limit.clamp(1, MAX_LIST_LIMIT);
        let collate = match self.backend {
            Backend::Postgres => " COLLATE \"C\"",
            Backend::Sqlite => "",
        };
        let (sk, filter) = if all {
            (
                format!("(s.owner_tenant || '/' || s.local_id){collate}"),
                // $1 is bound either way.
                "(s.owner_tenant = $1 OR 1 = 1)".to_string(),
            )
        } else {
            (
                format!("(CASE WHEN s.owner_tenant = $1 THEN s.local_id ELSE s.id END){collate}"),
                readable_by("$1"),
            )
        };
        let sql = format!(
            "SELECT p.id, p.local_id, p.owner_tenant, p.name, p.public, p.current_version, \
                    p.created_at, p.updated_at, v.content_hash, v.byte_len, t.model, t.tokens \
             FROM (SELECT s.id, s.local_id, s.owner_tenant, s.name, s.public, s.current_version, \
                          s.created_at, s.updated_at, {sk} AS sk \
                   FROM segments s \
                   WHERE s.deleted_at IS NULL AND {filter} AND {sk} > $2 \
                   ORDER BY sk LIMIT $3) p \
             JOIN segment_versions v ON v.segment_id = p.id AND v.version = p.current_version \
             LEFT JOIN segment_token_counts t ON t.segment_id = p.id AND t.version = p.current_version \
             ORDER BY p.sk, t.model"
        );
        let rows = sqlx::query(&sql)
            .bind(viewer)
            .bind(after.unwrap_or(""))
            .bind(limit as i64 + 1)
            .fetch_all(&self.pool)
            .await?;
        let mut items: Vec<Segment> = Vec::new();
        for r in &rows {
            let address: String = r.get(0);
            if items.last().is_none_or(|s| s.address != address) {
                items.push(Segment {
                    id: r.get(1),
                    address,
                    owner_tenant: Some(r.get(2)),
                    name: r.get(3),
                    public: r.get::<i64, _>(4) != 0,
                    current_version: r.get(5),
                    created_at: r.get(6),
                    updated_at: r.get(7),
                    content_hash: r.get(8),
                    byte_len: r.get(9),
                    tokens: BTreeMap::new(),
                });
            }
            let model: Option<String> = r.get(10);
            if let (Some(m), Some(s)) = (model, items.last_mut()) {
                s.tokens.insert(m, r.get::<i64, _>(11));
            }
        }
        let next = if items.len() > limit {
            items.truncate(limit);
            items.last().map(|s| {
                if all {
                    format!("{}/{}", s.owner_tenant.as_deref().unwrap_or(""), s.id)
                } else {
                    s.view_id(viewer)
                }
            })
        } else {
            None
        };
        Ok(SegmentPage { items, next })
    }

    /// The live segment `tenant` addresses as `reference`: an address
    /// (`~…`, any owner) or an id of the tenant's own segments. No access
    /// check (see [`Catalog::can_read`]); `NotFound` otherwise.
    pub async fn find_segment(&self, tenant: &str, reference: &str) -> CatalogResult<Segment> {
        if is_address(reference) {
            return self.get_segment(reference).await;
        }
        let row = sqlx::query(
            "SELECT id FROM segments WHERE owner_tenant = $1 AND local_id = $2 AND deleted_at IS NULL",
        )
        .bind(tenant)
        .bind(reference)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| CatalogError::NotFound(format!("segment {reference:?}")))?;
        self.get_segment(&row.get::<String, _>(0)).await
    }

    /// The newest soft-deleted segment that `reference` names for `tenant` (an
    /// address, or one of `tenant`'s own segment ids), without access checks;
    /// `None` when no deleted segment matches.
    pub async fn deleted_segment(
        &self,
        tenant: &str,
        reference: &str,
    ) -> CatalogResult<Option<DeletedSegment>> {
        let row = sqlx::query(
            "SELECT id, local_id, owner_tenant, public, deleted_at FROM segments \
             WHERE deleted_at IS NOT NULL AND (id = $1 OR (owner_tenant = $2 AND local_id = $1)) \
             ORDER BY deleted_at DESC LIMIT 1",
        )
        .bind(reference)
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|row| DeletedSegment {
            address: row.get(0),
            id: row.get(1),
            owner_tenant: row.get(2),
            public: row.get::<i64, _>(3) != 0,
            deleted_at: row.get(4),
        }))
    }

    /// The current state of a live segment by address, without access checks.
    pub async fn get_segment(&self, address: &str) -> CatalogResult<Segment> {
        let row = sqlx::query(
            "SELECT s.id, s.local_id, s.owner_tenant, s.name, s.public, s.current_version, v.content_hash, \
                    v.byte_len, s.created_at, s.updated_at \
             FROM segments s JOIN segment_versions v ON v.segment_id = s.id AND v.version = s.current_version \
             WHERE s.id = $1 AND s.deleted_at IS NULL",
        )
        .bind(address)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| CatalogError::NotFound(format!("segment {address:?}")))?;
        let version: i64 = row.get(5);
        let tokens = self.tokens(address, version).await?;
        Ok(Segment {
            address: row.get(0),
            id: row.get(1),
            owner_tenant: Some(row.get(2)),
            name: row.get(3),
            public: row.get::<i64, _>(4) != 0,
            current_version: version,
            content_hash: row.get(6),
            byte_len: row.get(7),
            tokens,
            created_at: row.get(8),
            updated_at: row.get(9),
        })
    }

    /// The content of a given version of the segment at `address`.
    pub async fn version_content(
        &self,
        address: &str,
        version: i64,
    ) -> CatalogResult<Option<String>> {
        let row = sqlx::query(
            "SELECT content FROM segment_versions WHERE segment_id = $1 AND version = $2",
        )
        .bind(address)
        .bind(version)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| CatalogError::NotFound(format!("segment {address:?} version {version}")))?;
        Ok(row.get(0))
    }

    async fn tokens(&self, address: &str, version: i64) -> CatalogResult<BTreeMap<String, i64>> {
        let rows = sqlx::query(
            "SELECT model, tokens FROM segment_token_counts WHERE segment_id = $1 AND version = $2",
        )
        .bind(address)
        .bind(version)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1)))
            .collect())
    }

    /// All versions of the segment at `address`, oldest first
    /// (`segment_id` is the address).
    pub async fn versions(&self, address: &str) -> CatalogResult<Vec<SegmentVersion>> {
        let rows = sqlx::query(
            "SELECT segment_id, version, content_hash, byte_len, created_by, created_at, superseded_at \
             FROM segment_versions WHERE segment_id = $1 ORDER BY version",
        )
        .bind(address)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| SegmentVersion {
                segment_id: r.get(0),
                version: r.get(1),
                content_hash: r.get(2),
                byte_len: r.get(3),
                created_by: r.get(4),
                created_at: r.get(5),
                superseded_at: r.get(6),
            })
            .collect())
    }

    /// Whether `tenant` may read the segment at `address`: it owns it, the
    /// segment is public, it holds a grant, or it is a member of a group
    /// holding a grant. Deleted segments are readable by no one.
    pub async fn can_read(&self, tenant: &str, address: &str) -> CatalogResult<bool> {
        let row = sqlx::query(&format!(
            "SELECT 1 FROM segments s WHERE s.id = $1 AND s.deleted_at IS NULL AND {}",
            readable_by("$2")
        ))
        .bind(address)
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.is_some())
    }

    /// Pins the current version of each segment `tenant` addresses in `refs`
    /// (its own ids or addresses, see [`Catalog::find_segment`]), in one
    /// statement, so the snapshot is consistent: it never mixes versions of a
    /// batch update, and each entry's hash is that of its version. Entries
    /// come in the order of `refs`, `segment_id` being the address. Fails with
    /// `NotFound` naming the first reference the tenant may not read (the
    /// caller treats that as a miss: no key, no cache hit).
    pub async fn snapshot(
        &self,
        tenant: &str,
        refs: &[String],
    ) -> CatalogResult<Vec<SnapshotEntry>> {
        if refs.is_empty() {
            return Ok(vec![]);
        }
        if refs.len() > 1000 {
            return Err(CatalogError::Invalid(
                "at most 1000 segments per snapshot".into(),
            ));
        }
        for r in refs {
            validate_ref("segment id", r).map_err(|e| e.for_field("segments"))?;
        }
        let placeholders: Vec<String> = (0..refs.len()).map(|i| format!("${}", i + 2)).collect();
        let list = placeholders.join(", ");
        let sql = format!(
            "SELECT s.id, v.version, v.content_hash, s.owner_tenant, s.public, s.local_id \
             FROM segments s JOIN segment_versions v ON v.segment_id = s.id AND v.version = s.current_version \
             WHERE s.deleted_at IS NULL AND (s.id IN ({list}) OR (s.owner_tenant = $1 AND s.local_id IN ({list}))) \
             AND {}",
            readable_by("$1")
        );
        let mut q = sqlx::query(&sql).bind(tenant);
        for r in refs {
            q = q.bind(r);
        }
        let rows = q.fetch_all(&self.pool).await?;
        let mut found: BTreeMap<String, SnapshotEntry> = BTreeMap::new();
        for r in &rows {
            let e = SnapshotEntry {
                segment_id: r.get(0),
                version: r.get(1),
                content_hash: r.get(2),
                owner_tenant: r.get(3),
                public: r.get::<i64, _>(4) != 0,
            };
            let local: String = r.get(5);
            if e.owner_tenant == tenant {
                found.insert(local, e.clone());
            }
            found.insert(e.segment_id.clone(), e);
        }
        let mut out = Vec::with_capacity(refs.len());
        for r in refs {
            match found.get(r) {
                Some(e) => out.push(e.clone()),
                None => return Err(CatalogError::NotFound(format!("segment {r:?}"))),
            }
        }
        Ok(out)
    }

    /// The id of the segment at `address` as its owner named it (also for a
    /// deleted one), for audit rows.
    async fn local_id_of(&self, address: &str) -> CatalogResult<String> {
        let row = sqlx::query("SELECT local_id FROM segments WHERE id = $1")
            .bind(address)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row
            .map(|r| r.get::<String, _>(0))
            .unwrap_or_else(|| address.to_string()))
    }

    // ---- grants ------------------------------------------------------------------

    /// Grants `tenant` read access to the segment at `address`.
    pub async fn grant(&self, address: &str, tenant: &str, actor: &str) -> CatalogResult<()> {
        validate_id("tenant id", tenant).map_err(|e| e.for_field("tenant"))?;
        let seg = self.get_segment(address).await?;
        self.ensure_tenant(tenant, tenant).await?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO grants (segment_id, tenant_id, granted_by, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (segment_id, tenant_id) DO NOTHING",
        )
        .bind(address)
        .bind(tenant)
        .bind(actor)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        insert_audit(
            &mut tx,
            actor,
            seg.owner_tenant.as_deref(),
            "grant.add",
            &seg.id,
            &serde_json::json!({"address": address, "tenant": tenant}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Revokes a grant; `NotFound` if there was none. The tenant's next
    /// snapshot of the segment fails, so it gets no key and no hit.
    pub async fn revoke(&self, address: &str, tenant: &str, actor: &str) -> CatalogResult<()> {
        let local = self.local_id_of(address).await?;
        let mut tx = self.pool.begin().await?;
        let res = sqlx::query("DELETE FROM grants WHERE segment_id = $1 AND tenant_id = $2")
            .bind(address)
            .bind(tenant)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(CatalogError::NotFound(format!(
                "grant of segment {address:?} to {tenant:?}"
            )));
        }
        insert_audit(
            &mut tx,
            actor,
            None,
            "grant.revoke",
            &local,
            &serde_json::json!({"address": address, "tenant": tenant}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Tenants holding a grant on the segment at `address`.
    pub async fn grants(&self, address: &str) -> CatalogResult<Vec<String>> {
        let rows =
            sqlx::query("SELECT tenant_id FROM grants WHERE segment_id = $1 ORDER BY tenant_id")
                .bind(address)
                .fetch_all(&self.pool)
                .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    // ---- audit log ---------------------------------------------------------------

    /// Appends an audit-log row.
    pub async fn audit(
        &self,
        actor: &str,
        tenant: Option<&str>,
        action: &str,
        target: &str,
        detail: &serde_json::Value,
    ) -> CatalogResult<()> {
        let mut conn = self.pool.acquire().await?;
        sqlx::query("INSERT INTO audit_log (at, actor, tenant, action, target, detail) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(now_ms())
            .bind(actor)
            .bind(tenant)
            .bind(action)
            .bind(target)
            .bind(detail.to_string())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// The newest audit rows (at most `limit`), optionally only one action;
    /// newest first.
    pub async fn audit_log(
        &self,
        action: Option<&str>,
        limit: i64,
    ) -> CatalogResult<Vec<AuditEntry>> {
        let f = AuditFilter {
            action: action.map(str::to_string),
            ..AuditFilter::default()
        };
        self.audit_log_filtered(&f, limit).await
    }

    /// Audit rows matching every set field of `f`, newest first, at most
    /// `limit` (clamped to 1..=10000).
    pub async fn audit_log_filtered(
        &self,
        f: &AuditFilter,
        limit: i64,
    ) -> CatalogResult<Vec<AuditEntry>> {
        let limit = limit.clamp(1, 10_000);
        let mut conds: Vec<String> = Vec::new();
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        if f.action.is_some() {
            conds.push(format!("action = {}", next()));
        }
        if f.actor.is_some() {
            conds.push(format!("actor = {}", next()));
        }
        if f.since_ms.is_some() {
            conds.push(format!("at >= {}", next()));
        }
        if f.until_ms.is_some() {
            conds.push(format!("at < {}", next()));
        }
        let lim = next();
        let sql = format!(
            "SELECT id, at, actor, tenant, action, target, detail FROM audit_log {} ORDER BY id DESC LIMIT {lim}",
            if conds.is_empty() {
                String::new()
            } else {
                format!("WHERE {}", conds.join(" AND "))
            }
        );
        let mut q = sqlx::query(&sql);
        if let Some(a) = &f.action {
            q = q.bind(a.clone());
        }
        if let Some(a) = &f.actor {
            q = q.bind(a.clone());
        }
        if let Some(t) = f.since_ms {
            q = q.bind(t);
        }
        if let Some(t) = f.until_ms {
            q = q.bind(t);
        }
        let rows = q.bind(limit).fetch_all(&self.pool).await?;
        Ok(rows
            .iter()
            .map(|r| AuditEntry {
                id: r.get(0),
                at: r.get(1),
                actor: r.get(2),
                tenant: r.get(3),
                action: r.get(4),
                target: r.get(5),
                detail: r.get(6),
            })
            .collect())
    }

    // ---- policies ----------------------------------------------------------------

    /// Stores a policy module as the next version of `name`; returns it.
    pub async fn insert_policy(
        &self,
        name: &str,
        kind: &str,
        module: &[u8],
        params: &str,
        actor: &str,
    ) -> CatalogResult<PolicyRecord> {
        validate_id("policy name", name).map_err(|e| e.for_field("name"))?;
        let sha = hex::encode(Sha256::digest(module));
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query("SELECT COALESCE(MAX(version), 0) FROM policies WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        let version: i64 = row.get::<i64, _>(0) + 1;
        let row = sqlx::query(
            "INSERT INTO policies (name, kind, module, module_sha256, params, version, created_by, created_at, active) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 0) RETURNING id",
        )
        .bind(name)
        .bind(kind)
        .bind(module)
        .bind(&sha)
        .bind(params)
        .bind(version)
        .bind(actor)
        .bind(now)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| match &e {
            sqlx::Error::Database(d) if d.is_unique_violation() => {
                CatalogError::Conflict(format!("policy {name:?} version {version} was uploaded concurrently; retry"))
            }
            _ => CatalogError::Db(e),
        })?;
        let id: i64 = row.get(0);
        insert_audit(&mut tx, actor, None, "policy.upload", &id.to_string(), &serde_json::json!({
            "name": name, "kind": kind, "version": version, "module_sha256": sha, "params": params,
        }))
        .await?;
        tx.commit().await?;
        self.policy(id).await
    }

    /// A stored policy by id (with its module).
    pub async fn policy(&self, id: i64) -> CatalogResult<PolicyRecord> {
        let row = sqlx::query(
            "SELECT id, name, kind, module_sha256, params, version, created_by, created_at, active, module \
             FROM policies WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or_else(|| CatalogError::NotFound(format!("policy {id}")))?;
        Ok(policy_from_row(&row, true))
    }

    /// All stored policies (without modules), newest first.
    pub async fn policies(&self) -> CatalogResult<Vec<PolicyRecord>> {
        let rows = sqlx::query(
            "SELECT id, name, kind, module_sha256, params, version, created_by, created_at, active \
             FROM policies ORDER BY id DESC",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| policy_from_row(r, false)).collect())
    }

    /// The active policy of `kind`, if a Wasm policy is active (else the
    /// native default applies).
    pub async fn active_policy(&self, kind: &str) -> CatalogResult<Option<PolicyRecord>> {
        let row = sqlx::query("SELECT id FROM policies WHERE kind = $1 AND active <> 0")
            .bind(kind)
            .fetch_optional(&self.pool)
            .await?;
        match row {
            Some(r) => Ok(Some(self.policy(r.get(0)).await?)),
            None => Ok(None),
        }
    }

    /// Makes `policy_id` (or the native default when `None`) the active policy
    /// of `kind`, recording the activation for rollback.
    pub async fn activate_policy(
        &self,
        kind: &str,
        policy_id: Option<i64>,
        actor: &str,
    ) -> CatalogResult<()> {
        let mut tx = self.pool.begin().await?;
        if let Some(id) = policy_id {
            let row = sqlx::query("SELECT kind FROM policies WHERE id = $1")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
            match row {
                None => return Err(CatalogError::NotFound(format!("policy {id}"))),
                Some(r) if r.get::<String, _>(0) != kind => {
                    return Err(CatalogError::Invalid(format!(
                        "policy {id} is not a {kind} policy"
                    )))
                }
                _ => {}
            }
        }
        sqlx::query("UPDATE policies SET active = 0 WHERE kind = $1 AND active <> 0")
            .bind(kind)
            .execute(&mut *tx)
            .await?;
        if let Some(id) = policy_id {
            sqlx::query("UPDATE policies SET active = 1 WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("INSERT INTO policy_activations (kind, policy_id, activated_by, activated_at) VALUES ($1, $2, $3, $4)")
            .bind(kind)
            .bind(policy_id)
            .bind(actor)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
        insert_audit(
            &mut tx,
            actor,
            None,
            "policy.activate",
            &policy_id.map(|i| i.to_string()).unwrap_or("native".into()),
            &serde_json::json!({"kind": kind}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The activations of `kind` that are not rolled back, newest first, with
    /// what identifies their policy's behaviour (module hash and parameters).
    async fn live_activations<'c, E>(&self, ex: E, kind: &str) -> CatalogResult<Vec<LiveActivation>>
    where
        E: sqlx::Executor<'c, Database = sqlx::Any>,
    {
        let rows = sqlx::query(
            "SELECT a.id, a.policy_id, p.module_sha256, p.params FROM policy_activations a \
             LEFT JOIN policies p ON p.id = a.policy_id \
             WHERE a.kind = $1 AND a.rolled_back_at IS NULL ORDER BY a.id DESC LIMIT 10000",
        )
        .bind(kind)
        .fetch_all(ex)
        .await?;
        Ok(rows
            .iter()
            .map(|r| LiveActivation {
                id: r.get(0),
                policy_id: r.get::<Option<i64>, _>(1),
                module_sha256: r.get::<Option<String>, _>(2),
                params: r
                    .get::<Option<String>, _>(3)
                    .and_then(|p| serde_json::from_str(&p).ok()),
            })
            .collect())
    }

    /// Where a rollback of `kind` would go, without changing anything:
    /// `Some(Some(id))` a policy, `Some(None)` the native default, `None` when
    /// there is nothing to roll back (no activation, or the native default is
    /// active and no different policy was active before it). See
    /// [`Catalog::rollback_policy`].
    pub async fn rollback_target(&self, kind: &str) -> CatalogResult<Option<Option<i64>>> {
        let rows = self.live_activations(&self.pool, kind).await?;
        Ok(rollback_plan(&rows).map(|(_, target)| target))
    }

    /// Rolls the policy of `kind` back to the latest one active before the
    /// current one that is *different* from it: activations of the same policy,
    /// or of a policy with the same module and parameters, are skipped (and
    /// marked rolled back with the current one). The native default when no
    /// different policy was active before. Returns the policy now active
    /// (`None` = native); 404 when there is nothing to roll back (no
    /// activation history, or the native default is active and nothing
    /// different came before it).
    pub async fn rollback_policy(&self, kind: &str, actor: &str) -> CatalogResult<Option<i64>> {
        let now = now_ms();
        let mut tx = self.pool.begin().await?;
        let rows = self.live_activations(&mut *tx, kind).await?;
        let Some((undone, previous)) = rollback_plan(&rows) else {
            return Err(CatalogError::NotFound(format!(
                "an earlier {kind} policy to roll back to (activation history of {kind} policies)"
            )));
        };
        for id in &undone {
            sqlx::query("UPDATE policy_activations SET rolled_back_at = $1 WHERE id = $2")
                .bind(now)
                .bind(*id)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query("UPDATE policies SET active = 0 WHERE kind = $1 AND active <> 0")
            .bind(kind)
            .execute(&mut *tx)
            .await?;
        if let Some(id) = previous {
            sqlx::query("UPDATE policies SET active = 1 WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        let from = rows.first().and_then(|r| r.policy_id);
        insert_audit(
            &mut tx,
            actor,
            None,
            "policy.rollback",
            &previous.map(|i| i.to_string()).unwrap_or("native".into()),
            &serde_json::json!({"kind": kind, "from": from}),
        )
        .await?;
        tx.commit().await?;
        Ok(previous)
    }

    // ---- cache residency -----------------------------------------------------------

    /// Records (or refreshes) that `worker` holds a cache entry.
    pub async fn report_residency(&self, r: &Residency) -> CatalogResult<()> {
        sqlx::query(
            "INSERT INTO cache_residency (worker, cache_key, segment_id, version, tenant, bytes, last_use) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (worker, cache_key) DO UPDATE SET \
             bytes = excluded.bytes, last_use = excluded.last_use",
        )
        .bind(&r.worker)
        .bind(&r.cache_key)
        .bind(&r.segment_id)
        .bind(r.version)
        .bind(r.tenant.as_deref())
        .bind(r.bytes)
        .bind(r.last_use)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// Workers holding `cache_key`.
    pub async fn residency_of(&self, cache_key: &str) -> CatalogResult<Vec<Residency>> {
        let rows = sqlx::query(
            "SELECT worker, cache_key, segment_id, version, tenant, bytes, last_use FROM cache_residency \
             WHERE cache_key = $1 ORDER BY worker",
        )
        .bind(cache_key)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| Residency {
                worker: r.get(0),
                cache_key: r.get(1),
                segment_id: r.get(2),
                version: r.get(3),
                tenant: r.get(4),
                bytes: r.get(5),
                last_use: r.get(6),
            })
            .collect())
    }

    /// Drops residency rows of superseded versions of `segment_id`; returns
    /// the number of rows dropped (the workers' entries to invalidate).
    pub async fn drop_superseded_residency(&self, segment_id: &str) -> CatalogResult<u64> {
        let res = sqlx::query(
            "DELETE FROM cache_residency WHERE segment_id = $1 AND version < \
             (SELECT current_version FROM segments WHERE id = $1 AND deleted_at IS NULL)",
        )
        .bind(segment_id)
        .execute(&self.pool)
        .await?;
        Ok(res.rows_affected())
    }
}

fn policy_from_row(r: &AnyRow, with_module: bool) -> PolicyRecord {
    PolicyRecord {
        id: r.get(0),
        name: r.get(1),
        kind: r.get(2),
        module_sha256: r.get(3),
        params: r.get(4),
        version: r.get(5),
        created_by: r.get(6),
        created_at: r.get(7),
        active: r.get::<i64, _>(8) != 0,
        module: if with_module { r.get(9) } else { vec![] },
    }
}

/// SQL condition (over segment alias `s`) that the tenant bound at `param`
/// may read the segment: owner, public, a tenant grant, or a grant to a group
/// the tenant belongs to. Evaluated per statement, so a revoked grant or a
/// removed membership takes effect at the next snapshot.
fn readable_by(param: &str) -> String {
    format!(
        "(s.owner_tenant = {p} OR s.public <> 0 \
          OR EXISTS (SELECT 1 FROM grants g WHERE g.segment_id = s.id AND g.tenant_id = {p}) \
          OR EXISTS (SELECT 1 FROM group_grants gg JOIN group_members m ON m.group_id = gg.group_id \
                     WHERE gg.segment_id = s.id AND m.tenant_id = {p}))",
        p = param
    )
}

async fn insert_version(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    id: &str,
    version: i64,
    content: &str,
    tokens: &BTreeMap<String, i64>,
    actor: &str,
    now: i64,
) -> CatalogResult<()> {
    sqlx::query(
        "INSERT INTO segment_versions (segment_id, version, content_hash, content, byte_len, created_by, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(id)
    .bind(version)
    .bind(content_hash(content))
    .bind(content)
    .bind(content.len() as i64)
    .bind(actor)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    for (model, t) in tokens {
        sqlx::query("INSERT INTO segment_token_counts (segment_id, version, model, tokens) VALUES ($1, $2, $3, $4)")
            .bind(id)
            .bind(version)
            .bind(model)
            .bind(*t)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

async fn insert_audit(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    actor: &str,
    tenant: Option<&str>,
    action: &str,
    target: &str,
    detail: &serde_json::Value,
) -> CatalogResult<()> {
    sqlx::query("INSERT INTO audit_log (at, actor, tenant, action, target, detail) VALUES ($1, $2, $3, $4, $5, $6)")
        .bind(now_ms())
        .bind(actor)
        .bind(tenant)
        .bind(action)
        .bind(target)
        .bind(detail.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

fn normalize_url(url: &str) -> CatalogResult<(String, Backend)> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return Ok((url.to_string(), Backend::Postgres));
    }
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let u = if rest.contains('?') || rest == ":memory:" {
            url.to_string()
        } else {
            format!("{url}?mode=rwc")
        };
        return Ok((u, Backend::Sqlite));
    }
    if url.contains("://") {
        return Err(CatalogError::Invalid(format!(
            "unsupported database url {url:?}: use postgres://… or sqlite://…"
        )));
    }
    if url.is_empty() {
        return Err(CatalogError::Invalid("empty database url".into()));
    }
    Ok((format!("sqlite://{url}?mode=rwc"), Backend::Sqlite))
}

impl Catalog {
    /// Residency rows of every version of `segment_id`.
    pub async fn residency_of_segment(&self, segment_id: &str) -> CatalogResult<Vec<Residency>> {
        let rows = sqlx::query(
            "SELECT worker, cache_key, segment_id, version, tenant, bytes, last_use FROM cache_residency \
             WHERE segment_id = $1 ORDER BY worker, cache_key",
        )
        .bind(segment_id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .iter()
            .map(|r| Residency {
                worker: r.get(0),
                cache_key: r.get(1),
                segment_id: r.get(2),
                version: r.get(3),
                tenant: r.get(4),
                bytes: r.get(5),
                last_use: r.get(6),
            })
            .collect())
    }

    /// Drops one residency row.
    pub async fn drop_residency(&self, worker: &str, cache_key: &str) -> CatalogResult<()> {
        sqlx::query("DELETE FROM cache_residency WHERE worker = $1 AND cache_key = $2")
            .bind(worker)
            .bind(cache_key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drops every residency row of `segment_id`; returns how many.
    pub async fn drop_all_residency(&self, segment_id: &str) -> CatalogResult<u64> {
        let r = sqlx::query("DELETE FROM cache_residency WHERE segment_id = $1")
            .bind(segment_id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }
}

// ---- groups ---------------------------------------------------------------------------

impl Catalog {
    /// Creates group `id` (`name` defaults to the id). `Conflict` if it exists.
    pub async fn create_group(
        &self,
        id: &str,
        name: Option<&str>,
        actor: &str,
    ) -> CatalogResult<Group> {
        validate_id("group id", id).map_err(|e| e.for_field("id"))?;
        let name = name.unwrap_or(id);
        if name.is_empty() || name.len() > 256 {
            return Err(CatalogError::InvalidField(
                "name",
                "group name must be 1..=256 characters".into(),
            ));
        }
        validate_text("group name", name).map_err(|e| e.for_field("name"))?;
        let mut tx = self.pool.begin().await?;
        let res = sqlx::query(
            "INSERT INTO tenant_groups (id, name, created_by, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(id)
        .bind(name)
        .bind(actor)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        if res.rows_affected() == 0 {
            return Err(CatalogError::Conflict(format!(
                "group {id:?} already exists"
            )));
        }
        insert_audit(
            &mut tx,
            actor,
            None,
            "group.create",
            id,
            &serde_json::json!({"name": name}),
        )
        .await?;
        tx.commit().await?;
        self.group(id).await
    }

    /// Deletes a group with its memberships and segment grants; its members
    /// lose what they could read only through it at their next snapshot.
    pub async fn delete_group(&self, id: &str, actor: &str) -> CatalogResult<()> {
        let mut tx = self.pool.begin().await?;
        // Explicit deletes, so the result does not depend on ON DELETE CASCADE
        // (SQLite enforces it only with foreign_keys on).
        let grants = sqlx::query("DELETE FROM group_grants WHERE group_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let members = sqlx::query("DELETE FROM group_members WHERE group_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let res = sqlx::query("DELETE FROM tenant_groups WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(CatalogError::NotFound(format!("group {id:?}")));
        }
        insert_audit(
            &mut tx,
            actor,
            None,
            "group.delete",
            id,
            &serde_json::json!({"members": members, "grants": grants}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// A group with its members.
    pub async fn group(&self, id: &str) -> CatalogResult<Group> {
        let row =
            sqlx::query("SELECT id, name, created_by, created_at FROM tenant_groups WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| CatalogError::NotFound(format!("group {id:?}")))?;
        let members = self.group_members(id).await?;
        Ok(Group {
            id: row.get(0),
            name: row.get(1),
            members,
            created_by: row.get(2),
            created_at: row.get(3),
        })
    }

    /// Every group with its members, by id.
    pub async fn groups(&self) -> CatalogResult<Vec<Group>> {
        let rows =
            sqlx::query("SELECT id, name, created_by, created_at FROM tenant_groups ORDER BY id")
                .fetch_all(&self.pool)
                .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let id: String = r.get(0);
            out.push(Group {
                members: self.group_members(&id).await?,
                id,
                name: r.get(1),
                created_by: r.get(2),
                created_at: r.get(3),
            });
        }
        Ok(out)
    }

    async fn group_members(&self, id: &str) -> CatalogResult<Vec<String>> {
        let rows = sqlx::query(
            "SELECT tenant_id FROM group_members WHERE group_id = $1 ORDER BY tenant_id",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    /// Groups `tenant` belongs to, sorted.
    pub async fn groups_of(&self, tenant: &str) -> CatalogResult<Vec<String>> {
        let rows = sqlx::query(
            "SELECT group_id FROM group_members WHERE tenant_id = $1 ORDER BY group_id",
        )
        .bind(tenant)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }

    /// Adds `tenant` (created if needed) to group `id`; adding a member twice
    /// is a no-op. `NotFound` if the group does not exist.
    pub async fn add_member(&self, id: &str, tenant: &str, actor: &str) -> CatalogResult<()> {
        validate_id("tenant id", tenant).map_err(|e| e.for_field("tenant"))?;
        self.group_exists(id).await?;
        self.ensure_tenant(tenant, tenant).await?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO group_members (group_id, tenant_id, added_by, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (group_id, tenant_id) DO NOTHING",
        )
        .bind(id)
        .bind(tenant)
        .bind(actor)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        insert_audit(
            &mut tx,
            actor,
            Some(tenant),
            "group.member.add",
            id,
            &serde_json::json!({"tenant": tenant}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Removes `tenant` from group `id`; `NotFound` if it was not a member.
    /// The tenant's next snapshot no longer sees segments granted to the group.
    pub async fn remove_member(&self, id: &str, tenant: &str, actor: &str) -> CatalogResult<()> {
        let mut tx = self.pool.begin().await?;
        let res = sqlx::query("DELETE FROM group_members WHERE group_id = $1 AND tenant_id = $2")
            .bind(id)
            .bind(tenant)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(CatalogError::NotFound(format!(
                "membership of {tenant:?} in group {id:?}"
            )));
        }
        insert_audit(
            &mut tx,
            actor,
            Some(tenant),
            "group.member.remove",
            id,
            &serde_json::json!({"tenant": tenant}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn group_exists(&self, id: &str) -> CatalogResult<()> {
        sqlx::query("SELECT 1 FROM tenant_groups WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .map(|_| ())
            .ok_or_else(|| CatalogError::NotFound(format!("group {id:?}")))
    }

    /// Grants every member of group `group` read access to segment `id`.
    /// `NotFound` if the segment or the group does not exist.
    pub async fn grant_group(&self, id: &str, group: &str, actor: &str) -> CatalogResult<()> {
        validate_id("group id", group).map_err(|e| e.for_field("group"))?;
        let seg = self.get_segment(id).await?;
        self.group_exists(group).await?;
        let mut tx = self.pool.begin().await?;
        sqlx::query(
            "INSERT INTO group_grants (segment_id, group_id, granted_by, created_at) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (segment_id, group_id) DO NOTHING",
        )
        .bind(id)
        .bind(group)
        .bind(actor)
        .bind(now_ms())
        .execute(&mut *tx)
        .await?;
        insert_audit(
            &mut tx,
            actor,
            seg.owner_tenant.as_deref(),
            "grant.group.add",
            &seg.id,
            &serde_json::json!({"address": id, "group": group}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Revokes a group grant; `NotFound` if there was none. Members' next
    /// snapshots of the segment fail unless they can read it another way.
    pub async fn revoke_group(&self, id: &str, group: &str, actor: &str) -> CatalogResult<()> {
        let local = self.local_id_of(id).await?;
        let mut tx = self.pool.begin().await?;
        let res = sqlx::query("DELETE FROM group_grants WHERE segment_id = $1 AND group_id = $2")
            .bind(id)
            .bind(group)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(CatalogError::NotFound(format!(
                "grant of segment {id:?} to group {group:?}"
            )));
        }
        insert_audit(
            &mut tx,
            actor,
            None,
            "grant.group.revoke",
            &local,
            &serde_json::json!({"address": id, "group": group}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Groups holding a grant on segment `id`, sorted.
    pub async fn group_grants(&self, id: &str) -> CatalogResult<Vec<String>> {
        let rows = sqlx::query(
            "SELECT group_id FROM group_grants WHERE segment_id = $1 ORDER BY group_id",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.iter().map(|r| r.get::<String, _>(0)).collect())
    }
}

/// One activation not rolled back (see [`Catalog::rollback_policy`]).
struct LiveActivation {
    id: i64,
    policy_id: Option<i64>,
    module_sha256: Option<String>,
    params: Option<serde_json::Value>,
}

impl LiveActivation {
    /// Whether the two activations install the same behaviour: the same policy,
    /// or policies with the same module and parameters (both native counts too).
    fn same_as(&self, o: &LiveActivation) -> bool {
        match (self.policy_id, o.policy_id) {
            (None, None) => true,
            (Some(a), Some(b)) if a == b => true,
            (Some(_), Some(_)) => {
                self.module_sha256.is_some()
                    && self.module_sha256 == o.module_sha256
                    && self.params == o.params
            }
            _ => false,
        }
    }
}

/// The rollback of `rows` (newest first): the activations it marks rolled back
/// and the policy it goes to (`None` = native), or `None` when there is nothing
/// to roll back to.
fn rollback_plan(rows: &[LiveActivation]) -> Option<(Vec<i64>, Option<i64>)> {
    let current = rows.first()?;
    let undone: Vec<i64> = rows
        .iter()
        .take_while(|r| r.same_as(current))
        .map(|r| r.id)
        .collect();
    match rows.get(undone.len()) {
        Some(prev) => Some((undone, prev.policy_id)),
        // Nothing different before: the native default, unless it is active.
        None if current.policy_id.is_some() => Some((undone, None)),
        None => None,
    }
}
