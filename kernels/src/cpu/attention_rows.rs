//! The per-row computations of causal attention, shared by the forward
//! ([`super::attention`]) and the backward ([`super::backward`]), which therefore see the
//! same probabilities bit for bit.
//!
//! Reduction orders (fixed per row, whatever else is in the call):
//! - a score `s_j = scale · (q · k_j)` is one sequential FMA chain over the head dimension
//!   `e = 0..d` from zero (lanes of a vector hold different keys, as in the GEMM contract of
//!   [`super::matmul`]), then one multiply by `scale`;
//! - the softmax subtracts the maximum, takes [`exp`], and sums in 16 lane partials (key `j`
//!   into lane `j mod 16`, in key order) folded by [`lane_sum`]; `p_j = e_j · (1 / Σ)`;
//! - a weighted row sum `o[e] = Σ_j w_j · r_j[e]` (attention's `P·V`, the backward's `dS·K`)
//!   is one FMA chain over `j` in key order per output element.
//!
//! Every helper is `#[inline(always)]`, to be compiled into the callers' `multiversion!`
//! variants.

#[cfg(target_arch = "x86_64")]
use super::simd::transpose16;
use super::simd::{exp, lane_sum, Isa, LANES};

/// Keys per block of [`Transposed`] (4 vectors of 16: four independent FMA chains).
pub const KB: usize = 64;

/// Rows `0..n` of one head's keys (or values), transposed in blocks of [`KB`] rows:
/// `data[(b·d + e)·KB + i] = row_{b·KB + i}[e]`, zero past `n`. Scores of a block are then
/// `d` vector FMAs with the query element broadcast.
pub struct Transposed {
    data: Vec<f32>,
    d: usize,
}

impl Transposed {
    /// Gathers `row(j)` (each of length `d`) for `j < n`, 16 rows at a time (through
    /// [`transpose16`] where AVX-512 is available; a scalar copy otherwise and for the
    /// columns past a multiple of 16).
    #[inline(always)]
    pub fn new<'a>(n: usize, d: usize, row: impl Fn(usize) -> &'a [f32]) -> Self {
        let mut data = vec![0.0f32; n.div_ceil(KB) * d * KB];
        let zeros = vec![0.0f32; d];
        let wide = cfg!(target_arch = "x86_64") && Isa::detect() == Isa::Avx512;
        for j0 in (0..n).step_by(16) {
            let rows: [&[f32]; 16] = std::array::from_fn(|i| if j0 + i < n { &row(j0 + i)[..d] } else { &zeros[..] });
            let (blk, i0) = (j0 / KB, j0 % KB);
            let dst = &mut data[blk * d * KB..(blk + 1) * d * KB];
            let mut e0 = 0;
            #[cfg(target_arch = "x86_64")]
            while wide && e0 + 16 <= d {
                // SAFETY: AVX-512 detected; rows hold d ≥ e0 + 16 values; dst from
                // e0·KB + i0 holds 15·KB + 16 (i0 ≤ KB − 16, e0 + 16 ≤ d).
                unsafe { transpose16(&rows, e0, dst.as_mut_ptr().add(e0 * KB + i0), KB) };
                e0 += 16;
            }
            for e in e0..d {
                for (i, r) in rows.iter().enumerate() {
                    dst[e * KB + i0 + i] = r[e];
                }
            }
        }
        Transposed { data, d }
    }

    /// Length a score buffer for these rows needs (`n` rounded up to a block).
    pub fn padded_len(&self) -> usize {
        self.data.len() / self.d.max(1)
    }
}

