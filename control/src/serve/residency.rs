//! The serving replica's side of the residency directory (the catalog's
//! `segment_residency`, [`crate::residency`]).
//!
//! - **Writes.** The engine's public pool tells a [`Directory`] of every change
//!   (insert, spill, restore, eviction, removal, clear) and the combiner of every
//!   segment a worker shipped; each change is put on a bounded queue without
//!   waiting (a full queue drops it and counts it) and one task drains the queue
//!   in batches into the catalog. A starting replica deletes the rows its id left.
//! - **Holder view.** The combiner's holder affinity asks the directory which
//!   worker holds a segment: an in-memory view, loaded from the catalog at start
//!   and after a lost notification connection, updated by this replica's own
//!   shipments at once and by other replicas' through their `NOTIFY`s.
//! - **Invalidation.** A segment's new version or deletion through any replica
//!   evicts this replica's entries of the superseded versions as soon as the
//!   event arrives (in-process on SQLite; `LISTEN` on Postgres). Catalog lookups
//!   are not cached across requests beyond token ids keyed by (address, version,
//!   content hash), so a request always resolves the current version.
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use dataplane::parallel::scatter::HolderDirectory;
use dataplane::pic::pool::{owner_group, EventKind, Key, PoolObserver, ResidencyChange, Tier};

use crate::catalog::{now_ms, Catalog};
use crate::residency::{CatalogEvent, HolderKind, ResidencyRow, ResidencyWrite};

/// Most changes one catalog transaction writes.
const BATCH: usize = 256;
/// Most segments the holder view remembers (cleared when full, as the combiner's
/// own map: a forgotten holder costs a prefill on another worker, never a wrong
/// entry).
const HOLDERS_CAP: usize = 1 << 16;
/// Most public-pool keys whose catalog segment the directory remembers.
const LABELS_CAP: usize = 1 << 16;

/// One queued change.
enum Change {
    Pool(ResidencyChange),
    Cleared,
    Worker {
        segment: u128,
        scope: String,
        worker: String,
        tokens: usize,
        bytes: usize,
    },
}

/// Counters of the directory (`/metrics`).
#[derive(Default)]
pub struct DirectoryCounters {
    /// Rows written or deleted in the catalog.
    pub rows_written: AtomicU64,
    /// Catalog transactions (batches) written.
    pub batches: AtomicU64,
    /// Batches the catalog refused or failed (their changes are lost).
    pub write_errors: AtomicU64,
    /// Changes dropped because the queue was full.
    pub queue_drops: AtomicU64,
    /// Notifications received from other replicas.
    pub notifications_received: AtomicU64,
    /// (Re)connections of the notification listener.
    pub listener_connects: AtomicU64,
    /// Resynchronisations after a lost listener connection.
    pub resyncs: AtomicU64,
    /// Segment events (new version, deletion) this replica acted on.
    pub segment_events: AtomicU64,
    /// Entries evicted on a segment event or a resynchronisation (another
    /// replica's update or deletion: this replica's own route evicts first).
    pub event_evictions: AtomicU64,
}

/// The residency directory of one serving replica (see the module docs).
pub struct Directory {
    replica: String,
    catalog: Catalog,
    queue: tokio::sync::mpsc::Sender<Change>,
    holders: Mutex<HashMap<u128, String>>,
    labels: Mutex<HashMap<Key, (String, i64)>>,
    /// Woken when events may have been lost (the listener reconnected).
    resync: Arc<tokio::sync::Notify>,
    /// Its counters.
    pub counters: DirectoryCounters,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
    /// Held by this replica's segment routes from the catalog change to their own
    /// eviction, and by the event handler around its evictions: the route's
    /// change event (delivered at commit) is acted on after the route evicted, so
    /// the route's answer counts the entries its change evicted.
    pub(crate) evict_gate: tokio::sync::Mutex<()>,
}

