//! The operator console's server side over a real `hypic serve`: the embedded page
//! at `/ui/` with its Content-Security-Policy, the metrics history it charts, the
//! audit filters, and the 403 a tenant token gets on those operator routes.
use crate::serve_common;

use serde_json::json;
use serve_common::{assert_error, start};

const DOC: &str =
    "Document A. The river flows north through the old city and the market square.<<PIC_SEP>>Where?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_page_history_and_audit_filters() {
    let s = start(|_| {}).await;
    // The page needs no token; the CSP allows nothing from another origin.
    let r = s.client.get(format!("{}/ui/", s.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let csp = r.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("script-src 'self'"));
    assert!(r.text().await.unwrap().contains("/ui/assets/app.js"));

    // A tenant is refused the operator routes the console uses.
    for path in [
        "/v1/metrics/history",
        "/v1/admin/audit",
        "/v1/admin/policies",
        "/v1/admin/traffic",
    ] {
        let (st, v) = s.get(path).await;
        assert_error(st, &v, 403, "operator_required");
    }

    let (st, before) = s.get_as(Some(&s.op_token), "/v1/metrics/history").await;
    assert_eq!(st, 200, "{before}");
    assert_eq!(before["interval_ms"], 5000);
    let n0 = before["samples"].as_array().unwrap().last().unwrap()["finished"]
        .as_u64()
        .unwrap();
    for _ in 0..2 {
        let (st, v) = s
            .post(
                "/v1/completions",
                &json!({"prompt": DOC, "max_tokens": 2, "temperature": 0}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
    }
    let (_, after) = s.get_as(Some(&s.op_token), "/v1/metrics/history").await;
    let now = after["samples"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(now["finished"].as_u64().unwrap(), n0 + 2, "{now}");
    assert!(now["prompt_tokens_computed"].as_u64().unwrap() > 0, "{now}");
    assert!(now["pools"]["public"]["bytes"].is_u64(), "{now}");
    let w = &after["ttft_window_ms"]["hypic"];
    assert!(w["count"].as_u64().unwrap() >= 2, "{after}");
    assert!(w["p50"].as_f64().unwrap() > 0.0, "{after}");

    // The recorded traffic: both prompts, the document only (the query is computed
    // in place), under the tenant's pseudonym, a valid dry-run trace.
    let (st, t) = s.get_as(Some(&s.op_token), "/v1/admin/traffic").await;
    assert_eq!(st, 200, "{t}");
    assert_eq!(t["requests"], 2, "{t}");
    let trace = t["trace"].as_str().unwrap();
    let recs = hypic_control::sim::parse_trace(trace).expect("a valid trace");
    assert_eq!(recs.len(), 2);
    assert!(
        recs[0].tenant.starts_with("t-") && !trace.contains("acme"),
        "{trace}"
    );
    assert!(
        recs.iter()
            .all(|r| r.segments.len() == r.bytes.len() && r.bytes[0] > 0),
        "{trace}"
    );
    assert_eq!(
        recs[0].segments[0], recs[1].segments[0],
        "the same document"
    );

    // Audit filters: by actor and by time.
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": "doc", "content": "Some text.", "prefill": false}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, rows) = s
        .get_as(Some(&s.op_token), "/v1/admin/audit?actor=u@acme")
        .await;
    assert_eq!(st, 200, "{rows}");
    let rows = rows.as_array().unwrap();
    assert!(!rows.is_empty());
    assert!(rows.iter().all(|r| r["actor"] == "u@acme"), "{rows:?}");
    let (_, none) = s
        .get_as(
            Some(&s.op_token),
            "/v1/admin/audit?actor=u@acme&since_ms=99999999999999",
        )
        .await;
    assert_eq!(none, json!([]));
    let (_, other) = s
        .get_as(Some(&s.op_token), "/v1/admin/audit?actor=nobody")
        .await;
    assert_eq!(other, json!([]));
    let (st, v) = s
        .get_as(Some(&s.op_token), "/v1/admin/audit?since_ms=soon")
        .await;
    assert_error(st, &v, 400, "invalid_request");
    s.server.stop().await;
}
