//! A training job's configuration: `rlserve train --config job.toml` or the JSON body of
//! `POST /v1/train/jobs`. Learner knobs are the learner's [`TrainConfig`] fields (TRL
//! names), flattened to the top level as in TRL's `GRPOConfig`; `temperature`,
//! `max_staleness` and `max_completion_length` are read from there too.

use super::rewards::RewardSpec;
use learner::TrainConfig;
use engine::SamplingParams;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct JobConfig {
    /// Model folder; default the served model (or the default model for `rlserve train`).
    pub model: Option<PathBuf>,
    /// JSONL with `prompt` or `messages` per line plus fields for the rewards (`answer`), or
    /// `builtin:arithmetic` (see `dataset.rs`).
    pub dataset: String,
    /// Held-out prompts for greedy evaluation (same format); default none.
    pub eval_dataset: Option<String>,
    /// Evaluate every this many steps (0 = only before the first and after the last step).
    pub eval_interval: u64,
    /// At most this many eval prompts.
    pub eval_size: usize,
    /// Completions per prompt (a GRPO group).
    pub num_generations: usize,
    /// Prompts per optimizer step (samples per step = prompts_per_step × num_generations).
    pub prompts_per_step: usize,
    pub max_steps: u64,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub stop: Vec<String>,
    /// Render `prompt` lines as one user message through the chat template.
    pub apply_chat_template: bool,
    pub system_prompt: Option<String>,
    pub seed: u64,
    pub rewards: Vec<RewardSpec>,
    /// Save a checkpoint every this many steps (0 = only at the end).
    pub save_steps: u64,
    /// Keep at most this many checkpoints (oldest deleted first).
    pub save_total_limit: usize,
    /// Checkpoints, `metrics.jsonl` and `metrics.png` go here.
    pub output_dir: PathBuf,
    /// A checkpoint folder, or `latest` (the newest under `output_dir`, if any).
    pub resume_from_checkpoint: Option<String>,
    /// Entropy-collapse alarm: mean entropy below this fraction of its first-steps value.
    pub entropy_collapse_fraction: f64,
    /// Learner settings (TRL names), flattened.
    #[serde(flatten)]
    pub train: TrainConfig,
}

impl Default for JobConfig {
    fn default() -> Self {
        let mut train = TrainConfig { max_staleness: Some(0), log_kl_to_initial: true, ..Default::default() };
        train.learning_rate = 1e-5;
        train.max_completion_length = 64;
        Self {
            model: None,
            dataset: "builtin:arithmetic".into(),
            eval_dataset: None,
            eval_interval: 0,
            eval_size: 64,
            num_generations: 8,
            prompts_per_step: 4,
            max_steps: 20,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            stop: vec![],
            apply_chat_template: true,
            system_prompt: None,
            seed: 0,
            rewards: vec![RewardSpec::ExactAnswer { weight: 1.0 }],
            save_steps: 0,
            save_total_limit: 2,
            output_dir: PathBuf::from("runs/job"),
            resume_from_checkpoint: None,
            entropy_collapse_fraction: 0.3,
            train,
        }
    }
}

impl JobConfig {
    /// Parses TOML; unknown keys are errors (a typo must not silently use a default).
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let raw: toml::Table = text.parse().map_err(|e: toml::de::Error| e.to_string())?;
        let mut cfg: JobConfig =
            toml::Value::Table(raw.clone()).try_into().map_err(|e: toml::de::Error| e.to_string())?;
        let known = serde_json::to_value(&cfg).map_err(|e| e.to_string())?;
        check_keys(raw.keys(), &known)?;
        cfg.job_defaults(|k| raw.contains_key(k));
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses the JSON body of `POST /v1/train/jobs` (unknown keys are errors).
    pub fn from_json(v: serde_json::Value) -> Result<Self, String> {
        let keys: Vec<String> = v.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        let mut cfg: JobConfig = serde_json::from_value(v).map_err(|e| e.to_string())?;
        check_keys(keys.iter(), &serde_json::to_value(&cfg).map_err(|e| e.to_string())?)?;
        cfg.job_defaults(|k| keys.iter().any(|x| x == k));
        cfg.validate()?;
        Ok(cfg)
    }

    /// A flattened struct takes its own defaults when deserialized, so the job's defaults
    /// for learner keys (see [`Default`]) are applied here to the keys the input left out.
    fn job_defaults(&mut self, given: impl Fn(&str) -> bool) {
        let d = JobConfig::default().train;
        let t = &mut self.train;
        if !given("learning_rate") {
            t.learning_rate = d.learning_rate;
        }
        if !given("max_completion_length") {
            t.max_completion_length = d.max_completion_length;
        }
        if !given("max_staleness") {
            t.max_staleness = d.max_staleness;
        }
        if !given("log_kl_to_initial") {
            t.log_kl_to_initial = d.log_kl_to_initial;
        }
    }

    /// The allowed ranges; messages name the field, the value and the limit.
    pub fn validate(&self) -> Result<(), String> {
        let t = &self.train;
        let checks: [(bool, String); 8] = [
            (
                self.num_generations >= 2,
                format!("`num_generations` must be >= 2 (a group needs two samples), got {}", self.num_generations),
            ),
            (self.prompts_per_step >= 1, format!("`prompts_per_step` must be >= 1, got {}", self.prompts_per_step)),
            (self.max_steps >= 1, format!("`max_steps` must be >= 1, got {}", self.max_steps)),
            (
                t.max_completion_length >= 1,
                format!("`max_completion_length` must be >= 1, got {}", t.max_completion_length),
            ),
            (!self.rewards.is_empty(), "`rewards` must name at least one reward function".into()),
            (
                t.temperature > 0.0,
                format!(
                    "`temperature` must be > 0 for RL sampling (greedy samples are not on-policy), got {}",
                    t.temperature
                ),
            ),
            (
                (0.0..=1.0).contains(&self.entropy_collapse_fraction),
                format!("`entropy_collapse_fraction` must be in [0, 1], got {}", self.entropy_collapse_fraction),
            ),
            (t.learning_rate >= 0.0, format!("`learning_rate` must be >= 0, got {}", t.learning_rate)),
        ];
        if let Some((_, msg)) = checks.into_iter().find(|(ok, _)| !ok) {
            return Err(msg);
        }
        for r in &self.rewards {
            r.validate()?;
        }
        self.sampling_params(0).validate().map_err(|e| e.to_string())
    }

    /// `max_staleness` (0 = synchronous: generate step k+1 only after step k's update).
    pub fn max_staleness(&self) -> u64 {
        self.train.max_staleness.unwrap_or(0)
    }

    /// Sampling parameters of the rollouts of step `step` (seeded per step).
    pub fn sampling_params(&self, step: u64) -> SamplingParams {
        SamplingParams {
            n: self.num_generations,
            temperature: self.train.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: Some(engine::sampling::splitmix64(self.seed ^ engine::sampling::splitmix64(step))),
            max_tokens: Some(self.train.max_completion_length),
            stop: self.stop.clone(),
            ..Default::default()
        }
    }
}

fn check_keys<'a>(keys: impl Iterator<Item = &'a String>, known: &serde_json::Value) -> Result<(), String> {
    for k in keys {
        if known.get(k).is_none() {
            return Err(format!("unknown field `{k}` in the job config"));
        }
    }
    Ok(())
}
