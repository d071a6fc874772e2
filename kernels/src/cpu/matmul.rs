//! `y [m, n] = x [m, k] · w [n, k]ᵀ` over weights packed in column panels, batch-invariant.
//!
//! Weights are packed once (at model load) into panels of `NP = 64` output columns:
//! `packed[(p·k + l)·NP + c] = w[p·NP + c, l]` (zero-padded past `n`), so every kernel reads
//! them as contiguous vectors.
//!
//! Reduction order (the contract): every output element is one sequential FMA chain,
//! `acc = 0; for l in 0..k { acc = fma(x[i, l], w[j, l], acc) }`. Vector lanes hold
//! *different* outputs, never partial sums of one output, so the result of `y[i, j]` does
//! not depend on `m`, the tile it falls in, or the thread computing it: a token's logits
//! are bitwise equal whether it is decoded alone, prefilled in a chunk, or batched with 63
//! other sequences (what batch invariance and the learner's ℓ = μ check, DESIGN-NOTES §3,
//! rest on; the approach of Thinking Machines' "Defeating Nondeterminism in LLM Inference", 2025).
//!
//! Kernels: a 6×16 register tile (12 accumulators, the BLIS shape for 16 AVX2 registers)
//! for many rows, and a 1×64 tile (8 independent chains, one contiguous stream) for decode.

use rayon::prelude::*;

/// Output columns per packed panel.
pub const NP: usize = 64;
/// Rows of `x` per register tile.
const MR: usize = 6;

/// Packs `w [n, k]` (row-major) into column panels; length `n.div_ceil(NP) · k · NP`.
pub fn pack(w: &[f32], n: usize, k: usize) -> Vec<f32> {
    assert_eq!(w.len(), n * k);
    let mut out = vec![0.0f32; n.div_ceil(NP) * k * NP];
    out.par_chunks_mut(k * NP).enumerate().for_each(|(p, panel)| {
        for c in 0..NP.min(n - p * NP) {
            let row = &w[(p * NP + c) * k..(p * NP + c + 1) * k];
            for (l, &v) in row.iter().enumerate() {
                panel[l * NP + c] = v;
            }
        }
    });
    out
}

/// `a [r, c]` → `aᵀ [c, r]` (row-major), in cache-sized tiles.
pub fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
    const B: usize = 32;
    let mut t = vec![0.0f32; r * c];
    t.par_chunks_mut(B * r).enumerate().for_each(|(cb, out)| {
        let c0 = cb * B;
        let cols = B.min(c - c0);
        for r0 in (0..r).step_by(B) {
            for i in r0..(r0 + B).min(r) {
                for j in 0..cols {
                    out[j * r + i] = a[i * c + c0 + j];
                }
            }
        }
    });
    t
}

/// Inverse of [`pack`]: `w [n, k]` row-major.
pub fn unpack(packed: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut w = vec![0.0f32; n * k];
    w.par_chunks_mut(k).enumerate().for_each(|(j, row)| {
        let (p, c) = (j / NP, j % NP);
        for (l, v) in row.iter_mut().enumerate() {
            *v = packed[(p * k + l) * NP + c];
        }
    });
    w
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint column ranges of one output buffer to rayon tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `y = x · wᵀ` with `x [m, k]`, `packed` from [`pack`] of `w [n, k]`, `y [m, n]`.
pub fn matmul_packed(x: &[f32], packed: &[f32], y: &mut [f32], m: usize, n: usize, k: usize) {
    let panels = n.div_ceil(NP);
    assert!(x.len() == m * k && packed.len() == panels * k * NP && y.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    let yp = SendPtr(y.as_mut_ptr());
    // One task per panel (64 output columns of every row); a panel stays in L2 while the
    // row tiles sweep over it.
    (0..panels).into_par_iter().for_each(|p| {
        let y = yp;
        let w = &packed[p * k * NP..(p + 1) * k * NP];
        let cols = NP.min(n - p * NP);
        let mut buf = [0.0f32; MR * NP];
        let mut i = 0;
        while i < m {
            let mr = if m == 1 { 1 } else { (m - i).min(MR) };
            kernel(&x[i * k..(i + mr) * k], w, k, mr, &mut buf);
            for r in 0..mr {
                // SAFETY: row i + r < m and columns p·NP .. p·NP + cols < n of y; tasks own
                // disjoint column ranges.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(r * NP), y.0.add((i + r) * n + p * NP), cols) };
            }
            i += mr;
        }
    });
}

/// `out[r·NP + c] = Σ_l x[r, l]·panel[l, c]` for `r < mr`, all `NP` columns of one panel.
fn kernel(x: &[f32], w: &[f32], k: usize, mr: usize, out: &mut [f32; MR * NP]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA are available; x has mr rows of k, w is a k × NP panel.
        unsafe {
            if mr == 1 {
                avx2::row_panel(x.as_ptr(), w.as_ptr(), k, out.as_mut_ptr());
            } else {
                for s in 0..NP / 16 {
                    let (xp, wp, op) = (x.as_ptr(), w.as_ptr().add(16 * s), out.as_mut_ptr().add(16 * s));
                    match mr {
                        6 => avx2::tile::<6>(xp, wp, k, op),
                        5 => avx2::tile::<5>(xp, wp, k, op),
                        4 => avx2::tile::<4>(xp, wp, k, op),
                        3 => avx2::tile::<3>(xp, wp, k, op),
                        _ => avx2::tile::<2>(xp, wp, k, op),
                    }
                }
            }
        }
        return;
    }
    for r in 0..mr {
        for c in 0..NP {
            let mut acc = 0.0f32;
            for l in 0..k {
                acc = x[r * k + l].mul_add(w[l * NP + c], acc);
            }
            out[r * NP + c] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::NP;
    use std::arch::x86_64::*;

    /// `R` rows × 16 columns (at `w`, row stride `NP`); results to `out` with row stride `NP`.
    ///
    /// # Safety
    /// AVX2+FMA available; `x` has `R` rows of `k`; `w` and `out` as described.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const R: usize>(x: *const f32, w: *const f32, k: usize, out: *mut f32) {
        // SAFETY: reads x[r·k + l] and w[l·NP .. l·NP + 16] for l < k; writes R rows of 16.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for l in 0..k {
                let w0 = _mm256_loadu_ps(w.add(l * NP));
                let w1 = _mm256_loadu_ps(w.add(l * NP + 8));
                for r in 0..R {
                    let xv = _mm256_broadcast_ss(&*x.add(r * k + l));
                    acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
                }
            }
            for r in 0..R {
                _mm256_storeu_ps(out.add(r * NP), acc[r][0]);
                _mm256_storeu_ps(out.add(r * NP + 8), acc[r][1]);
            }
        }
    }

    /// One row × the 64 columns of a panel: 8 independent chains over one contiguous stream.
    ///
    /// # Safety
    /// AVX2+FMA available; `x` has `k` values; `w` is a `k × NP` panel; `out` holds `NP`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row_panel(x: *const f32, w: *const f32, k: usize, out: *mut f32) {
        // SAFETY: reads x[l] and w[l·NP .. (l+1)·NP] for l < k; writes NP floats.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); NP / 8];
            for l in 0..k {
                let xv = _mm256_broadcast_ss(&*x.add(l));
                for (v, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w.add(l * NP + 8 * v)), *a);
                }
            }
            for (v, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(8 * v), *a);
            }
        }
    }
}
