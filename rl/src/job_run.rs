//! A training job's two threads (DESIGN-NOTES §5). The **generator** submits step `s`'s
//! prompts to the engine (which keeps serving other requests in the same batches), scores
//! the completions and queues the batch; the **learner** ([`LearnerLoop`]) trains on queued
//! batches in order, evaluates and checkpoints. Admission control ([`admits`]): the
//! generator starts step `s` (0-based) only once `done ≥ s − max_staleness` (`done ≥ s`
//! during the `on_policy_warmup_steps`, [`JobConfig::staleness_at`]), where `done` counts
//! finished learner steps. Every token of batch `s` is then computed by a version
//! ≥ `v0 + s − max_staleness`, and batch `s` is trained at version `v0 + s`: staleness ≤
//! `max_staleness`, and nothing is generated only to be thrown away. With
//! `max_staleness = 0` generation and training alternate (synchronous); with k ≥ 1 the
//! generation of step s + 1 overlaps the training of step s, and with
//! `generate_ahead = "as_needed"` (the default) the generator goes further ahead only while
//! it is measured to be slower than the learner ([`Pace`]).
//!
//! DPO/IPO jobs (`learner.loss_type`) generate nothing: step `s`'s batch is the next
//! `prompts_per_step` preference pairs of the dataset (two samples per pair, one group,
//! rewards 1 and 0), and the evaluation scores the held-out pairs' implicit rewards.

use super::config::{GenerateAhead, JobConfig};
use super::context::RlContext;
use super::dataset::{self, Example};
use super::error::{Result, RlError};
use super::job::Job;
use super::learner_loop::{self, Batch, LearnerLoop, LearnerTask};
use super::report::{EvalRecord, JobLog, PreferenceEval, RolloutTiming, StepRecord};
use super::rewards::{exact_answer, Rewards, Scored};
use super::rollout::{Rollout, RolloutSet};
use engine::SamplingParams;
use learner::{TrainSample, Trainer};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

/// What one run of a job works with (borrowed from the job's thread).
pub(crate) struct JobRun<'a> {
    pub job: &'a Job,
    pub ctx: &'a RlContext,
    pub train: &'a [Example],
    pub eval: &'a [Example],
    pub rewards: &'a Rewards,
}

/// Learner progress the generator's admission control waits on.
struct Progress {
    pace: Mutex<Pace>,
    cv: Condvar,
    /// The learner has ended (error or stop): the generator must not start another batch.
    ended: AtomicBool,
}

/// What admission knows of the learner's progress and of both threads' speeds.
#[derive(Debug)]
struct Pace {
    /// Finished learner steps: the 0-based index of the batch the learner trains (or waits for).
    done: u64,
    /// When `done` last changed (or the run started).
    at: Instant,
    /// Seconds per learner step without its wait for the batch (evaluations and checkpoints
    /// included), smoothed by [`smooth`]; `None` before the first step, and again when the
    /// on-policy warm start ends (so both speeds are measured overlapped).
    learner_seconds: Option<f64>,
    /// Seconds the generator takes per batch (rollouts and rewards), smoothed likewise.
    generation_seconds: Option<f64>,
}

impl Pace {
    /// The staleness bound of batch `s` ([`JobConfig::staleness_at`]; the generator's first
    /// batch is `start`). Where the bound changes from the previous batch's (the on-policy
    /// warm start ends), both speeds are forgotten first: the warm start measured each side
    /// alone, and overlapped both slow down by different factors (docs/OFF-POLICY.md,
    /// section 5), so the solo figures could rank them wrongly.
    fn bound_for(&mut self, s: u64, start: u64, cfg: &JobConfig) -> u64 {
        let k = cfg.staleness_at(s);
        if s > start && k != cfg.staleness_at(s - 1) {
            (self.generation_seconds, self.learner_seconds) = (None, None);
        }
        k
    }
}

/// An exponential moving average with weight 0.3 on the newest value `x` (seconds): a few
/// steps' memory, so the pace follows completion lengths as they drift during a run.
fn smooth(avg: Option<f64>, x: f64) -> Option<f64> {
    Some(avg.map_or(x, |a| 0.7 * a + 0.3 * x))
}

