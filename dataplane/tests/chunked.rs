//! Resumable prompt processing (the scheduler's token-budget loop): a prompt
//! advanced in pieces ([`Pic::begin`], [`Pic::advance`]) against the one-call
//! [`Pic::run`], and a cache entry built in pieces against the one-shot build.
//!
//! Nothing here is bit-identical, and the tolerance ([`TOL`], relative to the
//! largest magnitude of each compared tensor) says how far fp32 rounding goes:
//! * computed segments prefilled in pieces that are multiples of
//!   [`PREFILL_ALIGN`] (the GDN chunk length) keep the GDN chunk boundaries, but
//!   the projections, MLPs and attention run at other row counts (the matrix
//!   products block their sums differently, and a piece's queries read the earlier
//!   pieces' keys from the KV cache), so logits and states differ in the last bits;
//! * an entry built in pieces also composes each linear layer's pairs across
//!   pieces, `(T₂T₁, T₂S₁ + S₂)`, where the one-shot build gets `T_body` from one
//!   pass and `S_body|0 = S_T − T_body·S_w`: the same quantities summed in another
//!   order.
use dataplane::linear::transition::Pair;
use dataplane::model::Model;
use dataplane::pic::engine::{EntryLayer, SegmentEntry, PREFILL_ALIGN};
use dataplane::pic::{Mode, PicBackend, PicEngine, SegmentRef};
use dataplane::state::{LayerState, ModelState};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;

/// Relative tolerance (to the largest magnitude) of a prompt or an entry run in
/// pieces against one call.
const TOL: f32 = 5e-5;

fn engine(name: &str) -> PicEngine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(name);
    let m = Model::load(&dir, &mut |_, _| {}).unwrap();
    PicEngine::new(Arc::new(m), name, 1 << 30, 1 << 30)
}

fn tokens(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(0..317)).collect()
}

fn seg(seed: u64, len: usize) -> SegmentRef {
    SegmentRef {
        tokens: tokens(seed, len),
        isolation: "t".into(),
    }
}

/// `max |a − b| / max(max |a|, 1e-30)`.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn pair_rel(a: &Pair, b: &Pair) -> (f32, f32) {
    assert_eq!(a.kind(), b.kind());
    (rel(a.t(), b.t()), rel(a.b(), b.b()))
}

/// Entries built in pieces `pieces` (lengths) against the one-shot build: pairs to
/// `tol` relative, conv tails and KV bit for bit. Returns the largest relative
/// difference of the pairs.
fn compare_entries(
    e: &PicEngine,
    toks: &[u32],
    starts: &[usize],
    pieces: &[usize],
    tol: f32,
) -> f32 {
    let be = e.pic_backend();
    let whole: Vec<SegmentEntry> = be
        .build_entries(toks, starts, &vec![true; starts.len()])
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    let mut b = be
        .build_entries_start(toks, starts)
        .unwrap()
        .expect("CPU builds in pieces");
    let mut at = 0;
    for &p in pieces {
        be.build_entries_continue(&mut *b, toks, at, at + p)
            .unwrap();
        at += p;
    }
    assert_eq!(at, toks.len());
    let chunked: Vec<SegmentEntry> = be
        .build_entries_finish(b, toks)
        .unwrap()
        .into_iter()
        .map(Option::unwrap)
        .collect();
    let mut worst = 0f32;
    for (w, c) in whole.iter().zip(&chunked) {
        assert_eq!((w.body_start, w.len), (c.body_start, c.len));
        for (i, (lw, lc)) in w.layers.iter().zip(&c.layers).enumerate() {
            match (lw, lc) {
                (
                    EntryLayer::Linear {
                        pair: pw,
                        conv_tail: cw,
                    },
                    EntryLayer::Linear {
                        pair: pc,
                        conv_tail: cc,
                    },
                ) => {
                    let dc = rel(cw, cc);
                    assert!(dc <= tol, "layer {i}: conv tail {dc:e}");
                    worst = worst.max(dc);
                    let (dt, db) = pair_rel(pw, pc);
                    assert!(
                        dt <= tol && db <= tol,
                        "layer {i} body from {}: T {dt:e}, S {db:e} over {tol:e}",
                        w.body_start
                    );
                    worst = worst.max(dt).max(db);
                }
                (EntryLayer::Full { k: kw, v: vw }, EntryLayer::Full { k: kc, v: vc }) => {
                    let (dk, dv) = (rel(kw, kc), rel(vw, vc));
                    assert!(dk <= tol && dv <= tol, "layer {i}: body KV {dk:e} {dv:e}");
                    worst = worst.max(dk).max(dv);
                }
                _ => panic!("layer {i}: kinds differ"),
            }
        }
    }
    worst
}

