//! AVX-512 variant of the GEMM register tile ([`super::gemm_tile`]): `R ≤ 6` rows × 4
//! zmm vectors of 16 columns, 24 accumulators in registers; columns past `cols` are masked
//! off in loads and stores.

use super::gemm_tile::{Tile, NR};
use std::arch::x86_64::*;

/// Vectors of 16 per tile row.
const V: usize = NR / 16;

/// Dispatches on the tile height and on whether all `NR` columns are live.
///
/// # Safety
/// AVX-512F available; `t` as in [`super::gemm_tile::run`].
pub unsafe fn tile(t: &Tile) {
    // SAFETY: forwarded.
    unsafe {
        match (t.rows, t.cols == NR) {
            (6, true) => kernel::<6, true>(t),
            (5, true) => kernel::<5, true>(t),
            (4, true) => kernel::<4, true>(t),
            (3, true) => kernel::<3, true>(t),
            (2, true) => kernel::<2, true>(t),
            (1, true) => kernel::<1, true>(t),
            (6, false) => kernel::<6, false>(t),
            (5, false) => kernel::<5, false>(t),
            (4, false) => kernel::<4, false>(t),
            (3, false) => kernel::<3, false>(t),
            (2, false) => kernel::<2, false>(t),
            _ => kernel::<1, false>(t),
        }
    }
}

/// `R` rows; `FULL`: `t.cols == NR` (no masks).
///
/// # Safety
/// As [`tile`], with `t.rows == R`.
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const R: usize, const FULL: bool>(t: &Tile) {
    // Lane masks of the four vectors: bit i of mask v is column 16v + i < cols.
    let mask = |v: usize| -> __mmask16 {
        let live = t.cols.saturating_sub(16 * v).min(16);
        ((1u32 << live) - 1) as __mmask16
    };
    let masks = [mask(0), mask(1), mask(2), mask(3)];
    // SAFETY: reads a[r·a_rs + l·a_ls] (r < R, l < k) and the live columns of b[l·ldb ..],
    // reads (if accumulating) and writes the live columns of c[r·ldc ..]: all in bounds per the caller.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        if t.accumulate {
            for r in 0..R {
                for v in 0..V {
                    acc[r][v] = if FULL {
                        _mm512_loadu_ps(t.c.add(r * t.ldc + 16 * v))
                    } else {
                        _mm512_maskz_loadu_ps(masks[v], t.c.wrapping_add(r * t.ldc + 16 * v))
                    };
                }
            }
        }
        let (mut a, mut b) = (t.a, t.b);
        for _ in 0..t.k {
            let mut bv = [_mm512_setzero_ps(); V];
            for v in 0..V {
                bv[v] = if FULL {
                    _mm512_loadu_ps(b.add(16 * v))
                } else {
                    _mm512_maskz_loadu_ps(masks[v], b.wrapping_add(16 * v))
                };
            }
            for r in 0..R {
                let x = _mm512_set1_ps(*a.add(r * t.a_rs));
                for v in 0..V {
                    acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
                }
            }
            a = a.wrapping_add(t.a_ls);
            b = b.wrapping_add(t.ldb);
        }
        for r in 0..R {
            for v in 0..V {
                // (A fully masked vector's address may lie past the buffer: never dereferenced.)
                let c = t.c.wrapping_add(r * t.ldc + 16 * v);
                if FULL {
                    _mm512_storeu_ps(c, acc[r][v]);
                } else {
                    _mm512_mask_storeu_ps(c, masks[v], acc[r][v]);
                }
            }
        }
    }
}
