//! Tool calling on `/v1/chat/completions` (OpenAI's `tools` / `tool_choice` /
//! `parallel_tool_calls`, vLLM's `--tool-call-parser`).
//!
//! Request side: `tools` reach the chat template as given (HF `apply_chat_template(tools=…)`);
//! a template that does not render tools refuses them. `tool_choice: "none"` renders them and
//! returns text; `"auto"` (the default with tools) also parses the answer, which needs
//! `serve --tool-call-parser hermes`. `"required"` and a named function would need guided
//! decoding to force a call, which rlserve does not have: a 400 says so.
//!
//! Answer side, two of vLLM's parsers; in both a call's `arguments` is the object written
//! back as Python's `json.dumps` writes it:
//! - `hermes` (Qwen2.5, Qwen3, Hermes): each `<tool_call>{"name": …, "arguments": …}</tool_call>`
//!   block becomes a call; text before the first call is `content` (`null` when empty),
//!   whitespace between and after calls is dropped, other text stays content, and a block
//!   that is not such JSON stays content as written.
//! - `llama3_json` (Llama 3.1–3.3): an answer that opens with `{` (or `<|python_tag|>`) and is
//!   nothing but JSON objects `{"name": …, "parameters": …}` (or `"arguments"`) separated by
//!   `;` is calls and no content; any other answer is all content. Such an answer is held
//!   until it ends, since only the end tells.
//!
//! One [`ToolSplitter`] does it for whole answers and streams alike, so a streamed answer's
//! deltas add up to the whole message. Token ids, log-probs and what feedback trains on are
//! the generated tokens, calls included.

use super::body::typed_at;
use super::error::ApiError;
use serde::Deserialize;
use serde_json::{json, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
/// Llama 3.1's marker before a call (in the text when special tokens are not skipped).
const PYTHON_TAG: &str = "<|python_tag|>";

/// The parsers `--tool-call-parser` accepts (vLLM's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolParser {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen2.5, Qwen3, Hermes 2/3).
    Hermes,
    /// A whole answer of `{"name": …, "parameters": {…}}` objects (Llama 3.1–3.3).
    #[value(name = "llama3_json")]
    Llama3Json,
}

/// One tool definition of `tools`, checked (the template gets the JSON as given, other
/// members included: nothing is dropped, so none is refused).
#[derive(Debug, Deserialize)]
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
    /// Parse calls out of the answer with `parser`; `parallel` false keeps the first call only.
    Auto { parser: ToolParser, parallel: bool },
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
    let tools = tools.filter(|t| !t.is_empty()); // `[]` is no tools (vLLM's reading)
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
        ("auto", true) => match parser {
            Some(parser) => Ok(ToolChoice::Auto { parser, parallel: parallel.unwrap_or(true) }),
            None => Err(bad(
                "\"auto\" tool choice needs a tool-call parser: start the server with `--tool-call-parser hermes` \
                 (or `llama3_json`), or send `tool_choice: \"none\"`",
            )),
        },
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

    /// A Hermes block's body as a call: a JSON object with a string `name` and an `arguments`.
    fn parse(body: &str) -> Option<Self> {
        Self::from_value(&serde_json::from_str(body.trim()).ok()?, "arguments")
    }

    /// A call object: a string `name` and the arguments under `key`.
    fn from_value(v: &Value, key: &str) -> Option<Self> {
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = engine::chat_template::py_json(v.get(key)?, None);
        Some(Self { name, arguments })
    }

    /// A whole `llama3_json` answer as calls: `<|python_tag|>`? then JSON objects, each with a
    /// `name` and `parameters` (or `arguments`), separated by `;` and whitespace. `None` when
    /// the answer is anything else.
    fn parse_llama3(text: &str) -> Option<Vec<Self>> {
        let text = text.trim_start();
        let mut rest = text.strip_prefix(PYTHON_TAG).unwrap_or(text).trim_start();
        let mut calls = vec![];
        while !rest.is_empty() {
            if !calls.is_empty() {
                rest = rest.strip_prefix(';')?.trim_start();
            }
            let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
            let v = values.next()?.ok()?;
            let key = if v.get("parameters").is_some() { "parameters" } else { "arguments" };
            calls.push(Self::from_value(&v, key)?);
            rest = rest[values.byte_offset()..].trim_start();
        }
        (!calls.is_empty()).then_some(calls)
    }
}

/// Where a `llama3_json` answer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Llama3 {
    /// Only whitespace or the beginning of `<|python_tag|>` so far.
    Start,
    /// It opened like a call: held to the end.
    Held,
    /// It did not: content, streamed.
    Content,
}

