//! OpenAI-compatible request and response bodies (plus vLLM's extra sampling fields).
//! Every body is parsed by the rules of [`super::body`]: null = absent, unknown members are
//! a 400 naming them, type errors name the field.

use super::body::{check_messages, fields, object, only, strict, typed, Body};
use super::error::ApiError;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

/// `prompt` of `/v1/completions`: text, texts, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string, a list of strings, a list of token ids or a list of token-id lists")]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options` of a streamed request.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the usage of the whole response.
    pub include_usage: Option<bool>,
    /// With `include_usage`, every chunk carries the usage so far (vLLM's).
    pub continuous_usage_stats: Option<bool>,
}

/// Where a streamed response reports its usage ([`StreamOptions`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamUsage {
    /// Nowhere.
    #[default]
    Off,
    /// In a last chunk with no choices; every other chunk has `"usage": null` (OpenAI's).
    Last,
    /// In that last chunk and, so far, in every chunk (vLLM's `continuous_usage_stats`).
    Continuous,
}

/// Sampling fields shared by completions, chat and rollouts (OpenAI names plus vLLM's extras
/// at the top level); their meaning is [`engine::SamplingParams`]'.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub n: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// A seed in `[0, 2⁶⁴)`, or −1 for a random one (vLLM).
    pub seed: Option<i128>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub min_tokens: Option<usize>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub prompt_logprobs: Option<usize>,
    /// OpenAI `logit_bias`: token id (as a string key) → bias, clamped to [-100, 100] (as
    /// vLLM and OpenAI), added to the logits before penalties and temperature.
    pub logit_bias: Option<BTreeMap<String, f64>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// An end-user id (OpenAI); it does not change the answer.
    pub user: Option<String>,
    /// Also return `token_ids` per choice and `prompt_token_ids` (vLLM).
    pub return_token_ids: Option<bool>,
}

impl SamplingFields {
    /// Whether the response is streamed.
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Whether choices carry `token_ids`, `behavior_logprobs` and `versions`.
    pub fn return_token_ids(&self) -> bool {
        self.return_token_ids.unwrap_or(false)
    }

    /// Where a streamed response reports its usage: `stream_options.include_usage` (true when
    /// `stream_options` is given without it, vLLM's default) and `continuous_usage_stats`.
    pub fn stream_usage(&self) -> StreamUsage {
        match &self.stream_options {
            Some(o) if o.include_usage.unwrap_or(true) => match o.continuous_usage_stats {
                Some(true) => StreamUsage::Continuous,
                _ => StreamUsage::Last,
            },
            _ => StreamUsage::Off,
        }
    }
}

/// A body made of an endpoint's own fields (`T`, whose `sampling` is skipped by serde) and
/// the shared [`SamplingFields`]; no other member is accepted.
fn with_sampling<T: serde::de::DeserializeOwned>(
    v: Value,
    prepare: impl FnOnce(&mut serde_json::Map<String, Value>) -> Result<(), ApiError>,
    set: impl FnOnce(&mut T, SamplingFields),
) -> Result<T, ApiError> {
    let mut obj = object(v, "the request body")?;
    only(&obj, &[fields::<T>(), fields::<SamplingFields>()], "")?;
    prepare(&mut obj)?;
    let mut own: T = typed(&obj)?;
    set(&mut own, typed(&obj)?);
    Ok(own)
}

/// `POST /v1/completions` (fields named and meant as OpenAI's).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    /// Number of top log-probabilities per token (0 = the sampled token only).
    pub logprobs: Option<usize>,
    /// Put the prompt's text before each choice's text.
    pub echo: Option<bool>,
    /// vLLM: text prompts get BOS (when the tokenizer adds one) and inline special-token
    /// strings become control ids; `false` encodes the text as plain text. Default true.
    pub add_special_tokens: Option<bool>,
    #[serde(skip)]
    pub sampling: SamplingFields,
}

impl Body for CompletionRequest {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        with_sampling(v, |_| Ok(()), |r: &mut Self, s| r.sampling = s)
    }
}

