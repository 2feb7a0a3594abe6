//! Wasm policy tests: built-in policies answer as specified, hostile modules
//! are contained (native default used, fault counted and audited), and the
//! simulator reports what a trace does under each policy.

use crate::common;

use std::sync::Arc;

use hypic_control::policy::{
    builtin, native, policy_engine, AdmitInfo, AuditSink, EntryInfo, IsolationInfo, PolicyError,
    PolicyKind, PolicyLimits, PolicyRuntime, PolicySet, PolicySlot, WasmPolicy,
};
use hypic_control::sim::{parse_trace, simulate};
use serde_json::json;

fn load(name: &str, kind: PolicyKind, params: serde_json::Value) -> PolicySlot {
    let p = WasmPolicy::load(
        &policy_engine(),
        kind,
        builtin::module(name).unwrap(),
        &params,
        PolicyLimits::default(),
    )
    .unwrap_or_else(|e| panic!("builtin {name}: {e}"));
    PolicySlot::wasm(p, None)
}

fn entry(id: u64, bytes: u64, tokens: u64, last_use: u64, hits: u32) -> EntryInfo {
    EntryInfo {
        id,
        tenant: 9,
        bytes,
        recompute_tokens: tokens,
        last_use_ms: last_use,
        inserted_ms: 1,
        hits,
        shared: false,
        superseded: false,
    }
}

#[test]
fn builtin_lru_picks_least_recently_used() {
    let mut s = load("lru", PolicyKind::Eviction, json!({}));
    let c = [
        entry(1, 10, 10, 500, 0),
        entry(2, 10, 10, 100, 9),
        entry(3, 10, 10, 300, 0),
    ];
    assert_eq!(s.evict(&c, 1000), (1, None));
    assert_eq!(native::evict(&c), 1);
    let c2 = [entry(1, 10, 10, 50, 0), entry(2, 10, 10, 100, 9)];
    assert_eq!(s.evict(&c2, 1000), (0, None));
}

#[test]
fn builtin_gdsf_evicts_lowest_value_per_byte() {
    let mut s = load("gdsf", PolicyKind::Eviction, json!({}));
    // values: (hits+1)*tokens/bytes = 1*1000/1000=1, 10*100/100=10, 1*10/1000=0.01
    let c = [
        entry(1, 1000, 1000, 1, 0),
        entry(2, 100, 100, 2, 9),
        entry(3, 1000, 10, 3, 0),
    ];
    assert_eq!(s.evict(&c, 10), (2, None));
    // Tie on value: least recently used loses.
    let c = [entry(1, 100, 100, 7, 0), entry(2, 100, 100, 5, 0)];
    assert_eq!(s.evict(&c, 10), (1, None));
}

#[test]
fn builtin_quota_caps_each_tenant() {
    let mut s = load(
        "quota",
        PolicyKind::Admission,
        json!({"quota_permille": 250}),
    );
    let a = AdmitInfo {
        id: 1,
        tenant: 5,
        bytes: 100,
        recompute_tokens: 10,
        tenant_used_bytes: 100,
        capacity_bytes: 1000,
        seen_count: 1,
        shared: false,
    };
    assert_eq!(s.admit(&a, 0), (true, None)); // 200 <= 250
    assert_eq!(
        s.admit(
            &AdmitInfo {
                tenant_used_bytes: 200,
                ..a
            },
            0
        ),
        (false, None)
    ); // 300 > 250
    assert_eq!(
        s.admit(
            &AdmitInfo {
                tenant_used_bytes: 200,
                shared: true,
                ..a
            },
            0
        ),
        (true, None)
    );
    let mut b = load("quota", PolicyKind::Admission, json!({"quota_bytes": 150}));
    assert_eq!(b.admit(&a, 0), (false, None));
    assert_eq!(
        b.admit(
            &AdmitInfo {
                tenant_used_bytes: 50,
                ..a
            },
            0
        ),
        (true, None)
    );
}

