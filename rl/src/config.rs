//! A training job's configuration: `rlserve train --config job.toml` or the JSON body of
//! `POST /v1/train/jobs`, one serde type for both. Unknown keys are errors at every level.
//! Job keys are at the top; the learner's settings ([`TrainConfig`], TRL names) are the
//! `[learner]` table (`"learner": {...}` in JSON). `learner.temperature`,
//! `learner.max_staleness` and `learner.max_completion_length` also drive the rollouts.
//! With `learner.loss_type = "dpo"` (or `"ipo"`) the job trains on the preference pairs of
//! its dataset (`prompt`, `chosen`, `rejected` per line) instead of rollouts.
//!
//! Learner defaults: a job starts from one default set, [`job_learner_defaults`]
//! (`TrainConfig::default()` with `learning_rate = 1e-5`, `max_completion_length = 64`,
//! `max_staleness = 0`, `log_kl_to_initial = true`), whether `[learner]` is absent or
//! names only some keys: a given table is laid over that set, key by key. When
//! `total_steps` is unset the schedule's length is the job's `max_steps`, so `linear` and
//! `cosine` reach 0 at the end of the run (as in Hugging Face / TRL).

use super::error::{Result, RlError};
use super::rewards::RewardSpec;
use engine::SamplingParams;
use learner::TrainConfig;
use serde::{Deserialize, Deserializer};
use std::path::PathBuf;

/// A training job: data, rewards, sampling, schedule, outputs, and the `[learner]` table.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JobConfig {
    /// Model folder; default the served model (or the default model for `rlserve train`).
    pub model: Option<PathBuf>,
    /// JSONL with `prompt` or `messages` per line plus fields for the rewards (`answer`), or
    /// `builtin:arithmetic` (see `dataset.rs`); for DPO/IPO, `prompt`, `chosen`, `rejected`.
    pub dataset: String,
    /// Held-out prompts for greedy evaluation (same format); default none.
    pub eval_dataset: Option<String>,
    /// Evaluate every this many steps (0 = only before the first and after the last step).
    pub eval_interval: u64,
    /// At most this many eval prompts.
    pub eval_size: usize,
    /// Completions per prompt (a GRPO group; PPO may use 1; unused by DPO).
    pub num_generations: usize,
    /// Prompts per step (samples per step = prompts_per_step × num_generations; DPO: pairs per step).
    pub prompts_per_step: usize,
    /// Steps of the run (and the learning-rate schedule's length unless `total_steps`).
    pub max_steps: u64,
    /// Rollout nucleus mass (1 = off: μ is then the tempered softmax the learner computes).
    pub top_p: f32,
    /// Rollout top-k cutoff (0 = off).
    pub top_k: i32,
    /// Rollout min-p cutoff (0 = off).
    pub min_p: f32,
    /// Stop strings of the rollouts and evaluations.
    pub stop: Vec<String>,
    /// Render `prompt` lines as one user message through the chat template.
    pub apply_chat_template: bool,
    /// A system message put before every prompt (through the chat template).
    pub system_prompt: Option<String>,
    /// Extra chat-template variables for every prompt (vLLM's `chat_template_kwargs`, e.g.
    /// `{ enable_thinking = false }` for Qwen3); a dataset line's own object is laid over
    /// them.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Seeds the rollouts' sampling, and the dataset order unless `data_seed` is set.
    pub seed: u64,
    /// Seeds the dataset order (transformers' `TrainingArguments.data_seed`); unset = `seed`.
    /// Fixing it while varying `seed` repeats a run on the same prompts with other samples.
    pub data_seed: Option<u64>,
    /// Reward functions, summed with their weights.
    pub rewards: Vec<RewardSpec>,
    /// Save a checkpoint every this many steps (0 = only at the end).
    pub save_steps: u64,
    /// Keep at most this many checkpoints (oldest deleted first).
    pub save_total_limit: usize,
    /// Checkpoints, `metrics.jsonl` and `metrics.png` go here.
    pub output_dir: PathBuf,
    /// A checkpoint folder, or `latest` (the newest under `output_dir`, if any).
    pub resume_from_checkpoint: Option<String>,
    /// Start a new run in an `output_dir` that holds an earlier run's checkpoints,
    /// `metrics.jsonl` or `completions.jsonl` (transformers' name): they are removed first. Unset, such a folder is
    /// refused unless the job resumes, so a new run's pruning never deletes its own
    /// checkpoints in favour of an older run's higher step numbers.
    pub overwrite_output_dir: bool,
    /// Entropy-collapse alarm: mean entropy below this fraction of its first-steps value.
    pub entropy_collapse_fraction: f64,
    /// Append every rollout (step, prompt, completion, reward, finish_reason, tokens) to
    /// `output_dir/completions.jsonl` (TRL's `log_completions`).
    pub log_completions: bool,
    /// How far ahead of the learner the generator starts batches within `max_staleness`
    /// (see [`GenerateAhead`]).
    pub generate_ahead: GenerateAhead,
    /// The learner's settings (the `[learner]` table), over [`job_learner_defaults`].
    #[serde(deserialize_with = "over_job_learner_defaults")]
    pub learner: TrainConfig,
}

