//! A cache simulator for policy dry runs: replays a recorded request trace
//! (JSONL) through a [`PolicySet`] and reports hit ratio, bytes and
//! recompute tokens.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};

use serde::{Deserialize, Serialize};

use crate::policy::{opaque_id, AdmitInfo, EntryInfo, IsolationInfo, PolicySet};

/// One recorded request: the segments it used, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Tenant that sent the request.
    pub tenant: String,
    /// Segment ids.
    pub segments: Vec<String>,
    /// Token count of each segment (same length as `segments`).
    pub tokens: Vec<u64>,
    /// Cache bytes of each segment (same length as `segments`).
    pub bytes: Vec<u64>,
    /// Request time (ms); defaults to 1000 ms per line.
    #[serde(default)]
    pub ts_ms: Option<u64>,
    /// Segment versions (same length); a higher version supersedes cached ones.
    #[serde(default)]
    pub versions: Option<Vec<i64>>,
    /// Segments of this request that are explicitly public.
    #[serde(default)]
    pub public: Vec<String>,
}

/// Requests (lines) a trace may hold.
pub const MAX_TRACE_REQUESTS: usize = 200_000;
/// Segment occurrences a trace may name in all (the replay's work is linear in it).
pub const MAX_TRACE_SEGMENTS: usize = 400_000;
/// Largest token count of one segment in a trace.
pub const MAX_TRACE_TOKENS: u64 = 1 << 32;
/// Largest byte size of one segment in a trace (1 TiB).
pub const MAX_TRACE_BYTES: u64 = 1 << 40;

/// Parses a JSONL trace; errors name the line. Bounds: [`MAX_TRACE_REQUESTS`]
/// lines, [`MAX_TRACE_SEGMENTS`] segments in all, tenants and segment ids of 1 to
/// 256 bytes, at most [`MAX_TRACE_TOKENS`] tokens and [`MAX_TRACE_BYTES`] bytes a
/// segment (so no sum of a replay can overflow).
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>, String> {
    let mut out = Vec::new();
    let mut occurrences = 0usize;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r: TraceRecord =
            serde_json::from_str(line).map_err(|e| format!("trace line {}: {e}", i + 1))?;
        let n = r.segments.len();
        if r.tokens.len() != n
            || r.bytes.len() != n
            || r.versions.as_ref().is_some_and(|v| v.len() != n)
        {
            return Err(format!(
                "trace line {}: segments, tokens, bytes (and versions) must have equal lengths",
                i + 1
            ));
        }
        if r.tenant.is_empty() || r.tenant.len() > 256 {
            return Err(format!(
                "trace line {}: tenant must be 1 to 256 bytes",
                i + 1
            ));
        }
        if let Some(id) = r.segments.iter().find(|s| s.is_empty() || s.len() > 256) {
            return Err(format!(
                "trace line {}: segment id {:?} must be 1 to 256 bytes",
                i + 1,
                id.chars().take(40).collect::<String>()
            ));
        }
        if let Some(t) = r.tokens.iter().find(|&&t| t > MAX_TRACE_TOKENS) {
            return Err(format!(
                "trace line {}: tokens {t} is over {MAX_TRACE_TOKENS}",
                i + 1
            ));
        }
        if let Some(b) = r.bytes.iter().find(|&&b| b > MAX_TRACE_BYTES) {
            return Err(format!(
                "trace line {}: bytes {b} is over {MAX_TRACE_BYTES}",
                i + 1
            ));
        }
        occurrences += n;
        if occurrences > MAX_TRACE_SEGMENTS {
            return Err(format!(
                "trace line {}: the trace names more than {MAX_TRACE_SEGMENTS} segments in all",
                i + 1
            ));
        }
        out.push(r);
        if out.len() > MAX_TRACE_REQUESTS {
            return Err(format!("trace has more than {MAX_TRACE_REQUESTS} requests"));
        }
    }
    if out.is_empty() {
        return Err("trace is empty".into());
    }
    Ok(out)
}

