//! Gated DeltaNet (the `linear_attn` mixer of Qwen3-Next and Qwen3.5): the gated
//! delta rule with its simple reference beside the fast path, the CPU layer around
//! it, and the checkpoint layouts of its input projection.
//!
//! * [`naive`]: the token-by-token recurrence (the reference; FLA `naive.py`);
//! * [`chunk`]: the chunked WY prefill and the segment transition `T_C` built in the
//!   same pass (FLA `chunk.py`), tested against [`naive`];
//! * `layer` (crate-internal): projections, causal conv, gates, gated RMSNorm and the
//!   PIC body pairs of the CPU model ([`crate::model::Model`]);
//! * [`InProjLayout`]: how a checkpoint stores the input projection (a family picks
//!   one in its `ModelConfig`).
//!
//! The recurrence is `S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`,
//! `o_t = S_tᵀ q_t` (docs/pic-design.md §2.1): PIC transition family
//! [`TRANSITION_FAMILY`] (dense `T_C`). Layouts follow FLA / HF transformers:
//! time-major inputs `[T, H, D]`, recurrent state K-major `[Hv, dk, dv]` in fp32.
//! Callers pass q and k already L2-normalised and q already scaled by `dk^-0.5`.
pub mod chunk;
pub(crate) mod layer;
pub mod naive;

pub use chunk::{chunked, chunked_with_transition, DEFAULT_CHUNK};
pub(crate) use chunk::{flush, flush_all, for_each_head, matmul, FLUSH_STATE, FLUSH_UNIT};
pub use naive::recurrent;

use crate::config::ModelConfig;
use crate::linear::transition::Family;

/// The PIC transition family of this mixer: `T_t = exp(g_t)(I − β_t k_t k_tᵀ)`.
pub const TRANSITION_FAMILY: Family = Family::GatedDelta;

/// Dimensions of one gated-delta-rule call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdrDims {
    /// Number of tokens T.
    pub t: usize,
    /// Key (query) heads Hk.
    pub hk: usize,
    /// Value heads Hv (a multiple of Hk).
    pub hv: usize,
    /// Key head dim dk.
    pub dk: usize,
    /// Value head dim dv.
    pub dv: usize,
}

impl GdrDims {
    /// Elements of one recurrent state `[Hv, dk, dv]`.
    pub fn state_len(&self) -> usize {
        self.hv * self.dk * self.dv
    }
    pub(crate) fn check(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        state: &[f32],
    ) {
        assert!(
            self.hk > 0 && self.hv.is_multiple_of(self.hk),
            "Hv must be a multiple of Hk"
        );
        assert_eq!(q.len(), self.t * self.hk * self.dk, "q must be [T, Hk, dk]");
        assert_eq!(k.len(), self.t * self.hk * self.dk, "k must be [T, Hk, dk]");
        assert_eq!(v.len(), self.t * self.hv * self.dv, "v must be [T, Hv, dv]");
        assert_eq!(g.len(), self.t * self.hv, "g must be [T, Hv]");
        assert_eq!(beta.len(), self.t * self.hv, "beta must be [T, Hv]");
        assert_eq!(state.len(), self.state_len(), "state must be [Hv, dk, dv]");
    }
}

/// How a checkpoint stores the Gated DeltaNet input projection.
///
/// The model uses one merged matrix `[2·key_dim + 2·value_dim + 2·Hv, hidden]`
/// with rows `q | k | v | z | b | a` (each block head-major, key heads for q/k and
/// value heads for v/z/b/a). A layout names the checkpoint tensors that hold those
/// rows ([`InProjLayout::tensors`]) and which of their rows go where
/// ([`InProjLayout::blocks`]); the CPU loader, the GPU loader and the random
/// checkpoint writer all read it from here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InProjLayout {
    /// `in_proj_qkv [2·key_dim + value_dim, hidden]`, `in_proj_z [value_dim,
    /// hidden]`, `in_proj_b [Hv, hidden]`, `in_proj_a [Hv, hidden]`: the merged rows
    /// in order (Qwen3.5).
    Split,
    /// Grouped per key head `g` (with `r = Hv/Hk`): `in_proj_qkvz [2·key_dim +
    /// 2·value_dim, hidden]` holds `[q(dk) | k(dk) | v(r·dv) | z(r·dv)]` per group and
    /// `in_proj_ba [2·Hv, hidden]` holds `[b(r) | a(r)]` per group (Qwen3-Next; HF
    /// `fix_query_key_value_ordering` undoes the grouping).
    GroupedPerKeyHead,
}

