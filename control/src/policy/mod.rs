//! Cache policies: the hook interface, native defaults, the Wasm sandbox and
//! the live policy runtime with fault counting and auditing.
//!
//! Four hooks, one active policy each: eviction, admission, invalidation and
//! isolation. A Wasm policy (ABI in `policies/ABI.md`) runs under a fuel
//! budget and a memory limit; any fault (trap, timeout, memory, bad return,
//! load failure) falls back to the native default for that call, is counted
//! in [`PolicyMetrics`] and audited as `policy.fault`.

pub mod compile;
pub mod params;
pub mod pool_adapter;
pub mod shadow;
pub mod wasm;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

pub use compile::ModuleCache;
pub use shadow::{DecisionCounts, ShadowView};
pub use wasm::{policy_engine, PolicyError, WasmPolicy};

use crate::catalog::{now_ms, Catalog};

/// The four policy hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicyKind {
    /// Chooses victims when the cache is full.
    Eviction,
    /// Decides whether a computed entry is kept.
    Admission,
    /// Decides whether an existing entry must be dropped.
    Invalidation,
    /// Decides whether public segments use the shared namespace.
    Isolation,
}

impl PolicyKind {
    /// All kinds.
    pub const ALL: [PolicyKind; 4] = [
        PolicyKind::Eviction,
        PolicyKind::Admission,
        PolicyKind::Invalidation,
        PolicyKind::Isolation,
    ];

    /// ABI code (`hypic_policy_kind`).
    pub fn code(self) -> i32 {
        match self {
            PolicyKind::Eviction => 1,
            PolicyKind::Admission => 2,
            PolicyKind::Invalidation => 3,
            PolicyKind::Isolation => 4,
        }
    }

    /// Name as stored in the catalog.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Eviction => "eviction",
            PolicyKind::Admission => "admission",
            PolicyKind::Invalidation => "invalidation",
            PolicyKind::Isolation => "isolation",
        }
    }

    fn index(self) -> usize {
        self.code() as usize - 1
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<PolicyKind, String> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| format!("unknown policy kind {s:?} (expected eviction, admission, invalidation or isolation)"))
    }
}

/// Sandbox limits for policy calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyLimits {
    /// Fuel (roughly, Wasm instructions) per call.
    pub fuel_per_call: u64,
    /// Maximum linear memory in bytes.
    pub max_memory_bytes: usize,
    /// Maximum module size, bytes (larger uploads are refused with 413 before
    /// anything is compiled). Default 1 MiB.
    pub max_module_bytes: usize,
    /// Modules compiled at once on the blocking pool (more uploads meanwhile
    /// get 429). Default 1.
    pub max_concurrent_compiles: usize,
}

/// Default of [`PolicyLimits::max_module_bytes`]: 1 MiB.
pub const DEFAULT_MAX_MODULE_BYTES: usize = 1 << 20;

/// Default of [`PolicyLimits::max_concurrent_compiles`].
pub const DEFAULT_MAX_CONCURRENT_COMPILES: usize = 1;

impl Default for PolicyLimits {
    fn default() -> Self {
        PolicyLimits {
            fuel_per_call: 1_000_000,
            max_memory_bytes: 16 << 20,
            max_module_bytes: DEFAULT_MAX_MODULE_BYTES,
            max_concurrent_compiles: DEFAULT_MAX_CONCURRENT_COMPILES,
        }
    }
}

/// A cache entry as seen by eviction and invalidation hooks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EntryInfo {
    /// Opaque entry id.
    pub id: u64,
    /// Opaque tenant id (0 for shared entries).
    pub tenant: u64,
    /// Bytes held.
    pub bytes: u64,
    /// Tokens to recompute on a miss.
    pub recompute_tokens: u64,
    /// Last use (ms).
    pub last_use_ms: u64,
    /// Insertion time (ms).
    pub inserted_ms: u64,
    /// Hits since insertion.
    pub hits: u32,
    /// Shared-namespace entry.
    pub shared: bool,
    /// Its segment version has been superseded.
    pub superseded: bool,
}

impl EntryInfo {
    fn flags(&self) -> u32 {
        (self.shared as u32) | ((self.superseded as u32) << 1)
    }
}

/// An admission question.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdmitInfo {
    /// Opaque entry id.
    pub id: u64,
    /// Opaque tenant id.
    pub tenant: u64,
    /// Bytes the entry would hold.
    pub bytes: u64,
    /// Tokens it saves on a hit.
    pub recompute_tokens: u64,
    /// Bytes the tenant already holds.
    pub tenant_used_bytes: u64,
    /// Cache capacity in bytes.
    pub capacity_bytes: u64,
    /// Requests for this entry so far, including this one.
    pub seen_count: u32,
    /// Shared-namespace entry.
    pub shared: bool,
}

