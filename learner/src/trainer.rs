//! One learner step on a batch of samples. GRPO family: advantages → learner forward (ℓ,
//! and ℓ_ref when `beta > 0`) → policy loss → backward → global-norm clipping → AdamW on
//! the served f32 weights, in place, under the shared model's write guard (DESIGN-NOTES §1)
//! → version + 1. PPO (`algos::ppo`) runs `num_ppo_epochs × num_mini_batches` such updates
//! per batch; DPO/IPO (`algos::dpo`) one update on the batch's preference pairs.

use super::algos::advantages::{compute_advantages, ScaleRewards};
use super::algos::grpo::{
    policy_loss, token_weights, ImportanceSamplingLevel, KlEstimator, LossStats, LossType, OffPolicyCorrection,
    SampleLogprobs,
};
use super::algos::value_head::ValueHead;
use super::optim::{AdamW, Schedule, Steps};
use super::{forward_batch, forward_batch_with, Grads, OutputGrads, ParamKey, Recompute, SeqForward};
use crate::error::{LearnerError, Result};
use engine::{Model, SharedModel};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
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
    /// Jobs: the first steps generated on-policy (as `max_staleness = 0`) before generation
    /// overlaps training; `None` = `round(1 / (1 − adam_beta1))` (10 at the default β₁) when
    /// `max_staleness ≥ 1`. Adam's first updates are its largest relative moves (its
    /// bias-corrected `m̂/√v̂` is ±1 at the first step), and a batch one version behind those
    /// is where one-step-stale learning went wrong (docs/ARCHITECTURE.md, "Off-policy
    /// learning").
    pub on_policy_warmup_steps: Option<u64>,
    /// Exclude samples that ended by length (`finish_reason == "length"`) from the loss.
    pub mask_truncated_completions: bool,
    /// DAPO soft overlong punishment (Yu et al. 2025, eq. 13): with `L = max_completion_length`
    /// and `B = overlong_buffer_len`, a completion longer than `L − B` tokens gets reward
    /// `overlong_penalty_factor · ((L − B) − |y|) / B` added (at most `−factor`).
    pub overlong_buffer_len: Option<usize>,
    pub overlong_penalty_factor: f32,
    /// Keep only each layer's input in the forward and recompute the rest in backward, and
    /// compute the LM head's logits in chunks of rows, again in backward
    /// ([`Recompute::checkpointing`]).
    pub gradient_checkpointing: bool,
    /// Keep a frozen copy of the initial weights even when `beta` is 0, to report `kl`
    /// (k3 by default) on the trained tokens: a reward-hacking / drift signal.
    pub log_kl_to_initial: bool,
    // PPO (`loss_type = "ppo"`, `algos::ppo`): TRL `PPOConfig` names and defaults.
    /// Value-loss coefficient: `L = L_policy + vf_coef · L_value`.
    pub vf_coef: f32,
    /// Value clipping: `V_clip = V_old + clip(V − V_old, −c, c)`.
    pub cliprange_value: f32,
    /// GAE discount γ.
    pub gamma: f32,
    /// GAE λ.
    pub lam: f32,
    /// KL penalty in the reward (InstructGPT): `r_t −= kl_coef · (ℓ_old,t − ℓ_ref,t)`.
    pub kl_coef: f32,
    /// Passes over each rollout batch.
    pub num_ppo_epochs: usize,
    /// Optimizer steps per pass (the batch's samples shuffled and split; at most one
    /// mini-batch per sample).
    pub num_mini_batches: usize,
    /// Initial value head: a checkpoint folder (its `value_head.safetensors`) or a
    /// safetensors file with `v_head.weight` / `v_head.bias`; unset = zeros.
    pub value_head_path: Option<PathBuf>,
    // DPO (`loss_type = "dpo"` / `"ipo"`, `algos::dpo`): `beta` is DPO's β.
    /// cDPO label smoothing ε: the probability that a preference label is flipped.
    pub label_smoothing: f32,
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
            on_policy_warmup_steps: None,
            mask_truncated_completions: false,
            overlong_buffer_len: None,
            overlong_penalty_factor: 1.0,
            gradient_checkpointing: false,
            log_kl_to_initial: false,
            vf_coef: 0.1,
            cliprange_value: 0.2,
            gamma: 1.0,
            lam: 0.95,
            kl_coef: 0.05,
            num_ppo_epochs: 4,
            num_mini_batches: 1,
            value_head_path: None,
            label_smoothing: 0.0,
        }
    }
}