#[test]
fn builtin_second_sighting() {
    let mut s = load("second_sighting", PolicyKind::Admission, json!({}));
    let a = AdmitInfo {
        seen_count: 1,
        bytes: 1,
        capacity_bytes: 10,
        ..Default::default()
    };
    assert_eq!(s.admit(&a, 0), (false, None));
    assert_eq!(s.admit(&AdmitInfo { seen_count: 2, ..a }, 0), (true, None));
    let mut three = load(
        "second_sighting",
        PolicyKind::Admission,
        json!({"min_sightings": 3}),
    );
    assert_eq!(
        three.admit(&AdmitInfo { seen_count: 2, ..a }, 0),
        (false, None)
    );
    assert_eq!(
        three.admit(&AdmitInfo { seen_count: 3, ..a }, 0),
        (true, None)
    );
}

#[test]
fn builtin_ttl_and_on_update() {
    let mut ttl = load("ttl", PolicyKind::Invalidation, json!({"ttl_ms": 1000}));
    let e = EntryInfo {
        inserted_ms: 5000,
        ..entry(1, 1, 1, 5000, 0)
    };
    assert_eq!(ttl.invalidate(&e, 5500), (false, None));
    assert_eq!(ttl.invalidate(&e, 6001), (true, None));
    assert_eq!(
        ttl.invalidate(
            &EntryInfo {
                superseded: true,
                ..e
            },
            5001
        ),
        (true, None)
    );
    let mut upd = load("on_update", PolicyKind::Invalidation, json!({}));
    assert_eq!(upd.invalidate(&e, 999_999_999), (false, None));
    assert_eq!(
        upd.invalidate(
            &EntryInfo {
                superseded: true,
                ..e
            },
            0
        ),
        (true, None)
    );
}

#[test]
fn builtin_isolation_strict_vs_shared_and_host_never_widens() {
    let public = IsolationInfo {
        segment: 1,
        tenant: 2,
        public: true,
        owner: false,
    };
    let private = IsolationInfo {
        public: false,
        ..public
    };
    let mut strict = load("strict", PolicyKind::Isolation, json!({}));
    let mut shared = load("shared", PolicyKind::Isolation, json!({}));
    assert_eq!(strict.isolation(&public), (false, None));
    assert_eq!(shared.isolation(&public), (true, None));
    assert_eq!(shared.isolation(&private), (false, None));
    // A policy that always says "shared" still cannot share a private segment.
    let always = wat::parse_str(module(
        "isolation",
        "(func (export \"hypic_isolation\") (result i32) i32.const 1)",
    ))
    .unwrap();
    let mut slot = PolicySlot::wasm(
        WasmPolicy::load(
            &policy_engine(),
            PolicyKind::Isolation,
            &always,
            &json!({}),
            PolicyLimits::default(),
        )
        .unwrap(),
        None,
    );
    assert_eq!(slot.isolation(&private), (false, None));
    assert_eq!(slot.isolation(&public), (true, None));
}

#[test]
fn params_must_be_integers() {
    // A module without a parameter schema (ABI v1): integers and booleans only.
    let v1 = wat::parse_str(module(
        "eviction",
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) i32.const 0)"#,
    ))
    .unwrap();
    let e = WasmPolicy::load(
        &policy_engine(),
        PolicyKind::Eviction,
        &v1,
        &json!({"x": "str"}),
        PolicyLimits::default(),
    );
    assert!(
        matches!(&e, Err(PolicyError::Param { name, message }) if name == "x" && message.contains("integer")),
        "{:?}",
        e.err()
    );
    // A built-in declares its parameters: lru has none, so any is refused by name.
    let e = WasmPolicy::load(
        &policy_engine(),
        PolicyKind::Eviction,
        builtin::module("lru").unwrap(),
        &json!({"x": 1}),
        PolicyLimits::default(),
    );
    assert!(
        matches!(&e, Err(PolicyError::Param { name, message }) if name == "x" && message.contains("declares no parameters")),
        "{:?}",
        e.err()
    );
    let e = WasmPolicy::load(
        &policy_engine(),
        PolicyKind::Admission,
        builtin::module("lru").unwrap(),
        &json!({}),
        PolicyLimits::default(),
    );
    assert!(
        matches!(e, Err(PolicyError::Invalid(_))),
        "an eviction module is not an admission policy"
    );
}

