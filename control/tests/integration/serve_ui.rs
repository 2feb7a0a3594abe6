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
    // The bytes are the resident entry's, recurrent-state pairs included: more than
    // the document's KV alone, and within the public pool.
    let cfg = dataplane::config::ModelConfig::from_dir(&serve_common::golden_model()).unwrap();
    let full = cfg.num_attention_layers();
    let kv_per_token = (full * 2 * cfg.num_kv_heads * cfg.head_dim * 4 + full * 8) as u64;
    let pool = now["pools"]["public"]["bytes"].as_u64().unwrap();
    let (tokens, bytes) = (recs[1].tokens[0], recs[1].bytes[0]);
    assert!(
        bytes > tokens * kv_per_token && bytes <= pool,
        "entry {bytes} bytes for {tokens} tokens ({kv_per_token} KV bytes a token), public pool {pool}: {trace}"
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

const SYS: &str = "You answer questions from the documents below, citing them.";
const DOC_A: &str =
    "Document A. The river flows north through the old city, past the market square and the mill.";
const DOC_B: &str =
    "Document B. The harbour closes at dusk; fishing boats return before the lighthouse is lit.";

/// Seam tokens of one completion's `hypic.segments`.
fn seams(v: &serde_json::Value) -> u64 {
    v["hypic"]["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["seam"].as_u64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overview_counts_seam_tokens_and_splits_pools_by_tier() {
    let s = start(|_| {}).await;
    let sep = "<<PIC_SEP>>";
    let mut total = 0;
    for (a, b) in [(DOC_A, DOC_B), (DOC_B, DOC_A)] {
        let prompt = format!("{SYS}{sep}{a}{sep}{b}{sep}Where does the river flow?");
        let (st, v) = s
            .post(
                "/v1/completions",
                &json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let segs = v["hypic"]["segments"].as_array().unwrap();
        // The two documents are middle segments: 8 seam tokens each (a miss
        // builds its entry and then recomputes the seam; a hit only the seam).
        assert_eq!(segs[1]["seam"], 8, "{v}");
        assert_eq!(segs[2]["seam"], 8, "{v}");
        assert_eq!(segs[0]["seam"], 0, "{v}");
        total += seams(&v);
    }
    assert_eq!(total, 32);
    let (_, h) = s.get_as(Some(&s.op_token), "/v1/metrics/history").await;
    let now = h["samples"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(now["seam_tokens"], total, "{now}");
    let text = s.metrics().await;
    assert_eq!(
        serve_common::metric(&text, "hypic_seam_tokens_total", "mode=\"hypic\""),
        Some(total as f64)
    );

    // Tiers from the pools' counters: the CPU backend has a host tier only (no
    // GPU; no spill tier unless one is configured), and the host tier is the
    // pool's whole in-memory usage.
    for pool in ["public", "private"] {
        let p = &now["pools"][pool];
        let tiers = p["tiers"].as_object().unwrap();
        assert_eq!(tiers.keys().collect::<Vec<_>>(), vec!["host"], "{p}");
        assert_eq!(tiers["host"]["bytes"], p["bytes"], "{p}");
        assert_eq!(tiers["host"]["entries"], p["entries"], "{p}");
    }
    assert!(
        now["pools"]["public"]["tiers"]["host"]["entries"]
            .as_u64()
            .unwrap()
            >= 3
    );
    assert!(serve_common::metric(&text, "hypic_pool_tier_bytes", "tier=\"host\"").unwrap() > 0.0);
    assert_eq!(
        serve_common::metric(&text, "hypic_pool_tier_bytes", "tier=\"gpu\""),
        None,
        "no GPU tier on the CPU backend"
    );
    assert_eq!(
        serve_common::metric(&text, "hypic_pool_tier_bytes", "tier=\"spill\""),
        None
    );

    // A server with a spill tier reports it, with what it holds.
    let s = start(|c| c.spill_mib = 4).await;
    let (_, h) = s.get_as(Some(&s.op_token), "/v1/metrics/history").await;
    let now = h["samples"].as_array().unwrap().last().unwrap().clone();
    let tiers = now["pools"]["public"]["tiers"].as_object().unwrap();
    assert_eq!(
        tiers.keys().collect::<Vec<_>>(),
        vec!["host", "spill"],
        "{now}"
    );
    assert_eq!(tiers["spill"], json!({"bytes": 0, "entries": 0}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_warms_an_existing_segment_into_the_callers_namespace() {
    let s = start(|_| {}).await;
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": "doc", "content": DOC_A, "prefill": false}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["hypic"]["residency"]["resident"], false, "{v}");

    let (st, v) = s.post("/v1/segments/doc/prefill", &json!(null)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["tenant"], "acme", "{v}");
    assert_eq!(v["version"], 1, "{v}");
    let entries = v["prefill"]["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "body starts 0 and 8: {v}");
    assert!(
        entries
            .iter()
            .all(|e| e["status"] == "stored" && e["bytes"].as_u64().unwrap() > 0),
        "{v}"
    );
    assert_eq!(v["residency"]["resident"], true, "{v}");
    let (_, got) = s.get("/v1/segments/doc").await;
    assert_eq!(got["hypic"]["residency"]["resident"], true, "{got}");

    // A second prefill finds the entries; a request that uses the segment after
    // another is a hit without building anything.
    let (_, again) = s.post("/v1/segments/doc/prefill", &json!(null)).await;
    assert!(
        again["prefill"]["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["status"] == "present"),
        "{again}"
    );
    let (st, r) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"text": SYS}, {"id": "doc"}, {"text": "Where?"}],
                    "max_tokens": 1, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["hypic"]["segments"][1]["outcome"], "hit", "{r}");

    let addr = v["address"].as_str().unwrap();
    // Bad input and other callers.
    let (st, e) = s.post("/v1/segments/nope/prefill", &json!(null)).await;
    assert_error(st, &e, 404, "segment_not_found");
    let (st, e) = s
        .post_as(&s.token_b, "/v1/segments/doc/prefill", &json!(null))
        .await;
    assert_eq!(st, 404, "another tenant cannot read it: {e}");
    let (st, e) = s
        .post("/v1/segments/doc/prefill?tenant=globex", &json!(null))
        .await;
    assert_error(st, &e, 403, "tenant_mismatch");
    assert_eq!(e["error"]["param"], "tenant", "{e}");
    let (st, e) = s
        .post_as(
            &s.op_token,
            &format!("/v1/segments/{addr}/prefill?tenant=globex"),
            &json!(null),
        )
        .await;
    assert_error(st, &e, 404, "segment_not_found");
    assert_eq!(e["error"]["param"], "tenant", "{e}");
    // The operator warms the owner's namespace by naming it (the segment is
    // addressed as the operator sees it: its address).
    let (st, op) = s
        .post_as(
            &s.op_token,
            &format!("/v1/segments/{addr}/prefill?tenant=acme"),
            &json!(null),
        )
        .await;
    assert_eq!(st, 200, "{op}");
    assert_eq!(op["tenant"], "acme");
    assert_eq!(op["prefill"]["entries"][0]["status"], "present", "{op}");

    let (_, rows) = s
        .get_as(Some(&s.op_token), "/v1/admin/audit?action=segment.prefill")
        .await;
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 3, "{rows:?}");
    let mut actors: Vec<&str> = rows.iter().map(|r| r["actor"].as_str().unwrap()).collect();
    actors.sort();
    assert_eq!(actors, ["u@acme", "u@acme", "u@ops"], "{rows:?}");
    assert!(rows.iter().all(|r| r["target"] == addr), "{rows:?}");
}
