//! Gated full attention (the `self_attn` mixer of Qwen3-Next and Qwen3.5) on the CPU:
//! q (with the per-head sigmoid output gate when `attn_output_gate`), k, v
//! projections, zero-centred q/k RMSNorm, partial RoPE at the tokens' positions, the
//! KV append, causal GQA softmax attention ([`attention`], the reference of the GPU
//! attention kernels) and `o_proj`. Its PIC cache is the body K/V (no transition
//! family); K is re-rotated when a cached segment moves.
use crate::config::ModelConfig;
use crate::error::Result;
use crate::ops::{self, linear, Rope};
use crate::state::KvCache;
use crate::weights::{Checkpoint, F32Buf};
use rayon::prelude::*;

/// Gated attention weights.
pub(crate) struct AttnWeights {
    /// `[H·hd·(1+gate), hidden]`; per head `[q(hd) | gate(hd)]` when gated.
    pub(crate) q: F32Buf,
    /// `[Hkv·hd, hidden]`.
    pub(crate) k: F32Buf,
    /// `[Hkv·hd, hidden]`.
    pub(crate) v: F32Buf,
    /// `[hidden, H·hd]`.
    pub(crate) o: F32Buf,
    /// Zero-centred, `[hd]`.
    pub(crate) q_norm: Vec<f32>,
    /// Zero-centred, `[hd]`.
    pub(crate) k_norm: Vec<f32>,
}

/// How a family stores the full-attention projections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttnProjLayout {
    /// `q_proj` (with the gate rows when `attn_output_gate`), `k_proj`, `v_proj`,
    /// `o_proj`, `q_norm`, `k_norm` (Qwen3-Next, Qwen3.5).
    #[default]
    Split,
    /// One `query_key_value` `[(H + 2·Hkv)·hd, hidden]` with rows q | k | v, output
    /// `dense`, norms `query_layernorm` / `key_layernorm`, no output gate
    /// (Ring-linear `BailingMoeLinearV2Attention`). Split into q, k, v at load.
    FusedQkv,
}

/// Loads one layer's weights from tensors under the mixer prefix `p` (e.g.
/// `model.layers.3.self_attn.`), in the config's [`AttnProjLayout`]; norm weights
/// are brought to the zero-centred form (`ModelConfig::norm_weight`).
///
/// Errors: a missing tensor or a shape not matching the config (named).
pub(crate) fn load(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<AttnWeights> {
    let (h, nh, nkv, hd) = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim);
    let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
    match c.attn_proj {
        AttnProjLayout::Split => Ok(AttnWeights {
            q: ckpt.get_buf(&format!("{p}q_proj.weight"), &[qw, h])?,
            k: ckpt.get_buf(&format!("{p}k_proj.weight"), &[nkv * hd, h])?,
            v: ckpt.get_buf(&format!("{p}v_proj.weight"), &[nkv * hd, h])?,
            o: ckpt.get_buf(&format!("{p}o_proj.weight"), &[h, nh * hd])?,
            q_norm: c.norm_weight(ckpt.get(&format!("{p}q_norm.weight"), &[hd])?),
            k_norm: c.norm_weight(ckpt.get(&format!("{p}k_norm.weight"), &[hd])?),
        }),
        AttnProjLayout::FusedQkv => {
            let kw = nkv * hd;
            let qkv = ckpt.get_buf(&format!("{p}query_key_value.weight"), &[qw + 2 * kw, h])?;
            Ok(AttnWeights {
                q: qkv.range(0, qw * h),
                k: qkv.range(qw * h, (qw + kw) * h),
                v: qkv.range((qw + kw) * h, (qw + 2 * kw) * h),
                o: ckpt.get_buf(&format!("{p}dense.weight"), &[h, nh * hd])?,
                q_norm: c.norm_weight(ckpt.get(&format!("{p}query_layernorm.weight"), &[hd])?),
                k_norm: c.norm_weight(ckpt.get(&format!("{p}key_layernorm.weight"), &[hd])?),
            })
        }
    }
}

/// Gated attention for a span; appends the span's K/V to `kv`.
/// Returns (output `[T, hidden]`, span K, span V).
pub(crate) fn forward(
    c: &ModelConfig,
    rope: &Rope,
    w: &AttnWeights,
    r: &[f32],
    positions: &[i64],
    kv: &mut KvCache,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let t = positions.len();
    let (o, k, v) = mix(c, rope, w, project(c, w, r, t), positions, kv);
    (
        linear(&o, t, c.num_heads * c.head_dim, &w.o, c.hidden_size),
        k,
        v,
    )
}

