//! The AdamW moment update and step, in f32 in PyTorch's operation order.
//!
//! `torch.optim.AdamW` (single-tensor path, `torch/optim/adam.py`, decoupled decay), with
//! the gradient first scaled by the global-norm clip factor as
//! `torch.nn.utils.clip_grad_norm_` does:
//! `g ← g·clip`, `m ← m + (1−β₁)(g − m)` (`lerp`), `v ← v·β₂ + (1−β₂)·g·g` (`addcmul`),
//! `denom = √v / √(1−β₂ᵗ) + ε`, `Δ = −(lr / (1−β₁ᵗ)) · (m / denom)` (`addcdiv`).
//! Each element is independent, so the loop vectorises; the result does not depend on how
//! the buffer is split across threads.

use crate::ops::AdamWStep;
use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 16;

/// Advances `m`, `v` in place with gradient `g` and writes the step into `d` (equal lengths).
pub fn adamw_delta(g: &[f32], m: &mut [f32], v: &mut [f32], d: &mut [f32], s: &AdamWStep) {
    let k = Coeffs {
        clip: s.clip as f32,
        one_minus_b1: (1.0 - s.beta1) as f32,
        b2: s.beta2 as f32,
        one_minus_b2: (1.0 - s.beta2) as f32,
        bc2_sqrt: s.bias_correction2.sqrt() as f32,
        eps: s.eps as f32,
        neg_step: (-s.lr / s.bias_correction1) as f32,
    };
    d.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|(((d, m), v), g)| chunk(g, m, v, d, &k));
}

struct Coeffs {
    clip: f32,
    one_minus_b1: f32,
    b2: f32,
    one_minus_b2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step: f32,
}

fn chunk(g: &[f32], m: &mut [f32], v: &mut [f32], d: &mut [f32], k: &Coeffs) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is available.
        return unsafe { chunk_avx512(g, m, v, d, k) };
    }
    body(g, m, v, d, k)
}

/// The same loop compiled for AVX-512 (16 lanes; no FMA contraction, so the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chunk_avx512(g: &[f32], m: &mut [f32], v: &mut [f32], d: &mut [f32], k: &Coeffs) {
    body(g, m, v, d, k)
}

#[inline(always)]
fn body(g: &[f32], m: &mut [f32], v: &mut [f32], d: &mut [f32], k: &Coeffs) {
    let n = d.len().min(m.len()).min(v.len()).min(g.len());
    let (g, m, v, d) = (&g[..n], &mut m[..n], &mut v[..n], &mut d[..n]);
    for i in 0..n {
        let gi = if k.clip == 1.0 { g[i] } else { g[i] * k.clip };
        let mi = m[i] + k.one_minus_b1 * (gi - m[i]);
        let vi = v[i] * k.b2 + k.one_minus_b2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        d[i] = k.neg_step * (mi / (vi.sqrt() / k.bc2_sqrt + k.eps));
    }
}
