//! Next-token sampling from a logits row: greedy, temperature, top-k, top-p (nucleus).
//! (The engine issue extends this with penalties, min-p and logprobs.)

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling parameters (vLLM names and semantics).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p` (Holtzman et al. 2020). In (0, 1].
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// RNG seed; `None` = from OS entropy.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self { temperature: 1.0, top_p: 1.0, top_k: 0, seed: None }
    }
}

impl SamplingParams {
    /// Checks ranges; the message names the parameter, its value and the allowed range.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

/// Draws tokens with one RNG stream.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Self { params, rng }
    }

    /// Samples a token id from one row of logits `[vocab]`.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature == 0.0 {
            return argmax(logits) as u32;
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            idx.truncate(p.top_k);
        }
        let max = logits[idx[0]];
        let mut probs: Vec<f64> = idx.iter().map(|&i| (((logits[i] - max) / p.temperature) as f64).exp()).collect();
        let total: f64 = probs.iter().sum();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (k, q) in probs.iter().enumerate() {
                cum += q / total;
                if cum >= p.top_p as f64 {
                    keep = k + 1;
                    break;
                }
            }
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.gen::<f64>() * total;
        for (k, q) in probs.iter().enumerate() {
            if u < *q {
                return idx[k] as u32;
            }
            u -= q;
        }
        idx[probs.len() - 1] as u32
    }
}
