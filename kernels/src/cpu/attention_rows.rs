//! The per-row computations of causal attention's forward ([`super::attention`]); the
//! backward ([`super::backward`]) shares its [`Transposed`] layout, [`softmax`] and [`dot`],
//! and computes its scores with the GEMM tile, whose chains are the ones below, so it sees
//! the forward's probabilities bit for bit.
//!
//! Reduction orders (fixed per row, whatever else is in the call):
//! - a score `s_j = scale · (q · k_j)` is one sequential FMA chain over the head dimension
//!   `e = 0..d` from zero (lanes of a vector hold different keys, as in the GEMM contract of
//!   [`super::matmul`]), then one multiply by `scale`;
//! - the softmax subtracts the maximum, takes [`exp`], and sums in 16 lane partials (key `j`
//!   into lane `j mod 16`, in key order) folded by [`lane_sum`]; `p_j = e_j · (1 / Σ)`;
//! - a weighted row sum `o[e] = Σ_j w_j · r_j[e]` (attention's `P·V`)
//!   is one FMA chain over `j` in key order per output element.
//!
//! Every helper is `#[inline(always)]`, to be compiled into the callers' `multiversion!`
//! variants.

#[cfg(target_arch = "x86_64")]
use super::simd::transpose16;
use super::simd::{exp, lane_sum, wide_transpose, Isa, LANES};

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
    /// [`transpose16`] where AVX-512 or AVX2 is available; a scalar copy otherwise and for the
    /// columns past a multiple of 16). Only the padding rows past the last group of 16 are
    /// zero-filled (a decode step builds one of these per sequence, KV head and layer: a
    /// whole-buffer fill was 2.4 % of a 64-sequence decode step).
    #[inline(always)]
    pub fn new<'a>(n: usize, d: usize, row: impl Fn(usize) -> &'a [f32]) -> Self {
        let len = n.div_ceil(KB) * d * KB;
        let mut data: Vec<f32> = Vec::with_capacity(len);
        let out = data.as_mut_ptr();
        let zeros = vec![0.0f32; d];
        let wide = wide_transpose();
        for j0 in (0..n).step_by(16) {
            let rows: [&[f32]; 16] = std::array::from_fn(|i| if j0 + i < n { &row(j0 + i)[..d] } else { &zeros[..] });
            let (blk, i0) = (j0 / KB, j0 % KB);
            // SAFETY: block `blk` holds d·KB values of the capacity.
            let dst = unsafe { out.add(blk * d * KB) };
            let mut e0 = 0;
            #[cfg(target_arch = "x86_64")]
            while wide && e0 + 16 <= d {
                // SAFETY: a register variant detected; rows hold d ≥ e0 + 16 values; dst from
                // e0·KB + i0 holds 15·KB + 16 (i0 ≤ KB − 16, e0 + 16 ≤ d).
                unsafe { transpose16(&rows, e0, dst.add(e0 * KB + i0), KB) };
                e0 += 16;
            }
            for e in e0..d {
                for (i, r) in rows.iter().enumerate() {
                    // SAFETY: e < d, i0 + i < KB: inside block `blk`.
                    unsafe { *dst.add(e * KB + i0 + i) = r[e] };
                }
            }
        }
        // The last block's rows from the next multiple of 16 past n: zeros.
        let written = n.next_multiple_of(16);
        if !written.is_multiple_of(KB) {
            let (blk, i0) = (written / KB, written % KB);
            for e in 0..d {
                // SAFETY: KB − i0 values of row e of block `blk`, inside the capacity.
                unsafe { std::ptr::write_bytes(out.add((blk * d + e) * KB + i0), 0, KB - i0) };
            }
        }
        // SAFETY: every value below len was written above (rows < written by the groups, the
        // rest by the fill).
        unsafe { data.set_len(len) };
        Transposed { data, d }
    }

    /// Length a score buffer for these rows needs (`n` rounded up to a block).
    pub fn padded_len(&self) -> usize {
        self.data.len() / self.d.max(1)
    }

    /// The blocks' keys as [`KeyStrips`] (four strips per block, `stride` [`KB`]).
    pub fn strips(&self) -> KeyStrips<'_> {
        let need = self.d.saturating_sub(1) * KB + STRIP;
        let strips = (0..self.padded_len() / STRIP)
            .map(|i| &self.data[(i / 4) * self.d * KB + (i % 4) * STRIP..][..need])
            .collect();
        KeyStrips::new(strips, KB, self.d)
    }

    /// Block `b` (rows `b·KB ..`): `[d, KB]` row-major, the transposed rows side by side.
    pub fn block(&self, b: usize) -> &[f32] {
        &self.data[b * self.d * KB..(b + 1) * self.d * KB]
    }
}