/// What one step of a [`ToolSplitter`] produced: content text and completed calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// An incremental parser of one answer's content. Hermes: text that could still begin a
/// `<tool_call>`, an open block, and whitespace after a call are held until they are placed.
/// `llama3_json`: an answer that opens like a call is held to its end.
#[derive(Debug, Clone)]
pub struct ToolSplitter {
    parser: ToolParser,
    llama3: Llama3,
    parallel: bool,
    held: String,
    in_call: bool,
    /// Calls found so far (parallel or not).
    calls: usize,
    /// Whitespace after a call: dropped unless other text follows.
    pending: String,
}

impl ToolSplitter {
    pub fn new(parser: ToolParser, parallel: bool) -> Self {
        let held = String::new();
        Self { parser, llama3: Llama3::Start, parallel, held, in_call: false, calls: 0, pending: String::new() }
    }

    /// Whether a call was found.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// Takes the next content delta.
    pub fn push(&mut self, delta: &str) -> Parsed {
        self.held.push_str(delta);
        if self.parser == ToolParser::Llama3Json {
            return self.push_llama3();
        }
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
        if self.parser == ToolParser::Llama3Json {
            match ParsedCall::parse_llama3(&held).filter(|_| self.llama3 == Llama3::Held) {
                Some(calls) => {
                    self.calls = calls.len();
                    out.calls = calls.into_iter().take(if self.parallel { usize::MAX } else { 1 }).collect();
                }
                None => out.content = held,
            }
            return out;
        }
        if std::mem::take(&mut self.in_call) {
            self.close(&held, false, &mut out);
        } else {
            self.text(&held, &mut out);
        }
        out
    }

    /// `llama3_json`: hold the answer while its start could open a call and, once it does,
    /// to its end; otherwise it is content from then on.
    fn push_llama3(&mut self) -> Parsed {
        let mut out = Parsed::default();
        if self.llama3 == Llama3::Start {
            let start = self.held.trim_start();
            if start.starts_with('{') || start.starts_with(PYTHON_TAG) {
                self.llama3 = Llama3::Held;
            } else if !start.is_empty() && !PYTHON_TAG.starts_with(start) {
                self.llama3 = Llama3::Content;
            }
        }
        if self.llama3 == Llama3::Content {
            out.content = std::mem::take(&mut self.held);
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

    /// A whole answer's content and calls (the tests' reference for streamed answers).
    #[cfg(test)]
    pub fn split(text: &str, parser: ToolParser, parallel: bool) -> Parsed {
        let mut s = Self::new(parser, parallel);
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
        check_parser(ToolParser::Hermes);
        check_parser(ToolParser::Llama3Json);
    }

    fn check_parser(parser: ToolParser) {
        let check = |text: &str, parallel: bool, content: &str, calls: Vec<ParsedCall>| {
            let want = Parsed { content: content.into(), calls };
            assert_eq!(ToolSplitter::split(text, parser, parallel), want, "{text:?}");
            for cut in crate::api::reasoning::stream_cuts(text) {
                let mut s = ToolSplitter::new(parser, parallel);
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
        if parser == ToolParser::Llama3Json {
            let weather = call("get_weather", r#"{"city": "Zürich", "days": [1, 2.0]}"#);
            let a = r#"{"name": "get_weather", "parameters": {"city":"Zürich","days":[1,2.0]}}"#;
            check(a, true, "", vec![weather.clone()]);
            check(&format!(" <|python_tag|>{a}; {a}\n"), true, "", vec![weather.clone(), weather.clone()]);
            check(&format!("{a};{a}"), false, "", vec![weather.clone()]);
            check("{\"name\": \"now\", \"arguments\": {}}", true, "", vec![call("now", "{}")]);
            check(
                "Just text {\"name\": \"now\", \"arguments\": {}}",
                true,
                "Just text {\"name\": \"now\", \"arguments\": {}}",
                vec![],
            );
            check(&format!("{a} and more"), true, &format!("{a} and more"), vec![]);
            check("{\"name\": \"f\"}", true, "{\"name\": \"f\"}", vec![]);
            check(&format!("{a} {a}"), true, &format!("{a} {a}"), vec![]);
            check("<|python_ta", true, "<|python_ta", vec![]);
            check("  ", true, "  ", vec![]);
            return;
        }
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
        assert_eq!(ok(Some(&tools), None, None), ToolChoice::Auto { parser: ToolParser::Hermes, parallel: true });
        assert_eq!(
            ok(Some(&tools), Some(json!("auto")), Some(false)),
            ToolChoice::Auto { parser: ToolParser::Hermes, parallel: false }
        );
        assert_eq!(ok(Some(&tools), Some(json!("none")), None), ToolChoice::None);
        assert_eq!(ok(None, None, None), ToolChoice::None);
        assert_eq!(ok(Some(&[]), None, None), ToolChoice::None, "`[]` is no tools");
        let extra = [json!({"type": "function", "function": {"name": "f", "examples": []}, "cache": 1})];
        assert_eq!(ok(Some(&extra), Some(json!("none")), None), ToolChoice::None, "passed through as given");
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
