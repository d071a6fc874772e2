//! rlserve engine: model config and weights, the forward pass, tokenizer and chat template,
//! sampling, and the default-model fetcher. No HTTP and no async runtime in here.

pub mod chat_template;
pub mod convert;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod model;
pub mod sampling;
pub mod tokenizer;

pub use chat_template::ChatMessage;
pub use error::{ModelError, Result};
pub use model::{KvCache, Model, ModelConfig};
pub use sampling::{Sampler, SamplingParams};
pub use tokenizer::Tokenizer;
