//! Prompt datasets of a training job: JSONL files (`prompt` or `messages` per line, other
//! fields passed to the rewards) or the built-in `builtin:arithmetic` task. Prompts are
//! tokenized once: messages (and prompts under `apply_chat_template`) as the chat endpoint
//! does ([`Tokenizer::encode_chat`]: message contents are plain text, only the template's
//! markers are special tokens), raw prompts as a completions prompt (`Tokenizer::encode`
//! with special tokens); a `prompt` may also be a list of token ids (taken as is). The
//! job's `chat_template_kwargs` (and a line's own, laid over them) reach the template.
//!
//! Preference pairs (DPO/IPO jobs; TRL's preference format): lines with `prompt`, `chosen`
//! and `rejected`. A completion is text (tokenized without special tokens, then the EOS
//! token appended, as TRL) or a list of token ids (taken as is).

use super::error::{Result, RlError};
use engine::{ChatMessage, ChatOptions, Tokenizer};
use serde_json::{Map, Value};
use std::path::Path;

/// One prompt: its token ids and the line's fields (`answer`, ...) for the rewards.
#[derive(Debug, Clone)]
pub struct Example {
    /// The prompt's token ids (what the engine is given).
    pub prompt_ids: Vec<u32>,
    /// The prompt as text (what the chat template produced), for `http` rewards and logs.
    pub prompt_text: String,
    /// The dataset line's fields.
    pub fields: Map<String, Value>,
    /// The line's preference pair, when it has `chosen` and `rejected`.
    pub pair: Option<Pair>,
}

/// A preference between two completions of one prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    /// The preferred completion's token ids.
    pub chosen: Vec<u32>,
    /// The other completion's token ids.
    pub rejected: Vec<u32>,
}

/// The built-in task: two-number addition with the answer after `####`. Train and eval
/// split by pair, so eval prompts are never trained on: pairs `(a, b)` with
/// `(7a + b) % 5 == 0` are the eval set.
fn arithmetic(eval: bool) -> Vec<Map<String, Value>> {
    let mut rows = Vec::new();
    for a in 0..20u32 {
        for b in 0..10u32 {
            if ((7 * a + b) % 5 == 0) != eval {
                continue;
            }
            let q = format!("What is {a} + {b}? Give only the final answer after ####, like this: #### 42");
            let mut m = Map::new();
            m.insert("prompt".into(), q.into());
            m.insert("answer".into(), (a + b).to_string().into());
            rows.push(m);
        }
    }
    rows
}

/// How a dataset's prompts go through the chat template (the job's keys of the same names).
#[derive(Debug, Clone, Copy, Default)]
pub struct Templating<'a> {
    /// Render `prompt` lines as one user message through the template (`messages` lines
    /// always are).
    pub apply_chat_template: bool,
    /// A system message before every prompt.
    pub system_prompt: Option<&'a str>,
    /// Template variables for every prompt (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    /// `enable_thinking`); a line's own `chat_template_kwargs` object is laid over them, key
    /// by key.
    pub chat_template_kwargs: Option<&'a Map<String, Value>>,
}

/// Loads `spec` (`builtin:arithmetic`, `builtin:arithmetic-eval` or a JSONL path).
/// Errors name the config key (`key`: `dataset` or `eval_dataset`), the file and the line.
pub fn load(key: &'static str, spec: &str, tok: &Tokenizer, templating: Templating) -> Result<Vec<Example>> {
    let rows = rows(key, spec)?;
    let line_error =
        |i: usize, msg: &dyn std::fmt::Display| RlError::invalid(key, format!("{key} {spec} line {}: {msg}", i + 1));
    let Templating { apply_chat_template, system_prompt, chat_template_kwargs } = templating;
    rows.into_iter()
        .enumerate()
        .map(|(i, mut fields)| {
            let mut template_kwargs = chat_template_kwargs.cloned().unwrap_or_default();
            match fields.remove("chat_template_kwargs") {
                Some(Value::Object(own)) => template_kwargs.extend(own),
                Some(_) => return Err(line_error(i, &"`chat_template_kwargs` must be an object")),
                None => {}
            }
            let opts = ChatOptions { template_kwargs, ..ChatOptions::default() };
            let mut msgs: Vec<ChatMessage> = system_prompt.map(|s| ChatMessage::new("system", s)).into_iter().collect();
            match (fields.get("messages"), fields.get("prompt")) {
                (Some(Value::Array(m)), _) => {
                    for (j, v) in m.iter().enumerate() {
                        let (Some(role), Some(content)) = (v["role"].as_str(), v["content"].as_str()) else {
                            return Err(line_error(i, &format!("messages[{j}] needs string `role` and `content`")));
                        };
                        msgs.push(ChatMessage::new(role, content));
                    }
                }
                (_, Some(Value::String(p))) if apply_chat_template => msgs.push(ChatMessage::new("user", p)),
                (_, Some(Value::String(p))) => {
                    let prompt_ids = tok.encode(p, true).map_err(|e| line_error(i, &e))?;
                    return example(prompt_ids, p.clone(), fields, tok).map_err(|e| line_error(i, &e));
                }
                (_, Some(Value::Array(ids))) => {
                    let ids = token_ids(ids, tok.vocab_size()).map_err(|e| line_error(i, &format!("`prompt`: {e}")))?;
                    let text = tok.decode(&ids, false).map_err(|e| line_error(i, &e))?;
                    return example(ids, text, fields, tok).map_err(|e| line_error(i, &e));
                }
                _ => return Err(line_error(i, &"needs a string `prompt`, a list of token ids, or a `messages` list")),
            }
            let text = tok.render_chat(&msgs, opts.clone()).map_err(|e| line_error(i, &e))?;
            let prompt_ids = tok.encode_chat(&msgs, opts).map_err(|e| line_error(i, &e))?;
            example(prompt_ids, text, fields, tok).map_err(|e| line_error(i, &e))
        })
        .collect()
}

