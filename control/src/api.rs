//! The control-plane HTTP API (axum): segment catalog routes for tenants,
//! policy lifecycle routes for operators. Every route except
//! `GET /v1/control/health` needs a bearer JWT; errors are OpenAI-style JSON
//! `{"error":{"message":..,"type":..,"code":..}}`.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::auth::{AuthError, Authenticator, IsolationKeyer, Principal};
use crate::catalog::{
    now_ms, Catalog, CatalogError, Group, NewSegment, Residency, Role, Segment, SnapshotEntry,
};
use crate::policy::{
    opaque_id, EntryInfo, IsolationInfo, PolicyError, PolicyKind, PolicyRuntime, PolicySet,
    PolicySlot,
};
use crate::sim::{parse_trace, simulate, SimStats};

/// How requests are authenticated.
pub enum AuthMode {
    /// Bearer JWTs verified by the authenticator.
    Enabled(Authenticator),
    /// No auth (only allowed on loopback binds, see
    /// [`crate::auth::check_auth_disable`]): every caller is operator
    /// `local` of tenant `local`.
    Disabled,
}

struct Inner {
    catalog: Catalog,
    auth: AuthMode,
    keyer: IsolationKeyer,
    policies: Arc<PolicyRuntime>,
    known: Mutex<HashSet<(String, String)>>,
    /// Serialises activations and rollbacks: each changes the catalog and then
    /// installs the module in the runtime, and two interleaved ones would
    /// leave the server running a policy the catalog does not record as active.
    activation: tokio::sync::Mutex<()>,
}

/// Shared state of the control-plane router.
#[derive(Clone)]
pub struct ControlState {
    inner: Arc<Inner>,
}

impl ControlState {
    /// Builds the state. Load active policies with
    /// [`PolicyRuntime::load_active`] before serving.
    pub fn new(
        catalog: Catalog,
        auth: AuthMode,
        keyer: IsolationKeyer,
        policies: Arc<PolicyRuntime>,
    ) -> ControlState {
        ControlState {
            inner: Arc::new(Inner {
                catalog,
                auth,
                keyer,
                policies,
                known: Mutex::new(HashSet::new()),
                activation: tokio::sync::Mutex::new(()),
            }),
        }
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.inner.catalog
    }

    /// The live policies.
    pub fn policies(&self) -> &Arc<PolicyRuntime> {
        &self.inner.policies
    }

    /// The isolation keyer.
    pub fn keyer(&self) -> &IsolationKeyer {
        &self.inner.keyer
    }

    /// The token verifier (`None` when auth is disabled).
    pub fn authenticator(&self) -> Option<&Authenticator> {
        match &self.inner.auth {
            AuthMode::Enabled(a) => Some(a),
            AuthMode::Disabled => None,
        }
    }

    /// Starts a task that re-reads the authenticator's JWKS files every
    /// `every` (`None`: never periodically) and on SIGHUP (Unix), so keys can
    /// be rotated without a restart. Reloads and failures are logged and
    /// audited (`auth.jwks_reload`, `auth.jwks_reload_failed`; a failure is
    /// audited again only when its message changes); a file that fails keeps
    /// its previous keys. Returns `None` when there is no JWKS file to watch.
    /// The task ends once the state is dropped. Needs a tokio runtime.
    pub fn spawn_jwks_reloader(
        &self,
        every: Option<std::time::Duration>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if self.authenticator()?.jwks_files().is_empty() {
            return None;
        }
        let weak = Arc::downgrade(&self.inner);
        // Listen before returning, so a SIGHUP sent right after never hits the
        // default action (terminate).
        let mut hup = hangup_signal();
        Some(tokio::spawn(async move {
            let mut ticker = every.filter(|d| !d.is_zero()).map(|d| {
                let mut i = tokio::time::interval_at(tokio::time::Instant::now() + d, d);
                i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                i
            });
            let mut last_failure: Option<String> = None;
            loop {
                tokio::select! {
                    _ = async {
                        match ticker.as_mut() {
                            Some(t) => { t.tick().await; }
                            None => std::future::pending::<()>().await,
                        }
                    } => {}
                    _ = wait_hangup(&mut hup) => {}
                }
                let Some(inner) = weak.upgrade() else { break };
                let AuthMode::Enabled(a) = &inner.auth else {
                    break;
                };
                let r = a.reload_jwks();
                for path in &r.reloaded {
                    eprintln!(
                        "hypic: reloaded JWKS file {} ({} keys accepted)",
                        path.display(),
                        r.keys
                    );
                    let _ = inner
                        .catalog
                        .audit(
                            "system",
                            None,
                            "auth.jwks_reload",
                            &path.display().to_string(),
                            &serde_json::json!({"keys": r.keys}),
                        )
                        .await;
                }
                let failure = (!r.failed.is_empty()).then(|| format!("{:?}", r.failed));
                if failure.is_some() && failure != last_failure {
                    for (path, err) in &r.failed {
                        eprintln!(
                            "hypic: JWKS file {} not reloaded, previous keys kept: {err}",
                            path.display()
                        );
                        let _ = inner
                            .catalog
                            .audit(
                                "system",
                                None,
                                "auth.jwks_reload_failed",
                                &path.display().to_string(),
                                &serde_json::json!({"error": err}),
                            )
                            .await;
                    }
                }
                last_failure = failure;
            }
        }))
    }
}

