//! Test helpers shared by the linear-attention tests: seeded random inputs and
//! relative errors.
use rand::{Rng, SeedableRng};

use crate::mixers::gated_deltanet::GdrDims;

/// Seeded generator.
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// `n` values uniform in `[lo, hi)`.
pub fn uniform(r: &mut rand::rngs::StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// `n·dim` values uniform in [-1, 1), each row of `dim` L2-normalised, times `scale`.
pub fn unit_rows(r: &mut rand::rngs::StdRng, n: usize, dim: usize, scale: f32) -> Vec<f32> {
    let mut x = uniform(r, n * dim, -1.0, 1.0);
    for row in x.chunks_mut(dim) {
        let nrm = row.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
        row.iter_mut().for_each(|a| *a *= scale / nrm);
    }
    x
}

/// Random gated-delta-rule inputs: q, k L2-normalised (q scaled by dk^-0.5),
/// v uniform in [-1, 1), g uniform in [-2, 0], β uniform in (0, 1), and a nonzero
/// initial state uniform in [-1, 1).
pub struct GdnCase {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub g: Vec<f32>,
    pub beta: Vec<f32>,
    pub s0: Vec<f32>,
}

impl GdnCase {
    pub fn random(d: &GdrDims, seed: u64) -> Self {
        let mut r = rng(seed);
        let q = unit_rows(&mut r, d.t * d.hk, d.dk, (d.dk as f32).powf(-0.5));
        let k = unit_rows(&mut r, d.t * d.hk, d.dk, 1.0);
        let v = uniform(&mut r, d.t * d.hv * d.dv, -1.0, 1.0);
        let g = uniform(&mut r, d.t * d.hv, -2.0, 0.0);
        let beta = uniform(&mut r, d.t * d.hv, 1e-3, 1.0);
        let s0 = uniform(&mut r, d.state_len(), -1.0, 1.0);
        GdnCase {
            q,
            k,
            v,
            g,
            beta,
            s0,
        }
    }
}

/// Norm-wise relative error `‖a − b‖₂ / ‖b‖₂` (f64 accumulation).
pub fn rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Norm-wise relative error of `a` (f32) against an f64 reference `b`.
pub fn rel64(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Norm ratio `‖a‖₂ / ‖b‖₂` (f64 accumulation).
pub fn norm_ratio(a: &[f32], b: &[f32]) -> f64 {
    let n = |x: &[f32]| x.iter().map(|&y| (y as f64).powi(2)).sum::<f64>().sqrt();
    n(a) / n(b).max(1e-300)
}
