//! One sample of a request as the scheduler sees it.

use crate::block_manager::Block;
use crate::detokenizer::Detokenizer;
use crate::outputs::{FinishReason, PromptLogprob, StopReason};
use crate::sampling::SamplingParams;
use std::sync::Arc;

#[derive(Debug)]
pub struct Sequence {
    pub seq_id: u64,
    pub request_id: String,
    /// Sample index within the request (`0..n`).
    pub index: usize,
    pub prompt_len: usize,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub params: Arc<SamplingParams>,
    /// RNG stream of this sample.
    pub seed: u64,
    /// Block table: block `i` holds positions `i·block_size ..`.
    pub blocks: Vec<Block>,
    /// Tokens whose K/V is in `blocks`.
    pub num_computed: usize,
    /// Hash chain of the full blocks registered in (or found in) the prefix cache.
    pub block_hashes: Vec<u64>,
    /// Prefix-cache salt: the policy version when the sequence (re)started computing.
    pub cache_salt: u64,
    /// Maximum total length (prompt + output).
    pub max_len: usize,
    pub detok: Detokenizer,
    pub prompt_logprobs: Vec<PromptLogprob>,
    pub finish: Option<(FinishReason, Option<StopReason>)>,
    /// When the scheduler first admitted the sequence (kept across preemptions): the end of
    /// its queue time (vLLM's `scheduled_ts`).
    pub first_scheduled: Option<std::time::Instant>,
}

impl Sequence {
    pub fn output_ids(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next sample.
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    pub fn wants_prompt_logprobs(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.index == 0
    }

    /// Drops the KV (blocks freed) so the sequence can be recomputed later.
    pub fn reset_kv(&mut self) {
        self.blocks.clear();
        self.block_hashes.clear();
        self.num_computed = 0;
    }
}
