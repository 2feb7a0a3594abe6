//! Qwen3-Next (`model_type: qwen3_next`, HF `Qwen3NextForCausalLM`): a flat config,
//! tensors under `model.`, Gated DeltaNet layers with the fused, per-key-head grouped
//! `in_proj_qkvz` / `in_proj_ba`
//! ([`InProjLayout::GroupedPerKeyHead`]), gated attention every
//! `full_attention_interval`-th layer, MoE with a gated shared expert except the
//! `mlp_only_layers`. Keys and defaults: HF transformers
//! `configuration_qwen3_next.py` (docs/pic-design.md §8.1).
use super::{parse, qwen_hybrid_mixers, rotary_dim, FamilyEntry, RopeParameters};
use crate::config::{cfg_err, InProjLayout, ModelConfig, TensorNames};
use crate::error::Result;
use serde::Deserialize;
use serde_json::Value;

/// The registry entry.
pub const FAMILY: FamilyEntry = FamilyEntry {
    name: "qwen3_next",
    model_types: &["qwen3_next"],
    decoder_config,
};

/// The keys of a Qwen3-Next config.json that the data plane reads (other keys are
/// ignored). `Option` fields are optional; when absent (or `null`) they take the HF
/// default noted on each. The shape keys without a default here are required:
/// every config.json that transformers writes carries them, and a missing one is
/// reported by name instead of silently taking the 80B-A3B shape of HF's defaults.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Qwen3NextConfig {
    /// Vocabulary size (embedding and LM-head rows).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Dense-MLP width; required when some layer is dense.
    pub intermediate_size: Option<usize>,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Attention query heads.
    pub num_attention_heads: usize,
    /// Attention KV heads (HF default 2).
    pub num_key_value_heads: Option<usize>,
    /// Context limit in tokens (HF default 32768).
    pub max_position_embeddings: Option<usize>,
    /// RMSNorm epsilon (HF default 1e-6).
    pub rms_norm_eps: Option<f64>,
    /// LM head tied to the embedding (HF default false).
    pub tie_word_embeddings: Option<bool>,
    /// RoPE parameters (transformers ≥ 5).
    pub rope_parameters: Option<RopeParameters>,
    /// RoPE parameters (older transformers), used when `rope_parameters` is absent.
    pub rope_scaling: Option<RopeParameters>,
    /// RoPE base θ at the top level (older configs; HF default 10000).
    pub rope_theta: Option<f64>,
    /// Rotating fraction of each head at the top level (HF default 0.25).
    pub partial_rotary_factor: Option<f64>,
    /// Attention head dim (HF default 256).
    pub head_dim: Option<usize>,
    /// Whether `q_proj` also produces the per-head sigmoid output gate (not an HF
    /// key: HF's Qwen3-Next attention is always gated; default true).
    pub attn_output_gate: Option<bool>,
    /// Causal conv width K of the Gated DeltaNet layers (HF default 4).
    pub linear_conv_kernel_dim: Option<usize>,
    /// Gated DeltaNet key head dim dk.
    pub linear_key_head_dim: usize,
    /// Gated DeltaNet value head dim dv.
    pub linear_value_head_dim: usize,
    /// Gated DeltaNet key heads Hk.
    pub linear_num_key_heads: usize,
    /// Gated DeltaNet value heads Hv (a multiple of Hk).
    pub linear_num_value_heads: usize,
    /// Every `decoder_sparse_step`-th layer is MoE (HF default 1).
    pub decoder_sparse_step: Option<usize>,
    /// Routed expert width; required when there are experts.
    pub moe_intermediate_size: Option<usize>,
    /// Shared expert width, 0 for none (HF default 512).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Experts per token; required when there are experts.
    pub num_experts_per_tok: Option<usize>,
    /// Routed experts, 0 for a dense model (HF default 512).
    pub num_experts: Option<usize>,
    /// Renormalise the top-k router probabilities (HF default true).
    pub norm_topk_prob: Option<bool>,
    /// Layers (0-based) with a dense MLP although MoE (HF default none).
    pub mlp_only_layers: Option<Vec<usize>>,
    /// Per-layer `linear_attention` / `full_attention`.
    pub layer_types: Option<Vec<String>>,
    /// Without `layer_types`: every n-th layer is full attention (HF default 4).
    pub full_attention_interval: Option<usize>,
}

