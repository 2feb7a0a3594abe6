//! Deterministic random weights for benchmarking at real shapes without a checkpoint:
//! [`Model::random`] on the CPU and, with the same generator, `cuda::GpuModel::random`
//! on the device (kernel `dataplane/kernels/init.cu`), bit-identical in fp32.
//!
//! # Generator
//!
//! Counter-based, so any element can be produced independently (one GPU thread per
//! element, no host copy):
//!
//! * `mix(z)`: the SplitMix64 finaliser (Steele, Lea & Flood 2014; the constants of
//!   `java.util.SplittableRandom`);
//! * per tensor a key `key = mix(seed + mix(tensor_id + φ))` with `φ =
//!   0x9E3779B97F4A7C15` (wrapping arithmetic);
//! * element `i` (row-major index in the tensor's layout below) gets the 64 bits
//!   `r = mix(key + (i + 1)·φ)`: the `(i+1)`-th output of SplitMix64 seeded with `key`;
//! * `m = r >> 40` (24 uniform bits).
//!
//! # Distributions (HF transformers `_init_weights` of Qwen3-Next / Qwen3.5)
//!
//! * linear and embedding weights (`initializer_range` 0.02, HF draws
//!   `normal(0, 0.02)`): uniform with the same std, `s · b / 2²⁴` with the odd integer
//!   `s = 2m − (2²⁴ − 1)` and `b = 0.02·√3` (computed in f64, `b / 2²⁴` rounded to f32
//!   once); one f32 multiply of two exact operands, so CPU and GPU agree bit for bit;
//!   values in `(−b, b)`, mean 0, std 0.02;
//! * GDN causal conv weights (HF leaves `nn.Conv1d`'s default, kaiming-uniform with
//!   `a = √5`, i.e. uniform `±1/√fan_in`, `fan_in = K` for the depthwise conv): the
//!   same symmetric formula with `b = 1/√K`;
//! * `A_log = ln(A)`, `A = 1 + 15·u`, `u = m·2⁻²⁴ ∈ [0, 1)` (HF draws `A ~ U(0, 16)`;
//!   the interval starts at 1 to keep decay rates away from 0); the model stores
//!   `−exp(A_log) = −A`, computed as `−fma(15, u, 1)` (exactly rounded on both sides);
//! * `dt_bias`: ones (HF `torch.ones`);
//! * zero-centred RMSNorm weights (input / post-attention / final norm, q/k norm):
//!   zeros (HF init; the effective scale is `1 + w = 1`);
//! * GDN gated RMSNorm weight (not offset): ones (HF `Qwen3NextRMSNormGated`).
//!
//! # Tensor ids and layouts
//!
//! `tensor_id = slot` for global tensors, `((layer + 1) << 8) | slot` for per-layer
//! ones (see the `SLOT_*` constants). Layouts are the model's internal ones
//! (`model::GdnWeights`, `AttnWeights`, `Mlp`, `Moe`): the GDN in-projection is one
//! tensor `[conv_dim + value_dim + 2·Hv, hidden]` (rows `q | k | v | z | b | a`), the
//! routed experts of a layer are one `[E, 2I, hidden]` gate/up and one `[E, hidden, I]`
//! down tensor (expert `e` is the `e`-th block).
use crate::config::AttnProjLayout;
use crate::config::{MixerKind, ModelConfig};
use crate::model::{
    AttnWeights, Ffn, GdnWeights, KdaWeights, Layer, LightningWeights, Mixer, MlaWeights, Mlp,
    Model, Moe,
};
use crate::ops::Rope;
use rayon::prelude::*;

/// SplitMix64 increment φ (`0x9E3779B97F4A7C15`, 2⁶⁴ / golden ratio).
pub const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

/// Std of linear and embedding weights (HF `initializer_range`).
pub const INIT_STD: f64 = 0.02;

