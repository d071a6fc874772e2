//! The HTTP API (axum): OpenAI-compatible completions and chat, tokenizer endpoints,
//! health and Prometheus metrics. Handlers reach the engine only through its channels.

pub mod body;
pub mod chat;
pub mod completions;
pub mod cross_site;
pub mod error;
mod generation;
pub mod misc;
pub mod protocol;
pub mod reasoning;
pub mod rl;
pub mod tools;

use crate::metrics::Metrics;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::IntoResponse;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use engine::{EngineHandle, SharedModel, Tokenizer};
use error::ApiError;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Shared state of all handlers.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    pub max_model_len: usize,
    pub api_key: Option<String>,
    /// Requests in flight (queued or running) beyond which new ones get 429.
    pub max_queued_requests: usize,
    pub in_flight: AtomicUsize,
    pub metrics: Metrics,
    /// Unix time the server started (the `created` of `/v1/models`).
    pub created: u64,
    /// The served (and trained) weights, and their folder.
    pub model: SharedModel,
    pub model_dir: PathBuf,
    /// Bearer key of the RL endpoints (rollouts, jobs, feedback).
    pub admin_key: Option<String>,
    /// Whether the RL endpoints are enabled: an admin key is set, or the server listens on
    /// a loopback address only.
    pub admin_enabled: bool,
    /// Root of `POST /v1/checkpoints` (`--checkpoint-dir`); `None`: the endpoint is off.
    pub checkpoint_dir: Option<PathBuf>,
    /// Training jobs started on this server (over HTTP or by `rlserve train`).
    pub jobs: ::rl::Jobs,
    /// What training jobs and the feedback learner run against (this engine and weights,
    /// the learner slot, RL metrics).
    pub rl: ::rl::RlContext,
    /// Ratings and the feedback learner, with `--learn-from-feedback`.
    pub feedback: Option<Arc<::rl::FeedbackStore>>,
    /// Where jobs started over HTTP write (`--jobs-dir`).
    pub jobs_dir: PathBuf,
    /// `--reasoning-parser`: chat answers split into `reasoning_content` and `content`.
    pub reasoning_parser: Option<reasoning::ReasoningParser>,
    /// `--tool-call-parser`: how `tool_choice: "auto"` reads calls out of chat answers.
    pub tool_parser: Option<tools::ToolParser>,
    /// Which hosts and origins may reach the server ([`cross_site`]).
    pub cross_site: cross_site::CrossSite,
    /// Whether the web pages are served (`crate::ui`; `--no-ui` turns them off).
    pub ui: bool,
    /// The Tinker API's sessions, futures and training client (`crate::tinker`).
    pub tinker: crate::tinker::Tinker,
    /// The engine's last 10 minutes, sampled by the server (`GET /v1/status/history`).
    pub engine_history: misc::EngineHistory,
}

/// Counts one request in flight until dropped.
pub struct InFlight(Arc<AppState>);

impl AppState {
    /// Admits a request or answers 429 when `max_queued_requests` are in flight.
    pub fn admit(self: &Arc<Self>) -> Result<InFlight, ApiError> {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst);
        if n >= self.max_queued_requests {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::TooManyRequests(format!(
                "too many requests in flight ({n}, limit --max-queued-requests {}); retry later",
                self.max_queued_requests
            )));
        }
        Ok(InFlight(self.clone()))
    }

    /// 404 unless `model` is absent or the served model name.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.model_name => Err(ApiError::NotFound(format!(
                "The model `{m}` does not exist. This server serves `{}`.",
                self.model_name
            ))),
            _ => Ok(()),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Unix time now, in seconds.
pub fn generation_time() -> u64 {
    generation::unix_now()
}

/// Most sequences (prompts × `n`) one request may ask for (completions, rollouts): a
/// single request cannot bypass `--max-queued-requests` with 100,000 prompts.
pub const MAX_SEQS_PER_REQUEST: usize = 4096;

/// A 400 naming `param` when `prompts × n` exceeds [`MAX_SEQS_PER_REQUEST`].
pub fn check_seqs(prompts: usize, n: usize, param: &str, n_name: &str) -> Result<(), ApiError> {
    if prompts.saturating_mul(n) > MAX_SEQS_PER_REQUEST {
        return Err(ApiError::bad(
            format!(
                "{prompts} prompts × {n_name} {n} = {} sequences; at most {MAX_SEQS_PER_REQUEST} per request",
                prompts.saturating_mul(n)
            ),
            Some(param),
        ));
    }
    Ok(())
}