impl Drop for Directory {
    fn drop(&mut self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Directory {
    /// Starts the directory of replica `replica` over `catalog` with a queue of
    /// `queue` changes (at least 1) on the runtime `rt`: one task deletes the
    /// replica's rows of an earlier run, loads the worker holdings and then drains
    /// the queue; on Postgres another listens for other replicas' events. Both
    /// stop when the directory is dropped.
    pub fn spawn(
        replica: String,
        catalog: Catalog,
        queue: usize,
        rt: &tokio::runtime::Handle,
    ) -> Arc<Directory> {
        let (tx, rx) = tokio::sync::mpsc::channel(queue.max(1));
        let d = Arc::new(Directory {
            replica,
            catalog,
            queue: tx,
            holders: Mutex::new(HashMap::new()),
            labels: Mutex::new(HashMap::new()),
            resync: Arc::new(tokio::sync::Notify::new()),
            counters: DirectoryCounters::default(),
            tasks: Mutex::new(vec![]),
            evict_gate: tokio::sync::Mutex::new(()),
        });
        let weak = Arc::downgrade(&d);
        let drain = rt.spawn(async move {
            if let Some(d) = weak.upgrade() {
                match d.catalog.clear_holder(&d.replica).await {
                    Ok(n) if n > 0 => tracing::info!(
                        "residency directory: deleted {n} rows an earlier run of replica {} left",
                        d.replica
                    ),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!("residency directory: clearing stale rows failed: {e}")
                    }
                }
                d.resync_holders().await;
            }
            Directory::drain(weak, rx).await;
        });
        let listen = rt.spawn(Directory::listen(Arc::downgrade(&d)));
        lock(&d.tasks).extend([drain.abort_handle(), listen.abort_handle()]);
        d
    }

    /// This replica's id.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The catalog's notifications sent by this process (Postgres).
    pub fn notifications_sent(&self) -> u64 {
        self.catalog.notifications_sent()
    }

    /// Remembers that the public-pool entries under `keys` are version `version`
    /// of the catalog segment `address`, so that their rows name it.
    pub fn label(&self, address: &str, version: i64, keys: impl IntoIterator<Item = Key>) {
        let mut l = lock(&self.labels);
        for k in keys {
            if l.len() >= LABELS_CAP && !l.contains_key(&k) {
                l.clear();
            }
            l.insert(k, (address.to_string(), version));
        }
    }

    fn enqueue(&self, c: Change) {
        if self.queue.try_send(c).is_err() {
            self.counters.queue_drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn note_holder(&self, segment: u128, worker: Option<&str>) {
        let mut h = lock(&self.holders);
        match worker {
            Some(w) => {
                if h.len() >= HOLDERS_CAP && !h.contains_key(&segment) {
                    h.clear();
                }
                h.insert(segment, w.to_string());
            }
            None => {
                h.remove(&segment);
            }
        }
    }

    /// The write of one change (`None`: nothing to write).
    fn write_of(&self, c: Change) -> Option<ResidencyWrite> {
        let now = now_ms();
        match c {
            Change::Cleared => None,
            Change::Worker {
                segment,
                scope,
                worker,
                tokens,
                bytes,
            } => Some(ResidencyWrite::Put(ResidencyRow {
                holder: worker,
                holder_kind: HolderKind::Worker,
                entry_key: format!("{segment:032x}"),
                segment_id: None,
                version: None,
                scope,
                tier: "primary".into(),
                bytes: bytes as i64,
                tokens: tokens as i64,
                updated_at: now,
            })),
            Change::Pool(p) => {
                let entry_key = hex::encode(p.key);
                match p.kind {
                    EventKind::Inserted | EventKind::Restored | EventKind::Spilled => {
                        let label = lock(&self.labels).get(&p.key).cloned();
                        Some(ResidencyWrite::Put(ResidencyRow {
                            holder: self.replica.clone(),
                            holder_kind: HolderKind::Replica,
                            entry_key,
                            segment_id: label.as_ref().map(|l| l.0.clone()),
                            version: label.map(|l| l.1),
                            scope: owner_group(&p.owner).to_string(),
                            tier: match p.tier {
                                Tier::Primary => "primary".into(),
                                Tier::Spill => "spill".into(),
                            },
                            bytes: p.bytes as i64,
                            tokens: p.tokens as i64,
                            updated_at: now,
                        }))
                    }
                    _ => Some(ResidencyWrite::Drop {
                        holder: self.replica.clone(),
                        holder_kind: HolderKind::Replica,
                        entry_key,
                    }),
                }
            }
        }
    }

    /// Drains the queue into the catalog in batches until the directory is gone.
    async fn drain(weak: Weak<Directory>, mut rx: tokio::sync::mpsc::Receiver<Change>) {
        let mut buf = Vec::with_capacity(BATCH);
        while rx.recv_many(&mut buf, BATCH).await > 0 {
            let Some(d) = weak.upgrade() else { return };
            let mut writes = Vec::with_capacity(buf.len());
            for c in buf.drain(..) {
                if matches!(c, Change::Cleared) {
                    // Everything before the clear is moot: write it, then clear.
                    d.flush(std::mem::take(&mut writes)).await;
                    if let Err(e) = d.catalog.clear_holder(&d.replica).await {
                        d.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!("residency directory: clearing rows failed: {e}");
                    }
                    continue;
                }
                if let Some(w) = d.write_of(c) {
                    writes.push(w);
                }
            }
            d.flush(writes).await;
        }
    }

    async fn flush(&self, writes: Vec<ResidencyWrite>) {
        if writes.is_empty() {
            return;
        }
        match self.catalog.write_residency(&writes).await {
            Ok(n) => {
                self.counters.rows_written.fetch_add(n, Ordering::Relaxed);
                self.counters.batches.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "residency directory: writing {} changes failed: {e}",
                    writes.len()
                );
            }
        }
    }

    /// Reloads the holder view from the catalog (start-up, lost listener).
    pub async fn resync_holders(&self) {
        match self.catalog.worker_holders(HOLDERS_CAP).await {
            Ok(rows) => {
                let mut h = lock(&self.holders);
                h.clear();
                // Newest first: a segment held by several workers keeps the
                // latest holder.
                for (k, w) in rows {
                    if let Ok(d) = u128::from_str_radix(&k, 16) {
                        h.entry(d).or_insert(w);
                    }
                }
            }
            Err(e) => tracing::warn!("residency directory: loading worker holdings failed: {e}"),
        }
    }

    /// Applies another replica's holding change to the holder view.
    fn apply(&self, e: &CatalogEvent) {
        if let CatalogEvent::Holder {
            segment,
            worker,
            held,
        } = e
        {
            if let Ok(d) = u128::from_str_radix(segment, 16) {
                self.note_holder(d, held.then_some(worker.as_str()));
            }
        }
    }

    /// Runs the Postgres listener (returns at once on SQLite).
    async fn listen(weak: Weak<Directory>) {
        let Some(catalog) = weak.upgrade().map(|d| d.catalog.clone()) else {
            return;
        };
        let (w1, w2, w3) = (weak.clone(), weak.clone(), weak);
        let resync_rt = tokio::runtime::Handle::current();
        catalog
            .listen(
                move || {
                    if let Some(d) = w1.upgrade() {
                        d.counters.listener_connects.fetch_add(1, Ordering::Relaxed);
                    }
                },
                move |e| {
                    if let Some(d) = w2.upgrade() {
                        d.counters
                            .notifications_received
                            .fetch_add(1, Ordering::Relaxed);
                        d.apply(e);
                    }
                },
                move || {
                    if let Some(d) = w3.upgrade() {
                        d.counters.resyncs.fetch_add(1, Ordering::Relaxed);
                        d.resync.notify_one();
                        resync_rt.spawn(async move { d.resync_holders().await });
                    }
                },
            )
            .await;
    }
}

/// The public pool's observer: queues each change.
pub struct PoolHook(pub Arc<Directory>);

impl PoolObserver for PoolHook {
    fn changed(&self, change: &ResidencyChange) {
        self.0.enqueue(Change::Pool(change.clone()));
    }
    fn cleared(&self) {
        self.0.enqueue(Change::Cleared);
    }
}

impl HolderDirectory for Directory {
    fn holder(&self, segment: u128) -> Option<String> {
        lock(&self.holders).get(&segment).cloned()
    }
    fn built(&self, segment: u128, isolation: &str, worker: &str, tokens: usize, bytes: usize) {
        self.note_holder(segment, Some(worker));
        self.enqueue(Change::Worker {
            segment,
            scope: owner_group(isolation).to_string(),
            worker: worker.to_string(),
            tokens,
            bytes,
        });
    }
}

/// A replica id from the host name and `bind`'s port (`HOST:PORT`).
pub fn default_replica_id(bind: std::net::SocketAddr) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "localhost".into());
    format!("{host}:{}", bind.port())
}

