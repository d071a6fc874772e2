//! A training job: rollouts from the serving engine, rewards, learner steps on the served
//! weights, evaluation, checkpoints and metrics. This file holds the job's handle, its
//! status and the registry of jobs; `job_run.rs` holds its two threads.

use super::config::JobConfig;
use super::context::RlContext;
use super::dataset;
use super::error::{Result, RlError};
use super::job_run;
use super::report::{EvalRecord, StepRecord};
use super::rewards::{RewardSpec, Rewards};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Where a job is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Generating and training.
    Running,
    /// Asked to stop: finishing the current step, then a checkpoint.
    Stopping,
    /// Ran all `max_steps`.
    Completed,
    /// Stopped on request (a checkpoint was saved).
    Stopped,
    /// Ended by an error (see `error`).
    Failed,
}

/// `GET /v1/train/jobs/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct JobStatus {
    /// The job's id.
    pub id: String,
    /// Where the job is in its life.
    pub status: JobState,
    /// Steps finished (a resumed job starts at its checkpoint's step).
    pub step: u64,
    /// The job's `max_steps`.
    pub max_steps: u64,
    /// The served weights' policy version.
    pub version: u64,
    /// Why the job failed.
    pub error: Option<String>,
    /// The job's `output_dir`.
    pub output_dir: PathBuf,
    /// The record of the latest step.
    pub latest: Option<StepRecord>,
    /// Every step record of this run.
    pub history: Vec<StepRecord>,
    /// Every evaluation of this run.
    pub evals: Vec<EvalRecord>,
}

