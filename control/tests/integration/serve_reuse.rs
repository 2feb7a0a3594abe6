//! Issue 15 item 10 through the real server: a chat whose two documents swap places
//! reuses both (each miss builds the entries of both position roles), and every
//! segment that is not reused says why, in the response and in
//! `hypic_segment_misses_total`.
use crate::serve_common;

use serde_json::{json, Value};
use serve_common::{metric, start};

const DOC_A: &str = "Document A. The river flows north through the old city and the market square.";
const DOC_B: &str = "Document B. The bright green light over the harbour turned on every night.";

fn chat(first: &str, second: &str, question: &str, hypic: Value) -> Value {
    json!({"messages": [
        {"role": "user", "content": first},
        {"role": "user", "content": second},
        {"role": "user", "content": question}],
        "max_tokens": 2, "temperature": 0, "hypic": hypic})
}

fn field(v: &Value, name: &str) -> Vec<Value> {
    v["hypic"]["segments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s[name].clone())
        .collect()
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swapped_chat_documents_are_hits_and_misses_carry_reasons() {
    let s = start(|_| {}).await;
    let (st, v1) = s
        .post(
            "/v1/chat/completions",
            &chat(DOC_A, DOC_B, "Where does the river flow?", json!({})),
        )
        .await;
    assert_eq!(st, 200, "{v1}");
    assert_eq!(cached(&v1), 0, "{v1}");
    assert_eq!(
        field(&v1, "outcome"),
        [json!("miss"), json!("miss"), json!("computed")],
        "{v1}"
    );
    assert_eq!(
        field(&v1, "miss_reason"),
        [json!("never_seen"), json!("never_seen"), Value::Null],
        "{v1}"
    );

    // Swapped: B is now first (whole entry), A in the middle (body after the seam).
    let (st, v2) = s
        .post(
            "/v1/chat/completions",
            &chat(DOC_B, DOC_A, "What turned on every night?", json!({})),
        )
        .await;
    assert_eq!(st, 200, "{v2}");
    assert_eq!(
        field(&v2, "outcome"),
        [json!("hit"), json!("hit"), json!("computed")],
        "{v2}"
    );
    assert!(field(&v2, "miss_reason").iter().all(Value::is_null), "{v2}");
    let reused: u64 = field(&v2, "reused").iter().filter_map(Value::as_u64).sum();
    assert!(cached(&v2) > 0 && cached(&v2) == reused, "{v2}");
    assert_eq!(v2["hypic"]["misses"], 0);
    println!(
        "swap: cached_tokens {} of {} prompt tokens (cold: {})",
        cached(&v2),
        v2["usage"]["prompt_tokens"],
        cached(&v1)
    );

    // Another seam width finds A's entries only for the other role.
    let (st, v3) = s
        .post(
            "/v1/chat/completions",
            &chat(DOC_B, DOC_A, "Which way?", json!({"seam_width": 4})),
        )
        .await;
    assert_eq!(st, 200, "{v3}");
    assert_eq!(
        field(&v3, "outcome")[..2],
        [json!("hit"), json!("miss")],
        "{v3}"
    );
    assert_eq!(field(&v3, "miss_reason")[1], json!("role_mismatch"), "{v3}");

    let m = s.metrics().await;
    let misses = |reason: &str| {
        metric(
            &m,
            "hypic_segment_misses_total",
            &format!("mode=\"hypic\",reason=\"{reason}\""),
        )
    };
    assert_eq!(misses("never_seen"), Some(2.0), "{m}");
    assert_eq!(misses("role_mismatch"), Some(1.0), "{m}");
    assert!(
        metric(&m, "hypic_segments_total", "mode=\"hypic\",outcome=\"hit\"").unwrap() >= 2.0,
        "{m}"
    );
    s.server.stop().await;
}
