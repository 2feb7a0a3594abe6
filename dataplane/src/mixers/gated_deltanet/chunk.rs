//! Chunked (WY-form) gated delta rule: the fast CPU prefill path of Gated DeltaNet,
//! and the segment transition `T_C` built in the same pass. Same contract as the
//! reference recurrence [`super::naive::recurrent`] (tested against it below).
//! Source: HF transformers `torch_chunk_gated_delta_rule` (modeling_qwen3_next.py)
//! and FLA `fla/ops/gated_delta_rule/chunk.py`.
use super::GdrDims;
/// Default chunk length of [`chunked`] (FLA's and HF's default, 64).
pub const DEFAULT_CHUNK: usize = 64;

/// Chunked (WY-form) gated delta rule: same contract as [`recurrent`](super::naive::recurrent).
///
/// * `q`, `k`: `[T, Hk, dk]` (normalised, q scaled); `v`: `[T, Hv, dv]`;
/// * `g`: `[T, Hv]` log decay (≤ 0); `beta`: `[T, Hv]` in (0, 1);
/// * `state`: `[Hv, dk, dv]` fp32 K-major, updated in place (initial → final state);
/// * `chunk`: tokens per chunk (> 0; [`DEFAULT_CHUNK`] = 64). `T` need not be a
///   multiple of it: the last chunk is simply shorter (no padding).
///
/// Returns `o`: `[T, Hv, dv]`. Value heads run in parallel (rayon); chunks of one
/// head run in order. Per chunk of `c` tokens with cumulative log decay
/// `G_i = Σ_{j≤i} g_j` (chunk-local, so every `exp(G_i − G_j)`, `i ≥ j`, is ≤ 1) and
/// chunk-initial state `S`:
///
/// ```text
/// L_ij = β_i exp(G_i − G_j) k_i·k_j   (j < i)          strictly lower c×c
/// M    = (I + L)⁻¹                       forward substitution (unit lower)
/// U    = M diag(β) V,   W = M diag(β e^G) K            WY representation
/// Ũ    = U − W S = M (diag(β) V − diag(β e^G) K S)   the chunk's true writes u_i
/// O    = diag(e^G) Q S + (Q Kᵀ ⊙ D)_{j≤i} Ũ,   D_ij = exp(G_i − G_j)
/// S'   = e^{G_c} S + K̃ᵀ Ũ,                K̃_i = exp(G_c − G_i) k_i
/// ```
///
/// Derivation: unrolling the recurrence inside the chunk gives
/// `u_i + Σ_{j<i} L_ij u_j = β_i v_i − β_i e^{G_i} Sᵀ k_i`. Same algorithm as HF
/// transformers `torch_chunk_gated_delta_rule` (modeling_qwen3_next.py) and FLA
/// `fla/ops/gated_delta_rule/chunk.py`; the small products use the `gemm` crate.
///
/// Unit-scale quantities (decay factors, `M`, and `T` in
/// [`chunked_with_transition`]) are flushed to zero below 2⁻⁴⁰ and the state below
/// 1e-30 (underflowing arithmetic is ~100× slower on x86); this differs from
/// [`recurrent`](super::naive::recurrent) only by terms far below fp32 resolution.
///
/// Panics if a slice length does not match `d` or `chunk == 0` (internal
/// invariants, checked by callers that take user input).
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
    chunked_impl(d, q, k, v, g, beta, state, chunk, None)
}

/// [`chunked`] that also returns the segment's dense transition `T_C`.
///
/// Inputs and `state` (initial → final, in place) as in [`chunked`]. Returns
/// `(o, t_c)`: `o` is `[T, Hv, dv]`; `t_c` is `[Hv, dk, dk]` fp32 row-major per head,
/// `T_C = T_T ··· T_1` with `T_t = exp(g_t)(I − β_t k_t k_tᵀ)` (docs/pic-design.md §2.2), so
/// that `S_final = T_C S_initial + S_{C|0}` where `S_{C|0}` is the final state from
/// a zero start. `T_C` does not depend on the initial state.
///
/// It is obtained inside the chunk loop, not by a second pass: per chunk
/// `T_chunk = e^{G_c} I − K̃ᵀ W` (the WY form above), accumulated as
/// `T ← e^{G_c} T − K̃ᵀ (W T)` (2·c·dk² flops per chunk; no intra-chunk work is
/// repeated). This equals running the recurrence from `S₀ = I` with all writes
/// `β_t k_t v_tᵀ` set to zero, which is how the paper's implementation builds it
/// (a second full kernel pass with `initial_state = I`). Entries below 2⁻⁴⁰ are
/// returned as 0 (a fully decayed `T_C` is exactly zero, and its further updates
/// are skipped).
///
/// Panics under the same conditions as [`chunked`].
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
    let (dk, hv) = (d.dk, d.hv);
    let mut tc = vec![0f32; hv * dk * dk];
    for h in 0..hv {
        for i in 0..dk {
            tc[h * dk * dk + i * dk + i] = 1.0;
        }
    }
    let out = chunked_impl(d, q, k, v, g, beta, state, chunk, Some(&mut tc));
    (out, tc)
}

