//! Tokenizer (HF `tokenizers`, from `tokenizer.json`) plus the chat template and special
//! tokens from `tokenizer_config.json` and `generation_config.json`.
//!
//! Where special-token strings become control ids:
//! - chat messages ([`Tokenizer::encode_chat`]): only the template's own markers; a special
//!   string inside a message's content is plain text (see [`crate::chat_encode`]);
//! - raw text ([`Tokenizer::encode`]): with `add_special_tokens`, special strings written
//!   inline map to their ids (as HF and vLLM, so a hand-built chat prompt works); without
//!   it the text is plain text through and through.

use crate::chat_encode::{plain_tokenizers, unescape, Piece, Specials};
use crate::chat_template::{ChatMessage, ChatTemplate, FunctionCall, ToolCall};
use crate::error::{ModelError, Result};
use std::path::Path;

pub use tokenizers::DecodeStream;

/// Text ↔ token ids for one model folder.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with special-token matching off.
    plain: tokenizers::Tokenizer,
    /// `plain` for text that does not start the input, when that encodes differently
    /// (Metaspace `prepend_scheme: first`).
    plain_rest: Option<tokenizers::Tokenizer>,
    specials: Specials,
    chat_template: Option<ChatTemplate>,
    /// Token ids that end generation (from `generation_config.json`, else `config.json`,
    /// else the tokenizer's `eos_token`).
    pub eos_token_ids: Vec<u32>,
    /// Prepend BOS when encoding a raw prompt (`add_bos_token` in `tokenizer_config.json`).
    pub add_bos_token: bool,
    /// The BOS token's id, when the tokenizer has one.
    pub bos_token_id: Option<u32>,
}

/// How [`Tokenizer::encode_chat`] ends the rendered conversation (vLLM's chat options).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// End with the template's generation prompt (the opening of an assistant turn).
    pub add_generation_prompt: bool,
    /// Leave the final message open (no end-of-turn markers after its content), so the model
    /// continues it: an assistant prefill. Excludes `add_generation_prompt`.
    pub continue_final_message: bool,
    /// Extra template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    /// `enable_thinking`); they cannot replace the template's own (`messages`,
    /// `add_generation_prompt`, `bos_token`, `eos_token`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Tool definitions for the template's `tools` (OpenAI's `tools`, each `{"type":
    /// "function", "function": {...}}` as given); `None` renders `tools` as `none`.
    pub tools: Option<Vec<serde_json::Value>>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            add_generation_prompt: true,
            continue_final_message: false,
            template_kwargs: Default::default(),
            tools: None,
        }
    }
}

fn tok_err(e: impl ToString) -> ModelError {
    ModelError::Tokenizer { path: "tokenizer.json".into(), msg: e.to_string() }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|source| ModelError::Json { path: path.into(), source })
}

/// A special-token field of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_str(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        o => o.get("content")?.as_str().map(String::from),
    }
}

