//! Request bounds of `hypic serve`: oversized prompts are refused before they are
//! tokenised, with the server's peak memory bounded; caps on segments, prefill
//! tokens, message and segment bytes per request, each named by its error.
//!
//! The memory test runs the `hypic` binary as a child process and reads the child's
//! own peak RSS (`VmHWM` in `/proc/<pid>/status`): the other tests of this binary
//! run in parallel threads of the same process, so the test process's peak would
//! measure them too. The binary is built for these tests anyway; no extra link.
use crate::serve_common::{assert_error, golden_model, start};
use hypic_control::serve::ServeConfig;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `hypic serve` child process on a loopback port, killed on drop.
struct ChildServer {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ChildServer {
    fn start() -> ChildServer {
        let dir = tempfile::tempdir().unwrap();
        let mut c = Command::new(env!("CARGO_BIN_EXE_hypic"));
        for (k, _) in std::env::vars() {
            if k.starts_with("HYPIC_") {
                c.env_remove(k);
            }
        }
        let mut child = c
            .args(["serve", "--bind", "127.0.0.1:0", "--device", "cpu"])
            .arg("--model")
            .arg(golden_model())
            .arg("--data-dir")
            .arg(dir.path())
            .args(["--disable-auth", "--invalidation-sweep-ms", "0"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("hypic serve starts");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let url = loop {
            let line = lines
                .next()
                .expect("hypic serve exited before serving")
                .unwrap();
            if let Some(rest) = line.strip_prefix("hypic: serving ") {
                let addr = rest
                    .split(" on ")
                    .nth(1)
                    .unwrap()
                    .split(' ')
                    .next()
                    .unwrap();
                break format!("http://{addr}");
            }
        };
        // Keep draining stderr so that the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        ChildServer {
            child,
            url,
            _dir: dir,
        }
    }

    /// `VmHWM` (peak resident set) and `VmRSS` of the child, bytes.
    fn memory(&self) -> (u64, u64) {
        let st = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb = |key: &str| -> u64 {
            st.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("{key} in {st}"))
        };
        (kb("VmHWM:") << 10, kb("VmRSS:") << 10)
    }
}

/// Eight concurrent 10 MB prompts (and a 10 MB chat message and segment) are
/// refused with a clear 400 before tokenisation; the server's peak RSS grows by
/// less than 300 MiB (tokenising them took several GB) and it stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_prompts_are_refused_with_bounded_memory() {
    let srv = ChildServer::start();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let health = client
        .get(format!("{}/health", srv.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let (hwm0, _) = srv.memory();
    let t0 = Instant::now();
    let prompt = "river city market ".repeat((10 << 20) / 18);
    let body = |path: &str, v: Value| {
        let c = client.clone();
        let url = format!("{}{path}", srv.url);
        let bytes = serde_json::to_vec(&v).unwrap();
        async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(bytes)
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            (st, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let mut reqs = vec![];
    for _ in 0..8 {
        reqs.push(tokio::spawn(body(
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )));
    }
    let msg = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 1});
    reqs.push(tokio::spawn(body("/v1/chat/completions", msg)));
    let seg = json!({"id": "big", "content": prompt});
    reqs.push(tokio::spawn(body("/v1/segments", seg)));
    let mut answers = vec![];
    for r in reqs {
        answers.push(r.await.unwrap());
    }
    let elapsed = t0.elapsed();
    for (st, v) in &answers[..8] {
        assert_error(*st, v, 400, "context_length_exceeded");
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(
            m.contains("maximum context length is 4096 tokens") && m.contains("at least"),
            "{m}"
        );
    }
    let (st, v) = &answers[8];
    assert_error(*st, v, 400, "string_above_max_length");
    assert_eq!(v["error"]["param"], "messages[0].content", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_message_bytes"),
        "{v}"
    );
    // The segment may also be refused by the control plane's own body cap.
    let (st, v) = &answers[9];
    assert!([400, 413].contains(st), "{st} {v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    let (hwm1, rss1) = srv.memory();
    let grew = hwm1.saturating_sub(hwm0);
    eprintln!(
        "peak RSS {} MiB -> {} MiB (now {} MiB) in {elapsed:?}",
        hwm0 >> 20,
        hwm1 >> 20,
        rss1 >> 20
    );
    assert!(grew < 300 << 20, "peak RSS grew by {} MiB", grew >> 20);
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    let health = client
        .get(format!("{}/health", srv.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}

#[test]
fn request_bounds_have_the_documented_defaults() {
    let c = ServeConfig::default();
    assert_eq!(c.max_segments_per_request, 256);
    assert_eq!(c.max_prefill_tokens_per_request, 32_768);
    assert_eq!(c.max_segment_bytes, 1 << 20);
    assert_eq!(c.max_message_bytes, 4 << 20);
    assert_eq!(c.tokenize_concurrency, 4);
    for bad in [
        ServeConfig {
            max_segments_per_request: 0,
            ..ServeConfig::default()
        },
        ServeConfig {
            tokenize_concurrency: 0,
            ..ServeConfig::default()
        },
    ] {
        assert!(bad.validate().is_err());
    }
}

/// More segments than `max_segments_per_request` are refused before anything is
/// tokenised or prefilled (1,000 small segments took two minutes of CPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_segments_are_refused_naming_the_limit() {
    let s = start(|_| {}).await;
    let segs: Vec<Value> = (0..1000)
        .map(|i| json!({"text": format!("doc {i}. ")}))
        .collect();
    let t0 = Instant::now();
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": segs, "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "too_many_segments");
    assert_eq!(v["error"]["param"], "segments", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("max_segments_per_request") && m.contains("256") && m.contains("1000"),
        "{m}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    // A prompt cut into too many pieces, and a chat of too many messages.
    let sep = ServeConfig::default().separator;
    let prompt = vec!["x"; 300].join(&sep);
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "too_many_segments");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let msgs: Vec<Value> = (0..300)
        .map(|i| json!({"role": "user", "content": format!("m{i}")}))
        .collect();
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": msgs, "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "too_many_segments");
    assert_eq!(v["error"]["param"], "messages", "{v}");

    let s = start(|c| c.max_segments_per_request = 3).await;
    let segs = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|i| json!({"text": format!("doc {i}. ")}))
            .collect()
    };
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": segs(4), "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "too_many_segments");
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": segs(3), "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
}

