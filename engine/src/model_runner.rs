//! The model runner: owns the paged KV cache on the model's device, flattens the
//! scheduled work into one forward batch (tokens, positions, slot mapping, block tables,
//! logit rows), runs it, and samples the logit rows on the same device
//! ([`kernels::ops::sample`]): only the sampled tokens and their log-probabilities reach the
//! host, never the logits.
//!
//! On a CUDA device, a decode-only step (every sequence one new token, which it samples)
//! goes through [`DecodeGraphs`]: its inputs in one upload into a step plan, the forward and
//! the sampler replayed from a CUDA graph captured for the padded batch size
//! (docs/ARCHITECTURE.md, "Step plans and graphs").

use crate::model::{BatchSeq, ForwardBatch, KvCache, Model, StepInputs};
use crate::sampling::{draw_for, SampleContext};
use crate::scheduler::Scheduled;
use crate::sequence::Sequence;
use crate::Result;
use kernels::cuda::{CudaDevice, CudaGraph, CudaGraphPool, SampleOut, StepPlan};
use kernels::ops::{self, AttnBatch, AttnSeq};
use kernels::sample::{Draw, DrawParams, RowTask, SampleRow, Sampled, MAX_TOP_LOGPROBS};
use kernels::Device;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// What one step sampled for one scheduled sequence ([`ModelRunner::run`]).
#[derive(Debug)]
pub struct SeqSample {
    /// `(prompt position p, the log-probability of prompt token p + 1)`, positions ascending.
    pub prompt: Vec<(usize, Sampled)>,
    /// The drawn token, when the step reached the sequence's last token.
    pub sampled: Option<Sampled>,
}

pub struct ModelRunner {
    kv: KvCache,
    block_size: usize,
    graphs: Option<DecodeGraphs>,
}

/// What decode graphs must cover ([`ModelRunner::new`]).
#[derive(Debug, Clone, Copy)]
pub struct GraphLimits {
    /// The largest decode batch (the engine's `max_num_seqs`).
    pub max_num_seqs: usize,
    /// The longest context a sequence reaches.
    pub max_model_len: usize,
}

/// Where a scheduled sequence's logits are in the step's forward output.
struct RowPlan {
    /// Prompt positions whose next-token log-probabilities this step computes.
    pub prompt_positions: Range<usize>,
    /// Logit row of the first of them.
    pub prompt_row: usize,
    /// Logit row to sample from, when the step reaches the sequence's last token.
    pub sample_row: Option<usize>,
}

impl ModelRunner {
    /// A KV pool of `num_blocks` blocks of `block_size` token slots on the model's device,
    /// written before use when `prefault` ([`KvCache::new`]); on a CUDA device with `graphs`
    /// (not `--enforce-eager`) decode steps replay CUDA graphs, and the pool has one more
    /// block, which the padding rows of a graph's batch write into.
    pub fn new(
        model: &Model,
        num_blocks: usize,
        block_size: usize,
        prefault: bool,
        graphs: Option<GraphLimits>,
    ) -> Result<Self> {
        let graphs = match (model.device(), graphs) {
            (Device::Cuda(dev), Some(limits)) => Some(DecodeGraphs::new(dev, limits, num_blocks, block_size)?),
            _ => None,
        };
        let blocks = num_blocks + usize::from(graphs.is_some());
        let kv = KvCache::new(&model.config, blocks, block_size, model.device(), prefault)?;
        Ok(Self { kv, block_size, graphs })
    }

