//! The one learner loop of online RL, shared by training jobs (`job_run.rs`) and the
//! feedback learner (`feedback.rs`): take a batch, step the served weights
//! ([`Trainer::step`]), log the step (`metrics.jsonl`, progress bar, alarms), record its
//! metrics, let the task react (status, evaluation, queue bookkeeping), and checkpoint
//! when due. What differs between the two users is a [`LearnerTask`].
//!
//! Versions never go back, also across a crash: before each update becomes visible the loop
//! records the version it will serve in a small fsynced file ([`VERSION_FILE`] in the
//! job's output folder or the feedback folder, and in the server-wide record
//! `RlContext::version_record` when the server has one); a restart that loads an older
//! checkpoint labels it above every version that may have been served ([`restore_version`]).

use super::context::{LearnerGuard, RlContext};
use super::error::{Result, RlError};
use super::report::{JobLog, RolloutTiming, StepRecord};
use engine::SharedModel;
use learner::{checkpoint, TrainSample, Trainer};
use std::path::{Path, PathBuf};

/// One batch for the learner.
pub struct Batch {
    /// The samples of one optimizer step.
    pub samples: Vec<TrainSample>,
    /// Where they came from (zero for the feedback learner, whose samples were served).
    pub timing: RolloutTiming,
    /// Fields added to `trainer_state.json` when a checkpoint follows this step (a job's
    /// step, seed and dataset position; the feedback log position the batch covers).
    pub checkpoint_state: serde_json::Value,
    /// The learner slot, when it is held for this step only (the feedback learner); a job
    /// holds it for its whole run.
    pub guard: Option<LearnerGuard>,
}

/// What a [`LearnerLoop`] trains on and what it does around each step.
pub trait LearnerTask {
    /// Blocks until the next batch; `Ok(None)` ends the loop.
    fn next_batch(&mut self) -> Result<Option<Batch>>;

    /// The `step` of the record of the batch just trained, given the optimizer's step count.
    fn step_number(&self, optimizer_step: u64) -> u64;

    /// Called after each step is logged (status, evaluation with the trainer's reference,
    /// bookkeeping); returns whether it was the last step.
    fn after_step(
        &mut self,
        record: &StepRecord,
        batch: &Batch,
        log: &mut JobLog,
        trainer: &mut Trainer,
    ) -> Result<bool>;

    /// Where to write a checkpoint after step `step` (`optimizer_step` optimizer steps so
    /// far; `last` step of the run), if one is due.
    fn checkpoint_dir(&self, step: u64, optimizer_step: u64, last: bool) -> Option<PathBuf>;

    /// The outcome of writing that checkpoint: an error ends the loop unless the task
    /// absorbs it.
    fn saved(&mut self, result: Result<()>) -> Result<()>;
}

/// The file, in a job's output folder or the feedback folder, holding the highest policy
/// version the learner may have made visible.
pub const VERSION_FILE: &str = "policy_version";

/// The trainer over the served weights, with its step log.
pub struct LearnerLoop {
    ctx: RlContext,
    trainer: Trainer,
    log: JobLog,
    entropy_collapse_fraction: f64,
    /// Where each update's version is recorded before it is applied.
    version_file: Option<PathBuf>,
}

impl LearnerLoop {
    /// A loop stepping `trainer` on `ctx`'s weights, logging to `log`, with the
    /// entropy-collapse alarm at `entropy_collapse_fraction` of the first steps' entropy.
    pub fn new(ctx: RlContext, trainer: Trainer, log: JobLog, entropy_collapse_fraction: f64) -> Self {
        Self { ctx, trainer, log, entropy_collapse_fraction, version_file: None }
    }

    /// Records each update's version in `dir`/[`VERSION_FILE`] (fsynced) before applying it.
    pub fn record_versions_in(mut self, dir: &Path) -> Self {
        self.version_file = Some(dir.join(VERSION_FILE));
        self
    }

