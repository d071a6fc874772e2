//! The GEMM register tile: the one computation every CPU GEMM is made of, with its
//! instruction-set variants (AVX-512, AVX2+FMA, portable) chosen at run time.
//!
//! A [`Tile`] computes `c[r·ldc + j] = Σ_{l<k} a[r·a_rs + l] · b[l·ldb + j]` for
//! `r < rows ≤ MR`, `j < cols ≤ NP`: `a` has contiguous rows (the forward's `x`, the weight
//! gradient's transposed `dy`, `dx`'s `dy`), `b` rows `ldb` apart (packed panels, strips of
//! `x`, the row-major weight).
//!
//! Reduction order (the contract of [`super::matmul`]): every output is one sequential FMA
//! chain from zero, `acc = 0; for l in 0..k { acc = fma(a[r, l], b[l, j], acc) }`; vector
//! lanes hold different outputs, never partial sums. The variants therefore give bitwise
//! identical results (IEEE 754 fused multiply-add is correctly rounded on every path,
//! `f32::mul_add` included), which `tests` below asserts.

/// Rows of `a` per tile (the AVX-512 tile is 6 rows × 4 vectors of 16: 24 of the 32 zmm
/// registers accumulate, 4 hold the `b` row; BLIS's shape for 32 registers).
pub const MR: usize = 6;
/// Columns of `b` per tile (= the packed weight panel width, [`super::matmul::NP`]).
pub const NR: usize = 64;

/// One tile job; the pointers and strides describe `rows × k` of `a`, `k × cols` of `b`
/// and `rows × cols` of `c` (see the module doc).
#[derive(Clone, Copy, Debug)]
pub struct Tile {
    pub a: *const f32,
    pub a_rs: usize,
    pub b: *const f32,
    pub ldb: usize,
    pub k: usize,
    pub c: *mut f32,
    pub ldc: usize,
    pub rows: usize,
    pub cols: usize,
    /// Continue the chains from the values in `c` instead of from zero (the next block of
    /// the reduction: bitwise the same chain as one pass).
    pub accumulate: bool,
    /// This tile is the first to read its `b` rows (they come from memory, not from L2): the
    /// AVX-512 and AVX2 variants then prefetch `b` [`PREFETCH_ROWS`] rows ahead. A hint only
    /// (the portable variant ignores it; results are the same bits either way).
    pub prefetch: bool,
    /// `next_lines` 64-byte lines from `next`: a share of the `b` block its task multiplies
    /// next, which the AVX-512 and AVX2 variants prefetch into L2 one line per four reduction
    /// steps, so that block's first tile finds it in cache instead of waiting on memory. A
    /// hint only (same bits either way); `0` lines for none.
    pub next: *const f32,
    pub next_lines: usize,
}

impl Tile {
    /// Part `i` of `parts` equal shares (the last one shorter, later ones empty) of the lines
    /// `next` ([`Tile::next`], [`Tile::next_lines`]): what each of the tiles (or strips) that
    /// share a prefetch asks for.
    pub fn next_share((next, lines): (*const f32, usize), i: usize, parts: usize) -> (*const f32, usize) {
        let share = lines.div_ceil(parts.max(1));
        let done = i * share;
        (next.wrapping_add(16 * done), lines.saturating_sub(done).min(share))
    }
}

/// How far ahead (in rows of `b`) a [`Tile::prefetch`] tile prefetches: 32 rows of a packed
/// panel are 8 KiB. A decode batch of 8 (two tiles per panel, `b` streamed from memory once)
/// took 40–51 ms per pass over the default model's decoder weights without it and 33–40 ms
/// with it, its LM head 8.8–9.4 → 6.4–7.2 ms (min of 5, 3 alternations, 2 threads). The
/// driver asks only for the first tile of the first row block over each block of `b`: the
/// other tiles find `b` in L2 or L3 (their `b` loads gained nothing from it at m = 2048).
/// The hint is `prefetcht2` (to L2, not L1): a single-sequence decode step's projections
/// took 19.5–20.1 ms with it against 20.7–21.4 ms with `prefetcht0` (Xeon VM, 2 threads;
/// 24 and 64 rows ahead were no better).
pub const PREFETCH_ROWS: usize = 32;

/// An instruction-set variant of the tile kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// 16-lane zmm vectors (needs AVX-512F).
    Avx512,
    /// 8-lane ymm vectors (needs AVX2 and FMA).
    Avx2,
    /// `f32::mul_add` loops.
    Portable,
}

impl Isa {
    /// The widest variant this CPU runs (`is_x86_feature_detected!` caches its answer).
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU runs the variant.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            Isa::Avx2 => Isa::detect() != Isa::Portable,
            Isa::Avx512 => Isa::detect() == Isa::Avx512,
        }
    }
}

