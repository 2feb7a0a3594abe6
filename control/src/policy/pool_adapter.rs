//! Bridges the control plane's policy runtime (Wasm or native) into the data plane's
//! cache pools: [`RuntimePoolPolicy`] implements `dataplane::pic::pool::CachePolicy`,
//! so the active eviction and admission policies decide what the PIC engine's public
//! pool keeps (`PicEngine::set_public_policy`).
use super::{AdmitInfo, EntryInfo, PolicyRuntime};
use dataplane::pic::pool::{owner_group, CachePolicy, Decider, Decision, EntryMeta};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Arc;

/// A pool policy that asks the [`PolicyRuntime`] (whatever it has active; faults fall
/// back to the native default inside the runtime).
pub struct RuntimePoolPolicy {
    rt: Arc<PolicyRuntime>,
    capacity: u64,
    /// Per-entry sightings for admit-on-second-sighting style policies.
    seen: HashMap<[u8; 32], u32>,
    fair: bool,
}

impl RuntimePoolPolicy {
    /// Policy over `rt` for a pool of `capacity_bytes`.
    pub fn new(rt: Arc<PolicyRuntime>, capacity_bytes: usize) -> Self {
        RuntimePoolPolicy {
            rt,
            capacity: capacity_bytes as u64,
            seen: HashMap::new(),
            fair: true,
        }
    }

    /// Turns the pool's fair sharing between tenants on (the default) or off
    /// (`dataplane::pic::pool::CachePolicy::fair_share`).
    pub fn with_fair_share(mut self, on: bool) -> Self {
        self.fair = on;
        self
    }
}

/// Most candidate keys whose sighting counts are remembered (about 4 MiB);
/// past it the counts start over.
pub const SEEN_CAP: usize = 1 << 16;

fn id64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("at least 8 bytes"))
}

/// Owner group of the shared namespace (see `IsolationKeyer::isolation_key`).
const SHARED_GROUP: &str = "shared";

/// The opaque tenant id a policy sees: a hash of the owner group (the tenant the
/// bytes are charged to), 0 for the shared namespace.
fn tenant_id(owner: &str) -> u64 {
    match owner_group(owner) {
        SHARED_GROUP => 0,
        g => id64(&Sha256::digest(g.as_bytes())),
    }
}

fn is_shared(owner: &str) -> bool {
    owner_group(owner) == SHARED_GROUP
}

fn info(m: &EntryMeta) -> EntryInfo {
    EntryInfo {
        id: id64(&m.key),
        tenant: tenant_id(&m.owner),
        bytes: m.bytes as u64,
        recompute_tokens: m.tokens as u64,
        last_use_ms: m.last_use_ms,
        inserted_ms: m.inserted_ms,
        hits: m.hits.min(u32::MAX as u64) as u32,
        shared: is_shared(&m.owner),
        superseded: false,
    }
}

impl CachePolicy for RuntimePoolPolicy {
    fn name(&self) -> &str {
        "control-plane"
    }

    fn admit(&mut self, c: &EntryMeta, owner_used_bytes: usize) -> bool {
        if self.seen.len() >= SEEN_CAP && !self.seen.contains_key(&c.key) {
            // Sighting counts are a hint: forget them all rather than let every
            // distinct prompt segment ever offered stay in memory.
            self.seen.clear();
        }
        let seen = self.seen.entry(c.key).or_insert(0);
        *seen = seen.saturating_add(1);
        let a = AdmitInfo {
            id: id64(&c.key),
            tenant: tenant_id(&c.owner),
            bytes: c.bytes as u64,
            recompute_tokens: c.tokens as u64,
            tenant_used_bytes: owner_used_bytes as u64,
            capacity_bytes: self.capacity,
            seen_count: *seen,
            shared: is_shared(&c.owner),
        };
        self.rt.admit(&a, catalog_now())
    }

    fn victim(&mut self, entries: &[EntryMeta]) -> Option<usize> {
        let infos: Vec<EntryInfo> = entries.iter().map(info).collect();
        let i = self.rt.evict(&infos, catalog_now());
        (i < entries.len()).then_some(i)
    }

    fn fair_share(&self) -> bool {
        self.fair
    }

    /// The runtime's active policy of the hook: `{kind} policy #{id}` with its
    /// catalog id when a Wasm policy runs, else `native default` (also when the
    /// active Wasm policy was disabled after faults).
    fn decider(&self, kind: Decision) -> Decider {
        let k = match kind {
            Decision::Admission => super::PolicyKind::Admission,
            Decision::Eviction => super::PolicyKind::Eviction,
        };
        match self.rt.active_id(k) {
            Some(id) if self.rt.is_wasm(k) => Decider {
                name: format!("{} policy #{id}", k.as_str()),
                policy_id: Some(id),
            },
            _ => Decider {
                name: "native default".into(),
                policy_id: None,
            },
        }
    }
}

