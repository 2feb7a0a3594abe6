//! The KDA layer of the CPU model (HF transformers 5.17 `KimiLinearDeltaAttention`):
//!
//! 1. `q_proj`, `k_proj`, `v_proj` (`[H·d, hidden]` each), and from the same input
//!    the low-rank gate inputs `f_a_proj`, `g_a_proj` (`[d, hidden]`) and `b_proj`
//!    (`[H, hidden]`): one merged GEMM;
//! 2. a depthwise causal conv of kernel K over `q|k|v` (the checkpoint's
//!    `q_conv1d`, `k_conv1d`, `v_conv1d`, `[H·d, 1, K]` each) with the cached tail,
//!    then SiLU;
//! 3. q and k L2-normalised per head (`x / sqrt(Σx² + 1e-6)`), q scaled by `d^-½`;
//! 4. per-channel log decay `g = −exp(A_log_h) · softplus(f_b_proj(f_a) + dt_bias)`
//!    (`[T, H, d]`), `β = sigmoid(b)`;
//! 5. the recurrence ([`super::naive`] below [`NAIVE_MAX`] tokens, [`super::chunk`]
//!    otherwise);
//! 6. per-head RMSNorm `o_norm` (`[d]`, plain weight) times `sigmoid(g_b_proj(g_a))`;
//! 7. `o_proj` back to the residual width.
//!
//! The PIC body pairs of `from..T` are `(T_body, S_T − T_body·S_from)` with `T_body`
//! from the chunked kernel in the same pass (as `gated_deltanet::layer`).
//! Activations are fp32 `[T, hidden]` row-major.
use super::{chunk, naive, GdrDims, TRANSITION_FAMILY};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::linear::transition::Pair;
use crate::ops::{self, linear};
use crate::state::LinearState;
use crate::weights::{Checkpoint, F32Buf};
use rayon::prelude::*;

/// Spans shorter than this run the token loop; longer ones the chunked prefill.
pub const NAIVE_MAX: usize = 16;

/// KDA layer weights.
pub(crate) struct KdaWeights {
    /// `[in_width, hidden]`: rows `q | k | v` (`H·d` each), `f_a` (`d`), `g_a` (`d`),
    /// `b` (`H`).
    pub(crate) w_in: F32Buf,
    /// Forget-gate up projection `f_b_proj` `[H·d, d]`.
    pub(crate) f_b: F32Buf,
    /// Output-gate up projection `g_b_proj` `[H·d, d]`.
    pub(crate) g_b: F32Buf,
    /// Depthwise conv weights `[3·H·d, K]`, channels `q | k | v`.
    pub(crate) conv: Vec<f32>,
    /// `−exp(A_log)`, `[H]`.
    pub(crate) neg_a: Vec<f32>,
    /// `[H·d]`.
    pub(crate) dt_bias: Vec<f32>,
    /// Gated RMSNorm weight `[d]` (plain, not offset).
    pub(crate) o_norm: Vec<f32>,
    /// `[hidden, H·d]`.
    pub(crate) o_proj: F32Buf,
}

/// Width `H·d` of q, k, v and the output.
pub(crate) fn width(c: &ModelConfig) -> usize {
    c.linear_v_heads * c.linear_v_dim
}

/// Width of the merged input projection: `3·H·d + 2·d + H`.
pub(crate) fn in_width(c: &ModelConfig) -> usize {
    3 * width(c) + 2 * c.linear_k_dim + c.linear_v_heads
}

