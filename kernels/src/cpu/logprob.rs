//! Token log-probabilities, entropies and their gradient w.r.t. the logits.

use rayon::prelude::*;

/// `log softmax(logits / T)[token]`, in f64 with the max subtracted: the one formula for the
/// sampler's `raw_logprob` (T = 1) and the learner's ℓ (DESIGN-NOTES §3), so equal logits
/// give bitwise-equal log-probabilities.
pub fn token_logprob(logits: &[f32], token: usize, temperature: f32) -> f32 {
    let t = temperature as f64;
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = logits.iter().map(|&v| ((v as f64 - max) / t).exp()).sum();
    ((logits[token] as f64 - max) / t - z.ln()) as f32
}

/// [`token_logprob`] (bitwise: the same exponentials, summed in the same order) and the
/// entropy `−Σ p log p` of `softmax(row / T)` (f64, nats) of one row from one pass of exponentials. With `w_j = exp((z_j − max)/T)`,
/// `Z = Σ w_j` and `ln p_j = (z_j − max)/T − ln Z`, the entropy is
/// `H = −Σ p_j ln p_j = ln Z − Σ_j p_j·(z_j − max)/T` (terms with `w_j = 0` skipped): no
/// logarithm per element.
fn logprob_and_entropy(row: &[f32], token: usize, temperature: f32) -> (f32, f32) {
    let t = temperature as f64;
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = row.iter().map(|&v| ((v as f64 - max) / t).exp()).collect();
    let z: f64 = w.iter().sum();
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
    let tinv = 1.0 / temperature as f64;
    let mut dz = vec![0.0f32; logits.len()];
    dz.par_chunks_mut(v).zip(logits.par_chunks(v)).enumerate().for_each(|(i, (out, row))| {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let w: Vec<f64> = row.iter().map(|&x| ((x as f64 - max) * tinv).exp()).collect();
        let z: f64 = w.iter().sum();
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