/// An isolation question.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IsolationInfo {
    /// Opaque segment id.
    pub segment: u64,
    /// Opaque tenant id.
    pub tenant: u64,
    /// Segment is explicitly public.
    pub public: bool,
    /// Tenant owns the segment.
    pub owner: bool,
}

/// Stable 64-bit opaque id of a string (first 8 bytes of SHA-256).
pub fn opaque_id(s: &str) -> u64 {
    use sha2::Digest;
    let d = sha2::Sha256::digest(s.as_bytes());
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}

/// Native defaults, used when no Wasm policy is active and on every fault.
pub mod native {
    use super::*;

    /// LRU: oldest last use, then oldest insertion, then lowest index.
    pub fn evict(c: &[EntryInfo]) -> usize {
        let mut best = 0;
        for (i, e) in c.iter().enumerate() {
            let b = &c[best];
            if (e.last_use_ms, e.inserted_ms) < (b.last_use_ms, b.inserted_ms) {
                best = i;
            }
        }
        best
    }
    /// Admit everything.
    pub fn admit(_a: &AdmitInfo) -> bool {
        true
    }
    /// Drop exactly the superseded entries.
    pub fn invalidate(e: &EntryInfo) -> bool {
        e.superseded
    }
    /// Share exactly the public segments.
    pub fn isolation(s: &IsolationInfo) -> bool {
        s.public
    }
}

/// One hook's active policy: native, or a Wasm module.
pub struct PolicySlot {
    kind: PolicyKind,
    wasm: Option<WasmPolicy>,
    policy_id: Option<i64>,
    /// Outcomes of the last [`TRIP_WINDOW_CALLS`] Wasm calls, newest in bit 0
    /// (1 = fault).
    recent_faults: u64,
    tripped: bool,
}

/// A Wasm policy is disabled (native default until it is activated again) once
/// this many of its last [`TRIP_WINDOW_CALLS`] calls faulted: a policy that
/// always faults trips after 16 calls, one that faults on every other call
/// after 31, and a rare fault never trips it.
pub const TRIP_FAULTS_IN_WINDOW: u32 = 16;

/// Length of the window of recent calls the breaker counts faults over.
pub const TRIP_WINDOW_CALLS: u32 = 32;

/// Kept for callers of the old name: the faults that trip the breaker when
/// they are consecutive (see [`TRIP_FAULTS_IN_WINDOW`]).
pub const TRIP_AFTER_CONSECUTIVE_FAULTS: u32 = TRIP_FAULTS_IN_WINDOW;

impl PolicySlot {
    /// The native default of `kind`.
    pub fn native(kind: PolicyKind) -> PolicySlot {
        PolicySlot {
            kind,
            wasm: None,
            policy_id: None,
            recent_faults: 0,
            tripped: false,
        }
    }

    /// A Wasm policy (already loaded).
    pub fn wasm(policy: WasmPolicy, policy_id: Option<i64>) -> PolicySlot {
        PolicySlot {
            kind: policy.kind(),
            wasm: Some(policy),
            policy_id,
            recent_faults: 0,
            tripped: false,
        }
    }

    /// The hook.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// Catalog id of the Wasm policy, `None` for native.
    pub fn policy_id(&self) -> Option<i64> {
        self.policy_id
    }

    /// True when a Wasm policy is loaded and not tripped.
    pub fn is_wasm(&self) -> bool {
        self.wasm.is_some() && !self.tripped
    }

    /// Records one Wasm call's outcome; true when this call trips the breaker.
    fn record(&mut self, r: &Result<(), PolicyError>) -> bool {
        let mask = (1u64 << TRIP_WINDOW_CALLS) - 1;
        self.recent_faults = ((self.recent_faults << 1) | r.is_err() as u64) & mask;
        if r.is_err() && self.recent_faults.count_ones() >= TRIP_FAULTS_IN_WINDOW && !self.tripped {
            self.tripped = true;
            return true;
        }
        false
    }

    fn active(&mut self) -> Option<&mut WasmPolicy> {
        if self.tripped {
            None
        } else {
            self.wasm.as_mut()
        }
    }

    /// Whether a Wasm module answers this hook now (else the native default does).
    pub fn uses_wasm(&self) -> bool {
        self.wasm.is_some() && !self.tripped
    }

