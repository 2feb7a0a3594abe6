//! Ring-linear-2.0 (`model_type: bailing_moe_linear`, HF
//! `BailingMoeLinearV2ForCausalLM`: Ring-mini-linear-2.0, Ring-flash-linear-2.0).
//!
//! Layers: full attention where `(i + 1) % layer_group_size == 0` (and, as in the
//! HF remote code and mlx-lm, every layer past the last whole group), Lightning
//! attention ([`MixerKind::Lightning`]) elsewhere; a dense SwiGLU MLP below
//! `first_k_dense_replace`, a MoE block (sigmoid router with `expert_bias`, grouped
//! top-k, ungated shared experts) from there on. Plain RMSNorm everywhere
//! ([`NormStyle::Plain`]). Tensors: `model.word_embeddings`, `model.norm`,
//! `lm_head`, `model.layers.{i}.attention.{query_key_value, dense,
//! query_layernorm, key_layernorm, g_proj, g_norm}`, `mlp.gate.{weight,
//! expert_bias}`, `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts.*`;
//! the multi-token-prediction layers `model.mtp*` are not loaded.
//!
//! Defaults of optional keys: SGLang's `BailingMoeLinearConfig` (the config class
//! inclusionAI serves these checkpoints with) where it names the key, otherwise
//! mlx-lm 0.32 `bailing_moe_linear.ModelArgs`; each is written on its field.
use super::{parse, rotary_dim, FamilyEntry};
use crate::config::{
    cfg_err, AttnProjLayout, InProjLayout, LightningConfig, ModelConfig, NormStyle, SlopeRule,
    TensorNames,
};
use crate::error::Result;
use crate::mixers::MixerKind;
use crate::router::{RouterConfig, ScoreFunction};
use serde::Deserialize;
use serde_json::Value;

/// The registry entry.
pub const FAMILY: FamilyEntry = FamilyEntry {
    name: "bailing_moe_linear",
    model_types: &["bailing_moe_linear"],
    decoder_config,
};

/// The keys of a Ring-linear-2.0 config.json that the data plane reads (others are
/// ignored). `Option` fields take the default noted on each when absent or `null`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct BailingMoeLinearConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Dense-MLP width (layers below `first_k_dense_replace`).
    pub intermediate_size: usize,
    /// Decoder layers (the MTP layers are counted apart).
    pub num_hidden_layers: usize,
    /// Query heads (also the key/value heads of the Lightning layers).
    pub num_attention_heads: usize,
    /// KV heads of the full-attention layers (default 4).
    pub num_key_value_heads: Option<usize>,
    /// Head dim (default `hidden_size / num_attention_heads`; must equal it, since
    /// the Lightning layers use that width).
    pub head_dim: Option<usize>,
    /// Context limit (default 32768).
    pub max_position_embeddings: Option<usize>,
    /// RMSNorm epsilon (default 1e-6).
    pub rms_norm_eps: Option<f64>,
    /// RoPE base θ (default 600000).
    pub rope_theta: Option<f64>,
    /// Rotating fraction of each head (default 1.0).
    pub partial_rotary_factor: Option<f64>,
    /// RoPE scaling: only `null` (no scaling) is supported.
    pub rope_scaling: Option<Value>,
    /// LM head tied to the embedding (default false).
    pub tie_word_embeddings: Option<bool>,
    /// q/k RMSNorm in both attention kinds (default true; false is not supported).
    pub use_qk_norm: Option<bool>,
    /// Bias on `query_key_value` (default false; true is not supported).
    pub use_qkv_bias: Option<bool>,
    /// Bias on the other projections (default false; true is not supported).
    pub use_bias: Option<bool>,
    /// Every n-th layer is full attention (default 1).
    pub layer_group_size: Option<usize>,
    /// Groups of the Lightning output norm `g_norm` (default 1).
    pub group_norm_size: Option<usize>,
    /// SiLU on the Lightning q|k|v projection (default false).
    pub linear_silu: Option<bool>,
    /// Layers below this index use the dense MLP (default 1).
    pub first_k_dense_replace: Option<usize>,
    /// Routed experts (default 256; `null` or 0: dense MLP everywhere).
    pub num_experts: Option<usize>,
    /// Experts per token (default 8).
    pub num_experts_per_tok: Option<usize>,
    /// Routed expert width (default 512).
    pub moe_intermediate_size: Option<usize>,
    /// Shared experts (default 1), fused into one MLP of
    /// `num_shared_experts × moe_shared_expert_intermediate_size`.
    pub num_shared_experts: Option<usize>,
    /// Width of one shared expert (default `moe_intermediate_size`).
    pub moe_shared_expert_intermediate_size: Option<usize>,
    /// Renormalise the top-k weights (default true).
    pub norm_topk_prob: Option<bool>,
    /// Router score function, `sigmoid` or `softmax` (default `sigmoid`).
    pub score_function: Option<String>,
    /// Router selection bias `mlp.gate.expert_bias` (default true).
    pub moe_router_enable_expert_bias: Option<bool>,
    /// Expert groups (default 8).
    pub n_group: Option<usize>,
    /// Groups kept per token (default 4).
    pub topk_group: Option<usize>,
    /// Factor on the routing weights (default 1.0).
    pub routed_scaling_factor: Option<f64>,
    /// HYPIC key (not in HF configs): the per-layer factor of the Lightning slopes,
    /// `absolute` (default: `1 − l/(L−1) + 1e-5`, as SGLang and vLLM), `mlx_lm`
    /// or `layer_minus_one` ([`SlopeRule`]).
    pub lightning_slope_rule: Option<String>,
}

