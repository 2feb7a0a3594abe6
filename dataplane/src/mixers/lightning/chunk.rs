//! Chunked Lightning attention prefill (the fast CPU path), tested against
//! [`super::naive`] around every chunk edge.
//!
//! The span is cut into chunks of `C` tokens. Within a chunk starting from the
//! state `S₀`, with decay `γ = exp(g_h)` per head and `i, j` chunk-local indices:
//!
//! ```text
//! o_i   = scale · ( γ^{i+1} S₀ᵀ q_i + Σ_{j≤i} γ^{i−j} (q_i·k_j) v_j )
//! S_new = γ^{L} S₀ + Σ_j γ^{L−1−j} k_j v_jᵀ        (L = chunk length)
//! ```
//!
//! (Qin et al., *Lightning Attention-2*: intra-chunk quadratic, inter-chunk
//! recurrent.) The powers `γ^n = exp(n·g_h)` are computed in f64 and rounded once.
//! The same pass returns the segment transition of the whole span, the scalar
//! `T_C = exp(g_h·T)` per head (transition family `Scalar`), flushed to exactly 0
//! below 2⁻⁴⁰ as every built transition (`linear::transition`).
use super::LightningDims;
use crate::mixers::gated_deltanet::{flush, FLUSH_UNIT};
use rayon::prelude::*;

/// Chunk length of the CPU chunked prefill.
pub const LIGHTNING_CHUNK: usize = 64;

/// Runs the span in chunks of `chunk` tokens from `state` (initial → final, in
/// place). `log_decay`: `[H]`. Returns `(outputs [T, H, dv], T_C [H])`; the outputs
/// are all zeros and not computed when `want_out` is false (a state-only pass).
///
/// Panics (a programming error) when a slice length does not match `d` or
/// `chunk == 0`.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    d: &LightningDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    log_decay: &[f32],
    scale: f32,
    state: &mut [f32],
    chunk: usize,
    want_out: bool,
) -> (Vec<f32>, Vec<f32>) {
    let LightningDims { t, h, dk, dv } = *d;
    d.check(q, k, v, log_decay, state);
    assert!(chunk > 0, "chunk must be > 0");
    // Per head: outputs [T, dv] head-major, computed in parallel over heads.
    let per_head: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(hi, s)| {
            let g = log_decay[hi] as f64;
            let pow: Vec<f32> = (0..=chunk).map(|n| (g * n as f64).exp() as f32).collect();
            let mut o = vec![0f32; if want_out { t * dv } else { 0 }];
            let row = |ti: usize, w: usize| (ti * h + hi) * w..(ti * h + hi + 1) * w;
            let mut start = 0;
            while start < t {
                let len = chunk.min(t - start);
                if want_out {
                    for i in 0..len {
                        let ti = start + i;
                        let qi = &q[row(ti, dk)];
                        let oi = &mut o[ti * dv..(ti + 1) * dv];
                        // Inter-chunk: γ^{i+1} S₀ᵀ q_i.
                        let a = pow[i + 1] * scale;
                        for (r, &qv) in qi.iter().enumerate() {
                            let c = qv * a;
                            if c != 0.0 {
                                let srow = &s[r * dv..(r + 1) * dv];
                                oi.iter_mut().zip(srow).for_each(|(x, y)| *x += c * y);
                            }
                        }
                        // Intra-chunk: Σ_{j≤i} γ^{i−j} (q_i·k_j) v_j.
                        for j in 0..=i {
                            let tj = start + j;
                            let kj = &k[row(tj, dk)];
                            let w = crate::ops::dot(qi, kj) * pow[i - j] * scale;
                            let vj = &v[row(tj, dv)];
                            oi.iter_mut().zip(vj).for_each(|(x, y)| *x += w * y);
                        }
                    }
                }
                // State: γ^L S₀ + Σ_j γ^{L−1−j} k_j v_jᵀ.
                let dl = pow[len];
                s.iter_mut().for_each(|x| *x *= dl);
                for j in 0..len {
                    let tj = start + j;
                    let kj = &k[row(tj, dk)];
                    let vj = &v[row(tj, dv)];
                    let wj = pow[len - 1 - j];
                    for (r, &kv) in kj.iter().enumerate() {
                        let c = kv * wj;
                        let srow = &mut s[r * dv..(r + 1) * dv];
                        srow.iter_mut().zip(vj).for_each(|(x, y)| *x += c * y);
                    }
                }
                start += len;
            }
            o
        })
        .collect();
    let mut out = vec![0f32; t * h * dv];
    if want_out {
        for (hi, o) in per_head.iter().enumerate() {
            for ti in 0..t {
                out[(ti * h + hi) * dv..(ti * h + hi + 1) * dv]
                    .copy_from_slice(&o[ti * dv..(ti + 1) * dv]);
            }
        }
    }
    (out, transition(log_decay, t))
}

