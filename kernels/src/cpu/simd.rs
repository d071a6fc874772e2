//! What the vectorised CPU kernels share: compiling one body for the widest instruction set
//! at run time ([`multiversion!`](crate::multiversion)), an output pointer shared by rayon
//! tasks that write disjoint parts ([`SharedMut`]), and the exponentials of the softmaxes
//! ([`exp`] in f32 for attention, [`exp64`] for the f64 log-probability passes).
//!
//! Bodies compiled by `multiversion!` are plain Rust over `f32` (`mul_add`, `round_ties_even`,
//! comparisons), which Rust never reassociates or contracts; each variant therefore computes
//! the same IEEE operations in the same order, and AVX-512, AVX2 and baseline builds of a
//! body agree bitwise (the compiler only chooses the vector width).

pub use super::gemm_tile::Isa;

/// `multiversion! { fn name(args) { body } }` defines `name`, which runs `body` compiled for
/// AVX-512 (`avx512f,avx512vl,avx2,fma`), for AVX2+FMA, or for the baseline target, the
/// widest this CPU supports ([`Isa::detect`]). Keep `body`'s helpers `#[inline(always)]` so
/// they are compiled into each variant.
#[macro_export]
#[doc(hidden)]
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                match $crate::cpu::simd::Isa::detect() {
                    // SAFETY: the CPU has the variant's features (detected at run time).
                    $crate::cpu::simd::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::cpu::simd::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::simd::Isa::Portable => {}
                }
            }
            body($($arg),*)
        }
    };
}

/// A mutable `f32` buffer shared by rayon tasks that each write a disjoint set of elements.
#[derive(Clone, Copy)]
pub struct SharedMut(pub *mut f32);
// SAFETY: users hand each task a disjoint set of elements (documented at each use).
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    /// The `len` elements from `offset`.
    ///
    /// # Safety
    /// In bounds of the buffer, and written by no other task while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &mut [f32] {
        // SAFETY: per the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

/// `eˣ` to within 2 ulp for `x ≤ 88` (Cephes `expf`, S. Moshier: `x = n·ln 2 + r` with
/// `n = round(x·log₂e)` and `ln 2` split in two for an exact reduction, then a degree-5
/// minimax polynomial for `eʳ` (its last coefficient, 5.0000001201e−1, is 0.5 in f32) on `|r| ≤ ln 2 / 2`). Inputs below −87 give `e⁻⁸⁷` (≈ 1.6e−38)
/// instead of a subnormal or zero; NaN stays NaN. Vectorises (unlike `f32::exp`, a libm call).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // (`clamp` keeps NaN, unlike min/max.)
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let mut p = 1.987_569_1e-4f32;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // 2ⁿ from the bits of n + 1.5·2²³ (exact: n is an integer in [−126, 127]), whose low bits
    // are n in two's complement: integer operations that vectorise, where `n as i32`
    // (saturating) was converted lane by lane. A NaN gives some exponent, and NaN · it = NaN.
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³
    let k = (n + ROUND).to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    y * f32::from_bits(k << 23)
}

/// The constants of [`exp64`] and [`exp64x8`].
mod exp64_consts {
    pub const LOG2E: f64 = std::f64::consts::LOG2_E;
    /// fdlibm's `ln2_hi` (6.93147180369123816490e-01) and `ln2_lo` (1.90821492927058770002e-10).
    pub const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
    pub const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
    /// 1.5·2⁵²: adding it rounds to an integer held in the low mantissa bits.
    pub const ROUND: f64 = 6_755_399_441_055_744.0;
    /// 1/k! for k = 13 down to 2.
    pub const C: [f64; 12] = [
        1.0 / 6_227_020_800.0,
        1.0 / 479_001_600.0,
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
    ];
}

/// `eˣ` in f64 to within 2 ulp for `−708 ≤ x ≤ 709`, and exactly 0 below −708 (so `−∞`
/// gives 0): `x = n·ln 2 + r` with `n = round(x·log₂e)` (the 1.5·2⁵² rounding trick, whose
/// low bits are `n`), `ln 2` split in two (fdlibm's `ln2_hi`, `ln2_lo`) for an exact
/// reduction, then `eʳ` on `|r| ≤ ln 2 / 2` by its Taylor series to degree 13 (remainder
/// `r¹⁴/14! < 5·10⁻¹⁸`) in FMA Horner form, scaled by `2ⁿ` built in the exponent bits.
/// NaN stays NaN. Vectorises (unlike `f64::exp`, a libm call); only FMA, IEEE arithmetic
/// and integer bit operations, so every variant of a [`multiversion!`] body agrees bitwise.
#[inline(always)]
pub fn exp64(x: f64) -> f64 {
    use exp64_consts::*;
    // (`clamp` keeps NaN, unlike min/max.)
    let xc = x.clamp(-708.0, 709.0);
    let big = xc * LOG2E + ROUND;
    let n = big - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p = C[0];
    for c in &C[1..] {
        p = p.mul_add(r, *c);
    }
    let e_r = p.mul_add(r, 1.0).mul_add(r, 1.0);
    // `big`'s low bits hold n (two's complement): 2ⁿ has exponent field n + 1023.
    let k = big.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(1023);
    let y = e_r * f64::from_bits(k << 52);
    if x < -708.0 {
        0.0
    } else {
        y
    }
}

