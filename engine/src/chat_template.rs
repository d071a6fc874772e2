//! Chat templates from `tokenizer_config.json`, rendered with minijinja the way HF
//! `apply_chat_template` renders them (`trim_blocks`, `lstrip_blocks`, Python string methods,
//! `raise_exception`).

use crate::error::{ModelError, Result};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

/// One chat message (`role`: system / user / assistant / tool), with OpenAI's optional
/// participant `name`, which reaches the template as `message.name` (most templates ignore
/// it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: content.into(), name: None }
    }
}

/// The variables a chat template gets from rlserve itself; `chat_template_kwargs` cannot
/// replace them.
pub const TEMPLATE_VARIABLES: [&str; 4] = ["messages", "add_generation_prompt", "bos_token", "eos_token"];

/// A compiled chat template plus the special tokens it may reference.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`. Errors carry minijinja's message (line and cause).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        Ok(Self { env, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply starts. `kwargs` are further template variables (HF `apply_chat_template`'s
    /// `**kwargs`, vLLM's `chat_template_kwargs`). Errors: a kwarg that would replace one of
    /// the template's own variables, or a template error.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        if let Some(k) = kwargs.keys().find(|k| TEMPLATE_VARIABLES.contains(&k.as_str())) {
            return Err(ModelError::ChatTemplate(format!(
                "`chat_template_kwargs.{k}` would replace the template's own `{k}`"
            )));
        }
        let tmpl = self.env.get_template("chat").map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        let own = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        tmpl.render(minijinja::context! { ..own, ..minijinja::Value::from_serialize(kwargs) })
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))
    }
}
