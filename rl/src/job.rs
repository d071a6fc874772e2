//! A training job: rollouts from the serving engine, rewards, learner steps on the served
//! weights, evaluation, checkpoints and metrics.
//!
//! Two threads per job (DESIGN-NOTES §5). The **generator** submits step `s`'s prompts to
//! the engine (which keeps serving other requests in the same batches), scores the
//! completions and queues the batch; the **learner** trains on queued batches in order.
//! Admission control: the generator starts step `s` (0-based) only once `done ≥ s −
//! max_staleness`, where `done` counts finished learner steps. Every token of batch `s` is then computed by a version
//! ≥ `v0 + s − max_staleness`, and batch `s` is trained at version `v0 + s`: staleness ≤
//! `max_staleness`, and nothing is generated only to be thrown away. With
//! `max_staleness = 0` generation and training alternate (synchronous); with k ≥ 1 the
//! generation of step s + 1 overlaps the training of step s.

use super::config::JobConfig;
use super::dataset::{self, Example};
use super::report::{JobLog, RolloutTiming, StepRecord};
use super::rewards::{exact_answer, Rewards, Scored};
use super::rollout::{Rollout, RolloutSet};
use crate::metrics::Metrics;
use learner::{checkpoint, TrainSample, Trainer};
use engine::{EngineHandle, SamplingParams, SharedModel, Tokenizer};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// What a job runs against: the serving engine and the weights it serves.
#[derive(Clone)]
pub struct JobContext {
    pub engine: EngineHandle,
    pub model: SharedModel,
    pub tokenizer: Arc<Tokenizer>,
    /// The served model's folder (config and tokenizer files are copied into checkpoints).
    pub model_dir: PathBuf,
    /// Runs `http` rewards.
    pub runtime: tokio::runtime::Handle,
    pub metrics: Metrics,
    /// One learner at a time writes the weights (a job, or the feedback learner).
    pub learner: LearnerSlot,
    /// The engine's context limit (prompt + completion).
    pub max_model_len: usize,
}

/// The right to train the served weights: one holder at a time (a job, or one feedback
/// learner step). Cloning shares the slot; [`LearnerSlot::try_acquire`] takes it.
#[derive(Clone, Default)]
pub struct LearnerSlot(Arc<AtomicBool>);

/// Holding the slot; released on drop.
pub struct LearnerGuard(Arc<AtomicBool>);

impl LearnerSlot {
    pub fn try_acquire(&self) -> Option<LearnerGuard> {
        self.0
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| LearnerGuard(self.0.clone()))
    }
}

impl Drop for LearnerGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Stopping,
    Completed,
    Stopped,
    Failed,
}

/// `GET /v1/train/jobs/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct JobStatus {
    pub id: String,
    pub status: JobState,
    pub step: u64,
    pub max_steps: u64,
    pub version: u64,
    pub error: Option<String>,
    pub output_dir: PathBuf,
    pub latest: Option<StepRecord>,
    pub history: Vec<StepRecord>,
    pub evals: Vec<EvalRecord>,
}

/// Greedy evaluation on the eval set.
#[derive(Debug, Clone, Serialize)]
pub struct EvalRecord {
    pub step: u64,
    pub version: u64,
    /// Mean job reward of the greedy completions.
    pub eval_reward: f64,
    /// Fraction whose final answer equals `answer` (when the eval set has answers).
    pub eval_accuracy: Option<f64>,
    pub eval_size: usize,
}

