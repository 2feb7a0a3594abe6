//! Chunked KDA prefill (the WY form with per-channel decays), which also builds the
//! segment transition `T_C` of the span in the same pass.
//!
//! Per value head and chunk of `n` tokens starting from state `S₀` (`[dk, dv]`), with
//! `γ_i = Σ_{s≤i} g_s` (in-chunk cumulative log decay, `[dk]` per token) and
//! `E_ij = exp(γ_i − γ_j)` (per channel, `j ≤ i`, so every factor is ≤ 1):
//!
//! ```text
//! A_ij  = −β_i Σ_d k_id k_jd E_ijd              (j < i; strictly lower)
//! U     = (I − A)⁻¹ (β ⊙ v)                       forward substitution, [n, dv]
//! W     = (I − A)⁻¹ (β ⊙ k ⊙ exp γ)               forward substitution, [n, dk]
//! V'    = U − W S₀                                the corrected values
//! o_i   = (q_i ⊙ exp γ_i)ᵀ S₀ + Σ_{j≤i} (Σ_d q_id k_jd E_ijd) V'_j
//! S₁    = diag(exp γ_n) S₀ + K̃ᵀ V',   K̃_j = k_j ⊙ exp(γ_n − γ_j)
//! T_chk = diag(exp γ_n) − K̃ᵀ W                    so that S₁ = T_chk S₀ + K̃ᵀ U
//! ```
//!
//! and `T_C = T_chk,m ··· T_chk,1` over the span's chunks. The same algebra as HF
//! transformers' `chunk_kimi_delta_attention` (which forms `(I − A)⁻¹` explicitly).
//! `A` and the `QK` term are two `[n, dk]·[dk, n]` products with the decays split at
//! the chunk's middle token `r`, `E_ij = e^{γ_i−γ_r} e^{γ_r−γ_j}`, when that keeps
//! every factor within `e^{±40}` (`FACTOR_MAX_LOG`); a chunk whose decays span more
//! takes the pairwise `E_ij` (exact, `n²·dk` exponentials). The other steps are
//! GEMMs per head.
use super::{check_dims, GdrDims};
use crate::mixers::gated_deltanet::{flush_all, for_each_head, matmul, FLUSH_UNIT};

/// Chunk length of the CPU prefill (FLA's and HF's default).
pub const KDA_CHUNK: usize = 64;

/// Chunked KDA over `d.t` tokens from `state` (`[Hv, dk, dv]`, advanced in place).
/// Same inputs and output as [`super::naive::recurrent`]; `chunk` > 0 tokens per
/// chunk ([`KDA_CHUNK`]).
///
/// Panics if a slice does not match `d` or `chunk` is 0.
#[allow(clippy::too_many_arguments)]
pub fn chunked(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    chunk: usize,
) -> Vec<f32> {
    run(d, q, k, v, g, beta, state, None, chunk)
}

/// [`chunked`] that also returns the span's transition `T_C` (`[Hv, dk, dk]`
/// row-major, `T[h][i][j]` multiplies state row `j` into row `i`): running the span
/// from any state `S` ends in `T_C S + S_{C|0}`. Entries below 2⁻⁴⁰ are flushed to 0.
#[allow(clippy::too_many_arguments)]
pub fn chunked_with_transition(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    chunk: usize,
) -> (Vec<f32>, Vec<f32>) {
    let (hv, dk) = (d.hv, d.dk);
    let mut tm = vec![0f32; hv * dk * dk];
    for h in 0..hv {
        for i in 0..dk {
            tm[h * dk * dk + i * dk + i] = 1.0;
        }
    }
    let out = run(d, q, k, v, g, beta, state, Some(&mut tm), chunk);
    (out, tm)
}

/// Largest `|γ_i − γ_r|` (log space, per channel) for which a chunk uses the factored
/// decays `exp(γ_i − γ_r) · exp(γ_r − γ_j)` with `r` its middle token: every factor
/// then lies in `[e⁻⁴⁰, e⁴⁰]` and every product of two in f32 range. A chunk whose
/// decays span more is computed with the pairwise `exp(γ_i − γ_j)` instead.
const FACTOR_MAX_LOG: f32 = 40.0;