/// Whether the generator may start batch `s` (0-based) with `pace.done` learner steps
/// finished, under the staleness bound `k` (this step's, [`JobConfig::staleness_at`]):
/// never beyond `done + k`; with [`GenerateAhead::AsNeeded`] more than one batch ahead
/// only while a batch is measured to take at least as long to generate as a learner step
/// (then the learner would wait for it: the run-ahead buys throughput, not only staleness).
fn admits(s: u64, pace: &Pace, k: u64, ahead: GenerateAhead) -> bool {
    let lead = s.saturating_sub(pace.done);
    let slower = match (pace.generation_seconds, pace.learner_seconds) {
        (Some(g), Some(l)) => g >= l,
        // Not measured yet: no reason to run ahead.
        _ => false,
    };
    lead <= k.min(1) || (lead <= k && (ahead == GenerateAhead::ToMaxStaleness || slower))
}

/// The job's side of the learner loop: batches from the generator's queue.
struct JobTask<'a, 'r> {
    run: &'r JobRun<'a>,
    rx: flume::Receiver<Result<Batch>>,
    progress: &'r Progress,
    /// The last finished step.
    step: u64,
}

impl JobRun<'_> {
    /// Runs the job from `resume` (a checkpoint folder) or from the start; `progress`
    /// shows a progress bar.
    pub fn run(&self, resume: Option<&Path>, progress: bool) -> Result<()> {
        let (cfg, ctx) = (&self.job.config, self.ctx);
        // The reference (KL to the initial weights) is taken before a checkpoint is loaded.
        let mut trainer = Trainer::new(&ctx.model.read(), cfg.train_config())?;
        let mut start = 0;
        if let Some(dir) = resume {
            let state = learner_loop::resume(ctx, &mut trainer, dir)?;
            start = state["job_step"].as_u64().unwrap_or(0);
            learner_loop::restore_version(&ctx.model, &cfg.output_dir)?;
            self.job.update(|st| (st.step, st.version) = (start, ctx.model.version()));
            tracing::info!("resumed from {} at step {start}", dir.display());
        }
        let mut log = JobLog::open(&cfg.output_dir, start, progress.then_some(cfg.max_steps))?;
        // A resumed run keeps the evals it logged up to its checkpoint.
        if start == 0 {
            self.record_eval(start, &mut log, &mut trainer)?;
        }
        let mut learner = LearnerLoop::new(ctx.clone(), trainer, log, cfg.entropy_collapse_fraction)
            .record_versions_in(&cfg.output_dir);
        let k = cfg.max_staleness();
        let pace = Pace { done: start, at: Instant::now(), learner_seconds: None, generation_seconds: None };
        let prog = Progress { pace: Mutex::new(pace), cv: Condvar::new(), ended: AtomicBool::new(false) };
        let (tx, rx) = flume::bounded::<Result<Batch>>(k as usize + 1);
        std::thread::scope(|scope| {
            scope.spawn(|| self.generate_all(start, &prog, tx));
            let mut task = JobTask { run: self, rx, progress: &prog, step: start };
            // A panic must still end the generator below, or the scope waits for it for good.
            let out =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| learner.run(&mut task))).unwrap_or_else(|p| {
                    let msg =
                        p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
                    Err(RlError::Panicked(msg.unwrap_or_else(|| "(no message)".into())))
                });
            // Unblock the generator (it may wait for admission or on a full queue).
            prog.ended.store(true, Ordering::SeqCst);
            drop(task);
            prog.cv.notify_all();
            out
        })?;
        learner.finish()
    }

    /// The generator thread: steps `start..max_steps`, each admitted by the staleness bound.
    fn generate_all(&self, start: u64, prog: &Progress, tx: flume::Sender<Result<Batch>>) {
        let job = self.job;
        for s in start..job.config.max_steps {
            let t_wait = Instant::now();
            let ahead = job.config.generate_ahead;
            {
                let mut pace = prog.pace.lock().unwrap_or_else(|e| e.into_inner());
                let k = pace.bound_for(s, start, &job.config);
                while !admits(s, &pace, k, ahead) && !job.stopping() && !prog.ended.load(Ordering::SeqCst) {
                    pace = prog.cv.wait(pace).unwrap_or_else(|e| e.into_inner());
                }
            }
            if job.stopping() || prog.ended.load(Ordering::SeqCst) {
                return;
            }
            let wait = t_wait.elapsed().as_secs_f64();
            let t_gen = Instant::now();
            let r = match self.generate(s) {
                // Stopped while generating: the step's requests were aborted.
                Ok(None) => return,
                Ok(Some(mut b)) => {
                    b.timing.admission_wait_seconds = wait;
                    Ok(b)
                }
                Err(e) => Err(e),
            };
            {
                let mut pace = prog.pace.lock().unwrap_or_else(|e| e.into_inner());
                pace.generation_seconds = smooth(pace.generation_seconds, t_gen.elapsed().as_secs_f64());
            }
            let failed = r.is_err();
            if tx.send(r).is_err() || failed {
                return;
            }
        }
    }

    /// Submits step `s`'s prompts (× `num_generations`), waits for the completions and scores
    /// them; `None` when the job was asked to stop meanwhile (its requests are aborted).
    fn generate(&self, s: u64) -> Result<Option<Batch>> {
        let cfg = &self.job.config;
        let t0 = Instant::now();
        let pps = cfg.prompts_per_step as u64;
        let examples: Vec<&Example> =
            (0..pps).map(|j| dataset::at(self.train, cfg.dataset_seed(), s * pps + j)).collect();
        let checkpoint_state = serde_json::json!({
            "job_step": s + 1,
            "seed": cfg.seed,
            "data_seed": cfg.dataset_seed(),
            "dataset_position": (s + 1) * pps,
        });
        if cfg.learner.loss_type.is_preference() {
            let len = cfg.learner.max_completion_length;
            let samples =
                examples.iter().enumerate().flat_map(|(j, e)| pair_samples(e, s << 20 | j as u64, len)).collect();
            return Ok(Some(Batch { samples, timing: Default::default(), checkpoint_state, guard: None }));
        }
        let Some(rollouts) = self.rollouts(&examples, cfg.sampling_params(s))? else { return Ok(None) };
        let generation_seconds = t0.elapsed().as_secs_f64();
        let mut samples = Vec::with_capacity(rollouts.len());
        let mut reward_errors = 0;
        let mut log = String::new();
        for r in &rollouts {
            let score = self.rewards.score(&scored(examples[r.prompt_index], r));
            if cfg.log_completions {
                let line = serde_json::json!({
                    "step": s + 1,
                    "prompt": examples[r.prompt_index].prompt_text,
                    "completion": r.text,
                    "reward": score.as_ref().ok(),
                    "finish_reason": r.finish_reason_str(),
                    "completion_tokens": r.completion_ids.len(),
                });
                log += &format!("{line}\n");
            }
            match score {
                Ok(x) if !r.completion_ids.is_empty() => samples.push(r.to_sample(x, s << 20 | r.prompt_index as u64)),
                Ok(_) => {}
                Err(x) => {
                    tracing::warn!("reward skipped a sample: {x}");
                    reward_errors += 1;
                }
            }
        }
        if !log.is_empty() {
            use std::io::Write;
            let path = cfg.output_dir.join("completions.jsonl");
            let appended = std::fs::OpenOptions::new().create(true).append(true).open(&path);
            if let Err(e) = appended.and_then(|mut f| f.write_all(log.as_bytes())) {
                tracing::warn!("log_completions: writing {}: {e}", path.display());
            }
        }
        let rollout_tokens = rollouts.iter().map(|r| r.completion_ids.len()).sum();
        let timing = RolloutTiming { rollout_tokens, generation_seconds, reward_errors, ..Default::default() };
        Ok(Some(Batch { samples, timing, checkpoint_state, guard: None }))
    }

    /// Runs `examples` through the engine with `params` and waits for every sample; `None`
    /// when a stop is requested first (the streams are dropped, which aborts the requests and
    /// frees their KV blocks).
    fn rollouts(&self, examples: &[&Example], params: SamplingParams) -> Result<Option<Vec<Rollout>>> {
        let prompts: Vec<Vec<u32>> = examples.iter().map(|e| e.prompt_ids.clone()).collect();
        let set = RolloutSet::new(&prompts, params.n);
        let streams = prompts
            .into_iter()
            .map(|p| self.ctx.engine.add_request(p, params.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        self.ctx.runtime.block_on(async {
            tokio::select! {
                r = set.collect(streams) => Ok(Some(r?)),
                () = self.job.stopped() => Ok(None),
            }
        })
    }

    /// Greedy completions of the eval prompts after step `step`, scored with the job's
    /// rewards; for DPO/IPO, the held-out pairs' loss and implicit rewards
    /// (`eval_reward` = `rewards/margins`, `eval_accuracy` = `rewards/accuracies`).
    fn record_eval(&self, step: u64, log: &mut JobLog, trainer: &mut Trainer) -> Result<()> {
        if self.eval.is_empty() {
            return Ok(());
        }
        let cfg = &self.job.config;
        if cfg.learner.loss_type.is_preference() {
            let len = cfg.learner.max_completion_length;
            let samples: Vec<TrainSample> =
                self.eval.iter().enumerate().flat_map(|(i, e)| pair_samples(e, i as u64, len)).collect();
            let version = self.ctx.model.version();
            let (loss, stats) = trainer.evaluate_preferences(&self.ctx.model.read(), &samples)?;
            let rec = EvalRecord {
                step,
                version,
                eval_reward: stats.rewards_margins,
                eval_accuracy: Some(stats.rewards_accuracies),
                eval_size: stats.pairs,
                preferences: Some(PreferenceEval { loss, stats }),
            };
            log.eval(&rec)?;
            self.ctx.metrics.eval(&rec);
            self.job.update(|st| st.evals.push(rec));
            return Ok(());
        }
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: Some(cfg.learner.max_completion_length),
            stop: cfg.stop.clone(),
            ..Default::default()
        };
        let refs: Vec<&Example> = self.eval.iter().collect();
        let version = self.ctx.model.version();
        // A stop skips the evaluation (its requests are aborted).
        let Some(rs) = self.rollouts(&refs, params)? else { return Ok(()) };
        let (mut total, mut correct, mut with_answer) = (0.0f64, 0usize, 0usize);
        for r in &rs {
            let ex = &self.eval[r.prompt_index];
            total += self.rewards.score(&scored(ex, r)).unwrap_or(0.0) as f64;
            if ex.fields.contains_key("answer") {
                with_answer += 1;
                correct += exact_answer(&r.text, ex.fields.get("answer")) as usize;
            }
        }
        let rec = EvalRecord {
            step,
            version,
            eval_reward: total / rs.len() as f64,
            eval_accuracy: (with_answer > 0).then(|| correct as f64 / with_answer as f64),
            eval_size: rs.len(),
            preferences: None,
        };
        log.eval(&rec)?;
        self.ctx.metrics.eval(&rec);
        self.job.update(|st| st.evals.push(rec));
        Ok(())
    }
}

