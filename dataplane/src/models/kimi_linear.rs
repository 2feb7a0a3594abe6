//! Kimi-Linear (`model_type: kimi_linear`, HF `KimiLinearForCausalLM`:
//! Kimi-Linear-48B-A3B), CPU only.
//!
//! Layers: Kimi Delta Attention ([`MixerKind::Kda`]) and multi-head latent attention
//! without RoPE ([`MixerKind::Mla`]), placed by `layer_types` or, as the release
//! config stores them, by the **1-indexed** lists `linear_attn_config.kda_layers` /
//! `full_attn_layers`; a dense SwiGLU MLP below `first_k_dense_replace` (or where
//! `mlp_layer_types` says `dense`), a MoE block elsewhere: sigmoid router with
//! `e_score_correction_bias`, grouped top-k (dropped groups at −∞), renormalised,
//! scaled by `routed_scaling_factor`, plus ungated shared experts. Plain RMSNorm
//! ([`NormStyle::Plain`]). Tensors (the release layout, as transformers'
//! `save_pretrained` writes it): `model.embed_tokens`, `model.norm`, `lm_head`,
//! `model.layers.{i}.self_attn.*` (KDA: `q/k/v_proj`, `q/k/v_conv1d`, `f_a/f_b_proj`,
//! `A_log`, `dt_bias`, `b_proj`, `g_a/g_b_proj`, `o_norm`, `o_proj`; MLA: `q_proj`,
//! `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`),
//! `block_sparse_moe.{gate.weight, gate.e_score_correction_bias}`,
//! `block_sparse_moe.experts.{e}.{w1,w2,w3}`, `block_sparse_moe.shared_experts.*`;
//! the dense layers' MLP under `block_sparse_moe.` or `mlp.`.
//!
//! Keys: both spellings of the renamed ones are read (the release config's
//! `num_experts`, `num_experts_per_token`, `num_shared_experts`, `moe_renormalize`,
//! `num_expert_group`, `model_max_length`, and HF's attribute names
//! `num_local_experts`, `num_experts_per_tok`, `n_shared_experts`, `norm_topk_prob`,
//! `n_group`, `max_position_embeddings`). Defaults of optional keys: transformers
//! 5.17 `KimiLinearConfig`, written on each field.
use super::{parse, FamilyEntry};
use crate::config::{cfg_err, InProjLayout, MlaConfig, ModelConfig, NormStyle, TensorNames};
use crate::error::Result;
use crate::mixers::MixerKind;
use crate::router::{RouterConfig, ScoreFunction};
use serde::Deserialize;
use serde_json::Value;

/// The registry entry.
pub const FAMILY: FamilyEntry = FamilyEntry {
    name: "kimi_linear",
    model_types: &["kimi_linear"],
    decoder_config,
};

/// `linear_attn_config` of the release config.json.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct LinearAttnConfig {
    /// 1-indexed KDA layers.
    pub kda_layers: Option<Vec<usize>>,
    /// 1-indexed full-attention (MLA) layers.
    pub full_attn_layers: Option<Vec<usize>>,
    /// KDA head dim (overrides `linear_head_dim`).
    pub head_dim: Option<usize>,
    /// KDA heads (overrides `linear_num_heads`).
    pub num_heads: Option<usize>,
    /// Short-conv kernel (overrides `linear_conv_kernel_dim`).
    pub short_conv_kernel_size: Option<usize>,
}

