//! Policy hardening: policy modules compile off the request threads, once per
//! module, under a size cap and a compile cap; the fault breaker counts a fault
//! rate; a bad return resets the instance; the public pool is shared fairly
//! between tenants; the `shared_first_use = recompute` option hides whether
//! another tenant used a public segment.
use crate::serve_common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use hypic_control::auth::{load_or_create_secret, mint_token};
use hypic_control::catalog::Role;
use hypic_control::policy::{
    builtin, policy_engine, AdmitInfo, EntryInfo, PolicyKind, PolicyLimits, PolicyRuntime,
};
use serde_json::{json, Value};
use serve_common::{start, Srv};

/// A complete ABI-v1 module of `kind` whose hook is `hook` (WAT), plus `extra`.
fn module(code: i32, hook: &str, extra: &str) -> String {
    format!(
        r#"(module
          (memory (export "memory") 1)
          (func (export "hypic_abi_version") (result i32) i32.const 1)
          (func (export "hypic_policy_kind") (result i32) i32.const {code})
          (func (export "hypic_buf") (result i32) i32.const 0)
          (func (export "hypic_buf_cap") (result i32) i32.const 65536)
          (func (export "hypic_configure") (param i32) (result i32) i32.const 0)
          {hook}
          {extra})"#
    )
}

