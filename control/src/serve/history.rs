//! A bounded ring of metric samples for the operator UI's overview
//! (`GET /v1/metrics/history`, operator only). `/metrics` stays the Prometheus
//! exposition; this is the same data read back from the registry at a fixed
//! interval, so a browser can chart the last hour without a Prometheus server.
//!
//! Counters are cumulative since the server started (a client diffs two samples
//! for a rate); gauges are the value at the sample time; the TTFT quantiles of a
//! sample cover the requests that got their first token since the previous
//! sample.
use super::AppState;
use prometheus::proto::MetricFamily;
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, Weak};
use std::time::Duration;

/// Milliseconds between two stored samples.
pub const SAMPLE_EVERY_MS: u64 = 5_000;
/// Samples kept: one hour at [`SAMPLE_EVERY_MS`].
pub const CAPACITY: usize = 720;

/// Bytes and entries of one cache pool at a sample time.
#[derive(Debug, Clone, Default, Serialize, PartialEq, utoipa::ToSchema)]
pub struct PoolSample {
    /// Bytes held in memory (public: segment entries; private: snapshots).
    pub bytes: u64,
    /// Entries held in memory.
    pub entries: u64,
    /// Bytes held by the pool's host spill tier.
    pub spill_bytes: u64,
    /// Bytes and entries by storage tier (`gpu`, `host`, `spill`), from the
    /// pool's own counters (`hypic_pool_tier_bytes`, `hypic_pool_tier_entries`).
    /// Only the tiers the backend has are keys: the CPU backend has no `gpu`
    /// tier, the CUDA backend no `host` tier, and a pool without a spill tier no
    /// `spill`.
    pub tiers: BTreeMap<String, TierSample>,
}

/// Bytes and entries of one storage tier of a pool at a sample time.
#[derive(Debug, Clone, Default, Serialize, PartialEq, utoipa::ToSchema)]
pub struct TierSample {
    /// Bytes held in the tier.
    pub bytes: u64,
    /// Entries held in the tier.
    pub entries: u64,
}

/// TTFT quantiles of one mode over an interval, milliseconds (estimated from the
/// histogram buckets by linear interpolation, as Prometheus' `histogram_quantile`).
#[derive(Debug, Clone, Default, Serialize, PartialEq, utoipa::ToSchema)]
pub struct Quantiles {
    /// Requests in the interval.
    pub count: u64,
    /// Median, ms (`null` when `count` is 0).
    pub p50: Option<f64>,
    /// 95th percentile, ms.
    pub p95: Option<f64>,
    /// 99th percentile, ms.
    pub p99: Option<f64>,
}

/// One sample of the server's metrics (`MetricSample` in the OpenAPI document).
#[derive(Debug, Clone, Default, Serialize, PartialEq, utoipa::ToSchema)]
#[schema(as = MetricSample)]
pub struct Sample {
    /// Wall-clock time of the sample, ms since the Unix epoch.
    pub ts_ms: u64,
    /// HTTP requests answered (every endpoint and status), cumulative.
    pub requests: u64,
    /// Completion requests finished by the scheduler, cumulative.
    pub finished: u64,
    /// Requests refused with 429 (admission queue full), cumulative.
    pub rejected_429: u64,
    /// Requests timed out with 408 in the queue, cumulative.
    pub timeouts_408: u64,
    /// Prompt tokens whose work was reused, cumulative.
    pub prompt_tokens_cached: u64,
    /// Prompt tokens computed, cumulative.
    pub prompt_tokens_computed: u64,
    /// Generated tokens, cumulative.
    pub completion_tokens: u64,
    /// Segments reused from a cache (`hit` and `prefix_hit`), cumulative.
    pub segment_hits: u64,
    /// Segments that missed (`miss`), cumulative.
    pub segment_misses: u64,
    /// Seam-window tokens recomputed at a cached segment's new position (part of
    /// `prompt_tokens_computed`), cumulative.
    pub seam_tokens: u64,
    /// Requests waiting for admission.
    pub queue_depth: u64,
    /// Sequences in the running batch.
    pub running: u64,
    /// Pools by name (`public`, `private`).
    pub pools: BTreeMap<String, PoolSample>,
    /// Policy hook calls (every kind and policy), cumulative.
    pub policy_calls: u64,
    /// Policy faults, cumulative.
    pub policy_faults: u64,
    /// Policy calls answered by the native default after a fault, cumulative.
    pub policy_fallbacks: u64,
    /// TTFT by mode over the interval since the previous sample.
    pub ttft_ms: BTreeMap<String, Quantiles>,
}

/// Cumulative TTFT buckets by mode: (upper bound in seconds, cumulative count).
type Buckets = BTreeMap<String, Vec<(f64, u64)>>;