/// `max_prefill_tokens_per_request` bounds one prompt and the sum of a request's
/// prompts; `max_message_bytes` and `max_segment_bytes` bound single texts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_token_and_byte_caps_name_the_limit() {
    let s = start(|c| {
        c.max_prefill_tokens_per_request = 64;
        c.max_message_bytes = 1000;
        c.max_segment_bytes = 2000;
    })
    .await;
    let words = |n: usize| "river city market ".repeat(n);
    // One prompt over the cap (the context is 4096).
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": words(40), "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "prefill_tokens_exceeded");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("max_prefill_tokens_per_request") && m.contains("64"),
        "{m}"
    );
    // Two prompts that fit alone, not together.
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": [words(5), words(5), words(5)], "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "prefill_tokens_exceeded");
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": words(5), "max_tokens": 1}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    // Byte caps per message and per segment.
    let (st, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "a".repeat(1001)}]}),
        )
        .await;
    assert_error(st, &v, 400, "string_above_max_length");
    assert_eq!(v["error"]["param"], "messages[0].content", "{v}");
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"segments": [{"text": " a".repeat(1001)}], "max_tokens": 1}),
        )
        .await;
    assert_error(st, &v, 400, "string_above_max_length");
    assert_eq!(v["error"]["param"], "segments[0].text", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_segment_bytes"),
        "{v}"
    );
    let (st, v) = s
        .post(
            "/v1/segments",
            &json!({"id": "big", "content": " a".repeat(1001)}),
        )
        .await;
    // Catalog content over the shared key is refused by the control plane (413).
    assert_error(st, &v, 413, "too_large");
    assert_eq!(v["error"]["param"], "content", "{v}");
}
