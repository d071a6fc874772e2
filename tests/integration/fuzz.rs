//! The request fuzzer: property-based bodies (proptest) for completions, chat, rollouts,
//! feedback, jobs, tokenize, detokenize and checkpoints — valid templates with fields set to
//! wrong types, huge or negative numbers, special-token strings, nested junk, unknown keys,
//! and raw corruptions (truncation, invalid UTF-8, NaN/Infinity spellings) — then fixed
//! extremes (a 10 MB body, 100 000 levels of nesting). The request's headers are fuzzed too:
//! `Content-Type` (JSON with and without parameters, `text/plain`, form, none, junk), `Host`
//! (the server's own, `localhost`, a rebinding name, empty) and `Origin` (none, the server's
//! own, foreign, `null`); paths and sizes come through the values (`/`, `../x`, `/dev/zero`,
//! huge counts). Every answer is 2xx or a 4xx OpenAI envelope, never 5xx; a request a
//! browser could send cross-site (not JSON, a foreign `Origin` or `Host`) is never 2xx; and
//! the server keeps answering. `RLSERVE_FUZZ_CASES` sets the number of cases (default 1000,
//! seeded, so a CI run is reproducible).

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde_json::{json, Value};
use std::time::Duration;

/// Numbers at and beyond every limit, and small ones that make valid requests.
fn number() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => (-2i64..9).prop_map(Value::from),
        1 => (-3.0f64..3.0).prop_map(Value::from),
        1 => prop::sample::select(vec![
            json!(u64::MAX), json!(i64::MIN), json!(1e308), json!(-1e308), json!(5e-324), json!(0.5),
            json!(20), json!(21), json!(100), json!(101), json!(256), json!(257), json!(258), json!(259),
            json!(4097), json!(1u64 << 53), json!(-0.0), json!(u32::MAX),
        ]),
    ]
    .boxed()
}

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        "[a-z ]{0,6}",
        prop::sample::select(vec![
            "",
            "<|im_start|>system\n",
            "<|im_end|>",
            "\u{E000}0\u{E001}",
            "🍕é",
            "user",
            "assistant",
            "latest",
            "builtin:arithmetic",
            "text",
            "../x",
            "/",
            "/dev/zero",
            "/etc/passwd",
            "\u{0}",
        ])
        .prop_map(String::from),
        "\\PC{0,10}",
    ]
    .boxed()
}

fn json_value() -> BoxedStrategy<Value> {
    let leaf =
        prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::from), number(), text().prop_map(Value::from)];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::btree_map(text(), inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
    .boxed()
}

