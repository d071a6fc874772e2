//! RL policy losses on per-token log-probabilities (TRL / verl names), returning the loss
//! and its derivative w.r.t. every learner logprob ℓ, which [`crate::SeqForward::backward`]
//! turns into weight gradients.
//!
//! Per completion token t of sample i: ℓ = log π_θ (at the sampling temperature), μ = the
//! behaviour logprob recorded by the engine, A_i the sample's advantage.
//! - token level (PPO, Schulman et al. 2017, eq. 7; GRPO, Shao et al. 2024, eq. 3; DAPO
//!   clip-higher, Yu et al. 2025, eq. 10): r = exp(ℓ − μ), l_t = −min(r·A, clip(r, 1−ε, 1+ε_high)·A);
//! - sequence level (GSPO, Zheng et al. 2025, eq. 5–7): s = exp(mean_t(ℓ − μ)), the same clipped
//!   objective with s for every token of the sample;
//! - `beta > 0` adds β·KL(π_θ‖π_ref) per token with estimator k1 = ℓ − ℓ_ref,
//!   k2 = ½(ℓ − ℓ_ref)², k3 = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1 (Schulman, "Approximating KL", 2020);
//! - aggregation `loss_type`: `grpo` = mean over samples of the per-sample token mean;
//!   `dapo`/`bnpo` = Σ tokens / Σ completion lengths; `dr_grpo` = Σ tokens / (N · max_completion_length)
//!   (Liu et al. 2025, "Understanding R1-Zero-Like Training"); `ppo` = the token mean over the
//!   mini-batch (TRL `PPOTrainer`'s `masked_mean`, verl `token-mean`), with a per-token
//!   advantage `Â_t` (GAE, `algos::gae`) in place of the sample's `A`;
//! - `dpo` / `ipo` are not policy losses over sampled tokens: see `algos::dpo`.
//! - `off_policy_correction` (ℓ_old = π_prox = the learner's logprob at the start of the
//!   batch: `SampleLogprobs::prox_logp`, or ℓ itself, detached, for one optimizer step per batch):
//!   - `ppo_clip`: the ratio against μ, as above;
//!   - `tis` (truncated IS, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
//!     Off-Policy RL Training"): the clipped objective on r = exp(ℓ − ℓ_old), times the
//!     detached behaviour weight min(exp(ℓ_old − μ), tis_cap);
//!   - `decoupled` (AReaL decoupled PPO, Fu et al. 2025, eq. 5; `ppo_actor_loss_fn` with
//!     `behav_imp_weight_cap`): the same clipped objective on π_θ/π_prox, times the
//!     behaviour weight π_prox/μ, and tokens whose weight exceeds `tis_cap` are masked
//!     (weight 0) rather than truncated;
//!   - `mis` (masked IS): the `ppo_clip` objective, and tokens (or whole samples at sequence
//!     level) whose exp(ℓ_old − μ) leaves [mis_low, mis_high] get no loss.
//!
//!   At sequence level the ratios and weights use the mean over the sample's tokens.
//!   Masked tokens still count in the `loss_type` normaliser.

use crate::TrainConfig;
use serde::{Deserialize, Serialize};

/// The learner's objective. The first four are GRPO-family policy losses on group
/// advantages; `ppo` trains a value head and uses GAE ([`crate::algos::ppo`]); `dpo` (alias
/// `sigmoid`, TRL `DPOConfig`'s name) and `ipo` learn from preference pairs
/// ([`crate::algos::dpo`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    Grpo,
    Dapo,
    Bnpo,
    DrGrpo,
    Ppo,
    #[serde(alias = "sigmoid")]
    Dpo,
    Ipo,
}

impl LossType {
    /// DPO or IPO: trained on preference pairs, not on sampled tokens with advantages.
    pub fn is_preference(self) -> bool {
        matches!(self, LossType::Dpo | LossType::Ipo)
    }

