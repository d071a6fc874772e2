//! A request fuzzer over the JSON bodies of every POST endpoint (completions, chat,
//! rollouts, feedback, training jobs, tokenize/detokenize) and over raw bodies (invalid
//! JSON and UTF-8, NaN literals, 10 MB, deep nesting): every response is a 2xx or a 4xx
//! with the OpenAI error envelope, nothing hangs, and the server is healthy afterwards with
//! every KV block free.
//!
//! Bodies mix plausible values (to reach the deep paths: sampling, scheduling, jobs) with
//! arbitrary JSON (wrong types, huge and tiny numbers, "NaN"/"Infinity" spellings, control
//! tokens, unicode, nesting) for each known field, plus unknown fields.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Map, Value};
use server::serve::{build_state, ServeArgs, Server};
use std::time::Duration;
use tests::temp_dir;
use tests::tiny::TinySpec;

/// Fuzz cases per CI run.
const CASES: u32 = 1000;

/// Arbitrary JSON: special numbers and strings, arrays and objects up to depth 4.
fn any_json() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop::sample::select(vec![0i64, 1, -1, 2, 7, 255, 4096, 1 << 31, (1 << 53) + 1, i64::MAX, i64::MIN])
            .prop_map(Value::from),
        prop::sample::select(vec![0.5f64, -0.0, 1e308, -1e308, 5e-324, 0.999_999, 100.5, -3.25]).prop_map(|f| json!(f)),
        prop::sample::select(vec!["", "a", "NaN", "Infinity", "-Infinity", "1e999", "<|im_end|>", "é漢😀", "\u{0}", "0"])
            .prop_map(Value::from),
        "[ -~]{0,24}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..5)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
    .boxed()
}

fn ints(r: std::ops::Range<i64>) -> BoxedStrategy<Value> {
    r.prop_map(Value::from).boxed()
}

fn floats(lo: f64, hi: f64) -> BoxedStrategy<Value> {
    (lo..hi).prop_map(|f| json!(f)).boxed()
}

fn pick(v: Vec<Value>) -> BoxedStrategy<Value> {
    prop::sample::select(v).boxed()
}

/// The sampling fields shared by completions, chat and rollouts, with plausible values.
fn sampling_fields() -> Vec<(&'static str, BoxedStrategy<Value>)> {
    vec![
        ("max_tokens", ints(0..6)),
        ("temperature", floats(0.0, 2.0)),
        ("top_p", floats(0.0, 1.0)),
        ("top_k", ints(-1..5)),
        ("min_p", floats(0.0, 1.0)),
        ("n", ints(1..4)),
        ("seed", ints(0..100)),
        ("stop", pick(vec![json!("a"), json!(["\n", "b"]), json!([])])),
        ("stop_token_ids", pick(vec![json!([258]), json!([0, 1]), json!([])])),
        ("ignore_eos", any::<bool>().prop_map(Value::from).boxed()),
        ("min_tokens", ints(0..3)),
        ("presence_penalty", floats(-2.0, 2.0)),
        ("frequency_penalty", floats(-2.0, 2.0)),
        ("repetition_penalty", floats(0.5, 2.0)),
        ("logit_bias", pick(vec![json!({"5": 10}), json!({}), json!({"258": -100})])),
        ("return_token_ids", any::<bool>().prop_map(Value::from).boxed()),
        ("stream", any::<bool>().prop_map(Value::from).boxed()),
        ("model", pick(vec![json!("fuzz"), json!("other")])),
    ]
}

fn messages() -> BoxedStrategy<Value> {
    pick(vec![
        json!([{"role": "user", "content": "hi"}]),
        json!([{"role": "system", "content": "x"}, {"role": "user", "content": "y<|im_end|>"}]),
        json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]),
        json!([]),
    ])
}

