//! Chat that learns from feedback (`rlserve serve --learn-from-feedback`).
//!
//! Every finished chat/completion response is kept for a bounded window
//! (`--feedback-window` responses): per choice its prompt ids, completion ids, μ and
//! versions. `POST /v1/feedback` rates a choice (`reward` in [−1, 1]) or picks a preferred
//! one (it gets 1, the others 0). Each accepted rating is appended to
//! `<feedback-dir>/feedback.jsonl` and fsynced **before** the 200 reply.
//!
//! Samples become trainable by these rules:
//! - all `n ≥ 2` choices of a response rated → one GRPO group (advantages from the group);
//! - a response with `n = 1`, or one that leaves the window partly rated → each rated choice
//!   alone, REINFORCE with a baseline: advantage = reward − the running mean of all earlier
//!   single-choice rewards (0 before the first).
//!
//! The learner thread steps when `--feedback-batch-size` samples are ready, on the served
//! weights (later requests see the update), then saves `<feedback-dir>/checkpoint` with the
//! log position it covers. On restart the checkpoint's weights are loaded and every rating
//! after that position is replayed: accepted feedback is never lost.

use super::job::JobContext;
use super::rollout::Rollout;
use learner::{checkpoint, TrainConfig, TrainSample, Trainer};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};

/// The feedback learner's entropy-collapse alarm threshold (as a job's default).
const ENTROPY_COLLAPSE_FRACTION: f64 = 0.3;

/// Feedback learning settings.
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
    pub train: TrainConfig,
}

/// `POST /v1/feedback` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackRequest {
    pub id: String,
    pub choice: Option<usize>,
    pub reward: Option<f64>,
    pub preferred: Option<usize>,
}

/// Why feedback was refused (each maps to its own 4xx).
#[derive(Debug, thiserror::Error)]
pub enum FeedbackError {
    #[error("{0}")]
    Invalid(String),
    #[error("unknown response id `{0}` (not served by this server, or feedback learning was off)")]
    Unknown(String),
    #[error("response `{0}` has left the feedback window (--feedback-window); it can no longer be rated")]
    Expired(String),
    #[error("{0}")]
    Duplicate(String),
    #[error("writing the feedback log: {0}")]
    Io(String),
}

/// One log line: a rating with the data of every choice of its response.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LogLine {
    seq: u64,
    id: String,
    /// Rewards set by this rating, by choice index.
    ratings: Vec<(usize, f32)>,
    choices: Vec<KeptChoice>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeptChoice {
    prompt_ids: Vec<u32>,
    completion_ids: Vec<u32>,
    behavior_logprobs: Vec<f32>,
    versions: Vec<u64>,
    finish_reason: Option<String>,
}

struct Kept {
    choices: Vec<KeptChoice>,
    /// Sampled at temperature 0: μ is not a sampling probability, so it is not trained on.
    greedy: bool,
    rewards: Vec<Option<f32>>,
    /// Log sequence number of the latest rating.
    seq: u64,
}

#[derive(Default)]
struct Inner {
    order: VecDeque<String>,
    kept: HashMap<String, Kept>,
    /// Ids evicted from the window (410), and ids whose every choice is rated (409).
    expired: HashSet<String>,
    done: HashSet<String>,
    /// Trainable samples with the log position that made them.
    ready: VecDeque<(u64, TrainSample)>,
    next_seq: u64,
    next_group: u64,
    baseline: (f64, u64),
    accepted: u64,
    rejected: u64,
    trained: u64,
}

pub struct FeedbackStore {
    cfg: FeedbackConfig,
    inner: Mutex<Inner>,
    cv: Condvar,
    log: Mutex<std::fs::File>,
}

