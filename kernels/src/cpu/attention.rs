//! Causal grouped-query attention over a contiguous K/V buffer.

use super::elementwise::softmax_row;
use super::simd::{axpy, dot};
use rayon::prelude::*;

/// `out [t, H·D]` for queries `q [t, H·D]` at positions `past..past+t` over
/// `k`, `v [L, KVH·D]`. Work is split over (query row, head) pairs.
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    t: usize,
    past: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) {
    let group = n_heads / n_kv_heads;
    let (qc, kc) = (n_heads * head_dim, n_kv_heads * head_dim);
    let scale = 1.0 / (head_dim as f32).sqrt();
    out.par_chunks_mut(head_dim).enumerate().for_each(|(idx, o)| {
        let (row, h) = (idx / n_heads, idx % n_heads);
        let kvh = h / group;
        let qv = &q[row * qc + h * head_dim..row * qc + (h + 1) * head_dim];
        let n_keys = past + row + 1;
        let mut scores: Vec<f32> =
            (0..n_keys).map(|j| dot(qv, &k[j * kc + kvh * head_dim..j * kc + (kvh + 1) * head_dim]) * scale).collect();
        softmax_row(&mut scores);
        o.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            axpy(p, &v[j * kc + kvh * head_dim..j * kc + (kvh + 1) * head_dim], o);
        }
    });
    let _ = t;
}