/// Embedding `[vocab, hidden]`.
pub const SLOT_EMBED: u64 = 1;
/// Untied LM head `[vocab, hidden]`.
pub const SLOT_LM_HEAD: u64 = 2;
/// GDN in-projection `[conv_dim + value_dim + 2·Hv, hidden]`.
pub const SLOT_GDN_IN: u64 = 10;
/// GDN conv weight `[conv_dim, K]`.
pub const SLOT_GDN_CONV: u64 = 11;
/// GDN `A` (stored as `−A`) `[Hv]`.
pub const SLOT_GDN_A: u64 = 12;
/// GDN out-projection `[hidden, value_dim]`.
pub const SLOT_GDN_OUT: u64 = 13;
/// Attention `q_proj` `[H·hd·(1+gate), hidden]`.
pub const SLOT_ATTN_Q: u64 = 20;
/// Attention `k_proj` `[Hkv·hd, hidden]`.
pub const SLOT_ATTN_K: u64 = 21;
/// Attention `v_proj` `[Hkv·hd, hidden]`.
pub const SLOT_ATTN_V: u64 = 22;
/// Attention `o_proj` `[hidden, H·hd]`.
pub const SLOT_ATTN_O: u64 = 23;
/// Dense MLP gate/up `[2I, hidden]`.
pub const SLOT_MLP_GATE_UP: u64 = 30;
/// Dense MLP down `[hidden, I]`.
pub const SLOT_MLP_DOWN: u64 = 31;
/// MoE router `[E, hidden]`.
pub const SLOT_MOE_ROUTER: u64 = 40;
/// Routed experts' gate/up `[E, 2I, hidden]`.
pub const SLOT_MOE_GATE_UP: u64 = 41;
/// Routed experts' down `[E, hidden, I]`.
pub const SLOT_MOE_DOWN: u64 = 42;
/// Shared expert gate/up `[2Is, hidden]`.
pub const SLOT_SHARED_GATE_UP: u64 = 43;
/// Shared expert down `[hidden, Is]`.
pub const SLOT_SHARED_DOWN: u64 = 44;
/// Shared expert scalar gate `[1, hidden]`.
pub const SLOT_SHARED_GATE: u64 = 45;
/// Fused attention `query_key_value` `[(H + 2·Hkv)·hd, hidden]`
/// ([`AttnProjLayout::FusedQkv`]; rows q | k | v).
pub const SLOT_ATTN_QKV: u64 = 24;
/// Lightning `query_key_value` `[3·H·d, hidden]`.
pub const SLOT_LIGHTNING_QKV: u64 = 50;
/// Lightning output gate `g_proj` `[H·d, hidden]`.
pub const SLOT_LIGHTNING_G: u64 = 51;
/// Lightning output projection `dense` `[hidden, H·d]`.
pub const SLOT_LIGHTNING_DENSE: u64 = 52;
/// KDA merged input projection `[3·H·d + 2·d + H, hidden]` (rows `q | k | v | f_a |
/// g_a | b`).
pub const SLOT_KDA_IN: u64 = 60;
/// KDA forget-gate up projection `f_b_proj` `[H·d, d]`.
pub const SLOT_KDA_FB: u64 = 61;
/// KDA output-gate up projection `g_b_proj` `[H·d, d]`.
pub const SLOT_KDA_GB: u64 = 62;
/// KDA conv weights `[3·H·d, K]` (channels `q | k | v`).
pub const SLOT_KDA_CONV: u64 = 63;
/// KDA `A` (stored as `−A`) `[H]`.
pub const SLOT_KDA_A: u64 = 64;
/// KDA `o_proj` `[hidden, H·d]`.
pub const SLOT_KDA_O: u64 = 65;
/// MLA `q_proj` `[H·qk_head_dim, hidden]`.
pub const SLOT_MLA_Q: u64 = 70;
/// MLA `kv_a_proj_with_mqa` `[kv_lora_rank + qk_rope_head_dim, hidden]`.
pub const SLOT_MLA_KV_A: u64 = 71;
/// MLA `kv_b_proj` `[H·(qk_nope_head_dim + v_head_dim), kv_lora_rank]`.
pub const SLOT_MLA_KV_B: u64 = 72;
/// MLA `o_proj` `[hidden, H·v_head_dim]`.
pub const SLOT_MLA_O: u64 = 73;