#[cfg(unix)]
type Hangup = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
type Hangup = ();

#[cfg(unix)]
fn hangup_signal() -> Hangup {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!("cannot listen for SIGHUP, JWKS reloads only periodically: {e}");
            None
        }
    }
}
#[cfg(not(unix))]
fn hangup_signal() -> Hangup {}

#[cfg(unix)]
async fn wait_hangup(h: &mut Hangup) {
    match h.as_mut() {
        Some(s) => {
            if s.recv().await.is_none() {
                std::future::pending::<()>().await
            }
        }
        None => std::future::pending::<()>().await,
    }
}
#[cfg(not(unix))]
async fn wait_hangup(_: &mut Hangup) {
    std::future::pending::<()>().await
}

/// An API error rendered as OpenAI-style JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// Error type, e.g. `authentication_error`.
    pub kind: &'static str,
    /// Machine-readable code.
    pub code: &'static str,
    /// The request field the error is about, if any (`param` in the JSON).
    pub param: Option<String>,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            code,
            param: None,
        }
    }

    /// The same error, naming the request field it is about.
    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }
    /// 400.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            message,
        )
    }
    /// 403.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> ApiError {
        Self::new(StatusCode::FORBIDDEN, "permission_error", code, message)
    }
    /// 404.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "not_found",
            message,
        )
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            e.code(),
            e.to_string(),
        )
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> ApiError {
        let param = e.field();
        let err = match e {
            CatalogError::NotFound(_) => ApiError::not_found(e.to_string()),
            CatalogError::Conflict(_) => ApiError::new(
                StatusCode::CONFLICT,
                "conflict_error",
                "conflict",
                e.to_string(),
            ),
            CatalogError::Invalid(_) | CatalogError::InvalidField(..) => {
                ApiError::bad_request(e.to_string())
            }
            CatalogError::TooLarge(..) => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "too_large",
                e.to_string(),
            ),
            CatalogError::IdempotencyMismatch(_) => ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_request_error",
                "idempotency_key_reused",
                e.to_string(),
            )
            .with_param(IDEMPOTENCY_KEY),
            CatalogError::Db(_) | CatalogError::Migrate(_) => {
                // The cause (read-only, disk full, unreachable) is the operator's to
                // fix and the client's to know; the database's own message is logged.
                let cause = crate::readiness::DbCause::of_catalog(&e)
                    .unwrap_or(crate::readiness::DbCause::Other);
                tracing::error!(code = cause.code(), "catalog error: {e}");
                ApiError::new(
                    cause.status(),
                    "server_error",
                    cause.code(),
                    cause.describe(),
                )
            }
        };
        match param {
            Some(p) => err.with_param(p),
            None => err,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        let mut r = (self.status, Json(body)).into_response();
        if self.status.is_server_error() {
            r.extensions_mut()
                .insert(crate::serve::reqlog::ErrorCause(self.message.clone()));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        r
    }
}

type ApiResult<T> = Result<Json<T>, ApiError>;

/// JSON body extractor whose rejections are OpenAI-style 400s.
pub struct Body<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequest<S> for Body<T> {
    type Rejection = ApiError;
    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Body(v)),
            Err(e) => Err(match e {
                JsonRejection::BytesRejection(b) => ApiError::new(
                    b.status(),
                    "invalid_request_error",
                    "invalid_body",
                    b.body_text(),
                ),
                other => ApiError::bad_request(other.body_text()),
            }),
        }
    }
}

/// Path extractor whose rejections are OpenAI-style 400s naming the problem
/// (axum's own answers in plain text), and which refuses NUL characters (Postgres
/// cannot store or compare them: they would surface as a 500).
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let raw = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::bad_request(format!("invalid path: {}", e.body_text())))?;
        if let Some((name, _)) = raw.0.iter().find(|(_, v)| v.contains('\0')) {
            return Err(ApiError::bad_request(format!(
                "path parameter {name:?} contains a NUL character"
            )));
        }
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::bad_request(format!(
                "invalid path: {}",
                e.body_text()
            ))),
        }
    }
}

/// Query extractor whose rejections are OpenAI-style 400s naming the problem.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(ApiError::bad_request(format!(
                "invalid query string: {}",
                e.body_text()
            ))),
        }
    }
}

/// The authenticated caller.
pub struct Caller(pub Principal);

impl FromRequestParts<ControlState> for Caller {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ControlState) -> Result<Self, ApiError> {
        let p = match &state.inner.auth {
            AuthMode::Disabled => Principal {
                sub: "local".into(),
                tenant: "local".into(),
                role: Role::Operator,
            },
            AuthMode::Enabled(a) => {
                let h = parts
                    .headers
                    .get(header::AUTHORIZATION)
                    .ok_or(AuthError::Missing)?;
                let h = h
                    .to_str()
                    .map_err(|_| AuthError::Invalid("authorization header is not ASCII".into()))?;
                let token = h
                    .strip_prefix("Bearer ")
                    .or_else(|| h.strip_prefix("bearer "))
                    .ok_or_else(|| {
                        AuthError::Invalid("authorization must be 'Bearer <jwt>'".into())
                    })?;
                a.verify(token.trim())?
            }
        };
        if let Some(slot) = parts.extensions.get::<crate::serve::reqlog::LogSlot>() {
            slot.set_tenant(state.inner.keyer.pseudonym(&p.tenant));
        }
        let key = (p.tenant.clone(), p.sub.clone());
        let fresh = !state
            .inner
            .known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&key);
        if fresh {
            state
                .inner
                .catalog
                .upsert_principal(&p.tenant, &p.sub, p.role)
                .await?;
            state
                .inner
                .known
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(key);
        }
        Ok(Caller(p))
    }
}

