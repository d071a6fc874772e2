//! AVX-512 variants of the two hot loops of [`super::attention_rows`] (scores of key strips,
//! weighted row sums), with the accumulators held in zmm registers. They perform the
//! portable versions' FMAs in the same order, so the results are bitwise equal (tested there).

use super::attention_rows::{AHEAD, KB, STRIP};
use super::simd::prefetch;
use std::arch::x86_64::*;

/// `s[r][16·i + l] = scale · Σ_e q[r][e] · strips[i][e·stride + l]` (one FMA chain over `e`
/// from zero): [`super::attention_rows::scores_rows`], up to four strips of 16 keys at a time.
///
/// # Safety
/// AVX-512F available; every strip holds `(d − 1)·stride + 16` values, each `q[r]` `d`,
/// each `s[r]` `16·strips.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn scores_rows<const R: usize>(
    q: [&[f32]; R],
    strips: &[&[f32]],
    stride: usize,
    d: usize,
    scale: f32,
    s: [&mut [f32]; R],
) {
    debug_assert!(q.iter().all(|q| q.len() >= d) && s.iter().all(|s| s.len() >= STRIP * strips.len()));
    let mut s = s;
    for (c, group) in strips.chunks(4).enumerate() {
        let next = &strips[(4 * c + 4).min(strips.len())..(4 * c + 8).min(strips.len())];
        // SAFETY: forwarded.
        unsafe {
            match group.len() {
                4 => strips_group::<R, 4>(&q, group, next, stride, d, scale, &mut s, 4 * c),
                3 => strips_group::<R, 3>(&q, group, next, stride, d, scale, &mut s, 4 * c),
                2 => strips_group::<R, 2>(&q, group, next, stride, d, scale, &mut s, 4 * c),
                _ => strips_group::<R, 1>(&q, group, next, stride, d, scale, &mut s, 4 * c),
            }
        }
    }
}

/// `G` strips of [`scores_rows`], the first being strip `first` (`G·R` zmm accumulators),
/// prefetching the strips of `next` (the next group).
///
/// # Safety
/// As [`scores_rows`], with `group.len() == G`.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn strips_group<const R: usize, const G: usize>(
    q: &[&[f32]; R],
    group: &[&[f32]],
    next: &[&[f32]],
    stride: usize,
    d: usize,
    scale: f32,
    s: &mut [&mut [f32]; R],
    first: usize,
) {
    // SAFETY: every load is inside a strip ((d − 1)·stride + 16) or q[r][..d]; every store
    // inside s[r] (strips first..first + G of its 16·strips.len() values).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        for e in 0..d {
            // The next group's lines, one per strip and step (a hint: the cache's blocks are
            // scattered, so the hardware prefetchers stop at each one's end).
            for strip in next {
                _mm_prefetch::<_MM_HINT_T0>(strip.as_ptr().add(e * stride).cast());
            }
            let k: [__m512; G] = std::array::from_fn(|v| _mm512_loadu_ps(group[v].as_ptr().add(e * stride)));
            for r in 0..R {
                let qe = _mm512_set1_ps(*q[r].as_ptr().add(e));
                for v in 0..G {
                    acc[r][v] = _mm512_fmadd_ps(qe, k[v], acc[r][v]);
                }
            }
        }
        let sc = _mm512_set1_ps(scale);
        for r in 0..R {
            let out = s[r].as_mut_ptr().add(first * STRIP);
            for v in 0..G {
                _mm512_storeu_ps(out.add(STRIP * v), _mm512_mul_ps(acc[r][v], sc));
            }
        }
    }
}

/// `out[r][i] = fma(w[r][j], row(j)[e0 + i], out[r][i])` over `j` in order, for the 64 values
/// of each `out[r]` (`R` rows sharing the `row(j)` loads): one chunk of
/// [`super::attention_rows::weighted_sums`].
///
/// # Safety
/// AVX-512F available; every `w[r]` has the same length `n` and every `row(j)`, `j < n`,
/// holds `e0 + KB` values.
#[target_feature(enable = "avx512f")]
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
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        for r in 0..R {
            let o = out[r].as_ptr();
            for v in 0..4 {
                acc[r][v] = _mm512_loadu_ps(o.add(16 * v));
            }
        }
        for j in 0..n {
            if j + AHEAD < n {
                prefetch::<true>(&row(j + AHEAD)[e0..e0 + KB]);
            }
            let x = row(j)[e0..e0 + KB].as_ptr();
            let xs = [
                _mm512_loadu_ps(x),
                _mm512_loadu_ps(x.add(16)),
                _mm512_loadu_ps(x.add(32)),
                _mm512_loadu_ps(x.add(48)),
            ];
            for r in 0..R {
                let wv = _mm512_set1_ps(*w[r].as_ptr().add(j));
                for v in 0..4 {
                    acc[r][v] = _mm512_fmadd_ps(wv, xs[v], acc[r][v]);
                }
            }
        }
        for r in 0..R {
            let o = out[r].as_mut_ptr();
            for v in 0..4 {
                _mm512_storeu_ps(o.add(16 * v), acc[r][v]);
            }
        }
    }
}
