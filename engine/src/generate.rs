//! A single-sequence generation loop (prefill, then one token per step) over a dense KV
//! cache. Used by `rlserve generate`, the reference tests and the benchmark; the engine
//! issue's scheduler serves many sequences.

use crate::error::Result;
use crate::model::Model;
use crate::sampling::{sample, SampleContext, SamplingParams};
use std::time::{Duration, Instant};

/// Timings and counts of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time of the prompt forward pass (includes sampling the first token).
    pub prefill: Duration,
    /// Time of every later step.
    pub decode: Duration,
}

impl GenerationStats {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    /// Decode throughput over the steps after the first token.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

/// Generates up to `max_tokens` tokens after `prompt`, stopping after any of `stop_ids`
/// (the stop token is included in the output). `on_token` sees each token as it is produced.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    params: &SamplingParams,
    max_tokens: usize,
    stop_ids: &[u32],
    mut on_token: impl FnMut(u32),
) -> Result<(Vec<u32>, GenerationStats)> {
    let mut cache = model.new_cache(prompt.len() + max_tokens)?;
    let seed = params.seed.unwrap_or_else(rand::random);
    let mut out = Vec::with_capacity(max_tokens);
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    if max_tokens == 0 {
        return Ok((out, stats));
    }
    let t0 = Instant::now();
    let next_token = |logits: &kernels::Tensor, out: &[u32]| -> Result<u32> {
        let ctx = SampleContext { prompt_ids: prompt, output_ids: out, eos_token_ids: stop_ids, seed };
        Ok(sample(&logits.to_vec()?, params, &ctx).token)
    };
    let logits = model.forward(prompt, &mut cache, false)?;
    let mut next = next_token(&logits, &out)?;
    stats.prefill = t0.elapsed();
    let t1 = Instant::now();
    loop {
        out.push(next);
        on_token(next);
        if out.len() >= max_tokens || stop_ids.contains(&next) {
            break;
        }
        let logits = model.forward(&[next], &mut cache, false)?;
        next = next_token(&logits, &out)?;
    }
    stats.decode = t1.elapsed();
    stats.generated_tokens = out.len();
    Ok((out, stats))
}