/// The two samples of a preference pair (`ex.pair`; the job checked every example has one):
/// one group, the chosen completion rewarded 1 and the rejected 0, each cut to `max_len`
/// tokens (TRL's `max_completion_length`). No μ: DPO does not use it.
fn pair_samples(ex: &Example, group: u64, max_len: usize) -> Vec<TrainSample> {
    let Some(p) = &ex.pair else { return vec![] };
    [(&p.chosen, 1.0), (&p.rejected, 0.0)]
        .into_iter()
        .map(|(c, reward)| TrainSample {
            prompt_ids: ex.prompt_ids.clone(),
            completion_ids: c[..c.len().min(max_len)].to_vec(),
            behavior_logprobs: vec![],
            advantage: None,
            reward: Some(reward),
            group: Some(group),
            versions: None,
            finish_reason: None,
        })
        .collect()
}

/// What the rewards see of rollout `r` of example `ex`.
fn scored<'e>(ex: &'e Example, r: &'e Rollout) -> Scored<'e> {
    Scored {
        prompt: &ex.prompt_text,
        completion: &r.text,
        completion_tokens: r.completion_ids.len(),
        fields: &ex.fields,
    }
}

impl LearnerTask for JobTask<'_, '_> {
    fn next_batch(&mut self) -> Result<Option<Batch>> {
        let t_wait = Instant::now();
        // A closed queue: the generator has sent every step (or stopped).
        let Ok(batch) = self.rx.recv() else { return Ok(None) };
        let mut batch = batch?;
        batch.timing.learner_wait_seconds = t_wait.elapsed().as_secs_f64();
        Ok(Some(batch))
    }

