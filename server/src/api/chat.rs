//! `POST /v1/chat/completions`.

use super::body::ApiJson;
use super::error::ApiError;
use super::generation::{
    finish_json, response_id, sampling_params, set_token_fields, sse, stop_json, submit, unix_now, Generation,
};
use super::protocol::{ChatFormat, ChatMessageIn, ChatRequest, Content, ToolCallIn, Usage};
use super::reasoning::Splitter;
use super::tools::{tool_choice, ToolChoice, ToolSplitter};
use super::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use engine::chat_template::{FunctionCall, ToolCall};
use engine::sampling::MAX_LOGPROBS;
use engine::{ChatMessage, FinishReason, StopReason, TokenOutput, Tokenizer};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Flattens messages (string or text-part contents, text parts joined by `\n` as vLLM joins
/// them) for the chat template. `path` is where the prompt sits in the body (`""` for chat and
/// `/tokenize`, `prompts[2].` in rollouts): every error's `param` starts with it.
pub fn messages(msgs: &[ChatMessageIn], path: &str) -> Result<Vec<ChatMessage>, ApiError> {
    if msgs.is_empty() {
        let at = format!("{path}messages");
        return Err(ApiError::bad(format!("`{at}` must hold at least one message"), Some(&at)));
    }
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("{path}messages[{i}]");
            let bad =
                |field: &str, why: String| ApiError::bad(format!("`{at}{field}` {why}"), Some(&format!("{at}{field}")));
            if !["system", "user", "assistant", "tool", "developer"].contains(&m.role.as_str()) {
                let why = format!("must be one of system, user, assistant, tool, developer; got {:?}", m.role);
                return Err(bad(".role", why));
            }
            let content = match &m.content {
                // Only an assistant turn may go without content (OpenAI's rule).
                None if m.role == "assistant" => String::new(),
                None => return Err(bad(".content", format!("is required for a {} message", m.role))),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => parts
                    .iter()
                    .enumerate()
                    .map(|(j, p)| match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => Ok(t.as_str()),
                        ("text", None) => {
                            Err(bad(&format!(".content[{j}].text"), "is missing (a \"text\" part)".into()))
                        }
                        _ => Err(bad(
                            &format!(".content[{j}].type"),
                            format!("{:?} is not supported (only text)", p.kind),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join("\n"),
            };
            let only = |field: &str, set: bool, role: &str| match set && m.role != role {
                true => Err(bad(field, format!("is only for {role} messages, not {}", m.role))),
                false => Ok(()),
            };
            only(".tool_calls", m.tool_calls.is_some(), "assistant")?;
            only(".reasoning_content", m.reasoning_content.is_some(), "assistant")?;
            only(".tool_call_id", m.tool_call_id.is_some(), "tool")?;
            let tool_calls: Result<Vec<_>, _> = m
                .tool_calls
                .iter()
                .flatten()
                .enumerate()
                .map(|(j, c)| tool_call(&format!("{at}.tool_calls[{j}]"), c))
                .collect();
            Ok(ChatMessage {
                role: m.role.clone(),
                content,
                name: m.name.clone(),
                tool_calls: tool_calls?,
                tool_call_id: m.tool_call_id.clone(),
                reasoning_content: m.reasoning_content.clone(),
            })
        })
        .collect()
}

/// The call at `at` as templates read it: `arguments` parsed from its JSON string (vLLM's
/// preprocessing; floats stay floats, as Python's `json.loads` keeps them; `""` is `{}`).
fn tool_call(at: &str, c: &ToolCallIn) -> Result<ToolCall, ApiError> {
    if c.kind != "function" {
        return Err(ApiError::bad(
            format!("`{at}.type` must be \"function\", got {:?}", c.kind),
            Some(&format!("{at}.type")),
        ));
    }
    let arguments = match c.function.arguments.trim() {
        "" => json!({}),
        text => serde_json::from_str(text).map_err(|e| {
            ApiError::bad(
                format!("`{at}.function.arguments` must be a JSON string of the arguments: {e}"),
                Some(&format!("{at}.function.arguments")),
            )
        })?,
    };
    Ok(ToolCall {
        id: c.id.clone(),
        kind: c.kind.clone(),
        function: FunctionCall { name: c.function.name.clone(), arguments },
    })
}

/// Renders and tokenizes the conversation: only the template's markers are special tokens,
/// message contents are plain text ([`Tokenizer::encode_chat`]). The one path from messages
/// to ids for chat, `/tokenize` and rollouts, so the learner trains on these very ids.
/// `path` prefixes every error's `param` ([`messages`]).
pub fn chat_prompt(
    tok: &Tokenizer,
    msgs: &[ChatMessageIn],
    format: &ChatFormat,
    path: &str,
) -> Result<Vec<u32>, ApiError> {
    let opts = format.options();
    if opts.continue_final_message && opts.add_generation_prompt {
        return Err(ApiError::bad(
            "`continue_final_message: true` needs `add_generation_prompt: false` (it defaults to true)",
            Some("continue_final_message"),
        ));
    }
    if let Some(k) =
        opts.template_kwargs.keys().find(|k| engine::chat_template::TEMPLATE_VARIABLES.contains(&k.as_str()))
    {
        return Err(ApiError::bad(
            format!("`chat_template_kwargs.{k}` would replace the template's own `{k}`"),
            Some("chat_template_kwargs"),
        ));
    }
    if opts.tools.is_some() && !tok.template_uses_tools() {
        let at = format!("{path}tools");
        return Err(ApiError::bad(
            format!("`{at}` were given but this model's chat template does not render tools"),
            Some(&at),
        ));
    }
    let msgs = messages(msgs, path)?;
    let mut ids = vec![];
    if format.add_special_tokens == Some(true) && tok.add_bos_token {
        ids.extend(tok.bos_token_id);
    }
    let at = format!("{path}messages");
    ids.extend(tok.encode_chat(&msgs, opts).map_err(|e| ApiError::bad(e.to_string(), Some(&at)))?);
    Ok(ids)
}

fn token_json(tok: &Tokenizer, id: u32, lp: f32) -> Value {
    let s = tok.decode(&[id], false).unwrap_or_default();
    json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})
}