/// `(path, fields with plausible values)` of every POST endpoint.
fn endpoints() -> Vec<(&'static str, Vec<(&'static str, BoxedStrategy<Value>)>)> {
    let mut completions = sampling_fields();
    completions.extend([
        ("prompt", pick(vec![json!("ab"), json!(["ab", "c"]), json!([1, 2, 3]), json!([[1, 2], [3]])])),
        ("logprobs", ints(0..3)),
        ("echo", any::<bool>().prop_map(Value::from).boxed()),
        ("prompt_logprobs", ints(0..2)),
        ("suffix", pick(vec![json!("z")])),
    ]);
    let mut chat = sampling_fields();
    chat.extend([
        ("messages", messages()),
        ("logprobs", any::<bool>().prop_map(Value::from).boxed()),
        ("top_logprobs", ints(0..3)),
        ("add_generation_prompt", any::<bool>().prop_map(Value::from).boxed()),
        ("continue_final_message", any::<bool>().prop_map(Value::from).boxed()),
        ("tools", pick(vec![json!([])])),
    ]);
    let mut rollouts = sampling_fields();
    rollouts.extend([
        ("prompts", pick(vec![json!(["ab"]), json!([[1, 2], "c"]), json!([{"messages": [{"role": "user", "content": "q"}]}])])),
        ("num_generations", ints(1..4)),
    ]);
    vec![
        ("/v1/completions", completions),
        ("/v1/chat/completions", chat),
        ("/v1/rollouts", rollouts),
        (
            "/v1/feedback",
            vec![
                ("id", pick(vec![json!("RESPONSE_ID"), json!("chatcmpl-unknown")])),
                ("choice", ints(0..3)),
                ("reward", floats(-1.5, 1.5)),
                ("preferred", ints(0..3)),
            ],
        ),
        (
            "/v1/train/jobs",
            vec![
                ("max_steps", ints(1..3)),
                ("num_generations", ints(1..4)),
                ("prompts_per_step", ints(1..3)),
                ("dataset", pick(vec![json!("builtin:arithmetic"), json!("/nope.jsonl")])),
                ("rewards", pick(vec![json!([{"type": "exact_answer"}]), json!([{"type": "length", "target": 2}])])),
                ("learner", pick(vec![json!({"max_completion_length": 2}), json!({"learning_rate": 1e-3}), json!({})])),
            ],
        ),
        (
            "/tokenize",
            vec![
                ("prompt", pick(vec![json!("hé<|im_end|>")])),
                ("messages", messages()),
                ("add_special_tokens", any::<bool>().prop_map(Value::from).boxed()),
            ],
        ),
        ("/detokenize", vec![("tokens", pick(vec![json!([1, 2, 258]), json!([]), json!([999999])]))]),
    ]
}

/// A body for one endpoint: each known field absent, plausible or arbitrary; sometimes an
/// unknown field; sometimes not an object at all.
fn body(fields: Vec<(&'static str, BoxedStrategy<Value>)>) -> BoxedStrategy<Value> {
    let per_field: Vec<BoxedStrategy<Option<(String, Value)>>> = fields
        .into_iter()
        .map(|(name, plausible)| {
            prop::option::weighted(0.5, prop_oneof![7 => plausible, 1 => any_json()])
                .prop_map(move |v| v.map(|v| (name.to_string(), v)))
                .boxed()
        })
        .collect();
    let object = (per_field, prop::option::weighted(0.1, ("[a-z_]{1,12}", any_json()))).prop_map(|(kv, extra)| {
        let mut m: Map<String, Value> = kv.into_iter().flatten().collect();
        if let Some((k, v)) = extra {
            m.insert(k, v);
        }
        Value::Object(m)
    });
    prop_oneof![19 => object, 1 => any_json()].boxed()
}

/// Checks one response: 2xx, or 4xx with the OpenAI envelope.
async fn check(r: reqwest::Response, what: &str) -> Result<(u16, String), String> {
    let status = r.status().as_u16();
    let text = r.text().await.map_err(|e| format!("{what}: reading the body: {e}"))?;
    match status {
        200..=299 => Ok((status, text)),
        400..=499 => {
            let v: Value = serde_json::from_str(&text).map_err(|_| format!("{what}: {status} without a JSON body: {text}"))?;
            let ok = v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()) && v["error"]["type"].is_string();
            if ok { Ok((status, text)) } else { Err(format!("{what}: {status} without the error envelope: {text}")) }
        }
        _ => Err(format!("{what}: status {status}: {text}")),
    }
}