    /// Chooses a victim among `c` (non-empty). Returns the index and the
    /// fault, if the Wasm policy failed and the native default was used.
    pub fn evict(&mut self, c: &[EntryInfo], now: u64) -> (usize, Option<PolicyError>) {
        if c.is_empty() {
            return (0, None);
        }
        let Some(w) = self.active() else {
            return (native::evict(c), None);
        };
        let n = c.len().min(w.buf_cap().max(4096) / 56);
        let mut input = Vec::with_capacity(n * 56);
        for e in &c[..n] {
            put_u64(&mut input, e.id);
            put_u64(&mut input, e.tenant);
            put_u64(&mut input, e.bytes);
            put_u64(&mut input, e.recompute_tokens);
            put_u64(&mut input, e.last_use_ms);
            put_u64(&mut input, e.inserted_ms);
            put_u32(&mut input, e.hits);
            put_u32(&mut input, e.flags());
        }
        let r = w.call_evict(&input, n, now as i64);
        self.finish(r, || native::evict(c))
    }

    /// Admission decision.
    pub fn admit(&mut self, a: &AdmitInfo, now: u64) -> (bool, Option<PolicyError>) {
        let Some(w) = self.active() else {
            return (native::admit(a), None);
        };
        let mut input = Vec::with_capacity(56);
        for v in [
            a.id,
            a.tenant,
            a.bytes,
            a.recompute_tokens,
            a.tenant_used_bytes,
            a.capacity_bytes,
        ] {
            put_u64(&mut input, v);
        }
        put_u32(&mut input, a.seen_count);
        put_u32(&mut input, a.shared as u32);
        let r = w.call_bool(&input, now as i64);
        self.finish(r, || native::admit(a))
    }

    /// Invalidation decision (true = drop).
    pub fn invalidate(&mut self, e: &EntryInfo, now: u64) -> (bool, Option<PolicyError>) {
        let Some(w) = self.active() else {
            return (native::invalidate(e), None);
        };
        let mut input = Vec::with_capacity(48);
        for v in [e.id, e.tenant, e.bytes, e.inserted_ms, e.last_use_ms] {
            put_u64(&mut input, v);
        }
        put_u32(&mut input, e.flags());
        put_u32(&mut input, 0);
        let r = w.call_bool(&input, now as i64);
        self.finish(r, || native::invalidate(e))
    }

    /// Isolation decision (true = the shared namespace is allowed). The
    /// caller must still require the segment to be public.
    pub fn isolation(&mut self, s: &IsolationInfo) -> (bool, Option<PolicyError>) {
        let Some(w) = self.active() else {
            return (native::isolation(s), None);
        };
        let mut input = Vec::with_capacity(24);
        put_u64(&mut input, s.segment);
        put_u64(&mut input, s.tenant);
        put_u32(&mut input, (s.public as u32) | ((s.owner as u32) << 1));
        put_u32(&mut input, 0);
        let r = w.call_bool(&input, now_ms());
        let (v, f) = self.finish(r, || native::isolation(s));
        (v && s.public, f)
    }

    fn finish<T>(
        &mut self,
        r: Result<T, PolicyError>,
        fallback: impl FnOnce() -> T,
    ) -> (T, Option<PolicyError>) {
        let status = r.as_ref().map(|_| ()).map_err(|e| e.clone());
        let tripped = self.record(&status);
        match r {
            Ok(v) => (v, None),
            Err(e) => {
                let e = if tripped {
                    PolicyError::Trap(format!(
                        "{e}; disabled after {TRIP_FAULTS_IN_WINDOW} faults in its last {TRIP_WINDOW_CALLS} calls"
                    ))
                } else {
                    e
                };
                (fallback(), Some(e))
            }
        }
    }
}

/// A full set of hooks (used by the simulator and as the live set).
pub struct PolicySet {
    /// Eviction hook.
    pub eviction: PolicySlot,
    /// Admission hook.
    pub admission: PolicySlot,
    /// Invalidation hook.
    pub invalidation: PolicySlot,
    /// Isolation hook.
    pub isolation: PolicySlot,
}

impl PolicySet {
    /// All native defaults.
    pub fn native() -> PolicySet {
        PolicySet {
            eviction: PolicySlot::native(PolicyKind::Eviction),
            admission: PolicySlot::native(PolicyKind::Admission),
            invalidation: PolicySlot::native(PolicyKind::Invalidation),
            isolation: PolicySlot::native(PolicyKind::Isolation),
        }
    }

    /// Replaces the slot of its kind.
    pub fn set(&mut self, slot: PolicySlot) {
        match slot.kind() {
            PolicyKind::Eviction => self.eviction = slot,
            PolicyKind::Admission => self.admission = slot,
            PolicyKind::Invalidation => self.invalidation = slot,
            PolicyKind::Isolation => self.isolation = slot,
        }
    }

