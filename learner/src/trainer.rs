//! One optimizer step on a batch of samples: advantages → learner forward (ℓ, and ℓ_ref
//! when `beta > 0`) → policy loss → backward → global-norm clipping → AdamW on f32 master
//! weights, in place, under the shared model's write guard (DESIGN-NOTES §1) → version + 1.

use super::algos::advantages::{compute_advantages, ScaleRewards};
use super::algos::grpo::{
    policy_loss, token_weights, ImportanceSamplingLevel, KlEstimator, LossType, OffPolicyCorrection, SampleLogprobs,
};
use super::optim::{AdamW, Schedule};
use super::{forward_batch, forward_batch_with, Grads, OutputGrads};
use crate::error::{LearnerError, Result};
use engine::{Model, SharedModel};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Instant;

/// The learner's settings: one flat table of TRL / HF `TrainingArguments` names (the
/// `[learner]` table of a job config, `train-step --config`, `--learner-config`). Unknown
/// keys are errors. The losses (`algos/`), the optimizer and its schedule (`optim.rs`) and the
/// trainer all read this one type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    // Loss (see `algos/grpo.rs` for the formulas).
    pub loss_type: LossType,
    pub importance_sampling_level: ImportanceSamplingLevel,
    pub epsilon: f32,
    pub epsilon_high: f32,
    pub beta: f32,
    pub kl_estimator: KlEstimator,
    /// Normaliser of `dr_grpo`, the DAPO overlong threshold, and a job's `max_tokens`.
    pub max_completion_length: usize,
    pub off_policy_correction: OffPolicyCorrection,
    pub tis_cap: f32,
    pub mis_low: f32,
    pub mis_high: f32,
    /// Entropy bonus: `−entropy_coef · H` per token, aggregated like the policy loss.
    pub entropy_coef: f32,
    // Optimizer (see `optim.rs`).
    pub learning_rate: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    pub max_grad_norm: f64,
    pub lr_scheduler_type: Schedule,
    pub warmup_steps: u64,
    /// Length of the schedule (`linear` and `cosine` reach 0 here); unset, a job uses its
    /// `max_steps` and other learners [`crate::optim::DEFAULT_TOTAL_STEPS`].
    pub total_steps: Option<u64>,
    // Advantages and sample selection.
    pub scale_rewards: ScaleRewards,
    /// Drop groups whose rewards are all equal (DAPO dynamic sampling).
    pub filter_zero_std_groups: bool,
    /// The temperature the samples were drawn with (ℓ uses it).
    pub temperature: f32,
    /// Drop samples whose oldest token is more than this many versions behind (None = keep all).
    pub max_staleness: Option<u64>,
    /// Exclude samples that ended by length (`finish_reason == "length"`) from the loss.
    pub mask_truncated_completions: bool,
    /// DAPO soft overlong punishment (Yu et al. 2025, eq. 13): with `L = max_completion_length`
    /// and `B = overlong_buffer_len`, a completion longer than `L − B` tokens gets reward
    /// `overlong_penalty_factor · ((L − B) − |y|) / B` added (at most `−factor`).
    pub overlong_buffer_len: Option<usize>,
    pub overlong_penalty_factor: f32,
    /// Keep only each layer's input in the forward and recompute the rest in backward.
    pub gradient_checkpointing: bool,
    /// Keep a frozen copy of the initial weights even when `beta` is 0, to report `kl`
    /// (k3 by default) on the trained tokens: a reward-hacking / drift signal.
    pub log_kl_to_initial: bool,
}

