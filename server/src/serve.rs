//! `rlserve serve`: load the model, start the engine thread, serve the HTTP API until
//! SIGINT/SIGTERM, then stop accepting, let running requests finish within a grace
//! period, and abort the rest.

use crate::api::{router, AppState};
use crate::metrics::Metrics;
use anyhow::{Context, Result};
use clap::Args;
use engine::{EngineConfig, EngineHandle, KvOnUpdate, LLMEngine, Model, SharedModel, Tokenizer};
use kernels::Device;
use rl::{FeedbackConfig, FeedbackStore, LearnerSlot, RlContext, RlMetrics};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Engine flags (vLLM names).
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 16, value_parser = positive)]
    pub block_size: usize,
    /// Bytes for the KV cache (suffixes K, M, G accepted, e.g. 2G).
    #[arg(long, default_value = "2G", value_parser = parse_bytes)]
    pub kv_cache_memory: usize,
    /// KV blocks (overrides --kv-cache-memory).
    #[arg(long, value_parser = positive)]
    pub num_blocks: Option<usize>,
    /// Most sequences running at once.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub max_num_seqs: usize,
    /// Most tokens per engine step (decodes + prefill chunks).
    #[arg(long, default_value_t = 1024, value_parser = positive)]
    pub max_num_batched_tokens: usize,
    /// Context limit (prompt + output); default the model's.
    #[arg(long, value_parser = positive)]
    pub max_model_len: Option<usize>,
    /// Disable automatic prefix caching.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// In-flight sequences after a weight update: `keep` their KV (PipelineRL) or
    /// `recompute` it with the new weights (AReaL).
    #[arg(long, value_enum, default_value = "keep")]
    pub kv_on_update: KvOnUpdateArg,
    /// Write the whole KV pool at startup so that serving takes no first-touch page faults
    /// (slow where the host backs memory lazily; it then costs startup time instead).
    #[arg(long)]
    pub kv_cache_prefault: bool,
    /// Run every step's kernels one by one on a CUDA device (vLLM's flag): no CUDA graphs.
    #[arg(long)]
    pub enforce_eager: bool,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum KvOnUpdateArg {
    Keep,
    Recompute,
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            kv_cache_memory: self.kv_cache_memory,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            kv_on_update: match self.kv_on_update {
                KvOnUpdateArg::Keep => KvOnUpdate::Keep,
                KvOnUpdateArg::Recompute => KvOnUpdate::Recompute,
            },
            kv_cache_prefault: self.kv_cache_prefault,
            enforce_eager: self.enforce_eager,
        }
    }
}

/// `2G`, `512M`, `64K` or a plain byte count.
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim().trim_end_matches(['B', 'b']).trim_end_matches("i");
    let (num, mul) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0)
        .map(|v| (v * mul as f64) as usize)
        .ok_or_else(|| format!("{s:?} is not a byte size like 2G, 512M or 1048576"))
}

/// A count of at least 1 (clap's value parser for the engine's sizes).
pub fn positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1, got 0".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

