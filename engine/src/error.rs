//! Errors of model loading and conversion. Messages name the file, the tensor and the
//! expected shape so a user can fix a model folder without reading code.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error(
        "{path}: unsupported architecture {arch:?} (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
    )]
    UnknownArchitecture { path: PathBuf, arch: String },
    #[error("{path}: missing tensor `{name}` (expected shape {expected:?})")]
    MissingTensor { path: PathBuf, name: String, expected: Vec<usize> },
    #[error("{path}: tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch { path: PathBuf, name: String, expected: Vec<usize>, actual: Vec<usize> },
    #[error("{path}: tensor `{name}` has dtype {dtype}, supported: F32, BF16, F16")]
    UnsupportedDtype { path: PathBuf, name: String, dtype: String },
    #[error("{path}: invalid safetensors file: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("{path}: tokenizer: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("{path}: GGUF: {msg}")]
    Gguf { path: PathBuf, msg: String },
    #[error("fetching the default model: {0}")]
    Fetch(String),
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
}

impl ModelError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), source }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
