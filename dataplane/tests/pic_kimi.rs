//! Position-independent caching for Kimi-Linear (KDA + MLA NoPE) on the CPU
//! backend, on the transformers golden model: layer-0 composition, prefix cache,
//! HYPIC with covering seams, and every mode. KDA's transitions are dense
//! (`Family::KimiDelta`); MLA keys carry no RoPE, so nothing is re-rotated.
use dataplane::model::Model;
use dataplane::pic::engine::PREFILL_ALIGN;
use dataplane::pic::{Mode, Outcome, PicEngine, SegmentRef};
use dataplane::sampling::argmax;
use dataplane::state::{LayerState, ModelState};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;

const KIMI: &str = "kimi_linear";

fn engine() -> PicEngine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(KIMI);
    let m = Model::load(&dir, &mut |_, _| {}).unwrap();
    PicEngine::new(Arc::new(m), KIMI, 1 << 30, 1 << 30)
}

fn seg(rng: &mut StdRng, len: usize, vocab: u32) -> SegmentRef {
    SegmentRef {
        tokens: (0..len).map(|_| rng.random_range(0..vocab)).collect(),
        isolation: "t".into(),
    }
}

/// System prompt, `docs` documents of varied length (across the 16-token and
/// 64-token path edges), and a query.
fn prompt(seed: u64, docs: usize) -> Vec<SegmentRef> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut v = vec![seg(&mut rng, 24, 128)];
    for _ in 0..docs {
        let len = rng.random_range(12..90);
        v.push(seg(&mut rng, len, 128));
    }
    v.push(seg(&mut rng, 10, 128));
    v
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    num / den.max(1e-30)
}

fn layer0(st: &ModelState) -> &[f32] {
    match &st.layers[0] {
        LayerState::Linear(s) => &s.recurrent,
        _ => panic!("layer 0 is a KDA layer"),
    }
}

/// Layer 0's inputs never depend on the prefix; with a seam of at least K−1 = 3
/// tokens the conv boundary is recomputed too, so the composed layer-0 state equals
/// full recompute to fp32 rounding. With no seam the conv window crosses the cached
/// boundary and the state differs.
#[test]
fn kimi_layer0_composition_matches_full_recompute() {
    // A fresh engine per run: a repeated prompt would otherwise be served whole from
    // the exact prefix snapshots of the previous run.
    let hypic = |p: &[SegmentRef], w: usize| {
        engine()
            .run(
                p,
                Mode::Hypic {
                    seam_width: w,
                    rope_fix: true,
                },
                "t",
            )
            .unwrap()
    };
    for seed in 10..13 {
        let p = prompt(seed, 5);
        let full = engine().run(&p, Mode::FullRecompute, "t").unwrap();
        for w in [3usize, 8] {
            let h = hypic(&p, w);
            assert!(h.stats.misses > 0);
            let r = rel(layer0(&h.state), layer0(&full.state));
            assert!(r <= 1e-5, "seed {seed} w {w}: layer-0 rel err {r}");
            assert!(h.logits.iter().all(|v| v.is_finite()));
        }
        let h = hypic(&p, 0);
        let r = rel(layer0(&h.state), layer0(&full.state));
        assert!(
            r > 1e-4,
            "seed {seed}: w = 0 must cut the conv window ({r})"
        );
    }
}

#[test]
fn kimi_prefix_cache_is_bit_identical_to_full_recompute() {
    let e = engine();
    let p = prompt(1, 4);
    let full = e.run(&p, Mode::FullRecompute, "t").unwrap();
    let cold = e.run(&p, Mode::PrefixCache, "t").unwrap();
    assert_eq!(cold.logits, full.logits);
    let mut p2 = p.clone();
    *p2.last_mut().unwrap() = prompt(2, 0).pop().unwrap();
    let full2 = e.run(&p2, Mode::FullRecompute, "t").unwrap();
    let hot = e.run(&p2, Mode::PrefixCache, "t").unwrap();
    assert_eq!(hot.logits, full2.logits);
    assert_eq!(hot.state, full2.state);
    assert_eq!(hot.stats.hits, p2.len() - 1);
    assert!(hot.stats.segments[..p2.len() - 1]
        .iter()
        .all(|s| s.outcome == Outcome::PrefixHit));
}

