//! AdamW (Loshchilov & Hutter 2019, Alg. 2; PyTorch `torch.optim.AdamW` order: decoupled
//! decay, then the bias-corrected Adam step), global-norm clipping and LR schedules.

use super::{Grads, ParamKey};
use crate::TrainConfig;
use crate::{LearnerError, Result};
use engine::model::{Param, ParamId};
use kernels::ops::{self, AdamWPart, AdamWStep, PackedWeight};
use kernels::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Learning-rate schedules, with Hugging Face `get_scheduler` semantics (`transformers`
/// `optimization.py`): the optimizer's `t`-th step (1-based) uses the multiplier at
/// `s = t − 1`; warmup is `s / warmup_steps` while `s < warmup_steps`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// `1` at every step; `warmup_steps` is ignored (HF `constant`).
    Constant,
    /// Warmup, then `1` (HF `constant_with_warmup`).
    ConstantWithWarmup,
    /// Warmup, then `(total − s) / (total − warmup)`, reaching 0 at `total_steps` (HF `linear`).
    Linear,
    /// Warmup, then `½(1 + cos(π · (s − warmup) / (total − warmup)))` (HF `cosine`).
    Cosine,
}
/// Schedule length when `total_steps` is unset outside a job (a job uses its `max_steps`).
pub const DEFAULT_TOTAL_STEPS: u64 = 1000;

impl TrainConfig {
    /// Learning rate at optimizer step `step` (1-based), see [`Schedule`].
    pub fn lr_at(&self, step: u64) -> f64 {
        let s = step.saturating_sub(1) as f64;
        let (w, total) = (self.warmup_steps as f64, self.total_steps.unwrap_or(DEFAULT_TOTAL_STEPS) as f64);
        let warming = self.lr_scheduler_type != Schedule::Constant && s < w;
        let factor = if warming {
            s / w.max(1.0)
        } else {
            match self.lr_scheduler_type {
                Schedule::Constant | Schedule::ConstantWithWarmup => 1.0,
                Schedule::Linear => ((total - s) / (total - w).max(1.0)).max(0.0),
                Schedule::Cosine => {
                    let p = (s - w) / (total - w).max(1.0);
                    (0.5 * (1.0 + (std::f64::consts::PI * p).cos())).max(0.0)
                }
            }
        };
        self.learning_rate * factor
    }
}

/// AdamW state: first and second moments per parameter (f32, on the model's device, keyed
/// like the gradients), and the step count.
#[derive(Debug, Default, Clone)]
pub struct AdamW {
    pub step: u64,
    pub m: BTreeMap<ParamKey, Tensor>,
    pub v: BTreeMap<ParamKey, Tensor>,
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
    /// Zero moments for every parameter of `params` (the model's table), made before the
    /// first step instead of at it. Their memory is then taken before the first batch's
    /// activations: made at the first step (as `torch.optim.AdamW` does), they would take the
    /// addresses that batch just freed, and the second batch's activations would land on
    /// fresh pages (first touches cost ~8 s per GiB on a VM that backs memory lazily; the
    /// second step of `bench train` at 8 × 256 tokens took 20 s instead of 12).
    pub fn for_weights(params: &[Param], device: &Device) -> kernels::Result<Self> {
        let mut opt = AdamW::default();
        for p in params {
            opt.m.insert(p.id.into(), Tensor::zeros(&p.shape, device)?);
            opt.v.insert(p.id.into(), Tensor::zeros(&p.shape, device)?);
        }
        Ok(opt)
    }

    /// Starts a step: global norm, clip factor (`max_grad_norm / (norm + 1e-6)` above the
    /// limit, as `torch.nn.utils.clip_grad_norm_`), step count + 1, learning rate.
    ///
    /// Errors: a NaN or infinite norm ([`LearnerError::NonFiniteGradient`]), before anything
    /// changes: one bad batch must not poison the served weights.
    pub fn begin_step(&mut self, grads: &Grads, cfg: &TrainConfig) -> Result<StepScale> {
        let norm = grads.global_norm()?;
        if !norm.is_finite() {
            return Err(LearnerError::NonFiniteGradient { norm });
        }
        let clip =
            if cfg.max_grad_norm > 0.0 && norm > cfg.max_grad_norm { cfg.max_grad_norm / (norm + 1e-6) } else { 1.0 };
        self.step += 1;
        Ok(StepScale { grad_norm: norm, clip, lr: cfg.lr_at(self.step) })
    }

    /// Advances the moments of `key` with its gradient `g` and returns the Adam step
    /// `Δ = −lr · m̂ / (√v̂ + ε)` ([`ops::adamw_delta`]); the parameter update is
    /// `p ← (1 − lr·weight_decay)·p + Δ` (decoupled decay first, as PyTorch). Needs no
    /// access to `p`: the learner computes it while the engine keeps serving and applies it
    /// under the write guard in one pass.
    pub fn delta(&mut self, key: ParamKey, g: &Tensor, s: &StepScale, cfg: &TrainConfig) -> kernels::Result<Tensor> {
        let step = self.adamw_step(s, cfg);
        let (m, v) = self.moments(key, g)?;
        ops::adamw_delta(g, m, v, &step)
    }