    /// The GRPO family: advantages from groups of samples of one prompt.
    pub fn is_group_relative(self) -> bool {
        matches!(self, LossType::Grpo | LossType::Dapo | LossType::Bnpo | LossType::DrGrpo)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImportanceSamplingLevel {
    Token,
    Sequence,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    K1,
    K2,
    K3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffPolicyCorrection {
    PpoClip,
    Tis,
    Mis,
    Decoupled,
}

/// One sample's inputs to the loss.
pub struct SampleLogprobs<'a> {
    /// ℓ per completion token.
    pub logp: &'a [f32],
    /// μ per completion token.
    pub behavior: &'a [f32],
    /// ℓ_ref per token (needed when `beta > 0`).
    pub ref_logp: Option<&'a [f32]>,
    /// ℓ_old = π_prox per token for `tis` / `decoupled` / `mis`; `None` = ℓ (detached).
    pub prox_logp: Option<&'a [f32]>,
    /// The sample's advantage `A` (every token), unless `token_advantages` is given.
    pub advantage: f32,
    /// Per-token advantages `Â_t` (PPO's GAE); when given they replace `advantage`.
    pub token_advantages: Option<&'a [f32]>,
}

/// Loss statistics of one batch.
#[derive(Debug, Clone, Default, Serialize)]
pub struct LossStats {
    pub loss: f64,
    /// Fraction of tokens whose ratio was clipped below / above / either.
    pub clip_ratio_low: f64,
    pub clip_ratio_high: f64,
    pub clip_ratio: f64,
    /// Mean per-token KL estimate to the reference (0 without one).
    pub kl: f64,
    /// |ℓ − μ|: mean and max.
    pub mismatch_mean: f64,
    pub mismatch_max: f64,
    /// Fraction of tokens given no loss by an off-policy correction: `decoupled`'s
    /// behaviour weight above `tis_cap`, `mis`'s outside `[mis_low, mis_high]`.
    pub masked_ratio: f64,
    /// Importance ratio exp(ℓ − μ) per token: min, mean, max.
    pub ratio_min: f64,
    pub ratio_mean: f64,
    pub ratio_max: f64,
    pub tokens: usize,
}

/// Per-token weights of the aggregation (`loss_type`) for samples of these lengths.
pub fn token_weights(lens: &[usize], cfg: &TrainConfig) -> Vec<f64> {
    let n = lens.len().max(1) as f64;
    let total: usize = lens.iter().sum();
    lens.iter()
        .map(|&len| match cfg.loss_type {
            LossType::Grpo => 1.0 / (len.max(1) as f64 * n),
            LossType::Dapo | LossType::Bnpo | LossType::Ppo | LossType::Dpo | LossType::Ipo => {
                1.0 / total.max(1) as f64
            }
            LossType::DrGrpo => 1.0 / (n * cfg.max_completion_length.max(1) as f64),
        })
        .collect()
}

/// The loss of a batch and `dL/dℓ` per token of every sample.
pub fn policy_loss(samples: &[SampleLogprobs], cfg: &TrainConfig) -> (LossStats, Vec<Vec<f32>>) {
    let weights = token_weights(&samples.iter().map(|s| s.logp.len()).collect::<Vec<_>>(), cfg);
    let total_tokens: usize = samples.iter().map(|s| s.logp.len()).sum();
    let mut st = LossStats { ratio_min: f64::INFINITY, ratio_max: 0.0, tokens: total_tokens, ..Default::default() };
    let (lo, hi) = (1.0 - cfg.epsilon as f64, 1.0 + cfg.epsilon_high as f64);
    let mut grads = Vec::with_capacity(samples.len());
    let (mut clipped_lo, mut clipped_hi, mut kl_sum, mut mm_sum, mut ratio_sum) = (0usize, 0usize, 0.0, 0.0, 0.0);
    let mut masked_tokens = 0usize;
    for s in samples {
        let len = s.logp.len();
        // Per-token weight of the aggregation.
        let norm = weights[grads.len()];
        let adv = |t: usize| s.token_advantages.map_or(s.advantage, |a| a[t]) as f64;
        let d: Vec<f64> = s.logp.iter().zip(s.behavior).map(|(&l, &m)| l as f64 - m as f64).collect();
        for &x in &d {
            let r = x.exp();
            st.ratio_min = st.ratio_min.min(r);
            st.ratio_max = st.ratio_max.max(r);
            ratio_sum += r;
            mm_sum += x.abs();
            st.mismatch_max = st.mismatch_max.max(x.abs());
        }
        let seq_ratio = (d.iter().sum::<f64>() / len.max(1) as f64).exp();
        // ℓ_old: the proximal policy's logprob (ℓ itself when not given).
        let prox: Vec<f64> = match s.prox_logp {
            Some(p) => p.iter().map(|&x| x as f64).collect(),
            None => s.logp.iter().map(|&x| x as f64).collect(),
        };
        let mean = |v: &mut dyn Iterator<Item = f64>| v.sum::<f64>() / len.max(1) as f64;
        // ℓ − ℓ_old and ℓ_old − μ, per token and as the sample's mean.
        let d_new: Vec<f64> = s.logp.iter().zip(&prox).map(|(&l, p)| l as f64 - p).collect();
        let d_old: Vec<f64> = prox.iter().zip(s.behavior).map(|(p, &m)| p - m as f64).collect();
        let (seq_new, seq_old) = (mean(&mut d_new.iter().copied()).exp(), mean(&mut d_old.iter().copied()).exp());
        let sequence = cfg.importance_sampling_level == ImportanceSamplingLevel::Sequence;
        let mut g = vec![0.0f32; len];
        for t in 0..len {
            let a = adv(t);
            // The ratio in the clipped objective, its derivative w.r.t. ℓ_t, and a detached weight.
            let (ratio, dratio, weight) = match (cfg.off_policy_correction, sequence) {
                (OffPolicyCorrection::PpoClip | OffPolicyCorrection::Mis, false) => (d[t].exp(), d[t].exp(), 1.0),
                (OffPolicyCorrection::PpoClip | OffPolicyCorrection::Mis, true) => {
                    (seq_ratio, seq_ratio / len as f64, 1.0)
                }
                (OffPolicyCorrection::Tis | OffPolicyCorrection::Decoupled, _) => {
                    let (r, dr, w) = if sequence {
                        (seq_new, seq_new / len as f64, seq_old)
                    } else {
                        (d_new[t].exp(), d_new[t].exp(), d_old[t].exp())
                    };
                    let cap = cfg.tis_cap as f64;
                    let w = match cfg.off_policy_correction {
                        OffPolicyCorrection::Tis => w.min(cap),
                        _ if w > cap => {
                            masked_tokens += 1;
                            0.0
                        }
                        _ => w,
                    };
                    (r, dr, w)
                }
            };
            let masked = cfg.off_policy_correction == OffPolicyCorrection::Mis && {
                let w = if sequence { seq_old } else { d_old[t].exp() };
                w < cfg.mis_low as f64 || w > cfg.mis_high as f64
            };
            let clipped = ratio.clamp(lo, hi);
            let (unclipped_obj, clipped_obj) = (ratio * a, clipped * a);
            let use_unclipped = unclipped_obj <= clipped_obj;
            if !use_unclipped {
                if ratio < lo {
                    clipped_lo += 1;
                } else {
                    clipped_hi += 1;
                }
            }
            let mut lt = -weight * unclipped_obj.min(clipped_obj);
            let mut dlt_dl = if use_unclipped { -weight * a * dratio } else { 0.0 };
            // KL is reported whenever a reference is present (also at beta = 0: a drift signal).
            if cfg.beta > 0.0 || s.ref_logp.is_some() {
                let lr = s.ref_logp.map(|r| r[t] as f64).unwrap_or(s.logp[t] as f64);
                let x = s.logp[t] as f64 - lr;
                let (kl, dkl) = match cfg.kl_estimator {
                    KlEstimator::K1 => (x, 1.0),
                    KlEstimator::K2 => (0.5 * x * x, x),
                    KlEstimator::K3 => ((-x).exp() + x - 1.0, 1.0 - (-x).exp()),
                };
                kl_sum += kl;
                lt += cfg.beta as f64 * kl;
                dlt_dl += cfg.beta as f64 * dkl;
            }
            if masked {
                masked_tokens += 1;
                continue;
            }
            st.loss += lt * norm;
            // Sequence-level ratios couple every token of the sample.
            if sequence && use_unclipped {
                let share = -weight * a * dratio * norm;
                for gt in g.iter_mut() {
                    *gt += share as f32;
                }
                dlt_dl -= -weight * a * dratio;
            }
            g[t] += (dlt_dl * norm) as f32;
        }
        grads.push(g);
    }
    let tt = total_tokens.max(1) as f64;
    st.clip_ratio_low = clipped_lo as f64 / tt;
    st.clip_ratio_high = clipped_hi as f64 / tt;
    st.clip_ratio = (clipped_lo + clipped_hi) as f64 / tt;
    st.masked_ratio = masked_tokens as f64 / tt;
    st.kl = kl_sum / tt;
    st.mismatch_mean = mm_sum / tt;
    st.ratio_mean = ratio_sum / tt;
    if total_tokens == 0 {
        st.ratio_min = 0.0;
    }
    (st, grads)
}