/// The chat `logprobs.content` entries of `tokens`.
fn logprobs_json(tok: &Tokenizer, tokens: &[TokenOutput]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut v = token_json(tok, t.token_id, t.raw_logprob);
            v["top_logprobs"] = t.top_logprobs.iter().map(|(id, lp)| token_json(tok, *id, *lp)).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    let tools =
        tool_choice(req.tools.as_deref(), req.tool_choice.as_ref(), req.parallel_tool_calls, state.tool_parser)?;
    let prompt = chat_prompt(&state.tokenizer, &req.messages, &req.format(), "")?;
    let want_logprobs = req.logprobs.unwrap_or(false);
    if let Some(k) = req.top_logprobs.filter(|&k| k > MAX_LOGPROBS) {
        return Err(ApiError::bad(
            format!("`top_logprobs` must be at most {MAX_LOGPROBS}, got {k}"),
            Some("top_logprobs"),
        ));
    }
    if !want_logprobs && req.top_logprobs.is_some_and(|k| k > 0) {
        return Err(ApiError::bad("`top_logprobs` requires `logprobs: true`", Some("top_logprobs")));
    }
    let logprobs = want_logprobs.then_some(req.top_logprobs.unwrap_or(0));
    let params = sampling_params(&req.sampling, req.max_completion_tokens.or(req.max_tokens), logprobs)?;
    let id = response_id("chatcmpl-");
    let gen = submit(&state, vec![prompt.clone()], params, &id).await?;
    let created = unix_now();
    if req.sampling.stream() {
        return Ok(stream(state, req, tools, gen, id, created).into_response());
    }
    collect(state, req, tools, gen, id, created, prompt).await.map(IntoResponse::into_response)
}

/// One choice's text on its way into a message: the reasoning split (`--reasoning-parser`),
/// then the tool-call parse of the content (`tool_choice: "auto"`); whole answers and
/// streams go through the same steps.
struct Answer {
    reasoning: Option<Splitter>,
    tools: Option<ToolSplitter>,
}

/// What a piece of an answer became.
#[derive(Default)]
struct AnswerDelta {
    reasoning: String,
    content: String,
    calls: Vec<super::tools::ParsedCall>,
}

impl Answer {
    fn new(state: &AppState, tools: ToolChoice) -> Self {
        Self {
            reasoning: state.reasoning_parser.map(|_| Splitter::default()),
            tools: match tools {
                ToolChoice::Auto { parser, parallel } => Some(ToolSplitter::new(parser, parallel)),
                ToolChoice::None => None,
            },
        }
    }

    /// Takes the next text; `last` when the choice has finished.
    fn push(&mut self, text: &str, last: bool) -> AnswerDelta {
        let (mut reasoning, mut content) = (String::new(), text.to_string());
        if let Some(s) = &mut self.reasoning {
            (reasoning, content) = s.push(text);
            if last {
                let (r, c) = s.finish();
                reasoning.push_str(&r);
                content.push_str(&c);
            }
        }
        let mut calls = vec![];
        if let Some(t) = &mut self.tools {
            let mut p = t.push(&content);
            if last {
                let end = t.finish();
                p.content.push_str(&end.content);
                p.calls.extend(end.calls);
            }
            (content, calls) = (p.content, p.calls);
        }
        AnswerDelta { reasoning, content, calls }
    }

    /// `finish_reason`: `tool_calls` when the answer called a tool and stopped by itself (a
    /// cut-off answer stays `length`).
    fn finish_json(&self, f: Option<FinishReason>) -> Value {
        match (f, &self.tools) {
            (Some(FinishReason::Stop), Some(t)) if t.called() => json!("tool_calls"),
            _ => finish_json(f),
        }
    }
}

