//! The invalidation sweep: puts every public-pool entry this server knows to the
//! control plane's active invalidation policy at a fixed period and drops from the
//! pool those the policy rejects, so a TTL policy also removes entries that are
//! resident but no longer requested.
//!
//! The data-plane pool counts time in a logical clock, while invalidation policies
//! reason in wall-clock milliseconds, so the server keeps its own [`Ledger`] of
//! public-pool entries with their wall-clock insertion and last-use times: a
//! request's per-segment outcome records the entry it built (`miss`: inserted now)
//! or used (`hit`), and entries prefilled through `/v1/segments` are picked up from
//! the server's table of known catalog segments (inserted at the residency report's
//! time). An entry the sweep finds no longer resident (evicted for space, or
//! dropped on update/delete) leaves the ledger.
//!
//! Entries are tracked per (segment tokens, isolation key); the sweep drops all body
//! starts of a segment together. The private pool (running-state snapshots of
//! prompt prefixes, owned by the tenant) can only be dropped per tenant, so it is
//! tracked per tenant: the policy judges the tenant's oldest snapshot, and when it
//! rejects it every snapshot of that tenant goes. When an entry was evicted and rebuilt between two
//! sweeps by a request that hit instead of missing, its recorded insertion time can
//! be earlier than the real one; the error is towards dropping early (a later miss),
//! never towards keeping an entry past its policy.
use super::{AppState, Inner};
use crate::catalog::{now_ms, CatalogError, SnapshotEntry};
use crate::policy::{opaque_id, EntryInfo, PolicyKind};
use dataplane::pic::{Mode, Outcome, PicStats};
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::routes::Resolved;
use super::segments::WORKER;

/// A catalog segment version behind a ledger entry.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CatalogRef {
    id: String,
    version: i64,
}

/// One public-pool segment entry (all its body starts) as the sweep sees it.
#[derive(Clone, Debug)]
struct LedgerEntry {
    tokens: Arc<Vec<u32>>,
    isolation: String,
    segment: Option<CatalogRef>,
    /// Tenant of the namespace, `None` for the shared namespace.
    tenant: Option<String>,
    body_starts: BTreeSet<usize>,
    inserted_ms: u64,
    last_use_ms: u64,
    hits: u32,
}

type LedgerKey = (String, [u8; 32]);

fn ledger_key(tokens: &[u32], isolation: &str) -> LedgerKey {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    (isolation.to_string(), h.finalize().into())
}

/// Wall-clock times of one tenant's private-pool snapshots.
#[derive(Clone, Copy, Debug)]
struct PrivateTimes {
    oldest_ms: u64,
    last_use_ms: u64,
}

/// Wall-clock times of the public-pool entries and private-pool snapshots this
/// server built or used.
#[derive(Default, Debug)]
pub struct Ledger {
    map: Mutex<HashMap<LedgerKey, LedgerEntry>>,
    private: Mutex<HashMap<String, PrivateTimes>>,
}

/// What one sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Resident entries put to the invalidation policy.
    pub checked: usize,
    /// Entries the policy rejected, dropped from the pool.
    pub dropped: usize,
    /// Tenants whose private snapshots the policy rejected (all dropped).
    pub private_tenants_dropped: usize,
    /// Pool entries (one per body start) removed for them.
    pub pool_entries_removed: usize,
    /// Ledger entries forgotten because they were no longer resident.
    pub forgotten: usize,
}

