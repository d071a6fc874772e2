//! AVX2+FMA variants of the two hot loops of [`super::attention_rows`] (scores of key strips,
//! weighted row sums). With 16 ymm registers keys (or 64 output elements) are swept in
//! strips of 16, each strip's accumulators held in registers for all `R` rows;
//! every output is still the portable version's one FMA chain in the same order, so the
//! results are bitwise equal (tested there).

use super::attention_rows::{AHEAD, KB, STRIP};
use super::simd::prefetch;
use std::arch::x86_64::*;

/// `s[r][16·i + l] = scale · Σ_e q[r][e] · strips[i][e·stride + l]` (one FMA chain over `e`
/// from zero): [`super::attention_rows::scores_rows`], one strip of 16 keys at a time.
///
/// # Safety
/// AVX2 and FMA available; every strip holds `(d − 1)·stride + 16` values, each `q[r]` `d`,
/// each `s[r]` `16·strips.len()`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scores_rows<const R: usize>(
    q: [&[f32]; R],
    strips: &[&[f32]],
    stride: usize,
    d: usize,
    scale: f32,
    s: [&mut [f32]; R],
) {
    debug_assert!(q.iter().all(|q| q.len() >= d) && s.iter().all(|s| s.len() >= STRIP * strips.len()));
    // SAFETY: every load is inside a strip ((d − 1)·stride + 16) or q[r][..d]; every store
    // inside s[r].
    unsafe {
        let sc = _mm256_set1_ps(scale);
        for (i, strip) in strips.iter().enumerate() {
            let p = strip.as_ptr();
            // The next strip's lines, one per step (a hint: the cache's blocks are scattered,
            // so the hardware prefetchers stop at each one's end).
            let next = strips.get(i + 1).unwrap_or(strip).as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for e in 0..d {
                _mm_prefetch::<_MM_HINT_T0>(next.add(e * stride).cast());
                let col = p.add(e * stride);
                let k = [_mm256_loadu_ps(col), _mm256_loadu_ps(col.add(8))];
                for r in 0..R {
                    let qe = _mm256_broadcast_ss(&*q[r].as_ptr().add(e));
                    for v in 0..2 {
                        acc[r][v] = _mm256_fmadd_ps(qe, k[v], acc[r][v]);
                    }
                }
            }
            for r in 0..R {
                let out = s[r].as_ptr().add(i * STRIP) as *mut f32;
                for v in 0..2 {
                    _mm256_storeu_ps(out.add(8 * v), _mm256_mul_ps(acc[r][v], sc));
                }
            }
        }
    }
}

/// `out[r][i] = fma(w[r][j], row(j)[e0 + i], out[r][i])` over `j` in order, for the 64 values
/// of each `out[r]` (`R` rows sharing the `row(j)` loads): one chunk of
/// [`super::attention_rows::weighted_sums`].
///
/// # Safety
/// AVX2 and FMA available; every `w[r]` has the same length `n` and every `row(j)`, `j < n`,
/// holds `e0 + KB` values.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn weighted_sum64<'a, const R: usize>(
    w: [&[f32]; R],
    row: &impl Fn(usize) -> &'a [f32],
    e0: usize,
    out: &mut [&mut [f32; KB]; R],
) {
    let n = w[0].len();
    debug_assert!(w.iter().all(|w| w.len() == n));
    // SAFETY: loads of row(j)[e0 .. e0 + KB] (checked length), w[r][j] (j < n) and out; stores
    // to out.
    unsafe {
        for h in (0..KB).step_by(STRIP) {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for r in 0..R {
                let o = out[r].as_ptr().add(h);
                for v in 0..2 {
                    acc[r][v] = _mm256_loadu_ps(o.add(8 * v));
                }
            }
            for j in 0..n {
                if h == 0 && j + AHEAD < n {
                    prefetch::<true>(&row(j + AHEAD)[e0..e0 + KB]);
                }
                let x = row(j)[e0 + h..e0 + h + STRIP].as_ptr();
                let xs = [_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8))];
                for r in 0..R {
                    let wv = _mm256_broadcast_ss(&*w[r].as_ptr().add(j));
                    for v in 0..2 {
                        acc[r][v] = _mm256_fmadd_ps(wv, xs[v], acc[r][v]);
                    }
                }
            }
            for r in 0..R {
                let o = out[r].as_mut_ptr().add(h);
                for v in 0..2 {
                    _mm256_storeu_ps(o.add(8 * v), acc[r][v]);
                }
            }
        }
    }
}