impl FeedbackStore {
    /// Opens (or creates) the log, loads `checkpoint/` into the served weights when present,
    /// replays the ratings after it, and starts the learner thread.
    pub fn open(cfg: FeedbackConfig, ctx: JobContext) -> Result<Arc<Self>, String> {
        std::fs::create_dir_all(&cfg.dir).map_err(|e| format!("{}: {e}", cfg.dir.display()))?;
        let ckpt = cfg.dir.join("checkpoint");
        let mut trainer = Trainer::new(&ctx.model.read(), cfg.train.clone()).map_err(|e| e.to_string())?;
        let mut covered = 0;
        if ckpt.join("trainer_state.json").exists() {
            let state = checkpoint::load_state(&ckpt).map_err(|e| e.to_string())?;
            super::job::load_weights(&ctx.model, &ckpt, state["version"].as_u64().unwrap_or(0))?;
            trainer.optimizer = checkpoint::load_optimizer(&ckpt, &ctx.model.read().device().clone()).map_err(|e| e.to_string())?;
            covered = state["feedback_seq"].as_u64().unwrap_or(0);
        }
        let path = cfg.dir.join("feedback.jsonl");
        let mut inner = Inner { next_seq: 1, ..Default::default() };
        if let Ok(text) = std::fs::read_to_string(&path) {
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                match serde_json::from_str::<LogLine>(line) {
                    Ok(l) => inner.apply(&l, covered, cfg.window),
                    // A torn last line (crash mid-write) was never acknowledged: skip it.
                    Err(e) => tracing::warn!("{} line {}: {e}; skipped", path.display(), i + 1),
                }
            }
        }
        tracing::info!(replayed = inner.ready.len(), covered, "feedback log {}", path.display());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let store = Arc::new(Self { cfg, inner: Mutex::new(inner), cv: Condvar::new(), log: Mutex::new(log) });
        let s = store.clone();
        std::thread::Builder::new()
            .name("rlserve-feedback-learner".into())
            .spawn(move || s.learn(ctx, trainer))
            .map_err(|e| e.to_string())?;
        Ok(store)
    }

    /// Keeps a finished response for rating.
    pub fn register(&self, id: &str, rollouts: &[Rollout], greedy: bool) {
        let choices = rollouts
            .iter()
            .map(|r| KeptChoice {
                prompt_ids: r.prompt_token_ids.clone(),
                completion_ids: r.completion_ids.clone(),
                behavior_logprobs: r.behavior_logprobs.clone(),
                versions: r.versions.clone(),
                finish_reason: r.finish_reason_str(),
            })
            .collect::<Vec<_>>();
        let mut inner = self.lock();
        let n = choices.len();
        inner.insert(id.to_string(), Kept { choices, greedy, rewards: vec![None; n], seq: 0 }, self.cfg.window);
        drop(inner);
        self.cv.notify_all();
    }

    /// Validates and applies one rating; durable (fsynced) before it returns Ok.
    pub fn submit(&self, req: &FeedbackRequest) -> Result<serde_json::Value, FeedbackError> {
        let mut inner = self.lock();
        let r = inner.check(req);
        let (ratings, choices) = match r {
            Ok(x) => x,
            Err(e) => {
                inner.rejected += 1;
                return Err(e);
            }
        };
        let line = LogLine { seq: inner.next_seq, id: req.id.clone(), ratings, choices };
        {
            let mut f = self.log.lock().unwrap_or_else(|e| e.into_inner());
            let text = serde_json::to_string(&line).map_err(|e| FeedbackError::Io(e.to_string()))?;
            writeln!(f, "{text}").and_then(|_| f.sync_data()).map_err(|e| FeedbackError::Io(e.to_string()))?;
        }
        inner.apply(&line, 0, self.cfg.window);
        inner.accepted += 1;
        let ready = inner.ready.len();
        drop(inner);
        self.cv.notify_all();
        Ok(
            serde_json::json!({"id": req.id, "accepted": true, "seq": line.seq, "samples_ready": ready, "feedback_batch_size": self.cfg.batch_size}),
        )
    }

    /// Counters for metrics: (accepted, rejected, trained samples, ready samples).
    pub fn counts(&self) -> (u64, u64, u64, usize) {
        let i = self.lock();
        (i.accepted, i.rejected, i.trained, i.ready.len())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The learner loop: wait for a batch, take the learner slot, step, checkpoint.
    fn learn(self: Arc<Self>, ctx: JobContext, mut trainer: Trainer) {
        // Kept across steps: the entropy-collapse and length-drift baselines.
        let mut log = super::report::JobLog::detached();
        loop {
            let batch: Vec<(u64, TrainSample)> = {
                let mut inner = self.lock();
                while inner.ready.len() < self.cfg.batch_size {
                    inner = self.cv.wait(inner).unwrap_or_else(|e| e.into_inner());
                }
                // Whole groups only: a group's advantages need all of its samples.
                let mut take = self.cfg.batch_size.min(inner.ready.len());
                while take < inner.ready.len()
                    && inner.ready[take].1.group.is_some()
                    && inner.ready[take].1.group == inner.ready[take - 1].1.group
                {
                    take += 1;
                }
                inner.ready.iter().take(take).cloned().collect()
            };
            let guard = loop {
                match ctx.learner.try_acquire() {
                    Some(g) => break g,
                    None => std::thread::sleep(std::time::Duration::from_millis(200)),
                }
            };
            let samples: Vec<TrainSample> = batch.iter().map(|(_, s)| s.clone()).collect();
            let through = batch.iter().map(|(seq, _)| *seq).max().unwrap_or(0);
            let t0 = std::time::Instant::now();
            let record = match trainer.step(&ctx.model, &samples) {
                Ok((m, _)) => Some(m),
                Err(e) => {
                    tracing::warn!("feedback learner: no update: {e}");
                    None
                }
            };
            let rec =
                log.step(trainer.optimizer.step, record, &samples, &Default::default(), ENTROPY_COLLAPSE_FRACTION);
            ctx.metrics.learner_step(&rec, &samples);
            let state = serde_json::json!({"feedback_seq": through});
            let saved = if trainer.optimizer.step % self.cfg.save_steps.max(1) == 0 {
                checkpoint::save(
                    &self.cfg.dir.join("checkpoint"),
                    &ctx.model_dir,
                    &ctx.model.read(),
                    &trainer.optimizer,
                    state,
                )
            } else {
                Ok(())
            };
            drop(guard);
            if let Err(e) = saved {
                tracing::error!("feedback learner: saving the checkpoint failed: {e}");
            }
            let mut inner = self.lock();
            for _ in 0..batch.len() {
                inner.ready.pop_front();
            }
            inner.trained += batch.len() as u64;
            tracing::info!(
                version = rec.learner.version,
                loss = rec.learner.loss.loss,
                secs = t0.elapsed().as_secs_f64(),
                "feedback learner step"
            );
        }
    }
}

