//! AVX2+FMA variant of the GEMM register tile ([`super::gemm_tile`]): `R ≤ 6` rows × 2 ymm
//! vectors of 8 (12 accumulators, the BLIS shape for 16 registers), swept over the tile's
//! 16-column strips; columns past `cols` are masked off in loads and stores.

use super::gemm_tile::{Tile, NR};
use std::arch::x86_64::*;

/// Dispatches on the tile height, one 16-column strip at a time.
///
/// # Safety
/// AVX2 and FMA available; `t` as in [`super::gemm_tile::run`].
pub unsafe fn tile(t: &Tile) {
    debug_assert!(t.cols <= NR);
    for s in 0..t.cols.div_ceil(16) {
        let strip =
            Tile { b: t.b.wrapping_add(16 * s), c: t.c.wrapping_add(16 * s), cols: (t.cols - 16 * s).min(16), ..*t };
        // SAFETY: forwarded; the strip is a part of `t`.
        unsafe {
            match (t.rows, strip.cols == 16) {
                (6, true) => kernel::<6, true>(&strip),
                (5, true) => kernel::<5, true>(&strip),
                (4, true) => kernel::<4, true>(&strip),
                (3, true) => kernel::<3, true>(&strip),
                (2, true) => kernel::<2, true>(&strip),
                (1, true) => kernel::<1, true>(&strip),
                (6, false) => kernel::<6, false>(&strip),
                (5, false) => kernel::<5, false>(&strip),
                (4, false) => kernel::<4, false>(&strip),
                (3, false) => kernel::<3, false>(&strip),
                (2, false) => kernel::<2, false>(&strip),
                _ => kernel::<1, false>(&strip),
            }
        }
    }
}

/// `R` rows × one strip of `t.cols ≤ 16` columns; `FULL`: all 16 live (no masks).
///
/// # Safety
/// As [`tile`], with `t.rows == R`.
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize, const FULL: bool>(t: &Tile) {
    // Lane masks of the two vectors (all bits set in live lanes, for maskload/maskstore).
    let lanes = |v: usize| -> __m256i {
        let live = t.cols.saturating_sub(8 * v).min(8) as i32;
        _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
    };
    let masks = [lanes(0), lanes(1)];
    // SAFETY: reads a[r·a_rs + l] (r < R, l < k) and the live columns of b[l·ldb ..],
    // reads (if accumulating) and writes the live columns of c[r·ldc ..]: all in bounds per the caller.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if t.accumulate {
            for r in 0..R {
                for v in 0..2 {
                    acc[r][v] = if FULL {
                        _mm256_loadu_ps(t.c.add(r * t.ldc + 8 * v))
                    } else {
                        _mm256_maskload_ps(t.c.wrapping_add(r * t.ldc + 8 * v), masks[v])
                    };
                }
            }
        }
        let (mut a, mut b) = (t.a, t.b);
        for _ in 0..t.k {
            let mut bv = [_mm256_setzero_ps(); 2];
            for v in 0..2 {
                bv[v] = if FULL {
                    _mm256_loadu_ps(b.add(8 * v))
                } else {
                    _mm256_maskload_ps(b.wrapping_add(8 * v), masks[v])
                };
            }
            for r in 0..R {
                let x = _mm256_broadcast_ss(&*a.add(r * t.a_rs));
                for v in 0..2 {
                    acc[r][v] = _mm256_fmadd_ps(x, bv[v], acc[r][v]);
                }
            }
            a = a.wrapping_add(1);
            b = b.wrapping_add(t.ldb);
        }
        for r in 0..R {
            for v in 0..2 {
                // (A fully masked vector's address may lie past the buffer: never dereferenced.)
                let c = t.c.wrapping_add(r * t.ldc + 8 * v);
                if FULL {
                    _mm256_storeu_ps(c, acc[r][v]);
                } else {
                    _mm256_maskstore_ps(c, masks[v], acc[r][v]);
                }
            }
        }
    }
}