/// Loads one layer's weights from tensors under the mixer prefix `p` (e.g.
/// `model.layers.0.self_attn.`): the release layout that transformers'
/// `save_pretrained` writes (`q_conv1d`, `f_a_proj`, `A_log [1,1,H,1]`, …).
///
/// Errors: a missing tensor or a shape not matching the config (named).
pub(crate) fn load(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<KdaWeights> {
    let (h, nh, d) = (c.hidden_size, c.linear_v_heads, c.linear_k_dim);
    let wd = width(c);
    let mut w_in = Vec::with_capacity(in_width(c) * h);
    for (name, rows) in [
        ("q_proj", wd),
        ("k_proj", wd),
        ("v_proj", wd),
        ("f_a_proj", d),
        ("g_a_proj", d),
        ("b_proj", nh),
    ] {
        w_in.extend(ckpt.get(&format!("{p}{name}.weight"), &[rows, h])?);
    }
    let mut conv = Vec::with_capacity(3 * wd * c.conv_kernel);
    for name in ["q_conv1d", "k_conv1d", "v_conv1d"] {
        conv.extend(ckpt.get(&format!("{p}{name}.weight"), &[wd, 1, c.conv_kernel])?);
    }
    Ok(KdaWeights {
        w_in: w_in.into(),
        f_b: ckpt.get_buf(&format!("{p}f_b_proj.weight"), &[wd, d])?,
        g_b: ckpt.get_buf(&format!("{p}g_b_proj.weight"), &[wd, d])?,
        conv,
        neg_a: ckpt.neg_a_shaped(&format!("{p}A_log"), &[1, 1, nh, 1])?,
        dt_bias: ckpt.get(&format!("{p}dt_bias"), &[wd])?,
        o_norm: ckpt.get(&format!("{p}o_norm.weight"), &[d])?,
        o_proj: ckpt.get_buf(&format!("{p}o_proj.weight"), &[h, wd])?,
    })
}

/// The merged input projection of `r` (`[T, hidden]`): `[T, in_width]`.
pub(crate) fn project(c: &ModelConfig, w: &KdaWeights, r: &[f32], t: usize) -> Vec<f32> {
    linear(r, t, c.hidden_size, &w.w_in, in_width(c))
}

/// The recurrence inputs of a span, time-major.
struct KdaInputs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    /// Output-gate logits `[T, H·d]`.
    gate: Vec<f32>,
}