// ---- hostile policies ------------------------------------------------------------

/// A complete ABI-v1 module of `kind` whose hook is `hook` (WAT).
fn module(kind: &str, hook: &str) -> String {
    let code = match kind {
        "eviction" => 1,
        "admission" => 2,
        "invalidation" => 3,
        _ => 4,
    };
    format!(
        r#"(module
          (memory (export "memory") 1)
          (func (export "hypic_abi_version") (result i32) i32.const 1)
          (func (export "hypic_policy_kind") (result i32) i32.const {code})
          (func (export "hypic_buf") (result i32) i32.const 0)
          (func (export "hypic_buf_cap") (result i32) i32.const 65536)
          (func (export "hypic_configure") (param i32) (result i32) i32.const 0)
          {hook})"#
    )
}

struct Harness {
    rt: PolicyRuntime,
    sink: AuditSink,
    catalog: hypic_control::Catalog,
    _dir: tempfile::TempDir,
}

async fn harness() -> Harness {
    let (catalog, dir) = common::sqlite_catalog().await;
    let sink = AuditSink::spawn(catalog.clone());
    let rt = PolicyRuntime::new(policy_engine(), PolicyLimits::default(), Some(sink.clone()));
    Harness {
        rt,
        sink,
        catalog,
        _dir: dir,
    }
}

impl Harness {
    async fn fault_rows(&self) -> Vec<serde_json::Value> {
        self.sink.flush().await;
        self.catalog
            .audit_log(Some("policy.fault"), 100)
            .await
            .unwrap()
            .iter()
            .map(|e| serde_json::from_str(&e.detail).unwrap())
            .collect()
    }
}

fn cands() -> Vec<EntryInfo> {
    vec![
        entry(1, 10, 10, 300, 0),
        entry(2, 10, 10, 100, 0),
        entry(3, 10, 10, 200, 0),
    ]
}

/// Runs an eviction module that activates fine but misbehaves on every call:
/// each call must return the native LRU answer (index 1), count a fault of
/// `reason`, and the first one must be audited.
async fn assert_contained_at_call(hook: &str, reason: &str) {
    let h = harness().await;
    let wasm = wat::parse_str(module("eviction", hook)).unwrap();
    h.rt.activate_module(PolicyKind::Eviction, Some(42), &wasm, &json!({}))
        .expect("module loads");
    assert!(h.rt.is_wasm(PolicyKind::Eviction));
    for i in 1..=3u64 {
        assert_eq!(h.rt.evict(&cands(), 1000), 1, "native LRU answer expected");
        assert_eq!(h.rt.metrics().faults(PolicyKind::Eviction), i);
        assert_eq!(h.rt.metrics().fallbacks(PolicyKind::Eviction), i);
    }
    assert_eq!(
        h.rt.metrics()
            .faults_by_reason(PolicyKind::Eviction, reason),
        3
    );
    let rows = h.fault_rows().await;
    assert_eq!(
        rows.len(),
        1,
        "one audit row per reason per interval: {rows:?}"
    );
    assert_eq!(rows[0]["reason"], reason);
    assert_eq!(rows[0]["kind"], "eviction");
    assert_eq!(rows[0]["fallback"], "native default");
    let row = &h.catalog.audit_log(Some("policy.fault"), 1).await.unwrap()[0];
    assert_eq!(row.target, "42");
    // The runtime keeps working: other hooks are unaffected.
    assert!(h.rt.admit(&AdmitInfo::default(), 0));
}

