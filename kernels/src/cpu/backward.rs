//! Backward passes of the forward ops (hand-derived; checked against JAX autodiff in the
//! learner tests).

use super::attention_rows::{dot, softmax, Transposed, KB};
use super::gemm_tile::{self, Isa, Tile};
use super::matmul::transpose_into;
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
/// Probabilities are recomputed as the forward computes them (each score one FMA chain over
/// the head dimension, then `× 1/√D`, then [`softmax`]: the forward's bits). With
/// `P = softmax(S)`, `S = Q Kᵀ/√D` (Vaswani et al. 2017, eq. 1), `dP = dA Vᵀ`:
/// `dS_ij = P_ij (dP_ij − Σ_j P_ij dP_ij)/√D`, `dQ = dS K`, `dK = dSᵀ Q`, `dV = Pᵀ dA`
/// (summed over the query heads of a KV head).
///
/// One task per (sequence, KV head); it owns that part of `dk`/`dv` and `dq` of its query
/// heads. Per query head and block of [`ROW_BLOCK`] rows, the five products are register-tile
/// GEMMs ([`gemm_tile::serial`]) over the block's keys (past a row's causal limit `P` and
/// `dS` are zero): `dQ_i` is one FMA chain over the keys in order, `dK_j`, `dV_j` one chain
/// each over (query head, row) in order, so the result does not depend on the thread count.
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

/// Query rows per block of [`attention_backward`]'s products (= a key block, so a block's
/// `P` and `dS` rows, `ROW_BLOCK × padded`, stay in L2 next to the transposed keys).
const ROW_BLOCK: usize = KB;

/// Query heads, query heads per KV head, K/V row width, head dimension.
struct Heads {
    n_heads: usize,
    group: usize,
    kc: usize,
    d: usize,
}