fn example(
    prompt_ids: Vec<u32>,
    prompt_text: String,
    fields: Map<String, Value>,
    tok: &Tokenizer,
) -> std::result::Result<Example, String> {
    if prompt_ids.is_empty() {
        return Err("the prompt is empty".into());
    }
    let pair = pair(&fields, tok)?;
    Ok(Example { prompt_ids, prompt_text, fields, pair })
}

/// Token ids from a JSON list: every element an integer below `vocab`, at least one.
fn token_ids(v: &[Value], vocab: usize) -> std::result::Result<Vec<u32>, String> {
    if v.is_empty() {
        return Err("the list of token ids is empty".into());
    }
    v.iter()
        .map(|x| match x.as_u64() {
            Some(t) if (t as usize) < vocab => Ok(t as u32),
            _ => Err(format!("{x} is not a token id (an integer below the vocab size {vocab})")),
        })
        .collect()
}

/// The line's `chosen` / `rejected` completions, if it has them (both or neither).
fn pair(fields: &Map<String, Value>, tok: &Tokenizer) -> std::result::Result<Option<Pair>, String> {
    let completion = |key: &str| -> std::result::Result<Vec<u32>, String> {
        match &fields[key] {
            Value::String(t) => {
                let mut ids = tok.encode(t, false).map_err(|e| format!("`{key}`: {e}"))?;
                ids.extend(tok.eos_token_ids.first());
                if ids.is_empty() {
                    return Err(format!("`{key}` is empty"));
                }
                Ok(ids)
            }
            Value::Array(ids) => token_ids(ids, tok.vocab_size()).map_err(|e| format!("`{key}`: {e}")),
            _ => Err(format!("`{key}` must be text or a list of token ids")),
        }
    };
    match (fields.contains_key("chosen"), fields.contains_key("rejected")) {
        (false, false) => Ok(None),
        (true, true) => Ok(Some(Pair { chosen: completion("chosen")?, rejected: completion("rejected")? })),
        _ => Err("a preference pair needs both `chosen` and `rejected`".into()),
    }
}

/// The JSON objects of `spec`, one per non-empty line (or the built-in task's rows).
fn rows(key: &'static str, spec: &str) -> Result<Vec<Map<String, Value>>> {
    let rows: Vec<Map<String, Value>> = match spec {
        "builtin:arithmetic" => arithmetic(false),
        "builtin:arithmetic-eval" => arithmetic(true),
        b if b.starts_with("builtin:") => {
            return Err(RlError::invalid(
                key,
                format!("{key} {b:?} is not built in (builtin:arithmetic, builtin:arithmetic-eval)"),
            ))
        }
        path => {
            let text = engine::files::read_bounded_string(Path::new(path), engine::files::MAX_DATASET_BYTES)
                .map_err(|source| RlError::File { key, path: path.into(), source })?;
            let mut rows = Vec::new();
            for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
                match serde_json::from_str::<Value>(line) {
                    Ok(Value::Object(m)) => rows.push(m),
                    Ok(_) => {
                        return Err(RlError::invalid(
                            key,
                            format!("{key} {path} line {}: expected a JSON object", i + 1),
                        ))
                    }
                    Err(e) => return Err(RlError::invalid(key, format!("{key} {path} line {}: {e}", i + 1))),
                }
            }
            rows
        }
    };
    if rows.is_empty() {
        return Err(RlError::invalid(key, format!("{key} {spec} has no examples")));
    }
    Ok(rows)
}

/// The example at global position `pos` of a seeded shuffle that is redrawn every epoch:
/// resuming at a saved position continues the same order.
pub fn at(examples: &[Example], seed: u64, pos: u64) -> &Example {
    let n = examples.len() as u64;
    let (epoch, i) = (pos / n, pos % n);
    let mut order: Vec<u64> = (0..n).collect();
    let mut s = engine::sampling::splitmix64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for k in (1..n as usize).rev() {
        s = engine::sampling::splitmix64(s);
        order.swap(k, (s % (k as u64 + 1)) as usize);
    }
    &examples[order[i as usize] as usize]
}
