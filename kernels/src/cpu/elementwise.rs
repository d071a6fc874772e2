//! Row-wise and elementwise ops.

use super::simd;
use crate::multiversion;
use rayon::prelude::*;

/// Rows per rayon task for cheap row-wise ops.
const ROWS_PER_TASK: usize = 8;

pub fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_mut(b.len()) {
        for (v, bi) in row.iter_mut().zip(b) {
            *v += bi;
        }
    }
}

/// `Σ x²` in f64 over 8 interleaved accumulators (lane `l` sums `x[8j + l]`), then the
/// lanes and the tail in order: a fixed order for a given length, and vectorisable.
pub fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..8 {
            acc[l] += (c[l] as f64) * (c[l] as f64);
        }
    }
    acc.iter().sum::<f64>() + tail.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>()
}

/// `a ← a·s + d` elementwise (no FMA contraction: the optimizer's update, bitwise the same
/// wherever it runs).
pub fn scale_add(a: &mut [f32], s: f32, d: &[f32]) {
    for (a, d) in a.iter_mut().zip(d) {
        *a = *a * s + d;
    }
}

/// `d = w·s + d` ([`scale_add`]'s arithmetic with the roles swapped).
pub fn scale_add_into(w: &[f32], s: f32, d: &mut [f32]) {
    for (d, w) in d.iter_mut().zip(w) {
        *d += *w * s; // w·s + d: addition commutes bitwise
    }
}

pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// RMSNorm per row of width `d`; the mean of squares is accumulated in f64.
pub fn rms_norm(x: &[f32], w: &[f32], y: &mut [f32], d: usize, eps: f32) {
    let f = |(ys, xs): (&mut [f32], &[f32])| {
        for (yr, xr) in ys.chunks_mut(d).zip(xs.chunks(d)) {
            let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
            let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
            for i in 0..d {
                yr[i] = xr[i] * inv * w[i];
            }
        }
    };
    // Decode-sized inputs run inline: a rayon dispatch costs more than the work.
    if x.len() <= d * ROWS_PER_TASK {
        f((y, x));
    } else {
        y.par_chunks_mut(d * ROWS_PER_TASK).zip(x.par_chunks(d * ROWS_PER_TASK)).for_each(f);
    }
}

/// Rotate-half RoPE on rows of width `c` (heads of `head_dim`).
pub fn rope(x: &mut [f32], positions: &[u32], cos: &[f32], sin: &[f32], c: usize, head_dim: usize) {
    let half = head_dim / 2;
    let f = |(row, &p): (&mut [f32], &u32)| {
        let p = p as usize;
        let (cr, sr) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
        for head in row.chunks_mut(head_dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cr[i] - b * sr[i];
                head[i + half] = b * cr[i] + a * sr[i];
            }
        }
    };
    if positions.len() <= ROWS_PER_TASK {
        x.chunks_mut(c).zip(positions).for_each(f);
    } else {
        x.par_chunks_mut(c).zip(positions.par_iter()).for_each(f);
    }
}

/// `silu(g) · u` with `silu(g) = g / (1 + eᐨᵍ)` (Elfwing et al. 2018, eq. 4; [`simd::exp`]),
/// for rows `[g (i) | u (i)]` → `[i]`; rows in parallel, each element on its own.
pub fn silu_mul(gate_up: &[f32], i: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; gate_up.len() / 2];
    if i == 0 {
    } else if y.len() <= i * ROWS_PER_TASK {
        silu_mul_rows(gate_up, &mut y, i); // a decode step's few rows: no pool hand-off
    } else {
        y.par_chunks_mut(i * ROWS_PER_TASK)
            .zip(gate_up.par_chunks(2 * i * ROWS_PER_TASK))
            .for_each(|(y, gu)| silu_mul_rows(gu, y, i));
    }
    y
}

multiversion! {
    fn silu_mul_rows(gate_up: &[f32], y: &mut [f32], i: usize) {
        for (row, y) in gate_up.chunks_exact(2 * i).zip(y.chunks_exact_mut(i)) {
            let (g, u) = row.split_at(i);
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                *y = g / (1.0 + simd::exp(-g)) * u;
            }
        }
    }
}

/// In-place softmax of each row of width `n`.
pub fn softmax_rows(x: &mut [f32], n: usize) {
    x.par_chunks_mut(n).for_each(softmax_row);
}

/// In-place softmax of one row (max-subtracted; sum accumulated in f64).
pub fn softmax_row(row: &mut [f32]) {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// In-place log-softmax of each row of width `n`.
pub fn log_softmax_rows(x: &mut [f32], n: usize) {
    x.par_chunks_mut(n).for_each(|row| {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
        // (x - max) - ln Σ: subtracting max first keeps precision for large logits.
        let ln_sum = sum.ln() as f32;
        for v in row.iter_mut() {
            *v = (*v - max) - ln_sum;
        }
    });
}