/// Acts on the catalog's segment events (this replica's and, through the
/// listener, other replicas'): evicts the entries of superseded versions (all
/// versions of a deleted segment) at once. After lost events (the channel
/// lagged, or the listener reconnected) it checks every segment it knows
/// against the catalog. Ends when the server is gone.
pub(crate) fn spawn_invalidator(
    state: Weak<super::Inner>,
    dir: &Arc<Directory>,
    rt: &tokio::runtime::Handle,
) {
    let mut rx = dir.catalog.subscribe();
    let resync = Arc::downgrade(dir);
    let t = rt.spawn(async move {
        loop {
            let wake = resync.upgrade().map(|d| d.resync.clone());
            let Some(wake) = wake else { return };
            let ev = tokio::select! {
                ev = rx.recv() => Some(ev),
                _ = wake.notified() => None,
            };
            let Some(inner) = state.upgrade() else { return };
            let s = super::AppState(inner);
            let Some(d) = s.0.residency.clone() else {
                return;
            };
            match ev {
                Some(Ok(CatalogEvent::Segment {
                    address,
                    version,
                    deleted,
                })) => {
                    d.counters.segment_events.fetch_add(1, Ordering::Relaxed);
                    let _gate = d.evict_gate.lock().await;
                    let n = super::segments::evict(&s, &address, (!deleted).then_some(version));
                    d.counters
                        .event_evictions
                        .fetch_add(n as u64, Ordering::Relaxed);
                }
                Some(Ok(CatalogEvent::Holder { .. })) => {}
                // Events were lost (lagged here, or the listener reconnected).
                Some(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) | None => {
                    resync_segments(&s, &d).await
                }
                Some(Err(tokio::sync::broadcast::error::RecvError::Closed)) => return,
            }
        }
    });
    lock(&dir.tasks).push(t.abort_handle());
}

