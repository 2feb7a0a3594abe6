//! Multi-head latent attention without RoPE (MLA NoPE: the full-attention layers of
//! Kimi-Linear, HF transformers 5.17 `KimiLinearAttention`), on the CPU, with the KV
//! cache in **latent form**.
//!
//! HF computes, per token, `c = kv_a_layernorm(kv_a[..r])` (the latent, `r =
//! kv_lora_rank`) and the shared key part `k_rot = kv_a[r..]` (`qk_rope_head_dim`
//! wide, not rotated), expands them per head with `kv_b_proj` into
//! `k_h = [W_uk,h c | k_rot]` and `v_h = W_uv,h c`, and attends with
//! `q_h = [q_nope,h | q_rot,h]` at scale `qk_head_dim^-½`. Here the expansion is
//! absorbed into the query and the output instead (the same products, reassociated):
//!
//! ```text
//! score_hj = ([W_uk,hᵀ q_nope,h | q_rot,h] · [c_j | k_rot_j]) · qk_head_dim^-½
//! o_h      = W_uv,h · Σ_j softmax(score_h)_j c_j
//! ```
//!
//! so the cache holds one row `[c_j | k_rot_j]` of `r + qk_rope_head_dim` floats per
//! token and layer (`ModelConfig`: `num_kv_heads = 1`, `head_dim = r + rope dim`,
//! `rotary_dim = 0`, so PIC re-rotation leaves it unchanged). The row is stored as both
//! the `K` and the `V` of [`KvCache`] (the pools, spill files and PIC entries assume
//! equal K and V widths); the value read uses its first `r` entries.
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::mixers::attention::attention;
use crate::ops::{self, linear};
use crate::state::KvCache;
use crate::weights::{Checkpoint, F32Buf};

/// MLA sizes (config.json keys of the same names; `q_lora_rank` must be null).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MlaConfig {
    /// Latent width `r` (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per-head key width expanded from the latent (`qk_nope_head_dim`).
    pub qk_nope_head_dim: usize,
    /// Width of the shared key part and of each head's query part that meets it
    /// (`qk_rope_head_dim`; no rotation is applied).
    pub qk_rope_head_dim: usize,
    /// Per-head value width (`v_head_dim`).
    pub v_head_dim: usize,
}

