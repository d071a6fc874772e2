//! What the engine hands back per step: per-sequence increments.

use serde::Serialize;

/// Why a sequence ended (OpenAI / vLLM `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a `stop_token_ids` token or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// Aborted by the client or the server.
    Abort,
}

/// What matched when `finish_reason` is `stop` (vLLM `stop_reason`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// One generated token. See `sampling` for the two log-probabilities.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenOutput {
    pub token_id: u32,
    /// μ: log-probability under the distribution the token was actually drawn from (after
    /// penalties, temperature, top-k/top-p/min-p); 0 for greedy.
    pub behavior_logprob: f32,
    /// `log_softmax(model logits)[token]` at temperature 1, no processing.
    pub raw_logprob: f32,
    /// Top raw log-probabilities when `logprobs` was requested, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Policy version of the weights that computed this token's logits.
    pub version: u64,
}

/// A prompt token's raw log-probability given the tokens before it (`None` for the first).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptLogprob {
    pub token_id: u32,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The increment of one sequence (sample `index` of request `request_id`) in one step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SeqOutput {
    pub request_id: String,
    pub index: usize,
    /// Tokens generated this step.
    pub tokens: Vec<TokenOutput>,
    /// Text completed this step (never part of a stop string, never half a character).
    pub text: String,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    /// Prompt log-probabilities, once, with the first output of sample 0 when requested.
    pub prompt_logprobs: Option<Vec<PromptLogprob>>,
    /// True on the last output of the request (all `n` samples finished).
    pub request_finished: bool,
    /// When the scheduler first admitted this sample ([`crate::sequence::Sequence`]'s):
    /// the request's queue time ends there (the server's per-request time metrics).
    #[serde(skip)]
    pub first_scheduled: Option<std::time::Instant>,
}

/// Why the engine could not finish a request: the step that ran its sequences failed (a
/// model or kernel error: the server's fault, not the client's). The request was aborted and
/// its KV blocks freed; the engine keeps serving the other requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct EngineFault(pub String);