/// An authenticated operator (403 for tenant users).
pub struct Operator(pub Principal);

impl FromRequestParts<ControlState> for Operator {
    type Rejection = ApiError;
    async fn from_request_parts(parts: &mut Parts, state: &ControlState) -> Result<Self, ApiError> {
        let Caller(p) = Caller::from_request_parts(parts, state).await?;
        if !p.is_operator() {
            return Err(ApiError::forbidden(
                "operator_required",
                "this endpoint needs the operator role",
            ));
        }
        Ok(Operator(p))
    }
}

/// The control-plane router (mount it at the root of the server).
pub fn control_router(state: ControlState) -> Router {
    Router::new()
        .route("/v1/control/health", get(health))
        .route("/v1/whoami", get(whoami))
        .route("/v1/segments", post(create_segment).get(list_segments))
        .route(
            "/v1/segments/{id}",
            get(get_segment).put(update_segment).delete(delete_segment),
        )
        .route("/v1/segments/{id}/versions", get(segment_versions))
        .route("/v1/segments/{id}/grants", get(list_grants).post(add_grant))
        .route(
            "/v1/segments/{id}/grants/{tenant}",
            axum::routing::delete(revoke_grant),
        )
        .route(
            "/v1/segments/{id}/group-grants",
            get(list_group_grants).post(add_group_grant),
        )
        .route(
            "/v1/segments/{id}/group-grants/{group}",
            axum::routing::delete(revoke_group_grant),
        )
        .route("/v1/snapshot", post(snapshot))
        .route("/v1/admin/groups", get(list_groups).post(create_group))
        .route("/v1/admin/groups/{id}", get(get_group).delete(delete_group))
        .route(
            "/v1/admin/groups/{id}/members/{tenant}",
            axum::routing::put(add_member).delete(remove_member),
        )
        .route("/v1/admin/policies", get(list_policies).post(upload_policy))
        .route("/v1/admin/policies/stats", get(policy_stats))
        .route("/v1/admin/policies/rollback", post(rollback_policy))
        .route("/v1/admin/policies/{id}/activate", post(activate_policy))
        .route("/v1/admin/policies/{id}/dry-run", post(dry_run))
        .route("/v1/admin/audit", get(audit_log))
        .route("/v1/admin/residency", post(report_residency))
        .route_layer(axum::middleware::from_fn(
            crate::serve::reqlog::record_route,
        ))
        .merge(crate::ui::router())
        .fallback(|| async { ApiError::not_found("no such route") })
        .layer(DefaultBodyLimit::max(16 << 20))
        .with_state(state)
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn whoami(Caller(p): Caller) -> Json<Principal> {
    Json(p)
}

/// Header carrying a client's idempotency key on `POST /v1/segments`.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// Response header set (`true`) when a create was answered from the record of
/// an earlier request with the same idempotency key.
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";

/// The live segment the caller addresses as `reference` (an own id or an
/// address) and may read: owner, public, grant, group grant; operators read
/// every segment. Anything else is the same 404 as a segment that does not
/// exist, so ids of other tenants cannot be probed.
pub async fn readable_segment(
    state: &ControlState,
    p: &Principal,
    reference: &str,
) -> Result<Segment, ApiError> {
    let nf = || ApiError::not_found(format!("segment {reference:?} not found"));
    if crate::catalog::validate_ref("segment id", reference).is_err() {
        return Err(nf());
    }
    let seg = match state.inner.catalog.find_segment(&p.tenant, reference).await {
        Ok(seg) => seg,
        Err(CatalogError::NotFound(_)) => return Err(nf()),
        Err(e) => return Err(e.into()),
    };
    if p.is_operator()
        || state
            .inner
            .catalog
            .can_read(&p.tenant, &seg.address)
            .await?
    {
        Ok(seg)
    } else {
        Err(nf())
    }
}

/// Owner tenant or operator may modify a segment.
async fn require_owner(
    state: &ControlState,
    p: &Principal,
    reference: &str,
) -> Result<Segment, ApiError> {
    let seg = readable_segment(state, p, reference).await?;
    if p.is_operator() || seg.owner_tenant.as_deref() == Some(p.tenant.as_str()) {
        return Ok(seg);
    }
    Err(ApiError::forbidden(
        "not_owner",
        format!("only the owner tenant or an operator may modify segment {reference:?}"),
    ))
}

async fn create_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    headers: axum::http::HeaderMap,
    Body(seg): Body<NewSegment>,
) -> Result<Response, ApiError> {
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::bad_request("the Idempotency-Key header must be printable ASCII")
                .with_param(IDEMPOTENCY_KEY)
        })?),
    };
    let c = s
        .inner
        .catalog
        .create_segment_idempotent(&p.tenant, &p.sub, &seg, key)
        .await?;
    let mut r = Json(c.segment.view_for(&p.tenant, p.is_operator())).into_response();
    if c.replayed {
        r.headers_mut().insert(
            IDEMPOTENT_REPLAYED,
            header::HeaderValue::from_static("true"),
        );
    }
    Ok(r)
}

