//! Multi-document QA evaluation of the PIC modes (issue 4; paper Sec. 6.2).
//!
//! Items come from `models/hypic-tiny/eval/heldout.jsonl` (format in
//! `models/hypic-tiny/eval/FORMAT.md`, reference implementation
//! `tools/train/gen_corpus.py::segments`). Each prompt is split into segments
//! `[system, doc_1, …, doc_n, question]`, each tokenised on its own.
//!
//! Protocol per item (hot cache, as the paper's TTFT comparisons): the pools are
//! filled first (the public pool with every document's entry for the seam widths
//! under test, the private pool with the system-prompt prefix for `prefix_cache`,
//! which is all a request with the documents in another order could share), then the
//! measured request in the item's order is timed (TTFT = queueing + PIC assembly +
//! prefill + first sample, as the scheduler reports it) and greedily decoded until
//! `<|im_end|>`. Pools are cleared between items. Every request goes through the
//! [`Scheduler`] that `hypic serve` uses, so the evaluation runs on whichever engine
//! it drives (the CPU reference or the GPU).
//! Scores use HotpotQA's answer normalisation (lower-case, strip punctuation and the
//! articles a/an/the, collapse whitespace): exact match and token-level F1.
use crate::error::{Error, Result};
use crate::pic::{Mode, PicStats, SegmentRef};
use crate::sampling::SamplingParams;
use crate::scheduler::{ErrorKind, GenEvent, GenRequest, Scheduler};
use crate::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::Duration;

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
    /// Two-hop items: the bridge entity (the first hop's value), which the model writes
    /// before the answer (see [`reply_text`]). Absent or null for single-hop items.
    #[serde(default)]
    pub bridge: Option<String>,
    /// 1 (single-hop) or 2 (two-hop).
    pub hop: u8,
}

/// Separator between the bridge entity and the answer in a two-hop reply
/// (`tools/train/gen_corpus.py`, `BRIDGE_SEP` without its spaces).
pub const BRIDGE_SEP: &str = "->";

/// The reply the bundled model is trained to give (without the end-of-turn token):
/// the answer for a single-hop item, `"{bridge} -> {answer}"` for a two-hop item
/// (`eval/FORMAT.md`). Its tokens are what the mean answer NLL scores.
pub fn reply_text(item: &QaItem) -> String {
    match item.bridge.as_deref() {
        Some(b) if !b.is_empty() => format!("{b} {BRIDGE_SEP} {}", item.answer),
        _ => item.answer.clone(),
    }
}

/// The answer part of a generated reply: the text after the last [`BRIDGE_SEP`], or
/// the whole reply when there is none; whitespace-trimmed. Exact match and F1 score
/// this part only.
pub fn final_answer(reply: &str) -> &str {
    match reply.rfind(BRIDGE_SEP) {
        Some(i) => reply[i + BRIDGE_SEP.len()..].trim(),
        None => reply.trim(),
    }
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
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
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
    /// Mean negative log-likelihood (nats per token) of the gold reply
    /// ([`reply_text`]: the answer, preceded by the bridge entity for two-hop items)
    /// followed by `<|im_end|>`, teacher-forced from the measured request's state: how far a mode
    /// moves the model's belief in the right answer, finer than exact match.
    pub mean_answer_nll: f64,
    /// Mean KL divergence `KL(p_full ‖ p_mode)` (nats) of the first answer token's
    /// distribution from full recompute's on the same item; `None` unless
    /// `full_recompute` was among the evaluated modes.
    pub mean_first_token_kl: Option<f64>,
    /// Predictions, in item order.
    pub predictions: Vec<String>,
}