impl Inner {
    fn insert(&mut self, id: String, kept: Kept, window: usize) {
        self.order.push_back(id.clone());
        self.kept.insert(id, kept);
        while self.order.len() > window.max(1) {
            let old = self.order.pop_front().expect("non-empty");
            if let Some(k) = self.kept.remove(&old) {
                self.flush_partial(&k);
            }
            self.expired.insert(old);
        }
    }

    fn check(&self, req: &FeedbackRequest) -> Result<(Vec<(usize, f32)>, Vec<KeptChoice>), FeedbackError> {
        if self.done.contains(&req.id) {
            return Err(FeedbackError::Duplicate(format!("every choice of `{}` is already rated", req.id)));
        }
        if self.expired.contains(&req.id) {
            return Err(FeedbackError::Expired(req.id.clone()));
        }
        let k = self.kept.get(&req.id).ok_or_else(|| FeedbackError::Unknown(req.id.clone()))?;
        if k.greedy {
            return Err(FeedbackError::Invalid(format!(
                "response `{}` was generated greedily (temperature 0): greedy tokens are not on-policy samples \
                 and are not trained on; request with temperature > 0 to rate",
                req.id
            )));
        }
        let n = k.choices.len();
        let ratings = match (req.choice, req.reward, req.preferred) {
            (Some(c), Some(r), None) => {
                if c >= n {
                    return Err(FeedbackError::Invalid(format!(
                        "`choice` {c} is out of range: the response has {n} choice(s)"
                    )));
                }
                if !(r.is_finite() && (-1.0..=1.0).contains(&r)) {
                    return Err(FeedbackError::Invalid(format!("`reward` must be a number in [-1, 1], got {r}")));
                }
                if k.rewards[c].is_some() {
                    return Err(FeedbackError::Duplicate(format!("choice {c} of `{}` is already rated", req.id)));
                }
                vec![(c, r as f32)]
            }
            (None, None, Some(p)) => {
                if p >= n {
                    return Err(FeedbackError::Invalid(format!(
                        "`preferred` {p} is out of range: the response has {n} choice(s)"
                    )));
                }
                if k.rewards.iter().any(Option::is_some) {
                    return Err(FeedbackError::Duplicate(format!("response `{}` already has ratings", req.id)));
                }
                (0..n).map(|i| (i, if i == p { 1.0 } else { 0.0 })).collect()
            }
            _ => {
                return Err(FeedbackError::Invalid(
                    "give either `choice` and `reward`, or `preferred` (a choice index)".into(),
                ))
            }
        };
        Ok((ratings, k.choices.clone()))
    }