/// Query of `GET /v1/segments`.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// Page size, 1..=1000 (default 100).
    pub limit: Option<i64>,
    /// Cursor: the `next` of the previous page.
    pub after: Option<String>,
}

impl ListQuery {
    /// The page size, or a 400 naming `limit`.
    pub fn page_size(&self) -> Result<usize, ApiError> {
        let max = crate::catalog::MAX_LIST_LIMIT as i64;
        match self.limit {
            None => Ok(crate::catalog::DEFAULT_LIST_LIMIT),
            Some(l) if (1..=max).contains(&l) => Ok(l as usize),
            Some(l) => Err(
                ApiError::bad_request(format!("'limit' must be 1..={max}, not {l}"))
                    .with_param("limit"),
            ),
        }
    }

    /// The cursor, or a 400 naming `after`.
    pub fn cursor(&self) -> Result<Option<&str>, ApiError> {
        match self.after.as_deref() {
            None | Some("") => Ok(None),
            Some(a)
                if a.len() <= 300
                    && a.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"._:-~/".contains(&b)) =>
            {
                Ok(Some(a))
            }
            Some(_) => Err(ApiError::bad_request(
                "'after' must be the 'next' cursor of a previous page",
            )
            .with_param("after")),
        }
    }
}

/// Answer of the control plane's `GET /v1/segments`.
#[derive(Debug, Serialize, Deserialize)]
pub struct SegmentList {
    /// Always `list`.
    pub object: String,
    /// The segments of this page, as the caller may see them.
    pub data: Vec<Segment>,
    /// Cursor of the next page (`after`), `null` on the last page.
    pub next: Option<String>,
}

async fn list_segments(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> ApiResult<SegmentList> {
    let page = s
        .inner
        .catalog
        .list_segments(&p.tenant, p.is_operator(), q.cursor()?, q.page_size()?)
        .await?;
    Ok(Json(SegmentList {
        object: "list".into(),
        data: page
            .items
            .into_iter()
            .map(|x| x.view_for(&p.tenant, p.is_operator()))
            .collect(),
        next: page.next,
    }))
}

async fn get_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Segment> {
    let seg = readable_segment(&s, &p, &id).await?;
    Ok(Json(seg.view_for(&p.tenant, p.is_operator())))
}

/// Body of `PUT /v1/segments/{id}`.
#[derive(Debug, Deserialize)]
pub struct UpdateSegment {
    /// New content.
    pub content: String,
    /// Token counts per model.
    #[serde(default)]
    pub tokens: BTreeMap<String, i64>,
}

/// Answer of `PUT /v1/segments/{id}`.
#[derive(Debug, Serialize, Deserialize)]
pub struct UpdateResult {
    /// The segment after the update.
    pub segment: Segment,
    /// Cache-residency rows of superseded versions dropped by the
    /// invalidation policy.
    pub invalidated_entries: u64,
}

async fn update_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
    Body(u): Body<UpdateSegment>,
) -> ApiResult<UpdateResult> {
    let old = require_owner(&s, &p, &id).await?;
    let seg = s
        .inner
        .catalog
        .update_segment(&old.address, &p.sub, &u.content, &u.tokens)
        .await?;
    let invalidated = invalidate_superseded(&s, &seg).await?;
    Ok(Json(UpdateResult {
        segment: seg.view_for(&p.tenant, p.is_operator()),
        invalidated_entries: invalidated,
    }))
}

/// Runs the invalidation hook over the residency rows of superseded versions
/// of `seg` and drops those it rejects.
async fn invalidate_superseded(s: &ControlState, seg: &Segment) -> Result<u64, ApiError> {
    let rows = s.inner.catalog.residency_of_segment(&seg.address).await?;
    let now = now_ms() as u64;
    let mut dropped = 0;
    for r in rows.iter().filter(|r| r.version < seg.current_version) {
        let info = EntryInfo {
            id: opaque_id(&r.cache_key),
            tenant: r.tenant.as_deref().map(opaque_id).unwrap_or(0),
            bytes: r.bytes.max(0) as u64,
            recompute_tokens: seg.tokens.values().copied().max().unwrap_or(0).max(0) as u64,
            last_use_ms: r.last_use.max(0) as u64,
            inserted_ms: r.last_use.max(0) as u64,
            hits: 0,
            shared: r.tenant.is_none(),
            superseded: true,
        };
        if s.inner.policies.invalidate(&info, now) {
            s.inner
                .catalog
                .drop_residency(&r.worker, &r.cache_key)
                .await?;
            dropped += 1;
        }
    }
    Ok(dropped)
}