/// `c [rows, cols] = a · b` (or `+=` with `accumulate`), strided as in [`Tile`], on this thread.
///
/// # Safety
/// As [`gemm_tile::serial`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn product(
    a: *const f32,
    a_rs: usize,
    b: *const f32,
    ldb: usize,
    k: usize,
    c: *mut f32,
    ldc: usize,
    (rows, cols): (usize, usize),
    accumulate: bool,
) {
    let t = Tile { a, a_rs, b, ldb, k, c, ldc, rows, cols, accumulate, prefetch: false, next: b, next_lines: 0 };
    // SAFETY: forwarded; the variant is the detected one.
    unsafe { gemm_tile::serial(Isa::detect(), &t) }
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
        if t == 0 {
            return;
        }
        let scale = 1.0 / (d as f32).sqrt();
        let wide = simd::wide_transpose();
        // Offset of row j's part of KV head g in k/v.
        let kv = |j: usize| (s0 + j) * kc + g * d;
        let keys = Transposed::new(t, d, |j| &k[kv(j)..kv(j) + d]);
        let values = Transposed::new(t, d, |j| &v[kv(j)..kv(j) + d]);
        let padded = keys.padded_len();
        // dKᵀ, dVᵀ [d, padded]: chains continued over every head and row block.
        let (mut dkt, mut dvt) = (vec![0.0f32; d * padded], vec![0.0f32; d * padded]);
        // A block's P and dP → dS [ROW_BLOCK, padded]; its Qᵀ and dAᵀ [d, ROW_BLOCK].
        let (mut p, mut ds) = (vec![0.0f32; ROW_BLOCK * padded], vec![0.0f32; ROW_BLOCK * padded]);
        let (mut qt, mut dat) = (vec![0.0f32; d * ROW_BLOCK], vec![0.0f32; d * ROW_BLOCK]);
        for h in g * group..(g + 1) * group {
            let at = |i: usize| (s0 + i) * qc + h * d;
            for i0 in (0..t).step_by(ROW_BLOCK) {
                let rows = ROW_BLOCK.min(t - i0);
                let n_max = i0 + rows;
                let width = n_max.div_ceil(KB) * KB;
                // SAFETY (all products and transposes below): the operands are this task's
                // buffers at the sizes allocated above, q/da rows i0 .. i0 + rows of head h
                // (d values each, rows qc apart), k rows s0 .. s0 + n_max of KV head g, and
                // dq rows of head h, which only this task writes.
                unsafe {
                    for b in 0..width / KB {
                        // S = Q Kᵀ (unscaled) and dP = dA Vᵀ over key block b.
                        let c = b * KB;
                        let blk = (keys.block(b).as_ptr(), values.block(b).as_ptr());
                        product(q[at(i0)..].as_ptr(), qc, blk.0, KB, d, p[c..].as_mut_ptr(), padded, (rows, KB), false);
                        product(da[at(i0)..].as_ptr(), qc, blk.1, KB, d, ds[c..].as_mut_ptr(), padded, (rows, KB), false);
                    }
                }
                for r in 0..rows {
                    let n = i0 + r + 1;
                    let (p, ds) = (&mut p[r * padded..][..width], &mut ds[r * padded..][..width]);
                    for s in &mut p[..n] {
                        *s *= scale;
                    }
                    softmax(p, n);
                    let pdp = dot(&p[..n], &ds[..n]);
                    for (s, &pj) in ds[..n].iter_mut().zip(&p[..n]) {
                        *s = pj * (*s - pdp) * scale;
                    }
                    p[n..].fill(0.0);
                    ds[n..].fill(0.0);
                }
                // SAFETY: as above.
                unsafe {
                    // dQ = dS K, K's rows read in place.
                    let dq_rows = dq.0.add(at(i0));
                    product(ds.as_ptr(), padded, k[kv(0)..].as_ptr(), kc, n_max, dq_rows, qc, (rows, d), false);
                    // dKᵀ += Qᵀ dS, dVᵀ += dAᵀ P over the block's rows.
                    let q_row = |i: usize| &q[at(i0 + i)..at(i0 + i) + d];
                    let da_row = |i: usize| &da[at(i0 + i)..at(i0 + i) + d];
                    transpose_into(q_row, rows, d, qt.as_mut_ptr(), ROW_BLOCK, wide);
                    transpose_into(da_row, rows, d, dat.as_mut_ptr(), ROW_BLOCK, wide);
                    product(qt.as_ptr(), ROW_BLOCK, ds.as_ptr(), padded, rows, dkt.as_mut_ptr(), padded, (d, n_max), true);
                    product(dat.as_ptr(), ROW_BLOCK, p.as_ptr(), padded, rows, dvt.as_mut_ptr(), padded, (d, n_max), true);
                }
            }
        }
        // SAFETY: rows s0 .. s0 + t, columns of KV head g of dk and dv: this task's only.
        unsafe {
            transpose_into(|e| &dkt[e * padded..e * padded + t], d, t, dk.0.add(kv(0)), kc, wide);
            transpose_into(|e| &dvt[e * padded..e * padded + t], d, t, dv.0.add(kv(0)), kc, wide);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`attention_backward`] against the formulas evaluated in f64 (the forward recomputed
    /// in f64 too): two sequences, one of 70 rows (two row blocks, a partial key block) and
    /// one of 5, two query heads per KV head, a head dimension that is not a multiple of 16.
    #[test]
    fn attention_backward_matches_f64() {
        let (h, kvh, d) = (4usize, 2usize, 24usize);
        let spans = [0..70usize, 70..75];
        let t = 75;
        let val = |i: usize, s: usize| ((i * 7919 + s * 104_729) % 1013) as f32 / 1013.0 - 0.5;
        let q: Vec<f32> = (0..t * h * d).map(|i| 2.0 * val(i, 1)).collect();
        let k: Vec<f32> = (0..t * kvh * d).map(|i| 2.0 * val(i, 2)).collect();
        let v: Vec<f32> = (0..t * kvh * d).map(|i| val(i, 3)).collect();
        let da: Vec<f32> = (0..t * h * d).map(|i| val(i, 4)).collect();
        let (mut dq, mut dk, mut dv) =
            (vec![f32::NAN; t * h * d], vec![f32::NAN; t * kvh * d], vec![f32::NAN; t * kvh * d]);
        attention_backward(&q, &k, &v, &da, &mut dq, &mut dk, &mut dv, &spans, h, kvh, d);
        let (mut wq, mut wk, mut wv) = (vec![0.0f64; t * h * d], vec![0.0f64; t * kvh * d], vec![0.0f64; t * kvh * d]);
        let scale = 1.0 / (d as f64).sqrt();
        for span in &spans {
            for hh in 0..h {
                let g = hh / (h / kvh);
                let (qa, ka) = (|i: usize, e: usize| (i * h + hh) * d + e, |j: usize, e: usize| (j * kvh + g) * d + e);
                for i in span.clone() {
                    let keys = span.start..=i;
                    let s: Vec<f64> = keys
                        .clone()
                        .map(|j| (0..d).map(|e| q[qa(i, e)] as f64 * k[ka(j, e)] as f64).sum::<f64>() * scale)
                        .collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                    let p: Vec<f64> = s.iter().map(|x| (x - mx).exp() / z).collect();
                    let dp: Vec<f64> =
                        keys.clone().map(|j| (0..d).map(|e| da[qa(i, e)] as f64 * v[ka(j, e)] as f64).sum()).collect();
                    let pdp: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for (x, j) in keys.enumerate() {
                        let ds = p[x] * (dp[x] - pdp) * scale;
                        for e in 0..d {
                            wq[qa(i, e)] += ds * k[ka(j, e)] as f64;
                            wk[ka(j, e)] += ds * q[qa(i, e)] as f64;
                            wv[ka(j, e)] += p[x] * da[qa(i, e)] as f64;
                        }
                    }
                }
            }
        }
        for (name, got, want) in [("dq", &dq, &wq), ("dk", &dk, &wk), ("dv", &dv, &wv)] {
            let max = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            for (i, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
                assert!((g as f64 - w).abs() <= 1e-5 * max, "{name}[{i}]: {g} vs f64 {w} (max {max})");
            }
        }
    }
}