pub struct Job {
    pub id: String,
    pub config: JobConfig,
    stop: AtomicBool,
    status: Mutex<JobStatus>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Job {
    /// Validates the datasets and rewards (errors are the caller's 400), then starts the
    /// job's threads. Errors with "busy" when another learner holds the weights.
    pub fn start(id: String, config: JobConfig, ctx: JobContext, progress: bool) -> Result<Arc<Job>, JobError> {
        let tok = &ctx.tokenizer;
        let load = |key: &str, s: &str| {
            dataset::load(key, s, tok, config.apply_chat_template, config.system_prompt.as_deref())
        };
        let train = load("dataset", &config.dataset).map_err(JobError::Invalid)?;
        let eval = match &config.eval_dataset {
            Some(s) => load("eval_dataset", s).map_err(JobError::Invalid)?.into_iter().take(config.eval_size).collect(),
            None => vec![],
        };
        let rewards = Rewards::new(&config.rewards, ctx.runtime.clone()).map_err(JobError::Invalid)?;
        let resume = resolve_resume(&config).map_err(JobError::Invalid)?;
        let longest = train.iter().chain(&eval).map(|e| e.prompt_ids.len()).max().unwrap_or(0);
        let need = longest + config.train.max_completion_length;
        if need > ctx.max_model_len {
            return Err(JobError::Invalid(format!(
                "`max_completion_length` {} plus the longest prompt ({longest} tokens) exceeds the context of {} tokens",
                config.train.max_completion_length, ctx.max_model_len
            )));
        }
        std::fs::create_dir_all(&config.output_dir)
            .map_err(|e| JobError::Invalid(format!("`output_dir` {}: {e}", config.output_dir.display())))?;
        let guard = ctx.learner.try_acquire().ok_or(JobError::Busy)?;
        let job = Arc::new(Job {
            status: Mutex::new(JobStatus {
                id: id.clone(),
                status: JobState::Running,
                step: 0,
                max_steps: config.max_steps,
                version: ctx.model.version(),
                error: None,
                output_dir: config.output_dir.clone(),
                latest: None,
                history: vec![],
                evals: vec![],
            }),
            id,
            config,
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let j = job.clone();
        let handle = std::thread::Builder::new()
            .name(format!("rlserve-job-{}", job.id))
            .spawn(move || {
                let _guard = guard;
                let r = run(&j, &ctx, &train, &eval, &rewards, resume.as_deref(), progress);
                let mut st = j.status.lock().unwrap_or_else(|e| e.into_inner());
                st.status = match (&r, j.stop.load(Ordering::SeqCst)) {
                    (Err(_), _) => JobState::Failed,
                    (Ok(()), true) => JobState::Stopped,
                    (Ok(()), false) => JobState::Completed,
                };
                if let Err(e) = r {
                    tracing::error!(job = %j.id, "training job failed: {e}");
                    st.error = Some(e);
                }
            })
            .map_err(|e| JobError::Invalid(format!("spawning the job thread: {e}")))?;
        *job.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(job)
    }

    pub fn status(&self) -> JobStatus {
        self.status.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Asks the job to stop after the current step (a checkpoint is saved).
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if st.status == JobState::Running {
            st.status = JobState::Stopping;
        }
    }

    /// Blocks until the job's thread ends.
    pub fn wait(&self) {
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("{0}")]
    Invalid(String),
    #[error("another training job (or the feedback learner) is already updating the weights")]
    Busy,
}

/// The checkpoint folder to resume from, if any.
fn resolve_resume(cfg: &JobConfig) -> Result<Option<PathBuf>, String> {
    match cfg.resume_from_checkpoint.as_deref() {
        None => Ok(None),
        Some("latest") => match checkpoints(&cfg.output_dir).pop() {
            Some((_, p)) => Ok(Some(p)),
            None => Err(format!(
                "`resume_from_checkpoint` = \"latest\": no checkpoint-<step> folder under {}",
                cfg.output_dir.display()
            )),
        },
        Some(p) => {
            let p = PathBuf::from(p);
            if !p.join("trainer_state.json").exists() {
                return Err(format!(
                    "`resume_from_checkpoint`: {} is not a checkpoint (no trainer_state.json)",
                    p.display()
                ));
            }
            Ok(Some(p))
        }
    }
}

/// Complete checkpoints `output_dir/checkpoint-<step>`, oldest first.
pub fn checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
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

/// Replaces the served weights with a checkpoint's: loaded (and every tensor's shape
/// checked) outside any guard, swapped in under the write guard. The policy version becomes
/// the checkpoint's, or the current one + 1 if that is not newer: versions never go back,
/// so no KV or prefix-cache block of other weights is ever taken for these.
pub fn load_weights(model: &SharedModel, dir: &Path, version: u64) -> Result<(), String> {
    let (config, device) = {
        let m = model.read();
        (m.config.clone(), m.device().clone())
    };
    let loaded =
        engine::Model::load(dir, &device).map_err(|e| format!("loading weights from {}: {e}", dir.display()))?;
    if loaded.config != config {
        return Err(format!("{} holds a different model than the one served", dir.display()));
    }
    let mut m = model.write();
    let version = version.max(m.version + 1);
    *m = loaded;
    m.version = version;
    Ok(())
}

/// One step's scored rollouts, from the generator to the learner.
struct Batch {
    samples: Vec<TrainSample>,
    timing: RolloutTiming,
}

/// Learner progress the generator's admission control waits on.
#[derive(Default)]
struct Progress {
    done: Mutex<u64>,
    cv: Condvar,
    /// The learner has ended (error or stop): the generator must not start another batch.
    ended: AtomicBool,
}

fn run(
    job: &Job,
    ctx: &JobContext,
    train: &[Example],
    eval: &[Example],
    rewards: &Rewards,
    resume: Option<&Path>,
    progress: bool,
) -> Result<(), String> {
    let cfg = &job.config;
    std::fs::create_dir_all(&cfg.output_dir).map_err(|e| format!("{}: {e}", cfg.output_dir.display()))?;
    let e = |e: learner::LearnerError| e.to_string();
    // The reference (KL to the initial weights) is taken before a checkpoint is loaded.
    let mut trainer = Trainer::new(&ctx.model.read(), cfg.train.clone()).map_err(e)?;
    let mut start = 0;
    if let Some(dir) = resume {
        let state = checkpoint::load_state(dir).map_err(e)?;
        load_weights(&ctx.model, dir, state["version"].as_u64().unwrap_or(0))?;
        trainer.optimizer = checkpoint::load_optimizer(dir, &ctx.model.read().device().clone()).map_err(e)?;
        start = state["job_step"].as_u64().unwrap_or(0);
        let mut st = job.status.lock().unwrap_or_else(|e| e.into_inner());
        (st.step, st.version) = (start, ctx.model.version());
        drop(st);
        tracing::info!("resumed from {} at step {start}", dir.display());
    }
    let mut log = JobLog::open(&cfg.output_dir, start, progress.then_some(cfg.max_steps))?;
    let k = cfg.max_staleness();
    let prog = Arc::new(Progress::default());
    *prog.done.lock().unwrap() = start;
    let (tx, rx) = flume::bounded::<Result<Batch, String>>(k as usize + 1);
    // A resumed run keeps the evals it logged up to its checkpoint.
    if start == 0 {
        record_eval(job, ctx, eval, rewards, start, &mut log)?;
    }
    std::thread::scope(|scope| -> Result<(), String> {
        let gen_prog = prog.clone();
        scope.spawn(move || {
            for s in start..cfg.max_steps {
                let t_wait = Instant::now();
                {
                    let mut done = gen_prog.done.lock().unwrap_or_else(|e| e.into_inner());
                    while *done + k < s && !job.stopping() && !gen_prog.ended.load(Ordering::SeqCst) {
                        done = gen_prog.cv.wait(done).unwrap_or_else(|e| e.into_inner());
                    }
                }
                if job.stopping() || gen_prog.ended.load(Ordering::SeqCst) {
                    return;
                }
                let wait = t_wait.elapsed().as_secs_f64();
                let r = generate(ctx, cfg, train, rewards, s).map(|mut b| {
                    b.timing.admission_wait_seconds = wait;
                    b
                });
                let failed = r.is_err();
                if tx.send(r).is_err() || failed {
                    return;
                }
            }
        });
        let mut out = Ok(());
        for s in start..cfg.max_steps {
            let t_wait = Instant::now();
            let Ok(batch) = rx.recv() else { break };
            let batch = match batch {
                Ok(b) => b,
                Err(x) => {
                    out = Err(x);
                    break;
                }
            };
            let learner_wait = t_wait.elapsed().as_secs_f64();
            let rec = match trainer.step(&ctx.model, &batch.samples) {
                Ok((m, _)) => Some(m),
                Err(x) => {
                    // Every sample filtered (zero-std groups, staleness, truncation): no update.
                    tracing::warn!(step = s + 1, "no update: {x}");
                    None
                }
            };
            let timing = RolloutTiming { learner_wait_seconds: learner_wait, ..batch.timing };
            let record = log.step(s + 1, rec, &batch.samples, &timing, cfg.entropy_collapse_fraction);
            ctx.metrics.learner_step(&record, &batch.samples);
            {
                let mut st = job.status.lock().unwrap_or_else(|e| e.into_inner());
                st.step = s + 1;
                st.version = ctx.model.version();
                st.latest = Some(record.clone());
                st.history.push(record);
            }
            *prog.done.lock().unwrap_or_else(|e| e.into_inner()) = s + 1;
            prog.cv.notify_all();
            let last = s + 1 == cfg.max_steps || job.stopping();
            if eval_due(cfg, s + 1) || (last && !eval.is_empty()) {
                if let Err(x) = record_eval(job, ctx, eval, rewards, s + 1, &mut log) {
                    out = Err(x);
                    break;
                }
            }
            if (cfg.save_steps > 0 && (s + 1) % cfg.save_steps == 0) || last {
                if let Err(x) = save(ctx, cfg, &trainer, s + 1) {
                    out = Err(x);
                    break;
                }
            }
            if last {
                break;
            }
        }
        // Unblock the generator (it may wait for admission or on a full queue).
        prog.ended.store(true, Ordering::SeqCst);
        drop(rx);
        prog.cv.notify_all();
        out
    })?;
    log.finish()
}

fn eval_due(cfg: &JobConfig, step: u64) -> bool {
    cfg.eval_dataset.is_some() && cfg.eval_interval > 0 && step % cfg.eval_interval == 0
}

/// Submits step `s`'s prompts (× `num_generations`), waits for the completions and scores them.
fn generate(ctx: &JobContext, cfg: &JobConfig, train: &[Example], rewards: &Rewards, s: u64) -> Result<Batch, String> {
    let t0 = Instant::now();
    let examples: Vec<&Example> = (0..cfg.prompts_per_step as u64)
        .map(|j| dataset::at(train, cfg.seed, s * cfg.prompts_per_step as u64 + j))
        .collect();
    let rollouts = rollouts(ctx, &examples, cfg.sampling_params(s))?;
    let generation_seconds = t0.elapsed().as_secs_f64();
    let mut samples = Vec::with_capacity(rollouts.len());
    let mut reward_errors = 0;
    for r in &rollouts {
        let ex = examples[r.prompt_index];
        let scored = Scored {
            prompt: &ex.prompt_text,
            completion: &r.text,
            completion_tokens: r.completion_ids.len(),
            fields: &ex.fields,
        };
        match rewards.score(&scored) {
            Ok(x) if !r.completion_ids.is_empty() => samples.push(r.to_sample(x, s << 20 | r.prompt_index as u64)),
            Ok(_) => {}
            Err(x) => {
                tracing::warn!("reward skipped a sample: {x}");
                reward_errors += 1;
            }
        }
    }
    let rollout_tokens = rollouts.iter().map(|r| r.completion_ids.len()).sum();
    let timing = RolloutTiming { rollout_tokens, generation_seconds, reward_errors, ..Default::default() };
    Ok(Batch { samples, timing })
}

/// Runs `examples` through the engine with `params` and waits for every sample.
fn rollouts(ctx: &JobContext, examples: &[&Example], params: SamplingParams) -> Result<Vec<Rollout>, String> {
    let prompts: Vec<Vec<u32>> = examples.iter().map(|e| e.prompt_ids.clone()).collect();
    let set = RolloutSet::new(&prompts, params.n);
    let streams = prompts
        .into_iter()
        .map(|p| ctx.engine.add_request(p, params.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("submitting rollouts: {e}"))?;
    Ok(set.collect_blocking(streams))
}

/// Greedy completions of the eval prompts, scored with the job's rewards.
fn record_eval(
    job: &Job,
    ctx: &JobContext,
    eval: &[Example],
    rewards: &Rewards,
    step: u64,
    log: &mut JobLog,
) -> Result<(), String> {
    if eval.is_empty() {
        return Ok(());
    }
    let cfg = &job.config;
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(cfg.train.max_completion_length),
        stop: cfg.stop.clone(),
        ..Default::default()
    };
    let refs: Vec<&Example> = eval.iter().collect();
    let version = ctx.model.version();
    let rs = rollouts(ctx, &refs, params)?;
    let (mut total, mut correct, mut with_answer) = (0.0f64, 0usize, 0usize);
    for r in &rs {
        let ex = &eval[r.prompt_index];
        let sc = Scored {
            prompt: &ex.prompt_text,
            completion: &r.text,
            completion_tokens: r.completion_ids.len(),
            fields: &ex.fields,
        };
        total += rewards.score(&sc).unwrap_or(0.0) as f64;
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
    };
    log.eval(&rec)?;
    ctx.metrics.eval(&rec);
    job.status.lock().unwrap_or_else(|e| e.into_inner()).evals.push(rec);
    Ok(())
}

/// Writes `output_dir/checkpoint-<step>` atomically and prunes old ones.
fn save(ctx: &JobContext, cfg: &JobConfig, trainer: &Trainer, step: u64) -> Result<(), String> {
    let dir = cfg.output_dir.join(format!("checkpoint-{step}"));
    let state = serde_json::json!({
        "job_step": step,
        "seed": cfg.seed,
        "dataset_position": step * cfg.prompts_per_step as u64,
    });
    checkpoint::save(&dir, &ctx.model_dir, &ctx.model.read(), &trainer.optimizer, state).map_err(|e| e.to_string())?;
    let all = checkpoints(&cfg.output_dir);
    let keep = cfg.save_total_limit.max(1);
    for (_, old) in all.iter().take(all.len().saturating_sub(keep)) {
        let _ = std::fs::remove_dir_all(old);
    }
    Ok(())
}
