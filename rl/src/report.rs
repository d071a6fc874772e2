//! What a job reports per step: the learner's metrics plus the job's own (rollout and train
//! throughput, waits, reward-hacking signals, the entropy-collapse alarm), appended to
//! `output_dir/metrics.jsonl`, shown on a progress bar, and plotted at the end.

use super::error::{Result, RlError};
use indicatif::{ProgressBar, ProgressStyle};
use learner::{StepMetrics, TrainSample};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Steps whose mean entropy and completion length are the baselines of the alarms.
const BASELINE_STEPS: usize = 3;

/// One step of a job (`metrics.jsonl` line with `"kind": "train"`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepRecord {
    /// The job's step (the feedback learner: its optimizer step).
    pub step: u64,
    /// False when every sample was filtered out (no optimizer step, version unchanged).
    pub updated: bool,
    /// The learner's metrics of the step (defaults when nothing was trained).
    #[serde(flatten)]
    pub learner: StepMetrics,
    /// Mean of the job reward over the step's samples (before any filtering; its std is the
    /// learner metrics' `reward_std`, set to the same samples'). DPO/IPO (whose sample rewards
    /// are only the preference labels): the implicit reward margin `rewards/margins`, std 0.
    pub reward: f64,
    /// Where the step's samples came from.
    #[serde(flatten)]
    pub timing: RolloutTiming,
    /// Completion tokens generated per second of generation.
    pub rollout_tokens_per_s: f64,
    /// k3 KL to the initial weights on the trained tokens (= the learner's `kl`).
    pub kl_to_initial: f64,
    /// Mean completion length over its mean in the first steps.
    pub completion_length_drift: f64,
    /// Mean entropy below `entropy_collapse_fraction` × its first-steps mean.
    pub entropy_collapse: bool,
    /// Training reward minus the latest eval reward (None before any eval).
    pub train_eval_reward_gap: Option<f64>,
    /// Seconds since the log was opened.
    pub elapsed_seconds: f64,
}

/// Greedy evaluation on the eval set (`metrics.jsonl` line with `"kind": "eval"`).
#[derive(Debug, Clone, Serialize)]
pub struct EvalRecord {
    /// The job step after which it ran (0 = before the first).
    pub step: u64,
    /// The policy version evaluated.
    pub version: u64,
    /// Mean job reward of the greedy completions.
    pub eval_reward: f64,
    /// Fraction whose final answer equals `answer` (when the eval set has answers).
    pub eval_accuracy: Option<f64>,
    /// Eval prompts completed (DPO/IPO: held-out pairs).
    pub eval_size: usize,
    /// DPO/IPO jobs: the loss and implicit-reward metrics of the held-out pairs (TRL names).
    #[serde(flatten)]
    pub preferences: Option<PreferenceEval>,
}

/// A DPO/IPO evaluation on held-out pairs.
#[derive(Debug, Clone, Serialize)]
pub struct PreferenceEval {
    /// The DPO/IPO loss.
    pub loss: f64,
    /// `rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`, ...
    #[serde(flatten)]
    pub stats: learner::algos::dpo::DpoStats,
}

/// Where a step's samples came from: rollout volume, time and waits (all zero for the
/// feedback learner, whose samples were served to users).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RolloutTiming {
    /// Completion tokens generated for the step.
    pub rollout_tokens: usize,
    /// Seconds from submitting the step's prompts to the last completion.
    pub generation_seconds: f64,
    /// Generator time waiting for admission (staleness bound).
    pub admission_wait_seconds: f64,
    /// Learner time waiting for the batch.
    pub learner_wait_seconds: f64,
    /// Samples skipped because a reward function failed.
    pub reward_errors: usize,
}

/// The job's metrics log, progress bar and alarm baselines.
pub struct JobLog {
    file: Option<std::fs::File>,
    dir: PathBuf,
    bar: Option<ProgressBar>,
    start: std::time::Instant,
    entropies: Vec<f64>,
    lengths: Vec<f64>,
    last_eval_reward: Option<f64>,
}