async fn delete_segment(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<serde_json::Value> {
    let seg = require_owner(&s, &p, &id).await?;
    s.inner.catalog.delete_segment(&seg.address, &p.sub).await?;
    let dropped = s.inner.catalog.drop_all_residency(&seg.address).await?;
    Ok(Json(serde_json::json!({
        "deleted": id, "address": seg.address, "invalidated_entries": dropped,
    })))
}

async fn segment_versions(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Vec<crate::catalog::SegmentVersion>> {
    let seg = readable_segment(&s, &p, &id).await?;
    Ok(Json(s.inner.catalog.versions(&seg.address).await?))
}

/// Body of `POST /v1/segments/{id}/grants`.
#[derive(Debug, Deserialize)]
pub struct GrantBody {
    /// Tenant to grant read access to.
    pub tenant: String,
}

async fn list_grants(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Vec<String>> {
    let seg = require_owner(&s, &p, &id).await?;
    Ok(Json(s.inner.catalog.grants(&seg.address).await?))
}

async fn add_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
    Body(g): Body<GrantBody>,
) -> ApiResult<serde_json::Value> {
    let seg = require_owner(&s, &p, &id).await?;
    s.inner
        .catalog
        .grant(&seg.address, &g.tenant, &p.sub)
        .await?;
    Ok(Json(
        serde_json::json!({"segment": id, "granted": g.tenant}),
    ))
}

async fn revoke_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath((id, tenant)): ApiPath<(String, String)>,
) -> ApiResult<serde_json::Value> {
    let seg = require_owner(&s, &p, &id).await?;
    s.inner
        .catalog
        .revoke(&seg.address, &tenant, &p.sub)
        .await?;
    Ok(Json(serde_json::json!({"segment": id, "revoked": tenant})))
}

/// Body of `POST /v1/segments/{id}/group-grants`.
#[derive(Debug, Deserialize)]
pub struct GroupGrantBody {
    /// Group whose members get read access.
    pub group: String,
}

async fn list_group_grants(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Vec<String>> {
    let seg = require_owner(&s, &p, &id).await?;
    Ok(Json(s.inner.catalog.group_grants(&seg.address).await?))
}

async fn add_group_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath(id): ApiPath<String>,
    Body(g): Body<GroupGrantBody>,
) -> ApiResult<serde_json::Value> {
    let seg = require_owner(&s, &p, &id).await?;
    s.inner
        .catalog
        .grant_group(&seg.address, &g.group, &p.sub)
        .await?;
    Ok(Json(
        serde_json::json!({"segment": id, "granted_group": g.group}),
    ))
}

async fn revoke_group_grant(
    State(s): State<ControlState>,
    Caller(p): Caller,
    ApiPath((id, group)): ApiPath<(String, String)>,
) -> ApiResult<serde_json::Value> {
    let seg = require_owner(&s, &p, &id).await?;
    s.inner
        .catalog
        .revoke_group(&seg.address, &group, &p.sub)
        .await?;
    Ok(Json(
        serde_json::json!({"segment": id, "revoked_group": group}),
    ))
}

// ---- groups (operators) ---------------------------------------------------------------

/// Body of `POST /v1/admin/groups`.
#[derive(Debug, Deserialize)]
pub struct NewGroup {
    /// Group id: 1..=128 characters of `[A-Za-z0-9._:-]`.
    pub id: String,
    /// Human-readable name (defaults to the id).
    #[serde(default)]
    pub name: Option<String>,
}

async fn create_group(
    State(s): State<ControlState>,
    Operator(p): Operator,
    Body(g): Body<NewGroup>,
) -> ApiResult<Group> {
    Ok(Json(
        s.inner
            .catalog
            .create_group(&g.id, g.name.as_deref(), &p.sub)
            .await?,
    ))
}

async fn list_groups(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<Vec<Group>> {
    Ok(Json(s.inner.catalog.groups().await?))
}

async fn get_group(
    State(s): State<ControlState>,
    Operator(_): Operator,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<Group> {
    Ok(Json(s.inner.catalog.group(&id).await?))
}

async fn delete_group(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<String>,
) -> ApiResult<serde_json::Value> {
    s.inner.catalog.delete_group(&id, &p.sub).await?;
    Ok(Json(serde_json::json!({"deleted": id})))
}

async fn add_member(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath((id, tenant)): ApiPath<(String, String)>,
) -> ApiResult<Group> {
    s.inner.catalog.add_member(&id, &tenant, &p.sub).await?;
    Ok(Json(s.inner.catalog.group(&id).await?))
}

async fn remove_member(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath((id, tenant)): ApiPath<(String, String)>,
) -> ApiResult<Group> {
    s.inner.catalog.remove_member(&id, &tenant, &p.sub).await?;
    Ok(Json(s.inner.catalog.group(&id).await?))
}

/// Body of `POST /v1/snapshot`.
#[derive(Debug, Deserialize)]
pub struct SnapshotRequest {
    /// Segments the request uses (own ids or addresses), in prompt order.
    pub segments: Vec<String>,
    /// Optional client salt: narrows sharing (mixed into the key), never widens it.
    #[serde(default)]
    pub salt: Option<String>,
}

/// One pinned segment of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotItem {
    /// Segment id as the request gave it (an own id or an address).
    pub segment_id: String,
    /// The segment's global address.
    pub address: String,
    /// Pinned version.
    pub version: i64,
    /// Content hash of the pinned version.
    pub content_hash: String,
    /// Isolation key (namespace) derived server-side.
    pub isolation_key: String,
    /// Cache key of this version in that namespace.
    pub cache_key: String,
    /// True when the shared namespace is used.
    pub shared: bool,
    /// Workers holding the entry (a hit when non-empty).
    pub resident_on: Vec<String>,
}

/// Answer of `POST /v1/snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotResponse {
    /// Tenant from the token.
    pub tenant: String,
    /// One item per requested segment, same order.
    pub segments: Vec<SnapshotItem>,
}

/// The isolation key of a pinned segment for `tenant` and whether it is the
/// shared namespace (public, and the isolation policy allows sharing).
pub fn isolation_of(
    s: &ControlState,
    tenant: &str,
    e: &SnapshotEntry,
    salt: Option<&str>,
) -> (String, bool) {
    let allowed = s.inner.policies.isolation(&IsolationInfo {
        segment: opaque_id(&e.segment_id),
        tenant: opaque_id(tenant),
        public: e.public,
        owner: e.owner_tenant == tenant,
    });
    let shared = allowed && e.public;
    (s.inner.keyer.isolation_key(tenant, e, shared, salt), shared)
}

/// Resolves a snapshot for `tenant`: pins versions and derives keys. `ids`
/// are the tenant's own segment ids or addresses.
pub async fn resolve_snapshot(
    s: &ControlState,
    tenant: &str,
    ids: &[String],
    salt: Option<&str>,
) -> Result<SnapshotResponse, ApiError> {
    if let Some(salt) = salt {
        if salt.len() > 256 {
            return Err(ApiError::bad_request("salt must be at most 256 bytes"));
        }
    }
    let entries: Vec<SnapshotEntry> = s.inner.catalog.snapshot(tenant, ids).await?;
    let mut out = Vec::with_capacity(entries.len());
    for (reference, e) in ids.iter().zip(entries) {
        let (isolation_key, shared) = isolation_of(s, tenant, &e, salt);
        let cache_key = s.inner.keyer.cache_key(&isolation_key, &e);
        let resident_on = s
            .inner
            .catalog
            .residency_of(&cache_key)
            .await?
            .into_iter()
            .map(|r| r.worker)
            .collect();
        out.push(SnapshotItem {
            segment_id: reference.clone(),
            address: e.segment_id,
            version: e.version,
            content_hash: e.content_hash,
            isolation_key,
            cache_key,
            shared,
            resident_on,
        });
    }
    Ok(SnapshotResponse {
        tenant: tenant.to_string(),
        segments: out,
    })
}

async fn snapshot(
    State(s): State<ControlState>,
    Caller(p): Caller,
    Body(r): Body<SnapshotRequest>,
) -> ApiResult<SnapshotResponse> {
    Ok(Json(
        resolve_snapshot(&s, &p.tenant, &r.segments, r.salt.as_deref()).await?,
    ))
}

/// Body of `POST /v1/admin/residency`: a worker reports an entry it holds.
#[derive(Debug, Deserialize)]
pub struct ResidencyReport {
    /// Worker id.
    pub worker: String,
    /// Cache key from a snapshot.
    pub cache_key: String,
    /// Segment id.
    pub segment_id: String,
    /// Segment version.
    pub version: i64,
    /// Tenant namespace (`None` for shared).
    #[serde(default)]
    pub tenant: Option<String>,
    /// Bytes held.
    pub bytes: i64,
}

async fn report_residency(
    State(s): State<ControlState>,
    Operator(_): Operator,
    Body(r): Body<ResidencyReport>,
) -> ApiResult<serde_json::Value> {
    if r.worker.is_empty() || r.cache_key.is_empty() || r.bytes < 0 {
        return Err(ApiError::bad_request(
            "worker and cache_key must be non-empty and bytes non-negative",
        ));
    }
    for (what, v) in [
        ("worker", Some(&r.worker)),
        ("cache_key", Some(&r.cache_key)),
        ("segment_id", Some(&r.segment_id)),
        ("tenant", r.tenant.as_ref()),
    ] {
        if let Some(v) = v {
            crate::catalog::validate_text(what, v)?;
        }
    }
    s.inner
        .catalog
        .report_residency(&Residency {
            worker: r.worker,
            cache_key: r.cache_key,
            segment_id: r.segment_id,
            version: r.version,
            tenant: r.tenant,
            bytes: r.bytes,
            last_use: now_ms(),
        })
        .await?;
    Ok(Json(serde_json::json!({"ok": true})))
}

// ---- policies -----------------------------------------------------------------------

/// Body of `POST /v1/admin/policies`.
#[derive(Debug, Deserialize)]
pub struct UploadPolicy {
    /// Policy name (versions accumulate per name).
    pub name: String,
    /// Hook kind.
    pub kind: String,
    /// The module, base64 (standard alphabet).
    pub wasm_base64: String,
    /// Integer parameters (JSON object).
    #[serde(default)]
    pub params: serde_json::Value,
}

async fn upload_policy(
    State(s): State<ControlState>,
    Operator(p): Operator,
    Body(u): Body<UploadPolicy>,
) -> ApiResult<crate::catalog::PolicyRecord> {
    let kind: PolicyKind = u.kind.parse().map_err(ApiError::bad_request)?;
    let rt = &s.inner.policies;
    let limit = rt.limits().max_module_bytes;
    // Refuse an oversized module before decoding it (base64: 4 characters per 3 bytes).
    let b64 = u.wasm_base64.trim();
    if b64.len() / 4 * 3 > limit.saturating_add(3) {
        return Err(policy_error(PolicyError::TooLarge {
            bytes: b64.len() / 4 * 3,
            limit,
        }));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| ApiError::bad_request(format!("wasm_base64 is not valid base64: {e}")))?;
    // Compiled on the blocking pool (once per module: activation and dry runs of
    // this module reuse it); at the compile cap this answers 429 at once.
    let validated = rt
        .load(kind, bytes.as_slice().into(), &u.params, false)
        .await
        .and_then(|p| {
            // Smoke call: the hook must answer a synthetic input within limits.
            let mut slot = PolicySlot::wasm(p, None);
            smoke(&mut slot)
        });
    if let Err(e) = validated {
        if matches!(e, PolicyError::Busy { .. }) {
            return Err(policy_error(e));
        }
        s.inner
            .catalog
            .audit(
                &p.sub,
                Some(&p.tenant),
                "policy.reject",
                &u.name,
                &serde_json::json!({"kind": u.kind, "error": e.to_string()}),
            )
            .await?;
        return Err(policy_error(e));
    }
    let params = if u.params.is_null() {
        "{}".to_string()
    } else {
        u.params.to_string()
    };
    Ok(Json(
        s.inner
            .catalog
            .insert_policy(&u.name, kind.as_str(), &bytes, &params, &p.sub)
            .await?,
    ))
}

/// A policy load error as an API error: 413 for a module over the size limit,
/// 429 when the compile slots are taken, 400 otherwise.
fn policy_error(e: PolicyError) -> ApiError {
    match e {
        PolicyError::TooLarge { .. } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "module_too_large",
            e.to_string(),
        ),
        PolicyError::Busy { .. } => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "compile_busy",
            e.to_string(),
        ),
        other => ApiError::bad_request(other.to_string()),
    }
}