/// The segment transition of `t` tokens: `exp(g_h·t)` per head (f64, rounded once,
/// flushed to 0 below 2⁻⁴⁰).
pub fn transition(log_decay: &[f32], t: usize) -> Vec<f32> {
    log_decay
        .iter()
        .map(|&g| flush(((g as f64) * t as f64).exp() as f32, FLUSH_UNIT))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::naive;
    use super::*;

    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
            / scale
    }

    /// Chunked equals the token loop around every chunk edge, from a nonzero
    /// state, for outputs, final state and T_C; the state-only pass agrees too.
    #[test]
    fn chunked_matches_naive_around_chunk_edges() {
        let (h, dk, dv) = (3, 8, 6);
        let log_decay = [-0.02f32, -0.3, -1.5];
        let chunk = 16;
        for t in [1, 2, 15, 16, 17, 31, 32, 33, 64, 65, 100] {
            let d = LightningDims { t, h, dk, dv };
            let q = pseudo(t * h * dk, 1 + t as u64);
            let k = pseudo(t * h * dk, 2 + t as u64);
            let v = pseudo(t * h * dv, 3 + t as u64);
            let s0 = pseudo(h * dk * dv, 4);
            let mut s_ref = s0.clone();
            let o_ref = naive::recurrent(&d, &q, &k, &v, &log_decay, 0.35, &mut s_ref);
            let mut s = s0.clone();
            let (o, tc) = chunked(&d, &q, &k, &v, &log_decay, 0.35, &mut s, chunk, true);
            assert!(
                max_rel(&o, &o_ref) < 2e-5,
                "t={t}: out {}",
                max_rel(&o, &o_ref)
            );
            assert!(
                max_rel(&s, &s_ref) < 2e-5,
                "t={t}: state {}",
                max_rel(&s, &s_ref)
            );
            for (hi, &g) in log_decay.iter().enumerate() {
                let want = (g as f64 * t as f64).exp();
                assert!((tc[hi] as f64 - want).abs() <= 1e-6 * want.max(1e-30) + 1e-12);
            }
            let mut s2 = s0.clone();
            let (o2, _) = chunked(&d, &q, &k, &v, &log_decay, 0.35, &mut s2, chunk, false);
            assert_eq!(s2, s, "t={t}: state-only pass");
            assert!(o2.iter().all(|&x| x == 0.0));
        }
    }

    /// Linearity that PIC relies on: running from S gives T_C·S + S_{C|0}.
    #[test]
    fn span_from_any_state_is_transition_times_state_plus_zero_start() {
        let (t, h, dk, dv) = (40, 2, 4, 4);
        let d = LightningDims { t, h, dk, dv };
        let log_decay = [-0.1f32, -0.7];
        let (q, k, v) = (
            pseudo(t * h * dk, 7),
            pseudo(t * h * dk, 8),
            pseudo(t * h * dv, 9),
        );
        let s0 = pseudo(h * dk * dv, 10);
        let mut s = s0.clone();
        let (_, tc) = chunked(&d, &q, &k, &v, &log_decay, 1.0, &mut s, 16, false);
        let mut b = vec![0f32; h * dk * dv];
        chunked(&d, &q, &k, &v, &log_decay, 1.0, &mut b, 16, false);
        let composed: Vec<f32> = (0..h * dk * dv)
            .map(|i| tc[i / (dk * dv)] * s0[i] + b[i])
            .collect();
        assert!(max_rel(&composed, &s) < 1e-5);
    }
}