/// The ring (newest last) with the TTFT buckets of the oldest and newest sample.
#[derive(Default)]
pub struct History {
    inner: Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    samples: VecDeque<Sample>,
    /// Cumulative buckets at each stored sample (same order as `samples`).
    buckets: VecDeque<Buckets>,
}

/// Answer of `GET /v1/metrics/history` (`MetricsHistory` in the OpenAPI document).
#[derive(Debug, Serialize, utoipa::ToSchema)]
#[schema(as = MetricsHistory)]
pub struct HistoryView {
    /// Milliseconds between stored samples.
    pub interval_ms: u64,
    /// Samples kept at most.
    pub capacity: usize,
    /// Stored samples, oldest first, then one sample taken now (always last).
    pub samples: Vec<Sample>,
    /// TTFT by mode over the whole window (oldest stored sample to now; since
    /// the start while the ring is empty).
    pub ttft_window_ms: BTreeMap<String, Quantiles>,
}

fn sum_where(fams: &[MetricFamily], name: &str, label: Option<(&str, &[&str])>) -> f64 {
    fams.iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric())
        .filter(|m| match label {
            None => true,
            Some((k, vs)) => m
                .get_label()
                .iter()
                .any(|l| l.name() == k && vs.contains(&l.value())),
        })
        .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
        .sum()
}

fn label_value<'a>(m: &'a prometheus::proto::Metric, k: &str) -> Option<&'a str> {
    m.get_label()
        .iter()
        .find(|l| l.name() == k)
        .map(|l| l.value())
}

/// The tiers of `pool` in the tier gauges: (tier, bytes, entries) by tier name.
fn pool_tiers(fams: &[MetricFamily], pool: &str) -> BTreeMap<String, TierSample> {
    let mut out: BTreeMap<String, TierSample> = BTreeMap::new();
    for (name, bytes) in [
        ("hypic_pool_tier_bytes", true),
        ("hypic_pool_tier_entries", false),
    ] {
        for m in fams
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric())
            .filter(|m| label_value(m, "pool") == Some(pool))
        {
            let Some(tier) = label_value(m, "tier") else {
                continue;
            };
            let t = out.entry(tier.to_string()).or_default();
            let v = m.get_gauge().get_value() as u64;
            if bytes {
                t.bytes = v;
            } else {
                t.entries = v;
            }
        }
    }
    out
}

fn ttft_buckets(fams: &[MetricFamily]) -> Buckets {
    let mut out = Buckets::new();
    for f in fams
        .iter()
        .filter(|f| f.name() == "hypic_time_to_first_token_seconds")
    {
        for m in f.get_metric() {
            let Some(mode) = label_value(m, "mode") else {
                continue;
            };
            let h = m.get_histogram();
            let mut b: Vec<(f64, u64)> = h
                .get_bucket()
                .iter()
                .map(|b| (b.upper_bound(), b.cumulative_count()))
                .collect();
            b.push((f64::INFINITY, h.get_sample_count()));
            out.insert(mode.to_string(), b);
        }
    }
    out
}

/// The `q` quantile (0..=1) of the observations between two cumulative bucket
/// lists of the same layout (`older` may be empty: since the start), in the
/// unit of the bounds; `None` without observations. An observation in the
/// overflow bucket reports the largest finite bound.
pub fn quantile(newer: &[(f64, u64)], older: &[(f64, u64)], q: f64) -> Option<f64> {
    let at = |i: usize| {
        let o = older.get(i).map(|b| b.1).unwrap_or(0);
        newer[i].1.saturating_sub(o)
    };
    let total = at(newer.len().checked_sub(1)?);
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut lower = 0.0;
    let mut below = 0u64;
    for (i, &(bound, _)) in newer.iter().enumerate() {
        let c = at(i);
        if c as f64 >= rank && c > below {
            if bound.is_infinite() {
                return Some(lower);
            }
            let frac = (rank - below as f64) / (c - below) as f64;
            return Some(lower + (bound - lower) * frac.clamp(0.0, 1.0));
        }
        lower = if bound.is_finite() { bound } else { lower };
        below = c;
    }
    Some(lower)
}