    /// Runs `scheduled` (indices into `running`, with their token counts) through `model`
    /// in one forward, after copying the K/V slots `kv_copies` (`(from, to)`, the
    /// scheduler's forks), and samples: per scheduled sequence, in order, the prompt
    /// log-probabilities it still has to report and the token drawn when the step reaches
    /// its last token (`eos_token_ids` for the `min_tokens` mask).
    pub fn run(
        &mut self,
        model: &Model,
        running: &[Sequence],
        scheduled: &[Scheduled],
        kv_copies: &[(u32, u32)],
        eos_token_ids: &[u32],
    ) -> Result<Vec<SeqSample>> {
        self.kv.copy_slots(kv_copies)?;
        let (batch, plan) = self.build_batch(running, scheduled);
        let vocab = model.config.vocab_size;
        let (rows, reported) = sample_rows(running, scheduled, &plan, eos_token_ids, vocab);
        let decode_only = plan.iter().all(|p| p.prompt_positions.is_empty() && p.sample_row.is_some())
            && batch.seqs.iter().all(|s| s.rows.len() == 1);
        let graphed = match &mut self.graphs {
            Some(g) if decode_only => g.run(model, &mut self.kv, &batch, &rows)?,
            _ => None,
        };
        let results = match graphed {
            Some(results) => results,
            None => ops::sample(&model.forward_batch(&batch, &mut self.kv)?, &rows)?,
        };
        let mut results = results.into_iter();
        let mut next = || results.next().expect("one result per row");
        let out = reported.into_iter().zip(&plan).map(|(positions, p)| SeqSample {
            prompt: positions.into_iter().map(|pos| (pos, next())).collect(),
            sampled: p.sample_row.map(|_| next()),
        });
        Ok(out.collect())
    }

    fn build_batch(&self, running: &[Sequence], scheduled: &[Scheduled]) -> (ForwardBatch, Vec<RowPlan>) {
        let bs = self.block_size;
        let mut b = ForwardBatch { block_size: bs, ..Default::default() };
        let mut plan = Vec::with_capacity(scheduled.len());
        for sch in scheduled {
            let seq = &running[sch.seq];
            let (start, end) = (seq.num_computed, seq.num_computed + sch.num_tokens);
            let row0 = b.tokens.len();
            b.tokens.extend_from_slice(&seq.tokens[start..end]);
            b.positions.extend(start..end);
            b.slot_mapping.extend((start..end).map(|p| seq.blocks[p / bs].id() * bs as u32 + (p % bs) as u32));
            // Logits at position p give the log-probability of prompt token p + 1.
            let prompt_positions =
                if seq.wants_prompt_logprobs() { start..end.min(seq.prompt_len - 1).max(start) } else { start..start };
            let prompt_row = b.logit_rows.len();
            b.logit_rows.extend(prompt_positions.clone().map(|p| row0 + p - start));
            let sample_row = (end == seq.tokens.len()).then(|| {
                b.logit_rows.push(row0 + end - 1 - start);
                b.logit_rows.len() - 1
            });
            let block_table = seq.blocks[..end.div_ceil(bs)].iter().map(|blk| blk.id()).collect();
            b.seqs.push(BatchSeq { rows: row0..row0 + (end - start), start_pos: start, block_table });
            plan.push(RowPlan { prompt_positions, prompt_row, sample_row });
        }
        (b, plan)
    }
}

/// One row per prompt position to report and per draw, in order, and per scheduled
/// sequence the prompt positions it reports.
fn sample_rows(
    running: &[Sequence],
    scheduled: &[Scheduled],
    plan: &[RowPlan],
    eos_token_ids: &[u32],
    vocab: usize,
) -> (Vec<SampleRow>, Vec<Vec<usize>>) {
    let mut rows = Vec::new();
    let mut reported: Vec<Vec<usize>> = Vec::with_capacity(scheduled.len());
    for (sch, p) in scheduled.iter().zip(plan) {
        let seq = &running[sch.seq];
        // A recomputed prompt (preemption, weight update) reports each position once.
        let first = seq.prompt_logprobs.len();
        let report = |pos: &usize| seq.num_output() == 0 && *pos >= first;
        let positions: Vec<usize> = p.prompt_positions.clone().filter(report).collect();
        for &pos in &positions {
            let row = p.prompt_row + pos - p.prompt_positions.start;
            let top = seq.params.prompt_logprobs.unwrap_or(0);
            rows.push(SampleRow { row, task: RowTask::Score(seq.tokens[pos + 1]), top_logprobs: top });
        }
        if let Some(row) = p.sample_row {
            let ctx = SampleContext {
                prompt_ids: &seq.tokens[..seq.prompt_len],
                output_ids: seq.output_ids(),
                eos_token_ids,
                seed: seq.seed,
            };
            let task = RowTask::Draw(draw_for(&seq.params, &ctx, vocab));
            rows.push(SampleRow { row, task, top_logprobs: seq.params.logprobs.unwrap_or(0) });
        }
        reported.push(positions);
    }
    (rows, reported)
}