/// One checkpoint tensor of an input-projection layout: `{mixer prefix}{name}`,
/// shape `[rows, hidden]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InProjTensor {
    /// Name under the layer's mixer prefix, e.g. `in_proj_qkvz.weight`.
    pub name: &'static str,
    /// Rows (output features).
    pub rows: usize,
}

/// Rows `src_row .. src_row + rows` of tensor `tensor` (an index into
/// [`InProjLayout::tensors`]) are the next `rows` rows of the merged projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBlock {
    /// Index of the source tensor.
    pub tensor: usize,
    /// First source row.
    pub src_row: usize,
    /// Number of rows.
    pub rows: usize,
}

impl InProjLayout {
    /// Rows of the merged projection: `2·key_dim + 2·value_dim + 2·Hv`.
    pub fn merged_rows(c: &ModelConfig) -> usize {
        2 * c.key_dim() + 2 * c.value_dim() + 2 * c.linear_v_heads
    }

    /// The layout a checkpoint actually uses: grouped when it holds the fused
    /// `{prefix}in_proj_qkvz.weight` (Qwen3.5 weights converted under Qwen3-Next
    /// names load too), else `self`.
    pub fn resolve(self, has_tensor: impl Fn(&str) -> bool, prefix: &str) -> Self {
        if has_tensor(&format!("{prefix}in_proj_qkvz.weight")) {
            InProjLayout::GroupedPerKeyHead
        } else {
            self
        }
    }

    /// The checkpoint tensors of this layout, in reading order.
    pub fn tensors(self, c: &ModelConfig) -> Vec<InProjTensor> {
        let (kd, vd, hv) = (c.key_dim(), c.value_dim(), c.linear_v_heads);
        let t = |name, rows| InProjTensor { name, rows };
        match self {
            InProjLayout::Split => vec![
                t("in_proj_qkv.weight", 2 * kd + vd),
                t("in_proj_z.weight", vd),
                t("in_proj_b.weight", hv),
                t("in_proj_a.weight", hv),
            ],
            InProjLayout::GroupedPerKeyHead => vec![
                t("in_proj_qkvz.weight", 2 * kd + 2 * vd),
                t("in_proj_ba.weight", 2 * hv),
            ],
        }
    }

    /// The source row blocks in merged-row order (their `rows` sum to
    /// [`InProjLayout::merged_rows`]).
    pub fn blocks(self, c: &ModelConfig) -> Vec<RowBlock> {
        let b = |tensor, src_row, rows| RowBlock {
            tensor,
            src_row,
            rows,
        };
        match self {
            InProjLayout::Split => self
                .tensors(c)
                .iter()
                .enumerate()
                .map(|(i, t)| b(i, 0, t.rows))
                .collect(),
            InProjLayout::GroupedPerKeyHead => {
                let (hk, dk, dv) = (c.linear_k_heads, c.linear_k_dim, c.linear_v_dim);
                let rep = c.linear_v_heads / hk.max(1);
                let group = 2 * dk + 2 * rep * dv;
                let mut v = Vec::with_capacity(6 * hk);
                for (off, n) in [
                    (0, dk),
                    (dk, dk),
                    (2 * dk, rep * dv),
                    (2 * dk + rep * dv, rep * dv),
                ] {
                    v.extend((0..hk).map(|g| b(0, g * group + off, n)));
                }
                for off in [0, rep] {
                    v.extend((0..hk).map(|g| b(1, g * 2 * rep + off, rep)));
                }
                v
            }
        }
    }