impl JobLog {
    /// Appends to `dir/metrics.jsonl`, first dropping lines after `start_step` (a resumed
    /// run redoes those steps); a progress bar over `max_steps` when given.
    pub fn open(dir: &Path, start_step: u64, max_steps: Option<u64>) -> Result<Self> {
        let path = dir.join("metrics.jsonl");
        let kept: Vec<serde_json::Value> =
            read_lines(&path).into_iter().filter(|l| l["step"].as_u64().is_some_and(|s| s <= start_step)).collect();
        let tmp = path.with_extension("jsonl.partial");
        let text: String = kept.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, &path)).map_err(|e| RlError::io(&path, e))?;
        let file =
            std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| RlError::io(&path, e))?;
        let bar = max_steps.map(|n| {
            let b = ProgressBar::new(n);
            b.set_style(
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] step {pos}/{len} {msg}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            b.set_position(start_step);
            b
        });
        Ok(Self {
            file: Some(file),
            dir: dir.to_path_buf(),
            bar,
            start: std::time::Instant::now(),
            entropies: vec![],
            lengths: vec![],
            last_eval_reward: None,
        })
    }

    /// A log that only builds records (no file, no bar): the feedback learner's.
    pub fn detached() -> Self {
        Self {
            file: None,
            dir: PathBuf::new(),
            bar: None,
            start: std::time::Instant::now(),
            entropies: vec![],
            lengths: vec![],
            last_eval_reward: None,
        }
    }

    fn write(&mut self, kind: &str, v: &impl Serialize) -> Result<()> {
        let Some(f) = &mut self.file else { return Ok(()) };
        let mut j = serde_json::to_value(v).map_err(|e| RlError::io(self.dir.join("metrics.jsonl"), e.into()))?;
        j["kind"] = kind.into();
        writeln!(f, "{j}").and_then(|_| f.flush()).map_err(|e| RlError::io(self.dir.join("metrics.jsonl"), e))
    }

    /// Builds, logs and shows the record of one step (`learner` is `None` when nothing was
    /// trained). `entropy_collapse_fraction` is the alarm threshold.
    pub fn step(
        &mut self,
        step: u64,
        learner: Option<StepMetrics>,
        samples: &[TrainSample],
        t: &RolloutTiming,
        entropy_collapse_fraction: f64,
    ) -> StepRecord {
        let rewards: Vec<f64> = samples.iter().filter_map(|s| s.reward).map(f64::from).collect();
        let n = rewards.len().max(1) as f64;
        let (mean, std) = match learner.as_ref().and_then(|m| m.dpo.as_ref()) {
            Some(d) => (d.rewards_margins, 0.0),
            None => {
                let mean = rewards.iter().sum::<f64>() / n;
                (mean, (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt())
            }
        };
        let len = samples.iter().map(|s| s.completion_ids.len()).sum::<usize>() as f64 / samples.len().max(1) as f64;
        let updated = learner.is_some();
        let mut learner = learner.unwrap_or_default();
        // One `reward_std` in the record (TRL's: over every sample of the step).
        learner.reward_std = std;
        if updated && self.entropies.len() < BASELINE_STEPS {
            self.entropies.push(learner.entropy);
        }
        if self.lengths.len() < BASELINE_STEPS {
            self.lengths.push(len);
        }
        let avg = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let (h0, l0) = (avg(&self.entropies), avg(&self.lengths));
        let entropy_collapse =
            updated && self.entropies.len() >= BASELINE_STEPS && learner.entropy < entropy_collapse_fraction * h0;
        if entropy_collapse {
            tracing::warn!(
                step,
                entropy = learner.entropy,
                baseline = h0,
                "entropy collapse: mean entropy fell below {entropy_collapse_fraction} × its first-steps value"
            );
        }
        let rec = StepRecord {
            step,
            updated,
            kl_to_initial: learner.loss.kl,
            learner,
            reward: mean,
            rollout_tokens_per_s: t.rollout_tokens as f64 / t.generation_seconds.max(1e-9),
            timing: t.clone(),
            completion_length_drift: if l0 > 0.0 { len / l0 } else { 1.0 },
            entropy_collapse,
            train_eval_reward_gap: self.last_eval_reward.map(|e| mean - e),
            elapsed_seconds: self.start.elapsed().as_secs_f64(),
        };
        if let Err(e) = self.write("train", &rec) {
            tracing::warn!("{e}");
        }
        if let Some(b) = &self.bar {
            b.set_position(step);
            b.set_message(format!(
                "reward {:.3} kl {:.4} entropy {:.3} staleness {:.1} v{}",
                rec.reward, rec.kl_to_initial, rec.learner.entropy, rec.learner.staleness_mean, rec.learner.version
            ));
        }
        rec
    }

    /// Logs and shows an evaluation; later steps report their gap to it.
    pub fn eval(&mut self, rec: &EvalRecord) -> Result<()> {
        self.last_eval_reward = Some(rec.eval_reward);
        if let Some(b) = &self.bar {
            b.println(format!(
                "eval at step {}: reward {:.3}{}",
                rec.step,
                rec.eval_reward,
                rec.eval_accuracy.map(|a| format!(", accuracy {a:.3}")).unwrap_or_default()
            ));
        }
        self.write("eval", rec)
    }

    /// Finishes the bar and writes `metrics.png`.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(b) = &self.bar {
            b.finish();
        }
        plot(&self.dir)
    }
}

/// The JSON lines of a `metrics.jsonl` (unreadable lines skipped).
fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// Writes `dir/metrics.png` from `dir/metrics.jsonl` (see `plot.rs` for the layout).
pub fn plot(dir: &Path) -> Result<()> {
    super::plot::write_png(&dir.join("metrics.png"), &read_lines(&dir.join("metrics.jsonl")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step record names each metric once (the learner's metrics are flattened into it).
    #[test]
    fn a_step_record_names_each_key_once() {
        let text = serde_json::to_string(&StepRecord::default()).unwrap();
        let keys: Vec<&str> = text.split('"').skip(1).step_by(2).filter(|k| !k.is_empty()).collect();
        let mut seen = std::collections::BTreeSet::new();
        for k in &keys {
            assert!(seen.insert(*k) || k.parse::<f64>().is_ok(), "`{k}` twice in {text}");
        }
        assert!(seen.contains("reward_std"), "{text}");
    }
}
