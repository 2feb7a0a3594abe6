//! Prometheus metrics of the server (`GET /metrics`, text exposition format 0.0.4).
//!
//! Latency histograms and token counters are updated as requests run; gauges of
//! the scheduler and the pools, the pools' cumulative counters, and the control
//! plane's per-policy counters (calls, faults by reason, fallbacks, time per
//! call) are refreshed from their live values at each scrape.
use crate::policy::{PolicyKind, PolicyRuntime};
use dataplane::engine::{BackendInfo, EnginePools};
use dataplane::pic::{MissReason, PicStats};
use dataplane::scheduler::SchedulerMetrics;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

/// Every metric the server exports.
pub struct ServeMetrics {
    registry: Registry,
    /// Submission to first token, seconds, by mode.
    pub ttft: HistogramVec,
    /// Time between consecutive tokens of a stream, seconds, by mode.
    pub itl: HistogramVec,
    /// End-to-end request latency, seconds, by endpoint.
    pub e2e: HistogramVec,
    /// Prompt tokens by mode and kind (`cached`, `computed`).
    pub prompt_tokens: IntCounterVec,
    /// Segments by mode and outcome.
    pub segments: IntCounterVec,
    /// Segments not reused by mode and reason ([`MissReason`]).
    pub segment_misses: IntCounterVec,
    /// Seam-window tokens recomputed by mode (the data plane's
    /// [`PicStats::seam_tokens`]; part of the computed prompt tokens).
    pub seam_tokens: IntCounterVec,
    /// Generated tokens by mode.
    pub completion_tokens: IntCounterVec,
    /// Requests by endpoint and status code.
    pub requests: IntCounterVec,
    queue_depth: IntGauge,
    running: IntGauge,
    kv_reserved: IntGauge,
    state_bytes: IntGauge,
    pool_bytes: IntGaugeVec,
    pool_entries: IntGaugeVec,
    spill_bytes: IntGaugeVec,
    tier_bytes: IntGaugeVec,
    tier_entries: IntGaugeVec,
    pool_events: IntCounterVec,
    sched_events: IntCounterVec,
    backend: IntGaugeVec,
    /// Entries the invalidation sweep checked and dropped (`event`: checked, dropped).
    pub sweep: IntCounterVec,
    policy_calls: IntCounterVec,
    policy_faults: IntCounterVec,
    policy_fallbacks: IntCounterVec,
    policy_nanos: IntCounterVec,
    policy_ns_per_call: GaugeVec,
    policy_active: IntGaugeVec,
    scatter_seconds: HistogramVec,
    last: Mutex<Last>,
    reuse: Mutex<HashMap<String, ReuseTally>>,
}

/// Requests served in a reuse mode before the server warns (once per mode) that
/// none of them reused any prompt token.
pub const NO_REUSE_WARN_AFTER: u64 = 32;

/// Per-mode reuse tally behind the no-reuse warning.
#[derive(Default)]
struct ReuseTally {
    requests: u64,
    cached_tokens: u64,
    warned: bool,
    reasons: HashMap<MissReason, u64>,
}

