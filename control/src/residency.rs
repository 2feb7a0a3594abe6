//! The residency directory in the catalog (`segment_residency`) and the catalog's
//! change events.
//!
//! **Rows.** One row per (holder, entry): which serving replica's public pool, or
//! which segment-parallel worker, holds a segment entry, in which tier, how many
//! bytes (see `migrations/*/0005_segment_residency.sql`). A replica writes them
//! through [`Catalog::write_residency`] in batches (the serving side queues its
//! pool's events and never waits on the database: `crate::serve::residency`).
//!
//! **Events.** A segment's new version or deletion and a worker's holding are
//! [`CatalogEvent`]s. Every catalog delivers them to its own subscribers
//! ([`Catalog::subscribe`]: the in-process channel, the only one with SQLite); on
//! Postgres they are also sent with `NOTIFY` on the catalog's channel in the same
//! transaction as the change, so every replica listening on the same database and
//! schema ([`Catalog::listen`]) receives them when (and only if) the change
//! commits. A notification carries the sending catalog's origin id, so a replica
//! skips its own (it had them from the in-process channel).
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sqlx::Row;

use crate::catalog::{Backend, Catalog, CatalogError, CatalogResult};

/// Longest `NOTIFY` payload Postgres accepts is 8000 bytes; events are far smaller
/// (an address, a digest, a worker name), this bounds the worker name.
const MAX_HOLDER_BYTES: usize = 512;

/// Capacity of the in-process event channel: a subscriber that falls this far
/// behind loses events and is told so (it then resynchronises).
const EVENT_CHANNEL: usize = 4096;

/// A change other replicas must learn of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum CatalogEvent {
    /// Segment `address` got version `version` (`deleted`: it was deleted at
    /// `version`). Entries of earlier versions (all, when deleted) are stale.
    Segment {
        /// The segment's address.
        address: String,
        /// Its new current version, or the version it was deleted at.
        version: i64,
        /// Whether it was deleted.
        deleted: bool,
    },
    /// Worker `worker` holds (`held`) or no longer holds the segment whose digest
    /// (32 hex digits, `dataplane::parallel::scatter::segment_digest`) is `segment`.
    Holder {
        /// The segment digest, 32 lowercase hex digits.
        segment: String,
        /// The worker's name (its address as the replicas are configured with it).
        worker: String,
        /// Whether the worker holds it now.
        held: bool,
    },
}

/// The wire form of a notification: the event and the catalog that sent it.
#[derive(Serialize, Deserialize)]
struct Notice {
    origin: String,
    #[serde(flatten)]
    event: CatalogEvent,
}

/// The catalog's event plumbing (part of [`Catalog`]).
#[derive(Clone, Debug)]
pub(crate) struct Events {
    tx: tokio::sync::broadcast::Sender<CatalogEvent>,
    origin: Arc<str>,
    channel: Arc<str>,
    url: Arc<str>,
    sent: Arc<std::sync::atomic::AtomicU64>,
}

impl Events {
    pub(crate) fn new(url: &str, channel: String) -> Events {
        let (tx, _) = tokio::sync::broadcast::channel(EVENT_CHANNEL);
        let origin: String = {
            use rand::Rng;
            let mut r = rand::rng();
            (0..16)
                .map(|_| format!("{:x}", r.random_range(0..16u8)))
                .collect()
        };
        Events {
            tx,
            origin: origin.into(),
            channel: channel.into(),
            url: url.into(),
            sent: Arc::default(),
        }
    }
}

/// The `NOTIFY` channel of a catalog in `schema`: `hypic_` and the schema name
/// (letters, digits and `_` kept, others as `_`; at most 63 bytes, Postgres'
/// identifier length), so catalogs in different schemas of one database do not
/// hear each other.
pub fn channel_for(schema: &str) -> String {
    let mut c: String = format!("hypic_{schema}")
        .chars()
        .map(|ch| {
            if ch.is_ascii_alphanumeric() || ch == '_' {
                ch.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    c.truncate(63);
    c
}

/// Who holds an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum HolderKind {
    /// A serving replica's own public pool.
    Replica,
    /// A segment-parallel worker (`hypic worker`).
    Worker,
}

impl HolderKind {
    /// The name stored in `holder_kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            HolderKind::Replica => "replica",
            HolderKind::Worker => "worker",
        }
    }
}