impl TrainConfig {
    /// What a training forward of `model` keeps for backward: [`Recompute::checkpointing`]
    /// of `gradient_checkpointing`.
    pub fn recompute(&self, model: &Model) -> Recompute {
        Recompute::checkpointing(self.gradient_checkpointing, model.config.vocab_size)
    }

    /// Checks the values the chosen `loss_type` uses: `Err((key, message))` names the key,
    /// the value and the allowed range.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        let check = |ok: bool, key: &'static str, msg: String| if ok { Ok(()) } else { Err((key, msg)) };
        // AdamW's ranges (Loshchilov & Hutter 2019, Alg. 2): a negative rate would ascend
        // the loss on the served weights.
        let adamw: [(bool, &'static str, &str, f64); 6] = [
            (self.learning_rate >= 0.0, "learning_rate", ">= 0", self.learning_rate),
            ((0.0..1.0).contains(&self.adam_beta1), "adam_beta1", "in [0, 1)", self.adam_beta1),
            ((0.0..1.0).contains(&self.adam_beta2), "adam_beta2", "in [0, 1)", self.adam_beta2),
            (self.adam_epsilon > 0.0, "adam_epsilon", "> 0", self.adam_epsilon),
            (self.weight_decay >= 0.0, "weight_decay", ">= 0", self.weight_decay),
            (self.max_grad_norm >= 0.0, "max_grad_norm", ">= 0 (0: no clipping)", self.max_grad_norm),
        ];
        for (ok, key, range, v) in adamw {
            check(ok, key, format!("`{key}` must be {range}, got {v}"))?;
        }
        // The loss's ranges: the clip range [1 − ε, 1 + ε_high] must not be empty (DAPO's
        // ε_low/ε_high, Yu et al. 2025, eq. 8), β is a penalty weight, and ℓ divides the
        // logits by the temperature.
        let finite_nonneg = |v: f32| v.is_finite() && v >= 0.0;
        let loss: [(bool, &'static str, &str, f32); 4] = [
            (finite_nonneg(self.epsilon), "epsilon", "a finite number >= 0", self.epsilon),
            (finite_nonneg(self.epsilon_high), "epsilon_high", "a finite number >= 0", self.epsilon_high),
            (finite_nonneg(self.beta), "beta", "a finite number >= 0", self.beta),
            (
                self.temperature.is_finite() && !kernels::sample::is_greedy_temperature(self.temperature),
                "temperature",
                "a finite number >= 1e-5 (the temperature the samples were drawn with)",
                self.temperature,
            ),
        ];
        for (ok, key, range, v) in loss {
            check(ok, key, format!("`{key}` must be {range}, got {v}"))?;
        }
        match self.loss_type {
            LossType::Ppo => {
                check(
                    self.num_ppo_epochs >= 1,
                    "num_ppo_epochs",
                    format!("`num_ppo_epochs` must be >= 1, got {}", self.num_ppo_epochs),
                )?;
                check(
                    self.num_mini_batches >= 1,
                    "num_mini_batches",
                    format!("`num_mini_batches` must be >= 1, got {}", self.num_mini_batches),
                )?;
                check(
                    (0.0..=1.0).contains(&self.gamma),
                    "gamma",
                    format!("`gamma` must be in [0, 1], got {}", self.gamma),
                )?;
                check((0.0..=1.0).contains(&self.lam), "lam", format!("`lam` must be in [0, 1], got {}", self.lam))?;
                check(self.vf_coef >= 0.0, "vf_coef", format!("`vf_coef` must be >= 0, got {}", self.vf_coef))?;
                check(
                    self.cliprange_value > 0.0,
                    "cliprange_value",
                    format!("`cliprange_value` must be > 0, got {}", self.cliprange_value),
                )?;
                check(self.kl_coef >= 0.0, "kl_coef", format!("`kl_coef` must be >= 0, got {}", self.kl_coef))?;
            }
            LossType::Dpo | LossType::Ipo => {
                check(
                    self.beta > 0.0,
                    "beta",
                    format!(
                        "`beta` (DPO's β) must be > 0 for loss_type = \"{}\" (TRL's default is 0.1), got {}",
                        if self.loss_type == LossType::Dpo { "dpo" } else { "ipo" },
                        self.beta
                    ),
                )?;
                check(
                    (0.0..0.5).contains(&self.label_smoothing),
                    "label_smoothing",
                    format!("`label_smoothing` must be in [0, 0.5), got {}", self.label_smoothing),
                )?;
            }
            _ => {}
        }
        check(
            self.value_head_path.is_none() || self.loss_type == LossType::Ppo,
            "value_head_path",
            "`value_head_path` is only used by loss_type = \"ppo\"".into(),
        )
    }

    /// Optimizer steps one batch takes: `num_ppo_epochs × num_mini_batches` for PPO, else 1.
    pub fn updates_per_batch(&self) -> u64 {
        match self.loss_type {
            LossType::Ppo => (self.num_ppo_epochs * self.num_mini_batches) as u64,
            _ => 1,
        }
    }
}

/// One training sample (token in, token out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSample {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// μ per completion token; empty when unknown (preference pairs from a dataset), which
    /// only `dpo` / `ipo` accept.
    #[serde(default)]
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
        if !self.behavior_logprobs.is_empty() && self.behavior_logprobs.len() != self.completion_ids.len() {
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
        for (name, x) in [("advantage", self.advantage), ("reward", self.reward)] {
            if let Some(x) = x.filter(|x| !x.is_finite()) {
                return Err(format!("`{name}` {x} is not a finite number"));
            }
        }
        if self.advantage.is_none() && self.reward.is_none() {
            return Err("give `advantage`, or `reward` (with `group` for group advantages and preference pairs)".into());
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
    pub loss: LossStats,
    /// Global gradient norm before clipping (PPO: the mean over the batch's updates).
    pub grad_norm: f64,
    /// Learning rate of the (last) update.
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
    /// Fraction of the samples with versions whose tokens span more than one policy version
    /// (an update landed while they were generated: their KV was kept or recomputed).
    pub version_mixed_fraction: f64,
    /// Samples dropped for exceeding `max_staleness`, and masked as truncated.
    pub num_stale_dropped: usize,
    pub num_truncated_masked: usize,
    /// Policy version after this step.
    pub version: u64,
    /// Optimizer steps (versions) this batch took: `num_ppo_epochs × num_mini_batches` for
    /// PPO, else 1.
    pub num_updates: u64,
    /// The engine's pause per update, seconds, summed over the batch's updates: how long
    /// the optimizer held the write guard or, where longer, how long the device ran the
    /// guarded pass (on a GPU the engine's work queues behind it; CUDA events time it).
    pub pause_seconds: f64,
    /// Where the step's time went (seconds, summed over the batch's updates): the training
    /// forward passes (the reference's too), the backward passes, and the optimizer outside
    /// the write guard (gradient norm, AdamW moments, laying the step out like the weights).
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    pub optimizer_seconds: f64,
    /// PPO's value-head and advantage metrics.
    #[serde(flatten)]
    pub ppo: Option<crate::algos::ppo::PpoStats>,
    /// DPO's implicit-reward metrics (TRL names, `rewards/chosen`, ...).
    #[serde(flatten)]
    pub dpo: Option<crate::algos::dpo::DpoStats>,
}

/// The samples a step trains on, after the staleness and truncation filters.
pub(crate) struct Selection<'b> {
    /// (index in the batch, sample) of every kept sample, in batch order.
    pub kept: Vec<(usize, &'b TrainSample)>,
    /// Staleness of every sample of the batch (None without versions).
    pub staleness: Vec<Option<u64>>,
    pub stale_dropped: usize,
    pub truncated_masked: usize,
}

/// The outcome of one optimizer update.
#[derive(Debug, Clone, Copy)]
pub struct Update {
    pub grad_norm: f64,
    pub lr: f64,
    pub version: u64,
    pub pause_seconds: f64,
    /// Seconds before the write guard (norm, moments, layout).
    pub optimizer_seconds: f64,
}

/// The learner: AdamW state; when `beta > 0`, `log_kl_to_initial`, PPO's `kl_coef > 0` or
/// DPO/IPO, a frozen reference copy of the initial weights; PPO's value head. The weights
/// it trains are the served ones ([`SharedModel`]); it keeps no master copy (they are f32
/// already).
pub struct Trainer {
    pub config: TrainConfig,
    pub optimizer: AdamW,
    pub(crate) reference: Option<Model>,
    /// PPO's value head (`loss_type = "ppo"`): trained by the same AdamW, saved in checkpoints.
    pub value_head: Option<ValueHead>,
    pub(crate) ref_cache: crate::algos::dpo::RefCache,
    /// Batches trained by this trainer (seeds PPO's mini-batch shuffles).
    pub(crate) batches: u64,
}

impl Trainer {
    /// Starts from the model's current weights (the config is checked first, see
    /// [`TrainConfig::validate`]). Copies them into a frozen reference when `beta > 0`,
    /// `log_kl_to_initial`, PPO with `kl_coef > 0`, or DPO/IPO; PPO gets a value head (zeros,
    /// or `value_head_path`).
    pub fn new(model: &Model, config: TrainConfig) -> Result<Self> {
        config.validate().map_err(|(key, message)| LearnerError::Config { key, message })?;
        let ppo = config.loss_type == LossType::Ppo;
        let needs_reference = config.beta > 0.0
            || config.log_kl_to_initial
            || (ppo && config.kl_coef > 0.0)
            || config.loss_type.is_preference();
        let reference = if needs_reference {
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
        let hidden = model.config.hidden_size;
        let value_head = match (&config.value_head_path, ppo) {
            (Some(p), true) => Some(ValueHead::load(p, hidden, model.device())?),
            (None, true) => Some(ValueHead::zeros(hidden, model.device())?),
            _ => None,
        };
        Ok(Self {
            config,
            optimizer: AdamW::for_weights(&model.config.params(), model.device())?,
            reference,
            value_head,
            ref_cache: Default::default(),
            batches: 0,
        })
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

    /// The samples of `batch` that pass the staleness bound and the truncation mask, and
    /// `keep(i)` (the zero-std group filter).
    pub(crate) fn select<'b>(
        &self,
        model: &Model,
        batch: &'b [TrainSample],
        keep: &dyn Fn(usize) -> bool,
    ) -> Selection<'b> {
        let c = &self.config;
        let staleness: Vec<Option<u64>> = batch
            .iter()
            .map(|s| s.versions.as_ref().and_then(|v| v.iter().min()).map(|&m| model.version.saturating_sub(m)))
            .collect();
        let stale = |i: usize| c.max_staleness.is_some_and(|k| staleness[i].is_some_and(|s| s > k));
        let truncated = |s: &TrainSample| c.mask_truncated_completions && s.finish_reason.as_deref() == Some("length");
        let kept = batch.iter().enumerate().filter(|(i, s)| keep(*i) && !stale(*i) && !truncated(s)).collect();
        Selection {
            kept,
            stale_dropped: (0..batch.len()).filter(|&i| stale(i)).count(),
            truncated_masked: batch.iter().filter(|s| truncated(s)).count(),
            staleness,
        }
    }

    /// The metrics every loss reports: batch shape, staleness, entropy of the forward.
    pub(crate) fn base_metrics(
        &self,
        batch: &[TrainSample],
        sel: &Selection,
        fwd: &SeqForward,
        t0: Instant,
    ) -> StepMetrics {
        let lens: Vec<usize> = batch.iter().map(|s| s.completion_ids.len()).collect();
        let tokens = fwd.logprobs.len();
        let secs = t0.elapsed().as_secs_f64();
        let st = &sel.staleness;
        StepMetrics {
            step: self.optimizer.step,
            entropy: fwd.entropies.iter().map(|&e| e as f64).sum::<f64>() / tokens.max(1) as f64,
            completion_length_mean: lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64,
            completion_length_max: lens.iter().cloned().max().unwrap_or(0),
            samples: sel.kept.len(),
            tokens_per_s: batch.iter().map(|s| s.prompt_ids.len() + s.completion_ids.len()).sum::<usize>() as f64
                / secs,
            step_seconds: secs,
            staleness_mean: st.iter().flatten().sum::<u64>() as f64 / st.iter().flatten().count().max(1) as f64,
            staleness_max: st.iter().flatten().cloned().max().unwrap_or(0),
            version_mixed_fraction: {
                let spans: Vec<bool> = batch
                    .iter()
                    .filter_map(|s| s.versions.as_ref())
                    .map(|v| v.iter().min() != v.iter().max())
                    .collect();
                spans.iter().filter(|&&m| m).count() as f64 / spans.len().max(1) as f64
            },
            num_stale_dropped: sel.stale_dropped,
            num_truncated_masked: sel.truncated_masked,
            ..Default::default()
        }
    }

    /// The entropy bonus `−entropy_coef · Σ w_t H_t` with the `loss_type`'s token weights:
    /// its value and `dL/dH` per token (None when `entropy_coef` is 0).
    pub(crate) fn entropy_bonus(&self, fwd: &SeqForward) -> (f64, Option<Vec<f32>>) {
        let c = &self.config;
        if c.entropy_coef == 0.0 {
            return (0.0, None);
        }
        let w = token_weights(&fwd.lens, c);
        let mut start = 0;
        let (mut loss, mut de) = (0.0, Vec::with_capacity(fwd.entropies.len()));
        for (k, &n) in fwd.lens.iter().enumerate() {
            let h: f64 = fwd.entropies[start..start + n].iter().map(|&e| e as f64).sum();
            loss -= c.entropy_coef as f64 * w[k] * h;
            de.extend(std::iter::repeat_n((-(c.entropy_coef as f64) * w[k]) as f32, n));
            start += n;
        }
        (loss, Some(de))
    }

    /// The loss gradient of `batch` without updating anything (for `--dump-grads`). PPO: the
    /// gradient of the first update (the whole batch as one mini-batch, π = π_old).
    pub fn gradients(&mut self, model: &Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        match self.config.loss_type {
            LossType::Ppo => self.ppo_gradients(model, batch),
            LossType::Dpo | LossType::Ipo => self.dpo_gradients(model, batch),
            _ => self.policy_gradients(model, batch),
        }
    }

    /// The GRPO family: group advantages and the clipped policy loss.
    fn policy_gradients(&self, model: &Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let c = &self.config;
        check_behavior(batch)?;
        if let Some(i) = batch.iter().position(|s| s.advantage.is_none() && s.group.is_none()) {
            return Err(LearnerError::Batch(format!(
                "sample {i}: the group-relative losses need `advantage`, or `reward` and `group`"
            )));
        }
        let (rewards, groups): (Vec<f32>, Vec<u64>) = batch
            .iter()
            .enumerate()
            .map(|(i, s)| {
                (s.reward.unwrap_or(0.0) + self.overlong_penalty(s.completion_ids.len()), s.group.unwrap_or(i as u64))
            })
            .unzip();
        let adv = compute_advantages(&rewards, &groups, c.scale_rewards, c.filter_zero_std_groups);
        let sel = self.select(model, batch, &|i| adv.keep[i]);
        if sel.kept.is_empty() {
            return Err(LearnerError::EmptyBatch);
        }
        // One packed forward over all kept samples (and the reference when beta > 0).
        let seqs: Vec<(&[u32], &[u32])> =
            sel.kept.iter().map(|(_, s)| (s.prompt_ids.as_slice(), s.completion_ids.as_slice())).collect();
        let fwd = forward_batch_with(model, &seqs, c.temperature, c.recompute(model))?;
        let ref_fwd = match &self.reference {
            Some(r) => Some(forward_batch(r, &seqs, c.temperature)?),
            None => None,
        };
        let ref_lp = ref_fwd.as_ref().map(|f| &f.logprobs);
        let offsets = offsets(&fwd.lens);
        let span = |i: usize| offsets[i]..offsets[i + 1];
        let samples: Vec<SampleLogprobs> = sel
            .kept
            .iter()
            .enumerate()
            .map(|(k, (i, s))| SampleLogprobs {
                logp: &fwd.logprobs[span(k)],
                behavior: &s.behavior_logprobs,
                ref_logp: ref_lp.as_ref().map(|r| &r[span(k)]),
                prox_logp: None,
                advantage: s.advantage.unwrap_or(adv.advantages[*i]),
                token_advantages: None,
            })
            .collect();
        let (mut stats, dl) = policy_loss(&samples, c);
        let dl: Vec<f32> = dl.concat();
        let (bonus, de) = self.entropy_bonus(&fwd);
        stats.loss += bonus;
        let mut grads = Grads::default();
        fwd.backward(model, &OutputGrads { dl_dentropy: de.as_deref(), ..OutputGrads::logprobs(&dl) }, &mut grads)?;
        let m = StepMetrics {
            loss: stats,
            reward_mean: adv.reward_mean,
            reward_std: adv.reward_std,
            frac_reward_zero_std: adv.frac_reward_zero_std,
            forward_seconds: fwd.forward_seconds + ref_fwd.map_or(0.0, |f| f.forward_seconds),
            ..self.base_metrics(batch, &sel, &fwd, t0)
        };
        Ok((m, grads))
    }

    /// One AdamW update of the served weights (and the value head) with `grads`: the step is
    /// computed, laid out like the served weights and turned into the new weights
    /// (`Δ ← decay·w + Δ`, [`engine::Model::prepare_update`]) under a read guard while the
    /// engine keeps serving; the write guard covers the commit (buffer swaps where possible,
    /// [`engine::Model::commit_update`]) and the version bump. Holds
    /// [`SharedModel::lock_updates`] throughout.
    ///
    /// Errors: a gradient that is not one of the model's (or the value head's) parameters, or
    /// has another shape ([`LearnerError::Gradient`]); nothing is changed then.
    pub fn update(&mut self, model: &SharedModel, grads: &Grads) -> Result<Update> {
        let t0 = Instant::now();
        let cfg = &self.config;
        let _updates = model.lock_updates();
        let scale = self.optimizer.begin_step(grads, cfg)?;
        let decay = AdamW::decay(&scale, cfg);
        let mut laid = {
            let m = model.read();
            check_gradients(&m, self.value_head.as_ref(), grads)?;
            let mut steps = Steps { opt: &mut self.optimizer, grads, scale: &scale, cfg, device: m.device().clone() };
            let mut laid = m.lay_out(&mut steps)?;
            m.prepare_update(&mut laid, decay)?;
            if let Some(head) = &mut self.value_head {
                let mut deltas = BTreeMap::new();
                for (&key, g) in &grads.tensors {
                    if let ParamKey::ValueHead(part) = key {
                        deltas.insert(part, self.optimizer.delta(key, g, &scale, cfg)?);
                    }
                }
                head.apply(decay, &mut |part| deltas.remove(&part))?;
            }
            laid
        };
        let optimizer_seconds = t0.elapsed().as_secs_f64();
        let t_write = Instant::now();
        let (version, start, end) = {
            let mut w = model.write();
            let start = w.device().mark()?;
            w.commit_update(&mut laid)?;
            let end = w.device().mark()?;
            w.version += 1;
            (w.version, start, end)
        };
        // The engine waits for the guard on the host and, on a GPU, for the pass on the
        // device (its work queues behind it on the one stream): the pause is the longer.
        let hold = t_write.elapsed().as_secs_f64();
        let pause_seconds = hold.max(start.seconds_until(&end)?);
        drop(laid); // the old weights
        Ok(Update { grad_norm: scale.grad_norm, lr: scale.lr, version, pause_seconds, optimizer_seconds })
    }

    /// One learner step: gradients under a read guard (the engine keeps stepping), then
    /// AdamW applied to the served weights in place ([`Self::update`]). PPO takes
    /// `num_ppo_epochs × num_mini_batches` updates per batch. Returns the step's metrics and
    /// the gradient of its (last) update.
    pub fn step(&mut self, model: &SharedModel, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let (mut m, grads) = if self.config.loss_type == LossType::Ppo {
            self.ppo_step(model, batch)?
        } else {
            let (mut m, grads) = self.gradients(&model.read(), batch)?;
            let u = self.update(model, &grads)?;
            (m.grad_norm, m.learning_rate, m.version, m.pause_seconds, m.optimizer_seconds) =
                (u.grad_norm, u.lr, u.version, u.pause_seconds, u.optimizer_seconds);
            m.backward_seconds = grads.backward_seconds;
            m.num_updates = 1;
            (m, grads)
        };
        self.batches += 1;
        m.step = self.optimizer.step;
        m.step_seconds = t0.elapsed().as_secs_f64();
        m.tokens_per_s =
            batch.iter().map(|s| s.prompt_ids.len() + s.completion_ids.len()).sum::<usize>() as f64 / m.step_seconds;
        Ok((m, grads))
    }
}

/// Start of each sequence's tokens in the concatenation, and the total at the end.
pub(crate) fn offsets(lens: &[usize]) -> Vec<usize> {
    let mut o = Vec::with_capacity(lens.len() + 1);
    o.push(0);
    for n in lens {
        o.push(o.last().unwrap() + n);
    }
    o
}

/// The policy losses need μ on every token.
pub(crate) fn check_behavior(batch: &[TrainSample]) -> Result<()> {
    match batch.iter().position(|s| s.behavior_logprobs.len() != s.completion_ids.len()) {
        Some(i) => Err(LearnerError::Batch(format!(
            "sample {i}: `behavior_logprobs` has {} values for {} completion tokens (only loss_type dpo/ipo trains \
             without them)",
            batch[i].behavior_logprobs.len(),
            batch[i].completion_ids.len()
        ))),
        None => Ok(()),
    }
}

/// Mean of the loss statistics of several updates (ratio extremes: min and max over them).
pub(crate) fn mean_stats(all: &[LossStats]) -> LossStats {
    let n = all.len().max(1) as f64;
    let avg = |f: fn(&LossStats) -> f64| all.iter().map(f).sum::<f64>() / n;
    LossStats {
        loss: avg(|s| s.loss),
        clip_ratio_low: avg(|s| s.clip_ratio_low),
        clip_ratio_high: avg(|s| s.clip_ratio_high),
        clip_ratio: avg(|s| s.clip_ratio),
        masked_ratio: avg(|s| s.masked_ratio),
        kl: avg(|s| s.kl),
        mismatch_mean: avg(|s| s.mismatch_mean),
        mismatch_max: all.iter().map(|s| s.mismatch_max).fold(0.0, f64::max),
        ratio_min: all.iter().map(|s| s.ratio_min).fold(f64::INFINITY, f64::min),
        ratio_mean: avg(|s| s.ratio_mean),
        ratio_max: all.iter().map(|s| s.ratio_max).fold(0.0, f64::max),
        tokens: all.iter().map(|s| s.tokens).max().unwrap_or(0),
    }
}

/// Every gradient is one of the model's weights (its parameter table, what the update lays
/// out) or, with one, the value head's, with that weight's shape.
///
/// Errors: [`LearnerError::Gradient`] naming the gradient and what was expected.
fn check_gradients(model: &Model, head: Option<&ValueHead>, grads: &Grads) -> Result<()> {
    let mut known: BTreeMap<ParamKey, Vec<usize>> =
        model.config.params().into_iter().map(|p| (p.id.into(), p.shape)).collect();
    if let Some(h) = head {
        known.extend(h.params().map(|(p, t)| (p.into(), t.shape().to_vec())));
    }
    for (key, g) in &grads.tensors {
        match known.get(key) {
            Some(shape) if shape.as_slice() == g.shape() => {}
            Some(shape) => {
                return Err(LearnerError::Gradient(format!(
                    "the gradient of `{key}` has shape {:?}, the weight {shape:?}",
                    g.shape()
                )))
            }
            None => {
                return Err(LearnerError::Gradient(format!(
                    "a gradient for `{key}`, which is not a weight of this {:?} model{}",
                    model.config.architecture,
                    if head.is_some() { " or of its value head" } else { "" }
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algos::value_head::HeadParam;
    use engine::model::{ParamId, ParamKind};
    use kernels::{Device, Tensor};

    /// A gradient with a name the model does not have, or with another shape than its weight,
    /// fails the update naming it (it used to be skipped: a zero step); the model's own
    /// gradients step it.
    #[test]
    fn unknown_or_misshapen_gradients_are_errors() {
        let config = engine::ModelConfig::from_json(
            r#"{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8, "intermediate_size": 12,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                "vocab_size": 16, "tie_word_embeddings": true}"#,
            "config.json".as_ref(),
        )
        .unwrap();
        let model =
            Model::from_source(config, &|_, shape| Ok(Tensor::zeros(shape, &Device::Cpu)?), &Device::Cpu).unwrap();
        let mut trainer = Trainer::new(&model, TrainConfig::default()).unwrap();
        let shared = SharedModel::new(model);
        let update = |trainer: &mut Trainer, key: ParamKey, shape: &[usize]| {
            let mut g = Grads::default();
            g.add(key, Tensor::from_vec(vec![0.5; shape.iter().product()], shape).unwrap()).unwrap();
            trainer.update(&shared, &g).map(|u| u.version).map_err(|e| e.to_string())
        };
        let layer = |l, kind| ParamKey::Model(ParamId::layer(l, kind));
        let q_norm = layer(0, ParamKind::QNorm);
        assert_eq!(update(&mut trainer, q_norm, &[4]), Ok(1));
        let e = update(&mut trainer, q_norm, &[8]).unwrap_err();
        assert_eq!(e, "the gradient of `model.layers.0.self_attn.q_norm.weight` has shape [8], the weight [4]");
        let e = update(&mut trainer, layer(0, ParamKind::QBias), &[8]).unwrap_err();
        assert_eq!(
            e,
            "a gradient for `model.layers.0.self_attn.q_proj.bias`, which is not a weight of this Qwen3 model"
        );
        let e = update(&mut trainer, layer(1, ParamKind::QNorm), &[4]).unwrap_err();
        assert_eq!(
            e,
            "a gradient for `model.layers.1.self_attn.q_norm.weight`, which is not a weight of this Qwen3 model"
        );
        let e = update(&mut trainer, ParamKey::ValueHead(HeadParam::Bias), &[1]).unwrap_err();
        assert_eq!(e, "a gradient for `v_head.bias`, which is not a weight of this Qwen3 model");
        assert_eq!(shared.version(), 1, "a refused update changes nothing");
    }
}