/// SplitMix64 finaliser.
#[inline]
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Tensor id of a global (`layer = None`) or per-layer tensor.
pub fn tensor_id(layer: Option<usize>, slot: u64) -> u64 {
    match layer {
        None => slot,
        Some(l) => ((l as u64 + 1) << 8) | slot,
    }
}

/// Per-tensor key `mix(seed + mix(tensor_id + φ))`.
pub fn tensor_key(seed: u64, tensor_id: u64) -> u64 {
    mix(seed.wrapping_add(mix(tensor_id.wrapping_add(PHI))))
}

/// 24 uniform bits of element `i` of the tensor with key `key`.
#[inline]
pub fn bits24(key: u64, i: u64) -> u32 {
    (mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(PHI))) >> 40) as u32
}

/// The f32 scale `b / 2²⁴` of a symmetric uniform with bound `b`.
pub fn sym_scale(bound: f64) -> f32 {
    (bound / 16_777_216.0) as f32
}

/// Bound of the linear/embedding uniform: `0.02·√3`.
pub fn linear_bound() -> f64 {
    INIT_STD * 3f64.sqrt()
}

/// Bound of the conv uniform: `1/√K`.
pub fn conv_bound(k: usize) -> f64 {
    1.0 / (k.max(1) as f64).sqrt()
}

/// Symmetric uniform value of element `i`: `(2m − (2²⁴−1)) · scale`.
#[inline]
pub fn sym_value(key: u64, i: u64, scale: f32) -> f32 {
    let s = 2 * bits24(key, i) as i32 - ((1 << 24) - 1);
    s as f32 * scale
}

/// `−A` for element `i`: `−fma(15, m·2⁻²⁴, 1)`.
#[inline]
pub fn neg_a_value(key: u64, i: u64) -> f32 {
    let u = bits24(key, i) as f32 * (1.0 / 16_777_216.0);
    -(15.0f32.mul_add(u, 1.0))
}

/// `n` symmetric uniform values of tensor `tensor_id` (elements `0..n`).
pub fn sym_tensor(seed: u64, tensor_id: u64, n: usize, bound: f64) -> Vec<f32> {
    let key = tensor_key(seed, tensor_id);
    let scale = sym_scale(bound);
    let mut v = vec![0f32; n];
    v.par_chunks_mut(1 << 16).enumerate().for_each(|(c, ch)| {
        let base = (c << 16) as u64;
        for (j, x) in ch.iter_mut().enumerate() {
            *x = sym_value(key, base + j as u64, scale);
        }
    });
    v
}

fn lin(seed: u64, layer: Option<usize>, slot: u64, n: usize) -> Vec<f32> {
    sym_tensor(seed, tensor_id(layer, slot), n, linear_bound())
}

fn mlp(seed: u64, l: usize, gu: u64, dn: u64, h: usize, inter: usize) -> Mlp {
    Mlp {
        gate_up: lin(seed, Some(l), gu, 2 * inter * h).into(),
        down: lin(seed, Some(l), dn, h * inter).into(),
        inter,
    }
}

/// Parameter counts of a config (elements, not bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every weight, including the embedding, LM head and every routed expert.
    pub total: usize,
    /// Of `total`, the fp32-kept small tensors: norm weights, conv weights, `A`,
    /// `dt_bias` (the rest is stored in the model's element type).
    pub small_f32: usize,
    /// Weights touched per token by the matrix products (projections, router, the
    /// top-k routed experts and the shared expert, LM head); no embedding (a gather),
    /// no small fp32 tensors.
    pub active_matmul: usize,
}

