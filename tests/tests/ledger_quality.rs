//! Issue 23 quality check on the second eval model, `models/hypic-ledger` (CPU): a
//! slice of its held-out overwrite-recall prompts through full recompute, HYPIC
//! (w = 8) and naive addition (HYPIC with the transitions off).
//!
//! On this model the answer depends on the recurrent state carried across documents
//! (the last write to a box wins, and only the composed state knows which write came
//! last), so the modes separate at the answer level, unlike on hypic-tiny
//! (`qa_quality.rs`). Asserts, on the first `HYPIC_LEDGER_N` held-out prompts
//! (default 50; hop 1 and hop 2 alternate in the file, so half of each):
//! - full recompute answers at least 90 % of them (the model is loaded and sane);
//! - naive addition is worse than full recompute at the answer level: at least
//!   `NAIVE_MIN_GAP` of the slice lower in exact match, and lower on hop 2 alone;
//! - HYPIC (w = 8) is at most 2 points of exact match below full recompute. On 50
//!   prompts one item is 2 points, so one more miss than full recompute passes and two
//!   fail.
//!
//! `ledger_state_error_per_layer` (ignored; `cargo test -p hypic-e2e --test
//! ledger_quality -- --ignored --nocapture`) prints the relative error of each linear
//! layer's recurrent state against full recompute after the documents, for HYPIC w = 8,
//! w = 0 and naive addition (the paper's Table 4 analogue).
use dataplane::eval::{evaluate_modes, item_segments, load_items, ModeReport, QaItem};
use dataplane::model::Model;
use dataplane::pic::{Mode, PicEngine};
use dataplane::scheduler::{Scheduler, SchedulerConfig};
use dataplane::state::{LayerState, ModelState};
use dataplane::tokenizer::Tokenizer;
use std::path::PathBuf;
use std::sync::Arc;

/// Smallest exact-match gap (fraction of the slice) by which naive addition must
/// trail full recompute.
const NAIVE_MIN_GAP: f64 = 0.15;

/// Largest exact-match drop of HYPIC (w = 8) below full recompute (issue 23: 2 points).
const HYPIC_MAX_DROP: f64 = 0.02;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-ledger")
}

fn load(n: usize) -> (Arc<PicEngine>, Tokenizer, Vec<QaItem>) {
    let dir = model_dir();
    let mut items = load_items(&dir.join("eval/heldout.jsonl")).unwrap();
    items.truncate(n);
    assert_eq!(items.len(), n);
    let model = Model::load(&dir, &mut |_, _| {}).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let engine = Arc::new(PicEngine::new(
        Arc::new(model),
        "hypic-ledger",
        1 << 30,
        1 << 30,
    ));
    (engine, tok, items)
}

/// Number of right answers over both hops.
fn correct(r: &ModeReport) -> usize {
    (r.em_single * r.n_single as f64 + r.em_two * r.n_two as f64).round() as usize
}

#[test]
fn ledger_naive_addition_loses_answers_hypic_does_not() {
    let n: usize = env_or("HYPIC_LEDGER_N", 50);
    let (engine, tok, items) = load(n);
    // `hypic eval`'s path: every request through the scheduler over the engine.
    let sched = Scheduler::start(engine, SchedulerConfig::default());
    let modes = [
        Mode::FullRecompute,
        Mode::hypic_default(),
        Mode::NaiveAddition,
    ];
    let r = evaluate_modes(&sched, &tok, &items, &modes, 12, &mut |_| {}).unwrap();
    for x in &r {
        eprintln!(
            "{:>16}: EM hop 1 {:.3} hop 2 {:.3} ({}/{n}) answer NLL {:.4} computed {:.0}",
            x.label,
            x.em_single,
            x.em_two,
            correct(x),
            x.mean_answer_nll,
            x.mean_tokens_computed
        );
    }
    let (full, hypic, naive) = (&r[0], &r[1], &r[2]);
    let (c_full, c_hypic, c_naive) = (correct(full), correct(hypic), correct(naive));
    assert!(
        c_full as f64 >= 0.9 * n as f64,
        "full recompute answers {c_full}/{n}"
    );
    // Naive addition must stay clearly worse: transitions that stopped mattering (or
    // a naive mode that silently composes correctly) fail here.
    let gap = (NAIVE_MIN_GAP * n as f64).ceil() as usize;
    assert!(
        c_naive + gap <= c_full,
        "naive addition {c_naive}/{n} is not {gap} answers below full recompute {c_full}/{n}"
    );
    assert!(
        naive.em_two < full.em_two,
        "naive addition hop 2 EM {} is not below full recompute's {}",
        naive.em_two,
        full.em_two
    );
    // HYPIC at most 2 points below full recompute (counted in answers, no float edge).
    let allowed = (HYPIC_MAX_DROP * n as f64 + 1e-9).floor() as usize;
    assert!(
        c_hypic + allowed >= c_full,
        "hypic w=8 {c_hypic}/{n} is more than {allowed} answers below full recompute {c_full}/{n}"
    );
    assert!(hypic.mean_tokens_computed < 0.5 * full.mean_tokens_computed);
}

