//! The Gated DeltaNet layer of the CPU model (HF `Qwen3NextGatedDeltaNet` /
//! `Qwen3_5GatedDeltaNet`): merged input projection, causal depthwise conv with the
//! cached tail, SiLU, L2-normalised q/k, gates `β = sigmoid(b)` and
//! `g = −exp(A_log)·softplus(a + dt_bias)`, the gated delta rule ([`super::naive`]
//! for short spans, [`super::chunk`] otherwise), gated RMSNorm and `out_proj`; and
//! the PIC body pairs `(T_body, S_body|0)` built in the same pass. Activations are
//! fp32 `[T, hidden]` row-major.
use super::{chunk, naive, GdrDims, InProjLayout, TRANSITION_FAMILY};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::linear::transition::Pair;
use crate::ops::{self, linear};
use crate::state::LinearState;
use crate::weights::{Checkpoint, F32Buf};
use rayon::prelude::*;

/// Gated DeltaNet weights, with the projections merged into one matrix.
pub(crate) struct GdnWeights {
    /// `[2·key_dim + 2·value_dim + 2·Hv, hidden]`: rows `q_all | k_all | v_all | z_all | b | a`
    /// (the Qwen3.5 split order; Qwen3-Next's per-key-head grouping is undone at load).
    pub(crate) w_in: Vec<f32>,
    /// Depthwise conv weight `[conv_dim, K]`.
    pub(crate) conv: Vec<f32>,
    /// `−exp(A_log)`, `[Hv]`.
    pub(crate) neg_a: Vec<f32>,
    /// `[Hv]`.
    pub(crate) dt_bias: Vec<f32>,
    /// Gated RMSNorm weight `[dv]` (not offset).
    pub(crate) norm: Vec<f32>,
    /// `[hidden, value_dim]`.
    pub(crate) out: F32Buf,
}

/// Width of the merged GDN input projection: `conv_dim + value_dim + 2·Hv`.
pub(crate) fn in_width(c: &ModelConfig) -> usize {
    c.conv_dim() + c.value_dim() + 2 * c.linear_v_heads
}

/// From the GDN input projection `proj` (`[T, in_width]`) computes conv and
/// gates for a span: `(q [T,Hk,dk] normalised and scaled, k [T,Hk,dk] normalised,
/// v [T,Hv,dv], g [T,Hv], beta [T,Hv], z [T,Hv,dv])`, advancing the conv tail in `s`.
fn inputs(
    c: &ModelConfig,
    w: &GdnWeights,
    proj: &[f32],
    t: usize,
    s: &mut LinearState,
) -> GdnInputs {
    let (kd, vd, hv) = (c.key_dim(), c.value_dim(), c.linear_v_heads);
    let cd = c.conv_dim();
    let n_in = in_width(c);
    // Causal depthwise conv over q|k|v with the cached tail, then SiLU.
    let kw = c.conv_kernel;
    let tail = kw - 1;
    let input = |tau: isize, ch: usize| -> f32 {
        if tau >= 0 {
            proj[tau as usize * n_in + ch]
        } else {
            s.conv[ch * tail + (tail as isize + tau) as usize]
        }
    };
    let mut mixed = vec![0f32; t * cd];
    mixed.par_chunks_mut(cd).enumerate().for_each(|(ti, row)| {
        for (ch, out) in row.iter_mut().enumerate() {
            let wr = &w.conv[ch * kw..(ch + 1) * kw];
            let mut acc = 0f32;
            for (j, wj) in wr.iter().enumerate() {
                acc += wj * input(ti as isize - tail as isize + j as isize, ch);
            }
            *out = ops::silu(acc);
        }
    });
    let mut new_tail = vec![0f32; cd * tail];
    for ch in 0..cd {
        for j in 0..tail {
            new_tail[ch * tail + j] = input(t as isize - tail as isize + j as isize, ch);
        }
    }
    s.conv = new_tail;
    let mut q = Vec::with_capacity(t * kd);
    let mut k = Vec::with_capacity(t * kd);
    let mut v = Vec::with_capacity(t * vd);
    let mut z = Vec::with_capacity(t * vd);
    let mut g = Vec::with_capacity(t * hv);
    let mut beta = Vec::with_capacity(t * hv);
    for ti in 0..t {
        let m = &mixed[ti * cd..(ti + 1) * cd];
        q.extend_from_slice(&m[..kd]);
        k.extend_from_slice(&m[kd..2 * kd]);
        v.extend_from_slice(&m[2 * kd..]);
        let p = &proj[ti * n_in..(ti + 1) * n_in];
        z.extend_from_slice(&p[cd..cd + vd]);
        for h in 0..hv {
            beta.push(ops::sigmoid(p[cd + vd + h]));
            g.push(w.neg_a[h] * ops::softplus(p[cd + vd + hv + h] + w.dt_bias[h]));
        }
    }
    let dk = c.linear_k_dim;
    ops::l2_normalize(&mut q, dk, 1e-6);
    ops::l2_normalize(&mut k, dk, 1e-6);
    let scale = (dk as f32).powf(-0.5);
    q.iter_mut().for_each(|x| *x *= scale);
    GdnInputs {
        q,
        k,
        v,
        g,
        beta,
        z,
    }
}