impl Default for TrainConfig {
    /// TRL's `GRPOConfig` defaults (HF `TrainingArguments` for the optimizer).
    fn default() -> Self {
        Self {
            loss_type: LossType::Grpo,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            epsilon: 0.2,
            epsilon_high: 0.2,
            beta: 0.0,
            kl_estimator: KlEstimator::K3,
            max_completion_length: 256,
            off_policy_correction: OffPolicyCorrection::PpoClip,
            tis_cap: 2.0,
            mis_low: 0.5,
            mis_high: 2.0,
            entropy_coef: 0.0,
            learning_rate: 1e-6,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            lr_scheduler_type: Schedule::Constant,
            warmup_steps: 0,
            total_steps: None,
            scale_rewards: ScaleRewards::Group,
            filter_zero_std_groups: false,
            temperature: 1.0,
            max_staleness: None,
            mask_truncated_completions: false,
            overlong_buffer_len: None,
            overlong_penalty_factor: 1.0,
            gradient_checkpointing: false,
            log_kl_to_initial: false,
        }
    }
}

/// One training sample (token in, token out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSample {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// μ per completion token.
    pub behavior_logprobs: Vec<f32>,
    /// Given directly, or computed from `reward` and `group`.
    #[serde(default)]
    pub advantage: Option<f32>,
    #[serde(default)]
    pub reward: Option<f32>,
    #[serde(default)]
    pub group: Option<u64>,
    /// Policy version of each completion token (from the engine).
    #[serde(default)]
    pub versions: Option<Vec<u64>>,
    /// `stop`, `length` or `abort`.
    #[serde(default)]
    pub finish_reason: Option<String>,
}

impl TrainSample {
    /// Checks lengths and token ids; the message says what is wrong.
    pub fn validate(&self, vocab: usize) -> std::result::Result<(), String> {
        if self.prompt_ids.is_empty() {
            return Err("`prompt_ids` is empty".into());
        }
        if self.completion_ids.is_empty() {
            return Err("`completion_ids` is empty".into());
        }
        if self.behavior_logprobs.len() != self.completion_ids.len() {
            return Err(format!(
                "`behavior_logprobs` has {} values for {} completion tokens",
                self.behavior_logprobs.len(),
                self.completion_ids.len()
            ));
        }
        if let Some(t) = self.prompt_ids.iter().chain(&self.completion_ids).find(|&&t| t as usize >= vocab) {
            return Err(format!("token id {t} >= vocab size {vocab}"));
        }
        if let Some(b) = self.behavior_logprobs.iter().find(|b| !b.is_finite() || **b > 0.0) {
            return Err(format!("behavior logprob {b} is not a finite value <= 0"));
        }
        if let Some(v) = &self.versions {
            if v.len() != self.completion_ids.len() {
                return Err(format!(
                    "`versions` has {} values for {} completion tokens",
                    v.len(),
                    self.completion_ids.len()
                ));
            }
        }
        if self.advantage.is_none() && (self.reward.is_none() || self.group.is_none()) {
            return Err("give `advantage`, or `reward` and `group`".into());
        }
        Ok(())
    }
}

/// Metrics of one step (TRL names).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepMetrics {
    /// Optimizer steps taken so far.
    #[serde(rename = "optimizer_step")]
    pub step: u64,
    #[serde(flatten)]
    pub loss: super::algos::grpo::LossStats,
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub entropy: f64,
    pub reward_mean: f64,
    pub reward_std: f64,
    pub frac_reward_zero_std: f64,
    pub completion_length_mean: f64,
    pub completion_length_max: usize,
    pub samples: usize,
    pub tokens_per_s: f64,
    pub step_seconds: f64,
    /// Staleness = learner version − oldest token version, over samples with versions.
    pub staleness_mean: f64,
    pub staleness_max: u64,
    /// Samples dropped for exceeding `max_staleness`, and masked as truncated.
    pub num_stale_dropped: usize,
    pub num_truncated_masked: usize,
    /// Policy version after this step.
    pub version: u64,
    /// How long the optimizer held the write guard (the engine's pause), seconds.
    pub pause_seconds: f64,
}

/// The learner: AdamW state and, when `beta > 0` or `log_kl_to_initial`, a frozen
/// reference copy. The weights it trains are the served ones ([`SharedModel`]); it keeps
/// no master copy (they are f32 already).
pub struct Trainer {
    pub config: TrainConfig,
    pub optimizer: AdamW,
    reference: Option<Model>,
}

