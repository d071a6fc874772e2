//! The Tinker training API (`/api/v1`, Thinking Machines' protocol as the `tinker` Python SDK
//! 0.38 speaks it): a client's own training loop — `forward_backward`, `optim_step`,
//! `sample`, `save_weights_for_sampler`, `save_state`/`load_state` — on the very weights this
//! server serves, with no weight sync. See README "Tinker API" for what is supported.
//!
//! - Calls that do work answer `{"request_id"}` at once; the client polls
//!   `retrieve_future`, which waits up to [`LONG_POLL`] for the result and otherwise answers
//!   `{"type": "try_again"}` (the SDK re-polls at once). Results are JSON, except
//!   `ForwardBackwardOutput` and `SampleResponse`, which the SDK accepts only as protobuf
//!   ([`proto`]); failures are `{"error", "category": "user" | "server"}`.
//! - One training client at a time (the served model has one optimizer): it holds the
//!   learner slot (jobs and the feedback learner wait) until its session finishes or stops
//!   sending heartbeats for [`SESSION_TIMEOUT`]. Its requests run on one worker thread in
//!   arrival order, which is `seq_id` order (`client/config` turns the SDK's parallel chunk
//!   upload off); a retried `seq_id` gets the first request's future back.
//! - Gradients accumulate over `forward_backward` calls until `optim_step`, which applies
//!   AdamW (`torch.optim.AdamW` semantics, the request's `adam_params`) to the served weights
//!   in place and bumps the policy version. LoRA settings are accepted and ignored: rlserve
//!   trains the full weights.
//! - Sampling clients sample the served weights as they are when the sample runs (a saved
//!   sampler path names them; it is not a frozen copy); each token's logprob is the sampling
//!   distribution's (temperature applied), as the engine's behaviour logprobs.

pub mod proto;