/// Key vectors in strips of [`STRIP`] keys, each strip's keys side by side: element `e` of
/// key `STRIP·i + l` is `strips[i][e·stride + l]`. Scores load a strip's keys for one element
/// with one vector load, and need no transpose where the keys are stored this way already
/// (a [`Transposed`] copy, or a [`crate::ops::KvLayout::Blocked`] K cache).
pub struct KeyStrips<'a> {
    strips: Vec<&'a [f32]>,
    stride: usize,
    d: usize,
}

impl<'a> KeyStrips<'a> {
    /// Strips of `d`-element keys whose elements lie `stride` apart. Panics unless each
    /// strip holds `(d − 1)·stride + STRIP` values and `stride ≥ STRIP`.
    pub fn new(strips: Vec<&'a [f32]>, stride: usize, d: usize) -> Self {
        let need = d.saturating_sub(1) * stride + STRIP;
        assert!(stride >= STRIP && strips.iter().all(|s| s.len() >= need), "key strips of {d} × {stride}");
        KeyStrips { strips, stride, d }
    }

    /// Length a score buffer for these keys needs (`STRIP` per strip).
    pub fn padded_len(&self) -> usize {
        STRIP * self.strips.len()
    }
}

/// Rows ahead of the one being summed whose [`KB`] values the AVX2 and AVX-512
/// [`weighted_sums`] prefetch into L1 (one 16-slot block of the KV cache: its blocks are
/// scattered, so the hardware prefetchers stop at each one's end).
#[cfg(target_arch = "x86_64")]
pub const AHEAD: usize = 16;

/// Keys per strip of [`KeyStrips`]: 16 (one zmm, two ymm).
pub const STRIP: usize = 16;

/// `s[j] = scale · (q · key_j)` for the keys `j < n` (module doc's order); `s` holds
/// [`KeyStrips::padded_len`] values, those past `n` are meaningless. (The one-query
/// reference of the tests: the forward scores blocks of queries.)
#[cfg(test)]
#[inline(always)]
pub fn scores(q: &[f32], keys: &KeyStrips, n: usize, scale: f32, s: &mut [f32]) {
    scores_rows::<1>([q], keys, n, scale, [s]);
}

/// [`scores`] of `R` queries at once (each key vector loaded once for all of them; every
/// score is the same chain as alone): `s[r][j]` for `j < n`.
#[inline(always)]
pub fn scores_rows<const R: usize>(q: [&[f32]; R], keys: &KeyStrips, n: usize, scale: f32, s: [&mut [f32]; R]) {
    let (d, stride, strips) = (keys.d, keys.stride, &keys.strips[..n.div_ceil(STRIP)]);
    assert!(q.iter().all(|q| q.len() >= d) && s.iter().all(|s| s.len() >= strips.len() * STRIP));
    #[cfg(target_arch = "x86_64")]
    match Isa::detect() {
        // SAFETY: AVX-512 detected; lengths asserted above and in KeyStrips::new.
        Isa::Avx512 => return unsafe { super::attention_avx512::scores_rows(q, strips, stride, d, scale, s) },
        // SAFETY: AVX2 and FMA detected; lengths asserted above and in KeyStrips::new.
        Isa::Avx2 => return unsafe { super::attention_avx2::scores_rows(q, strips, stride, d, scale, s) },
        Isa::Portable => {}
    }
    scores_rows_portable(q, strips, stride, d, scale, s);
}