/// One choice of a non-streamed answer as its outputs arrive: text, tokens, finish and stop reasons.
type ChoiceSoFar = (String, Vec<TokenOutput>, Option<FinishReason>, Option<StopReason>);

async fn collect(
    state: Arc<AppState>,
    req: ChatRequest,
    tools: ToolChoice,
    mut gen: Generation,
    id: String,
    created: u64,
    prompt: Vec<u32>,
) -> Result<axum::Json<Value>, ApiError> {
    let mut choices: BTreeMap<usize, ChoiceSoFar> = BTreeMap::new();
    while let Some(ev) = gen.events.next().await {
        // A failed prompt fails the response: 500; dropping `gen` aborts the other prompts.
        let ev = ev?;
        let c = choices.entry(gen.choice(ev.prompt, ev.out.index)).or_default();
        c.0.push_str(&ev.out.text);
        c.1.extend(ev.out.tokens);
        c.2 = ev.out.finish_reason.or(c.2);
        c.3 = ev.out.stop_reason.or(c.3.take());
    }
    let completion_tokens: usize = choices.values().map(|c| c.1.len()).sum();
    let out: Vec<Value> = choices
        .into_iter()
        .map(|(idx, (text, tokens, f, s))| {
            let mut answer = Answer::new(&state, tools);
            let d = answer.push(&text, true);
            let mut message = json!({"role": "assistant", "content": d.content});
            if answer.reasoning.as_ref().is_some_and(Splitter::thinks) {
                message["reasoning_content"] = json!(d.reasoning);
            }
            if !d.calls.is_empty() {
                message["tool_calls"] = d.calls.iter().map(|c| c.to_json(None)).collect();
                if d.content.is_empty() {
                    message["content"] = Value::Null;
                }
            }
            let mut v = json!({
                "index": idx, "message": message, "finish_reason": answer.finish_json(f), "stop_reason": stop_json(&s),
                "logprobs": if req.logprobs == Some(true) { logprobs_json(&state.tokenizer, &tokens) } else { Value::Null },
            });
            if req.sampling.return_token_ids() {
                set_token_fields(&mut v, &tokens);
            }
            v
        })
        .collect();
    let p = gen.prompt_tokens();
    let mut body = json!({"id": id, "object": "chat.completion", "created": created, "model": state.model_name, "choices": out,
        "usage": Usage { prompt_tokens: p, completion_tokens, total_tokens: p + completion_tokens }});
    if req.sampling.return_token_ids() {
        body["prompt_token_ids"] = json!(prompt);
    }
    Ok(axum::Json(body))
}

fn stream(
    state: Arc<AppState>,
    req: ChatRequest,
    tools: ToolChoice,
    gen: Generation,
    id: String,
    created: u64,
) -> impl IntoResponse {
    let usage = req.sampling.stream_usage();
    let want_logprobs = req.logprobs == Some(true);
    let want_ids = req.sampling.return_token_ids();
    let model = state.model_name.clone();
    let envelope = move |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices});
    // Per choice: its parsers and how many calls it has streamed (each call's `index`).
    let mut answers: BTreeMap<usize, (Answer, usize)> = BTreeMap::new();
    sse(gen, usage, envelope, move |_prompt, idx, out| {
        let first = !answers.contains_key(&idx);
        let (answer, calls_sent) = answers.entry(idx).or_insert_with(|| (Answer::new(&state, tools), 0));
        let d = answer.push(&out.text, out.finish_reason.is_some());
        // The first chunk of every choice announces the role, whatever else it carries (a
        // choice may finish before producing any text).
        let mut delta = match (first, d.content.is_empty() && d.reasoning.is_empty() && d.calls.is_empty()) {
            (true, _) => json!({"role": "assistant", "content": d.content}),
            (false, false) => json!({"content": d.content}),
            // Tokens whose text is not out yet (an incomplete UTF-8 character, a tag being
            // parsed) still carry their logprobs, ids and versions.
            (false, true) if out.finish_reason.is_some() || want_logprobs || want_ids => json!({}),
            (false, true) => return None,
        };
        if d.content.is_empty() && !first {
            delta.as_object_mut().expect("an object").remove("content");
        }
        if !d.reasoning.is_empty() {
            delta["reasoning_content"] = json!(d.reasoning);
        }
        if !d.calls.is_empty() {
            let calls: Vec<Value> = d.calls.iter().enumerate().map(|(k, c)| c.to_json(Some(*calls_sent + k))).collect();
            *calls_sent += calls.len();
            delta["tool_calls"] = json!(calls);
        }
        let logprobs = if want_logprobs { logprobs_json(&state.tokenizer, &out.tokens) } else { Value::Null };
        let mut choice = json!({"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": answer.finish_json(out.finish_reason), "stop_reason": stop_json(&out.stop_reason)});
        if want_ids {
            set_token_fields(&mut choice, &out.tokens);
        }
        Some(choice)
    })
}