impl Qwen3NextConfig {
    /// The decoder description (unvalidated; [`super::decoder_config`] validates).
    ///
    /// Errors: bad `layer_types`; a missing key that the shape makes required.
    pub fn to_decoder(&self, model_type: &str) -> Result<ModelConfig> {
        let c = self;
        let mixers = qwen_hybrid_mixers(
            c.layer_types.as_deref(),
            c.full_attention_interval,
            c.num_hidden_layers,
        )?;
        let rope = c.rope_parameters.as_ref().or(c.rope_scaling.as_ref());
        let head_dim = c.head_dim.unwrap_or(256);
        let partial = rope
            .and_then(|r| r.partial_rotary_factor)
            .or(c.partial_rotary_factor)
            .unwrap_or(0.25);
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(c.rope_theta)
            .unwrap_or(10_000.0);
        let num_experts = c.num_experts.unwrap_or(512);
        let step = c.decoder_sparse_step.unwrap_or(1).max(1);
        let mlp_only = c.mlp_only_layers.clone().unwrap_or_default();
        let layer_is_moe: Vec<bool> = (0..c.num_hidden_layers)
            .map(|i| num_experts > 0 && !mlp_only.contains(&i) && (i + 1) % step == 0)
            .collect();
        let any_dense = layer_is_moe.iter().any(|m| !m);
        let moe = |v: Option<usize>, k: &str| -> Result<usize> {
            if num_experts == 0 {
                Ok(0)
            } else {
                v.ok_or_else(|| cfg_err(k, "missing"))
            }
        };
        Ok(ModelConfig {
            model_type: model_type.to_string(),
            family: FAMILY.name,
            names: TensorNames::qwen("model."),
            gdn_in_proj: InProjLayout::GroupedPerKeyHead,
            hidden_size: c.hidden_size,
            num_layers: c.num_hidden_layers,
            vocab_size: c.vocab_size,
            mixers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(2),
            head_dim,
            rotary_dim: rotary_dim(head_dim, partial),
            rope_theta,
            attn_output_gate: c.attn_output_gate.unwrap_or(true),
            linear_k_heads: c.linear_num_key_heads,
            linear_v_heads: c.linear_num_value_heads,
            linear_k_dim: c.linear_key_head_dim,
            linear_v_dim: c.linear_value_head_dim,
            conv_kernel: c.linear_conv_kernel_dim.unwrap_or(4),
            num_experts,
            experts_per_tok: moe(c.num_experts_per_tok, "num_experts_per_tok")?,
            moe_intermediate_size: moe(c.moe_intermediate_size, "moe_intermediate_size")?,
            shared_expert_intermediate_size: c.shared_expert_intermediate_size.unwrap_or(512),
            norm_topk_prob: c.norm_topk_prob.unwrap_or(true),
            router: Default::default(),
            intermediate_size: match c.intermediate_size {
                Some(i) => i,
                None if any_dense => return Err(cfg_err("intermediate_size", "missing")),
                None => 0,
            },
            layer_is_moe,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            norm: Default::default(),
            attn_proj: Default::default(),
            lightning: Default::default(),
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: c.max_position_embeddings.unwrap_or(32_768),
            mla: Default::default(),
        })
    }
}

/// [`FamilyEntry::decoder_config`] of Qwen3-Next: the whole config.json is the text
/// model's.
fn decoder_config(root: &Value, model_type: &str) -> Result<ModelConfig> {
    parse::<Qwen3NextConfig>(root, "")?.to_decoder(model_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden() -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden/qwen3_next/config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    #[test]
    fn golden_config_reads_every_key() {
        let c = super::super::decoder_config(&golden()).unwrap();
        assert_eq!(c.family, "qwen3_next");
        assert_eq!(c.names.embed_tokens(), "model.embed_tokens.weight");
        assert_eq!(c.gdn_in_proj, InProjLayout::GroupedPerKeyHead);
        assert_eq!(c.num_linear_layers(), 3);
        assert_eq!(c.num_attention_layers(), 2);
        // mlp_only_layers [1]: layer 1 dense, the rest MoE.
        assert_eq!(c.layer_is_moe, vec![true, false, true, true, true]);
        assert_eq!((c.num_experts, c.experts_per_tok), (8, 2));
        assert_eq!((c.head_dim, c.rotary_dim, c.num_kv_heads), (32, 8, 2));
        assert_eq!(c.max_position_embeddings, 4096);
    }

    /// Optional keys take HF's defaults; a required one is named when missing.
    #[test]
    fn absent_optional_keys_take_the_hf_defaults() {
        let mut v = golden();
        let o = v.as_object_mut().unwrap();
        for k in [
            "max_position_embeddings",
            "rope_parameters",
            "partial_rotary_factor",
            "shared_expert_intermediate_size",
            "layer_types",
        ] {
            o.remove(k);
        }
        let c = FAMILY.decoder_config;
        let c = c(&v, "qwen3_next").unwrap();
        assert_eq!(c.max_position_embeddings, 32_768);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.rotary_dim, 8, "partial_rotary_factor 0.25 of head_dim 32");
        assert_eq!(c.shared_expert_intermediate_size, 512);
        // full_attention_interval 4: layer 3 is the only attention layer of 5.
        assert_eq!(c.num_attention_layers(), 1);
        assert!(c.mixers[3] == crate::mixers::MixerKind::Attention);
        v.as_object_mut().unwrap().remove("num_experts_per_tok");
        let e = super::super::decoder_config(&v).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");
    }
}
