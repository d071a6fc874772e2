//! Advantage estimation for PPO over completion tokens: per-token rewards (the score at the
//! last token, an optional KL penalty per token), generalized advantage estimation, batch
//! whitening, and the explained variance of the value predictions.

/// Per-token rewards of one completion (InstructGPT, Ouyang et al. 2022, eq. 2; TRL
/// `PPOTrainer`): `r_t = −kl_coef · (ℓ_old,t − ℓ_ref,t)` on every token (the k1 estimate of
/// KL(π_old ‖ π_ref) at the sampled token), plus the sequence's `score` at the last token.
/// Without a reference (`ref_logp = None`) or with `kl_coef = 0` only the score remains.
pub fn token_rewards(score: f64, old_logp: &[f32], ref_logp: Option<&[f32]>, kl_coef: f64) -> Vec<f64> {
    let mut r: Vec<f64> = match ref_logp {
        Some(rf) if kl_coef != 0.0 => {
            old_logp.iter().zip(rf).map(|(&l, &q)| -kl_coef * (l as f64 - q as f64)).collect()
        }
        _ => vec![0.0; old_logp.len()],
    };
    if let Some(last) = r.last_mut() {
        *last += score;
    }
    r
}

/// Generalized advantage estimation (Schulman et al. 2016, "High-Dimensional Continuous
/// Control Using Generalized Advantage Estimation", eq. 16) over one completion of `T`
/// tokens, computed backwards as in TRL's `PPOTrainer` and verl's
/// `compute_gae_advantage_return`:
///
/// `δ_t = r_t + γ·V_{t+1} − V_t` (with `V_T = 0`: the completion ends the episode),
/// `Â_t = δ_t + γλ·Â_{t+1}` (`Â_T = 0`).
///
/// `λ = 0` gives the one-step TD error `δ_t`; `λ = 1` gives the discounted return minus the
/// value, `Σ_{k≥t} γ^{k−t} r_k − V_t`. Returns `Â`; the value targets are `Â_t + V_t`
/// ([`returns`]).
pub fn gae(rewards: &[f64], values: &[f64], gamma: f64, lam: f64) -> Vec<f64> {
    assert_eq!(rewards.len(), values.len(), "one value per reward");
    let mut adv = vec![0.0; rewards.len()];
    let mut last = 0.0;
    for t in (0..rewards.len()).rev() {
        let next = if t + 1 < values.len() { values[t + 1] } else { 0.0 };
        let delta = rewards[t] + gamma * next - values[t];
        last = delta + gamma * lam * last;
        adv[t] = last;
    }
    adv
}

/// Value targets `R_t = Â_t + V_t` (before the advantages are whitened).
pub fn returns(advantages: &[f64], values: &[f64]) -> Vec<f64> {
    advantages.iter().zip(values).map(|(a, v)| a + v).collect()
}

/// Whitens `x` in place over every token of the batch: `(x − mean) / sqrt(var + 1e-8)` with
/// the unbiased variance (TRL `masked_whiten`, `shift_mean = True`). Fewer than two values
/// are only centred.
pub fn whiten(x: &mut [f64]) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    if n < 2 {
        x.iter_mut().for_each(|v| *v -= mean);
        return;
    }
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    let s = 1.0 / (var + 1e-8).sqrt();
    x.iter_mut().for_each(|v| *v = (*v - mean) * s);
}

/// Explained variance of the value predictions, `1 − Var(R − V) / Var(R)` (population
/// variances; stable-baselines3 `explained_variance`, verl `vf_explained_var`): 1 for
/// perfect predictions, 0 for predicting the mean, negative when worse. NaN when the
/// returns have zero variance.
pub fn explained_variance(values: &[f64], returns: &[f64]) -> f64 {
    let var = |x: &mut dyn Iterator<Item = f64>| {
        let v: Vec<f64> = x.collect();
        let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
        v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len().max(1) as f64
    };
    let vr = var(&mut returns.iter().copied());
    if vr == 0.0 {
        return f64::NAN;
    }
    1.0 - var(&mut returns.iter().zip(values).map(|(r, v)| r - v)) / vr
}