#[derive(Args, Clone, Debug)]
pub struct ServeArgs {
    /// The device the model is loaded on; `None` is the CPU. The binary sets it from
    /// `--device` (`crate::device::DeviceSpec::open`), which it opens before anything else.
    #[arg(skip)]
    pub device: Option<Device>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name clients use (default: the model folder's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Require `Authorization: Bearer <KEY>` on /v1 and tokenizer routes.
    #[arg(long, env = "RLSERVE_API_KEY")]
    pub api_key: Option<String>,
    /// Requests in flight beyond which new ones get HTTP 429.
    #[arg(long, default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_seconds: u64,
    /// Require `Authorization: Bearer <KEY>` on the RL endpoints (rollouts, training jobs,
    /// feedback). Without it they are enabled only when --host is a loopback address.
    #[arg(long, env = "RLSERVE_ADMIN_KEY")]
    pub admin_key: Option<String>,
    /// Folder under which `POST /v1/checkpoints` saves the served weights (its `path` is a
    /// folder name relative to it); without it that endpoint is off.
    #[arg(long)]
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// Folder under which jobs started over HTTP write (`output_dir` is a folder name
    /// relative to it; default the job's id) and from which they resume.
    #[arg(long, default_value = "runs")]
    pub jobs_dir: std::path::PathBuf,
    /// Host names (besides the loopback names on a loopback server, and `--host`) whose
    /// requests are answered: the DNS-rebinding guard (comma-separated; `*` = any, behind a
    /// proxy that sets `Host`). On a non-loopback `--host`, unset means any.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Web origins (`https://app.example:8443`) other than the server's own that may send
    /// state-changing requests and read answers (CORS); comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Return a chat answer's `<think>…</think>` part as `reasoning_content`, apart from
    /// `content` (vLLM's `--reasoning-parser`; streamed too).
    #[arg(long, value_enum)]
    pub reasoning_parser: Option<crate::api::reasoning::ReasoningParser>,
    /// The chat template to use instead of the model folder's: a file, or the template
    /// itself (vLLM's `--chat-template`; e.g. a tool-calling template). Checkpoints keep the
    /// folder's own.
    #[arg(long, value_name = "FILE_OR_TEMPLATE")]
    pub chat_template: Option<String>,
    /// Read tool calls out of chat answers when a request has `tools` (`tool_choice:
    /// "auto"`, the default with tools): `hermes` for Qwen2.5, Qwen3 and Hermes models
    /// (vLLM's `--tool-call-parser`).
    #[arg(long, value_enum)]
    pub tool_call_parser: Option<crate::api::tools::ToolParser>,
    /// vLLM's switch for `tool_choice: "auto"`; here `--tool-call-parser` alone turns it on,
    /// and this flag only insists that one is given.
    #[arg(long, requires = "tool_call_parser")]
    pub enable_auto_tool_choice: bool,
    /// Do not serve the web pages (the chat at `/`, the dashboard at `/dashboard`); the API
    /// is unchanged.
    #[arg(long)]
    pub no_ui: bool,
    #[command(flatten)]
    pub feedback: FeedbackArgs,
}

/// `--learn-from-feedback` and its learner settings.
#[derive(Args, Clone, Debug)]
pub struct FeedbackArgs {
    /// Keep finished responses for `POST /v1/feedback` and train on the ratings.
    #[arg(long)]
    pub learn_from_feedback: bool,
    /// Responses kept for rating (oldest evicted first).
    #[arg(long, default_value_t = 1024)]
    pub feedback_window: usize,
    /// Rated samples per learner step.
    #[arg(long, default_value_t = 8)]
    pub feedback_batch_size: usize,
    /// Folder of the durable feedback log and the feedback learner's checkpoint.
    #[arg(long, default_value = "feedback")]
    pub feedback_dir: std::path::PathBuf,
    /// Save the feedback learner's checkpoint every N steps (ratings after the last one are
    /// replayed and retrained on restart).
    #[arg(long, default_value_t = 10)]
    pub feedback_save_steps: u64,
    /// TOML with the feedback learner's settings: the keys of a job's `[learner]` table
    /// (TRL names), at the top level as in `rlserve train-step --config`.
    #[arg(long)]
    pub learner_config: Option<std::path::PathBuf>,
    /// Learner learning rate (overrides --learner-config).
    #[arg(long)]
    pub learning_rate: Option<f64>,
}

impl FeedbackArgs {
    fn config(&self) -> Result<FeedbackConfig> {
        let mut learner: learner::TrainConfig = match &self.learner_config {
            Some(p) => toml::from_str(&std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)
                .with_context(|| format!("--learner-config {}", p.display()))?,
            None => learner::TrainConfig::default(),
        };
        if let Some(lr) = self.learning_rate {
            learner.learning_rate = lr;
        }
        anyhow::ensure!(self.feedback_batch_size >= 1, "--feedback-batch-size must be >= 1");
        anyhow::ensure!(self.feedback_window >= 1, "--feedback-window must be >= 1");
        Ok(FeedbackConfig {
            window: self.feedback_window,
            batch_size: self.feedback_batch_size,
            dir: self.feedback_dir.clone(),
            save_steps: self.feedback_save_steps.max(1),
            learner,
        })
    }
}

/// Whether `host` names only the local machine.
pub fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl Default for ServeArgs {
    /// The command-line defaults.
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: ServeArgs,
        }
        <Wrap as clap::Parser>::parse_from(["rlserve"]).args
    }
}

