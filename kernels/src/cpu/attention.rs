//! Causal grouped-query attention over a paged K/V buffer.

use super::attention_rows::{probs, weighted_sums, KeyStrips, Transposed, QB, STRIP};
use super::simd::SharedMut;
use crate::multiversion;
use crate::ops::{AttnSeq, KvLayout};
use rayon::prelude::*;
use std::ops::Range;

/// Query rows of one sequence per task (they share one transposed copy of the keys).
const ROWS_PER_TASK: usize = 32;

/// `out [t, H·D]` for queries `q [t, H·D]`; every row belongs to one of `seqs`, whose
/// position `p` lives in slot `block_table[p / block_size] · block_size + p % block_size` of
/// `k`, `v`, laid out as `geom.layout`.
///
/// Work is split into tasks of (sequence, KV head, up to 32 rows); a task views the keys its
/// rows attend as [`KeyStrips`] (in place for [`KvLayout::Blocked`]; a [`Transposed`] copy
/// for [`KvLayout::Rows`]), then for its (row, query head) pairs, 4 at a time, computes
/// [`probs`] over positions `0..=p` and `Σ_j p_j v_j` ([`weighted_sums`]), in the fixed orders
/// of [`super::attention_rows`]: a row's output does not depend on the other rows of the
/// call, nor on how they are split into tasks, nor on the layout.
pub fn paged_attention(q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], seqs: &[AttnSeq], geom: &Geometry) {
    assert_eq!(out.len(), q.len());
    let mut tasks: Vec<(usize, usize, Range<usize>)> = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for g in 0..geom.n_kv_heads {
            for r0 in s.rows.clone().step_by(ROWS_PER_TASK) {
                tasks.push((si, g, r0..(r0 + ROWS_PER_TASK).min(s.rows.end)));
            }
        }
    }
    let o = SharedMut(out.as_mut_ptr());
    let f = |(si, g, rows): &(usize, usize, Range<usize>)| task(q, k, v, o, &seqs[*si], rows.clone(), *g, geom);
    // On the pool even for a short decode, where the work is less than a dispatch costs:
    // run inline, it left the other worker idle long enough to fall asleep, and the next
    // projection paid its wake-up (o_proj 1.5 → 2.3 ms per decoded token, 30 layers, 2 threads).
    tasks.par_iter().for_each(f);
}

/// The layout of a call: KV block size, query and KV heads, head dimension, K/V layout.
pub struct Geometry {
    pub block_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub layout: KvLayout,
}

multiversion! {
    /// Rows `rows` of sequence `seq`, the query heads of KV head `g`, into `out`.
    fn task(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: SharedMut,
        seq: &AttnSeq<'_>,
        rows: Range<usize>,
        g: usize,
        geom: &Geometry,
    ) {
        let Geometry { block_size: bs, n_heads, n_kv_heads, head_dim: d, layout } = *geom;
        let (qc, kc, group) = (n_heads * d, n_kv_heads * d, n_heads / n_kv_heads);
        let scale = 1.0 / (d as f32).sqrt();
        // Keys up to the last row's position; where each one's V row (this head's part) starts.
        let ctx = seq.start_pos + (rows.end - seq.rows.start);
        let block = |p: usize| seq.block_table[p / bs] as usize * bs * kc;
        let transposed;
        let (keys, v_offs): (KeyStrips, Vec<usize>) = match layout {
            KvLayout::Rows => {
                let offs: Vec<usize> = (0..ctx).map(|p| block(p) + (p % bs) * kc + g * d).collect();
                transposed = Transposed::new(ctx, d, |j| &k[offs[j]..offs[j] + d]);
                (transposed.strips(), offs)
            }
            KvLayout::Blocked => {
                // This head's part of the block holding position p (K and V alike).
                let head = |p: usize| block(p) + g * d * bs;
                // Its keys and values in every block, all asked for into L2 before the first
                // is needed: the blocks are scattered, so the hardware prefetchers stop at
                // each one's end (64-sequence decode steps 5–12 % faster, context 64–256, with
                // the kernels' own look-ahead into L1).
                for j0 in (0..ctx).step_by(bs) {
                    super::simd::prefetch::<false>(&k[head(j0)..head(j0) + d * bs]);
                    super::simd::prefetch::<false>(&v[head(j0)..head(j0) + d * bs]);
                }
                // Strip j0 / 16: keys j0.. of one block (16 divides the block size), element e
                // of key j0 + l at e·bs + l from the strip's start.
                let need = d.saturating_sub(1) * bs + STRIP;
                let strips = (0..ctx).step_by(STRIP).map(|j0| &k[head(j0) + j0 % bs..][..need]).collect();
                let offs = (0..ctx).map(|p| head(p) + (p % bs) * d).collect();
                (KeyStrips::new(strips, bs, d), offs)
            }
        };
        let padded = keys.padded_len();
        let mut p = vec![0.0f32; QB * padded];
        // (row, query head) pairs, QB at a time: a decode row's heads are scored and summed
        // together (each key and value vector loaded once for all of them).
        let items: Vec<(usize, usize)> = rows.flat_map(|row| (g * group..(g + 1) * group).map(move |h| (row, h))).collect();
        for block in items.chunks(QB) {
            let n: Vec<usize> = block.iter().map(|&(row, _)| seq.start_pos + (row - seq.rows.start) + 1).collect();
            let qs: Vec<&[f32]> = block.iter().map(|&(row, h)| &q[row * qc + h * d..row * qc + (h + 1) * d]).collect();
            probs(&qs, &keys, &n, scale, &mut p);
            let ws: Vec<&[f32]> = p.chunks_exact(padded).zip(&n).map(|(p, &n)| &p[..n]).collect();
            let mut outs: Vec<&mut [f32]> = block
                .iter()
                .map(|&(row, h)| {
                    // SAFETY: (row, head h) is in this task's rows and KV head group only, and
                    // each pair appears once.
                    let o = unsafe { out.slice(row * qc + h * d, d) };
                    o.fill(0.0);
                    o
                })
                .collect();
            weighted_sums(&ws, |j| &v[v_offs[j]..v_offs[j] + d], &mut outs);
        }
    }
}