/// How far ahead of the learner a job's generator runs, within the `max_staleness` bound.
/// The generator produces one batch at a time, so running more than one batch ahead never
/// makes it faster: it only makes batches staler, and on a device shared with the learner
/// it takes compute the learner could use now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GenerateAhead {
    /// One batch ahead (the next batch is generated while the learner trains the current
    /// one: staleness 1), and further up to `max_staleness` only while generating a batch is
    /// measured to take at least as long as a learner step (the learner would otherwise wait).
    AsNeeded,
    /// Every batch the bound admits, as soon as the generator is free: where generation is
    /// faster than learning every batch is exactly `max_staleness` versions old (to study
    /// staleness, as AReaL's and PipelineRL's eager rollout workers do on their own devices).
    ToMaxStaleness,
}

/// The learner settings every job starts from (see the module docs).
pub fn job_learner_defaults() -> TrainConfig {
    TrainConfig {
        learning_rate: 1e-5,
        max_completion_length: 64,
        max_staleness: Some(0),
        log_kl_to_initial: true,
        ..Default::default()
    }
}

/// Deserializes a `[learner]` table as [`job_learner_defaults`] with the table's keys laid
/// over it. [`TrainConfig`] itself rejects unknown keys and wrong types; the message names
/// the key (`learner.<key>`).
fn over_job_learner_defaults<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<TrainConfig, D::Error> {
    use serde::de::Error;
    use serde_json::{Map, Value};
    let given = Map::<String, Value>::deserialize(d)?;
    let defaults = match serde_json::to_value(job_learner_defaults()) {
        Ok(Value::Object(m)) => m,
        other => return Err(D::Error::custom(format!("the learner defaults are not a table: {other:?}"))),
    };
    let over = |keys: &mut dyn Iterator<Item = (&String, &Value)>| {
        let mut table = defaults.clone();
        table.extend(keys.map(|(k, v)| (k.clone(), v.clone())));
        serde_json::from_value::<TrainConfig>(Value::Object(table))
    };
    over(&mut given.iter()).map_err(|e| {
        // The first key that fails on its own is the one to name.
        match given.iter().find(|kv| over(&mut std::iter::once(*kv)).is_err()) {
            Some((k, _)) => D::Error::custom(format!("`learner.{k}`: {e}")),
            None => D::Error::custom(format!("`learner`: {e}")),
        }
    })
}

impl Default for JobConfig {
    fn default() -> Self {
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
            chat_template_kwargs: Default::default(),
            seed: 0,
            data_seed: None,
            rewards: vec![RewardSpec::ExactAnswer { weight: 1.0, first_number: false }],
            save_steps: 0,
            save_total_limit: 2,
            output_dir: PathBuf::from("runs/job"),
            resume_from_checkpoint: None,
            overwrite_output_dir: false,
            entropy_collapse_fraction: 0.3,
            log_completions: false,
            generate_ahead: GenerateAhead::AsNeeded,
            learner: job_learner_defaults(),
        }
    }
}