/// A module that fails to load when activated: native default installed,
/// fault counted as `load`, audited.
async fn assert_contained_at_load(wat_src: &str, expect_msg: &str) {
    let h = harness().await;
    let wasm = wat::parse_str(wat_src).unwrap();
    let err =
        h.rt.activate_module(PolicyKind::Eviction, Some(7), &wasm, &json!({}))
            .unwrap_err();
    assert!(
        err.to_string().contains(expect_msg),
        "error {err} should mention {expect_msg:?}"
    );
    assert!(!h.rt.is_wasm(PolicyKind::Eviction));
    assert_eq!(h.rt.evict(&cands(), 1000), 1);
    assert_eq!(
        h.rt.metrics()
            .faults_by_reason(PolicyKind::Eviction, "load"),
        1
    );
    let rows = h.fault_rows().await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["reason"], "load");
}

#[tokio::test]
async fn hostile_infinite_loop_times_out() {
    assert_contained_at_call(r#"(func (export "hypic_evict") (param i32 i64) (result i32) (loop $l (br $l)) i32.const 0)"#, "timeout").await;
}

#[tokio::test]
async fn hostile_memory_bomb_hits_limit() {
    // Grows by 1 GiB at once; the store limit (16 MiB) makes growth trap.
    assert_contained_at_call(
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) (drop (memory.grow (i32.const 16384))) i32.const 0)"#,
        "memory",
    )
    .await;
}

#[tokio::test]
async fn hostile_memory_bomb_page_by_page() {
    // Grows one page at a time forever: stopped by the memory limit before fuel.
    assert_contained_at_call(
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) (loop $l (drop (memory.grow (i32.const 1))) (br $l)) i32.const 0)"#,
        "memory",
    )
    .await;
}

#[tokio::test]
async fn hostile_huge_initial_memory_rejected() {
    let src = module(
        "eviction",
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) i32.const 0)"#,
    )
    .replace(
        r#"(memory (export "memory") 1)"#,
        r#"(memory (export "memory") 1024)"#,
    );
    assert_contained_at_load(&src, "memory").await;
}

#[tokio::test]
async fn hostile_out_of_range_victim() {
    assert_contained_at_call(r#"(func (export "hypic_evict") (param i32 i64) (result i32) local.get 0 i32.const 5 i32.add)"#, "bad_return").await;
}

#[tokio::test]
async fn hostile_negative_victim() {
    assert_contained_at_call(
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) i32.const -1)"#,
        "bad_return",
    )
    .await;
}

#[tokio::test]
async fn hostile_trap() {
    assert_contained_at_call(
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) unreachable)"#,
        "trap",
    )
    .await;
}

#[tokio::test]
async fn hostile_missing_export() {
    assert_contained_at_load(&module("eviction", ""), "missing export `hypic_evict`").await;
}

#[tokio::test]
async fn hostile_wrong_signature() {
    assert_contained_at_load(
        &module(
            "eviction",
            r#"(func (export "hypic_evict") (param i32) (result i64) i64.const 0)"#,
        ),
        "signature",
    )
    .await;
}

#[tokio::test]
async fn hostile_imports_rejected() {
    let src = module(
        "eviction",
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) i32.const 0)"#,
    )
    .replacen("(module", r#"(module (import "env" "f" (func))"#, 1);
    assert_contained_at_load(&src, "imports are not allowed").await;
}

#[tokio::test]
async fn bad_admission_answer_is_contained() {
    let h = harness().await;
    let wasm = wat::parse_str(module(
        "admission",
        r#"(func (export "hypic_admit") (param i64) (result i32) i32.const 7)"#,
    ))
    .unwrap();
    h.rt.activate_module(PolicyKind::Admission, Some(3), &wasm, &json!({}))
        .unwrap();
    assert!(
        h.rt.admit(&AdmitInfo::default(), 0),
        "native default admits"
    );
    assert_eq!(
        h.rt.metrics()
            .faults_by_reason(PolicyKind::Admission, "bad_return"),
        1
    );
}