    /// Applies a logged rating (from a request or the replay). Ratings at or before
    /// `covered` are already in the checkpoint's weights: they count but are not re-queued.
    fn apply(&mut self, line: &LogLine, covered: u64, window: usize) {
        self.next_seq = self.next_seq.max(line.seq + 1);
        if !self.kept.contains_key(&line.id) {
            let n = line.choices.len();
            self.insert(
                line.id.clone(),
                Kept { choices: line.choices.clone(), greedy: false, rewards: vec![None; n], seq: 0 },
                window,
            );
        }
        let Some(k) = self.kept.get_mut(&line.id) else { return };
        for &(c, r) in &line.ratings {
            if c < k.rewards.len() {
                k.rewards[c] = Some(r);
            }
        }
        k.seq = line.seq;
        let complete = k.rewards.iter().all(Option::is_some);
        if line.seq <= covered {
            if complete {
                self.kept.remove(&line.id);
                self.order.retain(|x| x != &line.id);
                self.done.insert(line.id.clone());
            }
            return;
        }
        let n = k.choices.len();
        if n == 1 || !complete {
            if n == 1 {
                let k = self.kept.remove(&line.id).expect("present");
                self.order.retain(|x| x != &line.id);
                self.done.insert(line.id.clone());
                self.flush_partial(&k);
            }
            return;
        }
        let k = self.kept.remove(&line.id).expect("present");
        self.order.retain(|x| x != &line.id);
        self.done.insert(line.id.clone());
        self.next_group += 1;
        for (c, r) in k.choices.iter().zip(&k.rewards) {
            self.ready.push_back((k.seq, sample(c, None, *r, Some(self.next_group))));
        }
    }

    /// Rated choices of a response that will not be completed: REINFORCE with a baseline.
    fn flush_partial(&mut self, k: &Kept) {
        for (c, r) in k.choices.iter().zip(&k.rewards) {
            let Some(r) = *r else { continue };
            let (sum, count) = self.baseline;
            let base = if count == 0 { 0.0 } else { sum / count as f64 };
            self.baseline = (sum + r as f64, count + 1);
            self.ready.push_back((k.seq, sample(c, Some(r - base as f32), Some(r), None)));
        }
    }
}

fn sample(c: &KeptChoice, advantage: Option<f32>, reward: Option<f32>, group: Option<u64>) -> TrainSample {
    TrainSample {
        prompt_ids: c.prompt_ids.clone(),
        completion_ids: c.completion_ids.clone(),
        behavior_logprobs: c.behavior_logprobs.clone(),
        advantage,
        reward,
        group,
        versions: Some(c.versions.clone()),
        finish_reason: c.finish_reason.clone(),
    }
}