    /// Loads the active policies of the catalog (native where none is active
    /// or the stored module no longer loads), compiling through `rt`'s module
    /// cache (so the modules the server runs are not compiled again).
    pub async fn from_catalog(catalog: &Catalog, rt: &PolicyRuntime) -> PolicySet {
        let mut set = PolicySet::native();
        for kind in PolicyKind::ALL {
            if let Ok(Some(rec)) = catalog.active_policy(kind.as_str()).await {
                let params: serde_json::Value =
                    serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
                if let Ok(p) = rt.load(kind, rec.module.into(), &params, true).await {
                    set.set(PolicySlot::wasm(p, Some(rec.id)));
                }
            }
        }
        set
    }
}

/// Counters of one installed policy: the native default of a kind, or one
/// catalog policy id. Re-activating the same policy keeps counting on the
/// same counters, so they only grow (Prometheus counters).
#[derive(Debug, Default)]
pub struct PolicyCounters {
    calls: AtomicU64,
    faults: AtomicU64,
    fallbacks: AtomicU64,
    nanos: AtomicU64,
    by_reason: Mutex<BTreeMap<String, u64>>,
}

/// A snapshot of one policy's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyCountersSnapshot {
    /// Hook kind.
    pub kind: String,
    /// Catalog id of the policy, `None` for the native default (or a Wasm
    /// policy installed without a catalog row).
    pub policy_id: Option<i64>,
    /// Hook calls answered while this policy was installed.
    pub calls: u64,
    /// Faults (load failures, traps, timeouts, memory, bad returns).
    pub faults: u64,
    /// Calls answered by the native default because of a fault.
    pub fallbacks: u64,
    /// Wall-clock nanoseconds spent in those calls (host side included).
    pub nanos: u64,
    /// Faults by reason (load, timeout, memory, trap, bad_return).
    pub faults_by_reason: BTreeMap<String, u64>,
}

impl PolicyCountersSnapshot {
    /// Mean nanoseconds per call (0 before the first call).
    pub fn ns_per_call(&self) -> f64 {
        if self.calls == 0 {
            0.0
        } else {
            self.nanos as f64 / self.calls as f64
        }
    }
}

/// Fault, call and time counters (process-wide for the live runtime): per
/// kind, and per installed policy.
#[derive(Debug, Default)]
pub struct PolicyMetrics {
    calls: [AtomicU64; 4],
    faults: [AtomicU64; 4],
    fallbacks: [AtomicU64; 4],
    nanos: [AtomicU64; 4],
    by_reason: Mutex<HashMap<String, u64>>,
    per_policy: Mutex<PerPolicy>,
}

/// Counters by (kind index, catalog policy id; `None` = native).
type PerPolicy = BTreeMap<(usize, Option<i64>), Arc<PolicyCounters>>;

/// A snapshot of [`PolicyMetrics`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// Calls per kind.
    pub calls: HashMap<String, u64>,
    /// Faults per kind.
    pub faults: HashMap<String, u64>,
    /// Calls answered by the native default because of a fault, per kind.
    pub fallbacks: HashMap<String, u64>,
    /// Faults per `kind:reason` (reason: load, timeout, memory, trap, bad_return).
    pub faults_by_reason: HashMap<String, u64>,
    /// Mean nanoseconds per call, per kind.
    pub ns_per_call: HashMap<String, f64>,
    /// Counters of every policy installed so far, by kind then policy id.
    pub policies: Vec<PolicyCountersSnapshot>,
}