fn catalog_now() -> u64 {
    crate::catalog::now_ms().max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{builtin, policy_engine, PolicyKind, PolicyLimits};
    use dataplane::pic::pool::{Insert, Pool};

    fn runtime() -> Arc<PolicyRuntime> {
        Arc::new(PolicyRuntime::new(
            policy_engine(),
            PolicyLimits::default(),
            None,
        ))
    }

    #[test]
    fn native_default_is_lru_in_the_data_plane_pool() {
        let rt = runtime();
        let mut p: Pool<u8> = Pool::new(100, Box::new(RuntimePoolPolicy::new(rt, 100)));
        p.insert([1; 32], Arc::new(1), 40, 10, "a");
        p.insert([2; 32], Arc::new(2), 40, 10, "a");
        assert!(p.get(&[1; 32]).is_some());
        assert_eq!(
            p.insert([3; 32], Arc::new(3), 40, 10, "a"),
            Insert::Stored { evicted: 1 }
        );
        assert!(p.contains(&[1; 32]) && !p.contains(&[2; 32]));
    }

    #[test]
    fn sighting_counts_stay_bounded() {
        // Every distinct segment a client sends is offered to admission once; the
        // counts of keys never seen again must not accumulate without bound.
        let mut p = RuntimePoolPolicy::new(runtime(), 1 << 20);
        for i in 0..(SEEN_CAP as u64 + 1000) {
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&i.to_le_bytes());
            let meta = EntryMeta {
                key,
                bytes: 1,
                hits: 0,
                last_use: i,
                inserted: i,
                last_use_ms: i,
                inserted_ms: i,
                tokens: 1,
                owner: "t".into(),
            };
            assert!(p.admit(&meta, 0));
        }
        assert!(
            p.seen.len() <= SEEN_CAP,
            "{} sighting counts kept",
            p.seen.len()
        );
    }

    #[test]
    fn wasm_quota_admission_limits_each_owner() {
        // quota.wasm with 500 ‰: an owner may hold at most half the pool; another
        // owner is not affected, and freed bytes can be used again.
        let rt = runtime();
        let (_, _, bytes) = builtin::ALL
            .iter()
            .find(|(n, _, _)| *n == "quota")
            .expect("built-in");
        rt.activate_module(
            PolicyKind::Admission,
            None,
            bytes,
            &serde_json::json!({"quota_permille": 500}),
        )
        .expect("loads");
        let mut p: Pool<u8> = Pool::new(1000, Box::new(RuntimePoolPolicy::new(rt, 1000)));
        assert_eq!(
            p.insert([1; 32], Arc::new(1), 300, 10, "a"),
            Insert::Stored { evicted: 0 }
        );
        assert_eq!(
            p.insert([2; 32], Arc::new(1), 300, 10, "a"),
            Insert::NotAdmitted,
            "a would hold 600 of 1000 bytes"
        );
        assert_eq!(
            p.insert([3; 32], Arc::new(1), 300, 10, "b"),
            Insert::Stored { evicted: 0 }
        );
        assert!(p.remove(&[1; 32]));
        assert_eq!(
            p.insert([2; 32], Arc::new(1), 300, 10, "a"),
            Insert::Stored { evicted: 0 }
        );
    }

    #[test]
    fn refusals_and_evictions_name_the_active_catalog_policy() {
        let rt = runtime();
        let (_, _, bytes) = builtin::ALL
            .iter()
            .find(|(n, _, _)| *n == "quota")
            .expect("built-in");
        rt.activate_module(
            PolicyKind::Admission,
            Some(41),
            bytes,
            &serde_json::json!({"quota_permille": 500}),
        )
        .expect("loads");
        let mut p: Pool<u8> = Pool::new(1000, Box::new(RuntimePoolPolicy::new(rt, 1000)));
        p.insert([1; 32], Arc::new(1), 400, 10, "a");
        assert_eq!(
            p.insert([2; 32], Arc::new(1), 400, 10, "a"),
            Insert::NotAdmitted
        );
        let by = p.history(&[2; 32])[0].decided_by.clone().expect("decider");
        assert_eq!(
            (by.name.as_str(), by.policy_id),
            ("admission policy #41", Some(41))
        );
        // Eviction runs the native default: named so, with no catalog id.
        p.insert([3; 32], Arc::new(1), 400, 10, "b");
        p.insert([4; 32], Arc::new(1), 400, 10, "c");
        let evicted: Vec<_> = [[1u8; 32], [3; 32]]
            .iter()
            .flat_map(|k| p.history(k))
            .filter(|e| e.kind == dataplane::pic::pool::EventKind::Evicted)
            .collect();
        assert_eq!(evicted.len(), 1, "one entry made room for c");
        let by = evicted[0].decided_by.clone().expect("decider");
        assert_eq!((by.name.as_str(), by.policy_id), ("native default", None));
    }

    #[test]
    fn wasm_second_sighting_admission_controls_the_pool() {
        let rt = runtime();
        let (_, _, bytes) = builtin::ALL
            .iter()
            .find(|(n, _, _)| *n == "second_sighting")
            .expect("built-in");
        rt.activate_module(PolicyKind::Admission, None, bytes, &serde_json::json!({}))
            .expect("loads");
        let mut p: Pool<u8> = Pool::new(1000, Box::new(RuntimePoolPolicy::new(rt, 1000)));
        assert_eq!(
            p.insert([7; 32], Arc::new(1), 10, 10, "a"),
            Insert::NotAdmitted
        );
        assert_eq!(
            p.insert([7; 32], Arc::new(1), 10, 10, "a"),
            Insert::Stored { evicted: 0 }
        );
    }
}