#[allow(clippy::too_many_arguments)]
fn chunked_impl(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    chunk: usize,
    trans: Option<&mut [f32]>,
) -> Vec<f32> {
    d.check(q, k, v, g, beta, state);
    assert!(chunk > 0, "chunk must be > 0");
    if let Some(tr) = trans.as_deref() {
        assert_eq!(
            tr.len(),
            d.hv * d.dk * d.dk,
            "transition must be [Hv, dk, dk]"
        );
    }
    let c = chunk.min(d.t.max(1));
    for_each_head(d, state, trans, |h, s, tr, out_h| {
        let mut bufs = ChunkBufs::new(c, d.dk, d.dv, tr.is_some());
        let mut tr = tr;
        let mut t0 = 0;
        while t0 < d.t {
            let len = c.min(d.t - t0);
            gdn_chunk(
                d,
                h,
                t0,
                len,
                q,
                k,
                v,
                g,
                beta,
                s,
                tr.as_deref_mut(),
                out_h,
                &mut bufs,
            );
            t0 += len;
        }
    })
}

/// Runs `f(h, state_h [dk·dv], transition_h [dk·dk] (if any), out_h [T·dv])` for every
/// value head in parallel and interleaves the per-head outputs into `[T, Hv, dv]`.
pub(crate) fn for_each_head<F>(
    d: &GdrDims,
    state: &mut [f32],
    trans: Option<&mut [f32]>,
    f: F,
) -> Vec<f32>
where
    F: Fn(usize, &mut [f32], Option<&mut [f32]>, &mut [f32]) + Sync,
{
    use rayon::prelude::*;
    let GdrDims { t, hv, dk, dv, .. } = *d;
    let mut out = vec![0f32; t * hv * dv];
    if t == 0 || hv == 0 || dk == 0 || dv == 0 {
        return out;
    }
    let mut outs: Vec<Vec<f32>> = (0..hv).map(|_| vec![0f32; t * dv]).collect();
    match trans {
        Some(tr) => state
            .par_chunks_mut(dk * dv)
            .zip(tr.par_chunks_mut(dk * dk))
            .zip(outs.par_iter_mut())
            .enumerate()
            .for_each(|(h, ((s, tr), o))| f(h, s, Some(tr), o)),
        None => state
            .par_chunks_mut(dk * dv)
            .zip(outs.par_iter_mut())
            .enumerate()
            .for_each(|(h, (s, o))| f(h, s, None, o)),
    }
    for (h, oh) in outs.iter().enumerate() {
        for ti in 0..t {
            out[(ti * hv + h) * dv..(ti * hv + h + 1) * dv]
                .copy_from_slice(&oh[ti * dv..(ti + 1) * dv]);
        }
    }
    out
}

/// Scratch buffers of one head's chunk loop (sized for the full chunk length `c`).
struct ChunkBufs {
    /// `[K; Q]`: `[2c, dk]`.
    kq: Vec<f32>,
    /// `[K Kᵀ; Q Kᵀ]`: `[2c, c]` (the second half becomes the masked `P`).
    gp: Vec<f32>,
    /// `M = (I + L)⁻¹`: `[c, c]`.
    m: Vec<f32>,
    /// `[diag(β e^G) K; diag(e^G) Q]`: `[2c, dk]`.
    bq: Vec<f32>,
    /// `[bv − bk S; diag(e^G) Q S]`: `[2c, dv]`.
    xs: Vec<f32>,
    /// `Ũ`: `[c, dv]`.
    u: Vec<f32>,
    /// `K̃`: `[c, dk]`.
    ktil: Vec<f32>,
    /// `W = M diag(β e^G) K` and `W T` (transition only): `[c, dk]` each.
    w: Vec<f32>,
    wt: Vec<f32>,
    lrow: Vec<f32>,
    gc: Vec<f32>,
    bt: Vec<f32>,
    /// `T` is exactly zero (fully decayed): its updates are skipped.
    t_zero: bool,
}

