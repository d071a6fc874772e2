//! Token log-probabilities, entropies and their gradient w.r.t. the logits.

use super::simd::exp64;
use rayon::prelude::*;

crate::multiversion! {
    /// `w[j] = exp((x[j] − max) / t)` in f64 for every `j < x.len()` ([`exp64`]; `w` at least
    /// as long as `x`), returning `Σ w` summed in 8 interleaved partial sums (`j mod 8`) folded
    /// pairwise (lane `i` with `i + 4`, then `+ 2`, `+ 1`). The one exponential pass of a
    /// softmax row: the sampler's `raw_logprob`, the learner's ℓ and entropy, the prompt
    /// logprobs all take it, so equal logits give bitwise-equal log-probabilities
    /// (DESIGN-NOTES §3). `max` is the row's maximum (so every exponent is ≤ 0); `t > 0`.
    pub fn exp_weights(x: &[f32], max: f64, t: f64, w: &mut [f64]) -> f64 {
        let w = &mut w[..x.len()];
        let mut acc = [0.0f64; 8];
        let mut xs = x.chunks_exact(8);
        let mut ws = w.chunks_exact_mut(8);
        #[cfg(target_arch = "x86_64")]
        if super::simd::Isa::detect() == super::simd::Isa::Avx512 {
            // The loop below in zmm registers: the same operations lane by lane ([`exp64x8`]),
            // so the same bits. `y / 1` is `y` exactly: at T = 1 (sampling's default, every
            // raw log-probability) the division is skipped.
            // SAFETY: AVX-512F detected; 8 values read from each chunk of x, written to w.
            unsafe {
                use std::arch::x86_64::*;
                let (m, tv) = (_mm512_set1_pd(max), _mm512_set1_pd(t));
                let mut a = _mm512_setzero_pd();
                for (xc, wc) in (&mut xs).zip(&mut ws) {
                    let mut y = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(xc.as_ptr())), m);
                    if t != 1.0 {
                        y = _mm512_div_pd(y, tv);
                    }
                    let e = super::simd::exp64x8(y);
                    _mm512_storeu_pd(wc.as_mut_ptr(), e);
                    a = _mm512_add_pd(a, e);
                }
                _mm512_storeu_pd(acc.as_mut_ptr(), a);
            }
        }
        #[cfg(target_arch = "x86_64")]
        if super::simd::Isa::detect() == super::simd::Isa::Avx2 {
            // The same loop in ymm registers, each chunk of 8 as two halves of 4 lanes
            // ([`exp64x4`]), the halves summed into lanes 0..4 and 4..8: the same bits.
            // SAFETY: AVX2 and FMA detected; 8 values read from each chunk of x, written to w.
            unsafe {
                use std::arch::x86_64::*;
                let (m, tv) = (_mm256_set1_pd(max), _mm256_set1_pd(t));
                let mut a = [_mm256_setzero_pd(); 2];
                for (xc, wc) in (&mut xs).zip(&mut ws) {
                    for (h, a) in a.iter_mut().enumerate() {
                        let mut y = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(xc.as_ptr().add(4 * h))), m);
                        if t != 1.0 {
                            y = _mm256_div_pd(y, tv);
                        }
                        let e = super::simd::exp64x4(y);
                        _mm256_storeu_pd(wc.as_mut_ptr().add(4 * h), e);
                        *a = _mm256_add_pd(*a, e);
                    }
                }
                _mm256_storeu_pd(acc.as_mut_ptr(), a[0]);
                _mm256_storeu_pd(acc.as_mut_ptr().add(4), a[1]);
            }
        }
        for (xc, wc) in (&mut xs).zip(&mut ws) {
            for l in 0..8 {
                let e = exp64((xc[l] as f64 - max) / t);
                wc[l] = e;
                acc[l] += e;
            }
        }
        for (l, (&v, o)) in xs.remainder().iter().zip(ws.into_remainder()).enumerate() {
            let e = exp64((v as f64 - max) / t);
            *o = e;
            acc[l] += e;
        }
        for l in 0..4 {
            acc[l] += acc[l + 4];
        }
        for l in 0..2 {
            acc[l] += acc[l + 2];
        }
        acc[0] + acc[1]
    }
}

crate::multiversion! {
    /// The largest entry of `row` as f64 (NaN entries are skipped; `−∞` for an empty or
    /// all-`−∞` row), from 16 lane maxima (the order does not change a maximum; of `±0` either
    /// may come back, and both give the same `x − max`).
    pub fn row_max(row: &[f32]) -> f64 {
        let mut m = [f32::NEG_INFINITY; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                m[l] = if c[l] > m[l] { c[l] } else { m[l] };
            }
        }
        for (l, &v) in chunks.remainder().iter().enumerate() {
            m[l] = if v > m[l] { v } else { m[l] };
        }
        m.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a }) as f64
    }
}

/// `log softmax(logits / T)[token]`, in f64 with the max subtracted: the one formula for the
/// sampler's `raw_logprob` (T = 1) and the learner's ℓ (DESIGN-NOTES §3), so equal logits
/// give bitwise-equal log-probabilities.
pub fn token_logprob(logits: &[f32], token: usize, temperature: f32) -> f32 {
    logprob_and_entropy(logits, token, temperature).0
}

