//! AVX2+FMA variant of the GEMM register tile ([`super::gemm_tile`]): `R ≤ 6` rows × 2 ymm
//! vectors of 8 (12 accumulators, the BLIS shape for 16 registers), swept over the tile's
//! 16-column strips; columns past `cols` are masked off in loads and stores. A
//! [`Tile::prefetch`] tile's first strip prefetches the whole tile's `b` rows ahead of its
//! loads, so the other strips find them in L2; the strips share the tile's
//! [`Tile::next_lines`], one line per four steps. One to three rows of a full or half panel
//! (decode steps) instead run in passes of 32 or 64 columns ([`rows`]): each `b` line is read
//! once. (Copying a block's strips contiguous, so that a strip's rows are consecutive lines,
//! made the learner's GEMMs 10–25 % slower on Zen 4: `b`'s 256-byte stride is not what limits
//! this kernel.)

use super::gemm_tile::{Tile, NR, PREFETCH_ROWS};
use std::arch::x86_64::*;

/// Runs the tile one 16-column strip at a time (the first strip of a [`Tile::prefetch`] tile
/// prefetching all of the tile's columns), or, for one to three rows of a full or half panel,
/// in passes of all their columns ([`rows`]).
///
/// # Safety
/// AVX2 and FMA available; `t` as in [`super::gemm_tile::run`].
pub unsafe fn tile(t: &Tile) {
    debug_assert!(t.cols <= NR);
    if t.rows <= 3 && (t.cols == NR || t.cols == NR / 2) {
        // One row: all its columns in one pass; two or three: 32 columns per pass.
        let pass = if t.rows == 1 { t.cols } else { NR / 2 };
        for h in 0..t.cols / pass {
            let half = Tile { b: t.b.wrapping_add(pass * h), c: t.c.wrapping_add(pass * h), cols: pass, ..*t };
            // SAFETY: forwarded; the pass is a part of `t`.
            unsafe {
                match (t.rows, pass == NR, t.prefetch) {
                    (1, true, true) => rows::<1, 8, true>(&half),
                    (1, true, false) => rows::<1, 8, false>(&half),
                    (1, false, true) => rows::<1, 4, true>(&half),
                    (1, false, false) => rows::<1, 4, false>(&half),
                    (2, _, true) => rows::<2, 4, true>(&half),
                    (2, _, false) => rows::<2, 4, false>(&half),
                    (_, _, true) => rows::<3, 4, true>(&half),
                    (_, _, false) => rows::<3, 4, false>(&half),
                }
            }
        }
        return;
    }
    let strips = t.cols.div_ceil(16);
    for s in 0..strips {
        // The strips share the lines to prefetch.
        let (next, next_lines) = Tile::next_share((t.next, t.next_lines), s, strips);
        let strip = Tile {
            b: t.b.wrapping_add(16 * s),
            c: t.c.wrapping_add(16 * s),
            cols: (t.cols - 16 * s).min(16),
            next,
            next_lines,
            ..*t
        };
        // SAFETY: forwarded; the strip is a part of `t`.
        unsafe {
            match t.prefetch && s == 0 {
                true => by_shape::<true>(&strip, t.cols.div_ceil(16)),
                false => by_shape::<false>(&strip, 0),
            }
        }
    }
}

/// Dispatches a strip on its height and on whether all 16 columns are live.
///
/// # Safety
/// As [`tile`], for a strip of at most 16 columns.
unsafe fn by_shape<const PREFETCH: bool>(strip: &Tile, lines: usize) {
    // SAFETY: forwarded.
    unsafe {
        match (strip.rows, strip.cols == 16) {
            (6, true) => kernel::<6, true, PREFETCH>(strip, lines),
            (5, true) => kernel::<5, true, PREFETCH>(strip, lines),
            (4, true) => kernel::<4, true, PREFETCH>(strip, lines),
            (3, true) => kernel::<3, true, PREFETCH>(strip, lines),
            (2, true) => kernel::<2, true, PREFETCH>(strip, lines),
            (1, true) => kernel::<1, true, PREFETCH>(strip, lines),
            (6, false) => kernel::<6, false, PREFETCH>(strip, lines),
            (5, false) => kernel::<5, false, PREFETCH>(strip, lines),
            (4, false) => kernel::<4, false, PREFETCH>(strip, lines),
            (3, false) => kernel::<3, false, PREFETCH>(strip, lines),
            (2, false) => kernel::<2, false, PREFETCH>(strip, lines),
            _ => kernel::<1, false, PREFETCH>(strip, lines),
        }
    }
}

