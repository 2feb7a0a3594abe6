//! `hypic serve` end to end over a loopback port: OpenAI shapes (streaming and
//! not), cached_tokens on repeated and reordered requests, per-segment stats,
//! modes, stop/n/logprobs, the segment registry, auth, metrics.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{assert_error, metric, start};

const SYS: &str = "You are a careful assistant that answers from the given documents only.";
const DOC_A: &str = "Document A. The river flows north through the old city and the market square.";
const DOC_B: &str = "Document B. The bright green light over the harbour turned on every night.";
const Q: &str = "Question: where does the river flow?";

fn segs(items: &[&str]) -> Value {
    json!(items.iter().map(|t| json!({"text": t})).collect::<Vec<_>>())
}

fn outcomes(v: &Value) -> Vec<String> {
    v["hypic"]["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["outcome"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_shapes_non_streaming() {
    let s = start(|_| {}).await;
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], "tiny");
    assert!(v["created"].as_u64().unwrap() > 0);
    let c = &v["choices"][0];
    assert_eq!(c["index"], 0);
    assert!(c["text"].is_string());
    assert!(["length", "stop"].contains(&c["finish_reason"].as_str().unwrap()));
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 4);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(v["hypic"]["mode"], "hypic");
    assert_eq!(v["hypic"]["segments"].as_array().unwrap().len(), 1);

    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "system", "content": SYS}, {"role": "user", "content": Q}],
                    "max_tokens": 3}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(c["logprobs"].is_null());
    // Two messages: two segments (the generation prompt goes with the last).
    assert_eq!(v["hypic"]["segments"].as_array().unwrap().len(), 2);

    let (st, v) = s.get("/v1/models").await;
    assert_eq!(st, 200);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tiny");
    assert_eq!(v["data"][0]["object"], "model");
    let (st, v) = s.get_as(None, "/health").await;
    assert_eq!(st, 200);
    assert_eq!(v["status"], "ok");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_shapes_with_done_and_usage() {
    let s = start(|_| {}).await;
    let (st, data) = s
        .stream(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": Q}], "max_tokens": 5, "stream": true,
                    "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(st, 200, "{data:?}");
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let id = chunks[0]["id"].clone();
    assert!(chunks.iter().all(|c| c["id"] == id));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["hypic"]["mode"], "hypic");
    let finals: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finals.len(), 1);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(usage["usage"]["completion_tokens"].as_u64().unwrap() <= 5);
    let _ = text;

    let (st, data) = s
        .stream(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 3, "stream": true}),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "text_completion");
    assert!(first["choices"][0]["text"].is_string());
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_grow_on_repeat_and_reorder_with_per_segment_stats() {
    let s = start(|_| {}).await;
    let body = |items: &[&str]| json!({"segments": segs(items), "max_tokens": 2, "temperature": 0});
    let (st, v1) = s
        .post("/v1/completions", &body(&[SYS, DOC_A, DOC_B, Q]))
        .await;
    assert_eq!(st, 200, "{v1}");
    let c1 = v1["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(c1, 0, "cold request reuses nothing: {v1}");
    assert_eq!(outcomes(&v1), ["miss", "miss", "miss", "computed"]);
    let segs1 = v1["hypic"]["segments"].as_array().unwrap();
    assert!(segs1
        .iter()
        .all(|x| x["content_hash"].as_str().unwrap().len() == 64));
    assert_eq!(v1["hypic"]["misses"], 3);

    // Repeated: the whole prompt is a private-pool hit.
    let (_, v2) = s
        .post("/v1/completions", &body(&[SYS, DOC_A, DOC_B, Q]))
        .await;
    let p2 = v2["usage"]["prompt_tokens"].as_u64().unwrap();
    let c2 = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(c2, p2, "{v2}");
    assert!(outcomes(&v2).iter().all(|o| o == "prefix_hit"));

    // Reordered documents and a new question: the system prompt is a prefix hit,
    // the documents are position-independent hits, only the question and the seams
    // are computed.
    let (_, v3) = s
        .post(
            "/v1/completions",
            &body(&[SYS, DOC_B, DOC_A, "Question: what turned on?"]),
        )
        .await;
    let c3 = v3["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(
        outcomes(&v3),
        ["prefix_hit", "hit", "hit", "computed"],
        "{v3}"
    );
    assert!(c3 > 0 && c3 > c1, "{v3}");
    let seg = &v3["hypic"]["segments"][1];
    assert_eq!(
        seg["computed"].as_u64().unwrap() + seg["reused"].as_u64().unwrap(),
        seg["tokens"].as_u64().unwrap()
    );
    assert_eq!(seg["computed"], 8, "seam window w = 8 recomputed");
    assert_eq!(
        v3["hypic"]["segments"][1]["content_hash"],
        v1["hypic"]["segments"][2]["content_hash"]
    );

    // Prefix-cache mode cannot reuse the reordered documents.
    let (_, v4) = s
        .post(
            "/v1/completions",
            &json!({"segments": segs(&[SYS, DOC_A, DOC_B, Q]), "max_tokens": 2,
                    "hypic": {"mode": "prefix_cache"}}),
        )
        .await;
    assert_eq!(v4["hypic"]["mode"], "prefix_cache");
    let (_, v5) = s
        .post(
            "/v1/completions",
            &json!({"segments": segs(&[SYS, DOC_B, DOC_A, Q]), "max_tokens": 2,
                    "hypic": {"mode": "prefix_cache"}}),
        )
        .await;
    assert_eq!(
        outcomes(&v5),
        ["prefix_hit", "computed", "computed", "computed"],
        "{v5}"
    );

    // Full recompute reuses nothing, even repeated.
    for _ in 0..2 {
        let (_, v) = s
            .post(
                "/v1/completions",
                &json!({"segments": segs(&[SYS, DOC_A, Q]), "max_tokens": 2,
                        "hypic": {"mode": "full"}}),
            )
            .await;
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{v}"
        );
        assert!(outcomes(&v).iter().all(|o| o == "computed"));
    }

    // The separator form cuts a prompt into the same segments.
    let sep = [SYS, DOC_A, DOC_B, Q].join("<<PIC_SEP>>");
    let (_, v6) = s
        .post("/v1/completions", &json!({"prompt": sep, "max_tokens": 2}))
        .await;
    assert_eq!(v6["hypic"]["segments"].as_array().unwrap().len(), 4);
    assert_eq!(
        v6["usage"]["prompt_tokens_details"]["cached_tokens"], v6["usage"]["prompt_tokens"],
        "{v6}"
    );

    // Chat: each message is a segment; a reordered conversation reuses the documents.
    let chat = |a: &str, b: &str| {
        json!({"messages": [
            {"role": "system", "content": SYS},
            {"role": "user", "content": [{"type": "text", "text": a}, {"type": "text", "text": b}]},
            {"role": "user", "content": Q}], "max_tokens": 2})
    };
    let (st, c1) = s.post("/v1/chat/completions", &chat(DOC_A, DOC_B)).await;
    assert_eq!(st, 200, "{c1}");
    // system + user header | part A | part B | end marker + question + generation
    // prompt: the template glue joins the neighbouring whole messages.
    assert_eq!(c1["hypic"]["segments"].as_array().unwrap().len(), 4, "{c1}");
    let (_, c2) = s.post("/v1/chat/completions", &chat(DOC_B, DOC_A)).await;
    assert_eq!(
        outcomes(&c2),
        ["prefix_hit", "hit", "hit", "computed"],
        "{c2}"
    );
    assert!(
        c2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );
    // Messages reordered: each message block is reused.
    let msgs = |a: &str, b: &str| {
        json!({"messages": [
            {"role": "system", "content": SYS}, {"role": "user", "content": a},
            {"role": "user", "content": b}, {"role": "user", "content": Q}], "max_tokens": 2})
    };
    let (_, _) = s.post("/v1/chat/completions", &msgs(DOC_A, DOC_B)).await;
    let (_, m2) = s.post("/v1/chat/completions", &msgs(DOC_B, DOC_A)).await;
    assert_eq!(
        outcomes(&m2),
        ["prefix_hit", "hit", "hit", "computed"],
        "{m2}"
    );

    // Metrics saw it all.
    let m = s.metrics().await;
    assert!(
        metric(
            &m,
            "hypic_prompt_tokens_total",
            "kind=\"cached\",mode=\"hypic\""
        )
        .unwrap()
            > 0.0,
        "{m}"
    );
    assert!(
        metric(
            &m,
            "hypic_prompt_tokens_total",
            "kind=\"computed\",mode=\"full_recompute\""
        )
        .unwrap()
            > 0.0
    );
    assert!(metric(&m, "hypic_segments_total", "mode=\"hypic\",outcome=\"hit\"").unwrap() >= 2.0);
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_n_seed_logprobs() {
    let s = start(|_| {}).await;
    let (_, g) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "the river", "max_tokens": 12, "temperature": 0, "ignore_eos": true}),
        )
        .await;
    let text = g["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop sequence taken from the greedy output cuts it there.
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let (st, v) = s
            .post(
                "/v1/completions",
                &json!({"prompt": "the river", "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stop": [stop.clone()]}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let t = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert!(!t.contains(&stop));
        assert!(text.starts_with(t), "{t:?} vs {text:?}");
    }
    // n with a seed: n choices, reproducible.
    let body = json!({"prompt": "the river", "max_tokens": 6, "temperature": 1.0, "top_p": 0.9,
                      "n": 3, "seed": 7, "logprobs": 2});
    let (st, a) = s.post("/v1/completions", &body).await;
    assert_eq!(st, 200, "{a}");
    let (_, b) = s.post("/v1/completions", &body).await;
    assert_eq!(a["choices"].as_array().unwrap().len(), 3);
    for i in 0..3 {
        assert_eq!(a["choices"][i]["index"], i);
        assert_eq!(a["choices"][i]["text"], b["choices"][i]["text"]);
        let lp = &a["choices"][i]["logprobs"];
        let n = lp["tokens"].as_array().unwrap().len();
        assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), n);
        assert_eq!(lp["top_logprobs"].as_array().unwrap().len(), n);
        assert!(lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x.as_f64().unwrap() <= 0.0));
        if n > 0 {
            assert_eq!(
                lp["top_logprobs"][0].as_object().unwrap().len().min(2),
                lp["top_logprobs"][0].as_object().unwrap().len()
            );
        }
    }
    let total: u64 = a["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(total <= 18);
    // Chat logprobs.
    let (st, c) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "logprobs": true, "top_logprobs": 2}),
        )
        .await;
    assert_eq!(st, 200, "{c}");
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert!(content
        .iter()
        .all(|e| e["top_logprobs"].as_array().unwrap().len() == 2));
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn segment_registry_prefill_residency_versions_and_isolation() {
    let s = start(|_| {}).await;
    // Register a private segment: prefilled into the public pool.
    let (st, v) = s
        .post("/v1/segments", &json!({"id": "doc-a", "content": DOC_A}))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["id"], "doc-a");
    assert_eq!(v["current_version"], 1);
    let ntok = v["hypic"]["tokens"].as_u64().unwrap();
    assert!(ntok > 8, "{v}");
    assert_eq!(v["tokens"]["tiny"], ntok);
    assert_eq!(v["hypic"]["residency"]["resident"], true, "{v}");
    assert!(v["hypic"]["prefill"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["status"] == "stored"));

    let (st, g) = s.get("/v1/segments/doc-a").await;
    assert_eq!(st, 200, "{g}");
    assert_eq!(g["hypic"]["tokens"], ntok);
    assert_eq!(g["hypic"]["residency"]["resident"], true);
    let (_, l) = s.get("/v1/segments").await;
    assert!(l["data"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["id"] == "doc-a" && x["version"] == 1));

    // Used by id in the middle of a request: a hit on the prefilled entry.
    let req = |v: Option<i64>| {
        let mut d = json!({"id": "doc-a"});
        if let Some(v) = v {
            d["version"] = json!(v);
        }
        json!({"segments": [{"text": SYS}, d, {"text": Q}], "max_tokens": 2})
    };
    let (st, r1) = s.post("/v1/completions", &req(Some(1))).await;
    assert_eq!(st, 200, "{r1}");
    assert_eq!(outcomes(&r1), ["miss", "hit", "computed"], "{r1}");
    assert_eq!(r1["hypic"]["segments"][1]["id"], "doc-a");
    assert_eq!(r1["hypic"]["segments"][1]["version"], 1);
    assert_eq!(r1["hypic"]["segments"][1]["shared"], false);

    // Another tenant cannot see it (404, never a hit).
    let (st, e) = s.post_as(&s.token_b, "/v1/completions", &req(None)).await;
    assert_error(st, &e, 404, "segment_not_found");
    // Wrong version.
    let (st, e) = s.post("/v1/completions", &req(Some(5))).await;
    assert_error(st, &e, 409, "version_mismatch");

    // Update: version 2, version 1's entries evicted, version 2 prefilled.
    let r = s
        .client
        .put(format!("{}/v1/segments/doc-a", s.url))
        .bearer_auth(&s.token)
        .json(&json!({"content": DOC_B}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let u: Value = r.json().await.unwrap();
    assert_eq!(u["segment"]["current_version"], 2, "{u}");
    assert!(u["hypic"]["evicted_entries"].as_u64().unwrap() >= 1, "{u}");
    let (_, r2) = s.post("/v1/completions", &req(None)).await;
    assert_eq!(r2["hypic"]["segments"][1]["version"], 2);
    assert_eq!(r2["hypic"]["segments"][1]["outcome"], "hit");
    assert_ne!(
        r2["hypic"]["segments"][1]["content_hash"],
        r1["hypic"]["segments"][1]["content_hash"]
    );

    // A public segment shares one namespace across tenants.
    let (st, p) = s
        .post(
            "/v1/segments",
            &json!({"id": "handbook", "content": DOC_B, "public": true}),
        )
        .await;
    assert_eq!(st, 200, "{p}");
    // Another tenant names it by its address (its own ids are its own).
    let shared_req =
        json!({"segments": [{"text": SYS}, {"id": p["address"]}, {"text": Q}], "max_tokens": 2});
    let (st, b) = s.post_as(&s.token_b, "/v1/completions", &shared_req).await;
    assert_eq!(st, 200, "{b}");
    assert_eq!(b["hypic"]["segments"][1]["outcome"], "hit", "{b}");
    assert_eq!(b["hypic"]["segments"][1]["shared"], true);

    // Delete: evicted, then unknown.
    let r = s
        .client
        .delete(format!("{}/v1/segments/doc-a", s.url))
        .bearer_auth(&s.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let d: Value = r.json().await.unwrap();
    assert!(d["hypic"]["evicted_entries"].as_u64().unwrap() >= 1, "{d}");
    let (st, e) = s.post("/v1/completions", &req(None)).await;
    assert_error(st, &e, 404, "segment_not_found");
    let (st, _) = s.get("/v1/segments/doc-a").await;
    assert_eq!(st, 404);
    // Control-plane routes stay mounted.
    let (st, w) = s.get("/v1/whoami").await;
    assert_eq!(st, 200);
    assert_eq!(w["tenant"], "acme");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_is_required_and_metrics_are_exposed() {
    let s = start(|_| {}).await;
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/segments"] {
        let (st, _, v) = s
            .raw(
                reqwest::Method::POST,
                path,
                None,
                br#"{"prompt":"x"}"#.to_vec(),
            )
            .await;
        assert_error(st, &v, 401, "missing_token");
        let (st, _, v) = s
            .raw(
                reqwest::Method::POST,
                path,
                Some("not-a-jwt"),
                br#"{"prompt":"x"}"#.to_vec(),
            )
            .await;
        assert_error(st, &v, 401, "invalid_token");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains("not a JWT"), "{msg}");
    }
    let (st, v) = s.get_as(None, "/v1/models").await;
    assert_error(st, &v, 401, "missing_token");
    let (st, _) = s
        .post(
            "/v1/completions",
            // ignore_eos: always 3 tokens, so there are inter-token latencies to count.
            &json!({"prompt": "hello", "max_tokens": 3, "ignore_eos": true}),
        )
        .await;
    assert_eq!(st, 200);
    // The scheduler retires the request just after the response is written.
    let t0 = std::time::Instant::now();
    let mut m = s.metrics().await;
    while metric(&m, "hypic_running_requests", "") != Some(0.0)
        && t0.elapsed() < std::time::Duration::from_secs(5)
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        m = s.metrics().await;
    }
    for name in [
        "hypic_time_to_first_token_seconds_bucket",
        "hypic_inter_token_latency_seconds_bucket",
        "hypic_queue_depth",
        "hypic_running_requests",
        "hypic_kv_reserved_bytes",
        "hypic_state_bytes",
        "hypic_prompt_tokens_total",
        "hypic_pool_bytes",
        "hypic_pool_entries",
        "hypic_pool_spill_bytes",
        "hypic_pool_events_total",
        "hypic_requests_total",
    ] {
        assert!(m.contains(name), "missing {name} in\n{m}");
    }
    assert!(m.contains("# TYPE hypic_time_to_first_token_seconds histogram"));
    assert_eq!(
        metric(
            &m,
            "hypic_time_to_first_token_seconds_count",
            "mode=\"hypic\""
        ),
        Some(1.0),
        "{m}"
    );
    assert!(
        metric(
            &m,
            "hypic_inter_token_latency_seconds_count",
            "mode=\"hypic\""
        )
        .unwrap()
            >= 1.0
    );
    assert_eq!(metric(&m, "hypic_running_requests", ""), Some(0.0));
    assert!(metric(
        &m,
        "hypic_pool_events_total",
        "event=\"eviction\",pool=\"public\""
    )
    .is_some());
    assert!(metric(&m, "hypic_pool_bytes", "pool=\"private\"").unwrap() > 0.0);
    assert_eq!(
        metric(
            &m,
            "hypic_requests_total",
            "endpoint=\"completions\",status=\"200\""
        ),
        Some(1.0)
    );
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_in_process_and_over_http_and_writes_reports() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: hypic_control::bench::BenchArgs,
    }
    let out = tempfile::tempdir().unwrap();
    let model = serve_common::golden_model();
    let common = |dir: &str| {
        vec![
            "bench".to_string(),
            "--requests".into(),
            "6".into(),
            "--rates".into(),
            "20,40".into(),
            "--docs".into(),
            "5".into(),
            "--doc-words".into(),
            "20".into(),
            "--system-words".into(),
            "10".into(),
            "--max-tokens".into(),
            "2".into(),
            "--out".into(),
            out.path().join(dir).display().to_string(),
            "--save-trace".into(),
            out.path()
                .join(dir)
                .join("trace.jsonl")
                .display()
                .to_string(),
        ]
    };
    // In-process.
    let mut args = common("local");
    args.extend(["--model".into(), model.display().to_string()]);
    let a = Cli::parse_from(args).a;
    let sum = hypic_control::bench::run_bench(&a).await.unwrap();
    assert_eq!(sum.runs.len(), 8, "4 modes × 2 rates");
    // The two default warm-up requests are sent first and counted in no run.
    assert_eq!(sum.warmup_requests, 2);
    assert!(
        sum.runs.iter().all(|r| r.ok == 6 && r.requests == 6),
        "{:?}",
        sum.runs
    );
    let hypic = sum.runs.iter().find(|r| r.mode == "hypic").unwrap();
    let full = sum
        .runs
        .iter()
        .find(|r| r.mode == "full_recompute")
        .unwrap();
    assert!(hypic.hit_ratio > 0.0 && full.hit_ratio == 0.0);
    assert!(hypic.ttft_p50_ms <= hypic.ttft_p99_ms);
    for f in [
        "summary.json",
        "summary.md",
        "samples.jsonl",
        "ttft_vs_rate.svg",
        "ttft_cdf.svg",
        "trace.jsonl",
    ] {
        assert!(out.path().join("local").join(f).exists(), "missing {f}");
    }
    // Over HTTP, replaying the saved trace.
    let s = start(|_| {}).await;
    let mut args = common("http");
    args.extend([
        "--url".into(),
        s.url.clone(),
        "--token".into(),
        s.token.clone(),
        "--modes".into(),
        "prefix_cache,hypic".into(),
        "--trace".into(),
        out.path().join("local/trace.jsonl").display().to_string(),
    ]);
    let a = Cli::parse_from(args).a;
    let sum = hypic_control::bench::run_bench(&a).await.unwrap();
    assert_eq!(sum.runs.len(), 4);
    assert!(sum.runs.iter().all(|r| r.ok == 6), "{:?}", sum.runs);
    let h = sum.runs.iter().find(|r| r.mode == "hypic").unwrap();
    assert!(h.cached_token_ratio > 0.0, "{h:?}");
    s.server.stop().await;
}

#[test]
fn config_from_toml_then_flags() {
    use hypic_control::serve::{ServeArgs, ServeConfig};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("hypic.toml");
    std::fs::write(
        &p,
        "bind = \"127.0.0.1:9999\"\nmode = \"prefix_cache\"\nqueue_capacity = 3\nseparator = \"@@\"\n",
    )
    .unwrap();
    let args = ServeArgs {
        config: Some(p.clone()),
        queue_capacity: Some(5),
        ..Default::default()
    };
    let c = ServeConfig::resolve(&args).unwrap();
    assert_eq!(c.bind.port(), 9999);
    assert_eq!(c.mode, "prefix_cache");
    assert_eq!(c.separator, "@@");
    assert_eq!(c.queue_capacity, 5, "flags override the file");
    assert_eq!(c.max_running, ServeConfig::default().max_running);
    std::fs::write(&p, "no_such_key = 1\n").unwrap();
    assert!(
        ServeConfig::resolve(&args).is_err(),
        "unknown keys are refused"
    );
    std::fs::write(&p, "mode = \"magic\"\n").unwrap();
    assert!(ServeConfig::resolve(&args).is_err());
}
