//! Backward passes of the forward ops (hand-derived; checked against JAX autodiff in the
//! learner tests).

use super::attention_rows::{dot, probs, scores_block, weighted_sum, Transposed, QB};
use super::simd::{self, SharedMut};
use crate::multiversion;
use rayon::prelude::*;
use std::ops::Range;

/// RMSNorm backward. With `r = 1/sqrt(mean(x²) + eps)`, `y = x·r·w`:
/// `dw = Σ_rows dy·x·r`, `dx = r·(dy·w) − x·r³·Σ(dy·w·x)/d` (sums in f64).
///
/// Rows in parallel, [`NORM_ROWS`] per task: a task writes its rows of `dx` and returns its
/// rows' part of `dw`; the parts are added in task order, so every value is the same
/// whatever the thread count. (Serial, with one f64 chain per sum, it took 0.16 s of an
/// 8 × 256-token learner step.)
pub fn rms_norm_backward(x: &[f32], w: &[f32], dy: &[f32], dx: &mut [f32], dw: &mut [f32], d: usize, eps: f32) {
    if d == 0 {
        return;
    }
    let parts: Vec<Vec<f64>> = x
        .par_chunks(d * NORM_ROWS)
        .zip(dy.par_chunks(d * NORM_ROWS))
        .zip(dx.par_chunks_mut(d * NORM_ROWS))
        .map(|((x, dy), dx)| rms_norm_backward_rows(x, w, dy, dx, d, eps))
        .collect();
    for (i, dw) in dw.iter_mut().enumerate() {
        *dw = parts.iter().map(|p| p[i]).sum::<f64>() as f32;
    }
}

/// Rows per task of [`rms_norm_backward`].
const NORM_ROWS: usize = 64;

multiversion! {
    /// [`rms_norm_backward`] over whole rows: writes `dx`, returns `Σ_rows dy·x·r` (f64).
    fn rms_norm_backward_rows(x: &[f32], w: &[f32], dy: &[f32], dx: &mut [f32], d: usize, eps: f32) -> Vec<f64> {
        let mut dw = vec![0.0f64; d];
        for ((xr, dyr), dxr) in x.chunks_exact(d).zip(dy.chunks_exact(d)).zip(dx.chunks_exact_mut(d)) {
            let ms = sum_products([xr, xr]) / d as f64;
            let r = 1.0 / (ms + eps as f64).sqrt();
            let gx = sum_products([dyr, w, xr]);
            let c = r * r * r * gx / d as f64;
            for i in 0..d {
                dxr[i] = (r * dyr[i] as f64 * w[i] as f64 - xr[i] as f64 * c) as f32;
                dw[i] += dyr[i] as f64 * xr[i] as f64 * r;
            }
        }
        dw
    }
}

/// `Σ_i Π_n v[n][i]` in f64, in 8 interleaved lanes (`lane[i % 8]`, then the lanes in
/// order): a fixed order that vectorises, where one chain of dependent adds does not.
#[inline(always)]
fn sum_products<const N: usize>(v: [&[f32]; N]) -> f64 {
    let len = v[0].len();
    let mut lanes = [0.0f64; 8];
    for c in 0..len / 8 {
        for (j, lane) in lanes.iter_mut().enumerate() {
            *lane += v.iter().map(|r| r[8 * c + j] as f64).product::<f64>();
        }
    }
    for (j, lane) in lanes.iter_mut().enumerate().take(len % 8) {
        *lane += v.iter().map(|r| r[len / 8 * 8 + j] as f64).product::<f64>();
    }
    lanes.iter().sum()
}

/// Backward of `silu(g)·u` on fused rows `[g | u]`: `dg = da·u·σ(g)(1 + g(1 − σ(g)))`,
/// `du = da·silu(g)`, with `σ(g) = 1 / (1 + eᐨᵍ)` from the forward's [`simd::exp`]; rows in
/// parallel.
pub fn silu_mul_backward(gate_up: &[f32], da: &[f32], dgu: &mut [f32], i: usize) {
    const ROWS: usize = 8;
    if i == 0 {
        return;
    }
    dgu.par_chunks_mut(2 * i * ROWS)
        .zip(gate_up.par_chunks(2 * i * ROWS))
        .zip(da.par_chunks(i * ROWS))
        .for_each(|((d, gu), da)| silu_mul_backward_rows(gu, da, d, i));
}

multiversion! {
    fn silu_mul_backward_rows(gate_up: &[f32], da: &[f32], dgu: &mut [f32], i: usize) {
        for ((row, dar), drow) in gate_up.chunks_exact(2 * i).zip(da.chunks_exact(i)).zip(dgu.chunks_exact_mut(2 * i)) {
            let (g, u) = row.split_at(i);
            let (dg, du) = drow.split_at_mut(i);
            for j in 0..i {
                let s = 1.0 / (1.0 + simd::exp(-g[j]));
                dg[j] = dar[j] * u[j] * s * (1.0 + g[j] * (1.0 - s));
                du[j] = dar[j] * g[j] * s;
            }
        }
    }
}