impl PolicyMetrics {
    /// Calls recorded for `kind`.
    pub fn calls(&self, kind: PolicyKind) -> u64 {
        self.calls[kind.index()].load(Ordering::Relaxed)
    }
    /// Faults recorded for `kind`.
    pub fn faults(&self, kind: PolicyKind) -> u64 {
        self.faults[kind.index()].load(Ordering::Relaxed)
    }
    /// Fallback calls recorded for `kind`.
    pub fn fallbacks(&self, kind: PolicyKind) -> u64 {
        self.fallbacks[kind.index()].load(Ordering::Relaxed)
    }
    /// Faults of `kind` with `reason`.
    pub fn faults_by_reason(&self, kind: PolicyKind, reason: &str) -> u64 {
        let m = self.by_reason.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&format!("{}:{reason}", kind.as_str()))
            .copied()
            .unwrap_or(0)
    }
    /// The counters of policy `policy_id` (`None`: native) of `kind`,
    /// created on first use.
    pub fn counters(&self, kind: PolicyKind, policy_id: Option<i64>) -> Arc<PolicyCounters> {
        self.per_policy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((kind.index(), policy_id))
            .or_default()
            .clone()
    }
    /// Snapshots of every policy's counters, by kind then policy id
    /// (native first).
    pub fn policy_snapshots(&self) -> Vec<PolicyCountersSnapshot> {
        let m = self.per_policy.lock().unwrap_or_else(|p| p.into_inner());
        m.iter()
            .map(|(&(k, id), c)| PolicyCountersSnapshot {
                kind: PolicyKind::ALL[k].as_str().into(),
                policy_id: id,
                calls: c.calls.load(Ordering::Relaxed),
                faults: c.faults.load(Ordering::Relaxed),
                fallbacks: c.fallbacks.load(Ordering::Relaxed),
                nanos: c.nanos.load(Ordering::Relaxed),
                faults_by_reason: c
                    .by_reason
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone(),
            })
            .collect()
    }
    /// All counters.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut s = MetricsSnapshot::default();
        for k in PolicyKind::ALL {
            let calls = self.calls(k);
            let nanos = self.nanos[k.index()].load(Ordering::Relaxed);
            s.calls.insert(k.as_str().into(), calls);
            s.faults.insert(k.as_str().into(), self.faults(k));
            s.fallbacks.insert(k.as_str().into(), self.fallbacks(k));
            s.ns_per_call.insert(
                k.as_str().into(),
                if calls == 0 {
                    0.0
                } else {
                    nanos as f64 / calls as f64
                },
            );
        }
        s.faults_by_reason = self
            .by_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        s.policies = self.policy_snapshots();
        s
    }
    fn call(&self, kind: PolicyKind, c: &PolicyCounters, nanos: u64) {
        self.calls[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.nanos[kind.index()].fetch_add(nanos, Ordering::Relaxed);
        c.calls.fetch_add(1, Ordering::Relaxed);
        c.nanos.fetch_add(nanos, Ordering::Relaxed);
    }
    fn fault(&self, kind: PolicyKind, c: &PolicyCounters, e: &PolicyError, fallback_call: bool) {
        self.faults[kind.index()].fetch_add(1, Ordering::Relaxed);
        c.faults.fetch_add(1, Ordering::Relaxed);
        if fallback_call {
            self.fallbacks[kind.index()].fetch_add(1, Ordering::Relaxed);
            c.fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        *c.by_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(e.label().to_string())
            .or_insert(0) += 1;
        let mut m = self.by_reason.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry(format!("{}:{}", kind.as_str(), e.label()))
            .or_insert(0) += 1;
    }
}

/// A message to the audit writer task.
#[derive(Debug)]
pub enum AuditMsg {
    /// Write a row.
    Row {
        /// Actor.
        actor: String,
        /// Action.
        action: String,
        /// Target.
        target: String,
        /// JSON detail.
        detail: serde_json::Value,
    },
    /// Reply once every earlier row is written.
    Flush(oneshot::Sender<()>),
}

/// Sends audit rows to a background task that writes them to the catalog,
/// so hot-path policy calls never wait on the database.
#[derive(Clone, Debug)]
pub struct AuditSink {
    tx: mpsc::UnboundedSender<AuditMsg>,
}

impl AuditSink {
    /// Spawns the writer task on the current tokio runtime.
    pub fn spawn(catalog: Catalog) -> AuditSink {
        let (tx, mut rx) = mpsc::unbounded_channel::<AuditMsg>();
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                match msg {
                    AuditMsg::Row {
                        actor,
                        action,
                        target,
                        detail,
                    } => {
                        if let Err(e) = catalog.audit(&actor, None, &action, &target, &detail).await
                        {
                            tracing::warn!("audit write failed: {e}");
                        }
                    }
                    AuditMsg::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        });
        AuditSink { tx }
    }

    /// Queues a row.
    pub fn send(&self, action: &str, target: &str, detail: serde_json::Value) {
        let _ = self.tx.send(AuditMsg::Row {
            actor: "system".into(),
            action: action.into(),
            target: target.into(),
            detail,
        });
    }

    /// Waits until every row queued before this call is written.
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(AuditMsg::Flush(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

/// Audit rows for the same (kind, reason) are written at most this often;
/// every fault is still counted.
pub const AUDIT_FAULT_INTERVAL_MS: u64 = 10_000;

/// An installed slot with the counters of its policy.
struct LiveSlot {
    slot: PolicySlot,
    counters: Arc<PolicyCounters>,
}

/// The live policies of a server: one slot per hook behind a mutex, shared
/// counters, and fault auditing.
pub struct PolicyRuntime {
    engine: wasmtime::Engine,
    limits: PolicyLimits,
    modules: ModuleCache,
    slots: [Mutex<LiveSlot>; 4],
    /// At most one shadow per kind; `shadow_on` lets a call skip the lock
    /// when there is none.
    shadows: [Mutex<Option<shadow::Shadow>>; 4],
    shadow_on: [AtomicBool; 4],
    metrics: PolicyMetrics,
    audit: Option<AuditSink>,
    last_audit: Mutex<HashMap<String, u64>>,
}

impl PolicyRuntime {
    /// A runtime with native defaults. `audit` receives `policy.fault` rows.
    pub fn new(
        engine: wasmtime::Engine,
        limits: PolicyLimits,
        audit: Option<AuditSink>,
    ) -> PolicyRuntime {
        let metrics = PolicyMetrics::default();
        PolicyRuntime {
            modules: ModuleCache::new(
                engine.clone(),
                limits.max_module_bytes,
                limits.max_concurrent_compiles,
            ),
            engine,
            limits,
            slots: PolicyKind::ALL.map(|k| {
                Mutex::new(LiveSlot {
                    slot: PolicySlot::native(k),
                    counters: metrics.counters(k, None),
                })
            }),
            shadows: PolicyKind::ALL.map(|_| Mutex::new(None)),
            shadow_on: PolicyKind::ALL.map(|_| AtomicBool::new(false)),
            metrics,
            audit,
            last_audit: Mutex::new(HashMap::new()),
        }
    }

    /// The wasmtime engine.
    pub fn engine(&self) -> &wasmtime::Engine {
        &self.engine
    }

    /// Sandbox limits.
    pub fn limits(&self) -> PolicyLimits {
        self.limits
    }

    /// Counters.
    pub fn metrics(&self) -> &PolicyMetrics {
        &self.metrics
    }

    /// The compiled-module cache (see [`ModuleCache::compiles`]).
    pub fn modules(&self) -> &ModuleCache {
        &self.modules
    }

    /// Compiles (through the module cache, on the blocking pool) and
    /// instantiates a module of `kind`; nothing is installed. `wait`: see
    /// [`ModuleCache::get`].
    pub async fn load(
        &self,
        kind: PolicyKind,
        bytes: Arc<[u8]>,
        params: &serde_json::Value,
        wait: bool,
    ) -> Result<WasmPolicy, PolicyError> {
        let schema = params::read_schema(&bytes)?;
        let module = self.modules.get(bytes, wait).await?;
        WasmPolicy::from_module(
            &self.engine,
            kind,
            module,
            schema.as_ref(),
            params,
            self.limits,
        )
    }

    /// Installs an already loaded Wasm policy in its hook.
    pub fn install_wasm(&self, policy: WasmPolicy, policy_id: Option<i64>) {
        self.install(PolicySlot::wasm(policy, policy_id));
    }

    /// [`PolicyRuntime::activate_module`] for async callers: compiles on the
    /// blocking pool through the module cache (waiting for a compile slot).
    pub async fn activate(
        &self,
        kind: PolicyKind,
        policy_id: Option<i64>,
        bytes: Arc<[u8]>,
        params: &serde_json::Value,
    ) -> Result<(), PolicyError> {
        let r = self.load(kind, bytes, params, true).await;
        self.install_loaded(kind, policy_id, r)
    }

    fn install_loaded(
        &self,
        kind: PolicyKind,
        policy_id: Option<i64>,
        r: Result<WasmPolicy, PolicyError>,
    ) -> Result<(), PolicyError> {
        match r {
            Ok(p) => {
                self.install(PolicySlot::wasm(p, policy_id));
                Ok(())
            }
            Err(e) => {
                self.set_native(kind);
                self.on_fault(kind, policy_id, &e, false);
                Err(e)
            }
        }
    }

    /// The audit sink, if any.
    pub fn audit_sink(&self) -> Option<&AuditSink> {
        self.audit.as_ref()
    }

    fn slot(&self, kind: PolicyKind) -> std::sync::MutexGuard<'_, LiveSlot> {
        self.slots[kind.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn install(&self, slot: PolicySlot) {
        let kind = slot.kind();
        let counters = self.metrics.counters(kind, slot.policy_id());
        *self.slot(kind) = LiveSlot { slot, counters };
    }

    /// Catalog id of the active Wasm policy of `kind` (`None` = native).
    pub fn active_id(&self, kind: PolicyKind) -> Option<i64> {
        self.slot(kind).slot.policy_id()
    }

    /// Whether `kind` currently runs a Wasm policy.
    pub fn is_wasm(&self, kind: PolicyKind) -> bool {
        self.slot(kind).slot.is_wasm()
    }

    /// Installs the native default for `kind`.
    pub fn set_native(&self, kind: PolicyKind) {
        self.install(PolicySlot::native(kind));
    }

    /// Loads and installs a Wasm policy, compiling on the calling thread when
    /// the module is not cached (async callers use [`PolicyRuntime::activate`]).
    /// If it does not load, the native default is installed instead, the fault
    /// is counted and audited, and the error returned.
    pub fn activate_module(
        &self,
        kind: PolicyKind,
        policy_id: Option<i64>,
        bytes: &[u8],
        params: &serde_json::Value,
    ) -> Result<(), PolicyError> {
        let r = params::read_schema(bytes).and_then(|schema| {
            self.modules.get_blocking(bytes).and_then(|m| {
                WasmPolicy::from_module(&self.engine, kind, m, schema.as_ref(), params, self.limits)
            })
        });
        self.install_loaded(kind, policy_id, r)
    }

    fn on_fault(
        &self,
        kind: PolicyKind,
        policy_id: Option<i64>,
        e: &PolicyError,
        fallback_call: bool,
    ) {
        let counters = self.metrics.counters(kind, policy_id);
        self.metrics.fault(kind, &counters, e, fallback_call);
        tracing::warn!(
            kind = kind.as_str(),
            ?policy_id,
            "policy fault, native default used: {e}"
        );
        let Some(audit) = &self.audit else { return };
        let key = format!("{}:{}:{:?}", kind.as_str(), e.label(), policy_id);
        let now = now_ms() as u64;
        {
            let mut last = self.last_audit.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(&t) = last.get(&key) {
                if now.saturating_sub(t) < AUDIT_FAULT_INTERVAL_MS {
                    return;
                }
            }
            last.insert(key, now);
        }
        audit.send(
            "policy.fault",
            &policy_id
                .map(|i| i.to_string())
                .unwrap_or_else(|| "unsaved".into()),
            serde_json::json!({
                "kind": kind.as_str(),
                "reason": e.label(),
                "error": e.to_string(),
                "fallback": "native default",
                "total_faults": self.metrics.faults(kind),
            }),
        );
    }

    fn run<T>(
        &self,
        kind: PolicyKind,
        f: impl FnOnce(&mut PolicySlot) -> (T, Option<PolicyError>),
    ) -> (T, bool) {
        let (v, fault, id) = {
            let mut live = self.slot(kind);
            let t0 = Instant::now();
            let (v, fault) = f(&mut live.slot);
            let nanos = t0.elapsed().as_nanos().min(u64::MAX as u128) as u64;
            self.metrics.call(kind, &live.counters, nanos);
            (v, fault, live.slot.policy_id())
        };
        let faulted = fault.is_some();
        if let Some(e) = fault {
            self.on_fault(kind, id, &e, true);
        }
        (v, faulted)
    }

    /// Asks the shadow of `kind`, if any, the same question the active
    /// policy answered with `active` (`active_faulted`: it faulted), and
    /// counts both answers. The shadow's answer is never applied.
    fn shadow_call(
        &self,
        kind: PolicyKind,
        call: shadow::Call<'_>,
        active: usize,
        active_faulted: bool,
        ask: impl FnOnce(&mut PolicySlot) -> (usize, Option<PolicyError>),
    ) {
        if !self.shadow_on[kind.index()].load(Ordering::Relaxed) {
            return;
        }
        let mut g = self.shadows[kind.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(sh) = g.as_mut() {
            let (cand, fault) = ask(&mut sh.slot);
            sh.tally(&call, active, active_faulted, cand, fault.is_some());
        }
    }

    /// Victim index among `c` (non-empty).
    pub fn evict(&self, c: &[EntryInfo], now: u64) -> usize {
        let (v, faulted) = self.run(PolicyKind::Eviction, |s| s.evict(c, now));
        self.shadow_call(
            PolicyKind::Eviction,
            shadow::Call::Evict(c),
            v,
            faulted,
            |s| s.evict(c, now),
        );
        v
    }

    /// Admission decision.
    pub fn admit(&self, a: &AdmitInfo, now: u64) -> bool {
        let (v, faulted) = self.run(PolicyKind::Admission, |s| s.admit(a, now));
        self.shadow_call(
            PolicyKind::Admission,
            shadow::Call::Admit(a),
            v as usize,
            faulted,
            |s| {
                let (b, f) = s.admit(a, now);
                (b as usize, f)
            },
        );
        v
    }

    /// Invalidation decision (true = drop).
    pub fn invalidate(&self, e: &EntryInfo, now: u64) -> bool {
        let (v, faulted) = self.run(PolicyKind::Invalidation, |s| s.invalidate(e, now));
        self.shadow_call(
            PolicyKind::Invalidation,
            shadow::Call::Invalidate,
            v as usize,
            faulted,
            |s| {
                let (b, f) = s.invalidate(e, now);
                (b as usize, f)
            },
        );
        v
    }

    /// Whether the shared namespace is allowed (never for non-public segments).
    pub fn isolation(&self, s: &IsolationInfo) -> bool {
        let (v, faulted) = self.run(PolicyKind::Isolation, |slot| slot.isolation(s));
        self.shadow_call(
            PolicyKind::Isolation,
            shadow::Call::Isolation,
            v as usize,
            faulted,
            |slot| {
                let (b, f) = slot.isolation(s);
                (b as usize, f)
            },
        );
        v
    }

    /// Starts (or replaces) the shadow of the policy's kind: from now on every
    /// call of that hook is also answered by `policy`, whose answers are only
    /// counted. `params`: its effective parameters, for the view.
    pub fn start_shadow(
        &self,
        policy: WasmPolicy,
        policy_id: i64,
        params: serde_json::Value,
        started_by: &str,
    ) -> ShadowView {
        let kind = policy.kind();
        let sh = shadow::Shadow {
            slot: PolicySlot::wasm(policy, Some(policy_id)),
            policy_id,
            params,
            started_at: now_ms(),
            started_by: started_by.to_string(),
            candidate: DecisionCounts::default(),
            active: DecisionCounts::default(),
            agreed: 0,
            disagreed: 0,
        };
        let view = sh.view(kind, self.active_id(kind));
        *self.shadows[kind.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(sh);
        self.shadow_on[kind.index()].store(true, Ordering::Relaxed);
        view
    }

    /// Resumes a shadow recorded by an earlier run of the server (see
    /// [`crate::persist::restore`]): `policy` answers beside the active policy
    /// of its kind again, counting on from `saved`'s counts, with its start
    /// time, operator and parameters.
    pub fn resume_shadow(&self, policy: WasmPolicy, saved: &ShadowView) -> ShadowView {
        let kind = policy.kind();
        let sh = shadow::Shadow {
            slot: PolicySlot::wasm(policy, Some(saved.policy_id)),
            policy_id: saved.policy_id,
            params: saved.params.clone(),
            started_at: saved.started_at,
            started_by: saved.started_by.clone(),
            candidate: saved.candidate.clone(),
            active: saved.active.clone(),
            agreed: saved.agreed,
            disagreed: saved.disagreed,
        };
        let view = sh.view(kind, self.active_id(kind));
        *self.shadows[kind.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(sh);
        self.shadow_on[kind.index()].store(true, Ordering::Relaxed);
        view
    }

    /// Stops the shadow of `kind`; its final counts, `None` when there was none.
    pub fn stop_shadow(&self, kind: PolicyKind) -> Option<ShadowView> {
        let active = self.active_id(kind);
        let mut g = self.shadows[kind.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.shadow_on[kind.index()].store(false, Ordering::Relaxed);
        g.take().map(|sh| sh.view(kind, active))
    }

    /// The shadow of `kind` and its counts so far, if one runs.
    pub fn shadow(&self, kind: PolicyKind) -> Option<ShadowView> {
        let active = self.active_id(kind);
        self.shadows[kind.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|sh| sh.view(kind, active))
    }

    /// Installs the catalog's active policies.
    pub async fn load_active(&self, catalog: &Catalog) {
        for kind in PolicyKind::ALL {
            match catalog.active_policy(kind.as_str()).await {
                Ok(Some(rec)) => {
                    let params: serde_json::Value =
                        serde_json::from_str(&rec.params).unwrap_or(serde_json::Value::Null);
                    let _ = self
                        .activate(kind, Some(rec.id), rec.module.into(), &params)
                        .await;
                }
                _ => self.set_native(kind),
            }
        }
    }
}

/// The built-in policy modules shipped in `policies/dist/`, embedded.
pub mod builtin {
    /// `(name, kind, module bytes)` of every built-in policy.
    pub const ALL: &[(&str, &str, &[u8])] = &[
        (
            "lru",
            "eviction",
            include_bytes!("../../../policies/dist/lru.wasm"),
        ),
        (
            "gdsf",
            "eviction",
            include_bytes!("../../../policies/dist/gdsf.wasm"),
        ),
        (
            "quota",
            "admission",
            include_bytes!("../../../policies/dist/quota.wasm"),
        ),
        (
            "second_sighting",
            "admission",
            include_bytes!("../../../policies/dist/second_sighting.wasm"),
        ),
        (
            "ttl",
            "invalidation",
            include_bytes!("../../../policies/dist/ttl.wasm"),
        ),
        (
            "on_update",
            "invalidation",
            include_bytes!("../../../policies/dist/on_update.wasm"),
        ),
        (
            "strict",
            "isolation",
            include_bytes!("../../../policies/dist/strict.wasm"),
        ),
        (
            "shared",
            "isolation",
            include_bytes!("../../../policies/dist/shared.wasm"),
        ),
    ];

    /// The module bytes of built-in policy `name`.
    pub fn module(name: &str) -> Option<&'static [u8]> {
        ALL.iter().find(|(n, _, _)| *n == name).map(|(_, _, b)| *b)
    }
}

/// Reads a policy module from a file (for tools and tests).
pub fn read_module(path: &Path) -> std::io::Result<Vec<u8>> {
    std::fs::read(path)
}