/// Merges the reports of disjoint shards of one held-out set (e.g. `hypic eval --skip`
/// runs in parallel) into the reports of their union, as if evaluated in one run:
/// single-hop (two-hop) scores are weighted by each shard's single-hop (two-hop) item
/// count, per-item means by its item count, predictions concatenated in shard order.
/// Every shard must list the same modes in the same order; otherwise
/// [`Error::Input`] names the first mismatch. A first-token KL survives only if every
/// shard has one.
pub fn merge_reports(shards: &[Vec<ModeReport>]) -> Result<Vec<ModeReport>> {
    let Some(first) = shards.first() else {
        return Err(Error::Input("no reports to merge".into()));
    };
    let mut out = Vec::with_capacity(first.len());
    for (j, head) in first.iter().enumerate() {
        let mut m = ModeReport {
            label: head.label.clone(),
            mode: head.mode,
            mean_first_token_kl: Some(0.0),
            ..Default::default()
        };
        for (k, shard) in shards.iter().enumerate() {
            let r = shard
                .get(j)
                .filter(|r| r.label == head.label)
                .ok_or_else(|| {
                    Error::Input(format!(
                        "shard {k} does not have mode `{}` at position {j}",
                        head.label
                    ))
                })?;
            if shard.len() != first.len() {
                return Err(Error::Input(format!(
                    "shard {k} has {} modes, shard 0 has {}",
                    shard.len(),
                    first.len()
                )));
            }
            let (n1, n2) = (r.n_single as f64, r.n_two as f64);
            let n = n1 + n2;
            m.n_single += r.n_single;
            m.n_two += r.n_two;
            m.em_single += r.em_single * n1;
            m.f1_single += r.f1_single * n1;
            m.em_two += r.em_two * n2;
            m.f1_two += r.f1_two * n2;
            m.mean_ttft_ms += r.mean_ttft_ms * n;
            m.mean_tokens_computed += r.mean_tokens_computed * n;
            m.mean_tokens_reused += r.mean_tokens_reused * n;
            m.mean_answer_nll += r.mean_answer_nll * n;
            m.mean_first_token_kl = match (m.mean_first_token_kl, r.mean_first_token_kl) {
                (Some(a), Some(b)) => Some(a + b * n),
                _ => None,
            };
            m.predictions.extend(r.predictions.iter().cloned());
        }
        let d = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
        let (n1, n2, n) = (m.n_single, m.n_two, m.n_single + m.n_two);
        m.em_single = d(m.em_single, n1);
        m.f1_single = d(m.f1_single, n1);
        m.em_two = d(m.em_two, n2);
        m.f1_two = d(m.f1_two, n2);
        m.mean_ttft_ms = d(m.mean_ttft_ms, n);
        m.mean_tokens_computed = d(m.mean_tokens_computed, n);
        m.mean_tokens_reused = d(m.mean_tokens_reused, n);
        m.mean_answer_nll = d(m.mean_answer_nll, n);
        m.mean_first_token_kl = m.mean_first_token_kl.map(|k| d(k, n));
        out.push(m);
    }
    Ok(out)
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
///
/// Errors: as [`evaluate_modes`].
pub fn evaluate(
    sched: &Scheduler,
    tok: &Tokenizer,
    items: &[QaItem],
    mode: Mode,
    max_new: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<ModeReport> {
    let mut r = evaluate_modes(sched, tok, items, &[mode], max_new, progress)?;
    r.pop()
        .ok_or_else(|| Error::Input("no report for the mode".into()))
}

/// Running sums of one mode over the items.
#[derive(Default)]
struct Sums {
    em1: f64,
    f11: f64,
    em2: f64,
    f12: f64,
    ttft: f64,
    computed: f64,
    reused: f64,
    nll: f64,
    kl: f64,
}

/// What one request through the scheduler returned.
struct Served {
    stats: PicStats,
    ttft: Duration,
    /// `(prompt logits, per-token NLL)` of a scored request.
    scored: Option<(Vec<f32>, Vec<f64>)>,
    generated: Vec<u32>,
}

/// Submits one greedy request to `sched` and waits for its events (blocking the
/// calling thread).
fn serve_one(
    sched: &Scheduler,
    segments: &[SegmentRef],
    mode: Mode,
    max_tokens: usize,
    stop_token_ids: &[u32],
    score: Option<Vec<u32>>,
) -> Result<Served> {
    let mut h = sched
        .submit(GenRequest {
            segments: segments.to_vec(),
            mode,
            tenant: EVAL_TENANT.into(),
            sampling: SamplingParams::default(),
            max_tokens,
            stop_token_ids: stop_token_ids.to_vec(),
            top_logprobs: 0,
            logprobs: false,
            score,
        })
        .map_err(|e| Error::Input(format!("submitting an eval request: {e}")))?;
    let mut out = Served {
        stats: PicStats::default(),
        ttft: Duration::ZERO,
        scored: None,
        generated: vec![],
    };
    loop {
        match h.events.blocking_recv() {
            Some(GenEvent::Started { stats, ttft, .. }) => {
                out.stats = stats;
                out.ttft = ttft;
            }
            Some(GenEvent::Scored {
                prompt_logits,
                token_nll,
            }) => out.scored = Some((prompt_logits, token_nll)),
            Some(GenEvent::Token { id, .. }) => out.generated.push(id),
            Some(GenEvent::Done { .. }) => return Ok(out),
            Some(GenEvent::Error { kind, message }) => {
                return Err(match kind {
                    ErrorKind::Internal => Error::Device(message),
                    _ => Error::Input(message),
                })
            }
            None => return Err(Error::Device("the scheduler dropped the request".into())),
        }
    }
}

/// Tenant of the evaluation requests (and isolation key of their segments).
const EVAL_TENANT: &str = "eval";

/// Runs `items` through every mode of `modes` (protocol in the module doc), item by
/// item, every request through `sched` (the scheduler `hypic serve` uses, over the
/// CPU or the GPU engine): the public-pool entries an item's modes need (every seam
/// width, and body start 0 for naive addition) are built before its measured
/// requests, one prefill per segment ([`crate::engine::EnginePools::prefetch_many`]);
/// `prefix_cache` is warmed with a request of the system segment alone, the only
/// prefix a reordered request can share. Each measured request is greedy, stops at
/// the tokenizer's end-of-turn tokens or `max_new` tokens, and scores the gold reply
/// teacher-forced on a fork of its prompt state ([`GenRequest::score`]); TTFT is the
/// scheduler's (submission to the first token). `progress` is called after each
/// item. Reports in the order of `modes`.
///
/// Blocks the calling thread on the request events: call it outside an async
/// runtime. Errors: `max_new` 0, a request the scheduler refuses (e.g. over the
/// context limit or the KV budget) as [`Error::Input`], a device failure as
/// [`Error::Device`].
pub fn evaluate_modes(
    sched: &Scheduler,
    tok: &Tokenizer,
    items: &[QaItem],
    modes: &[Mode],
    max_new: usize,
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<ModeReport>> {
    if max_new == 0 {
        return Err(Error::Input(
            "the reply budget (max new tokens) must be at least 1".into(),
        ));
    }
    let engine = sched.engine();
    let mut reports = empty_reports(modes);
    let mut sums: Vec<Sums> = modes.iter().map(|_| Sums::default()).collect();
    let later_starts = later_body_starts(modes);
    for (i, item) in items.iter().enumerate() {
        engine.clear();
        let segs = item_segments(tok, item, EVAL_TENANT)?;
        let n = segs.len();
        if !later_starts.is_empty() {
            engine.prefetch_many(&segs[0].tokens, EVAL_TENANT, &[0])?;
            for s in &segs[1..n - 1] {
                engine.prefetch_many(&s.tokens, EVAL_TENANT, &later_starts)?;
            }
        }
        let mut target = tok.encode(&reply_text(item))?;
        if let Some(&eos) = tok.eos_ids.first() {
            target.push(eos);
        }
        // Full recompute first, so every mode can be compared with its logits.
        let mut order: Vec<usize> = (0..modes.len()).collect();
        order.sort_by_key(|&j| modes[j] != Mode::FullRecompute);
        let mut full_logits: Option<Vec<f32>> = None;
        for j in order {
            let mode = modes[j];
            if mode == Mode::PrefixCache && n > 1 {
                serve_one(sched, &segs[..1], mode, 1, &[], None)?;
            }
            let out = serve_one(
                sched,
                &segs,
                mode,
                max_new,
                &tok.eos_ids,
                Some(target.clone()),
            )?;
            let (logits, token_nll) = out
                .scored
                .ok_or_else(|| Error::Device("the scheduler sent no scores".into()))?;
            let s = &mut sums[j];
            s.ttft += out.ttft.as_secs_f64() * 1e3;
            s.computed += out.stats.tokens_computed as f64;
            s.reused += out.stats.tokens_reused as f64;
            s.nll += token_nll.iter().sum::<f64>() / token_nll.len().max(1) as f64;
            if mode == Mode::FullRecompute && full_logits.is_none() {
                full_logits = Some(logits.clone());
            }
            if let Some(f) = &full_logits {
                s.kl += kl_divergence(f, &logits);
            }
            let pred = tok.decode(&out.generated)?.trim().to_string();
            let ans = final_answer(&pred);
            let (em, f1) = (
                exact_match(ans, &item.answer) as u8 as f64,
                f1_score(ans, &item.answer),
            );
            let r = &mut reports[j];
            if item.hop >= 2 {
                r.n_two += 1;
                s.em2 += em;
                s.f12 += f1;
            } else {
                r.n_single += 1;
                s.em1 += em;
                s.f11 += f1;
            }
            r.predictions.push(pred);
        }
        progress(i + 1);
    }
    engine.clear();
    let d = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
    for (r, s) in reports.iter_mut().zip(&sums) {
        r.em_single = d(s.em1, r.n_single);
        r.f1_single = d(s.f11, r.n_single);
        r.em_two = d(s.em2, r.n_two);
        r.f1_two = d(s.f12, r.n_two);
        r.mean_ttft_ms = d(s.ttft, items.len());
        r.mean_tokens_computed = d(s.computed, items.len());
        r.mean_tokens_reused = d(s.reused, items.len());
        r.mean_answer_nll = d(s.nll, items.len());
        r.mean_first_token_kl = modes
            .contains(&Mode::FullRecompute)
            .then(|| d(s.kl, items.len()));
    }
    Ok(reports)
}

/// `KL(softmax(p) ‖ softmax(q))` in nats, computed in f64.
pub fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |x: &[f32]| -> Vec<f64> {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max + x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
        x.iter().map(|&v| v as f64 - lse).collect()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// One empty report per mode, labelled.
fn empty_reports(modes: &[Mode]) -> Vec<ModeReport> {
    modes
        .iter()
        .map(|m| ModeReport {
            label: mode_label(m),
            mode: Some(*m),
            ..Default::default()
        })
        .collect()
}

/// Body starts of the public-pool entries a segment after the first uses under
/// `modes` (the first segment always uses 0): the seam width for HYPIC, 0 for naive
/// addition; each start once, in order of first use.
fn later_body_starts(modes: &[Mode]) -> Vec<usize> {
    let mut starts: Vec<usize> = vec![];
    for m in modes {
        let b = match m {
            Mode::NaiveAddition => 0,
            Mode::Hypic { seam_width, .. } => *seam_width,
            _ => continue,
        };
        if !starts.contains(&b) {
            starts.push(b);
        }
    }
    starts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pic::PicEngine;
    use crate::sampling::argmax;
    use crate::scheduler::SchedulerConfig;
    use std::sync::Arc;

    /// The evaluation before it went through the scheduler: every request straight
    /// into the CPU engine ([`PicEngine::run`]), greedy decoding and the
    /// teacher-forced answer NLL with one `Model::decode` per token. Same protocol
    /// (pools, warm-up, mode order); no TTFT.
    fn direct_reference(
        engine: &PicEngine,
        tok: &Tokenizer,
        items: &[QaItem],
        modes: &[Mode],
        max_new: usize,
    ) -> Vec<ModeReport> {
        let mut reports = empty_reports(modes);
        let mut sums: Vec<Sums> = modes.iter().map(|_| Sums::default()).collect();
        let later_starts = later_body_starts(modes);
        let model = engine.model();
        for item in items {
            engine.clear();
            let segs = item_segments(tok, item, "eval").unwrap();
            let n = segs.len();
            if !later_starts.is_empty() {
                engine.prefetch_many(&segs[0].tokens, "eval", &[0]).unwrap();
                for s in &segs[1..n - 1] {
                    engine
                        .prefetch_many(&s.tokens, "eval", &later_starts)
                        .unwrap();
                }
            }
            let mut order: Vec<usize> = (0..modes.len()).collect();
            order.sort_by_key(|&j| modes[j] != Mode::FullRecompute);
            let mut full_logits: Option<Vec<f32>> = None;
            for j in order {
                let mode = modes[j];
                if mode == Mode::PrefixCache && n > 1 {
                    engine.run(&segs[..1], mode, "eval").unwrap();
                }
                let out = engine.run(&segs, mode, "eval").unwrap();
                let s = &mut sums[j];
                s.computed += out.stats.tokens_computed as f64;
                s.reused += out.stats.tokens_reused as f64;
                // Teacher-forced NLL of the reply + <|im_end|>.
                let mut target = tok.encode(&reply_text(item)).unwrap();
                target.push(tok.eos_ids[0]);
                let (mut st, mut logits, mut total) =
                    (out.state.clone(), out.logits.clone(), 0.0f64);
                for (k, &t) in target.iter().enumerate() {
                    total += token_nll_f64(&logits, t);
                    if k + 1 < target.len() {
                        logits = model.decode(t, &mut st).unwrap();
                    }
                }
                s.nll += total / target.len() as f64;
                if mode == Mode::FullRecompute && full_logits.is_none() {
                    full_logits = Some(out.logits.clone());
                }
                if let Some(f) = &full_logits {
                    s.kl += kl_divergence(f, &out.logits);
                }
                let mut state = out.state;
                let mut next = argmax(&out.logits);
                let mut gen = vec![];
                while gen.len() < max_new && !tok.eos_ids.contains(&next) {
                    gen.push(next);
                    if gen.len() == max_new {
                        break;
                    }
                    next = argmax(&model.decode(next, &mut state).unwrap());
                }
                let pred = tok.decode(&gen).unwrap().trim().to_string();
                let ans = final_answer(&pred);
                let (em, f1) = (
                    exact_match(ans, &item.answer) as u8 as f64,
                    f1_score(ans, &item.answer),
                );
                let r = &mut reports[j];
                if item.hop >= 2 {
                    r.n_two += 1;
                    s.em2 += em;
                    s.f12 += f1;
                } else {
                    r.n_single += 1;
                    s.em1 += em;
                    s.f11 += f1;
                }
                r.predictions.push(pred);
            }
        }
        engine.clear();
        let d = |x: f64, n: usize| if n == 0 { 0.0 } else { x / n as f64 };
        for (r, s) in reports.iter_mut().zip(&sums) {
            r.em_single = d(s.em1, r.n_single);
            r.f1_single = d(s.f11, r.n_single);
            r.em_two = d(s.em2, r.n_two);
            r.f1_two = d(s.f12, r.n_two);
            r.mean_tokens_computed = d(s.computed, items.len());
            r.mean_tokens_reused = d(s.reused, items.len());
            r.mean_answer_nll = d(s.nll, items.len());
            r.mean_first_token_kl = modes
                .contains(&Mode::FullRecompute)
                .then(|| d(s.kl, items.len()));
        }
        reports
    }

    /// `-log softmax(logits)[t]` in f64, written out as the evaluation did it.
    fn token_nll_f64(logits: &[f32], t: u32) -> f64 {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + logits
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        lse - logits[t as usize] as f64
    }

    /// `hypic eval` through the scheduler scores the bundled model exactly as the
    /// direct engine loop did, on single- and two-hop items in every kind of mode:
    /// the same predictions, exact match, F1, tokens computed and reused, answer NLL,
    /// first-token KL, and pool hit/miss counters, bit for bit (one request at a
    /// time: the scheduler's batched decode step runs with a batch of one, which
    /// computes what single-token decode does).
    #[test]
    fn evaluation_through_the_scheduler_equals_the_direct_engine() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny");
        let model = Arc::new(crate::model::Model::load(&dir, &mut |_, _| {}).unwrap());
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let all = load_items(&dir.join("eval/heldout.jsonl")).unwrap();
        let mut items: Vec<QaItem> = all.iter().filter(|i| i.hop == 1).take(2).cloned().collect();
        items.extend(all.iter().filter(|i| i.hop == 2).take(2).cloned());
        let modes = [
            Mode::FullRecompute,
            Mode::PrefixCache,
            Mode::NaiveAddition,
            Mode::Hypic {
                seam_width: 8,
                rope_fix: true,
            },
            Mode::Hypic {
                seam_width: 0,
                rope_fix: true,
            },
            Mode::Hypic {
                seam_width: 8,
                rope_fix: false,
            },
        ];
        let direct = PicEngine::new(model.clone(), "hypic-tiny", 1 << 30, 1 << 30);
        let want = direct_reference(&direct, &tok, &items, &modes, 24);
        let engine = Arc::new(PicEngine::new(model, "hypic-tiny", 1 << 30, 1 << 30));
        // Each prompt in one step, as the offline commands run it: entries built in
        // pieces agree with the direct path only to fp32 rounding.
        let cfg = SchedulerConfig {
            step_tokens: usize::MAX,
            prefill_chunk_tokens: usize::MAX,
            ..SchedulerConfig::default()
        };
        let sched = Scheduler::start(engine.clone(), cfg);
        let mut seen = vec![];
        let got = evaluate_modes(&sched, &tok, &items, &modes, 24, &mut |i| seen.push(i)).unwrap();
        assert_eq!(seen, (1..=items.len()).collect::<Vec<_>>());
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.label, w.label);
            assert_eq!(g.predictions, w.predictions, "{}", g.label);
            assert_eq!((g.n_single, g.n_two), (w.n_single, w.n_two));
            assert_eq!(
                (g.em_single, g.f1_single, g.em_two, g.f1_two),
                (w.em_single, w.f1_single, w.em_two, w.f1_two),
                "{}",
                g.label
            );
            assert_eq!(
                (g.mean_tokens_computed, g.mean_tokens_reused),
                (w.mean_tokens_computed, w.mean_tokens_reused),
                "{}",
                g.label
            );
            assert_eq!(g.mean_answer_nll, w.mean_answer_nll, "{}: NLL", g.label);
            assert_eq!(
                g.mean_first_token_kl, w.mean_first_token_kl,
                "{}: first-token KL",
                g.label
            );
            assert!(g.mean_first_token_kl.is_some());
            assert!(g.mean_ttft_ms > 0.0, "{}", g.label);
        }
        // The modes reuse: HYPIC computes fewer prompt tokens than full recompute.
        assert!(got[3].mean_tokens_computed < got[0].mean_tokens_computed);
        assert!(got
            .iter()
            .any(|r| r.predictions.iter().any(|p| !p.is_empty())));
        // Same pool traffic: hits, misses, inserts, evictions of both pools.
        assert_eq!(engine.public_usage().2, direct.public_usage().2);
        assert_eq!(engine.private_usage().2, direct.private_usage().2);
        assert!(engine.public_usage().2.hits > 0 && engine.private_usage().2.hits > 0);
        let e = evaluate_modes(&sched, &tok, &items[..1], &modes[..1], 0, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 1"), "{e}");
    }

    #[test]
    fn kl_divergence_values() {
        assert_eq!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), 0.0);
        // Shift invariance of the logits.
        assert!(kl_divergence(&[1.0, 2.0], &[11.0, 12.0]) < 1e-12);
        // p = (1/2, 1/2), q = (e/(1+e), 1/(1+e)), written out.
        let e = std::f64::consts::E;
        let want = 0.5 * (0.5f64 / (e / (1.0 + e))).ln() + 0.5 * (0.5f64 / (1.0 / (1.0 + e))).ln();
        assert!((kl_divergence(&[0.0, 0.0], &[1.0, 0.0]) - want).abs() < 1e-12);
    }

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
    fn merged_shards_weight_by_item_counts() {
        let rep = |label: &str, n1, n2, em1, em2, ttft, kl: Option<f64>, p: &[&str]| ModeReport {
            label: label.into(),
            n_single: n1,
            n_two: n2,
            em_single: em1,
            f1_single: em1,
            em_two: em2,
            f1_two: em2,
            mean_ttft_ms: ttft,
            mean_first_token_kl: kl,
            predictions: p.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        };
        let a = vec![rep(
            "full_recompute",
            1,
            3,
            1.0,
            1.0 / 3.0,
            10.0,
            Some(0.0),
            &["a"],
        )];
        let b = vec![rep(
            "full_recompute",
            3,
            1,
            2.0 / 3.0,
            0.0,
            20.0,
            Some(0.0),
            &["b", "c"],
        )];
        let m = merge_reports(&[a.clone(), b.clone()]).unwrap();
        assert_eq!((m[0].n_single, m[0].n_two), (4, 4));
        assert!((m[0].em_single - 0.75).abs() < 1e-12);
        assert!((m[0].em_two - 0.25).abs() < 1e-12);
        assert!((m[0].mean_ttft_ms - 15.0).abs() < 1e-12);
        assert_eq!(m[0].mean_first_token_kl, Some(0.0));
        assert_eq!(m[0].predictions, vec!["a", "b", "c"]);
        let c = vec![rep("hypic_w8", 1, 1, 1.0, 1.0, 1.0, None, &[])];
        let e = merge_reports(&[a.clone(), c]).unwrap_err().to_string();
        assert!(e.contains("full_recompute"), "{e}");
        let d = vec![rep("full_recompute", 1, 1, 1.0, 1.0, 1.0, None, &[])];
        assert_eq!(merge_reports(&[a, d]).unwrap()[0].mean_first_token_kl, None);
        assert!(merge_reports(&[]).is_err());
    }

    #[test]
    fn two_hop_replies_are_scored_on_the_answer_after_the_bridge() {
        assert_eq!(final_answer(" Stoumora Dynamics -> 1986 "), "1986");
        assert_eq!(final_answer("Kreitha 3"), "Kreitha 3");
        assert_eq!(final_answer("a -> b -> Joan Ralbyndov"), "Joan Ralbyndov");
        assert_eq!(final_answer("Xosfusora ->"), "");
        let mut item = QaItem {
            id: "x".into(),
            system: "s".into(),
            documents: vec![],
            question: "q?".into(),
            answer: "1986".into(),
            bridge: Some("Xosfusora".into()),
            hop: 2,
        };
        assert_eq!(reply_text(&item), "Xosfusora -> 1986");
        assert_eq!(final_answer(&reply_text(&item)), "1986");
        item.bridge = None;
        assert_eq!(reply_text(&item), "1986");
        let parsed: QaItem = serde_json::from_str(
            r#"{"system":"s","documents":["d"],"question":"q?","answer":"1946","hop":1}"#,
        )
        .unwrap();
        assert_eq!(parsed.bridge, None);
    }

    #[test]
    fn segments_concatenate_to_the_chatml_prompt() {
        let item = QaItem {
            id: "x".into(),
            system: "S".into(),
            documents: vec!["D1".into(), "D2".into()],
            question: "Q?".into(),
            answer: "A".into(),
            bridge: None,
            hop: 1,
        };
        assert_eq!(
            segment_texts(&item).concat(),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nD1\n\nD2\n\nQuestion: Q?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