/// `A` (strictly lower, with its minus sign, `[n, n]`) and `QK` (lower with the
/// diagonal, `[n, n]`) of one chunk of one head.
fn chunk_attn(
    n: usize,
    dk: usize,
    qh: &[f32],
    kh: &[f32],
    gam: &[f32],
    bh: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let mut am = vec![0f32; n * n];
    let mut qk = vec![0f32; n * n];
    let r = n / 2;
    let gr = &gam[r * dk..(r + 1) * dk];
    let factored = gam.chunks_exact(dk).all(|gi| {
        gi.iter()
            .zip(gr)
            .all(|(a, b)| (a - b).abs() <= FACTOR_MAX_LOG)
    });
    if factored {
        // QK = (q ⊙ e^{γ−γ_r}) (k ⊙ e^{γ_r−γ})ᵀ, A = −β (k ⊙ e^{γ−γ_r}) (k ⊙ e^{γ_r−γ})ᵀ.
        let mut qf = vec![0f32; n * dk];
        let mut kf = vec![0f32; n * dk];
        let mut kb = vec![0f32; n * dk];
        for i in 0..n {
            for a in 0..dk {
                let x = gam[i * dk + a] - gr[a];
                let (up, down) = (x.exp(), (-x).exp());
                qf[i * dk + a] = qh[i * dk + a] * up;
                kf[i * dk + a] = kh[i * dk + a] * up;
                kb[i * dk + a] = kh[i * dk + a] * down;
            }
        }
        matmul(n, n, dk, &mut qk, n, &qf, dk, 1, &kb, 1, dk, 0.0, 1.0);
        matmul(n, n, dk, &mut am, n, &kf, dk, 1, &kb, 1, dk, 0.0, 1.0);
        for i in 0..n {
            for j in 0..n {
                if j > i {
                    qk[i * n + j] = 0.0;
                }
                am[i * n + j] = if j < i { -bh[i] * am[i * n + j] } else { 0.0 };
            }
        }
    } else {
        let mut e = vec![0f32; dk];
        for i in 0..n {
            let gi = &gam[i * dk..(i + 1) * dk];
            for j in 0..=i {
                let gj = &gam[j * dk..(j + 1) * dk];
                for a in 0..dk {
                    e[a] = (gi[a] - gj[a]).exp();
                }
                let kj = &kh[j * dk..(j + 1) * dk];
                let mut sq = 0f32;
                let mut sk = 0f32;
                for a in 0..dk {
                    let w = kj[a] * e[a];
                    sq += qh[i * dk + a] * w;
                    sk += kh[i * dk + a] * w;
                }
                qk[i * n + j] = sq;
                if j < i {
                    am[i * n + j] = -bh[i] * sk;
                }
            }
        }
    }
    (am, qk)
}