/// From the projections `proj` (`[T, in_width]`): conv (advancing the tail in `s`),
/// SiLU, q/k normalisation, decays, β and the output-gate logits.
fn inputs(
    c: &ModelConfig,
    w: &KdaWeights,
    proj: &[f32],
    t: usize,
    s: &mut LinearState,
) -> KdaInputs {
    let (nh, d) = (c.linear_v_heads, c.linear_k_dim);
    let wd = width(c);
    let cd = 3 * wd;
    let n_in = in_width(c);
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
    let mut q = Vec::with_capacity(t * wd);
    let mut k = Vec::with_capacity(t * wd);
    let mut v = Vec::with_capacity(t * wd);
    let mut fa = Vec::with_capacity(t * d);
    let mut ga = Vec::with_capacity(t * d);
    let mut beta = Vec::with_capacity(t * nh);
    for ti in 0..t {
        let m = &mixed[ti * cd..(ti + 1) * cd];
        q.extend_from_slice(&m[..wd]);
        k.extend_from_slice(&m[wd..2 * wd]);
        v.extend_from_slice(&m[2 * wd..]);
        let p = &proj[ti * n_in..(ti + 1) * n_in];
        fa.extend_from_slice(&p[cd..cd + d]);
        ga.extend_from_slice(&p[cd + d..cd + 2 * d]);
        beta.extend(p[cd + 2 * d..].iter().map(|&b| ops::sigmoid(b)));
    }
    ops::l2_normalize(&mut q, d, 1e-6);
    ops::l2_normalize(&mut k, d, 1e-6);
    let scale = (d as f32).powf(-0.5);
    q.iter_mut().for_each(|x| *x *= scale);
    let mut g = linear(&fa, t, d, &w.f_b, wd);
    for row in g.chunks_exact_mut(wd) {
        for (j, x) in row.iter_mut().enumerate() {
            *x = w.neg_a[j / d] * ops::softplus(*x + w.dt_bias[j]);
        }
    }
    let gate = linear(&ga, t, d, &w.g_b, wd);
    KdaInputs {
        q,
        k,
        v,
        g,
        beta,
        gate,
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

type KdaSlices<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

impl KdaInputs {
    /// Tokens `a..b` of (q, k, v, g, beta).
    fn slice(&self, d: &GdrDims, a: usize, b: usize) -> KdaSlices<'_> {
        let (kw, vw, gw) = (d.hk * d.dk, d.hv * d.dv, d.hv * d.dk);
        (
            &self.q[a * kw..b * kw],
            &self.k[a * kw..b * kw],
            &self.v[a * vw..b * vw],
            &self.g[a * gw..b * gw],
            &self.beta[a * d.hv..b * d.hv],
        )
    }
}

/// The recurrence over tokens `a..b` of `inp` from `state` (in place).
fn run(c: &ModelConfig, inp: &KdaInputs, a: usize, b: usize, state: &mut [f32]) -> Vec<f32> {
    let n = b - a;
    if n == 0 {
        return vec![];
    }
    let d = dims(c, n);
    let (q, k, v, g, beta) = inp.slice(&d, a, b);
    if n < NAIVE_MAX {
        naive::recurrent(&d, q, k, v, g, beta, state)
    } else {
        chunk::chunked(&d, q, k, v, g, beta, state, chunk::KDA_CHUNK)
    }
}

/// The recurrence over `0..t` from `state` (advanced to the end): the core output
/// `[t, H, d]` and the body pair of `from..t`.
fn with_body_pair(
    c: &ModelConfig,
    inp: &KdaInputs,
    from: usize,
    t: usize,
    state: &mut [f32],
) -> (Vec<f32>, Pair) {
    let from = from.min(t);
    let (hv, dk, dv) = (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim);
    let mut core = run(c, inp, 0, from, state);
    if from == t {
        return (core, Pair::identity(TRANSITION_FAMILY.kind(), hv, dk, dv));
    }
    let s_w = state.to_vec();
    let d = dims(c, t - from);
    let (q, k, v, g, beta) = inp.slice(&d, from, t);
    let (o, tc) = chunk::chunked_with_transition(&d, q, k, v, g, beta, state, chunk::KDA_CHUNK);
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

/// From the projections of [`project`] (`[T, in_width]`): conv, gates, the
/// recurrence from `s` (conv tail and state advanced in place), gated norm. Returns
/// the gated output `[T, H·d]` before `o_proj` and one body pair per entry of
/// `froms` (same order; each extra pair costs one more pass of the recurrence).
pub(crate) fn mix(
    c: &ModelConfig,
    w: &KdaWeights,
    proj: &[f32],
    t: usize,
    s: &mut LinearState,
    froms: &[usize],
) -> (Vec<f32>, Vec<Pair>) {
    let s0 = (froms.len() > 1).then(|| s.recurrent.clone());
    let inp = inputs(c, w, proj, t, s);
    let mut pairs = Vec::with_capacity(froms.len());
    let mut core = match froms.split_first() {
        None => run(c, &inp, 0, t, &mut s.recurrent),
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
    ops::rms_norm(&mut core, &w.o_norm, c.rms_norm_eps);
    core.iter_mut()
        .zip(&inp.gate)
        .for_each(|(o, g)| *o *= ops::sigmoid(*g));
    (core, pairs)
}

/// The layer on a span: `r` is the normed residual `[T, hidden]`; returns the mixer
/// output `[T, hidden]` (after `o_proj`) and the body pairs of `froms`.
pub(crate) fn forward(
    c: &ModelConfig,
    w: &KdaWeights,
    r: &[f32],
    t: usize,
    s: &mut LinearState,
    froms: &[usize],
) -> (Vec<f32>, Vec<Pair>) {
    let proj = project(c, w, r, t);
    let (o, pairs) = mix(c, w, &proj, t, s, froms);
    (linear(&o, t, width(c), &w.o_proj, c.hidden_size), pairs)
}
