//! Multi-document QA evaluation of the PIC modes (issue 4; paper Sec. 6.2).
//!
//! Items come from `models/hypic-tiny/eval/heldout.jsonl` (format in
//! `models/hypic-tiny/eval/FORMAT.md`, reference implementation
//! `tools/train/gen_corpus.py::segments`). Each prompt is split into segments
//! `[system, doc_1, …, doc_n, question]`, each tokenised on its own.
//!
//! Protocol per item (hot cache, as the paper's TTFT comparisons): a warm-up request
//! with the same documents in a rotated order fills the pools, then the measured
//! request in the item's order is timed (TTFT = PIC assembly + prefill + first
//! sample) and greedily decoded until `<|im_end|>`. Pools are cleared between items.
//! Scores use HotpotQA's answer normalisation (lower-case, strip punctuation and the
//! articles a/an/the, collapse whitespace): exact match and token-level F1.
use crate::error::{Error, Result};
use crate::pic::{Mode, PicEngine, SegmentRef};
use crate::sampling::argmax;
use crate::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Instant;

/// One held-out QA item.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct QaItem {
    /// Item id.
    #[serde(default)]
    pub id: String,
    /// System prompt text.
    pub system: String,
    /// Document texts, in the order of this item.
    pub documents: Vec<String>,
    /// The question.
    pub question: String,
    /// Gold answer.
    pub answer: String,
    /// 1 (single-hop) or 2 (two-hop).
    pub hop: u8,
}

/// Reads a JSONL file of [`QaItem`]s. Errors name the file and line.
pub fn load_items(path: &std::path::Path) -> Result<Vec<QaItem>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.into(),
        source: e,
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| Error::Json {
                path: path.into(),
                msg: format!("line {}: {e}", i + 1),
            })
        })
        .collect()
}

/// The prompt's segment texts: `[system, doc_1, …, doc_n, question]` (ChatML; their
/// concatenation is the whole prompt, ending with the assistant header).
pub fn segment_texts(item: &QaItem) -> Vec<String> {
    let mut v = vec![format!(
        "<|im_start|>system\n{}<|im_end|>\n<|im_start|>user\n",
        item.system
    )];
    v.extend(item.documents.iter().map(|d| format!("{d}\n\n")));
    v.push(format!(
        "Question: {}<|im_end|>\n<|im_start|>assistant\n",
        item.question
    ));
    v
}

/// HotpotQA answer normalisation.
pub fn normalize_answer(s: &str) -> String {
    let lower = s.to_lowercase();
    let no_punct: String = lower
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Exact match after normalisation.
pub fn exact_match(pred: &str, gold: &str) -> bool {
    normalize_answer(pred) == normalize_answer(gold)
}

/// Token-level F1 after normalisation (HotpotQA).
pub fn f1_score(pred: &str, gold: &str) -> f64 {
    let p = normalize_answer(pred);
    let g = normalize_answer(gold);
    let pt: Vec<&str> = p.split_whitespace().collect();
    let gt: Vec<&str> = g.split_whitespace().collect();
    if pt.is_empty() || gt.is_empty() {
        return if pt == gt { 1.0 } else { 0.0 };
    }
    let mut counts: HashMap<&str, i64> = HashMap::new();
    for t in &gt {
        *counts.entry(t).or_default() += 1;
    }
    let mut same = 0i64;
    for t in &pt {
        if let Some(c) = counts.get_mut(t) {
            if *c > 0 {
                *c -= 1;
                same += 1;
            }
        }
    }
    if same == 0 {
        return 0.0;
    }
    let prec = same as f64 / pt.len() as f64;
    let rec = same as f64 / gt.len() as f64;
    2.0 * prec * rec / (prec + rec)
}

/// Scores of one mode.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ModeReport {
    /// Mode label (`full_recompute`, `hypic_w8`, …).
    pub label: String,
    /// The mode.
    pub mode: Option<Mode>,
    /// Items per hop count.
    pub n_single: usize,
    /// See `n_single`.
    pub n_two: usize,
    /// Exact match, single-hop, in [0, 1].
    pub em_single: f64,
    /// Token F1, single-hop.
    pub f1_single: f64,
    /// Exact match, two-hop.
    pub em_two: f64,
    /// Token F1, two-hop.
    pub f1_two: f64,
    /// Mean TTFT in ms of the measured requests.
    pub mean_ttft_ms: f64,
    /// Mean prompt tokens run through the model in the measured requests.
    pub mean_tokens_computed: f64,
    /// Mean prompt tokens reused in the measured requests.
    pub mean_tokens_reused: f64,
    /// Predictions, in item order.
    pub predictions: Vec<String>,
}

