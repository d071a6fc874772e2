//! The CPU sampler: [`crate::sample`]'s rule on one logits row, the reference the CUDA
//! sampler (`kernels/cuda/sampler.cu`) is tested against bit for bit.

use super::logprob;
use crate::sample::{Draw, RowTask, Sampled};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::borrow::Cow;

/// SplitMix64 finaliser (Steele et al. 2014): a well-mixed 64-bit hash of `x`.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Index of the largest value (first on ties); NaN never wins (a row of NaNs gives its last
/// index).
///
/// Two vectorisable passes: [`logprob::row_max`] (16 lanes; NaN never compares greater) and
/// the first index holding it. (The old loop's compare against the running best, the rule
/// the tests keep as `argmax_scalar`, ran at ~4 cycles per value: 230 µs of a greedy
/// token's 360 µs sampling over 49,152 logits.)
pub fn argmax(x: &[f32]) -> usize {
    let max = logprob::row_max(x) as f32;
    x.iter().position(|&v| v == max).unwrap_or(x.len().saturating_sub(1))
}

/// [`argmax`]'s rule one value at a time (the definition the tests check it against).
#[cfg(test)]
fn argmax_scalar(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best
}

/// `ln Σ exp(x)` in f64 (max-subtracted, the sampler's pass: [`logprob::exp_weights`]);
/// `-inf` when every entry is `-inf`.
pub fn logsumexp(x: &[f32]) -> f64 {
    let max = logprob::row_max(x);
    if max == f64::NEG_INFINITY {
        return max;
    }
    let mut w = vec![0.0f64; x.len()];
    max + logprob::exp_weights(x, max, 1.0, &mut w).ln()
}

