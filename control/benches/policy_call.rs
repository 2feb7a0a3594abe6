//! Measures the cost of one policy call on the hot path (ns/call), through
//! the live `PolicyRuntime` (mutex, input encoding, fuel reset, Wasm call).
//! Run: `cargo bench -p hypic-control --bench policy_call`.

use std::hint::black_box;
use std::time::Instant;

use hypic_control::policy::{
    builtin, policy_engine, AdmitInfo, EntryInfo, IsolationInfo, PolicyKind, PolicyLimits,
    PolicyRuntime,
};
use serde_json::json;

fn measure(name: &str, iters: u64, mut f: impl FnMut() -> u64) {
    for _ in 0..iters / 10 {
        black_box(f());
    }
    let t = Instant::now();
    let mut acc = 0u64;
    for _ in 0..iters {
        acc = acc.wrapping_add(f());
    }
    let ns = t.elapsed().as_nanos() as f64 / iters as f64;
    black_box(acc);
    println!("{name:<44} {ns:>9.1} ns/call");
}

fn main() {
    let iters: u64 = std::env::var("ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
    let rt = PolicyRuntime::new(policy_engine(), PolicyLimits::default(), None);
    let cands = |n: usize| -> Vec<EntryInfo> {
        (0..n)
            .map(|i| EntryInfo {
                id: i as u64,
                tenant: 1,
                bytes: 1000 + i as u64,
                recompute_tokens: 100,
                last_use_ms: (i as u64 * 7919) % 1000,
                inserted_ms: 1,
                hits: i as u32 % 5,
                shared: false,
                superseded: false,
            })
            .collect()
    };
    let c8 = cands(8);
    let c64 = cands(64);
    let admit = AdmitInfo {
        id: 1,
        tenant: 2,
        bytes: 4096,
        recompute_tokens: 100,
        tenant_used_bytes: 1 << 20,
        capacity_bytes: 1 << 30,
        seen_count: 2,
        shared: false,
    };
    let iso = IsolationInfo {
        segment: 1,
        tenant: 2,
        public: true,
        owner: false,
    };

    measure("native eviction (LRU, 8 candidates)", iters, || {
        rt.evict(&c8, 0) as u64
    });
    rt.activate_module(
        PolicyKind::Eviction,
        None,
        builtin::module("lru").unwrap(),
        &json!({}),
    )
    .unwrap();
    measure("wasm eviction lru.wasm (8 candidates)", iters, || {
        rt.evict(&c8, 0) as u64
    });
    measure("wasm eviction lru.wasm (64 candidates)", iters, || {
        rt.evict(&c64, 0) as u64
    });
    rt.activate_module(
        PolicyKind::Eviction,
        None,
        builtin::module("gdsf").unwrap(),
        &json!({}),
    )
    .unwrap();
    measure("wasm eviction gdsf.wasm (8 candidates)", iters, || {
        rt.evict(&c8, 0) as u64
    });
    measure("native admission (admit all)", iters, || {
        rt.admit(&admit, 0) as u64
    });
    rt.activate_module(
        PolicyKind::Admission,
        None,
        builtin::module("quota").unwrap(),
        &json!({}),
    )
    .unwrap();
    measure("wasm admission quota.wasm", iters, || {
        rt.admit(&admit, 0) as u64
    });
    rt.activate_module(
        PolicyKind::Admission,
        None,
        builtin::module("second_sighting").unwrap(),
        &json!({}),
    )
    .unwrap();
    measure("wasm admission second_sighting.wasm", iters, || {
        rt.admit(&admit, 0) as u64
    });
    rt.activate_module(
        PolicyKind::Isolation,
        None,
        builtin::module("shared").unwrap(),
        &json!({}),
    )
    .unwrap();
    measure("wasm isolation shared.wasm", iters, || {
        rt.isolation(&iso) as u64
    });
    let e = c8[0];
    rt.activate_module(
        PolicyKind::Invalidation,
        None,
        builtin::module("ttl").unwrap(),
        &json!({}),
    )
    .unwrap();
    measure("wasm invalidation ttl.wasm", iters, || {
        rt.invalidate(&e, 10) as u64
    });
    assert_eq!(rt.metrics().faults(PolicyKind::Eviction), 0);
}
