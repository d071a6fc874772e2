//! The RL endpoints (admin only, see [`super::admin`]): `POST /v1/rollouts`, training jobs
//! (`POST /v1/train/jobs`, `GET /v1/train/jobs[/{id}]`, `POST /v1/train/jobs/{id}/stop`,
//! `GET /v1/train/jobs/{id}/plot`), `POST /v1/feedback` and `POST /v1/checkpoints`.

use super::body::{check_messages, fields, object, only, strict, typed, ApiJson, Body};
use super::chat::chat_prompt;
use super::error::ApiError;
use super::generation::{response_id, sampling_params};
use super::protocol::{ChatFormat, ChatMessageIn, SamplingFields};
use super::AppState;
use ::rl::rollout::RolloutSet;
use ::rl::{FeedbackRequest, Job, JobConfig};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use learner::checkpoint::MARKER;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// One prompt of a rollout request: text, token ids, or chat messages with optional tool
/// definitions for the template (as chat's `tools`; the rollouts are raw text and ids, no
/// call is parsed out of them).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string, a list of token ids or {\"messages\": [...], \"tools\": [...]}")]
pub enum RolloutPrompt {
    Text(String),
    Tokens(Vec<u32>),
    Chat { messages: Vec<ChatMessageIn>, tools: Option<Vec<Value>> },
}

/// `POST /v1/rollouts`.
#[derive(Debug, Clone, Deserialize)]
pub struct RolloutRequest {
    /// The served model's name, if given.
    pub model: Option<String>,
    /// The prompts; each is sampled `num_generations` times.
    pub prompts: Vec<RolloutPrompt>,
    /// Samples per prompt (a GRPO group); `n` is accepted as an alias.
    pub num_generations: Option<usize>,
    /// Most tokens per rollout (default 16).
    pub max_tokens: Option<usize>,
    /// Wrap text prompts as a user message in the chat template.
    pub apply_chat_template: Option<bool>,
    /// The shared sampling fields.
    #[serde(skip)]
    pub sampling: SamplingFields,
}

impl Body for RolloutRequest {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        let mut obj = object(v, "the request body")?;
        only(&obj, &[fields::<Self>(), fields::<SamplingFields>()], "")?;
        if let Some(Value::Array(ps)) = obj.get_mut("prompts") {
            for (i, p) in ps.iter_mut().enumerate() {
                let Value::Object(po) = p else { continue };
                po.retain(|_, v| !v.is_null());
                only(po, &[&["messages", "tools"]], &format!("prompts[{i}]."))?;
                if let Some(m) = po.get_mut("messages") {
                    check_messages(m, &format!("prompts[{i}].messages"))?;
                }
            }
        }
        let mut req: Self = typed(&obj)?;
        req.sampling = typed(&obj)?;
        Ok(req)
    }
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
    if req.sampling.stream() {
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
                RolloutPrompt::Chat { messages, tools } => {
                    super::tools::check_tools(tools.as_deref(), &format!("prompts[{i}].tools"))?;
                    let format = ChatFormat { tools: tools.clone(), ..Default::default() };
                    chat_prompt(tok, messages, &format, &format!("prompts[{i}]."))?
                }
                RolloutPrompt::Text(t) if req.apply_chat_template == Some(true) => {
                    let msgs = [ChatMessageIn {
                        role: "user".into(),
                        content: Some(super::protocol::Content::Text(t.clone())),
                        name: None,
                        tool_calls: None,
                        tool_call_id: None,
                        reasoning_content: None,
                    }];
                    chat_prompt(tok, &msgs, &ChatFormat::default(), &format!("prompts[{i}]."))?
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
        return Err(ApiError::bad(
            format!("`num_generations` must be in [1, {max}], got {g}"),
            Some("num_generations"),
        ));
    }
    if let (Some(g), Some(n)) = (req.num_generations, fields.n) {
        if g != n {
            return Err(ApiError::bad(
                format!("`num_generations` ({g}) and `n` ({n}) name the same count: give one of them"),
                Some("num_generations"),
            ));
        }
    }
    fields.n = req.num_generations.or(fields.n);
    // As completions: 16 tokens unless `max_tokens` says otherwise.
    let max_tokens = req.max_tokens.unwrap_or(super::completions::DEFAULT_MAX_TOKENS);
    let params = sampling_params(&fields, Some(max_tokens), None)?;
    params.validate()?;
    super::check_seqs(prompts.len(), params.n, "prompts", "num_generations")?;
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
    let given_dir = body.get("output_dir").is_some_and(|v| !v.is_null());
    let mut cfg = JobConfig::from_json(body)?;
    let id = format!("job-{:016x}", rand::random::<u64>());
    // A job from HTTP writes only under --jobs-dir (its id's folder unless `output_dir`
    // names one there), and resumes only from there; checked before anything touches disk.
    let root = &state.jobs_dir;
    cfg.output_dir =
        if given_dir { confined(root, &cfg.output_dir, "output_dir", "--jobs-dir")? } else { root.join(&id) };
    if let Some(r) = cfg.resume_from_checkpoint.as_mut().filter(|r| *r != "latest") {
        let p = confined(root, std::path::Path::new(r.as_str()), "resume_from_checkpoint", "--jobs-dir")?;
        *r = p.to_string_lossy().into_owned();
    }
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
    let feedback = state.feedback.as_ref().map(|f| f.status());
    let jobs: Vec<Value> = state
        .jobs
        .statuses()
        .into_iter()
        .chain(feedback)
        .map(
            |s| json!({"id": s.id, "status": s.status, "step": s.step, "max_steps": s.max_steps, "version": s.version}),
        )
        .collect();
    axum::Json(json!({"object": "list", "data": jobs}))
}