use crate::api::body::{ApiJson, RawBody};
use crate::api::error::ApiError;
use crate::api::AppState;
use axum::extract::{Path, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use learner::algos::tinker::{self as losses, TinkerLoss};
use learner::{Grads, TrainConfig, Trainer};
use prost::Message;
use rl::context::LearnerGuard;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long `retrieve_future` holds a poll open before `try_again` (the SDK's timeout is 45 s).
pub const LONG_POLL: Duration = Duration::from_secs(20);
/// A session without a request or heartbeat for this long is ended: its training client is
/// dropped and the learner slot released (the SDK beats every 10 s).
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(120);
/// Finished results kept for re-polls this long after they were first delivered.
const RESULT_TTL: Duration = Duration::from_secs(600);
/// Futures nobody polled are dropped this long after they were made.
const UNCLAIMED_TTL: Duration = Duration::from_secs(3600);

/// The outcome of a future.
#[derive(Debug, Clone)]
enum Outcome {
    Json(Value),
    Proto(Vec<u8>),
    /// `category` `user` (the request was wrong) or `server`.
    Failed {
        error: String,
        category: &'static str,
    },
}

impl Outcome {
    fn user(e: impl std::fmt::Display) -> Self {
        Outcome::Failed { error: e.to_string(), category: "user" }
    }
    fn server(e: impl std::fmt::Display) -> Self {
        Outcome::Failed { error: e.to_string(), category: "server" }
    }
}

/// A future's result slot.
struct Future {
    tx: watch::Sender<Option<Arc<Outcome>>>,
    created: Instant,
    /// When it was first delivered (pruned [`RESULT_TTL`] later).
    delivered: Mutex<Option<Instant>>,
}

/// Sessions, futures, the training client and the sampling sessions.
#[derive(Default)]
pub struct Tinker {
    next_id: AtomicU64,
    sessions: Mutex<HashMap<String, Session>>,
    futures: Mutex<HashMap<String, Arc<Future>>>,
    trainer: Mutex<Option<TrainingClient>>,
    /// `sampling_session_id` → the model path it was made for (`None`: the base model).
    samplers: Mutex<HashMap<String, Option<String>>>,
    /// Sampler paths saved by `save_weights_for_sampler` → the policy version they named.
    sampler_paths: Mutex<HashMap<String, u64>>,
}

struct Session {
    last_seen: Instant,
    /// This session's training clients that a newer one replaced → that one's id.
    replaced: HashMap<String, String>,
}

/// The one training client: its worker's queue and the seq_ids it has seen. Dropping it
/// closes the queue: the worker finishes what is queued, then releases the learner slot.
struct TrainingClient {
    model_id: String,
    session_id: String,
    tx: flume::Sender<Work>,
    seen: HashMap<i64, String>,
    /// The worker thread; it returns the learner slot's guard when it ends.
    worker: std::thread::JoinHandle<LearnerGuard>,
}

/// How a new worker gets the learner slot.
enum Learner {
    Held(LearnerGuard),
    /// From the session's previous worker, when it ends.
    After(std::thread::JoinHandle<LearnerGuard>),
}

/// One request for the training worker, with the future it completes.
struct Work {
    op: Op,
    future: Arc<Future>,
}

enum Op {
    ForwardBackward(Box<proto::ForwardBackwardRequest>),
    OptimStep(AdamParams),
    SaveWeights {
        name: String,
    },
    LoadWeights {
        path: String,
        optimizer: bool,
    },
    /// `save_weights_for_sampler`: `Some(name)` saves a path, `None` opens a sampling session.
    SaveForSampler {
        name: Option<String>,
        sampler_id: String,
    },
}

/// `optim_step`'s `adam_params` (the SDK's defaults).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
struct AdamParams {
    learning_rate: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    grad_clip_norm: f64,
}

impl Default for AdamParams {
    fn default() -> Self {
        Self { learning_rate: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-12, weight_decay: 0.0, grad_clip_norm: 0.0 }
    }
}

impl Tinker {
    fn new_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.next_id.fetch_add(1, Ordering::SeqCst))
    }

    /// A new pending future: its id and slot.
    fn future(&self) -> (String, Arc<Future>) {
        let id = self.new_id("req");
        let f = Arc::new(Future { tx: watch::channel(None).0, created: Instant::now(), delivered: Mutex::new(None) });
        let mut all = lock(&self.futures);
        all.retain(|_, f| lock(&f.delivered).map_or(f.created.elapsed() < UNCLAIMED_TTL, |t| t.elapsed() < RESULT_TTL));
        all.insert(id.clone(), f.clone());
        (id, f)
    }

    /// A future already done with `outcome`.
    fn done(&self, outcome: Outcome) -> String {
        let (id, f) = self.future();
        f.tx.send_replace(Some(Arc::new(outcome)));
        id
    }

    fn touch(&self, session_id: &str) -> bool {
        match lock(&self.sessions).get_mut(session_id) {
            Some(s) => {
                s.last_seen = Instant::now();
                true
            }
            None => false,
        }
    }

    /// The 404 for a training client `model_id` that is not open, naming the client that
    /// replaced it where a newer one of its session did.
    fn no_client(&self, model_id: &str) -> ApiError {
        let newer = lock(&self.sessions).values().find_map(|s| s.replaced.get(model_id).cloned());
        ApiError::NotFound(match newer {
            Some(newer) => format!(
                "training client `{model_id}` was replaced by `{newer}`, its session's newer training client: rlserve \
                 trains one model (the served one), so a session's new training client replaces the previous one"
            ),
            None => format!("training client `{model_id}` does not exist (create_model first, or its session ended)"),
        })
    }

    /// Ends sessions silent for [`SESSION_TIMEOUT`]; their training client goes with them.
    /// (Locks: `trainer` before `sessions`, as [`submit`].)
    pub fn expire_sessions(&self) {
        lock(&self.sessions).retain(|id, s| {
            let live = s.last_seen.elapsed() < SESSION_TIMEOUT;
            if !live {
                tracing::info!(session = %id, "tinker session expired (no heartbeat)");
            }
            live
        });
        let mut trainer = lock(&self.trainer);
        if trainer.as_ref().is_some_and(|t| !lock(&self.sessions).contains_key(&t.session_id)) {
            *trainer = None; // the worker ends and releases the learner slot
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `/api/v1` routes (behind [`auth`]).
pub fn router(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/api/v1/client/config", post(client_config))
        .route("/api/v1/get_server_capabilities", get(server_capabilities))
        .route("/api/v1/client/dynamic_config", post(|| async { axum::Json(json!({})) }))
        .route("/api/v1/create_session", post(create_session))
        .route("/api/v1/session_heartbeat", post(heartbeat))
        .route("/api/v1/telemetry", post(|| async { axum::Json(json!({"status": "accepted"})) }))
        .route("/api/v1/sessions/{id}/finish", post(finish_session))
        .route("/api/v1/create_model", post(create_model))
        .route("/api/v1/get_info", post(get_info))
        .route("/api/v1/forward_backward", post(forward_backward))
        .route("/api/v1/optim_step", post(optim_step))
        .route("/api/v1/save_weights", post(save_weights))
        .route("/api/v1/load_weights", post(load_weights))
        .route("/api/v1/save_weights_for_sampler", post(save_weights_for_sampler))
        .route("/api/v1/create_sampling_session", post(create_sampling_session))
        .route("/api/v1/samplers/{id}", get(get_sampler))
        .route("/api/v1/asample", post(asample))
        .route("/api/v1/retrieve_future", post(retrieve_future))
        .route("/api/v1/{*rest}", axum::routing::any(unsupported))
        .route_layer(axum::middleware::from_fn_with_state(state, auth))
}

/// The training endpoints' rule (as the RL endpoints: loopback-only without `--admin-key`)
/// with the SDK's header: `X-API-Key: <admin key>` or `tml-<admin key>` (the SDK only sends
/// keys that start with `tml-`).
async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Result<Response, ApiError> {
    if !state.admin_enabled {
        return Err(ApiError::Forbidden(
            "the Tinker API is disabled: the server listens on a non-loopback address without --admin-key".into(),
        ));
    }
    if let Some(key) = &state.admin_key {
        let got = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
        let ok = got.is_some_and(|g| {
            crate::api::key_matches(Some(g), Some(key)) || crate::api::key_matches(g.strip_prefix("tml-"), Some(key))
        });
        if !ok {
            return Err(ApiError::Unauthorized(
                "the Tinker API needs the admin key: X-API-Key: tml-<--admin-key> (TINKER_API_KEY)".into(),
            ));
        }
    }
    Ok(next.run(req).await)
}

/// `GET /api/v1/get_server_capabilities` (`ServiceClient.get_server_capabilities`): the one
/// model this server trains, the one it serves.
async fn server_capabilities(State(state): State<Arc<AppState>>) -> axum::Json<Value> {
    axum::Json(json!({"supported_models": [{"model_name": state.model_name}]}))
}

async fn unsupported(req: Request) -> ApiError {
    ApiError::NotFound(format!(
        "{} {} is not part of rlserve's Tinker API (supported: client/config, client/dynamic_config, \
         get_server_capabilities, create_session, session_heartbeat, telemetry, create_model, get_info, \
         forward_backward, optim_step, save_weights, load_weights, save_weights_for_sampler, \
         create_sampling_session, samplers/{{id}}, asample, retrieve_future, sessions/{{id}}/finish)",
        req.method(),
        req.uri().path()
    ))
}

/// `Value` → `T`, ignoring members `T` does not name (the SDK sends `type`, metadata, ...).
fn parse<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        ApiError::bad(format!("{path}: {}", e.inner()), Some(&path))
    })
}

fn future_reply(request_id: &str) -> Response {
    axum::Json(json!({"request_id": request_id})).into_response()
}

async fn client_config() -> axum::Json<Value> {
    // Plain httpx (not the pyqwest transport), uncompressed and sequential forward_backward
    // chunks (arrival order = seq_id order), no session futures poller, no JWT exchange.
    axum::Json(json!({
        "use_pyqwest_transport": false,
        "proto_compress_fwdbwd": false,
        "parallel_fwdbwd_chunks": false,
        "sample_use_retrieve_futures": false,
        "pjwt_auth_enabled": false,
    }))
}

async fn create_session(State(state): State<Arc<AppState>>) -> axum::Json<Value> {
    let t = &state.tinker;
    t.expire_sessions();
    let id = t.new_id("session");
    lock(&t.sessions).insert(id.clone(), Session { last_seen: Instant::now(), replaced: HashMap::new() });
    axum::Json(json!({"session_id": id, "type": "create_session"}))
}

