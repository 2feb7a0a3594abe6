//! Model families: one file per checkpoint family, and the registry that picks the
//! family from the `model_type` of an unmodified Hugging Face `config.json`.
//!
//! A family owns everything that is specific to it:
//!
//! * its config struct, mirroring the keys of its config.json (serde, with the HF
//!   transformers defaults for optional keys);
//! * the conversion of that struct into the generic decoder description the engine
//!   runs, [`ModelConfig`]: sizes, the per-layer token mixer
//!   ([`crate::mixers::MixerKind`]), the FFN layout (dense / MoE per layer);
//! * its checkpoint layout: tensor names ([`crate::config::TensorNames`]) and
//!   mixer-specific row layouts such as the Gated DeltaNet input projection
//!   ([`crate::config::InProjLayout`]), which the CPU loader (`model.rs`), the GPU
//!   loader (`cuda/load.rs`) and the random-checkpoint writer all read from the
//!   config, so none of them branches on the family.
//!
//! Adding a family is one file here and one line in [`FAMILIES`]
//! (docs/adding-a-model-family.md).
pub mod bailing_moe_linear;
pub mod kimi_linear;
pub mod qwen3_5;
pub mod qwen3_next;

use crate::config::{cfg_err, ModelConfig};
use crate::error::{Error, Result};
use crate::mixers::MixerKind;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// One registered model family.
#[derive(Clone, Copy, Debug)]
pub struct FamilyEntry {
    /// Family name (its file under `models/`).
    pub name: &'static str,
    /// The config.json `model_type` values it reads.
    pub model_types: &'static [&'static str],
    /// Builds the decoder description from a whole config.json whose top-level
    /// `model_type` is one of [`FamilyEntry::model_types`] (passed as the second
    /// argument).
    pub decoder_config: fn(&Value, &str) -> Result<ModelConfig>,
}

/// The registry: one line per family.
pub const FAMILIES: &[FamilyEntry] = &[
    qwen3_next::FAMILY,
    qwen3_5::FAMILY,
    bailing_moe_linear::FAMILY,
    kimi_linear::FAMILY,
];

/// The family registered for `model_type`, if any.
pub fn family_for(model_type: &str) -> Option<&'static FamilyEntry> {
    FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&model_type))
}

/// Every supported `model_type`, in registry order.
pub fn supported_model_types() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

/// Parses a whole config.json value into the decoder description, through the
/// family registered for its `model_type`; the result is validated
/// ([`ModelConfig::validate`]).
///
/// Errors: [`Error::Config`] when `model_type` is missing or a field is missing,
/// mistyped or inconsistent (named); [`Error::UnsupportedModel`] (listing the
/// supported types) when no family reads the `model_type`.
pub fn decoder_config(root: &Value) -> Result<ModelConfig> {
    let model_type = root
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| cfg_err("model_type", "missing or not a string"))?;
    let family =
        family_for(model_type).ok_or_else(|| Error::UnsupportedModel(model_type.to_string()))?;
    let cfg = (family.decoder_config)(root, model_type)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Deserialises `v` into a family's config struct; a failure becomes
/// [`Error::Config`] naming the field's path (under `at`, e.g. `text_config.`).
pub(crate) fn parse<T: DeserializeOwned>(v: &Value, at: &str) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            at.trim_end_matches('.').to_string()
        } else {
            format!("{at}{path}")
        };
        let field = if field.is_empty() {
            "config.json".to_string()
        } else {
            field
        };
        cfg_err(&field, &e.into_inner().to_string())
    })
}

/// `rope_parameters` (transformers ≥ 5) or `rope_scaling` (older): the keys read here.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct RopeParameters {
    /// RoPE base θ.
    pub rope_theta: Option<f64>,
    /// Fraction of each head's dims that rotate.
    pub partial_rotary_factor: Option<f64>,
}