fn ids(v: Option<&serde_json::Value>) -> Vec<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => vec![],
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json`,
    /// `generation_config.json` and `config.json` of `dir`. The chat template is
    /// `chat_template.jinja` when the folder has one (as transformers ≥ 4.50 saves it, and as
    /// HF loads it: the file wins), else `tokenizer_config.json`'s `chat_template`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_dir_with_template(dir, None)
    }

    /// [`Self::from_dir`] with `chat_template` (a template's source) in place of the
    /// folder's (vLLM's `--chat-template`).
    pub fn from_dir_with_template(dir: &Path, chat_template: Option<&str>) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
        let model_cfg = read_json(&dir.join("config.json"))?.unwrap_or_default();
        let bos = token_str(cfg.get("bos_token"));
        let eos = token_str(cfg.get("eos_token"));
        let file = dir.join("chat_template.jinja");
        let file = match file.exists() {
            true => Some(std::fs::read_to_string(&file).map_err(|e| ModelError::io(&file, e))?),
            false => None,
        };
        let template = match cfg.get("chat_template") {
            _ if chat_template.is_some() => chat_template.map(String::from),
            _ if file.is_some() => file,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: use "default".
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        };
        let chat_template = template
            .map(|t| ChatTemplate::new(&t, bos.as_deref().unwrap_or(""), eos.as_deref().unwrap_or("")))
            .transpose()?;
        let mut eos_token_ids = ids(gen.get("eos_token_id"));
        if eos_token_ids.is_empty() {
            eos_token_ids = ids(model_cfg.get("eos_token_id"));
        }
        if eos_token_ids.is_empty() {
            eos_token_ids.extend(eos.as_deref().and_then(|e| inner.token_to_id(e)));
        }
        let bos_token_id = bos
            .as_deref()
            .and_then(|b| inner.token_to_id(b))
            .or_else(|| ids(model_cfg.get("bos_token_id")).first().copied());
        let add_bos_token = cfg.get("add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
        let (plain, plain_rest) = plain_tokenizers(&inner);
        let specials = Specials::new(&inner);
        Ok(Self { inner, plain, plain_rest, specials, chat_template, eos_token_ids, add_bos_token, bos_token_id })
    }

    /// Encodes raw text. With `add_special_tokens`, special tokens written inline (e.g.
    /// `<|im_start|>`) map to their ids and BOS is prepended when the tokenizer config asks
    /// for it; without, every character is plain text (a special string gets the ids of its
    /// characters) and no BOS is added.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        if !add_special_tokens {
            return self.encode_plain(text, true);
        }
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if self.add_bos_token {
            ids.extend(self.bos_token_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// `text` with special-token matching off; `first` when it starts the input.
    fn encode_plain(&self, text: &str, first: bool) -> Result<Vec<u32>> {
        let tok = if first { &self.plain } else { self.plain_rest.as_ref().unwrap_or(&self.plain) };
        Ok(tok.encode(text, false).map_err(tok_err)?.get_ids().to_vec())
    }

    /// Renders `messages` with the chat template and encodes the result so that only the
    /// template's own markers are special tokens: a special-token string inside a message's
    /// content is encoded as plain text ([`crate::chat_encode`]). No BOS beyond what the
    /// template writes (as HF `apply_chat_template(tokenize=True)`).
    pub fn encode_chat(&self, messages: &[ChatMessage], opts: ChatOptions) -> Result<Vec<u32>> {
        let mut table = vec![];
        let mut escape = |s: &str| self.specials.escape(s, &mut table);
        let escaped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                role: m.role.clone(),
                content: escape(&m.content),
                name: m.name.as_deref().map(&mut escape),
                tool_calls: m
                    .tool_calls
                    .iter()
                    .map(|c| ToolCall {
                        id: escape(&c.id),
                        kind: escape(&c.kind),
                        function: FunctionCall {
                            name: escape(&c.function.name),
                            arguments: escape_json(&c.function.arguments, &mut escape),
                        },
                    })
                    .collect(),
                tool_call_id: m.tool_call_id.as_deref().map(&mut escape),
                reasoning_content: m.reasoning_content.as_deref().map(&mut escape),
            })
            .collect();
        let tools = opts.tools.as_ref().map(|t| t.iter().map(|v| escape_json(v, &mut escape)).collect());
        let rendered = self.render_chat(&escaped, ChatOptions { tools, ..opts })?;
        let (text, protected) = unescape(&rendered, &table);
        let mut ids = vec![];
        for piece in self.specials.split(&text, &protected) {
            match piece {
                Piece::Special(id) => ids.push(id),
                Piece::Text(r) => ids.extend(self.encode_plain(&text[r.clone()], r.start == 0)?),
            }
        }
        Ok(ids)
    }

    /// The rendered conversation (the text [`Self::encode_chat`] encodes), cut after the
    /// final message's content with `continue_final_message` (HF `apply_chat_template`'s
    /// rule: the last occurrence of the stripped content, keeping its leading whitespace
    /// when the template kept it).
    pub fn render_chat(&self, messages: &[ChatMessage], opts: ChatOptions) -> Result<String> {
        if opts.continue_final_message && opts.add_generation_prompt {
            return Err(ModelError::ChatTemplate(
                "`continue_final_message` and `add_generation_prompt` cannot both be true".into(),
            ));
        }
        let template = self.template()?;
        if opts.tools.is_some() && !template.uses_tools() {
            return Err(ModelError::ChatTemplate(
                "`tools` were given but this model's chat template does not render tools".into(),
            ));
        }
        let text =
            template.render(messages, opts.tools.as_deref(), opts.add_generation_prompt, &opts.template_kwargs)?;
        if !opts.continue_final_message {
            return Ok(text);
        }
        let last = messages.last().map(|m| m.content.as_str()).unwrap_or("");
        let stripped = last.trim();
        let at = text.rfind(stripped).ok_or_else(|| {
            ModelError::ChatTemplate(
                "`continue_final_message`: the final message does not appear in the rendered chat".into(),
            )
        })?;
        let lstripped = last.trim_start();
        let keep = if text[at..].starts_with(lstripped) { lstripped.len() } else { stripped.len() };
        Ok(text[..at + keep].to_string())
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tok_err)
    }

    /// An incremental detokenizer that never splits a UTF-8 character.
    pub fn decode_stream(
        &self,
        skip_special_tokens: bool,
    ) -> DecodeStream<
        '_,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    > {
        self.inner.decode_stream(skip_special_tokens)
    }

    /// Number of token ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Renders `messages` with the model's chat template (text only; [`Self::encode_chat`]
    /// is the way to token ids). Errors when the model has none.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.template()?.render(messages, None, add_generation_prompt, &Default::default())
    }

    fn template(&self) -> Result<&crate::chat_template::ChatTemplate> {
        self.chat_template
            .as_ref()
            .ok_or_else(|| ModelError::ChatTemplate("the model's tokenizer_config.json has no chat_template".into()))
    }

    /// Whether the model's chat template renders `tools` (false without a template).
    pub fn template_uses_tools(&self) -> bool {
        self.chat_template.as_ref().is_some_and(ChatTemplate::uses_tools)
    }

    /// The wrapped HF tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// `v` with every string and object key passed through `escape` (tool definitions and call
/// arguments are message text too: a special-token string in them stays plain text).
fn escape_json(v: &serde_json::Value, escape: &mut impl FnMut(&str) -> String) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::String(s) => Value::String(escape(s)),
        Value::Array(a) => Value::Array(a.iter().map(|x| escape_json(x, escape)).collect()),
        Value::Object(o) => Value::Object(o.iter().map(|(k, x)| (escape(k), escape_json(x, escape))).collect()),
        other => other.clone(),
    }
}