/// What a replay measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SimStats {
    /// Requests replayed.
    pub requests: u64,
    /// Segment lookups.
    pub lookups: u64,
    /// Lookups that hit.
    pub hits: u64,
    /// hits / lookups.
    pub hit_ratio: f64,
    /// Bytes served from cache.
    pub bytes_hit: u64,
    /// Bytes inserted.
    pub bytes_inserted: u64,
    /// Bytes evicted.
    pub bytes_evicted: u64,
    /// Tokens recomputed on misses.
    pub recompute_tokens: u64,
    /// Tokens saved by hits.
    pub saved_tokens: u64,
    /// Evictions.
    pub evictions: u64,
    /// Admissions refused.
    pub rejected: u64,
    /// Entries dropped by the invalidation hook.
    pub invalidations: u64,
    /// Lookups served from the shared namespace.
    pub shared_hits: u64,
    /// Policy faults (native default used).
    pub policy_faults: u64,
    /// Peak bytes held.
    pub peak_bytes: u64,
    /// The same replay broken down by the trace's tenant (as the trace names it;
    /// the dry-run route pseudonymises the names), in name order.
    #[serde(default)]
    pub tenants: Vec<TenantSimStats>,
}

/// One tenant's share of a replay. Lookups, hits, hit bytes, recompute
/// tokens, insertions and refused admissions are the tenant's requests';
/// evictions, evicted bytes and invalidations are of the entries the tenant's
/// requests inserted (a shared entry counts for the tenant that inserted it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TenantSimStats {
    /// The tenant (a pseudonym `t-…` in a dry-run answer).
    pub tenant: String,
    /// Its requests.
    pub requests: u64,
    /// Its segment lookups.
    pub lookups: u64,
    /// Its lookups that hit.
    pub hits: u64,
    /// hits / lookups (0 without lookups).
    pub hit_ratio: f64,
    /// Bytes its hits served from cache.
    pub bytes_hit: u64,
    /// Bytes its misses inserted.
    pub bytes_inserted: u64,
    /// Bytes of its entries evicted.
    pub bytes_evicted: u64,
    /// Tokens its misses recomputed.
    pub recompute_tokens: u64,
    /// Its entries evicted.
    pub evictions: u64,
    /// Its admissions refused (by the admission hook, or larger than the cache).
    pub rejected: u64,
    /// Its entries dropped by the invalidation hook.
    pub invalidations: u64,
}

/// A simulated cache entry's key: (isolation namespace of a private entry, or `None`
/// for a shared one; segment id; version).
type EntryKey = (Option<String>, String, i64);

#[derive(Clone, Debug)]
struct Entry {
    info: EntryInfo,
    /// The trace tenant whose request inserted it.
    inserted_by: String,
}

/// Eviction candidates offered to the eviction hook at most, oldest first (a Wasm
/// policy's input buffer holds about as many; the native default takes the
/// oldest, the first).
pub const EVICTION_CANDIDATES: usize = 4096;

/// The simulated cache with the indexes that keep a replay's cost linear in the
/// trace: entries by key, by recency (the eviction candidates' order) and by
/// segment id (the entries a new version supersedes), and the bytes held.
#[derive(Default)]
struct Cache {
    entries: HashMap<EntryKey, Entry>,
    /// `(last use, insertion, key)` of every entry, oldest first.
    order: BTreeSet<(u64, u64, EntryKey)>,
    by_segment: HashMap<String, BTreeSet<EntryKey>>,
    used: u64,
    tenant_used: HashMap<String, u64>,
}

impl Cache {
    fn insert(&mut self, key: EntryKey, e: Entry) {
        self.used = self.used.saturating_add(e.info.bytes);
        let t = self
            .tenant_used
            .entry(key.0.clone().unwrap_or_default())
            .or_insert(0);
        *t = t.saturating_add(e.info.bytes);
        self.order
            .insert((e.info.last_use_ms, e.info.inserted_ms, key.clone()));
        self.by_segment
            .entry(key.1.clone())
            .or_default()
            .insert(key.clone());
        self.entries.insert(key, e);
    }

