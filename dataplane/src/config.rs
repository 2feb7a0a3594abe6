//! The generic decoder description the engine runs ([`ModelConfig`]), built by a
//! model family ([`crate::models`]) from an unmodified Hugging Face `config.json`.
//!
//! Each family (`models/qwen3_next.rs`, `models/qwen3_5.rs`) parses its own
//! config.json struct and converts it into a [`ModelConfig`]: sizes, the per-layer
//! token mixers ([`MixerKind`]), the FFN layout and the checkpoint tensor names
//! ([`TensorNames`], [`InProjLayout`]). Nothing outside `models/` branches on the
//! family (docs/pic-design.md §8.1 for the Qwen facts).
use crate::error::{io_err, Error, Result};
pub use crate::mixers::attention::AttnProjLayout;
pub use crate::mixers::gated_deltanet::InProjLayout;
pub use crate::mixers::lightning::{LightningConfig, SlopeRule};
pub use crate::mixers::mla::MlaConfig;
pub use crate::mixers::MixerKind;
pub use crate::router::{RouterConfig, ScoreFunction};
use serde_json::Value;
use std::path::Path;

/// Checkpoint tensor names of a family: `{prefix}{embed}`, `{prefix}{norm}`,
/// `{lm_head}` (no prefix), and per layer `i` `{prefix}{layers}{i}.` followed by the
/// norm names, the mixer prefix of its [`MixerKind`] and the FFN prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorNames {
    /// Prefix of the decoder tensors (`model.`, or `model.language_model.` for a
    /// Qwen3.5 vision-language wrapper).
    pub prefix: String,
    /// Token embedding under the prefix (`embed_tokens.weight`).
    pub embed: &'static str,
    /// Final norm under the prefix (`norm.weight`).
    pub final_norm: &'static str,
    /// Untied LM head, without the prefix (`lm_head.weight`).
    pub lm_head: &'static str,
    /// Layer list under the prefix (`layers.`).
    pub layers: &'static str,
    /// Pre-mixer norm under the layer (`input_layernorm.weight`).
    pub input_norm: &'static str,
    /// Pre-FFN norm under the layer (`post_attention_layernorm.weight`).
    pub post_norm: &'static str,
    /// Gated DeltaNet mixer prefix under the layer (`linear_attn.`).
    pub gated_deltanet: &'static str,
    /// Attention mixer prefix under the layer (`self_attn.`).
    pub attention: &'static str,
    /// Lightning attention mixer prefix under the layer (`attention.` in
    /// Ring-linear; unused by families without Lightning layers).
    pub lightning: &'static str,
    /// Kimi Delta Attention mixer prefix under the layer (`self_attn.` in
    /// Kimi-Linear; unused by families without KDA layers).
    pub kda: &'static str,
    /// Latent-attention (MLA) mixer prefix under the layer (`self_attn.` in
    /// Kimi-Linear).
    pub mla: &'static str,
    /// FFN (dense MLP or MoE) prefix under the layer (`mlp.`).
    pub ffn: &'static str,
    /// A second prefix under the layer for a *dense* FFN, used when
    /// `{ffn}gate_proj.weight` is absent (Kimi-Linear: HF `save_pretrained` writes the
    /// dense layer under `block_sparse_moe.`, other exports under `mlp.`).
    pub dense_ffn_alt: Option<&'static str>,
    /// Names of a routed expert's gate, up and down projections under
    /// `{ffn}experts.{e}.` (`gate_proj.weight`, `up_proj.weight`, `down_proj.weight`;
    /// Kimi-Linear: `w1.weight`, `w3.weight`, `w2.weight`).
    pub expert_proj: [&'static str; 3],
    /// Shared-expert MLP prefix under the FFN prefix (`shared_expert.` for Qwen,
    /// `shared_experts.` for the DeepSeek-style families).
    pub shared_expert: &'static str,
    /// Sigmoid gate `[1, hidden]` of the shared expert under the FFN prefix
    /// (`shared_expert_gate.weight` for Qwen); `None`: the shared expert's output is
    /// added ungated (Ring-linear, Kimi-Linear).
    pub shared_expert_gate: Option<&'static str>,
}

