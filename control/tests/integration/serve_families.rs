//! `hypic serve` on the Ring-linear (`bailing_moe_linear`: Lightning scalar-decay
//! layers with RoPE in the linear layers) and Kimi-Linear (`kimi_linear`: KDA layers,
//! MLA attention) families, on the CPU backend, through the HTTP API.
//!
//! Each family's model is a random-weight checkpoint of its golden fixture's shape
//! (`dataplane/tests/fixtures/golden/<family>/config.json`) with the vocabulary of
//! the qwen3_next fixture's tokenizer, written by `dataplane::random_checkpoint`.
//! For one chat (system, two documents as content parts, a question) the test asks:
//! - full recompute, twice: the same greedy tokens (the reference);
//! - prefix cache, cold then warm: the warm request reuses the whole prompt before the
//!   question and answers exactly as full recompute;
//! - HYPIC with the documents swapped after a cold request: both documents are hits,
//!   their bodies reused after the seam window; naive addition answers too.
//!
//! The per-family exactness of the composition (layer 0, covering seams, the RoPE
//! rotation of a cached Lightning state) is tested on the engine in
//! `dataplane/tests/pic_ring.rs` and `pic_kimi.rs`.
use crate::serve_common;

use dataplane::config::ModelConfig;
use dataplane::random_checkpoint::{self as rc, LargeDtype};
use serde_json::{json, Value};
use serve_common::start;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../dataplane/tests/fixtures/golden")
}

/// Writes a random checkpoint of `family`'s fixture shape into `dir`, with the
/// qwen3_next fixture's tokenizer (320 ids) and its special ids.
fn family_model(family: &str, dir: &Path) {
    let text = std::fs::read_to_string(fixtures().join(family).join("config.json")).unwrap();
    let mut json: Value = serde_json::from_str(&text).unwrap();
    json["vocab_size"] = json!(320);
    json["bos_token_id"] = json!(317);
    json["eos_token_id"] = json!(319);
    json["pad_token_id"] = json!(317);
    let c = ModelConfig::from_json(&json).unwrap();
    rc::write(&c, &json, dir, 7, LargeDtype::F32, 1 << 30, &mut |_, _| {}).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixtures().join("qwen3_next").join(f), dir.join(f)).unwrap();
    }
}

const DOC_A: &str = "Document A. The river flows north through the old city.\n\n";
const DOC_B: &str = "Document B. A green light over the harbour turned on.\n\n";

fn chat(first: &str, second: &str, hypic: Value) -> Value {
    json!({"messages": [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": [
            {"type": "text", "text": first},
            {"type": "text", "text": second},
            {"type": "text", "text": "Question: where does the river flow?"}]}],
        "max_tokens": 6, "temperature": 0, "hypic": hypic})
}

fn outcomes(v: &Value) -> Vec<String> {
    v["hypic"]["segments"]
        .as_array()
        .unwrap_or_else(|| panic!("no hypic.segments: {v}"))
        .iter()
        .map(|s| s["outcome"].as_str().unwrap().to_string())
        .collect()
}

fn text(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {v}"))
        .to_string()
}

async fn check_family(family: &str) {
    let model = tempfile::tempdir().unwrap();
    family_model(family, model.path());
    let s = start(|c| {
        c.model = Some(model.path().to_path_buf());
        c.model_id = Some(family.into());
    })
    .await;
    let ask = |body: Value| {
        let s = &s;
        async move {
            let (st, v) = s.post("/v1/chat/completions", &body).await;
            assert_eq!(st, 200, "{family}: {v}");
            v
        }
    };
    let full = json!({"mode": "full_recompute"});
    let reference = text(&ask(chat(DOC_A, DOC_B, full.clone())).await);
    assert!(!reference.is_empty(), "{family}: empty greedy answer");
    assert_eq!(
        text(&ask(chat(DOC_A, DOC_B, full.clone())).await),
        reference,
        "{family}: full recompute is deterministic"
    );

    let prefix = json!({"mode": "prefix_cache"});
    let cold = ask(chat(DOC_A, DOC_B, prefix.clone())).await;
    let warm = ask(chat(DOC_A, DOC_B, prefix)).await;
    assert_eq!(text(&cold), reference, "{family}: cold prefix cache");
    assert_eq!(text(&warm), reference, "{family}: warm prefix cache");
    assert!(
        warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{family}: the warm request reuses its prefix: {warm}"
    );

    // HYPIC: a cold request, then the documents swapped: both are hits, each body
    // reused after its seam window.
    let hypic = json!({"mode": "hypic", "seam_width": 8});
    let cold = ask(chat(DOC_A, DOC_B, hypic.clone())).await;
    assert!(
        outcomes(&cold).iter().all(|o| o != "hit"),
        "{family}: {cold}"
    );
    let swapped = ask(chat(DOC_B, DOC_A, hypic)).await;
    let o = outcomes(&swapped);
    // Segment 0 is the system prompt (a prefix hit), 1 and 2 the documents.
    assert_eq!(
        (o[0].as_str(), o[1].as_str(), o[2].as_str()),
        ("prefix_hit", "hit", "hit"),
        "{family}: both documents are hits when swapped: {swapped}"
    );
    assert!(
        swapped["hypic"]["tokens_reused"].as_u64().unwrap() > 0,
        "{family}: {swapped}"
    );
    assert!(!text(&swapped).is_empty(), "{family}: {swapped}");
    // Naive addition composes the same cached entries without transitions.
    let naive = ask(chat(DOC_B, DOC_A, json!({"mode": "naive_addition"}))).await;
    assert!(!text(&naive).is_empty(), "{family}: {naive}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_linear_serves_every_mode() {
    check_family("bailing_moe_linear").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kimi_linear_serves_every_mode() {
    check_family("kimi_linear").await;
}
