//! The Lightning attention layer of the CPU model (Ring-linear-2.0
//! `BailingMoeLinearV2LinearAttention`; mlx-lm `bailing_moe_linear.LinearAttention`):
//!
//! 1. fused `query_key_value` → q | k | v (`[T, 3·H·d]`, heads in that order);
//! 2. optional SiLU on q|k|v (`linear_silu`);
//! 3. per-head RMSNorm of q (`query_layernorm`) and k (`key_layernorm`);
//! 4. fp32 NeoX partial RoPE on q and k at the tokens' positions;
//! 5. the recurrence with the layer's log decays ([`super::naive`] for short spans,
//!    [`super::chunk`] otherwise), `scale = d^−½`;
//! 6. group RMSNorm `g_norm` over `group_norm_size` groups of the `H·d` channels,
//!    times `sigmoid(g_proj(x))`;
//! 7. `dense` back to the residual width.
//!
//! The PIC body pairs of `from..T` are `(exp(g_h·(T−from)), S_body|0)` with
//! `S_body|0` from a state-only chunked pass over the body from zero.
//! Activations are fp32 `[T, hidden]` row-major.
use super::{chunk, log_decays, naive, LightningDims, TRANSITION_FAMILY};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::linear::transition::Pair;
use crate::ops::{self, linear, Rope};
use crate::state::LinearState;
use crate::weights::{Checkpoint, F32Buf};

/// Spans shorter than this run the token loop; longer ones the chunked prefill.
pub const NAIVE_MAX: usize = 16;

/// Lightning layer weights.
pub(crate) struct LightningWeights {
    /// `[3·H·d, hidden]`: rows q | k | v.
    pub(crate) qkv: F32Buf,
    /// q RMSNorm weight `[d]`, zero-centred (stored as `w − 1`).
    pub(crate) q_norm: Vec<f32>,
    /// k RMSNorm weight `[d]`, zero-centred.
    pub(crate) k_norm: Vec<f32>,
    /// Output gate projection `[H·d, hidden]`.
    pub(crate) g_proj: F32Buf,
    /// Group RMSNorm weight `[H·d]` (not offset).
    pub(crate) g_norm: Vec<f32>,
    /// Output projection `[hidden, H·d]`.
    pub(crate) dense: F32Buf,
    /// Log decays `g_h = −slope_h·f_l`, `[H]`.
    pub(crate) log_decay: Vec<f32>,
}

/// Width `H·d` of q, k, v and the output.
pub(crate) fn width(c: &ModelConfig) -> usize {
    c.linear_v_heads * c.linear_v_dim
}

/// Loads layer `layer`'s weights from tensors under the mixer prefix `p` (e.g.
/// `model.layers.0.attention.`).
///
/// Errors: a missing tensor or a shape not matching the config (named).
pub(crate) fn load(
    c: &ModelConfig,
    ckpt: &Checkpoint,
    p: &str,
    layer: usize,
) -> Result<LightningWeights> {
    let (h, d, w) = (c.hidden_size, c.linear_k_dim, width(c));
    Ok(LightningWeights {
        qkv: ckpt.get_buf(&format!("{p}query_key_value.weight"), &[3 * w, h])?,
        q_norm: c.norm_weight(ckpt.get(&format!("{p}query_layernorm.weight"), &[d])?),
        k_norm: c.norm_weight(ckpt.get(&format!("{p}key_layernorm.weight"), &[d])?),
        g_proj: ckpt.get_buf(&format!("{p}g_proj.weight"), &[w, h])?,
        g_norm: ckpt.get(&format!("{p}g_norm.weight"), &[w])?,
        dense: ckpt.get_buf(&format!("{p}dense.weight"), &[h, w])?,
        log_decay: layer_log_decay(c, layer),
    })
}

/// The log decays of layer `layer` under the config's slope rule.
pub(crate) fn layer_log_decay(c: &ModelConfig, layer: usize) -> Vec<f32> {
    log_decays(
        c.linear_v_heads,
        layer,
        c.num_layers,
        c.lightning.slope_rule,
    )
}

/// Projections of `r` (`[T, hidden]`): `(q|k|v [T, 3·H·d], gate logits [T, H·d])`.
pub(crate) fn project(
    c: &ModelConfig,
    w: &LightningWeights,
    r: &[f32],
    t: usize,
) -> (Vec<f32>, Vec<f32>) {
    let wd = width(c);
    (
        linear(r, t, c.hidden_size, &w.qkv, 3 * wd),
        linear(r, t, c.hidden_size, &w.g_proj, wd),
    )
}

