//! Per-layer model state: what a span's prefill starts from and returns.
//!
//! Linear layers (Gated DeltaNet, KDA, Lightning) keep a conv tail (empty for
//! Lightning) and a recurrent state; full-attention layers (gated attention, MLA)
//! keep the KV of earlier tokens with their absolute positions (positions need not be
//! contiguous: position-independent caching places re-rotated KV anywhere).

/// State of one linear-attention layer (Gated DeltaNet, KDA, Lightning).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearState {
    /// Conv tail: the last `K−1` conv inputs, channel-major `[conv_dim, K−1]`
    /// (oldest first). Zeros at the start of a sequence.
    pub conv: Vec<f32>,
    /// Recurrent state `S`, `[Hv, dk, dv]` K-major, fp32.
    pub recurrent: Vec<f32>,
}

/// KV cache of one full-attention layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvCache {
    /// Keys after q/k-norm and RoPE at their position, token-major `[n, Hkv, head_dim]`
    /// (MLA: the latent rows `[n, 1, kv_lora_rank + qk_rope_head_dim]`).
    pub k: Vec<f32>,
    /// Values, `[n, Hkv, head_dim]` (MLA: the same latent rows as `k`).
    pub v: Vec<f32>,
    /// Absolute position of each of the `n` cached tokens.
    pub positions: Vec<i64>,
}

impl KvCache {
    /// Number of cached tokens.
    pub fn len(&self) -> usize {
        self.positions.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

/// State of one decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub enum LayerState {
    /// Linear-attention layer.
    Linear(LinearState),
    /// Full-attention layer.
    Full(KvCache),
}

/// Whole-model state of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelState {
    /// One entry per decoder layer.
    pub layers: Vec<LayerState>,
    /// Absolute position the next token gets.
    pub next_position: i64,
}

impl ModelState {
    /// Bytes held (fp32 elements × 4 plus positions).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => 4 * (s.conv.len() + s.recurrent.len()),
                LayerState::Full(kv) => 4 * (kv.k.len() + kv.v.len()) + 8 * kv.positions.len(),
            })
            .sum()
    }
}