fn dims(c: &ModelConfig, t: usize) -> GdrDims {
    GdrDims {
        t,
        hk: c.linear_k_heads,
        hv: c.linear_v_heads,
        dk: c.linear_k_dim,
        dv: c.linear_v_dim,
    }
}

/// The layer on a span: `r` is the normed residual `[T, hidden]`; advances the conv
/// tail and recurrent state in `s` and returns the mixer output `[T, hidden]`
/// (after `out_proj`) and one body pair per entry of `froms` (same order; each
/// extra pair costs one more gated-delta-rule pass over the span, no GEMMs).
pub(crate) fn forward(
    c: &ModelConfig,
    w: &GdnWeights,
    r: &[f32],
    t: usize,
    s: &mut LinearState,
    froms: &[usize],
) -> (Vec<f32>, Vec<Pair>) {
    let proj = linear(r, t, c.hidden_size, &w.w_in, in_width(c));
    let (normed, pairs) = mix(c, w, &proj, t, s, froms);
    (
        linear(&normed, t, c.value_dim(), &w.out, c.hidden_size),
        pairs,
    )
}

/// From the merged input projection `proj` (`[T, in_width]`) of a span: conv, gates,
/// the gated delta rule from `s` (conv tail and recurrent state advanced in place)
/// and the gated norm. Returns the output `[T, value_dim]` before `out_proj` and one
/// body pair per entry of `froms` (as [`forward`]).
pub(crate) fn mix(
    c: &ModelConfig,
    w: &GdnWeights,
    proj: &[f32],
    t: usize,
    s: &mut LinearState,
    froms: &[usize],
) -> (Vec<f32>, Vec<Pair>) {
    let s0 = (froms.len() > 1).then(|| s.recurrent.clone());
    let inp = inputs(c, w, proj, t, s);
    let mut pairs = Vec::with_capacity(froms.len());
    let core = match froms.split_first() {
        None => run_gdr(&dims(c, t), &inp, 0, t, &mut s.recurrent),
        Some((&first, rest)) => {
            let (core, pair) = with_body_pair(c, &inp, first, t, &mut s.recurrent);
            pairs.push(pair);
            for &from in rest {
                let mut st = s0.clone().unwrap_or_default();
                pairs.push(with_body_pair(c, &inp, from, t, &mut st).1);
            }
            core
        }
    };
    (gated_norm(c, w, core, &inp.z), pairs)
}

/// The gated delta rule over tokens `0..t` from `state` (advanced to the end):
/// returns the core output `[t, Hv, dv]` and the body pair of `from..t`,
/// `T_body` from the chunked kernel in the same pass and
/// `S_body|0 = S_t − T_body · S_from` (docs/pic-design.md §2.4).
fn with_body_pair(
    c: &ModelConfig,
    inp: &GdnInputs,
    from: usize,
    t: usize,
    state: &mut [f32],
) -> (Vec<f32>, Pair) {
    let from = from.min(t);
    let (hv, dk, dv) = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim);
    let mut core = run_gdr(&dims(c, from), inp, 0, from, state);
    let body = t - from;
    if body == 0 {
        return (core, Pair::identity(TRANSITION_FAMILY.kind(), hv, dk, dv));
    }
    let s_w = state.to_vec();
    let d = dims(c, body);
    let sl = inp.slice(&d, from, t);
    let (o, tc) =
        chunk::chunked_with_transition(&d, sl.0, sl.1, sl.2, sl.3, sl.4, state, GDR_CHUNK);
    core.extend_from_slice(&o);
    let t_only = Pair::from_parts(
        TRANSITION_FAMILY.kind(),
        hv,
        dk,
        dv,
        tc.clone(),
        vec![0.0; hv * dk * dv],
    )
    .expect("shapes from the model config");
    let mut ts_w = s_w;
    t_only
        .apply(&mut ts_w)
        .expect("state shape from the model config");
    let b: Vec<f32> = state.iter().zip(&ts_w).map(|(a, b)| a - b).collect();
    let pair = Pair::from_parts(TRANSITION_FAMILY.kind(), hv, dk, dv, tc, b)
        .expect("shapes from the model config");
    (core, pair)
}

