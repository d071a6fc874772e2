//! `POST /v1/completions`.

use super::body::ApiJson;
use super::error::ApiError;
use super::generation::{
    finish_json, response_id, sampling_params, set_token_fields, sse, stop_json, submit, unix_now, Generation,
};
use super::protocol::{CompletionRequest, Prompt, Usage};
use super::AppState;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use engine::outputs::PromptLogprob;
use engine::{FinishReason, StopReason, TokenOutput, Tokenizer};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// The legacy completions `logprobs` object for `tokens`, starting at text offset `offset`.
fn logprobs_json(tok: &Tokenizer, tokens: &[TokenOutput], offset: &mut usize) -> Value {
    logprobs_json_echo(tok, &[], tokens, offset)
}

/// [`logprobs_json`] preceded by the echoed prompt's entries (vLLM's `echo` with
/// `logprobs`, what lm-eval's `local-completions` scores with): each prompt token with its
/// raw log-probability given the tokens before it (`null` for the first) and its top
/// entries, offsets from the start of the echoed text.
///
/// Each `top_logprobs` entry is OpenAI's "up to `logprobs` + 1" map, as vLLM builds it: the
/// chosen token first, then the `logprobs` most likely in rank order (keys are decoded
/// text, so a chosen token among them appears once).
fn logprobs_json_echo(tok: &Tokenizer, prompt: &[PromptLogprob], tokens: &[TokenOutput], offset: &mut usize) -> Value {
    let text = |id: u32| tok.decode(&[id], false).unwrap_or_default();
    let entries = prompt
        .iter()
        .map(|p| (p.token_id, p.logprob, &p.top_logprobs))
        .chain(tokens.iter().map(|t| (t.token_id, Some(t.raw_logprob), &t.top_logprobs)));
    let mut out = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for (id, logprob, top) in entries {
        let s = text(id);
        out["text_offset"].as_array_mut().unwrap().push(json!(*offset));
        *offset += s.len();
        let top = logprob.map(|lp| {
            let ranked = top.iter().map(|&(id, lp)| (text(id), json!(lp)));
            let mut m = serde_json::Map::new();
            for (k, v) in std::iter::once((s.clone(), json!(lp))).chain(ranked) {
                m.entry(k).or_insert(v);
            }
            Value::Object(m)
        });
        out["tokens"].as_array_mut().unwrap().push(json!(s));
        out["token_logprobs"].as_array_mut().unwrap().push(json!(logprob));
        out["top_logprobs"].as_array_mut().unwrap().push(top.unwrap_or(Value::Null));
    }
    out
}

/// Token ids of every prompt. Text goes through [`engine::Tokenizer::encode`]: with
/// `add_special_tokens` (the default) BOS when the model asks for it and inline special
/// tokens as control ids, without it plain text.
fn prompts(state: &AppState, p: Prompt, add_special_tokens: bool) -> Result<Vec<Vec<u32>>, ApiError> {
    let enc = |t: &str| {
        state.tokenizer.encode(t, add_special_tokens).map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))
    };
    let ps = match p {
        Prompt::Text(t) => vec![enc(&t)?],
        Prompt::Texts(ts) => ts.iter().map(|t| enc(t)).collect::<Result<_, _>>()?,
        Prompt::Tokens(ids) => vec![ids],
        Prompt::TokenLists(l) => l,
    };
    if ps.is_empty() {
        return Err(ApiError::bad("`prompt` must hold at least one prompt", Some("prompt")));
    }
    Ok(ps)
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    state.check_model(req.model.as_deref())?;
    let ps = prompts(&state, req.prompt.clone(), req.add_special_tokens.unwrap_or(true))?;
    let mut params = sampling_params(&req.sampling, Some(req.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)), req.logprobs)?;
    // `echo` with `logprobs` scores the prompt too (vLLM): its log-probabilities come first.
    if echo_logprobs(&req) {
        params.prompt_logprobs = params.prompt_logprobs.or(req.logprobs);
    }
    super::check_seqs(ps.len(), params.n, "prompt", "n")?;
    let echo: Vec<String> = if req.echo.unwrap_or(false) {
        ps.iter().map(|p| state.tokenizer.decode(p, false).unwrap_or_default()).collect()
    } else {
        vec![]
    };
    let id = response_id("cmpl-");
    let gen = submit(&state, ps.clone(), params, &id).await?;
    let created = unix_now();
    if req.sampling.stream() {
        return Ok(stream(state, req, gen, id, created, echo).into_response());
    }
    collect(state, req, gen, id, created, echo, ps).await.map(IntoResponse::into_response)
}

/// Whether the response's `logprobs` cover the echoed prompt (`echo` and `logprobs`, not
/// streamed: a stream echoes the prompt's text only).
fn echo_logprobs(req: &CompletionRequest) -> bool {
    req.echo.unwrap_or(false) && req.logprobs.is_some() && !req.sampling.stream()
}

#[derive(Default)]
struct Choice {
    text: String,
    tokens: Vec<TokenOutput>,
    finish: Option<FinishReason>,
    stop: Option<StopReason>,
}

