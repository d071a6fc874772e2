//! Backward passes of the forward ops (hand-derived; checked against JAX autodiff in the
//! learner tests).

use super::attention::attention_probs;
use super::simd::{axpy, dot};
use rayon::prelude::*;

/// RMSNorm backward. With `r = 1/sqrt(mean(x²) + eps)`, `y = x·r·w`:
/// `dw = Σ_rows dy·x·r`, `dx = r·(dy·w) − x·r³·Σ(dy·w·x)/d`.
pub fn rms_norm_backward(x: &[f32], w: &[f32], dy: &[f32], dx: &mut [f32], dw: &mut [f32], d: usize, eps: f32) {
    dw.fill(0.0);
    for ((xr, dyr), dxr) in x.chunks(d).zip(dy.chunks(d)).zip(dx.chunks_mut(d)) {
        let ms = xr.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        let gx: f64 = (0..d).map(|i| dyr[i] as f64 * w[i] as f64 * xr[i] as f64).sum();
        let c = r * r * r * gx / d as f64;
        for i in 0..d {
            dxr[i] = (r * dyr[i] as f64 * w[i] as f64 - xr[i] as f64 * c) as f32;
            dw[i] += (dyr[i] as f64 * xr[i] as f64 * r) as f32;
        }
    }
}

/// Backward of `silu(g)·u` on fused rows `[g | u]`: `dg = da·u·σ(g)(1 + g(1 − σ(g)))`, `du = da·silu(g)`.
pub fn silu_mul_backward(gate_up: &[f32], da: &[f32], dgu: &mut [f32], i: usize) {
    for ((row, dar), drow) in gate_up.chunks(2 * i).zip(da.chunks(i)).zip(dgu.chunks_mut(2 * i)) {
        let (g, u) = row.split_at(i);
        let (dg, du) = drow.split_at_mut(i);
        for j in 0..i {
            let s = 1.0 / (1.0 + (-g[j]).exp());
            dg[j] = dar[j] * u[j] * s * (1.0 + g[j] * (1.0 - s));
            du[j] = dar[j] * g[j] * s;
        }
    }
}

/// Causal GQA attention backward for one sequence whose rows are positions `0..t`
/// (`q [t, H·D]`, `k`/`v [t, KVH·D]`, `da [t, H·D]`). Probabilities are recomputed.
/// `ds_ij = p_ij (dp_ij − Σ_j p_ij dp_ij)`, `dq_i = Σ_j ds_ij k_j/√D`, `dk_j = Σ_i ds_ij q_i/√D`, `dv_j = Σ_i p_ij da_i`.
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    da: &[f32],
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    t: usize,
    n_heads: usize,
    n_kv_heads: usize,
    d: usize,
) {
    let group = n_heads / n_kv_heads;
    let (qc, kc) = (n_heads * d, n_kv_heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    dq.fill(0.0);
    // One task per KV head: it owns dk/dv of that head and dq of its query heads.
    let per_kv: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..n_kv_heads)
        .into_par_iter()
        .map(|g| {
            let (mut dkg, mut dvg, mut dqg) = (vec![0.0f32; t * d], vec![0.0f32; t * d], vec![0.0f32; t * group * d]);
            let kr = |j: usize| &k[j * kc + g * d..j * kc + (g + 1) * d];
            let vr = |j: usize| &v[j * kc + g * d..j * kc + (g + 1) * d];
            for hh in 0..group {
                let h = g * group + hh;
                for i in 0..t {
                    let qi = &q[i * qc + h * d..i * qc + (h + 1) * d];
                    let dai = &da[i * qc + h * d..i * qc + (h + 1) * d];
                    let p = attention_probs(qi, (0..=i).map(kr), scale);
                    let dp: Vec<f32> = (0..=i).map(|j| dot(dai, vr(j))).collect();
                    let pdp: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    for j in 0..=i {
                        let ds = p[j] * (dp[j] - pdp) * scale;
                        axpy(ds, kr(j), &mut dqg[(i * group + hh) * d..(i * group + hh + 1) * d]);
                        axpy(ds, qi, &mut dkg[j * d..(j + 1) * d]);
                        axpy(p[j], dai, &mut dvg[j * d..(j + 1) * d]);
                    }
                }
            }
            (dkg, dvg, dqg)
        })
        .collect();
    for (g, (dkg, dvg, dqg)) in per_kv.into_iter().enumerate() {
        for j in 0..t {
            dk[j * kc + g * d..j * kc + (g + 1) * d].copy_from_slice(&dkg[j * d..(j + 1) * d]);
            dv[j * kc + g * d..j * kc + (g + 1) * d].copy_from_slice(&dvg[j * d..(j + 1) * d]);
            for hh in 0..group {
                let h = g * group + hh;
                dq[j * qc + h * d..j * qc + (h + 1) * d]
                    .copy_from_slice(&dqg[(j * group + hh) * d..(j * group + hh + 1) * d]);
            }
        }
    }
}