/// Most steps a job may ask for (a request cannot ask for unbounded work).
pub const MAX_STEPS: u64 = 10_000_000;
/// Most prompts per step, and most sequences per step (`prompts_per_step ×
/// num_generations`): a step's rollouts are at most what one `/v1/rollouts` request may ask
/// for, so a job cannot queue unbounded work in the engine.
pub const MAX_PROMPTS_PER_STEP: usize = 4096;

impl JobConfig {
    /// Parses and validates a TOML job config (`rlserve train --config`).
    pub fn from_toml(text: &str) -> Result<Self> {
        let cfg: JobConfig = toml::from_str(text).map_err(|e| RlError::invalid_input(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses and validates the JSON body of `POST /v1/train/jobs`; a type error names the
    /// field's path (`learner.loss_type`).
    pub fn from_json(v: serde_json::Value) -> Result<Self> {
        if !v.is_object() {
            return Err(RlError::invalid_input(format!(
                "the job config must be a JSON object (the TOML's keys), got {}",
                match v {
                    serde_json::Value::Array(_) => "an array",
                    serde_json::Value::String(_) => "a string",
                    serde_json::Value::Number(_) => "a number",
                    serde_json::Value::Bool(_) => "a boolean",
                    _ => "null",
                }
            )));
        }
        let cfg: JobConfig = serde_path_to_error::deserialize(v).map_err(|e| {
            let (path, inner) = (e.path().to_string(), json_words(&e.inner().to_string()));
            // The learner table's errors name their key already (`learner.k`: ...).
            let named = inner.strip_prefix('`').and_then(|r| r.split_once('`')).map(|(k, _)| k.to_string());
            match named {
                Some(k) => RlError::invalid(&k, inner),
                None if path == "." => RlError::invalid_input(inner),
                None => RlError::invalid(&path, format!("`{path}`: {inner}")),
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The allowed ranges; messages name the field, the value and the limit.
    pub fn validate(&self) -> Result<()> {
        let t = &self.learner;
        let seqs = self.prompts_per_step.saturating_mul(self.num_generations);
        let checks: [(bool, &str, String); 9] = [
            (
                self.num_generations >= 2 || (!t.loss_type.is_group_relative() && self.num_generations >= 1),
                "num_generations",
                if t.loss_type.is_group_relative() {
                    format!("`num_generations` must be >= 2 (a group needs two samples), got {}", self.num_generations)
                } else {
                    format!("`num_generations` must be >= 1, got {}", self.num_generations)
                },
            ),
            (
                (1..=MAX_PROMPTS_PER_STEP).contains(&self.prompts_per_step),
                "prompts_per_step",
                format!("`prompts_per_step` must be in [1, {MAX_PROMPTS_PER_STEP}], got {}", self.prompts_per_step),
            ),
            (
                t.loss_type.is_preference() || seqs <= MAX_PROMPTS_PER_STEP,
                "num_generations",
                format!(
                    "`prompts_per_step` × `num_generations` must be <= {MAX_PROMPTS_PER_STEP} sequences per step, got {} × {} = {seqs}",
                    self.prompts_per_step, self.num_generations
                ),
            ),
            (
                (1..=MAX_STEPS).contains(&self.max_steps),
                "max_steps",
                format!("`max_steps` must be in [1, {MAX_STEPS}], got {}", self.max_steps),
            ),
            (
                t.max_completion_length >= 1,
                "learner.max_completion_length",
                format!("`learner.max_completion_length` must be >= 1, got {}", t.max_completion_length),
            ),
            (!self.rewards.is_empty(), "rewards", "`rewards` must name at least one reward function".into()),
            (
                !engine::sampling::is_greedy_temperature(t.temperature),
                "learner.temperature",
                format!(
                    "`learner.temperature` must be >= {} for RL sampling (below it sampling is greedy, and greedy samples are not on-policy), got {}",
                    engine::sampling::GREEDY_EPS,
                    t.temperature
                ),
            ),
            (
                (0.0..=1.0).contains(&self.entropy_collapse_fraction),
                "entropy_collapse_fraction",
                format!("`entropy_collapse_fraction` must be in [0, 1], got {}", self.entropy_collapse_fraction),
            ),
            (
                t.total_steps != Some(0),
                "learner.total_steps",
                "`learner.total_steps` must be >= 1 when set, got 0".into(),
            ),
        ];
        if let Some((_, param, msg)) = checks.into_iter().find(|(ok, ..)| !ok) {
            return Err(RlError::invalid(param, msg));
        }
        t.validate()
            .map_err(|(key, msg)| RlError::invalid(&format!("learner.{key}"), msg.replacen('`', "`learner.", 1)))?;
        for r in &self.rewards {
            r.validate()?;
        }
        self.sampling_params(0).validate().map_err(|e| RlError::invalid_input(e.to_string()))
    }

    /// `max_staleness` (0 = synchronous: generate step k+1 only after step k's update).
    pub fn max_staleness(&self) -> u64 {
        self.learner.max_staleness.unwrap_or(0)
    }

    /// The staleness bound of step `s` (0-based): 0 during `on_policy_warmup_steps`, then
    /// `max_staleness` (see `TrainConfig::on_policy_warmup_steps`).
    pub fn staleness_at(&self, s: u64) -> u64 {
        let l = &self.learner;
        let warmup = l.on_policy_warmup_steps.unwrap_or_else(|| (1.0 / (1.0 - l.adam_beta1).max(1e-6)).round() as u64);
        if s < warmup {
            0
        } else {
            self.max_staleness()
        }
    }

    /// The learner's settings for this job: `[learner]` with `total_steps` defaulting to the
    /// run's optimizer steps, `max_steps × updates per batch` (PPO: `num_ppo_epochs ×
    /// num_mini_batches`), so the schedule ends with the run.
    pub fn train_config(&self) -> TrainConfig {
        let total = self.max_steps * self.learner.updates_per_batch();
        TrainConfig { total_steps: Some(self.learner.total_steps.unwrap_or(total)), ..self.learner.clone() }
    }

    /// The seed of the dataset order: `data_seed`, else `seed`.
    pub fn dataset_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed)
    }

    /// Sampling parameters of the rollouts of step `step` (seeded per step).
    pub fn sampling_params(&self, step: u64) -> SamplingParams {
        SamplingParams {
            n: self.num_generations,
            temperature: self.learner.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: Some(engine::sampling::splitmix64(self.seed ^ engine::sampling::splitmix64(step))),
            max_tokens: Some(self.learner.max_completion_length),
            stop: self.stop.clone(),
            ..Default::default()
        }
    }
}

/// A serde type error in a JSON reader's words: the expected Rust primitive at its end
/// (`invalid type: floating point \`1.5\`, expected i128`) becomes the JSON values it takes
/// (`expected an integer`); any other message is returned as it is. For the request bodies
/// of the HTTP API and the JSON job configs alike.
pub fn json_words(msg: &str) -> String {
    const WORDS: [(&str, &str); 12] = [
        ("u8", "an integer in [0, 255]"),
        ("u16", "an integer in [0, 65535]"),
        ("u32", "an integer in [0, 2^32)"),
        ("u64", "an integer in [0, 2^64)"),
        ("usize", "an integer in [0, 2^64)"),
        ("i8", "an integer in [-128, 127]"),
        ("i16", "an integer in [-32768, 32767]"),
        ("i32", "an integer in [-2^31, 2^31)"),
        ("i64", "an integer in [-2^63, 2^63)"),
        ("i128", "an integer"),
        ("f32", "a number"),
        ("f64", "a number"),
    ];
    let Some((head, prim)) = msg.rsplit_once(", expected ") else { return msg.to_string() };
    match WORDS.iter().find(|(p, _)| *p == prim) {
        Some((_, words)) => format!("{head}, expected {words}"),
        None => msg.to_string(),
    }
}
