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
use kernels::cpu::logprob;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::borrow::Cow;

/// Temperatures below this are treated as greedy (vLLM `_SAMPLING_EPS`).
pub const GREEDY_EPS: f32 = 1e-5;

/// The one greedy rule: a temperature below [`GREEDY_EPS`] takes the argmax (μ = 0). The
/// sampler, the feedback check ("cannot be rated") and the RL config all decide with it.
/// NaN (rejected by validation anyway) is never a sampling temperature, so it counts as greedy.
pub fn is_greedy_temperature(temperature: f32) -> bool {
    temperature.is_nan() || temperature < GREEDY_EPS
}

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
pub const MAX_LOGPROBS: usize = 20;

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

/// One sampled token with its log-probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub token: u32,
    /// μ: log-probability under the distribution actually sampled from (0 for greedy).
    pub behavior_logprob: f32,
    /// `log_softmax(raw logits)[token]`.
    pub raw_logprob: f32,
    /// The `logprobs` most likely tokens under the raw distribution, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What the sampler needs to know about the sequence.
pub struct SampleContext<'a> {
    pub prompt_ids: &'a [u32],
    pub output_ids: &'a [u32],
    pub eos_token_ids: &'a [u32],
    /// The sequence's RNG stream id (from the request seed and the sample index).
    pub seed: u64,
}

/// SplitMix64 finaliser: a well-mixed 64-bit hash of `x`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Index of the largest value (first on ties); NaN never wins (a row of NaNs gives its last
/// index).
///
/// Two vectorisable passes: [`logprob::row_max`] (16 lanes; NaN never compares greater) and
/// the first index holding it. (The old loop's compare against the running best, the rule
/// the tests keep as `argmax_scalar`, ran at ~4 cycles per value: 230 µs of a greedy
/// token's 360 µs sampling over 49,152 logits.)
pub fn argmax(x: &[f32]) -> usize {
    let max = logprob::row_max(x) as f32;
    x.iter().position(|&v| v == max).unwrap_or(x.len().saturating_sub(1))
}

/// [`argmax`]'s rule one value at a time (the definition the tests check it against).
#[cfg(test)]
fn argmax_scalar(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best
}

/// `ln Σ exp(x)` in f64 (max-subtracted, the sampler's pass: [`logprob::exp_weights`]);
/// `-inf` when every entry is `-inf`.
pub fn logsumexp(x: &[f32]) -> f64 {
    let max = logprob::row_max(x);
    if max == f64::NEG_INFINITY {
        return max;
    }
    let mut w = vec![0.0f64; x.len()];
    max + logprob::exp_weights(x, max, 1.0, &mut w).ln()
}