impl ParamCounts {
    /// Counts for `c`.
    pub fn of(c: &ModelConfig) -> ParamCounts {
        let h = c.hidden_size;
        let mut p = ParamCounts::default();
        let vh = c.vocab_size * h;
        p.total += vh + if c.tie_word_embeddings { 0 } else { vh };
        p.active_matmul += vh;
        p.small_f32 += h;
        for l in 0..c.num_layers {
            p.small_f32 += 2 * h;
            let m = match c.mixers[l] {
                MixerKind::GatedDeltaNet => {
                    let hv = c.linear_v_heads;
                    p.small_f32 += c.conv_dim() * c.conv_kernel + 2 * hv + c.linear_v_dim;
                    (c.conv_dim() + c.value_dim() + 2 * hv) * h + h * c.value_dim()
                }
                MixerKind::Attention => {
                    let hd = c.head_dim;
                    p.small_f32 += 2 * hd;
                    let qw = c.num_heads * hd * if c.attn_output_gate { 2 } else { 1 };
                    (qw + 2 * c.num_kv_heads * hd) * h + h * c.num_heads * hd
                }
                MixerKind::Lightning => {
                    let wd = c.linear_v_heads * c.linear_v_dim;
                    p.small_f32 += 2 * c.linear_k_dim + wd;
                    3 * wd * h + wd * h + h * wd
                }
                MixerKind::Kda => {
                    let (d, wd) = (c.linear_k_dim, c.linear_v_heads * c.linear_v_dim);
                    p.small_f32 += 3 * wd * c.conv_kernel + c.linear_v_heads + wd + d;
                    (3 * wd + 2 * d + c.linear_v_heads) * h + 2 * wd * d + h * wd
                }
                MixerKind::Mla => {
                    let m = &c.mla;
                    let nh = c.num_heads;
                    p.small_f32 += m.kv_lora_rank;
                    nh * m.qk_head_dim() * h
                        + m.row() * h
                        + nh * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
                        + h * nh * m.v_head_dim
                }
            };
            p.total += m;
            p.active_matmul += m;
            if c.layer_is_moe[l] {
                let (e, i, si) = (
                    c.num_experts,
                    c.moe_intermediate_size,
                    c.shared_expert_intermediate_size,
                );
                let gate = if c.names.shared_expert_gate.is_some() {
                    h
                } else {
                    0
                };
                let shared = if si > 0 { 3 * si * h + gate } else { 0 };
                p.small_f32 += if c.router.selection_bias.is_some() {
                    e
                } else {
                    0
                };
                p.total += e * h + e * 3 * i * h + shared;
                p.active_matmul += e * h + c.experts_per_tok * 3 * i * h + shared;
            } else {
                p.total += 3 * c.intermediate_size * h;
                p.active_matmul += 3 * c.intermediate_size * h;
            }
        }
        p.total += p.small_f32;
        p
    }

    /// Device bytes of the weights with `elem_bytes` per large-tensor element (fp32
    /// small tensors at 4 bytes).
    pub fn bytes(&self, elem_bytes: usize) -> usize {
        (self.total - self.small_f32) * elem_bytes + 4 * self.small_f32
    }
}