impl Trainer {
    /// Starts from the model's current weights; copies them into a frozen reference only
    /// when `beta > 0` or `log_kl_to_initial`.
    pub fn new(model: &Model, config: TrainConfig) -> Result<Self> {
        let reference = if config.beta > 0.0 || config.log_kl_to_initial {
            let named = model.named_weights()?;
            let get = |n: &str, s: &[usize]| -> engine::Result<kernels::Tensor> {
                named.get(n).cloned().ok_or_else(|| engine::ModelError::MissingTensor {
                    path: "<reference>".into(),
                    name: n.into(),
                    expected: s.to_vec(),
                })
            };
            Some(Model::from_source(model.config.clone(), &get, model.device())?)
        } else {
            None
        };
        Ok(Self { config, optimizer: AdamW::default(), reference })
    }

    /// DAPO soft overlong punishment for a completion of `len` tokens (0 when off).
    pub fn overlong_penalty(&self, len: usize) -> f32 {
        let c = &self.config;
        let Some(buffer) = c.overlong_buffer_len.filter(|&b| b > 0) else { return 0.0 };
        let expected = c.max_completion_length.saturating_sub(buffer);
        if len <= expected {
            return 0.0;
        }
        c.overlong_penalty_factor * ((expected as f32 - len as f32) / buffer as f32).max(-1.0)
    }