/// Largest accepted request body.
pub const MAX_BODY_BYTES: usize = 8 << 20;

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(misc::models))
        .route("/v1/models/{*model}", get(misc::model))
        .route("/v1/status", get(misc::status))
        .route("/v1/status/history", get(misc::status_history))
        .route("/tokenize", post(misc::tokenize))
        .route("/detokenize", post(misc::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let admin = Router::new()
        .route("/v1/rollouts", post(rl::rollouts))
        .route("/v1/train/jobs", post(rl::create_job).get(rl::list_jobs))
        .route("/v1/train/jobs/{id}", get(rl::get_job))
        .route("/v1/train/jobs/{id}/stop", post(rl::stop_job))
        .route("/v1/train/jobs/{id}/plot", get(rl::job_plot))
        .route("/v1/feedback", post(rl::feedback))
        .route("/v1/checkpoints", post(rl::save_checkpoint).get(rl::list_checkpoints))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin));
    let pages = if state.ui { crate::ui::router() } else { Router::new() };
    Router::new()
        .merge(v1)
        .merge(admin)
        .merge(crate::tinker::router(state.clone()))
        .merge(pages)
        .route("/health", get(misc::health))
        .route("/version", get(misc::version))
        .route("/metrics", get(misc::metrics))
        .fallback(|req: Request| async move {
            ApiError::NotFound(format!("no route for {} {}", req.method(), req.uri().path()))
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::MethodNotAllowed(format!("{} is not allowed on {}", req.method(), req.uri().path()))
        })
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn(oversized_body))
        .layer(middleware::from_fn_with_state(state.clone(), cross_site::guard))
        .with_state(state)
}

/// Oversized bodies read and discarded before the 413: clients (reqwest, the OpenAI SDKs)
/// send the whole body before reading the answer, so a server that answers early and closes
/// leaves them with a reset connection instead of the error envelope.
const DRAIN_LIMIT_BYTES: usize = 64 << 20;

/// A request whose `Content-Length` exceeds [`MAX_BODY_BYTES`] gets the 413 envelope after
/// its body is drained (up to [`DRAIN_LIMIT_BYTES`]; beyond that the connection is closed).
async fn oversized_body(req: Request, next: Next) -> Response {
    let len =
        req.headers().get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    let Some(len) = len.filter(|&n| n > MAX_BODY_BYTES) else { return next.run(req).await };
    if len <= DRAIN_LIMIT_BYTES {
        let mut body = req.into_body().into_data_stream();
        while let Some(Ok(_)) = futures_util::StreamExt::next(&mut body).await {}
    }
    ApiError::PayloadTooLarge(format!("request body of {len} bytes is larger than the limit of {MAX_BODY_BYTES} bytes"))
        .into_response()
}

/// The key of `Authorization: Bearer <key>`, if any.
fn bearer(req: &Request) -> Option<&str> {
    req.headers().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "))
}

/// Whether `got` is `key`, compared in constant time (`subtle`): the time taken does not
/// tell how many leading bytes of a guess were right (only whether the lengths differ).
pub(crate) fn key_matches(got: Option<&str>, key: Option<&str>) -> bool {
    use subtle::ConstantTimeEq;
    matches!((got, key), (Some(g), Some(k)) if bool::from(g.as_bytes().ct_eq(k.as_bytes())))
}

/// `Authorization: Bearer <key>` when the server has `--api-key`.
async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Result<Response, ApiError> {
    if let Some(key) = &state.api_key {
        let got = bearer(&req);
        // The admin key opens every endpoint.
        if !key_matches(got, Some(key)) && !key_matches(got, state.admin_key.as_deref()) {
            return Err(ApiError::Unauthorized(
                "missing or invalid API key: send `Authorization: Bearer <key>`".into(),
            ));
        }
    }
    Ok(next.run(req).await)
}

/// The RL endpoints: `Authorization: Bearer <admin key>` when `--admin-key` is set; without
/// one they work only on a loopback-only server (403 otherwise).
async fn admin(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Result<Response, ApiError> {
    if !state.admin_enabled {
        return Err(ApiError::Forbidden(
            "the RL endpoints are disabled: the server listens on a non-loopback address without --admin-key".into(),
        ));
    }
    if let Some(key) = &state.admin_key {
        if !key_matches(bearer(&req), Some(key)) {
            return Err(ApiError::Unauthorized(
                "this endpoint needs the admin key: send `Authorization: Bearer <--admin-key>`".into(),
            ));
        }
    }
    Ok(next.run(req).await)
}

#[cfg(test)]
mod tests {
    use super::key_matches;

    #[test]
    fn keys_match_only_when_equal() {
        let cases = [
            (Some("secret"), Some("secret"), true),
            (Some("secreT"), Some("secret"), false),
            (Some("secre"), Some("secret"), false),
            (Some(""), Some(""), true),
            (None, Some("secret"), false),
            (Some("secret"), None, false),
            (None, None, false),
        ];
        for (got, key, want) in cases {
            assert_eq!(key_matches(got, key), want, "{got:?} vs {key:?}");
        }
    }
}