/// [`exp64`] of 8 lanes at once in AVX-512 registers: the same IEEE operations in the same
/// order (a multiply then an add for the rounding trick, the FMA Horner chain, the exponent
/// bits), so every lane is bitwise `exp64` of its input (the test below). LLVM splits the
/// scalar body into 2- and 4-lane pieces; this runs about 4× faster.
///
/// # Safety
/// AVX-512F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn exp64x8(x: std::arch::x86_64::__m512d) -> std::arch::x86_64::__m512d {
    use exp64_consts::*;
    use std::arch::x86_64::*;
    let set = _mm512_set1_pd;
    // clamp: `max(lo, x)`, `min(hi, ·)` return their second operand for a NaN, keeping it.
    let xc = _mm512_min_pd(set(709.0), _mm512_max_pd(set(-708.0), x));
    let big = _mm512_add_pd(_mm512_mul_pd(xc, set(LOG2E)), set(ROUND));
    let n = _mm512_sub_pd(big, set(ROUND));
    let r = _mm512_fmadd_pd(n, set(-LN2_LO), _mm512_fmadd_pd(n, set(-LN2_HI), xc));
    let mut p = set(C[0]);
    for c in &C[1..] {
        p = _mm512_fmadd_pd(p, r, set(*c));
    }
    let one = set(1.0);
    let e_r = _mm512_fmadd_pd(_mm512_fmadd_pd(p, r, one), r, one);
    let k = _mm512_add_epi64(
        _mm512_sub_epi64(_mm512_castpd_si512(big), _mm512_set1_epi64(ROUND.to_bits() as i64)),
        _mm512_set1_epi64(1023),
    );
    let y = _mm512_mul_pd(e_r, _mm512_castsi512_pd(_mm512_slli_epi64::<52>(k)));
    let below = _mm512_cmp_pd_mask::<_CMP_LT_OQ>(x, set(-708.0));
    _mm512_mask_blend_pd(below, y, _mm512_setzero_pd())
}

/// [`exp64`] of 4 lanes at once in AVX2 registers: [`exp64x8`]'s operations on half the
/// lanes, so every lane is bitwise `exp64` of its input (the test below).
///
/// # Safety
/// AVX2 and FMA available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp64x4(x: std::arch::x86_64::__m256d) -> std::arch::x86_64::__m256d {
    use exp64_consts::*;
    use std::arch::x86_64::*;
    let set = _mm256_set1_pd;
    // clamp: `max(lo, x)`, `min(hi, ·)` return their second operand for a NaN, keeping it.
    let xc = _mm256_min_pd(set(709.0), _mm256_max_pd(set(-708.0), x));
    let big = _mm256_add_pd(_mm256_mul_pd(xc, set(LOG2E)), set(ROUND));
    let n = _mm256_sub_pd(big, set(ROUND));
    let r = _mm256_fmadd_pd(n, set(-LN2_LO), _mm256_fmadd_pd(n, set(-LN2_HI), xc));
    let mut p = set(C[0]);
    for c in &C[1..] {
        p = _mm256_fmadd_pd(p, r, set(*c));
    }
    let one = set(1.0);
    let e_r = _mm256_fmadd_pd(_mm256_fmadd_pd(p, r, one), r, one);
    let k = _mm256_add_epi64(
        _mm256_sub_epi64(_mm256_castpd_si256(big), _mm256_set1_epi64x(ROUND.to_bits() as i64)),
        _mm256_set1_epi64x(1023),
    );
    let y = _mm256_mul_pd(e_r, _mm256_castsi256_pd(_mm256_slli_epi64::<52>(k)));
    let below = _mm256_cmp_pd::<_CMP_LT_OQ>(x, set(-708.0));
    _mm256_blendv_pd(y, _mm256_setzero_pd(), below)
}