fn quantiles_ms(newer: &Buckets, older: Option<&Buckets>) -> BTreeMap<String, Quantiles> {
    newer
        .iter()
        .map(|(mode, b)| {
            let o: &[(f64, u64)] = older.and_then(|o| o.get(mode)).map_or(&[], |v| v);
            let n = b.last().map(|x| x.1).unwrap_or(0);
            let count = n.saturating_sub(o.last().map(|x| x.1).unwrap_or(0));
            let ms = |q| quantile(b, o, q).map(|s| (s * 1000.0 * 1000.0).round() / 1000.0);
            (
                mode.clone(),
                Quantiles {
                    count,
                    p50: ms(0.5),
                    p95: ms(0.95),
                    p99: ms(0.99),
                },
            )
        })
        .collect()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Reads one sample from the live metrics (refreshing the gauges as a scrape
/// does) with the cumulative TTFT buckets at that time.
fn take(s: &AppState) -> (Sample, Buckets) {
    let fams =
        s.0.metrics
            .gather(&s.0.sched.metrics(), &*s.0.engine, s.0.control.policies());
    let n = |name: &str, label: Option<(&str, &[&str])>| sum_where(&fams, name, label) as u64;
    let mut pools = BTreeMap::new();
    for pool in ["public", "private"] {
        let one = |name| n(name, Some(("pool", &[pool])));
        pools.insert(
            pool.to_string(),
            PoolSample {
                bytes: one("hypic_pool_bytes"),
                entries: one("hypic_pool_entries"),
                spill_bytes: one("hypic_pool_spill_bytes"),
                tiers: pool_tiers(&fams, pool),
            },
        );
    }
    let ev = |e: &str| n("hypic_scheduler_events_total", Some(("event", &[e])));
    let seg = |o: &[&str]| n("hypic_segments_total", Some(("outcome", o)));
    let tok = |k: &str| n("hypic_prompt_tokens_total", Some(("kind", &[k])));
    let sample = Sample {
        ts_ms: now_ms(),
        requests: n("hypic_requests_total", None),
        finished: ev("finished"),
        rejected_429: ev("queue_full"),
        timeouts_408: ev("queue_timeout"),
        prompt_tokens_cached: tok("cached"),
        prompt_tokens_computed: tok("computed"),
        completion_tokens: n("hypic_completion_tokens_total", None),
        segment_hits: seg(&["hit", "prefix_hit"]),
        segment_misses: seg(&["miss"]),
        seam_tokens: n("hypic_seam_tokens_total", None),
        queue_depth: n("hypic_queue_depth", None),
        running: n("hypic_running_requests", None),
        pools,
        policy_calls: n("hypic_policy_calls_total", None),
        policy_faults: n("hypic_policy_faults_total", None),
        policy_fallbacks: n("hypic_policy_fallbacks_total", None),
        ttft_ms: BTreeMap::new(),
    };
    (sample, ttft_buckets(&fams))
}

impl History {
    /// Stores a sample now, dropping the oldest beyond [`CAPACITY`].
    pub fn record(&self, s: &AppState) {
        let (mut sample, buckets) = take(s);
        let mut r = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        sample.ttft_ms = quantiles_ms(&buckets, r.buckets.back());
        r.samples.push_back(sample);
        r.buckets.push_back(buckets);
        while r.samples.len() > CAPACITY {
            r.samples.pop_front();
            r.buckets.pop_front();
        }
    }

    /// The stored samples followed by one taken now.
    pub fn view(&self, s: &AppState) -> HistoryView {
        let (mut now, buckets) = take(s);
        let r = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        now.ttft_ms = quantiles_ms(&buckets, r.buckets.back());
        let mut samples: Vec<Sample> = r.samples.iter().cloned().collect();
        samples.push(now);
        HistoryView {
            interval_ms: SAMPLE_EVERY_MS,
            capacity: CAPACITY,
            samples,
            ttft_window_ms: quantiles_ms(&buckets, r.buckets.front()),
        }
    }
}

/// Starts the sampler: one sample every `every` until the server state is dropped.
pub(crate) fn spawn_sampler(state: Weak<super::Inner>, every: Duration) {
    tokio::spawn(async move {
        let mut t = tokio::time::interval(every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            t.tick().await;
            let Some(inner) = state.upgrade() else { break };
            let s = AppState(inner);
            s.0.history.record(&s);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_within_the_bucket_and_diffs_the_older_counts() {
        // Bounds 1, 2, 4, +Inf; 10 observations: 2 ≤ 1, 6 in (1, 2], 2 in (2, 4].
        let newer = [(1.0, 2), (2.0, 8), (4.0, 10), (f64::INFINITY, 10)];
        assert_eq!(quantile(&newer, &[], 0.5), Some(1.0 + 3.0 / 6.0));
        assert_eq!(quantile(&newer, &[], 0.1), Some(0.5));
        assert_eq!(quantile(&newer, &[], 1.0), Some(4.0));
        // Since an older sample with the first 2 observations: 8 left, all > 1.
        let older = [(1.0, 2), (2.0, 2), (4.0, 2), (f64::INFINITY, 2)];
        assert_eq!(quantile(&newer, &older, 0.75), Some(2.0));
        assert_eq!(quantile(&newer, &older, 0.0625), Some(1.0 + 1.0 / 12.0));
        assert_eq!(quantile(&newer, &newer, 0.5), None, "no observation");
        // Overflow bucket: the largest finite bound.
        let over = [(1.0, 0), (f64::INFINITY, 3)];
        assert_eq!(quantile(&over, &[], 0.99), Some(1.0));
    }
}