    /// The loss gradient of `batch` without updating anything (for `--dump-grads`).
    pub fn gradients(&self, model: &Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let c = &self.config;
        let (rewards, groups): (Vec<f32>, Vec<u64>) = batch
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (s.reward.unwrap_or(0.0) + self.overlong_penalty(s.completion_ids.len()), s.group.unwrap_or(i as u64))
            })
            .unzip();
        let adv = compute_advantages(&rewards, &groups, c.scale_rewards, c.filter_zero_std_groups);
        let staleness: Vec<Option<u64>> = batch
            .iter()
            .map(|s| s.versions.as_ref().and_then(|v| v.iter().min()).map(|&m| model.version.saturating_sub(m)))
            .collect();
        let stale = |i: usize| c.max_staleness.is_some_and(|k| staleness[i].is_some_and(|s| s > k));
        let truncated = |s: &TrainSample| c.mask_truncated_completions && s.finish_reason.as_deref() == Some("length");
        let kept: Vec<(usize, &TrainSample)> =
            batch.iter().enumerate().filter(|(i, s)| adv.keep[*i] && !stale(*i) && !truncated(s)).collect();
        if kept.is_empty() {
            return Err(LearnerError::EmptyBatch);
        }
        // One packed forward over all kept samples (and the reference when beta > 0).
        let seqs: Vec<(&[u32], &[u32])> =
            kept.iter().map(|(_, s)| (s.prompt_ids.as_slice(), s.completion_ids.as_slice())).collect();
        let fwd = forward_batch_with(model, &seqs, c.temperature, c.gradient_checkpointing)?;
        let ref_lp = match &self.reference {
            Some(r) => Some(forward_batch(r, &seqs, c.temperature)?.logprobs),
            None => None,
        };
        let mut offsets = vec![0usize];
        for n in &fwd.lens {
            offsets.push(offsets.last().unwrap() + n);
        }
        let span = |i: usize| offsets[i]..offsets[i + 1];
        let samples: Vec<SampleLogprobs> = kept
            .iter()
            .enumerate()
            .map(|(k, (i, s))| SampleLogprobs {
                logp: &fwd.logprobs[span(k)],
                behavior: &s.behavior_logprobs,
                ref_logp: ref_lp.as_ref().map(|r| &r[span(k)]),
                prox_logp: None,
                advantage: s.advantage.unwrap_or(adv.advantages[*i]),
            })
            .collect();
        let (mut stats, dl) = policy_loss(&samples, c);
        let dl: Vec<f32> = dl.concat();
        let mut grads = Grads::default();
        if c.entropy_coef != 0.0 {
            // Entropy bonus: L −= entropy_coef · Σ w_t H_t with the loss_type's token weights.
            let w = token_weights(&fwd.lens, c);
            let de: Vec<f32> = (0..fwd.lens.len())
                .flat_map(|k| std::iter::repeat_n((-(c.entropy_coef as f64) * w[k]) as f32, fwd.lens[k]))
                .collect();
            stats.loss -= (0..fwd.lens.len())
                .map(|k| c.entropy_coef as f64 * w[k] * fwd.entropies[span(k)].iter().map(|&e| e as f64).sum::<f64>())
                .sum::<f64>();
            fwd.backward(model, &OutputGrads { dl_dentropy: Some(&de), ..OutputGrads::logprobs(&dl) }, &mut grads)?;
        } else {
            fwd.backward(model, &OutputGrads::logprobs(&dl), &mut grads)?;
        }
        let lens: Vec<usize> = batch.iter().map(|s| s.completion_ids.len()).collect();
        let tokens = fwd.logprobs.len();
        let secs = t0.elapsed().as_secs_f64();
        let m = StepMetrics {
            step: self.optimizer.step,
            entropy: fwd.entropies.iter().map(|&e| e as f64).sum::<f64>() / tokens.max(1) as f64,
            loss: stats,
            reward_mean: adv.reward_mean,
            reward_std: adv.reward_std,
            frac_reward_zero_std: adv.frac_reward_zero_std,
            completion_length_mean: lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64,
            completion_length_max: lens.iter().cloned().max().unwrap_or(0),
            samples: kept.len(),
            tokens_per_s: batch.iter().map(|s| s.prompt_ids.len() + s.completion_ids.len()).sum::<usize>() as f64
                / secs,
            step_seconds: secs,
            staleness_mean: staleness.iter().flatten().sum::<u64>() as f64
                / staleness.iter().flatten().count().max(1) as f64,
            staleness_max: staleness.iter().flatten().cloned().max().unwrap_or(0),
            num_stale_dropped: (0..batch.len()).filter(|&i| stale(i)).count(),
            num_truncated_masked: batch.iter().filter(|s| truncated(s)).count(),
            ..Default::default()
        };
        Ok((m, grads))
    }

    /// One optimizer step: gradients under a read guard (the engine keeps stepping), the AdamW
    /// step prepared outside any guard, then applied to the served weights in place under the
    /// write guard, and the version bumped before the guard is released.
    pub fn step(&mut self, model: &SharedModel, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let (mut m, grads) = self.gradients(&model.read(), batch)?;
        let cfg = &self.config;
        let scale = self.optimizer.begin_step(&grads, cfg)?;
        // AdamW's step Δ is computed and laid out like the served weights while the engine
        // keeps serving; the write guard covers one elementwise pass `w ← decay·w + Δ`.
        let mut deltas = BTreeMap::new();
        for (name, g) in &grads.tensors {
            deltas.insert(name.as_str(), self.optimizer.delta(name, g, &scale, cfg)?);
        }
        let laid = model.read().lay_out(&mut |n| deltas.remove(n))?;
        drop(deltas);
        let t_write = Instant::now();
        {
            let mut w = model.write();
            w.apply_deltas(&laid, AdamW::decay(&scale, cfg))?;
            w.version += 1;
            m.version = w.version;
        }
        m.pause_seconds = t_write.elapsed().as_secs_f64();
        m.grad_norm = scale.grad_norm;
        m.learning_rate = scale.lr;
        m.step = self.optimizer.step;
        m.step_seconds = t0.elapsed().as_secs_f64();
        m.tokens_per_s =
            batch.iter().map(|s| s.prompt_ids.len() + s.completion_ids.len()).sum::<usize>() as f64 / m.step_seconds;
        Ok((m, grads))
    }
}
