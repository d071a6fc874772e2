//! The AdamW moment update and step, in f32 in PyTorch's operation order.
//!
//! `torch.optim.AdamW` (single-tensor path, `torch/optim/adam.py`, decoupled decay), with
//! the gradient first scaled by the global-norm clip factor as
//! `torch.nn.utils.clip_grad_norm_` does:
//! `g ← g·clip`, `m ← m + (1−β₁)(g − m)` (`lerp`), `v ← v·β₂ + (1−β₂)·g·g` (`addcmul`),
//! `denom = √v / √(1−β₂ᵗ) + ε`, `Δ = −(lr / (1−β₁ᵗ)) · (m / denom)` (`addcdiv`).
//! Each element is independent, so the loop vectorises; the result does not depend on how
//! the buffer is split across threads.

use super::matmul::{self, NP};
use crate::ops::AdamWStep;
use rayon::prelude::*;

/// Elements per rayon task.
const CHUNK: usize = 1 << 16;

/// Advances `m`, `v` in place with gradient `g` and writes the step into `d` (equal lengths).
pub fn adamw_delta(g: &[f32], m: &mut [f32], v: &mut [f32], d: &mut [f32], s: &AdamWStep) {
    let k = Coeffs::new(s);
    d.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .zip(g.par_chunks(CHUNK))
        .for_each(|(((d, m), v), g)| chunk(g, m, v, d, &k));
}

/// One row block of a stacked weight: its gradient and moments, `[r, k]` each.
pub type Part<'a> = (&'a [f32], &'a mut [f32], &'a mut [f32]);

