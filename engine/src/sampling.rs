//! Sampling parameters (vLLM names, semantics and validation) and the sampler.
//!
//! Per token, in this order (vLLM `Sampler`): `logit_bias`, repetition / frequency /
//! presence penalties, `min_tokens` masking of EOS and `stop_token_ids`, temperature, then top-k, top-p
//! (nucleus, Holtzman et al. 2020) and min-p (Nguyen et al. 2024) truncation,
//! renormalisation, and one draw from a counter-based RNG stream.
//!
//! Two log-probabilities are returned for every sampled token (DESIGN-NOTES §3):
//! - `raw_logprob`: `log_softmax(logits)[token]` of the unprocessed model logits (T = 1);
//! - `behavior_logprob` (μ): the log-probability with which the token was actually drawn,
//!   after penalties, temperature and truncation. Greedy sampling (a temperature below
//!   [`GREEDY_EPS`], 0 included: [`is_greedy_temperature`]) has μ = 0 by definition: never
//!   feed greedy samples to the learner as on-policy.

use crate::validation::ValidationError;
use kernels::cpu::sampler;
pub use kernels::cpu::sampler::{argmax, logsumexp, splitmix64, top_k_of};
pub use kernels::sample::{is_greedy_temperature, GREEDY_EPS};
use kernels::sample::{Draw, DrawParams, RowTask, Sampled};

/// Sampling parameters of one request (vLLM `SamplingParams`).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Number of samples to draw for the prompt.
    pub n: usize,
    /// Below [`GREEDY_EPS`] (0 included) = greedy; otherwise logits are divided by it.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 or -1 = off.
    pub top_k: i32,
    /// Drop tokens with probability below `min_p · p_max`; 0 = off.
    pub min_p: f32,
    /// > 1 discourages tokens already in the prompt or output (CTRL, Keskar et al. 2019): positive logits divided, negative multiplied.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated, in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of generated tokens, in [-2, 2].
    pub frequency_penalty: f32,
    /// RNG seed; with a seed, outputs are reproducible regardless of batching or preemption.
    pub seed: Option<u64>,
    /// Maximum tokens to generate; `None` = up to the context length.
    pub max_tokens: Option<usize>,
    /// EOS and `stop_token_ids` are masked until this many tokens are generated.
    pub min_tokens: usize,
    /// Stop strings; the output text never contains any part of a matched one.
    pub stop: Vec<String>,
    /// Token ids that end generation (the token is kept in the output ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Return this many top raw log-probabilities per token (the sampled token's always).
    pub logprobs: Option<usize>,
    /// Return the raw log-probability of every prompt token (plus this many top entries).
    pub prompt_logprobs: Option<usize>,
    /// Leave special tokens out of the output text.
    pub skip_special_tokens: bool,
    /// OpenAI `logit_bias`: `(token id, bias)` pairs, each bias in [-100, 100] added to the
    /// token's logit before penalties and temperature (so μ and greedy see it; the raw
    /// log-probabilities do not). A repeated id adds up.
    pub logit_bias: Vec<(u32, f64)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: None,
            min_tokens: 0,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            skip_special_tokens: true,
            logit_bias: vec![],
        }
    }
}

/// Largest `logit_bias` magnitude (OpenAI's range).
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// Most top log-probabilities a request may ask for (vLLM `max_logprobs`).
pub const MAX_LOGPROBS: usize = kernels::sample::MAX_TOP_LOGPROBS;

/// Most samples per request (`n`, `num_generations`): each sample is a sequence with its own
/// state, so an unbounded `n` could exhaust memory.
pub const MAX_N: usize = 256;

