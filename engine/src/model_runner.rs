//! The model runner: owns the paged KV cache on the model's device, flattens the
//! scheduled work into one forward batch (tokens, positions, slot mapping, block tables,
//! logit rows), runs it, and samples the logit rows on the same device
//! ([`kernels::ops::sample`]): only the sampled tokens and their log-probabilities reach the
//! host, never the logits.

use crate::model::{BatchSeq, ForwardBatch, KvCache, Model};
use crate::sampling::{draw_for, SampleContext};
use crate::scheduler::Scheduled;
use crate::sequence::Sequence;
use crate::Result;
use kernels::ops;
use kernels::sample::{RowTask, SampleRow, Sampled};
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
    /// written before use when `prefault` ([`KvCache::new`]).
    pub fn new(model: &Model, num_blocks: usize, block_size: usize, prefault: bool) -> Result<Self> {
        Ok(Self { kv: KvCache::new(&model.config, num_blocks, block_size, model.device(), prefault)?, block_size })
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
        let logits = model.forward_batch(&batch, &mut self.kv)?;
        let vocab = model.config.vocab_size;
        // One row per prompt position to report and per draw, then one sampling call.
        let mut rows = Vec::new();
        let mut reported: Vec<Vec<usize>> = Vec::with_capacity(scheduled.len());
        for (sch, p) in scheduled.iter().zip(&plan) {
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
        let mut results = ops::sample(&logits, &rows)?.into_iter();
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