/// The `k` largest entries of `x` as `(index, value)`, largest first in IEEE total order
/// (ties: lower index first).
pub fn top_k_of(x: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(x.len());
    if k == 0 {
        return vec![];
    }
    let cmp = |a: &usize, b: &usize| x[*b].total_cmp(&x[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..x.len()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx.into_iter().map(|i| (i as u32, x[i])).collect()
}

thread_local! {
    /// Each sampling thread's `exp(z − max)` buffer, one vocabulary long, reused across rows
    /// (a fresh 384 KiB zeroed allocation per row cost more than its exponentials).
    static RAW_WEIGHTS: std::cell::RefCell<Vec<f64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One row of [`crate::ops::sample`] on its logits `[vocab]`.
///
/// One pass of `exp(z − max)` in f64 over the raw row gives every raw log-probability:
/// `raw = (z_t − max) − ln Σ exp(z − max)`, bitwise the learner's formula at T = 1
/// ([`logprob::token_logprob`]); top entries are `z_i − (max + ln Σ)`. When the draw leaves
/// the row untouched ([`Draw::untouched`]) those same terms are its weights, so a row costs
/// one pass of exponentials and μ is the raw log-probability.
pub fn sample_row(logits: &[f32], task: &RowTask, top: usize) -> Sampled {
    RAW_WEIGHTS.with_borrow_mut(|raw_w| {
        let max = logprob::row_max(logits);
        raw_w.resize(logits.len(), 0.0);
        let raw_z = logprob::exp_weights(logits, max, 1.0, raw_w);
        let ln_z = raw_z.ln();
        let raw_lse = if max == f64::NEG_INFINITY { max } else { max + ln_z };
        let (token, behavior_logprob) = match task {
            RowTask::Score(t) => (*t as usize, Some(0.0)),
            RowTask::Draw(d) => draw_row(logits, d, (&raw_w[..], raw_z)),
        };
        let raw_logprob = ((logits[token] as f64 - max) - ln_z) as f32;
        let top_logprobs =
            top_k_of(logits, top).into_iter().map(|(i, _)| (i, (logits[i as usize] as f64 - raw_lse) as f32)).collect();
        Sampled {
            token: token as u32,
            behavior_logprob: behavior_logprob.unwrap_or(raw_logprob),
            raw_logprob,
            top_logprobs,
        }
    })
}

/// The draw of one row: bias, penalties, mask, then greedy or [`draw`]. Returns the token
/// and μ, `None` for the latter when μ is the raw log-probability (an untouched row).
fn draw_row(logits: &[f32], d: &Draw, raw: (&[f64], f64)) -> (usize, Option<f32>) {
    let p = &d.params;
    let mut l = Cow::Borrowed(logits);
    for &(t, b) in &d.bias {
        let v = &mut l.to_mut()[t as usize];
        *v = (*v as f64 + b) as f32;
    }
    if p.repetition_penalty != 1.0 {
        let l = l.to_mut();
        for &t in &d.rep_tokens {
            let v = &mut l[t as usize];
            *v = if *v > 0.0 { *v / p.repetition_penalty } else { *v * p.repetition_penalty };
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let l = l.to_mut();
        for &(t, c) in &d.out_counts {
            l[t as usize] -= p.frequency_penalty * c as f32 + p.presence_penalty;
        }
    }
    for &t in &d.mask {
        l.to_mut()[t as usize] = f32::NEG_INFINITY;
    }
    if d.is_greedy() {
        return (argmax(&l), Some(0.0));
    }
    draw(&l, d, d.untouched().then_some(raw))
}

/// Temperature, truncation, renormalisation and one draw. Returns the token and `ln p(token)`,
/// `None` for the latter when the draw used `weights` unchanged (μ is then the raw
/// log-probability, [`sample_row`]). Probabilities are `exp((l - max) / T)` in f64
/// ([`logprob::exp_weights`]), so the most likely token has weight 1: no overflow, no NaN,
/// and a sampled token always has p > 0, even for a tiny T. `weights`, when given, are those
/// values already computed for every token (T = 1) with their sum.
fn draw(l: &[f32], d: &Draw, weights: Option<(&[f64], f64)>) -> (usize, Option<f32>) {
    let p = &d.params;
    let t = p.temperature as f64;
    let truncated = d.truncates();
    // Candidates in a fixed order: index order without truncation (`ids` = None), else most
    // likely first; and their total weight.
    let owned: Vec<f64>;
    let (ids, w, total): (Option<Vec<usize>>, &[f64], f64) = if !truncated {
        match weights {
            Some((w, z)) => (None, w, z),
            None => {
                let mut w = vec![0.0f64; l.len()];
                let z = logprob::exp_weights(l, logprob::row_max(l), t, &mut w);
                owned = w;
                (None, &owned, z)
            }
        }
    } else {
        let k = if p.top_k > 0 { p.top_k as usize } else { l.len() };
        let top = top_k_of(l, k);
        let values: Vec<f32> = top.iter().map(|&(_, v)| v).collect();
        let mut ws = vec![0.0f64; values.len()];
        logprob::exp_weights(&values, logprob::row_max(l), t, &mut ws);
        let mut c: Vec<(usize, f64)> = top.iter().zip(ws).map(|(&(i, _), w)| (i as usize, w)).collect();
        if p.top_p < 1.0 {
            let total: f64 = c.iter().map(|x| x.1).sum();
            let (mut cum, mut keep) = (0.0, c.len());
            for (j, x) in c.iter().enumerate() {
                cum += x.1;
                if cum >= p.top_p as f64 * total {
                    keep = j + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            // c[0] is the most likely token (weight 1).
            let floor = p.min_p as f64 * c[0].1;
            c.retain(|x| x.1 >= floor);
        }
        let (ids, ws): (Vec<usize>, Vec<f64>) = c.into_iter().unzip();
        owned = ws;
        let total = owned.iter().sum();
        (Some(ids), &owned, total)
    };
    let token = |j: usize| ids.as_ref().map_or(j, |ids| ids[j]);
    let mut rng = StdRng::seed_from_u64(splitmix64(p.seed ^ splitmix64(p.step)));
    let u = rng.gen::<f64>() * total;
    let chosen = inverse_cdf(w, u)
        .or_else(|| w.iter().rposition(|&x| x > 0.0))
        .map_or_else(|| (argmax(l), 1.0), |j| (token(j), w[j]));
    (chosen.0, weights.is_none().then(|| (chosen.1 / total).ln() as f32))
}

/// The first `j` with `w_j > 0` and `u < w_j` once `w_0 .. w_{j−1}` are subtracted from `u`
/// (inverse-CDF sampling of `u ∈ [0, Σ w)`); `None` if `u` runs past the end (rounding).
/// Blocks of [`CDF_BLOCK`] weights whose sum does not exceed the rest of `u` are skipped
/// whole, so a 49,152-token row takes 768 dependent subtractions, not 49,152.
fn inverse_cdf(w: &[f64], mut u: f64) -> Option<usize> {
    for (b, blk) in w.chunks(CDF_BLOCK).enumerate() {
        let s = block_sum(blk);
        if u >= s {
            u -= s;
            continue;
        }
        for (i, &wj) in blk.iter().enumerate() {
            if wj > 0.0 && u < wj {
                return Some(b * CDF_BLOCK + i);
            }
            u -= wj;
        }
    }
    None
}

/// Weights per block of [`inverse_cdf`].
const CDF_BLOCK: usize = 64;

/// `Σ blk` in 8 interleaved partial sums (vectorisable).
fn block_sum(blk: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut it = blk.chunks_exact(8);
    for c in &mut it {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum::<f64>() + it.remainder().iter().sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-pass [`argmax`] against the scalar rule and hand-picked answers: ties (first
    /// wins, also `+0`/`−0`), the maximum in the remainder past the 16-lane chunks, all
    /// `−inf`, NaNs (never the answer, unless the row is all NaN: its last index), empty.
    #[test]
    fn argmax_is_the_first_maximum() {
        let check = |x: &[f32], want: usize| {
            assert_eq!(argmax(x), want, "{x:?}");
            assert_eq!(argmax_scalar(x), want, "{x:?}");
        };
        let mut x: Vec<f32> = (0..37).map(|i| (i % 7) as f32).collect();
        check(&x, 6);
        x[20] = 9.0;
        x[33] = 9.0;
        check(&x, 20);
        x[35] = 10.0;
        check(&x, 35);
        check(&[-0.0, 0.0, -1.0], 0);
        check(&[f32::NEG_INFINITY; 40], 0);
        let mut y = vec![1.0f32; 40];
        y[3] = f32::NAN;
        y[17] = 2.0;
        check(&y, 17);
        check(&[f32::NAN, 1.0, 3.0, f32::NAN], 2);
        check(&[f32::NAN, f32::NEG_INFINITY], 1);
        check(&[f32::NAN; 3], 2);
        check(&[], 0);
    }

    /// [`inverse_cdf`] against the definition (one subtraction per weight, in order), on
    /// weights in eighths, whose sums are exact in f64, so both must give the same index for
    /// every `u`: zero weights (never picked), a block of zeros, a partial last block, and
    /// `u` on block boundaries and past the end.
    #[test]
    fn inverse_cdf_is_the_sequential_scan() {
        let w: Vec<f64> =
            (0..300).map(|i| if (64..128).contains(&i) { 0.0 } else { ((i * 5) % 9) as f64 / 8.0 }).collect();
        let sequential = |mut u: f64| {
            for (j, &wj) in w.iter().enumerate() {
                if wj > 0.0 && u < wj {
                    return Some(j);
                }
                u -= wj;
            }
            None
        };
        let total: f64 = w.iter().sum();
        let block0: f64 = w[..64].iter().sum();
        for u in (0..=(total * 8.0) as usize + 2).map(|q| q as f64 / 8.0).chain([block0, 0.3, total - 1e-9]) {
            assert_eq!(inverse_cdf(&w, u), sequential(u), "u = {u}");
        }
        assert_eq!(inverse_cdf(&w, total), None);
        assert_eq!(inverse_cdf(&w, 0.0), Some(1), "w[0] = 0 is never drawn");
    }
}
