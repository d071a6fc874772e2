//! The one error type of online RL. Each variant is one kind of failure; the server maps
//! each kind to one HTTP status (`server/src/api/error.rs`), the CLI prints the message.
//! Messages name the field, the value and the limit.

use std::path::PathBuf;

/// Why an RL operation (a job config, a job, a rating, a report) failed.
#[derive(Debug, thiserror::Error)]
pub enum RlError {
    /// A job config that does not parse (unknown key, wrong type) or a value outside its
    /// allowed range, a malformed dataset line, a malformed rating. `param` is the offending
    /// field when one is known (`num_generations`, `learner.temperature`, `choice`).
    #[error("{message}")]
    Invalid {
        /// The field, as the caller wrote it.
        param: Option<String>,
        /// What is wrong, with the value and the limit.
        message: String,
    },
    /// A file or folder the config names (`dataset`, `eval_dataset`, `output_dir`) cannot be
    /// read or created: the caller's input is at fault, not the server.
    #[error("`{key}` {}: {source}", path.display())]
    File {
        /// The config key that names the file.
        key: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// Why it cannot be used (not found, permission denied, ...).
        #[source]
        source: std::io::Error,
    },
    /// A training job or a response id that this server does not know, or a job that has no
    /// metrics yet.
    #[error("{0}")]
    NotFound(String),
    /// The response was known but has left the feedback window.
    #[error("response `{0}` has left the feedback window (--feedback-window); it can no longer be rated")]
    Expired(String),
    /// The rating repeats one already applied.
    #[error("{0}")]
    AlreadyRated(String),
    /// Another learner (a job or the feedback learner) holds the served weights.
    #[error("another learner (a training job, the feedback learner or a Tinker training client) is already updating the weights")]
    Busy,
    /// The server's own files (feedback log, `metrics.jsonl`, checkpoints it prunes) failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The failure.
        #[source]
        source: std::io::Error,
    },
    /// Drawing `metrics.png` failed.
    #[error("{}: {message}", path.display())]
    Plot {
        /// The PNG being drawn.
        path: PathBuf,
        /// The drawing backend's message.
        message: String,
    },
    /// Weights could not be loaded (a checkpoint folder's files).
    #[error(transparent)]
    Model(#[from] engine::ModelError),
    /// The learner failed (loading or saving a checkpoint, a training step).
    #[error(transparent)]
    Learner(#[from] learner::LearnerError),
    /// The engine refused the rollout requests (bad sampling parameters, or it has stopped).
    #[error("submitting rollouts: {0}")]
    Engine(#[from] engine::handle::AddError),
    /// An engine step failed while generating the rollouts (the requests were aborted).
    #[error("generating rollouts: {0}")]
    Generation(#[from] engine::outputs::EngineFault),
    /// A thread of a job or of the feedback learner could not be started.
    #[error("starting a thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The learner panicked (a bug): the job fails instead of hanging with its generator.
    #[error("the learner panicked: {0}")]
    Panicked(String),
}

impl RlError {
    /// A validation error about `param` (the field name as the caller wrote it).
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        RlError::Invalid { param: Some(param.to_string()), message: message.into() }
    }

    /// A validation error that concerns no single field.
    pub fn invalid_input(message: impl Into<String>) -> Self {
        RlError::Invalid { param: None, message: message.into() }
    }

    /// A failure of the server's own file at `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RlError::Io { path: path.into(), source }
    }
}

/// `Result` with [`RlError`].
pub type Result<T, E = RlError> = std::result::Result<T, E>;