/// Checks every segment this replica holds tokens of against the catalog and
/// evicts the entries of versions that are no longer current.
pub(crate) async fn resync_segments(s: &super::AppState, d: &Directory) {
    let addresses: std::collections::BTreeSet<String> = {
        let k = s.0.known.lock().unwrap_or_else(|p| p.into_inner());
        k.tokens.keys().map(|(a, _)| a.clone()).collect()
    };
    for a in addresses {
        let keep = match d.catalog.get_segment(&a).await {
            Ok(seg) => Some(seg.current_version),
            Err(crate::catalog::CatalogError::NotFound(_)) => None,
            Err(e) => {
                tracing::warn!("residency directory: resync of {a} failed: {e}");
                continue;
            }
        };
        let n = {
            let _gate = d.evict_gate.lock().await;
            super::segments::evict(s, &a, keep)
        };
        d.counters
            .event_evictions
            .fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Names version `version` of the catalog segment `address` as the segment of
/// the public-pool entries of `tokens` under `isolation` (every body start this
/// server builds), so that the directory's rows of those entries carry it.
pub(crate) fn label(
    s: &super::AppState,
    address: &str,
    version: i64,
    tokens: &[u32],
    isolation: &str,
) {
    let Some(d) = &s.0.residency else { return };
    let keys: Vec<Key> = super::segments::body_starts(s)
        .into_iter()
        .filter_map(|b| s.0.engine.public_entry_key(tokens, isolation, b))
        .collect();
    d.label(address, version, keys);
}

impl Directory {
    /// The directory's counters in the text exposition format
    /// (`hypic_residency_*`, `hypic_catalog_notifications_*`).
    pub fn metrics_text(&self) -> String {
        use std::fmt::Write;
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let mut out = String::new();
        for (name, help, v) in [
            (
                "hypic_residency_rows_written_total",
                "Residency rows written or deleted in the catalog.",
                get(&c.rows_written),
            ),
            (
                "hypic_residency_batches_total",
                "Catalog transactions of residency changes.",
                get(&c.batches),
            ),
            (
                "hypic_residency_write_errors_total",
                "Batches of residency changes the catalog failed (their changes are lost).",
                get(&c.write_errors),
            ),
            (
                "hypic_residency_queue_drops_total",
                "Residency changes dropped because the queue was full.",
                get(&c.queue_drops),
            ),
            (
                "hypic_residency_segment_events_total",
                "Segment events (new version, deletion) acted on.",
                get(&c.segment_events),
            ),
            (
                "hypic_residency_event_evictions_total",
                "Entries evicted on a segment event or a resynchronisation.",
                get(&c.event_evictions),
            ),
            (
                "hypic_catalog_notifications_sent_total",
                "Catalog notifications (NOTIFY) this process sent that committed.",
                self.notifications_sent() as f64,
            ),
            (
                "hypic_catalog_notifications_received_total",
                "Catalog notifications received from other replicas.",
                get(&c.notifications_received),
            ),
            (
                "hypic_catalog_listener_connects_total",
                "Connections of the catalog's notification listener (reconnections included).",
                get(&c.listener_connects),
            ),
            (
                "hypic_catalog_listener_resyncs_total",
                "Resynchronisations after a lost listener connection.",
                get(&c.resyncs),
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        }
        out
    }
}