/// The `k` largest entries of `x` as `(index, value)`, largest first (ties: lower index first).
pub fn top_k_of(x: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(x.len());
    if k == 0 {
        return vec![];
    }
    let cmp = |a: &usize, b: &usize| x[*b].total_cmp(&x[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..x.len()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx.into_iter().map(|i| (i as u32, x[i])).collect()
}

/// Samples the next token of one sequence from its logits row `[vocab]`.
///
/// One pass of `exp(z − max)` in f64 over the raw row gives every raw log-probability:
/// `raw_logprob = (z_token − max) − ln Σ exp(z − max)`, bitwise the learner's formula at
/// T = 1 ([`kernels::cpu::logprob::token_logprob`], DESIGN-NOTES §3). When the sampler leaves
/// the row as it is (no bias, penalty or `min_tokens` mask), T = 1 and nothing truncates,
/// those same terms are the draw's weights, so a row costs one pass of exponentials.
pub fn sample(logits: &[f32], p: &SamplingParams, ctx: &SampleContext) -> SampledToken {
    RAW_WEIGHTS.with_borrow_mut(|raw_w| sample_with(logits, p, ctx, raw_w))
}

thread_local! {
    /// Each sampling thread's `exp(z − max)` buffer, one vocabulary long, reused across rows
    /// (a fresh 384 KiB zeroed allocation per row cost more than its exponentials).
    static RAW_WEIGHTS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`sample`] with the caller's weight buffer (resized to the row).
fn sample_with(logits: &[f32], p: &SamplingParams, ctx: &SampleContext, raw_w: &mut Vec<f64>) -> SampledToken {
    let max = logprob::row_max(logits);
    raw_w.resize(logits.len(), 0.0);
    let raw_z = logprob::exp_weights(logits, max, 1.0, raw_w);
    let ln_z = raw_z.ln();
    let raw_lse = if max == f64::NEG_INFINITY { max } else { max + ln_z };
    let raw_lp = |t: usize| (logits[t] as f64 - raw_lse) as f32;
    let mut l = Cow::Borrowed(logits);
    for &(t, b) in &p.logit_bias {
        if let Some(v) = l.to_mut().get_mut(t as usize) {
            *v = (*v as f64 + b) as f32;
        }
    }
    apply_penalties(&mut l, p, ctx);
    if ctx.output_ids.len() < p.min_tokens {
        for &t in ctx.eos_token_ids.iter().chain(&p.stop_token_ids) {
            if let Some(v) = l.to_mut().get_mut(t as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
    }
    let untouched = matches!(l, Cow::Borrowed(_)) && p.temperature == 1.0;
    let (token, behavior_logprob) = if p.is_greedy() {
        (argmax(&l), Some(0.0))
    } else {
        draw(&l, p, ctx.seed, ctx.output_ids.len(), untouched.then_some((&raw_w[..], raw_z)))
    };
    let top_logprobs = match p.logprobs {
        Some(k) if k > 0 => top_k_of(logits, k).into_iter().map(|(i, _)| (i, raw_lp(i as usize))).collect(),
        _ => vec![],
    };
    let raw_logprob = ((logits[token] as f64 - max) - ln_z) as f32;
    // A draw from the raw weights (the row untouched, T = 1, nothing truncated) has μ = the
    // raw log-probability, by the same formula: the learner's ℓ equals it bitwise.
    let behavior_logprob = behavior_logprob.unwrap_or(raw_logprob);
    SampledToken { token: token as u32, behavior_logprob, raw_logprob, top_logprobs }
}

/// Applies the repetition, frequency and presence penalties (vLLM's order); leaves `l`
/// borrowed when none is set.
fn apply_penalties(l: &mut Cow<'_, [f32]>, p: &SamplingParams, ctx: &SampleContext) {
    if p.repetition_penalty != 1.0 {
        let l = l.to_mut();
        let mut seen = vec![false; l.len()];
        for &t in ctx.prompt_ids.iter().chain(ctx.output_ids) {
            let t = t as usize;
            if t < l.len() && !seen[t] {
                seen[t] = true;
                l[t] = if l[t] > 0.0 { l[t] / p.repetition_penalty } else { l[t] * p.repetition_penalty };
            }
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let l = l.to_mut();
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in ctx.output_ids {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(v) = l.get_mut(t as usize) {
                *v -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
    }
}

/// Temperature, truncation, renormalisation and one draw. Returns the token and `ln p(token)`,
/// `None` for the latter when the draw used `weights` unchanged (μ is then the raw
/// log-probability, [`sample`]). Probabilities are `exp((l - max) / T)` in f64
/// ([`logprob::exp_weights`]), so the most likely token has weight 1: no overflow, no NaN,
/// and a sampled token always has p > 0, even for a tiny T. `weights`, when given, are those
/// values already computed for every token (T = 1) with their sum.
fn draw(l: &[f32], p: &SamplingParams, seed: u64, step: usize, weights: Option<(&[f64], f64)>) -> (usize, Option<f32>) {
    let t = p.temperature as f64;
    let truncated = p.top_k > 0 || p.top_p < 1.0 || p.min_p > 0.0;
    let given = weights.is_some() && !truncated;
    // Candidates in a fixed order: index order without truncation (`ids` = None), else most
    // likely first; and their total weight.
    let owned: Vec<f64>;
    let (ids, w, total): (Option<Vec<usize>>, &[f64], f64) = if !truncated {
        match weights {
            Some((w, z)) => (None, w, z),
            None => {
                let mut w = vec![0.0f64; l.len()];
                let z = logprob::exp_weights(l, logprob::row_max(l), t, &mut w);
                owned = w;
                (None, &owned, z)
            }
        }
    } else {
        let k = if p.top_k > 0 { p.top_k as usize } else { l.len() };
        let top = top_k_of(l, k);
        let values: Vec<f32> = top.iter().map(|&(_, v)| v).collect();
        let mut ws = vec![0.0f64; values.len()];
        logprob::exp_weights(&values, logprob::row_max(l), t, &mut ws);
        let mut c: Vec<(usize, f64)> = top.iter().zip(ws).map(|(&(i, _), w)| (i as usize, w)).collect();
        if p.top_p < 1.0 {
            let total: f64 = c.iter().map(|x| x.1).sum();
            let (mut cum, mut keep) = (0.0, c.len());
            for (j, x) in c.iter().enumerate() {
                cum += x.1;
                if cum >= p.top_p as f64 * total {
                    keep = j + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            // c[0] is the most likely token (weight 1).
            let floor = p.min_p as f64 * c[0].1;
            c.retain(|x| x.1 >= floor);
        }
        let (ids, ws): (Vec<usize>, Vec<f64>) = c.into_iter().unzip();
        owned = ws;
        let total = owned.iter().sum();
        (Some(ids), &owned, total)
    };
    let token = |j: usize| ids.as_ref().map_or(j, |ids| ids[j]);
    let mut rng = StdRng::seed_from_u64(splitmix64(seed ^ splitmix64(step as u64)));
    let u = rng.gen::<f64>() * total;
    let chosen = inverse_cdf(w, u)
        .or_else(|| w.iter().rposition(|&x| x > 0.0))
        .map_or_else(|| (argmax(l), 1.0), |j| (token(j), w[j]));
    (chosen.0, (!given).then(|| (chosen.1 / total).ln() as f32))
}

/// The first `j` with `w_j > 0` and `u < w_j` once `w_0 .. w_{j−1}` are subtracted from `u`
/// (inverse-CDF sampling of `u ∈ [0, Σ w)`); `None` if `u` runs past the end (rounding).
/// Blocks of [`CDF_BLOCK`] weights whose sum does not exceed the rest of `u` are skipped
/// whole, so a 49,152-token row takes 768 dependent subtractions, not 49,152.
fn inverse_cdf(w: &[f64], mut u: f64) -> Option<usize> {
    for (b, blk) in w.chunks(CDF_BLOCK).enumerate() {
        let s = block_sum(blk);
        if u >= s {
            u -= s;
            continue;
        }
        for (i, &wj) in blk.iter().enumerate() {
            if wj > 0.0 && u < wj {
                return Some(b * CDF_BLOCK + i);
            }
            u -= wj;
        }
    }
    None
}

/// Weights per block of [`inverse_cdf`].
const CDF_BLOCK: usize = 64;

/// `Σ blk` in 8 interleaved partial sums (vectorisable).
fn block_sum(blk: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut it = blk.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f64>() + it.remainder().iter().sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-pass [`argmax`] against the scalar rule and hand-picked answers: ties (first
    /// wins, also `+0`/`−0`), the maximum in the remainder past the 16-lane chunks, all
    /// `−inf`, NaNs (never the answer, unless the row is all NaN: its last index), empty.
    #[test]
    fn argmax_is_the_first_maximum() {
        let check = |x: &[f32], want: usize| {
            assert_eq!(argmax(x), want, "{x:?}");
            assert_eq!(argmax_scalar(x), want, "{x:?}");
        };
        let mut x: Vec<f32> = (0..37).map(|i| (i % 7) as f32).collect();
        check(&x, 6);
        x[20] = 9.0;
        x[33] = 9.0;
        check(&x, 20);
        x[35] = 10.0;
        check(&x, 35);
        check(&[-0.0, 0.0, -1.0], 0);
        check(&[f32::NEG_INFINITY; 40], 0);
        let mut y = vec![1.0f32; 40];
        y[3] = f32::NAN;
        y[17] = 2.0;
        check(&y, 17);
        check(&[f32::NAN, 1.0, 3.0, f32::NAN], 2);
        check(&[f32::NAN, f32::NEG_INFINITY], 1);
        check(&[f32::NAN; 3], 2);
        check(&[], 0);
    }

    /// [`inverse_cdf`] against the definition (one subtraction per weight, in order), on
    /// weights in eighths, whose sums are exact in f64, so both must give the same index for
    /// every `u`: zero weights (never picked), a block of zeros, a partial last block, and
    /// `u` on block boundaries and past the end.
    #[test]
    fn inverse_cdf_is_the_sequential_scan() {
        let w: Vec<f64> =
            (0..300).map(|i| if (64..128).contains(&i) { 0.0 } else { ((i * 5) % 9) as f64 / 8.0 }).collect();
        let sequential = |mut u: f64| {
            for (j, &wj) in w.iter().enumerate() {
                if wj > 0.0 && u < wj {
                    return Some(j);
                }
                u -= wj;
            }
            None
        };
        let total: f64 = w.iter().sum();
        let block0: f64 = w[..64].iter().sum();
        for u in (0..=(total * 8.0) as usize + 2).map(|q| q as f64 / 8.0).chain([block0, 0.3, total - 1e-9]) {
            assert_eq!(inverse_cdf(&w, u), sequential(u), "u = {u}");
        }
        assert_eq!(inverse_cdf(&w, total), None);
        assert_eq!(inverse_cdf(&w, 0.0), Some(1), "w[0] = 0 is never drawn");
    }
}