#[tokio::test]
async fn persistent_faults_trip_the_policy() {
    let h = harness().await;
    let wasm = wat::parse_str(module(
        "eviction",
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) unreachable)"#,
    ))
    .unwrap();
    h.rt.activate_module(PolicyKind::Eviction, Some(1), &wasm, &json!({}))
        .unwrap();
    for _ in 0..hypic_control::policy::TRIP_AFTER_CONSECUTIVE_FAULTS {
        assert_eq!(h.rt.evict(&cands(), 0), 1);
    }
    assert!(!h.rt.is_wasm(PolicyKind::Eviction), "tripped to native");
    let before = h.rt.metrics().faults(PolicyKind::Eviction);
    assert_eq!(h.rt.evict(&cands(), 0), 1);
    assert_eq!(
        h.rt.metrics().faults(PolicyKind::Eviction),
        before,
        "no more wasm calls once tripped"
    );
}

#[tokio::test]
async fn a_faulting_call_does_not_poison_later_calls() {
    // Traps only when n == 2; other calls answer n-1 (the last candidate).
    let h = harness().await;
    let wasm = wat::parse_str(module(
        "eviction",
        r#"(func (export "hypic_evict") (param i32 i64) (result i32)
             (if (i32.eq (local.get 0) (i32.const 2)) (then unreachable))
             (i32.sub (local.get 0) (i32.const 1)))"#,
    ))
    .unwrap();
    h.rt.activate_module(PolicyKind::Eviction, None, &wasm, &json!({}))
        .unwrap();
    assert_eq!(h.rt.evict(&cands()[..2], 0), 1); // fault -> LRU picks index 1
    assert_eq!(h.rt.evict(&cands(), 0), 2); // fresh instance answers n-1
    assert_eq!(h.rt.metrics().faults(PolicyKind::Eviction), 1);
}

// ---- simulator -------------------------------------------------------------------

const TRACE: &str = r#"
{"tenant":"a","segments":["sys","d1"],"tokens":[100,1000],"bytes":[100,1000]}
{"tenant":"a","segments":["sys","d2"],"tokens":[100,1000],"bytes":[100,1000]}
{"tenant":"b","segments":["sys","d3"],"tokens":[100,1000],"bytes":[100,1000],"public":["sys"]}
{"tenant":"a","segments":["sys","d1"],"tokens":[100,1000],"bytes":[100,1000]}
{"tenant":"a","segments":["sys","d1"],"tokens":[100,1000],"bytes":[100,1000],"versions":[1,2]}
"#;

#[test]
fn simulator_counts_hits_bytes_and_tokens() {
    let trace = parse_trace(TRACE).unwrap();
    // Unlimited capacity, native policies: `sys` is public only in line 3, so
    // it is per-tenant elsewhere.
    let s = simulate(&trace, 1 << 30, &mut PolicySet::native());
    assert_eq!(s.requests, 5);
    assert_eq!(s.lookups, 10);
    // hits: line2 sys(a), line4 sys(a)+d1(a), line5 sys(a); d1 v2 is a miss and v1 is invalidated.
    assert_eq!(s.hits, 4);
    assert_eq!(s.invalidations, 1);
    assert_eq!(s.recompute_tokens, 100 + 1000 + 1000 + 100 + 1000 + 1000);
    assert!((s.hit_ratio - 0.4).abs() < 1e-9);
    // Per tenant: every hit is a's; b's two lookups missed; the superseded d1 v1
    // was a's entry.
    let names: Vec<&str> = s.tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    let (a, b) = (&s.tenants[0], &s.tenants[1]);
    assert_eq!((a.requests, a.lookups, a.hits), (4, 8, 4));
    assert!((a.hit_ratio - 0.5).abs() < 1e-9);
    assert_eq!((b.requests, b.lookups, b.hits, b.hit_ratio), (1, 2, 0, 0.0));
    assert_eq!((a.invalidations, b.invalidations), (1, 0));
    assert_eq!((a.recompute_tokens, b.recompute_tokens), (3100, 1100));
    assert_eq!(a.bytes_hit + b.bytes_hit, s.bytes_hit);
    assert_eq!(a.bytes_inserted + b.bytes_inserted, s.bytes_inserted);

    // Tiny cache: second sighting admits nothing seen once.
    let mut set = PolicySet::native();
    set.set(load("second_sighting", PolicyKind::Admission, json!({})));
    let s2 = simulate(&trace, 1 << 30, &mut set);
    assert_eq!(
        s2.hits, 2,
        "sys(a) admitted on its 2nd sighting, hit on 3rd and 4th"
    );
    assert_eq!(s2.policy_faults, 0);
}

