//! The RL endpoints (admin only, see [`super::admin`]): `POST /v1/rollouts`, training jobs
//! (`POST /v1/train/jobs`, `GET /v1/train/jobs[/{id}]`, `POST /v1/train/jobs/{id}/stop`,
//! `GET /v1/train/jobs/{id}/plot`), `POST /v1/feedback` and `POST /v1/checkpoints`.

use super::chat::chat_prompt;
use super::error::{ApiError, ApiJson};
use super::generation::{response_id, sampling_params};
use super::protocol::{ChatMessageIn, SamplingFields};
use super::AppState;
use ::rl::rollout::RolloutSet;
use ::rl::{FeedbackRequest, Job, JobConfig};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// Most sequences (prompts × num_generations) in one rollout request.
pub const MAX_ROLLOUT_SEQS: usize = 4096;

/// One prompt of a rollout request: text, token ids, or chat messages.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RolloutPrompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat { messages: Vec<ChatMessageIn> },
}

#[derive(Debug, Clone, Deserialize)]
pub struct RolloutRequest {
    pub model: Option<String>,
    pub prompts: Vec<RolloutPrompt>,
    /// Samples per prompt (a GRPO group); `n` is accepted as an alias.
    pub num_generations: Option<usize>,
    pub max_tokens: Option<usize>,
    /// Wrap text prompts as a user message in the chat template.
    #[serde(default)]
    pub apply_chat_template: bool,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `POST /v1/rollouts`: every prompt × `num_generations`, submitted at once (the group's
/// samples share the prompt's KV blocks); token ids, μ, raw logprobs and versions per token.
pub async fn rollouts(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<RolloutRequest>,
) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    if req.prompts.is_empty() {
        return Err(ApiError::bad("`prompts` must hold at least one prompt", Some("prompts")));
    }
    if req.sampling.stream {
        return Err(ApiError::bad("`stream` is not supported for rollouts", Some("stream")));
    }
    let tok = &state.tokenizer;
    let prompts = req
        .prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ids = match p {
                RolloutPrompt::Tokens(ids) => ids.clone(),
                RolloutPrompt::Chat { messages } => chat_prompt(tok, messages, true)?,
                RolloutPrompt::Text(t) if req.apply_chat_template => {
                    let msgs = [ChatMessageIn {
                        role: "user".into(),
                        content: Some(super::protocol::Content::Text(t.clone())),
                    }];
                    chat_prompt(tok, &msgs, true)?
                }
                RolloutPrompt::Text(t) => {
                    tok.encode(t, true).map_err(|e| ApiError::bad(e.to_string(), Some("prompts")))?
                }
            };
            if ids.is_empty() {
                return Err(ApiError::bad(format!("`prompts[{i}]` is empty"), Some("prompts")));
            }
            Ok(ids)
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let mut fields = req.sampling.clone();
    if let Some(g) = req.num_generations.filter(|g| !(1..=engine::sampling::MAX_N).contains(g)) {
        let max = engine::sampling::MAX_N;
        return Err(ApiError::bad(format!("`num_generations` must be in [1, {max}], got {g}"), Some("num_generations")));
    }
    fields.n = req.num_generations.or(fields.n);
    // As completions: 16 tokens unless `max_tokens` says otherwise.
    let max_tokens = req.max_tokens.unwrap_or(super::completions::DEFAULT_MAX_TOKENS);
    let params = sampling_params(&fields, Some(max_tokens), None);
    params.validate()?;
    if prompts.len() * params.n > MAX_ROLLOUT_SEQS {
        return Err(ApiError::bad(
            format!(
                "{} prompts × num_generations {} = {} sequences; at most {MAX_ROLLOUT_SEQS} per request",
                prompts.len(),
                params.n,
                prompts.len() * params.n
            ),
            Some("prompts"),
        ));
    }
    let t0 = Instant::now();
    let sub = super::generation::submit_streams_async(&state, prompts.clone(), params.clone()).await?;
    let rollouts = RolloutSet::new(&prompts, params.n).collect(sub.streams).await?;
    drop(sub.in_flight);
    let secs = t0.elapsed().as_secs_f64();
    let completion_tokens: usize = rollouts.iter().map(|r| r.completion_ids.len()).sum();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    Ok(axum::Json(json!({
        "id": response_id("rollout-"),
        "object": "rollouts",
        "model": state.model_name,
        "version": state.model.version(),
        "rollouts": rollouts,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens},
        "seconds": secs,
        "completion_tokens_per_s": completion_tokens as f64 / secs.max(1e-9),
    }))
    .into_response())
}