/// `R` rows × one strip of `t.cols ≤ 16` columns; `FULL`: all 16 live (no masks).
/// `PREFETCH`: also prefetch `lines` 64-byte lines (16 columns each) of the `b` row
/// [`PREFETCH_ROWS`] ahead, per step.
///
/// # Safety
/// As [`tile`], with `t.rows == R`.
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize, const FULL: bool, const PREFETCH: bool>(t: &Tile, lines: usize) {
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
        // One reduction step: the b row's vectors, then each row's broadcast times them.
        macro_rules! step {
            () => {{
                if PREFETCH {
                    // A hint: prefetches never fault, also past the end of `b`. Only the tile's
                    // columns: another thread may be streaming the rest of the row.
                    for v in 0..lines {
                        _mm_prefetch::<_MM_HINT_T2>(b.wrapping_add(PREFETCH_ROWS * t.ldb + 16 * v).cast());
                    }
                }
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
            }};
        }
        // Four steps per iteration: the loop's own work (row addresses, counter, branch) is
        // paid once per four. The weight gradient and the streamed input gradient at m = 158
        // (64-step reduction blocks) went from 94–137 and 63–94 to 113–152 and 81–120 GFLOP/s
        // (3 alternations, same binary; Zen 4, 2 threads); m = 2048 unchanged within noise.
        let (mut next, mut next_left) = (t.next, t.next_lines);
        for _ in 0..t.k / 4 {
            if next_left > 0 {
                // A hint (never faults).
                _mm_prefetch::<_MM_HINT_T2>(next.cast());
                next = next.wrapping_add(16);
                next_left -= 1;
            }
            step!();
            step!();
            step!();
            step!();
        }
        for _ in 0..t.k % 4 {
            step!();
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

/// `R ≤ 3` rows × `8·V` columns (`R·V ≤ 12` accumulators) in one pass over `k`: a decode
/// step's tiles. Each step reads the tile's `b` row once; swept in 16-column strips, the row's
/// lines were streamed from memory in two or four passes (single-sequence decode, 2
/// alternations of tg128: 25.0, 26.9 → 28.0, 31.6 tokens/s for the full rows alone; Zen 3, 2
/// threads), and a strip of `R < 4` rows has too few independent FMA chains to hide their
/// latency (the LM head at m = 2 took 4.4 ms against 2.5 ms at m = 1).
///
/// # Safety
/// As [`tile`], with `t.rows == R` and `t.cols == 8·V`.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows<const R: usize, const V: usize, const PREFETCH: bool>(t: &Tile) {
    // SAFETY: reads a[r·a_rs + l] (r < R, l < k), b[l·ldb .. + 8V] and (if accumulating)
    // c[r·ldc .. + 8V], writes c[r·ldc .. + 8V]: in bounds per the caller.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); V]; R];
        if t.accumulate {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (v, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm256_loadu_ps(t.c.add(r * t.ldc + 8 * v));
                }
            }
        }
        let (mut a, mut b) = (t.a, t.b);
        for _ in 0..t.k {
            if PREFETCH {
                // A hint (never faults, also past the end of `b`).
                for line in 0..V / 2 {
                    _mm_prefetch::<_MM_HINT_T2>(b.wrapping_add(PREFETCH_ROWS * t.ldb + 16 * line).cast());
                }
            }
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, bv) in bv.iter_mut().enumerate() {
                *bv = _mm256_loadu_ps(b.add(8 * v));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*a.add(r * t.a_rs));
                for (acc, bv) in acc.iter_mut().zip(&bv) {
                    *acc = _mm256_fmadd_ps(x, *bv, *acc);
                }
            }
            a = a.wrapping_add(1);
            b = b.wrapping_add(t.ldb);
        }
        for (r, acc) in acc.iter().enumerate() {
            for (v, acc) in acc.iter().enumerate() {
                _mm256_storeu_ps(t.c.add(r * t.ldc + 8 * v), *acc);
            }
        }
    }
}
