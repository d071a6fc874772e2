//! Chat templates from `tokenizer_config.json`, rendered with minijinja the way HF
//! `apply_chat_template` renders them (`trim_blocks`, `lstrip_blocks`, Python string methods,
//! `raise_exception`, and `tojson` as Python's `json.dumps`).

use crate::error::{ModelError, Result};
use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::io;

/// One chat message (`role`: system / user / assistant / tool), with OpenAI's optional
/// participant `name`, which reaches the template as `message.name` (most templates ignore
/// it), an assistant turn's `tool_calls` and `reasoning_content`, a tool turn's
/// `tool_call_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The calls an assistant turn made (absent from the template's message when empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` turn answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant turn's thinking apart from its content (Qwen3's template reads it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        let (name, tool_calls, tool_call_id, reasoning_content) = (None, vec![], None, None);
        Self { role: role.into(), content: content.into(), name, tool_calls, tool_call_id, reasoning_content }
    }
}

/// One call of an assistant turn as templates read it: OpenAI's `{"id", "type": "function",
/// "function": {"name", "arguments"}}` with `arguments` parsed from its JSON string to the
/// value it holds (vLLM hands templates the parsed object, so Qwen's and Llama's
/// `arguments | tojson` write it back as JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function part of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: Value,
}

/// The variables a chat template gets from rlserve itself; `chat_template_kwargs` cannot
/// replace them.
pub const TEMPLATE_VARIABLES: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

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
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_string()).map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        Ok(Self { env, bos_token: bos_token.into(), eos_token: eos_token.into() })
    }

    /// Whether the template reads `tools` (tool definitions given to one that does not would
    /// be dropped without a trace).
    pub fn uses_tools(&self) -> bool {
        self.env.get_template("chat").is_ok_and(|t| t.undeclared_variables(false).contains("tools"))
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply starts. `tools` are the tool definitions (OpenAI's `tools`, as given; `none`
    /// when absent, as HF passes `tools=None`). `kwargs` are further template variables (HF
    /// `apply_chat_template`'s `**kwargs`, vLLM's `chat_template_kwargs`). Errors: a kwarg
    /// that would replace one of the template's own variables, or a template error.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        if let Some(k) = kwargs.keys().find(|k| TEMPLATE_VARIABLES.contains(&k.as_str())) {
            return Err(ModelError::ChatTemplate(format!(
                "`chat_template_kwargs.{k}` would replace the template's own `{k}`"
            )));
        }
        let tmpl = self.env.get_template("chat").map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        let own = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        tmpl.render(minijinja::context! { ..own, ..JinjaValue::from_serialize(kwargs) })
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))
    }
}

/// The `tojson` filter of HF's chat-template environment: Python's `json.dumps(value,
/// ensure_ascii=False, indent=indent, sort_keys=sort_keys)`, the only keyword arguments
/// accepted.
fn tojson(value: JinjaValue, kwargs: Kwargs) -> std::result::Result<JinjaValue, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let bad = |e: serde_json::Error| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}"));
    let mut v = serde_json::to_value(&value).map_err(bad)?;
    if sort_keys == Some(true) {
        v.sort_all_objects();
    }
    Ok(JinjaValue::from_safe_string(py_json(&v, indent)))
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False, indent=indent)` writes it: `", "` and
/// `": "` between items without an indent, one item per line with one; floats as Python's
/// `repr` (`1e-05`, `1e+16`, `2.0`). The tool-call `arguments` of a response are this, as
/// vLLM's tool parsers write them.
pub fn py_json(v: &Value, indent: Option<usize>) -> String {
    let mut out = Vec::new();
    let pad = vec![b' '; indent.unwrap_or(0)];
    let fmt = PyFormatter { indent: indent.map(|_| pad.as_slice()), depth: 0, has_value: false };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    v.serialize(&mut ser).expect("a JSON value serializes");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// serde_json's formatter with Python's separators and float repr.
struct PyFormatter<'a> {
    indent: Option<&'a [u8]>,
    depth: usize,
    has_value: bool,
}

impl PyFormatter<'_> {
    fn newline<W: ?Sized + io::Write>(&self, w: &mut W) -> io::Result<()> {
        if let Some(pad) = self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.depth {
                w.write_all(pad)?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + io::Write>(&mut self, w: &mut W, c: &[u8]) -> io::Result<()> {
        self.depth += 1;
        self.has_value = false;
        w.write_all(c)
    }

    fn close<W: ?Sized + io::Write>(&mut self, w: &mut W, c: &[u8]) -> io::Result<()> {
        self.depth -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        self.has_value = true;
        w.write_all(c)
    }

    fn item<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(if self.indent.is_some() { b"," } else { b", " })?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyFormatter<'_> {
    fn begin_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"[")
    }
    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"]")
    }
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.open(w, b"{")
    }
    fn end_object<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.close(w, b"}")
    }
    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + io::Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn write_f64<W: ?Sized + io::Write>(&mut self, w: &mut W, v: f64) -> io::Result<()> {
        w.write_all(py_float(v).as_bytes())
    }
    fn write_f32<W: ?Sized + io::Write>(&mut self, w: &mut W, v: f32) -> io::Result<()> {
        w.write_all(py_float(v as f64).as_bytes())
    }
}

/// Python's `repr` of a finite float: the shortest digits that round-trip (as Rust's),
/// positional for decimal exponents in [-4, 16), else `d.ddde±XX` with at least two exponent
/// digits.
fn py_float(v: f64) -> String {
    let sci = format!("{v:e}"); // shortest round-trip digits, e.g. "-1.25e-5"
    let (mantissa, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() { String::new() } else { format!(".{tail}") };
        return format!("{sign}{head}{frac}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    if point <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
    } else if point as usize >= digits.len() {
        format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
    } else {
        let (a, b) = digits.split_at(point as usize);
        format!("{sign}{a}.{b}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Python 3's `json.dumps(v, ensure_ascii=False)` / `indent=2` of the same values, and
    /// `repr` of floats (written out by hand from CPython's output).
    #[test]
    fn json_as_python_writes_it() {
        let v = json!({"b": [1, 2.5, {}], "a": {"x": null, "é": "\"q\"\n"}, "e": []});
        assert_eq!(py_json(&v, None), r#"{"b": [1, 2.5, {}], "a": {"x": null, "é": "\"q\"\n"}, "e": []}"#);
        assert_eq!(
            py_json(&v, Some(2)),
            "{\n  \"b\": [\n    1,\n    2.5,\n    {}\n  ],\n  \"a\": {\n    \"x\": null,\n    \"é\": \"\\\"q\\\"\\n\"\n  },\n  \"e\": []\n}"
        );
        for (f, want) in [
            (2.0, "2.0"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1234567890123456.0, "1234567890123456.0"),
            (-1.5e-7, "-1.5e-07"),
            (1.25e100, "1.25e+100"),
            (0.0, "0.0"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
    }
}