    /// [`Self::delta`] for the HF weights `parts = (id, gradient)` that one served linear
    /// weight stacks (fused q/k/v, gate/up), returned laid out like it in one pass
    /// ([`ops::adamw_delta_packed`]).
    pub fn delta_packed(
        &mut self,
        parts: &[(ParamId, &Tensor)],
        s: &StepScale,
        cfg: &TrainConfig,
    ) -> kernels::Result<PackedWeight> {
        let step = self.adamw_step(s, cfg);
        // The parts' moments, taken out of the maps for the call and put back after it.
        let mut mv = Vec::with_capacity(parts.len());
        for &(id, g) in parts {
            let key = id.into();
            self.moments(key, g)?;
            mv.push((self.m.remove(&key).expect("made"), self.v.remove(&key).expect("made")));
        }
        let mut ps: Vec<AdamWPart> =
            parts.iter().zip(mv.iter_mut()).map(|((_, g), (m, v))| AdamWPart { g, m, v }).collect();
        let laid = ops::adamw_delta_packed(&mut ps, &step);
        drop(ps);
        for (&(id, _), (m, v)) in parts.iter().zip(mv) {
            self.m.insert(id.into(), m);
            self.v.insert(id.into(), v);
        }
        laid
    }

    /// The moments of `key` (zeros shaped like `g` at its first step).
    fn moments(&mut self, key: ParamKey, g: &Tensor) -> kernels::Result<(&mut Tensor, &mut Tensor)> {
        if let std::collections::btree_map::Entry::Vacant(e) = self.m.entry(key) {
            e.insert(Tensor::zeros(g.shape(), &g.device())?);
            self.v.insert(key, Tensor::zeros(g.shape(), &g.device())?);
        }
        Ok((self.m.get_mut(&key).expect("inserted"), self.v.get_mut(&key).expect("inserted")))
    }

    fn adamw_step(&self, s: &StepScale, cfg: &TrainConfig) -> AdamWStep {
        let t = self.step as i32;
        AdamWStep {
            lr: s.lr,
            beta1: cfg.adam_beta1,
            beta2: cfg.adam_beta2,
            eps: cfg.adam_epsilon,
            bias_correction1: 1.0 - cfg.adam_beta1.powi(t),
            bias_correction2: 1.0 - cfg.adam_beta2.powi(t),
            clip: s.clip,
        }
    }

    /// The decoupled weight-decay factor `1 − lr·weight_decay` of this step.
    pub fn decay(s: &StepScale, cfg: &TrainConfig) -> f32 {
        (1.0 - s.lr * cfg.weight_decay) as f32
    }

    /// One whole step over tensors keyed like the gradients ([`Self::begin_step`] +
    /// [`Self::delta`] + the decayed update). Returns `(grad_norm before clipping, learning
    /// rate used)`.
    pub fn step(
        &mut self,
        params: &mut BTreeMap<ParamKey, Tensor>,
        grads: &Grads,
        cfg: &TrainConfig,
    ) -> Result<(f64, f64)> {
        let s = self.begin_step(grads, cfg)?;
        let decay = Self::decay(&s, cfg);
        for (&key, g) in &grads.tensors {
            if let Some(p) = params.get_mut(&key) {
                let d = self.delta(key, g, &s, cfg)?;
                ops::scale_add_inplace(p, decay, &d)?;
            }
        }
        Ok((s.grad_norm, s.lr))
    }
}

/// One update's AdamW steps, handed to the served model by parameter id
/// ([`engine::model::StepSource`] for `Model::lay_out`). A weight without a gradient gets a
/// zero step and its moments stay as they are (the gradients were checked against the
/// table before: none is ignored).
pub(crate) struct Steps<'a> {
    pub opt: &'a mut AdamW,
    pub grads: &'a Grads,
    pub scale: &'a StepScale,
    pub cfg: &'a TrainConfig,
    pub device: Device,
}

impl engine::model::StepSource for Steps<'_> {
    fn dense(&mut self, id: ParamId, shape: &[usize]) -> kernels::Result<Tensor> {
        match self.grads.tensors.get(&id.into()) {
            Some(g) => self.opt.delta(id.into(), g, self.scale, self.cfg),
            None => Tensor::zeros(shape, &self.device),
        }
    }

    fn packed(&mut self, parts: &[(ParamId, usize)], k: usize) -> kernels::Result<PackedWeight> {
        let grads = self.grads;
        let gs: Option<Vec<(ParamId, &Tensor)>> =
            parts.iter().map(|&(id, _)| grads.tensors.get(&id.into()).map(|g| (id, g))).collect();
        if let Some(gs) = gs {
            return self.opt.delta_packed(&gs, self.scale, self.cfg);
        }
        // Some part has no gradient: step the others, zeros for it, then stack and pack.
        let steps = parts.iter().map(|&(id, r)| self.dense(id, &[r, k])).collect::<kernels::Result<Vec<_>>>()?;
        let stacked = match steps.len() {
            1 => steps.into_iter().next().expect("one"),
            _ => ops::cat_rows(&steps.iter().collect::<Vec<_>>())?,
        };
        ops::pack_weight(&stacked)
    }
}
