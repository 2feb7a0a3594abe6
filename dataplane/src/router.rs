//! The MoE router of the CPU backend: which routed experts a token goes to and
//! with which weights.
//!
//! Two routing rules are implemented, chosen by [`RouterConfig`]:
//!
//! * **Softmax top-k** (Qwen3-Next, Qwen3.5-MoE): `p = softmax(logits)`, the `k`
//!   largest `p` (ties to the lower expert index), weights `p_j` or, with
//!   `norm_topk_prob`, `p_j / Σ_top p`.
//! * **Sigmoid with selection bias and grouped top-k** (DeepSeek-V3 style: Ring-linear
//!   `expert_bias`, Kimi-Linear `e_score_correction_bias`): `s = sigmoid(logits)`;
//!   experts are *selected* on `s + bias`; with `n_group > 1` the experts are split
//!   into `n_group` contiguous groups, each group scored by the sum of its two
//!   largest biased scores, and only the `topk_group` best groups stay eligible
//!   (the others' biased scores are set to [`RouterConfig::dropped_group_score`]: 0
//!   in DeepSeek-V3 and Ring-linear, −∞ in Kimi-Linear); the `k` largest
//!   eligible biased scores are chosen (ties to the lower index). The *weights* are
//!   the unbiased `s_j`, renormalised by `Σ_top s` when `norm_topk_prob` and `k > 1`
//!   (also for `k = 1` with [`RouterConfig::renorm_single`], as HF Kimi-Linear).
//!
//! Either rule then multiplies the weights by `routed_scaling_factor` (1 for Qwen).
//! Sources: HF transformers `modeling_deepseek_v3.py` (`DeepseekV3TopkRouter`),
//! `modeling_bailing_moe_v2`, mlx-lm `bailing_moe_linear.py` (`group_expert_select`).
use crate::ops;

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFunction {
    /// `softmax` over the experts (Qwen).
    Softmax,
    /// Per-expert `sigmoid` (DeepSeek-V3, Ring-linear, Kimi-Linear).
    Sigmoid,
}

/// The routing rule of a family's MoE blocks (see the module doc).
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Score function (config.json `score_function`; Qwen: softmax).
    pub score: ScoreFunction,
    /// Name, under the layer's FFN prefix, of the selection bias `[E]` added to the
    /// scores for selection only (`gate.expert_bias` for Ring-linear,
    /// `gate.e_score_correction_bias` for Kimi-Linear); `None`: no bias.
    pub selection_bias: Option<&'static str>,
    /// Expert groups (`n_group`; 1: no grouping). Must divide the expert count.
    pub n_group: usize,
    /// Groups kept per token (`topk_group`, ≤ `n_group`).
    pub topk_group: usize,
    /// Factor on the final routing weights (`routed_scaling_factor`).
    pub routed_scaling_factor: f32,
    /// The biased score given to the experts of the groups that are not kept
    /// (`0.0`: HF DeepSeek-V3, mlx-lm Ring-linear; `f32::NEG_INFINITY`: HF
    /// Kimi-Linear). It matters only when an eligible biased score is negative.
    pub dropped_group_score: f32,
    /// Whether `norm_topk_prob` also renormalises a single sigmoid-routed expert
    /// (its weight becomes 1): HF Kimi-Linear does (`false`: mlx-lm's
    /// `top_k > 1 and norm_topk_prob`, the Ring-linear reference).
    pub renorm_single: bool,
}

impl Default for RouterConfig {
    /// The Qwen softmax router: no bias, no groups, scale 1.
    fn default() -> Self {
        RouterConfig {
            score: ScoreFunction::Softmax,
            selection_bias: None,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            dropped_group_score: 0.0,
            renorm_single: false,
        }
    }
}