    fn remove(&mut self, key: &EntryKey) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.order
            .remove(&(e.info.last_use_ms, e.info.inserted_ms, key.clone()));
        if let Some(set) = self.by_segment.get_mut(&key.1) {
            set.remove(key);
            if set.is_empty() {
                self.by_segment.remove(&key.1);
            }
        }
        self.used = self.used.saturating_sub(e.info.bytes);
        if let Some(t) = self.tenant_used.get_mut(&key.0.clone().unwrap_or_default()) {
            *t = t.saturating_sub(e.info.bytes);
        }
        Some(e)
    }

    /// Counts a hit on `key` at `now`.
    fn touch(&mut self, key: &EntryKey, now: u64) {
        if let Some(e) = self.entries.get_mut(key) {
            self.order
                .remove(&(e.info.last_use_ms, e.info.inserted_ms, key.clone()));
            e.info.hits = e.info.hits.saturating_add(1);
            e.info.last_use_ms = now;
            self.order.insert((now, e.info.inserted_ms, key.clone()));
        }
    }

    /// Keys of `segment`'s cached versions older than `version`.
    fn older(&self, segment: &str, version: i64) -> Vec<EntryKey> {
        self.by_segment
            .get(segment)
            .map(|set| set.iter().filter(|k| k.2 < version).cloned().collect())
            .unwrap_or_default()
    }
}

/// Replays `trace` through a cache of `capacity_bytes` governed by `policies`.
pub fn simulate(trace: &[TraceRecord], capacity_bytes: u64, policies: &mut PolicySet) -> SimStats {
    simulate_until(trace, capacity_bytes, policies, &AtomicBool::new(false)).unwrap_or_default()
}

