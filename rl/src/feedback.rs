//! Chat that learns from feedback (`rlserve serve --learn-from-feedback`).
//!
//! Every finished chat/completion response is kept for a bounded window
//! (`--feedback-window` responses): per choice its prompt ids, completion ids, μ and
//! versions ([`FeedbackRecorder`]). `POST /v1/feedback` rates a choice (`reward` in
//! [−1, 1]), picks a preferred one (it gets 1, the others 0), or prefers one choice over
//! another (`chosen` gets 1, `rejected` 0). Each accepted rating is appended to
//! `<feedback-dir>/feedback.jsonl` and fsynced **before** the 200 reply.
//!
//! Samples become trainable by these rules (`ratings.rs`):
//! - all `n ≥ 2` choices of a response rated → one group (GRPO advantages from the group;
//!   with `loss_type = "dpo"`/`"ipo"`, a preference pair for every two choices whose rewards
//!   differ);
//! - a `chosen` / `rejected` preference → those two choices as one group at once (a DPO
//!   pair; a GRPO group of two), and the response counts as fully rated;
//! - a response with `n = 1`, or one that leaves the window partly rated → each rated choice
//!   alone, REINFORCE with a baseline: advantage = reward − the running mean of all earlier
//!   single-choice rewards (0 before the first). Leaving the window is logged too (a flush
//!   line), so samples queue in log order and a checkpoint's position is exact;
//! - with a preference `loss_type` (`dpo`, `ipo`) a rating of a one-choice response is
//!   refused (400): one answer never makes a pair.
//!
//! The learner thread runs the shared [`LearnerLoop`]: it steps when
//! `--feedback-batch-size` samples are ready, on the served weights (later requests see the
//! update), then saves `<feedback-dir>/checkpoint` with the log position it covers. On
//! restart the checkpoint's weights are loaded and every rating after that position is
//! replayed: accepted feedback is never lost.

use super::context::RlContext;
use super::error::{Result, RlError};
use super::job::{JobState, JobStatus};
use super::learner_loop::{self, Batch, LearnerLoop, LearnerTask};
use super::metrics::FeedbackCounts;
pub use super::ratings::FeedbackRequest;
use super::ratings::{LogLine, Ratings};
use super::report::{JobLog, StepRecord};
use super::rollout::RolloutSet;
use engine::{SamplingParams, SeqOutput};
use learner::{TrainConfig, Trainer};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// The feedback learner's entropy-collapse alarm threshold (as a job's default).
const ENTROPY_COLLAPSE_FRACTION: f64 = 0.3;

/// How often the feedback learner retries the learner slot while a job holds it.
const SLOT_POLL: Duration = Duration::from_millis(200);

/// Feedback learning settings (`--feedback-*` flags and `--learner-config`).
#[derive(Debug, Clone)]
pub struct FeedbackConfig {
    /// Responses kept for rating (oldest evicted first).
    pub window: usize,
    /// Samples per learner step.
    pub batch_size: usize,
    /// `feedback.jsonl` and `checkpoint/` live here.
    pub dir: PathBuf,
    /// Save `checkpoint/` every this many learner steps (ratings after it are replayed).
    pub save_steps: u64,
    /// The learner's settings.
    pub learner: TrainConfig,
}

/// The rateable responses, the durable log of ratings, and the feedback learner's queue.
pub struct FeedbackStore {
    cfg: FeedbackConfig,
    ctx: RlContext,
    ratings: Mutex<Ratings>,
    cv: Condvar,
    log: Mutex<std::fs::File>,
    /// The feedback learner's step records since the server started (for
    /// [`FeedbackStore::status`]).
    history: Mutex<Vec<StepRecord>>,
}

/// The job id under which the feedback learner is listed ([`FeedbackStore::status`]).
pub const FEEDBACK_JOB_ID: &str = "feedback";

