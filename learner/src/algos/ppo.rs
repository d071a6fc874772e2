//! RLHF-PPO (Ouyang et al. 2022, "Training language models to follow instructions with
//! human feedback", §3.5 and eq. 2; PPO, Schulman et al. 2017, eq. 7 and 9), with the
//! semantics of TRL's `PPOTrainer` and verl / OpenRLHF:
//!
//! 1. **Rollout targets**, once per batch, at the weights the batch starts from (π_old):
//!    one forward gives ℓ_old per completion token and the values `V_old` (the value head,
//!    [`super::value_head`]); per-token rewards are the score at the last token plus
//!    `−kl_coef · (ℓ_old − ℓ_ref)` on every token ([`gae::token_rewards`]); GAE
//!    ([`gae::gae`], `gamma`, `lam`) gives `Â_t`; returns `R_t = Â_t + V_old,t`; the
//!    advantages are whitened over the batch's tokens ([`gae::whiten`]).
//! 2. **Updates**: `num_ppo_epochs` passes, each over the batch shuffled and split into
//!    `num_mini_batches`; every mini-batch is one AdamW step on
//!    `L = L_policy + vf_coef · L_value`:
//!    - `L_policy`: the clipped objective of `grpo.rs` with `Â_t` per token, token-mean
//!      aggregation, and ℓ_old passed as π_prox, so every `off_policy_correction` works as in
//!      GRPO (`ppo_clip`: the ratio against μ, which equals π_old when on-policy; `tis` /
//!      `decoupled`: π_θ/π_old times the behaviour weight π_old/μ; `mis`);
//!    - `L_value = ½ · mean_t max((V − R)², (V_old + clip(V − V_old, ±cliprange_value) − R)²)`
//!      ([`value_loss`], TRL), whose gradient reaches the trunk through the value head.
//!
//! Every update bumps the policy version; staleness is measured once, at the batch's start.

use super::gae;
use crate::algos::grpo::{policy_loss, LossStats, SampleLogprobs};
use crate::error::{LearnerError, Result};
use crate::trainer::{check_behavior, mean_stats, offsets, Selection};
use crate::{
    forward_batch, forward_batch_with, Grads, OutputGrads, SeqForward, StepMetrics, TrainConfig, TrainSample, Trainer,
};
use engine::{Model, SharedModel};
use serde::Serialize;
use std::time::Instant;

/// PPO's metrics of one batch (the value loss and clip fraction: the mean over its updates).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PpoStats {
    /// `L_value` (before `vf_coef`).
    pub value_loss: f64,
    /// Fraction of tokens whose clipped value term was the larger one (TRL `val/clipfrac`).
    pub value_clipfrac: f64,
    /// `1 − Var(R − V_old) / Var(R)` over the batch's tokens ([`gae::explained_variance`]).
    pub explained_variance: f64,
    /// Mean value target `R_t` per token.
    pub returns_mean: f64,
    /// Mean `V_old` per token.
    pub values_mean: f64,
    /// Mean over samples of the summed KL penalty `Σ_t −kl_coef · (ℓ_old − ℓ_ref)` (TRL
    /// `objective/non_score_reward`).
    pub non_score_reward: f64,
}

/// One sample's rollout quantities at the start of a batch.
pub struct PpoInput<'a> {
    /// ℓ_old per completion token.
    pub old_logp: &'a [f32],
    /// ℓ_ref per token (for the KL penalty), if a reference is kept.
    pub ref_logp: Option<&'a [f32]>,
    /// `V_old` per token.
    pub values: &'a [f32],
    /// The sequence's reward (at its last token).
    pub score: f32,
}

/// The targets of one batch, per sample and token.
pub struct PpoTargets {
    /// Whitened GAE advantages.
    pub advantages: Vec<Vec<f32>>,
    /// Value targets `Â + V_old` (before whitening).
    pub returns: Vec<Vec<f32>>,
    /// Explained variance, means and the KL penalty (value loss and clip fraction unset).
    pub stats: PpoStats,
}