/// [`adamw_delta`] over a linear weight stacked from row blocks (`parts`, in order, `k`
/// columns each), written in [`matmul::pack`]'s panel layout in one pass: each panel's 64
/// rows are stepped into a cache-sized row-major scratch, then transposed from cache into
/// the panel. Bitwise the per-part [`adamw_delta`], concatenated and packed.
pub fn adamw_delta_packed(parts: &mut [Part<'_>], k: usize, s: &AdamWStep) -> Vec<f32> {
    let coeffs = Coeffs::new(s);
    // Row j of the stack: (g, m, v) pointers into its part.
    let mut stack: Vec<[usize; 3]> = Vec::new();
    for (g, m, v) in parts.iter_mut() {
        assert!(g.len() % k.max(1) == 0 && m.len() == g.len() && v.len() == g.len());
        for r in 0..g.len() / k.max(1) {
            let o = r * k;
            stack.push([g[o..].as_ptr() as usize, m[o..].as_mut_ptr() as usize, v[o..].as_mut_ptr() as usize]);
        }
    }
    let n = stack.len();
    if k == 0 {
        return Vec::new();
    }
    // A plain allocation, not `HostBuf::huge`: the allocator can hand back memory it holds
    // from the step's freed activations, where a 2 MiB-aligned request gets fresh memory
    // from the OS (with rlserve's mimalloc, which keeps what is freed: peak RSS 4.85 →
    // 5.39 GB for the default model, one packed step more). The commit swaps it in as the
    // weight (`CpuStorage::commit_from`); mimalloc's segments are on huge pages already.
    // Written in full below (every panel column by `pack_panel` or the padding fill), so
    // not zero-filled first: at 540 MB per step for the default model, a fill was a tenth
    // of the optimizer's time.
    let len = n.div_ceil(NP) * k * NP;
    let mut packed = Vec::with_capacity(len);
    // SAFETY: f32 has no invalid bit patterns and nothing reads an element before the
    // loop below writes it.
    #[allow(clippy::uninit_vec)]
    unsafe {
        packed.set_len(len)
    };
    let wide = super::simd::wide_transpose();
    let stack = &*stack;
    packed.par_chunks_mut(k * NP).enumerate().for_each(|(p, panel)| {
        let live = NP.min(n - p * NP);
        let mut d = vec![0.0f32; live * k];
        if live < NP {
            // The last panel's columns past n: zeros, as `matmul::pack` leaves them.
            for row in panel.chunks_exact_mut(NP) {
                row[live..].fill(0.0);
            }
        }
        for (c, d) in d.chunks_mut(k).enumerate() {
            let [g, m, v] = stack[p * NP + c];
            // SAFETY: the pointers name row p·NP + c of the parts (k values each, asserted
            // above); `parts` is borrowed mutably for the call and each row belongs to exactly
            // one panel, so no two tasks touch the same moments.
            let (g, m, v) = unsafe {
                (
                    std::slice::from_raw_parts(g as *const f32, k),
                    std::slice::from_raw_parts_mut(m as *mut f32, k),
                    std::slice::from_raw_parts_mut(v as *mut f32, k),
                )
            };
            chunk(g, m, v, d, &coeffs);
        }
        let d = &*d;
        matmul::pack_panel(|c| &d[c * k..(c + 1) * k], live, k, panel, wide);
    });
    packed
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

impl Coeffs {
    fn new(s: &AdamWStep) -> Self {
        Coeffs {
            clip: s.clip as f32,
            one_minus_b1: (1.0 - s.beta1) as f32,
            b2: s.beta2 as f32,
            one_minus_b2: (1.0 - s.beta2) as f32,
            bc2_sqrt: s.bias_correction2.sqrt() as f32,
            eps: s.eps as f32,
            neg_step: (-s.lr / s.bias_correction1) as f32,
        }
    }
}

crate::multiversion! {
    /// One chunk of the AdamW step, compiled for the widest instruction set (Rust does not
    /// contract `a·b + c` into an FMA, so every variant gives the same bits).
    fn chunk(g: &[f32], m: &mut [f32], v: &mut [f32], d: &mut [f32], k: &Coeffs) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused step against its definition: per-part [`adamw_delta`], concatenated, then
    /// [`matmul::pack`]; the moments advance alike. Parts of 70 and 30 rows straddle a
    /// panel boundary, `k = 37` leaves scalar edges in the transpose; clipped and not.
    #[test]
    fn the_fused_step_is_adamw_then_pack() {
        let k = 37;
        let rows = [70usize, 30];
        let vals = |seed: usize, n: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * 7919 + seed * 104729) % 2003) as f32 / 1000.0 - 1.0).collect()
        };
        for clip in [1.0, 0.25] {
            let s = AdamWStep {
                lr: 1e-3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                bias_correction1: 0.19,
                bias_correction2: 0.00299,
                clip,
            };
            let g: Vec<Vec<f32>> = rows.iter().enumerate().map(|(i, &r)| vals(i, r * k)).collect();
            let m0: Vec<Vec<f32>> = rows.iter().enumerate().map(|(i, &r)| vals(i + 5, r * k)).collect();
            let v0: Vec<Vec<f32>> = m0.iter().map(|m| m.iter().map(|x| x * x).collect()).collect();
            let (mut m_want, mut v_want, mut d_want) = (m0.clone(), v0.clone(), vec![]);
            for i in 0..rows.len() {
                let mut d = vec![0.0; g[i].len()];
                adamw_delta(&g[i], &mut m_want[i], &mut v_want[i], &mut d, &s);
                d_want.extend(d);
            }
            let (mut m, mut v) = (m0.clone(), v0.clone());
            let mut parts: Vec<Part> = g
                .iter()
                .zip(m.iter_mut())
                .zip(v.iter_mut())
                .map(|((g, m), v)| (&g[..], &mut m[..], &mut v[..]))
                .collect();
            let packed = adamw_delta_packed(&mut parts, k, &s);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&packed), bits(&matmul::pack(&d_want, 100, k)), "packed step, clip {clip}");
            assert_eq!((m, v), (m_want, v_want), "moments, clip {clip}");
        }
    }
}