/// Whether this CPU has a register variant of [`transpose16`] (AVX-512 or AVX2); without
/// one, callers move the values by a scalar copy.
pub fn wide_transpose() -> bool {
    cfg!(target_arch = "x86_64") && Isa::detect() != Isa::Portable
}

/// `dst[e·ld + i] = rows[i][e0 + e]` for `i, e < 16`: a 16 × 16 block transposed through
/// registers, AVX-512's 16-lane or AVX2's 8-lane (data movement only, so bitwise equal to
/// the scalar copy).
///
/// # Safety
/// [`wide_transpose`]; every `rows[i]` holds `e0 + 16` values; `dst` holds `15·ld + 16`.
#[cfg(target_arch = "x86_64")]
#[inline]
pub unsafe fn transpose16(rows: &[&[f32]; 16], e0: usize, dst: *mut f32, ld: usize) {
    // SAFETY: forwarded; the variant's features were detected.
    unsafe {
        match Isa::detect() {
            Isa::Avx512 => transpose16_avx512(rows, e0, dst, ld),
            _ => transpose16_avx2(rows, e0, dst, ld),
        }
    }
}

/// [`transpose16`] as four 8 × 8 blocks through ymm registers (unpack pairs, 4-wide
/// shuffles, then 128-bit lane permutes).
///
/// # Safety
/// AVX2 available; otherwise as [`transpose16`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose16_avx2(rows: &[&[f32]; 16], e0: usize, dst: *mut f32, ld: usize) {
    use std::arch::x86_64::*;
    for (ib, eb) in [(0, 0), (0, 8), (8, 0), (8, 8)] {
        // SAFETY: 8 loads of 8 values at rows[ib + i][e0 + eb ..] (inside e0 + 16), 8 stores
        // of 8 at dst + (eb + e)·ld + ib (inside 15·ld + 16).
        unsafe {
            let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(rows[ib + i][e0 + eb..e0 + eb + 8].as_ptr()));
            // t[2p] = (a0 b0 a1 b1 | a4 b4 a5 b5), t[2p+1] = (a2 b2 a3 b3 | a6 b6 a7 b7) of rows 2p, 2p+1.
            let t: [__m256; 8] = std::array::from_fn(|i| {
                let (a, b) = (r[i & !1], r[i | 1]);
                if i % 2 == 0 {
                    _mm256_unpacklo_ps(a, b)
                } else {
                    _mm256_unpackhi_ps(a, b)
                }
            });
            // u[4h + c] = column c (low lane) and c + 4 (high lane) of rows 4h .. 4h + 4.
            let u: [__m256; 8] = std::array::from_fn(|i| {
                let (h, c) = (i / 4, i % 4);
                let (a, b) = (t[4 * h + c / 2], t[4 * h + 2 + c / 2]);
                if c % 2 == 0 {
                    _mm256_shuffle_ps::<0x44>(a, b)
                } else {
                    _mm256_shuffle_ps::<0xEE>(a, b)
                }
            });
            for e in 0..8 {
                let (a, b) = (u[e % 4], u[4 + e % 4]);
                let col =
                    if e < 4 { _mm256_permute2f128_ps::<0x20>(a, b) } else { _mm256_permute2f128_ps::<0x31>(a, b) };
                _mm256_storeu_ps(dst.add((eb + e) * ld + ib), col);
            }
        }
    }
}

/// [`transpose16`] through zmm registers (unpack pairs, 4-wide shuffles, then two rounds of
/// 128-bit lane shuffles).
///
/// # Safety
/// AVX-512F available; otherwise as [`transpose16`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_avx512(rows: &[&[f32]; 16], e0: usize, dst: *mut f32, ld: usize) {
    use std::arch::x86_64::*;
    // SAFETY: 16 loads of 16 values at rows[i][e0..], 16 stores of 16 at dst + e·ld.
    unsafe {
        let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(rows[i][e0..e0 + 16].as_ptr()));
        // Row pairs interleaved: t[2p] = (a0 b0 a1 b1 | a4 b4 a5 b5 | …), t[2p+1] = (a2 b2 a3 b3 | …).
        let t: [__m512; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        // Quads: u[4q + c] holds column c (+4, +8, +12 in lanes 1..3) of rows 4q..4q+4.
        let u: [__m512; 16] = std::array::from_fn(|i| {
            let (q, c) = (i / 4, i % 4);
            let (a, b) = (t[4 * q + c / 2], t[4 * q + 2 + c / 2]);
            if c % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(a, b)
            } else {
                _mm512_shuffle_ps::<0xEE>(a, b)
            }
        });
        // Lanes (0, 2) / (1, 3) of quads (0, 1) and (2, 3), then of those: columns in order.
        let v: [__m512; 16] = std::array::from_fn(|i| {
            let (c, hi, q) = (i % 4, (i / 4) % 2, i / 8);
            let (a, b) = (u[8 * q + c], u[8 * q + 4 + c]);
            if hi == 0 {
                _mm512_shuffle_f32x4::<0x88>(a, b)
            } else {
                _mm512_shuffle_f32x4::<0xDD>(a, b)
            }
        });
        for e in 0..16 {
            let (c, hi4, hi8) = (e % 4, (e / 4) % 2, e / 8);
            let (a, b) = (v[4 * hi4 + c], v[8 + 4 * hi4 + c]);
            let col = if hi8 == 0 { _mm512_shuffle_f32x4::<0x88>(a, b) } else { _mm512_shuffle_f32x4::<0xDD>(a, b) };
            _mm512_storeu_ps(dst.add(e * ld), col);
        }
    }
}

