//! Continuous batching (vLLM V1 style): every step serves the running sequences first
//! (decodes and unfinished prefill chunks), then admits waiting sequences FCFS, all within
//! `max_num_batched_tokens` and `max_num_seqs`. Long prompts are prefilled in chunks. When
//! blocks run out, the newest running sequence is preempted by recompute: its blocks are
//! freed and it goes back to the front of the queue with its tokens kept.

use crate::block_manager::{block_hash, BlockManager};
use crate::sequence::Sequence;
use std::collections::VecDeque;

/// Scheduler limits (vLLM names).
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens (prefill + decode) in one step.
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
}

/// One sequence's share of a step: `running[seq]` runs `num_tokens` new tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub seq: usize,
    pub num_tokens: usize,
}

#[derive(Default)]
pub struct Scheduler {
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    pub num_preemptions: u64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// K/V slot copies `(from, to)` the last [`Self::schedule`] asked for, to run before its
    /// step's forward: a sample admitted after a sibling has computed their common prompt
    /// takes the prompt's tail past the cached full blocks from it ([`Self::fork_tail`]).
    pub kv_copies: Vec<(u32, u32)>,
}

/// Allocates blocks until `seq` can hold `len` tokens; false (nothing kept) if the pool is short.
fn grow(seq: &mut Sequence, len: usize, blocks: &BlockManager) -> bool {
    let need = len.div_ceil(blocks.block_size()).saturating_sub(seq.blocks.len());
    if need > blocks.num_free() {
        return false;
    }
    for _ in 0..need {
        seq.blocks.push(blocks.allocate().expect("counted free blocks"));
    }
    true
}

impl Scheduler {
    /// Picks this step's work. `can_start(seq)` gates admission (siblings of an `n > 1`
    /// request wait until the first sample's prompt is cached, so the group pays for one prefill).
    pub fn schedule(
        &mut self,
        cfg: &SchedulerConfig,
        blocks: &BlockManager,
        version: u64,
        can_start: impl Fn(&Sequence) -> bool,
    ) -> Vec<Scheduled> {
        let mut budget = cfg.max_num_batched_tokens;
        let mut out = Vec::new();
        self.kv_copies.clear();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let n = self.running[i].num_uncomputed().min(budget);
            let target = self.running[i].num_computed + n;
            loop {
                if grow(&mut self.running[i], target, blocks) {
                    out.push(Scheduled { seq: i, num_tokens: n });
                    budget -= n;
                    i += 1;
                    break;
                }
                // Preempt the newest running sequence (possibly this one).
                let mut victim = self.running.pop().expect("running is non-empty");
                victim.reset_kv();
                self.waiting.push_front(victim);
                self.num_preemptions += 1;
                preempted = true;
                if i >= self.running.len() {
                    break;
                }
            }
        }
        if preempted {
            return out;
        }
        // Admit waiting sequences, first come first served.
        let mut w = 0;
        while w < self.waiting.len() && budget > 0 && self.running.len() < cfg.max_num_seqs {
            if !can_start(&self.waiting[w]) {
                w += 1;
                continue;
            }
            let seq = &mut self.waiting[w];
            seq.cache_salt = version;
            let shares = cfg.enable_prefix_caching && !seq.wants_prompt_logprobs();
            if shares {
                self.lookup_prefix(w, blocks);
            }
            let donor = if shares { self.fork_donor(&self.waiting[w]) } else { None };
            let seq = &mut self.waiting[w];
            let cached = seq.num_computed;
            if donor.is_some() {
                seq.num_computed = seq.prompt_len - 1;
            }
            let n = seq.num_uncomputed().min(budget);
            let target = seq.num_computed + n;
            if !grow(seq, target, blocks) {
                seq.reset_kv();
                break;
            }
            if let Some(d) = donor {
                self.fork_tail(w, d, cached, blocks.block_size());
            }
            let mut seq = self.waiting.remove(w).expect("index in range");
            seq.first_scheduled.get_or_insert_with(std::time::Instant::now);
            budget -= n;
            self.running.push(seq);
            out.push(Scheduled { seq: self.running.len() - 1, num_tokens: n });
        }
        out
    }

    /// Reuses cached full blocks of the waiting sequence `w` (never its last token, which
    /// must be computed to produce logits).
    fn lookup_prefix(&mut self, w: usize, blocks: &BlockManager) {
        let seq = &mut self.waiting[w];
        let bs = blocks.block_size();
        let full = (seq.tokens.len() - 1) / bs;
        self.prefix_queries += seq.tokens.len() as u64;
        let mut parent = None;
        for b in 0..full {
            let h = block_hash(parent, &seq.tokens[b * bs..(b + 1) * bs], seq.cache_salt);
            match blocks.lookup(h) {
                Some(block) => {
                    seq.blocks.push(block);
                    seq.block_hashes.push(h);
                    parent = Some(h);
                }
                None => break,
            }
        }
        seq.num_computed = seq.blocks.len() * bs;
        self.prefix_hits += seq.num_computed as u64;
    }

    /// A running sibling of the waiting `seq` (same request) whose K/V holds `seq`'s prompt
    /// up to its last token computed at the same version (`cache_salt`), when the prefix
    /// cache left some of those positions to compute: the tail past the last full block,
    /// which the cache (full blocks only, as vLLM's) cannot share.
    fn fork_donor(&self, seq: &Sequence) -> Option<usize> {
        let p = seq.prompt_len.checked_sub(1)?;
        if seq.num_computed >= p {
            return None;
        }
        self.running.iter().position(|d| {
            d.request_id == seq.request_id
                && d.cache_salt == seq.cache_salt
                && d.num_computed >= p
                && d.tokens.get(..p) == seq.tokens.get(..p)
        })
    }

    /// Gives the waiting sequence `w` (its blocks grown to its prompt) the K/V of prompt
    /// positions `from .. prompt_len − 1` by copying them from `running[donor]`
    /// ([`Self::kv_copies`]), so only its last prompt token runs (for its logits). The copy
    /// is exact: every position's K/V is a fixed-order computation of the same tokens and
    /// weights (batch invariance), so the sample's logits are bitwise those it would have
    /// computed itself, and 8 samples of a 30-token prompt prefill 37 tokens instead of 128.
    fn fork_tail(&mut self, w: usize, donor: usize, from: usize, bs: usize) {
        let (seq, d) = (&self.waiting[w], &self.running[donor]);
        let slot = |s: &Sequence, p: usize| s.blocks[p / bs].id() * bs as u32 + (p % bs) as u32;
        let to = seq.prompt_len - 1;
        self.kv_copies.extend((from..to).map(|p| (slot(d, p), slot(seq, p))));
        self.prefix_hits += (to - from) as u64;
    }

    /// Registers the newly full, computed blocks of `seq` in the prefix cache.
    pub fn cache_full_blocks(seq: &mut Sequence, blocks: &BlockManager) {
        let bs = blocks.block_size();
        while seq.block_hashes.len() < seq.num_computed / bs {
            let b = seq.block_hashes.len();
            let h = block_hash(seq.block_hashes.last().copied(), &seq.tokens[b * bs..(b + 1) * bs], seq.cache_salt);
            blocks.register(&seq.blocks[b], h, seq.cache_salt);
            seq.block_hashes.push(h);
        }
    }
}