    /// Whether every tensor is one block, in order (the merged matrix is the
    /// tensors' concatenation, so a loader can place each tensor directly).
    pub fn is_concatenation(self, c: &ModelConfig) -> bool {
        let t = self.tensors(c);
        let b = self.blocks(c);
        b.len() == t.len()
            && b.iter()
                .enumerate()
                .all(|(i, x)| x.tensor == i && x.src_row == 0 && x.rows == t[i].rows)
    }

    /// For source tensor `tensor`: the merged row of each of its rows.
    pub fn row_map(self, c: &ModelConfig, tensor: usize) -> Vec<usize> {
        let rows = self.tensors(c).get(tensor).map_or(0, |t| t.rows);
        let mut map = vec![usize::MAX; rows];
        let mut at = 0;
        for b in self.blocks(c) {
            if b.tensor == tensor {
                for j in 0..b.rows {
                    map[b.src_row + j] = at + j;
                }
            }
            at += b.rows;
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(model_type: &str) -> ModelConfig {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/golden")
            .join(model_type);
        ModelConfig::from_dir(&dir).unwrap()
    }

    /// Every layout covers each merged row once and uses each source row once.
    #[test]
    fn in_proj_layouts_are_permutations() {
        let c = config("qwen3_next");
        for layout in [InProjLayout::Split, InProjLayout::GroupedPerKeyHead] {
            let tensors = layout.tensors(&c);
            let blocks = layout.blocks(&c);
            let total: usize = blocks.iter().map(|b| b.rows).sum();
            assert_eq!(total, InProjLayout::merged_rows(&c), "{layout:?}");
            let mut merged = vec![];
            for (i, t) in tensors.iter().enumerate() {
                let m = layout.row_map(&c, i);
                assert_eq!(m.len(), t.rows);
                merged.extend(m);
            }
            merged.sort_unstable();
            assert_eq!(merged, (0..total).collect::<Vec<_>>(), "{layout:?}");
        }
        assert!(InProjLayout::Split.is_concatenation(&c));
        assert!(!InProjLayout::GroupedPerKeyHead.is_concatenation(&c));
    }

    /// Qwen3-Next grouping: merged k row 0 of key head 1 is row `group + dk` of
    /// `in_proj_qkvz`, and merged `a` of value head 0 is row `r` of `in_proj_ba`.
    #[test]
    fn grouped_layout_matches_the_hf_ordering() {
        let c = config("qwen3_next");
        let (hk, dk, dv) = (c.linear_k_heads, c.linear_k_dim, c.linear_v_dim);
        let rep = c.linear_v_heads / hk;
        let (kd, vd, hv) = (c.key_dim(), c.value_dim(), c.linear_v_heads);
        let group = 2 * dk + 2 * rep * dv;
        let l = InProjLayout::GroupedPerKeyHead;
        let qkvz = l.row_map(&c, 0);
        assert_eq!(qkvz[group + dk], kd + dk, "k of key head 1");
        assert_eq!(qkvz[group + 2 * dk], 2 * kd + rep * dv, "v of key head 1");
        let ba = l.row_map(&c, 1);
        assert_eq!(ba[rep], 2 * kd + 2 * vd + hv, "a of value head 0");
        assert_eq!(ba[2 * rep], 2 * kd + 2 * vd + rep, "b of key group 1");
    }

    /// A Qwen3.5 layout switches to grouped only when the fused tensor exists.
    #[test]
    fn resolve_follows_the_checkpoint() {
        let has = |n: &str| n == "p.in_proj_qkvz.weight";
        assert_eq!(
            InProjLayout::Split.resolve(has, "p."),
            InProjLayout::GroupedPerKeyHead
        );
        assert_eq!(InProjLayout::Split.resolve(has, "q."), InProjLayout::Split);
    }
}