impl Model {
    /// A model with deterministic random weights (see the module docs for the exact
    /// generator and distributions), all fp32 on the host. Holds `4·params` bytes:
    /// meant for small configs and as the CPU reference of `GpuModel::random`.
    pub fn random(config: ModelConfig, seed: u64) -> Model {
        let c = &config;
        let h = c.hidden_size;
        let embed = lin(seed, None, SLOT_EMBED, c.vocab_size * h).into();
        let lm_head = (!c.tie_word_embeddings)
            .then(|| lin(seed, None, SLOT_LM_HEAD, c.vocab_size * h).into());
        let (hv, hd) = (c.linear_v_heads, c.head_dim);
        let layers = (0..c.num_layers)
            .map(|l| {
                let mixer = match c.mixers[l] {
                    MixerKind::GatedDeltaNet => {
                        let key_a = tensor_key(seed, tensor_id(Some(l), SLOT_GDN_A));
                        Mixer::GatedDeltaNet(GdnWeights {
                            w_in: lin(
                                seed,
                                Some(l),
                                SLOT_GDN_IN,
                                (c.conv_dim() + c.value_dim() + 2 * hv) * h,
                            ),
                            conv: sym_tensor(
                                seed,
                                tensor_id(Some(l), SLOT_GDN_CONV),
                                c.conv_dim() * c.conv_kernel,
                                conv_bound(c.conv_kernel),
                            ),
                            neg_a: (0..hv as u64).map(|i| neg_a_value(key_a, i)).collect(),
                            dt_bias: vec![1.0; hv],
                            norm: vec![1.0; c.linear_v_dim],
                            out: lin(seed, Some(l), SLOT_GDN_OUT, h * c.value_dim()).into(),
                        })
                    }
                    MixerKind::Attention => {
                        let qw = c.num_heads * hd * if c.attn_output_gate { 2 } else { 1 };
                        let kv = c.num_kv_heads * hd;
                        let (q, k, v) = match c.attn_proj {
                            AttnProjLayout::Split => (
                                lin(seed, Some(l), SLOT_ATTN_Q, qw * h),
                                lin(seed, Some(l), SLOT_ATTN_K, kv * h),
                                lin(seed, Some(l), SLOT_ATTN_V, kv * h),
                            ),
                            AttnProjLayout::FusedQkv => {
                                let f = lin(seed, Some(l), SLOT_ATTN_QKV, (qw + 2 * kv) * h);
                                (
                                    f[..qw * h].to_vec(),
                                    f[qw * h..(qw + kv) * h].to_vec(),
                                    f[(qw + kv) * h..].to_vec(),
                                )
                            }
                        };
                        Mixer::Attention(AttnWeights {
                            q: q.into(),
                            k: k.into(),
                            v: v.into(),
                            o: lin(seed, Some(l), SLOT_ATTN_O, h * c.num_heads * hd).into(),
                            q_norm: vec![0.0; hd],
                            k_norm: vec![0.0; hd],
                        })
                    }
                    MixerKind::Lightning => {
                        let wd = c.linear_v_heads * c.linear_v_dim;
                        Mixer::Lightning(LightningWeights {
                            qkv: lin(seed, Some(l), SLOT_LIGHTNING_QKV, 3 * wd * h).into(),
                            q_norm: vec![0.0; c.linear_k_dim],
                            k_norm: vec![0.0; c.linear_k_dim],
                            g_proj: lin(seed, Some(l), SLOT_LIGHTNING_G, wd * h).into(),
                            g_norm: vec![1.0; wd],
                            dense: lin(seed, Some(l), SLOT_LIGHTNING_DENSE, h * wd).into(),
                            log_decay: crate::mixers::lightning::layer::layer_log_decay(c, l),
                        })
                    }
                    MixerKind::Kda => {
                        let (d, nh) = (c.linear_k_dim, c.linear_v_heads);
                        let wd = nh * c.linear_v_dim;
                        let n_in = 3 * wd + 2 * d + nh;
                        let key_a = tensor_key(seed, tensor_id(Some(l), SLOT_KDA_A));
                        Mixer::Kda(KdaWeights {
                            w_in: lin(seed, Some(l), SLOT_KDA_IN, n_in * h).into(),
                            f_b: lin(seed, Some(l), SLOT_KDA_FB, wd * d).into(),
                            g_b: lin(seed, Some(l), SLOT_KDA_GB, wd * d).into(),
                            conv: sym_tensor(
                                seed,
                                tensor_id(Some(l), SLOT_KDA_CONV),
                                3 * wd * c.conv_kernel,
                                conv_bound(c.conv_kernel),
                            ),
                            neg_a: (0..nh as u64).map(|i| neg_a_value(key_a, i)).collect(),
                            dt_bias: vec![1.0; wd],
                            o_norm: vec![1.0; d],
                            o_proj: lin(seed, Some(l), SLOT_KDA_O, h * wd).into(),
                        })
                    }
                    MixerKind::Mla => {
                        let m = &c.mla;
                        let (nh, r) = (c.num_heads, m.kv_lora_rank);
                        let (nope, vd) = (m.qk_nope_head_dim, m.v_head_dim);
                        let kv_b = lin(seed, Some(l), SLOT_MLA_KV_B, nh * (nope + vd) * r);
                        let mut w_uk = Vec::with_capacity(nh * nope * r);
                        let mut w_uv = Vec::with_capacity(nh * vd * r);
                        for head in kv_b.chunks_exact((nope + vd) * r) {
                            w_uk.extend_from_slice(&head[..nope * r]);
                            w_uv.extend_from_slice(&head[nope * r..]);
                        }
                        Mixer::Mla(MlaWeights {
                            q: lin(seed, Some(l), SLOT_MLA_Q, nh * m.qk_head_dim() * h).into(),
                            kv_a: lin(seed, Some(l), SLOT_MLA_KV_A, m.row() * h).into(),
                            kv_norm: vec![1.0; r],
                            w_uk,
                            w_uv,
                            o: lin(seed, Some(l), SLOT_MLA_O, h * nh * vd).into(),
                        })
                    }
                };
                let ffn = if c.layer_is_moe[l] {
                    let (e, i) = (c.num_experts, c.moe_intermediate_size);
                    let gu = lin(seed, Some(l), SLOT_MOE_GATE_UP, e * 2 * i * h);
                    let dn = lin(seed, Some(l), SLOT_MOE_DOWN, e * h * i);
                    let experts = (0..e)
                        .map(|j| Mlp {
                            gate_up: gu[j * 2 * i * h..(j + 1) * 2 * i * h].to_vec().into(),
                            down: dn[j * h * i..(j + 1) * h * i].to_vec().into(),
                            inter: i,
                        })
                        .collect();
                    let si = c.shared_expert_intermediate_size;
                    let shared_mlp = (si > 0)
                        .then(|| mlp(seed, l, SLOT_SHARED_GATE_UP, SLOT_SHARED_DOWN, h, si));
                    let (shared, shared_plain) = match c.names.shared_expert_gate {
                        Some(_) => (
                            shared_mlp.map(|m| (m, lin(seed, Some(l), SLOT_SHARED_GATE, h).into())),
                            None,
                        ),
                        None => (None, shared_mlp),
                    };
                    Ffn::Moe(Moe {
                        router: lin(seed, Some(l), SLOT_MOE_ROUTER, e * h).into(),
                        // HF initialises the selection bias to zeros.
                        bias: c.router.selection_bias.map(|_| vec![0.0; e]),
                        experts,
                        shared,
                        shared_plain,
                    })
                } else {
                    Ffn::Dense(mlp(
                        seed,
                        l,
                        SLOT_MLP_GATE_UP,
                        SLOT_MLP_DOWN,
                        h,
                        c.intermediate_size,
                    ))
                };
                Layer {
                    input_norm: vec![0.0; h],
                    post_norm: vec![0.0; h],
                    mixer,
                    ffn,
                }
            })
            .collect();
        let rope = Rope::new(c.rotary_dim, c.rope_theta);
        Model {
            embed,
            final_norm: vec![0.0; h],
            lm_head,
            layers,
            rope,
            config,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn golden(name: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(name);
        ModelConfig::from_dir(&dir).unwrap()
    }

    #[test]
    fn splitmix_reference_values() {
        // SplitMix64 seeded with 1234567: first outputs per the reference algorithm
        // (state += φ; mix(state)).
        let mut state: u64 = 1234567;
        for i in 0..4u64 {
            state = state.wrapping_add(PHI);
            assert_eq!(
                mix(state),
                mix(1234567u64.wrapping_add((i + 1).wrapping_mul(PHI)))
            );
        }
        // Known first value of SplitMix64(seed 0): 0xE220A8397B1DCDAF.
        assert_eq!(mix(PHI), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn qwen3_5_35b_a3b_config_parses() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/configs/qwen3_5_35b_a3b");
        let c = ModelConfig::from_dir(&dir).unwrap();
        let lin = c
            .mixers
            .iter()
            .filter(|k| **k == MixerKind::GatedDeltaNet)
            .count();
        let full = c
            .mixers
            .iter()
            .filter(|k| **k == MixerKind::Attention)
            .count();
        assert_eq!((c.num_layers, lin, full), (40, 30, 10));
        assert!(c
            .mixers
            .iter()
            .skip(3)
            .step_by(4)
            .all(|k| *k == MixerKind::Attention));
        assert_eq!((c.hidden_size, c.vocab_size), (2048, 248_320));
        assert_eq!(
            (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim),
            (16, 2, 256, 64)
        );
        assert!(c.attn_output_gate && !c.tie_word_embeddings && c.norm_topk_prob);
        assert_eq!(c.rope_theta, 1e7);
        assert_eq!(
            (
                c.linear_k_heads,
                c.linear_v_heads,
                c.linear_k_dim,
                c.linear_v_dim
            ),
            (16, 32, 128, 128)
        );
        assert_eq!(c.conv_kernel, 4);
        assert_eq!(
            (c.num_experts, c.experts_per_tok, c.moe_intermediate_size),
            (256, 8, 512)
        );
        assert_eq!(c.shared_expert_intermediate_size, 512);
        assert!(c.layer_is_moe.iter().all(|&m| m));
        assert_eq!(c.max_position_embeddings, 262_144);
        assert_eq!(c.rms_norm_eps, 1e-6);
        let p = ParamCounts::of(&c);
        // ~35B total, ~3B active (Qwen3.5-35B-A3B).
        assert!((34_000_000_000..36_000_000_000).contains(&p.total), "{p:?}");
        assert!(
            (2_500_000_000..3_500_000_000).contains(&p.active_matmul),
            "{p:?}"
        );
    }

    #[test]
    fn kimi_linear_48b_a3b_config_counts() {
        let dir =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/configs/kimi_linear_48b_a3b");
        let c = ModelConfig::from_dir(&dir).unwrap();
        let kda = c.mixers.iter().filter(|k| **k == MixerKind::Kda).count();
        let mla = c.mixers.iter().filter(|k| **k == MixerKind::Mla).count();
        assert_eq!((c.num_layers, kda, mla), (27, 20, 7));
        let p = ParamCounts::of(&c);
        // ~48B total (49.1B counted), ~3B active (Kimi-Linear-48B-A3B).
        assert!((48_000_000_000..50_500_000_000).contains(&p.total), "{p:?}");
        assert!(
            (2_500_000_000..3_500_000_000).contains(&p.active_matmul),
            "{p:?}"
        );
    }

    #[test]
    fn param_counts_match_random_model() {
        for name in [
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "bailing_moe_linear",
            "kimi_linear",
        ] {
            let c = golden(name);
            let m = Model::random(c.clone(), 1);
            let mut n =
                m.embed.len() + m.final_norm.len() + m.lm_head.as_ref().map_or(0, |w| w.len());
            for l in &m.layers {
                n += l.input_norm.len() + l.post_norm.len();
                n += match &l.mixer {
                    Mixer::GatedDeltaNet(g) => {
                        g.w_in.len()
                            + g.conv.len()
                            + g.neg_a.len()
                            + g.dt_bias.len()
                            + g.norm.len()
                            + g.out.len()
                    }
                    Mixer::Attention(a) => {
                        a.q.len()
                            + a.k.len()
                            + a.v.len()
                            + a.o.len()
                            + a.q_norm.len()
                            + a.k_norm.len()
                    }
                    Mixer::Lightning(w) => {
                        w.qkv.len()
                            + w.q_norm.len()
                            + w.k_norm.len()
                            + w.g_proj.len()
                            + w.g_norm.len()
                            + w.dense.len()
                    }
                    Mixer::Kda(w) => {
                        w.w_in.len()
                            + w.f_b.len()
                            + w.g_b.len()
                            + w.conv.len()
                            + w.neg_a.len()
                            + w.dt_bias.len()
                            + w.o_norm.len()
                            + w.o_proj.len()
                    }
                    Mixer::Mla(w) => {
                        w.q.len()
                            + w.kv_a.len()
                            + w.kv_norm.len()
                            + w.w_uk.len()
                            + w.w_uv.len()
                            + w.o.len()
                    }
                };
                n += match &l.ffn {
                    Ffn::Dense(d) => d.gate_up.len() + d.down.len(),
                    Ffn::Moe(mo) => {
                        mo.router.len()
                            + mo.experts
                                .iter()
                                .map(|e| e.gate_up.len() + e.down.len())
                                .sum::<usize>()
                            + mo.shared
                                .as_ref()
                                .map_or(0, |(s, g)| s.gate_up.len() + s.down.len() + g.len())
                            + mo.shared_plain
                                .as_ref()
                                .map_or(0, |s| s.gate_up.len() + s.down.len())
                            + mo.bias.as_ref().map_or(0, Vec::len)
                    }
                };
            }
            assert_eq!(ParamCounts::of(&c).total, n, "{name}");
        }
    }

    #[test]
    fn random_model_is_deterministic_and_shaped() {
        for name in [
            "qwen3_next",
            "qwen3_5",
            "qwen3_5_moe",
            "bailing_moe_linear",
            "kimi_linear",
        ] {
            let c = golden(name);
            let a = Model::random(c.clone(), 7);
            let b = Model::random(c.clone(), 7);
            let d = Model::random(c.clone(), 8);
            assert_eq!(a.embed, b.embed);
            assert_ne!(a.embed, d.embed);
            assert_eq!(a.embed.len(), c.vocab_size * c.hidden_size);
            assert_eq!(a.layers.len(), c.num_layers);
            // Std and bound of the embedding (n = vocab·hidden ≥ 20k values).
            let n = a.embed.len() as f64;
            let mean = a.embed.iter().map(|&x| x as f64).sum::<f64>() / n;
            let std = (a
                .embed
                .iter()
                .map(|&x| (x as f64 - mean).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            assert!(mean.abs() < 1e-3, "{name}: mean {mean}");
            assert!((std - 0.02).abs() < 0.001, "{name}: std {std}");
            let b = linear_bound() as f32;
            assert!(a.embed.iter().all(|x| x.abs() < b));
            for (l, layer) in a.layers.iter().enumerate() {
                assert!(layer.input_norm.iter().all(|&x| x == 0.0));
                match (&layer.mixer, c.mixers[l]) {
                    (Mixer::GatedDeltaNet(g), MixerKind::GatedDeltaNet) => {
                        assert!(g.neg_a.iter().all(|&x| (-16.0..=-1.0).contains(&x)));
                        assert_eq!(
                            g.w_in.len(),
                            (c.conv_dim() + c.value_dim() + 2 * c.linear_v_heads) * c.hidden_size
                        );
                        let cb = conv_bound(c.conv_kernel) as f32;
                        assert!(g.conv.iter().all(|x| x.abs() < cb));
                    }
                    (Mixer::Attention(w), MixerKind::Attention) => {
                        assert_eq!(w.k.len(), c.num_kv_heads * c.head_dim * c.hidden_size);
                    }
                    (Mixer::Lightning(w), MixerKind::Lightning) => {
                        assert!(w.log_decay.iter().all(|&g| g < 0.0));
                    }
                    (Mixer::Kda(w), MixerKind::Kda) => {
                        assert!(w.neg_a.iter().all(|&x| (-16.0..=-1.0).contains(&x)));
                        let cb = conv_bound(c.conv_kernel) as f32;
                        assert!(w.conv.iter().all(|x| x.abs() < cb));
                    }
                    (Mixer::Mla(w), MixerKind::Mla) => {
                        assert_eq!(w.kv_norm.len(), c.mla.kv_lora_rank);
                    }
                    _ => panic!("{name}: layer {l} kind mismatch"),
                }
            }
            // The random model runs.
            let mut st = a.new_state();
            let out = a
                .prefill(&[1, 2, 3], &mut st, crate::model::Logits::Last)
                .unwrap();
            assert_eq!(out.logits.len(), c.vocab_size);
            assert!(out.logits.iter().all(|x| x.is_finite()));
        }
    }
}