/// [`simulate`] that stops, returning `None`, once `cancelled` is set (checked
/// before every trace line and every 1024 segments of a line): a dry run whose client went away stops its replay.
/// Its work is linear in the trace's segment occurrences (the eviction hook sees
/// at most [`EVICTION_CANDIDATES`] candidates); sums saturate.
pub fn simulate_until(
    trace: &[TraceRecord],
    capacity_bytes: u64,
    policies: &mut PolicySet,
    cancelled: &AtomicBool,
) -> Option<SimStats> {
    let mut s = SimStats::default();
    let mut cache = Cache::default();
    let mut seen: HashMap<EntryKey, u32> = HashMap::new();
    let mut latest: HashMap<String, i64> = HashMap::new();
    let mut by: BTreeMap<String, TenantSimStats> = BTreeMap::new();
    fn of<'a>(by: &'a mut BTreeMap<String, TenantSimStats>, t: &str) -> &'a mut TenantSimStats {
        by.entry(t.to_string()).or_insert_with(|| TenantSimStats {
            tenant: t.to_string(),
            ..TenantSimStats::default()
        })
    }
    let fault = |f: Option<crate::policy::PolicyError>, s: &mut SimStats| {
        if f.is_some() {
            s.policy_faults += 1;
        }
    };
    for (line, r) in trace.iter().enumerate() {
        if cancelled.load(Ordering::Relaxed) {
            return None;
        }
        let now = r.ts_ms.unwrap_or((line as u64 + 1).saturating_mul(1000));
        s.requests += 1;
        of(&mut by, &r.tenant).requests += 1;
        let public: BTreeSet<&str> = r.public.iter().map(|x| x.as_str()).collect();
        for (i, seg) in r.segments.iter().enumerate() {
            if i % 1024 == 1023 && cancelled.load(Ordering::Relaxed) {
                return None;
            }
            let version = r.versions.as_ref().map(|v| v[i]).unwrap_or(1);
            let (tokens, bytes) = (r.tokens[i], r.bytes[i]);
            // A newer version supersedes cached older ones: ask the invalidation hook.
            let prev = latest.get(seg).copied().unwrap_or(i64::MIN);
            if version > prev {
                latest.insert(seg.clone(), version);
                for k in cache.older(seg, version) {
                    let Some(e) = cache.entries.get_mut(&k) else {
                        continue;
                    };
                    e.info.superseded = true;
                    let info = e.info;
                    let (drop, f) = policies.invalidation.invalidate(&info, now);
                    fault(f, &mut s);
                    if drop {
                        if let Some(e) = cache.remove(&k) {
                            s.invalidations += 1;
                            of(&mut by, &e.inserted_by).invalidations += 1;
                        }
                    }
                }
            }
            s.lookups += 1;
            of(&mut by, &r.tenant).lookups += 1;
            let is_public = public.contains(seg.as_str());
            let iso = IsolationInfo {
                segment: opaque_id(seg),
                tenant: opaque_id(&r.tenant),
                public: is_public,
                owner: false,
            };
            let (shared, f) = policies.isolation.isolation(&iso);
            fault(f, &mut s);
            let ns = if shared && is_public {
                None
            } else {
                Some(r.tenant.clone())
            };
            let key = (ns.clone(), seg.clone(), version);
            let count = seen.entry(key.clone()).or_insert(0);
            *count = count.saturating_add(1);
            let seen_count = *count;
            if let Some(e) = cache.entries.get(&key) {
                let (drop, f) = policies.invalidation.invalidate(&e.info, now);
                fault(f, &mut s);
                if drop {
                    if let Some(e) = cache.remove(&key) {
                        s.invalidations += 1;
                        of(&mut by, &e.inserted_by).invalidations += 1;
                    }
                } else {
                    cache.touch(&key, now);
                    s.hits += 1;
                    s.bytes_hit = s.bytes_hit.saturating_add(bytes);
                    s.saved_tokens = s.saved_tokens.saturating_add(tokens);
                    if ns.is_none() {
                        s.shared_hits += 1;
                    }
                    let t = of(&mut by, &r.tenant);
                    t.hits += 1;
                    t.bytes_hit = t.bytes_hit.saturating_add(bytes);
                    continue;
                }
            }
            s.recompute_tokens = s.recompute_tokens.saturating_add(tokens);
            let t = of(&mut by, &r.tenant);
            t.recompute_tokens = t.recompute_tokens.saturating_add(tokens);
            if bytes > capacity_bytes {
                s.rejected += 1;
                of(&mut by, &r.tenant).rejected += 1;
                continue;
            }
            let tenant_key = ns.clone().unwrap_or_default();
            let admit = AdmitInfo {
                id: opaque_id(&format!("{:?}/{seg}/{version}", ns)),
                tenant: ns.as_deref().map(opaque_id).unwrap_or(0),
                bytes,
                recompute_tokens: tokens,
                tenant_used_bytes: cache.tenant_used.get(&tenant_key).copied().unwrap_or(0),
                capacity_bytes,
                seen_count,
                shared: ns.is_none(),
            };
            let (ok, f) = policies.admission.admit(&admit, now);
            fault(f, &mut s);
            if !ok {
                s.rejected += 1;
                of(&mut by, &r.tenant).rejected += 1;
                continue;
            }
            while cache.used.saturating_add(bytes) > capacity_bytes && !cache.entries.is_empty() {
                // The native default takes the least recently used entry, the
                // first of `order`; a Wasm policy chooses among the oldest.
                let offered = if policies.eviction.uses_wasm() {
                    EVICTION_CANDIDATES
                } else {
                    1
                };
                let cands: Vec<&EntryKey> = cache
                    .order
                    .iter()
                    .take(offered)
                    .map(|(_, _, k)| k)
                    .collect();
                let infos: Vec<EntryInfo> = cands.iter().map(|k| cache.entries[*k].info).collect();
                let (victim, f) = policies.eviction.evict(&infos, now);
                fault(f, &mut s);
                let vk = cands[victim.min(cands.len() - 1)].clone();
                let Some(e) = cache.remove(&vk) else { break };
                s.evictions += 1;
                s.bytes_evicted = s.bytes_evicted.saturating_add(e.info.bytes);
                let t = of(&mut by, &e.inserted_by);
                t.evictions += 1;
                t.bytes_evicted = t.bytes_evicted.saturating_add(e.info.bytes);
            }
            let info = EntryInfo {
                id: admit.id,
                tenant: admit.tenant,
                bytes,
                recompute_tokens: tokens,
                last_use_ms: now,
                inserted_ms: now,
                hits: 0,
                shared: ns.is_none(),
                superseded: false,
            };
            s.bytes_inserted = s.bytes_inserted.saturating_add(bytes);
            let t = of(&mut by, &r.tenant);
            t.bytes_inserted = t.bytes_inserted.saturating_add(bytes);
            cache.insert(
                key,
                Entry {
                    info,
                    inserted_by: r.tenant.clone(),
                },
            );
            s.peak_bytes = s.peak_bytes.max(cache.used);
        }
    }
    s.hit_ratio = if s.lookups == 0 {
        0.0
    } else {
        s.hits as f64 / s.lookups as f64
    };
    s.tenants = by
        .into_values()
        .map(|mut t| {
            t.hit_ratio = if t.lookups == 0 {
                0.0
            } else {
                t.hits as f64 / t.lookups as f64
            };
            t
        })
        .collect();
    Some(s)
}

