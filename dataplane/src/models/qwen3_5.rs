//! Qwen3.5 and Qwen3.5-MoE (`model_type: qwen3_5` / `qwen3_5_moe`, HF
//! `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`): a
//! vision-language wrapper whose text model is under `text_config` and whose text
//! tensors are under `model.language_model.` (the vision tower is not loaded); also
//! the bare text checkpoints `qwen3_5_text` / `qwen3_5_moe_text` (flat config,
//! tensors under `model.`). Gated DeltaNet layers with the split
//! `in_proj_qkv | in_proj_z | in_proj_b | in_proj_a` ([`InProjLayout::Split`]),
//! gated attention, and for the MoE variant a MoE block with a gated shared expert
//! on every layer. Keys and defaults: HF transformers `configuration_qwen3_5.py` /
//! `configuration_qwen3_5_moe.py` (docs/pic-design.md §8.1).
use super::{parse, qwen_hybrid_mixers, rotary_dim, FamilyEntry, RopeParameters};
use crate::config::{cfg_err, InProjLayout, ModelConfig, TensorNames};
use crate::error::Result;
use serde::Deserialize;
use serde_json::Value;

/// The registry entry.
pub const FAMILY: FamilyEntry = FamilyEntry {
    name: "qwen3_5",
    model_types: &["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"],
    decoder_config,
};

/// The keys of a Qwen3.5 (or Qwen3.5-MoE) text config that the data plane reads:
/// the wrapper's `text_config`, with keys it lacks taken from the wrapper's top
/// level (e.g. `tie_word_embeddings`), or a bare text config.json. Other keys are
/// ignored. `Option` fields are optional and take the HF default noted on each when
/// absent (or `null`); the shape keys without a default here are required (every
/// config.json that transformers writes carries them; a missing one is named).
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Qwen35TextConfig {
    /// Vocabulary size (embedding and LM-head rows).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Dense-MLP width; required for the dense variant.
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
    /// RoPE parameters (the multimodal `mrope_*` keys are not used for text).
    pub rope_parameters: Option<RopeParameters>,
    /// RoPE parameters (older transformers), used when `rope_parameters` is absent.
    pub rope_scaling: Option<RopeParameters>,
    /// RoPE base θ at the top level (older configs; HF default 10000).
    pub rope_theta: Option<f64>,
    /// Rotating fraction of each head at the top level (HF default 0.25).
    pub partial_rotary_factor: Option<f64>,
    /// Attention head dim (HF default 256).
    pub head_dim: Option<usize>,
    /// Whether `q_proj` also produces the per-head sigmoid output gate (default
    /// true, as HF's Qwen3.5 attention).
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
    /// MoE variant: routed experts (HF default 256).
    pub num_experts: Option<usize>,
    /// MoE variant: experts per token; required.
    pub num_experts_per_tok: Option<usize>,
    /// MoE variant: routed expert width; required.
    pub moe_intermediate_size: Option<usize>,
    /// MoE variant: shared expert width, 0 for none (HF default 512).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Per-layer `linear_attention` / `full_attention`.
    pub layer_types: Option<Vec<String>>,
    /// Without `layer_types`: every n-th layer is full attention (HF default 4).
    pub full_attention_interval: Option<usize>,
}

impl Qwen35TextConfig {
    /// The decoder description (unvalidated; [`super::decoder_config`] validates)
    /// for the top-level `model_type` (MoE when it names `moe`), with decoder
    /// tensors under `prefix`.
    ///
    /// Errors: bad `layer_types`; a missing key that the variant makes required.
    pub fn to_decoder(&self, model_type: &str, prefix: &str) -> Result<ModelConfig> {
        let c = self;
        let moe_variant = model_type.contains("moe");
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
        // HF Qwen3.5-MoE: a MoE block on every layer, router always renormalised.
        let num_experts = if moe_variant {
            c.num_experts.unwrap_or(256)
        } else {
            0
        };
        let layer_is_moe = vec![num_experts > 0; c.num_hidden_layers];
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
            names: TensorNames::qwen(prefix),
            gdn_in_proj: InProjLayout::Split,
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
            shared_expert_intermediate_size: if moe_variant {
                c.shared_expert_intermediate_size.unwrap_or(512)
            } else {
                0
            },
            norm_topk_prob: true,
            router: Default::default(),
            intermediate_size: match c.intermediate_size {
                Some(i) => i,
                None if num_experts == 0 => return Err(cfg_err("intermediate_size", "missing")),
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

/// [`FamilyEntry::decoder_config`] of Qwen3.5: the wrapper types read
/// `text_config` (falling back to the top level for keys it lacks) with tensors
/// under `model.language_model.`; the `*_text` types read the top level with
/// tensors under `model.`.
fn decoder_config(root: &Value, model_type: &str) -> Result<ModelConfig> {
    if model_type.ends_with("_text") {
        return parse::<Qwen35TextConfig>(root, "")?.to_decoder(model_type, "model.");
    }
    let text = root
        .get("text_config")
        .ok_or_else(|| cfg_err("text_config", "missing for a Qwen3.5 wrapper config"))?
        .as_object()
        .ok_or_else(|| cfg_err("text_config", "not an object"))?;
    let mut merged = text.clone();
    if let Some(top) = root.as_object() {
        for (k, v) in top {
            if k != "text_config" && k != "vision_config" && !merged.contains_key(k) {
                merged.insert(k.clone(), v.clone());
            }
        }
    }
    parse::<Qwen35TextConfig>(&Value::Object(merged), "text_config.")?
        .to_decoder(model_type, "model.language_model.")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden(name: &str) -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(name)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    #[test]
    fn wrapper_configs_read_the_text_model() {
        let dense = super::super::decoder_config(&golden("qwen3_5")).unwrap();
        assert_eq!(dense.names.layer(2), "model.language_model.layers.2.");
        assert_eq!(dense.gdn_in_proj, InProjLayout::Split);
        assert_eq!((dense.num_experts, dense.intermediate_size), (0, 96));
        assert!(dense.layer_is_moe.iter().all(|m| !m));
        let moe = super::super::decoder_config(&golden("qwen3_5_moe")).unwrap();
        assert_eq!((moe.num_experts, moe.experts_per_tok), (8, 2));
        assert_eq!(moe.shared_expert_intermediate_size, 32);
        assert!(moe.layer_is_moe.iter().all(|m| *m) && moe.norm_topk_prob);
    }

    #[test]
    fn wrapper_without_text_config_is_named() {
        let mut v = golden("qwen3_5");
        v.as_object_mut().unwrap().remove("text_config");
        let e = super::super::decoder_config(&v).unwrap_err().to_string();
        assert!(e.contains("text_config"), "{e}");
        let mut v = golden("qwen3_5_moe");
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("num_experts_per_tok");
        let e = super::super::decoder_config(&v).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok"), "{e}");
    }
}
