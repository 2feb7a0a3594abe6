//! The control plane inside `hypic serve`, end to end over a loopback port:
//! group grants against the real pools, the periodic invalidation sweep (TTL)
//! dropping idle entries from the public pool, and per-policy metrics on the
//! Prometheus endpoint.
use crate::serve_common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use hypic_control::auth::{load_or_create_secret, mint_token};
use hypic_control::catalog::Role;
use hypic_control::policy::{builtin, PolicyKind};
use serde_json::{json, Value};
use serve_common::{assert_error, metric, start, Srv};

const SYS: &str = "You are a careful assistant that answers from the given documents only.";
const DOC_A: &str = "Document A. The river flows north through the old city and the market square.";
const DOC_B: &str = "Document B. The bright green light over the harbour turned on every night.";
const Q: &str = "Question: where does the river flow?";

fn outcomes(v: &Value) -> Vec<String> {
    v["hypic"]["segments"]
        .as_array()
        .unwrap_or_else(|| panic!("no segments in {v}"))
        .iter()
        .map(|s| s["outcome"].as_str().unwrap().to_string())
        .collect()
}

fn token_for(s: &Srv, tenant: &str, role: Role) -> String {
    let (secret, _) = load_or_create_secret(&s.server.state.config().data_dir).unwrap();
    mint_token(&secret, "hypic", tenant, &format!("u@{tenant}"), role, 3600).unwrap()
}

async fn send(
    s: &Srv,
    method: reqwest::Method,
    token: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut b = s
        .client
        .request(method, format!("{}{path}", s.url))
        .bearer_auth(token);
    if let Some(v) = body {
        b = b.json(&v);
    }
    let r = b.send().await.unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or(Value::Null))
}