/// Relative L2 distance `‖a − b‖ / ‖b‖` of each linear layer's recurrent state
/// (`None` for attention layers).
fn state_rel_per_layer(a: &ModelState, b: &ModelState) -> Vec<Option<f64>> {
    a.layers
        .iter()
        .zip(&b.layers)
        .map(|(x, y)| match (x, y) {
            (LayerState::Linear(x), LayerState::Linear(y)) => {
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for (p, q) in x.recurrent.iter().zip(&y.recurrent) {
                    num += ((p - q) as f64).powi(2);
                    den += (*q as f64).powi(2);
                }
                Some((num / den.max(1e-30)).sqrt())
            }
            _ => None,
        })
        .collect()
}

#[test]
#[ignore = "prints the per-layer state-error table; run with --ignored --nocapture"]
fn ledger_state_error_per_layer() {
    let k: usize = env_or("HYPIC_LEDGER_STATE_N", 32);
    let (engine, tok, items) = load(k);
    let modes = [
        ("hypic w=8", Mode::hypic_default()),
        (
            "hypic w=0",
            Mode::Hypic {
                seam_width: 0,
                rope_fix: true,
            },
        ),
        ("naive", Mode::NaiveAddition),
    ];
    // As in qa_quality.rs: compose the system prompt and the documents, end with a
    // one-token segment (the question's first token; the final segment is always
    // computed) and compare the linear layers' recurrent states with full recompute's.
    let mut sums: Vec<Vec<f64>> = vec![];
    let mut by_hop = [[0.0f64; 3]; 2]; // [hop-1][mode]: whole-model error, summed
    let mut n_hop = [0usize; 2];
    for item in &items {
        let segs = item_segments(&tok, item, "eval").unwrap();
        let mut docs = segs[..segs.len() - 1].to_vec();
        let mut last = segs[segs.len() - 1].clone();
        last.tokens.truncate(1);
        docs.push(last);
        engine.clear();
        let full = engine.run(&docs, Mode::FullRecompute, "t").unwrap().state;
        let h = (item.hop.clamp(1, 2) - 1) as usize;
        n_hop[h] += 1;
        for (j, (_, m)) in modes.iter().enumerate() {
            engine.run(&docs, *m, "t").unwrap(); // fill the pools
            let s = engine.run(&docs, *m, "t").unwrap().state;
            let per = state_rel_per_layer(&s, &full);
            if sums.len() <= j {
                sums.push(vec![0.0; per.len()]);
            }
            for (acc, e) in sums[j].iter_mut().zip(&per) {
                *acc += e.unwrap_or(f64::NAN) / k as f64;
            }
            // Whole-model error over the linear layers (as qa_quality.rs's state_rel).
            let (mut num, mut den) = (0.0f64, 0.0f64);
            for (x, y) in s.layers.iter().zip(&full.layers) {
                if let (LayerState::Linear(x), LayerState::Linear(y)) = (x, y) {
                    for (p, q) in x.recurrent.iter().zip(&y.recurrent) {
                        num += ((p - q) as f64).powi(2);
                        den += (*q as f64).powi(2);
                    }
                }
            }
            by_hop[h][j] += (num / den.max(1e-30)).sqrt();
        }
    }
    println!("mean relative error of the recurrent state vs full recompute, {k} prompts");
    println!("| layer | {} |", modes.map(|(l, _)| l).join(" | "));
    println!("|---|{}", "---|".repeat(modes.len()));
    for l in 0..sums[0].len() {
        if sums[0][l].is_nan() {
            continue; // attention layer
        }
        let cells: Vec<String> = sums.iter().map(|s| format!("{:.4}", s[l])).collect();
        println!("| {l} | {} |", cells.join(" | "));
    }
    for (h, n) in n_hop.iter().enumerate() {
        let cells: Vec<String> = by_hop[h]
            .iter()
            .map(|e| format!("{:.4}", e / (*n).max(1) as f64))
            .collect();
        println!(
            "| all linear, hop {} ({n}) | {} |",
            h + 1,
            cells.join(" | ")
        );
    }
    // The transitions matter: HYPIC's state is much closer to full recompute's.
    let last = (0..sums[0].len()).rfind(|&l| !sums[0][l].is_nan());
    let l = last.expect("a linear layer");
    assert!(sums[0][l] < 0.5 * sums[2][l]);
}