/// The portable [`scores_rows`] (the definition the AVX-512 and AVX2 variants match bitwise).
#[inline(always)]
fn scores_rows_portable<const R: usize>(
    q: [&[f32]; R],
    strips: &[&[f32]],
    stride: usize,
    d: usize,
    scale: f32,
    s: [&mut [f32]; R],
) {
    for (i, strip) in strips.iter().enumerate() {
        let mut acc = [[0.0f32; STRIP]; R];
        for e in 0..d {
            let col = &strip[e * stride..e * stride + STRIP];
            for r in 0..R {
                let qe = q[r][e];
                for (a, &c) in acc[r].iter_mut().zip(col) {
                    *a = qe.mul_add(c, *a);
                }
            }
        }
        for r in 0..R {
            for (o, a) in s[r][i * STRIP..(i + 1) * STRIP].iter_mut().zip(acc[r]) {
                *o = a * scale;
            }
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

/// Rows of queries scored together by [`scores_block`].
pub const QB: usize = 4;

/// [`scores`] of up to [`QB`] queries `q` over the first `n` keys, all at once (each key
/// vector loaded once for all of them): query `r`'s scores in `s[r·P .. (r+1)·P]`,
/// `P` = [`KeyStrips::padded_len`].
#[inline(always)]
pub fn scores_block(q: &[&[f32]], t: &KeyStrips, n: usize, scale: f32, s: &mut [f32]) {
    fn rows<const R: usize>(q: &[&[f32]], t: &KeyStrips, n: usize, scale: f32, s: &mut [f32]) {
        let mut bufs = s.chunks_exact_mut(t.padded_len());
        let s: [&mut [f32]; R] = std::array::from_fn(|_| bufs.next().expect("a buffer per query"));
        scores_rows::<R>(std::array::from_fn(|r| q[r]), t, n, scale, s);
    }
    match q.len() {
        0 => {}
        1 => rows::<1>(q, t, n, scale, s),
        2 => rows::<2>(q, t, n, scale, s),
        3 => rows::<3>(q, t, n, scale, s),
        4 => rows::<4>(q, t, n, scale, s),
        _ => panic!("scores_block takes at most {QB} queries, got {}", q.len()),
    }
}

/// The attention probabilities of up to [`QB`] queries `q`, query `r` over the first `n[r]`
/// keys (laid out as in [`scores_block`]): scores then [`softmax`]. A query's probabilities
/// do not depend on the other queries of the block.
#[inline(always)]
pub fn probs(q: &[&[f32]], keys: &KeyStrips, n: &[usize], scale: f32, p: &mut [f32]) {
    scores_block(q, keys, n.iter().copied().max().unwrap_or(0), scale, p);
    for (p, &n) in p.chunks_exact_mut(keys.padded_len()).zip(n) {
        softmax(p, n);
    }
}

/// `out[e] += Σ_{j<w.len()} w[j] · row(j)[e]` for `e < out.len()`: continues each element's
/// FMA chain from its current value over `j` in order (module doc; from zero it is attention's
/// `P·V`). The chains of 64 elements at a time are held in registers. (The one-row reference
/// of the tests: the forward sums rows in blocks, [`weighted_sums`].)
#[cfg(test)]
#[inline(always)]
pub fn weighted_sum<'a>(w: &[f32], row: impl Fn(usize) -> &'a [f32], out: &mut [f32]) {
    weighted_sums(&[w], row, &mut [out]);
}

/// [`weighted_sum`] of up to [`QB`] weight rows over the same `row(j)`s (the query heads of
/// one KV head): `out[r][e] += Σ_{j<w[r].len()} w[r][j] · row(j)[e]`. Each `row(j)` chunk is
/// loaded once for all of them over the common length, and every element is still the one
/// chain of [`weighted_sum`] (the rows past the common length continue it alone), so the
/// bits do not depend on which rows are summed together.
#[inline(always)]
pub fn weighted_sums<'a>(w: &[&[f32]], row: impl Fn(usize) -> &'a [f32], out: &mut [&mut [f32]]) {
    assert!(w.len() == out.len() && w.len() <= QB);
    let n = w.iter().map(|w| w.len()).min().unwrap_or(0);
    match w.len() {
        0 => return,
        1 => sums_rows::<1>(w, n, &row, out),
        2 => sums_rows::<2>(w, n, &row, out),
        3 => sums_rows::<3>(w, n, &row, out),
        _ => sums_rows::<4>(w, n, &row, out),
    }
    for (w, out) in w.iter().zip(out.iter_mut()) {
        if w.len() > n {
            sums_rows::<1>(&[&w[n..]], w.len() - n, &|j| row(n + j), std::slice::from_mut(out));
        }
    }
}

/// The first `n` terms of [`weighted_sums`] for exactly `R` rows.
#[inline(always)]
fn sums_rows<'a, const R: usize>(w: &[&[f32]], n: usize, row: &impl Fn(usize) -> &'a [f32], out: &mut [&mut [f32]]) {
    let d = out[0].len();
    assert!(w.len() == R && out.len() == R && w.iter().all(|w| w.len() >= n) && out.iter().all(|o| o.len() == d));
    let mut e0 = 0;
    while e0 + KB <= d {
        let mut chunks: [&mut [f32; KB]; R] = {
            let mut it = out.iter_mut();
            std::array::from_fn(|_| (&mut it.next().expect("R outputs")[e0..e0 + KB]).try_into().expect("KB values"))
        };
        #[cfg(target_arch = "x86_64")]
        if Isa::detect() != Isa::Portable {
            let ws: [&[f32]; R] = std::array::from_fn(|r| &w[r][..n]);
            // SAFETY: the variant's features detected; every row holds d ≥ e0 + KB values
            // (indexing checks).
            unsafe {
                match Isa::detect() {
                    Isa::Avx512 => super::attention_avx512::weighted_sum64::<R>(ws, row, e0, &mut chunks),
                    _ => super::attention_avx2::weighted_sum64::<R>(ws, row, e0, &mut chunks),
                }
            }
            e0 += KB;
            continue;
        }
        for j in 0..n {
            let x = &row(j)[e0..e0 + KB];
            for r in 0..R {
                for (a, &x) in chunks[r].iter_mut().zip(x) {
                    *a = w[r][j].mul_add(x, *a);
                }
            }
        }
        e0 += KB;
    }
    for (r, out) in out.iter_mut().enumerate() {
        for (e, o) in out.iter_mut().enumerate().skip(e0) {
            *o = (0..n).fold(*o, |acc, j| w[r][j].mul_add(row(j)[e], acc));
        }
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

    /// The dispatched (AVX-512 or AVX2 where available) scores and weighted sums give the bits of the
    /// portable definitions: 4-query blocks and single queries, a partial last key block,
    /// `d` with a tail past a multiple of 64, a weighted sum continuing a nonzero start.
    #[test]
    fn vector_variants_are_bitwise_equal() {
        let (n, d) = (150usize, 80usize);
        let val = |i: usize| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 2.0;
        let keys: Vec<f32> = (0..n * d).map(val).collect();
        let qs: Vec<Vec<f32>> = (0..4).map(|r| (0..d).map(|e| val(9000 + 100 * r + e)).collect()).collect();
        let t = Transposed::new(n, d, |j| &keys[j * d..(j + 1) * d]);
        let padded = t.padded_len();
        let q4: [&[f32]; 4] = std::array::from_fn(|r| qs[r].as_slice());
        let (mut got, mut want) = (vec![0.0f32; 4 * padded], vec![0.0f32; 4 * padded]);
        let ks = t.strips();
        scores_block(&q4, &ks, n, 0.3, &mut got);
        let mut bufs = want.chunks_exact_mut(padded);
        let strips = &ks.strips[..n.div_ceil(STRIP)];
        scores_rows_portable::<4>(q4, strips, KB, d, 0.3, std::array::from_fn(|_| bufs.next().unwrap()));
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "4-query scores");
        for r in 1..QB {
            let mut some = vec![0.0f32; r * padded];
            scores_block(&q4[..r], &ks, n, 0.3, &mut some);
            assert!(some.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{r} vs 4 queries");
        }
        let mut one = vec![0.0f32; padded];
        scores(q4[2], &ks, n, 0.3, &mut one);
        assert!(
            one.iter().zip(&want[2 * padded..3 * padded]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "1 vs 4 queries"
        );
        let w: Vec<f32> = (0..n).map(|j| val(j + 3)).collect();
        let start: Vec<f32> = (0..d).map(|e| val(e + 77)).collect();
        let mut out = start.clone();
        weighted_sum(&w, |j| &keys[j * d..(j + 1) * d], &mut out);
        for e in 0..d {
            let want = w.iter().enumerate().fold(start[e], |acc, (j, &wj)| wj.mul_add(keys[j * d + e], acc));
            assert_eq!(out[e].to_bits(), want.to_bits(), "weighted sum {e}");
        }
        // Up to 4 rows summed together, of different lengths, give each row's bits alone.
        for r in 1..=QB {
            let ws: Vec<Vec<f32>> = (0..r).map(|i| (0..n - i * 7).map(|j| val(31 * i + j)).collect()).collect();
            let mut alone: Vec<Vec<f32>> = vec![start.clone(); r];
            for (w, o) in ws.iter().zip(&mut alone) {
                weighted_sum(w, |j| &keys[j * d..(j + 1) * d], o);
            }
            let mut together: Vec<Vec<f32>> = vec![start.clone(); r];
            let wr: Vec<&[f32]> = ws.iter().map(|w| w.as_slice()).collect();
            let mut outs: Vec<&mut [f32]> = together.iter_mut().map(|o| o.as_mut_slice()).collect();
            weighted_sums(&wr, |j| &keys[j * d..(j + 1) * d], &mut outs);
            let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&together), bits(&alone), "{r} rows together vs alone");
        }
    }

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
        let ks = t.strips();
        scores(&q, &ks, n, scale, &mut p);
        let s64: Vec<f64> =
            (0..n).map(|j| (0..d).map(|e| q[e] as f64 * keys[j * d + e] as f64).sum::<f64>() * scale as f64).collect();
        for j in 0..n {
            assert!((p[j] as f64 - s64[j]).abs() < 1e-6, "score {j}: {} vs {}", p[j], s64[j]);
        }
        probs(&[&q], &ks, &[n], scale, &mut p);
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
