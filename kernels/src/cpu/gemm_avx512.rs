//! AVX-512 variant of the GEMM register tile ([`super::gemm_tile`]): `R ≤ 6` rows × 4
//! zmm vectors of 16 columns, 24 accumulators in registers; columns past `cols` are masked
//! off in loads and stores. A [`Tile::prefetch`] tile prefetches `b` ahead of its loads, and
//! every tile its [`Tile::next_lines`] and the next tile's `a` rows.

use super::gemm_tile::{Tile, NR, PREFETCH_ROWS};
use std::arch::x86_64::*;

/// Dispatches on the tile height and on whether all `NR` columns are live.
///
/// # Safety
/// AVX-512F available; `t` as in [`super::gemm_tile::run`].
pub unsafe fn tile(t: &Tile) {
    // SAFETY: forwarded.
    unsafe {
        if t.prefetch {
            by_shape::<true>(t)
        } else {
            by_shape::<false>(t)
        }
    }
}

/// [`tile`] for one value of `t.prefetch`: `V` = 2 vectors when at most 32 columns are live
/// (the driver's half panels), else 4.
///
/// # Safety
/// As [`tile`].
unsafe fn by_shape<const PREFETCH: bool>(t: &Tile) {
    // SAFETY: forwarded.
    unsafe {
        match (t.rows, t.cols == NR, t.cols <= NR / 2) {
            (6, true, _) => kernel::<6, 4, true, PREFETCH>(t),
            (5, true, _) => kernel::<5, 4, true, PREFETCH>(t),
            (4, true, _) => kernel::<4, 4, true, PREFETCH>(t),
            (3, true, _) => kernel::<3, 4, true, PREFETCH>(t),
            (2, true, _) => kernel::<2, 4, true, PREFETCH>(t),
            (1, true, _) => kernel::<1, 4, true, PREFETCH>(t),
            (6, false, false) => kernel::<6, 4, false, PREFETCH>(t),
            (5, false, false) => kernel::<5, 4, false, PREFETCH>(t),
            (4, false, false) => kernel::<4, 4, false, PREFETCH>(t),
            (3, false, false) => kernel::<3, 4, false, PREFETCH>(t),
            (2, false, false) => kernel::<2, 4, false, PREFETCH>(t),
            (_, false, false) => kernel::<1, 4, false, PREFETCH>(t),
            (6, false, true) => kernel::<6, 2, false, PREFETCH>(t),
            (5, false, true) => kernel::<5, 2, false, PREFETCH>(t),
            (4, false, true) => kernel::<4, 2, false, PREFETCH>(t),
            (3, false, true) => kernel::<3, 2, false, PREFETCH>(t),
            (2, false, true) => kernel::<2, 2, false, PREFETCH>(t),
            _ => kernel::<1, 2, false, PREFETCH>(t),
        }
    }
}

/// `R` rows × `V` vectors of 16 columns; `FULL`: `t.cols == NR` (no masks, `V` = 4);
/// `PREFETCH`: `t.prefetch`.
///
/// # Safety
/// As [`tile`], with `t.rows == R` and `t.cols ≤ 16·V`.
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const R: usize, const V: usize, const FULL: bool, const PREFETCH: bool>(t: &Tile) {
    // Lane masks of the V vectors: bit i of mask v is column 16v + i < cols.
    let mask = |v: usize| -> __mmask16 {
        let live = t.cols.saturating_sub(16 * v).min(16);
        ((1u32 << live) - 1) as __mmask16
    };
    let masks: [__mmask16; V] = std::array::from_fn(mask);
    // SAFETY: reads a[r·a_rs + l] (r < R, l < k) and the live columns of b[l·ldb ..],
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
        let (mut next, mut next_left) = (t.next, t.next_lines);
        for l in 0..t.k {
            if l % 16 == 8 {
                // A hint (never faults, also past the end of `a`): the next tile's `a` rows
                // (R rows on, the same steps), one line of each per 16 steps, so that tile
                // finds them in L2 instead of waiting on L3 or memory for its six row
                // streams. One core, tiles over a 128-step block of `b` in cache with their `a`
                // rows from L3: 115–129 → 127–147 GFLOP/s; a learner step at 8 × (128 + 128)
                // tokens: 6.95–7.44 → 6.82–6.99 s (3 alternations, Xeon VM, 2 threads).
                for r in 0..R {
                    _mm_prefetch::<_MM_HINT_T1>(a.wrapping_add((R + r) * t.a_rs).cast());
                }
            }
            if next_left > 0 && l % 4 == 0 {
                // A hint (never faults): one line of the task's next block per four steps.
                _mm_prefetch::<_MM_HINT_T2>(next.cast());
                next = next.wrapping_add(16);
                next_left -= 1;
            }
            if PREFETCH {
                // A hint: prefetches never fault, also past the end of `b`. Only the live
                // columns: another thread may be streaming the rest of the row.
                for v in 0..V {
                    if FULL || masks[v] != 0 {
                        _mm_prefetch::<_MM_HINT_T2>(b.wrapping_add(PREFETCH_ROWS * t.ldb + 16 * v).cast());
                    }
                }
            }
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
            a = a.wrapping_add(1);
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