#[allow(clippy::too_many_arguments)]
fn run(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    trans: Option<&mut [f32]>,
    chunk: usize,
) -> Vec<f32> {
    check_dims(d, q, k, v, g, beta, state);
    assert!(chunk > 0, "chunk must be > 0");
    let GdrDims { t, hk, hv, dk, dv } = *d;
    for_each_head(d, state, trans, |h, s, mut tr, o| {
        let kh = h / (hv / hk);
        let mut c0 = 0;
        while c0 < t {
            let n = chunk.min(t - c0);
            // This head's rows of the chunk, contiguous.
            let mut qh = vec![0f32; n * dk];
            let mut kh_ = vec![0f32; n * dk];
            let mut vh = vec![0f32; n * dv];
            let mut gam = vec![0f32; n * dk];
            let mut bh = vec![0f32; n];
            for i in 0..n {
                let ti = c0 + i;
                qh[i * dk..(i + 1) * dk]
                    .copy_from_slice(&q[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk]);
                kh_[i * dk..(i + 1) * dk]
                    .copy_from_slice(&k[(ti * hk + kh) * dk..(ti * hk + kh + 1) * dk]);
                vh[i * dv..(i + 1) * dv]
                    .copy_from_slice(&v[(ti * hv + h) * dv..(ti * hv + h + 1) * dv]);
                let gt = &g[(ti * hv + h) * dk..(ti * hv + h + 1) * dk];
                for a in 0..dk {
                    let prev = if i > 0 { gam[(i - 1) * dk + a] } else { 0.0 };
                    gam[i * dk + a] = prev + gt[a];
                }
                bh[i] = beta[ti * hv + h];
            }
            let (am, qk) = chunk_attn(n, dk, &qh, &kh_, &gam, &bh);
            // U = (I − A)⁻¹ (β v), W = (I − A)⁻¹ (β k ⊙ exp γ) by forward substitution.
            let mut u = vec![0f32; n * dv];
            let mut w = vec![0f32; n * dk];
            for i in 0..n {
                for c in 0..dv {
                    u[i * dv + c] = bh[i] * vh[i * dv + c];
                }
                for a in 0..dk {
                    w[i * dk + a] = bh[i] * kh_[i * dk + a] * gam[i * dk + a].exp();
                }
                for j in 0..i {
                    let aij = am[i * n + j];
                    if aij == 0.0 {
                        continue;
                    }
                    let (done, row) = u.split_at_mut(i * dv);
                    for (y, &z) in row[..dv].iter_mut().zip(&done[j * dv..(j + 1) * dv]) {
                        *y += aij * z;
                    }
                    let (done, row) = w.split_at_mut(i * dk);
                    for (y, &z) in row[..dk].iter_mut().zip(&done[j * dk..(j + 1) * dk]) {
                        *y += aij * z;
                    }
                }
            }
            // V' = U − W S₀.
            let mut vn = u;
            matmul(n, dv, dk, &mut vn, dv, &w, dk, 1, s, dv, 1, 1.0, -1.0);
            // o = (q ⊙ exp γ) S₀ + QK V'.
            let mut qe = qh;
            for (x, &gv) in qe.iter_mut().zip(&gam) {
                *x *= gv.exp();
            }
            let oc = &mut o[c0 * dv..(c0 + n) * dv];
            matmul(n, dv, dk, oc, dv, &qe, dk, 1, s, dv, 1, 0.0, 1.0);
            matmul(n, dv, n, oc, dv, &qk, n, 1, &vn, dv, 1, 1.0, 1.0);
            // K̃_j = k_j ⊙ exp(γ_n − γ_j); decay of the whole chunk exp(γ_n).
            let last: Vec<f32> = gam[(n - 1) * dk..n * dk].to_vec();
            let mut kt = kh_;
            for (j, row) in kt.chunks_exact_mut(dk).enumerate() {
                for (a, x) in row.iter_mut().enumerate() {
                    *x *= (last[a] - gam[j * dk + a]).exp();
                }
            }
            // S₁ = diag(exp γ_n) S₀ + K̃ᵀ V'.
            for (a, row) in s.chunks_exact_mut(dv).enumerate() {
                let ea = last[a].exp();
                row.iter_mut().for_each(|y| *y *= ea);
            }
            matmul(dk, dv, n, s, dv, &kt, 1, dk, &vn, dv, 1, 1.0, 1.0);
            // T ← (diag(exp γ_n) − K̃ᵀ W) T.
            if let Some(tr) = tr.as_deref_mut() {
                let mut tc = vec![0f32; dk * dk];
                for a in 0..dk {
                    tc[a * dk + a] = last[a].exp();
                }
                matmul(dk, dk, n, &mut tc, dk, &kt, 1, dk, &w, dk, 1, 1.0, -1.0);
                let mut next = vec![0f32; dk * dk];
                matmul(dk, dk, dk, &mut next, dk, &tc, dk, 1, tr, dk, 1, 0.0, 1.0);
                flush_all(&mut next, FLUSH_UNIT);
                tr.copy_from_slice(&next);
            }
            c0 += n;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::naive;
    use super::*;
    use crate::linear::transition::{Family, LinearInputs, Pair};

    /// Deterministic inputs: q, k L2-normalised (q scaled), v in [-1, 1), g in
    /// [g_lo, 0] per channel, β in (0, 1).
    struct Case {
        d: GdrDims,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
    }

    fn case(t: usize, hk: usize, hv: usize, dk: usize, dv: usize, g_lo: f32, seed: u64) -> Case {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32) / (1u64 << 24) as f32
        };
        let mut q: Vec<f32> = (0..t * hk * dk).map(|_| next() * 2.0 - 1.0).collect();
        let mut k: Vec<f32> = (0..t * hk * dk).map(|_| next() * 2.0 - 1.0).collect();
        crate::ops::l2_normalize(&mut q, dk, 1e-6);
        crate::ops::l2_normalize(&mut k, dk, 1e-6);
        let scale = (dk as f32).powf(-0.5);
        q.iter_mut().for_each(|y| *y *= scale);
        let v = (0..t * hv * dv).map(|_| next() * 2.0 - 1.0).collect();
        let g = (0..t * hv * dk).map(|_| g_lo * next()).collect();
        let beta = (0..t * hv).map(|_| 0.05 + 0.9 * next()).collect();
        Case {
            d: GdrDims { t, hk, hv, dk, dv },
            q,
            k,
            v,
            g,
            beta,
        }
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let s = b.iter().fold(1f32, |m, y| m.max(y.abs()));
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
            / s
    }

    fn start_state(d: &GdrDims, seed: u64) -> Vec<f32> {
        (0..d.state_len())
            .map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    /// Chunked equals the token loop around every chunk edge, from a nonzero state,
    /// with GVA, for mild decays (the factored in-chunk decays) and strong ones
    /// (g down to −3 per token: chunks of 64 span more than `FACTOR_MAX_LOG` and take
    /// the pairwise path; chunks of 16 mostly do not).
    #[test]
    fn chunked_equals_naive_around_chunk_edges() {
        for (t, chunk) in [
            (1, 16),
            (15, 16),
            (16, 16),
            (17, 16),
            (33, 16),
            (63, 64),
            (64, 64),
            (65, 64),
            (130, 64),
        ] {
            for g_lo in [-0.05f32, -3.0] {
                let c = case(t, 2, 4, 16, 8, g_lo, t as u64);
                let s0 = start_state(&c.d, 7);
                let mut a = s0.clone();
                let mut b = s0.clone();
                let oa = naive::recurrent(&c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut a);
                let ob = chunked(&c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut b, chunk);
                let (eo, es) = (max_rel(&ob, &oa), max_rel(&b, &a));
                assert!(
                    eo < 2e-5 && es < 2e-5,
                    "t={t} chunk={chunk} g_lo={g_lo}: {eo} {es}"
                );
            }
        }
    }

    /// The transition built in the chunked pass: running the span from `S` ends in
    /// `T_C S + S_{C|0}` (checked against the token loop from `S`), and it equals the
    /// transition that `linear::transition`'s KimiDelta token loop builds.
    #[test]
    fn chunked_transition_composes_like_the_recurrence() {
        for (t, chunk) in [(1, 64), (17, 16), (64, 64), (100, 64)] {
            let c = case(t, 4, 4, 16, 16, -1.0, 100 + t as u64);
            let mut zero = vec![0f32; c.d.state_len()];
            let (_, tc) =
                chunked_with_transition(&c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut zero, chunk);
            let s0 = start_state(&c.d, 3);
            let mut want = s0.clone();
            naive::recurrent(&c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut want);
            let pair = Pair::from_parts(
                super::super::TRANSITION_FAMILY.kind(),
                c.d.hv,
                c.d.dk,
                c.d.dv,
                tc.clone(),
                zero,
            )
            .unwrap();
            let mut got = s0;
            pair.apply(&mut got).unwrap();
            let e = max_rel(&got, &want);
            assert!(e < 2e-5, "t={t}: composed state rel err {e}");
            let x = LinearInputs {
                q: &c.q,
                k: &c.k,
                v: &c.v,
                g: &c.g,
                beta: Some(&c.beta),
            };
            let seg = Family::KimiDelta.build(&c.d, &x, 64).unwrap();
            let e = max_rel(&tc, seg.pair.t());
            assert!(
                e < 2e-5,
                "t={t}: T_C differs from the KimiDelta family's, {e}"
            );
        }
    }

    /// The reference agrees with `linear::transition`'s KimiDelta token loop (an
    /// independent implementation of the same recurrence).
    #[test]
    fn naive_equals_the_transition_family_token_loop() {
        let c = case(40, 2, 4, 8, 8, -2.0, 9);
        let s0 = start_state(&c.d, 11);
        let mut a = s0.clone();
        let oa = naive::recurrent(&c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut a);
        let x = LinearInputs {
            q: &c.q,
            k: &c.k,
            v: &c.v,
            g: &c.g,
            beta: Some(&c.beta),
        };
        let mut b = s0;
        let ob = Family::KimiDelta.recurrent(&c.d, &x, &mut b).unwrap();
        assert!(max_rel(&oa, &ob) < 1e-6 && max_rel(&a, &b) < 1e-6);
    }

    /// Wall time of the token loop and the chunked kernel (with and without `T_C`)
    /// at Kimi-Linear's head shape (d = 128); run with `--ignored --nocapture`.
    #[test]
    #[ignore]
    fn bench_naive_vs_chunked() {
        use std::time::Instant;
        let time = |f: &mut dyn FnMut()| {
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t0 = Instant::now();
                f();
                best = best.min(t0.elapsed().as_secs_f64());
            }
            best * 1e3
        };
        for &(h, t) in &[(4usize, 256usize), (4, 1024), (32, 512)] {
            let c = case(t, h, h, 128, 128, -0.1, 5);
            let mut s = vec![0f32; c.d.state_len()];
            let n = time(&mut || {
                std::hint::black_box(naive::recurrent(
                    &c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s,
                ));
            });
            let ch = time(&mut || {
                std::hint::black_box(chunked(
                    &c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, KDA_CHUNK,
                ));
            });
            let tc = time(&mut || {
                std::hint::black_box(chunked_with_transition(
                    &c.d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, KDA_CHUNK,
                ));
            });
            println!("H={h} T={t}: naive {n:.1} ms, chunked {ch:.1} ms, with T_C {tc:.1} ms");
        }
    }
}