    fn step_number(&self, _optimizer_step: u64) -> u64 {
        self.step + 1
    }

    fn after_step(
        &mut self,
        record: &StepRecord,
        batch: &Batch,
        log: &mut JobLog,
        trainer: &mut Trainer,
    ) -> Result<bool> {
        let (job, cfg) = (self.run.job, &self.run.job.config);
        self.step = record.step;
        job.update(|st| {
            st.step = record.step;
            st.version = self.run.ctx.model.version();
            st.latest = Some(record.clone());
            st.history.push(record.clone());
        });
        {
            let mut pace = self.progress.pace.lock().unwrap_or_else(|e| e.into_inner());
            // The time since the previous step ended, less this step's wait for its batch.
            let busy = pace.at.elapsed().as_secs_f64() - batch.timing.learner_wait_seconds;
            pace.learner_seconds = smooth(pace.learner_seconds, busy.max(0.0));
            (pace.done, pace.at) = (record.step, Instant::now());
        }
        self.progress.cv.notify_all();
        let last = record.step == cfg.max_steps || job.stopping();
        let eval_due =
            cfg.eval_dataset.is_some() && cfg.eval_interval > 0 && record.step.is_multiple_of(cfg.eval_interval);
        if eval_due || (last && !self.run.eval.is_empty()) {
            self.run.record_eval(record.step, log, trainer)?;
        }
        Ok(last)
    }

