//! Segment parallelism end to end: `hypic serve --workers` with two `hypic worker`
//! processes on loopback and the bundled model gives exactly the answers and
//! statistics of a server alone, for segments by text, by catalog id and as chat
//! content parts; a worker killed while the request runs costs no correctness.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{metric, start, Srv};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny")
}

/// A `hypic worker` process; killed when dropped.
struct WorkerProc {
    child: Child,
    addr: String,
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_worker() -> WorkerProc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_hypic"))
        .args(["worker", "--listen", "127.0.0.1:0", "--model"])
        .arg(tiny())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("hypic worker starts");
    let out = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line).unwrap();
    let addr = line
        .split_whitespace()
        .nth(4)
        .unwrap_or_else(|| panic!("no ready line: {line:?}"))
        .to_string();
    assert!(line.starts_with("hypic: worker ready on "), "{line}");
    WorkerProc { child, addr }
}

/// A server on the bundled model with `workers` (none: the single server). A step
/// budget above every prompt here builds each entry in one pass, as a worker does
/// (an entry built in pieces under a tight step budget equals it up to fp32
/// rounding only: `PicBackend::build_entries_start`).
async fn server(workers: &[&WorkerProc]) -> Srv {
    let addrs: Vec<String> = workers.iter().map(|w| w.addr.clone()).collect();
    start(move |c| {
        c.model = Some(tiny());
        c.model_id = Some("tiny".into());
        c.step_tokens = 16384;
        c.prefill_chunk_tokens = 16384;
        c.workers = addrs;
        c.scatter_floor_ms = 1000;
    })
    .await
}

fn doc(k: usize, words: usize) -> String {
    let names = [
        "Zentrix", "Morvale", "Quillon", "Astera", "Brennic", "Calder",
    ];
    let founders = [
        "Mara Quell",
        "Ido Fenn",
        "Lys Orrin",
        "Tam Vek",
        "Ona Pell",
        "Rue Sal",
    ];
    let mut s = format!(
        "{} was founded by {}. ",
        names[k % names.len()],
        founders[k % founders.len()]
    );
    for i in 0..words {
        s.push_str(["river ", "stone ", "lantern ", "harbor ", "copper "][(i + k) % 5]);
    }
    s
}

/// The fields of the `hypic` object that must not depend on where segments were
/// prefilled (times excluded).
fn stats(v: &Value) -> Value {
    let h = &v["hypic"];
    json!({
        "tokens_computed": h["tokens_computed"],
        "tokens_reused": h["tokens_reused"],
        "hits": h["hits"],
        "misses": h["misses"],
        "segments": h["segments"].as_array().unwrap().iter().map(|s| json!({
            "tokens": s["tokens"], "outcome": s["outcome"], "computed": s["computed"],
            "reused": s["reused"], "seam": s["seam"], "content_hash": s["content_hash"],
            "miss_reason": s["miss_reason"], "id": s["id"],
        })).collect::<Vec<_>>(),
    })
}

fn text(v: &Value) -> String {
    let c = &v["choices"][0];
    c["text"]
        .as_str()
        .or_else(|| c["message"]["content"].as_str())
        .unwrap_or_else(|| panic!("no text: {v}"))
        .to_string()
}

async fn both(a: &Srv, b: &Srv, path: &str, body: &Value) -> (Value, Value) {
    let (sa, va) = a.post(path, body).await;
    assert_eq!(sa, 200, "{va}");
    let (sb, vb) = b.post(path, body).await;
    assert_eq!(sb, 200, "{vb}");
    assert_eq!(text(&va), text(&vb), "{va}\n{vb}");
    assert_eq!(stats(&va), stats(&vb));
    (va, vb)
}