/// A long cold segment's entries (both roles, whole and body from the seam width)
/// built across pieces equal the one-shot build: pairs to fp32 rounding, conv tails
/// and KV exactly; pieces that split the seam window and ragged pieces included.
#[test]
fn an_entry_built_in_pieces_equals_the_one_shot_build() {
    for name in ["qwen3_5", "qwen3_next"] {
        let e = engine(name);
        let toks = tokens(7, 300);
        let a = PREFILL_ALIGN;
        let worst = [
            vec![a, a, a, a, 300 - 4 * a],
            vec![3, 61, 2 * a, 300 - 64 - 2 * a],
            vec![300],
        ]
        .iter()
        .map(|p| compare_entries(&e, &toks, &[0, 8], p, TOL))
        .fold(0f32, f32::max);
        println!("{name}: entries in pieces vs one shot: {worst:e}");
        assert!(worst.is_finite(), "{name}");
    }
}

fn max_rel_state(a: &ModelState, b: &ModelState) -> f32 {
    let mut worst = 0f32;
    for (la, lb) in a.layers.iter().zip(&b.layers) {
        match (la, lb) {
            (LayerState::Linear(x), LayerState::Linear(y)) => {
                worst = worst.max(rel(&x.recurrent, &y.recurrent));
                worst = worst.max(rel(&x.conv, &y.conv));
            }
            (LayerState::Full(x), LayerState::Full(y)) => {
                worst = worst.max(rel(&x.k, &y.k)).max(rel(&x.v, &y.v));
            }
            _ => panic!("kinds differ"),
        }
    }
    worst
}

/// Runs `segs` through `begin`/`advance` with `budget` tokens a call; returns the
/// output and the tokens each call ran.
fn run_in_pieces(
    e: &PicEngine,
    segs: &[SegmentRef],
    mode: Mode,
    tenant: &str,
    budget: usize,
) -> (dataplane::pic::PicOutput, Vec<usize>) {
    let mut job = e.begin(segs.to_vec(), mode, tenant).unwrap();
    let mut calls = vec![];
    while !job.is_done() {
        calls.push(e.advance(&mut job, budget, true).unwrap());
        assert!(calls.len() < 10_000, "no progress");
    }
    (job.take_output().unwrap(), calls)
}

/// Full recompute and prefix cache in pieces of `PREFILL_ALIGN` multiples: the same
/// statistics as one call, logits and state to [`TOL`]; no call runs more than its
/// budget.
#[test]
fn computed_segments_in_aligned_pieces_match_one_call() {
    let e = engine("qwen3_5");
    let segs = vec![seg(1, 40), seg(2, 333), seg(3, 21)];
    for mode in [Mode::FullRecompute, Mode::PrefixCache] {
        e.clear();
        let whole = e.run(&segs, mode, "w").unwrap();
        e.clear();
        let (chunked, calls) = run_in_pieces(&e, &segs, mode, "c", 2 * PREFILL_ALIGN);
        assert!(calls.len() >= 4, "{calls:?}");
        assert!(calls.iter().all(|&c| c <= 2 * PREFILL_ALIGN), "{calls:?}");
        assert_eq!(calls.iter().sum::<usize>(), 394);
        let (dl, ds) = (
            rel(&whole.logits, &chunked.logits),
            max_rel_state(&whole.state, &chunked.state),
        );
        println!("{mode:?}: logits {dl:e}, state {ds:e}");
        assert!(
            dl <= TOL && ds <= TOL,
            "{mode:?}: logits {dl:e}, state {ds:e}"
        );
        assert_eq!(whole.stats, chunked.stats, "{mode:?}");
    }
}

/// HYPIC with cold segments built in pieces: the same outcomes, reasons and token
/// counts as one call; logits and states to fp32 rounding (the pairs are composed
/// across pieces); a second request then hits the entries the pieces stored, and
/// equals the same request served from one-shot entries to the same rounding.
#[test]
fn hypic_cold_segments_built_in_pieces_match_the_one_shot_path() {
    let e = engine("qwen3_5");
    let segs = vec![
        seg(11, 30),
        seg(12, 260),
        seg(13, 9),
        seg(14, 150),
        seg(15, 17),
    ];
    let mode = Mode::hypic_default();
    let whole = e.run(&segs, mode, "w").unwrap();
    e.clear();
    let (chunked, calls) = run_in_pieces(&e, &segs, mode, "c", PREFILL_ALIGN);
    assert!(calls.iter().all(|&c| c <= PREFILL_ALIGN), "{calls:?}");
    assert_eq!(whole.stats, chunked.stats);
    assert!(chunked.stats.misses >= 3, "{:?}", chunked.stats);
    let dl = rel(&whole.logits, &chunked.logits);
    let ds = max_rel_state(&whole.state, &chunked.state);
    println!("hypic cold: logits {dl:e}, state {ds:e}");
    assert!(dl <= TOL && ds <= TOL, "logits {dl:e}, state {ds:e}");
    // Warm: every cached segment hits the entries built in pieces.
    let (warm, _) = run_in_pieces(&e, &segs, mode, "c2", PREFILL_ALIGN);
    assert_eq!(warm.stats.misses, 0, "{:?}", warm.stats);
    let dl = rel(&whole.logits, &warm.logits);
    println!("hypic warm: logits {dl:e}");
    assert!(dl <= TOL, "warm logits {dl:e}");
}

