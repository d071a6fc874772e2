//! rlserve engine: model config and weights, the forward pass, tokenizer and chat template,
//! sampling, and the default-model fetcher. No HTTP and no async runtime in here.

pub mod block_manager;
pub mod chat_encode;
pub mod chat_template;
pub mod convert;
pub mod detokenizer;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod files;
pub mod generate;
pub mod handle;
pub mod model;
pub mod model_runner;
pub mod outputs;
pub mod publish;
pub mod sampling;
pub mod scheduler;
pub mod sequence;
pub mod tokenizer;
pub mod validation;

pub use chat_template::ChatMessage;
pub use engine::{EngineConfig, EngineStats, KvOnUpdate, LLMEngine};
pub use error::{ModelError, Result};
pub use handle::{EngineHandle, RequestStream};
pub use model::{BatchSeq, ForwardBatch, KvCache, Model, ModelConfig, SharedModel};
pub use outputs::{FinishReason, SeqOutput, StopReason, TokenOutput};
pub use sampling::SamplingParams;
pub use tokenizer::{ChatOptions, Tokenizer};
pub use validation::ValidationError;