#[derive(Deserialize)]
struct SessionRef {
    session_id: String,
}

async fn heartbeat(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: SessionRef = parse(v)?;
    if !state.tinker.touch(&r.session_id) {
        return Err(ApiError::Gone(format!("session `{}` has ended", r.session_id)));
    }
    Ok(axum::Json(json!({"type": "session_heartbeat"})).into_response())
}

async fn finish_session(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> axum::Json<Value> {
    let t = &state.tinker;
    lock(&t.sessions).remove(&id);
    let mut trainer = lock(&t.trainer);
    if trainer.as_ref().is_some_and(|c| c.session_id == id) {
        *trainer = None;
    }
    axum::Json(json!({}))
}

#[derive(Deserialize)]
struct CreateModel {
    session_id: String,
    model_seq_id: i64,
    base_model: String,
    #[serde(default)]
    optimizer_config: Option<Value>,
}

/// The served model's folder as an absolute path (what `get_info` names the model by).
fn folder(state: &AppState) -> std::path::PathBuf {
    std::fs::canonicalize(&state.model_dir).unwrap_or_else(|_| state.model_dir.clone())
}

/// Whether `base_model` names the served model (its served name or its folder).
fn is_served(state: &AppState, base_model: &str) -> bool {
    base_model == state.model_name || std::fs::canonicalize(base_model).is_ok_and(|p| p == folder(state))
}

async fn create_model(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: CreateModel = parse(v)?;
    let t = &state.tinker;
    let outcome = match open_training_client(&state, &r.session_id, r.model_seq_id, &r.base_model, &r.optimizer_config)
    {
        Ok(model_id) => Outcome::Json(json!({"model_id": model_id, "type": "create_model"})),
        Err(e) => e,
    };
    Ok(future_reply(&t.done(outcome)))
}

#[derive(Deserialize)]
struct GetInfo {
    model_id: String,
}

/// `get_info`: the model's name and tokenizer are the served model's folder, so the SDK's
/// `get_tokenizer` (`AutoTokenizer.from_pretrained`) loads it offline.
async fn get_info(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: GetInfo = parse(v)?;
    if lock(&state.tinker.trainer).as_ref().is_none_or(|c| c.model_id != r.model_id) {
        return Err(state.tinker.no_client(&r.model_id));
    }
    let folder = folder(&state).to_string_lossy().into_owned();
    let arch = format!("{:?}", state.model.read().config.architecture).to_lowercase();
    Ok(axum::Json(json!({
        "model_id": r.model_id,
        "model_data": {"model_name": folder, "tokenizer_id": folder, "arch": arch},
        "is_lora": false,
        "type": "get_info",
    }))
    .into_response())
}

/// Makes the session's training client `{session}:train:{seq}` and starts its worker.
fn open_training_client(
    state: &Arc<AppState>,
    session_id: &str,
    model_seq_id: i64,
    base_model: &str,
    optimizer: &Option<Value>,
) -> Result<String, Outcome> {
    let t = &state.tinker;
    t.expire_sessions();
    if !t.touch(session_id) {
        return Err(Outcome::user(format!("session `{session_id}` does not exist or has ended")));
    }
    if !is_served(state, base_model) {
        return Err(Outcome::user(format!(
            "base_model `{base_model}`: this server trains the model it serves, `{}` (or its folder {})",
            state.model_name,
            state.model_dir.display()
        )));
    }
    if let Some(kind) =
        optimizer.as_ref().and_then(|o| o.get("type")).and_then(|k| k.as_str()).filter(|&k| k != "adamw")
    {
        return Err(Outcome::user(format!("optimizer_config type `{kind}`: rlserve's optimizer is adamw")));
    }
    let model_id = format!("{session_id}:train:{model_seq_id}");
    let mut slot = lock(&t.trainer);
    // A session's new training client (create_training_client_from_state) replaces its
    // previous one, taking the learner slot when that one's queued work is done.
    let learner = match slot.take() {
        Some(prev) if prev.session_id == session_id => {
            if let Some(s) = lock(&t.sessions).get_mut(session_id).filter(|_| prev.model_id != model_id) {
                s.replaced.insert(prev.model_id.clone(), model_id.clone());
            }
            Learner::After(prev.worker)
        }
        Some(other) => {
            let id = other.model_id.clone();
            *slot = Some(other);
            return Err(Outcome::user(format!(
                "training client `{id}` of another session is open: rlserve trains one model (the served one) at a \
                 time; finish that session first (ServiceClient.close()), or wait: a session with no heartbeat for \
                 {} s ends by itself",
                SESSION_TIMEOUT.as_secs()
            )));
        }
        None => Learner::Held(state.rl.learner.try_acquire().ok_or_else(|| {
            Outcome::user(
                "the learner is busy (a training job or the feedback learner holds it); retry when it is done",
            )
        })?),
    };
    let config = TrainConfig { log_kl_to_initial: false, beta: 0.0, ..Default::default() };
    let trainer = Trainer::new(&state.model.read(), config).map_err(Outcome::server)?;
    let (tx, rx) = flume::unbounded::<Work>();
    let mut worker = Worker { state: state.clone(), model_id: model_id.clone(), trainer, grads: Grads::default() };
    let rl = state.rl.clone();
    let handle = std::thread::Builder::new()
        .name("tinker-trainer".into())
        .spawn(move || {
            let guard = match learner {
                Learner::Held(g) => g,
                // The previous worker hands the slot over when it ends (or left it free).
                Learner::After(prev) => prev.join().unwrap_or_else(|_| rl.learner.acquire(Duration::from_millis(50))),
            };
            while let Ok(w) = rx.recv() {
                let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run(w.op)))
                    .unwrap_or_else(|_| Outcome::server("the training worker panicked"));
                w.future.tx.send_replace(Some(Arc::new(outcome)));
            }
            guard
        })
        .map_err(Outcome::server)?;
    *slot = Some(TrainingClient {
        model_id: model_id.clone(),
        session_id: session_id.into(),
        tx,
        seen: HashMap::new(),
        worker: handle,
    });
    Ok(model_id)
}

