//! Bounded concurrency on `hypic serve`: 32 clients at once against a small queue;
//! every request completes or gets a clean 429 with Retry-After, nothing hangs, and
//! the scheduler's state and KV reservations return to zero afterwards. A client
//! that disconnects mid-stream has its sequence cancelled.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{metric, start};
use std::time::Duration;

fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_clients_complete_or_get_429_and_state_returns_to_baseline() {
    let s = start(|c| {
        c.queue_capacity = 6;
        c.max_running = 4;
    })
    .await;
    let docs: Vec<String> = (0..6)
        .map(|i| {
            format!("Document {i}. The river city market number {i} opens at dawn and closes late.")
        })
        .collect();
    // Warm up once so the baseline includes the allocator's steady state.
    let (st, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "warm", "max_tokens": 2}),
        )
        .await;
    assert_eq!(st, 200);
    let rss0 = rss_bytes();
    let mut tasks = vec![];
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(32));
    for i in 0..32usize {
        let barrier = barrier.clone();
        let (client, url, token) = (s.client.clone(), s.url.clone(), s.token.clone());
        let segs: Vec<Value> = [i % 6, (i + 2) % 6, (i + 3) % 6]
            .iter()
            .map(|&d| json!({"text": docs[d]}))
            .chain(std::iter::once(json!({"text": format!("Question {i}?")})))
            .collect();
        tasks.push(tokio::spawn(async move {
            let stream = i % 2 == 0;
            let body = if i % 3 == 0 {
                json!({"messages": [{"role": "user", "content": format!("hello {i}")}],
                       "max_tokens": 300, "ignore_eos": true, "stream": stream})
            } else {
                json!({"segments": segs, "max_tokens": 300, "ignore_eos": true, "stream": stream})
            };
            // Everyone at once: 4 running + 6 queued fit, the rest must be refused.
            barrier.wait().await;
            let path = if i % 3 == 0 {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            };
            let r = client
                .post(format!("{url}{path}"))
                .bearer_auth(token)
                .json(&body)
                .send()
                .await
                .expect("request sent");
            let st = r.status().as_u16();
            let retry = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let text = r.text().await.expect("body read");
            (st, retry, text, stream)
        }));
    }
    let results = tokio::time::timeout(
        Duration::from_secs(240),
        futures_util::future::join_all(tasks),
    )
    .await
    .expect("no request hangs");
    let (mut ok, mut busy) = (0, 0);
    for r in results {
        let (st, retry, text, stream) = r.unwrap();
        match st {
            200 => {
                ok += 1;
                if stream {
                    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    assert!(v["choices"][0]["finish_reason"].is_string(), "{v}");
                }
            }
            429 => {
                busy += 1;
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["error"]["code"], "queue_full", "{v}");
                assert_eq!(v["error"]["type"], "rate_limit_error");
                let secs: u64 = retry.expect("Retry-After on 429").parse().unwrap();
                assert!(secs >= 1);
            }
            other => panic!("unexpected status {other}: {text}"),
        }
    }
    eprintln!("{ok} completed, {busy} refused with 429");
    assert_eq!(ok + busy, 32);
    assert!(
        ok >= 6,
        "at least the queue's worth completes ({ok} ok, {busy} busy)"
    );
    assert!(
        busy >= 1,
        "32 simultaneous long requests overflow a queue of 6"
    );
    // Back to baseline: nothing running, queued, reserved or held.
    let mut last = String::new();
    let mut settled = false;
    for _ in 0..100 {
        last = s.metrics().await;
        if [
            "hypic_running_requests",
            "hypic_queue_depth",
            "hypic_kv_reserved_bytes",
            "hypic_state_bytes",
        ]
        .iter()
        .all(|n| metric(&last, n, "") == Some(0.0))
        {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(settled, "state did not return to baseline:\n{last}");
    assert_eq!(
        metric(
            &last,
            "hypic_scheduler_events_total",
            "event=\"queue_full\""
        )
        .unwrap() as usize,
        busy
    );
    // Batched prefills are counted (how many depends on arrival timing).
    let batches = metric(
        &last,
        "hypic_scheduler_events_total",
        "event=\"prefill_batch\"",
    );
    let in_batches = metric(
        &last,
        "hypic_scheduler_events_total",
        "event=\"prefill_batch_request\"",
    );
    eprintln!("batched prefill forwards {batches:?}, requests' pieces in them {in_batches:?}");
    let (b, r) = (
        batches.expect("prefill_batch series"),
        in_batches.expect("prefill_batch_request series"),
    );
    assert!(r >= 2.0 * b, "{b} batched forwards of {r} pieces");
    // Caches are bounded by their byte budgets; the process does not balloon.
    if let (Some(a), Some(b)) = (rss0, rss_bytes()) {
        assert!(b < a + (512 << 20), "RSS grew from {a} to {b}");
    }
    let (st, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "after", "max_tokens": 2}),
        )
        .await;
    assert_eq!(st, 200);
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_sequence() {
    let s = start(|c| c.max_running = 2).await;
    let mut r = s
        .client
        .post(format!("{}/v1/completions", s.url))
        .bearer_auth(&s.token)
        .json(&json!({"prompt": "the river", "max_tokens": 3000, "stream": true, "temperature": 0, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Read a little, then hang up.
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data:"));
    drop(r);
    let mut cancelled = false;
    for _ in 0..200 {
        let m = s.metrics().await;
        if metric(&m, "hypic_running_requests", "") == Some(0.0)
            && metric(&m, "hypic_scheduler_events_total", "event=\"cancelled\"").unwrap_or(0.0)
                >= 1.0
        {
            assert_eq!(metric(&m, "hypic_state_bytes", ""), Some(0.0));
            cancelled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(cancelled, "the disconnected request kept running");
    s.server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_is_a_clean_408() {
    let s = start(|c| {
        c.max_running = 1;
        c.queue_timeout_s = 0.05;
    })
    .await;
    // One long request holds the only slot…
    let hog = {
        let (client, url, token) = (s.client.clone(), s.url.clone(), s.token.clone());
        tokio::spawn(async move {
            client
                .post(format!("{url}/v1/completions"))
                .bearer_auth(token)
                .json(&json!({"prompt": "hold", "max_tokens": 1500, "ignore_eos": true}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    let mut timed_out = false;
    for _ in 0..50 {
        // …so the next one waits in the queue past the timeout.
        let (st, v) = s
            .post(
                "/v1/completions",
                &json!({"prompt": "wait", "max_tokens": 1}),
            )
            .await;
        if st == 408 {
            assert_eq!(v["error"]["code"], "queue_timeout", "{v}");
            assert_eq!(v["error"]["type"], "timeout_error");
            timed_out = true;
            break;
        }
        assert_eq!(st, 200, "{v}");
    }
    assert!(timed_out, "no request timed out in the queue");
    assert_eq!(hog.await.unwrap(), 200);
    s.server.stop().await;
}
