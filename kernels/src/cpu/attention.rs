//! Causal grouped-query attention over a paged K/V buffer.

use super::elementwise::softmax_row;
use super::simd::{axpy, dot};
use crate::ops::AttnSeq;
use rayon::prelude::*;

/// `out [t, H·D]` for queries `q [t, H·D]`; every row belongs to one of `seqs`, whose
/// position `p` lives in slot `block_table[p / block_size] · block_size + p % block_size`.
/// Work is split over (row, head) pairs; each is computed in a fixed order: scores over
/// positions `0..=p` with [`dot`], a max-subtracted softmax, then `Σ_j p_j v_j` in position order.
pub fn paged_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    seqs: &[AttnSeq],
    block_size: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) {
    let group = n_heads / n_kv_heads;
    let (qc, kc) = (n_heads * head_dim, n_kv_heads * head_dim);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let t = q.len() / qc;
    let mut row_seq = vec![0usize; t];
    for (si, s) in seqs.iter().enumerate() {
        row_seq[s.rows.clone()].fill(si);
    }
    let slot = |s: &AttnSeq, p: usize| s.block_table[p / block_size] as usize * block_size + p % block_size;
    let f = |(idx, o): (usize, &mut [f32])| {
        let (row, h) = (idx / n_heads, idx % n_heads);
        let seq = &seqs[row_seq[row]];
        let pos = seq.start_pos + (row - seq.rows.start);
        let off = (h / group) * head_dim;
        let qv = &q[row * qc + h * head_dim..row * qc + (h + 1) * head_dim];
        let scores = attention_probs(
            qv,
            (0..=pos).map(|p| &k[slot(seq, p) * kc + off..slot(seq, p) * kc + off + head_dim]),
            scale,
        );
        o.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            let s = slot(seq, p);
            axpy(w, &v[s * kc + off..s * kc + off + head_dim], o);
        }
    };
    // Multiply-adds of the whole call; small ones (a short decode) run inline, since a
    // rayon dispatch costs more than the work.
    let work: usize =
        row_seq.iter().enumerate().map(|(r, &si)| seqs[si].start_pos + r - seqs[si].rows.start + 1).sum::<usize>() * qc;
    if work < INLINE_WORK {
        out.chunks_mut(head_dim).enumerate().for_each(f);
    } else {
        out.par_chunks_mut(head_dim).enumerate().for_each(f);
    }
}

/// Below this many multiply-adds attention runs on the calling thread.
const INLINE_WORK: usize = 1 << 17;

/// `softmax_j(q · k_j · scale)` over the keys in order: the one probability computation of
/// the forward and of the backward's recomputation, so both see the same values.
pub fn attention_probs<'a>(q: &[f32], keys: impl Iterator<Item = &'a [f32]>, scale: f32) -> Vec<f32> {
    let mut p: Vec<f32> = keys.map(|k| dot(q, k) * scale).collect();
    softmax_row(&mut p);
    p
}
