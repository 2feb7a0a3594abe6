//! Position-independent caching for Ring-linear-2.0 (Lightning attention + full
//! attention) on the CPU backend, on the mlx-lm golden model: every mode, and the
//! RoPE re-rotation of cached Lightning states (the state of a segment cached at
//! position 0 moved to offset `b` by `R(b)` on its key axis).
use dataplane::model::Model;
use dataplane::pic::{Mode, Outcome, PicEngine, SegmentRef};
use dataplane::sampling::argmax;
use dataplane::state::{LayerState, ModelState};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;

const RING: &str = "bailing_moe_linear";

fn engine() -> PicEngine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(RING);
    let m = Model::load(&dir, &mut |_, _| {}).unwrap();
    PicEngine::new(Arc::new(m), RING, 1 << 30, 1 << 30)
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
        _ => panic!("layer 0 is a Lightning layer"),
    }
}

#[test]
fn ring_prefix_cache_is_bit_identical_to_full_recompute() {
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
fn ring_hypic_with_covering_seams_equals_full_recompute() {
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
    }
}

/// Layer 0's inputs never depend on the prefix, so with the state rotation the
/// composed layer-0 state equals full recompute to fp32 rounding, for every seam
/// width (0 included: no token of a cached segment is recomputed).
#[test]
fn ring_layer0_composition_matches_full_recompute() {
    let e = engine();
    for seed in 10..13 {
        let p = prompt(seed, 5);
        let full = e.run(&p, Mode::FullRecompute, "t").unwrap();
        for w in [0usize, 8] {
            let h = e
                .run(
                    &p,
                    Mode::Hypic {
                        seam_width: w,
                        rope_fix: true,
                    },
                    "t",
                )
                .unwrap();
            let r = rel(layer0(&h.state), layer0(&full.state));
            assert!(r <= 1e-5, "seed {seed} w {w}: layer-0 rel err {r}");
            assert!(h.logits.iter().all(|v| v.is_finite()));
        }
    }
}

/// A segment cached at position 0 and composed at offset b: with the state rotated
/// by R(b) it equals the in-place state at layer 0; without the rotation it does not.
#[test]
fn ring_cached_state_needs_the_rope_rotation() {
    let e = engine();
    let p = prompt(7, 3);
    let full = e.run(&p, Mode::FullRecompute, "t").unwrap();
    let with = e
        .run(
            &p,
            Mode::Hypic {
                seam_width: 0,
                rope_fix: true,
            },
            "t",
        )
        .unwrap();
    let without = e
        .run(
            &p,
            Mode::Hypic {
                seam_width: 0,
                rope_fix: false,
            },
            "t",
        )
        .unwrap();
    assert!(with.stats.misses > 0);
    let r_with = rel(layer0(&with.state), layer0(&full.state));
    let r_without = rel(layer0(&without.state), layer0(&full.state));
    assert!(r_with <= 1e-5, "rotated: rel err {r_with}");
    assert!(
        r_without > 1e-3,
        "unrotated: rel err {r_without} (must differ)"
    );
}

/// Naive addition runs (finite, every segment but the query from the cache) and is
/// further from full recompute than HYPIC.
#[test]
fn ring_naive_addition_runs_and_hypic_is_closer() {
    let e = engine();
    let (mut d_h, mut d_n) = (0.0, 0.0);
    for seed in 20..24 {
        let p = prompt(seed, 3);
        let full = e.run(&p, Mode::FullRecompute, "t").unwrap();
        let n = e.run(&p, Mode::NaiveAddition, "t").unwrap();
        let h = e.run(&p, Mode::hypic_default(), "t").unwrap();
        assert!(n.logits.iter().all(|v| v.is_finite()));
        d_n += rel(&n.logits, &full.logits);
        d_h += rel(&h.logits, &full.logits);
    }
    assert!(d_h < d_n, "hypic {d_h} not closer than naive {d_n}");
    assert!(d_h > 0.0);
}
