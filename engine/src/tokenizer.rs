//! Tokenizer (HF `tokenizers`, from `tokenizer.json`) plus the chat template and special
//! tokens from `tokenizer_config.json` and `generation_config.json`.

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{ModelError, Result};
use std::path::Path;

pub use tokenizers::DecodeStream;

/// Text ↔ token ids for one model folder.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<ChatTemplate>,
    /// Token ids that end generation (from `generation_config.json`, else `config.json`,
    /// else the tokenizer's `eos_token`).
    pub eos_token_ids: Vec<u32>,
    /// Prepend BOS when encoding a raw prompt (`add_bos_token` in `tokenizer_config.json`).
    pub add_bos_token: bool,
    pub bos_token_id: Option<u32>,
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
    /// `generation_config.json` and `config.json` of `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer { path: path.clone(), msg: e.to_string() })?;
        let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or_default();
        let gen = read_json(&dir.join("generation_config.json"))?.unwrap_or_default();
        let model_cfg = read_json(&dir.join("config.json"))?.unwrap_or_default();
        let bos = token_str(cfg.get("bos_token"));
        let eos = token_str(cfg.get("eos_token"));
        let template = match cfg.get("chat_template") {
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
        Ok(Self { inner, chat_template, eos_token_ids, add_bos_token, bos_token_id })
    }

    /// Encodes text; special tokens written inline (e.g. `<|im_start|>`) map to their ids.
    /// Adds BOS only when `add_special_tokens` and the tokenizer config asks for it.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer { path: "tokenizer.json".into(), msg: e.to_string() })?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special_tokens && self.add_bos_token {
            ids.extend(self.bos_token_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer { path: "tokenizer.json".into(), msg: e.to_string() })
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

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Renders `messages` with the model's chat template. Errors when the model has none.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let t = self
            .chat_template
            .as_ref()
            .ok_or_else(|| ModelError::ChatTemplate("the model's tokenizer_config.json has no chat_template".into()))?;
        t.render(messages, add_generation_prompt)
    }

    /// The wrapped HF tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