#[test]
fn simulator_charges_an_eviction_to_the_tenant_whose_entry_went() {
    // 1000 bytes: b's entry pushes out a's; b's too-large one is refused.
    let trace = parse_trace(
        r#"{"tenant":"a","segments":["x"],"tokens":[60],"bytes":[600]}
{"tenant":"b","segments":["y"],"tokens":[60],"bytes":[600]}
{"tenant":"b","segments":["z"],"tokens":[60],"bytes":[2000]}"#,
    )
    .unwrap();
    let mut s = simulate(&trace, 1000, &mut PolicySet::native());
    assert_eq!((s.evictions, s.rejected), (1, 1));
    let (a, b) = (&s.tenants[0], &s.tenants[1]);
    assert_eq!((a.evictions, a.bytes_evicted, a.rejected), (1, 600, 0));
    assert_eq!((b.evictions, b.bytes_evicted, b.rejected), (0, 0, 1));
    assert_eq!((a.bytes_inserted, b.bytes_inserted), (600, 600));
    // Names become pseudonyms; a pseudonym stays as it is.
    s.tenants[1].tenant = "t-0123456789ab".into();
    hypic_control::sim::pseudonymise(&mut s, |t| {
        format!("t-{t}{t}{t}{t}{t}{t}{t}{t}{t}{t}{t}{t}")
    });
    let names: Vec<&str> = s.tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["t-0123456789ab", "t-aaaaaaaaaaaa"]);
    assert!(!hypic_control::sim::is_pseudonym("t-0123456789AB"));
    assert!(!hypic_control::sim::is_pseudonym("acme"));
}

#[test]
fn simulator_eviction_policies_differ() {
    // Cache of 1100 bytes: a big cheap doc and small expensive ones compete.
    let mut lines = String::new();
    for i in 0..30 {
        let seg = if i % 3 == 0 {
            "big"
        } else if i % 3 == 1 {
            "small1"
        } else {
            "small2"
        };
        let (tokens, bytes) = if seg == "big" { (10, 1000) } else { (500, 100) };
        lines.push_str(&format!(
            r#"{{"tenant":"a","segments":["{seg}"],"tokens":[{tokens}],"bytes":[{bytes}]}}"#
        ));
        lines.push('\n');
    }
    let trace = parse_trace(&lines).unwrap();
    let lru = simulate(&trace, 1100, &mut PolicySet::native());
    let mut set = PolicySet::native();
    set.set(load("gdsf", PolicyKind::Eviction, json!({})));
    let gdsf = simulate(&trace, 1100, &mut set);
    assert!(
        gdsf.recompute_tokens < lru.recompute_tokens,
        "gdsf {gdsf:?} vs lru {lru:?}"
    );
    assert!(gdsf.hits > lru.hits);
    assert_eq!(gdsf.policy_faults, 0);
}

#[test]
fn trace_errors_are_clear() {
    assert!(parse_trace("").unwrap_err().contains("empty"));
    let e = parse_trace(r#"{"tenant":"a","segments":["x"],"tokens":[],"bytes":[1]}"#).unwrap_err();
    assert!(e.contains("line 1") && e.contains("equal lengths"), "{e}");
    assert!(parse_trace("not json").unwrap_err().contains("line 1"));
}

#[test]
fn runtime_is_shareable_across_threads() {
    let rt = Arc::new(PolicyRuntime::new(
        policy_engine(),
        PolicyLimits::default(),
        None,
    ));
    rt.activate_module(
        PolicyKind::Eviction,
        None,
        builtin::module("lru").unwrap(),
        &json!({}),
    )
    .unwrap();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let rt = rt.clone();
            std::thread::spawn(move || (0..200).map(|_| rt.evict(&cands(), 0)).collect::<Vec<_>>())
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap().iter().all(|&v| v == 1));
    }
    assert_eq!(rt.metrics().faults(PolicyKind::Eviction), 0);
}