/// Whether layer `i` of `n` is a full-attention layer: `(i + 1) % group == 0`, or
/// `i` past the last whole group (the HF remote code's tail rule; it never applies
/// to the published checkpoints, whose layer counts are multiples of the group).
pub fn is_full_attention(i: usize, n: usize, group: usize) -> bool {
    let g = group.max(1);
    (i + 1).is_multiple_of(g) || i >= n / g * g
}

impl BailingMoeLinearConfig {
    /// The decoder description (unvalidated; [`super::decoder_config`] validates).
    ///
    /// Errors: an unsupported option (qkv or projection bias, no q/k norm, RoPE
    /// scaling, an unknown score function or slope rule), a head dim that is not
    /// `hidden_size / num_attention_heads`, a group count that does not divide the
    /// channels (each named).
    pub fn to_decoder(&self, model_type: &str) -> Result<ModelConfig> {
        let c = self;
        let n = c.num_hidden_layers;
        let heads = c.num_attention_heads;
        if heads == 0 || !c.hidden_size.is_multiple_of(heads) {
            return Err(cfg_err(
                "num_attention_heads",
                "must be > 0 and divide hidden_size",
            ));
        }
        let d = c.hidden_size / heads;
        let head_dim = c.head_dim.unwrap_or(d);
        if head_dim != d {
            return Err(cfg_err(
                "head_dim",
                &format!(
                    "{head_dim} differs from hidden_size / num_attention_heads = {d}, \
                     the head width of the Lightning layers; not supported"
                ),
            ));
        }
        if c.use_qkv_bias.unwrap_or(false) {
            return Err(cfg_err("use_qkv_bias", "true is not supported"));
        }
        if c.use_bias.unwrap_or(false) {
            return Err(cfg_err("use_bias", "true is not supported"));
        }
        if !c.use_qk_norm.unwrap_or(true) {
            return Err(cfg_err("use_qk_norm", "false is not supported"));
        }
        if c.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(cfg_err("rope_scaling", "RoPE scaling is not supported"));
        }
        let group = c.layer_group_size.unwrap_or(1);
        if group == 0 {
            return Err(cfg_err("layer_group_size", "must be > 0"));
        }
        let mixers: Vec<MixerKind> = (0..n)
            .map(|i| {
                if is_full_attention(i, n, group) {
                    MixerKind::Attention
                } else {
                    MixerKind::Lightning
                }
            })
            .collect();
        let groups = c.group_norm_size.unwrap_or(1);
        if groups == 0 || !(heads * d).is_multiple_of(groups) {
            return Err(cfg_err(
                "group_norm_size",
                &format!(
                    "must be > 0 and divide num_attention_heads × head_dim = {}",
                    heads * d
                ),
            ));
        }
        let slope_rule = match c.lightning_slope_rule.as_deref() {
            None => SlopeRule::default(),
            Some(s) => SlopeRule::parse(s).ok_or_else(|| {
                cfg_err(
                    "lightning_slope_rule",
                    &format!("\"{s}\": expected \"absolute\", \"mlx_lm\" or \"layer_minus_one\""),
                )
            })?,
        };
        let num_experts = c.num_experts.unwrap_or(256);
        let first_dense = c.first_k_dense_replace.unwrap_or(1);
        let layer_is_moe: Vec<bool> = (0..n)
            .map(|i| num_experts > 0 && i >= first_dense)
            .collect();
        let moe_i = c.moe_intermediate_size.unwrap_or(512);
        let shared = c.num_shared_experts.unwrap_or(1)
            * c.moe_shared_expert_intermediate_size.unwrap_or(moe_i);
        let score = match c.score_function.as_deref().unwrap_or("sigmoid") {
            "sigmoid" => ScoreFunction::Sigmoid,
            "softmax" => ScoreFunction::Softmax,
            other => {
                return Err(cfg_err(
                    "score_function",
                    &format!("\"{other}\": expected \"sigmoid\" or \"softmax\""),
                ))
            }
        };
        let router = RouterConfig {
            score,
            selection_bias: c
                .moe_router_enable_expert_bias
                .unwrap_or(true)
                .then_some("gate.expert_bias"),
            n_group: c.n_group.unwrap_or(8),
            topk_group: c.topk_group.unwrap_or(4),
            routed_scaling_factor: c.routed_scaling_factor.unwrap_or(1.0) as f32,
            dropped_group_score: 0.0,
            renorm_single: false,
        };
        let names = TensorNames {
            embed: "word_embeddings.weight",
            attention: "attention.",
            lightning: "attention.",
            shared_expert: "shared_experts.",
            shared_expert_gate: None,
            ..TensorNames::qwen("model.")
        };
        Ok(ModelConfig {
            model_type: model_type.to_string(),
            family: FAMILY.name,
            names,
            gdn_in_proj: InProjLayout::Split,
            hidden_size: c.hidden_size,
            num_layers: n,
            vocab_size: c.vocab_size,
            mixers,
            num_heads: heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(4),
            head_dim,
            rotary_dim: rotary_dim(head_dim, c.partial_rotary_factor.unwrap_or(1.0)),
            rope_theta: c.rope_theta.unwrap_or(600_000.0),
            attn_output_gate: false,
            linear_k_heads: heads,
            linear_v_heads: heads,
            linear_k_dim: d,
            linear_v_dim: d,
            // No causal conv: a kernel of 1 leaves an empty conv tail.
            conv_kernel: 1,
            num_experts,
            experts_per_tok: if num_experts > 0 {
                c.num_experts_per_tok.unwrap_or(8)
            } else {
                0
            },
            moe_intermediate_size: moe_i,
            shared_expert_intermediate_size: if num_experts > 0 { shared } else { 0 },
            norm_topk_prob: c.norm_topk_prob.unwrap_or(true),
            router,
            intermediate_size: c.intermediate_size,
            layer_is_moe,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            norm: NormStyle::Plain,
            attn_proj: AttnProjLayout::FusedQkv,
            lightning: LightningConfig {
                slope_rule,
                group_norm_size: groups,
                silu: c.linear_silu.unwrap_or(false),
            },
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: c.max_position_embeddings.unwrap_or(32_768),
            mla: Default::default(),
        })
    }
}