/// A running (or finished) training job.
pub struct Job {
    /// The job's id (`job-…` over HTTP, `job-cli` for `rlserve train`).
    pub id: String,
    /// The validated config it runs.
    pub config: JobConfig,
    /// Set once by [`Self::request_stop`]; the generator's rollouts wait on it too, so a stop
    /// aborts the requests in flight.
    stop: tokio::sync::watch::Sender<bool>,
    status: Mutex<JobStatus>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Job {
    /// Checks the config against the served model (model folder, datasets, rewards,
    /// checkpoint to resume, context length, `output_dir`), takes the learner slot
    /// ([`RlError::Busy`] when another learner holds it), then starts the job's threads.
    /// `progress` shows a progress bar on stderr.
    pub fn start(id: String, config: JobConfig, ctx: RlContext, progress: bool) -> Result<Arc<Job>> {
        if config.model.as_ref().is_some_and(|m| m != &ctx.model_dir) {
            return Err(RlError::invalid(
                "model",
                format!(
                    "`model` must be the served model ({}); a job trains the weights being served",
                    ctx.model_dir.display()
                ),
            ));
        }
        let templating = dataset::Templating {
            apply_chat_template: config.apply_chat_template,
            system_prompt: config.system_prompt.as_deref(),
            chat_template_kwargs: Some(&config.chat_template_kwargs),
        };
        let load = |key: &'static str, s: &str| dataset::load(key, s, &ctx.tokenizer, templating);
        let train = load("dataset", &config.dataset)?;
        let eval = match &config.eval_dataset {
            Some(s) => load("eval_dataset", s)?.into_iter().take(config.eval_size).collect(),
            None => vec![],
        };
        if config.learner.loss_type.is_preference() {
            for (key, spec, set) in
                [("dataset", Some(&config.dataset), &train), ("eval_dataset", config.eval_dataset.as_ref(), &eval)]
            {
                if let (Some(spec), Some(i)) = (spec, set.iter().position(|e| e.pair.is_none())) {
                    return Err(RlError::invalid(
                        key,
                        format!("{key} {spec}: example {} has no `chosen` and `rejected`: loss_type dpo/ipo trains on preference pairs", i + 1),
                    ));
                }
            }
        }
        // A reward that reads `answer` on a row without one would score 0 for good: every
        // step's group would be flat and train nothing (DPO/IPO train on the pairs, no reward).
        let exact = config.rewards.iter().position(|r| matches!(r, RewardSpec::ExactAnswer { .. }));
        if let Some(k) = exact.filter(|_| !config.learner.loss_type.is_preference()) {
            for (key, spec, set) in
                [("dataset", Some(&config.dataset), &train), ("eval_dataset", config.eval_dataset.as_ref(), &eval)]
            {
                if let (Some(spec), Some(i)) = (spec, set.iter().position(|e| !e.fields.contains_key("answer"))) {
                    return Err(RlError::invalid(
                        &format!("rewards[{k}]"),
                        format!(
                            "`rewards[{k}]` (exact_answer) reads each row's `answer`, and {key} {spec} example {} has none \
                             (TRL's `solution` column: name it `answer`)",
                            i + 1
                        ),
                    ));
                }
            }
        }
        let rewards = Rewards::new(&config.rewards, ctx.runtime.clone())?;
        let resume = job_run::resolve_resume(&config)?;
        let longest = train.iter().chain(&eval).map(|e| e.prompt_ids.len()).max().unwrap_or(0);
        let max_completion_length = config.learner.max_completion_length;
        if longest + max_completion_length > ctx.max_model_len {
            return Err(RlError::invalid(
                "learner.max_completion_length",
                format!(
                    "`learner.max_completion_length` {max_completion_length} plus the longest prompt ({longest} tokens) \
                     exceeds the context of {} tokens",
                    ctx.max_model_len
                ),
            ));
        }
        let earlier = match resume {
            None => job_run::earlier_run(&config.output_dir),
            Some(_) => vec![],
        };
        if !earlier.is_empty() && !config.overwrite_output_dir {
            return Err(RlError::invalid(
                "output_dir",
                format!(
                    "`output_dir` {} holds an earlier run ({}): set `resume_from_checkpoint` = \"latest\" to continue \
                     it, choose another `output_dir`, or set `overwrite_output_dir` = true to remove it and start over",
                    config.output_dir.display(),
                    earlier
                        .iter()
                        .map(|p| p.file_name().unwrap_or_default().to_string_lossy())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        // The slot first: a refused job (409) creates nothing.
        let guard = ctx.learner.try_acquire().ok_or(RlError::Busy)?;
        for old in &earlier {
            let removed = match old.is_dir() {
                true => learner::checkpoint::remove(old).map_err(RlError::from),
                false => std::fs::remove_file(old).map_err(|e| RlError::io(old.clone(), e)),
            };
            removed?;
        }
        std::fs::create_dir_all(&config.output_dir).map_err(|source| RlError::File {
            key: "output_dir",
            path: config.output_dir.clone(),
            source,
        })?;
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
            stop: tokio::sync::watch::Sender::new(false),
            thread: Mutex::new(None),
        });
        let j = job.clone();
        let handle = std::thread::Builder::new()
            .name(format!("rlserve-job-{}", job.id))
            .spawn(move || {
                let _guard = guard;
                let run = job_run::JobRun { job: &j, ctx: &ctx, train: &train, eval: &eval, rewards: &rewards };
                let r = run.run(resume.as_deref(), progress);
                let stopped = j.stopping();
                j.update(|st| {
                    st.status = match (&r, stopped) {
                        (Err(_), _) => JobState::Failed,
                        (Ok(()), true) => JobState::Stopped,
                        (Ok(()), false) => JobState::Completed,
                    };
                    if let Err(e) = &r {
                        tracing::error!(job = %st.id, "training job failed: {e}");
                        st.error = Some(e.to_string());
                    }
                });
            })
            .map_err(RlError::Spawn)?;
        *job.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(handle);
        Ok(job)
    }

    /// A snapshot of the job's status.
    pub fn status(&self) -> JobStatus {
        self.status.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Changes the status under its lock.
    pub(crate) fn update(&self, f: impl FnOnce(&mut JobStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Asks the job to stop after the current step (a checkpoint is saved).
    pub fn request_stop(&self) {
        self.stop.send_replace(true);
        self.update(|st| {
            if st.status == JobState::Running {
                st.status = JobState::Stopping;
            }
        });
    }

    /// Blocks until the job's thread ends.
    pub fn wait(&self) {
        if let Some(h) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// Whether a stop was requested.
    pub(crate) fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Resolves once a stop is requested (at once if it was already).
    pub(crate) async fn stopped(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|&s| s).await;
    }

    /// Redraws `metrics.png` from the job's `metrics.jsonl` and returns the PNG's bytes.
    pub fn plot(&self) -> Result<Vec<u8>> {
        let dir = &self.config.output_dir;
        if !dir.join("metrics.jsonl").exists() {
            return Err(RlError::NotFound(format!("training job `{}` has no metrics to plot yet", self.id)));
        }
        super::report::plot(dir)?;
        let png = dir.join("metrics.png");
        std::fs::read(&png).map_err(|e| RlError::io(png, e))
    }
}

/// The jobs a server has started, by id.
#[derive(Default)]
pub struct Jobs(Mutex<BTreeMap<String, Arc<Job>>>);

impl Jobs {
    /// Registers a started job.
    pub fn insert(&self, job: Arc<Job>) {
        self.lock().insert(job.id.clone(), job);
    }

    /// The job with this id, or [`RlError::NotFound`].
    pub fn get(&self, id: &str) -> Result<Arc<Job>> {
        self.lock().get(id).cloned().ok_or_else(|| RlError::NotFound(format!("no training job with id `{id}`")))
    }

    /// Asks every job to stop after its current step (a checkpoint is saved) and returns
    /// them, to [`Job::wait`] for: a server's shutdown.
    pub fn stop_all(&self) -> Vec<Arc<Job>> {
        let jobs: Vec<Arc<Job>> = self.lock().values().cloned().collect();
        jobs.iter().for_each(|j| j.request_stop());
        jobs
    }

    /// Every job's status, by id.
    pub fn statuses(&self) -> Vec<JobStatus> {
        self.lock().values().map(|j| j.status()).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<Job>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
