//! Next-token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.
use rand::{rngs::StdRng, Rng, SeedableRng};

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
        }
    }
}

/// A seeded sampler for one sequence.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
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
    /// New sampler.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler { params, rng }
    }

    /// Picks the next token from `logits` (`[vocab]`).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 || p.top_k == 1 {
            return argmax(logits);
        }
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v / p.temperature))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && cand.len() > p.top_k {
            cand.truncate(p.top_k);
        }
        let m = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - m).exp()).collect();
        let s: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= s);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = probs.len();
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep);
            cand.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= s);
        }
        let u: f32 = self.rng.random();
        let mut acc = 0.0;
        for (c, q) in cand.iter().zip(&probs) {
            acc += q;
            if u < acc {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
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
        });
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64 / n as f64;
        assert!((ones - 0.25).abs() < 0.015, "frequency {ones}");
    }
}
