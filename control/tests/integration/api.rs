//! Router tests (tower oneshot): auth (401/403), tenant isolation of cache
//! keys, grant revocation, segment versions over HTTP, and the operator
//! policy lifecycle (upload, dry run, activate, roll back, audit).

use crate::common;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use base64::Engine as _;
use http_body_util::BodyExt;
use hypic_control::auth::{mint_token, Claims};
use hypic_control::catalog::{content_hash, Role};
use hypic_control::policy::builtin;
use hypic_control::{control_router, ControlState};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
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
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&bytes)}))
    };
    (status, v)
}

async fn sqlite_state() -> (ControlState, tempfile::TempDir) {
    let (c, d) = common::sqlite_catalog().await;
    (common::state(c), d)
}

fn assert_openai_error(v: &Value, typ: &str, code: &str) {
    assert_eq!(v["error"]["type"], typ, "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
}

fn claims(tenant: &str, role: &str, aud: &str, exp: u64) -> Claims {
    Claims {
        sub: "x".into(),
        tenant: tenant.into(),
        role: role.into(),
        aud: aud.into(),
        exp,
        iat: 0,
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
async fn bad_tokens_get_401() {
    let (s, _d) = sqlite_state().await;
    let (st, v) = call(&s, Method::GET, "/v1/whoami", None, None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_openai_error(&v, "authentication_error", "missing_token");

    // Forged: signed with another secret.
    let forged = mint_token(
        b"another-secret-another-secret-another-secret",
        "hypic",
        "a",
        "x",
        Role::Operator,
        3600,
    )
    .unwrap();
    let (st, v) = call(&s, Method::GET, "/v1/whoami", Some(&forged), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_openai_error(&v, "authentication_error", "invalid_token");

    // Tampered payload: tenant swapped, signature kept.
    let good = tok("a", Role::Tenant);
    let parts: Vec<&str> = good.split('.').collect();
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(&claims("b", "operator", "hypic", now() + 3600)).unwrap());
    let tampered = format!("{}.{}.{}", parts[0], payload, parts[2]);
    let (st, _) = call(&s, Method::GET, "/v1/whoami", Some(&tampered), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);

    // Expired.
    let key = EncodingKey::from_secret(common::SECRET).unwrap();
    let expired = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims("a", "tenant", "hypic", now() - 3600),
        &key,
    )
    .unwrap();
    let (st, v) = call(&s, Method::GET, "/v1/whoami", Some(&expired), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_openai_error(&v, "authentication_error", "token_expired");

    // Wrong audience.
    let wrong_aud = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims("a", "tenant", "other", now() + 3600),
        &key,
    )
    .unwrap();
    let (st, v) = call(&s, Method::GET, "/v1/whoami", Some(&wrong_aud), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    assert_openai_error(&v, "authentication_error", "wrong_audience");

    // Garbage and unknown role.
    let (st, _) = call(&s, Method::GET, "/v1/whoami", Some("not.a.jwt"), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let bad_role = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims("a", "root", "hypic", now() + 3600),
        &key,
    )
    .unwrap();
    let (st, _) = call(&s, Method::GET, "/v1/whoami", Some(&bad_role), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);

    // Good token: tenant comes from the token.
    let (st, v) = call(&s, Method::GET, "/v1/whoami", Some(&good), None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["tenant"], "a");
    assert_eq!(v["role"], "tenant");
    // Health needs no token.
    assert_eq!(
        call(&s, Method::GET, "/v1/control/health", None, None)
            .await
            .0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn jwks_rs256_and_eddsa_tokens() {
    let (s, _d) = sqlite_state().await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/keys");
    // Test-only keys (tests/keys/*.pem); their public halves are in jwks.json.
    let ed = EncodingKey::from_ed_pem(&std::fs::read(dir.join("ed25519.pem")).unwrap()).unwrap();
    let rsa = EncodingKey::from_rsa_pem(&std::fs::read(dir.join("rsa.pem")).unwrap()).unwrap();
    let c = claims("jw", "operator", "hypic", now() + 600);
    let mut h = Header::new(Algorithm::EdDSA);
    h.kid = Some("ed-1".into());
    let t = jsonwebtoken::encode(&h, &c, &ed).unwrap();
    let (st, v) = call(&s, Method::GET, "/v1/whoami", Some(&t), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["role"], "operator");
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some("rsa-1".into());
    let t = jsonwebtoken::encode(&h, &c, &rsa).unwrap();
    let (st, v) = call(&s, Method::GET, "/v1/whoami", Some(&t), None).await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["tenant"], "jw");
    // Unknown kid.
    let mut h = Header::new(Algorithm::RS256);
    h.kid = Some("rsa-9".into());
    let t = jsonwebtoken::encode(&h, &c, &rsa).unwrap();
    assert_eq!(
        call(&s, Method::GET, "/v1/whoami", Some(&t), None).await.0,
        StatusCode::UNAUTHORIZED
    );
}

#[tokio::test]
async fn tenant_user_on_operator_endpoints_gets_403() {
    let (s, _d) = sqlite_state().await;
    let t = tok("a", Role::Tenant);
    for (m, uri, body) in [
        (Method::GET, "/v1/admin/policies", None),
        (
            Method::POST,
            "/v1/admin/policies",
            Some(json!({"name":"x","kind":"eviction","wasm_base64":""})),
        ),
        (Method::POST, "/v1/admin/policies/1/activate", None),
        (
            Method::POST,
            "/v1/admin/policies/rollback",
            Some(json!({"kind":"eviction"})),
        ),
        (Method::GET, "/v1/admin/audit", None),
        (Method::GET, "/v1/admin/policies/stats", None),
    ] {
        let (st, v) = call(&s, m, uri, Some(&t), body).await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{uri}");
        assert_openai_error(&v, "permission_error", "operator_required");
    }
    let (st, _) = call(
        &s,
        Method::GET,
        "/v1/admin/policies",
        Some(&tok("ops", Role::Operator)),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::OK);
}

async fn snapshot(
    s: &ControlState,
    token: &str,
    segs: &[&str],
    salt: Option<&str>,
) -> (StatusCode, Value) {
    call(
        s,
        Method::POST,
        "/v1/snapshot",
        Some(token),
        Some(json!({"segments": segs, "salt": salt})),
    )
    .await
}

#[tokio::test]
async fn isolation_keys_private_shared_and_revocation() {
    for backend in ["sqlite", "postgres"] {
        let (c, _d, _schema) = if backend == "sqlite" {
            let (c, d) = common::sqlite_catalog().await;
            (c, Some(d), None)
        } else {
            let (c, g) = common::pg_catalog().await;
            (c, None, Some(g))
        };
        let s = common::state(c);
        let (a, b, ops) = (
            tok("tenant-a", Role::Tenant),
            tok("tenant-b", Role::Tenant),
            tok("ops", Role::Operator),
        );
        let (st, _) = call(
            &s,
            Method::POST,
            "/v1/segments",
            Some(&a),
            Some(json!({"id":"a-private","content":"secret doc"})),
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/segments",
            Some(&a),
            Some(json!({"id":"sys","content":"shared system prompt","public":true})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        // Other tenants address A's segments by address (A's ids are A's own).
        let sys = v["address"].as_str().unwrap().to_string();
        let (_, v) = call(&s, Method::GET, "/v1/segments/a-private", Some(&a), None).await;
        let a_private = v["address"].as_str().unwrap().to_string();

        // A fetches its private segment; a worker reports holding it.
        let (st, va) = snapshot(&s, &a, &["a-private", "sys"], None).await;
        assert_eq!(st, StatusCode::OK, "{va}");
        let ka = va["segments"][0]["cache_key"].as_str().unwrap().to_string();
        let ia = va["segments"][0]["isolation_key"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(va["segments"][0]["shared"], false);
        assert_eq!(va["segments"][1]["shared"], true);
        let (st, _) = call(&s, Method::POST, "/v1/admin/residency", Some(&ops), Some(json!({
            "worker":"w1","cache_key":ka,"segment_id":a_private,"version":1,"tenant":"tenant-a","bytes":4096}))).await;
        assert_eq!(st, StatusCode::OK);
        let shared_key = va["segments"][1]["cache_key"].as_str().unwrap().to_string();
        call(
            &s,
            Method::POST,
            "/v1/admin/residency",
            Some(&ops),
            Some(json!({
            "worker":"w1","cache_key":shared_key,"segment_id":sys,"version":1,"bytes":100})),
        )
        .await;
        let (_, va2) = snapshot(&s, &a, &["a-private"], None).await;
        assert_eq!(
            va2["segments"][0]["resident_on"],
            json!(["w1"]),
            "A hits its own entry"
        );

        // B without a grant: miss (404), whatever salt it sends.
        for salt in [None, Some(""), Some("x"), Some(ia.as_str())] {
            for r in ["a-private", a_private.as_str()] {
                let (st, v) = snapshot(&s, &b, &[r], salt).await;
                assert_eq!(st, StatusCode::NOT_FOUND, "{backend}: {v}");
                assert_openai_error(&v, "not_found_error", "not_found");
            }
        }
        let (st, _) = call(&s, Method::GET, "/v1/segments/a-private", Some(&b), None).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        // B cannot grant itself access, or update A's segment.
        let (st, _) = call(
            &s,
            Method::POST,
            "/v1/segments/a-private/grants",
            Some(&b),
            Some(json!({"tenant":"tenant-b"})),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        let (st, _) = call(
            &s,
            Method::PUT,
            "/v1/segments/a-private",
            Some(&b),
            Some(json!({"content":"pwned"})),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);

        // The shared segment: same key for A and B; a hit for B too.
        let (_, vb) = snapshot(&s, &b, &[&sys], None).await;
        assert_eq!(vb["segments"][0]["cache_key"].as_str().unwrap(), shared_key);
        assert_eq!(vb["segments"][0]["resident_on"], json!(["w1"]));
        // A salt narrows sharing: B's salted key differs and misses.
        let (_, vbs) = snapshot(&s, &b, &[&sys], Some("mine")).await;
        assert_ne!(
            vbs["segments"][0]["cache_key"].as_str().unwrap(),
            shared_key
        );
        assert_eq!(vbs["segments"][0]["resident_on"], json!([]));

        // With a grant, B may read the content, but its cache namespace is its own.
        let (st, _) = call(
            &s,
            Method::POST,
            "/v1/segments/a-private/grants",
            Some(&a),
            Some(json!({"tenant":"tenant-b"})),
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        for salt in [None, Some("x"), Some(ia.as_str())] {
            let (st, vb) = snapshot(&s, &b, &[&a_private], salt).await;
            assert_eq!(st, StatusCode::OK);
            let kb = vb["segments"][0]["cache_key"].as_str().unwrap();
            assert_ne!(kb, ka, "B must never get A's private key");
            assert_ne!(vb["segments"][0]["isolation_key"].as_str().unwrap(), ia);
            assert_eq!(
                vb["segments"][0]["resident_on"],
                json!([]),
                "no hit on A's entry"
            );
        }
        // Revoke: B's next request misses.
        let (st, _) = call(
            &s,
            Method::DELETE,
            "/v1/segments/a-private/grants/tenant-b",
            Some(&a),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        let (st, _) = snapshot(&s, &b, &[&a_private], None).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        // A is unaffected.
        let (_, va3) = snapshot(&s, &a, &["a-private"], None).await;
        assert_eq!(va3["segments"][0]["cache_key"].as_str().unwrap(), ka);
    }
}

#[tokio::test]
async fn strict_isolation_policy_unshares_public_segments() {
    let (s, _d) = sqlite_state().await;
    let (a, b, ops) = (
        tok("a", Role::Tenant),
        tok("b", Role::Tenant),
        tok("ops", Role::Operator),
    );
    let (_, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"id":"sys","content":"p","public":true})),
    )
    .await;
    let sys = v["address"].as_str().unwrap().to_string();
    let key = |v: &Value| v["segments"][0]["cache_key"].as_str().unwrap().to_string();
    let (ka, kb) = (
        key(&snapshot(&s, &a, &["sys"], None).await.1),
        key(&snapshot(&s, &b, &[&sys], None).await.1),
    );
    assert_eq!(ka, kb);
    let id = upload(&s, &ops, "strict", "isolation", "strict", json!({})).await;
    let (st, _) = call(
        &s,
        Method::POST,
        &format!("/v1/admin/policies/{id}/activate"),
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let (ka2, kb2) = (
        key(&snapshot(&s, &a, &["sys"], None).await.1),
        key(&snapshot(&s, &b, &[&sys], None).await.1),
    );
    assert_ne!(ka2, kb2);
    // Roll back to native (shared iff public).
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/admin/policies/rollback",
        Some(&ops),
        Some(json!({"kind":"isolation"})),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["active"], Value::Null);
    assert_eq!(key(&snapshot(&s, &b, &[&sys], None).await.1), ka);
}

#[tokio::test]
async fn segment_versions_over_http_and_invalidation() {
    let (s, _d) = sqlite_state().await;
    let (a, ops) = (tok("a", Role::Tenant), tok("ops", Role::Operator));
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"id":"doc","content":"v1","tokens":{"qwen3":2}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(v["current_version"], 1);
    let (_, snap) = snapshot(&s, &a, &["doc"], None).await;
    let k1 = snap["segments"][0]["cache_key"]
        .as_str()
        .unwrap()
        .to_string();
    // Residency is reported by address.
    let doc = snap["segments"][0]["address"].clone();
    call(
        &s,
        Method::POST,
        "/v1/admin/residency",
        Some(&ops),
        Some(json!({
        "worker":"w1","cache_key":k1,"segment_id":doc,"version":1,"tenant":"a","bytes":10})),
    )
    .await;
    let (st, v) = call(
        &s,
        Method::PUT,
        "/v1/segments/doc",
        Some(&a),
        Some(json!({"content":"v2","tokens":{"qwen3":3}})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["segment"]["current_version"], 2);
    assert_eq!(v["segment"]["content_hash"], content_hash("v2"));
    assert_eq!(
        v["invalidated_entries"], 1,
        "on-update default drops the superseded entry"
    );
    let (_, snap2) = snapshot(&s, &a, &["doc"], None).await;
    assert_ne!(
        snap2["segments"][0]["cache_key"].as_str().unwrap(),
        k1,
        "new version, new key"
    );
    assert_eq!(snap2["segments"][0]["version"], 2);
    let (_, vs) = call(&s, Method::GET, "/v1/segments/doc/versions", Some(&a), None).await;
    assert_eq!(vs.as_array().unwrap().len(), 2);
    assert!(vs[0]["superseded_at"].is_i64());
    // Each version's content, superseded ones included; readable only by who may read the segment.
    for (n, want) in [(1, "v1"), (2, "v2")] {
        let (st, v) = call(
            &s,
            Method::GET,
            &format!("/v1/segments/doc/versions/{n}"),
            Some(&a),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["content"], want);
        assert_eq!(v["version"], n);
        assert_eq!(v["segment_id"], doc);
    }
    let (st, _) = call(
        &s,
        Method::GET,
        "/v1/segments/doc/versions/3",
        Some(&a),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND, "no version 3");
    let (st, v) = call(
        &s,
        Method::GET,
        "/v1/segments/doc/versions/one",
        Some(&a),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    let addr = doc.as_str().unwrap();
    let (st, _) = call(
        &s,
        Method::GET,
        &format!("/v1/segments/{addr}/versions/1"),
        Some(&tok("b", Role::Tenant)),
        None,
    )
    .await;
    assert_eq!(
        st,
        StatusCode::NOT_FOUND,
        "another tenant cannot read a private segment's versions"
    );
    let (st, v) = call(
        &s,
        Method::GET,
        &format!("/v1/segments/{addr}/versions/1"),
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(
        (st, v["content"].as_str()),
        (StatusCode::OK, Some("v1")),
        "the operator reads any version"
    );
    // Bad input: clear 400s, never a panic.
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"id":"bad id","content":"x"})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert_openai_error(&v, "invalid_request_error", "invalid_request");
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"content":"no id"})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
    let (st, _) = call(
        &s,
        Method::POST,
        "/v1/segments",
        Some(&a),
        Some(json!({"id":"doc","content":"dup"})),
    )
    .await;
    assert_eq!(st, StatusCode::CONFLICT);
    let (st, _) = call(&s, Method::DELETE, "/v1/segments/doc", Some(&a), None).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        snapshot(&s, &a, &["doc"], None).await.0,
        StatusCode::NOT_FOUND
    );
}

async fn upload(
    s: &ControlState,
    ops: &str,
    name: &str,
    kind: &str,
    builtin_name: &str,
    params: Value,
) -> i64 {
    let b64 =
        base64::engine::general_purpose::STANDARD.encode(builtin::module(builtin_name).unwrap());
    let (st, v) = call(
        s,
        Method::POST,
        "/v1/admin/policies",
        Some(ops),
        Some(json!({"name":name,"kind":kind,"wasm_base64":b64,"params":params})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    v["id"].as_i64().unwrap()
}

#[tokio::test]
async fn policy_lifecycle_upload_dry_run_activate_rollback_audited() {
    let (s, _d) = sqlite_state().await;
    let ops = tok("ops", Role::Operator);
    // Upload validation: garbage, wrong kind, hostile module.
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/admin/policies",
        Some(&ops),
        Some(json!({"name":"x","kind":"eviction","wasm_base64":"!!"})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("base64"));
    let lru = base64::engine::general_purpose::STANDARD.encode(builtin::module("lru").unwrap());
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/admin/policies",
        Some(&ops),
        Some(json!({"name":"x","kind":"admission","wasm_base64":lru})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("looks like an eviction policy, not an admission policy"),
        "{v}"
    );
    let (st, _) = call(
        &s,
        Method::POST,
        "/v1/admin/policies",
        Some(&ops),
        Some(json!({"name":"x","kind":"bogus","wasm_base64":lru})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    let looping = wat::parse_str(
        r#"(module (memory (export "memory") 1)
          (func (export "hypic_abi_version") (result i32) i32.const 1)
          (func (export "hypic_policy_kind") (result i32) i32.const 1)
          (func (export "hypic_buf") (result i32) i32.const 0)
          (func (export "hypic_buf_cap") (result i32) i32.const 65536)
          (func (export "hypic_configure") (param i32) (result i32) i32.const 0)
          (func (export "hypic_evict") (param i32 i64) (result i32) (loop $l (br $l)) i32.const 0))"#,
    )
    .unwrap();
    let (st, v) = call(
        &s,
        Method::POST,
        "/v1/admin/policies",
        Some(&ops),
        Some(json!({"name":"loop","kind":"eviction",
        "wasm_base64": base64::engine::general_purpose::STANDARD.encode(&looping)})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("fuel"),
        "{v}"
    );

    let id_lru = upload(&s, &ops, "evict-lru", "eviction", "lru", json!({})).await;
    let id_gdsf = upload(
        &s,
        &ops,
        "evict-gdsf",
        "eviction",
        "gdsf",
        json!({"cost_per_token": 1}),
    )
    .await;

    // Dry run GDSF against the active (native LRU) policy.
    let mut trace = String::new();
    for i in 0..30 {
        let (seg, tokens, bytes) = match i % 3 {
            0 => ("big", 10, 1000),
            1 => ("s1", 500, 100),
            _ => ("s2", 500, 100),
        };
        trace.push_str(
            &json!({"tenant":"t","segments":[seg],"tokens":[tokens],"bytes":[bytes]}).to_string(),
        );
        trace.push('\n');
    }
    let (st, v) = call(
        &s,
        Method::POST,
        &format!("/v1/admin/policies/{id_gdsf}/dry-run"),
        Some(&ops),
        Some(json!({"trace":trace,"capacity_bytes":1100})),
    )
    .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    assert_eq!(v["candidate"]["requests"], 30);
    assert_eq!(v["active"]["requests"], 30);
    assert!(
        v["candidate"]["hit_ratio"].as_f64().unwrap() > v["active"]["hit_ratio"].as_f64().unwrap(),
        "{v}"
    );
    assert!(v["recompute_tokens_delta"].as_i64().unwrap() < 0);
    // The per-tenant breakdown names the trace's one tenant by its pseudonym
    // (never "t"), and adds up to the aggregate.
    for side in ["candidate", "active"] {
        let ts = v[side]["tenants"].as_array().unwrap();
        assert_eq!(ts.len(), 1, "{v}");
        let name = ts[0]["tenant"].as_str().unwrap();
        assert!(hypic_control::sim::is_pseudonym(name), "{name}");
        for k in [
            "requests",
            "lookups",
            "hits",
            "evictions",
            "rejected",
            "bytes_evicted",
        ] {
            assert_eq!(ts[0][k], v[side][k], "{side} {k}: {v}");
        }
        assert_eq!(ts[0]["hit_ratio"], v[side]["hit_ratio"], "{v}");
    }
    assert_eq!(
        v["candidate"]["tenants"][0]["tenant"], v["active"]["tenants"][0]["tenant"],
        "the same pseudonym on both sides"
    );
    let (st, v) = call(
        &s,
        Method::POST,
        &format!("/v1/admin/policies/{id_gdsf}/dry-run"),
        Some(&ops),
        Some(json!({"trace":"{bad","capacity_bytes":1100})),
    )
    .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(v["error"]["message"].as_str().unwrap().contains("line 1"));

    // Activate LRU then GDSF, roll back to LRU, then to native.
    for id in [id_lru, id_gdsf] {
        let (st, _) = call(
            &s,
            Method::POST,
            &format!("/v1/admin/policies/{id}/activate"),
            Some(&ops),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK);
    }
    assert_eq!(
        s.policies()
            .active_id(hypic_control::policy::PolicyKind::Eviction),
        Some(id_gdsf)
    );
    let (_, v) = call(
        &s,
        Method::POST,
        "/v1/admin/policies/rollback",
        Some(&ops),
        Some(json!({"kind":"eviction"})),
    )
    .await;
    assert_eq!(v["active"], id_lru);
    assert_eq!(
        s.policies()
            .active_id(hypic_control::policy::PolicyKind::Eviction),
        Some(id_lru)
    );
    let (_, v) = call(
        &s,
        Method::POST,
        "/v1/admin/policies/rollback",
        Some(&ops),
        Some(json!({"kind":"eviction"})),
    )
    .await;
    assert_eq!(v["active"], Value::Null);
    assert_eq!(
        s.policies()
            .active_id(hypic_control::policy::PolicyKind::Eviction),
        None
    );
    let (st, _) = call(
        &s,
        Method::POST,
        "/v1/admin/policies/999/activate",
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::NOT_FOUND);

    // Everything audited.
    let (st, log) = call(
        &s,
        Method::GET,
        "/v1/admin/audit?limit=100",
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(st, StatusCode::OK);
    let actions: Vec<&str> = log
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        vec![
            "policy.reject",
            "policy.reject",
            "policy.upload",
            "policy.upload",
            "policy.dry_run",
            "policy.activate",
            "policy.activate",
            "policy.rollback",
            "policy.rollback"
        ],
    );
    let (_, stats) = call(
        &s,
        Method::GET,
        "/v1/admin/policies/stats",
        Some(&ops),
        None,
    )
    .await;
    assert_eq!(stats["active"]["eviction"], Value::Null);
}

#[tokio::test]
async fn real_loopback_server() {
    let (s, _d) = sqlite_state().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server =
        tokio::spawn(async move { axum::serve(listener, control_router(s)).await.unwrap() });
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let req = |auth: Option<String>| {
        let mut r = String::from("GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
        if let Some(a) = auth {
            r.push_str(&format!("Authorization: Bearer {a}\r\n"));
        }
        r.push_str("\r\n");
        r
    };
    for (auth, want) in [(None, "401"), (Some(tok("z", Role::Tenant)), "200")] {
        let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
        sock.write_all(req(auth).as_bytes()).await.unwrap();
        let mut out = String::new();
        sock.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with(&format!("HTTP/1.1 {want}")), "{out}");
    }
    server.abort();
}

#[tokio::test]
async fn group_grants_over_http_isolated_and_revocable() {
    for backend in ["sqlite", "postgres"] {
        let (c, _d, _schema) = if backend == "sqlite" {
            let (c, d) = common::sqlite_catalog().await;
            (c, Some(d), None)
        } else {
            let (c, g) = common::pg_catalog().await;
            (c, None, Some(g))
        };
        let s = common::state(c);
        let (a, b, x, ops) = (
            tok("tenant-a", Role::Tenant),
            tok("tenant-b", Role::Tenant),
            tok("tenant-x", Role::Tenant),
            tok("ops", Role::Operator),
        );
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/segments",
            Some(&a),
            Some(json!({"id":"playbook","content":"team playbook"})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{backend}: {v}");
        // Other tenants address it by address.
        let pb = v["address"].as_str().unwrap().to_string();

        // Groups are operator business.
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/admin/groups",
            Some(&a),
            Some(json!({"id":"team"})),
        )
        .await;
        assert_eq!(st, StatusCode::FORBIDDEN, "{v}");
        assert_openai_error(&v, "permission_error", "operator_required");
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/admin/groups",
            Some(&ops),
            Some(json!({"id":"team","name":"The team"})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{backend}: {v}");
        assert_eq!(v["members"], json!([]));
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/admin/groups",
            Some(&ops),
            Some(json!({"id":"team"})),
        )
        .await;
        assert_eq!(st, StatusCode::CONFLICT, "{v}");
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/admin/groups",
            Some(&ops),
            Some(json!({"id":"no spaces"})),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/admin/groups",
            Some(&ops),
            Some(json!({"name":"missing id"})),
        )
        .await;
        assert_eq!(st, StatusCode::BAD_REQUEST, "{v}");
        let (st, v) = call(
            &s,
            Method::PUT,
            "/v1/admin/groups/team/members/tenant-b",
            Some(&ops),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["members"], json!(["tenant-b"]));
        let (st, _) = call(
            &s,
            Method::PUT,
            "/v1/admin/groups/nope/members/tenant-b",
            Some(&ops),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        let (st, v) = call(&s, Method::GET, "/v1/admin/groups", Some(&ops), None).await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(v[0]["id"], "team");
        assert_eq!(v[0]["name"], "The team");

        // Only the owner (or an operator) grants; B cannot grant itself via a group.
        let (st, _) = call(
            &s,
            Method::POST,
            &format!("/v1/segments/{pb}/group-grants"),
            Some(&b),
            Some(json!({"group":"team"})),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND, "B cannot see the segment yet");
        let (st, _) = snapshot(&s, &b, &[&pb], None).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/segments/playbook/group-grants",
            Some(&a),
            Some(json!({"group":"team"})),
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        let (st, v) = call(
            &s,
            Method::POST,
            "/v1/segments/playbook/group-grants",
            Some(&a),
            Some(json!({"group":"ghost"})),
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND, "{v}");
        let (_, v) = call(
            &s,
            Method::GET,
            "/v1/segments/playbook/group-grants",
            Some(&a),
            None,
        )
        .await;
        assert_eq!(v, json!(["team"]));

        // Member B reads it, in its own namespace: never A's key, never A's entry.
        let (st, va) = snapshot(&s, &a, &["playbook"], None).await;
        assert_eq!(st, StatusCode::OK);
        let a_key = va["segments"][0]["cache_key"].as_str().unwrap().to_string();
        let (st, _) = call(&s, Method::POST, "/v1/admin/residency", Some(&ops), Some(json!({
            "worker":"w1","cache_key":a_key,"segment_id":pb,"version":1,"tenant":"tenant-a","bytes":64}))).await;
        assert_eq!(st, StatusCode::OK);
        let (st, vb) = snapshot(&s, &b, &[&pb], None).await;
        assert_eq!(st, StatusCode::OK, "{backend}: {vb}");
        assert_eq!(vb["segments"][0]["shared"], false);
        assert_ne!(
            vb["segments"][0]["cache_key"],
            va["segments"][0]["cache_key"]
        );
        assert_ne!(
            vb["segments"][0]["isolation_key"],
            va["segments"][0]["isolation_key"]
        );
        assert_eq!(vb["segments"][0]["resident_on"], json!([]), "a miss for B");
        let (st, _) = call(
            &s,
            Method::GET,
            &format!("/v1/segments/{pb}"),
            Some(&b),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        // A non-member still cannot.
        let (st, _) = snapshot(&s, &x, &[&pb], None).await;
        assert_eq!(st, StatusCode::NOT_FOUND);

        // Revoking the group grant: B's next snapshot misses (404), whatever salt.
        let (st, _) = call(
            &s,
            Method::DELETE,
            &format!("/v1/segments/{pb}/group-grants/team"),
            Some(&b),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::FORBIDDEN, "a reader may not revoke");
        let (st, v) = call(
            &s,
            Method::DELETE,
            "/v1/segments/playbook/group-grants/team",
            Some(&a),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        for salt in [None, Some("x")] {
            let (st, _) = snapshot(&s, &b, &[&pb], salt).await;
            assert_eq!(st, StatusCode::NOT_FOUND, "{backend}");
        }
        let (st, _) = call(
            &s,
            Method::DELETE,
            "/v1/segments/playbook/group-grants/team",
            Some(&a),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);

        // Granted again, then B leaves the group: the next snapshot misses again.
        call(
            &s,
            Method::POST,
            "/v1/segments/playbook/group-grants",
            Some(&a),
            Some(json!({"group":"team"})),
        )
        .await;
        assert_eq!(snapshot(&s, &b, &[&pb], None).await.0, StatusCode::OK);
        let (st, v) = call(
            &s,
            Method::DELETE,
            "/v1/admin/groups/team/members/tenant-b",
            Some(&ops),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK, "{v}");
        assert_eq!(v["members"], json!([]));
        assert_eq!(
            snapshot(&s, &b, &[&pb], None).await.0,
            StatusCode::NOT_FOUND
        );
        let (st, _) = call(
            &s,
            Method::DELETE,
            "/v1/admin/groups/team/members/tenant-b",
            Some(&ops),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        // Deleting the group.
        let (st, _) = call(
            &s,
            Method::DELETE,
            "/v1/admin/groups/team",
            Some(&ops),
            None,
        )
        .await;
        assert_eq!(st, StatusCode::OK);
        let (st, _) = call(&s, Method::GET, "/v1/admin/groups/team", Some(&ops), None).await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        // All audited.
        let (_, log) = call(
            &s,
            Method::GET,
            "/v1/admin/audit?limit=200",
            Some(&ops),
            None,
        )
        .await;
        let actions: Vec<&str> = log
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["action"].as_str().unwrap())
            .collect();
        for want in [
            "group.create",
            "group.delete",
            "group.member.add",
            "group.member.remove",
            "grant.group.add",
            "grant.group.revoke",
        ] {
            assert!(
                actions.contains(&want),
                "{backend}: no {want} in {actions:?}"
            );
        }
    }
}