/// Step 1 of the module docs for a batch of samples.
pub fn targets(inputs: &[PpoInput], cfg: &TrainConfig) -> PpoTargets {
    let (gamma, lam, kl_coef) = (cfg.gamma as f64, cfg.lam as f64, cfg.kl_coef as f64);
    let (mut adv, mut ret, mut penalty) = (vec![], vec![], 0.0);
    for s in inputs {
        let rewards = gae::token_rewards(s.score as f64, s.old_logp, s.ref_logp, kl_coef);
        penalty += rewards.iter().sum::<f64>() - s.score as f64;
        let values: Vec<f64> = s.values.iter().map(|&v| v as f64).collect();
        let a = gae::gae(&rewards, &values, gamma, lam);
        ret.push(gae::returns(&a, &values));
        adv.push(a);
    }
    let flat_ret: Vec<f64> = ret.concat();
    let flat_val: Vec<f64> = inputs.iter().flat_map(|s| s.values.iter().map(|&v| v as f64)).collect();
    let mut flat_adv: Vec<f64> = adv.concat();
    gae::whiten(&mut flat_adv);
    let tokens = flat_ret.len().max(1) as f64;
    let mut start = 0;
    let advantages = adv
        .iter()
        .map(|a| {
            let v = flat_adv[start..start + a.len()].iter().map(|&x| x as f32).collect();
            start += a.len();
            v
        })
        .collect();
    PpoTargets {
        advantages,
        returns: ret.iter().map(|r| r.iter().map(|&x| x as f32).collect()).collect(),
        stats: PpoStats {
            explained_variance: gae::explained_variance(&flat_val, &flat_ret),
            returns_mean: flat_ret.iter().sum::<f64>() / tokens,
            values_mean: flat_val.iter().sum::<f64>() / tokens,
            non_score_reward: penalty / inputs.len().max(1) as f64,
            ..Default::default()
        },
    }
}

/// The clipped value loss of TRL's `PPOTrainer` over the tokens of a mini-batch:
/// `½ · mean_t max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t, −c, c) − R_t)²)`. Returns
/// `(loss, clip fraction, dL/dV per token)`; the clipped branch has no gradient where it is
/// the larger (V outside `V_old ± c`).
pub fn value_loss(vpred: &[f32], v_old: &[f32], returns: &[f32], cliprange_value: f32) -> (f64, f64, Vec<f32>) {
    let n = vpred.len().max(1) as f64;
    let c = cliprange_value as f64;
    let (mut loss, mut clipped, mut grad) = (0.0, 0usize, Vec::with_capacity(vpred.len()));
    for ((&v, &old), &r) in vpred.iter().zip(v_old).zip(returns) {
        let (v, old, r) = (v as f64, old as f64, r as f64);
        let vc = old + (v - old).clamp(-c, c);
        let (l1, l2) = ((v - r).powi(2), (vc - r).powi(2));
        if l2 > l1 {
            clipped += 1;
            loss += 0.5 * l2 / n;
            grad.push(0.0);
        } else {
            loss += 0.5 * l1 / n;
            grad.push(((v - r) / n) as f32);
        }
    }
    (loss, clipped as f64 / n, grad)
}

/// A batch prepared for PPO updates: the kept samples and their targets.
struct Rollout<'b> {
    sel: Selection<'b>,
    old_logp: Vec<Vec<f32>>,
    ref_logp: Option<Vec<Vec<f32>>>,
    values: Vec<Vec<f32>>,
    targets: PpoTargets,
}