/// A running server (for tests and embedding).
pub struct Server {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// `--chat-template`'s source: the file it names, or itself when it is a template (has
/// `{{` or `{%`), as vLLM reads it.
fn read_chat_template(arg: &str) -> Result<String> {
    let path = Path::new(arg);
    if path.is_dir() {
        anyhow::bail!("--chat-template {arg}: a folder, not a template file");
    }
    if path.is_file() {
        return std::fs::read_to_string(path).with_context(|| format!("--chat-template {arg}"));
    }
    if arg.contains("{{") || arg.contains("{%") {
        return Ok(arg.to_string());
    }
    anyhow::bail!("--chat-template {arg}: no such file, and not a template (no `{{{{` or `{{%`)")
}

/// Loads the model in `dir` and builds the shared state (engine thread started).
pub fn build_state(given: &Path, args: &ServeArgs) -> Result<Arc<AppState>> {
    // One absolute path for everything that reads the folder later (checkpoints copy its
    // files), whatever the working directory is then.
    let dir = &given.canonicalize().with_context(|| format!("model folder {}", given.display()))?;
    let template = args.chat_template.as_deref().map(read_chat_template).transpose()?;
    let tokenizer = Tokenizer::from_dir_with_template(dir, template.as_deref());
    let tokenizer = Arc::new(match &args.chat_template {
        Some(arg) => tokenizer.with_context(|| format!("--chat-template {arg}"))?,
        None => tokenizer?,
    });
    if args.tool_call_parser.is_some() && !tokenizer.template_uses_tools() {
        tracing::warn!("--tool-call-parser: this model's chat template does not render tools; requests with `tools` will be refused");
    }
    let admin_enabled = args.admin_key.is_some() || is_loopback(&args.host);
    if args.feedback.learn_from_feedback && !admin_enabled {
        anyhow::bail!(
            "refusing --learn-from-feedback on --host {} without --admin-key: anyone could train the model",
            args.host
        );
    }
    let device = args.device.clone().unwrap_or(Device::Cpu);
    let mut model = Model::load(dir, &device).with_context(|| format!("loading {}", dir.display()))?;
    // A checkpoint folder is served at the policy version it was saved at.
    if let Ok(state) = learner::checkpoint::load_state(dir) {
        model.version = state["version"].as_u64().unwrap_or(0);
    }
    let model = SharedModel::new(model);
    let engine = LLMEngine::new(model.clone(), tokenizer.clone(), args.engine.config())?;
    let max_model_len = engine.max_model_len();
    tracing::info!(
        kv_capacity_tokens = engine.kv_capacity_tokens(),
        max_model_len,
        "KV cache: {} tokens ({} blocks of {})",
        engine.kv_capacity_tokens(),
        engine.stats().num_blocks,
        args.engine.block_size
    );
    let model_name = args.served_model_name.clone().unwrap_or_else(|| {
        let name = given.file_name().or(dir.file_name());
        name.map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
    });
    let engine = EngineHandle::spawn(engine);
    let metrics = Metrics::new(&model_name);
    let rl = RlContext {
        engine: engine.clone(),
        model: model.clone(),
        tokenizer: tokenizer.clone(),
        model_dir: dir.to_path_buf(),
        runtime: tokio::runtime::Handle::try_current().context("the server needs the tokio runtime")?,
        metrics: RlMetrics::new(&model_name),
        learner: LearnerSlot::default(),
        max_model_len,
        version_record: args
            .feedback
            .learn_from_feedback
            .then(|| args.feedback.feedback_dir.join(::rl::learner_loop::VERSION_FILE)),
    };
    let feedback = if args.feedback.learn_from_feedback {
        let store = FeedbackStore::open(args.feedback.config()?, rl.clone())
            .with_context(|| format!("--feedback-dir {}", args.feedback.feedback_dir.display()))?;
        Some(store)
    } else {
        None
    };
    Ok(Arc::new(AppState {
        engine,
        tokenizer,
        metrics,
        model_name,
        max_model_len,
        api_key: args.api_key.clone(),
        max_queued_requests: args.max_queued_requests.max(1),
        in_flight: AtomicUsize::new(0),
        created: crate::api::generation_time(),
        model,
        model_dir: dir.to_path_buf(),
        admin_key: args.admin_key.clone(),
        admin_enabled,
        checkpoint_dir: args.checkpoint_dir.clone(),
        jobs: Default::default(),
        rl,
        feedback,
        jobs_dir: args.jobs_dir.clone(),
        reasoning_parser: args.reasoning_parser,
        tool_parser: args.tool_call_parser,
        ui: !args.no_ui,
        tinker: Default::default(),
        engine_history: Default::default(),
        cross_site: crate::api::cross_site::CrossSite {
            listen_host: args.host.clone(),
            allowed_hosts: args.allowed_hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
            allowed_origins: args.allowed_origins.clone(),
        },
    }))
}

/// Calls `f` on the server's state every `period` (the first call at once) until the state
/// is dropped.
fn every(state: &Arc<AppState>, period: Duration, f: fn(&AppState)) {
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            match weak.upgrade() {
                Some(s) => f(&s),
                None => break,
            }
        }
    });
}