/// Decode steps through CUDA graphs, as vLLM runs them: a graph per padded batch size (1, 2,
/// 4, 8, then multiples of 8 up to `max_num_seqs`), captured on the size's second step (its
/// first runs eagerly and leaves the buffers the capture takes in the workspace), replayed
/// after. A step writes its inputs and its sampler rows into the [`StepPlan`] (one upload),
/// replays the forward and the sampler in one graph launch, and reads the sampled tokens and
/// log-probabilities back (one download). The padding rows decode token 0 at position 0
/// into the pool's extra block and are drawn greedily; their results are dropped. Graphs
/// hold the weights' addresses: an in-place update keeps them valid, a model replaced by a
/// checkpoint's ([`Model::weights_id`]) drops them. A capture that fails is logged once and
/// its size runs eagerly from then on.
struct DecodeGraphs {
    dev: CudaDevice,
    plan: StepPlan,
    pool: CudaGraphPool,
    /// Per padded batch size: the graph and the sampler results it writes.
    graphs: HashMap<usize, (CudaGraph, SampleOut)>,
    /// Sizes that ran eagerly once since the weights were loaded.
    warmed: HashSet<usize>,
    /// Sizes whose capture failed.
    failed: HashSet<usize>,
    weights_id: Option<u64>,
    max_num_seqs: usize,
    /// The KV block the padding rows write into (the pool's last).
    pad_block: u32,
    block_size: usize,
}

impl DecodeGraphs {
    // In a build without the kernels crate's `cuda` feature `CudaDevice` is uninhabited
    // (the stub) and the body after its first use unreachable.
    #[allow(unreachable_code, unused_variables)]
    fn new(dev: &CudaDevice, limits: GraphLimits, num_blocks: usize, block_size: usize) -> Result<Self> {
        let max_blocks = limits.max_model_len.div_ceil(block_size);
        let n = padded(limits.max_num_seqs, limits.max_num_seqs);
        // Tokens, positions, slots, logit rows and row tables: 5 words a row; the block
        // tables; the sampler's rows (12 words of parameters and ~20 of offsets a row, plus
        // room for penalty, bias and mask lists; a step whose lists do not fit runs eagerly).
        let words = n * (5 + max_blocks + 32) + (1 << 16);
        Ok(Self {
            dev: dev.clone(),
            plan: dev.step_plan(words, limits.max_model_len)?,
            pool: dev.graph_pool(),
            graphs: HashMap::new(),
            warmed: HashSet::new(),
            failed: HashSet::new(),
            weights_id: None,
            max_num_seqs: limits.max_num_seqs,
            pad_block: num_blocks as u32,
            block_size,
        })
    }

