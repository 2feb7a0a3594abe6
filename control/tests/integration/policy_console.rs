//! The console's policy and tenant routes against a real `hypic serve`: shadow
//! mode on live traffic (counted, never applied; operator only; audited;
//! stopped), parameter schemas (checked at upload, activation, dry run and
//! shadow start, 400 naming the parameter), a policy's detail, tenant usage.
use crate::serve_common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use hypic_control::policy::builtin;
use serde_json::{json, Value};
use serve_common::{assert_error, start, Srv};

const Q: &str = "Question: where does the river flow?";

fn outcomes(v: &Value) -> Vec<String> {
    v["hypic"]["segments"]
        .as_array()
        .unwrap_or_else(|| panic!("no segments in {v}"))
        .iter()
        .map(|s| s["outcome"].as_str().unwrap().to_string())
        .collect()
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
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

async fn upload(s: &Srv, name: &str, kind: &str, module: &[u8], params: Value) -> (u16, Value) {
    s.post_as(
        &s.op_token,
        "/v1/admin/policies",
        &json!({"name": name, "kind": kind, "wasm_base64": b64(module), "params": params}),
    )
    .await
}

/// Waits for an audit row of `action` (the writer may lag) and returns it.
async fn audit_row(s: &Srv, action: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let (st, log) = s
            .get_as(
                Some(&s.op_token),
                &format!("/v1/admin/audit?action={action}"),
            )
            .await;
        assert_eq!(st, 200, "{log}");
        if let Some(r) = log.as_array().and_then(|a| a.first()) {
            return r.clone();
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no {action} row");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A prompt whose first segment differs per `n` (no private prefix snapshot, so
/// each segment is offered to the public pool's admission).
fn req(n: usize, doc: &str) -> Value {
    json!({"segments": [{"text": format!("Preface {n}.")}, {"text": doc}, {"text": Q}], "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_policy_counts_live_decisions_without_applying_them() {
    let s = start(|c| c.invalidation_sweep_ms = 0).await;
    // Candidate: admit from the second sighting on; the active admission stays
    // the native admit-all.
    let (st, rec) = upload(
        &s,
        "second",
        "admission",
        builtin::module("second_sighting").unwrap(),
        json!({}),
    )
    .await;
    assert_eq!(st, 200, "{rec}");
    let id = rec["id"].as_i64().unwrap();

    // A tenant token is refused every shadow route.
    let shadow_path = format!("/v1/admin/policies/{id}/shadow");
    for (m, p) in [
        (reqwest::Method::POST, shadow_path.as_str()),
        (reqwest::Method::GET, "/v1/admin/policies/shadow"),
        (reqwest::Method::GET, "/v1/admin/policies/shadow/admission"),
        (
            reqwest::Method::DELETE,
            "/v1/admin/policies/shadow/admission",
        ),
    ] {
        let (st, v) = send(&s, m.clone(), &s.token, p, None).await;
        assert_error(st, &v, 403, "operator_required");
    }
    // Parameters the schema refuses: 400 naming the parameter; nothing starts.
    let (st, v) = send(
        &s,
        reqwest::Method::POST,
        &s.op_token,
        &shadow_path,
        Some(json!({"params": {"min_sightings": 0}})),
    )
    .await;
    assert_error(st, &v, 400, "invalid_param");
    assert_eq!(v["error"]["param"], "params.min_sightings", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("below the minimum 1"),
        "{v}"
    );
    let (st, _) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow/admission")
        .await;
    assert_eq!(st, 404);

    // Start it (no body: the stored parameters, completed with the defaults).
    let (st, v) = send(&s, reqwest::Method::POST, &s.op_token, &shadow_path, None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["policy_id"], id);
    assert_eq!(v["params"], json!({"min_sightings": 2}));
    assert_eq!(v["active_policy_id"], Value::Null);
    assert_eq!(v["candidate"]["calls"], 0);
    let row = audit_row(&s, "policy.shadow_start").await;
    assert_eq!(row["actor"], "u@ops", "{row}");
    assert_eq!(row["target"], id.to_string());

    // Live traffic: the active policy admits the new document and the next
    // request hits it (the shadow, which would have rejected it, was not applied).
    let doc = "Document S. The shadow of the tower falls across the square at noon.";
    let gen = |r: &Value| r["usage"]["completion_tokens"].as_u64().unwrap();
    let (st, r) = s.post("/v1/completions", &req(1, doc)).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(outcomes(&r), ["miss", "miss", "computed"], "{r}");
    let mut generated = gen(&r);
    let (_, r) = s.post("/v1/completions", &req(2, doc)).await;
    assert_eq!(outcomes(&r), ["miss", "hit", "computed"], "{r}");
    generated += gen(&r);

    let (st, v1) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow/admission")
        .await;
    assert_eq!(st, 200, "{v1}");
    let (cand, act) = (&v1["candidate"], &v1["active"]);
    let calls = act["calls"].as_u64().unwrap();
    assert!(calls >= 3, "three misses were offered: {v1}");
    assert_eq!(cand["calls"].as_u64(), Some(calls), "same calls: {v1}");
    assert_eq!(act["admitted"].as_u64(), Some(calls), "native admits all");
    assert_eq!(act["rejected"], 0);
    // The three entries offered were first sightings: the candidate rejected
    // them, disagreeing with the active policy on each.
    let rejected = cand["rejected"].as_u64().unwrap();
    assert!(rejected >= 3, "{v1}");
    assert_eq!(cand["admitted"].as_u64().unwrap() + rejected, calls);
    assert_eq!(v1["disagreed"].as_u64(), Some(rejected));
    assert_eq!(v1["agreed"].as_u64(), Some(calls - rejected));
    assert_eq!(cand["faults"], 0);
    assert!(act["admitted_bytes"].as_u64().unwrap() > 0);
    // The list route has the same shadow.
    let (st, list) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow")
        .await;
    assert_eq!(st, 200);
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["kind"], "admission");

    // The counts move with more traffic: two more first sightings.
    let doc2 = "Document T. Two bells ring from the harbour before the ferry leaves.";
    let (_, r) = s.post("/v1/completions", &req(3, doc2)).await;
    generated += gen(&r);
    let (_, v2) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow/admission")
        .await;
    assert!(
        v2["candidate"]["calls"].as_u64().unwrap() > calls,
        "{v1} then {v2}"
    );
    assert!(v2["candidate"]["rejected"].as_u64().unwrap() > cand["rejected"].as_u64().unwrap());

    // Stop: the final counts, audited; the shadow is gone and counts stop.
    let (st, fin) = send(
        &s,
        reqwest::Method::DELETE,
        &s.op_token,
        "/v1/admin/policies/shadow/admission",
        None,
    )
    .await;
    assert_eq!(st, 200, "{fin}");
    assert!(
        fin["candidate"]["calls"].as_u64().unwrap() >= v2["candidate"]["calls"].as_u64().unwrap()
    );
    let row = audit_row(&s, "policy.shadow_stop").await;
    assert_eq!(row["actor"], "u@ops");
    assert!(
        row["detail"].as_str().unwrap().contains("\"candidate\""),
        "{row}"
    );
    let (st, v) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow/admission")
        .await;
    assert_error(st, &v, 404, "not_found");
    let (st, v) = send(
        &s,
        reqwest::Method::DELETE,
        &s.op_token,
        "/v1/admin/policies/shadow/admission",
        None,
    )
    .await;
    assert_eq!(st, 404, "{v}");
    let (st, v) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow/caching")
        .await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "kind");
    // Traffic after the stop does not reach the stopped shadow.
    let (_, r) = s
        .post("/v1/completions", &req(4, "Document U. Under the bridge."))
        .await;
    generated += gen(&r);
    let (_, list) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/shadow")
        .await;
    assert_eq!(list, json!([]));

    // Usage per tenant moved with the completions above.
    let (st, all) = s.get_as(Some(&s.op_token), "/v1/admin/tenants").await;
    assert_eq!(st, 200, "{all}");
    let acme = all
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == "acme")
        .unwrap_or_else(|| panic!("no acme in {all}"))
        .clone();
    assert_eq!(acme["serving"]["requests"], 4, "{acme}");
    assert!(acme["serving"]["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(
        acme["serving"]["cached_tokens"].as_u64().unwrap() > 0,
        "one hit: {acme}"
    );
    assert!(acme["serving"]["segment_hits"].as_u64().unwrap() >= 1);
    assert_eq!(acme["serving"]["completion_tokens"], generated, "{acme}");
    assert_eq!(
        acme["principals"],
        json!([{"sub": "u@acme", "role": "tenant"}])
    );
    let (st, own) = s.get("/v1/tenants/acme/usage").await;
    assert_eq!(st, 200, "{own}");
    assert_eq!(own["serving"], acme["serving"]);
    let (st, v) = s.get("/v1/tenants/globex/usage").await;
    assert_error(st, &v, 403, "other_tenant");
    let (st, v) = s.get_as(Some(&s.token), "/v1/admin/tenants").await;
    assert_error(st, &v, 403, "operator_required");
    let (st, v) = s
        .get_as(Some(&s.op_token), "/v1/tenants/nobody/usage")
        .await;
    assert_eq!(st, 404, "{v}");
    s.server.stop().await;
}

/// A minimal ABI-v2 admission module that admits everything and declares
/// `schema` in its `hypic.params` section.
fn v2_module(schema: &str) -> Vec<u8> {
    let escaped = schema
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    wat::parse_str(format!(
        r#"(module
          (@custom "hypic.params" "{escaped}")
          (memory (export "memory") 1)
          (func (export "hypic_abi_version") (result i32) i32.const 2)
          (func (export "hypic_policy_kind") (result i32) i32.const 2)
          (func (export "hypic_buf") (result i32) i32.const 0)
          (func (export "hypic_buf_cap") (result i32) i32.const 65536)
          (func (export "hypic_configure") (param i32) (result i32) i32.const 0)
          (func (export "hypic_admit") (param i64) (result i32) i32.const 1))"#
    ))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parameter_schema_is_checked_at_upload_activation_and_dry_run() {
    let s = start(|c| c.invalidation_sweep_ms = 0).await;
    // A malformed schema: refused at upload, naming the problem.
    let bad = v2_module(
        r#"{"params": [{"name": "ratio", "type": "float", "min": 1, "max": 0, "default": 0.5}]}"#,
    );
    let (st, v) = upload(&s, "bad", "admission", &bad, json!({})).await;
    assert_error(st, &v, 400, "invalid_param_schema");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("params[0] (\"ratio\"): min 1 is above max 0"),
        "{v}"
    );
    // ABI v2 without the section: refused.
    let none = wat::parse_str(
        r#"(module
          (memory (export "memory") 1)
          (func (export "hypic_abi_version") (result i32) i32.const 2)
          (func (export "hypic_policy_kind") (result i32) i32.const 2)
          (func (export "hypic_buf") (result i32) i32.const 0)
          (func (export "hypic_buf_cap") (result i32) i32.const 65536)
          (func (export "hypic_configure") (param i32) (result i32) i32.const 0)
          (func (export "hypic_admit") (param i64) (result i32) i32.const 1))"#,
    )
    .unwrap();
    let (st, v) = upload(&s, "none", "admission", &none, json!({})).await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("hypic.params"),
        "{v}"
    );

    // Every type; a bad value at upload names the parameter.
    let schema = r#"{"params": [
        {"name": "limit", "type": "int", "min": 1, "max": 10, "default": 3, "description": "how many"},
        {"name": "ratio", "type": "float", "min": 0, "max": 1, "default": 0.5},
        {"name": "strict", "type": "bool", "default": false},
        {"name": "label", "type": "string", "max_len": 8, "default": "x"},
        {"name": "mode", "type": "enum", "choices": ["lru", "lfu"], "default": "lru"}]}"#;
    let m = v2_module(schema);
    let (st, v) = upload(&s, "typed", "admission", &m, json!({"mode": "fifo"})).await;
    assert_error(st, &v, 400, "invalid_param");
    assert_eq!(v["error"]["param"], "params.mode");
    let (st, v) = upload(&s, "typed", "admission", &m, json!({"colour": 1})).await;
    assert_error(st, &v, 400, "invalid_param");
    assert_eq!(v["error"]["param"], "params.colour");
    let (st, rec) = upload(
        &s,
        "typed",
        "admission",
        &m,
        json!({"ratio": 0.25, "label": "hot"}),
    )
    .await;
    assert_eq!(st, 200, "{rec}");
    let id = rec["id"].as_i64().unwrap();

    // The detail: schema, effective values (defaults filled in), module contents.
    let (st, d) = s
        .get_as(Some(&s.op_token), &format!("/v1/admin/policies/{id}"))
        .await;
    assert_eq!(st, 200, "{d}");
    assert_eq!(d["param_schema"]["params"].as_array().unwrap().len(), 5);
    assert_eq!(d["param_schema"]["params"][0]["type"], "int");
    assert_eq!(d["param_schema"]["params"][0]["description"], "how many");
    assert_eq!(
        d["effective_params"],
        json!({"limit": 3, "ratio": 0.25, "strict": false, "label": "hot", "mode": "lru"})
    );
    assert_eq!(d["module"]["bytes"].as_u64(), Some(m.len() as u64));
    assert!(d["module"]["exports"]
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "hypic_admit" && e["kind"] == "func"));
    assert_eq!(d["module"]["custom_sections"][0]["name"], "hypic.params");
    assert_eq!(d["version"], 1);
    let (st, v) = s
        .get_as(Some(&s.token), &format!("/v1/admin/policies/{id}"))
        .await;
    assert_error(st, &v, 403, "operator_required");

    // Dry run with parameters the schema refuses: 400 naming the parameter.
    let trace = r#"{"tenant":"a","segments":["x"],"tokens":[10],"bytes":[100]}"#;
    let (st, v) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{id}/dry-run"),
            &json!({"trace": trace, "capacity_bytes": 1000, "params": {"limit": 11}}),
        )
        .await;
    assert_error(st, &v, 400, "invalid_param");
    assert_eq!(v["error"]["param"], "params.limit");
    let (st, v) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{id}/dry-run"),
            &json!({"trace": trace, "capacity_bytes": 1000, "params": {"limit": 10}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");

    // Activation with a refused value: 400, nothing activated.
    let act = format!("/v1/admin/policies/{id}/activate");
    let (st, v) = s
        .post_as(&s.op_token, &act, &json!({"params": {"strict": "yes"}}))
        .await;
    assert_error(st, &v, 400, "invalid_param");
    assert_eq!(v["error"]["param"], "params.strict");
    let (_, st_now) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/stats")
        .await;
    assert_eq!(st_now["active"]["admission"], Value::Null);
    // Activation with the stored parameters, or the same effective values
    // spelled out (defaults included): this version.
    let (st, v) = s.post_as(&s.op_token, &act, &json!({})).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["active"], id);
    let (st, v) = s
        .post_as(
            &s.op_token,
            &act,
            &json!({"params": {"ratio": 0.25, "label": "hot", "limit": 3}}),
        )
        .await;
    // The same version with the same effective values is active already: 409,
    // no new version.
    assert_error(st, &v, 409, "already_active");
    let (_, listed) = s.get_as(Some(&s.op_token), "/v1/admin/policies").await;
    assert_eq!(
        listed.as_array().unwrap().len(),
        1,
        "no new version for the same effective values: {listed}"
    );
    // Activation with new parameters: stored as the next version, which is active.
    let (st, v) = s
        .post_as(
            &s.op_token,
            &act,
            &json!({"params": {"limit": 7, "strict": true}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let id2 = v["active"].as_i64().unwrap();
    assert_ne!(id2, id);
    let (_, d2) = s
        .get_as(Some(&s.op_token), &format!("/v1/admin/policies/{id2}"))
        .await;
    assert_eq!(d2["version"], 2, "{d2}");
    assert_eq!(d2["name"], "typed");
    assert_eq!(d2["active"], true);
    assert_eq!(d2["module_sha256"], d["module_sha256"]);
    assert_eq!(d2["effective_params"]["limit"], 7);
    assert_eq!(d2["effective_params"]["strict"], true);
    let row = audit_row(&s, "policy.activate").await;
    assert_eq!(row["actor"], "u@ops", "{row}");

    // The built-ins declare their parameters: quota's two integers.
    let (st, q) = upload(
        &s,
        "quota",
        "admission",
        builtin::module("quota").unwrap(),
        json!({}),
    )
    .await;
    assert_eq!(st, 200, "{q}");
    let (_, qd) = s
        .get_as(
            Some(&s.op_token),
            &format!("/v1/admin/policies/{}", q["id"]),
        )
        .await;
    assert_eq!(
        qd["effective_params"],
        json!({"quota_permille": 500, "quota_bytes": 0}),
        "{qd}"
    );

    // The new routes are in the OpenAPI document.
    let (st, doc) = s.get_as(None, "/openapi.json").await;
    assert_eq!(st, 200);
    for p in [
        "/v1/admin/policies/{id}",
        "/v1/admin/policies/{id}/shadow",
        "/v1/admin/policies/shadow",
        "/v1/admin/policies/shadow/{kind}",
        "/v1/admin/tenants",
        "/v1/tenants/{tenant}/usage",
    ] {
        assert!(
            doc["paths"][p].is_object(),
            "{p} missing from /openapi.json"
        );
    }
    assert!(doc["paths"]["/v1/admin/policies/shadow/{kind}"]["delete"].is_object());
    assert!(doc["components"]["schemas"]["ShadowView"].is_object());
    assert!(doc["components"]["schemas"]["ParamSchema"].is_object());
    s.server.stop().await;
}