    fn checkpoint_dir(&self, step: u64, _optimizer_step: u64, last: bool) -> Option<PathBuf> {
        let cfg = &self.run.job.config;
        ((cfg.save_steps > 0 && step.is_multiple_of(cfg.save_steps)) || last)
            .then(|| cfg.output_dir.join(format!("checkpoint-{step}")))
    }

    /// A failed save ends the job; a saved one prunes the oldest beyond `save_total_limit`
    /// (only checkpoints rlserve wrote, file by file: a folder holding anything else stays).
    fn saved(&mut self, result: Result<()>) -> Result<()> {
        result?;
        let cfg = &self.run.job.config;
        let all = checkpoints(&cfg.output_dir);
        let keep = cfg.save_total_limit.max(1);
        for (_, old) in all.iter().take(all.len().saturating_sub(keep)) {
            if let Err(e) = learner::checkpoint::remove(old) {
                tracing::warn!("not pruning {}: {e}", old.display());
            }
        }
        Ok(())
    }
}

/// The checkpoint folder to resume from, if any.
pub(crate) fn resolve_resume(cfg: &JobConfig) -> Result<Option<PathBuf>> {
    let key = "resume_from_checkpoint";
    match cfg.resume_from_checkpoint.as_deref() {
        None => Ok(None),
        Some("latest") => match checkpoints(&cfg.output_dir).pop() {
            Some((_, p)) => Ok(Some(p)),
            None => Err(RlError::invalid(
                key,
                format!(
                    "`resume_from_checkpoint` = \"latest\": no checkpoint-<step> folder under {}",
                    cfg.output_dir.display()
                ),
            )),
        },
        Some(p) => {
            let p = PathBuf::from(p);
            if !p.join("trainer_state.json").exists() {
                return Err(RlError::invalid(
                    key,
                    format!("`resume_from_checkpoint`: {} is not a checkpoint (no trainer_state.json)", p.display()),
                ));
            }
            Ok(Some(p))
        }
    }
}

/// What an earlier run left in `dir`: its checkpoints (oldest first), a non-empty
/// `metrics.jsonl` and `completions.jsonl` (a new run would rewrite the one and append to
/// the other; empty, as a run stopped before its first step leaves them, they hold nothing).
pub(crate) fn earlier_run(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = checkpoints(dir).into_iter().map(|(_, p)| p).collect();
    let written = |p: &PathBuf| std::fs::metadata(p).is_ok_and(|m| m.len() > 0);
    v.extend(["metrics.jsonl", "completions.jsonl"].map(|f| dir.join(f)).into_iter().filter(written));
    v
}