impl TensorNames {
    /// The Hugging Face Qwen decoder names (Qwen3-Next, Qwen3.5) under `prefix`.
    pub fn qwen(prefix: &str) -> Self {
        TensorNames {
            prefix: prefix.to_string(),
            embed: "embed_tokens.weight",
            final_norm: "norm.weight",
            lm_head: "lm_head.weight",
            layers: "layers.",
            input_norm: "input_layernorm.weight",
            post_norm: "post_attention_layernorm.weight",
            gated_deltanet: "linear_attn.",
            attention: "self_attn.",
            lightning: "attention.",
            kda: "self_attn.",
            mla: "self_attn.",
            ffn: "mlp.",
            dense_ffn_alt: None,
            expert_proj: ["gate_proj.weight", "up_proj.weight", "down_proj.weight"],
            shared_expert: "shared_expert.",
            shared_expert_gate: Some("shared_expert_gate.weight"),
        }
    }
    /// Full name of the token embedding.
    pub fn embed_tokens(&self) -> String {
        format!("{}{}", self.prefix, self.embed)
    }
    /// Full name of the final norm.
    pub fn norm(&self) -> String {
        format!("{}{}", self.prefix, self.final_norm)
    }
    /// Prefix of layer `i` (`model.layers.3.`).
    pub fn layer(&self, i: usize) -> String {
        format!("{}{}{i}.", self.prefix, self.layers)
    }
    /// Full name of layer `i`'s pre-mixer norm.
    pub fn input_layernorm(&self, i: usize) -> String {
        format!("{}{}", self.layer(i), self.input_norm)
    }
    /// Full name of layer `i`'s pre-FFN norm.
    pub fn post_layernorm(&self, i: usize) -> String {
        format!("{}{}", self.layer(i), self.post_norm)
    }
    /// Prefix of layer `i`'s mixer of kind `kind`.
    pub fn mixer(&self, i: usize, kind: MixerKind) -> String {
        let m = match kind {
            MixerKind::GatedDeltaNet => self.gated_deltanet,
            MixerKind::Attention => self.attention,
            MixerKind::Lightning => self.lightning,
            MixerKind::Kda => self.kda,
            MixerKind::Mla => self.mla,
        };
        format!("{}{m}", self.layer(i))
    }
    /// Prefix of layer `i`'s FFN.
    pub fn mlp(&self, i: usize) -> String {
        format!("{}{}", self.layer(i), self.ffn)
    }
}

/// Text-model hyper-parameters. Sizes are element counts.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// `model_type` of the top-level config.
    pub model_type: String,
    /// Name of the model family that built this description (`models::FAMILIES`).
    pub family: &'static str,
    /// Checkpoint tensor names.
    pub names: TensorNames,
    /// How the checkpoint stores the Gated DeltaNet input projection.
    pub gdn_in_proj: InProjLayout,
    /// Residual width (`hidden_size`).
    pub hidden_size: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub num_layers: usize,
    /// Vocabulary size (embedding and LM-head rows).
    pub vocab_size: usize,
    /// Per-layer token mixer (from `layer_types`).
    pub mixers: Vec<MixerKind>,
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
    /// Gated DeltaNet key (query) heads Hk.
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
    /// The MoE routing rule (score function, selection bias, grouped top-k,
    /// scaling); [`RouterConfig::default`] is the Qwen softmax router.
    pub router: RouterConfig,
    /// Dense-MLP width (layers that are not MoE).
    pub intermediate_size: usize,
    /// Per-layer: true when the layer's MLP is a MoE block.
    pub layer_is_moe: Vec<bool>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// How the checkpoint stores the decoder's RMSNorm weights (input,
    /// post-attention, final, q/k norms). The model keeps them zero-centred.
    pub norm: NormStyle,
    /// How the checkpoint stores the full-attention projections.
    pub attn_proj: AttnProjLayout,
    /// Lightning attention settings (used by [`MixerKind::Lightning`] layers).
    pub lightning: LightningConfig,
    /// Latent-attention sizes (used by [`MixerKind::Mla`] layers; zeros otherwise).
    /// An MLA model sets `num_kv_heads = 1` and `head_dim = MlaConfig::row()`: the
    /// width of its cached latent rows.
    pub mla: MlaConfig,
    /// LM head tied to the embedding.
    pub tie_word_embeddings: bool,
    /// Context limit in tokens.
    pub max_position_embeddings: usize,
}