impl FeedbackStore {
    /// Opens (or creates) the log, loads `checkpoint/` into the served weights when present,
    /// replays the ratings after it, and starts the learner thread.
    pub fn open(cfg: FeedbackConfig, ctx: RlContext) -> Result<Arc<Self>> {
        std::fs::create_dir_all(&cfg.dir).map_err(|e| RlError::io(&cfg.dir, e))?;
        let ckpt = cfg.dir.join("checkpoint");
        let mut trainer = Trainer::new(&ctx.model.read(), cfg.learner.clone())?;
        let mut covered = 0;
        learner::checkpoint::recover(&ckpt)?;
        if ckpt.join("trainer_state.json").exists() {
            let state = learner_loop::resume(&ctx, &mut trainer, &ckpt)?;
            covered = state["feedback_seq"].as_u64().unwrap_or(0);
        }
        learner_loop::restore_version(&ctx.model, &cfg.dir)?;
        let path = cfg.dir.join("feedback.jsonl");
        drop_torn_tail(&path)?;
        let mut ratings = Ratings::new();
        if let Ok(text) = std::fs::read_to_string(&path) {
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                match serde_json::from_str::<LogLine>(line) {
                    Ok(l) => ratings.apply(&l, covered),
                    // A torn last line (crash mid-write) was never acknowledged: skip it.
                    Err(e) => tracing::warn!("{} line {}: {e}; skipped", path.display(), i + 1),
                }
            }
        }
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| RlError::io(&path, e))?;
        let store = Arc::new(Self {
            cfg,
            ctx: ctx.clone(),
            ratings: Mutex::new(Ratings::new()),
            cv: Condvar::new(),
            log: Mutex::new(log),
            history: Mutex::new(Vec::new()),
        });
        // The replay kept every rated response: back to the window's size.
        let flushes = ratings.evict(store.cfg.window);
        let _ = store.flush(&mut ratings, flushes);
        tracing::info!(replayed = ratings.ready.len(), covered, "feedback log {}", path.display());
        *store.lock() = ratings;
        // Kept across steps: the entropy-collapse and length-drift baselines.
        let mut learner = LearnerLoop::new(ctx, trainer, JobLog::detached(), ENTROPY_COLLAPSE_FRACTION)
            .record_versions_in(&store.cfg.dir);
        let mut task = FeedbackTask(store.clone());
        std::thread::Builder::new()
            .name("rlserve-feedback-learner".into())
            .spawn(move || {
                if let Err(e) = learner.run(&mut task) {
                    tracing::error!("the feedback learner stopped: {e}");
                }
            })
            .map_err(RlError::Spawn)?;
        Ok(store)
    }

    /// A recorder for one response with `prompts.len()` prompts sampled with `params`:
    /// it keeps the response for rating once every choice has finished.
    pub fn recorder(self: &Arc<Self>, id: &str, prompts: &[Vec<u32>], params: &SamplingParams) -> FeedbackRecorder {
        FeedbackRecorder {
            store: self.clone(),
            id: id.to_string(),
            greedy: params.is_greedy(),
            set: Some(RolloutSet::new(prompts, params.n)),
        }
    }

    /// Validates and applies one rating; durable (fsynced) before it returns Ok.
    pub fn submit(&self, req: &FeedbackRequest) -> Result<serde_json::Value> {
        let mut ratings = self.lock();
        let checked = ratings.check(req).and_then(|line| match line.choices.len() {
            // A preference learner trains on pairs: one answer never makes one.
            1 if self.cfg.learner.loss_type.is_preference() => Err(RlError::invalid(
                "id",
                format!(
                    "response `{}` has one choice; the feedback learner's loss_type {} trains on preference pairs: \
                     rate a response with n >= 2 (`preferred`, `chosen`/`rejected`, or every choice)",
                    req.id,
                    serde_json::to_string(&self.cfg.learner.loss_type).unwrap_or_default()
                ),
            )),
            _ => Ok(line),
        });
        let line = match checked {
            Ok(line) => line,
            Err(e) => {
                ratings.rejected += 1;
                return Err(e);
            }
        };
        self.append(&line)?;
        ratings.apply(&line, 0);
        ratings.accepted += 1;
        let ready = ratings.ready.len();
        drop(ratings);
        self.cv.notify_all();
        Ok(serde_json::json!({
            "id": req.id, "accepted": true, "seq": line.seq, "samples_ready": ready,
            "feedback_batch_size": self.cfg.batch_size,
        }))
    }

    /// Appends `line` to `feedback.jsonl` and fsyncs it.
    fn append(&self, line: &LogLine) -> Result<()> {
        let path = self.cfg.dir.join("feedback.jsonl");
        let mut f = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let text = serde_json::to_string(line).map_err(|e| RlError::io(&path, e.into()))?;
        writeln!(f, "{text}").and_then(|_| f.sync_data()).map_err(|e| RlError::io(&path, e))
    }

    /// Logs the flush lines of responses the window pushed out ([`Ratings::evict`]), then
    /// applies them: their rated choices become samples. A line that cannot be logged is
    /// still applied (the samples are not lost; a restart would queue them once more).
    fn flush(&self, ratings: &mut Ratings, lines: Vec<LogLine>) -> Result<()> {
        let mut first_error = Ok(());
        for line in lines {
            if let Err(e) = self.append(&line) {
                tracing::warn!("feedback: logging the flush of `{}`: {e}", line.id);
                first_error = first_error.and(Err(e));
            }
            ratings.apply(&line, 0);
        }
        first_error
    }

    /// Accepted samples per feedback learner step (`--feedback-batch-size`).
    pub fn batch_size(&self) -> usize {
        self.cfg.batch_size
    }

    /// The feedback learner as a job's status (id [`FEEDBACK_JOB_ID`], running while the
    /// server runs, no `max_steps`): its steps since the server started, so a dashboard
    /// shows it like a training job.
    pub fn status(&self) -> JobStatus {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner()).clone();
        JobStatus {
            id: FEEDBACK_JOB_ID.into(),
            status: JobState::Running,
            step: history.last().map_or(0, |r| r.step),
            max_steps: 0,
            version: self.ctx.model.version(),
            error: None,
            output_dir: self.cfg.dir.clone(),
            latest: history.last().cloned(),
            history,
            evals: vec![],
        }
    }

    /// The store's counters.
    pub fn counts(&self) -> FeedbackCounts {
        let r = self.lock();
        FeedbackCounts { accepted: r.accepted, rejected: r.rejected, trained: r.trained, ready: r.ready.len() }
    }

    /// Records the counters as metrics (at scrape time).
    pub fn record_metrics(&self) {
        self.ctx.metrics.feedback(self.counts());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ratings> {
        self.ratings.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Cuts a torn last line (a crash mid-append: never acknowledged, since a rating is
/// acknowledged only after its whole line is fsynced) off the log, so the next rating starts
/// on a line of its own instead of being glued to the fragment.
fn drop_torn_tail(path: &std::path::Path) -> Result<()> {
    let Ok(bytes) = std::fs::read(path) else { return Ok(()) };
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if keep < bytes.len() {
        tracing::warn!("{}: dropping {} bytes of a torn last line", path.display(), bytes.len() - keep);
        let f = std::fs::OpenOptions::new().write(true).open(path).map_err(|e| RlError::io(path, e))?;
        f.set_len(keep as u64).and_then(|_| f.sync_all()).map_err(|e| RlError::io(path, e))?;
    }
    Ok(())
}

/// Gathers one response's choices as the engine streams them; once every choice has
/// finished (none aborted), the response is kept for rating.
pub struct FeedbackRecorder {
    store: Arc<FeedbackStore>,
    id: String,
    greedy: bool,
    /// `None` once registered.
    set: Option<RolloutSet>,
}

impl FeedbackRecorder {
    /// Takes one engine output of prompt `prompt`'s request.
    pub fn observe(&mut self, prompt: usize, out: &SeqOutput) {
        let Some(set) = self.set.as_mut() else { return };
        if set.push(prompt, out.clone()) {
            let choices = self.set.take().expect("present").into_rollouts().iter().map(|r| r.sample()).collect();
            let mut ratings = self.store.lock();
            let flushes = ratings.register(self.id.clone(), choices, self.greedy, self.store.cfg.window);
            // Logged with a warning on failure (`flush`): a response's end has no caller to tell.
            let _ = self.store.flush(&mut ratings, flushes);
            drop(ratings);
            self.store.cv.notify_all();
        }
    }
}

/// The feedback learner's side of the learner loop: rated samples as they become ready.
struct FeedbackTask(Arc<FeedbackStore>);

impl LearnerTask for FeedbackTask {
    /// Waits for a batch, then for the learner slot (a job may hold it).
    fn next_batch(&mut self) -> Result<Option<Batch>> {
        let store = &self.0;
        let (samples, through) = {
            let mut ratings = store.lock();
            loop {
                match ratings.next_batch(store.cfg.batch_size) {
                    Some(b) => break b,
                    None => ratings = store.cv.wait(ratings).unwrap_or_else(|e| e.into_inner()),
                }
            }
        };
        let guard = store.ctx.learner.acquire(SLOT_POLL);
        let checkpoint_state = serde_json::json!({ "feedback_seq": through });
        Ok(Some(Batch { samples, timing: Default::default(), checkpoint_state, guard: Some(guard) }))
    }

    /// Learner steps so far: optimizer steps over the updates each takes (PPO: several).
    fn step_number(&self, optimizer_step: u64) -> u64 {
        optimizer_step / self.0.cfg.learner.updates_per_batch().max(1)
    }

    fn after_step(&mut self, record: &StepRecord, batch: &Batch, _log: &mut JobLog, _: &mut Trainer) -> Result<bool> {
        self.0.lock().trained(batch.samples.len());
        self.0.history.lock().unwrap_or_else(|e| e.into_inner()).push(record.clone());
        tracing::info!(
            version = record.learner.version,
            loss = record.learner.loss.loss,
            secs = record.learner.step_seconds,
            "feedback learner step"
        );
        Ok(false)
    }

    fn checkpoint_dir(&self, step: u64, _optimizer_step: u64, _last: bool) -> Option<PathBuf> {
        let cfg = &self.0.cfg;
        // Step 0: no update yet (a batch that made none), nothing to save.
        (step > 0 && step.is_multiple_of(cfg.save_steps.max(1))).then(|| cfg.dir.join("checkpoint"))
    }

    /// A failed save is logged; the ratings after the last good checkpoint are replayed on
    /// restart, so learning goes on.
    fn saved(&mut self, result: Result<()>) -> Result<()> {
        if let Err(e) = result {
            tracing::error!("feedback learner: saving the checkpoint failed: {e}");
        }
        Ok(())
    }
}