/// Causal GQA attention backward over packed sequences: sequence `s` is rows `spans[s]` of
/// `q [t, H·D]`, `k`/`v [t, KVH·D]`, `da [t, H·D]`, at positions `0..len`; writes `dq`, `dk`,
/// `dv` (shaped like `q`, `k`, `v`; rows outside every span are left as they are).
/// Probabilities are recomputed by the forward's [`probs`]. With `P = softmax(S)`,
/// `S = Q Kᵀ/√D` (Vaswani et al. 2017, eq. 1), `dP = dA Vᵀ`:
/// `dS_ij = P_ij (dP_ij − Σ_j P_ij dP_ij)`, `dQ_i = Σ_j dS_ij K_j/√D`,
/// `dK_j = Σ_i dS_ij Q_i/√D`, `dV_j = Σ_i P_ij dA_i` (summed over the query heads of a KV head).
///
/// One task per (sequence, KV head); it owns that part of `dk`/`dv` and `dq` of its query
/// heads. `dK_j`, `dV_j` are one FMA chain each over (query head, row) in order, `dQ_i` one
/// chain over `j` ([`weighted_sum`]).
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    da: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    spans: &[Range<usize>],
    n_heads: usize,
    n_kv_heads: usize,
    d: usize,
) {
    let tasks: Vec<(Range<usize>, usize)> =
        spans.iter().flat_map(|s| (0..n_kv_heads).map(move |g| (s.clone(), g))).collect();
    let (dq, dk, dv) = (SharedMut(dq.as_mut_ptr()), SharedMut(dk.as_mut_ptr()), SharedMut(dv.as_mut_ptr()));
    tasks.par_iter().for_each(|(span, g)| {
        let heads = Heads { n_heads, group: n_heads / n_kv_heads, kc: n_kv_heads * d, d };
        attention_backward_task(q, k, v, da, [dq, dk, dv], span.clone(), *g, &heads);
    });
}

/// Query rows whose `dK`/`dV` contributions are added in one pass over the keys (one load
/// and store of `dK_j`, `dV_j` per block instead of per row).
const ROW_BLOCK: usize = QB;

/// Query heads, query heads per KV head, K/V row width, head dimension.
struct Heads {
    n_heads: usize,
    group: usize,
    kc: usize,
    d: usize,
}

multiversion! {
    /// The gradients of KV head `g` of the sequence at rows `span` (see [`attention_backward`]).
    fn attention_backward_task(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        da: &[f32],
        grads: [SharedMut; 3],
        span: Range<usize>,
        g: usize,
        heads: &Heads,
    ) {
        let Heads { n_heads, group, kc, d } = *heads;
        let [dq, dk, dv] = grads;
        let (qc, t, s0) = (n_heads * d, span.len(), span.start);
        let scale = 1.0 / (d as f32).sqrt();
        // Offset of row j's part of KV head g in k/v.
        let kv = |j: usize| (s0 + j) * kc + g * d;
        let key = |j: usize| &k[kv(j)..kv(j) + d];
        let keys = Transposed::new(t, d, key);
        let values = Transposed::new(t, d, |j| &v[kv(j)..kv(j) + d]);
        let (mut dkg, mut dvg) = (vec![0.0f32; t * d], vec![0.0f32; t * d]);
        let padded = keys.padded_len();
        let (mut p, mut ds) = (vec![0.0f32; ROW_BLOCK * padded], vec![0.0f32; ROW_BLOCK * padded]);
        for h in g * group..(g + 1) * group {
            let at = |i: usize| (s0 + i) * qc + h * d;
            let (q_row, da_row) = (|i: usize| &q[at(i)..at(i) + d], |i: usize| &da[at(i)..at(i) + d]);
            for i0 in (0..t).step_by(ROW_BLOCK) {
                let rows = ROW_BLOCK.min(t - i0);
                let (qs, das): (Vec<&[f32]>, Vec<&[f32]>) = (i0..i0 + rows).map(|i| (q_row(i), da_row(i))).unzip();
                let n: Vec<usize> = (i0 + 1..=i0 + rows).collect();
                probs(&qs, &keys, &n, scale, &mut p);
                scores_block(&das, &values, i0 + rows, 1.0, &mut ds);
                for r in 0..rows {
                    let (i, p, ds) = (i0 + r, &p[r * padded..(r + 1) * padded], &mut ds[r * padded..(r + 1) * padded]);
                    let pdp = dot(&p[..=i], &ds[..=i]);
                    for (s, &pj) in ds[..=i].iter_mut().zip(&p[..=i]) {
                        *s = pj * (*s - pdp) * scale;
                    }
                    // SAFETY: (row s0 + i, head h) belongs to this task only.
                    let dqi = unsafe { dq.slice(at(i), d) };
                    dqi.fill(0.0);
                    weighted_sum(&ds[..=i], key, dqi);
                }
                // dK_j, dV_j continue their chains over the block's rows i ≥ j, in order.
                for j in 0..i0 + rows {
                    let r0 = j.saturating_sub(i0);
                    let w = |b: &[f32]| -> [f32; ROW_BLOCK] { std::array::from_fn(|r| if r0 + r < rows { b[(r0 + r) * padded + j] } else { 0.0 }) };
                    let (wk, wv) = (w(&ds), w(&p));
                    weighted_sum(&wk[..rows - r0], |r| q_row(i0 + r0 + r), &mut dkg[j * d..(j + 1) * d]);
                    weighted_sum(&wv[..rows - r0], |r| da_row(i0 + r0 + r), &mut dvg[j * d..(j + 1) * d]);
                }
            }
        }
        for j in 0..t {
            // SAFETY: rows of this span, columns of KV head g: this task's only.
            unsafe {
                dk.slice(kv(j), d).copy_from_slice(&dkg[j * d..(j + 1) * d]);
                dv.slice(kv(j), d).copy_from_slice(&dvg[j * d..(j + 1) * d]);
            }
        }
    }
}