/// Queues `op` for the training client `model_id` (request `seq_id`), or returns the future
/// of the first request with that `seq_id` (a retry).
fn submit(state: &AppState, model_id: &str, seq_id: Option<i64>, op: Op) -> Result<String, ApiError> {
    let t = &state.tinker;
    let mut slot = lock(&t.trainer);
    let Some(client) = slot.as_mut().filter(|c| c.model_id == model_id) else {
        return Err(t.no_client(model_id));
    };
    t.touch(&client.session_id);
    if let Some(id) = seq_id.and_then(|s| client.seen.get(&s)) {
        return Ok(id.clone());
    }
    let (id, future) = t.future();
    if client.tx.send(Work { op, future }).is_err() {
        return Err(ApiError::Internal("the training worker has stopped".into()));
    }
    if let Some(s) = seq_id {
        client.seen.insert(s, id.clone());
    }
    Ok(id)
}

/// The training client's state, on its worker thread.
struct Worker {
    state: Arc<AppState>,
    model_id: String,
    trainer: Trainer,
    /// Accumulated since the last `optim_step`.
    grads: Grads,
}

impl Worker {
    fn run(&mut self, op: Op) -> Outcome {
        match op {
            Op::ForwardBackward(req) => self.forward_backward(&req),
            Op::OptimStep(p) => self.optim_step(&p),
            Op::SaveWeights { name } => self.save_weights(&name),
            Op::LoadWeights { path, optimizer } => self.load_weights(&path, optimizer),
            Op::SaveForSampler { name: Some(name), .. } => {
                let path = format!("tinker://{}/sampler_weights/{name}", self.model_id);
                lock(&self.state.tinker.sampler_paths).insert(path.clone(), self.state.model.version());
                Outcome::Json(json!({"path": path, "type": "save_weights_for_sampler"}))
            }
            Op::SaveForSampler { name: None, sampler_id } => {
                lock(&self.state.tinker.samplers).insert(sampler_id.clone(), None);
                Outcome::Json(json!({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}))
            }
        }
    }

    fn forward_backward(&mut self, req: &proto::ForwardBackwardRequest) -> Outcome {
        let (loss, data) = match parse_forward_backward(req, self.state.model.read().config.vocab_size) {
            Ok(x) => x,
            Err(e) => return Outcome::user(e),
        };
        let model = self.state.model.read();
        let grads = (!req.forward_only).then_some(&mut self.grads);
        match losses::forward_backward(&model, &data, &loss, grads) {
            Ok(out) => {
                let metrics = HashMap::from([("loss:sum".to_string(), out.loss)]);
                Outcome::Proto(proto::forward_backward_output(&out.logprobs, metrics).encode_to_vec())
            }
            Err(e @ learner::LearnerError::Batch(_)) => Outcome::user(e),
            Err(e) => Outcome::server(e),
        }
    }

    fn optim_step(&mut self, p: &AdamParams) -> Outcome {
        let mut c = self.trainer.config.clone();
        (c.learning_rate, c.adam_beta1, c.adam_beta2, c.adam_epsilon, c.weight_decay, c.max_grad_norm) =
            (p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm);
        c.lr_scheduler_type = learner::optim::Schedule::Constant;
        // Checked before anything changes: the accumulated gradients stay for a retry.
        if let Err((key, msg)) = c.validate() {
            let sdk = match key {
                "adam_beta1" => "beta1",
                "adam_beta2" => "beta2",
                "adam_epsilon" => "eps",
                "max_grad_norm" => "grad_clip_norm",
                k => k,
            };
            return Outcome::user(msg.replacen(&format!("`{key}`"), &format!("`adam_params.{sdk}`"), 1));
        }
        self.trainer.config = c;
        let grads = std::mem::take(&mut self.grads);
        if let Err(e) = self.state.rl.record_version(self.state.model.version() + 1) {
            self.grads = grads;
            return Outcome::server(e);
        }
        match self.trainer.update(&self.state.model, &grads) {
            Ok(u) => Outcome::Json(json!({"metrics": {
                "grad_norm:mean": u.grad_norm,
                "learning_rate:mean": u.lr,
                "policy_version:max": u.version,
                "pause_seconds:sum": u.pause_seconds,
            }})),
            // A retry would meet the same gradients: they are dropped.
            Err(e @ learner::LearnerError::NonFiniteGradient { .. }) => {
                Outcome::user(format!("{e}; the accumulated gradients were dropped"))
            }
            Err(e) => Outcome::server(e),
        }
    }

    /// `tinker://{model_id}/weights/{name}` ↔ `<--checkpoint-dir>/tinker/{name}`.
    fn state_dir(&self, name: &str) -> Result<std::path::PathBuf, Outcome> {
        let root = self.state.checkpoint_dir.as_ref().ok_or_else(|| {
            Outcome::user("save_state/load_state write checkpoints: start the server with --checkpoint-dir DIR")
        })?;
        if name.is_empty()
            || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            || name.starts_with('.')
        {
            return Err(Outcome::user(format!(
                "checkpoint name `{name}`: use letters, digits, `-`, `_` and `.` (not first)"
            )));
        }
        Ok(root.join("tinker").join(name))
    }

    fn save_weights(&mut self, name: &str) -> Outcome {
        let dir = match self.state_dir(name) {
            Ok(d) => d,
            Err(e) => return e,
        };
        let model = self.state.model.read();
        let saved =
            std::fs::create_dir_all(dir.parent().expect("root/tinker")).map_err(|e| e.to_string()).and_then(|_| {
                learner::checkpoint::check_replaceable(&dir).map_err(|e| e.to_string())?;
                learner::checkpoint::save_trainer(&dir, &self.state.model_dir, &model, &self.trainer, json!({}))
                    .map_err(|e| e.to_string())
            });
        match saved {
            Ok(()) => Outcome::Json(
                json!({"path": format!("tinker://{}/weights/{name}", self.model_id), "type": "save_weights"}),
            ),
            Err(e) => Outcome::server(format!("saving {}: {e}", dir.display())),
        }
    }

