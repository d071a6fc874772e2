//! `rlserve train-step`: one optimizer step on a JSONL batch, for debugging the learner.

use crate::cli::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use engine::{Model, SharedModel};
use learner::{checkpoint, TrainConfig, TrainSample, Trainer};
use std::path::PathBuf;

#[derive(Args)]
pub struct TrainStepArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// JSON lines: {"prompt_ids", "completion_ids", "behavior_logprobs", "advantage"}, or
    /// with "reward" and "group" instead of "advantage" (PPO: "reward"; DPO/IPO: pairs as
    /// two lines of one "group" with rewards 1 and 0, "behavior_logprobs" optional).
    #[arg(long)]
    pub batch: PathBuf,
    /// TOML with learner settings (TRL names: loss_type, importance_sampling_level, epsilon,
    /// epsilon_high, beta, kl_estimator, learning_rate, max_grad_norm, scale_rewards, ...).
    #[arg(long)]
    pub config: Option<PathBuf>,
    #[arg(long)]
    pub learning_rate: Option<f64>,
    #[arg(long)]
    pub loss_type: Option<String>,
    #[arg(long)]
    pub importance_sampling_level: Option<String>,
    #[arg(long)]
    pub epsilon: Option<f32>,
    #[arg(long)]
    pub epsilon_high: Option<f32>,
    #[arg(long)]
    pub beta: Option<f32>,
    /// Sampling temperature of the batch (the learner's ℓ uses it).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Write the loss gradient (before clipping and the optimizer) here, with HF names.
    #[arg(long)]
    pub dump_grads: Option<PathBuf>,
    /// Save the updated weights and optimizer state as a checkpoint folder.
    #[arg(long)]
    pub save: Option<PathBuf>,
}

/// Parses and validates the batch; errors name the line.
pub fn read_batch(path: &PathBuf, vocab: usize) -> Result<Vec<TrainSample>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --batch {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let s: TrainSample =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        s.validate(vocab).map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        out.push(s);
    }
    if out.is_empty() {
        bail!("{}: the batch is empty", path.display());
    }
    Ok(out)
}

fn config(a: &TrainStepArgs) -> Result<TrainConfig> {
    let mut v: toml::Value = match &a.config {
        Some(p) => {
            toml::from_str(&std::fs::read_to_string(p).with_context(|| format!("reading --config {}", p.display()))?)
                .with_context(|| format!("parsing {}", p.display()))?
        }
        None => toml::Value::Table(Default::default()),
    };
    let t = v.as_table_mut().context("the config must be a TOML table")?;
    let mut set = |k: &str, x: Option<toml::Value>| {
        if let Some(x) = x {
            t.insert(k.into(), x);
        }
    };
    set("learning_rate", a.learning_rate.map(toml::Value::Float));
    set("loss_type", a.loss_type.clone().map(toml::Value::String));
    set("importance_sampling_level", a.importance_sampling_level.clone().map(toml::Value::String));
    set("epsilon", a.epsilon.map(|x| toml::Value::Float(x as f64)));
    set("epsilon_high", a.epsilon_high.map(|x| toml::Value::Float(x as f64)));
    set("beta", a.beta.map(|x| toml::Value::Float(x as f64)));
    set("temperature", a.temperature.map(|x| toml::Value::Float(x as f64)));
    v.try_into::<TrainConfig>().context("invalid learner settings")
}

pub fn run(a: TrainStepArgs) -> Result<()> {
    let cfg = config(&a)?;
    let (device, dir) = a.model.open()?;
    let model = Model::load(&dir, &device)?;
    let batch = read_batch(&a.batch, model.config.vocab_size)?;
    let mut trainer = Trainer::new(&model, cfg)?;
    if let Some(p) = &a.dump_grads {
        let (_, grads) = trainer.gradients(&model, &batch)?;
        checkpoint::write_named(p, grads.tensors.iter().map(|(k, t)| (k.to_string(), t)))?;
    }
    let model = SharedModel::new(model);
    let (metrics, _) = trainer.step(&model, &batch)?;
    println!("{}", serde_json::to_string(&metrics)?);
    if let Some(out) = &a.save {
        checkpoint::save_trainer(out, &dir, &model.read(), &trainer, serde_json::json!({}))?;
        eprintln!("saved checkpoint to {}", out.display());
    }
    Ok(())
}