/// Storage form of a family's RMSNorm weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormStyle {
    /// `x̂ · (1 + w)` (Qwen3-Next, Qwen3.5: `Qwen3NextRMSNorm`).
    #[default]
    ZeroCentred,
    /// `x̂ · w` (the standard RMSNorm: Ring-linear, Kimi-Linear).
    Plain,
}

impl ModelConfig {
    /// A checkpoint RMSNorm weight in the model's zero-centred form: unchanged for
    /// [`NormStyle::ZeroCentred`], `w − 1` for [`NormStyle::Plain`] (exact for
    /// `w ∈ [0.5, 2]`; one rounding otherwise).
    pub fn norm_weight(&self, mut w: Vec<f32>) -> Vec<f32> {
        if self.norm == NormStyle::Plain {
            w.iter_mut().for_each(|x| *x -= 1.0);
        }
        w
    }

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

    /// Parses a config.json value through the family registered for its
    /// `model_type` ([`crate::models::decoder_config`]; see [`ModelConfig::from_dir`]).
    pub fn from_json(root: &Value) -> Result<Self> {
        crate::models::decoder_config(root)
    }

    /// Number of layers whose mixer is linear attention (a recurrent state).
    pub fn num_linear_layers(&self) -> usize {
        self.mixers.iter().filter(|m| m.is_linear()).count()
    }

    /// Number of full-attention layers (a KV cache).
    pub fn num_attention_layers(&self) -> usize {
        self.mixers.len() - self.num_linear_layers()
    }

    /// Layer counts `n` at which the first `n` layers end on a full-attention layer
    /// (attention or MLA): the end of one group of the family's layer plan as its
    /// parser wrote [`ModelConfig::mixers`] (Qwen: every `full_attention_interval`-th
    /// layer; Ring-linear: `(i + 1) % layer_group_size == 0`; Kimi-Linear: the
    /// `full_attn_layers` list). Ascending; [`ModelConfig::num_layers`] is always the
    /// last entry, so a stack without full attention has the single cut `num_layers`.
    pub fn layer_cuts(&self) -> Vec<usize> {
        let n = self.num_layers.min(self.mixers.len());
        let mut cuts: Vec<usize> = (0..n)
            .filter(|&i| !self.mixers[i].is_linear())
            .map(|i| i + 1)
            .collect();
        if cuts.last() != Some(&self.num_layers) {
            cuts.push(self.num_layers);
        }
        cuts
    }

    /// The first `n` layers of the stack (same shapes; `num_layers`, `mixers` and
    /// `layer_is_moe` truncated; `n` is clamped to the stack). Lightning decay factors,
    /// which depend on the layer count ([`SlopeRule::factor`]), follow the new count.
    pub fn first_layers(&self, n: usize) -> ModelConfig {
        let n = n.min(self.num_layers);
        let mut c = self.clone();
        c.num_layers = n;
        c.mixers.truncate(n);
        c.layer_is_moe.truncate(n);
        c
    }

    /// The largest of [`ModelConfig::layer_cuts`] whose [`ModelConfig::first_layers`]
    /// satisfies `fits` (e.g. weights and states within the free device memory), with
    /// `true`; the smallest cut with `false` when none does.
    pub fn largest_cut(&self, mut fits: impl FnMut(&ModelConfig) -> bool) -> (usize, bool) {
        let cuts = self.layer_cuts();
        for &n in cuts.iter().rev() {
            if fits(&self.first_layers(n)) {
                return (n, true);
            }
        }
        (cuts[0], false)
    }

    /// Layer indices (0-based) of each mixer kind in the stack, in order of first
    /// appearance, as `kind: i, j, a..b` (runs of consecutive indices shortened), for
    /// headers that say which layers a cut model kept.
    pub fn layer_plan(&self) -> String {
        let mut kinds: Vec<MixerKind> = vec![];
        for m in &self.mixers {
            if !kinds.contains(m) {
                kinds.push(*m);
            }
        }
        let parts: Vec<String> = kinds
            .iter()
            .map(|k| {
                let idx: Vec<usize> = (0..self.mixers.len())
                    .filter(|&i| self.mixers[i] == *k)
                    .collect();
                let mut runs: Vec<String> = vec![];
                let mut i = 0;
                while i < idx.len() {
                    let mut j = i;
                    while j + 1 < idx.len() && idx[j + 1] == idx[j] + 1 {
                        j += 1;
                    }
                    runs.push(if j > i {
                        format!("{}-{}", idx[i], idx[j])
                    } else {
                        idx[i].to_string()
                    });
                    i = j + 1;
                }
                format!("{} {} [{}]", idx.len(), k.name(), runs.join(", "))
            })
            .collect();
        parts.join("; ")
    }

