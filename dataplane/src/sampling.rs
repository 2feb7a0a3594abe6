//! Next-token sampling: greedy, temperature, top-k, top-p (nucleus), seeded, after
//! the logit processors of [`SamplingParams`] (penalties, `logit_bias`, `min_tokens`).
//!
//! The processors run on the host logits in [`Sampler::sample`], in this order, on a
//! copy of the row (the raw row is what log-probabilities are computed from):
//!
//! 1. `repetition_penalty` `r` (Hugging Face semantics) over every token that occurs in
//!    the prompt or the generated tokens: `l > 0 → l / r`, else `l · r`.
//! 2. `presence_penalty` `p` and `frequency_penalty` `f` (OpenAI semantics) over the
//!    generated tokens: `l[t] −= p · 1[c_t > 0] + f · c_t`, `c_t` the count of `t`.
//! 3. `logit_bias`: `l[t] += b_t`.
//! 4. `min_tokens`: while fewer than `min_tokens` tokens were sampled, every stop
//!    token id given to [`Sampler::with_context`] is set to `−∞`.
//!
//! 5. The sequence's [`Constraint`] (constrained decoding, e.g. a JSON schema): every
//!    token it does not allow next is set to `−∞`. When the processors and the
//!    constraint together leave no finite logit (e.g. `min_tokens` masks the stop token
//!    that a finished grammar requires), the constraint alone decides.
//!
//! The draw itself ([`draw`]) is a deterministic function of (row, parameters, seed,
//! step): the Gumbel-max trick over the kept candidates with noise hashed from
//! `(seed, step, token id)`. The CUDA sampler (`cuda::sample`) computes the same draw
//! on the device, so a seeded request gives the same tokens on both backends (up to
//! fp32 rounding at a top-p boundary or between two scores within an ulp). Rows
//! without processors can therefore be sampled on the device
//! ([`Sampler::device_draw`], [`Sampler::accept`]); rows with processors, a constraint
//! or log-probabilities requested are sampled on the host with this type.
use rand::Rng;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// One sequence's live constraint on its next token (a compiled grammar's parser
/// state, for instance), created by [`ConstraintSpec::start`] when the sequence starts.
pub trait TokenConstraint: Send {
    /// Sets the logit of every token not allowed next to `−∞`, in place. `logits` is
    /// one row, `[vocab]`, indexed by token id.
    ///
    /// Errors: the constraint is in an error state (its message, for the client).
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// Advances past the sampled `token`.
    ///
    /// Errors: `token` is not allowed in the current state.
    fn commit(&mut self, token: u32) -> Result<(), String>;
}

/// A compiled, shareable constraint (e.g. a JSON schema compiled to a grammar) from
/// which each sequence of a request starts its own [`TokenConstraint`].
pub trait ConstraintSpec: Send + Sync {
    /// Short description for logs and errors, e.g. `json_schema "weather"`.
    fn describe(&self) -> String;
    /// A fresh per-sequence state.
    ///
    /// Errors: the constraint cannot start (its message).
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String>;
}