/// A short label for a mode.
pub fn mode_label(m: &Mode) -> String {
    match m {
        Mode::FullRecompute => "full_recompute".into(),
        Mode::PrefixCache => "prefix_cache".into(),
        Mode::NaiveAddition => "naive_addition".into(),
        Mode::Hypic {
            seam_width,
            rope_fix: true,
        } => format!("hypic_w{seam_width}"),
        Mode::Hypic {
            seam_width,
            rope_fix: false,
        } => format!("hypic_w{seam_width}_norope"),
    }
}

/// Tokenises an item's segments.
pub fn item_segments(tok: &Tokenizer, item: &QaItem, isolation: &str) -> Result<Vec<SegmentRef>> {
    segment_texts(item)
        .iter()
        .map(|t| {
            Ok(SegmentRef {
                tokens: tok.encode(t)?,
                isolation: isolation.to_string(),
            })
        })
        .collect()
}

/// Runs `items` through `mode` (protocol in the module doc); `progress` is called
/// after each item. Answers are decoded greedily for at most `max_new` tokens.
pub fn evaluate(
    engine: &PicEngine,
    tok: &Tokenizer,
    items: &[QaItem],
    mode: Mode,
    max_new: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<ModeReport> {
    let mut r = ModeReport {
        label: mode_label(&mode),
        mode: Some(mode),
        ..Default::default()
    };
    let (mut em1, mut f11, mut em2, mut f12, mut ttft, mut comp, mut reu) =
        (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0);
    for (i, item) in items.iter().enumerate() {
        engine.clear();
        let segs = item_segments(tok, item, "eval")?;
        if mode != Mode::FullRecompute && segs.len() > 3 {
            // Warm-up: same documents, rotated order.
            let mut warm = segs.clone();
            let n = warm.len();
            warm[1..n - 1].rotate_left(1);
            engine.run(&warm, mode, "eval")?;
        }
        let t0 = Instant::now();
        let out = engine.run(&segs, mode, "eval")?;
        let mut next = argmax(&out.logits);
        ttft += t0.elapsed().as_secs_f64() * 1e3;
        comp += out.stats.tokens_computed as f64;
        reu += out.stats.tokens_reused as f64;
        let mut state = out.state;
        let mut gen = vec![];
        while gen.len() < max_new && !tok.eos_ids.contains(&next) {
            gen.push(next);
            if gen.len() == max_new {
                break;
            }
            next = argmax(&engine.model().decode(next, &mut state)?);
        }
        let pred = tok.decode(&gen)?.trim().to_string();
        let (em, f1) = (
            exact_match(&pred, &item.answer) as u8 as f64,
            f1_score(&pred, &item.answer),
        );
        if item.hop >= 2 {
            r.n_two += 1;
            em2 += em;
            f12 += f1;
        } else {
            r.n_single += 1;
            em1 += em;
            f11 += f1;
        }
        r.predictions.push(pred);
        progress(i + 1);
    }
    engine.clear();
    let d = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
    r.em_single = d(em1, r.n_single);
    r.f1_single = d(f11, r.n_single);
    r.em_two = d(em2, r.n_two);
    r.f1_two = d(f12, r.n_two);
    r.mean_ttft_ms = d(ttft, items.len());
    r.mean_tokens_computed = d(comp, items.len());
    r.mean_tokens_reused = d(reu, items.len());
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hotpot_normalisation_and_f1() {
        assert_eq!(normalize_answer("The  Eiffel, Tower!"), "eiffel tower");
        assert!(exact_match("an Apple", "apple"));
        assert!(!exact_match("apples", "apple"));
        assert!((f1_score("new york city", "new york") - 0.8).abs() < 1e-12);
        assert_eq!(f1_score("paris", "london"), 0.0);
        assert_eq!(f1_score("the", "a"), 1.0);
    }

    #[test]
    fn segments_concatenate_to_the_chatml_prompt() {
        let item = QaItem {
            id: "x".into(),
            system: "S".into(),
            documents: vec!["D1".into(), "D2".into()],
            question: "Q?".into(),
            answer: "A".into(),
            hop: 1,
        };
        assert_eq!(
            segment_texts(&item).concat(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nD1\n\nD2\n\nQuestion: Q?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