/// `POST /v1/train/jobs` with the JSON form of the job config: 201 and the job's status.
pub async fn create_job(
    State(state): State<Arc<AppState>>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let cfg = JobConfig::from_json(body)?;
    let id = format!("job-{:016x}", rand::random::<u64>());
    let ctx = state.rl.clone();
    let job = tokio::task::spawn_blocking(move || Job::start(id, cfg, ctx, false))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let status = job.status();
    state.jobs.insert(job);
    Ok((StatusCode::CREATED, axum::Json(status)).into_response())
}

/// `GET /v1/train/jobs`: every job's id, status, step and version.
pub async fn list_jobs(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let jobs: Vec<Value> = state
        .jobs
        .statuses()
        .into_iter()
        .map(
            |s| json!({"id": s.id, "status": s.status, "step": s.step, "max_steps": s.max_steps, "version": s.version}),
        )
        .collect();
    axum::Json(json!({"object": "list", "data": jobs}))
}

/// `GET /v1/train/jobs/{id}`: the job's status with its step and eval history.
pub async fn get_job(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    Ok(axum::Json(state.jobs.get(&id)?.status()).into_response())
}

/// `POST /v1/train/jobs/{id}/stop`: stop after the current step (a checkpoint is saved).
pub async fn stop_job(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let job = state.jobs.get(&id)?;
    job.request_stop();
    Ok(axum::Json(job.status()).into_response())
}

/// The job's `metrics.png`, redrawn from its history now.
pub async fn job_plot(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let job = state.jobs.get(&id)?;
    let bytes =
        tokio::task::spawn_blocking(move || job.plot()).await.map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok(([(header::CONTENT_TYPE, "image/png")], bytes).into_response())
}

/// `POST /v1/feedback`: `{"id", "choice", "reward"}`, `{"id", "preferred"}` or
/// `{"id", "chosen", "rejected"}` (a preference pair). 200 only after the rating is in the
/// durable log.
pub async fn feedback(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<FeedbackRequest>,
) -> Result<Response, ApiError> {
    let store = state.feedback.clone().ok_or_else(|| {
        ApiError::NotFound("feedback learning is off: start the server with --learn-from-feedback".into())
    })?;
    let v = tokio::task::spawn_blocking(move || store.submit(&req))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok(axum::Json(v).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    /// Folder to write (created; replaced atomically if it exists).
    pub path: std::path::PathBuf,
}

/// `POST /v1/checkpoints {"path"}`: the served weights as they are now (HF names, with the
/// model's config and tokenizer files), loadable by `rlserve serve --model` and by
/// transformers; written to `<path>.partial` and renamed. The optimizer state of a job or of
/// the feedback learner is in their own checkpoints.
pub async fn save_checkpoint(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CheckpointRequest>,
) -> Result<Response, ApiError> {
    if req.path.as_os_str().is_empty() {
        return Err(ApiError::bad("`path` must name a folder", Some("path")));
    }
    let (model, src, path) = (state.model.clone(), state.model_dir.clone(), req.path.clone());
    let version = tokio::task::spawn_blocking(move || {
        let m = model.read();
        let opt = learner::optim::AdamW::default();
        learner::checkpoint::save(&path, &src, &m, &opt, json!({})).map(|_| m.version)
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::bad(format!("saving to {}: {e}", req.path.display()), Some("path")))?;
    Ok(axum::Json(json!({"path": req.path, "version": version, "model": state.model_name})).into_response())
}