impl Server {
    /// Binds `host:port` (port 0 = any free port) and serves in the background.
    pub async fn start(state: Arc<AppState>, host: &str, port: u16) -> Result<Server> {
        let listener = TcpListener::bind((host, port)).await.with_context(|| format!("binding {host}:{port}"))?;
        let addr = listener.local_addr()?;
        let (tx, rx) = oneshot::channel();
        let app = router(state.clone());
        let task = tokio::spawn(accept_loop(listener, app, rx));
        // Tinker sessions that stopped sending heartbeats release the learner.
        every(&state, Duration::from_secs(10), |s| s.tinker.expire_sessions());
        // The engine's recent past, for the dashboard.
        every(&state, crate::api::misc::EngineHistory::EVERY, crate::api::misc::EngineHistory::sample);
        Ok(Server { addr, state, shutdown: Some(tx), task })
    }

    /// Stops accepting connections and waits up to `grace` for open ones to finish.
    pub async fn shutdown(mut self, grace: Duration) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if tokio::time::timeout(grace, &mut self.task).await.is_err() {
            tracing::warn!("grace period of {grace:?} over: aborting the remaining requests");
            self.task.abort();
        }
    }
}

/// How long a client may take to send a request's headers before its connection is closed
/// (hyper's `header_read_timeout`; `axum::serve` sets none, and 1,000 connections holding
/// partial headers stayed open indefinitely).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `stop` fires, then waits for the open connections
/// (HTTP/1.1 with the header timeout, and HTTP/2); what `axum::serve` does, plus the timeout.
async fn accept_loop(listener: TcpListener, app: axum::Router, mut stop: oneshot::Receiver<()>) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                // A failed accept (too many open files, ...) is the client's loss, not the server's.
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc).into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            s.recv().await;
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

/// Runs the server until SIGINT/SIGTERM (the `rlserve serve` command).
pub async fn run(dir: &Path, args: ServeArgs) -> Result<()> {
    let state = tokio::task::block_in_place(|| build_state(dir, &args))?;
    let server = Server::start(state, &args.host, args.port).await?;
    tracing::info!("serving {} on http://{}", server.state.model_name, server.addr);
    println!("rlserve: serving `{}` on http://{} (OpenAI API at /v1)", server.state.model_name, server.addr);
    shutdown_signal().await;
    tracing::info!(
        "shutting down: no new connections; waiting up to {}s for running requests",
        args.shutdown_grace_seconds
    );
    // Training jobs stop as on `POST /v1/train/jobs/{id}/stop` (their rollouts in flight are
    // aborted; the current step ends and is saved), as `rlserve train` does on Ctrl-C.
    let jobs = server.state.jobs.stop_all();
    server.shutdown(Duration::from_secs(args.shutdown_grace_seconds)).await;
    let running: Vec<String> =
        jobs.iter().filter(|j| j.status().status == ::rl::JobState::Stopping).map(|j| j.id.clone()).collect();
    if !running.is_empty() {
        println!(
            "rlserve: waiting for training job(s) {} to finish the current step and save a checkpoint \
             (send SIGINT/SIGTERM again to exit without it)",
            running.join(", ")
        );
        let wait = tokio::task::spawn_blocking(move || jobs.iter().for_each(|j| j.wait()));
        tokio::select! {
            _ = wait => {}
            _ = shutdown_signal() => tracing::warn!("exiting before the training jobs saved their last step"),
        }
    }
    Ok(())
}