#[derive(Default)]
struct Last {
    pool: [[u64; 10]; 2],
    sched: [u64; 6],
    /// Last exported value of each policy counter, by metric and label values.
    policy: HashMap<(&'static str, Vec<String>), u64>,
}

/// Adds to `c` (labels `lv`) what `now` has grown since the last scrape.
fn advance(
    last: &mut HashMap<(&'static str, Vec<String>), u64>,
    metric: &'static str,
    c: &IntCounterVec,
    lv: &[&str],
    now: u64,
) {
    let key = (metric, lv.iter().map(|s| s.to_string()).collect());
    let prev = last.entry(key).or_insert(0);
    c.with_label_values(lv).inc_by(now.saturating_sub(*prev));
    *prev = (*prev).max(now);
}

fn buckets_s() -> Vec<f64> {
    // 0.5 ms … ~65 s.
    prometheus::exponential_buckets(0.0005, 2.0, 18).expect("static buckets")
}

impl ServeMetrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let r = Registry::new();
        macro_rules! reg {
            ($m:expr) => {{
                let m = $m.expect("static metric definition");
                r.register(Box::new(m.clone())).expect("unique metric");
                m
            }};
        }
        let ttft = reg!(HistogramVec::new(
            HistogramOpts::new(
                "hypic_time_to_first_token_seconds",
                "Time from submission to the first generated token."
            )
            .buckets(buckets_s()),
            &["mode"]
        ));
        let itl = reg!(HistogramVec::new(
            HistogramOpts::new(
                "hypic_inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request."
            )
            .buckets(buckets_s()),
            &["mode"]
        ));
        let e2e = reg!(HistogramVec::new(
            HistogramOpts::new(
                "hypic_request_duration_seconds",
                "Time from submission to the last token."
            )
            .buckets(buckets_s()),
            &["endpoint"]
        ));
        let prompt_tokens = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_prompt_tokens_total",
                "Prompt tokens by reuse mode: cached (work reused) or computed."
            ),
            &["mode", "kind"]
        ));
        let segments = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_segments_total",
                "Prompt segments by reuse mode and outcome (computed, prefix_hit, hit, miss)."
            ),
            &["mode", "outcome"]
        ));
        let segment_misses = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_segment_misses_total",
                "Prompt segments a reuse mode did not reuse, by mode and reason: never_seen, evicted, invalidated, damaged, not_admitted, role_mismatch (an entry exists for the other position role only), too_short_for_seam, private_prefix_miss."
            ),
            &["mode", "reason"]
        ));
        let seam_tokens = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_seam_tokens_total",
                "Prompt tokens of seam windows recomputed at a cached segment's new position, by reuse mode (counted in hypic_prompt_tokens_total{kind=\"computed\"} too)."
            ),
            &["mode"]
        ));
        let completion_tokens = reg!(IntCounterVec::new(
            Opts::new("hypic_completion_tokens_total", "Generated tokens."),
            &["mode"]
        ));
        let requests = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_requests_total",
                "HTTP requests by endpoint and status."
            ),
            &["endpoint", "status"]
        ));
        let queue_depth = reg!(IntGauge::new(
            "hypic_queue_depth",
            "Requests waiting for admission."
        ));
        let running = reg!(IntGauge::new(
            "hypic_running_requests",
            "Sequences in the running batch."
        ));
        let kv_reserved = reg!(IntGauge::new(
            "hypic_kv_reserved_bytes",
            "KV bytes reserved by running sequences."
        ));
        let state_bytes = reg!(IntGauge::new(
            "hypic_state_bytes",
            "Recurrent and KV state bytes held by running sequences."
        ));
        let pool_bytes = reg!(IntGaugeVec::new(
            Opts::new(
                "hypic_pool_bytes",
                "Bytes held by a cache pool (public: segment entries; private: running-state snapshots)."
            ),
            &["pool"]
        ));
        let pool_entries = reg!(IntGaugeVec::new(
            Opts::new("hypic_pool_entries", "Entries in a cache pool."),
            &["pool"]
        ));
        let spill_bytes = reg!(IntGaugeVec::new(
            Opts::new(
                "hypic_pool_spill_bytes",
                "Bytes held by a pool's host spill tier (checksummed blobs of evicted entries)."
            ),
            &["pool"]
        ));
        let tier_bytes = reg!(IntGaugeVec::new(
            Opts::new(
                "hypic_pool_tier_bytes",
                "Bytes a cache pool holds in one storage tier: gpu (device memory, CUDA backend), host (host memory, CPU backend) or spill (the host spill tier). A tier the backend does not have has no series."
            ),
            &["pool", "tier"]
        ));
        let tier_entries = reg!(IntGaugeVec::new(
            Opts::new(
                "hypic_pool_tier_entries",
                "Entries a cache pool holds in one storage tier (gpu, host, spill; see hypic_pool_tier_bytes)."
            ),
            &["pool", "tier"]
        ));
        let pool_events = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_pool_events_total",
                "Pool lookups and changes: hit, miss, insert, eviction, rejected; spill tier: spill, spill_restore, spill_checksum_failure, spill_eviction, spill_rejected."
            ),
            &["pool", "event"]
        ));
        let sched_events = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_scheduler_events_total",
                "Scheduler events: queue_full (429), queue_timeout (408), cancelled, finished; prefill_batch (one forward ran several requests' prefill pieces together) and prefill_batch_request (the requests' pieces in those forwards)."
            ),
            &["event"]
        ));
        let backend = reg!(IntGaugeVec::new(
            Opts::new(
                "hypic_backend_info",
                "The backend that serves (always 1): device (cpu, cuda), dtype (f32, bf16) and its description (e.g. cuda:0 NVIDIA H200 (sm_90a) f32)."
            ),
            &["device", "dtype", "backend"]
        ));
        let sweep = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_invalidation_sweep_entries_total",
                "Cache entries the periodic invalidation sweep put to the invalidation policy (checked) and dropped (a public-pool segment entry, or all private snapshots of one tenant, count once)."
            ),
            &["event"]
        ));
        let pl = &["kind", "policy"];
        let policy_calls = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_policy_calls_total",
                "Policy hook calls by kind and policy (catalog id, or native)."
            ),
            pl
        ));
        let policy_faults = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_policy_faults_total",
                "Policy faults by kind, policy and reason (load, trap, timeout, memory, bad_return)."
            ),
            &["kind", "policy", "reason"]
        ));
        let policy_fallbacks = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_policy_fallbacks_total",
                "Policy calls answered by the native default after a fault."
            ),
            pl
        ));
        let policy_nanos = reg!(IntCounterVec::new(
            Opts::new(
                "hypic_policy_call_nanoseconds_total",
                "Wall-clock nanoseconds spent in policy hook calls."
            ),
            pl
        ));
        let policy_ns_per_call = reg!(GaugeVec::new(
            Opts::new(
                "hypic_policy_nanoseconds_per_call",
                "Mean wall-clock nanoseconds per policy hook call since start."
            ),
            pl
        ));
        let policy_active = reg!(IntGaugeVec::new(
            Opts::new(
                "hypic_policy_active",
                "Catalog id of the active Wasm policy of each kind (0: native default)."
            ),
            &["kind"]
        ));
        let scatter_seconds = reg!(HistogramVec::new(
            HistogramOpts::new(
                "hypic_scatter_seconds",
                "Per scattered prompt: `scatter` (start to the last cold segment in), `combine` (the combiner's first look at a shipped entry to its last), `transfer` (frame receive time, summed), `wait` (combiner blocked on entries not yet in)."
            )
            .buckets(buckets_s()),
            &["phase"]
        ));
        ServeMetrics {
            registry: r,
            scatter_seconds,
            sweep,
            policy_calls,
            policy_faults,
            policy_fallbacks,
            policy_nanos,
            policy_ns_per_call,
            policy_active,
            ttft,
            itl,
            e2e,
            prompt_tokens,
            segments,
            segment_misses,
            seam_tokens,
            completion_tokens,
            requests,
            queue_depth,
            running,
            kv_reserved,
            state_bytes,
            pool_bytes,
            pool_entries,
            spill_bytes,
            tier_bytes,
            tier_entries,
            pool_events,
            sched_events,
            backend,
            last: Mutex::new(Last::default()),
            reuse: Mutex::new(HashMap::new()),
        }
    }

    /// Records the scatter times of one request's prompts (`hypic_scatter_seconds`).
    pub fn observe_scatter(&self, reports: &[Option<dataplane::parallel::scatter::ScatterReport>]) {
        for r in reports.iter().flatten() {
            for (phase, ms) in [
                ("scatter", r.scatter_ms),
                ("combine", r.combine_ms),
                ("transfer", r.transfer_ms),
                ("wait", r.wait_ms),
            ] {
                self.scatter_seconds
                    .with_label_values(&[phase])
                    .observe(ms / 1e3);
            }
        }
    }

    /// Counts a started request's segments that were not reused by reason
    /// (`hypic_segment_misses_total`), and logs one warning per mode (per server)
    /// when the first [`NO_REUSE_WARN_AFTER`] or more requests of a reuse mode
    /// (every mode but `full_recompute`) have reused no prompt token at all, naming
    /// the miss reasons seen. Returns true when it warned now.
    pub fn observe_reuse(&self, mode: &str, stats: &PicStats) -> bool {
        let reasons: Vec<MissReason> = stats
            .segments
            .iter()
            .filter_map(|s| s.miss_reason)
            .collect();
        for r in &reasons {
            self.segment_misses
                .with_label_values(&[mode, r.as_str()])
                .inc();
        }
        if mode == "full_recompute" {
            return false;
        }
        let mut all = self.reuse.lock().unwrap_or_else(|p| p.into_inner());
        let t = all.entry(mode.to_string()).or_default();
        t.requests += 1;
        t.cached_tokens += stats.tokens_reused as u64;
        if t.warned || t.cached_tokens > 0 {
            return false;
        }
        for r in reasons {
            *t.reasons.entry(r).or_default() += 1;
        }
        if t.requests < NO_REUSE_WARN_AFTER {
            return false;
        }
        t.warned = true;
        let mut by: Vec<(MissReason, u64)> = t.reasons.iter().map(|(r, n)| (*r, *n)).collect();
        by.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.as_str().cmp(b.0.as_str())));
        let by: Vec<String> = by
            .iter()
            .map(|(r, n)| format!("{}={n}", r.as_str()))
            .collect();
        tracing::warn!(
            mode,
            requests = t.requests,
            "no prompt token was reused in the first {} requests of mode {mode}; segments \
             not reused by reason: {} (see hypic_segment_misses_total and each \
             segment's miss_reason)",
            t.requests,
            if by.is_empty() {
                "none".to_string()
            } else {
                by.join(", ")
            }
        );
        true
    }

    /// Records which backend serves (`hypic_backend_info`).
    pub fn set_backend(&self, b: &BackendInfo) {
        self.backend.reset();
        self.backend
            .with_label_values(&[b.device.as_str(), b.dtype.as_str(), b.describe.as_str()])
            .set(1);
    }

    /// Refreshes the per-policy counters from the runtime's live values.
    fn observe_policies(&self, rt: &PolicyRuntime, last: &mut Last) {
        for k in PolicyKind::ALL {
            self.policy_active
                .with_label_values(&[k.as_str()])
                .set(rt.active_id(k).unwrap_or(0));
        }
        for p in rt.metrics().policy_snapshots() {
            let policy = p
                .policy_id
                .map(|i| i.to_string())
                .unwrap_or_else(|| "native".into());
            let lv = [p.kind.as_str(), policy.as_str()];
            let l = &mut last.policy;
            advance(l, "calls", &self.policy_calls, &lv, p.calls);
            advance(l, "fallbacks", &self.policy_fallbacks, &lv, p.fallbacks);
            advance(l, "nanos", &self.policy_nanos, &lv, p.nanos);
            for (reason, n) in &p.faults_by_reason {
                let lr = [p.kind.as_str(), policy.as_str(), reason.as_str()];
                advance(l, "faults", &self.policy_faults, &lr, *n);
            }
            self.policy_ns_per_call
                .with_label_values(&lv)
                .set(p.ns_per_call());
        }
    }

    /// Refreshes the live gauges and counters and renders the text exposition.
    pub fn render(
        &self,
        sched: &SchedulerMetrics,
        engine: &dyn EnginePools,
        policies: &PolicyRuntime,
    ) -> String {
        let fams = self.gather(sched, engine, policies);
        let mut buf = vec![];
        let enc = TextEncoder::new();
        if let Err(e) = enc.encode(&fams, &mut buf) {
            return format!("# encoding error: {e}\n");
        }
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Refreshes the live gauges and counters and returns every metric family
    /// (what [`ServeMetrics::render`] encodes).
    pub fn gather(
        &self,
        sched: &SchedulerMetrics,
        engine: &dyn EnginePools,
        policies: &PolicyRuntime,
    ) -> Vec<prometheus::proto::MetricFamily> {
        self.queue_depth
            .set(sched.queue_depth.load(Ordering::Relaxed) as i64);
        self.running
            .set(sched.running.load(Ordering::Relaxed) as i64);
        self.kv_reserved
            .set(sched.kv_reserved_bytes.load(Ordering::Relaxed) as i64);
        self.state_bytes
            .set(sched.state_bytes.load(Ordering::Relaxed) as i64);
        {
            let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
            for (pool, tiers) in pool_tiers(engine) {
                for t in tiers {
                    self.tier_bytes
                        .with_label_values(&[pool, t.tier])
                        .set(t.bytes as i64);
                    self.tier_entries
                        .with_label_values(&[pool, t.tier])
                        .set(t.entries as i64);
                }
            }
            for (pi, (name, (entries, bytes, st))) in [
                ("public", engine.public_usage()),
                ("private", engine.private_usage()),
            ]
            .into_iter()
            .enumerate()
            {
                self.pool_bytes.with_label_values(&[name]).set(bytes as i64);
                self.pool_entries
                    .with_label_values(&[name])
                    .set(entries as i64);
                self.spill_bytes
                    .with_label_values(&[name])
                    .set(engine.spill_usage()[pi].1 as i64);
                let now = [
                    st.hits,
                    st.misses,
                    st.inserts,
                    st.evictions,
                    st.rejected,
                    st.spilled,
                    st.spill_restores,
                    st.spill_corrupt,
                    st.spill_evictions,
                    st.spill_rejected,
                ];
                for (i, ev) in [
                    "hit",
                    "miss",
                    "insert",
                    "eviction",
                    "rejected",
                    "spill",
                    "spill_restore",
                    "spill_checksum_failure",
                    "spill_eviction",
                    "spill_rejected",
                ]
                .into_iter()
                .enumerate()
                {
                    let d = now[i].saturating_sub(last.pool[pi][i]);
                    self.pool_events.with_label_values(&[name, ev]).inc_by(d);
                    last.pool[pi][i] = last.pool[pi][i].max(now[i]);
                }
            }
            let now = [
                sched.rejected_queue_full.load(Ordering::Relaxed),
                sched.queue_timeouts.load(Ordering::Relaxed),
                sched.cancelled.load(Ordering::Relaxed),
                sched.finished.load(Ordering::Relaxed),
                sched.batched_prefills.load(Ordering::Relaxed),
                sched.batched_prefill_requests.load(Ordering::Relaxed),
            ];
            for (i, ev) in [
                "queue_full",
                "queue_timeout",
                "cancelled",
                "finished",
                "prefill_batch",
                "prefill_batch_request",
            ]
            .into_iter()
            .enumerate()
            {
                let d = now[i].saturating_sub(last.sched[i]);
                self.sched_events.with_label_values(&[ev]).inc_by(d);
                last.sched[i] = last.sched[i].max(now[i]);
            }
            self.observe_policies(policies, &mut last);
        }
        self.registry.gather()
    }
}

