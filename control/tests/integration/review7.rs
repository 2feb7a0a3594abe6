//! Hostile review of the control plane (issue 7): regression tests for the
//! problems it found.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{start, Srv};

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
    let text = r.text().await.unwrap_or_default();
    (
        st,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// A segment id taken from the path is spliced into the URI forwarded to the
/// control plane: `doc%3Fx` ("doc?x") must not address segment `doc`, and ids
/// that cannot be put in a URI must get a JSON 404, not a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segment_ids_in_paths_cannot_address_other_resources() {
    let s = start(|_| {}).await;
    let (st, v) = send(
        &s,
        reqwest::Method::POST,
        &s.token,
        "/v1/segments",
        Some(json!({"id": "doc", "content": "The river flows north.", "prefill": false})),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    for (m, p) in [
        (reqwest::Method::DELETE, "/v1/segments/doc%3Fx"),
        (reqwest::Method::PUT, "/v1/segments/doc%3Fx"),
        (reqwest::Method::GET, "/v1/segments/doc%2Fversions"),
        (reqwest::Method::GET, "/v1/segments/a%20b"),
        (reqwest::Method::GET, "/v1/segments/%C3%A9"),
        (reqwest::Method::DELETE, "/v1/segments/a%20b"),
    ] {
        let body = (m == reqwest::Method::PUT).then(|| json!({"content": "Replaced."}));
        let (st, v) = send(&s, m.clone(), &s.token, p, body).await;
        serve_common::assert_error(st, &v, 404, "segment_not_found");
        eprintln!("{m} {p} -> {st} {v}");
    }
    let (st, v) = send(&s, reqwest::Method::GET, &s.token, "/v1/segments/doc", None).await;
    assert_eq!(st, 200, "segment doc was deleted through \"doc?x\": {v}");
    assert_eq!(v["current_version"], 1, "{v}");
}

use crate::common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use base64::Engine as _;
use http_body_util::BodyExt;
use hypic_control::auth::mint_token;
use hypic_control::catalog::Role;
use hypic_control::policy::{builtin, PolicyKind};
use hypic_control::{control_router, ControlState};
use tower::ServiceExt;

fn tok(tenant: &str, role: Role) -> String {
    mint_token(
        common::SECRET,
        "hypic",
        tenant,
        &format!("{}@{tenant}", role.as_str()),
        role,
        3600,
    )
    .unwrap()
}

async fn call(
    state: &ControlState,
    method: Method,
    uri: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut b = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let req = match body {
        Some(v) => b
            .header("content-type", "application/json")
            .body(Body::from(v.to_string()))
            .unwrap(),
        None => b.body(Body::empty()).unwrap(),
    };
    let resp = control_router(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, v)
}

async fn upload(s: &ControlState, ops: &str, name: &str, kind: &str, builtin_name: &str) -> i64 {
    let b64 =
        base64::engine::general_purpose::STANDARD.encode(builtin::module(builtin_name).unwrap());
    let (st, v) = call(
        s,
        Method::POST,
        "/v1/admin/policies",
        Some(ops),
        Some(json!({"name": name, "kind": kind, "wasm_base64": b64})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v["id"].as_i64().unwrap()
}

/// Concurrent activations (and rollbacks) of one kind: the policy the server
/// runs must be the one the catalog records as active.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_activations_leave_runtime_and_catalog_agreeing_sqlite() {
    let (c, _d) = common::sqlite_catalog().await;
    concurrent_activations(common::state(c)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_activations_leave_runtime_and_catalog_agreeing_postgres() {
    let (c, _guard) = common::pg_catalog().await;
    concurrent_activations(common::state(c)).await;
}

async fn concurrent_activations(s: ControlState) {
    let ops = tok("ops", Role::Operator);
    let a = upload(&s, &ops, "lru", "eviction", "lru").await;
    let b = upload(&s, &ops, "gdsf", "eviction", "gdsf").await;
    for round in 0..12 {
        let mut tasks = vec![];
        for i in 0..6 {
            let (s, ops) = (s.clone(), ops.clone());
            let id = if (i + round) % 2 == 0 { a } else { b };
            tasks.push(tokio::spawn(async move {
                if i == 5 {
                    call(
                        &s,
                        Method::POST,
                        "/v1/admin/policies/rollback",
                        Some(&ops),
                        Some(json!({"kind": "eviction"})),
                    )
                    .await
                } else {
                    call(
                        &s,
                        Method::POST,
                        &format!("/v1/admin/policies/{id}/activate"),
                        Some(&ops),
                        None,
                    )
                    .await
                }
            }));
        }
        for t in tasks {
            let (st, v) = t.await.unwrap();
            // 404: nothing to roll back; 409 `already_active`: that version was
            // active already when this activation got its turn.
            assert!(
                st.is_success()
                    || st == StatusCode::NOT_FOUND
                    || (st == StatusCode::CONFLICT && v["error"]["code"] == "already_active"),
                "{st} {v}"
            );
        }
        let in_catalog = s
            .catalog()
            .active_policy("eviction")
            .await
            .unwrap()
            .map(|r| r.id);
        let running = s.policies().active_id(PolicyKind::Eviction);
        assert_eq!(
            running, in_catalog,
            "round {round}: the server runs policy {running:?} but the catalog says {in_catalog:?} is active"
        );
    }
}

/// Path and query parameters of the wrong type get the OpenAI-style JSON
/// error every other bad input gets (axum's default rejections are plain text).
#[tokio::test]
async fn bad_path_and_query_parameters_get_json_errors() {
    let (c, _d) = common::sqlite_catalog().await;
    let s = common::state(c);
    let ops = tok("ops", Role::Operator);
    for (m, uri, body) in [
        (Method::POST, "/v1/admin/policies/abc/activate", None),
        (
            Method::POST,
            "/v1/admin/policies/99999999999999999999/dry-run",
            Some(json!({"trace": "", "capacity_bytes": 1})),
        ),
        (Method::GET, "/v1/admin/audit?limit=abc", None),
        (Method::GET, "/v1/segments/%FF", None),
    ] {
        let (st, v) = call(&s, m, uri, Some(&ops), body).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{uri}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{uri}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{uri}: {v}"
        );
    }
}

/// Postgres cannot store or compare NUL characters: input carrying one must be
/// refused as a 400 naming the problem on both backends, not fail as a 500
/// "internal catalog error" on the production backend only.
#[tokio::test]
async fn nul_characters_are_a_400_on_postgres() {
    let (c, _guard) = common::pg_catalog().await;
    let s = common::state(c);
    let a = tok("acme", Role::Tenant);
    let ops = tok("ops", Role::Operator);
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"id": "doc", "content": "ok"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    let cases: Vec<(Method, String, &str, Option<Value>)> = vec![
        (
            Method::POST,
            "/v1/segments".into(),
            &a,
            Some(json!({"id": "d2", "content": "a\0b"})),
        ),
        (
            Method::POST,
            "/v1/segments".into(),
            &a,
            Some(json!({"id": "d3", "content": "x", "name": "n\0"})),
        ),
        (
            Method::POST,
            "/v1/segments".into(),
            &a,
            Some(json!({"id": "d4", "content": "x", "tokens": {"m\0": 1}})),
        ),
        (
            Method::PUT,
            "/v1/segments/doc".into(),
            &a,
            Some(json!({"content": "new\0"})),
        ),
        (Method::GET, "/v1/segments/do%00c/versions".into(), &a, None),
        (
            Method::DELETE,
            "/v1/segments/doc/grants/x%00".into(),
            &a,
            None,
        ),
        (
            Method::POST,
            "/v1/segments/doc/group-grants".into(),
            &a,
            Some(json!({"group": "g\0"})),
        ),
        (
            Method::POST,
            "/v1/admin/groups".into(),
            &ops,
            Some(json!({"id": "g", "name": "G\0"})),
        ),
        (Method::GET, "/v1/admin/groups/g%00".into(), &ops, None),
        (
            Method::GET,
            "/v1/admin/audit?action=a%00".into(),
            &ops,
            None,
        ),
    ];
    for (m, uri, t, body) in cases {
        let (st, v) = call(&s, m.clone(), &uri, Some(t), body).await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{m} {uri}: {v}");
        assert_eq!(
            v["error"]["type"], "invalid_request_error",
            "{m} {uri}: {v}"
        );
    }
    // Nothing was lost: the failed update left version 1 current.
    let (st, v) = call(&s, Method::GET, "/v1/segments/doc", Some(&a), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["current_version"], 1, "{v}");
}

/// "." and ".." cannot be put in a URL path (clients normalise them away), so
/// they are not valid ids: such a segment could never be read, updated or
/// deleted.
#[tokio::test]
async fn dot_segment_ids_are_refused() {
    let (c, _d) = common::sqlite_catalog().await;
    let s = common::state(c);
    let a = tok("acme", Role::Tenant);
    for id in [".", ".."] {
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/segments",
            Some(&a),
            Some(json!({"id": id, "content": "x"})),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{id}: {v}");
    }
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"id": "...", "content": "x"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
}
