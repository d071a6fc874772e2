//! Request validation errors: one enum, messages that quote the bad field, its value and
//! the allowed range (TGI router style). The server maps every variant to HTTP 400.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum ValidationError {
    #[error("`{param}` must be {expected}, got {value}")]
    Param { param: &'static str, value: String, expected: &'static str },
    #[error("the prompt is empty: at least one token is required")]
    EmptyPrompt,
    #[error("prompt token id {id} is out of range: the vocabulary has {vocab} tokens (ids 0..{vocab})")]
    TokenId { id: u32, vocab: usize },
    #[error("This model's maximum context length is {max} tokens. However, you requested {requested} tokens ({prompt} in the prompt, {completion} for the completion).")]
    ContextLength { max: usize, requested: usize, prompt: usize, completion: usize },
    #[error(
        "`{param}` holds token id {id}, which is out of range: the vocabulary has {vocab} tokens (ids 0..{vocab})"
    )]
    VocabId { param: &'static str, id: u32, vocab: usize },
    #[error("request id {0:?} is already in use")]
    DuplicateRequestId(String),
    #[error(
        "the prompt ({prompt} tokens) and the completion (`max_tokens` {completion}) need {needed} KV-cache blocks \
         but the pool has only {total}: ask for fewer tokens, or give the KV cache more memory (--kv-cache-memory)"
    )]
    TooLongForCache { needed: usize, total: usize, prompt: usize, completion: usize },
}
