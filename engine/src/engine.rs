//! The engine core, readable top to bottom (nano-vllm style): `step()` = scheduler →
//! model runner (one batched forward) → sampler → outputs. Single-threaded; the
//! [`crate::handle`] runs it on its own thread behind a channel.

use crate::block_manager::BlockManager;
use crate::model::{KvCache, SharedModel};
use crate::model_runner::{GraphLimits, ModelRunner};
use crate::outputs::{FinishReason, PromptLogprob, SeqOutput, StopReason, TokenOutput};
use crate::sampling::{splitmix64, SampledToken, SamplingParams};
use crate::scheduler::{Scheduled, Scheduler, SchedulerConfig};
use crate::sequence::Sequence;
use crate::tokenizer::Tokenizer;
use crate::validation::ValidationError;
use crate::{ModelError, Result};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// Engine settings (vLLM names).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool; when `None`, derived from `kv_cache_memory`.
    pub num_blocks: Option<usize>,
    /// Bytes for the KV pool when `num_blocks` is not set.
    pub kv_cache_memory: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Context limit (prompt + output); default the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    pub enable_prefix_caching: bool,
    /// What running sequences do when the weights change under them.
    pub kv_on_update: KvOnUpdate,
    /// Write every page of a host KV pool when the engine starts, so that serving never
    /// takes a first-touch page fault (vLLM and llama.cpp hold their KV caches resident;
    /// llama.cpp clears its buffer at start). Off by default: where the host backs memory
    /// lazily a first touch is slow (about 8 s per GiB on the development VM: a decode step
    /// that moved 64 sequences into new blocks took 0.82 s instead of 0.11 s), and this moves
    /// that cost of the whole pool to startup.
    pub kv_cache_prefault: bool,
    /// vLLM's `--enforce-eager`: no CUDA graphs; every step runs its kernels one by one. Off
    /// by default: on a CUDA device decode-only steps replay captured graphs
    /// ([`crate::model_runner`]). No effect on the CPU.
    pub enforce_eager: bool,
}

/// What happens to in-flight sequences' KV when the policy version changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvOnUpdate {
    /// Keep the KV computed by older weights and continue on the new ones (PipelineRL).
    #[default]
    Keep,
    /// Drop it and recompute prompt and generated tokens with the new weights (AReaL).
    Recompute,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: None,
            kv_cache_memory: 2 << 30,
            max_num_seqs: 64,
            max_num_batched_tokens: 1024,
            max_model_len: None,
            enable_prefix_caching: true,
            kv_on_update: KvOnUpdate::Keep,
            kv_cache_prefault: false,
            enforce_eager: false,
        }
    }
}

/// Counters and gauges of the engine.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    pub block_size: usize,
    /// Prompt tokens looked up in the prefix cache, and how many were found.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Tokens run through the model in prefill (prompt chunks and recomputation).
    pub prefill_tokens: u64,
    pub generation_tokens: u64,
    pub num_preemptions: u64,
    pub steps: u64,
    pub version: u64,
    /// Sequences whose KV was dropped for recomputation after a weight update.
    pub num_kv_recomputes: u64,
}

impl EngineStats {
    /// The fraction of KV blocks in use (vLLM's `kv_cache_usage_perc`), 0 with no pool.
    pub fn kv_cache_usage(&self) -> f64 {
        self.num_blocks.saturating_sub(self.num_free_blocks) as f64 / self.num_blocks.max(1) as f64
    }
}

/// A failed [`LLMEngine::step`]: the batched forward pass returned an error (a model or
/// kernel fault, not a bad request: requests are validated before they are queued). The
/// requests it had scheduled are already aborted and their KV blocks freed; requests that
/// were not in the step are untouched, and the engine keeps serving.
#[derive(Debug, thiserror::Error)]
#[error("engine step failed: {cause}")]
pub struct StepError {
    /// The aborted requests, in schedule order.
    pub requests: Vec<String>,
    /// What the forward pass reported.
    pub cause: ModelError,
}

struct RequestState {
    n: usize,
    finished: usize,
    /// Sample 0 has computed its prompt: the siblings may start and hit the prefix cache.
    prompt_ready: bool,
}