    /// Runs a decode-only `batch` (one row per sequence, sampled by `rows`) through the
    /// graph of its padded size; `None` when it must run eagerly (too many sequences, a
    /// plan that does not fit).
    fn run(
        &mut self,
        model: &Model,
        kv: &mut KvCache,
        batch: &ForwardBatch,
        rows: &[SampleRow],
    ) -> Result<Option<Vec<Sampled>>> {
        let n = batch.seqs.len();
        if n == 0 || n > self.max_num_seqs {
            return Ok(None);
        }
        if self.weights_id != Some(model.weights_id()) {
            self.graphs.clear();
            self.warmed.clear();
            self.failed.clear();
            self.weights_id = Some(model.weights_id());
        }
        let bp = padded(n, self.max_num_seqs);
        let pad = bp - n;
        let plan = &mut self.plan;
        plan.clear();
        // The sections a graph reads at fixed offsets first: the rows' inputs, their block
        // table offsets (filled in below), the sampler's rows (the padding rows greedy
        // draws, their results dropped); the block tables, of varying lengths, after them.
        let tokens = plan.push(batch.tokens.iter().copied().chain(std::iter::repeat_n(0, pad)));
        let positions = plan.push(batch.positions.iter().map(|&p| p as u32).chain(std::iter::repeat_n(0, pad)));
        let pad_slot = self.pad_block * self.block_size as u32;
        let slots = plan.push(batch.slot_mapping.iter().copied().chain(std::iter::repeat_n(pad_slot, pad)));
        let logit_rows = plan.push(0..bp as u32);
        let row_table = plan.push(std::iter::repeat_n(0, bp));
        let greedy = Draw { params: DrawParams { temperature: 0.0, ..DrawParams::default() }, ..Draw::default() };
        let pads = (n..bp).map(|row| SampleRow { row, task: RowTask::Draw(greedy.clone()), top_logprobs: 0 });
        let padded_rows: Vec<SampleRow> = rows.iter().cloned().chain(pads).collect();
        let staged = plan.stage_sample(bp, model.config.vocab_size, &padded_rows, MAX_TOP_LOGPROBS)?;
        let mut at = plan.len();
        for (i, s) in batch.seqs.iter().enumerate() {
            plan.words_mut(row_table.clone())[i] = at as u32;
            at += plan.push(s.block_table.iter().copied()).len();
        }
        plan.words_mut(row_table.clone())[n..].fill(at as u32);
        plan.push([self.pad_block]);
        if !plan.fits() {
            return Ok(None);
        }
        plan.upload()?;
        // The graph's results buffer is the one its replays write.
        let mut eager = None;
        if let Some((graph, _)) = self.graphs.get(&bp) {
            graph.replay()?;
        } else {
            let tables: Vec<Vec<u32>> =
                (0..bp).map(|i| batch.seqs.get(i).map_or(vec![self.pad_block], |s| s.block_table.clone())).collect();
            let seqs: Vec<AttnSeq> = (0..bp)
                .map(|i| AttnSeq {
                    rows: i..i + 1,
                    start_pos: batch.positions.get(i).copied().unwrap_or(0),
                    block_table: &tables[i],
                })
                .collect();
            let plan = &self.plan;
            let step = StepInputs {
                tokens: plan.indices(tokens)?,
                positions: plan.indices(positions.clone())?,
                slots: plan.indices(slots)?,
                attn: plan.decode_attn(AttnBatch::new(&seqs, self.block_size)?, row_table, positions)?,
                logit_rows: plan.indices(logit_rows)?,
            };
            let mut forward = || -> Result<SampleOut> {
                let logits = model.forward_step(&step, kv)?;
                Ok(plan.sample_launch(&logits, &staged)?)
            };
            // The size's first step runs eagerly (the warm-up); its second captures and
            // replays. A capture, or its first launch, that fails leaves the size eager.
            if !self.warmed.insert(bp) && !self.failed.contains(&bp) {
                let captured = self.dev.capture(&self.pool, &mut forward);
                match captured.and_then(|(graph, out)| Ok(graph.replay().map(|()| (graph, out))?)) {
                    Ok(g) => {
                        self.graphs.insert(bp, g);
                    }
                    Err(e) => {
                        tracing::warn!("CUDA graph for decode batch {bp} failed, running it eagerly: {e}");
                        self.failed.insert(bp);
                    }
                }
            }
            if !self.graphs.contains_key(&bp) {
                eager = Some(forward()?);
            }
        }
        let out = match &eager {
            Some(out) => out,
            None => &self.graphs[&bp].1,
        };
        let mut results = self.plan.sample_read(out, &staged, &padded_rows)?;
        results.truncate(n);
        Ok(Some(results))
    }
}

/// The graph batch size for `n` sequences: 1, 2, 4, 8, then the next multiple of 8 (vLLM's
/// capture sizes), at most `max` rounded up to one of them.
fn padded(n: usize, max: usize) -> usize {
    let size = |n: usize| if n <= 8 { n.next_power_of_two() } else { n.div_ceil(8) * 8 };
    size(n.min(max.max(1)))
}