/// Uploads built-in policy `name` with `params` and activates it; returns its id.
async fn activate_builtin(s: &Srv, name: &str, kind: &str, params: Value) -> i64 {
    let wasm = base64::engine::general_purpose::STANDARD.encode(builtin::module(name).unwrap());
    let (st, rec) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies",
            &json!({"name": name, "kind": kind, "wasm_base64": wasm, "params": params}),
        )
        .await;
    assert_eq!(st, 200, "{rec}");
    let id = rec["id"].as_i64().unwrap();
    let (st, v) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{id}/activate"),
            &json!({}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_member_reads_in_its_own_namespace_and_loses_access_on_revocation() {
    let s = start(|_| {}).await;
    let outsider = token_for(&s, "hooli", Role::Tenant);
    // acme registers a private segment: prefilled into acme's namespace.
    let (st, v) = s
        .post("/v1/segments", &json!({"id": "playbook", "content": DOC_A}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["hypic"]["residency"]["resident"], true, "{v}");
    // Other tenants name it by its address (the owner may too).
    let pb = v["address"].as_str().unwrap().to_string();
    let (st, v) = s
        .post_as(&s.op_token, "/v1/admin/groups", &json!({"id": "partners"}))
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = send(
        &s,
        reqwest::Method::PUT,
        &s.op_token,
        "/v1/admin/groups/partners/members/globex",
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = s
        .post(
            "/v1/segments/playbook/group-grants",
            &json!({"group": "partners"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");

    // A fresh first segment per request, so no private prefix snapshot answers:
    // the catalog segment is looked up in the public pool every time.
    let req = |first: &str| json!({"segments": [{"text": first}, {"id": pb}, {"text": Q}], "max_tokens": 2});
    // The owner hits its prefilled entry.
    let (st, a) = s.post("/v1/completions", &req("Intro one.")).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(outcomes(&a)[1], "hit", "{a}");
    // The member reads the segment but misses: its own namespace, never acme's entry.
    let (st, b1) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro one."))
        .await;
    assert_eq!(st, 200, "{b1}");
    assert_eq!(outcomes(&b1)[1], "miss", "{b1}");
    assert_eq!(b1["hypic"]["segments"][1]["shared"], false);
    assert_eq!(b1["hypic"]["segments"][1]["id"], json!(pb));
    assert_eq!(
        b1["hypic"]["segments"][1]["content_hash"], a["hypic"]["segments"][1]["content_hash"],
        "same content"
    );
    // …and then hits the entry it built.
    let (_, b2) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro two."))
        .await;
    assert_eq!(outcomes(&b2)[1], "hit", "{b2}");
    // A tenant outside the group: 404, never a hit.
    let (st, e) = s
        .post_as(&outsider, "/v1/completions", &req("Intro one."))
        .await;
    assert_error(st, &e, 404, "segment_not_found");

    // Revoking the group grant: the member's next request gets nothing.
    let (st, v) = send(
        &s,
        reqwest::Method::DELETE,
        &s.token,
        "/v1/segments/playbook/group-grants/partners",
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, e) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro two."))
        .await;
    assert_error(st, &e, 404, "segment_not_found");
    // Granted again, then the membership is removed: the same.
    let (st, _) = s
        .post(
            "/v1/segments/playbook/group-grants",
            &json!({"group": "partners"}),
        )
        .await;
    assert_eq!(st, 200);
    let (st, b3) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro three."))
        .await;
    assert_eq!(st, 200, "{b3}");
    let (st, v) = send(
        &s,
        reqwest::Method::DELETE,
        &s.op_token,
        "/v1/admin/groups/partners/members/globex",
        None,
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, e) = s
        .post_as(&s.token_b, "/v1/completions", &req("Intro four."))
        .await;
    assert_error(st, &e, 404, "segment_not_found");
    // The owner is unaffected.
    let (st, a2) = s.post("/v1/completions", &req("Intro four.")).await;
    assert_eq!(st, 200);
    assert_eq!(outcomes(&a2)[1], "hit", "{a2}");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_sweep_drops_idle_entries_without_any_request() {
    let s = start(|c| c.invalidation_sweep_ms = 100).await;
    let engine = s.server.state.engine().clone();
    let (st, v) = s
        .post("/v1/segments", &json!({"id": "doc-ttl", "content": DOC_B}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["hypic"]["residency"]["resident"], true, "{v}");
    // The sweep's audit rows name segments by address.
    let doc_ttl = v["address"].as_str().unwrap().to_string();
    let t_request = Instant::now();
    let inline =
        json!({"segments": [{"text": SYS}, {"text": DOC_A}, {"text": Q}], "max_tokens": 2});
    let (st, r) = s.post("/v1/completions", &inline).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(outcomes(&r), ["miss", "miss", "computed"], "{r}");
    let (entries0, _, stats0) = engine.public_usage();
    assert!(entries0 >= 3, "prefilled + two inline entries: {entries0}");

    // Under the native invalidation policy (drop superseded versions only) the
    // sweep checks the entries and keeps them.
    let t0 = Instant::now();
    loop {
        let m = s.metrics().await;
        let checked = metric(
            &m,
            "hypic_invalidation_sweep_entries_total",
            "event=\"checked\"",
        )
        .unwrap_or(0.0);
        if checked >= 6.0 {
            assert_eq!(
                metric(
                    &m,
                    "hypic_invalidation_sweep_entries_total",
                    "event=\"dropped\""
                ),
                Some(0.0)
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the sweep does not run:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(engine.public_usage().0, entries0, "nothing dropped");
    assert!(
        s.server.state.ledger().len() >= 3,
        "the sweep tracks the entries"
    );

    // TTL policy: every entry older than 1.5 s goes, with no request touching it.
    let ttl = Duration::from_millis(1500);
    activate_builtin(&s, "ttl", "invalidation", json!({"ttl_ms": 1500})).await;
    let t0 = Instant::now();
    while engine.public_usage().0 > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "entries still resident: {:?}",
            engine.public_usage()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        t_request.elapsed() >= ttl,
        "dropped after {:?}, before the TTL",
        t_request.elapsed()
    );
    let (_, bytes, stats1) = engine.public_usage();
    assert_eq!(bytes, 0);
    assert_eq!(
        (stats1.hits, stats1.misses),
        (stats0.hits, stats0.misses),
        "no lookup touched the pool"
    );
    // The sweep empties the pool, then records the drops (catalog, ledger, counters):
    // wait for the records rather than read them once.
    let t0 = Instant::now();
    while !s.server.state.ledger().is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the sweep's ledger still tracks entries"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // The tenant's private prefix snapshots are older than the TTL too: gone.
    let t0 = Instant::now();
    while engine.private_usage().0 > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "private snapshots still held"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(s.server.state.ledger().private_tenants(), 0);
    let t0 = Instant::now();
    let m = loop {
        let m = s.metrics().await;
        let dropped = metric(
            &m,
            "hypic_invalidation_sweep_entries_total",
            "event=\"dropped\"",
        )
        .unwrap_or(0.0);
        if dropped >= 3.0 {
            break m;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "fewer than 3 drops counted:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(
        metric(&m, "hypic_pool_entries", "pool=\"public\""),
        Some(0.0)
    );
    // Audited (the audit writer is asynchronous: wait for its row), and visible in
    // the segment's residency.
    let t0 = Instant::now();
    loop {
        let (st, log) = s
            .get_as(Some(&s.op_token), "/v1/admin/audit?action=cache.invalidate")
            .await;
        assert_eq!(st, 200);
        let found = log
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["detail"].as_str().unwrap().contains(&doc_ttl));
        if found {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, g) = s.get("/v1/segments/doc-ttl").await;
    assert_eq!(g["hypic"]["residency"]["resident"], false, "{g}");
    // The next request misses and rebuilds.
    let (st, r) = s.post("/v1/completions", &inline).await;
    assert_eq!(st, 200);
    assert_eq!(outcomes(&r), ["miss", "miss", "computed"], "{r}");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_metrics_are_exported_in_prometheus_format() {
    let s = start(|c| c.invalidation_sweep_ms = 0).await;
    let calls = |m: &str, kind: &str, policy: &str| {
        metric(
            m,
            "hypic_policy_calls_total",
            &format!("kind=\"{kind}\",policy=\"{policy}\""),
        )
    };
    let req = |doc: &str| json!({"segments": [{"text": SYS}, {"text": doc}, {"text": Q}], "max_tokens": 2});
    // Another first segment: no private prefix snapshot, so the public pool is asked.
    let req_alt = |doc: &str| json!({"segments": [{"text": "Preface."}, {"text": doc}, {"text": Q}], "max_tokens": 2});
    // Native admission is asked once per miss inserted into the public pool.
    let (st, r) = s.post("/v1/completions", &req(DOC_A)).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(outcomes(&r), ["miss", "miss", "computed"]);
    let m1 = s.metrics().await;
    assert!(
        m1.contains("# TYPE hypic_policy_calls_total counter"),
        "{m1}"
    );
    assert!(m1.contains("# TYPE hypic_policy_nanoseconds_per_call gauge"));
    let native1 = calls(&m1, "admission", "native").unwrap();
    assert!(native1 >= 2.0, "{m1}");
    assert!(
        metric(
            &m1,
            "hypic_policy_nanoseconds_per_call",
            "kind=\"admission\",policy=\"native\""
        )
        .unwrap()
            > 0.0
    );
    assert!(
        metric(
            &m1,
            "hypic_policy_call_nanoseconds_total",
            "kind=\"admission\",policy=\"native\""
        )
        .unwrap()
            > 0.0
    );
    assert_eq!(
        metric(&m1, "hypic_policy_active", "kind=\"admission\""),
        Some(0.0)
    );

    // A hostile admission policy (traps on every call): faults and fallbacks
    // counted under its id, and native calls stop moving.
    let trap = wat::parse_str(
        r#"(module
          (memory (export "memory") 1)
          (func (export "hypic_abi_version") (result i32) i32.const 1)
          (func (export "hypic_policy_kind") (result i32) i32.const 2)
          (func (export "hypic_buf") (result i32) i32.const 0)
          (func (export "hypic_buf_cap") (result i32) i32.const 65536)
          (func (export "hypic_configure") (param i32) (result i32) i32.const 0)
          (func (export "hypic_admit") (param i64) (result i32) unreachable))"#,
    )
    .unwrap();
    s.server
        .state
        .control()
        .policies()
        .activate_module(PolicyKind::Admission, Some(4242), &trap, &json!({}))
        .unwrap();
    let (st, r) = s.post("/v1/completions", &req(DOC_B)).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(outcomes(&r)[1], "miss", "{r}");
    let m2 = s.metrics().await;
    let hostile = calls(&m2, "admission", "4242").unwrap();
    assert!(hostile >= 1.0, "{m2}");
    assert_eq!(
        metric(
            &m2,
            "hypic_policy_faults_total",
            "kind=\"admission\",policy=\"4242\",reason=\"trap\""
        ),
        Some(hostile),
        "every call trapped"
    );
    assert_eq!(
        metric(
            &m2,
            "hypic_policy_fallbacks_total",
            "kind=\"admission\",policy=\"4242\""
        ),
        Some(hostile)
    );
    assert_eq!(calls(&m2, "admission", "native"), Some(native1));
    assert_eq!(
        metric(&m2, "hypic_policy_active", "kind=\"admission\""),
        Some(4242.0)
    );
    // The native admission admitted the entry after the fault: the next request hits.
    let (_, r) = s.post("/v1/completions", &req_alt(DOC_B)).await;
    assert_eq!(outcomes(&r), ["miss", "hit", "computed"], "{r}");
    // (Its first segment missed: one more trapped call.)
    let hostile = calls(&s.metrics().await, "admission", "4242").unwrap();
    assert!(hostile >= 2.0);

    // A healthy built-in, through the lifecycle API: calls under its catalog id, no faults.
    let id = activate_builtin(&s, "second_sighting", "admission", json!({})).await;
    let doc_c = "Document C. A quiet lane runs east between the mill and the chapel.";
    let (st, _) = s.post("/v1/completions", &req(doc_c)).await;
    assert_eq!(st, 200);
    let m3 = s.metrics().await;
    assert!(
        calls(&m3, "admission", &id.to_string()).unwrap() >= 1.0,
        "{m3}"
    );
    assert_eq!(
        metric(
            &m3,
            "hypic_policy_faults_total",
            &format!("policy=\"{id}\"")
        ),
        None,
        "{m3}"
    );
    assert_eq!(
        metric(&m3, "hypic_policy_active", "kind=\"admission\""),
        Some(id as f64)
    );
    // Counters never go back: the hostile policy's totals are still exported.
    assert_eq!(calls(&m3, "admission", "4242"), Some(hostile));
    // With the sweep off nothing is tracked for it (the ledger would only grow).
    assert!(s.server.state.ledger().is_empty());
    assert_eq!(s.server.state.ledger().private_tenants(), 0);
    // The JSON view agrees.
    let (st, j) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/stats")
        .await;
    assert_eq!(st, 200);
    let row = j["metrics"]["policies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["policy_id"] == 4242)
        .cloned()
        .unwrap();
    assert_eq!(row["calls"].as_f64(), Some(hostile));
    assert_eq!(row["faults_by_reason"]["trap"].as_f64(), Some(hostile));
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lru_pool_policy_bypasses_the_control_plane_policies() {
    // `pool_policy = "lru"`: the engine's own LRU decides; the control plane's
    // admission/eviction hooks are never called. `control` (the default) calls them.
    let admission_calls = |m: &str| {
        metric(
            m,
            "hypic_policy_calls_total",
            "kind=\"admission\",policy=\"native\"",
        )
        .unwrap_or(0.0)
    };
    let req = json!({"segments": [{"text": SYS}, {"text": DOC_A}, {"text": Q}], "max_tokens": 2});
    for (policy, called) in [("lru", false), ("control", true)] {
        let s = start(|c| {
            c.pool_policy = policy.into();
            c.invalidation_sweep_ms = 0;
        })
        .await;
        let (st, r) = s.post("/v1/completions", &req).await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(outcomes(&r), ["miss", "miss", "computed"], "{policy}");
        let (st, r) = s.post("/v1/completions", &req).await;
        assert_eq!(st, 200, "{r}");
        let calls = admission_calls(&s.metrics().await);
        assert_eq!(calls > 0.0, called, "{policy}: {calls} admission calls");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segment_list_comes_from_the_catalog_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_path_buf();
    let cfg = |c: &mut hypic_control::serve::ServeConfig| {
        c.data_dir = path.clone();
        c.invalidation_sweep_ms = 0;
    };
    let s = start(&cfg).await;
    for (id, text) in [("doc-b", DOC_B), ("doc-a", DOC_A)] {
        let (st, v) = s
            .post("/v1/segments", &json!({"id": id, "content": text}))
            .await;
        assert_eq!(st, 200, "{v}");
    }
    s.server.stop().await;
    // A new process on the same data directory lists them before touching them.
    let s = start(&cfg).await;
    let ids = |v: &Value| -> Vec<String> {
        v["data"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x["id"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (st, v) = s.get("/v1/segments").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(ids(&v), ["doc-a", "doc-b"], "{v}");
    assert!(v["data"][0]["tokens"].as_u64().unwrap_or(0) > 0, "{v}");
    // Another tenant sees none of acme's private segments; the operator sees all.
    let (st, v) = s.get_as(Some(&s.token_b), "/v1/segments").await;
    assert_eq!(st, 200, "{v}");
    assert!(ids(&v).is_empty(), "{v}");
    let (_, v) = s.get_as(Some(&s.op_token), "/v1/segments").await;
    assert_eq!(ids(&v), ["doc-a", "doc-b"], "{v}");
    s.server.stop().await;
}