/// The keys of a Kimi-Linear config.json that the data plane reads (others are
/// ignored). `Option` fields take the default noted on each when absent or `null`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct KimiLinearConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Dense-MLP width (default 9216).
    pub intermediate_size: Option<usize>,
    /// Routed (and shared) expert width (default 1024).
    pub moe_intermediate_size: Option<usize>,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// MLA heads.
    pub num_attention_heads: usize,
    /// MLA KV heads (default `num_attention_heads`; must equal it).
    pub num_key_value_heads: Option<usize>,
    /// MLA latent width (default 512).
    pub kv_lora_rank: Option<usize>,
    /// Low-rank query width (default null; only null is supported).
    pub q_lora_rank: Option<usize>,
    /// Shared key part width (default 64).
    pub qk_rope_head_dim: Option<usize>,
    /// Per-head key width from the latent (default 128).
    pub qk_nope_head_dim: Option<usize>,
    /// Per-head value width (default 128).
    pub v_head_dim: Option<usize>,
    /// No RoPE in MLA (release key; default true, false is not supported).
    pub mla_use_nope: Option<bool>,
    /// Bias on the attention projections (default false; true is not supported).
    pub attention_bias: Option<bool>,
    /// Routed experts (default 256).
    #[serde(alias = "num_local_experts")]
    pub num_experts: Option<usize>,
    /// Experts per token (default 8).
    #[serde(alias = "num_experts_per_tok")]
    pub num_experts_per_token: Option<usize>,
    /// Shared experts, fused into one MLP of `num_shared_experts ×
    /// moe_intermediate_size` (default 1).
    #[serde(alias = "n_shared_experts")]
    pub num_shared_experts: Option<usize>,
    /// Renormalise the top-k weights (default true).
    #[serde(alias = "norm_topk_prob")]
    pub moe_renormalize: Option<bool>,
    /// Expert groups (default 1).
    #[serde(alias = "n_group")]
    pub num_expert_group: Option<usize>,
    /// Groups kept per token (default 1).
    pub topk_group: Option<usize>,
    /// Factor on the routing weights (default 2.446).
    pub routed_scaling_factor: Option<f64>,
    /// Router score function (release key; default `sigmoid`, the only one supported).
    pub moe_router_activation_func: Option<String>,
    /// Every n-th layer MoE (release key; default 1, the only value supported).
    pub moe_layer_freq: Option<usize>,
    /// Layers below this index use the dense MLP (default 1; ignored when
    /// `mlp_layer_types` is given).
    pub first_k_dense_replace: Option<usize>,
    /// Per layer `dense` or `sparse` (HF key; default from `first_k_dense_replace`).
    pub mlp_layer_types: Option<Vec<String>>,
    /// MLP activation (default `silu`, the only one supported).
    pub hidden_act: Option<String>,
    /// Context limit (default 1048576).
    #[serde(alias = "max_position_embeddings")]
    pub model_max_length: Option<usize>,
    /// RMSNorm epsilon (default 1e-5).
    pub rms_norm_eps: Option<f64>,
    /// LM head tied to the embedding (default false).
    pub tie_word_embeddings: Option<bool>,
    /// Per layer `linear_attention` (KDA) or `full_attention` (MLA); takes precedence
    /// over `linear_attn_config`'s lists, as in HF.
    pub layer_types: Option<Vec<String>>,
    /// The release config's KDA settings and 1-indexed layer lists.
    pub linear_attn_config: Option<LinearAttnConfig>,
    /// KDA heads (default 32).
    pub linear_num_heads: Option<usize>,
    /// KDA head dim (default 128).
    pub linear_head_dim: Option<usize>,
    /// KDA short-conv kernel (default 4).
    pub linear_conv_kernel_dim: Option<usize>,
}