/// Complete checkpoints `output_dir/checkpoint-<step>`, oldest first.
fn checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path().join("trainer_state.json").exists().then(|| (step, e.path()))
        })
        .collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use GenerateAhead::{AsNeeded, ToMaxStaleness};

    /// `admits(s, pace, k, ahead)` for batch `s` with 5 learner steps done, the generator's and
    /// the learner's measured seconds per batch / step (`None`: not measured yet).
    fn check(s: u64, k: u64, ahead: GenerateAhead, g: Option<f64>, l: Option<f64>, expected: bool) {
        let pace = Pace { done: 5, at: Instant::now(), learner_seconds: l, generation_seconds: g };
        assert_eq!(admits(s, &pace, k, ahead), expected, "s {s}, k {k}, {ahead:?}, generation {g:?}, learner {l:?}");
    }

    #[test]
    fn admission_runs_ahead_only_as_far_as_the_learner_needs() {
        let (fast, slow) = (Some(0.4), Some(0.6));
        // On-policy (and the warm start): only the batch the learner waits for.
        check(5, 0, AsNeeded, fast, slow, true);
        check(6, 0, AsNeeded, slow, fast, false);
        check(6, 0, ToMaxStaleness, slow, fast, false);
        // One batch ahead overlaps the learner's step: always, at any bound ≥ 1.
        for k in [1, 2, 4] {
            check(6, k, AsNeeded, fast, slow, true);
            check(6, k, AsNeeded, None, None, true);
        }
        // Generation faster than learning: one ahead is enough, further only makes batches staler.
        check(7, 4, AsNeeded, fast, slow, false);
        check(7, 4, AsNeeded, None, slow, false);
        check(7, 4, AsNeeded, fast, None, false);
        // Generation as slow as learning or slower: up to the bound, never past it.
        check(7, 4, AsNeeded, Some(0.6), slow, true);
        check(9, 4, AsNeeded, Some(0.9), slow, true);
        check(10, 4, AsNeeded, Some(0.9), slow, false);
        check(7, 1, AsNeeded, Some(0.9), slow, false);
        // Eager: whatever the bound admits.
        check(9, 4, ToMaxStaleness, fast, slow, true);
        check(10, 4, ToMaxStaleness, fast, slow, false);
    }

    #[test]
    fn the_end_of_the_warm_start_forgets_the_solo_speeds() {
        let mut cfg = JobConfig::default();
        (cfg.learner.max_staleness, cfg.learner.on_policy_warmup_steps) = (Some(4), Some(10));
        // Measured during the warm start, each side alone: generation the slower (seed 8's
        // figures in the parity runs), which would admit a run-ahead to the bound at once.
        let solo =
            |done| Pace { done, at: Instant::now(), learner_seconds: Some(0.36), generation_seconds: Some(0.40) };
        let mut pace = solo(9);
        assert_eq!(pace.bound_for(9, 0, &cfg), 0);
        assert_eq!(pace.generation_seconds, Some(0.40), "within the warm start the speeds are kept");
        let mut pace = solo(10);
        assert!(admits(12, &pace, 4, GenerateAhead::AsNeeded), "the solo speeds admit two ahead");
        assert_eq!(pace.bound_for(10, 0, &cfg), 4);
        assert!(!admits(12, &pace, 4, GenerateAhead::AsNeeded), "forgotten: only one ahead until remeasured");
        assert!(admits(11, &pace, 4, GenerateAhead::AsNeeded));
        // Past the change, and for a run resumed there, the measured speeds stay.
        let mut pace = solo(10);
        assert_eq!(pace.bound_for(11, 0, &cfg), 4);
        assert_eq!(pace.bound_for(10, 10, &cfg), 4);
        assert!(admits(12, &pace, 4, GenerateAhead::AsNeeded));
    }

    #[test]
    fn smoothing_starts_at_the_first_value_and_weighs_the_newest_by_0_3() {
        assert_eq!(smooth(None, 2.0), Some(2.0));
        assert!((smooth(Some(1.0), 2.0).unwrap() - 1.3).abs() < 1e-12);
    }
}