/// One `segment_residency` row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ResidencyRow {
    /// The replica id or the worker name (empty in a tenant's view: the
    /// deployment's topology is the operator's).
    pub holder: String,
    /// Replica or worker.
    pub holder_kind: HolderKind,
    /// The digest the holder keys the entry by (hex): a replica's public-pool key
    /// (64 hex digits: content, isolation and body start), a worker's segment
    /// digest (32 hex digits: tokens and isolation).
    pub entry_key: String,
    /// The catalog segment (address) the entry is a version of, when the replica
    /// knows it; `null` for inline segments and unknown ones.
    pub segment_id: Option<String>,
    /// That segment's version.
    pub version: Option<i64>,
    /// The namespace: `shared`, or the owner's account pseudonym.
    pub scope: String,
    /// `primary` (the pool's own memory: device or host) or `spill` (host spill tier).
    pub tier: String,
    /// Bytes in that tier (a worker's: bytes shipped).
    pub bytes: i64,
    /// Tokens of the segment.
    pub tokens: i64,
    /// Last change, milliseconds since the Unix epoch.
    pub updated_at: i64,
}

/// One write of a batch ([`Catalog::write_residency`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResidencyWrite {
    /// Insert or replace the row of (`holder`, `entry_key`); a `None`
    /// `segment_id`/`version` keeps what the row had.
    Put(ResidencyRow),
    /// Delete the row of (`holder`, `entry_key`), if any.
    Drop {
        /// The holder.
        holder: String,
        /// Its kind (a worker's removal is announced).
        holder_kind: HolderKind,
        /// The entry.
        entry_key: String,
    },
}

/// Which rows [`Catalog::residency_rows`] returns.
#[derive(Clone, Debug, Default)]
pub struct ResidencyFilter {
    /// Only rows of these scopes (`None`: every scope, for operators).
    pub scopes: Option<Vec<String>>,
    /// Only rows of this segment (address).
    pub segment_id: Option<String>,
    /// Only rows of this holder.
    pub holder: Option<String>,
    /// At most this many rows (clamped to 1..=10000).
    pub limit: usize,
}

fn row_from(r: &sqlx::any::AnyRow) -> ResidencyRow {
    ResidencyRow {
        holder: r.get(0),
        holder_kind: if r.get::<String, _>(1) == "worker" {
            HolderKind::Worker
        } else {
            HolderKind::Replica
        },
        entry_key: r.get(2),
        segment_id: r.get(3),
        version: r.get(4),
        scope: r.get(5),
        tier: r.get(6),
        bytes: r.get(7),
        tokens: r.get(8),
        updated_at: r.get(9),
    }
}

fn check_row(r: &ResidencyRow) -> CatalogResult<()> {
    if r.holder.is_empty() || r.holder.len() > MAX_HOLDER_BYTES {
        return Err(CatalogError::Invalid(format!(
            "residency holder must be 1 to {MAX_HOLDER_BYTES} bytes, got {}",
            r.holder.len()
        )));
    }
    if r.entry_key.is_empty() || !r.entry_key.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(CatalogError::Invalid(format!(
            "residency entry_key must be hex digits, got {:?}",
            r.entry_key
        )));
    }
    if r.tier != "primary" && r.tier != "spill" {
        return Err(CatalogError::Invalid(format!(
            "residency tier must be \"primary\" or \"spill\", got {:?}",
            r.tier
        )));
    }
    if r.bytes < 0 || r.tokens < 0 {
        return Err(CatalogError::Invalid(
            "residency bytes and tokens must not be negative".into(),
        ));
    }
    Ok(())
}