/// q|gate, k, v projections of `r` (`[T, hidden]`).
pub(crate) fn project(
    c: &ModelConfig,
    w: &AttnWeights,
    r: &[f32],
    t: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let qw = nh * hd * if c.attn_output_gate { 2 } else { 1 };
    (
        linear(r, t, c.hidden_size, &w.q, qw),
        linear(r, t, c.hidden_size, &w.k, nkv * hd),
        linear(r, t, c.hidden_size, &w.v, nkv * hd),
    )
}

/// From the projections `(q|gate, k, v)` of [`project`]: q/k norm, RoPE, KV
/// append, causal attention, output gate. Returns (gated attention output
/// `[T, H·hd]` before `o_proj`, span K, span V).
pub(crate) fn mix(
    c: &ModelConfig,
    rope: &Rope,
    w: &AttnWeights,
    (qg, mut k, v): (Vec<f32>, Vec<f32>, Vec<f32>),
    positions: &[i64],
    kv: &mut KvCache,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let t = positions.len();
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let gated = c.attn_output_gate;
    let mut q = vec![0f32; t * nh * hd];
    let mut gate = vec![0f32; if gated { t * nh * hd } else { 0 }];
    for ti in 0..t {
        for h in 0..nh {
            let src = if gated {
                (ti * nh + h) * 2 * hd
            } else {
                (ti * nh + h) * hd
            };
            q[(ti * nh + h) * hd..(ti * nh + h + 1) * hd].copy_from_slice(&qg[src..src + hd]);
            if gated {
                gate[(ti * nh + h) * hd..(ti * nh + h + 1) * hd]
                    .copy_from_slice(&qg[src + hd..src + 2 * hd]);
            }
        }
    }
    ops::rms_norm_zero_centred(&mut q, &w.q_norm, c.rms_norm_eps);
    ops::rms_norm_zero_centred(&mut k, &w.k_norm, c.rms_norm_eps);
    for ti in 0..t {
        rope.apply(&mut q[ti * nh * hd..(ti + 1) * nh * hd], hd, positions[ti]);
        rope.apply(
            &mut k[ti * nkv * hd..(ti + 1) * nkv * hd],
            hd,
            positions[ti],
        );
    }
    kv.k.extend_from_slice(&k);
    kv.v.extend_from_slice(&v);
    kv.positions.extend_from_slice(positions);
    let mut o = attention(&q, positions, kv, nh, nkv, hd);
    if gated {
        o.iter_mut()
            .zip(&gate)
            .for_each(|(a, g)| *a *= ops::sigmoid(*g));
    }
    (o, k, v)
}

/// Causal GQA attention of queries `q` (`[T, H, hd]`, at `positions`) over every
/// cached key with position ≤ the query's position. Scale `hd^-0.5`, fp32 softmax.
/// Returns `[T, H, hd]`.
pub fn attention(
    q: &[f32],
    positions: &[i64],
    kv: &KvCache,
    nh: usize,
    nkv: usize,
    hd: usize,
) -> Vec<f32> {
    let t = positions.len();
    let n = kv.len();
    let rep = nh / nkv;
    let scale = (hd as f32).powf(-0.5);
    let mut out = vec![0f32; t * nh * hd];
    out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
        let (ti, h) = (idx / nh, idx % nh);
        let kh = h / rep;
        let qv = &q[idx * hd..(idx + 1) * hd];
        let p = positions[ti];
        let mut scores = Vec::with_capacity(n);
        let mut m = f32::NEG_INFINITY;
        for j in 0..n {
            if kv.positions[j] <= p {
                let kvec = &kv.k[(j * nkv + kh) * hd..(j * nkv + kh + 1) * hd];
                let s = ops::dot(qv, kvec) * scale;
                m = m.max(s);
                scores.push((j, s));
            }
        }
        let mut denom = 0f32;
        for (_, s) in scores.iter_mut() {
            *s = (*s - m).exp();
            denom += *s;
        }
        for (j, s) in scores {
            let vv = &kv.v[(j * nkv + kh) * hd..(j * nkv + kh + 1) * hd];
            let wgt = s / denom;
            o.iter_mut().zip(vv).for_each(|(a, b)| *a += wgt * b);
        }
    });
    out
}
