//! Lightning attention (the linear-attention mixer of Ring-linear-2.0,
//! `model_type: bailing_moe_linear`): linear attention with a constant per-head
//! scalar decay and RoPE on q and k.
//!
//! * [`naive`]: the token-by-token recurrence `S_t = exp(g_h)·S_{t−1} + k_t v_tᵀ`,
//!   `o_t = scale·S_tᵀ q_t` (the reference);
//! * [`chunk`]: the chunked prefill, which also returns the segment transition
//!   `T_C = exp(g_h·T)` per head in the same pass;
//! * [`layer`]: the CPU layer (fused `query_key_value`, optional SiLU, q/k RMSNorm,
//!   fp32 NeoX partial RoPE, the recurrence, group RMSNorm `g_norm`, sigmoid gate
//!   from `g_proj`, `dense`) and its PIC body pairs.
//!
//! The log decay is `g_h = −slope_h·f_l`: ALiBi slopes ([`alibi_slopes`]) times a
//! per-layer factor whose definition differs between implementations
//! ([`SlopeRule`]). PIC: the transition family is [`TransitionFamily::Scalar`]; since
//! the keys carry RoPE, a state built at position 0 and reused at offset `b` is
//! `R(b)` applied to its key axis ([`rotate_state`]), exact for this mixer.
pub mod chunk;
pub mod layer;
pub mod naive;

use crate::linear::transition::Family as TransitionFamily;
use crate::ops::Rope;

/// The transition family of Lightning attention (scalar decay per head).
pub const TRANSITION_FAMILY: TransitionFamily = TransitionFamily::Scalar;

/// Sizes of one Lightning recurrence call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LightningDims {
    /// Tokens T.
    pub t: usize,
    /// Heads H (queries, keys and values share the head count).
    pub h: usize,
    /// Key head dim dk.
    pub dk: usize,
    /// Value head dim dv.
    pub dv: usize,
}

impl LightningDims {
    /// Panics when a slice does not have the length these sizes imply (the layer
    /// sizes every slice from the config, so this is a programming error).
    pub(crate) fn check(&self, q: &[f32], k: &[f32], v: &[f32], g: &[f32], s: &[f32]) {
        let LightningDims { t, h, dk, dv } = *self;
        assert_eq!(q.len(), t * h * dk, "q [T, H, dk]");
        assert_eq!(k.len(), t * h * dk, "k [T, H, dk]");
        assert_eq!(v.len(), t * h * dv, "v [T, H, dv]");
        assert_eq!(g.len(), h, "log decay [H]");
        assert_eq!(s.len(), h * dk * dv, "state [H, dk, dv]");
    }
}

/// The per-layer factor `f_l` on the ALiBi slopes (`l` the absolute layer index,
/// `L` the number of layers; denominators are `max(1, L−1)`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SlopeRule {
    /// `1 − l/(L−1) + 1e-5`: the rule inclusionAI's SGLang build and vLLM serve the
    /// Ring-linear checkpoints with (config value `"absolute"`, the default).
    #[default]
    Absolute,
    /// `1 − max(0, l−1)/max(1, L−1) + 1e-5`: mlx-lm 0.32 (`"mlx_lm"`).
    MlxLm,
    /// `1 − (l−1)/(L−1) + 1e-5`, not clamped (layer 0 gets a factor above 1):
    /// other ports (`"layer_minus_one"`).
    LayerMinusOne,
}

impl SlopeRule {
    /// Parses the config value (`absolute`, `mlx_lm`, `layer_minus_one`).
    pub fn parse(s: &str) -> Option<SlopeRule> {
        match s {
            "absolute" => Some(SlopeRule::Absolute),
            "mlx_lm" => Some(SlopeRule::MlxLm),
            "layer_minus_one" => Some(SlopeRule::LayerMinusOne),
            _ => None,
        }
    }

    /// The factor `f_l` for layer `layer` of `num_layers` (f64, as the references
    /// compute it in Python floats).
    pub fn factor(self, layer: usize, num_layers: usize) -> f64 {
        let denom = num_layers.saturating_sub(1).max(1) as f64;
        let l = layer as f64;
        let pos = match self {
            SlopeRule::Absolute => l,
            SlopeRule::MlxLm => (l - 1.0).max(0.0),
            SlopeRule::LayerMinusOne => l - 1.0,
        };
        1.0 - pos / denom + 1e-5
    }
}

/// Mixer settings of a Lightning layer stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LightningConfig {
    /// Per-layer slope factor rule.
    pub slope_rule: SlopeRule,
    /// Groups of the output RMSNorm `g_norm` over the `H·dv` channels
    /// (`group_norm_size`).
    pub group_norm_size: usize,
    /// SiLU on the fused q|k|v projection before the q/k norms (`linear_silu`).
    pub silu: bool,
}

/// ALiBi slopes `get_slopes(n)` (Press et al.): for `n` a power of two
/// `r^{i+1}` with `r = 2^{−8/n}`; otherwise the slopes of the largest power of two
/// `p < n` followed by every other slope of `2p`, up to `n`. f64.
pub fn alibi_slopes(n: usize) -> Vec<f64> {
    fn pow2(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n).map(|i| start.powi(i as i32 + 1)).collect()
    }
    if n == 0 {
        return vec![];
    }
    if n.is_power_of_two() {
        pow2(n)
    } else {
        let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
        let mut s = pow2(p);
        s.extend(pow2(2 * p).into_iter().step_by(2).take(n - p));
        s
    }
}