    fn load_weights(&mut self, path: &str, optimizer: bool) -> Outcome {
        let Some(name) = path.strip_prefix("tinker://").and_then(|p| p.split_once("/weights/")).map(|(_, n)| n) else {
            return Outcome::user(format!(
                "path `{path}`: expected tinker://<model_id>/weights/<name> from save_state"
            ));
        };
        let dir = match self.state_dir(name) {
            Ok(d) => d,
            Err(e) => return e,
        };
        if !dir.is_dir() {
            return Outcome::user(format!("`{path}`: no checkpoint named `{name}` (save_state writes them)"));
        }
        let version = self.state.model.version() + 1;
        if let Err(e) = self.state.rl.record_version(version) {
            return Outcome::server(e);
        }
        if let Err(e) = rl::learner_loop::load_weights(&self.state.model, &dir, version) {
            return Outcome::user(format!("loading {path}: {e}"));
        }
        if optimizer {
            match learner::checkpoint::load_optimizer(&dir, self.state.model.read().device()) {
                Ok(opt) => self.trainer.optimizer = opt,
                Err(e) => return Outcome::user(format!("loading the optimizer state of {path}: {e}")),
            }
        }
        self.grads = Grads::default();
        Outcome::Json(json!({"path": path, "model_id": self.model_id, "type": "load_weights"}))
    }
}

/// The loss and the data of a `ForwardBackwardRequest` (token ids below `vocab`).
fn parse_forward_backward(
    req: &proto::ForwardBackwardRequest,
    vocab: usize,
) -> Result<(TinkerLoss, Vec<losses::Datum>), String> {
    // The SDK writes each number into both maps, and strings only into v2.
    let mut config: BTreeMap<String, f64> = req.loss_fn_config.iter().map(|(k, v)| (k.clone(), *v)).collect();
    for (k, v) in &req.loss_fn_config_v2 {
        match &v.value {
            Some(proto::loss_config_value::Value::Number(x)) => {
                config.insert(k.clone(), *x);
            }
            Some(proto::loss_config_value::Value::Text(s)) => {
                return Err(format!("loss_fn_config `{k}` = \"{s}\": rlserve's losses take numbers only"))
            }
            None => {}
        }
    }
    let loss = TinkerLoss::new(&req.loss_fn, &config)?;
    let data = req
        .data
        .iter()
        .enumerate()
        .map(|(i, d)| parse_datum(d, &loss, vocab).map_err(|e| format!("datum {i}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((loss, data))
}

fn parse_datum(d: &proto::Datum, loss: &TinkerLoss, vocab: usize) -> Result<losses::Datum, String> {
    let mut model_input = Vec::new();
    for c in &d.model_input {
        match &c.chunk {
            Some(proto::chunk::Chunk::EncodedText(t)) => model_input.extend(int32_tokens(&t.tokens, vocab)?),
            Some(proto::chunk::Chunk::Image(_)) => return Err("image chunks: rlserve's models read text only".into()),
            Some(proto::chunk::Chunk::Dmel(_)) => return Err("dmel chunks: rlserve's models read text only".into()),
            None => return Err("an empty model_input chunk".into()),
        }
    }
    let keys = loss.input_keys();
    if let Some(k) = d.loss_fn_inputs.keys().find(|k| *k != "target_tokens" && !keys.contains(&k.as_str())) {
        return Err(format!(
            "loss_fn_inputs `{k}` is not read by this loss (it reads target_tokens, {})",
            keys.join(", ")
        ));
    }
    let get =
        |k: &str| d.loss_fn_inputs.get(k).map(|t| tensor_values(t).map_err(|e| format!("loss_fn_inputs `{k}`: {e}")));
    let target_tokens = match get("target_tokens") {
        Some(v) => v?
            .into_iter()
            .map(|x| if x >= 0.0 && (x as usize) < vocab && x.fract() == 0.0 { Ok(x as u32) } else { Err(x) })
            .collect::<Result<Vec<u32>, f64>>()
            .map_err(|x| {
                format!("loss_fn_inputs `target_tokens`: {x} is not a token id below the vocabulary size {vocab}")
            })?,
        None => return Err("loss_fn_inputs needs `target_tokens`".into()),
    };
    // A NaN or infinite input would make the gradient non-finite (and `optim_step` refuse it).
    let floats = |k: &str| -> Result<Option<Vec<f32>>, String> {
        let Some(v) = get(k).transpose()? else { return Ok(None) };
        let v: Vec<f32> = v.into_iter().map(|x| x as f32).collect();
        match v.iter().position(|x| !x.is_finite()) {
            Some(i) => Err(format!("loss_fn_inputs `{k}`: value {} at position {i} is not a finite number", v[i])),
            None => Ok(Some(v)),
        }
    };
    Ok(losses::Datum {
        model_input,
        target_tokens,
        weights: floats("weights")?,
        sampler_logprobs: floats("logprobs")?,
        advantages: floats("advantages")?,
    })
}

/// int32 little-endian token ids, each below `vocab`.
fn int32_tokens(bytes: &[u8], vocab: usize) -> Result<Vec<u32>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!("encoded_text tokens: {} bytes is not a whole number of int32 ids", bytes.len()));
    }
    bytes
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .map(|t| {
            if t >= 0 && (t as usize) < vocab {
                Ok(t as u32)
            } else {
                Err(format!("token id {t} is not below the vocabulary size {vocab}"))
            }
        })
        .collect()
}

/// A `Tensor`'s values in C order (float32 or int64, dense or 2-D CSR).
fn tensor_values(t: &proto::Tensor) -> Result<Vec<f64>, String> {
    let width = match proto::DType::try_from(t.dtype) {
        Ok(proto::DType::Float32) | Ok(proto::DType::Int32) => 4,
        Ok(proto::DType::Int64) => 8,
        _ => return Err(format!("dtype {} (expected float32 or int64)", t.dtype)),
    };
    let decode = |bytes: &[u8]| -> Result<Vec<f64>, String> {
        if !bytes.len().is_multiple_of(width) {
            return Err(format!("{} bytes is not a whole number of values", bytes.len()));
        }
        Ok(bytes
            .chunks_exact(width)
            .map(|b| match proto::DType::try_from(t.dtype) {
                Ok(proto::DType::Float32) => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                Ok(proto::DType::Int32) => i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
                _ => i64::from_le_bytes(b.try_into().expect("8 bytes")) as f64,
            })
            .collect())
    };
    let numel = t.shape.iter().product::<i64>().max(0) as usize;
    match &t.encoding {
        Some(proto::tensor::Encoding::Dense(bytes)) => {
            let v = decode(bytes)?;
            if !t.shape.is_empty() && v.len() != numel {
                return Err(format!("{} values for shape {:?}", v.len(), t.shape));
            }
            Ok(v)
        }
        Some(proto::tensor::Encoding::SparseCsr(csr)) => {
            let (&[rows, cols], values) = (t.shape.as_slice(), decode(&csr.values)?) else {
                return Err(format!("a sparse tensor must be 2-D, not shape {:?}", t.shape));
            };
            let ints = |b: &[u8]| -> Vec<i64> {
                b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect()
            };
            let (crow, col) = (ints(&csr.crow_indices), ints(&csr.col_indices));
            let mut out = vec![0.0; numel];
            if crow.len() != rows as usize + 1 || col.len() != values.len() {
                return Err("inconsistent sparse_csr indices".into());
            }
            for r in 0..rows as usize {
                for k in crow[r].max(0) as usize..(crow[r + 1].max(0) as usize).min(values.len()) {
                    let c = col[k];
                    if c < 0 || c >= cols {
                        return Err(format!("sparse_csr column {c} outside {cols}"));
                    }
                    out[r * cols as usize + c as usize] = values[k];
                }
            }
            Ok(out)
        }
        None => Err("no values".into()),
    }
}