/// `GET /v1/train/jobs/{id}`: the job's status with its step and eval history (`feedback`:
/// the feedback learner's, with `--learn-from-feedback`).
pub async fn get_job(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    if let (::rl::FEEDBACK_JOB_ID, Some(f)) = (id.as_str(), &state.feedback) {
        return Ok(axum::Json(f.status()).into_response());
    }
    Ok(axum::Json(state.jobs.get(&id)?.status()).into_response())
}

/// `POST /v1/train/jobs/{id}/stop`: stop after the current step (a checkpoint is saved).
pub async fn stop_job(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    feedback_is_not_a_job(&state, &id, "stopped: it runs while the server runs")?;
    let job = state.jobs.get(&id)?;
    job.request_stop();
    Ok(axum::Json(job.status()).into_response())
}

/// The job's `metrics.png`, redrawn from its history now.
pub async fn job_plot(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    feedback_is_not_a_job(&state, &id, "plotted here: it keeps no metrics.jsonl (the dashboard charts it)")?;
    let job = state.jobs.get(&id)?;
    let bytes =
        tokio::task::spawn_blocking(move || job.plot()).await.map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok(([(header::CONTENT_TYPE, "image/png")], bytes).into_response())
}

/// A 400 for `/stop` and `/plot` on the feedback learner's id (listed with the jobs, but not
/// one): the learner cannot be `what`.
fn feedback_is_not_a_job(state: &AppState, id: &str, what: &str) -> Result<(), ApiError> {
    match (id, &state.feedback) {
        (::rl::FEEDBACK_JOB_ID, Some(_)) => {
            Err(ApiError::bad(format!("`{id}` is the feedback learner, not a training job; it cannot be {what}"), None))
        }
        _ => Ok(()),
    }
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

/// `POST /v1/checkpoints`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRequest {
    /// Folder to write, relative to `--checkpoint-dir` (created; an rlserve checkpoint
    /// already there is replaced atomically, anything else is refused).
    pub path: std::path::PathBuf,
}

impl Body for CheckpointRequest {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        strict(v)
    }
}

/// `root` joined with `path` when `path` stays inside it: relative, only plain folder names
/// (no `..`, `.`, root or drive), and no symbolic link among the parts that exist leads out
/// of `root`. Touches nothing on disk. A 400 naming `key` and the `flag` that sets `root`
/// otherwise.
fn confined(
    root: &std::path::Path,
    path: &std::path::Path,
    key: &str,
    flag: &str,
) -> Result<std::path::PathBuf, ApiError> {
    use std::path::Component;
    let bad = |why: &str| {
        ApiError::bad(
            format!("`{key}` must be a folder name relative to {flag} {}; {:?} {why}", root.display(), path),
            Some(key),
        )
    };
    if path.as_os_str().is_empty() {
        return Err(bad("is empty"));
    }
    if !path.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(bad("leaves it (absolute, or with `..` or `.`)"));
    }
    let target = root.join(path);
    if std::fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(bad("is a symbolic link"));
    }
    // The deepest part that exists must resolve inside the (resolved) root.
    if let Ok(root_c) = root.canonicalize() {
        let existing = target.ancestors().find(|p| p.exists()).unwrap_or(root);
        let inside = existing.canonicalize().is_ok_and(|p| p.starts_with(&root_c));
        if !inside {
            return Err(bad("leads out of it through a symbolic link"));
        }
    }
    Ok(target)
}

