//! Token mixers: the sequence operator of each decoder layer (the part that mixes
//! information across positions; the FFN after it is per token).
//!
//! Each decoder layer has one [`MixerKind`], read from the family's config
//! (`ModelConfig::mixers`). A linear-attention mixer keeps a recurrent state and
//! declares the PIC transition family of its recurrence
//! ([`MixerKind::transition_family`]), which fixes the storage form of the cached
//! segment pairs `(T_C, S_{C|0})` (`linear::transition`); the PIC engine and both
//! backends read it from the layer's mixer instead of assuming one.
//!
//! Modules: [`attention`] (gated full attention, CPU), [`gated_deltanet`],
//! [`lightning`] (Ring-linear's scalar-decay linear attention with RoPE), [`kda`]
//! (Kimi Delta Attention) and [`mla`] (Kimi-Linear's latent attention without RoPE).
//!
//! Every linear mixer keeps its simple reference beside its fast path, as FLA keeps
//! `naive.py` beside `chunk.py`: [`gated_deltanet::naive`] (token-by-token) beside
//! [`gated_deltanet::chunk`] (chunked WY form), tested against each other; the GPU
//! kernels (`cuda::gdr`) are tested against the same reference.
//!
//! Adding a mixer (docs/adding-a-model-family.md): a module here with its naive and
//! chunked recurrences and its CPU layer, a [`MixerKind`] variant with its
//! transition family, and the layer dispatch in `model.rs` (and `cuda/model.rs`).
pub mod attention;
pub mod gated_deltanet;
pub mod kda;
pub mod lightning;
pub mod mla;

use crate::linear::transition::{Family as TransitionFamily, TransitionKind};

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MixerKind {
    /// Gated DeltaNet ([`gated_deltanet`]): conv tail `[conv_dim, K−1]` and
    /// recurrent state `[Hv, dk, dv]`; transition family
    /// [`TransitionFamily::GatedDelta`]. HF `layer_types` entry `linear_attention`
    /// in Qwen3-Next / Qwen3.5.
    GatedDeltaNet,
    /// Gated full softmax attention with a KV cache (q/k RMSNorm, partial RoPE,
    /// optional sigmoid output gate). HF `layer_types` entry `full_attention`.
    Attention,
    /// Lightning attention ([`lightning`]): no conv tail, recurrent state
    /// `[H, d, d]`, constant per-head scalar decay, RoPE on q/k; transition family
    /// [`TransitionFamily::Scalar`]. The linear layers of Ring-linear-2.0.
    Lightning,
    /// Kimi Delta Attention ([`kda`]): conv tail `[3·H·d, K−1]` and recurrent state
    /// `[H, d, d]`, per-channel decay; transition family
    /// [`TransitionFamily::KimiDelta`]. The `kda_layers` of Kimi-Linear.
    Kda,
    /// Multi-head latent attention without RoPE ([`mla`]): a KV cache of latent rows
    /// (one `[kv_lora_rank + qk_rope_head_dim]` row per token). The
    /// `full_attn_layers` of Kimi-Linear.
    Mla,
}

impl MixerKind {
    /// Whether the layer keeps a fixed-size recurrent state (linear attention)
    /// rather than a KV cache.
    pub fn is_linear(self) -> bool {
        match self {
            MixerKind::GatedDeltaNet | MixerKind::Lightning | MixerKind::Kda => true,
            MixerKind::Attention | MixerKind::Mla => false,
        }
    }

    /// The PIC transition family of a linear mixer's recurrence (the form of its
    /// cached segment transitions); `None` for attention, whose cache is its K/V.
    pub fn transition_family(self) -> Option<TransitionFamily> {
        match self {
            MixerKind::GatedDeltaNet => Some(gated_deltanet::TRANSITION_FAMILY),
            MixerKind::Lightning => Some(lightning::TRANSITION_FAMILY),
            MixerKind::Kda => Some(kda::TRANSITION_FAMILY),
            MixerKind::Attention | MixerKind::Mla => None,
        }
    }

    /// Storage form of the cached segment transitions `T_C` of a linear mixer
    /// (its family's [`TransitionFamily::kind`]); `None` for attention.
    pub fn transition_kind(self) -> Option<TransitionKind> {
        self.transition_family().map(TransitionFamily::kind)
    }

    /// Short name for messages and metrics (`gated_deltanet`, `attention`,
    /// `lightning`, `kda`, `mla`).
    pub fn name(self) -> &'static str {
        match self {
            MixerKind::GatedDeltaNet => "gated_deltanet",
            MixerKind::Attention => "attention",
            MixerKind::Lightning => "lightning",
            MixerKind::Kda => "kda",
            MixerKind::Mla => "mla",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_mixers_declare_a_transition_family() {
        for m in [
            MixerKind::GatedDeltaNet,
            MixerKind::Attention,
            MixerKind::Lightning,
            MixerKind::Kda,
            MixerKind::Mla,
        ] {
            assert_eq!(m.is_linear(), m.transition_family().is_some(), "{m:?}");
        }
        assert_eq!(
            MixerKind::GatedDeltaNet.transition_family(),
            Some(TransitionFamily::GatedDelta)
        );
        assert_eq!(
            MixerKind::Lightning.transition_family(),
            Some(TransitionFamily::Scalar)
        );
        assert_eq!(
            MixerKind::Kda.transition_family(),
            Some(TransitionFamily::KimiDelta)
        );
        assert_eq!(MixerKind::Mla.transition_family(), None);
    }
}
