//! What a restart of `hypic serve` keeps (SQLite catalog in one data
//! directory, started three times): each tenant's serving usage, and a running
//! shadow policy with its counts, which goes on counting after the restart; a
//! stopped shadow stays stopped.
use crate::serve_common::golden_model;

use base64::Engine as _;
use hypic_control::auth::{load_or_create_secret, mint_token};
use hypic_control::catalog::Role;
use hypic_control::policy::builtin;
use hypic_control::serve::{spawn, RunningServer, ServeConfig};
use serde_json::{json, Value};

struct Client {
    url: String,
    http: reqwest::Client,
    tenant: String,
    op: String,
}

impl Client {
    async fn call(
        &self,
        token: &str,
        m: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut b = self
            .http
            .request(m, format!("{}{path}", self.url))
            .bearer_auth(token);
        if let Some(v) = body {
            b = b.json(&v);
        }
        let r = b.send().await.unwrap();
        let st = r.status().as_u16();
        (st, r.json().await.unwrap_or(Value::Null))
    }

    /// One completion of tenant `acme` whose first segment differs per `n`
    /// (so its segments are offered to the admission policy).
    async fn complete(&self, n: usize) -> Value {
        let body = json!({"segments": [
            {"text": format!("Preface {n}.")},
            {"text": format!("Document {n}. The lighthouse keeper counts {n} ships every evening.")},
            {"text": "Question: what does the keeper count?"}], "max_tokens": 2});
        let (st, v) = self
            .call(
                &self.tenant,
                reqwest::Method::POST,
                "/v1/completions",
                Some(body),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        v
    }

    async fn op_get(&self, path: &str) -> (u16, Value) {
        self.call(&self.op, reqwest::Method::GET, path, None).await
    }
}

async fn boot(dir: &std::path::Path) -> (RunningServer, Client) {
    let cfg = ServeConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        model: Some(golden_model()),
        model_id: Some("tiny".into()),
        data_dir: dir.to_path_buf(),
        default_max_tokens: 2,
        invalidation_sweep_ms: 0,
        ..ServeConfig::default()
    };
    let server = spawn(cfg).await.expect("server starts");
    let (secret, _) = load_or_create_secret(dir).unwrap();
    let tok =
        |t: &str, r: Role| mint_token(&secret, "hypic", t, &format!("u@{t}"), r, 3600).unwrap();
    let c = Client {
        url: server.url(),
        http: reqwest::Client::new(),
        tenant: tok("acme", Role::Tenant),
        op: tok("ops", Role::Operator),
    };
    (server, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_and_a_running_shadow_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (server, c) = boot(dir.path()).await;
    let module = builtin::module("second_sighting").unwrap();
    let (st, rec) = c
        .call(
            &c.op,
            reqwest::Method::POST,
            "/v1/admin/policies",
            Some(json!({"name": "second", "kind": "admission",
                "wasm_base64": base64::engine::general_purpose::STANDARD.encode(module),
                "params": {}})),
        )
        .await;
    assert_eq!(st, 200, "{rec}");
    let id = rec["id"].as_i64().unwrap();
    let (st, started) = c
        .call(
            &c.op,
            reqwest::Method::POST,
            &format!("/v1/admin/policies/{id}/shadow"),
            None,
        )
        .await;
    assert_eq!(st, 200, "{started}");
    let mut generated = 0;
    for n in 0..2 {
        generated += c.complete(n).await["usage"]["completion_tokens"]
            .as_u64()
            .unwrap();
    }
    let (_, usage1) = c
        .call(
            &c.tenant,
            reqwest::Method::GET,
            "/v1/tenants/acme/usage",
            None,
        )
        .await;
    assert_eq!(usage1["serving"]["requests"], 2, "{usage1}");
    assert_eq!(
        usage1["serving"]["completion_tokens"], generated,
        "{usage1}"
    );
    let (st, shadow1) = c.op_get("/v1/admin/policies/shadow/admission").await;
    assert_eq!(st, 200, "{shadow1}");
    let calls1 = shadow1["candidate"]["calls"].as_u64().unwrap();
    assert!(
        calls1 >= 2,
        "the misses were offered to both policies: {shadow1}"
    );
    server.stop().await;

    // Second start on the same data directory: the usage and the shadow are back.
    let (server, c) = boot(dir.path()).await;
    let (st, usage2) = c
        .call(
            &c.tenant,
            reqwest::Method::GET,
            "/v1/tenants/acme/usage",
            None,
        )
        .await;
    assert_eq!(st, 200, "{usage2}");
    assert_eq!(
        usage2["serving"], usage1["serving"],
        "usage after the restart"
    );
    let (st, shadow2) = c.op_get("/v1/admin/policies/shadow/admission").await;
    assert_eq!(st, 200, "the shadow is resumed: {shadow2}");
    for k in [
        "policy_id",
        "params",
        "started_at",
        "started_by",
        "candidate",
        "active",
        "agreed",
        "disagreed",
    ] {
        assert_eq!(shadow2[k], shadow1[k], "{k} after the restart");
    }
    assert_eq!(shadow2["tripped"], false);
    // It goes on counting, and usage goes on adding up.
    c.complete(2).await;
    let (_, shadow3) = c.op_get("/v1/admin/policies/shadow/admission").await;
    assert!(
        shadow3["candidate"]["calls"].as_u64().unwrap() > calls1,
        "{shadow2} then {shadow3}"
    );
    let (_, usage3) = c
        .call(
            &c.tenant,
            reqwest::Method::GET,
            "/v1/tenants/acme/usage",
            None,
        )
        .await;
    assert_eq!(usage3["serving"]["requests"], 3, "{usage3}");
    let (st, fin) = c
        .call(
            &c.op,
            reqwest::Method::DELETE,
            "/v1/admin/policies/shadow/admission",
            None,
        )
        .await;
    assert_eq!(st, 200, "{fin}");
    server.stop().await;

    // Third start: the stopped shadow stays stopped; the operator's list shows
    // the stored usage too.
    let (server, c) = boot(dir.path()).await;
    let (st, v) = c.op_get("/v1/admin/policies/shadow/admission").await;
    assert_eq!(st, 404, "a stopped shadow is not resumed: {v}");
    let (_, all) = c.op_get("/v1/admin/tenants").await;
    let acme = all
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == "acme")
        .unwrap_or_else(|| panic!("no acme in {all}"))
        .clone();
    assert_eq!(acme["serving"], usage3["serving"], "{acme}");
    server.stop().await;
}
