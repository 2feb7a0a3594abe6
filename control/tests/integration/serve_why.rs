//! "Why did it miss?" through the real server (`GET /v1/segments/{id}/why`,
//! `POST /v1/segments/{id}/evict`): each reason is provoked, then asked for.
use crate::serve_common;

use base64::Engine as _;
use hypic_control::policy::builtin;
use serde_json::{json, Value};
use serve_common::{assert_error, start, Srv};

const SYS: &str = "You are a careful assistant. Answer from the documents only.";
const Q: &str = "Question: what does the document say?";

fn codes(v: &Value) -> Vec<String> {
    v["reasons"]
        .as_array()
        .unwrap_or_else(|| panic!("no reasons: {v}"))
        .iter()
        .map(|r| r["code"].as_str().unwrap().to_string())
        .collect()
}

fn entry(v: &Value, body_start: u64) -> &Value {
    v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["body_start"] == body_start)
        .unwrap_or_else(|| panic!("no entry {body_start}: {v}"))
}

async fn why(s: &Srv, token: &str, path: &str) -> (u16, Value) {
    s.get_as(Some(token), path).await
}

async fn register(s: &Srv, id: &str, content: &str, prefill: bool) -> Value {
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": id, "content": content, "prefill": prefill}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eviction_names_the_active_policy_its_version_and_the_tier() {
    // A 1 MiB public pool fills after a few dozen segments.
    let s = start(|c| c.public_pool_mib = 1).await;
    // The operator activates the Wasm LRU as the eviction policy.
    let b64 = base64::engine::general_purpose::STANDARD.encode(builtin::module("lru").unwrap());
    let (st, p) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies",
            &json!({"name": "lru-why", "kind": "eviction", "wasm_base64": b64, "params": {}}),
        )
        .await;
    assert_eq!(st, 200, "{p}");
    let pid = p["id"].as_i64().unwrap();
    let (st, a) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{pid}/activate"),
            &json!({}),
        )
        .await;
    assert_eq!(st, 200, "{a}");

    register(
        &s,
        "doc-0",
        "Document zero. The lighthouse keeper counted ships every night until dawn.",
        true,
    )
    .await;
    let (st, w) = why(&s, &s.token, "/v1/segments/doc-0/why").await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(w["object"], "segment.why");
    assert_eq!(w["tenant"], "acme");
    assert_eq!(w["resident"], true, "{w}");
    assert_eq!(entry(&w, 0)["tier"], "host", "{w}");
    assert!(entry(&w, 0)["bytes"].as_u64().unwrap() > 0);
    assert!(codes(&w).is_empty(), "{w}");
    assert_eq!(entry(&w, 0)["events"][0]["event"], "inserted", "{w}");

    // Fill the pool until doc-0 is evicted.
    let mut evicted = false;
    for i in 1..200 {
        let text = format!("Document {i}. Ship number {i} passed the lighthouse at hour {i} carrying {i} crates of salt.");
        register(&s, &format!("doc-{i}"), &text, true).await;
        let (_, w) = why(&s, &s.token, "/v1/segments/doc-0/why").await;
        if w["resident"] == false {
            evicted = true;
            break;
        }
    }
    assert!(evicted, "the 1 MiB pool never evicted doc-0");
    let (st, w) = why(&s, &s.token, "/v1/segments/doc-0/why").await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(codes(&w)[0], "evicted", "{w}");
    let r = &w["reasons"][0];
    assert_eq!(r["decided_by"]["policy_id"], pid, "{w}");
    assert_eq!(r["decided_by"]["policy_name"], "lru-why", "{w}");
    assert_eq!(r["decided_by"]["policy_version"], 1, "{w}");
    assert!(r["message"].as_str().unwrap().contains("host tier"), "{w}");
    assert!(r["at_ms"].as_u64().unwrap() > 1_600_000_000_000, "{w}");
    let ev = entry(&w, r["body_start"].as_u64().unwrap())["events"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(ev.last().unwrap()["event"], "evicted", "{w}");
    assert_eq!(ev.last().unwrap()["tier"], "host", "{w}");
    assert!(entry(&w, 0)["tier"].is_null(), "{w}");

    // The request path reports the same reason, and the why view records it.
    let (st, c) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"id": "doc-0"}, {"text": Q}], "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["hypic"]["segments"][0]["miss_reason"], "evicted", "{c}");
    let (_, w) = why(&s, &s.token, "/v1/segments/doc-0/why").await;
    let last = &w["recent"][0];
    assert_eq!(
        (&last["event"], &last["outcome"], &last["miss_reason"]),
        (&json!("request"), &json!("miss"), &json!("evicted")),
        "{w}"
    );
    assert_eq!(entry(&w, 0)["tier"], "host", "rebuilt by the miss: {w}");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_seen_too_short_superseded_evicted_on_request_and_deleted() {
    let s = start(|_| {}).await;
    // Never seen: registered without a prefill, never used.
    register(
        &s,
        "cold",
        "Cold document. Nobody has asked about the glacier yet.",
        false,
    )
    .await;
    let (st, w) = why(&s, &s.token, "/v1/segments/cold/why").await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(w["resident"], false);
    assert_eq!(codes(&w), ["never_seen", "never_seen"], "{w}");
    assert!(w["reasons"][0]["at_ms"].is_null());
    assert!(entry(&w, 0)["events"].as_array().unwrap().is_empty());

    // Too short for the seam window (8 tokens): the body entry is never built.
    let short = register(&s, "short", "Hi.", true).await;
    let n = short["hypic"]["tokens"].as_u64().unwrap();
    assert!(n <= 8, "{short}");
    let (_, w) = why(&s, &s.token, "/v1/segments/short/why").await;
    assert_eq!(entry(&w, 0)["tier"], "host", "{w}");
    assert_eq!(entry(&w, 8)["cacheable"], false, "{w}");
    assert_eq!(codes(&w), ["too_short_for_seam"], "{w}");
    assert!(w["reasons"][0]["message"]
        .as_str()
        .unwrap()
        .contains(&format!("has {n} tokens")));
    // The request path agrees.
    let (_, c) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"text": SYS}, {"id": "short"}, {"text": Q}], "max_tokens": 1}),
        )
        .await;
    assert_eq!(
        c["hypic"]["segments"][1]["miss_reason"], "too_short_for_seam",
        "{c}"
    );

    // Superseded: version 2 replaces version 1; a request naming 1 is refused.
    register(&s, "doc", "Version one. The bridge opens at noon.", true).await;
    let r = s
        .client
        .put(format!("{}/v1/segments/doc", s.url))
        .bearer_auth(&s.token)
        .json(&json!({"content": "Version two. The bridge opens at midnight."}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (st, e) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"id": "doc", "version": 1}, {"text": Q}], "max_tokens": 1}),
        )
        .await;
    assert_error(st, &e, 409, "version_mismatch");
    let (st, w) = why(&s, &s.token, "/v1/segments/doc/why?version=1").await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(w["version"], 2);
    assert_eq!(w["resident"], true, "the new version is prefilled: {w}");
    let sup: Vec<&Value> = w["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["code"] == "superseded_version")
        .collect();
    assert_eq!(sup.len(), 3, "query, the refused request, the update: {w}");
    assert!(sup.iter().all(|r| r["at_ms"].as_u64().is_some()), "{w}");
    assert!(
        sup.iter().any(|r| r["message"]
            .as_str()
            .unwrap()
            .contains("a request named version 1")),
        "{w}"
    );
    assert_eq!(w["recent"][0]["event"], "version_mismatch", "{w}");
    // Without the version, the update is still a reason (entries of v1 evicted).
    let (_, w) = why(&s, &s.token, "/v1/segments/doc/why").await;
    assert_eq!(
        codes(&w),
        ["superseded_version", "superseded_version"],
        "the refused request, the update: {w}"
    );
    // A version that never existed is a 400 naming the field.
    let (st, e) = why(&s, &s.token, "/v1/segments/doc/why?version=9").await;
    assert_error(st, &e, 400, "invalid_value");
    assert_eq!(e["error"]["param"], "version");

    // Evicted on request (the owner): the entries were removed, by whom is said.
    let (st, ev) = s.post("/v1/segments/doc/evict", &json!({})).await;
    assert_eq!(st, 200, "{ev}");
    assert!(ev["evicted_entries"].as_u64().unwrap() >= 1, "{ev}");
    let (_, w) = why(&s, &s.token, "/v1/segments/doc/why").await;
    assert_eq!(w["resident"], false, "{w}");
    let c = codes(&w);
    assert_eq!(c[0], "evicted_on_request", "{w}");
    assert!(c.iter().filter(|x| *x == "invalidated").count() >= 1, "{w}");
    assert!(w["reasons"][0]["message"]
        .as_str()
        .unwrap()
        .contains("u@acme"));
    // Another tenant may not evict it (cannot even see it).
    let (st, e) = s
        .post_as(&s.token_b, "/v1/segments/doc/evict", &json!({}))
        .await;
    assert_eq!(st, 404, "{e}");

    // Deleted.
    let r = s
        .client
        .delete(format!("{}/v1/segments/doc", s.url))
        .bearer_auth(&s.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (st, w) = why(&s, &s.token, "/v1/segments/doc/why").await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(codes(&w), ["deleted"], "{w}");
    assert!(w["version"].is_null() && w["entries"].as_array().unwrap().is_empty());
    // Never existed: 404.
    let (st, e) = why(&s, &s.token, "/v1/segments/nothing/why").await;
    assert_error(st, &e, 404, "segment_not_found");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_permission_is_explained_to_operators_and_tenants_stay_in_their_lane() {
    let s = start(|_| {}).await;
    let v = register(
        &s,
        "private",
        "Private notes of acme about the harbour contract.",
        true,
    )
    .await;
    let addr = v["address"].as_str().unwrap().to_string();
    // The operator asks for globex, which has no grant.
    let path = format!("/v1/segments/{addr}/why?tenant=globex");
    let (st, w) = why(&s, &s.op_token, &path).await;
    assert_eq!(st, 200, "{w}");
    assert_eq!(w["tenant"], "globex");
    assert_eq!(codes(&w), ["no_permission"], "{w}");
    assert!(w["entries"].as_array().unwrap().is_empty());
    // Asked for acme, the operator sees acme's resident entries.
    let (_, w) = why(
        &s,
        &s.op_token,
        &format!("/v1/segments/{addr}/why?tenant=acme"),
    )
    .await;
    assert_eq!(w["resident"], true, "{w}");
    // After a grant, globex's namespace is explained instead (never used there).
    let (st, g) = s
        .post("/v1/segments/private/grants", &json!({"tenant": "globex"}))
        .await;
    assert_eq!(st, 200, "{g}");
    let (_, w) = why(&s, &s.op_token, &path).await;
    assert!(!codes(&w).contains(&"no_permission".to_string()), "{w}");
    assert_eq!(w["entries"].as_array().unwrap().len(), 2, "{w}");

    // The operator names its own segment by id (ids are per namespace) and asks
    // for globex: a public one is globex's to read (by address), a private one not.
    for (id, public) in [("op-public", true), ("op-private", false)] {
        let (st, v) = s
            .post_as(
                &s.op_token,
                "/v1/segments",
                &json!({"id": id, "content": format!("Operator notes {id} for every tenant."), "public": public, "prefill": true}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let (st, w) = why(
            &s,
            &s.op_token,
            &format!("/v1/segments/{id}/why?tenant=globex"),
        )
        .await;
        assert_eq!(st, 200, "{w}");
        assert_eq!(w["address"], v["address"], "{w}");
        let denied = codes(&w).contains(&"no_permission".to_string());
        assert_eq!(denied, !public, "{id}: {w}");
        assert_eq!(
            w["entries"].as_array().unwrap().is_empty(),
            !public,
            "{id}: {w}"
        );
    }

    // A tenant asking about another tenant: 403 naming the field.
    let (st, e) = why(
        &s,
        &s.token_b,
        &format!("/v1/segments/{addr}/why?tenant=acme"),
    )
    .await;
    assert_error(st, &e, 403, "tenant_mismatch");
    assert_eq!(e["error"]["param"], "tenant");
    // A tenant asking for itself about a segment it may not read: 404, as elsewhere.
    let v2 = register(
        &s,
        "secret",
        "Acme secret: the vault code is kept offline.",
        false,
    )
    .await;
    let a2 = v2["address"].as_str().unwrap();
    let (st, e) = why(&s, &s.token_b, &format!("/v1/segments/{a2}/why")).await;
    assert_error(st, &e, 404, "segment_not_found");
    // Without a token: 401.
    let (st, _) = s.get_as(None, &format!("/v1/segments/{a2}/why")).await;
    assert_eq!(st, 401);
    // The routes are in the OpenAPI document.
    let (st, doc) = s.get_as(None, "/openapi.json").await;
    assert_eq!(st, 200);
    assert!(doc["paths"]["/v1/segments/{id}/why"]["get"].is_object());
    assert!(doc["paths"]["/v1/segments/{id}/evict"]["post"].is_object());
    assert!(doc["components"]["schemas"]["WhyAnswer"].is_object());
    s.server.stop().await;
}