/// A budget of one token still makes progress (one aligned piece a call), and
/// without `progress` a call over a piece larger than its budget does nothing.
#[test]
fn a_tiny_budget_progresses_one_piece_per_call() {
    let e = engine("qwen3_5");
    let segs = vec![seg(21, 200)];
    let mut job = e.begin(segs.clone(), Mode::FullRecompute, "t").unwrap();
    assert_eq!(e.advance(&mut job, 10, false).unwrap(), 0);
    let mut calls = vec![];
    while !job.is_done() {
        calls.push(e.advance(&mut job, 1, true).unwrap());
    }
    assert_eq!(calls, vec![64, 64, 64, 8]);
    let out = job.take_output().unwrap();
    let whole = e.run(&segs, Mode::FullRecompute, "t").unwrap();
    assert!(rel(&whole.logits, &out.logits) <= TOL);
}

/// Several requests' computed pieces in one batched forward
/// ([`PicEngine::advance_computed_many`]): a full-recompute, a prefix-cache and a
/// HYPIC request (whose query follows a composed run) advanced together, each
/// step's computed pieces batched, give each request's logits and state to [`TOL`]
/// of that request served alone, with the same statistics, for every golden family;
/// and at least one step batched two or more requests.
#[test]
fn requests_prefilled_in_one_batched_forward_match_each_alone() {
    for name in [
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "bailing_moe_linear",
        "kimi_linear",
    ] {
        let e = engine(name);
        // Token ids below every fixture's vocabulary (the smallest is 128).
        let seg_in = |seed: u64, len: usize| SegmentRef {
            tokens: tokens(seed, len).into_iter().map(|t| t % 128).collect(),
            isolation: "t".into(),
        };
        let reqs: Vec<(Vec<SegmentRef>, Mode, &str)> = vec![
            (
                vec![seg_in(31, 40), seg_in(32, 150)],
                Mode::FullRecompute,
                "a",
            ),
            (vec![seg_in(33, 70)], Mode::PrefixCache, "b"),
            (
                vec![seg_in(34, 30), seg_in(35, 120), seg_in(36, 19)],
                Mode::hypic_default(),
                "c",
            ),
        ];
        let alone: Vec<_> = reqs
            .iter()
            .map(|(s, m, t)| {
                e.clear();
                e.run(s, *m, t).unwrap()
            })
            .collect();
        e.clear();
        let mut jobs: Vec<_> = reqs
            .iter()
            .map(|(s, m, t)| e.begin(s.clone(), *m, t).unwrap())
            .collect();
        let budget = 2 * PREFILL_ALIGN;
        let (mut batched_steps, mut steps) = (0, 0);
        while jobs.iter().any(|j| !j.is_done()) {
            steps += 1;
            assert!(steps < 1000, "{name}: no progress");
            let mut batch = vec![];
            for (j, job) in jobs.iter_mut().enumerate() {
                if job.is_done() {
                    continue;
                }
                assert_eq!(
                    e.advance(job, 0, false).unwrap(),
                    0,
                    "{name}: lookups ran tokens"
                );
                match e.computed_piece(job, budget, true) {
                    Some(n) => batch.push((j, n)),
                    None => {
                        e.advance(job, budget, true).unwrap();
                    }
                }
            }
            if batch.len() > 1 {
                batched_steps += 1;
            }
            let pieces: Vec<usize> = batch.iter().map(|b| b.1).collect();
            let mut refs: Vec<_> = jobs
                .iter_mut()
                .enumerate()
                .filter(|(j, _)| batch.iter().any(|b| b.0 == *j))
                .map(|(_, job)| job)
                .collect();
            e.advance_computed_many(&mut refs, &pieces).unwrap();
        }
        assert!(batched_steps >= 1, "{name}: no step batched two requests");
        for (j, (job, one)) in jobs.iter_mut().zip(&alone).enumerate() {
            let out = job.take_output().unwrap();
            let (dl, ds) = (
                rel(&one.logits, &out.logits),
                max_rel_state(&one.state, &out.state),
            );
            println!("{name} request {j}: batched vs alone: logits {dl:e}, state {ds:e}");
            assert!(
                dl <= TOL && ds <= TOL,
                "{name} request {j}: logits {dl:e}, state {ds:e}"
            );
            assert_eq!(one.stats, out.stats, "{name} request {j}");
        }
        // A job not at a computed segment is refused, nothing run.
        let mut job = e
            .begin(vec![seg_in(37, 20)], Mode::FullRecompute, "d")
            .unwrap();
        let err = e.advance_computed_many(&mut [&mut job], &[5]).unwrap_err();
        assert!(
            err.to_string().contains("not at a computed segment"),
            "{err}"
        );
        e.advance(&mut job, 0, false).unwrap();
        let err = e.advance_computed_many(&mut [&mut job], &[21]).unwrap_err();
        assert!(err.to_string().contains("21 tokens"), "{err}");
    }
}
