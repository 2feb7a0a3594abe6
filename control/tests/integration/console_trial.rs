//! What a first trial of the operator console found, against a real `hypic
//! serve`: segment rows carry hits and last use and stay apart per owner;
//! activating the active policy version is a 409 and a rollback goes to an
//! earlier *different* version; every 400 names its parameter, a file that is not
//! Wasm gets one line, an out-of-range parameter the allowed range; the console's
//! icon is served, and its routes are logged by route.
use crate::serve_common;

use base64::Engine as _;
use hypic_control::policy::builtin;
use serde_json::{json, Value};
use serve_common::{assert_error, start, Srv};

const SYS: &str = "You answer questions from the documents below, citing them.";
const DOC_ACME: &str =
    "Document A. The river flows north through the old city, past the market square and the mill.";
const DOC_GLOBEX: &str =
    "Document G. The harbour closes at dusk; fishing boats return before the lighthouse is lit.";

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

async fn upload(s: &Srv, name: &str, kind: &str, module: &[u8], params: Value) -> (u16, Value) {
    s.post_as(
        &s.op_token,
        "/v1/admin/policies",
        &json!({"name": name, "kind": kind, "wasm_base64": b64(module), "params": params}),
    )
    .await
}

/// The rows of `GET /v1/segments` for `token` with the id `id`.
async fn rows(s: &Srv, token: &str, id: &str) -> Vec<Value> {
    let (st, v) = s.get_as(Some(token), "/v1/segments").await;
    assert_eq!(st, 200, "{v}");
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["id"] == id)
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segment_rows_show_hits_and_last_use_apart_per_owner() {
    let s = start(|_| {}).await;
    // The same id, owned by two tenants.
    for (tok, doc) in [(&s.token, DOC_ACME), (&s.token_b, DOC_GLOBEX)] {
        let (st, v) = s
            .post_as(tok, "/v1/segments", &json!({"id": "doc", "content": doc}))
            .await;
        assert_eq!(st, 200, "{v}");
    }
    // acme uses its segment after another: a hit on its prefilled entry.
    let (st, r) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"text": SYS}, {"id": "doc"}, {"text": "Where?"}],
                    "max_tokens": 1, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["hypic"]["segments"][1]["outcome"], "hit", "{r}");

    // The owner's row: resident, its hits and last use.
    let mine = rows(&s, &s.token, "doc").await;
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert!(mine[0]["hits"].as_u64().unwrap() >= 1, "{mine:?}");
    assert!(mine[0]["last_use_ms"].as_u64().unwrap() > 0, "{mine:?}");

    // The operator: two rows `doc`, one per owner, each as its owner uses it.
    let all = rows(&s, &s.op_token, "doc").await;
    assert_eq!(all.len(), 2, "{all:?}");
    let owners: Vec<&str> = all
        .iter()
        .map(|r| r["owner_tenant"].as_str().unwrap())
        .collect();
    assert_eq!(owners.len(), 2);
    assert_ne!(owners[0], owners[1], "{all:?}");
    assert_ne!(all[0]["address"], all[1]["address"]);
    let acme = all.iter().find(|r| r["owner_tenant"] == "acme").unwrap();
    let globex = all.iter().find(|r| r["owner_tenant"] == "globex").unwrap();
    assert_eq!(acme["residency"]["resident"], true, "{acme}");
    assert_eq!(acme["hits"], mine[0]["hits"], "{acme}");
    assert_eq!(acme["last_use_ms"], mine[0]["last_use_ms"], "{acme}");
    assert_eq!(globex["residency"]["resident"], true, "{globex}");
    assert_eq!(globex["hits"], 0, "prefilled, never used: {globex}");
    // One segment's detail, opened by address, reports the owner's namespace too.
    let (st, one) = s
        .get_as(
            Some(&s.op_token),
            &format!("/v1/segments/{}", acme["address"].as_str().unwrap()),
        )
        .await;
    assert_eq!(st, 200, "{one}");
    assert_eq!(one["owner_tenant"], "acme");
    assert_eq!(one["hypic"]["residency"]["resident"], true, "{one}");
    let hits: u64 = one["hypic"]["residency"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["hits"].as_u64())
        .sum();
    assert_eq!(Some(hits), acme["hits"].as_u64(), "{one}");
}