/// A [`ConstraintSpec`] carried by [`SamplingParams`]; equal when it is the same
/// compiled spec.
#[derive(Clone)]
pub struct Constraint(pub Arc<dyn ConstraintSpec>);

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({})", self.0.describe())
    }
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Sampling parameters (OpenAI semantics: temperature 0 means greedy).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `≤ 0` selects greedy decoding.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p` (1 = all).
    pub top_p: f32,
    /// RNG seed (None: from entropy).
    pub seed: Option<u64>,
    /// OpenAI `presence_penalty` (0 = off): subtracted once from every token generated
    /// at least once.
    pub presence_penalty: f32,
    /// OpenAI `frequency_penalty` (0 = off): subtracted once per earlier occurrence in
    /// the generated tokens.
    pub frequency_penalty: f32,
    /// Hugging Face `repetition_penalty` (1 = off, > 0) over prompt and generated
    /// tokens: positive logits are divided by it, negative ones multiplied.
    pub repetition_penalty: f32,
    /// Added to the logit of each listed token id.
    pub logit_bias: Vec<(u32, f32)>,
    /// Stop tokens are masked until this many tokens were sampled.
    pub min_tokens: usize,
    /// Constrained decoding: only tokens this constraint allows are sampled.
    pub constraint: Option<Constraint>,
}

impl SamplingParams {
    /// Whether any logit processor is active (otherwise the row is sampled as is).
    pub fn has_processors(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
            || self.constraint.is_some()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            constraint: None,
        }
    }
}

/// The parameters of one seeded draw ([`draw`]; on the GPU `cuda::sample::sample`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawParams {
    /// Softmax temperature; `≤ 0` (or NaN) is greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all; 1 = greedy).
    pub top_k: usize,
    /// Nucleus mass (`≥ 1` or NaN = off).
    pub top_p: f32,
    /// Seed of the sequence.
    pub seed: u64,
    /// Draw index within the sequence (0 for the token sampled from the prompt's
    /// logits, then 1, 2, …); a new noise per step.
    pub step: u64,
}

impl DrawParams {
    /// From the OpenAI-style parameters; `fallback_seed` is used when `p.seed` is
    /// `None`. The logit processors of [`SamplingParams`] (penalties, `logit_bias`,
    /// `min_tokens`, the constraint) are not part of a draw: [`Sampler`] applies them
    /// to the row first.
    pub fn new(p: &SamplingParams, fallback_seed: u64, step: u64) -> Self {
        DrawParams {
            temperature: p.temperature,
            top_k: p.top_k,
            top_p: p.top_p,
            seed: p.seed.unwrap_or(fallback_seed),
            step,
        }
    }

    /// Whether the draw is greedy ([`argmax`]): temperature `≤ 0` or NaN, or `top_k == 1`.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }
}

/// SplitMix64 finaliser (the hash of [`gumbel`]).
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The Gumbel noise of token `i` for `(seed, step)`: `g = −ln(−ln u)`,
/// `u = ((h >> 11) + ½) · 2⁻⁵³ ∈ (0, 1)`, `h = mix64(mix64(mix64(seed) ^ step) ^ i)`, in f64.
pub fn gumbel(seed: u64, step: u64, i: u32) -> f64 {
    let h = mix64(mix64(mix64(seed) ^ step) ^ i as u64);
    let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -(-u.ln()).ln()
}

/// Fixed-point scale of the top-p masses (`2⁴⁰`).
const MASS_ONE: f64 = (1u64 << 40) as f64;

/// One seeded draw from `logits` (`[vocab]`, after any processors).
///
/// * Greedy ([`DrawParams::is_greedy`]): [`argmax`].
/// * Otherwise the candidates are the finite logits `l_i`, ordered by (`l` descending
///   by `f32::total_cmp`, index ascending); the first `top_k` (0 = all); then, when
///   `top_p < 1`, the shortest prefix whose mass reaches `top_p`, measured in fixed
///   point: `q_i = rint(exp((l_i − m) / T) / Z · 2⁴⁰)` (`m` the largest `l`, `Z` the fp32
///   sum over the top-k set), the shortest prefix with `Σ q ≥ ceil(top_p · Σ q)`
///   (`top_p ≤ 0` keeps one token). The token is `argmax_i (l_i + T · g_i)` over the kept
///   set (the order of `l_i / T + g_i`: a sample from the softmax of `l / T` restricted
///   to the kept set), `g_i = gumbel(seed, step, i)`, ties to the lower index.
/// * No finite logit: [`argmax`].
pub fn draw(logits: &[f32], p: &DrawParams) -> u32 {
    if p.is_greedy() {
        return argmax(logits);
    }
    let t = p.temperature;
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, &v)| (i as u32, v))
        .collect();
    let m = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    if cand.is_empty() || !m.is_finite() {
        return argmax(logits);
    }
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.truncate(p.top_k);
    }
    if p.top_p < 1.0 {
        let z: f32 = cand.iter().map(|c| ((c.1 - m) / t).exp()).sum();
        let q: Vec<u64> = cand
            .iter()
            .map(|c| ((((c.1 - m) / t).exp() / z) as f64 * MASS_ONE).round_ties_even() as u64)
            .collect();
        let qtot: u64 = q.iter().sum();
        if qtot > 0 {
            let target = if p.top_p > 0.0 {
                ((p.top_p as f64) * qtot as f64).ceil() as u64
            } else {
                1
            }
            .clamp(1, qtot);
            let mut acc = 0u64;
            let mut keep = cand.len();
            for (i, &qi) in q.iter().enumerate() {
                acc += qi;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
    }
    let mut best = (f64::NEG_INFINITY, u32::MAX);
    for &(i, l) in &cand {
        let sc = l as f64 + t as f64 * gumbel(p.seed, p.step, i);
        if sc > best.0 || (sc == best.0 && i < best.1) {
            best = (sc, i);
        }
    }
    if best.1 == u32::MAX {
        0
    } else {
        best.1
    }
}

/// A seeded sampler for one sequence, with the per-sequence state of its logit
/// processors (counts of generated tokens, the prompt's token set). Its draws are
/// [`draw`] with the request's seed (or one from the OS when none was given) and
/// `step` = the number of tokens sampled so far.
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    /// Occurrences of each generated token.
    counts: HashMap<u32, u32>,
    /// Distinct prompt tokens (only kept when `repetition_penalty != 1`).
    prompt: HashSet<u32>,
    /// Token ids masked while fewer than `min_tokens` were sampled.
    stop: Vec<u32>,
    /// Tokens sampled so far.
    sampled: usize,
    /// The sequence's constraint state, or why it could not start.
    constraint: Option<Result<Box<dyn TokenConstraint>, String>>,
}

/// Index of the largest logit (lowest index on ties, like `torch.argmax`). NaN is
/// never chosen unless every entry is NaN.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// New sampler without a prompt (the repetition penalty sees only generated
    /// tokens) and without stop tokens (`min_tokens` masks nothing).
    pub fn new(params: SamplingParams) -> Self {
        Self::with_context(params, &[], &[])
    }

    /// New sampler for a sequence whose prompt is `prompt` and whose generation ends
    /// at any of `stop` (masked until `min_tokens` tokens were sampled).
    pub fn with_context(params: SamplingParams, prompt: &[u32], stop: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        let prompt = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        let constraint = params.constraint.as_ref().map(|c| c.0.start());
        Sampler {
            params,
            seed,
            counts: HashMap::new(),
            prompt,
            stop: stop.to_vec(),
            sampled: 0,
            constraint,
        }
    }

    /// Applies the logit processors (see the module docs) to `logits` in place, given
    /// the tokens sampled so far. Token ids outside the row are ignored.
    pub fn process(&self, logits: &mut [f32]) {
        let p = &self.params;
        let v = logits.len();
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty;
            let seen = self
                .prompt
                .iter()
                .chain(self.counts.keys().filter(|t| !self.prompt.contains(*t)));
            for &t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        for &(t, b) in &p.logit_bias {
            if (t as usize) < v {
                logits[t as usize] += b;
            }
        }
        if self.sampled < p.min_tokens {
            for &t in &self.stop {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Picks the next token from `logits` (`[vocab]`), after the logit processors
    /// and the constraint, and records it in the sequence's state.
    ///
    /// Errors: the constraint could not start, is in an error state, or rejected the
    /// token (its message); the sequence should end with an error.
    pub fn try_sample(&mut self, logits: &[f32]) -> Result<u32, String> {
        let t = if self.params.has_processors() {
            let mut row = logits.to_vec();
            self.process(&mut row);
            if let Some(c) = &mut self.constraint {
                let c = c.as_mut().map_err(|e| e.clone())?;
                c.mask(&mut row)?;
                if !row.iter().any(|v| v.is_finite()) {
                    row.copy_from_slice(logits);
                    c.mask(&mut row)?;
                }
            }
            self.pick(&row)
        } else {
            self.pick(logits)
        };
        self.accept(t)?;
        Ok(t)
    }

    /// The draw of the next token when it needs nothing but the raw logits (no logit
    /// processor, no constraint: [`SamplingParams::has_processors`] is false), so that
    /// it can be made elsewhere (on the device) with the same result as
    /// [`Sampler::try_sample`]; `None` otherwise. Record the token with
    /// [`Sampler::accept`].
    pub fn device_draw(&self) -> Option<DrawParams> {
        if self.params.has_processors() {
            return None;
        }
        Some(DrawParams::new(
            &self.params,
            self.seed,
            self.sampled as u64,
        ))
    }

    /// Records `token` as the next sampled token (drawn elsewhere with
    /// [`Sampler::device_draw`]): advances the constraint, the counts and the step.
    ///
    /// Errors: the constraint could not start, or rejected the token (its message).
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        if let Some(c) = &mut self.constraint {
            c.as_mut().map_err(|e| e.clone())?.commit(token)?;
        }
        *self.counts.entry(token).or_insert(0) += 1;
        self.sampled += 1;
        Ok(())
    }

    /// [`Sampler::try_sample`] for a sampler without a constraint (its only error).
    /// With a failing constraint the token is picked from the logits after the
    /// processors alone; callers that set a constraint use `try_sample`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.try_sample(logits) {
            Ok(t) => t,
            Err(_) => {
                let mut row = logits.to_vec();
                self.process(&mut row);
                let t = self.pick(&row);
                *self.counts.entry(t).or_insert(0) += 1;
                self.sampled += 1;
                t
            }
        }
    }

    fn pick(&self, logits: &[f32]) -> u32 {
        draw(
            logits,
            &DrawParams::new(&self.params, self.seed, self.sampled as u64),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_max_and_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_even_with_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            top_p: 1.0,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 0.5, 0.4]), 1);
        }
    }

    #[test]
    fn top_k_restricts_support() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 10.0,
            top_k: 2,
            top_p: 1.0,
            seed: Some(3),
            ..Default::default()
        });
        for _ in 0..200 {
            let t = s.sample(&[1.0, 0.9, 0.8, 0.0]);
            assert!(t == 0 || t == 1, "sampled {t} outside top-2");
        }
    }

    #[test]
    fn top_p_restricts_support() {
        // probs ≈ [0.64, 0.24, 0.09, 0.03]: top_p = 0.7 keeps the first two.
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.7,
            seed: Some(9),
            ..Default::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0);
        assert!(seen[0] > seen[1] && seen[1] > 0);
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            seed: Some(42),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..30).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..30).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 3);
    }

    #[test]
    fn sampling_follows_distribution() {
        // p = softmax([ln 3, 0]) = [0.75, 0.25]
        let logits = [3f32.ln(), 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: Some(5),
            ..Default::default()
        });
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64 / n as f64;
        assert!((ones - 0.25).abs() < 0.015, "frequency {ones}");
    }

    /// A sampler whose generated history is `history` (recorded through `sample` on
    /// rows that force each token).
    fn with_history(p: SamplingParams, prompt: &[u32], stop: &[u32], history: &[u32]) -> Sampler {
        let mut s = Sampler::with_context(p, prompt, stop);
        for &t in history {
            s.counts.entry(t).and_modify(|c| *c += 1).or_insert(1);
            s.sampled += 1;
        }
        s
    }

    #[test]
    fn presence_and_frequency_penalties_follow_openai() {
        let p = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        };
        // Token 1 generated twice, token 3 once; the prompt (token 0) does not count.
        let s = with_history(p, &[0], &[], &[1, 3, 1]);
        let mut l = vec![1.0f32, 2.0, -1.0, 0.0];
        s.process(&mut l);
        assert_eq!(l, vec![1.0, 2.0 - 0.5 - 0.5, -1.0, 0.0 - 0.5 - 0.25]);
    }

    #[test]
    fn repetition_penalty_follows_hf_over_prompt_and_output() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        // Prompt has 0 and 2, output has 2 (penalised once) and 3.
        let s = with_history(p, &[0, 2, 0], &[], &[2, 3]);
        let mut l = vec![3.0f32, 5.0, -1.5, -4.0, 1.0];
        s.process(&mut l);
        assert_eq!(l, vec![1.5, 5.0, -3.0, -8.0, 1.0]);
    }

    #[test]
    fn logit_bias_adds_and_ignores_out_of_row_ids() {
        let p = SamplingParams {
            logit_bias: vec![(0, -100.0), (2, 3.5), (99, 1.0)],
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let mut l = vec![10.0f32, 1.0, 0.0];
        s.process(&mut l);
        assert_eq!(l, vec![-90.0, 1.0, 3.5]);
        // Greedy picks the biased token, not the raw argmax.
        assert_eq!(s.sample(&[10.0, 1.0, 0.0]), 2);
    }

    #[test]
    fn min_tokens_masks_stop_tokens_until_reached() {
        let p = SamplingParams {
            min_tokens: 2,
            ..Default::default()
        };
        let mut s = Sampler::with_context(p, &[], &[0]);
        let row = [5.0f32, 1.0, 2.0];
        let mut l = row.to_vec();
        s.process(&mut l);
        assert_eq!(l, vec![f32::NEG_INFINITY, 1.0, 2.0]);
        assert_eq!(s.sample(&row), 2);
        assert_eq!(s.sample(&row), 2);
        // Two tokens sampled: the stop token is allowed again.
        assert_eq!(s.sample(&row), 0);
    }

    #[test]
    fn frequency_penalty_changes_greedy_choice_over_steps() {
        // Row [2, 1.8]: with frequency 0.5 greedy alternates once token 0 was taken.
        let p = SamplingParams {
            frequency_penalty: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let row = [2.0f32, 1.8];
        let got: Vec<u32> = (0..4).map(|_| s.sample(&row)).collect();
        // step 0: [2, 1.8] → 0; step 1: [1.5, 1.8] → 1; step 2: [1.5, 1.3] → 0;
        // step 3: [1.0, 1.3] → 1.
        assert_eq!(got, vec![0, 1, 0, 1]);
    }

    #[test]
    fn device_draw_then_accept_equals_try_sample() {
        let logits: Vec<f32> = (0..64).map(|i| (i as f32 * 0.71).cos() * 3.0).collect();
        for (temperature, top_k, top_p) in [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.3, 5, 0.9)] {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(11),
                ..Default::default()
            };
            let mut host = Sampler::new(p.clone());
            let mut dev = Sampler::new(p);
            for step in 0..40u64 {
                let d = dev.device_draw().expect("no processors: a device draw");
                assert_eq!(d.step, step);
                assert_eq!(d.seed, 11);
                let t = draw(&logits, &d);
                dev.accept(t).unwrap();
                assert_eq!(host.try_sample(&logits).unwrap(), t, "step {step}");
            }
        }
    }

    #[test]
    fn draws_depend_on_seed_and_step_only() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let d = |seed, step| {
            draw(
                &logits,
                &DrawParams {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                    seed,
                    step,
                },
            )
        };
        let a: Vec<u32> = (0..50).map(|s| d(3, s)).collect();
        let b: Vec<u32> = (0..50).map(|s| d(3, s)).collect();
        let c: Vec<u32> = (0..50).map(|s| d(4, s)).collect();
        assert_eq!(a, b);
        assert_ne!(a, c, "another seed gives other draws");
        assert!(a.iter().collect::<HashSet<_>>().len() > 10);
    }

    #[test]
    fn processors_and_constraints_have_no_device_draw() {
        let s = Sampler::new(SamplingParams {
            logit_bias: vec![(1, 2.0)],
            ..Default::default()
        });
        assert!(s.device_draw().is_none());
        let s = Sampler::new(SamplingParams {
            constraint: scripted(vec![1], 2, false),
            ..Default::default()
        });
        assert!(s.device_draw().is_none());
        let s = Sampler::new(SamplingParams {
            temperature: 0.7,
            ..Default::default()
        });
        assert!(s.device_draw().is_some());
    }

    #[test]
    fn no_processors_by_default() {
        assert!(!SamplingParams::default().has_processors());
    }

    /// A constraint that allows exactly the token ids of `script`, one per step, then
    /// only `end`; with `fail_start` it cannot start.
    struct Script {
        script: Vec<u32>,
        end: u32,
        fail_start: bool,
    }
    struct ScriptState {
        left: Vec<u32>,
        end: u32,
    }
    impl ConstraintSpec for Script {
        fn describe(&self) -> String {
            "script".into()
        }
        fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
            if self.fail_start {
                return Err("cannot start".into());
            }
            let mut left = self.script.clone();
            left.reverse();
            Ok(Box::new(ScriptState {
                left,
                end: self.end,
            }))
        }
    }
    impl TokenConstraint for ScriptState {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
            let allow = *self.left.last().unwrap_or(&self.end);
            for (i, l) in logits.iter_mut().enumerate() {
                if i as u32 != allow {
                    *l = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
        fn commit(&mut self, token: u32) -> Result<(), String> {
            let want = self.left.pop().unwrap_or(self.end);
            if token != want {
                return Err(format!("token {token} is not allowed"));
            }
            Ok(())
        }
    }

    fn scripted(script: Vec<u32>, end: u32, fail_start: bool) -> Option<Constraint> {
        Some(Constraint(Arc::new(Script {
            script,
            end,
            fail_start,
        })))
    }

    #[test]
    fn constraint_decides_against_the_logits_greedy_and_sampled() {
        // The row prefers token 0 strongly; the constraint forces 3, 1, 2, then 4.
        let row = [9.0f32, 1.0, 0.5, 0.0, -1.0];
        for temperature in [0.0, 1.0] {
            let p = SamplingParams {
                temperature,
                seed: Some(7),
                constraint: scripted(vec![3, 1, 2], 4, false),
                ..Default::default()
            };
            assert!(p.has_processors());
            let mut s = Sampler::new(p);
            let got: Vec<u32> = (0..5).map(|_| s.try_sample(&row).unwrap()).collect();
            assert_eq!(got, vec![3, 1, 2, 4, 4]);
        }
    }

    #[test]
    fn constraint_wins_over_min_tokens_when_both_leave_nothing() {
        // min_tokens masks stop token 4, which is all the finished constraint allows.
        let p = SamplingParams {
            min_tokens: 3,
            constraint: scripted(vec![1], 4, false),
            ..Default::default()
        };
        let mut s = Sampler::with_context(p, &[], &[4]);
        let row = [0.0f32, 0.0, 0.0, 0.0, 5.0];
        assert_eq!(s.try_sample(&row).unwrap(), 1);
        assert_eq!(s.try_sample(&row).unwrap(), 4);
    }

    #[test]
    fn constraint_errors_reach_the_caller() {
        let p = SamplingParams {
            constraint: scripted(vec![1], 2, true),
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        assert_eq!(s.try_sample(&[0.0, 1.0, 0.0]).unwrap_err(), "cannot start");
        // `sample` falls back to the processed row.
        assert_eq!(s.sample(&[0.0, 1.0, 0.0]), 1);
    }

    #[test]
    fn constraints_compare_by_identity() {
        let a = scripted(vec![1], 2, false).unwrap();
        let b = scripted(vec![1], 2, false).unwrap();
        assert_eq!(a, a.clone());
        assert_ne!(a, b);
        assert_eq!(format!("{a:?}"), "Constraint(script)");
    }
}