impl Ledger {
    /// Entries tracked now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tenants whose private snapshots are tracked now.
    pub fn private_tenants(&self) -> usize {
        self.private_lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<LedgerKey, LedgerEntry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn private_lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PrivateTimes>> {
        self.private.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the public-pool outcome of each segment of one served prompt:
    /// a miss built (and offered to the pool) an entry now, a hit used one.
    pub(crate) fn record(&self, tenant: &str, mode: Mode, segs: &[Resolved], stats: &PicStats) {
        let now = now_ms().max(0) as u64;
        if matches!(mode, Mode::Hypic { .. } | Mode::PrefixCache) && !stats.segments.is_empty() {
            // The engine snapshots the running state after every segment it processed
            // (all but the restored prefix), owned by the tenant.
            let inserted = stats
                .segments
                .iter()
                .any(|s| s.outcome != Outcome::PrefixHit);
            let mut p = self.private_lock();
            let t = p.entry(tenant.to_string()).or_insert(PrivateTimes {
                oldest_ms: now,
                last_use_ms: now,
            });
            if inserted {
                t.oldest_ms = t.oldest_ms.min(now);
            }
            t.last_use_ms = now;
        }
        let mut m = self.lock();
        for st in &stats.segments {
            let Some(r) = segs.get(st.index) else {
                continue;
            };
            let body_start = match mode {
                Mode::Hypic { seam_width, .. } if st.index > 0 => seam_width,
                _ => 0,
            };
            let key = ledger_key(&r.tokens, &r.isolation);
            let fresh = || LedgerEntry {
                tokens: r.tokens.clone(),
                isolation: r.isolation.clone(),
                segment: r
                    .address
                    .clone()
                    .zip(r.version)
                    .map(|(id, version)| CatalogRef { id, version }),
                tenant: (!r.shared).then(|| tenant.to_string()),
                body_starts: BTreeSet::new(),
                inserted_ms: now,
                last_use_ms: now,
                hits: 0,
            };
            match st.outcome {
                Outcome::Miss => {
                    let e = m.entry(key).or_insert_with(fresh);
                    e.body_starts.insert(body_start);
                    e.inserted_ms = now;
                    e.last_use_ms = now;
                    e.hits = 0;
                }
                Outcome::Hit => {
                    let e = m.entry(key).or_insert_with(fresh);
                    e.body_starts.insert(body_start);
                    e.last_use_ms = now;
                    e.hits = e.hits.saturating_add(1);
                }
                Outcome::Computed | Outcome::PrefixHit => {}
            }
        }
    }
}

/// Adds the catalog segments prefilled through `/v1/segments` (known tokens ×
/// isolation keys used) that the ledger does not track yet; their insertion
/// time is that of the residency report, when there is one.
async fn import_known(s: &AppState) {
    // (segment id, version, content hash, tokens, isolation keys used)
    type KnownVersion = (String, i64, String, Arc<Vec<u32>>, Vec<String>);
    let known: Vec<KnownVersion> = {
        let k = s.0.known.lock().unwrap_or_else(|p| p.into_inner());
        k.tokens
            .iter()
            .filter_map(|((id, v), c)| {
                let isos: Vec<String> = k.isolations.get(id)?.iter().cloned().collect();
                Some((
                    id.clone(),
                    *v,
                    c.content_hash.clone(),
                    c.tokens.clone(),
                    isos,
                ))
            })
            .collect()
    };
    let starts = default_body_starts(s);
    for (id, version, hash, tokens, isos) in known {
        for iso in isos {
            let key = ledger_key(&tokens, &iso);
            if s.0.ledger.lock().contains_key(&key) {
                continue;
            }
            if !starts
                .iter()
                .any(|&b| s.0.engine.resident_bytes(&tokens, &iso, b).is_some())
            {
                continue;
            }
            let cache_key = cache_key(s, &iso, &id, version, &hash);
            let row =
                s.0.control
                    .catalog()
                    .residency_of(&cache_key)
                    .await
                    .ok()
                    .and_then(|rows| rows.into_iter().find(|r| r.worker == WORKER));
            let now = now_ms().max(0) as u64;
            let (inserted, tenant) = match &row {
                Some(r) => (r.last_use.max(0) as u64, r.tenant.clone()),
                // Not reported (yet): first seen now.
                None => (now, None),
            };
            s.0.ledger.lock().entry(key).or_insert(LedgerEntry {
                tokens: tokens.clone(),
                isolation: iso.clone(),
                segment: Some(CatalogRef {
                    id: id.clone(),
                    version,
                }),
                tenant,
                body_starts: starts.iter().copied().collect(),
                inserted_ms: inserted,
                last_use_ms: inserted,
                hits: 0,
            });
        }
    }
}

/// Body starts the server builds entries for ahead of time: 0, and the seam
/// width of the default mode and of the configuration (as `/v1/segments` does).
fn default_body_starts(s: &AppState) -> Vec<usize> {
    let mut v = vec![0];
    if let Mode::Hypic { seam_width, .. } = s.0.default_mode {
        v.push(seam_width);
    }
    v.push(s.0.cfg.seam_width);
    v.sort_unstable();
    v.dedup();
    v
}

fn cache_key(s: &AppState, iso: &str, id: &str, version: i64, hash: &str) -> String {
    s.0.control.keyer().cache_key(
        iso,
        &SnapshotEntry {
            segment_id: id.to_string(),
            version,
            content_hash: hash.to_string(),
            owner_tenant: String::new(),
            public: false,
        },
    )
}

/// One sweep: every tracked entry still resident is put to the invalidation
/// policy (superseded when its catalog version is no longer current or the
/// segment was deleted); rejected entries are evicted from the public pool and
/// their residency rows dropped. Counted in the `hypic_invalidation_sweep_entries_total`
/// metric; a sweep that drops entries writes one `cache.invalidate` audit row.
pub async fn sweep_once(s: &AppState) -> SweepReport {
    import_known(s).await;
    let entries: Vec<(LedgerKey, LedgerEntry)> =
        s.0.ledger
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
    // Current versions of the catalog segments involved (None: deleted).
    let mut current: HashMap<String, Option<i64>> = HashMap::new();
    for (_, e) in &entries {
        if let Some(c) = &e.segment {
            if current.contains_key(&c.id) {
                continue;
            }
            match s.0.control.catalog().get_segment(&c.id).await {
                Ok(seg) => {
                    current.insert(c.id.clone(), Some(seg.current_version));
                }
                Err(CatalogError::NotFound(_)) => {
                    current.insert(c.id.clone(), None);
                }
                // Database trouble: judge this segment next time.
                Err(e) => tracing::warn!("invalidation sweep: catalog error: {e}"),
            }
        }
    }
    let default_starts = default_body_starts(s);
    let inner = s.0.clone();
    let work = tokio::task::spawn_blocking(move || {
        let mut report = SweepReport::default();
        let mut forget = vec![];
        let mut dropped = vec![];
        for (key, e) in entries {
            let starts: Vec<usize> = e
                .body_starts
                .iter()
                .chain(default_starts.iter())
                .copied()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let resident: Vec<usize> = starts
                .iter()
                .filter_map(|&b| inner.engine.resident_bytes(&e.tokens, &e.isolation, b))
                .collect();
            let bytes: usize = resident.iter().sum();
            if resident.is_empty() {
                forget.push(key);
                continue;
            }
            let superseded = match &e.segment {
                None => false,
                Some(c) => match current.get(&c.id) {
                    None => continue,
                    Some(None) => true,
                    Some(Some(v)) => c.version < *v,
                },
            };
            let info = EntryInfo {
                id: opaque_id(&format!("{}:{}", e.isolation, hex::encode(key.1))),
                tenant: e.tenant.as_deref().map(opaque_id).unwrap_or(0),
                bytes: bytes as u64,
                recompute_tokens: e.tokens.len() as u64,
                last_use_ms: e.last_use_ms,
                inserted_ms: e.inserted_ms,
                hits: e.hits,
                shared: e.tenant.is_none(),
                superseded,
            };
            report.checked += 1;
            if inner
                .control
                .policies()
                .invalidate(&info, now_ms().max(0) as u64)
            {
                report.pool_entries_removed +=
                    inner.engine.evict_segment(&e.tokens, &e.isolation, &starts);
                report.dropped += 1;
                dropped.push((key, e));
            }
        }
        report.forgotten = forget.len();
        // Private snapshots, per tenant.
        let mut private_dropped = vec![];
        if inner.engine.private_usage().0 == 0 {
            inner.ledger.private_lock().clear();
        } else {
            let tenants: Vec<(String, PrivateTimes)> = inner
                .ledger
                .private_lock()
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            for (tenant, t) in tenants {
                let info = EntryInfo {
                    id: opaque_id(&format!("private:{tenant}")),
                    tenant: opaque_id(&tenant),
                    bytes: 0,
                    recompute_tokens: 0,
                    last_use_ms: t.last_use_ms,
                    inserted_ms: t.oldest_ms,
                    hits: 0,
                    shared: false,
                    superseded: false,
                };
                report.checked += 1;
                if inner
                    .control
                    .policies()
                    .invalidate(&info, now_ms().max(0) as u64)
                {
                    // Private snapshots are owned by the tenant name; public entries by
                    // isolation keys, so only this tenant's snapshots go.
                    report.pool_entries_removed += inner.engine.invalidate_owner(&tenant);
                    report.private_tenants_dropped += 1;
                    private_dropped.push((tenant, t));
                }
            }
        }
        {
            let mut p = inner.ledger.private_lock();
            for (tenant, t) in &private_dropped {
                // Unless a request snapshotted again meanwhile (then keep its times).
                if p.get(tenant)
                    .is_some_and(|now| now.last_use_ms == t.last_use_ms)
                {
                    p.remove(tenant);
                }
            }
        }
        (report, forget, dropped)
    })
    .await;
    let (report, forget, dropped) = match work {
        Ok(x) => x,
        Err(e) => {
            tracing::error!("invalidation sweep failed: {e}");
            return SweepReport::default();
        }
    };
    {
        let mut m = s.0.ledger.lock();
        for k in forget.iter().chain(dropped.iter().map(|(k, _)| k)) {
            m.remove(k);
        }
    }
    let cat = s.0.control.catalog();
    for (_, e) in &dropped {
        let Some(c) = &e.segment else { continue };
        let hash =
            s.0.known
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .tokens
                .get(&(c.id.clone(), c.version))
                .map(|t| t.content_hash.clone());
        if let Some(hash) = hash {
            let key = cache_key(s, &e.isolation, &c.id, c.version, &hash);
            let _ = cat.drop_residency(WORKER, &key).await;
        }
    }
    let m = &s.0.metrics;
    m.sweep
        .with_label_values(&["checked"])
        .inc_by(report.checked as u64);
    m.sweep
        .with_label_values(&["dropped"])
        .inc_by((report.dropped + report.private_tenants_dropped) as u64);
    if report.dropped + report.private_tenants_dropped > 0 {
        let policy = s.0.control.policies().active_id(PolicyKind::Invalidation);
        let segments: BTreeSet<&str> = dropped
            .iter()
            .filter_map(|(_, e)| e.segment.as_ref().map(|c| c.id.as_str()))
            .collect();
        let _ = cat
            .audit(
                "system",
                None,
                "cache.invalidate",
                &policy
                    .map(|i| i.to_string())
                    .unwrap_or_else(|| "native".into()),
                &serde_json::json!({
                    "source": "sweep",
                    "dropped": report.dropped,
                    "private_tenants": report.private_tenants_dropped,
                    "pool_entries": report.pool_entries_removed,
                    "catalog_segments": segments,
                }),
            )
            .await;
    }
    report
}

/// Runs [`sweep_once`] every `every` until the server state is dropped.
pub(crate) fn spawn_sweeper(state: Weak<Inner>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut t = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            t.tick().await;
            let Some(inner) = state.upgrade() else { break };
            sweep_once(&AppState(inner)).await;
        }
    })
}