const SYS: &str = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n";
const Q: &str = "\n\nQuestion: Who founded Zentrix?<|im_end|>\n<|im_start|>assistant\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_parallel_two_workers_give_the_single_server_answers_and_statistics() {
    let (w1, w2) = (spawn_worker(), spawn_worker());
    let par = server(&[&w1, &w2]).await;
    let one = server(&[]).await;
    assert_eq!(par.server.state.scatter().unwrap().live(), 2);

    // Segments by text: the system prompt and three unequal documents are cold.
    let segs = json!([{"text": SYS}, {"text": doc(0, 60)}, {"text": doc(1, 20)},
        {"text": doc(2, 40)}, {"text": Q}]);
    let body = json!({"model": "tiny", "segments": segs, "max_tokens": 6, "temperature": 0});
    let (p, _) = both(&par, &one, "/v1/completions", &body).await;
    let sc = &p["hypic"]["scatter"];
    assert_eq!(sc["segments"], 4, "{p}");
    assert_eq!(p["hypic"]["misses"], 4);
    assert_eq!(sc["recomputed"], 0, "{sc}");
    assert_eq!(sc["corrupt"], 0, "{sc}");
    let shipped: u64 = sc["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["segments"].as_u64().unwrap())
        .sum();
    assert_eq!(shipped, 4, "{sc}");
    assert_eq!(
        sc["workers"].as_array().unwrap().len(),
        2,
        "LPT uses both: {sc}"
    );

    // Reordered: every document a hit on both servers, nothing scattered.
    let segs = json!([{"text": SYS}, {"text": doc(2, 40)}, {"text": doc(0, 60)},
        {"text": doc(1, 20)}, {"text": Q}]);
    let body = json!({"model": "tiny", "segments": segs, "max_tokens": 6, "temperature": 0});
    let (p, _) = both(&par, &one, "/v1/completions", &body).await;
    assert!(p["hypic"].get("scatter").is_none(), "{p}");
    assert_eq!(p["hypic"]["hits"], 4);

    // Catalog segments by id, registered without a prefill: cold, then scattered.
    for s in [&par, &one] {
        for (id, k) in [("doc-a", 3), ("doc-b", 4)] {
            let (st, v) = s
                .post(
                    "/v1/segments",
                    &json!({"id": id, "content": doc(k, 30), "prefill": false}),
                )
                .await;
            assert_eq!(st, 200, "{v}");
        }
    }
    let body = json!({"model": "tiny", "max_tokens": 6, "temperature": 0,
        "segments": [{"text": SYS}, {"id": "doc-a"}, {"id": "doc-b"}, {"text": Q}]});
    let (p, _) = both(&par, &one, "/v1/completions", &body).await;
    assert_eq!(p["hypic"]["scatter"]["segments"], 2, "{p}");

    // Chat: a document per content part.
    let body = json!({"model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": [
            {"type": "text", "text": doc(5, 25)},
            {"type": "text", "text": doc(0, 35)},
            {"type": "text", "text": "Question: Who founded Calder?"}]}]});
    let (p, _) = both(&par, &one, "/v1/chat/completions", &body).await;
    assert!(
        p["hypic"]["scatter"]["segments"].as_u64().unwrap() >= 1,
        "{p}"
    );

    let m = par.metrics().await;
    let up = format!("worker=\"{}\",transport=\"tcp\"", w1.addr);
    assert_eq!(metric(&m, "hypic_worker_up", &up), Some(1.0), "{m}");
    assert!(
        metric(&m, "hypic_worker_transfer_seconds_total", &up).is_some(),
        "{m}"
    );
    assert!(metric(&m, "hypic_scatter_segments_total", "").unwrap() >= 7.0);
    assert_eq!(metric(&m, "hypic_scatter_recomputed_total", ""), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_parallel_a_worker_killed_mid_request_still_completes_correctly() {
    let (mut w1, w2) = (spawn_worker(), spawn_worker());
    let par = server(&[&w1, &w2]).await;
    let one = server(&[]).await;
    // Six long documents: the scatter takes a while on this machine.
    let mut segs = vec![json!({"text": SYS})];
    segs.extend((0..6).map(|k| json!({"text": doc(k, 400)})));
    segs.push(json!({"text": Q}));
    let body = json!({"model": "tiny", "segments": segs, "max_tokens": 6, "temperature": 0});
    let (url, token) = (par.url.clone(), par.token.clone());
    let b = body.clone();
    let req = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .bearer_auth(token)
            .json(&b)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    });
    // Kill one worker while the request runs.
    let t = Instant::now();
    while par.server.state.scatter().unwrap().drivers() == 0
        && t.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    w1.child.kill().unwrap();
    let _ = w1.child.wait();
    let (st, p) = req.await.unwrap();
    assert_eq!(st, 200, "{p}");
    let (st, v) = one.post("/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(text(&p), text(&v));
    assert_eq!(stats(&p), stats(&v));
    let sc = &p["hypic"]["scatter"];
    assert_eq!(sc["segments"], 7, "{sc}");
    let failed = sc["workers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w["failed"] == true && w["worker"] == w1.addr.as_str());
    assert!(failed, "the killed worker's failure is reported: {sc}");
    assert!(
        sc["reassigned"].as_u64().unwrap() + sc["recomputed"].as_u64().unwrap() >= 1,
        "{sc}"
    );
    // Nothing left running; the dead worker is out of the assignment set.
    let sc = par.server.state.scatter().unwrap();
    let t = Instant::now();
    while sc.drivers() > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(sc.drivers(), 0);
    assert_eq!(sc.live(), 1);
    drop(w2);
}

/// `hypic worker --device cuda` in a build without CUDA stops at once with the
/// error `serve` gives (naming the alternatives), before any weights are read.
#[cfg(not(feature = "cuda"))]
#[test]
fn worker_on_cuda_without_the_feature_is_a_clear_startup_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hypic"))
        .args([
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--device",
            "cuda",
            "--model",
        ])
        .arg(tiny())
        .output()
        .expect("hypic worker runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--device cuda") && err.contains("--device cpu"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "no ready line: {:?}", out.stdout);
}