pub struct LLMEngine {
    model: SharedModel,
    vocab_size: usize,
    kv_on_update: KvOnUpdate,
    tokenizer: Arc<Tokenizer>,
    runner: ModelRunner,
    blocks: BlockManager,
    sched: Scheduler,
    cfg: SchedulerConfig,
    max_model_len: usize,
    requests: HashMap<String, RequestState>,
    next_seq_id: u64,
    /// The policy version seen by the last step.
    version: u64,
    num_kv_recomputes: u64,
    prefill_tokens: u64,
    generation_tokens: u64,
    steps: u64,
}

impl LLMEngine {
    /// An engine over the shared weights: it takes a read guard for each step.
    /// Errors when the KV pool cannot be allocated on the model's device.
    pub fn new(model: SharedModel, tokenizer: Arc<Tokenizer>, config: EngineConfig) -> Result<Self> {
        let m = model.read();
        let c = &m.config;
        let per_block = KvCache::bytes_per_slot(c) * config.block_size;
        let num_blocks = config.num_blocks.unwrap_or(config.kv_cache_memory / per_block).max(1);
        let max_model_len = config.max_model_len.unwrap_or(c.max_position_embeddings).min(m.max_positions());
        let runner = ModelRunner::new(
            &m,
            num_blocks,
            config.block_size,
            config.kv_cache_prefault,
            (!config.enforce_eager).then_some(GraphLimits { max_num_seqs: config.max_num_seqs.max(1), max_model_len }),
        )?;
        let (vocab_size, version) = (c.vocab_size, m.version);
        drop(m);
        let cfg = SchedulerConfig {
            max_num_seqs: config.max_num_seqs.max(1),
            max_num_batched_tokens: config.max_num_batched_tokens.max(1),
            enable_prefix_caching: config.enable_prefix_caching,
        };
        Ok(LLMEngine {
            model,
            vocab_size,
            kv_on_update: config.kv_on_update,
            tokenizer,
            runner,
            blocks: BlockManager::new(num_blocks, config.block_size),
            sched: Scheduler::default(),
            cfg,
            max_model_len,
            requests: HashMap::new(),
            next_seq_id: 0,
            version,
            num_kv_recomputes: 0,
            prefill_tokens: 0,
            generation_tokens: 0,
            steps: 0,
        })
    }

    /// Token capacity of the KV pool.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.blocks.num_blocks() * self.blocks.block_size()
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The policy version of the weights now; every output token records the version of
    /// the step that computed it.
    pub fn version(&self) -> u64 {
        self.model.version()
    }

    /// The weights this engine serves.
    pub fn model(&self) -> &SharedModel {
        &self.model
    }