impl SamplingParams {
    /// Greedy parameters (temperature 0).
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Default::default() }
    }

    /// Whether these parameters sample greedily ([`is_greedy_temperature`]).
    pub fn is_greedy(&self) -> bool {
        is_greedy_temperature(self.temperature)
    }

    /// Range checks that need no model; messages name the parameter, value and range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        let p = |param: &'static str, value: String, expected: &'static str| {
            Err(ValidationError::Param { param, value, expected })
        };
        if self.n == 0 || self.n > MAX_N {
            return p("n", self.n.to_string(), "in [1, 256]");
        }
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return p("temperature", self.temperature.to_string(), "a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return p("top_p", self.top_p.to_string(), "in (0, 1]");
        }
        if self.top_k < -1 {
            return p("top_k", self.top_k.to_string(), "-1 (off), 0 (off) or a positive integer");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return p("min_p", self.min_p.to_string(), "in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return p("repetition_penalty", self.repetition_penalty.to_string(), "a finite number > 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return p("presence_penalty", self.presence_penalty.to_string(), "in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return p("frequency_penalty", self.frequency_penalty.to_string(), "in [-2, 2]");
        }
        if self.max_tokens == Some(0) {
            return p("max_tokens", "0".into(), "at least 1");
        }
        if let Some(m) = self.max_tokens {
            if self.min_tokens > m {
                return p("min_tokens", self.min_tokens.to_string(), "at most max_tokens");
            }
        }
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_LOGPROBS) {
            return p("logprobs", k.to_string(), "at most 20");
        }
        if let Some(k) = self.prompt_logprobs.filter(|&k| k > MAX_LOGPROBS) {
            return p("prompt_logprobs", k.to_string(), "at most 20");
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return p("stop", "\"\"".into(), "non-empty strings");
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b)) {
            return p("logit_bias", format!("{b} (token {id})"), "a map of token ids to biases in [-100, 100]");
        }
        Ok(())
    }

    /// Checks the token ids the parameters name (`stop_token_ids`, `logit_bias` keys) against
    /// the vocabulary size.
    pub fn validate_ids(&self, vocab: usize) -> Result<(), ValidationError> {
        fn check(param: &'static str, mut ids: impl Iterator<Item = u32>, vocab: usize) -> Result<(), ValidationError> {
            match ids.find(|&t| t as usize >= vocab) {
                Some(id) => Err(ValidationError::VocabId { param, id, vocab }),
                None => Ok(()),
            }
        }
        check("stop_token_ids", self.stop_token_ids.iter().copied(), vocab)?;
        check("logit_bias", self.logit_bias.iter().map(|b| b.0), vocab)
    }
}

/// One sampled token with its log-probabilities (μ, raw, top raw): the backend contract's
/// [`kernels::sample::Sampled`].
pub type SampledToken = Sampled;

/// What the sampler needs to know about the sequence.
pub struct SampleContext<'a> {
    pub prompt_ids: &'a [u32],
    pub output_ids: &'a [u32],
    pub eos_token_ids: &'a [u32],
    /// The sequence's RNG stream id (from the request seed and the sample index).
    pub seed: u64,
}

/// The draw of the next token of a sequence with these parameters, for a vocabulary of
/// `vocab` ids (ids at or past it are left out, as no logit has them): the token lists its
/// penalties and mask read, built only when the parameter that reads them is set.
pub fn draw_for(p: &SamplingParams, ctx: &SampleContext, vocab: usize) -> Draw {
    let ok = |t: &u32| (*t as usize) < vocab;
    let rep_tokens = if p.repetition_penalty != 1.0 {
        let mut seen: Vec<u32> = ctx.prompt_ids.iter().chain(ctx.output_ids).copied().filter(ok).collect();
        seen.sort_unstable();
        seen.dedup();
        seen
    } else {
        vec![]
    };
    let out_counts = if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let mut ids: Vec<u32> = ctx.output_ids.iter().copied().filter(ok).collect();
        ids.sort_unstable();
        ids.chunk_by(|a, b| a == b).map(|c| (c[0], c.len() as u32)).collect()
    } else {
        vec![]
    };
    let mask = if ctx.output_ids.len() < p.min_tokens {
        ctx.eos_token_ids.iter().chain(&p.stop_token_ids).copied().filter(ok).collect()
    } else {
        vec![]
    };
    Draw {
        params: DrawParams {
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            top_k: p.top_k,
            pad: 0,
            seed: ctx.seed,
            step: ctx.output_ids.len() as u64,
        },
        rep_tokens,
        out_counts,
        bias: p.logit_bias.iter().copied().filter(|(t, _)| ok(t)).collect(),
        mask,
    }
}

/// Samples the next token of one sequence from its logits row `[vocab]` on the host
/// ([`kernels::cpu::sampler::sample_row`]; the engine samples through
/// [`kernels::ops::sample`] on the model's device, by the same rule).
pub fn sample(logits: &[f32], p: &SamplingParams, ctx: &SampleContext) -> SampledToken {
    let draw = RowTask::Draw(draw_for(p, ctx, logits.len()));
    sampler::sample_row(logits, &draw, p.logprobs.unwrap_or(0))
}