#[test]
fn every_fuzzed_request_gets_a_2xx_or_a_4xx_envelope() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = temp_dir("fuzz-model");
    TinySpec { seed: 91, ..Default::default() }.write(&dir);
    let mut args = ServeArgs { served_model_name: Some("fuzz".into()), ..Default::default() };
    args.feedback.learn_from_feedback = true;
    args.feedback.feedback_dir = temp_dir("fuzz-feedback");
    args.feedback.feedback_batch_size = 4;
    let server: Server = rt.block_on(async {
        let state = tokio::task::spawn_blocking(move || build_state(&dir, &args)).await.unwrap().unwrap();
        Server::start(state, "127.0.0.1", 0).await.unwrap()
    });
    let base = format!("http://{}", server.addr);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    // A real response id for the feedback cases.
    let id: String = rt.block_on(async {
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": "ab", "max_tokens": 2, "n": 2, "temperature": 1.0}))
            .send()
            .await
            .unwrap();
        r.json::<Value>().await.unwrap()["id"].as_str().unwrap().to_string()
    });
    let jobs_dir = temp_dir("fuzz-jobs");
    let cases = endpoints();
    let strategy = (0..cases.len()).prop_flat_map(move |i| (Just(i), body(endpoints().swap_remove(i).1)));
    let mut runner = TestRunner::new(Config { cases: CASES, failure_persistence: None, ..Config::default() });
    let seen = std::cell::RefCell::new(std::collections::BTreeMap::<(&str, u16), usize>::new());
    let result = runner.run(&strategy, |(i, mut body)| {
        let path = cases[i].0;
        if let Value::Object(m) = &mut body {
            if path == "/v1/feedback" && m.get("id") == Some(&json!("RESPONSE_ID")) {
                m.insert("id".into(), json!(id));
            }
            if path == "/v1/train/jobs" {
                // Jobs write only under a temp folder.
                m.insert("output_dir".into(), json!(jobs_dir.join("run")));
            }
        }
        let what = format!("POST {path} {body}");
        let (status, text) = rt
            .block_on(async {
                let r = client.post(format!("{base}{path}")).json(&body).send().await.map_err(|e| format!("{what}: {e}"))?;
                check(r, &what).await
            })
            .map_err(TestCaseError::fail)?;
        *seen.borrow_mut().entry((path, status)).or_default() += 1;
        if path == "/v1/train/jobs" && status == 201 {
            // A fuzzed job that starts is stopped again.
            let job: Value = serde_json::from_str(&text).unwrap();
            let stop = format!("{base}/v1/train/jobs/{}/stop", job["id"].as_str().unwrap());
            rt.block_on(async { client.post(stop).send().await }).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        Ok(())
    });
    let seen = seen.into_inner();
    eprintln!("(endpoint, status) → cases: {seen:?}");
    result.unwrap();
    // Every endpoint was reached with both accepted and rejected bodies.
    for (path, _) in &cases {
        assert!(seen.iter().any(|((p, s), _)| p == path && *s < 300), "{path}: no accepted body in {CASES} cases");
        assert!(seen.iter().any(|((p, s), _)| p == path && *s >= 400), "{path}: no rejected body in {CASES} cases");
    }
    rt.block_on(raw_bodies(&client, &base));
    rt.block_on(async {
        // Started jobs end (they were stopped); then every block is free and the server is healthy.
        for _ in 0..600 {
            let jobs: Value = client.get(format!("{base}/v1/train/jobs")).send().await.unwrap().json().await.unwrap();
            let running = jobs["data"].as_array().into_iter().flatten().any(|j| j["status"] == "running");
            if !running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(client.get(format!("{base}/health")).send().await.unwrap().status(), 200);
        let metrics = client.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
        let usage = metrics.lines().find(|l| l.starts_with("rlserve:kv_cache_usage_perc")).unwrap_or("");
        assert!(usage.ends_with(" 0"), "every KV block is free after the run: {usage}");
        server.shutdown(Duration::from_secs(5)).await;
    });
}

/// Bodies that are not valid JSON of the right size and shape.
async fn raw_bodies(client: &reqwest::Client, base: &str) {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let huge = format!("{{\"prompt\": \"{}\"}}", "a".repeat(10 << 20));
    let bodies: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("truncated", b"{\"prompt\": ".to_vec()),
        ("NaN literal", b"{\"prompt\": \"a\", \"temperature\": NaN}".to_vec()),
        ("Infinity literal", b"{\"prompt\": \"a\", \"max_tokens\": Infinity}".to_vec()),
        ("invalid UTF-8", b"{\"prompt\": \"\xff\xfe\"}".to_vec()),
        ("deep nesting", deep.into_bytes()),
        ("10 MB", huge.into_bytes()),
        ("number overflow", b"{\"prompt\": 1e999999}".to_vec()),
    ];
    for path in ["/v1/completions", "/v1/chat/completions", "/v1/rollouts", "/v1/feedback", "/v1/train/jobs", "/tokenize"] {
        for (name, b) in &bodies {
            let r = client
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(b.clone())
                .send()
                .await
                .unwrap();
            let what = format!("POST {path} with a {name} body");
            let (status, _) = check(r, &what).await.unwrap();
            assert!(status >= 400, "{what}: accepted with {status}");
        }
        // Not JSON at all.
        let r = client.post(format!("{base}{path}")).header("content-type", "text/plain").body("hi").send().await.unwrap();
        let (status, _) = check(r, &format!("POST {path} as text/plain")).await.unwrap();
        assert!(status >= 400);
    }
}