    pub fn has_unfinished(&self) -> bool {
        !self.sched.running.is_empty() || !self.sched.waiting.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            num_running: self.sched.running.len(),
            num_waiting: self.sched.waiting.len(),
            num_blocks: self.blocks.num_blocks(),
            num_free_blocks: self.blocks.num_free(),
            block_size: self.blocks.block_size(),
            prefix_cache_queries: self.sched.prefix_queries,
            prefix_cache_hits: self.sched.prefix_hits,
            prefill_tokens: self.prefill_tokens,
            generation_tokens: self.generation_tokens,
            num_preemptions: self.sched.num_preemptions,
            steps: self.steps,
            version: self.model.version(),
            num_kv_recomputes: self.num_kv_recomputes,
        }
    }

    /// Checks a request against the parameter ranges, the vocabulary, the context length
    /// and the KV pool; returns the maximum output length.
    pub fn validate(&self, prompt: &[u32], params: &SamplingParams) -> std::result::Result<usize, ValidationError> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(ValidationError::EmptyPrompt);
        }
        let vocab = self.vocab_size;
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ValidationError::TokenId { id, vocab });
        }
        params.validate_ids(vocab)?;
        let max = self.max_model_len;
        let completion = params.max_tokens.unwrap_or(max.saturating_sub(prompt.len())).max(1);
        if prompt.len() + completion > max {
            return Err(ValidationError::ContextLength {
                max,
                requested: prompt.len() + completion,
                prompt: prompt.len(),
                completion,
            });
        }
        let needed = (prompt.len() + completion).div_ceil(self.blocks.block_size());
        if needed > self.blocks.num_blocks() {
            let (total, prompt) = (self.blocks.num_blocks(), prompt.len());
            return Err(ValidationError::TooLongForCache { needed, total, prompt, completion });
        }
        Ok(completion)
    }

    /// Queues a request: `params.n` samples of `prompt` (token ids).
    pub fn add_request(
        &mut self,
        request_id: &str,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> std::result::Result<(), ValidationError> {
        let completion = self.validate(&prompt, &params)?;
        if self.requests.contains_key(request_id) {
            return Err(ValidationError::DuplicateRequestId(request_id.into()));
        }
        let base_seed = params.seed.unwrap_or_else(rand::random);
        let params = Arc::new(params);
        for index in 0..params.n {
            self.next_seq_id += 1;
            self.sched.waiting.push_back(Sequence {
                seq_id: self.next_seq_id,
                request_id: request_id.into(),
                index,
                prompt_len: prompt.len(),
                tokens: prompt.clone(),
                params: params.clone(),
                seed: splitmix64(base_seed ^ splitmix64(index as u64)),
                blocks: vec![],
                num_computed: 0,
                block_hashes: vec![],
                cache_salt: 0, // set at admission
                max_len: prompt.len() + completion,
                detok: Default::default(),
                prompt_logprobs: vec![],
                finish: None,
                first_scheduled: None,
            });
        }
        self.requests.insert(request_id.into(), RequestState { n: params.n, finished: 0, prompt_ready: false });
        Ok(())
    }

    /// Drops every sample of a request at once (its KV blocks are freed). Returns whether it existed.
    pub fn abort(&mut self, request_id: &str) -> bool {
        self.sched.waiting.retain(|s| s.request_id != request_id);
        self.sched.running.retain(|s| s.request_id != request_id);
        self.requests.remove(request_id).is_some()
    }

    /// One engine step: schedule → run the model once on the whole batch → sample →
    /// outputs (what each sequence produced). When the forward pass fails, every request
    /// with a sequence in this step is aborted (see [`StepError`]).
    pub fn step(&mut self) -> std::result::Result<Vec<SeqOutput>, StepError> {
        // The read guard spans the whole step: the optimizer's write lands between steps, and
        // every token of this step is computed by (and tagged with) one version.
        let shared = self.model.clone();
        let model = shared.read();
        if model.version != self.version {
            self.version = model.version;
            self.blocks.retire_salts_below(self.version);
            if self.kv_on_update == KvOnUpdate::Recompute {
                self.recompute_running();
            }
        }
        let prefix = self.cfg.enable_prefix_caching;
        let requests = &self.requests;
        let scheduled = self.sched.schedule(&self.cfg, &self.blocks, self.version, |s| {
            s.index == 0 || !prefix || requests.get(&s.request_id).is_some_and(|r| r.prompt_ready)
        });
        if scheduled.is_empty() {
            return Ok(vec![]);
        }
        self.steps += 1;
        let samples = match self.runner.run(
            &model,
            &self.sched.running,
            &scheduled,
            &self.sched.kv_copies,
            &self.tokenizer.eos_token_ids,
        ) {
            Ok(r) => r,
            Err(cause) => {
                drop(model);
                return Err(self.fail_scheduled(&scheduled, cause));
            }
        };
        drop(model);
        let mut outputs = Vec::new();
        for (sch, s) in scheduled.iter().zip(samples) {
            let seq = &mut self.sched.running[sch.seq];
            let start = seq.num_computed;
            seq.num_computed += sch.num_tokens;
            if start < seq.prompt_len {
                self.prefill_tokens += sch.num_tokens.min(seq.tokens.len() - start) as u64;
            }
            Scheduler::cache_full_blocks(seq, &self.blocks);
            for (pos, lp) in s.prompt {
                debug_assert_eq!(seq.prompt_logprobs.len(), pos, "prompt positions are reported once, in order");
                seq.prompt_logprobs.push(PromptLogprob {
                    token_id: lp.token,
                    logprob: Some(lp.raw_logprob),
                    top_logprobs: lp.top_logprobs,
                });
            }
            if seq.index == 0 && seq.num_computed >= seq.prompt_len {
                if let Some(r) = self.requests.get_mut(&seq.request_id) {
                    r.prompt_ready = true;
                }
            }
            if let Some(s) = s.sampled {
                let out = Self::append_and_check(seq, s, &self.tokenizer, self.version, self.max_model_len);
                self.generation_tokens += 1;
                outputs.push(out);
            }
        }
        // Retire finished sequences (dropping them frees their blocks).
        let mut i = 0;
        while i < self.sched.running.len() {
            if self.sched.running[i].finish.is_some() {
                let seq = self.sched.running.remove(i);
                let r = self.requests.get_mut(&seq.request_id).expect("running sequences have a request");
                r.finished += 1;
                if r.finished == r.n {
                    self.requests.remove(&seq.request_id);
                    if let Some(o) = outputs.iter_mut().find(|o| o.request_id == seq.request_id && o.index == seq.index)
                    {
                        o.request_finished = true;
                    }
                }
            } else {
                i += 1;
            }
        }
        Ok(outputs)
    }

    /// The error path of [`Self::step`]: one batched forward computes every scheduled row, so
    /// a failure loses them all. Aborts each request with a sequence in `scheduled` (all its
    /// samples, scheduled or waiting; their blocks are freed, and blocks this step half wrote
    /// were never put in the prefix cache). Requests not in the step are untouched.
    fn fail_scheduled(&mut self, scheduled: &[Scheduled], cause: ModelError) -> StepError {
        let mut requests: Vec<String> = Vec::new();
        for sch in scheduled {
            let id = &self.sched.running[sch.seq].request_id;
            if !requests.contains(id) {
                requests.push(id.clone());
            }
        }
        for id in &requests {
            self.abort(id);
        }
        StepError { requests, cause }
    }

    /// `--kv-on-update recompute`: every running sequence drops its KV and goes back to the
    /// front of the queue (in order), to be recomputed by the new weights with the new
    /// prefix-cache salt. Sampled tokens are kept; their versions stay as recorded.
    fn recompute_running(&mut self) {
        for mut seq in self.sched.running.drain(..).rev() {
            seq.reset_kv();
            self.num_kv_recomputes += 1;
            self.sched.waiting.push_front(seq);
        }
    }

    /// Appends the token sampled for `seq` and applies the stop conditions.
    fn append_and_check(
        seq: &mut Sequence,
        s: SampledToken,
        tok: &Tokenizer,
        version: u64,
        max_model_len: usize,
    ) -> SeqOutput {
        let params = seq.params.clone();
        seq.tokens.push(s.token);
        let n_out = seq.num_output();
        let mut finish = None;
        if params.stop_token_ids.contains(&s.token) {
            finish = Some((FinishReason::Stop, Some(StopReason::Token(s.token))));
        } else if !params.ignore_eos && tok.eos_token_ids.contains(&s.token) {
            finish = Some((FinishReason::Stop, None));
        }
        let from = seq.detok.push(tok, &seq.tokens[seq.prompt_len..], params.skip_special_tokens);
        if finish.is_none() && n_out >= params.min_tokens && !params.stop.is_empty() {
            if let Some(stop) = seq.detok.find_stop(from, &params.stop) {
                finish = Some((FinishReason::Stop, Some(StopReason::Text(stop))));
            }
        }
        if finish.is_none() && (seq.tokens.len() >= seq.max_len || seq.tokens.len() >= max_model_len) {
            finish = Some((FinishReason::Length, None));
        }
        let text = seq.detok.take_delta(&params.stop, finish.is_some());
        let prompt_logprobs = (seq.wants_prompt_logprobs() && n_out == 1).then(|| {
            let mut v = vec![PromptLogprob { token_id: seq.tokens[0], logprob: None, top_logprobs: vec![] }];
            v.append(&mut seq.prompt_logprobs);
            v
        });
        seq.finish = finish.clone();
        let token = TokenOutput {
            token_id: s.token,
            behavior_logprob: s.behavior_logprob,
            raw_logprob: s.raw_logprob,
            top_logprobs: s.top_logprobs,
            version,
        };
        SeqOutput {
            request_id: seq.request_id.clone(),
            index: seq.index,
            tokens: vec![token],
            text,
            finish_reason: finish.as_ref().map(|f| f.0),
            stop_reason: finish.and_then(|f| f.1),
            prompt_logprobs,
            request_finished: false,
            first_scheduled: seq.first_scheduled,
        }
    }

    /// Free blocks and cached blocks, for leak checks: with nothing running, every block is free.
    pub fn num_free_blocks(&self) -> usize {
        self.blocks.num_free()
    }
}
