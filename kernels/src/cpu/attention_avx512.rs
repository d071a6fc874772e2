//! AVX-512 variants of the two hot loops of [`super::attention_rows`] (scores of a key block,
//! weighted row sums), with the accumulators held in zmm registers. They perform the
//! portable versions' FMAs in the same order, so the results are bitwise equal (tested there).

use super::attention_rows::KB;
use std::arch::x86_64::*;

/// `s[r][b·KB + i] = scale · Σ_e q[r][e] · data[(b·d + e)·KB + i]` (one FMA chain over `e` from
/// zero) for the first `blocks` blocks: [`super::attention_rows::scores_rows`].
///
/// # Safety
/// AVX-512F available; `data` holds `blocks·d·KB` values, each `q[r]` `d`, each `s[r]`
/// `blocks·KB`.
#[target_feature(enable = "avx512f")]
pub unsafe fn scores_rows<const R: usize>(
    q: [&[f32]; R],
    data: &[f32],
    d: usize,
    blocks: usize,
    scale: f32,
    s: [&mut [f32]; R],
) {
    debug_assert!(data.len() >= blocks * d * KB && q.iter().all(|q| q.len() >= d));
    // SAFETY: every load is inside data (blocks·d·KB) or q[r][..d]; every store inside s[r].
    unsafe {
        let sc = _mm512_set1_ps(scale);
        for b in 0..blocks {
            let blk = data.as_ptr().add(b * d * KB);
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for e in 0..d {
                let col = blk.add(e * KB);
                let k = [
                    _mm512_loadu_ps(col),
                    _mm512_loadu_ps(col.add(16)),
                    _mm512_loadu_ps(col.add(32)),
                    _mm512_loadu_ps(col.add(48)),
                ];
                for r in 0..R {
                    let qe = _mm512_set1_ps(*q[r].as_ptr().add(e));
                    for v in 0..4 {
                        acc[r][v] = _mm512_fmadd_ps(qe, k[v], acc[r][v]);
                    }
                }
            }
            for r in 0..R {
                let out = s[r].as_ptr().add(b * KB) as *mut f32;
                for v in 0..4 {
                    _mm512_storeu_ps(out.add(16 * v), _mm512_mul_ps(acc[r][v], sc));
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