impl Catalog {
    /// Receives this catalog's events from now on: those of changes made through
    /// it (both databases) and, once [`Catalog::listen`] runs, those other
    /// replicas sent. A receiver that lags more than the channel's capacity gets
    /// `RecvError::Lagged` and should resynchronise.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<CatalogEvent> {
        self.events.tx.subscribe()
    }

    /// This catalog's origin id (random per [`Catalog::connect`]; notifications
    /// carry it).
    pub fn origin(&self) -> &str {
        &self.events.origin
    }

    /// The `NOTIFY` channel (Postgres; see [`channel_for`]).
    pub fn channel(&self) -> &str {
        &self.events.channel
    }

    /// Delivers `e` to this process's subscribers (after the change committed).
    pub(crate) fn publish(&self, e: CatalogEvent) {
        if self.backend() == Backend::Postgres {
            // It was sent with NOTIFY in the transaction that just committed.
            self.events
                .sent
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let _ = self.events.tx.send(e);
    }

    /// Notifications this process sent through this catalog (and its clones)
    /// that committed (Postgres; 0 on SQLite).
    pub fn notifications_sent(&self) -> u64 {
        self.events.sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Sends `e` with `NOTIFY` inside `tx` (Postgres; delivered when `tx`
    /// commits, never when it rolls back). Nothing on SQLite.
    pub(crate) async fn notify_in(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Any>,
        e: &CatalogEvent,
    ) -> CatalogResult<()> {
        if self.backend() != Backend::Postgres {
            return Ok(());
        }
        let payload = serde_json::to_string(&Notice {
            origin: self.origin().to_string(),
            event: e.clone(),
        })
        .map_err(|err| CatalogError::Invalid(err.to_string()))?;
        sqlx::query("SELECT CAST(pg_notify($1, $2) AS TEXT)")
            .bind(self.channel())
            .bind(payload)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Writes a batch of residency changes in one transaction, in order; a
    /// worker's holding (put or drop) is announced as a [`CatalogEvent::Holder`]
    /// (`NOTIFY` in the same transaction, then in-process). Returns the number of
    /// rows written or deleted.
    ///
    /// Errors: `Invalid` for a row with an empty or overlong holder, a non-hex
    /// key, an unknown tier or negative sizes (nothing of the batch is written);
    /// `Db` when the database fails.
    pub async fn write_residency(&self, batch: &[ResidencyWrite]) -> CatalogResult<u64> {
        for w in batch {
            if let ResidencyWrite::Put(r) = w {
                check_row(r)?;
            }
        }
        let mut n = 0;
        let mut events = vec![];
        let mut tx = self.pool().begin().await?;
        for w in batch {
            match w {
                ResidencyWrite::Put(r) => {
                    n += sqlx::query(
                        "INSERT INTO segment_residency (holder, holder_kind, entry_key, segment_id, version, \
                         scope, tier, bytes, tokens, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) \
                         ON CONFLICT (holder, entry_key) DO UPDATE SET \
                         segment_id = COALESCE(excluded.segment_id, segment_residency.segment_id), \
                         version = COALESCE(excluded.version, segment_residency.version), \
                         scope = excluded.scope, tier = excluded.tier, bytes = excluded.bytes, \
                         tokens = excluded.tokens, updated_at = excluded.updated_at",
                    )
                    .bind(&r.holder)
                    .bind(r.holder_kind.as_str())
                    .bind(&r.entry_key)
                    .bind(r.segment_id.as_deref())
                    .bind(r.version)
                    .bind(&r.scope)
                    .bind(&r.tier)
                    .bind(r.bytes)
                    .bind(r.tokens)
                    .bind(r.updated_at)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    if r.holder_kind == HolderKind::Worker {
                        events.push(CatalogEvent::Holder {
                            segment: r.entry_key.clone(),
                            worker: r.holder.clone(),
                            held: true,
                        });
                    }
                }
                ResidencyWrite::Drop {
                    holder,
                    holder_kind,
                    entry_key,
                } => {
                    let d = sqlx::query(
                        "DELETE FROM segment_residency WHERE holder = $1 AND entry_key = $2",
                    )
                    .bind(holder)
                    .bind(entry_key)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    n += d;
                    if *holder_kind == HolderKind::Worker && d > 0 {
                        events.push(CatalogEvent::Holder {
                            segment: entry_key.clone(),
                            worker: holder.clone(),
                            held: false,
                        });
                    }
                }
            }
        }
        for e in &events {
            self.notify_in(&mut tx, e).await?;
        }
        tx.commit().await?;
        for e in events {
            self.publish(e);
        }
        Ok(n)
    }

    /// Deletes every row of the replica `holder` (a replica starting up clears what
    /// an earlier run of it left: its pools start empty). Returns how many.
    pub async fn clear_holder(&self, holder: &str) -> CatalogResult<u64> {
        let r = sqlx::query(
            "DELETE FROM segment_residency WHERE holder = $1 AND holder_kind = 'replica'",
        )
        .bind(holder)
        .execute(self.pool())
        .await?;
        Ok(r.rows_affected())
    }

    /// Rows matching `f`, newest change first.
    pub async fn residency_rows(&self, f: &ResidencyFilter) -> CatalogResult<Vec<ResidencyRow>> {
        let mut sql = String::from(
            "SELECT holder, holder_kind, entry_key, segment_id, version, scope, tier, bytes, tokens, \
             updated_at FROM segment_residency WHERE 1 = 1",
        );
        let mut args: Vec<String> = vec![];
        if let Some(scopes) = &f.scopes {
            if scopes.is_empty() {
                return Ok(vec![]);
            }
            let ps: Vec<String> = scopes
                .iter()
                .map(|s| {
                    args.push(s.clone());
                    format!("${}", args.len())
                })
                .collect();
            sql.push_str(&format!(" AND scope IN ({})", ps.join(", ")));
        }
        if let Some(seg) = &f.segment_id {
            args.push(seg.clone());
            sql.push_str(&format!(" AND segment_id = ${}", args.len()));
        }
        if let Some(h) = &f.holder {
            args.push(h.clone());
            sql.push_str(&format!(" AND holder = ${}", args.len()));
        }
        sql.push_str(&format!(
            " ORDER BY updated_at DESC, holder, entry_key LIMIT {}",
            f.limit.clamp(1, 10_000)
        ));
        let mut q = sqlx::query(&sql);
        for a in &args {
            q = q.bind(a);
        }
        Ok(q.fetch_all(self.pool())
            .await?
            .iter()
            .map(row_from)
            .collect())
    }

    /// The `limit` newest worker holdings, newest first: (segment digest, worker),
    /// for a replica's holder view at start-up and after a lost notification
    /// connection.
    pub async fn worker_holders(&self, limit: usize) -> CatalogResult<Vec<(String, String)>> {
        let rows = sqlx::query(&format!(
            "SELECT entry_key, holder FROM segment_residency WHERE holder_kind = 'worker' \
             ORDER BY updated_at DESC, holder, entry_key LIMIT {}",
            limit.max(1)
        ))
        .fetch_all(self.pool())
        .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Listens on this catalog's channel (Postgres) and forwards other replicas'
    /// events to this catalog's subscribers ([`Catalog::subscribe`]), calling
    /// `received` for each first; runs until its task is dropped. `connected` is
    /// called on every (re)connection once `LISTEN` succeeded. On a lost
    /// connection it reconnects (after 100 ms, doubling up to 5 s) and calls
    /// `resync` once connected again (what was sent meanwhile is lost, so the
    /// caller reloads its view). Returns at once on SQLite (no other process).
    pub async fn listen(
        &self,
        connected: impl Fn(),
        received: impl Fn(&CatalogEvent),
        resync: impl Fn(),
    ) {
        if self.backend() != Backend::Postgres {
            return;
        }
        let mut backoff = std::time::Duration::from_millis(100);
        let mut first = true;
        loop {
            let mut l = match self.listener().await {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!("catalog listener: {e}; retrying in {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
                    continue;
                }
            };
            backoff = std::time::Duration::from_millis(100);
            connected();
            if !first {
                resync();
            }
            first = false;
            // Ends when the connection was lost: reconnect (a fresh listener).
            while let Ok(Some(n)) = l.try_recv().await {
                let Ok(notice) = serde_json::from_str::<Notice>(n.payload()) else {
                    tracing::warn!("catalog listener: unreadable notification ignored");
                    continue;
                };
                if notice.origin == self.origin() {
                    continue;
                }
                received(&notice.event);
                let _ = self.events.tx.send(notice.event);
            }
        }
    }

    async fn listener(&self) -> Result<sqlx::postgres::PgListener, sqlx::Error> {
        let mut l = sqlx::postgres::PgListener::connect(&self.events.url).await?;
        l.listen(self.channel()).await?;
        Ok(l)
    }
}