/// What one storage tier of a pool holds, read from the pool's own counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierUsage {
    /// `gpu`, `host` or `spill`.
    pub tier: &'static str,
    /// Entries held in the tier.
    pub entries: usize,
    /// Bytes held in the tier.
    pub bytes: usize,
}

/// The tiers each pool (`public`, `private`) has, with their usage: the primary
/// tier ([`EnginePools::primary_tier_name`]: `gpu` on the CUDA backend, `host` on
/// the CPU), then `spill` when the pool has a spill tier (capacity above 0). A
/// tier the backend does not have is left out, never reported as 0.
pub fn pool_tiers(engine: &dyn EnginePools) -> [(&'static str, Vec<TierUsage>); 2] {
    let primary = engine.primary_tier_name();
    let spill = engine.spill_usage();
    let one = |pi: usize, (entries, bytes): (usize, usize)| {
        let mut v = vec![TierUsage {
            tier: primary,
            entries,
            bytes,
        }];
        let (se, sb, cap) = spill[pi];
        if cap > 0 {
            v.push(TierUsage {
                tier: "spill",
                entries: se,
                bytes: sb,
            });
        }
        v
    };
    let (pe, pb, _) = engine.public_usage();
    let (qe, qb, _) = engine.private_usage();
    [("public", one(0, (pe, pb))), ("private", one(1, (qe, qb)))]
}

impl Default for ServeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A per-worker metric: name, type, help, value.
type PerWorker = (
    &'static str,
    &'static str,
    &'static str,
    fn(&dataplane::parallel::scatter::WorkerMetrics) -> f64,
);

/// The live counters of the segment-parallel workers in the text exposition
/// format: `hypic_worker_*{worker,transport}` (up, throughput, segments, tokens,
/// failures, transfer seconds, segments in flight; `transport` is `tcp`, `peer` or
/// `in-process`) and `hypic_scatter_*` (requests, segments, reassigned,
/// recomputed, corrupt, timeouts, driver threads).
pub fn scatter_text(m: &dataplane::parallel::scatter::ScatterMetrics) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let per: [PerWorker; 7] = [
        (
            "hypic_worker_up",
            "gauge",
            "1 while the worker is in the assignment set.",
            |w| w.up as u8 as f64,
        ),
        (
            "hypic_worker_tokens_per_second",
            "gauge",
            "Entry-build throughput the deadlines assume, tokens per second.",
            |w| w.tokens_per_s,
        ),
        (
            "hypic_worker_segments_total",
            "counter",
            "Cold segments the worker shipped that verified.",
            |w| w.segments as f64,
        ),
        (
            "hypic_worker_tokens_total",
            "counter",
            "Tokens of those segments.",
            |w| w.tokens as f64,
        ),
        (
            "hypic_worker_failures_total",
            "counter",
            "Times the worker failed a task (dead, late, failed segment, bad frame).",
            |w| w.failures as f64,
        ),
        (
            "hypic_worker_transfer_seconds_total",
            "counter",
            "Transfer time of the worker's verified entries (TCP receive, or device copy and checksum), seconds.",
            |w| w.transfer_ms / 1e3,
        ),
        (
            "hypic_worker_in_flight_segments",
            "gauge",
            "Segments assigned to the worker and not answered yet.",
            |w| w.in_flight as f64,
        ),
    ];
    for (name, kind, help, f) in per {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for w in &m.workers {
            let _ = writeln!(
                out,
                "{name}{{worker=\"{}\",transport=\"{}\"}} {}",
                escape_label(&w.worker),
                escape_label(&w.transport),
                f(w)
            );
        }
    }
    for (name, kind, help, v) in [
        (
            "hypic_scatter_requests_total",
            "counter",
            "Prompts whose cold segments were scattered.",
            m.requests as f64,
        ),
        (
            "hypic_scatter_segments_total",
            "counter",
            "Cold segments scattered.",
            m.segments as f64,
        ),
        (
            "hypic_scatter_reassigned_total",
            "counter",
            "Scattered segments moved to another worker.",
            m.reassigned as f64,
        ),
        (
            "hypic_scatter_recomputed_total",
            "counter",
            "Scattered segments built by the combiner after all.",
            m.recomputed as f64,
        ),
        (
            "hypic_scatter_corrupt_total",
            "counter",
            "Shipped entries refused (checksum, model, shape); never composed.",
            m.corrupt as f64,
        ),
        (
            "hypic_scatter_timeouts_total",
            "counter",
            "Per-segment deadlines missed.",
            m.timeouts as f64,
        ),
        (
            "hypic_scatter_drivers",
            "gauge",
            "Scatter driver threads running.",
            m.drivers as f64,
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::pic::{Outcome, SegmentStat};

    fn stats(reused: usize, reason: Option<MissReason>) -> PicStats {
        PicStats {
            tokens_reused: reused,
            segments: vec![SegmentStat {
                index: 0,
                tokens: 10,
                outcome: if reused > 0 {
                    Outcome::Hit
                } else {
                    Outcome::Miss
                },
                computed: 10 - reused,
                reused,
                seam: 0,
                content_hash: String::new(),
                miss_reason: reason,
            }],
            ..PicStats::default()
        }
    }

    #[test]
    fn no_reuse_warns_once_per_mode_and_misses_are_counted_by_reason() {
        let m = ServeMetrics::new();
        let miss = stats(0, Some(MissReason::RoleMismatch));
        for _ in 1..NO_REUSE_WARN_AFTER {
            assert!(!m.observe_reuse("hypic", &miss));
        }
        assert!(m.observe_reuse("hypic", &miss), "warns at the threshold");
        for _ in 0..2 * NO_REUSE_WARN_AFTER {
            assert!(!m.observe_reuse("hypic", &miss), "only once");
        }
        // Full recompute reuses nothing by design; a mode that reused once never warns.
        m.observe_reuse("prefix_cache", &stats(4, None));
        for _ in 0..2 * NO_REUSE_WARN_AFTER {
            assert!(!m.observe_reuse("full_recompute", &stats(0, None)));
            assert!(!m.observe_reuse("prefix_cache", &miss));
        }
        // Another reuse mode has its own warning.
        let warned = (0..NO_REUSE_WARN_AFTER)
            .filter(|_| m.observe_reuse("naive_addition", &miss))
            .count();
        assert_eq!(warned, 1);
        let n = |mode: &str| {
            m.segment_misses
                .with_label_values(&[mode, "role_mismatch"])
                .get()
        };
        assert_eq!(n("hypic"), 3 * NO_REUSE_WARN_AFTER);
        assert_eq!(n("prefix_cache"), 2 * NO_REUSE_WARN_AFTER);
        assert_eq!(n("full_recompute"), 0);
    }
}