/// Message `content`: a string or a list of `{"type": "text", "text": ...}` parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged, expecting = "a string or a list of parts like {\"type\": \"text\", \"text\": \"...\"}")]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a list `content` (only `{"type": "text", "text": ...}` is supported).
#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// One chat message of a request: `role` (system, user, assistant, tool, developer),
/// `content`, the optional participant `name` (to the template as `message.name`), an
/// assistant turn's `tool_calls` and a tool turn's `tool_call_id`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    pub tool_call_id: Option<String>,
    /// An assistant turn's thinking, as `--reasoning-parser` returned it (Qwen3's template
    /// reads `message.reasoning_content`).
    pub reasoning_content: Option<String>,
}

/// One call of an assistant message: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, `arguments` a JSON string (OpenAI's).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCallIn {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCallIn,
    /// The call's place in a streamed answer: what the OpenAI client keeps when it
    /// accumulates `delta.tool_calls`; the order of the list is the order.
    #[allow(dead_code)]
    pub index: Option<usize>,
}

/// The function part of a [`ToolCallIn`]; an empty `arguments` is `{}` (vLLM's reading).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionCallIn {
    pub name: String,
    pub arguments: String,
}

/// How a conversation is turned into a prompt (vLLM's chat options).
#[derive(Debug, Clone, Default)]
pub struct ChatFormat {
    /// End with the opening of an assistant turn (default true).
    pub add_generation_prompt: Option<bool>,
    /// Continue the final message (an assistant prefill) instead of closing it; needs
    /// `add_generation_prompt: false` (default false).
    pub continue_final_message: Option<bool>,
    /// Prepend BOS when the tokenizer adds one (default false: the template writes it).
    pub add_special_tokens: Option<bool>,
    /// Extra chat-template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    /// `{"enable_thinking": false}`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Tool definitions for the template (OpenAI's `tools`, checked by
    /// [`super::tools::tool_choice`]); `[]` is none.
    pub tools: Option<Vec<Value>>,
}

impl ChatFormat {
    /// The engine's chat options (defaults filled in).
    pub fn options(&self) -> engine::ChatOptions {
        engine::ChatOptions {
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            continue_final_message: self.continue_final_message.unwrap_or(false),
            template_kwargs: self.chat_template_kwargs.clone().unwrap_or_default(),
            tools: self.tools.clone().filter(|t| !t.is_empty()),
        }
    }
}

/// `POST /v1/chat/completions` (fields named and meant as OpenAI's and vLLM's).
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub add_special_tokens: Option<bool>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Tool definitions (OpenAI's; see [`super::tools`]).
    pub tools: Option<Vec<Value>>,
    /// `"none"`, `"auto"` (the default with `tools`); `"required"` and a named function are
    /// refused ([`super::tools::tool_choice`]).
    pub tool_choice: Option<Value>,
    /// `false` keeps only an answer's first call (default true).
    pub parallel_tool_calls: Option<bool>,
    #[serde(skip)]
    pub sampling: SamplingFields,
}

impl ChatRequest {
    /// The conversation's formatting options.
    pub fn format(&self) -> ChatFormat {
        ChatFormat {
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            add_special_tokens: self.add_special_tokens,
            chat_template_kwargs: self.chat_template_kwargs.clone(),
            tools: self.tools.clone(),
        }
    }
}

impl Body for ChatRequest {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        let prepare = |o: &mut serde_json::Map<String, Value>| match o.get_mut("messages") {
            Some(m) => check_messages(m, "messages"),
            None => Ok(()),
        };
        with_sampling(v, prepare, |r: &mut Self, s| r.sampling = s)
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// `POST /tokenize`: a text `prompt` or chat `messages` (vLLM).
#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Text: BOS and inline special tokens (default true); messages: BOS (default false).
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Tool definitions rendered with `messages` (as chat's `tools`).
    pub tools: Option<Vec<Value>>,
}

impl Body for TokenizeRequest {
    fn from_value(mut v: Value) -> Result<Self, ApiError> {
        if let Some(m) = v.get_mut("messages") {
            check_messages(m, "messages")?;
        }
        strict(v)
    }
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

impl Body for DetokenizeRequest {
    fn from_value(v: Value) -> Result<Self, ApiError> {
        strict(v)
    }
}