/// The mixers of a Qwen-style hybrid stack: from `layer_types` (`linear_attention`
/// → Gated DeltaNet, `full_attention` → attention) or, without it, every
/// `full_attention_interval`-th layer full attention (HF default interval 4).
///
/// Errors: an unknown entry (named with its index); a list whose length is not
/// `num_layers`.
pub(crate) fn qwen_hybrid_mixers(
    layer_types: Option<&[String]>,
    full_attention_interval: Option<usize>,
    num_layers: usize,
) -> Result<Vec<MixerKind>> {
    let mixers = match layer_types {
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "linear_attention" => Ok(MixerKind::GatedDeltaNet),
                "full_attention" => Ok(MixerKind::Attention),
                _ => Err(cfg_err(
                    "layer_types",
                    &format!(
                        "entry {i} is \"{t}\", expected \"linear_attention\" or \"full_attention\""
                    ),
                )),
            })
            .collect::<Result<Vec<_>>>()?,
        None => {
            let interval = full_attention_interval.unwrap_or(4).max(1);
            (0..num_layers)
                .map(|i| {
                    if (i + 1) % interval == 0 {
                        MixerKind::Attention
                    } else {
                        MixerKind::GatedDeltaNet
                    }
                })
                .collect()
        }
    };
    if mixers.len() != num_layers {
        return Err(cfg_err(
            "layer_types",
            &format!(
                "has {} entries but num_hidden_layers is {num_layers}",
                mixers.len()
            ),
        ));
    }
    Ok(mixers)
}

/// Rotary dims per head: `int(head_dim · partial_rotary_factor)` (HF truncates).
pub(crate) fn rotary_dim(head_dim: usize, partial_rotary_factor: f64) -> usize {
    ((head_dim as f64) * partial_rotary_factor) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture(name: &str) -> Value {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(name)
            .join("config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    #[test]
    fn unknown_model_type_lists_the_supported_ones() {
        let e = decoder_config(&serde_json::json!({"model_type": "llama", "hidden_size": 8}))
            .unwrap_err();
        assert!(
            matches!(&e, Error::UnsupportedModel(t) if t == "llama"),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("`llama`"), "{msg}");
        for t in supported_model_types() {
            assert!(msg.contains(t), "{msg} lacks {t}");
        }
        let e = decoder_config(&serde_json::json!({"hidden_size": 8})).unwrap_err();
        assert!(e.to_string().contains("model_type"), "{e}");
    }

    #[test]
    fn model_types_are_registered_once() {
        let mut all = supported_model_types();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a model_type is claimed by two families");
        for f in FAMILIES {
            for t in f.model_types {
                assert_eq!(family_for(t).map(|g| g.name), Some(f.name));
            }
        }
    }

    /// Every registered model_type parses a fixture config: the golden folders for
    /// the wrapper types, and the wrapper's `text_config` lifted to the top level
    /// for the bare `*_text` types (as a text-only checkpoint stores it).
    #[test]
    fn each_registered_model_type_parses_its_fixture() {
        for t in supported_model_types() {
            let (json, folder) = match t {
                t if t.ends_with("_text") => {
                    let folder = t.trim_end_matches("_text");
                    let mut text = fixture(folder)["text_config"].clone();
                    text["model_type"] = Value::from(t);
                    (text, folder)
                }
                _ => (fixture(t), t),
            };
            let c = decoder_config(&json).unwrap_or_else(|e| panic!("{t}: {e}"));
            assert_eq!(c.model_type, t);
            assert_eq!(c.family, family_for(t).unwrap().name);
            // The wrapper and its bare text model describe the same decoder, with
            // the text model's tensors one level up.
            let wrapper = decoder_config(&fixture(folder)).unwrap();
            assert_eq!(c.mixers, wrapper.mixers, "{t}");
            assert_eq!(c.layer_is_moe, wrapper.layer_is_moe, "{t}");
            assert_eq!(
                (c.hidden_size, c.num_layers, c.num_experts, c.rotary_dim),
                (
                    wrapper.hidden_size,
                    wrapper.num_layers,
                    wrapper.num_experts,
                    wrapper.rotary_dim
                ),
                "{t}"
            );
        }
    }

    #[test]
    fn a_mistyped_field_is_named_with_its_path() {
        let mut v = fixture("qwen3_5");
        v["text_config"]["hidden_size"] = Value::from("wide");
        let e = decoder_config(&v).unwrap_err().to_string();
        assert!(e.contains("text_config.hidden_size"), "{e}");
        let mut v = fixture("qwen3_next");
        v["layer_types"][1] = Value::from("sliding_attention");
        let e = decoder_config(&v).unwrap_err().to_string();
        assert!(
            e.contains("entry 1") && e.contains("sliding_attention"),
            "{e}"
        );
    }
}