/// The `policy.activate` and `policy.rollback` audit rows, newest first.
async fn audit_rows(s: &Srv, action: &str) -> Vec<Value> {
    let (st, v) = s
        .get_as(
            Some(&s.op_token),
            &format!("/v1/admin/audit?action={action}"),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    v.as_array().unwrap().clone()
}

async fn stats(s: &Srv) -> Value {
    let (st, v) = s
        .get_as(Some(&s.op_token), "/v1/admin/policies/stats")
        .await;
    assert_eq!(st, 200, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn activating_the_active_version_is_409_and_rollback_skips_identical_versions() {
    let s = start(|_| {}).await;
    let id = |v: &Value| v["id"].as_i64().unwrap();
    let (_, gdsf) = upload(
        &s,
        "gdsf",
        "eviction",
        builtin::module("gdsf").unwrap(),
        json!({}),
    )
    .await;
    let (_, lru_a) = upload(
        &s,
        "lru-a",
        "eviction",
        builtin::module("lru").unwrap(),
        json!({}),
    )
    .await;
    // The same module and parameters under another name: an identical version.
    let (_, lru_b) = upload(
        &s,
        "lru-b",
        "eviction",
        builtin::module("lru").unwrap(),
        json!({}),
    )
    .await;
    let (c, a, b) = (id(&gdsf), id(&lru_a), id(&lru_b));
    assert_eq!(
        stats(&s).await["rollback_to"],
        json!({}),
        "nothing to roll back yet"
    );

    for p in [c, a] {
        let (st, v) = s
            .post_as(
                &s.op_token,
                &format!("/v1/admin/policies/{p}/activate"),
                &json!({}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["active"], p, "{v}");
    }
    // Again: 409 naming the version, no new activation or audit row.
    let before = audit_rows(&s, "policy.activate").await.len();
    for body in [json!({}), json!({"params": {}})] {
        let (st, v) = s
            .post_as(
                &s.op_token,
                &format!("/v1/admin/policies/{a}/activate"),
                &body,
            )
            .await;
        assert_error(st, &v, 409, "already_active");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(&format!("#{a} lru-a v1")) && msg.contains("already"),
            "{v}"
        );
    }
    assert_eq!(audit_rows(&s, "policy.activate").await.len(), before);
    assert_eq!(stats(&s).await["active"]["eviction"], a);

    // lru-b behaves as lru-a: a rollback from it skips lru-a and goes to gdsf.
    let (st, v) = s
        .post_as(
            &s.op_token,
            &format!("/v1/admin/policies/{b}/activate"),
            &json!({}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(stats(&s).await["rollback_to"]["eviction"], c);
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies/rollback",
            &json!({"kind": "eviction"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v, json!({"kind": "eviction", "active": c, "from": b}));
    let st_now = stats(&s).await;
    assert_eq!(st_now["active"]["eviction"], c, "{st_now}");
    // Next: the native default, then nothing.
    assert_eq!(st_now["rollback_to"]["eviction"], Value::Null, "{st_now}");
    assert!(st_now["rollback_to"].get("eviction").is_some(), "{st_now}");
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies/rollback",
            &json!({"kind": "eviction"}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["active"], Value::Null, "{v}");
    assert!(stats(&s).await["rollback_to"].get("eviction").is_none());
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/admin/policies/rollback",
            &json!({"kind": "eviction"}),
        )
        .await;
    assert_error(st, &v, 404, "not_found");
    let rb = audit_rows(&s, "policy.rollback").await;
    assert_eq!(rb.len(), 2, "{rb:?}");
    assert_eq!(rb[1]["target"], c.to_string(), "{rb:?}");
}

/// Sends `method path body` as the operator and asserts a 400 naming `param`.
async fn assert_names(
    s: &Srv,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
    param: &str,
) -> String {
    let mut b = s
        .client
        .request(method.clone(), format!("{}{path}", s.url))
        .bearer_auth(&s.op_token);
    if let Some(v) = &body {
        b = b.json(v);
    }
    let r = b.send().await.unwrap();
    let st = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!(st, 400, "{method} {path} {body:?}: {v}");
    assert_eq!(v["error"]["param"], param, "{method} {path} {body:?}: {v}");
    v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_400_names_its_parameter_and_says_what_is_allowed() {
    use reqwest::Method;
    let s = start(|_| {}).await;
    let lru = b64(builtin::module("lru").unwrap());
    let ttl = b64(builtin::module("ttl").unwrap());
    let post = Method::POST;
    let up = "/v1/admin/policies";
    // Policy upload.
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"kind": "eviction", "wasm_base64": lru})),
        "name",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "x", "kind": 7, "wasm_base64": lru})),
        "kind",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "x", "kind": "nope", "wasm_base64": lru})),
        "kind",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "x", "kind": "eviction", "wasm_base64": "!!"})),
        "wasm_base64",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "a b", "kind": "eviction", "wasm_base64": lru})),
        "name",
    )
    .await;
    // A file that is not Wasm: one line saying so.
    let msg = assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "x", "kind": "eviction", "wasm_base64": b64(b"#!/bin/sh\necho not wasm\n")})),
        "wasm_base64",
    )
    .await;
    assert!(!msg.contains('\n'), "{msg:?}");
    assert!(msg.contains("not a Wasm module"), "{msg}");
    assert!(
        msg.contains("23 21 2f 62"),
        "the bytes it starts with: {msg}"
    );
    // A module of the wrong kind: the module is the field at fault.
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "x", "kind": "admission", "wasm_base64": lru})),
        "wasm_base64",
    )
    .await;
    // An out-of-range ttl: the allowed range.
    let msg = assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "t", "kind": "invalidation", "wasm_base64": ttl, "params": {"ttl_ms": -5}})),
        "params.ttl_ms",
    )
    .await;
    assert!(
        msg.contains("-5 is below the minimum 0 (allowed: 0 or more)"),
        "{msg}"
    );
    let msg = assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "t", "kind": "invalidation", "wasm_base64": ttl, "params": {"ttl_ms": 1e30}})),
        "params.ttl_ms",
    )
    .await;
    assert!(
        msg.contains("must be an integer (allowed: 0 or more)"),
        "{msg}"
    );
    // ABI v1 parameters (no schema) name theirs too.
    assert_names(
        &s,
        post.clone(),
        up,
        Some(json!({"name": "x", "kind": "eviction", "wasm_base64": lru, "params": {"k": "text"}})),
        "params.k",
    )
    .await;

    // Activation, rollback, dry run.
    let (st, rec) = s
        .post_as(
            &s.op_token,
            up,
            &json!({"name": "lru", "kind": "eviction", "wasm_base64": lru}),
        )
        .await;
    assert_eq!(st, 200, "{rec}");
    let id = rec["id"].as_i64().unwrap();
    assert_names(
        &s,
        post.clone(),
        "/v1/admin/policies/abc/activate",
        None,
        "id",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        &format!("/v1/admin/policies/{id}/activate"),
        Some(json!({"nope": 1})),
        "nope",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        "/v1/admin/policies/rollback",
        Some(json!({"kind": "nope"})),
        "kind",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        "/v1/admin/policies/rollback",
        Some(json!({})),
        "kind",
    )
    .await;
    let dry = format!("/v1/admin/policies/{id}/dry-run");
    assert_names(
        &s,
        post.clone(),
        &dry,
        Some(json!({"trace": "", "capacity_bytes": 0})),
        "capacity_bytes",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        &dry,
        Some(json!({"trace": "{", "capacity_bytes": 1000})),
        "trace",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        &dry,
        Some(json!({"trace": ""})),
        "capacity_bytes",
    )
    .await;

    // Segment routes, groups, audit.
    assert_names(
        &s,
        post.clone(),
        "/v1/segments",
        Some(json!({"id": "a b", "content": "Some text."})),
        "id",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        "/v1/segments",
        Some(json!({"id": "d", "content": "Some text.", "public": "yes"})),
        "public",
    )
    .await;
    let (st, v) = s
        .post_as(
            &s.op_token,
            "/v1/segments",
            &json!({"id": "d", "content": "Some text.", "prefill": false}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_names(
        &s,
        post.clone(),
        "/v1/segments/d/grants",
        Some(json!({"tenant": "a b"})),
        "tenant",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        "/v1/segments/d/grants",
        Some(json!({})),
        "tenant",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        "/v1/segments/d/group-grants",
        Some(json!({"group": "a b"})),
        "group",
    )
    .await;
    assert_names(
        &s,
        Method::GET,
        "/v1/segments/d/versions/abc",
        None,
        "version",
    )
    .await;
    assert_names(&s, Method::GET, "/v1/segments?limit=0", None, "limit").await;
    assert_names(
        &s,
        Method::GET,
        "/v1/segments/d/why?version=abc",
        None,
        "version",
    )
    .await;
    assert_names(
        &s,
        post.clone(),
        "/v1/admin/groups",
        Some(json!({"id": "a b"})),
        "id",
    )
    .await;
    assert_names(
        &s,
        Method::GET,
        "/v1/admin/audit?since_ms=soon",
        None,
        "since_ms",
    )
    .await;
    assert_names(&s, Method::GET, "/v1/admin/audit?limit=x", None, "limit").await;
    for bad in ["0", "-1", "10001"] {
        let path = format!("/v1/admin/audit?limit={bad}");
        assert_names(&s, Method::GET, &path, None, "limit").await;
    }
}

#[test]
fn an_out_of_range_token_ttl_says_the_allowed_range() {
    let dir = tempfile::tempdir().unwrap();
    let args = |ttl: &str| hypic_control::auth::TokenArgs {
        tenant: "demo".into(),
        role: "tenant".into(),
        ttl: ttl.into(),
        sub: None,
        audience: hypic_control::auth::DEFAULT_AUDIENCE.into(),
        data_dir: dir.path().to_path_buf(),
        max_lifetime: "90d".into(),
    };
    for ttl in ["0", "91d", "soon"] {
        let e = format!(
            "{:#}",
            hypic_control::auth::token_from_args(&args(ttl)).unwrap_err()
        );
        assert!(e.contains("allowed: 1 s to 7776000 s"), "--ttl {ttl}: {e}");
    }
    assert!(hypic_control::auth::token_from_args(&args("7d")).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_icon_is_served_and_its_routes_are_logged_by_route() {
    let cap = crate::serve_netops::log_capture();
    let s = start(|_| {}).await;
    let mut rids = vec![];
    for (path, mime) in [
        ("/favicon.ico", "image/x-icon"),
        ("/ui/favicon.ico", "image/x-icon"),
        ("/ui/favicon.svg", "image/svg+xml"),
        ("/ui/", "text/html; charset=utf-8"),
        ("/ui/policies", "text/html; charset=utf-8"),
    ] {
        let r = s
            .client
            .get(format!("{}{path}", s.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.headers()["content-type"], mime, "{path}");
        assert!(
            r.headers().contains_key("content-security-policy"),
            "{path}"
        );
        rids.push((
            path,
            r.headers()["x-request-id"].to_str().unwrap().to_string(),
        ));
        assert!(!r.bytes().await.unwrap().is_empty(), "{path}");
    }
    // The page names its icon, which the CSP allows (img-src 'self').
    let r = s.client.get(format!("{}/ui/", s.url)).send().await.unwrap();
    let csp = r.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(csp.contains("img-src 'self'"), "{csp}");
    assert!(r.text().await.unwrap().contains("href=\"/ui/favicon.svg\""));
    s.server.stop().await;
    let all = cap.text();
    for (path, rid) in rids {
        let line = all
            .lines()
            .find(|l| l.contains(&format!("request_id={rid}")))
            .unwrap_or_else(|| panic!("no log line for {path}"));
        assert!(!line.contains("route=unmatched"), "{path}: {line}");
        let want = match path {
            "/favicon.ico" => "route=/favicon.ico ",
            "/ui/" => "route=/ui/ ",
            _ => "route=/ui/{*path} ",
        };
        assert!(line.contains(want), "{path}: {line}");
    }
}
