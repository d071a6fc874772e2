//! `rlserve generate`'s loop: one request through [`LLMEngine`], so its seeds, stop rules,
//! sampling and log-probabilities are the API's (`--seed S` draws what `"seed": S` draws).
//! Also `bench latency`'s decode measurement.

use crate::engine::{EngineConfig, LLMEngine};
use crate::model::SharedModel;
use crate::outputs::SeqOutput;
use crate::sampling::SamplingParams;
use crate::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Timings and counts of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time to the first token (the prompt's forward and the first draw).
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

/// Generates one completion of `prompt` with `params` (`n` must be 1) on an engine of its
/// own over `model`, with a KV pool just large enough for it. `on_output` sees each step's
/// output (tokens with their log-probabilities, and the text delta, stop strings held back
/// as the API does) as it is produced; returns every output and the timings. On a CUDA
/// device decode steps replay a CUDA graph unless `enforce_eager`.
/// Errors: the parameters' validation (as the API's 400s) and a failed engine step.
pub fn generate(
    model: &SharedModel,
    tokenizer: Arc<Tokenizer>,
    prompt: &[u32],
    params: &SamplingParams,
    enforce_eager: bool,
    mut on_output: impl FnMut(&SeqOutput),
) -> anyhow::Result<(Vec<SeqOutput>, GenerationStats)> {
    anyhow::ensure!(params.n == 1, "generate draws one sample (n = {})", params.n);
    let context = model.read().max_positions();
    let len = prompt.len() + params.max_tokens.unwrap_or(context);
    let block_size = EngineConfig::default().block_size;
    let cfg = EngineConfig {
        num_blocks: Some(len.min(context).div_ceil(block_size) + 1),
        max_num_seqs: 1,
        enforce_eager,
        ..Default::default()
    };
    let mut engine = LLMEngine::new(model.clone(), tokenizer, cfg)?;
    engine.add_request("generate", prompt.to_vec(), params.clone())?;
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let (t0, mut first) = (Instant::now(), None);
    let mut outputs = Vec::new();
    while engine.has_unfinished() {
        for o in engine.step()? {
            first.get_or_insert_with(|| {
                stats.prefill = t0.elapsed();
                Instant::now()
            });
            stats.generated_tokens += o.tokens.len();
            on_output(&o);
            outputs.push(o);
        }
    }
    stats.decode = first.map_or(Duration::ZERO, |t| t.elapsed());
    Ok((outputs, stats))
}