/// A valid eviction policy padded with `funcs` functions of `ops` arithmetic
/// steps each (slow to compile); `salt` makes distinct modules.
fn big_module(funcs: usize, ops: usize, salt: u32) -> Vec<u8> {
    let body = format!("i32.const {salt} i32.add i32.const 3 i32.mul ").repeat(ops);
    let mut extra = String::with_capacity(funcs * (body.len() + 64));
    for i in 0..funcs {
        extra.push_str(&format!(
            "(func (export \"pad{i}\") (param i32) (result i32) local.get 0 {body})\n"
        ));
    }
    wat::parse_str(module(
        1,
        r#"(func (export "hypic_evict") (param i32 i64) (result i32) i32.const 0)"#,
        &extra,
    ))
    .unwrap()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn stats(s: &Srv) -> Value {
    let (st, v) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/stats")
        .await;
    assert_eq!(st, 200, "{v}");
    v
}

fn compiles(v: &Value) -> u64 {
    v["module_compiles"].as_u64().expect("module_compiles")
}

// ---- compilation off the request threads -----------------------------------------

/// Polls `/health` every 20 ms while `work` runs (at least `min` long); returns
/// `work`'s output, the slowest answer and the number of probes.
async fn health_during<T>(
    s: &Srv,
    min: Duration,
    work: impl std::future::Future<Output = T>,
) -> (T, Duration, usize) {
    let done = std::sync::atomic::AtomicBool::new(false);
    let work = async {
        let r = work.await;
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    };
    let health = async {
        let mut worst = Duration::ZERO;
        let mut n = 0;
        let t = Instant::now();
        while t.elapsed() < min || !done.load(std::sync::atomic::Ordering::Relaxed) {
            let t0 = Instant::now();
            let r = s
                .client
                .get(format!("{}/health", s.url))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            worst = worst.max(t0.elapsed());
            n += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (worst, n)
    };
    let (r, (worst, n)) = tokio::join!(work, health);
    (r, worst, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_large_uploads_do_not_stall_health() {
    let s = start(|c| c.policy_max_module_bytes = 16 << 20).await;
    // Modules big enough to take at least 400 ms to compile on this machine (measured
    // directly, not through the server): the function count doubles until they do.
    let mut funcs = 400;
    let one = loop {
        let t = Instant::now();
        wasmtime::Module::new(&policy_engine(), big_module(funcs, 60, 99)).unwrap();
        let one = t.elapsed();
        if one > Duration::from_millis(400) || funcs >= 6400 {
            break one;
        }
        funcs *= 2;
    };
    let modules: Vec<Vec<u8>> = (0..3).map(|i| big_module(funcs, 60, i)).collect();
    eprintln!(
        "one {} KB module compiles in {one:?}",
        modules[0].len() / 1024
    );
    assert!(
        one > Duration::from_millis(400),
        "module too quick to compile: {one:?}"
    );
    // The old way, for comparison: three compilations on the runtime's worker
    // threads (more of them than workers) stall /health.
    let engine = policy_engine();
    let blocking = futures_util::future::join_all(modules.iter().map(|m| {
        let (e, m) = (engine.clone(), m.clone());
        tokio::spawn(async move { wasmtime::Module::new(&e, &m).is_ok() })
    }));
    let (_, worst_inline, n) = health_during(&s, one, blocking).await;
    eprintln!("/health: worst of {n} probes {worst_inline:?} while compiling on the workers");
    // Three concurrent uploads of distinct large modules through the server.
    let bodies: Vec<Value> = modules
        .iter()
        .enumerate()
        .map(|(i, m)| json!({"name": format!("big{i}"), "kind": "eviction", "wasm_base64": b64(m)}))
        .collect();
    let uploads = futures_util::future::join_all(
        bodies
            .iter()
            .map(|b| s.post_as(&s.op_token, "/v1/admin/policies", b)),
    );
    let (results, worst, n) = health_during(&s, one, uploads).await;
    eprintln!("/health: worst of {n} probes {worst:?} during 3 uploads");
    let codes: Vec<u16> = results.iter().map(|(st, _)| *st).collect();
    for (st, v) in &results {
        assert!(*st == 200 || *st == 429, "{st}: {v}");
        if *st == 429 {
            assert_eq!(v["error"]["code"], "compile_busy", "{v}");
        }
    }
    assert!(codes.contains(&200), "{codes:?}");
    assert!(
        worst < Duration::from_millis(300),
        "/health took {worst:?} while modules compiled"
    );
    assert!(
        worst_inline > worst,
        "compiling on the workers did not stall /health ({worst_inline:?}): the test cannot fail"
    );
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_compiles_once_for_upload_activation_and_dry_run() {
    let s = start(|_| {}).await;
    let before = compiles(&stats(&s).await);
    let gdsf = b64(builtin::module("gdsf").unwrap());
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies",
            &json!({"name": "g", "kind": "eviction", "wasm_base64": gdsf}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let id = v["id"].as_i64().unwrap();
    assert_eq!(compiles(&stats(&s).await), before + 1, "upload compiles");
    let (st, v) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{id}/activate"),
            &json!({}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let trace = r#"{"tenant":"a","segments":["s","d"],"tokens":[10,100],"bytes":[10,100]}"#;
    let (st, v) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{id}/dry-run"),
            &json!({"trace": trace, "capacity_bytes": 1000}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    // The same module uploaded under another name.
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies",
            &json!({"name": "g2", "kind": "eviction", "wasm_base64": gdsf}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let st = stats(&s).await;
    assert_eq!(compiles(&st), before + 1, "compiled again: {st}");
    assert_eq!(st["active"]["eviction"], id, "{st}");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_module_is_refused_with_413_naming_the_limit() {
    let s = start(|c| c.policy_max_module_bytes = 4096).await;
    let before = compiles(&stats(&s).await);
    let big = big_module(40, 20, 1);
    assert!(big.len() > 4096);
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies",
            &json!({"name": "big", "kind": "eviction", "wasm_base64": b64(&big)}),
        )
        .await;
    assert_eq!(st, 413, "{v}");
    assert_eq!(v["error"]["code"], "module_too_large", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("4096") && msg.contains("policy_max_module_bytes"),
        "{msg}"
    );
    // Under the limit: accepted; nothing was compiled for the refused one.
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies",
            &json!({"name": "q", "kind": "admission",
                    "wasm_base64": b64(builtin::module("quota").unwrap())}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(compiles(&stats(&s).await), before + 1);
    s.server.stop().await;
}

// ---- breaker and bad returns --------------------------------------------------------

fn rt() -> PolicyRuntime {
    PolicyRuntime::new(policy_engine(), PolicyLimits::default(), None)
}

fn cand(id: u64, last_use: u64) -> EntryInfo {
    EntryInfo {
        id,
        tenant: 1,
        bytes: 10,
        recompute_tokens: 10,
        last_use_ms: last_use,
        inserted_ms: 1,
        hits: 0,
        shared: false,
        superseded: false,
    }
}

#[test]
fn a_policy_faulting_on_every_other_call_trips_the_breaker() {
    // Traps when given two candidates, answers otherwise.
    let wasm = wat::parse_str(module(
        1,
        r#"(func (export "hypic_evict") (param i32 i64) (result i32)
             (if (i32.eq (local.get 0) (i32.const 2)) (then unreachable))
             i32.const 0)"#,
        "",
    ))
    .unwrap();
    let rt = rt();
    rt.activate_module(PolicyKind::Eviction, Some(1), &wasm, &json!({}))
        .unwrap();
    let three = [cand(1, 5), cand(2, 3), cand(3, 4)];
    for i in 0..64 {
        if !rt.is_wasm(PolicyKind::Eviction) {
            eprintln!("tripped after {i} calls");
            assert!(i >= 2 * 16 - 1, "tripped too early ({i} calls)");
            return;
        }
        let c = if i % 2 == 0 { &three[..2] } else { &three[..] };
        rt.evict(c, 10);
    }
    panic!(
        "a policy faulting on every other call ran 64 calls ({} faults) without tripping",
        rt.metrics().faults(PolicyKind::Eviction)
    );
}

#[test]
fn rare_faults_do_not_trip_the_breaker() {
    let wasm = wat::parse_str(module(
        1,
        r#"(func (export "hypic_evict") (param i32 i64) (result i32)
             (if (i32.eq (local.get 0) (i32.const 2)) (then unreachable))
             i32.const 0)"#,
        "",
    ))
    .unwrap();
    let rt = rt();
    rt.activate_module(PolicyKind::Eviction, Some(1), &wasm, &json!({}))
        .unwrap();
    let three = [cand(1, 5), cand(2, 3), cand(3, 4)];
    for i in 0..400 {
        let c = if i % 4 == 0 { &three[..2] } else { &three[..] };
        rt.evict(c, 10);
    }
    assert!(
        rt.is_wasm(PolicyKind::Eviction),
        "one fault in four tripped it"
    );
    assert_eq!(rt.metrics().faults(PolicyKind::Eviction), 100);
}

#[test]
fn a_bad_return_resets_the_instance() {
    // Counts its calls in memory and returns the count: 1 (admit) on a fresh
    // instance, 2 (a bad return) on the next call of the same instance.
    let wasm = wat::parse_str(module(
        2,
        r#"(global $n (mut i32) (i32.const 0))
           (func (export "hypic_admit") (param i64) (result i32)
             (global.set $n (i32.add (global.get $n) (i32.const 1)))
             global.get $n)"#,
        "",
    ))
    .unwrap();
    let rt = rt();
    rt.activate_module(PolicyKind::Admission, Some(1), &wasm, &json!({}))
        .unwrap();
    let a = AdmitInfo {
        id: 1,
        tenant: 1,
        bytes: 10,
        recompute_tokens: 10,
        tenant_used_bytes: 0,
        capacity_bytes: 100,
        seen_count: 1,
        shared: false,
    };
    let m = rt.metrics();
    assert!(rt.admit(&a, 0));
    assert_eq!(m.faults(PolicyKind::Admission), 0);
    rt.admit(&a, 0);
    assert_eq!(m.faults_by_reason(PolicyKind::Admission, "bad_return"), 1);
    // A fresh instance answers 1 again; the old one would answer 3.
    assert!(rt.admit(&a, 0));
    assert_eq!(
        m.faults(PolicyKind::Admission),
        1,
        "the instance that returned a bad value was kept"
    );
}

// ---- fair sharing of the public pool ------------------------------------------------

const DOC: &str = "Victim handbook. The river flows north through the old city, past the \
    market square and the stone bridge, and reaches the harbour after three days.";
const Q: &str = "Question: where does the river flow?";

/// Victim tenant (globex) uses its registered document between floods of unique
/// segments from another tenant (acme); returns (hits, uses) of the document.
async fn victim_under_flood(fair: bool) -> (usize, usize) {
    let s = start(|c| {
        c.public_pool_mib = 1;
        c.private_pool_mib = 1;
        c.pool_fair_share = fair;
    })
    .await;
    let (st, v) = s
        .post_as(
            &s.token_b,
            "/v1/segments",
            &json!({"id": "vdoc", "content": DOC}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (mut hits, mut uses) = (0, 0);
    for round in 0..4 {
        let (st, v) = s
            .post_as(
                &s.token_b,
                "/v1/completions",
                &json!({"segments": [{"text": format!("Victim note {round}.")},
                                     {"id": "vdoc"}, {"text": Q}], "max_tokens": 1}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let outcome = v["hypic"]["segments"][1]["outcome"]
            .as_str()
            .unwrap()
            .to_string();
        if round > 0 {
            uses += 1;
            hits += (outcome == "hit") as usize;
        }
        // The flood: one request of many unique short segments.
        let segs: Vec<Value> = (0..120)
            .map(|i| json!({"text": format!("F{round}.{i} abc def")}))
            .chain(std::iter::once(json!({"text": Q})))
            .collect();
        let (st, v) = s
            .post(
                "/v1/completions",
                &json!({"segments": segs, "max_tokens": 1}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
    }
    // The victim's running-state snapshots (private pool) also survive: its last
    // request, repeated after the floods, restores the whole prompt.
    let (st, v) = s
        .post_as(
            &s.token_b,
            "/v1/completions",
            &json!({"segments": [{"text": "Victim note 3."}, {"id": "vdoc"}, {"text": Q}],
                    "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let restored = v["hypic"]["segments"]
        .as_array()
        .unwrap()
        .iter()
        .all(|x| x["outcome"] == "prefix_hit");
    assert!(restored, "the victim's snapshots were evicted: {v}");
    let (_, _, pstats) = s.server.state.engine().public_usage();
    eprintln!(
        "fair={fair}: victim hits {hits}/{uses}; public pool evictions {}, fair-share refusals {}",
        pstats.evictions, pstats.fair_share_refused
    );
    assert!(pstats.evictions > 50, "the flood did not fill the pool");
    s.server.stop().await;
    (hits, uses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_tenant_cannot_turn_another_tenants_segment_into_a_miss() {
    let (hits, uses) = victim_under_flood(true).await;
    assert_eq!(hits, uses, "the victim's document missed under the flood");
    // The same workload without fair sharing evicts it: the test can fail.
    let (hits, _) = victim_under_flood(false).await;
    assert_eq!(
        hits, 0,
        "without fair sharing the flood did not evict the document"
    );
}

// ---- first use of a shared entry ----------------------------------------------------

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Probes a public segment as fresh tenants, right after the owner used it and
/// when nobody did; returns (outcomes, median ms) for (used, unused).
async fn probe_public(
    first_use: &str,
    n: usize,
    clauses: usize,
) -> ((Vec<String>, f64), (Vec<String>, f64)) {
    let s = start(|c| c.shared_first_use = first_use.into()).await;
    let (secret, _) = load_or_create_secret(&s.server.state.config().data_dir).unwrap();
    let content = (0..clauses)
        .map(|i| format!("clause {i} of the shared handbook"))
        .collect::<Vec<_>>()
        .join(". ");
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": "pub", "content": content, "public": true}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    // Other tenants reach a public segment by its address.
    let address = v["address"].as_str().expect("address").to_string();
    let req = json!({"segments": [{"id": address}, {"text": Q}], "max_tokens": 1});
    let probe = |tenant: String| {
        let token = mint_token(&secret, "hypic", &tenant, "u", Role::Tenant, 600).unwrap();
        let (s, req) = (&s, &req);
        async move {
            let t = Instant::now();
            let (st, v) = s.post_as(&token, "/v1/completions", req).await;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            assert_eq!(st, 200, "{v}");
            let seg = &v["hypic"]["segments"][0];
            (
                format!(
                    "{}/{}",
                    seg["outcome"].as_str().unwrap(),
                    seg["miss_reason"].as_str().unwrap_or("-")
                ),
                ms,
            )
        }
    };
    let (mut used, mut unused) = ((vec![], vec![]), (vec![], vec![]));
    for i in 0..n {
        s.server.state.engine().clear();
        let (o, ms) = probe(format!("cold{i}")).await;
        unused.0.push(o);
        unused.1.push(ms);
        let (st, v) = s.post("/v1/completions", &req).await; // the owner uses it
        assert_eq!(st, 200, "{v}");
        let (o, ms) = probe(format!("warm{i}")).await;
        used.0.push(o);
        used.1.push(ms);
    }
    s.server.stop().await;
    ((used.0, median(used.1)), (unused.0, median(unused.1)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_use_recompute_hides_whether_a_public_segment_was_used() {
    // Figures in docs come from n = 7 probes of a 100-clause (about 2,500-token)
    // segment; the test keeps to a short segment and few probes.
    let (n, clauses) = (3, 20);
    let ((used_o, used_ms), (unused_o, unused_ms)) = probe_public("share", n, clauses).await;
    eprintln!("share: probe median {used_ms:.1} ms after use, {unused_ms:.1} ms unused");
    assert!(used_o.iter().all(|o| o.starts_with("hit/")), "{used_o:?}");
    assert!(
        unused_o.iter().all(|o| o.starts_with("miss/")),
        "{unused_o:?}"
    );
    let ((used_o, used_ms), (unused_o, unused_ms)) = probe_public("recompute", n, clauses).await;
    eprintln!("recompute: probe median {used_ms:.1} ms after use, {unused_ms:.1} ms unused");
    // Outcome and miss reason alike: a first use reads as a miss never seen,
    // whether the entry was cached (and dropped) or cold.
    assert!(
        used_o
            .iter()
            .chain(&unused_o)
            .all(|o| o == "miss/never_seen"),
        "a first use told whether the shared entry was cached: {used_o:?} {unused_o:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_its_first_use_a_tenant_hits_the_shared_entry() {
    let s = start(|c| c.shared_first_use = "recompute".into()).await;
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": "pub", "content": DOC, "public": true}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let address = v["address"].as_str().expect("address").to_string();
    let req = |i: usize| {
        json!({"segments": [{"text": format!("Note {i}.")}, {"id": address}, {"text": Q}],
               "max_tokens": 1})
    };
    let mut outcomes = vec![];
    for i in 0..3 {
        let (st, v) = s.post_as(&s.token_b, "/v1/completions", &req(i)).await;
        assert_eq!(st, 200, "{v}");
        outcomes.push(
            v["hypic"]["segments"][1]["outcome"]
                .as_str()
                .unwrap()
                .to_string(),
        );
    }
    assert_eq!(outcomes, ["miss", "hit", "hit"]);
    assert_eq!(s.server.state.first_use().forced(), 1);
    s.server.stop().await;
}