async fn collect(
    state: Arc<AppState>,
    req: CompletionRequest,
    mut gen: Generation,
    id: String,
    created: u64,
    echo: Vec<String>,
    ps: Vec<Vec<u32>>,
) -> Result<axum::Json<Value>, ApiError> {
    let mut choices: BTreeMap<usize, (usize, Choice)> = BTreeMap::new();
    // Per prompt: the engine sends them once, with the first output of the prompt's choice 0.
    let mut prompt_logprobs: BTreeMap<usize, Vec<PromptLogprob>> = BTreeMap::new();
    while let Some(ev) = gen.events.next().await {
        // A failed prompt fails the response: 500; dropping `gen` aborts the other prompts.
        let ev = ev?;
        let idx = gen.choice(ev.prompt, ev.out.index);
        let (_, c) = choices.entry(idx).or_insert_with(|| (ev.prompt, Choice::default()));
        c.text.push_str(&ev.out.text);
        c.tokens.extend(ev.out.tokens);
        c.finish = ev.out.finish_reason.or(c.finish);
        c.stop = ev.out.stop_reason.or(c.stop.take());
        if let Some(pl) = ev.out.prompt_logprobs {
            prompt_logprobs.insert(ev.prompt, pl);
        }
    }
    let completion_tokens: usize = choices.values().map(|(_, c)| c.tokens.len()).sum();
    let out: Vec<Value> = choices
        .into_iter()
        .map(|(idx, (prompt, c))| {
            let mut text = echo.get(prompt).cloned().unwrap_or_default();
            let pl = prompt_logprobs.get(&prompt);
            let scored = match (pl, echo_logprobs(&req)) {
                (Some(pl), true) => pl.as_slice(),
                _ => &[],
            };
            // With the prompt's entries, offsets count from the echoed text's start.
            let mut offset = if scored.is_empty() { text.len() } else { 0 };
            text.push_str(&c.text);
            let logprobs = match req.logprobs {
                Some(_) => logprobs_json_echo(&state.tokenizer, scored, &c.tokens, &mut offset),
                None => Value::Null,
            };
            let mut v = json!({
                "index": idx, "text": text, "finish_reason": finish_json(c.finish), "stop_reason": stop_json(&c.stop),
                "logprobs": logprobs,
            });
            if let Some(pl) = pl {
                // vLLM's shape: one entry per prompt token, null for the first.
                let tok = &state.tokenizer;
                v["prompt_logprobs"] = pl.iter().map(|p| p.logprob.map(|lp| {
                    let mut m = serde_json::Map::new();
                    m.insert(p.token_id.to_string(), json!({"logprob": lp, "decoded_token": tok.decode(&[p.token_id], false).unwrap_or_default()}));
                    for (id, l) in &p.top_logprobs {
                        m.entry(id.to_string()).or_insert_with(|| json!({"logprob": l, "decoded_token": tok.decode(&[*id], false).unwrap_or_default()}));
                    }
                    Value::Object(m)
                }).unwrap_or(Value::Null)).collect();
            }
            if req.sampling.return_token_ids() {
                v["prompt_token_ids"] = json!(ps[prompt]);
                set_token_fields(&mut v, &c.tokens);
            }
            v
        })
        .collect();
    let usage = Usage {
        prompt_tokens: gen.prompt_tokens(),
        completion_tokens,
        total_tokens: gen.prompt_tokens() + completion_tokens,
    };
    Ok(axum::Json(
        json!({"id": id, "object": "text_completion", "created": created, "model": state.model_name, "choices": out, "usage": usage}),
    ))
}

fn stream(
    state: Arc<AppState>,
    req: CompletionRequest,
    gen: Generation,
    id: String,
    created: u64,
    echo: Vec<String>,
) -> impl IntoResponse {
    let usage = req.sampling.stream_usage();
    let model = state.model_name.clone();
    let envelope = move |choices: Value| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices});
    // Bytes of text sent so far per choice (for `text_offset`).
    let mut offsets: BTreeMap<usize, usize> = BTreeMap::new();
    sse(gen, usage, envelope, move |prompt, idx, out| {
        let first = !offsets.contains_key(&idx);
        let offset = offsets.entry(idx).or_insert(0);
        // The first chunk of a choice carries the echoed prompt.
        let mut text = if first { echo.get(prompt).cloned().unwrap_or_default() } else { String::new() };
        *offset += text.len();
        let mut lp_offset = *offset;
        text.push_str(&out.text);
        *offset += out.text.len();
        // Tokens whose text is not out yet (an incomplete UTF-8 character) still carry their
        // logprobs and, with `return_token_ids`, their ids.
        if text.is_empty() && out.finish_reason.is_none() && req.logprobs.is_none() && !req.sampling.return_token_ids()
        {
            return None;
        }
        let logprobs = if req.logprobs.is_some() {
            logprobs_json(&state.tokenizer, &out.tokens, &mut lp_offset)
        } else {
            Value::Null
        };
        let mut c = json!({"index": idx, "text": text, "logprobs": logprobs, "finish_reason": finish_json(out.finish_reason), "stop_reason": stop_json(&out.stop_reason)});
        if req.sampling.return_token_ids() {
            set_token_fields(&mut c, &out.tokens);
        }
        Some(c)
    })
}