#[test]
fn kimi_hypic_with_covering_seams_equals_full_recompute() {
    let e = engine();
    let p = prompt(4, 4);
    let full = e.run(&p, Mode::FullRecompute, "t").unwrap();
    let mode = Mode::Hypic {
        seam_width: 1000,
        rope_fix: true,
    };
    // Cold, then from cached entries (a warm run composes identity bodies).
    for pass in 0..2 {
        let h = e.run(&p, mode, "t").unwrap();
        let r = rel(&h.logits, &full.logits);
        assert!(r < 1e-5, "pass {pass}: rel diff {r}");
        assert_eq!(argmax(&h.logits), argmax(&full.logits));
        assert_eq!(h.state.next_position, full.state.next_position);
    }
}

/// Every mode runs: naive addition (finite, further from full recompute than
/// HYPIC), HYPIC at the default seam cold and warm (the warm run reuses every
/// cached segment and gives the cold run's logits), with and without `rope_fix`
/// (identical: nothing in Kimi-Linear carries RoPE).
#[test]
fn kimi_every_mode_runs_and_hypic_is_closer_than_naive() {
    let e = engine();
    let (mut d_h, mut d_n) = (0.0, 0.0);
    for seed in 20..24 {
        let p = prompt(seed, 3);
        let full = e.run(&p, Mode::FullRecompute, "t").unwrap();
        let n = e.run(&p, Mode::NaiveAddition, "t").unwrap();
        let cold = e.run(&p, Mode::hypic_default(), "t").unwrap();
        let warm = e.run(&p, Mode::hypic_default(), "t").unwrap();
        assert!(n.logits.iter().all(|v| v.is_finite()));
        assert!(warm.stats.hits >= p.len() - 1, "{:?}", warm.stats.hits);
        assert_eq!(warm.logits, cold.logits);
        let no_fix = e
            .run(
                &p,
                Mode::Hypic {
                    seam_width: 8,
                    rope_fix: false,
                },
                "t",
            )
            .unwrap();
        assert_eq!(no_fix.logits, cold.logits);
        d_n += rel(&n.logits, &full.logits);
        d_h += rel(&cold.logits, &full.logits);
    }
    assert!(d_h < d_n, "hypic {d_h} not closer than naive {d_n}");
    assert!(d_h > 0.0);
}

/// `max |a − b| / max(max |a|, 1e-30)`.
fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// The scheduler's token-budget path: HYPIC with cold segments built in pieces of
/// `PREFILL_ALIGN` tokens (KDA pairs composed across pieces, MLA rows appended per
/// piece) gives the one-call result to fp32 rounding, and a second request hits
/// every entry the pieces stored.
#[test]
fn kimi_entries_built_in_pieces_match_the_one_shot_path() {
    let e = engine();
    let mut rng = StdRng::seed_from_u64(31);
    let segs: Vec<SegmentRef> = [30usize, 200, 9, 150, 17]
        .iter()
        .map(|&l| seg(&mut rng, l, 128))
        .collect();
    let mode = Mode::hypic_default();
    let whole = e.run(&segs, mode, "w").unwrap();
    e.clear();
    let run = |tenant: &str| {
        let mut job = e.begin(segs.clone(), mode, tenant).unwrap();
        let mut calls = vec![];
        while !job.is_done() {
            calls.push(e.advance(&mut job, PREFILL_ALIGN, true).unwrap());
            assert!(calls.len() < 1000, "no progress");
        }
        (job.take_output().unwrap(), calls)
    };
    let (pieces, calls) = run("c");
    assert!(
        calls.len() > 5 && calls.iter().all(|&c| c <= PREFILL_ALIGN),
        "{calls:?}"
    );
    assert_eq!(whole.stats, pieces.stats);
    assert!(pieces.stats.misses >= 3, "{:?}", pieces.stats);
    let dl = max_rel(&whole.logits, &pieces.logits);
    assert!(dl <= 5e-5, "logits rel err {dl:e}");
    for (x, y) in whole.state.layers.iter().zip(&pieces.state.layers) {
        match (x, y) {
            (LayerState::Linear(a), LayerState::Linear(b)) => {
                let d = max_rel(&a.recurrent, &b.recurrent);
                assert!(d <= 5e-5, "KDA state rel err {d:e}");
            }
            (LayerState::Full(a), LayerState::Full(b)) => {
                assert_eq!(a.positions, b.positions);
                let d = max_rel(&a.k, &b.k);
                assert!(d <= 5e-5, "MLA rows rel err {d:e}");
            }
            _ => panic!("layer kinds differ"),
        }
    }
    let (warm, _) = run("c2");
    assert_eq!(warm.stats.misses, 0, "{:?}", warm.stats);
    let dl = max_rel(&whole.logits, &warm.logits);
    assert!(dl <= 5e-5, "warm logits rel err {dl:e}");
}
