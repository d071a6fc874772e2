//! Tool calling on `/v1/chat/completions` (OpenAI's `tools` / `tool_choice` /
//! `parallel_tool_calls`, vLLM's `--tool-call-parser`).
//!
//! Request side: `tools` reach the chat template as given (HF `apply_chat_template(tools=…)`);
//! a template that does not render tools refuses them. `tool_choice: "none"` renders them and
//! returns text; `"auto"` (the default with tools) also parses the answer, which needs
//! `serve --tool-call-parser hermes`. `"required"` and a named function would need guided
//! decoding to force a call, which rlserve does not have: a 400 says so.
//!
//! Answer side, the `hermes` parser (Qwen2.5, Qwen3, Hermes; vLLM's `hermes` parser): each
//! `<tool_call>{"name": …, "arguments": …}</tool_call>` block becomes a call whose
//! `arguments` is the object written back as Python's `json.dumps` writes it; text before the
//! first call is `content` (`null` when empty), whitespace between and after calls is
//! dropped, other text stays content, and a block that is not such JSON stays content as
//! written. One [`ToolSplitter`] does it for whole answers and streams alike, so a streamed
//! answer's deltas add up to the whole message. Token ids, log-probs and what feedback
//! trains on are the generated tokens, calls included.

use super::body::typed_at;
use super::error::ApiError;
use serde::Deserialize;
use serde_json::{json, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The parsers `--tool-call-parser` accepts (vLLM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolParser {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5, Qwen3, Hermes 2/3).
    Hermes,
}

/// One tool definition of `tools`, checked (the template gets the JSON as given).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // read by serde to check the definition's shape
struct ToolDef {
    #[serde(rename = "type")]
    kind: FunctionKind,
    function: FunctionDef,
}

/// `"function"`, the only kind of tool.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum FunctionKind {
    Function,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)] // read by serde to check the definition's shape
struct FunctionDef {
    name: String,
    description: Option<String>,
    parameters: Option<serde_json::Map<String, Value>>,
    strict: Option<bool>,
}

/// What the server does with an answer's tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolChoice {
    /// Return text (no tools, or `tool_choice: "none"`).
    None,
    /// Parse calls out of the answer; `parallel` false keeps the first call only.
    Auto { parallel: bool },
}

/// Checks tool definitions, each `{"type": "function", "function": {"name",
/// "description"?, "parameters"?, "strict"?}}`; `path` names the list (`tools`,
/// `prompts[2].tools`). Errors: a 400 naming the member at fault.
pub fn check_tools(tools: Option<&[Value]>, path: &str) -> Result<(), ApiError> {
    for (i, t) in tools.unwrap_or_default().iter().enumerate() {
        typed_at::<ToolDef>(t, &format!("{path}[{i}]"))?;
    }
    Ok(())
}

/// Checks `tools` ([`check_tools`]) and resolves `tool_choice` (default `"auto"` with tools,
/// `"none"` without). Errors (400, naming the field): a malformed tool; `tool_choice` without
/// `tools`; `"auto"` without a parser; `"required"` or a named function (no guided decoding);
/// anything else.
pub fn tool_choice(
    tools: Option<&[Value]>,
    choice: Option<&Value>,
    parallel: Option<bool>,
    parser: Option<ToolParser>,
) -> Result<ToolChoice, ApiError> {
    check_tools(tools, "tools")?;
    let bad = |m: &str| ApiError::bad(m, Some("tool_choice"));
    let choice = match (choice, tools.is_some()) {
        (None, true) => "auto",
        (None, false) => "none",
        (Some(Value::String(s)), _) => s.as_str(),
        (Some(Value::Object(_)), _) => {
            return Err(bad(
                "a named `tool_choice` forces a call, which needs guided decoding; rlserve has none: use \"auto\"",
            ))
        }
        (Some(_), _) => return Err(bad("`tool_choice` must be \"none\", \"auto\", \"required\" or an object")),
    };
    match (choice, tools.is_some()) {
        ("none", _) => Ok(ToolChoice::None),
        (_, false) => Err(bad("`tool_choice` needs `tools`")),
        ("auto", true) if parser.is_none() => Err(bad(
            "\"auto\" tool choice needs a tool-call parser: start the server with `--tool-call-parser hermes` \
             (or send `tool_choice: \"none\"`)",
        )),
        ("auto", true) => Ok(ToolChoice::Auto { parallel: parallel.unwrap_or(true) }),
        ("required", true) => Err(bad(
            "`tool_choice: \"required\"` forces a call, which needs guided decoding; rlserve has none: use \"auto\"",
        )),
        (other, true) => Err(bad(&format!("`tool_choice` must be \"none\", \"auto\" or \"required\", got {other:?}"))),
    }
}