async fn forward_backward(State(state): State<Arc<AppState>>, body: RawBody) -> Result<Response, ApiError> {
    let req = proto::ForwardBackwardRequest::decode(body.0.as_slice())
        .map_err(|e| ApiError::bad(format!("the body is not a protobuf ForwardBackwardRequest: {e}"), None))?;
    let (model_id, seq_id) = (req.model_id.clone(), req.seq_id as i64);
    let id = submit(&state, &model_id, Some(seq_id), Op::ForwardBackward(Box::new(req)))?;
    Ok(future_reply(&id))
}

/// The JSON body of a training client's calls (`optim_step`, `save_weights`,
/// `load_weights`, `save_weights_for_sampler`); each reads its own fields.
#[derive(Deserialize)]
struct ModelRequest {
    /// Absent only for `load_weights` from `create_training_client_from_state`.
    #[serde(default)]
    model_id: Option<String>,
    #[serde(default)]
    seq_id: Option<i64>,
    #[serde(default)]
    adam_params: Option<AdamParams>,
    #[serde(default)]
    optimizer_params: Option<Value>,
    #[serde(default)]
    path: Option<String>,
    /// `load_weights`: also the AdamW moments.
    #[serde(default)]
    optimizer: bool,
    /// `create_training_client_from_state`: the session and its model counter.
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    model_seq_id: Option<i64>,
}

impl ModelRequest {
    fn model_id(&self) -> Result<&str, ApiError> {
        self.model_id.as_deref().ok_or_else(|| ApiError::bad("`model_id` is required", Some("model_id")))
    }

    fn path(&self, call: &str) -> Result<String, ApiError> {
        self.path.clone().ok_or_else(|| ApiError::bad(format!("{call} needs `path`"), Some("path")))
    }
}

async fn optim_step(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: ModelRequest = parse(v)?;
    if r.optimizer_params.is_some() {
        return Err(ApiError::bad(
            "optimizer_params: rlserve's optimizer is AdamW (send adam_params)",
            Some("optimizer_params"),
        ));
    }
    let op = Op::OptimStep(r.adam_params.clone().unwrap_or_default());
    Ok(future_reply(&submit(&state, r.model_id()?, r.seq_id, op)?))
}

async fn save_weights(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: ModelRequest = parse(v)?;
    let op = Op::SaveWeights { name: r.path("save_weights")? };
    Ok(future_reply(&submit(&state, r.model_id()?, r.seq_id, op)?))
}

async fn load_weights(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: ModelRequest = parse(v)?;
    let op = Op::LoadWeights { path: r.path("load_weights")?, optimizer: r.optimizer };
    let model_id = match (&r.model_id, &r.session_id) {
        (Some(m), _) => m.clone(),
        (None, Some(session)) => {
            let base = state.model_name.clone();
            match open_training_client(&state, session, r.model_seq_id.unwrap_or(0), &base, &None) {
                Ok(m) => m,
                Err(e) => return Ok(future_reply(&state.tinker.done(e))),
            }
        }
        (None, None) => return Err(ApiError::bad("load_weights needs `model_id` (or `session_id`)", Some("model_id"))),
    };
    Ok(future_reply(&submit(&state, &model_id, r.seq_id, op)?))
}

async fn save_weights_for_sampler(
    State(state): State<Arc<AppState>>,
    ApiJson(v): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let r: ModelRequest = parse(v)?;
    let op = Op::SaveForSampler { name: r.path.clone(), sampler_id: state.tinker.new_id("sampler") };
    Ok(future_reply(&submit(&state, r.model_id()?, r.seq_id, op)?))
}

#[derive(Deserialize)]
struct CreateSampler {
    session_id: String,
    #[serde(default)]
    model_path: Option<String>,
    #[serde(default)]
    base_model: Option<String>,
}

async fn create_sampling_session(
    State(state): State<Arc<AppState>>,
    ApiJson(v): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let r: CreateSampler = parse(v)?;
    let t = &state.tinker;
    if !t.touch(&r.session_id) {
        return Err(ApiError::NotFound(format!("session `{}` does not exist or has ended", r.session_id)));
    }
    if let Some(p) = &r.model_path {
        if !lock(&t.sampler_paths).contains_key(p) {
            return Err(ApiError::NotFound(format!(
                "model_path `{p}` was not saved by save_weights_for_sampler on this server"
            )));
        }
    }
    if let Some(b) = r.base_model.as_deref().filter(|b| !is_served(&state, b)) {
        return Err(ApiError::NotFound(format!("base_model `{b}`: this server samples `{}`", state.model_name)));
    }
    let id = t.new_id("sampler");
    lock(&t.samplers).insert(id.clone(), r.model_path);
    Ok(axum::Json(json!({"sampling_session_id": id, "type": "create_sampling_session"})).into_response())
}

async fn get_sampler(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Response, ApiError> {
    let path = lock(&state.tinker.samplers)
        .get(&id)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("sampling session `{id}` does not exist")))?;
    Ok(axum::Json(json!({"sampler_id": id, "base_model": state.model_name, "model_path": path})).into_response())
}