/// `(path, a valid body, the fields to mutate)`.
fn endpoints(root: &str) -> Vec<(&'static str, Value, Vec<&'static str>)> {
    let sampling = [
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "prompt_logprobs",
        "logit_bias",
        "stream",
        "stream_options",
        "user",
        "return_token_ids",
        "model",
        "tools",
        "response_format",
    ];
    let with = |own: &[&'static str]| own.iter().chain(&sampling).copied().collect::<Vec<_>>();
    vec![
        (
            "/v1/completions",
            json!({"prompt": "ab", "max_tokens": 4}),
            with(&["prompt", "max_tokens", "logprobs", "echo", "add_special_tokens", "suffix"]),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            with(&[
                "messages",
                "max_tokens",
                "max_completion_tokens",
                "logprobs",
                "top_logprobs",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "chat_template_kwargs",
            ]),
        ),
        (
            "/v1/rollouts",
            json!({"prompts": ["ab", [1, 2]], "num_generations": 2, "max_tokens": 4}),
            with(&["prompts", "num_generations", "max_tokens", "apply_chat_template"]),
        ),
        (
            "/v1/feedback",
            json!({"id": "cmpl-0", "choice": 0, "reward": 0.5}),
            vec!["id", "choice", "reward", "preferred", "x"],
        ),
        // The dataset never exists and the output folder is fixed: no job ever starts.
        (
            "/v1/train/jobs",
            json!({"dataset": format!("{root}/missing.jsonl"), "output_dir": format!("{root}/job"), "max_steps": 1}),
            vec![
                "num_generations",
                "prompts_per_step",
                "max_steps",
                "seed",
                "top_p",
                "top_k",
                "min_p",
                "stop",
                "learner",
                "rewards",
                "eval_interval",
                "save_steps",
                "apply_chat_template",
                "system_prompt",
                "x",
            ],
        ),
        (
            "/tokenize",
            json!({"prompt": "ab"}),
            vec![
                "prompt",
                "messages",
                "add_special_tokens",
                "add_generation_prompt",
                "continue_final_message",
                "chat_template_kwargs",
                "model",
            ],
        ),
        ("/detokenize", json!({"tokens": [1, 2]}), vec!["tokens", "model"]),
        ("/v1/checkpoints", json!({"path": "c"}), vec!["path"]),
    ]
}

/// How the serialized body is damaged.
#[derive(Debug, Clone)]
enum Damage {
    None,
    Truncate(usize),
    InvalidUtf8(usize),
    NonFinite(&'static str),
    Whole(Value),
}

fn damage() -> BoxedStrategy<Damage> {
    prop_oneof![
        12 => Just(Damage::None),
        1 => any::<usize>().prop_map(Damage::Truncate),
        1 => any::<usize>().prop_map(Damage::InvalidUtf8),
        1 => prop::sample::select(vec!["NaN", "Infinity", "-Infinity", "1e999", "nan"]).prop_map(Damage::NonFinite),
        1 => json_value().prop_map(Damage::Whole),
    ]
    .boxed()
}

/// The request's `Content-Type`, `Host` and `Origin` (`None`: not sent; `Host` `None`: the
/// server's address as reqwest sends it; `"SELF"`: the server's own origin).
#[derive(Debug, Clone)]
struct Headers {
    content_type: Option<&'static str>,
    host: Option<&'static str>,
    origin: Option<&'static str>,
}

impl Headers {
    /// Whether the server must refuse it (403 or 415) on every route it fuzzes: a body that is
    /// not JSON, a foreign `Origin`, or a `Host` that is not the server's.
    fn hostile(&self) -> bool {
        let json = self.content_type.is_some_and(|c| c.starts_with("application/json"));
        let host_ok = self.host.is_none_or(|h| h == "localhost");
        let origin_ok = self.origin.is_none_or(|o| o == "SELF");
        !(json && host_ok && origin_ok)
    }
}

fn headers() -> BoxedStrategy<Headers> {
    let ct = prop::sample::select(vec![
        Some("application/json"),
        Some("application/json; charset=utf-8"),
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
        None,
    ]);
    let host = prop::sample::select(vec![None, Some("localhost"), Some("rebind.example"), Some("")]);
    let origin = prop::sample::select(vec![None, Some("SELF"), Some("http://evil.example"), Some("null")]);
    prop_oneof![
        8 => Just(Headers { content_type: Some("application/json"), host: None, origin: None }),
        2 => (ct, host, origin).prop_map(|(content_type, host, origin)| Headers { content_type, host, origin }),
    ]
    .boxed()
}

/// One case: the endpoint, `(field index, new value or removal)` edits, the damage and the
/// headers.
type Case = (usize, Vec<(usize, Option<Value>)>, Damage, Headers);

fn body(template: &Value, fields: &[&str], edits: &[(usize, Option<Value>)], damage: &Damage) -> Vec<u8> {
    let mut v = template.clone();
    for (i, new) in edits {
        let key = fields[i % fields.len()];
        match new {
            Some(x) => v[key] = x.clone(),
            None => {
                v.as_object_mut().unwrap().remove(key);
            }
        }
    }
    let mut bytes = serde_json::to_vec(&v).unwrap();
    match damage {
        Damage::None => {}
        Damage::Truncate(at) => bytes.truncate(at % bytes.len().max(1)),
        Damage::InvalidUtf8(at) => {
            // Inside a string when there is one: after the first quote past `at`.
            let q = bytes.iter().enumerate().skip(at % bytes.len().max(1)).find(|(_, &b)| b == b'"').map(|(i, _)| i);
            bytes.insert(q.map_or(0, |i| i + 1), 0xFF);
        }
        Damage::NonFinite(s) => {
            let text = String::from_utf8(bytes.clone()).unwrap();
            bytes = text.replacen(": 4", &format!(": {s}"), 1).replacen(":4", &format!(":{s}"), 1).into_bytes();
        }
        Damage::Whole(w) => bytes = serde_json::to_vec(w).unwrap(),
    }
    bytes
}

/// The JSON headers every fixed request sends.
const JSON: Headers = Headers { content_type: Some("application/json"), host: None, origin: None };

/// Sends `bytes` to `path` with `h`; `Err` unless the answer is 2xx or a well-formed 4xx
/// envelope, and unless a hostile request ([`Headers::hostile`]) is refused.
async fn check(c: &reqwest::Client, base: &str, path: &str, bytes: Vec<u8>, h: &Headers) -> Result<u16, String> {
    let shown = format!("{h:?} {}", String::from_utf8_lossy(&bytes[..bytes.len().min(300)]));
    let mut req = c.post(format!("{base}{path}")).body(bytes);
    if let Some(ct) = h.content_type {
        req = req.header("content-type", ct);
    }
    if let Some(host) = h.host {
        req = req.header("host", host);
    }
    if let Some(o) = h.origin {
        req = req.header("origin", if o == "SELF" { base } else { o });
    }
    let r = req.send().await.map_err(|e| format!("{path} {shown}: no answer: {e}"))?;
    let status = r.status().as_u16();
    let text = r.text().await.map_err(|e| format!("{path} {shown}: body cut: {e}"))?;
    if h.hostile() && !matches!(status, 403 | 415) {
        return Err(format!("{path} {shown}: a cross-site request answered {status}: {text}"));
    }
    match status {
        200..=299 => Ok(status),
        400..=499 => {
            let v: Value =
                serde_json::from_str(&text).map_err(|_| format!("{path} {shown}: {status} not JSON: {text}"))?;
            let e = &v["error"];
            let ok = e["message"].is_string()
                && e["type"].is_string()
                && e["code"] == json!(status)
                && e.get("param").is_some();
            ok.then_some(status).ok_or_else(|| format!("{path} {shown}: {status} without the envelope: {text}"))
        }
        _ => Err(format!("{path} {shown}: {status}: {text}")),
    }
}

#[test]
fn fuzzed_requests_get_2xx_or_a_4xx_envelope_and_the_server_stays_up() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let root = tests::temp_dir("fuzz");
    let mut a = crate::server::args("tiny-fuzz");
    a.feedback.learn_from_feedback = true;
    a.feedback.feedback_dir = root.join("feedback");
    a.feedback.feedback_batch_size = 1000;
    a.checkpoint_dir = Some(root.join("checkpoints"));
    let (s, base) = rt.block_on(crate::server::start(crate::server::tiny_dir("tiny-fuzz"), a));
    let c = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let eps = endpoints(&root.display().to_string());
    let cases: u32 = std::env::var("RLSERVE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let config = Config { cases, failure_persistence: None, max_shrink_iters: 200, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let edits = prop::collection::vec((any::<usize>(), prop::option::weighted(0.85, json_value())), 0..4);
    let strategy = (0..eps.len(), edits, damage(), headers());
    let statuses = std::sync::Mutex::new(std::collections::BTreeMap::<u16, usize>::new());
    let result = runner.run(&strategy, |(e, edits, damage, headers): Case| {
        let (path, template, fields) = &eps[e];
        let bytes = body(template, fields, &edits, &damage);
        let status = rt.block_on(check(&c, &base, path, bytes, &headers)).map_err(TestCaseError::fail)?;
        *statuses.lock().unwrap().entry(status).or_default() += 1;
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let statuses = statuses.into_inner().unwrap();
    eprintln!("fuzzer: {cases} cases, statuses {statuses:?}");
    assert!(
        statuses.keys().any(|s| (200..300).contains(s)) && [400, 403, 415].iter().all(|s| statuses.contains_key(s)),
        "{statuses:?}"
    );

    // Fixed extremes: 10 MB, deep nesting, invalid UTF-8, non-finite numbers, no JSON at all.
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(10 << 20));
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_obj = format!("{{\"prompt\": {}1{}}}", "{\"a\":".repeat(50_000), "}".repeat(50_000));
    let extremes: Vec<(&str, Vec<u8>, u16)> = vec![
        ("/v1/completions", big.into_bytes(), 413),
        ("/v1/chat/completions", deep.into_bytes(), 400),
        ("/v1/completions", deep_obj.into_bytes(), 400),
        ("/v1/completions", b"{\"prompt\": \"a\xff\xfe\"}".to_vec(), 400),
        ("/v1/completions", b"{\"prompt\": \"a\", \"temperature\": NaN}".to_vec(), 400),
        ("/v1/completions", b"{\"prompt\": \"a\", \"temperature\": Infinity}".to_vec(), 400),
        ("/v1/completions", b"{\"prompt\": \"a\", \"max_tokens\": 1e999}".to_vec(), 400),
        ("/v1/completions", vec![], 400),
        ("/v1/rollouts", b"null".to_vec(), 400),
    ];
    for (path, bytes, want) in extremes {
        let got = rt.block_on(check(&c, &base, path, bytes, &JSON)).unwrap();
        assert_eq!(got, want, "{path}");
    }
    let health = rt.block_on(async { c.get(format!("{base}/health")).send().await.unwrap().status() });
    assert_eq!(health, 200);
    let ok = rt.block_on(check(&c, &base, "/v1/completions", br#"{"prompt": "ab", "max_tokens": 2}"#.to_vec(), &JSON));
    assert_eq!(ok, Ok(200));
    rt.block_on(s.shutdown(Duration::from_secs(5)));
}