/// [`token_logprob`] and the entropy `−Σ p log p` of `softmax(row / T)` (f64, nats) of one
/// row from one pass of exponentials ([`exp_weights`]). With `w_j = exp((z_j − max)/T)`,
/// `Z = Σ w_j` and `ln p_j = (z_j − max)/T − ln Z`, the entropy is
/// `H = −Σ p log p = ln Z − Σ_j p_j·(z_j − max)/T` (terms with `w_j = 0` skipped): no
/// logarithm per element.
fn logprob_and_entropy(row: &[f32], token: usize, temperature: f32) -> (f32, f32) {
    let t = temperature as f64;
    let max = row_max(row);
    let mut w = vec![0.0f64; row.len()];
    let z = exp_weights(row, max, t, &mut w);
    let ln_z = z.ln();
    let mean_logit: f64 =
        row.iter().zip(&w).filter(|(_, &wj)| wj > 0.0).map(|(&v, &wj)| wj / z * ((v as f64 - max) / t)).sum();
    (((row[token] as f64 - max) / t - ln_z) as f32, (ln_z - mean_logit) as f32)
}

/// `(ℓ, H)` per row of `logits [m, v]`.
pub fn token_logprobs(logits: &[f32], v: usize, tokens: &[u32], temperature: f32) -> (Vec<f32>, Vec<f32>) {
    logits
        .par_chunks(v)
        .zip(tokens.par_iter())
        .map(|(row, &tok)| logprob_and_entropy(row, tok as usize, temperature))
        .unzip()
}

/// `dz = g·(onehot − p)/T + e·dH/dz` per row with `p = softmax(z/T)` and
/// `dH/dz_j = −(1/T)·p_j·(ln p_j + H)` (entropy bonus, only when `dl_dentropy` is given;
/// `ln p_j = (z_j − max)/T − ln Z`, no logarithm per element), in f64 per element.
pub fn token_logprobs_backward(
    logits: &[f32],
    v: usize,
    tokens: &[u32],
    temperature: f32,
    dl_dlogp: &[f32],
    dl_dentropy: Option<&[f32]>,
    entropies: &[f32],
) -> Vec<f32> {
    let t = temperature as f64;
    let tinv = 1.0 / t;
    let mut dz = vec![0.0f32; logits.len()];
    dz.par_chunks_mut(v).zip(logits.par_chunks(v)).enumerate().for_each(|(i, (out, row))| {
        let max = row_max(row);
        let mut w = vec![0.0f64; row.len()];
        let z = exp_weights(row, max, t, &mut w);
        let (zinv, ln_z) = (1.0 / z, z.ln());
        let (g, hh) = (dl_dlogp[i] as f64, entropies[i] as f64);
        let tok = tokens[i] as usize;
        match dl_dentropy.map(|d| d[i] as f64) {
            None => {
                for (o, &wj) in out.iter_mut().zip(&w) {
                    *o = (g * tinv * -(wj * zinv)) as f32;
                }
                out[tok] = (g * tinv * (1.0 - w[tok] * zinv)) as f32;
            }
            Some(e) => {
                for (j, ((o, &wj), &x)) in out.iter_mut().zip(&w).zip(row).enumerate() {
                    let p = wj * zinv;
                    let onehot = if j == tok { 1.0 } else { 0.0 };
                    let dh = if p > 0.0 { -tinv * p * ((x as f64 - max) * tinv - ln_z + hh) } else { 0.0 };
                    *o = (g * tinv * (onehot - p) + e * dh) as f32;
                }
            }
        }
    });
    dz
}

#[cfg(test)]
mod tests {
    use super::super::simd::exp64;

    /// [`super::exp_weights`] (its AVX-512 or AVX2 loop where the CPU has it) against its definition
    /// written out in scalars: `exp64((x − max)/t)` per entry, 8 interleaved sums folded
    /// pairwise, bitwise, at T = 1 and T = 0.7, on a row with a remainder past the last 8.
    #[test]
    fn exp_weights_is_its_definition() {
        let x: Vec<f32> = (0..1003).map(|i| ((i * 7919) % 2003) as f32 / 97.0 - 10.0).collect();
        let max = super::row_max(&x);
        for t in [1.0, 0.7] {
            let mut w = vec![0.0f64; x.len()];
            let z = super::exp_weights(&x, max, t, &mut w);
            let want: Vec<f64> = x.iter().map(|&v| exp64((v as f64 - max) / t)).collect();
            let mut acc = [0.0f64; 8];
            for (j, e) in want.iter().enumerate() {
                acc[j % 8] += e;
            }
            let z_want = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
            assert!(w.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "weights at T = {t}");
            assert_eq!(z.to_bits(), z_want.to_bits(), "sum at T = {t}");
        }
    }

    /// [`super::row_max`] against a scalar fold: NaNs skipped wherever they fall, `−∞` rows,
    /// the maximum in the remainder past the last 16-lane chunk, an empty row.
    #[test]
    fn row_max_skips_nan() {
        let check = |row: &[f32], want: f64| assert_eq!(super::row_max(row).to_bits(), want.to_bits(), "{row:?}");
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
        row[3] = f32::NAN;
        row[20] = f32::NAN;
        check(&row, row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64);
        row[35] = 7.5;
        check(&row, 7.5);
        check(&[f32::NAN, f32::NEG_INFINITY], f64::NEG_INFINITY);
        check(&[], f64::NEG_INFINITY);
        check(&[f32::NAN; 20], f64::NEG_INFINITY);
    }
}