impl ChunkBufs {
    fn new(c: usize, dk: usize, dv: usize, with_t: bool) -> Self {
        let wl = if with_t { c * dk } else { 0 };
        ChunkBufs {
            kq: vec![0.0; 2 * c * dk],
            gp: vec![0.0; 2 * c * c],
            m: vec![0.0; c * c],
            bq: vec![0.0; 2 * c * dk],
            xs: vec![0.0; 2 * c * dv],
            u: vec![0.0; c * dv],
            ktil: vec![0.0; c * dk],
            w: vec![0.0; wl],
            wt: vec![0.0; wl],
            lrow: vec![0.0; c],
            gc: vec![0.0; c],
            bt: vec![0.0; c],
            t_zero: false,
        }
    }
}

/// One chunk `[t0, t0 + c)` of value head `h` (see [`chunked`] for the algebra).
///
/// Products are merged to keep the gemm calls few and large: `[K; Q] Kᵀ` in one
/// call, `[diag(βe^G) K; diag(e^G) Q] S` in one call, and `Ũ = M (diag(β) V −
/// diag(βe^G) K S)` so the plain path never forms `W`.
#[allow(clippy::too_many_arguments)]
fn gdn_chunk(
    d: &GdrDims,
    h: usize,
    t0: usize,
    c: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    s: &mut [f32],
    tr: Option<&mut [f32]>,
    out_h: &mut [f32],
    b: &mut ChunkBufs,
) {
    let GdrDims { hk, hv, dk, dv, .. } = *d;
    let kh = h / (hv / hk);
    // Gather [K; Q] and the chunk-local cumulative log decay.
    let mut acc = 0f32;
    for i in 0..c {
        let ti = t0 + i;
        let src = (ti * hk + kh) * dk;
        b.kq[i * dk..(i + 1) * dk].copy_from_slice(&k[src..src + dk]);
        b.kq[(c + i) * dk..(c + i + 1) * dk].copy_from_slice(&q[src..src + dk]);
        acc += g[ti * hv + h];
        b.gc[i] = acc;
        b.bt[i] = beta[ti * hv + h];
    }
    // gp = [K; Q] Kᵀ: rows 0..c are K Kᵀ, rows c..2c are Q Kᵀ (row stride c).
    matmul(
        2 * c,
        c,
        dk,
        &mut b.gp,
        c,
        &b.kq,
        dk,
        1,
        &b.kq,
        1,
        dk,
        0.0,
        1.0,
    );
    // Decay-mask P = (Q Kᵀ ⊙ D) (lower incl. diagonal) and build M = (I + L)⁻¹.
    let (gram, pq) = b.gp.split_at_mut(c * c);
    for i in 0..c {
        for j in 0..i {
            let dec = flush((b.gc[i] - b.gc[j]).exp(), FLUSH_UNIT);
            b.lrow[j] = b.bt[i] * dec * gram[i * c + j];
            pq[i * c + j] *= dec;
        }
        pq[i * c + i + 1..(i + 1) * c]
            .iter_mut()
            .for_each(|x| *x = 0.0);
        let (done, rest) = b.m.split_at_mut(i * c);
        let mi = &mut rest[..c];
        mi.iter_mut().for_each(|x| *x = 0.0);
        mi[i] = 1.0;
        for (mm, &coef) in b.lrow[..i].iter().enumerate() {
            if coef != 0.0 {
                let mrow = &done[mm * c..mm * c + mm + 1];
                for (x, &y) in mi[..=mm].iter_mut().zip(mrow) {
                    *x -= coef * y;
                }
            }
        }
        mi.iter_mut().for_each(|x| *x = flush(*x, FLUSH_UNIT));
    }
    // bq = [diag(β e^G) K; diag(e^G) Q].
    for i in 0..c {
        let e = flush(b.gc[i].exp(), FLUSH_UNIT);
        let be = flush(b.bt[i] * e, FLUSH_UNIT);
        let (kr, qr) = (i * dk, (c + i) * dk);
        for a in 0..dk {
            b.bq[kr + a] = be * b.kq[kr + a];
            b.bq[qr + a] = e * b.kq[qr + a];
        }
    }
    // xs = bq S: rows 0..c = diag(βe^G) K S, rows c..2c = diag(e^G) Q S.
    matmul(
        2 * c,
        dv,
        dk,
        &mut b.xs,
        dv,
        &b.bq,
        dk,
        1,
        s,
        dv,
        1,
        0.0,
        1.0,
    );
    // xs[0..c] ← diag(β) V − xs[0..c];  Ũ = M xs[0..c].
    for i in 0..c {
        let bi = b.bt[i];
        let src = &v[((t0 + i) * hv + h) * dv..((t0 + i) * hv + h + 1) * dv];
        for (x, &y) in b.xs[i * dv..(i + 1) * dv].iter_mut().zip(src) {
            *x = bi * y - *x;
        }
    }
    matmul(c, dv, c, &mut b.u, dv, &b.m, c, 1, &b.xs, dv, 1, 0.0, 1.0);
    // O = diag(e^G) Q S + P Ũ.
    let oc = &mut out_h[t0 * dv..(t0 + c) * dv];
    oc.copy_from_slice(&b.xs[c * dv..2 * c * dv]);
    matmul(c, dv, c, oc, dv, pq, c, 1, &b.u, dv, 1, 1.0, 1.0);
    // K̃ = diag(exp(G_c − G)) K.
    let gl = b.gc[c - 1];
    for i in 0..c {
        let e = flush((gl - b.gc[i]).exp(), FLUSH_UNIT);
        for (x, &y) in b.ktil[i * dk..(i + 1) * dk]
            .iter_mut()
            .zip(&b.kq[i * dk..(i + 1) * dk])
        {
            *x = e * y;
        }
    }
    let egl = flush(gl.exp(), FLUSH_UNIT);
    if let (Some(tr), false) = (tr, b.t_zero) {
        // W = M diag(βe^G) K;  T ← e^{G_c} T − K̃ᵀ (W T).
        matmul(c, dk, c, &mut b.w, dk, &b.m, c, 1, &b.bq, dk, 1, 0.0, 1.0);
        matmul(c, dk, dk, &mut b.wt, dk, &b.w, dk, 1, tr, dk, 1, 0.0, 1.0);
        matmul(dk, dk, c, tr, dk, &b.ktil, 1, dk, &b.wt, dk, 1, egl, -1.0);
        // Once T has decayed below FLUSH everywhere it is exactly 0 from then on.
        b.t_zero = flush_all(tr, FLUSH_UNIT);
    }
    // S ← e^{G_c} S + K̃ᵀ Ũ.
    matmul(dk, dv, c, s, dv, &b.ktil, 1, dk, &b.u, dv, 1, egl, 1.0);
    flush_all(s, FLUSH_STATE);
}

