//! AdamW (Loshchilov & Hutter 2019, Alg. 2; PyTorch `torch.optim.AdamW` order: decoupled
//! decay, then the bias-corrected Adam step), global-norm clipping and LR schedules.

use super::Grads;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    Constant,
    /// Linear warmup over `warmup_steps`, then constant.
    Linear,
    /// Linear warmup, then cosine decay to 0 at `total_steps`.
    Cosine,
}

/// Optimizer settings (TRL / HF `TrainingArguments` names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimConfig {
    pub learning_rate: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (0 = off).
    pub max_grad_norm: f64,
    pub lr_scheduler_type: Schedule,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            learning_rate: 1e-6,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            lr_scheduler_type: Schedule::Constant,
            warmup_steps: 0,
            total_steps: 1000,
        }
    }
}

impl OptimConfig {
    /// Learning rate at optimizer step `step` (1-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        let w = self.warmup_steps;
        if w > 0 && step <= w {
            return self.learning_rate * step as f64 / w as f64;
        }
        match self.lr_scheduler_type {
            Schedule::Constant | Schedule::Linear => self.learning_rate,
            Schedule::Cosine => {
                let span = self.total_steps.saturating_sub(w).max(1) as f64;
                let p = ((step - w) as f64 / span).min(1.0);
                self.learning_rate * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())
            }
        }
    }
}

/// AdamW state: first and second moments per parameter (f32), and the step count.
#[derive(Debug, Default, Clone)]
pub struct AdamW {
    pub step: u64,
    pub m: BTreeMap<String, Vec<f32>>,
    pub v: BTreeMap<String, Vec<f32>>,
}

/// The step-wide factors of one AdamW step (from [`AdamW::begin_step`]).
#[derive(Debug, Clone, Copy)]
pub struct StepScale {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Factor applied to every gradient (1 when not clipped).
    pub clip: f64,
    pub lr: f64,
}

impl AdamW {
    /// Starts a step: global norm, clip factor, step count + 1, learning rate.
    pub fn begin_step(&mut self, grads: &Grads, cfg: &OptimConfig) -> StepScale {
        let norm = grads.global_norm();
        let clip =
            if cfg.max_grad_norm > 0.0 && norm > cfg.max_grad_norm { cfg.max_grad_norm / (norm + 1e-6) } else { 1.0 };
        self.step += 1;
        StepScale { grad_norm: norm, clip, lr: cfg.lr_at(self.step) }
    }

    /// Advances the moments of `name` with its gradient `g` and returns the Adam step
    /// `Δ = −lr · m̂ / (√v̂ + ε)`; the parameter update is `p ← (1 − lr·weight_decay)·p + Δ`
    /// (decoupled decay first, as PyTorch). Needs no access to `p`: the learner computes it
    /// while the engine keeps serving and applies it under the write guard in one pass.
    pub fn delta(&mut self, name: &str, g: &[f32], s: &StepScale, cfg: &OptimConfig) -> Vec<f32> {
        let (b1, b2, lr, clip) = (cfg.adam_beta1, cfg.adam_beta2, s.lr, s.clip);
        let (bc1, bc2) = (1.0 - b1.powi(self.step as i32), 1.0 - b2.powi(self.step as i32));
        let m = self.m.entry(name.to_string()).or_insert_with(|| vec![0.0; g.len()]);
        let v = self.v.entry(name.to_string()).or_insert_with(|| vec![0.0; g.len()]);
        let mut d = vec![0.0f32; g.len()];
        const CHUNK: usize = 1 << 16;
        d.par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(|(((d, m), v), g)| {
                for i in 0..d.len() {
                    let gi = g[i] as f64 * clip;
                    let mi = b1 * m[i] as f64 + (1.0 - b1) * gi;
                    let vi = b2 * v[i] as f64 + (1.0 - b2) * gi * gi;
                    m[i] = mi as f32;
                    v[i] = vi as f32;
                    d[i] = (-lr * (mi / bc1) / ((vi / bc2).sqrt() + cfg.adam_epsilon)) as f32;
                }
            });
        d
    }

    /// The decoupled weight-decay factor `1 − lr·weight_decay` of this step.
    pub fn decay(s: &StepScale, cfg: &OptimConfig) -> f32 {
        (1.0 - s.lr * cfg.weight_decay) as f32
    }

    /// One whole step over a name → values map ([`Self::begin_step`] + [`Self::update`]).
    /// Returns `(grad_norm before clipping, learning rate used)`.
    pub fn step(&mut self, params: &mut BTreeMap<String, Vec<f32>>, grads: &Grads, cfg: &OptimConfig) -> (f64, f64) {
        let s = self.begin_step(grads, cfg);
        let decay = Self::decay(&s, cfg);
        for (name, (_, g)) in &grads.tensors {
            if let Some(p) = params.get_mut(name) {
                let d = self.delta(name, g, &s, cfg);
                p.iter_mut().zip(d).for_each(|(p, d)| *p = *p * decay + d);
            }
        }
        (s.grad_norm, s.lr)
    }
}