    /// Runs until the task ends it (no more batches, or its last step).
    pub fn run(&mut self, task: &mut impl LearnerTask) -> Result<()> {
        // The latest step trained and not yet checkpointed, with its checkpoint state.
        let mut unsaved: Option<(u64, serde_json::Value)> = None;
        while let Some(batch) = task.next_batch()? {
            // The learner holds the slot: this batch's updates (several for PPO) take the
            // versions after the current one.
            let next = self.ctx.model.version() + self.trainer.config.updates_per_batch().max(1);
            if let Some(f) = &self.version_file {
                write_version(f, next)?;
            }
            if self.ctx.version_record.as_ref() != self.version_file.as_ref() {
                self.ctx.record_version(next)?;
            }
            let trained = self.trainer.step(&self.ctx.model, &batch.samples);
            let step = task.step_number(self.trainer.optimizer.step);
            let metrics = match trained {
                Ok((m, _)) => Some(m),
                Err(e) => {
                    // Every sample filtered (zero-std groups, staleness, truncation): no update.
                    tracing::warn!(step, "no update: {e}");
                    None
                }
            };
            let record = self.log.step(step, metrics, &batch.samples, &batch.timing, self.entropy_collapse_fraction);
            self.ctx.metrics.learner_step(&record, &batch.samples);
            let last = task.after_step(&record, &batch, &mut self.log, &mut self.trainer)?;
            let state = batch.checkpoint_state.clone();
            unsaved = match task.checkpoint_dir(step, self.trainer.optimizer.step, last) {
                Some(dir) => {
                    task.saved(self.save(&dir, state))?;
                    None
                }
                None => Some((step, state)),
            };
            // Held until the checkpoint is written: the feedback learner's slot guard.
            drop(batch);
            if last {
                break;
            }
        }
        // The batches ended between steps (a job stopped while its next batch was being
        // generated, whose rollouts were aborted): the last step trained is the run's last.
        if let Some((step, state)) = unsaved {
            if let Some(dir) = task.checkpoint_dir(step, self.trainer.optimizer.step, true) {
                task.saved(self.save(&dir, state))?;
            }
        }
        Ok(())
    }

    /// Writes the served weights, the optimizer state and the value head (PPO) to `dir`
    /// (atomically), with `state` added to `trainer_state.json`.
    fn save(&self, dir: &Path, state: serde_json::Value) -> Result<()> {
        let model = self.ctx.model.read();
        Ok(checkpoint::save_trainer(dir, &self.ctx.model_dir, &model, &self.trainer, state)?)
    }

    /// Ends the log (progress bar, `metrics.png`).
    pub fn finish(&mut self) -> Result<()> {
        self.log.finish()
    }
}

/// Writes `version` to `path` durably (temporary file, fsync, rename, fsync of the folder).
pub(crate) fn write_version(path: &Path, version: u64) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(version.to_string().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
    };
    write().map_err(|e| RlError::io(path, e))
}

/// After a restart: when `dir`/[`VERSION_FILE`] says versions up to `v` may have been served
/// and the weights now served are older (version below `v`), they become version `v + 1`:
/// no client ever sees the version go back, and no version names two sets of weights.
pub fn restore_version(model: &SharedModel, dir: &Path) -> Result<()> {
    let path = dir.join(VERSION_FILE);
    let recorded = match std::fs::read_to_string(&path) {
        Ok(t) => t.trim().parse::<u64>().map_err(|e| RlError::invalid_input(format!("{}: {e}", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(RlError::io(&path, e)),
    };
    let _updates = model.lock_updates();
    let mut m = model.write();
    if recorded > m.version {
        m.version = recorded + 1;
    }
    Ok(())
}

/// Loads the checkpoint in `dir` into the served weights, `trainer`'s optimizer and (PPO)
/// its value head, and returns its `trainer_state.json`. Build the trainer first: its
/// reference (KL, DPO) is the weights before the checkpoint. A PPO trainer resumed from a
/// checkpoint without a value head keeps its initial one.
pub fn resume(ctx: &RlContext, trainer: &mut Trainer, dir: &Path) -> Result<serde_json::Value> {
    let state = checkpoint::load_state(dir)?;
    let version = state["version"].as_u64().unwrap_or(0).max(ctx.model.version() + 1);
    ctx.record_version(version)?;
    load_weights(&ctx.model, dir, version)?;
    let (device, hidden) = {
        let m = ctx.model.read();
        (m.device().clone(), m.config.hidden_size)
    };
    trainer.optimizer = checkpoint::load_optimizer(dir, &device)?;
    if trainer.value_head.is_some() {
        match checkpoint::load_value_head(dir, hidden, &device)? {
            Some(head) => trainer.value_head = Some(head),
            None => tracing::warn!("{} has no value head; PPO starts from its initial one", dir.display()),
        }
    }
    Ok(state)
}

/// Replaces the served weights with a checkpoint's: loaded (and every tensor's shape
/// checked) outside any guard, swapped in under the write guard. The policy version becomes
/// `version`, or the current one + 1 if that is not newer: versions never go back, so no KV
/// or prefix-cache block of other weights is ever taken for these.
pub fn load_weights(model: &SharedModel, dir: &Path, version: u64) -> Result<()> {
    let (config, device) = {
        let m = model.read();
        (m.config.clone(), m.device().clone())
    };
    let loaded = engine::Model::load(dir, &device)?;
    if loaded.config != config {
        return Err(RlError::invalid_input(format!("{} holds a different model than the one served", dir.display())));
    }
    let _updates = model.lock_updates();
    let mut m = model.write();
    let version = version.max(m.version + 1);
    *m = loaded;
    m.version = version;
    Ok(())
}