impl Trainer {
    /// Step 1 (targets) on `batch`; also returns the forward over the kept samples at π_old
    /// (in batch order), which the first update reuses when there is one mini-batch.
    fn ppo_rollout<'b>(&self, model: &Model, batch: &'b [TrainSample]) -> Result<(Rollout<'b>, SeqForward)> {
        let c = &self.config;
        check_behavior(batch)?;
        if let Some(i) = batch.iter().position(|s| s.reward.is_none()) {
            return Err(LearnerError::Batch(format!(
                "sample {i}: loss_type = \"ppo\" needs a `reward` on every sample"
            )));
        }
        let sel = self.select(model, batch, &|_| true);
        if sel.kept.is_empty() {
            return Err(LearnerError::EmptyBatch);
        }
        let seqs: Vec<(&[u32], &[u32])> =
            sel.kept.iter().map(|(_, s)| (s.prompt_ids.as_slice(), s.completion_ids.as_slice())).collect();
        let fwd = forward_batch_with(model, &seqs, c.temperature, c.recompute(model))?;
        let head = self.value_head.as_ref().expect("PPO trainers have a value head");
        let values_flat = head.values(fwd.hidden())?;
        let ref_flat = match &self.reference {
            Some(r) => Some(forward_batch(r, &seqs, c.temperature)?.logprobs),
            None => None,
        };
        let o = offsets(&fwd.lens);
        let split = |v: &[f32]| -> Vec<Vec<f32>> { (0..fwd.lens.len()).map(|k| v[o[k]..o[k + 1]].to_vec()).collect() };
        let (old_logp, values) = (split(&fwd.logprobs), split(&values_flat));
        let ref_logp = ref_flat.as_deref().map(split);
        let inputs: Vec<PpoInput> = sel
            .kept
            .iter()
            .enumerate()
            .map(|(k, (_, s))| PpoInput {
                old_logp: &old_logp[k],
                ref_logp: ref_logp.as_ref().map(|r| r[k].as_slice()),
                values: &values[k],
                score: s.reward.unwrap_or(0.0) + self.overlong_penalty(s.completion_ids.len()),
            })
            .collect();
        let targets = targets(&inputs, c);
        Ok((Rollout { sel, old_logp, ref_logp, values, targets }, fwd))
    }

    /// The loss and gradient of one mini-batch (`idx`: positions in the rollout's kept
    /// samples) given its forward `fwd` at the current weights.
    fn ppo_minibatch(
        &self,
        model: &Model,
        r: &Rollout,
        idx: &[usize],
        fwd: &SeqForward,
    ) -> Result<(LossStats, f64, f64, Grads)> {
        let c = &self.config;
        let o = offsets(&fwd.lens);
        let samples: Vec<SampleLogprobs> = idx
            .iter()
            .enumerate()
            .map(|(k, &i)| SampleLogprobs {
                logp: &fwd.logprobs[o[k]..o[k + 1]],
                behavior: &r.sel.kept[i].1.behavior_logprobs,
                ref_logp: r.ref_logp.as_ref().map(|v| v[i].as_slice()),
                prox_logp: Some(&r.old_logp[i]),
                advantage: 0.0,
                token_advantages: Some(&r.targets.advantages[i]),
            })
            .collect();
        let (mut stats, dl) = policy_loss(&samples, c);
        let dl: Vec<f32> = dl.concat();
        let (bonus, de) = self.entropy_bonus(fwd);
        stats.loss += bonus;
        let head = self.value_head.as_ref().expect("PPO trainers have a value head");
        let vpred = head.values(fwd.hidden())?;
        let cat = |v: &Vec<Vec<f32>>| -> Vec<f32> { idx.iter().flat_map(|&i| v[i].iter().copied()).collect() };
        let (vl, clipfrac, dv) = value_loss(&vpred, &cat(&r.values), &cat(&r.targets.returns), c.cliprange_value);
        stats.loss += c.vf_coef as f64 * vl;
        let dv: Vec<f32> = dv.iter().map(|g| g * c.vf_coef).collect();
        let mut grads = Grads::default();
        let dh = head.backward(fwd.hidden(), &dv, &mut grads)?;
        let g = OutputGrads { dl_dlogp: &dl, dl_dentropy: de.as_deref(), dl_dhidden: Some(&dh) };
        fwd.backward(model, &g, &mut grads)?;
        Ok((stats, vl, clipfrac, grads))
    }

    /// The gradient of the first PPO update of `batch` taken as one mini-batch (π = π_old).
    pub(crate) fn ppo_gradients(&self, model: &Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let (r, fwd) = self.ppo_rollout(model, batch)?;
        let all: Vec<usize> = (0..r.sel.kept.len()).collect();
        let (stats, vl, clipfrac, grads) = self.ppo_minibatch(model, &r, &all, &fwd)?;
        let m = self.ppo_metrics(
            batch,
            &r,
            &fwd,
            t0,
            stats,
            PpoStats { value_loss: vl, value_clipfrac: clipfrac, ..r.targets.stats.clone() },
        );
        Ok((m, grads))
    }

    /// The metrics of a PPO batch.
    fn ppo_metrics(
        &self,
        batch: &[TrainSample],
        r: &Rollout,
        fwd0: &SeqForward,
        t0: Instant,
        loss: LossStats,
        ppo: PpoStats,
    ) -> StepMetrics {
        let rewards: Vec<f64> = batch
            .iter()
            .map(|s| (s.reward.unwrap_or(0.0) + self.overlong_penalty(s.completion_ids.len())) as f64)
            .collect();
        let n = rewards.len().max(1) as f64;
        let mean = rewards.iter().sum::<f64>() / n;
        let std = if rewards.len() < 2 {
            0.0
        } else {
            (rewards.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
        };
        StepMetrics {
            loss,
            reward_mean: mean,
            reward_std: std,
            ppo: Some(ppo),
            ..self.base_metrics(batch, &r.sel, fwd0, t0)
        }
    }

    /// A whole PPO batch: targets at π_old, then `num_ppo_epochs × num_mini_batches` updates
    /// (mini-batches reshuffled every epoch, seeded by the trainer's batch count). Returns the
    /// gradient of the last update.
    pub(crate) fn ppo_step(&mut self, model: &SharedModel, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let (r, fwd0) = self.ppo_rollout(&model.read(), batch)?;
        // Entropy, lengths and staleness: the batch at π_old.
        let mut metrics = self.ppo_metrics(batch, &r, &fwd0, t0, LossStats::default(), PpoStats::default());
        // The rollout: the policy's (and the reference's) forward and the value head.
        metrics.forward_seconds = t0.elapsed().as_secs_f64();
        let c = self.config.clone();
        let n = r.sel.kept.len();
        let m = c.num_mini_batches.min(n);
        // With one mini-batch the first update is at π_old: the rollout's forward is reused.
        let mut reuse = (m == 1).then_some(fwd0);
        let (mut losses, mut vls, mut clips, mut norms) = (vec![], vec![], vec![], vec![]);
        let mut last = (Grads::default(), 0.0, 0);
        for epoch in 0..c.num_ppo_epochs {
            let order = shuffled(n, engine::sampling::splitmix64(self.batches) ^ epoch as u64, m > 1);
            for chunk in split(&order, m) {
                let fwd = match reuse.take() {
                    Some(f) => f,
                    None => {
                        let kept = |i: usize| r.sel.kept[i].1;
                        let seqs: Vec<(&[u32], &[u32])> = chunk
                            .iter()
                            .map(|&i| (kept(i).prompt_ids.as_slice(), kept(i).completion_ids.as_slice()))
                            .collect();
                        let served = model.read();
                        let f = forward_batch_with(&served, &seqs, c.temperature, c.recompute(&served))?;
                        metrics.forward_seconds += f.forward_seconds;
                        f
                    }
                };
                let (stats, vl, clipfrac, grads) = self.ppo_minibatch(&model.read(), &r, &chunk, &fwd)?;
                drop(fwd);
                let u = self.update(model, &grads)?;
                metrics.backward_seconds += grads.backward_seconds;
                metrics.optimizer_seconds += u.optimizer_seconds;
                losses.push(stats);
                vls.push(vl);
                clips.push(clipfrac);
                norms.push(u.grad_norm);
                metrics.pause_seconds += u.pause_seconds;
                last = (grads, u.lr, u.version);
            }
        }
        let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        metrics.loss = mean_stats(&losses);
        metrics.loss.tokens = r.sel.kept.iter().map(|(_, s)| s.completion_ids.len()).sum();
        metrics.ppo = Some(PpoStats { value_loss: avg(&vls), value_clipfrac: avg(&clips), ..r.targets.stats.clone() });
        let (grads, lr, version) = last;
        (metrics.grad_norm, metrics.learning_rate, metrics.version) = (avg(&norms), lr, version);
        metrics.num_updates = losses.len() as u64;
        Ok((metrics, grads))
    }
}

/// `0..n`, shuffled (Fisher–Yates over splitmix64) when `shuffle`.
fn shuffled(n: usize, seed: u64, shuffle: bool) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    if shuffle {
        let mut s = seed;
        for k in (1..n).rev() {
            s = engine::sampling::splitmix64(s);
            v.swap(k, (s % (k as u64 + 1)) as usize);
        }
    }
    v
}

/// `order` split into `m` nearly equal consecutive chunks.
fn split(order: &[usize], m: usize) -> Vec<Vec<usize>> {
    let (n, m) = (order.len(), m.max(1));
    (0..m).map(|j| order[j * n / m..(j + 1) * n / m].to_vec()).collect()
}
