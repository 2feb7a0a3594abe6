//! Kimi Delta Attention (KDA, the linear layers of Kimi-Linear): the gated delta rule
//! with a **per-channel** decay, its simple reference beside the fast path, and the
//! CPU layer around it.
//!
//! * [`naive`]: the token-by-token recurrence (the reference; FLA `kda/naive.py`, HF
//!   `recurrent_kimi_delta_attention`);
//! * [`chunk`]: the chunked WY prefill, which also builds the segment transition
//!   `T_C` in the same pass, tested against [`naive`] around every chunk edge;
//! * `layer` (crate-internal): projections, the three short convolutions, gates,
//!   sigmoid-gated RMSNorm, `o_proj` and the PIC body pairs of the CPU model.
//!
//! The recurrence per value head, with `g_t ∈ R^{dk}` (log space, ≤ 0):
//!
//! ```text
//! S ← diag(exp g_t) S;   S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ;   o_t = Sᵀ q_t
//! ```
//!
//! that is `S_t = (I − β_t k_t k_tᵀ) diag(exp g_t) S_{t−1} + β_t k_t v_tᵀ`: PIC
//! transition family [`TRANSITION_FAMILY`] (dense `T_C`, `[Hv, dk, dk]`). Layouts as
//! Gated DeltaNet ([`GdrDims`]): time-major `q, k [T, Hk, dk]`, `v [T, Hv, dv]`,
//! `g [T, Hv, dk]`, `beta [T, Hv]`, state K-major `[Hv, dk, dv]` fp32. Callers pass q
//! and k already L2-normalised and q already scaled by `dk^-0.5`.
pub mod chunk;
pub(crate) mod layer;
pub mod naive;

pub use crate::mixers::gated_deltanet::GdrDims;
pub use chunk::{chunked, KDA_CHUNK};
pub use naive::recurrent;

use crate::linear::transition::Family;

/// The PIC transition family of this mixer: `T_t = (I − β_t k_t k_tᵀ) diag(exp g_t)`.
pub const TRANSITION_FAMILY: Family = Family::KimiDelta;

/// Panics unless the slices match `d` (`g` per channel: `[T, Hv, dk]`).
pub(crate) fn check_dims(
    d: &GdrDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &[f32],
) {
    assert!(
        d.hk > 0 && d.hv.is_multiple_of(d.hk),
        "Hv must be a multiple of Hk"
    );
    assert_eq!(q.len(), d.t * d.hk * d.dk, "q must be [T, Hk, dk]");
    assert_eq!(k.len(), d.t * d.hk * d.dk, "k must be [T, Hk, dk]");
    assert_eq!(v.len(), d.t * d.hv * d.dv, "v must be [T, Hv, dv]");
    assert_eq!(g.len(), d.t * d.hv * d.dk, "g must be [T, Hv, dk]");
    assert_eq!(beta.len(), d.t * d.hv, "beta must be [T, Hv]");
    assert_eq!(state.len(), d.state_len(), "state must be [Hv, dk, dv]");
}
