//! Causal grouped-query attention over a paged K/V buffer.

use super::attention_rows::{probs, weighted_sums, Transposed, QB};
use super::simd::SharedMut;
use crate::multiversion;
use crate::ops::AttnSeq;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows of one sequence per task (they share one transposed copy of the keys).
const ROWS_PER_TASK: usize = 32;

/// `out [t, H·D]` for queries `q [t, H·D]`; every row belongs to one of `seqs`, whose
/// position `p` lives in slot `block_table[p / block_size] · block_size + p % block_size`.
///
/// Work is split into tasks of (sequence, KV head, up to 32 rows); a task transposes the
/// keys its rows attend once ([`Transposed`]), then for its (row, query head) pairs, 4 at a
/// time, computes [`probs`] over positions `0..=p` and `Σ_j p_j v_j` ([`weighted_sums`]), in
/// the fixed orders of [`super::attention_rows`]: a row's output does not depend on the other
/// rows of the call, nor on how they are split into tasks.
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
    assert_eq!(out.len(), q.len());
    let mut tasks: Vec<(usize, usize, Range<usize>)> = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for g in 0..n_kv_heads {
            for r0 in s.rows.clone().step_by(ROWS_PER_TASK) {
                tasks.push((si, g, r0..(r0 + ROWS_PER_TASK).min(s.rows.end)));
            }
        }
    }
    let o = SharedMut(out.as_mut_ptr());
    let f = |(si, g, rows): &(usize, usize, Range<usize>)| {
        let geom =
            Geometry { block_size, n_heads, group: n_heads / n_kv_heads, kc: n_kv_heads * head_dim, d: head_dim };
        task(q, k, v, o, &seqs[*si], rows.clone(), *g, &geom);
    };
    // On the pool even for a short decode, where the work is less than a dispatch costs:
    // run inline, it left the other worker idle long enough to fall asleep, and the next
    // projection paid its wake-up (o_proj 1.5 → 2.3 ms per decoded token, 30 layers, 2 threads).
    tasks.par_iter().for_each(f);
}

/// The layout constants of a call: KV block size, query heads, query heads per KV head,
/// K/V row width, head dimension.
struct Geometry {
    block_size: usize,
    n_heads: usize,
    group: usize,
    kc: usize,
    d: usize,
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
        let Geometry { block_size, n_heads, group, kc, d } = *geom;
        let qc = n_heads * d;
        let scale = 1.0 / (d as f32).sqrt();
        // Keys up to the last row's position; offsets of their K/V rows (this head's part).
        let ctx = seq.start_pos + (rows.end - seq.rows.start);
        let offs: Vec<usize> =
            (0..ctx).map(|p| (seq.block_table[p / block_size] as usize * block_size + p % block_size) * kc + g * d).collect();
        let keys = Transposed::new(ctx, d, |j| &k[offs[j]..offs[j] + d]);
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
            weighted_sums(&ws, |j| &v[offs[j]..offs[j] + d], &mut outs);
        }
    }
}
