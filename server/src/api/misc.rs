//! `/v1/models` (and `/v1/models/{model}`), `/tokenize`, `/detokenize`, `/health`, `/metrics`.

use super::body::ApiJson;
use super::chat::chat_prompt;
use super::error::ApiError;
use super::protocol::{ChatFormat, DetokenizeRequest, TokenizeRequest};
use super::AppState;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde_json::{json, Value};
use std::sync::Arc;

pub async fn models(State(s): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&s)]}))
}

/// `GET /v1/models/{model}` (the OpenAI client's `models.retrieve`): the served model's
/// card, or a 404 naming the served model.
pub async fn model(State(s): State<Arc<AppState>>, Path(model): Path<String>) -> Result<Json<Value>, ApiError> {
    s.check_model(Some(&model))?;
    Ok(Json(model_card(&s)))
}

/// vLLM's model card: `root` is the folder the weights were loaded from, `parent` null (no
/// adapters).
fn model_card(s: &AppState) -> Value {
    json!({
        "id": s.model_name, "object": "model", "created": s.created, "owned_by": "rlserve",
        "root": s.model_dir.display().to_string(), "parent": null, "max_model_len": s.max_model_len,
    })
}

/// `GET /v1/status`: what the web pages show, as JSON (the numbers `/metrics` exposes as
/// Prometheus text): the model and its policy version, the engine's requests, KV-cache
/// usage (fraction of blocks in use) and token counters (prompt tokens computed,
/// generation tokens; a client takes rates from two readings and `time`, Unix seconds),
/// the feedback store's counters (`null` without `--learn-from-feedback`), and whether the
/// RL endpoints need the admin key.
pub async fn status(State(s): State<Arc<AppState>>) -> Json<Value> {
    let engine = engine_json(&s);
    let feedback = s.feedback.as_ref().map(|f| {
        let c = f.counts();
        json!({"accepted": c.accepted, "rejected": c.rejected, "trained": c.trained, "ready": c.ready, "batch_size": f.batch_size()})
    });
    Json(json!({
        "object": "status", "model": s.model_name, "version": s.model.version(), "time": unix_seconds(),
        "engine": engine, "feedback": feedback,
        "admin_key_required": s.admin_key.is_some(), "admin_enabled": s.admin_enabled,
    }))
}

/// The engine's part of [`status`] (`None` when the engine has stopped).
fn engine_json(s: &AppState) -> Option<Value> {
    s.engine.stats().ok().map(|st| {
        json!({
            "num_requests_running": st.num_running, "num_requests_waiting": st.num_waiting,
            "kv_cache_usage": st.kv_cache_usage(), "prompt_tokens_total": st.prefill_tokens,
            "generation_tokens_total": st.generation_tokens, "num_preemptions_total": st.num_preemptions,
        })
    })
}

/// Now, in Unix seconds.
fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The engine's recent past: a `{time, engine}` sample (as in [`status`]) every
/// [`EngineHistory::EVERY`], the last [`EngineHistory::WINDOW`] of them kept, so that the
/// dashboard opens on the last 10 minutes instead of an empty chart.
#[derive(Default)]
pub struct EngineHistory(std::sync::Mutex<std::collections::VecDeque<Value>>);

impl EngineHistory {
    /// Time between samples.
    pub const EVERY: std::time::Duration = std::time::Duration::from_secs(2);
    /// Time kept.
    pub const WINDOW: std::time::Duration = std::time::Duration::from_secs(600);

    /// Takes a sample of `s`'s engine now and drops those older than [`Self::WINDOW`].
    pub fn sample(s: &AppState) {
        let Some(engine) = engine_json(s) else { return };
        let now = unix_seconds();
        let mut h = s.engine_history.0.lock().unwrap_or_else(|e| e.into_inner());
        h.push_back(json!({"time": now, "engine": engine}));
        while h.front().is_some_and(|v| v["time"].as_f64().unwrap_or(0.0) < now - Self::WINDOW.as_secs_f64()) {
            h.pop_front();
        }
    }
}

/// `GET /v1/status/history`: the [`EngineHistory`] samples, oldest first, as
/// `{"object": "list", "data": [{"time", "engine"}, ...]}`.
pub async fn status_history(State(s): State<Arc<AppState>>) -> Json<Value> {
    let h = s.engine_history.0.lock().unwrap_or_else(|e| e.into_inner());
    Json(json!({"object": "list", "data": h.iter().collect::<Vec<_>>()}))
}

pub async fn tokenize(
    State(s): State<Arc<AppState>>,
    ApiJson(req): ApiJson<TokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    s.check_model(req.model.as_deref())?;
    if req.prompt.is_some() {
        let chat_only = [
            ("add_generation_prompt", req.add_generation_prompt.is_some()),
            ("continue_final_message", req.continue_final_message.is_some()),
            ("chat_template_kwargs", req.chat_template_kwargs.is_some()),
            ("tools", req.tools.is_some()),
        ];
        if let Some((k, _)) = chat_only.iter().find(|(_, set)| *set) {
            return Err(ApiError::bad(format!("`{k}` applies to `messages`, not to `prompt`"), Some(k)));
        }
    }
    let tokens = match (&req.prompt, &req.messages) {
        (Some(p), None) => s
            .tokenizer
            .encode(p, req.add_special_tokens.unwrap_or(true))
            .map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))?,
        (None, Some(m)) => {
            let format = ChatFormat {
                add_generation_prompt: req.add_generation_prompt,
                continue_final_message: req.continue_final_message,
                add_special_tokens: req.add_special_tokens,
                chat_template_kwargs: req.chat_template_kwargs.clone(),
                tools: req.tools.clone(),
            };
            super::tools::check_tools(req.tools.as_deref(), "tools")?;
            chat_prompt(&s.tokenizer, m, &format, "")?
        }
        _ => return Err(ApiError::bad("give exactly one of `prompt` or `messages`", Some("prompt"))),
    };
    Ok(Json(json!({"count": tokens.len(), "max_model_len": s.max_model_len, "tokens": tokens})))
}

pub async fn detokenize(
    State(s): State<Arc<AppState>>,
    ApiJson(req): ApiJson<DetokenizeRequest>,
) -> Result<Json<Value>, ApiError> {
    s.check_model(req.model.as_deref())?;
    let vocab = s.tokenizer.vocab_size();
    if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad(
            format!("token id {bad} is out of range: the vocabulary has {vocab} tokens"),
            Some("tokens"),
        ));
    }
    let prompt = s.tokenizer.decode(&req.tokens, false).map_err(|e| ApiError::bad(e.to_string(), Some("tokens")))?;
    Ok(Json(json!({ "prompt": prompt })))
}

/// 200 while the engine thread is alive, 503 otherwise.
pub async fn health(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    if s.engine.is_alive() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// `GET /version` (vLLM's): `{"version": "<rlserve's version>"}`.
pub async fn version() -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")}))
}

pub async fn metrics(State(s): State<Arc<AppState>>) -> impl IntoResponse {
    if let Ok(mut stats) = s.engine.stats() {
        // The weights' version now (the engine's snapshot lags until its next step, e.g.
        // after a checkpoint is loaded at startup).
        stats.version = s.model.version();
        s.metrics.engine(&stats);
    }
    if let Some(fb) = &s.feedback {
        fb.record_metrics();
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render())
}