fn smoke(slot: &mut PolicySlot) -> Result<(), crate::policy::PolicyError> {
    let now = now_ms() as u64;
    let e = EntryInfo {
        id: 1,
        tenant: 2,
        bytes: 4096,
        recompute_tokens: 100,
        last_use_ms: now,
        inserted_ms: now,
        hits: 1,
        shared: false,
        superseded: false,
    };
    let fault = match slot.kind() {
        PolicyKind::Eviction => {
            slot.evict(
                &[
                    e,
                    EntryInfo {
                        id: 3,
                        last_use_ms: now - 1,
                        ..e
                    },
                ],
                now,
            )
            .1
        }
        PolicyKind::Admission => {
            slot.admit(
                &crate::policy::AdmitInfo {
                    id: 1,
                    tenant: 2,
                    bytes: 4096,
                    recompute_tokens: 100,
                    tenant_used_bytes: 0,
                    capacity_bytes: 1 << 30,
                    seen_count: 1,
                    shared: false,
                },
                now,
            )
            .1
        }
        PolicyKind::Invalidation => slot.invalidate(&e, now).1,
        PolicyKind::Isolation => {
            slot.isolation(&IsolationInfo {
                segment: 1,
                tenant: 2,
                public: true,
                owner: false,
            })
            .1
        }
    };
    match fault {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

async fn list_policies(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<Vec<crate::catalog::PolicyRecord>> {
    Ok(Json(s.inner.catalog.policies().await?))
}

async fn policy_stats(
    State(s): State<ControlState>,
    Operator(_): Operator,
) -> ApiResult<serde_json::Value> {
    let rt = &s.inner.policies;
    let active: BTreeMap<&str, Option<i64>> = PolicyKind::ALL
        .iter()
        .map(|k| (k.as_str(), rt.active_id(*k)))
        .collect();
    Ok(Json(serde_json::json!({
        "active": active,
        "metrics": rt.metrics().snapshot(),
        "module_compiles": rt.modules().compiles(),
        "modules_cached": rt.modules().len(),
    })))
}

async fn activate_policy(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<serde_json::Value> {
    let rec = s.inner.catalog.policy(id).await?;
    let kind: PolicyKind = rec.kind.parse().map_err(ApiError::bad_request)?;
    let params: serde_json::Value =
        serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
    let _serial = s.inner.activation.lock().await;
    // Load first (compiled module from the cache, or compiled on the blocking
    // pool): a module that no longer loads is not activated.
    let loaded = s
        .inner
        .policies
        .load(kind, rec.module.into(), &params, false)
        .await
        .map_err(policy_error)?;
    s.inner
        .catalog
        .activate_policy(kind.as_str(), Some(id), &p.sub)
        .await?;
    s.inner.policies.install_wasm(loaded, Some(id));
    Ok(Json(
        serde_json::json!({"kind": kind.as_str(), "active": id}),
    ))
}

/// Body of `POST /v1/admin/policies/rollback`.
#[derive(Debug, Deserialize)]
pub struct RollbackBody {
    /// Hook kind to roll back.
    pub kind: String,
}

async fn rollback_policy(
    State(s): State<ControlState>,
    Operator(p): Operator,
    Body(b): Body<RollbackBody>,
) -> ApiResult<serde_json::Value> {
    let kind: PolicyKind = b.kind.parse().map_err(ApiError::bad_request)?;
    let _serial = s.inner.activation.lock().await;
    let now_active = s
        .inner
        .catalog
        .rollback_policy(kind.as_str(), &p.sub)
        .await?;
    match now_active {
        Some(id) => {
            let rec = s.inner.catalog.policy(id).await?;
            let params: serde_json::Value =
                serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
            let _ = s
                .inner
                .policies
                .activate(kind, Some(id), rec.module.into(), &params)
                .await;
        }
        None => s.inner.policies.set_native(kind),
    }
    Ok(Json(
        serde_json::json!({"kind": kind.as_str(), "active": now_active}),
    ))
}

/// Body of `POST /v1/admin/policies/{id}/dry-run`.
#[derive(Debug, Deserialize)]
pub struct DryRunBody {
    /// The recorded trace, JSONL (see [`crate::sim::TraceRecord`]).
    pub trace: String,
    /// Simulated cache capacity in bytes.
    pub capacity_bytes: u64,
}

/// Answer of a dry run.
#[derive(Debug, Serialize, Deserialize)]
pub struct DryRunResult {
    /// Policy tried.
    pub policy_id: i64,
    /// Its kind.
    pub kind: String,
    /// Replay with the candidate in its hook (other hooks as active).
    pub candidate: SimStats,
    /// Replay with the active policies.
    pub active: SimStats,
    /// candidate.hit_ratio − active.hit_ratio.
    pub hit_ratio_delta: f64,
    /// candidate.recompute_tokens − active.recompute_tokens.
    pub recompute_tokens_delta: i64,
}

async fn dry_run(
    State(s): State<ControlState>,
    Operator(p): Operator,
    ApiPath(id): ApiPath<i64>,
    Body(b): Body<DryRunBody>,
) -> ApiResult<DryRunResult> {
    let rec = s.inner.catalog.policy(id).await?;
    let kind: PolicyKind = rec.kind.parse().map_err(ApiError::bad_request)?;
    if b.capacity_bytes == 0 {
        return Err(ApiError::bad_request("capacity_bytes must be positive"));
    }
    let trace = parse_trace(&b.trace).map_err(ApiError::bad_request)?;
    let rt = s.inner.policies.clone();
    let catalog = s.inner.catalog.clone();
    let mut active = PolicySet::from_catalog(&catalog, &rt).await;
    let mut candidate = PolicySet::from_catalog(&catalog, &rt).await;
    let params: serde_json::Value =
        serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
    let w = rt
        .load(kind, rec.module.into(), &params, false)
        .await
        .map_err(policy_error)?;
    candidate.set(PolicySlot::wasm(w, Some(id)));
    let cap = b.capacity_bytes;
    let (cand, act) = tokio::task::spawn_blocking(move || {
        let c = simulate(&trace, cap, &mut candidate);
        let a = simulate(&trace, cap, &mut active);
        (c, a)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "internal_error",
            e.to_string(),
        )
    })?;
    let result = DryRunResult {
        policy_id: id,
        kind: kind.as_str().into(),
        hit_ratio_delta: cand.hit_ratio - act.hit_ratio,
        recompute_tokens_delta: cand.recompute_tokens as i64 - act.recompute_tokens as i64,
        candidate: cand,
        active: act,
    };
    s.inner
        .catalog
        .audit(
            &p.sub,
            None,
            "policy.dry_run",
            &id.to_string(),
            &serde_json::json!({
                "requests": result.candidate.requests,
                "candidate_hit_ratio": result.candidate.hit_ratio,
                "active_hit_ratio": result.active.hit_ratio,
            }),
        )
        .await?;
    Ok(Json(result))
}

/// Query of `GET /v1/admin/audit`.
#[derive(Debug, Deserialize)]
pub struct AuditQuery {
    /// Only this action.
    pub action: Option<String>,
    /// Only rows by this actor (token subject, or `system`).
    pub actor: Option<String>,
    /// Only rows at or after this time (ms since the Unix epoch).
    pub since_ms: Option<i64>,
    /// Only rows before this time (ms since the Unix epoch).
    pub until_ms: Option<i64>,
    /// At most this many rows (default 100).
    pub limit: Option<i64>,
}

async fn audit_log(
    State(s): State<ControlState>,
    Operator(_): Operator,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> ApiResult<Vec<crate::catalog::AuditEntry>> {
    for (name, v) in [("action", &q.action), ("actor", &q.actor)] {
        if v.as_deref().is_some_and(|a| a.contains('\0')) {
            return Err(
                ApiError::bad_request(format!("{name} contains a NUL character")).with_param(name),
            );
        }
    }
    let f = crate::catalog::AuditFilter {
        action: q.action.filter(|a| !a.is_empty()),
        actor: q.actor.filter(|a| !a.is_empty()),
        since_ms: q.since_ms,
        until_ms: q.until_ms,
    };
    Ok(Json(
        s.inner
            .catalog
            .audit_log_filtered(&f, q.limit.unwrap_or(100))
            .await?,
    ))
}