/// Gated RMSNorm `w · rmsnorm(core) · silu(z)` per value head (before `out_proj`).
fn gated_norm(c: &ModelConfig, w: &GdnWeights, mut core: Vec<f32>, z: &[f32]) -> Vec<f32> {
    ops::rms_norm(&mut core, &w.norm, c.rms_norm_eps);
    core.iter_mut()
        .zip(z)
        .for_each(|(o, zi)| *o *= ops::silu(*zi));
    core
}

struct GdnInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    z: Vec<f32>,
}

type GdrSlices<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

impl GdnInputs {
    /// Tokens `a..b` of (q, k, v, g, beta); `d` holds the full-span head dims.
    fn slice(&self, d: &GdrDims, a: usize, b: usize) -> GdrSlices<'_> {
        let (kw, vw) = (d.hk * d.dk, d.hv * d.dv);
        (
            &self.q[a * kw..b * kw],
            &self.k[a * kw..b * kw],
            &self.v[a * vw..b * vw],
            &self.g[a * d.hv..b * d.hv],
            &self.beta[a * d.hv..b * d.hv],
        )
    }
}

/// Chunk size of the WY prefill kernel (FLA's default).
pub const GDR_CHUNK: usize = 64;

/// Spans shorter than this run the token-by-token recurrence (decode, seams).
pub(crate) const CHUNKED_MIN_TOKENS: usize = 16;

/// Runs the gated delta rule over tokens `a..b` of `inp` from `state` (in place).
fn run_gdr(d: &GdrDims, inp: &GdnInputs, a: usize, b: usize, state: &mut [f32]) -> Vec<f32> {
    let n = b - a;
    if n == 0 {
        return vec![];
    }
    let d = GdrDims { t: n, ..*d };
    let (q, k, v, g, beta) = inp.slice(&d, a, b);
    if n < CHUNKED_MIN_TOKENS {
        naive::recurrent(&d, q, k, v, g, beta, state)
    } else {
        chunk::chunked(&d, q, k, v, g, beta, state, GDR_CHUNK)
    }
}

/// Loads one layer's weights from tensors under the mixer prefix `p` (e.g.
/// `model.layers.0.linear_attn.`), assembling the merged in-projection from the
/// family's [`InProjLayout`] (`c.gdn_in_proj`, or the grouped one when the
/// checkpoint holds `in_proj_qkvz`).
///
/// Errors: a missing tensor or a shape not matching the config (named).
pub(crate) fn load(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<GdnWeights> {
    let h = c.hidden_size;
    let hv = c.linear_v_heads;
    let (dv, vd) = (c.linear_v_dim, c.value_dim());
    let layout = c.gdn_in_proj.resolve(|n| ckpt.contains(n), p);
    let src = layout
        .tensors(c)
        .iter()
        .map(|t| ckpt.get(&format!("{p}{}", t.name), &[t.rows, h]))
        .collect::<Result<Vec<_>>>()?;
    let mut w_in = Vec::with_capacity(InProjLayout::merged_rows(c) * h);
    for b in layout.blocks(c) {
        w_in.extend_from_slice(&src[b.tensor][b.src_row * h..(b.src_row + b.rows) * h]);
    }
    Ok(GdnWeights {
        w_in,
        conv: ckpt.get(
            &format!("{p}conv1d.weight"),
            &[c.conv_dim(), 1, c.conv_kernel],
        )?,
        neg_a: ckpt.neg_a(&format!("{p}A_log"), hv)?,
        dt_bias: ckpt.get(&format!("{p}dt_bias"), &[hv])?,
        norm: ckpt.get(&format!("{p}norm.weight"), &[dv])?,
        out: ckpt.get_buf(&format!("{p}out_proj.weight"), &[h, vd])?,
    })
}

/// One decode token of one sequence: from its row `proj` (`[in_width]`) of the
/// batch's in-projection, advances the conv tail and recurrent state in `s` and
/// returns the gated-normed core output `[value_dim]` (before `out_proj`).
pub(crate) fn decode_token(
    c: &ModelConfig,
    w: &GdnWeights,
    proj: &[f32],
    s: &mut LinearState,
) -> Vec<f32> {
    let inp = inputs(c, w, proj, 1, s);
    let core = run_gdr(&dims(c, 1), &inp, 0, 1, &mut s.recurrent);
    gated_norm(c, w, core, &inp.z)
}