/// [`FamilyEntry::decoder_config`] of Ring-linear: a flat config, tensors under
/// `model.`.
fn decoder_config(root: &Value, model_type: &str) -> Result<ModelConfig> {
    parse::<BailingMoeLinearConfig>(root, "")?.to_decoder(model_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published Ring-mini-linear-2.0 config.json (keys as shipped on the Hub).
    fn ring_mini() -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../benches/configs/ring_mini_linear_2_0/config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    #[test]
    fn ring_mini_layer_plan_and_router() {
        let c = super::super::decoder_config(&ring_mini()).unwrap();
        let full: Vec<usize> = (0..c.num_layers)
            .filter(|&i| c.mixers[i] == MixerKind::Attention)
            .collect();
        assert_eq!(full, vec![4, 9, 14, 19]);
        assert_eq!(c.num_linear_layers(), 16);
        assert!(!c.layer_is_moe[0] && c.layer_is_moe[1..].iter().all(|&m| m));
        assert_eq!(
            (c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim),
            (16, 4, 128, 64)
        );
        assert_eq!(c.router.score, ScoreFunction::Sigmoid);
        assert_eq!(c.router.selection_bias, Some("gate.expert_bias"));
        assert_eq!((c.router.n_group, c.router.topk_group), (8, 4));
        assert_eq!(c.router.routed_scaling_factor, 2.5);
        assert_eq!(c.shared_expert_intermediate_size, 512);
        assert_eq!(c.names.embed_tokens(), "model.word_embeddings.weight");
        assert_eq!(
            c.names.mixer(3, MixerKind::Lightning),
            "model.layers.3.attention."
        );
        assert_eq!(c.norm, NormStyle::Plain);
        assert_eq!(c.lightning.group_norm_size, 4);
        assert_eq!(c.lightning.slope_rule, SlopeRule::Absolute);
    }

    #[test]
    fn the_tail_rule_makes_leftover_layers_full_attention() {
        let full: Vec<usize> = (0..22).filter(|&i| is_full_attention(i, 22, 5)).collect();
        assert_eq!(full, vec![4, 9, 14, 19, 20, 21]);
        assert!((0..3).all(|i| is_full_attention(i, 3, 5)));
    }

    #[test]
    fn unsupported_options_are_named() {
        for (k, v) in [
            ("use_qkv_bias", Value::from(true)),
            ("use_qk_norm", Value::from(false)),
            ("head_dim", Value::from(64)),
            ("lightning_slope_rule", Value::from("sglang")),
            ("score_function", Value::from("relu")),
            ("group_norm_size", Value::from(3)),
        ] {
            let mut j = ring_mini();
            j[k] = v;
            let e = super::super::decoder_config(&j).unwrap_err().to_string();
            assert!(e.contains(k), "{k}: {e}");
        }
        let mut j = ring_mini();
        j["lightning_slope_rule"] = Value::from("mlx_lm");
        let c = super::super::decoder_config(&j).unwrap();
        assert_eq!(c.lightning.slope_rule, SlopeRule::MlxLm);
    }
}