/// `s[j] = scale · (q · row_j)` for the rows `j < n` of `t` (module doc's order); `s` holds
/// [`Transposed::padded_len`] values, those past `n` are meaningless.
#[inline(always)]
pub fn scores(q: &[f32], t: &Transposed, n: usize, scale: f32, s: &mut [f32]) {
    let d = t.d;
    for (blk, out) in t.data.chunks_exact(d * KB).zip(s.chunks_exact_mut(KB)).take(n.div_ceil(KB)) {
        let mut acc = [0.0f32; KB];
        for (&qe, col) in q[..d].iter().zip(blk.chunks_exact(KB)) {
            for (a, &c) in acc.iter_mut().zip(col) {
                *a = qe.mul_add(c, *a);
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = a * scale;
        }
    }
}

/// In place over `s[..n]`: `softmax` (module doc's order). `s` is padded as for [`scores`].
#[inline(always)]
pub fn softmax(s: &mut [f32], n: usize) {
    let chunks = n.div_ceil(LANES);
    let mut mx = [f32::NEG_INFINITY; LANES];
    for (c, ch) in s.chunks_exact(LANES).take(chunks).enumerate() {
        for (l, (m, &x)) in mx.iter_mut().zip(ch).enumerate() {
            if c * LANES + l < n {
                *m = m.max(x);
            }
        }
    }
    let max = mx.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut part = [0.0f32; LANES];
    for (c, ch) in s.chunks_exact_mut(LANES).take(chunks).enumerate() {
        for (l, (p, x)) in part.iter_mut().zip(ch.iter_mut()).enumerate() {
            let e = if c * LANES + l < n { exp(*x - max) } else { 0.0 };
            *x = e;
            *p += e;
        }
    }
    let inv = 1.0 / lane_sum(part);
    for x in &mut s[..n] {
        *x *= inv;
    }
}

/// The attention probabilities of query `q` over the first `n` rows of `keys`: [`scores`]
/// then [`softmax`]; the one computation of the forward and of the backward's recomputation.
#[inline(always)]
pub fn probs(q: &[f32], keys: &Transposed, n: usize, scale: f32, p: &mut [f32]) {
    scores(q, keys, n, scale, p);
    softmax(p, n);
}

/// `out[e] = Σ_{j<w.len()} w[j] · row(j)[e]` for `e < out.len()`, one FMA chain over `j` per
/// element (module doc).
#[inline(always)]
pub fn weighted_sum<'a>(w: &[f32], row: impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
    let d = out.len();
    let mut e0 = 0;
    while e0 + KB <= d {
        let mut acc = [0.0f32; KB];
        for (j, &wj) in w.iter().enumerate() {
            let r: &[f32; KB] = row(j)[e0..e0 + KB].try_into().expect("a row holds d values");
            for (a, &x) in acc.iter_mut().zip(r) {
                *a = wj.mul_add(x, *a);
            }
        }
        out[e0..e0 + KB].copy_from_slice(&acc);
        e0 += KB;
    }
    for (e, o) in out.iter_mut().enumerate().skip(e0) {
        *o = w.iter().enumerate().fold(0.0f32, |acc, (j, &wj)| wj.mul_add(row(j)[e], acc));
    }
}

/// `y[e] = fma(a, x[e], y[e])` (one more step of `y`'s chains).
#[inline(always)]
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = a.mul_add(x, *y);
    }
}

/// `Σ a[j]·b[j]` in 16 lane partials (FMA chains over `j ≡ lane mod 16`) folded by
/// [`lane_sum`].
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut part = [0.0f32; LANES];
    for (ca, cb) in a.chunks(LANES).zip(b.chunks(LANES)) {
        for ((p, &x), &y) in part.iter_mut().zip(ca).zip(cb) {
            *p = x.mul_add(y, *p);
        }
    }
    lane_sum(part)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores, probabilities and weighted sums against f64 sums, for a row count that is not
    /// a multiple of a block and a head dimension that is not a multiple of 64.
    #[test]
    fn rows_match_f64() {
        let (n, d) = (70usize, 72usize);
        let val = |i: usize| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0;
        let keys: Vec<f32> = (0..n * d).map(val).collect();
        let q: Vec<f32> = (0..d).map(|e| val(e + 5000)).collect();
        let t = Transposed::new(n, d, |j| &keys[j * d..(j + 1) * d]);
        assert_eq!(t.padded_len(), 128);
        let scale = 0.125f32;
        let mut p = vec![0.0f32; t.padded_len()];
        scores(&q, &t, n, scale, &mut p);
        let s64: Vec<f64> =
            (0..n).map(|j| (0..d).map(|e| q[e] as f64 * keys[j * d + e] as f64).sum::<f64>() * scale as f64).collect();
        for j in 0..n {
            assert!((p[j] as f64 - s64[j]).abs() < 1e-6, "score {j}: {} vs {}", p[j], s64[j]);
        }
        probs(&q, &t, n, scale, &mut p);
        let z: f64 = s64.iter().map(|s| s.exp()).sum();
        for j in 0..n {
            assert!((p[j] as f64 - s64[j].exp() / z).abs() < 1e-7, "prob {j}");
        }
        let mut out = vec![0.0f32; d];
        weighted_sum(&p[..n], |j| &keys[j * d..(j + 1) * d], &mut out);
        for (e, &o) in out.iter().enumerate() {
            let want: f64 = (0..n).map(|j| p[j] as f64 * keys[j * d + e] as f64).sum();
            assert!((o as f64 - want).abs() < 1e-6, "weighted sum {e}");
        }
        let want_dot: f64 = (0..d).map(|e| q[e] as f64 * keys[e] as f64).sum();
        assert!((dot(&q, &keys[..d]) as f64 - want_dot).abs() < 1e-5);
    }
}