#[derive(Deserialize)]
struct SampleRequest {
    num_samples: usize,
    prompt: ModelInput,
    sampling_params: TinkerSamplingParams,
    #[serde(default)]
    sampling_session_id: Option<String>,
    #[serde(default)]
    base_model: Option<String>,
    #[serde(default)]
    model_path: Option<String>,
    #[serde(default)]
    prompt_logprobs: bool,
    #[serde(default)]
    topk_prompt_logprobs: usize,
    #[serde(default)]
    topk_sample_logprobs: usize,
}

#[derive(Deserialize)]
struct ModelInput {
    chunks: Vec<Value>,
}

#[derive(Deserialize)]
struct TinkerSamplingParams {
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default = "one")]
    temperature: f32,
    #[serde(default = "minus_one")]
    top_k: i32,
    #[serde(default = "one")]
    top_p: f32,
}

fn one() -> f32 {
    1.0
}
fn minus_one() -> i32 {
    -1
}

/// The engine request of an `asample` body: prompt ids and sampling parameters.
fn sample_request(state: &AppState, r: &SampleRequest) -> Result<(Vec<u32>, engine::SamplingParams), ApiError> {
    let vocab = state.model.read().config.vocab_size;
    let mut prompt = Vec::new();
    for (i, c) in r.prompt.chunks.iter().enumerate() {
        let param = format!("prompt.chunks[{i}]");
        match c.get("type").and_then(|t| t.as_str()).unwrap_or("encoded_text") {
            "encoded_text" => {
                let ids: Vec<i64> = parse(c.get("tokens").cloned().unwrap_or(Value::Null))
                    .map_err(|e| ApiError::bad(format!("{param}.tokens: {e}"), Some(&param)))?;
                for t in ids {
                    if t < 0 || t as usize >= vocab {
                        return Err(ApiError::bad(
                            format!("{param}: token id {t} is not below the vocabulary size {vocab}"),
                            Some(&param),
                        ));
                    }
                    prompt.push(t as u32);
                }
            }
            other => {
                return Err(ApiError::bad(
                    format!("{param}: `{other}` chunks: rlserve's models read text only"),
                    Some(&param),
                ))
            }
        }
    }
    if r.topk_prompt_logprobs > 0 || r.topk_sample_logprobs > 0 {
        return Err(ApiError::bad(
            "topk_prompt_logprobs / topk_sample_logprobs are not supported (each sampled token's logprob is returned)",
            Some("topk_sample_logprobs"),
        ));
    }
    let p = &r.sampling_params;
    let (mut stop, mut stop_token_ids, mut ignore_eos) = (vec![], vec![], false);
    match &p.stop {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => stop.push(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => ignore_eos = true, // [] disables every stop, EOS included
        Some(Value::Array(a)) if a.iter().all(|x| x.is_string()) => {
            stop = a.iter().filter_map(|x| x.as_str().map(String::from)).collect()
        }
        Some(Value::Array(a)) if a.iter().all(|x| x.as_u64().is_some_and(|t| (t as usize) < vocab)) => {
            stop_token_ids = a.iter().filter_map(|x| x.as_u64().map(|t| t as u32)).collect();
            ignore_eos = true; // explicit stop tokens replace the implicit EOS
        }
        Some(other) => {
            return Err(ApiError::bad(
                format!("sampling_params.stop {other}: a string, a list of strings or a list of token ids"),
                Some("sampling_params.stop"),
            ))
        }
    }
    let params = engine::SamplingParams {
        n: r.num_samples,
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k,
        seed: p.seed,
        max_tokens: p.max_tokens,
        stop,
        stop_token_ids,
        ignore_eos,
        prompt_logprobs: r.prompt_logprobs.then_some(0),
        ..Default::default()
    };
    params.validate().and_then(|_| params.validate_ids(vocab)).map_err(ApiError::from)?;
    Ok((prompt, params))
}

async fn asample(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: SampleRequest = parse(v)?;
    let t = &state.tinker;
    match (&r.sampling_session_id, &r.base_model, &r.model_path) {
        (Some(s), ..) if !lock(&t.samplers).contains_key(s) => {
            return Err(ApiError::NotFound(format!("sampling session `{s}` does not exist")))
        }
        (None, Some(b), _) if !is_served(&state, b) => {
            return Err(ApiError::NotFound(format!("base_model `{b}`: this server samples `{}`", state.model_name)))
        }
        (None, None, Some(p)) if !lock(&t.sampler_paths).contains_key(p) => {
            return Err(ApiError::NotFound(format!("model_path `{p}` was not saved by save_weights_for_sampler")))
        }
        (None, None, None) => {
            return Err(ApiError::bad(
                "asample needs sampling_session_id, base_model or model_path",
                Some("sampling_session_id"),
            ))
        }
        _ => {}
    }
    if r.num_samples == 0 || r.num_samples > crate::api::MAX_SEQS_PER_REQUEST {
        return Err(ApiError::bad(
            format!("num_samples {} must be 1 to {}", r.num_samples, crate::api::MAX_SEQS_PER_REQUEST),
            Some("num_samples"),
        ));
    }
    let (prompt, params) = sample_request(&state, &r)?;
    let admit = state.admit()?;
    let stream = state.engine.add_request(prompt.clone(), params).map_err(ApiError::from)?;
    let (id, future) = t.future();
    let seq_ids: Vec<String> = (0..r.num_samples).map(|i| format!("{id}-{i}")).collect();
    let n = r.num_samples;
    tokio::spawn(async move {
        let _admit = admit;
        let outcome = match rl::rollout::RolloutSet::new(&[prompt], n).collect(vec![stream]).await {
            Ok(rollouts) => Outcome::Proto(sample_response(&rollouts).encode_to_vec()),
            Err(e) => Outcome::server(e),
        };
        future.tx.send_replace(Some(Arc::new(outcome)));
    });
    Ok(axum::Json(json!({"request_id": id, "sample_sequence_ids": seq_ids})).into_response())
}

/// The `SampleResponse` of one prompt's samples.
fn sample_response(rollouts: &[rl::rollout::Rollout]) -> proto::SampleResponse {
    let sequences = rollouts
        .iter()
        .map(|r| proto::SampledSequence {
            stop_reason: match r.finish_reason {
                Some(engine::FinishReason::Length) => proto::StopReason::Length,
                _ => proto::StopReason::Stop,
            } as i32,
            tokens: proto::token_bytes(&r.completion_ids),
            logprobs: Some(proto::f32_bytes(&r.behavior_logprobs)),
        })
        .collect();
    let prompt_logprobs = rollouts
        .first()
        .and_then(|r| r.prompt_logprobs.as_ref())
        .map(|p| proto::f32_bytes(&p.iter().map(|x| x.unwrap_or(f32::NAN)).collect::<Vec<_>>()));
    proto::SampleResponse { sequences, prompt_logprobs, prompt_cache_hit_tokens: 0 }
}

#[derive(Deserialize)]
struct RetrieveFuture {
    request_id: String,
}

async fn retrieve_future(State(state): State<Arc<AppState>>, ApiJson(v): ApiJson<Value>) -> Result<Response, ApiError> {
    let r: RetrieveFuture = parse(v)?;
    let future = lock(&state.tinker.futures)
        .get(&r.request_id)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("future `{}` does not exist (or expired)", r.request_id)))?;
    let mut rx = future.tx.subscribe();
    let outcome = match tokio::time::timeout(LONG_POLL, rx.wait_for(|o| o.is_some())).await {
        Ok(Ok(o)) => o.clone().expect("waited for Some"),
        _ => {
            return Ok(axum::Json(json!({"type": "try_again", "request_id": r.request_id, "queue_state": "active"}))
                .into_response())
        }
    };
    lock(&future.delivered).get_or_insert_with(Instant::now);
    Ok(match &*outcome {
        Outcome::Json(v) => axum::Json(v.clone()).into_response(),
        Outcome::Proto(bytes) => ([(header::CONTENT_TYPE, "application/x-protobuf")], bytes.clone()).into_response(),
        Outcome::Failed { error, category } => {
            axum::Json(json!({"error": error, "category": category})).into_response()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(dtype: proto::DType, bytes: Vec<u8>, shape: Vec<i64>) -> proto::Tensor {
        proto::Tensor { encoding: Some(proto::tensor::Encoding::Dense(bytes)), dtype: dtype as i32, shape }
    }

    /// The SDK's encodings (`request_conv.py`): dense float32 / int64 little-endian, and
    /// 2-D CSR whose missing entries are 0; malformed tensors are errors.
    #[test]
    fn tensors_decode_as_the_sdk_encodes_them() {
        let f = dense(proto::DType::Float32, proto::f32_bytes(&[1.5, -2.0]), vec![2]);
        assert_eq!(tensor_values(&f).unwrap(), vec![1.5, -2.0]);
        let i = dense(proto::DType::Int64, [7i64, 300].iter().flat_map(|x| x.to_le_bytes()).collect(), vec![]);
        assert_eq!(tensor_values(&i).unwrap(), vec![7.0, 300.0]);
        // [[0, 3], [4, 0]] as CSR: row starts [0, 1, 2], columns [1, 0].
        let le = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let csr = proto::Tensor {
            encoding: Some(proto::tensor::Encoding::SparseCsr(proto::SparseCsr {
                values: proto::f32_bytes(&[3.0, 4.0]),
                crow_indices: le(&[0, 1, 2]),
                col_indices: le(&[1, 0]),
            })),
            dtype: proto::DType::Float32 as i32,
            shape: vec![2, 2],
        };
        assert_eq!(tensor_values(&csr).unwrap(), vec![0.0, 3.0, 4.0, 0.0]);
        let short = dense(proto::DType::Float32, vec![0; 6], vec![2]);
        assert_eq!(tensor_values(&short).unwrap_err(), "6 bytes is not a whole number of values");
        let shape = dense(proto::DType::Float32, vec![0; 8], vec![3]);
        assert_eq!(tensor_values(&shape).unwrap_err(), "2 values for shape [3]");
        assert_eq!(int32_tokens(&[5, 0, 0, 0, 9, 0, 0, 0], 10).unwrap(), vec![5, 9]);
        assert_eq!(int32_tokens(&[10, 0, 0, 0], 10).unwrap_err(), "token id 10 is not below the vocabulary size 10");
    }

    /// `ForwardBackwardOutput`'s logprobs: one record, datums concatenated as f32 with `N + 1`
    /// int64 byte offsets (`response_conv.py` reads them so).
    #[test]
    fn forward_backward_output_lays_out_datums() {
        let out = proto::forward_backward_output(&[vec![-1.0, -2.0], vec![-0.5]], HashMap::new());
        let rec = &out.loss_fn_outputs[0];
        assert_eq!(rec.num_datums, 2);
        let lp = &rec.fields["logprobs"];
        assert_eq!(lp.data, proto::f32_bytes(&[-1.0, -2.0, -0.5]));
        let offsets: Vec<i64> = lp.offsets.chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(offsets, vec![0, 8, 12]);
        // A datum's targets must be its input shifted by one.
        let d = proto::Datum {
            model_input: vec![proto::Chunk {
                chunk: Some(proto::chunk::Chunk::EncodedText(proto::EncodedTextChunk {
                    tokens: proto::token_bytes(&[1, 2, 3]),
                })),
            }],
            loss_fn_inputs: HashMap::from([
                (
                    "target_tokens".to_string(),
                    dense(proto::DType::Int64, [2i64, 3, 4].iter().flat_map(|x| x.to_le_bytes()).collect(), vec![3]),
                ),
                ("mask".to_string(), dense(proto::DType::Float32, proto::f32_bytes(&[1.0; 3]), vec![3])),
            ]),
        };
        let loss = TinkerLoss::CrossEntropy;
        let e = parse_datum(&d, &loss, 10).unwrap_err();
        assert_eq!(e, "loss_fn_inputs `mask` is not read by this loss (it reads target_tokens, weights)");
        // A weight that is not a finite number would make the gradient NaN.
        let mut d = d;
        d.loss_fn_inputs.remove("mask");
        let w = dense(proto::DType::Float32, proto::f32_bytes(&[1.0, f32::NAN, 1.0]), vec![3]);
        d.loss_fn_inputs.insert("weights".into(), w);
        let e = parse_datum(&d, &loss, 10).unwrap_err();
        assert_eq!(e, "loss_fn_inputs `weights`: value NaN at position 1 is not a finite number");
    }
}
