//! The model runner: owns the paged KV cache on the model's device, flattens the
//! scheduled work into one forward batch (tokens, positions, slot mapping, block tables,
//! logit rows), runs it, and hands the needed logit rows back to the host for sampling.

use crate::model::{BatchSeq, ForwardBatch, KvCache, Model};
use crate::scheduler::Scheduled;
use crate::sequence::Sequence;
use crate::Result;
use std::ops::Range;

pub struct ModelRunner {
    kv: KvCache,
    block_size: usize,
}

/// Where a scheduled sequence's logits are in [`ModelRunner::run`]'s output.
pub struct RowPlan {
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
    /// scheduler's forks); returns the host logits `[rows, vocab]` and each sequence's rows.
    pub fn run(
        &mut self,
        model: &Model,
        running: &[Sequence],
        scheduled: &[Scheduled],
        kv_copies: &[(u32, u32)],
    ) -> Result<(Vec<f32>, Vec<RowPlan>)> {
        self.kv.copy_slots(kv_copies)?;
        let (batch, plan) = self.build_batch(running, scheduled);
        let logits = model.forward_batch(&batch, &mut self.kv)?;
        Ok((logits.to_vec()?, plan))
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