/// Flush threshold (2⁻⁴⁰ ≈ 9.1e-13) for quantities whose natural scale is 1:
/// decay factors `exp(ΔG)`, the WY inverse `M` and transitions `T` (‖T‖₂ ≤ 1 for
/// g ≤ 0, β ∈ [0, 1]). Dropping them changes results by < 2⁻⁴⁰ relative to unit
/// scale, 2¹⁶× below fp32 resolution, and keeps fast-decaying heads (Qwen3-Next's
/// `g` reaches −20 per token) and long segments (`T_C ≈ exp(Σg)`) out of the
/// underflow/subnormal range, where x86 arithmetic takes ~100× longer per
/// operation. A transition that decays below it becomes exactly 0 and its further
/// updates are skipped.
pub(crate) const FLUSH_UNIT: f32 = 9.094_947e-13;

/// Flush threshold for states (no natural scale): only avoids subnormals.
pub(crate) const FLUSH_STATE: f32 = 1e-30;

/// `x`, or 0 when `|x| < thr`.
#[inline]
pub(crate) fn flush(x: f32, thr: f32) -> f32 {
    if x.abs() < thr {
        0.0
    } else {
        x
    }
}

/// Flushes every element of `x` below `thr` to 0; returns whether all are now 0.
pub(crate) fn flush_all(x: &mut [f32], thr: f32) -> bool {
    let mut zero = true;
    for y in x.iter_mut() {
        *y = flush(*y, thr);
        zero &= *y == 0.0;
    }
    zero
}

