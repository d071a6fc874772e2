//! Errors of the learner: bad batches, checkpoint files, and the model/kernel errors below.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum LearnerError {
    /// Every sample of a batch was filtered out before the loss.
    #[error("every sample was filtered out (zero-std groups, staleness or truncation)")]
    EmptyBatch,
    /// A learner setting outside its allowed range for the chosen `loss_type`.
    #[error("{message}")]
    Config { key: &'static str, message: String },
    /// A batch the chosen loss cannot train on (missing μ, reward or pairs).
    #[error("{0}")]
    Batch(String),
    /// A gradient that names no trainable weight, or has another shape than its weight: a
    /// bug in a loss or backward, never skipped silently.
    #[error("{0}")]
    Gradient(String),
    /// The gradient's global norm is NaN or infinite (a non-finite loss input, or an
    /// overflow): the update is skipped and the weights stay as they were, as
    /// `torch.amp.GradScaler` skips such a step.
    #[error(
        "the gradient is not finite (global norm {norm}): no update was applied and the weights are unchanged; \
         look for NaN, infinite or extreme values in the loss inputs (rewards, advantages, weights, logprobs)"
    )]
    NonFiniteGradient { norm: f64 },
    /// A checkpoint folder or file is missing or malformed.
    #[error("{path}: {msg}")]
    Checkpoint { path: PathBuf, msg: String },
    /// An existing folder rlserve would replace is not a checkpoint rlserve wrote.
    #[error("{path} is not an rlserve checkpoint ({msg}); rlserve replaces only its own checkpoints")]
    NotRlserve { path: PathBuf, msg: String },
    #[error(transparent)]
    Model(#[from] engine::ModelError),
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
}

impl LearnerError {
    pub(crate) fn io(path: impl Into<PathBuf>, e: std::io::Error) -> Self {
        LearnerError::Model(engine::ModelError::io(path, e))
    }
}

pub type Result<T> = std::result::Result<T, LearnerError>;