/// Renames the tenants of `stats.tenants` with `pseudonym` (a name already in
/// the recorded traffic's pseudonym form, `t-` and 12 lowercase hex digits, is
/// kept, so the recorded traffic's tenants stay comparable with the request
/// log), then sorts them by the new name.
pub fn pseudonymise(stats: &mut SimStats, pseudonym: impl Fn(&str) -> String) {
    for t in &mut stats.tenants {
        if !is_pseudonym(&t.tenant) {
            t.tenant = pseudonym(&t.tenant);
        }
    }
    stats.tenants.sort_by(|a, b| a.tenant.cmp(&b.tenant));
}

/// Whether `name` has the pseudonym form `t-` + 12 lowercase hex digits.
pub fn is_pseudonym(name: &str) -> bool {
    name.strip_prefix("t-").is_some_and(|h| {
        h.len() == 12
            && h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(tenant: &str, segs: &[(&str, u64, u64)]) -> String {
        serde_json::json!({
            "tenant": tenant,
            "segments": segs.iter().map(|s| s.0).collect::<Vec<_>>(),
            "tokens": segs.iter().map(|s| s.1).collect::<Vec<_>>(),
            "bytes": segs.iter().map(|s| s.2).collect::<Vec<_>>(),
        })
        .to_string()
    }

    #[test]
    fn traces_out_of_bounds_are_refused_naming_the_line() {
        let ok = line("a", &[("x", 10, 100)]);
        let cases = [
            (line("a", &[("x", MAX_TRACE_TOKENS + 1, 1)]), "tokens"),
            (line("a", &[("x", 1, MAX_TRACE_BYTES + 1)]), "bytes"),
            (line("", &[("x", 1, 1)]), "tenant"),
            (line("a", &[("", 1, 1)]), "segment id"),
        ];
        for (bad, what) in cases {
            let e = parse_trace(&format!("{ok}\n{bad}\n")).unwrap_err();
            assert!(e.starts_with("trace line 2:") && e.contains(what), "{e}");
        }
        // More segment occurrences in all than a replay takes.
        let per = 1000;
        let big: Vec<(String, u64, u64)> = (0..per).map(|i| (format!("s{i}"), 1, 1)).collect();
        let big: Vec<(&str, u64, u64)> = big.iter().map(|(s, t, b)| (s.as_str(), *t, *b)).collect();
        let l = line("a", &big);
        let lines = MAX_TRACE_SEGMENTS / per + 1;
        let text = vec![l; lines].join("\n");
        let e = parse_trace(&text).unwrap_err();
        assert!(e.contains("segments in all"), "{e}");
        assert!(parse_trace(&ok).is_ok());
    }

    #[test]
    fn the_largest_values_do_not_overflow_a_replay() {
        let seg = ("x", MAX_TRACE_TOKENS, MAX_TRACE_BYTES);
        let text = vec![line("a", &[seg]); 2000].join("\n");
        let trace = parse_trace(&text).unwrap();
        let s = simulate(&trace, 1 << 50, &mut PolicySet::native());
        assert_eq!((s.lookups, s.hits), (2000, 1999));
        assert_eq!(s.saved_tokens, 1999 * MAX_TRACE_TOKENS);
        assert_eq!(s.bytes_inserted, MAX_TRACE_BYTES);
    }

    #[test]
    fn a_cancelled_replay_stops() {
        let trace = parse_trace(&line("a", &[("x", 1, 1)])).unwrap();
        let stop = AtomicBool::new(true);
        assert!(simulate_until(&trace, 10, &mut PolicySet::native(), &stop).is_none());
        let go = AtomicBool::new(false);
        assert!(simulate_until(&trace, 10, &mut PolicySet::native(), &go).is_some());
    }

    /// The plain replay the indexed one must equal: every entry in one map, the
    /// eviction candidates sorted afresh at each eviction, older versions found
    /// by a scan (the native policies: LRU eviction, admit all, drop superseded).
    fn reference(trace: &[TraceRecord], cap: u64) -> (u64, u64, u64, u64) {
        let mut cache: HashMap<(String, i64), (u64, u64, u64)> = HashMap::new();
        let mut latest: HashMap<String, i64> = HashMap::new();
        let (mut hits, mut evictions, mut invalidations, mut used) = (0, 0, 0, 0u64);
        for (line, r) in trace.iter().enumerate() {
            let now = (line as u64 + 1) * 1000;
            for (i, seg) in r.segments.iter().enumerate() {
                let v = r.versions.as_ref().map(|v| v[i]).unwrap_or(1);
                // Only a version newer than any seen supersedes.
                let newest = latest.get(seg).is_none_or(|&l| v > l);
                if newest {
                    latest.insert(seg.clone(), v);
                }
                let stale: Vec<_> = cache
                    .keys()
                    .filter(|k| newest && &k.0 == seg && k.1 < v)
                    .cloned()
                    .collect();
                for k in stale {
                    used -= cache.remove(&k).unwrap().2;
                    invalidations += 1;
                }
                let key = (seg.clone(), v);
                if let Some(e) = cache.get_mut(&key) {
                    e.0 = now;
                    hits += 1;
                    continue;
                }
                let b = r.bytes[i];
                if b > cap {
                    continue;
                }
                while used + b > cap {
                    let victim = cache
                        .iter()
                        .min_by_key(|(k, e)| (e.0, e.1, (*k).clone()))
                        .map(|(k, _)| k.clone())
                        .unwrap();
                    used -= cache.remove(&victim).unwrap().2;
                    evictions += 1;
                }
                cache.insert(key, (now, now, b));
                used += b;
            }
        }
        (hits, evictions, invalidations, used)
    }

    #[test]
    fn the_indexed_replay_equals_the_plain_one() {
        // A deterministic mix of reuse, new versions and evictions.
        let mut x: u64 = 7;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut lines = vec![];
        for _ in 0..400 {
            let n = 1 + next() % 4;
            let segs: Vec<String> = (0..n).map(|_| format!("s{}", next() % 30)).collect();
            let versions: Vec<i64> = segs.iter().map(|_| 1 + (next() % 3) as i64).collect();
            let bytes: Vec<u64> = segs.iter().map(|_| 1 + next() % 50).collect();
            lines.push(
                serde_json::json!({
                    "tenant": "a", "segments": segs, "tokens": bytes, "bytes": bytes,
                    "versions": versions,
                })
                .to_string(),
            );
        }
        let trace = parse_trace(&lines.join("\n")).unwrap();
        for cap in [40, 200, 10_000] {
            let s = simulate(&trace, cap, &mut PolicySet::native());
            let (hits, evictions, invalidations, _) = reference(&trace, cap);
            assert_eq!(
                (s.hits, s.evictions, s.invalidations),
                (hits, evictions, invalidations),
                "capacity {cap}"
            );
        }
    }
}
