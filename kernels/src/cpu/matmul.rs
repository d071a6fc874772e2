//! `y [m, n] = x [m, k] · w [n, k]ᵀ`, batch-invariant.
//!
//! Every output element is reduced in one fixed order that depends only on `k`, never on
//! `m`, `n`, the tile it falls in or the thread that computes it (the contract below). So a
//! token's logits are bitwise identical whether it is decoded alone (`m = 1`), prefilled
//! in a chunk, or batched with 63 other sequences — what the engine's batch-invariance
//! guarantee and the learner's ℓ = μ check (DESIGN-NOTES §3) rest on. The approach follows
//! Thinking Machines' "Defeating Nondeterminism in LLM Inference" (2025): fix the reduction
//! strategy per element instead of per batch shape.
//!
//! Reduction order of `y[i, j] = Σ_l x[i, l]·w[j, l]` (the contract):
//! 1. four 8-lane accumulators `a0..a3`; for each 32-element step `t` and `s < 4`:
//!    `a_s = fma(x[32t+8s..32t+8s+8], w[..], a_s)`;
//! 2. each remaining full 8-element step: `a0 = fma(x[..8], w[..8], a0)`;
//! 3. `s = (a0 + a1) + (a2 + a3)`; `h[i] = s[i] + s[i+4]`; `g[i] = h[i] + h[i+2]`; `r = g[0] + g[1]`;
//! 4. the last `k mod 8` elements: `r = fma(x[l], w[l], r)` in order.
//!
//! Four independent FMA chains per output keep enough loads in flight to stream the weights
//! at memory bandwidth when decoding (two chains measured 3× slower). Tiles are `MR × 1`:
//! up to 3 rows of `x` share each load of a weight row (12 accumulators).

use rayon::prelude::*;

/// Rows of `x` per tile.
const MR: usize = 3;
/// Work split over rows of `w`: about this many tasks per thread, each at least `MIN_ROWS` rows.
const TASKS_PER_THREAD: usize = 2;
const MIN_ROWS: usize = 16;

/// Computes `y = x · wᵀ` with `x [m, k]`, `w [n, k]`, `y [m, n]` (all row-major).
pub fn matmul_t(x: &[f32], w: &[f32], y: &mut [f32], m: usize, n: usize, k: usize) {
    assert!(x.len() == m * k && w.len() == n * k && y.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    let rows = n.div_ceil(rayon::current_num_threads() * TASKS_PER_THREAD).max(MIN_ROWS);
    // Each task owns the columns j0..j1 of every row of y.
    let y_ptr = SendPtr(y.as_mut_ptr());
    (0..n.div_ceil(rows)).into_par_iter().for_each(|c| {
        let (j0, j1) = (c * rows, ((c + 1) * rows).min(n));
        let y = y_ptr;
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(MR);
            for j in j0..j1 {
                // SAFETY: rows i..i+mr of x, row j of w and the (i, j) column of y are in
                // bounds; tasks write disjoint column ranges of y.
                unsafe { tile(x.as_ptr().add(i * k), w.as_ptr().add(j * k), k, y.0.add(i * n + j), n, mr) };
            }
            i += mr;
        }
    });
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint parts of one output buffer to rayon tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// One tile of `mr × 1` outputs (`mr ≤ MR`).
///
/// # Safety
/// `x` points to `mr` rows of `k`, `w` to one row of `k`, `y` to `mr` rows of stride `ldy`.
unsafe fn tile(x: *const f32, w: *const f32, k: usize, y: *mut f32, ldy: usize, mr: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA are available; pointer contract forwarded.
        unsafe {
            match mr {
                3 => avx2::tile::<3>(x, w, k, y, ldy),
                2 => avx2::tile::<2>(x, w, k, y, ldy),
                _ => avx2::tile::<1>(x, w, k, y, ldy),
            }
        }
        return;
    }
    for r in 0..mr {
        // SAFETY: in bounds by the pointer contract.
        unsafe {
            let xs = std::slice::from_raw_parts(x.add(r * k), k);
            *y.add(r * ldy) = dot_portable(xs, std::slice::from_raw_parts(w, k));
        }
    }
}

/// The contract's reduction order in portable code (used without AVX2/FMA).
pub fn dot_portable(x: &[f32], w: &[f32]) -> f32 {
    let k = x.len();
    let mut a = [[0.0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= k {
        for (s, acc) in a.iter_mut().enumerate() {
            for l in 0..8 {
                acc[l] = x[i + 8 * s + l].mul_add(w[i + 8 * s + l], acc[l]);
            }
        }
        i += 32;
    }
    while i + 8 <= k {
        for l in 0..8 {
            a[0][l] = x[i + l].mul_add(w[i + l], a[0][l]);
        }
        i += 8;
    }
    let s: [f32; 8] = std::array::from_fn(|l| (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]));
    let h: [f32; 4] = std::array::from_fn(|l| s[l] + s[l + 4]);
    let mut r = (h[0] + h[2]) + (h[1] + h[3]);
    while i < k {
        r = x[i].mul_add(w[i], r);
        i += 1;
    }
    r
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `s = (a0 + a1) + (a2 + a3)`; `h[i] = s[i] + s[i+4]`; `g[i] = h[i] + h[i+2]`; `g[0] + g[1]`.
    #[inline(always)]
    unsafe fn hsum(a: [__m256; 4]) -> f32 {
        // SAFETY: only called from AVX2 functions.
        unsafe {
            let s = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            let h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            let g = _mm_add_ps(h, _mm_movehl_ps(h, h));
            _mm_cvtss_f32(_mm_add_ss(g, _mm_shuffle_ps(g, g, 1)))
        }
    }

    /// # Safety
    /// AVX2+FMA available; see [`super::tile`] for the pointers.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile<const R: usize>(x: *const f32, w: *const f32, k: usize, y: *mut f32, ldy: usize) {
        // SAFETY: every load reads 8 floats ending at or before k within its row.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 4]; R];
            let mut i = 0;
            while i + 32 <= k {
                for s in 0..4 {
                    let wv = _mm256_loadu_ps(w.add(i + 8 * s));
                    for r in 0..R {
                        acc[r][s] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(r * k + i + 8 * s)), wv, acc[r][s]);
                    }
                }
                i += 32;
            }
            while i + 8 <= k {
                let wv = _mm256_loadu_ps(w.add(i));
                for r in 0..R {
                    acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(r * k + i)), wv, acc[r][0]);
                }
                i += 8;
            }
            for r in 0..R {
                let mut v = hsum(acc[r]);
                for l in i..k {
                    v = (*x.add(r * k + l)).mul_add(*w.add(l), v);
                }
                *y.add(r * ldy) = v;
            }
        }
    }
}