    /// Checks the sizes a family produced (nonzero where needed, head counts that
    /// divide, even rotary dims, top-k within the experts).
    ///
    /// Errors: [`Error::Config`] naming the config.json field at fault.
    pub fn validate(&self) -> Result<()> {
        if self.mixers.len() != self.num_layers {
            return Err(cfg_err(
                "layer_types",
                &format!(
                    "has {} entries but num_hidden_layers is {}",
                    self.mixers.len(),
                    self.num_layers
                ),
            ));
        }
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
        if self.num_experts > 0 {
            self.router
                .check(self.num_experts, self.experts_per_tok)
                .map_err(|(k, m)| cfg_err(k, &m))?;
        }
        Ok(())
    }
}

/// A [`Error::Config`] for `field`.
pub(crate) fn cfg_err(field: &str, msg: &str) -> Error {
    Error::Config {
        field: field.to_string(),
        msg: msg.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench_config(name: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../benches/configs")
            .join(name);
        ModelConfig::from_dir(&dir).unwrap()
    }

    /// Cuts end on each family's full-attention layers, so a cut model keeps the
    /// layer plan: Ring-mini groups of 5, Ring-flash groups of 8, Kimi-Linear's
    /// `full_attn_layers` (1-indexed 4, 8, …, 24, 27), Qwen3.5 every 4th layer.
    #[test]
    fn layer_cuts_follow_each_family_plan() {
        let ring = bench_config("ring_mini_linear_2_0");
        assert_eq!(ring.layer_cuts(), vec![5, 10, 15, 20]);
        let flash = bench_config("ring_flash_linear_2_0");
        assert_eq!(flash.layer_cuts(), vec![8, 16, 24, 32]);
        let kimi = bench_config("kimi_linear_48b_a3b");
        assert_eq!(kimi.layer_cuts(), vec![4, 8, 12, 16, 20, 24, 27]);
        let qwen = bench_config("qwen3_5_35b_a3b");
        assert_eq!(
            qwen.layer_cuts(),
            (1..=qwen.num_layers / 4).map(|g| 4 * g).collect::<Vec<_>>()
        );
        // No full attention: the whole stack is the only cut.
        let lin = ring.first_layers(4);
        assert!(lin.mixers.iter().all(|m| m.is_linear()));
        assert_eq!(lin.layer_cuts(), vec![4]);
        let c = kimi.first_layers(8);
        assert_eq!(c.num_layers, 8);
        assert_eq!(c.mixers, kimi.mixers[..8].to_vec());
        assert_eq!(c.layer_is_moe, kimi.layer_is_moe[..8].to_vec());
        assert_eq!((c.num_linear_layers(), c.num_attention_layers()), (6, 2));
        assert_eq!(kimi.first_layers(99).num_layers, 27);
    }

    /// The largest cut that fits a budget, and the smallest (marked) when none does.
    #[test]
    fn largest_cut_picks_by_budget() {
        let ring = bench_config("ring_mini_linear_2_0");
        let bytes = |c: &ModelConfig| crate::random::ParamCounts::of(c).bytes(4);
        let full = bytes(&ring);
        assert_eq!(ring.largest_cut(|c| bytes(c) <= full), (20, true));
        assert_eq!(ring.largest_cut(|c| bytes(c) < full), (15, true));
        assert_eq!(ring.largest_cut(|_| false), (5, false));
        let kimi = bench_config("kimi_linear_48b_a3b");
        let (n, ok) = kimi.largest_cut(|c| bytes(c) <= 70 << 30);
        assert!(ok && n < 27 && n.is_multiple_of(4), "{n}");
        assert_eq!(kimi.first_layers(n).mixers.last(), Some(&MixerKind::Mla));
    }

    #[test]
    fn layer_plan_names_kept_layers() {
        let ring = bench_config("ring_mini_linear_2_0").first_layers(10);
        assert_eq!(
            ring.layer_plan(),
            "8 lightning [0-3, 5-8]; 2 attention [4, 9]"
        );
    }
}