/// From the projections of [`project`]: SiLU, q/k norms, RoPE, the recurrence from
/// `s` (advanced in place), group norm and gate. Returns the gated output
/// `[T, H·d]` before `dense` and one body pair per entry of `froms`.
pub(crate) fn mix(
    c: &ModelConfig,
    rope: &Rope,
    w: &LightningWeights,
    (mut qkv, gate): (Vec<f32>, Vec<f32>),
    positions: &[i64],
    s: &mut LinearState,
    froms: &[usize],
) -> (Vec<f32>, Vec<Pair>) {
    let t = positions.len();
    let (nh, d) = (c.linear_v_heads, c.linear_k_dim);
    let wd = width(c);
    if c.lightning.silu {
        qkv.iter_mut().for_each(|x| *x = ops::silu(*x));
    }
    let mut q = Vec::with_capacity(t * wd);
    let mut k = Vec::with_capacity(t * wd);
    let mut v = Vec::with_capacity(t * wd);
    for row in qkv.chunks_exact(3 * wd) {
        q.extend_from_slice(&row[..wd]);
        k.extend_from_slice(&row[wd..2 * wd]);
        v.extend_from_slice(&row[2 * wd..]);
    }
    ops::rms_norm_zero_centred(&mut q, &w.q_norm, c.rms_norm_eps);
    ops::rms_norm_zero_centred(&mut k, &w.k_norm, c.rms_norm_eps);
    for (ti, &p) in positions.iter().enumerate() {
        rope.apply(&mut q[ti * wd..(ti + 1) * wd], d, p);
        rope.apply(&mut k[ti * wd..(ti + 1) * wd], d, p);
    }
    let scale = (d as f32).powf(-0.5);
    let dims = LightningDims {
        t,
        h: nh,
        dk: d,
        dv: d,
    };
    let mut pairs = Vec::with_capacity(froms.len());
    for &from in froms {
        let from = from.min(t);
        let body = LightningDims {
            t: t - from,
            ..dims
        };
        let mut b = vec![0f32; nh * d * d];
        let (_, tc) = chunk::chunked(
            &body,
            &q[from * wd..],
            &k[from * wd..],
            &v[from * wd..],
            &w.log_decay,
            scale,
            &mut b,
            chunk::LIGHTNING_CHUNK,
            false,
        );
        pairs.push(
            Pair::from_parts(TRANSITION_FAMILY.kind(), nh, d, d, tc, b)
                .expect("pair sized from the config"),
        );
    }
    let mut o = if t < NAIVE_MAX {
        naive::recurrent(&dims, &q, &k, &v, &w.log_decay, scale, &mut s.recurrent)
    } else {
        chunk::chunked(
            &dims,
            &q,
            &k,
            &v,
            &w.log_decay,
            scale,
            &mut s.recurrent,
            chunk::LIGHTNING_CHUNK,
            true,
        )
        .0
    };
    group_rms_norm(
        &mut o,
        &w.g_norm,
        c.lightning.group_norm_size,
        c.rms_norm_eps,
    );
    o.iter_mut()
        .zip(&gate)
        .for_each(|(a, g)| *a *= ops::sigmoid(*g));
    (o, pairs)
}

/// Lightning layer for a span (projections, [`mix`], `dense`). Returns the output
/// `[T, hidden]` and the body pairs of `froms`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn forward(
    c: &ModelConfig,
    rope: &Rope,
    w: &LightningWeights,
    r: &[f32],
    positions: &[i64],
    s: &mut LinearState,
    froms: &[usize],
) -> (Vec<f32>, Vec<Pair>) {
    let t = positions.len();
    let (o, pairs) = mix(c, rope, w, project(c, w, r, t), positions, s, froms);
    (linear(&o, t, width(c), &w.dense, c.hidden_size), pairs)
}

/// Group RMSNorm over rows of width `w.len()`: each row is split into `groups`
/// contiguous groups, each normalised by its own RMS, then scaled by `w`.
pub(crate) fn group_rms_norm(x: &mut [f32], w: &[f32], groups: usize, eps: f32) {
    let width = w.len();
    let g = width / groups.max(1);
    for row in x.chunks_exact_mut(width) {
        for (grp, wg) in row.chunks_exact_mut(g).zip(w.chunks_exact(g)) {
            let ms = grp.iter().map(|v| v * v).sum::<f32>() / g as f32;
            let r = 1.0 / (ms + eps).sqrt();
            grp.iter_mut().zip(wg).for_each(|(v, wi)| *v = *v * r * wi);
        }
    }
}
