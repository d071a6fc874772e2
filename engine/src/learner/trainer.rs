//! One optimizer step on a batch of samples: advantages → learner forward (ℓ, and ℓ_ref
//! when `beta > 0`) → policy loss → backward → global-norm clipping → AdamW on f32 master
//! weights → the model's weights replaced.

use super::advantages::{compute_advantages, ScaleRewards};
use super::loss::{policy_loss, LossConfig, SampleLogprobs};
use super::optim::{AdamW, OptimConfig};
use super::{forward, Grads};
use crate::error::Result;
use crate::model::Model;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Instant;

/// Learner settings: loss, optimizer and advantage options (TRL names), flattened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    #[serde(flatten)]
    pub loss: LossConfig,
    #[serde(flatten)]
    pub optim: OptimConfig,
    pub scale_rewards: ScaleRewards,
    /// Drop groups whose rewards are all equal (DAPO dynamic sampling).
    pub filter_zero_std_groups: bool,
    /// The temperature the samples were drawn with (ℓ uses it).
    pub temperature: f32,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            loss: LossConfig::default(),
            optim: OptimConfig::default(),
            scale_rewards: ScaleRewards::Group,
            filter_zero_std_groups: false,
            temperature: 1.0,
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
        if self.advantage.is_none() && (self.reward.is_none() || self.group.is_none()) {
            return Err("give `advantage`, or `reward` and `group`".into());
        }
        Ok(())
    }
}

/// Metrics of one step (TRL names).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepMetrics {
    pub step: u64,
    #[serde(flatten)]
    pub loss: super::loss::LossStats,
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
}

/// The learner: f32 master weights, AdamW state, and the frozen reference when `beta > 0`.
pub struct Trainer {
    pub config: TrainConfig,
    pub params: BTreeMap<String, Vec<f32>>,
    pub optimizer: AdamW,
    reference: Option<Model>,
}

impl Trainer {
    /// Starts from the model's current weights; loads a frozen reference copy only when `beta > 0`.
    pub fn new(model: &Model, config: TrainConfig) -> Result<Self> {
        let named = model.named_weights()?;
        let reference = if config.loss.beta > 0.0 {
            let get = |n: &str, s: &[usize]| -> Result<kernels::Tensor> {
                let v = named.get(n).ok_or_else(|| crate::error::ModelError::MissingTensor {
                    path: "<reference>".into(),
                    name: n.into(),
                    expected: s.to_vec(),
                })?;
                Ok(kernels::Tensor::from_vec(v.1.clone(), s)?)
            };
            Some(Model::from_source(model.config.clone(), &get, model.device())?)
        } else {
            None
        };
        Ok(Self {
            config,
            params: named.into_iter().map(|(k, v)| (k, v.1)).collect(),
            optimizer: AdamW::default(),
            reference,
        })
    }

    /// The loss gradient of `batch` without updating anything (for `--dump-grads`).
    pub fn gradients(&self, model: &Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let c = &self.config;
        let (rewards, groups): (Vec<f32>, Vec<u64>) =
            batch.iter().enumerate().map(|(i, s)| (s.reward.unwrap_or(0.0), s.group.unwrap_or(i as u64))).unzip();
        let adv = compute_advantages(&rewards, &groups, c.scale_rewards, c.filter_zero_std_groups);
        let kept: Vec<(usize, &TrainSample)> = batch.iter().enumerate().filter(|(i, _)| adv.keep[*i]).collect();
        let mut fwds = Vec::with_capacity(kept.len());
        let mut refs = Vec::with_capacity(kept.len());
        for (_, s) in &kept {
            fwds.push(forward(model, &s.prompt_ids, &s.completion_ids, c.temperature)?);
            refs.push(match &self.reference {
                Some(r) => Some(forward(r, &s.prompt_ids, &s.completion_ids, c.temperature)?.logprobs),
                None => None,
            });
        }
        let samples: Vec<SampleLogprobs> = kept
            .iter()
            .zip(&fwds)
            .zip(&refs)
            .map(|(((i, s), f), r)| SampleLogprobs {
                logp: &f.logprobs,
                behavior: &s.behavior_logprobs,
                ref_logp: r.as_deref(),
                advantage: s.advantage.unwrap_or(adv.advantages[*i]),
            })
            .collect();
        let (stats, dl) = policy_loss(&samples, &c.loss);
        let mut grads = Grads::default();
        for (f, g) in fwds.iter().zip(&dl) {
            f.backward(model, g, &mut grads)?;
        }
        let lens: Vec<usize> = batch.iter().map(|s| s.completion_ids.len()).collect();
        let tokens: usize = fwds.iter().map(|f| f.logprobs.len()).sum();
        let secs = t0.elapsed().as_secs_f64();
        let m = StepMetrics {
            step: self.optimizer.step,
            entropy: fwds.iter().flat_map(|f| f.entropies.iter()).map(|&e| e as f64).sum::<f64>()
                / tokens.max(1) as f64,
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
            ..Default::default()
        };
        Ok((m, grads))
    }

    /// One optimizer step; the model's weights are replaced by the updated master weights.
    pub fn step(&mut self, model: &mut Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let (mut m, grads) = self.gradients(model, batch)?;
        let (norm, lr) = self.optimizer.step(&mut self.params, &grads, &self.config.optim);
        model.set_weights(&self.params)?;
        m.grad_norm = norm;
        m.learning_rate = lr;
        m.step = self.optimizer.step;
        m.step_seconds = t0.elapsed().as_secs_f64();
        m.tokens_per_s =
            batch.iter().map(|s| s.prompt_ids.len() + s.completion_ids.len()).sum::<usize>() as f64 / m.step_seconds;
        Ok((m, grads))
    }
}