impl KimiLinearConfig {
    /// The per-layer mixers: `layer_types`, else the 1-indexed lists, else HF's
    /// default (MLA at every 0-indexed `i > 0` with `i % 4 == 0`).
    ///
    /// Errors: an unknown `layer_types` entry, a list index outside
    /// `1..=num_hidden_layers`, a layer in both lists or in neither (each named).
    pub fn mixers(&self) -> Result<Vec<MixerKind>> {
        let n = self.num_hidden_layers;
        if let Some(types) = &self.layer_types {
            return types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "linear_attention" => Ok(MixerKind::Kda),
                    "full_attention" => Ok(MixerKind::Mla),
                    _ => Err(cfg_err(
                        "layer_types",
                        &format!(
                            "entry {i} is \"{t}\", expected \"linear_attention\" or \"full_attention\""
                        ),
                    )),
                })
                .collect();
        }
        let lac = self.linear_attn_config.clone().unwrap_or_default();
        let (Some(kda), Some(full)) = (lac.kda_layers, lac.full_attn_layers) else {
            return Ok((0..n)
                .map(|i| {
                    if i > 0 && i % 4 == 0 {
                        MixerKind::Mla
                    } else {
                        MixerKind::Kda
                    }
                })
                .collect());
        };
        let mut out: Vec<Option<MixerKind>> = vec![None; n];
        for (key, list, kind) in [
            ("linear_attn_config.full_attn_layers", &full, MixerKind::Mla),
            ("linear_attn_config.kda_layers", &kda, MixerKind::Kda),
        ] {
            for &l in list {
                if l == 0 || l > n {
                    return Err(cfg_err(
                        key,
                        &format!("layer {l} is outside 1..={n} (the lists are 1-indexed)"),
                    ));
                }
                if out[l - 1].is_some() {
                    return Err(cfg_err(key, &format!("layer {l} is listed twice")));
                }
                out[l - 1] = Some(kind);
            }
        }
        out.iter()
            .enumerate()
            .map(|(i, m)| {
                m.ok_or_else(|| {
                    cfg_err(
                        "linear_attn_config",
                        &format!(
                            "layer {} is in neither kda_layers nor full_attn_layers",
                            i + 1
                        ),
                    )
                })
            })
            .collect()
    }

    /// The decoder description (unvalidated; [`super::decoder_config`] validates).
    ///
    /// Errors: as [`KimiLinearConfig::mixers`]; an unsupported option (low-rank
    /// query, RoPE in MLA, attention bias, KV heads ≠ heads, a router function other
    /// than sigmoid, `moe_layer_freq` ≠ 1, an activation other than SiLU, an unknown
    /// `mlp_layer_types` entry), each named.
    pub fn to_decoder(&self, model_type: &str) -> Result<ModelConfig> {
        let c = self;
        let n = c.num_hidden_layers;
        if c.q_lora_rank.is_some() {
            return Err(cfg_err(
                "q_lora_rank",
                "a low-rank MLA query is not supported",
            ));
        }
        if !c.mla_use_nope.unwrap_or(true) {
            return Err(cfg_err(
                "mla_use_nope",
                "false (RoPE in MLA) is not supported",
            ));
        }
        if c.attention_bias.unwrap_or(false) {
            return Err(cfg_err("attention_bias", "true is not supported"));
        }
        let heads = c.num_attention_heads;
        if c.num_key_value_heads.unwrap_or(heads) != heads {
            return Err(cfg_err(
                "num_key_value_heads",
                "must equal num_attention_heads (MLA expands one latent per head)",
            ));
        }
        if let Some(f) = c.moe_router_activation_func.as_deref() {
            if f != "sigmoid" {
                return Err(cfg_err(
                    "moe_router_activation_func",
                    &format!("\"{f}\": only \"sigmoid\" is supported"),
                ));
            }
        }
        if c.moe_layer_freq.unwrap_or(1) != 1 {
            return Err(cfg_err("moe_layer_freq", "only 1 is supported"));
        }
        if let Some(a) = c.hidden_act.as_deref() {
            if a != "silu" {
                return Err(cfg_err(
                    "hidden_act",
                    &format!("\"{a}\": only \"silu\" is supported"),
                ));
            }
        }
        let mixers = c.mixers()?;
        let layer_is_moe: Vec<bool> = match &c.mlp_layer_types {
            Some(types) => types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "sparse" => Ok(true),
                    "dense" => Ok(false),
                    _ => Err(cfg_err(
                        "mlp_layer_types",
                        &format!("entry {i} is \"{t}\", expected \"dense\" or \"sparse\""),
                    )),
                })
                .collect::<Result<_>>()?,
            None => {
                let first = c.first_k_dense_replace.unwrap_or(1);
                (0..n).map(|i| i >= first).collect()
            }
        };
        if layer_is_moe.len() != n {
            return Err(cfg_err(
                "mlp_layer_types",
                &format!(
                    "has {} entries but num_hidden_layers is {n}",
                    layer_is_moe.len()
                ),
            ));
        }
        let lac = c.linear_attn_config.clone().unwrap_or_default();
        let kda_heads = lac.num_heads.or(c.linear_num_heads).unwrap_or(32);
        let kda_dim = lac.head_dim.or(c.linear_head_dim).unwrap_or(128);
        let conv = lac
            .short_conv_kernel_size
            .or(c.linear_conv_kernel_dim)
            .unwrap_or(4);
        if conv == 0 {
            return Err(cfg_err(
                "linear_attn_config.short_conv_kernel_size",
                "must be > 0",
            ));
        }
        if kda_heads == 0 || kda_dim == 0 {
            return Err(cfg_err(
                "linear_attn_config",
                "num_heads and head_dim must be > 0",
            ));
        }
        let mla = MlaConfig {
            kv_lora_rank: c.kv_lora_rank.unwrap_or(512),
            qk_nope_head_dim: c.qk_nope_head_dim.unwrap_or(128),
            qk_rope_head_dim: c.qk_rope_head_dim.unwrap_or(64),
            v_head_dim: c.v_head_dim.unwrap_or(128),
        };
        if mla.kv_lora_rank == 0 || mla.qk_head_dim() == 0 || mla.v_head_dim == 0 {
            return Err(cfg_err(
                "kv_lora_rank",
                "kv_lora_rank, qk_nope_head_dim + qk_rope_head_dim and v_head_dim must be > 0",
            ));
        }
        let num_experts = c.num_experts.unwrap_or(256);
        let moe_i = c.moe_intermediate_size.unwrap_or(1024);
        let any_moe = layer_is_moe.iter().any(|&m| m);
        let router = RouterConfig {
            score: ScoreFunction::Sigmoid,
            selection_bias: Some("gate.e_score_correction_bias"),
            n_group: c.num_expert_group.unwrap_or(1),
            topk_group: c.topk_group.unwrap_or(1),
            routed_scaling_factor: c.routed_scaling_factor.unwrap_or(2.446) as f32,
            dropped_group_score: f32::NEG_INFINITY,
            renorm_single: true,
        };
        let names = TensorNames {
            ffn: "block_sparse_moe.",
            dense_ffn_alt: Some("mlp."),
            shared_expert: "shared_experts.",
            shared_expert_gate: None,
            expert_proj: ["w1.weight", "w3.weight", "w2.weight"],
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
            // The MLA cache holds one latent row per token (mixers::mla).
            num_kv_heads: 1,
            head_dim: mla.row(),
            rotary_dim: 0,
            rope_theta: 10_000.0,
            attn_output_gate: false,
            linear_k_heads: kda_heads,
            linear_v_heads: kda_heads,
            linear_k_dim: kda_dim,
            linear_v_dim: kda_dim,
            conv_kernel: conv,
            num_experts: if any_moe { num_experts } else { 0 },
            experts_per_tok: if any_moe {
                c.num_experts_per_token.unwrap_or(8)
            } else {
                0
            },
            moe_intermediate_size: moe_i,
            shared_expert_intermediate_size: if any_moe {
                c.num_shared_experts.unwrap_or(1) * moe_i
            } else {
                0
            },
            norm_topk_prob: c.moe_renormalize.unwrap_or(true),
            router,
            intermediate_size: c.intermediate_size.unwrap_or(9216),
            layer_is_moe,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-5) as f32,
            norm: NormStyle::Plain,
            attn_proj: Default::default(),
            lightning: Default::default(),
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: c.model_max_length.unwrap_or(1_048_576),
            mla,
        })
    }
}

