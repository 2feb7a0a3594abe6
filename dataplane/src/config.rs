//! Model configuration from an unmodified Hugging Face `config.json`.
//!
//! Supports `qwen3_next` (flat) and `qwen3_5` / `qwen3_5_moe` (VL wrapper with the text
//! model under `text_config`; also the bare `*_text` types). Keys and defaults follow
//! HF transformers `configuration_qwen3_next.py` / `configuration_qwen3_5*.py`
//! (see docs/pic-design.md §8.1).
use crate::error::{io_err, Error, Result};
use serde_json::Value;
use std::path::Path;

/// Kind of token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    Linear,
    /// Gated full (softmax) attention with a KV cache.
    Full,
}

/// Checkpoint family, which fixes tensor names and the GDN projection layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Qwen3-Next: flat `model.` prefix, fused `in_proj_qkvz`/`in_proj_ba`.
    Qwen3Next,
    /// Qwen3.5 (dense or MoE): `model.language_model.` prefix (wrapper) or `model.`
    /// (bare text checkpoint), split `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a`.
    Qwen35,
}

/// Text-model hyper-parameters. Sizes are element counts.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `model_type` of the top-level config.
    pub model_type: String,
    /// Checkpoint family.
    pub family: Family,
    /// Prefix of decoder weights (`model.` or `model.language_model.`).
    pub weight_prefix: String,
    /// Residual width (`hidden_size`).
    pub hidden_size: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub num_layers: usize,
    /// Vocabulary size (embedding and LM-head rows).
    pub vocab_size: usize,
    /// Per-layer mixer kind (`layer_types`).
    pub layer_kinds: Vec<LayerKind>,
    /// Full-attention query heads.
    pub num_heads: usize,
    /// Full-attention KV heads (GQA).
    pub num_kv_heads: usize,
    /// Full-attention head dim.
    pub head_dim: usize,
    /// Number of rotary dims per head: `int(head_dim * partial_rotary_factor)`.
    pub rotary_dim: usize,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Whether `q_proj` also produces the per-head sigmoid output gate.
    pub attn_output_gate: bool,
    /// GDN key (query) heads Hk.
    pub linear_k_heads: usize,
    /// GDN value heads Hv.
    pub linear_v_heads: usize,
    /// GDN key head dim dk.
    pub linear_k_dim: usize,
    /// GDN value head dim dv.
    pub linear_v_dim: usize,
    /// Causal conv kernel width K.
    pub conv_kernel: usize,
    /// Routed experts (0: dense MLP everywhere).
    pub num_experts: usize,
    /// Experts per token (top-k).
    pub experts_per_tok: usize,
    /// Routed expert SwiGLU width.
    pub moe_intermediate_size: usize,
    /// Shared expert SwiGLU width (0: none).
    pub shared_expert_intermediate_size: usize,
    /// Renormalise the top-k router probabilities.
    pub norm_topk_prob: bool,
    /// Dense-MLP width (layers that are not MoE).
    pub intermediate_size: usize,
    /// Per-layer: true when the layer's MLP is a MoE block.
    pub layer_is_moe: Vec<bool>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// LM head tied to the embedding.
    pub tie_word_embeddings: bool,
    /// Context limit in tokens.
    pub max_position_embeddings: usize,
}

impl ModelConfig {
    /// GDN key width `Hk·dk`.
    pub fn key_dim(&self) -> usize {
        self.linear_k_heads * self.linear_k_dim
    }
    /// GDN value width `Hv·dv`.
    pub fn value_dim(&self) -> usize {
        self.linear_v_heads * self.linear_v_dim
    }
    /// Channels of the causal conv: `2·key_dim + value_dim` (q|k|v).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }

    /// Reads `dir/config.json`.
    ///
    /// Errors: missing file, invalid JSON, unknown `model_type`, missing or
    /// inconsistent fields (each named).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| Error::Json {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        Self::from_json(&v)
    }

    /// Parses a config.json value (see [`ModelConfig::from_dir`]).
    pub fn from_json(root: &Value) -> Result<Self> {
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| cfg_err("model_type", "missing or not a string"))?
            .to_string();
        let (family, text, prefix) = match model_type.as_str() {
            "qwen3_next" => (Family::Qwen3Next, root, "model."),
            "qwen3_5" | "qwen3_5_moe" => {
                let t = root.get("text_config").ok_or_else(|| {
                    cfg_err("text_config", "missing for a Qwen3.5 wrapper config")
                })?;
                (Family::Qwen35, t, "model.language_model.")
            }
            "qwen3_5_text" | "qwen3_5_moe_text" => (Family::Qwen35, root, "model."),
            other => return Err(Error::UnsupportedModel(other.to_string())),
        };
        let moe_type = model_type.contains("moe");
        let get = |k: &str| text.get(k).or_else(|| root.get(k));
        let usize_req = |k: &str| -> Result<usize> {
            get(k)
                .ok_or_else(|| cfg_err(k, "missing"))?
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| cfg_err(k, "not a non-negative integer"))
        };
        let usize_opt = |k: &str, d: usize| -> Result<usize> {
            match get(k) {
                None | Some(Value::Null) => Ok(d),
                Some(v) => v
                    .as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| cfg_err(k, "not a non-negative integer")),
            }
        };
        let bool_opt = |k: &str, d: bool| -> Result<bool> {
            match get(k) {
                None | Some(Value::Null) => Ok(d),
                Some(v) => v.as_bool().ok_or_else(|| cfg_err(k, "not a boolean")),
            }
        };
        let rope = get("rope_parameters").or_else(|| get("rope_scaling"));
        let f64_from = |k: &str| -> Option<f64> {
            rope.and_then(|r| r.get(k))
                .and_then(Value::as_f64)
                .or_else(|| get(k).and_then(Value::as_f64))
        };

        let hidden_size = usize_req("hidden_size")?;
        let num_layers = usize_req("num_hidden_layers")?;
        let vocab_size = usize_req("vocab_size")?;
        let num_heads = usize_req("num_attention_heads")?;
        let num_kv_heads = usize_opt("num_key_value_heads", num_heads)?;
        let head_dim = usize_opt("head_dim", hidden_size / num_heads.max(1))?;
        let layer_kinds = match get("layer_types") {
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("linear_attention") => Ok(LayerKind::Linear),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => Err(cfg_err(
                        "layer_types",
                        &format!(
                            "entry {i} is {t}, expected \"linear_attention\" or \"full_attention\""
                        ),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            Some(_) => return Err(cfg_err("layer_types", "not a list")),
            None => {
                let interval = usize_opt("full_attention_interval", 4)?.max(1);
                (0..num_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Linear
                        }
                    })
                    .collect()
            }
        };
        if layer_kinds.len() != num_layers {
            return Err(cfg_err(
                "layer_types",
                &format!(
                    "has {} entries but num_hidden_layers is {num_layers}",
                    layer_kinds.len()
                ),
            ));
        }
        let partial = f64_from("partial_rotary_factor").unwrap_or(0.25);
        let rotary_dim = ((head_dim as f64) * partial) as usize;
        let rope_theta = f64_from("rope_theta").unwrap_or(10_000.0);
        let num_experts = usize_opt("num_experts", 0)?;
        let decoder_sparse_step = usize_opt("decoder_sparse_step", 1)?.max(1);
        let mlp_only: Vec<usize> = match get("mlp_only_layers") {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(Value::as_u64)
                .map(|x| x as usize)
                .collect(),
            _ => vec![],
        };
        let layer_is_moe = (0..num_layers)
            .map(|i| {
                num_experts > 0 && !mlp_only.contains(&i) && (i + 1) % decoder_sparse_step == 0
            })
            .collect::<Vec<_>>();
        let any_dense = layer_is_moe.iter().any(|m| !m);
        let cfg = ModelConfig {
            family,
            weight_prefix: prefix.to_string(),
            hidden_size,
            num_layers,
            vocab_size,
            layer_kinds,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            attn_output_gate: bool_opt("attn_output_gate", true)?,
            linear_k_heads: usize_req("linear_num_key_heads")?,
            linear_v_heads: usize_req("linear_num_value_heads")?,
            linear_k_dim: usize_req("linear_key_head_dim")?,
            linear_v_dim: usize_req("linear_value_head_dim")?,
            conv_kernel: usize_opt("linear_conv_kernel_dim", 4)?,
            num_experts,
            experts_per_tok: if num_experts > 0 {
                usize_req("num_experts_per_tok")?
            } else {
                0
            },
            moe_intermediate_size: if num_experts > 0 {
                usize_req("moe_intermediate_size")?
            } else {
                0
            },
            shared_expert_intermediate_size: usize_opt("shared_expert_intermediate_size", 0)?,
            norm_topk_prob: if moe_type && family == Family::Qwen35 {
                true
            } else {
                bool_opt("norm_topk_prob", true)?
            },
            intermediate_size: if any_dense {
                usize_req("intermediate_size")?
            } else {
                usize_opt("intermediate_size", 0)?
            },
            layer_is_moe,
            rms_norm_eps: get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            tie_word_embeddings: bool_opt("tie_word_embeddings", false)?,
            max_position_embeddings: usize_opt("max_position_embeddings", 262_144)?,
            model_type,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let nz = |k: &str, v: usize| {
            if v == 0 {
                Err(cfg_err(k, "must be > 0"))
            } else {
                Ok(())
            }
        };
        nz("hidden_size", self.hidden_size)?;
        nz("num_hidden_layers", self.num_layers)?;
        nz("vocab_size", self.vocab_size)?;
        nz("num_attention_heads", self.num_heads)?;
        nz("num_key_value_heads", self.num_kv_heads)?;
        nz("linear_num_key_heads", self.linear_k_heads)?;
        nz("linear_key_head_dim", self.linear_k_dim)?;
        nz("linear_value_head_dim", self.linear_v_dim)?;
        nz("linear_conv_kernel_dim", self.conv_kernel)?;
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(cfg_err(
                "num_key_value_heads",
                "must divide num_attention_heads",
            ));
        }
        if !self.linear_v_heads.is_multiple_of(self.linear_k_heads) {
            return Err(cfg_err(
                "linear_num_value_heads",
                "must be a multiple of linear_num_key_heads",
            ));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(cfg_err(
                "partial_rotary_factor",
                "rotary dims must be even and ≤ head_dim",
            ));
        }
        if self.num_experts > 0
            && (self.experts_per_tok == 0 || self.experts_per_tok > self.num_experts)
        {
            return Err(cfg_err("num_experts_per_tok", "must be in 1..=num_experts"));
        }
        Ok(())
    }
}

fn cfg_err(field: &str, msg: &str) -> Error {
    Error::Config {
        field: field.to_string(),
        msg: msg.to_string(),
    }
}