/// Log decays `g_h = −(slope_h · f_l)` of layer `layer` (`[H]`), rounded as the
/// references do: slope and factor each to f32, their product in f32.
pub fn log_decays(heads: usize, layer: usize, num_layers: usize, rule: SlopeRule) -> Vec<f32> {
    let f = rule.factor(layer, num_layers) as f32;
    alibi_slopes(heads)
        .into_iter()
        .map(|s| -((s as f32) * f))
        .collect()
}

/// Moves a Lightning state built with its keys at positions `p` to positions
/// `p + b`: applies the RoPE rotation `R(b)` to the key axis of every head
/// (`state [H, dk, dv]`; the first `rope.rot` rows of each head rotate, NeoX
/// pairing `(i, i + rot/2)`). Since `S = Σ_t w_t k_t v_tᵀ` and RoPE rotations
/// compose additively, the result is exactly the state whose keys were rotated to
/// the new positions.
pub fn rotate_state(rope: &Rope, state: &mut [f32], h: usize, dk: usize, dv: usize, b: i64) {
    if b == 0 || rope.rot == 0 {
        return;
    }
    let mut col = vec![0f32; dv * dk];
    for head in state.chunks_exact_mut(dk * dv).take(h) {
        // [dk, dv] → [dv, dk]: each column is one key-axis vector.
        for i in 0..dk {
            for j in 0..dv {
                col[j * dk + i] = head[i * dv + j];
            }
        }
        rope.apply(&mut col, dk, b);
        for i in 0..dk {
            for j in 0..dv {
                head[i * dv + j] = col[j * dk + i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alibi_slopes_follow_the_reference_formula() {
        let s = alibi_slopes(16);
        let r = 2f64.powf(-0.5);
        for (i, v) in s.iter().enumerate() {
            assert!((v - r.powi(i as i32 + 1)).abs() < 1e-15);
        }
        // Non-power of two: 8-head slopes, then every other 16-head slope.
        let s12 = alibi_slopes(12);
        assert_eq!(&s12[..8], &alibi_slopes(8)[..]);
        let s16 = alibi_slopes(16);
        for k in 0..4 {
            assert_eq!(s12[8 + k], s16[2 * k]);
        }
    }

    /// The three layer-factor rules, each at its defining points.
    #[test]
    fn slope_rules_differ_where_documented() {
        let n = 5;
        // Default (SGLang / vLLM): absolute index, last layer ≈ 1e-5.
        let a = SlopeRule::Absolute;
        assert_eq!(a.factor(0, n), 1.0 + 1e-5);
        assert!((a.factor(4, n) - 1e-5).abs() < 1e-15);
        assert!((a.factor(2, n) - (0.5 + 1e-5)).abs() < 1e-15);
        // mlx-lm: layers 0 and 1 share factor 1; the last is 1/(L−1) + 1e-5.
        let m = SlopeRule::MlxLm;
        assert_eq!(m.factor(0, n), m.factor(1, n));
        assert_eq!(m.factor(1, n), 1.0 + 1e-5);
        assert!((m.factor(4, n) - (0.25 + 1e-5)).abs() < 1e-15);
        // l − 1 unclamped: layer 0 above 1.
        let u = SlopeRule::LayerMinusOne;
        assert!((u.factor(0, n) - (1.25 + 1e-5)).abs() < 1e-15);
        assert_eq!(u.factor(3, n), m.factor(3, n));
        assert_eq!(SlopeRule::parse("mlx_lm"), Some(m));
        assert_eq!(SlopeRule::parse("absolute"), Some(a));
        assert_eq!(SlopeRule::parse("layer_minus_one"), Some(u));
        assert_eq!(SlopeRule::parse("sglang"), None);
        assert_eq!(SlopeRule::default(), a);
        // Log decays are the negated products.
        let g = log_decays(4, 2, n, a);
        let s = alibi_slopes(4);
        for (gv, sv) in g.iter().zip(&s) {
            assert_eq!(*gv, -((*sv as f32) * (a.factor(2, n) as f32)));
            assert!(*gv < 0.0);
        }
    }

    /// Rotating a state by R(b) equals building it from keys rotated by R(b).
    #[test]
    fn rotated_state_equals_state_of_rotated_keys() {
        let (h, dk, dv, t) = (2, 8, 3, 5);
        let rope = Rope::new(4, 10_000.0);
        let k: Vec<f32> = (0..t * h * dk)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 9.0)
            .collect();
        let v: Vec<f32> = (0..t * h * dv)
            .map(|i| ((i * 11 % 13) as f32 - 6.0) / 7.0)
            .collect();
        let build = |keys: &[f32]| {
            let mut s = vec![0f32; h * dk * dv];
            for ti in 0..t {
                for hi in 0..h {
                    for i in 0..dk {
                        for j in 0..dv {
                            s[(hi * dk + i) * dv + j] +=
                                keys[(ti * h + hi) * dk + i] * v[(ti * h + hi) * dv + j];
                        }
                    }
                }
            }
            s
        };
        let b = 37;
        let mut s = build(&k);
        rotate_state(&rope, &mut s, h, dk, dv, b);
        let mut kr = k.clone();
        for tok in kr.chunks_exact_mut(h * dk) {
            rope.apply(tok, dk, b);
        }
        let want = build(&kr);
        for (x, y) in s.iter().zip(&want) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
        // The rows past rot/2·2 are untouched.
        let mut s0 = build(&k);
        let orig = s0.clone();
        rotate_state(&rope, &mut s0, h, dk, dv, b);
        for hi in 0..h {
            for i in 4..dk {
                for j in 0..dv {
                    let ix = (hi * dk + i) * dv + j;
                    assert_eq!(s0[ix], orig[ix]);
                }
            }
        }
    }
}