impl MlaConfig {
    /// Per-head query/key width `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Width of one cached latent row `kv_lora_rank + qk_rope_head_dim`.
    pub fn row(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// MLA weights, with `kv_b_proj` split per head for the absorbed products.
pub(crate) struct MlaWeights {
    /// `q_proj` `[H·qk_head_dim, hidden]` (per head `q_nope | q_rot`).
    pub(crate) q: F32Buf,
    /// `kv_a_proj_with_mqa` `[r + rope, hidden]`.
    pub(crate) kv_a: F32Buf,
    /// `kv_a_layernorm` weight `[r]` (plain).
    pub(crate) kv_norm: Vec<f32>,
    /// Key expansion `[H, qk_nope, r]` (rows of `kv_b_proj`).
    pub(crate) w_uk: Vec<f32>,
    /// Value expansion `[H, v, r]` (rows of `kv_b_proj`).
    pub(crate) w_uv: Vec<f32>,
    /// `o_proj` `[hidden, H·v]`.
    pub(crate) o: F32Buf,
}

/// Loads one layer's weights from tensors under the mixer prefix `p` (e.g.
/// `model.layers.3.self_attn.`).
///
/// Errors: a missing tensor or a shape not matching the config (named); a
/// checkpoint with `q_a_proj` (a low-rank query, not supported).
pub(crate) fn load(c: &ModelConfig, ckpt: &Checkpoint, p: &str) -> Result<MlaWeights> {
    let m = &c.mla;
    let (h, nh, r) = (c.hidden_size, c.num_heads, m.kv_lora_rank);
    if ckpt.contains(&format!("{p}q_a_proj.weight")) {
        return Err(Error::Config {
            field: "q_lora_rank".into(),
            msg: format!("{p}q_a_proj.weight: a low-rank MLA query is not supported"),
        });
    }
    let (nope, vd) = (m.qk_nope_head_dim, m.v_head_dim);
    let kv_b = ckpt.get(&format!("{p}kv_b_proj.weight"), &[nh * (nope + vd), r])?;
    let mut w_uk = Vec::with_capacity(nh * nope * r);
    let mut w_uv = Vec::with_capacity(nh * vd * r);
    for head in kv_b.chunks_exact((nope + vd) * r) {
        w_uk.extend_from_slice(&head[..nope * r]);
        w_uv.extend_from_slice(&head[nope * r..]);
    }
    Ok(MlaWeights {
        q: ckpt.get_buf(&format!("{p}q_proj.weight"), &[nh * m.qk_head_dim(), h])?,
        kv_a: ckpt.get_buf(&format!("{p}kv_a_proj_with_mqa.weight"), &[m.row(), h])?,
        kv_norm: ckpt.get(&format!("{p}kv_a_layernorm.weight"), &[r])?,
        w_uk,
        w_uv,
        o: ckpt.get_buf(&format!("{p}o_proj.weight"), &[h, nh * vd])?,
    })
}

/// Projections of `r` (`[T, hidden]`): `(q [T, H·qk_head_dim], kv_a [T, r + rope])`.
pub(crate) fn project(
    c: &ModelConfig,
    w: &MlaWeights,
    x: &[f32],
    t: usize,
) -> (Vec<f32>, Vec<f32>) {
    let m = &c.mla;
    (
        linear(x, t, c.hidden_size, &w.q, c.num_heads * m.qk_head_dim()),
        linear(x, t, c.hidden_size, &w.kv_a, m.row()),
    )
}

/// From the projections of [`project`]: the latent rows `[c | k_rot]` (appended to
/// `kv` at `positions`), causal attention over every cached row with position ≤ the
/// query's, and the value expansion. Returns (attention output `[T, H·v]` before
/// `o_proj`, the span's rows `[T, r + rope]` as K, the same as V).
pub(crate) fn mix(
    c: &ModelConfig,
    w: &MlaWeights,
    (q, mut rows): (Vec<f32>, Vec<f32>),
    positions: &[i64],
    kv: &mut KvCache,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let m = &c.mla;
    let t = positions.len();
    let (nh, r, nope, rope, vd) = (
        c.num_heads,
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let (row, qkd) = (m.row(), m.qk_head_dim());
    for x in rows.chunks_exact_mut(row) {
        ops::rms_norm(&mut x[..r], &w.kv_norm, c.rms_norm_eps);
    }
    kv.k.extend_from_slice(&rows);
    kv.v.extend_from_slice(&rows);
    kv.positions.extend_from_slice(positions);
    // Absorbed queries [T, H, row], pre-scaled so that `attention`'s row^-½ becomes
    // qk_head_dim^-½.
    let fix = ((row as f32) / (qkd as f32)).sqrt();
    let mut qa = vec![0f32; t * nh * row];
    for ti in 0..t {
        for h in 0..nh {
            let src = &q[(ti * nh + h) * qkd..(ti * nh + h + 1) * qkd];
            let dst = &mut qa[(ti * nh + h) * row..(ti * nh + h + 1) * row];
            let uk = &w.w_uk[h * nope * r..(h + 1) * nope * r];
            for (n, &qn) in src[..nope].iter().enumerate() {
                for (y, &u) in dst[..r].iter_mut().zip(&uk[n * r..(n + 1) * r]) {
                    *y += qn * u;
                }
            }
            dst[r..].copy_from_slice(&src[nope..nope + rope]);
            dst.iter_mut().for_each(|y| *y *= fix);
        }
    }
    let lat = attention(&qa, positions, kv, nh, 1, row);
    let mut o = vec![0f32; t * nh * vd];
    for ti in 0..t {
        for h in 0..nh {
            let l = &lat[(ti * nh + h) * row..(ti * nh + h) * row + r];
            let uv = &w.w_uv[h * vd * r..(h + 1) * vd * r];
            for (e, y) in o[(ti * nh + h) * vd..(ti * nh + h + 1) * vd]
                .iter_mut()
                .enumerate()
            {
                *y = ops::dot(&uv[e * r..(e + 1) * r], l);
            }
        }
    }
    let k = rows.clone();
    (o, k, rows)
}

/// MLA for a span (projections, [`mix`], `o_proj`). Returns (output `[T, hidden]`,
/// span K rows, span V rows).
pub(crate) fn forward(
    c: &ModelConfig,
    w: &MlaWeights,
    x: &[f32],
    positions: &[i64],
    kv: &mut KvCache,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let t = positions.len();
    let (o, k, v) = mix(c, w, project(c, w, x, t), positions, kv);
    (
        linear(&o, t, c.num_heads * c.mla.v_head_dim, &w.o, c.hidden_size),
        k,
        v,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-s, s).
    fn vals(n: usize, seed: u64, s: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * s
            })
            .collect()
    }

    /// The absorbed latent form equals HF's expanded form (per-head keys
    /// `[W_uk c | k_rot]`, values `W_uv c`, scale `qk_head_dim^-½`), over a span that
    /// continues a cached prefix.
    #[test]
    fn absorbed_attention_equals_the_expanded_form() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden/kimi_linear");
        let c = ModelConfig::from_dir(&dir).unwrap();
        let m = c.mla;
        let (nh, r, nope, rope, vd) = (
            c.num_heads,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        );
        let (qkd, row) = (m.qk_head_dim(), m.row());
        let w = MlaWeights {
            q: vec![].into(),
            kv_a: vec![].into(),
            kv_norm: vals(r, 1, 1.0).iter().map(|x| 1.0 + 0.5 * x).collect(),
            w_uk: vals(nh * nope * r, 2, 0.3),
            w_uv: vals(nh * vd * r, 3, 0.3),
            o: vec![].into(),
        };
        let (t0, t) = (5usize, 7usize);
        let q_all = vals((t0 + t) * nh * qkd, 4, 1.0);
        let kva_all = vals((t0 + t) * row, 5, 1.0);
        let mut kv = KvCache::default();
        let pos: Vec<i64> = (0..(t0 + t) as i64).collect();
        mix(
            &c,
            &w,
            (
                q_all[..t0 * nh * qkd].to_vec(),
                kva_all[..t0 * row].to_vec(),
            ),
            &pos[..t0],
            &mut kv,
        );
        let (o, k, v) = mix(
            &c,
            &w,
            (
                q_all[t0 * nh * qkd..].to_vec(),
                kva_all[t0 * row..].to_vec(),
            ),
            &pos[t0..],
            &mut kv,
        );
        assert_eq!(k, v);
        assert_eq!(kv.len(), t0 + t);
        // Expanded reference in f64.
        let n = t0 + t;
        let lat: Vec<Vec<f64>> = (0..n)
            .map(|j| {
                let x = &kva_all[j * row..j * row + r];
                let ms = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / r as f64;
                let s = 1.0 / (ms + c.rms_norm_eps as f64).sqrt();
                x.iter()
                    .zip(&w.kv_norm)
                    .map(|(v, g)| *v as f64 * s * *g as f64)
                    .collect()
            })
            .collect();
        let mut worst = 0f64;
        for ti in 0..t {
            let qi = t0 + ti;
            for h in 0..nh {
                let q = &q_all[(qi * nh + h) * qkd..(qi * nh + h + 1) * qkd];
                let key = |j: usize| -> Vec<f64> {
                    let mut kk: Vec<f64> = (0..nope)
                        .map(|e| {
                            (0..r)
                                .map(|c_| w.w_uk[(h * nope + e) * r + c_] as f64 * lat[j][c_])
                                .sum()
                        })
                        .collect();
                    kk.extend(
                        kva_all[j * row + r..j * row + r + rope]
                            .iter()
                            .map(|x| *x as f64),
                    );
                    kk
                };
                let scores: Vec<f64> = (0..=qi)
                    .map(|j| {
                        key(j)
                            .iter()
                            .zip(q)
                            .map(|(a, b)| a * *b as f64)
                            .sum::<f64>()
                            / (qkd as f64).sqrt()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let den: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                for e in 0..vd {
                    let want: f64 = (0..=qi)
                        .map(|j| {
                            let vj: f64 = (0..r)
                                .map(|c_| w.w_uv[(h * vd + e) * r + c_] as f64 * lat[j][c_])
                                .sum();
                            (scores[j] - mx).exp() / den * vj
                        })
                        .sum();
                    let got = o[(ti * nh + h) * vd + e] as f64;
                    worst = worst.max((got - want).abs() / want.abs().max(1.0));
                }
            }
        }
        assert!(worst < 1e-5, "absorbed vs expanded: rel err {worst}");
    }
}
