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

/// Entropy `−Σ p log p` of `softmax(row / T)`, in f64 (nats).
pub fn entropy(row: &[f32], temperature: f32) -> f32 {
    let t = temperature as f64;
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = row.iter().map(|&v| ((v as f64 - max) / t).exp()).collect();
    let z: f64 = w.iter().sum();
    -w.iter().filter(|&&x| x > 0.0).map(|&x| (x / z) * (x / z).ln()).sum::<f64>() as f32
}

/// `(ℓ, H)` per row of `logits [m, v]`.
pub fn token_logprobs(logits: &[f32], v: usize, tokens: &[u32], temperature: f32) -> (Vec<f32>, Vec<f32>) {
    logits
        .par_chunks(v)
        .zip(tokens.par_iter())
        .map(|(row, &tok)| (token_logprob(row, tok as usize, temperature), entropy(row, temperature)))
        .unzip()
}

/// `dz = g·(onehot − p)/T + e·dH/dz` per row with `p = softmax(z/T)` and
/// `dH/dz_j = −(1/T)·p_j·(ln p_j + H)` (entropy bonus), in f64 per element.
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
        let zinv = 1.0 / w.iter().sum::<f64>();
        let (g, e, hh) = (dl_dlogp[i] as f64, dl_dentropy.map_or(0.0, |d| d[i] as f64), entropies[i] as f64);
        for (j, (o, &wj)) in out.iter_mut().zip(&w).enumerate() {
            let p = wj * zinv;
            let onehot = if j == tokens[i] as usize { 1.0 } else { 0.0 };
            let dh = if p > 0.0 { -tinv * p * (p.ln() + hh) } else { 0.0 };
            *o = (g * tinv * (onehot - p) + e * dh) as f32;
        }
    });
    dz
}