/// `dst[m×n] = alpha·dst + beta·lhs[m×k]·rhs[k×n]` in fp32 through the `gemm` crate
/// (single-threaded; callers parallelise over heads). Matrices are addressed by row
/// stride `*_rs` and column stride `*_cs` (row-major: `rs = cols, cs = 1`; a
/// transpose swaps them); `dst` is row-major with row stride `dst_rs`. `dst` is not
/// read when `alpha == 0`. Panics if a stride would index outside a slice.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: &[f32],
    lhs_rs: usize,
    lhs_cs: usize,
    rhs: &[f32],
    rhs_rs: usize,
    rhs_cs: usize,
    alpha: f32,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * dst_rs + n <= dst.len(), "matmul: dst too short");
    if k == 0 {
        for i in 0..m {
            dst[i * dst_rs..i * dst_rs + n]
                .iter_mut()
                .for_each(|x| *x *= alpha);
        }
        return;
    }
    assert!(
        (m - 1) * lhs_rs + (k - 1) * lhs_cs < lhs.len(),
        "matmul: lhs too short"
    );
    assert!(
        (k - 1) * rhs_rs + (n - 1) * rhs_cs < rhs.len(),
        "matmul: rhs too short"
    );
    // SAFETY: the asserts above bound every index gemm touches inside its slice;
    // dst is an exclusive borrow distinct from lhs and rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            alpha != 0.0,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            alpha,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::naive::recurrent;
    use super::*;
    use crate::linear::testutil::{rel, rel64, GdnCase};

    fn dims(t: usize, hk: usize, hv: usize, dk: usize, dv: usize) -> GdrDims {
        GdrDims { t, hk, hv, dk, dv }
    }

    /// Runs both kernels from the case's nonzero initial state; returns the
    /// relative errors of (output, final state).
    fn compare(d: &GdrDims, seed: u64, chunk: usize) -> (f64, f64) {
        let c = GdnCase::random(d, seed);
        let mut s_ref = c.s0.clone();
        let o_ref = recurrent(d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s_ref);
        let mut s = c.s0.clone();
        let o = chunked(d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, chunk);
        (rel(&o, &o_ref), rel(&s, &s_ref))
    }

    #[test]
    fn chunked_matches_recurrent_gva_all_lengths_and_chunks() {
        for &t in &[1usize, 5, 63, 64, 65, 200] {
            for &chunk in &[16usize, 32, 64] {
                // Hv = 2·Hk (GVA); dk ≠ dv to catch transposed products.
                let d = dims(t, 2, 4, 32, 48);
                let (eo, es) = compare(&d, 1000 + t as u64, chunk);
                eprintln!("T={t} chunk={chunk}: out {eo:.2e} state {es:.2e}");
                assert!(
                    eo <= 1e-4 && es <= 1e-4,
                    "T={t} chunk={chunk}: out {eo:e} state {es:e}"
                );
            }
        }
    }

    #[test]
    fn chunked_matches_recurrent_dk128() {
        let d = dims(200, 2, 4, 128, 128);
        let (eo, es) = compare(&d, 7, DEFAULT_CHUNK);
        assert!(eo <= 1e-4 && es <= 1e-4, "out {eo:e} state {es:e}");
    }

    #[test]
    fn chunked_chunk_longer_than_sequence_and_hv_equal_hk() {
        let d = dims(9, 3, 3, 16, 8);
        let (eo, es) = compare(&d, 3, 64);
        assert!(eo <= 1e-5 && es <= 1e-5, "out {eo:e} state {es:e}");
    }

    #[test]
    fn chunked_zero_tokens_keeps_state() {
        let d = dims(0, 2, 4, 8, 8);
        let c = GdnCase::random(&d, 1);
        let mut s = c.s0.clone();
        let (o, tc) = chunked_with_transition(&d, &[], &[], &[], &[], &[], &mut s, 64);
        assert!(o.is_empty());
        assert_eq!(s, c.s0);
        // Empty segment: T_C = I.
        for h in 0..4 {
            for i in 0..8 {
                for j in 0..8 {
                    assert_eq!(tc[h * 64 + i * 8 + j], if i == j { 1.0 } else { 0.0 });
                }
            }
        }
    }

    /// f64 product `T_T ··· T_1` of the per-token `T_t = exp(g_t)(I − β_t k_t k_tᵀ)`
    /// for value head `h`, `[dk, dk]` row-major.
    fn token_product(d: &GdrDims, c: &GdnCase, h: usize) -> Vec<f64> {
        let dk = d.dk;
        let kh = h / (d.hv / d.hk);
        let mut p = vec![0f64; dk * dk];
        for i in 0..dk {
            p[i * dk + i] = 1.0;
        }
        for ti in 0..d.t {
            let kt: Vec<f64> = c.k[(ti * d.hk + kh) * dk..(ti * d.hk + kh + 1) * dk]
                .iter()
                .map(|&x| x as f64)
                .collect();
            let e = (c.g[ti * d.hv + h] as f64).exp();
            let b = c.beta[ti * d.hv + h] as f64;
            // P ← e(I − b k kᵀ) P = e(P − b k (kᵀ P)).
            let mut w = vec![0f64; dk];
            for a in 0..dk {
                for j in 0..dk {
                    w[j] += kt[a] * p[a * dk + j];
                }
            }
            for a in 0..dk {
                for j in 0..dk {
                    p[a * dk + j] = e * (p[a * dk + j] - b * kt[a] * w[j]);
                }
            }
        }
        p
    }

    #[test]
    fn transition_equals_token_product_and_identity_run() {
        // g in [−2, 0] makes T_C ~ e^{−T}, below the 2⁻⁴⁰ flush beyond ~T = 30
        // (see `fully_decayed_transition_is_exactly_zero`); the longer cases scale g
        // so that T_C stays a comparable fp32 number.
        for &(t, chunk, g_scale) in &[
            (1usize, 64usize, 1.0f32),
            (65, 16, 0.2),
            (200, 64, 0.01),
            (130, 32, 0.01),
        ] {
            let d = dims(t, 2, 4, 32, 24);
            let mut c = GdnCase::random(&d, 50 + t as u64);
            c.g.iter_mut().for_each(|x| *x *= g_scale);
            // One pass: output, final state from s0, and T_C.
            let mut s = c.s0.clone();
            let (o, tc) =
                chunked_with_transition(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, chunk);
            // Output and state are those of plain `chunked`.
            let mut s2 = c.s0.clone();
            let o2 = chunked(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s2, chunk);
            assert_eq!(o, o2);
            assert_eq!(s, s2);
            // (a) product of per-token transitions (f64).
            for h in 0..d.hv {
                let p = token_product(&d, &c, h);
                let e = rel64(&tc[h * 32 * 32..(h + 1) * 32 * 32], &p);
                assert!(e <= 1e-5, "T={t} h={h}: T_C vs token product {e:e}");
            }
            // (b) recurrence from S₀ = I with zero writes (dv = dk, v = 0).
            let di = dims(t, 2, 4, 32, 32);
            let mut si = vec![0f32; di.state_len()];
            for h in 0..4 {
                for i in 0..32 {
                    si[h * 1024 + i * 32 + i] = 1.0;
                }
            }
            let zeros = vec![0f32; t * 4 * 32];
            recurrent(&di, &c.q, &c.k, &zeros, &c.g, &c.beta, &mut si);
            let e = rel(&tc, &si);
            assert!(e <= 1e-5, "T={t}: T_C vs identity run {e:e}");
            // (c) S_final = T_C S₀ + S_{C|0}.
            let mut sz = vec![0f32; d.state_len()];
            chunked(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut sz, chunk);
            let mut pred = sz.clone();
            for h in 0..4 {
                let th = &tc[h * 1024..(h + 1) * 1024];
                for a in 0..32 {
                    for j in 0..24 {
                        let mut acc = 0f64;
                        for b in 0..32 {
                            acc += th[a * 32 + b] as f64 * c.s0[h * 768 + b * 24 + j] as f64;
                        }
                        pred[h * 768 + a * 24 + j] += acc as f32;
                    }
                }
            }
            let e = rel(&pred, &s);
            assert!(e <= 1e-5, "T={t}: T_C S0 + S_C|0 vs final state {e:e}");
        }
    }

    #[test]
    fn fully_decayed_transition_is_exactly_zero() {
        // g in [−2, 0] over 200 tokens: the true T_C is ~e^{−200}, far below fp32's
        // normal range; it is returned as exact zeros, and output and state still
        // match the recurrence.
        let d = dims(200, 2, 4, 32, 24);
        let c = GdnCase::random(&d, 77);
        let mut s = c.s0.clone();
        let (o, tc) = chunked_with_transition(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s, 64);
        assert!(tc.iter().all(|&x| x == 0.0));
        for h in 0..d.hv {
            assert!(token_product(&d, &c, h).iter().all(|x| x.abs() < 1e-40));
        }
        let mut s_ref = c.s0.clone();
        let o_ref = recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, &mut s_ref);
        assert!(rel(&o, &o_ref) <= 1e-5 && rel(&s, &s_ref) <= 1e-5);
    }

    /// On-CPU nanoseconds of all threads of this process so far (Linux
    /// `/proc/self/task/*/schedstat`, first field); 0 where unavailable.
    fn cpu_ns() -> u64 {
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return 0;
        };
        dir.filter_map(|e| e.ok())
            .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
            .filter_map(|s| {
                s.split_whitespace()
                    .next()
                    .and_then(|x| x.parse::<u64>().ok())
            })
            .sum()
    }

    /// Timing (not a test): `cargo test --release -p hypic-dataplane --lib
    /// mixers::gated_deltanet::chunk::tests::bench -- --ignored --nocapture` (set
    /// `RAYON_NUM_THREADS=1` for single-core numbers). Prints, per kernel, the best
    /// of several runs of wall time and of on-CPU time summed over threads (ms; the
    /// CPU time is robust to other processes sharing the cores): `recurrent`,
    /// `chunked` (chunk 64 and 32) and `chunked_with_transition` (chunk 64), from
    /// the same nonzero state, for g in [−2, 0] and in [−0.02, 0] (slow decay:
    /// `T_C` stays nonzero, the worst case for the transition's cost).
    #[test]
    #[ignore]
    fn bench_recurrent_vs_chunked() {
        use std::time::Instant;
        fn best<F: FnMut()>(mut f: F) -> (f64, f64) {
            let (mut bw, mut bc, mut total, mut n) = (f64::INFINITY, f64::INFINITY, 0.0, 0);
            while n < 3 || (total < 1.0 && n < 20) {
                let (t0, c0) = (Instant::now(), cpu_ns());
                f();
                let e = t0.elapsed().as_secs_f64();
                bc = bc.min((cpu_ns() - c0) as f64 * 1e-9);
                bw = bw.min(e);
                total += e;
                n += 1;
            }
            (bw * 1e3, bc * 1e3)
        }
        println!("rayon threads: {}", rayon::current_num_threads());
        for &g_scale in &[1.0f32, 0.01] {
            for &(hk, hv) in &[(2usize, 4usize), (16, 32)] {
                for &t in &[256usize, 1024, 4096] {
                    let d = dims(t, hk, hv, 128, 128);
                    let mut c = GdnCase::random(&d, 9);
                    c.g.iter_mut().for_each(|x| *x *= g_scale);
                    let run = |f: &dyn Fn(&mut [f32])| {
                        best(|| {
                            let mut s = c.s0.clone();
                            f(&mut s);
                            std::hint::black_box(&s);
                        })
                    };
                    let r = run(&|s| {
                        std::hint::black_box(recurrent(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, s));
                    });
                    let c64 = run(&|s| {
                        std::hint::black_box(chunked(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, s, 64));
                    });
                    let c32 = run(&|s| {
                        std::hint::black_box(chunked(&d, &c.q, &c.k, &c.v, &c.g, &c.beta, s, 32));
                    });
                    let wt = run(&|s| {
                        std::hint::black_box(chunked_with_transition(
                            &d, &c.q, &c.k, &c.v, &c.g, &c.beta, s, 64,
                        ));
                    });
                    println!(
                        "g<={:.2} Hk={hk} Hv={hv} T={t} [wall ms / cpu ms]: recurrent {:.1}/{:.1} | \
                         chunked64 {:.1}/{:.1} | chunked32 {:.1}/{:.1} | with_T64 {:.1}/{:.1} || \
                         cpu speedup c64 {:.2}x c32 {:.2}x, T overhead (cpu) {:.3}",
                        -2.0 * g_scale,
                        r.0,
                        r.1,
                        c64.0,
                        c64.1,
                        c32.0,
                        c32.1,
                        wt.0,
                        wt.1,
                        r.1 / c64.1,
                        r.1 / c32.1,
                        wt.1 / c64.1
                    );
                }
            }
        }
    }
}