/// Runs `t` with the variant `isa`.
///
/// # Safety
/// `isa.available()`; `1 ≤ t.rows ≤ MR`, `1 ≤ t.cols ≤ NR`; every `a`, `b` element named
/// by the module doc's formula is readable and every `c` element writable.
pub unsafe fn run(isa: Isa, t: &Tile) {
    debug_assert!((1..=MR).contains(&t.rows) && (1..=NR).contains(&t.cols));
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::gemm_avx512::tile(t),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::gemm_avx2::tile(t),
            _ => portable(t),
        }
    }
}

/// `t` of any size on the calling thread: its `MR × NR` tiles, column panels outermost (each
/// panel's `b` rows reused by every row tile). Same chains, so the same bits, as one tile.
///
/// # Safety
/// `isa.available()`; every `a`, `b` element the module doc's formula names for
/// `t.rows × t.cols` outputs is readable and every `c` element writable.
pub unsafe fn serial(isa: Isa, t: &Tile) {
    for c0 in (0..t.cols).step_by(NR) {
        for r0 in (0..t.rows).step_by(MR) {
            let tile = Tile {
                a: t.a.wrapping_add(r0 * t.a_rs),
                b: t.b.wrapping_add(c0),
                c: t.c.wrapping_add(r0 * t.ldc + c0),
                rows: MR.min(t.rows - r0),
                cols: NR.min(t.cols - c0),
                ..*t
            };
            // SAFETY: a part of `t` (caller).
            unsafe { run(isa, &tile) };
        }
    }
}

/// The portable variant: the contract's loop as written.
///
/// # Safety
/// As [`run`].
unsafe fn portable(t: &Tile) {
    for r in 0..t.rows {
        for j in 0..t.cols {
            // SAFETY: the elements of the formula, readable/writable per the caller.
            unsafe {
                let mut acc = if t.accumulate { *t.c.add(r * t.ldc + j) } else { 0.0 };
                for l in 0..t.k {
                    acc = (*t.a.add(r * t.a_rs + l)).mul_add(*t.b.add(l * t.ldb + j), acc);
                }
                *t.c.add(r * t.ldc + j) = acc;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1) (splitmix64).
    fn vals(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// Every variant this CPU runs gives the portable chain's bits, for every tile height,
    /// partial widths (masked loads and stores), odd `k`, padded strides, with and without
    /// [`Tile::prefetch`]; and the portable chain
    /// itself matches an f64 sum to f32 accuracy (an independent check of the formula).
    #[test]
    fn variants_are_bitwise_equal() {
        for (case, &(k, cols)) in
            [(1, 64), (7, 64), (37, 13), (64, 1), (129, 47), (301, 64), (65, 32), (9, 33)].iter().enumerate()
        {
            for rows in 1..=MR {
                let (lda, ldb, ldc) = (k + 3, cols + 5, cols + 2);
                let a = vals(MR * lda, case as u64);
                let b = vals(k * ldb, 100 + case as u64);
                let a_rs = lda;
                let tile = |c: &mut Vec<f32>| Tile {
                    a: a.as_ptr(),
                    a_rs,
                    b: b.as_ptr(),
                    ldb,
                    k,
                    c: c.as_mut_ptr(),
                    ldc,
                    rows,
                    cols,
                    accumulate: false,
                    prefetch: case % 2 == 0,
                    next: b.as_ptr(),
                    next_lines: case,
                };
                let mut want = vec![f32::NAN; MR * ldc];
                // SAFETY: a, b, c hold every element the strides name.
                unsafe { run(Isa::Portable, &tile(&mut want)) };
                for r in 0..rows {
                    for j in 0..cols {
                        let exact: f64 = (0..k).map(|l| a[r * a_rs + l] as f64 * b[l * ldb + j] as f64).sum();
                        assert!((want[r * ldc + j] as f64 - exact).abs() < 1e-5 * k as f64, "k {k} r {r} j {j}");
                    }
                }
                for isa in [Isa::Portable, Isa::Avx2, Isa::Avx512].into_iter().filter(|i| i.available()) {
                    let mut got = vec![f32::NAN; MR * ldc];
                    // SAFETY: as above; the variant is available.
                    unsafe { run(isa, &tile(&mut got)) };
                    // The chains split at l = k/2 and continued (`accumulate`) give the same bits.
                    let mut split = vec![f32::NAN; MR * ldc];
                    let first = Tile { k: k / 2, ..tile(&mut split) };
                    let a_rest = a[k / 2..].as_ptr();
                    let second =
                        Tile { a: a_rest, b: b[(k / 2) * ldb..].as_ptr(), k: k - k / 2, accumulate: true, ..first };
                    // SAFETY: as above; both halves lie inside a and b.
                    unsafe {
                        run(isa, &first);
                        run(isa, &second)
                    };
                    assert!(got.iter().zip(&split).all(|(g, s)| g.to_bits() == s.to_bits()), "{isa:?} split k {k}");
                    for r in 0..MR {
                        for j in 0..ldc {
                            let (g, w) = (got[r * ldc + j], want[r * ldc + j]);
                            // Outside the tile nothing is written (both stay NaN).
                            assert!(
                                g.to_bits() == w.to_bits(),
                                "{isa:?} k {k} cols {cols} rows {rows}: [{r},{j}] {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
