//! Shared helpers of the `hypic serve` end-to-end tests: a real server on a
//! loopback port (tiny golden model, SQLite catalog in a temp dir) and a real
//! HTTP client.
#![allow(dead_code)]

use hypic_control::auth::{load_or_create_secret, mint_token};
use hypic_control::catalog::Role;
use hypic_control::serve::{spawn, RunningServer, ServeConfig};
use serde_json::Value;
use std::path::PathBuf;

pub struct Srv {
    pub server: RunningServer,
    pub url: String,
    /// Tenant `acme`.
    pub token: String,
    /// Tenant `globex`.
    pub token_b: String,
    /// Operator.
    pub op_token: String,
    pub client: reqwest::Client,
    _dir: tempfile::TempDir,
}

pub fn golden_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dataplane/tests/fixtures/golden/qwen3_next")
}

pub async fn start(tweak: impl FnOnce(&mut ServeConfig)) -> Srv {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServeConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        model: Some(golden_model()),
        model_id: Some("tiny".into()),
        data_dir: dir.path().to_path_buf(),
        default_max_tokens: 8,
        ..ServeConfig::default()
    };
    tweak(&mut cfg);
    let data_dir = cfg.data_dir.clone();
    let server = spawn(cfg).await.expect("server starts");
    let (secret, _) = load_or_create_secret(&data_dir).unwrap();
    let tok =
        |t: &str, r: Role| mint_token(&secret, "hypic", t, &format!("u@{t}"), r, 3600).unwrap();
    Srv {
        url: server.url(),
        token: tok("acme", Role::Tenant),
        token_b: tok("globex", Role::Tenant),
        op_token: tok("ops", Role::Operator),
        server,
        client: reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(120))
            .build()
            .unwrap(),
        _dir: dir,
    }
}

impl Srv {
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_as(&self.token, path, body).await
    }

    pub async fn post_as(&self, token: &str, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}{path}", self.url))
            .bearer_auth(token)
            .json(body)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        (st, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn raw(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Vec<u8>,
    ) -> (u16, reqwest::header::HeaderMap, Value) {
        let mut b = self
            .client
            .request(method, format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            b = b.bearer_auth(t);
        }
        let r = b.send().await.unwrap();
        let st = r.status().as_u16();
        let h = r.headers().clone();
        let text = r.text().await.unwrap_or_default();
        (
            st,
            h,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.get_as(Some(&self.token), path).await
    }

    pub async fn get_as(&self, token: Option<&str>, path: &str) -> (u16, Value) {
        let mut b = self.client.get(format!("{}{path}", self.url));
        if let Some(t) = token {
            b = b.bearer_auth(t);
        }
        let r = b.send().await.unwrap();
        let st = r.status().as_u16();
        let text = r.text().await.unwrap();
        (
            st,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub async fn metrics(&self) -> String {
        self.client
            .get(format!("{}/metrics", self.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// POSTs with `stream: true` and returns the `data:` payloads in order.
    pub async fn stream(&self, path: &str, body: &Value) -> (u16, Vec<String>) {
        let r = self
            .client
            .post(format!("{}{path}", self.url))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .unwrap();
        let st = r.status().as_u16();
        let ct = r
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let text = r.text().await.unwrap();
        if st != 200 {
            return (st, vec![text]);
        }
        assert!(ct.starts_with("text/event-stream"), "content-type {ct}");
        let data = text
            .split("\n\n")
            .filter_map(|ev| {
                ev.lines()
                    .find_map(|l| l.strip_prefix("data:").map(|d| d.trim().to_string()))
            })
            .collect();
        (st, data)
    }
}

/// Value of a metric line `name{labels} value` (labels matched as a substring).
pub fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .next()
}

/// Asserts an OpenAI-style error body.
pub fn assert_error(status: u16, body: &Value, want_status: u16, want_code: &str) {
    assert_eq!(status, want_status, "body: {body}");
    let e = &body["error"];
    assert!(e.is_object(), "no error object: {body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert_eq!(e["code"], want_code, "{body}");
}