/// One parsed call: the function's name and its arguments as a JSON string.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

impl ParsedCall {
    /// OpenAI's `tool_calls` entry, with a fresh id (vLLM's `chatcmpl-tool-…`); streamed
    /// entries also carry their `index`.
    pub fn to_json(&self, index: Option<usize>) -> Value {
        let mut v = json!({"id": super::generation::response_id("chatcmpl-tool-"), "type": "function",
                           "function": {"name": self.name, "arguments": self.arguments}});
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }

    /// A block's body as a call: a JSON object with a string `name` and an `arguments`.
    fn parse(body: &str) -> Option<Self> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = engine::chat_template::py_json(v.get("arguments")?, None);
        Some(Self { name, arguments })
    }
}

/// What one step of a [`ToolSplitter`] produced: content text and completed calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// An incremental Hermes parser of one answer's content: text that could still begin a
/// `<tool_call>`, an open block, and whitespace after a call are held until they are placed.
#[derive(Debug, Clone)]
pub struct ToolSplitter {
    parallel: bool,
    held: String,
    in_call: bool,
    /// Calls found so far (parallel or not).
    calls: usize,
    /// Whitespace after a call: dropped unless other text follows.
    pending: String,
}

impl ToolSplitter {
    pub fn new(parallel: bool) -> Self {
        Self { parallel, held: String::new(), in_call: false, calls: 0, pending: String::new() }
    }

    /// Whether a call was found.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Takes the next content delta.
    pub fn push(&mut self, delta: &str) -> Parsed {
        self.held.push_str(delta);
        let mut out = Parsed::default();
        loop {
            if self.in_call {
                let Some(at) = self.held.find(CLOSE) else { return out };
                let body = self.held[..at].to_string();
                self.held.drain(..at + CLOSE.len());
                self.in_call = false;
                self.close(&body, true, &mut out);
            } else if let Some(at) = self.held.find(OPEN) {
                let text = self.held[..at].to_string();
                self.held.drain(..at + OPEN.len());
                self.text(&text, &mut out);
                self.pending.clear();
                self.in_call = true;
            } else {
                // Keep a suffix that could begin `<tool_call>`.
                let keep = (1..OPEN.len()).rev().find(|&n| self.held.ends_with(&OPEN[..n])).unwrap_or(0);
                let text: String = self.held.drain(..self.held.len() - keep).collect();
                self.text(&text, &mut out);
                return out;
            }
        }
    }