impl RouterConfig {
    /// Checks the grouping against `num_experts` and `top_k`.
    ///
    /// Errors: a message naming the config.json key at fault (`n_group`,
    /// `topk_group`).
    pub fn check(&self, num_experts: usize, top_k: usize) -> Result<(), (&'static str, String)> {
        if self.n_group == 0 || !num_experts.is_multiple_of(self.n_group) {
            return Err((
                "n_group",
                format!(
                    "{} must be ≥ 1 and divide num_experts = {num_experts}",
                    self.n_group
                ),
            ));
        }
        if self.n_group > 1 {
            let per_group = num_experts / self.n_group;
            if self.topk_group == 0 || self.topk_group > self.n_group {
                return Err((
                    "topk_group",
                    format!("must be in 1..=n_group ({})", self.n_group),
                ));
            }
            if self.topk_group * per_group < top_k {
                return Err((
                    "topk_group",
                    format!(
                        "{} groups of {per_group} experts hold fewer than num_experts_per_tok = {top_k}",
                        self.topk_group
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Routes one token: `logits` is the router output `[E]`, `bias` the selection
    /// bias `[E]` (when [`RouterConfig::selection_bias`] is set). Returns the
    /// `top_k` chosen experts with their weights, in selection order.
    pub fn route(
        &self,
        logits: &[f32],
        bias: Option<&[f32]>,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> Vec<(usize, f32)> {
        let e = logits.len();
        let mut scores = logits.to_vec();
        match self.score {
            ScoreFunction::Softmax => ops::softmax(&mut scores),
            ScoreFunction::Sigmoid => scores.iter_mut().for_each(|s| *s = ops::sigmoid(*s)),
        }
        let mut choice = scores.clone();
        if let Some(b) = bias {
            choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
        }
        if self.n_group > 1 {
            let per = e / self.n_group;
            let group_score = |g: usize| -> f32 {
                let mut s: Vec<f32> = choice[g * per..(g + 1) * per].to_vec();
                s.sort_by(|a, b| b.total_cmp(a));
                s.iter().take(2).sum()
            };
            let gs: Vec<f32> = (0..self.n_group).map(group_score).collect();
            let mut order: Vec<usize> = (0..self.n_group).collect();
            order.sort_by(|&a, &b| gs[b].total_cmp(&gs[a]).then(a.cmp(&b)));
            for &g in &order[self.topk_group..] {
                choice[g * per..(g + 1) * per].fill(self.dropped_group_score);
            }
        }
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        let top = &idx[..top_k.min(e)];
        let sum: f32 = top.iter().map(|&j| scores[j]).sum();
        let renorm = norm_topk_prob
            && (self.score == ScoreFunction::Softmax || top.len() > 1 || self.renorm_single);
        top.iter()
            .map(|&j| {
                let w = if renorm { scores[j] / sum } else { scores[j] };
                (j, w * self.routed_scaling_factor)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sigmoid_router(n_group: usize, topk_group: usize, scale: f32) -> RouterConfig {
        RouterConfig {
            score: ScoreFunction::Sigmoid,
            selection_bias: Some("gate.expert_bias"),
            n_group,
            topk_group,
            routed_scaling_factor: scale,
            dropped_group_score: 0.0,
            renorm_single: false,
        }
    }

    /// The default router is the softmax top-k of the Qwen families.
    #[test]
    fn softmax_router_is_top_k_of_the_softmax() {
        let r = RouterConfig::default();
        let logits = [0.1f32, 2.0, -1.0, 1.5];
        let got = r.route(&logits, None, 2, false);
        let mut p = logits.to_vec();
        ops::softmax(&mut p);
        assert_eq!(got, vec![(1, p[1]), (3, p[3])]);
        let got = r.route(&logits, None, 2, true);
        assert!((got[0].1 + got[1].1 - 1.0).abs() < 1e-6);
    }

    /// The bias moves the selection, not the weights; weights are renormalised
    /// sigmoids times the scaling factor.
    #[test]
    fn sigmoid_router_selects_on_biased_scores_and_weights_unbiased() {
        let r = sigmoid_router(1, 1, 2.5);
        let logits = [1.0f32, 0.0, 0.5, -0.5];
        let bias = [0.0f32, 2.0, 0.0, 0.0];
        let got = r.route(&logits, Some(&bias), 2, true);
        let s: Vec<f32> = logits.iter().map(|&x| ops::sigmoid(x)).collect();
        assert_eq!(got[0].0, 1, "bias lifts expert 1");
        assert_eq!(got[1].0, 0);
        let sum = s[1] + s[0];
        assert!((got[0].1 - 2.5 * s[1] / sum).abs() < 1e-6);
        assert!((got[1].1 - 2.5 * s[0] / sum).abs() < 1e-6);
        // Without renormalisation the weights are the raw sigmoids.
        let got = r.route(&logits, Some(&bias), 2, false);
        assert!((got[0].1 - 2.5 * s[1]).abs() < 1e-6);
    }

    /// Grouped top-k: the experts of the groups with the lower top-2 sums are out of
    /// reach even when one of them has the best single score.
    #[test]
    fn grouped_top_k_keeps_only_the_best_groups() {
        let r = sigmoid_router(2, 1, 1.0);
        // Group 0 = experts 0..4: one high score; group 1 = 4..8: two good ones.
        let logits = [3.0f32, -3.0, -3.0, -3.0, 2.0, 2.0, -3.0, -3.0];
        let got = r.route(&logits, None, 2, true);
        let chosen: Vec<usize> = got.iter().map(|p| p.0).collect();
        assert_eq!(chosen, vec![4, 5]);
        // With both groups allowed, expert 0 wins.
        let r = sigmoid_router(2, 2, 1.0);
        let got = r.route(&logits, None, 2, true);
        assert_eq!(got[0].0, 0);
        assert!(r.check(8, 2).is_ok());
        assert_eq!(
            sigmoid_router(3, 1, 1.0).check(8, 2).unwrap_err().0,
            "n_group"
        );
        assert_eq!(
            sigmoid_router(4, 1, 1.0).check(8, 4).unwrap_err().0,
            "topk_group"
        );
    }

    /// With negative biased scores in the kept group, a dropped group scored 0 wins
    /// the selection and one scored −∞ does not.
    #[test]
    fn the_dropped_group_score_decides_against_negative_biased_scores() {
        let logits = [0.0f32; 4];
        // Kept group 0 (experts 0, 1) has biased scores 0.5 − 1 < 0; group 1 has less.
        let bias = [-1.0f32, -1.0, -2.0, -2.0];
        let zero = sigmoid_router(2, 1, 1.0);
        let got: Vec<usize> = zero
            .route(&logits, Some(&bias), 2, true)
            .iter()
            .map(|p| p.0)
            .collect();
        assert_eq!(
            got,
            vec![2, 3],
            "dropped experts scored 0 beat negative ones"
        );
        let kimi = RouterConfig {
            dropped_group_score: f32::NEG_INFINITY,
            ..zero
        };
        let got: Vec<usize> = kimi
            .route(&logits, Some(&bias), 2, true)
            .iter()
            .map(|p| p.0)
            .collect();
        assert_eq!(got, vec![0, 1]);
    }

    /// One sigmoid-routed expert keeps its score unless `renorm_single` is set.
    #[test]
    fn a_single_expert_is_renormalised_only_when_asked() {
        let logits = [0.5f32, -1.0];
        let r = sigmoid_router(1, 1, 2.0);
        let got = r.route(&logits, None, 1, true);
        assert_eq!(got, vec![(0, 2.0 * ops::sigmoid(0.5))]);
        let r = RouterConfig {
            renorm_single: true,
            ..r
        };
        assert_eq!(r.route(&logits, None, 1, true), vec![(0, 2.0)]);
    }
}