/// The folder `POST /v1/checkpoints` writes ([`confined`] under `--checkpoint-dir`), its
/// parent created.
fn checkpoint_target(root: &std::path::Path, path: &std::path::Path) -> Result<std::path::PathBuf, ApiError> {
    let target = confined(root, path, "path", "--checkpoint-dir")?;
    // Not inside another checkpoint (it would then hold a folder rlserve does not write there).
    if let Some(outer) = target.ancestors().skip(1).take_while(|a| *a != root).find(|a| a.join(MARKER).exists()) {
        let outer = outer.strip_prefix(root).unwrap_or(outer);
        return Err(ApiError::bad(
            format!("`path` {} is inside the checkpoint {}: choose a path outside it", path.display(), outer.display()),
            Some("path"),
        ));
    }
    let parent = target.parent().unwrap_or(root);
    std::fs::create_dir_all(parent).map_err(|e| ApiError::Internal(format!("creating {}: {e}", parent.display())))?;
    // Checked again now that the folders exist (a link raced in is refused).
    confined(root, path, "path", "--checkpoint-dir")
}

/// Folder levels under `--checkpoint-dir` that `GET /v1/checkpoints` looks through.
const CHECKPOINT_LIST_DEPTH: usize = 4;

/// `GET /v1/checkpoints` (with `--checkpoint-dir`): the rlserve checkpoints under the root
/// (folders holding its marker, up to [`CHECKPOINT_LIST_DEPTH`] levels down, symbolic links
/// not followed, unfinished `.partial` and `.old` folders left out), by path: each with its
/// policy version, optimizer step and `created` (Unix seconds of its `trainer_state.json`).
pub async fn list_checkpoints(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let root = state.checkpoint_dir.clone().ok_or_else(|| {
        ApiError::NotFound("checkpoints over HTTP are off: start the server with --checkpoint-dir DIR".into())
    })?;
    let found = tokio::task::spawn_blocking(move || {
        let mut out = vec![];
        let mut stack = vec![(root.clone(), 0)];
        while let Some((dir, depth)) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for e in entries.flatten() {
                let (path, name) = (e.path(), e.file_name().to_string_lossy().into_owned());
                if !e.file_type().is_ok_and(|t| t.is_dir()) || name.ends_with(".partial") || name.ends_with(".old") {
                    continue;
                }
                if !path.join(MARKER).exists() {
                    if depth + 1 < CHECKPOINT_LIST_DEPTH {
                        stack.push((path, depth + 1));
                    }
                    continue;
                }
                let Ok(st) = learner::checkpoint::load_state(&path) else { continue };
                let created = std::fs::metadata(path.join("trainer_state.json"))
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_secs());
                let rel = path.strip_prefix(&root).unwrap_or(&path).to_string_lossy().into_owned();
                out.push(json!({"path": rel, "version": st["version"], "step": st["step"], "created": created}));
            }
        }
        out.sort_by(|a, b| a["path"].as_str().cmp(&b["path"].as_str()));
        out
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(axum::Json(json!({"object": "list", "data": found})).into_response())
}

/// `POST /v1/checkpoints {"path"}` (with `--checkpoint-dir`): the served weights as they are
/// now (HF names, with the model's config and tokenizer files), loadable by `rlserve serve
/// --model` and by transformers, written to `<path>.partial` and renamed. Only a checkpoint
/// rlserve wrote is ever replaced; a path outside the root or an existing folder that is not
/// an rlserve checkpoint is a 400 and nothing is touched. The optimizer state of a job or
/// of the feedback learner is in their own checkpoints.
pub async fn save_checkpoint(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CheckpointRequest>,
) -> Result<Response, ApiError> {
    let root = state.checkpoint_dir.clone().ok_or_else(|| {
        ApiError::NotFound("saving checkpoints over HTTP is off: start the server with --checkpoint-dir DIR".into())
    })?;
    let (model, src, path) = (state.model.clone(), state.model_dir.clone(), req.path.clone());
    let saved = tokio::task::spawn_blocking(move || {
        let target = checkpoint_target(&root, &path)?;
        learner::checkpoint::check_replaceable(&target).map_err(|e| ApiError::bad(e.to_string(), Some("path")))?;
        let m = model.read();
        let opt = learner::optim::AdamW::default();
        learner::checkpoint::save(&target, &src, &m, &opt, json!({}))
            .map_err(|e| ApiError::Internal(format!("saving {}: {e}", target.display())))?;
        Ok::<_, ApiError>((target, m.version))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    let (target, version) = saved?;
    Ok(axum::Json(json!({"path": target, "version": version, "model": state.model_name})).into_response())
}