    /// The end of the answer: held text is content, an unclosed block is a call when its
    /// body parses (vLLM's parser reads one at the end) and content otherwise; whitespace
    /// after the last call is dropped.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        let held = std::mem::take(&mut self.held);
        if std::mem::take(&mut self.in_call) {
            self.close(&held, false, &mut out);
        } else {
            self.text(&held, &mut out);
        }
        out
    }

    /// Text outside blocks: content before the first call; after one, whitespace is held.
    fn text(&mut self, text: &str, out: &mut Parsed) {
        if self.calls == 0 || !text.trim().is_empty() {
            out.content.push_str(&std::mem::take(&mut self.pending));
            out.content.push_str(text);
        } else {
            self.pending.push_str(text);
        }
    }

    /// A block's end: a call, or its text as written when it does not parse.
    fn close(&mut self, body: &str, closed: bool, out: &mut Parsed) {
        match ParsedCall::parse(body) {
            Some(call) => {
                if self.parallel || self.calls == 0 {
                    out.calls.push(call);
                }
                self.calls += 1;
            }
            None => {
                let raw = format!("{OPEN}{body}{}", if closed { CLOSE } else { "" });
                self.text(&raw, out);
            }
        }
    }

    /// A whole answer's content and calls.
    pub fn split(text: &str, parallel: bool) -> Parsed {
        let mut s = Self::new(parallel);
        let mut p = s.push(text);
        let end = s.finish();
        p.content.push_str(&end.content);
        p.calls.extend(end.calls);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: &str) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: arguments.into() }
    }

    /// Whole answers, and the same answers streamed in every split into two deltas and one
    /// character at a time: the parts add up to the whole answer's. Expected values written
    /// by hand from vLLM's hermes parser's rules (arguments as `json.dumps` writes them).
    #[test]
    fn splits_whole_and_streamed_answers_alike() {
        let check = |text: &str, parallel: bool, content: &str, calls: Vec<ParsedCall>| {
            let want = Parsed { content: content.into(), calls };
            assert_eq!(ToolSplitter::split(text, parallel), want, "{text:?}");
            let cuts: Vec<Vec<usize>> = (0..=text.len())
                .filter(|&i| text.is_char_boundary(i))
                .map(|i| vec![i])
                .chain([text.char_indices().map(|(i, _)| i).collect()])
                .collect();
            for cut in cuts {
                let mut s = ToolSplitter::new(parallel);
                let (mut got, mut last) = (Parsed::default(), 0);
                for &at in cut.iter().chain([&text.len()]) {
                    let p = s.push(&text[last..at]);
                    got.content.push_str(&p.content);
                    got.calls.extend(p.calls);
                    last = at;
                }
                let p = s.finish();
                got.content.push_str(&p.content);
                got.calls.extend(p.calls);
                assert_eq!(got, want, "{text:?} cut at {cut:?}");
            }
        };
        let a = r#"<tool_call>
{"name": "get_weather", "arguments": {"city":"Zürich","days":[1,2.0]}}
</tool_call>"#;
        let weather = call("get_weather", r#"{"city": "Zürich", "days": [1, 2.0]}"#);
        check("Just text.", true, "Just text.", vec![]);
        check(a, true, "", vec![weather.clone()]);
        check(&format!("Let me look.\n{a}\n{a}\n"), true, "Let me look.\n", vec![weather.clone(), weather.clone()]);
        check(&format!("{a}\n{a}"), false, "", vec![weather.clone()]);
        check(&format!("{a}\nDone."), true, "\nDone.", vec![weather.clone()]);
        check("<tool_call>{\"name\": \"now\", \"arguments\": {}}", true, "", vec![call("now", "{}")]);
        check("<tool_call>not json</tool_call> tail", true, "<tool_call>not json</tool_call> tail", vec![]);
        check("<tool_call>{\"arguments\": {}}</tool_call>", true, "<tool_call>{\"arguments\": {}}</tool_call>", vec![]);
        check("<tool_call>{\"name\": 1", true, "<tool_call>{\"name\": 1", vec![]);
        check("a <tool_", true, "a <tool_", vec![]);
        check("<tool_call>{\"name\": \"f\", \"arguments\": \"x\"}</tool_call>", true, "", vec![call("f", "\"x\"")]);
    }

    #[test]
    fn tool_choice_follows_openai_and_vllm() {
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})];
        let hermes = Some(ToolParser::Hermes);
        let ok = |t: Option<&[Value]>, c: Option<Value>, p| tool_choice(t, c.as_ref(), p, hermes).unwrap();
        assert_eq!(ok(Some(&tools), None, None), ToolChoice::Auto { parallel: true });
        assert_eq!(ok(Some(&tools), Some(json!("auto")), Some(false)), ToolChoice::Auto { parallel: false });
        assert_eq!(ok(Some(&tools), Some(json!("none")), None), ToolChoice::None);
        assert_eq!(ok(None, None, None), ToolChoice::None);
        assert_eq!(ok(None, Some(json!("none")), None), ToolChoice::None);
        let err = |t: Option<&[Value]>, c: Option<Value>, parser| {
            let e = tool_choice(t, c.as_ref(), None, parser).unwrap_err();
            let v = e.envelope();
            (v["error"]["param"].as_str().unwrap().to_string(), v["error"]["message"].as_str().unwrap().to_string())
        };
        let (p, m) = err(Some(&tools), None, None);
        assert_eq!(p, "tool_choice");
        assert!(m.contains("--tool-call-parser hermes"), "{m}");
        assert!(err(Some(&tools), Some(json!("required")), hermes).1.contains("guided decoding"));
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert!(err(Some(&tools), Some(named), hermes).1.contains("guided decoding"));
        assert!(err(None, Some(json!("auto")), hermes).1.contains("needs `tools`"));
        assert!(err(Some(&tools), Some(json!("sometimes")), hermes).1.contains("\"sometimes\""));
        let bad = [json!({"type": "function", "function": {"name": "f", "parameters": []}})];
        assert_eq!(err(Some(&bad), None, hermes).0, "tools[0].function.parameters");
        let bad = [json!({"type": "code", "function": {"name": "f"}})];
        assert_eq!(err(Some(&bad), None, hermes).0, "tools[0].type");
        let bad = [json!({"type": "function", "function": {"description": "d"}})];
        let (p, m) = err(Some(&bad), None, hermes);
        assert_eq!(p, "tools[0].function.name", "{m}");
    }
}
