//! Sampling in the backend contract ([`crate::ops::sample`]): a step's logit rows in, per
//! row only what the host needs out — the token, μ, the raw log-probability and the top raw
//! log-probabilities — so a device backend never sends the logits back on a decode step.
//!
//! The rule (vLLM's `Sampler` order), per draw row: `logit_bias`, the repetition penalty
//! (CTRL, Keskar et al. 2019) over the distinct tokens of prompt ∪ output, frequency and
//! presence penalties over the output's tokens, the mask (EOS and `stop_token_ids` before
//! `min_tokens`: −∞), then greedy (temperature < 1e-5: the first index of the largest value,
//! μ = 0) or temperature, top-k, top-p (Holtzman et al. 2020) and min-p (Nguyen et al. 2024)
//! truncation and one inverse-CDF draw from rand 0.8's
//! `StdRng::seed_from_u64(splitmix64(seed ^ splitmix64(step)))`. Implementations: the CPU's
//! [`crate::cpu::sampler`] and CUDA's `kernels/cuda/sampler.cu` + `logprob.cu`
//! (`sample_logprobs`), the same RNG stream bit for bit.
//!
//! Log-probabilities (docs/ARCHITECTURE.md, "Log-probabilities"):
//! - raw: `(z_t − max) − ln Σ_j exp(z_j − max)` of the unprocessed row, in f64: the
//!   learner's ℓ at T = 1 ([`crate::ops::token_logprobs`]), by the same code on each backend;
//! - μ: `ln(w_t / Σ w_kept)` of the processed, truncated weights; 0 for greedy; and the raw
//!   log-probability itself when the draw used the row untouched ([`Draw::untouched`]), so
//!   ℓ = μ bitwise where the backend's ℓ is batch-invariant.

/// Per-row draw parameters (vLLM `SamplingParams` names), laid out as sampler.cu's
/// `RlsSampleParams` (`#[repr(C)]`: six f32, two i32, two u64 = 48 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawParams {
    /// Below 1e-5 (NaN included) = greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Drop tokens with probability below `min_p · p_max`; 0 = off.
    pub min_p: f32,
    /// Positive logits divided, negative multiplied by it; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from each distinct output token's logit.
    pub presence_penalty: f32,
    /// Subtracted per occurrence from each output token's logit.
    pub frequency_penalty: f32,
    /// Keep the `top_k` largest logits; ≤ 0 = off.
    pub top_k: i32,
    /// Padding (0).
    pub pad: i32,
    /// The sequence's RNG stream id.
    pub seed: u64,
    /// The draw's index in the stream: the number of tokens generated so far.
    pub step: u64,
}

impl Default for DrawParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            top_k: 0,
            pad: 0,
            seed: 0,
            step: 0,
        }
    }
}

/// Temperatures below this are greedy (vLLM `_SAMPLING_EPS`; sampler.cu's constant).
pub const GREEDY_EPS: f32 = 1e-5;

/// The one greedy rule: a temperature below [`GREEDY_EPS`] takes the argmax (μ = 0). The
/// samplers, the feedback check ("cannot be rated") and the RL config all decide with it.
/// NaN (rejected by validation anyway) is never a sampling temperature, so it counts as greedy.
pub fn is_greedy_temperature(temperature: f32) -> bool {
    temperature.is_nan() || temperature < GREEDY_EPS
}

/// Most top log-probabilities a row may ask for (vLLM `max_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One row's draw: its parameters and the sparse token lists its penalties and mask read.
/// Ids must be below the vocabulary size ([`crate::ops::sample`] checks).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draw {
    pub params: DrawParams,
    /// The distinct ids of prompt ∪ output (read when `repetition_penalty != 1`).
    pub rep_tokens: Vec<u32>,
    /// The distinct output ids with their counts (read when a frequency or presence penalty
    /// is set).
    pub out_counts: Vec<(u32, u32)>,
    /// `(token, bias)` added to the logit in order (repeats add up).
    pub bias: Vec<(u32, f64)>,
    /// Ids whose logit becomes −∞.
    pub mask: Vec<u32>,
}

impl Draw {
    /// Whether the sampler reads the logits row as it is (T = 1, no bias, penalty, mask or
    /// truncation): then μ is the raw log-probability, bitwise.
    pub fn untouched(&self) -> bool {
        let p = &self.params;
        p.temperature == 1.0
            && p.top_k <= 0
            && p.top_p >= 1.0
            && p.min_p <= 0.0
            && p.repetition_penalty == 1.0
            && p.frequency_penalty == 0.0
            && p.presence_penalty == 0.0
            && self.bias.is_empty()
            && self.mask.is_empty()
    }

    /// Whether the draw is greedy (temperature below [`GREEDY_EPS`], NaN included).
    pub fn is_greedy(&self) -> bool {
        is_greedy_temperature(self.params.temperature)
    }

    /// Whether top-k, top-p or min-p truncates the candidates.
    pub fn truncates(&self) -> bool {
        let p = &self.params;
        p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0
    }
}

/// What a row of [`crate::ops::sample`] does.
#[derive(Debug, Clone, PartialEq)]
pub enum RowTask {
    /// Draw a token.
    Draw(Draw),
    /// Score a given token (a prompt log-probability): its raw log-probability.
    Score(u32),
}

/// One row of a sampling call: logit row `row` of the step's logits.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRow {
    pub row: usize,
    pub task: RowTask,
    /// Return this many top raw log-probabilities (at most [`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: usize,
}

/// A row's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The drawn token (or the scored one).
    pub token: u32,
    /// μ: the log-probability of the draw (0 for greedy and for scored rows).
    pub behavior_logprob: f32,
    /// The raw log-probability of `token` (see the module doc).
    pub raw_logprob: f32,
    /// The `top_logprobs` largest raw log-probabilities as `(token, logprob)`, largest first
    /// (ties: lower id first).
    pub top_logprobs: Vec<(u32, f32)>,
}