/// Lanes of the fixed-order sums of [`lane_sum`].
pub const LANES: usize = 16;

/// Asks for the 64-byte lines of `data` to be brought into L1 (`L1`) or else L2: a hint (no
/// value changes), and nothing happens off x86-64.
#[inline(always)]
pub fn prefetch<const L1: bool>(data: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let at = line.as_ptr().cast();
        // SAFETY: SSE is part of x86-64; a prefetch does not access memory.
        unsafe {
            match L1 {
                true => _mm_prefetch::<_MM_HINT_T0>(at),
                false => _mm_prefetch::<_MM_HINT_T1>(at),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Folds 16 lane partials into one sum in a fixed pairwise order (lane `i` with `i + 8`,
/// then `i + 4`, `i + 2`, `i + 1`).
#[inline(always)]
pub fn lane_sum(mut part: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for i in 0..w {
            part[i] += part[i + w];
        }
        w /= 2;
    }
    part[0]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`exp`] against f64 `exp` over the softmax's range (x ≤ 0), at every 1/1024 step of
    /// [-90, 1] and the edges: relative error below 2 ulp (2⁻²² ≈ 2.4e−7).
    #[test]
    fn exp_matches_f64() {
        let xs = (-90 * 1024..=1024).map(|i| i as f32 / 1024.0).chain([0.0, -0.0, -1e-30, -87.0, 88.0]);
        for x in xs {
            let want = (x.max(-87.0) as f64).exp();
            let got = exp(x) as f64;
            assert!(((got - want) / want).abs() < 2.4e-7, "exp({x}) = {got}, want {want}");
        }
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
    }

    /// [`exp`]'s `2ⁿ` from the bits of `n + 1.5·2²³` equals the `(n as i32 + 127) << 23` it
    /// replaced, bitwise, at every 1/256 step of [−100, 100] (both clamps) and the edges.
    #[test]
    fn exp_scale_is_the_integer_conversion() {
        let old = |x: f32| {
            let x = x.clamp(-87.0, 88.0);
            let n = (x * std::f32::consts::LOG2_E).round_ties_even();
            let r = n.mul_add(2.121_944_4e-4, n.mul_add(-0.693_359_4, x));
            let mut p = 1.987_569_1e-4f32;
            for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
                p = p.mul_add(r, c);
            }
            (p.mul_add(r * r, r) + 1.0) * f32::from_bits(((n as i32 + 127) << 23) as u32)
        };
        let xs = (-100 * 256..=100 * 256).map(|i| i as f32 / 256.0).chain([-0.0, -87.0, 88.0, f32::NEG_INFINITY]);
        for x in xs {
            assert_eq!(exp(x).to_bits(), old(x).to_bits(), "exp({x})");
        }
    }

    /// [`exp64x8`] gives [`exp64`]'s bits in every lane: a sweep of [−750, 720] in steps of
    /// 1/7 (both clamps, the cut at −708), NaN, ±∞, ±0 and the edges.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp64x8_is_exp64() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        let mut xs: Vec<f64> = (-5250..5040).map(|i| i as f64 / 7.0).collect();
        xs.extend([f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, -708.0, 709.0, -708.0000001, 709.5]);
        for c in xs.chunks(8) {
            let mut lanes = [0.0f64; 8];
            lanes[..c.len()].copy_from_slice(c);
            let mut out = [0.0f64; 8];
            // SAFETY: AVX-512F detected; 8 values loaded and stored.
            unsafe {
                use std::arch::x86_64::*;
                _mm512_storeu_pd(out.as_mut_ptr(), exp64x8(_mm512_loadu_pd(lanes.as_ptr())));
            }
            for (x, y) in lanes.iter().zip(out) {
                assert_eq!(y.to_bits(), exp64(*x).to_bits(), "exp64x8({x})");
            }
        }
    }

    /// [`exp64x4`] gives [`exp64`]'s bits in every lane, on [`exp64x8_is_exp64`]'s inputs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp64x4_is_exp64() {
        if !Isa::Avx2.available() {
            return;
        }
        let mut xs: Vec<f64> = (-5250..5040).map(|i| i as f64 / 7.0).collect();
        xs.extend([f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, -708.0, 709.0, -708.0000001, 709.5]);
        for c in xs.chunks(4) {
            let mut lanes = [0.0f64; 4];
            lanes[..c.len()].copy_from_slice(c);
            let mut out = [0.0f64; 4];
            // SAFETY: AVX2 and FMA detected; 4 values loaded and stored.
            unsafe {
                use std::arch::x86_64::*;
                _mm256_storeu_pd(out.as_mut_ptr(), exp64x4(_mm256_loadu_pd(lanes.as_ptr())));
            }
            for (x, y) in lanes.iter().zip(out) {
                assert_eq!(y.to_bits(), exp64(*x).to_bits(), "exp64x4({x})");
            }
        }
    }

    /// [`exp64`] against libm's `exp` at every 1/64 step of [−745, 709] and the edges:
    /// within 2 ulp (relative 4.5e−16) on [−708, 709], 0 below; `exp64(0) = 1` exactly.
    #[test]
    fn exp64_matches_libm() {
        let xs = (-745 * 64..=709 * 64).map(|i| i as f64 / 64.0).chain([-1e-300, -0.0, 1e-10, -707.99, -708.0]);
        let mut worst = 0.0f64;
        for x in xs {
            let got = exp64(x);
            if x < -708.0 {
                assert_eq!(got, 0.0, "exp64({x})");
                continue;
            }
            let want = x.exp();
            let rel = ((got - want) / want).abs();
            worst = worst.max(rel);
            assert!(rel < 4.5e-16, "exp64({x}) = {got:e}, want {want:e} (rel {rel:e})");
        }
        eprintln!("exp64: worst relative error {worst:e}");
        assert_eq!(exp64(0.0), 1.0);
        assert_eq!(exp64(f64::NEG_INFINITY), 0.0);
        assert!(exp64(f64::NAN).is_nan());
    }

    /// Each register transpose this CPU runs against the scalar copy.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transpose16_matches_scalar() {
        let data: Vec<Vec<f32>> = (0..16).map(|i| (0..20).map(|e| (100 * i + e) as f32).collect()).collect();
        let rows: [&[f32]; 16] = std::array::from_fn(|i| data[i].as_slice());
        let ld = 21;
        type Variant = unsafe fn(&[&[f32]; 16], usize, *mut f32, usize);
        let variants: [(Isa, Variant); 2] = [(Isa::Avx2, transpose16_avx2), (Isa::Avx512, transpose16_avx512)];
        for (isa, variant) in variants.into_iter().filter(|(isa, _)| isa.available()) {
            let mut dst = vec![-1.0f32; 15 * ld + 16];
            // SAFETY: the variant's features are available; rows hold 3 + 16 values; dst
            // holds 15·ld + 16.
            unsafe { variant(&rows, 3, dst.as_mut_ptr(), ld) };
            check_transposed(&dst, ld, isa);
        }
    }

    fn check_transposed(dst: &[f32], ld: usize, isa: Isa) {
        for e in 0..16 {
            for i in 0..16 {
                assert_eq!(dst[e * ld + i], (100 * i + 3 + e) as f32, "{isa:?}: e {e} i {i}");
            }
            if e < 15 {
                assert!(dst[e * ld + 16..(e + 1) * ld].iter().all(|&x| x == -1.0), "{isa:?}: e {e}");
            }
        }
    }

    /// The fixed tree, with values whose order matters: lanes 0 and 2 (1e8, −1e8) meet
    /// before lane 1 (1) is added, giving 1; a sequential sum gives (1e8 + 1) − 1e8 = 0.
    #[test]
    fn lane_sum_order() {
        let mut part = [0.0f32; LANES];
        part[0] = 1e8;
        part[1] = 1.0;
        part[2] = -1e8;
        assert_eq!(lane_sum(part), 1.0);
        assert_eq!(part.iter().sum::<f32>(), 0.0);
        let ones = [1.0f32; LANES];
        assert_eq!(lane_sum(ones), 16.0);
    }
}