/// [`FamilyEntry::decoder_config`] of Kimi-Linear: a flat config, tensors under
/// `model.`.
fn decoder_config(root: &Value, model_type: &str) -> Result<ModelConfig> {
    parse::<KimiLinearConfig>(root, "")?.to_decoder(model_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(rel: &str) -> Value {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    fn fixture() -> Value {
        json("tests/fixtures/golden/kimi_linear/config.json")
    }

    /// The fixture (written by transformers' `save_pretrained`): layer plan from
    /// `layer_types`, the same plan from the 1-indexed lists alone, router, names.
    #[test]
    fn fixture_layer_plan_router_and_names() {
        let c = super::super::decoder_config(&fixture()).unwrap();
        use MixerKind::{Kda, Mla};
        assert_eq!(c.mixers, vec![Kda, Kda, Mla, Kda]);
        assert_eq!(c.layer_is_moe, vec![false, true, true, true]);
        assert_eq!((c.num_experts, c.experts_per_tok), (8, 2));
        assert_eq!((c.router.n_group, c.router.topk_group), (2, 1));
        assert_eq!(
            c.router.selection_bias,
            Some("gate.e_score_correction_bias")
        );
        assert_eq!(c.router.dropped_group_score, f32::NEG_INFINITY);
        assert_eq!(c.shared_expert_intermediate_size, 16);
        assert_eq!((c.num_kv_heads, c.head_dim, c.rotary_dim), (1, 40, 0));
        assert_eq!(
            (c.linear_v_heads, c.linear_k_dim, c.conv_kernel),
            (4, 16, 4)
        );
        assert_eq!(c.names.mixer(2, Mla), "model.layers.2.self_attn.");
        assert_eq!(c.names.mlp(1), "model.layers.1.block_sparse_moe.");
        assert_eq!(c.max_position_embeddings, 4096);
        let mut j = fixture();
        j.as_object_mut().unwrap().remove("layer_types");
        j.as_object_mut().unwrap().remove("mlp_layer_types");
        let d = super::super::decoder_config(&j).unwrap();
        assert_eq!(d.mixers, c.mixers);
        assert_eq!(d.layer_is_moe, c.layer_is_moe);
    }

    /// The published Kimi-Linear-48B-A3B shape (benches/configs).
    #[test]
    fn kimi_linear_48b_layer_plan() {
        let c = super::super::decoder_config(&json(
            "../benches/configs/kimi_linear_48b_a3b/config.json",
        ))
        .unwrap();
        let full: Vec<usize> = (0..c.num_layers)
            .filter(|&i| c.mixers[i] == MixerKind::Mla)
            .collect();
        assert_eq!(full, vec![3, 7, 11, 15, 19, 23, 26]);
        assert_eq!(c.num_linear_layers(), 20);
        assert_eq!((c.num_experts, c.experts_per_tok), (256, 8));
        assert_eq!(c.head_dim, 512 + 64);
        assert_eq!((c.linear_v_heads, c.linear_k_dim), (32, 128));
        assert!(!c.layer_is_moe[0] && c.layer_is_moe[1..].iter().all(|&m| m));
    }

    #[test]
    fn bad_layer_lists_and_unsupported_options_are_named() {
        let base = || {
            let mut j = fixture();
            j.as_object_mut().unwrap().remove("layer_types");
            j
        };
        for (list, msg) in [
            (vec![0usize], "outside"),
            (vec![5], "outside"),
            (vec![3, 3], "twice"),
            (vec![], "neither"),
        ] {
            let mut j = base();
            j["linear_attn_config"]["full_attn_layers"] = Value::from(list.clone());
            let e = super::super::decoder_config(&j).unwrap_err().to_string();
            assert!(e.contains(msg), "{list:?}: {e}");
        }
        for (k, v) in [
            ("q_lora_rank", Value::from(16)),
            ("mla_use_nope", Value::from(false)),
            ("num_key_value_heads", Value::from(2)),
            ("moe_router_activation_func", Value::from("softmax")),
            ("hidden_act", Value::from("gelu")),
            ("linear_attn_config", serde_json::json!({"num_heads": 0})),
        ] {
            let mut j = fixture();
            j[k] = v;
            let e = super::super::decoder_config(&j).unwrap_err().to_string();
            assert!(e.contains(k), "{k}: {e}");
        }
    }
}
