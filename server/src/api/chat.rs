//! `POST /v1/chat/completions`.

use super::body::ApiJson;
use super::error::ApiError;
use super::generation::{
    finish_json, response_id, sampling_params, set_token_fields, sse, stop_json, submit, unix_now, Generation,
};
use super::protocol::{ChatFormat, ChatMessageIn, ChatRequest, Content, Usage};
use super::reasoning::Splitter;
use super::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use engine::sampling::MAX_LOGPROBS;
use engine::{ChatMessage, FinishReason, StopReason, TokenOutput, Tokenizer};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// Flattens messages (string or text-part contents) for the chat template.
pub fn messages(msgs: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::bad("`messages` must hold at least one message", Some("messages")));
    }
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            if !["system", "user", "assistant", "tool", "developer"].contains(&m.role.as_str()) {
                return Err(ApiError::bad(
                    format!(
                        "`messages[{i}].role` must be one of system, user, assistant, tool, developer; got {:?}",
                        m.role
                    ),
                    Some(&format!("messages[{i}].role")),
                ));
            }
            let content = match &m.content {
                // Only an assistant turn may go without content (OpenAI's rule).
                None if m.role == "assistant" => String::new(),
                None => {
                    return Err(ApiError::bad(
                        format!("`messages[{i}].content` is required for a {} message", m.role),
                        Some(&format!("messages[{i}].content")),
                    ))
                }
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => parts
                    .iter()
                    .enumerate()
                    .map(|(j, p)| match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => Ok(t.as_str()),
                        ("text", None) => Err(ApiError::bad(
                            format!("`messages[{i}].content[{j}]` of type \"text\" has no `text`"),
                            Some(&format!("messages[{i}].content[{j}].text")),
                        )),
                        _ => Err(ApiError::bad(
                            format!("`messages[{i}].content[{j}]` of type {:?} is not supported (only text)", p.kind),
                            Some(&format!("messages[{i}].content[{j}].type")),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(""),
            };
            Ok(ChatMessage { role: m.role.clone(), content, name: m.name.clone() })
        })
        .collect()
}

/// Renders and tokenizes the conversation: only the template's markers are special tokens,
/// message contents are plain text ([`Tokenizer::encode_chat`]). The one path from messages
/// to ids for chat, `/tokenize` and rollouts, so the learner trains on these very ids.
pub fn chat_prompt(tok: &Tokenizer, msgs: &[ChatMessageIn], format: &ChatFormat) -> Result<Vec<u32>, ApiError> {
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
    let msgs = messages(msgs)?;
    let mut ids = vec![];
    if format.add_special_tokens == Some(true) && tok.add_bos_token {
        ids.extend(tok.bos_token_id);
    }
    ids.extend(tok.encode_chat(&msgs, opts).map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?);
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
    let prompt = chat_prompt(&state.tokenizer, &req.messages, &req.format())?;
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
        return Ok(stream(state, req, gen, id, created).into_response());
    }
    collect(state, req, gen, id, created, prompt).await.map(IntoResponse::into_response)
}

/// One choice of a non-streamed answer as its outputs arrive: text, tokens, finish and stop reasons.
type ChoiceSoFar = (String, Vec<TokenOutput>, Option<FinishReason>, Option<StopReason>);

async fn collect(
    state: Arc<AppState>,
    req: ChatRequest,
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
            let message = match state.reasoning_parser {
                Some(_) => match Splitter::split(&text) {
                    (Some(r), c) => json!({"role": "assistant", "content": c, "reasoning_content": r}),
                    (None, c) => json!({"role": "assistant", "content": c}),
                },
                None => json!({"role": "assistant", "content": text}),
            };
            let mut v = json!({
                "index": idx, "message": message, "finish_reason": finish_json(f), "stop_reason": stop_json(&s),
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

fn stream(state: Arc<AppState>, req: ChatRequest, gen: Generation, id: String, created: u64) -> impl IntoResponse {
    let usage = req.sampling.stream_usage();
    let want_logprobs = req.logprobs == Some(true);
    let want_ids = req.sampling.return_token_ids();
    let model = state.model_name.clone();
    let envelope = move |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices});
    let mut started: BTreeSet<usize> = BTreeSet::new();
    let mut splitters: BTreeMap<usize, Splitter> = BTreeMap::new();
    let parser = state.reasoning_parser;
    sse(gen, usage, envelope, move |_prompt, idx, out| {
        // With a reasoning parser, the delta's text split into reasoning and content.
        let (reasoning, content) = match parser {
            Some(_) => {
                let s = splitters.entry(idx).or_default();
                let (mut r, mut c) = s.push(&out.text);
                if out.finish_reason.is_some() {
                    let (r2, c2) = s.finish();
                    r.push_str(&r2);
                    c.push_str(&c2);
                }
                (r, c)
            }
            None => (String::new(), out.text.clone()),
        };
        // The first chunk of every choice announces the role, whatever else it carries (a
        // choice may finish before producing any text).
        let first = started.insert(idx);
        let mut delta = match (first, content.is_empty() && reasoning.is_empty()) {
            (true, _) => json!({"role": "assistant", "content": content}),
            (false, false) => json!({"content": content}),
            // Tokens whose text is not out yet (an incomplete UTF-8 character) still carry
            // their logprobs, ids and versions.
            (false, true) if out.finish_reason.is_some() || want_logprobs || want_ids => json!({}),
            (false, true) => return None,
        };
        if !reasoning.is_empty() {
            delta["reasoning_content"] = json!(reasoning);
            if content.is_empty() && !first {
                delta.as_object_mut().expect("an object").remove("content");
            }
        }
        let logprobs = if want_logprobs { logprobs_json(&state.tokenizer, &out.tokens) } else { Value::Null };
        let mut choice = json!({"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish_json(out.finish_reason), "stop_reason": stop_json(&out.stop_reason)});
        if want_ids {
            set_token_fields(&mut choice, &out.tokens);
        }
        Some(choice)
    })
}
