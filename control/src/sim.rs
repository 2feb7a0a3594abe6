//! A cache simulator for policy dry runs: replays a recorded request trace
//! (JSONL) through a [`PolicySet`] and reports hit ratio, bytes and
//! recompute tokens.

use std::collections::{BTreeMap, BTreeSet, HashMap};

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

/// Parses a JSONL trace; errors name the line.
pub fn parse_trace(text: &str) -> Result<Vec<TraceRecord>, String> {
    let mut out = Vec::new();
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
        out.push(r);
        if out.len() > 200_000 {
            return Err("trace has more than 200000 requests".into());
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
    segment: String,
    version: i64,
    tenant_ns: Option<String>,
    /// The trace tenant whose request inserted it.
    inserted_by: String,
}

/// Replays `trace` through a cache of `capacity_bytes` governed by `policies`.
pub fn simulate(trace: &[TraceRecord], capacity_bytes: u64, policies: &mut PolicySet) -> SimStats {
    let mut s = SimStats::default();
    let mut entries: HashMap<EntryKey, Entry> = HashMap::new();
    let mut used: u64 = 0;
    let mut tenant_used: HashMap<String, u64> = HashMap::new();
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
        let now = r.ts_ms.unwrap_or((line as u64 + 1) * 1000);
        s.requests += 1;
        of(&mut by, &r.tenant).requests += 1;
        let public: BTreeSet<&str> = r.public.iter().map(|x| x.as_str()).collect();
        for (i, seg) in r.segments.iter().enumerate() {
            let version = r.versions.as_ref().map(|v| v[i]).unwrap_or(1);
            let (tokens, bytes) = (r.tokens[i], r.bytes[i]);
            // A newer version supersedes cached older ones: ask the invalidation hook.
            let prev = latest.get(seg).copied().unwrap_or(i64::MIN);
            if version > prev {
                latest.insert(seg.clone(), version);
                let stale: Vec<_> = entries
                    .iter()
                    .filter(|(k, _)| &k.1 == seg && k.2 < version)
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in stale {
                    let mut info = entries[&k].info;
                    info.superseded = true;
                    entries.get_mut(&k).expect("present").info.superseded = true;
                    let (drop, f) = policies.invalidation.invalidate(&info, now);
                    fault(f, &mut s);
                    if drop {
                        let e = entries.remove(&k).expect("present");
                        remove_bytes(&mut used, &mut tenant_used, &e);
                        s.invalidations += 1;
                        of(&mut by, &e.inserted_by).invalidations += 1;
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
            if let Some(e) = entries.get(&key) {
                let (drop, f) = policies.invalidation.invalidate(&e.info, now);
                fault(f, &mut s);
                if drop {
                    let e = entries.remove(&key).expect("present");
                    remove_bytes(&mut used, &mut tenant_used, &e);
                    s.invalidations += 1;
                    of(&mut by, &e.inserted_by).invalidations += 1;
                } else {
                    let e = entries.get_mut(&key).expect("present");
                    e.info.hits = e.info.hits.saturating_add(1);
                    e.info.last_use_ms = now;
                    s.hits += 1;
                    s.bytes_hit += bytes;
                    s.saved_tokens += tokens;
                    if ns.is_none() {
                        s.shared_hits += 1;
                    }
                    let t = of(&mut by, &r.tenant);
                    t.hits += 1;
                    t.bytes_hit += bytes;
                    continue;
                }
            }
            s.recompute_tokens += tokens;
            of(&mut by, &r.tenant).recompute_tokens += tokens;
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
                tenant_used_bytes: tenant_used.get(&tenant_key).copied().unwrap_or(0),
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
            while used + bytes > capacity_bytes && !entries.is_empty() {
                let mut cands: Vec<(&EntryKey, &Entry)> = entries.iter().collect();
                cands.sort_by(|a, b| {
                    (a.1.info.last_use_ms, a.1.info.inserted_ms, a.0).cmp(&(
                        b.1.info.last_use_ms,
                        b.1.info.inserted_ms,
                        b.0,
                    ))
                });
                let infos: Vec<EntryInfo> = cands.iter().map(|(_, e)| e.info).collect();
                let (victim, f) = policies.eviction.evict(&infos, now);
                fault(f, &mut s);
                let vk = cands[victim.min(cands.len() - 1)].0.clone();
                let e = entries.remove(&vk).expect("present");
                remove_bytes(&mut used, &mut tenant_used, &e);
                s.evictions += 1;
                s.bytes_evicted += e.info.bytes;
                let t = of(&mut by, &e.inserted_by);
                t.evictions += 1;
                t.bytes_evicted += e.info.bytes;
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
            used += bytes;
            *tenant_used.entry(tenant_key).or_insert(0) += bytes;
            s.bytes_inserted += bytes;
            of(&mut by, &r.tenant).bytes_inserted += bytes;
            s.peak_bytes = s.peak_bytes.max(used);
            entries.insert(
                key,
                Entry {
                    info,
                    segment: seg.clone(),
                    version,
                    tenant_ns: ns,
                    inserted_by: r.tenant.clone(),
                },
            );
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
    s
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

fn remove_bytes(used: &mut u64, tenant_used: &mut HashMap<String, u64>, e: &Entry) {
    let _ = (&e.segment, e.version);
    *used = used.saturating_sub(e.info.bytes);
    let k = e.tenant_ns.clone().unwrap_or_default();
    if let Some(t) = tenant_used.get_mut(&k) {
        *t = t.saturating_sub(e.info.bytes);
    }
}
