//! The HTTP server over a real socket: endpoints, streaming = non-streaming, n and seeds,
//! logprobs, stop strings, disconnects, auth, limits, a table of bad requests, a failing
//! engine step (500 / SSE error event), and the greedy rule of feedback.

use futures_util::StreamExt;
use serde_json::{json, Value};
use server::serve::{build_state, ServeArgs, Server};
use std::path::PathBuf;
use std::time::Duration;
use tests::tiny::TinySpec;
use tests::{default_model, eventually, get_json, temp_dir};

/// A tiny Qwen2 model in its own folder (`name` keeps concurrent tests apart).
pub(crate) fn tiny_dir(name: &str) -> PathBuf {
    let dir = temp_dir(&format!("server-{name}"));
    TinySpec { architecture: "Qwen2ForCausalLM", seed: 51, ..Default::default() }.write(&dir);
    dir
}

pub(crate) async fn start(dir: PathBuf, args: ServeArgs) -> (Server, String) {
    let state = tokio::task::spawn_blocking(move || build_state(&dir, &args)).await.unwrap().unwrap();
    let s = Server::start(state, "127.0.0.1", 0).await.unwrap();
    let base = format!("http://{}", s.addr);
    (s, base)
}

pub(crate) fn args(name: &str) -> ServeArgs {
    ServeArgs { served_model_name: Some(name.into()), ..Default::default() }
}

pub(crate) async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{base}{path}")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// The `data:` payloads of an SSE response, `[DONE]` included.
pub(crate) async fn stream(base: &str, path: &str, body: Value) -> Vec<String> {
    let r = reqwest::Client::new().post(format!("{base}{path}")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream; charset=utf-8");
    let text = r.text().await.unwrap();
    text.lines().filter_map(|l| l.strip_prefix("data: ")).map(String::from).collect()
}

/// Concatenated text per choice index of streamed chunks (completions `text` or chat `delta.content`).
pub(crate) fn stream_texts(events: &[String]) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if out.len() <= i {
                out.resize(i + 1, String::new());
            }
            let piece = c["text"].as_str().or_else(|| c["delta"]["content"].as_str()).unwrap_or("");
            out[i].push_str(piece);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_answer() {
    let (s, base) = start(tiny_dir("tiny-endpoints"), args("tiny-endpoints")).await;
    let c = reqwest::Client::new();
    assert_eq!(c.get(format!("{base}/health")).send().await.unwrap().status(), 200);
    let models: Value = c.get(format!("{base}/v1/models")).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "tiny-endpoints");
    assert_eq!(models["data"][0]["max_model_len"], 128);
    assert!(models["data"][0]["root"].as_str().unwrap().ends_with("server-tiny-endpoints"), "{models}");
    assert!(models["data"][0]["parent"].is_null(), "{models}");
    // `models.retrieve`: the card by its id, or a 404 naming the served model.
    let one = c.get(format!("{base}/v1/models/tiny-endpoints")).send().await.unwrap();
    assert_eq!(one.status(), 200);
    assert_eq!(one.json::<Value>().await.unwrap(), models["data"][0]);
    let r = c.get(format!("{base}/v1/models/Qwen/Qwen3-8B")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["error"]["message"], "The model `Qwen/Qwen3-8B` does not exist. This server serves `tiny-endpoints`.",
        "{v}"
    );
    let (st, tok) = post(&base, "/tokenize", json!({"prompt": "hé"})).await;
    assert_eq!((st, tok["count"].as_u64()), (200, Some(3)));
    let (_, chat_tok) = post(&base, "/tokenize", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(chat_tok["tokens"][0], 257, "starts with <|im_start|>");
    let (st, de) = post(&base, "/detokenize", json!({"tokens": tok["tokens"]})).await;
    assert_eq!((st, de["prompt"].as_str()), (200, Some("hé")));
    let (st, out) = post(
        &base,
        "/v1/completions",
        json!({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["usage"], json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}));
    assert_eq!(out["choices"][0]["token_ids"].as_array().unwrap().len(), 4);
    assert_eq!(out["choices"][0]["versions"], json!([0, 0, 0, 0]));
    assert!(out["id"].as_str().unwrap().starts_with("cmpl-"));
    // prompt_logprobs: null for the first token, then each prompt token's entry.
    let (_, pl) =
        post(&base, "/v1/completions", json!({"prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 1})).await;
    let pl = pl["choices"][0]["prompt_logprobs"].as_array().unwrap().clone();
    assert_eq!(pl.len(), 3);
    assert!(pl[0].is_null() && pl[1]["2"]["logprob"].as_f64().unwrap() < 0.0 && pl[2]["3"].is_object());
    // The engine's recent past, sampled by the server every 2 s from its start.
    let url = format!("{base}/v1/status/history");
    let h = eventually(Duration::from_secs(5), async || get_json(&url).await, |h| h["data"][0].is_object()).await;
    let first = &h["data"][0];
    assert!(first["time"].as_f64() > Some(1.7e9) && first["engine"]["kv_cache_usage"].is_number(), "{h}");
    let version: Value = c.get(format!("{base}/version")).send().await.unwrap().json().await.unwrap();
    assert_eq!(version, json!({"version": env!("CARGO_PKG_VERSION")}));
    let metrics = c.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    // vLLM's per-request series, this server's (the recorder is shared by the tests): the two
    // completions above, 3 + 3 prompt and 4 + 1 generated tokens.
    let series = |name: &str| -> f64 {
        let mine = |l: &&str| l.starts_with(name) && l.contains("model_name=\"tiny-endpoints\"");
        metrics.lines().filter(mine).map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap()).sum()
    };
    assert_eq!(series("rlserve:request_success_total{"), 2.0, "{metrics}");
    assert_eq!(series("rlserve:request_prompt_tokens_sum"), 6.0, "{metrics}");
    assert_eq!(series("rlserve:request_generation_tokens_sum"), 5.0, "{metrics}");
    assert!(metrics.contains("rlserve:request_generation_tokens_bucket{model_name=\"tiny-endpoints\",le=\"5\"} 2"));
    // Each request's phases: queue + prefill + decode is its end-to-end latency, and
    // inference is prefill + decode (the same instants, so up to f64 rounding of the sums).
    let phase = |p: &str| series(&format!("rlserve:request_{p}_time_seconds_sum"));
    for p in ["queue", "prefill", "decode", "inference"] {
        assert_eq!(series(&format!("rlserve:request_{p}_time_seconds_count")), 2.0, "{p}: {metrics}");
    }
    let e2e = series("rlserve:e2e_request_latency_seconds_sum");
    assert!((phase("prefill") + phase("decode") - phase("inference")).abs() < 1e-9, "{metrics}");
    assert!((phase("queue") + phase("inference") - e2e).abs() < 1e-9, "{metrics}");
    assert!(phase("prefill") > 0.0 && phase("decode") > 0.0, "{metrics}");
    for name in [
        "rlserve:num_requests_running",
        "rlserve:kv_cache_usage_perc",
        "rlserve:prefix_cache_hits_total",
        "rlserve:generation_tokens_total",
        "rlserve:time_to_first_token_seconds_bucket",
        "rlserve:e2e_request_latency_seconds_count",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }
    assert!(
        metrics.contains("# HELP rlserve:num_requests_running Number of requests in model execution batches.\n"),
        "{metrics}"
    );
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_equals_non_streaming_with_n_and_seed() {
    let (s, base) = start(tiny_dir("tiny-stream"), args("tiny-stream")).await;
    let body = json!({"prompt": ["ab", "xyz"], "max_tokens": 12, "n": 2, "seed": 3, "temperature": 0.8, "logprobs": 2});
    let (st, full) = post(&base, "/v1/completions", body.clone()).await;
    assert_eq!(st, 200, "{full}");
    let choices = full["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let texts: Vec<String> = choices.iter().map(|c| c["text"].as_str().unwrap().to_string()).collect();
    assert_ne!(texts[0], texts[1], "n samples differ");
    for c in choices {
        let lp = &c["logprobs"];
        assert_eq!(lp["tokens"].as_array().unwrap().len(), lp["token_logprobs"].as_array().unwrap().len());
        // OpenAI's "up to logprobs + 1" (vLLM's order): the chosen token first, then the 2 most
        // likely by rank.
        for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
            let top: Vec<(&String, f64)> =
                top.as_object().unwrap().iter().map(|(k, v)| (k, v.as_f64().unwrap())).collect();
            // Fewer where tokens decode to the same text (such as "\u{fffd}" for part of a character).
            assert!((1..=3).contains(&top.len()), "{top:?}");
            assert_eq!(
                (top[0].0.as_str(), top[0].1),
                (lp["tokens"][i].as_str().unwrap(), lp["token_logprobs"][i].as_f64().unwrap())
            );
            assert!(top[1..].windows(2).all(|w| w[0].1 >= w[1].1), "ranked: {top:?}");
        }
    }
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let events = stream(&base, "/v1/completions", sb).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    assert_eq!(stream_texts(&events), texts);
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"], full["usage"]);
    let (_, again) = post(&base, "/v1/completions", body).await;
    assert_eq!(again["choices"], full["choices"], "same seed, same outputs");
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_with_chinese_and_emoji_equals_non_streaming() {
    let (s, base) = start(default_model(), args("smol-chat")).await;
    // Greedy answers of the default model: Chinese ("汉哥！！！") and emoji ("🍨🍨🍨🍨"), whose
    // characters span several byte-level tokens.
    for (prompt, want) in [("Say hi in Chinese", '汉'), ("Reply with only emojis: I love pizza", '🍨')] {
        let body = json!({"messages": [{"role": "user", "content": prompt}], "max_completion_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
        let (st, full) = post(&base, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{full}");
        let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        assert!(text.contains(want), "expected {want} in {text:?}");
        assert_eq!(
            full["choices"][0]["logprobs"]["content"].as_array().unwrap().len(),
            full["usage"]["completion_tokens"].as_u64().unwrap() as usize
        );
        let mut sb = body;
        sb["stream"] = json!(true);
        let events = stream(&base, "/v1/chat/completions", sb).await;
        assert_eq!(stream_texts(&events), vec![text]);
        let first: Value = serde_json::from_str(&events[0]).unwrap();
        assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(first["object"], "chat.completion.chunk");
    }
    // Stop strings over HTTP: the text ends before the stop string.
    let (_, plain) =
        post(&base, "/v1/completions", json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0})).await;
    let t = plain["choices"][0]["text"].as_str().unwrap();
    let stop: String = t.chars().skip(5).take(4).collect();
    let (_, cut) = post(
        &base,
        "/v1/completions",
        json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "stop": stop}),
    )
    .await;
    assert_eq!(cut["choices"][0]["text"].as_str().unwrap(), &t[..t.find(&stop).unwrap()]);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    s.shutdown(Duration::from_secs(5)).await;
}

pub(crate) async fn free_blocks(base: &str, model: &str) -> (f64, String) {
    let m = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    let line = m
        .lines()
        .find(|l| l.starts_with("rlserve:kv_cache_usage_perc") && l.contains(model))
        .unwrap_or("x 1")
        .to_string();
    (line.rsplit(' ').next().unwrap().parse().unwrap(), line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_aborts_and_frees_blocks() {
    // The default model (~50 ms per token) so the request is still running when we leave.
    let (s, base) = start(default_model(), ServeArgs { max_queued_requests: 1, ..args("smol-disconnect") }).await;
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "abc", "max_tokens": 400, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    body.next().await.unwrap().unwrap();
    assert!(free_blocks(&base, "smol-disconnect").await.0 > 0.0, "blocks in use while streaming");
    // The queue holds one request: a second gets 429.
    let (st, e) = post(&base, "/v1/completions", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!((st, e["error"]["type"].as_str()), (429, Some("rate_limit_error")));
    drop(body);
    let usage =
        eventually(Duration::from_secs(5), async || free_blocks(&base, "smol-disconnect").await.0, |&u| u == 0.0).await;
    assert_eq!(usage, 0.0, "KV blocks freed after the disconnect");
    let (st, _) = post(&base, "/v1/completions", json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(st, 200);
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_when_set() {
    let (s, base) =
        start(tiny_dir("tiny-auth"), ServeArgs { api_key: Some("sekrit".into()), ..args("tiny-auth") }).await;
    let c = reqwest::Client::new();
    let body = json!({"prompt": "a", "max_tokens": 1});
    let r = c.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "authentication_error");
    let r = c.post(format!("{base}/v1/completions")).bearer_auth("wrong").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c.post(format!("{base}/v1/completions")).bearer_auth("sekrit").json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(c.get(format!("{base}/health")).send().await.unwrap().status(), 200);
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_right_status_and_envelope() {
    let (s, base) = start(tiny_dir("tiny-bad"), args("tiny-bad")).await;
    let c = reqwest::Client::new();
    // (method, path, raw body, status, message fragment)
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v1/completions", "{\"prompt\": \"a\",".into(), 400, "malformed JSON"),
        ("POST", "/v1/completions", "not json".into(), 400, "malformed JSON"),
        (
            "POST",
            "/v1/completions",
            "{\"prompt\": \"a\", \"stop\": [\"x\"], \"max_tokens\": 2, \"max_tokens\": 3}".into(),
            400,
            "malformed JSON: the key `max_tokens` appears twice in one object at line 1",
        ),
        (
            "POST",
            "/v1/chat/completions",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"a\", \"role\": \"system\"}]}".into(),
            400,
            "the key `role` appears twice",
        ),
        ("POST", "/v1/completions", "{}".into(), 400, "missing field `prompt`"),
        ("POST", "/v1/completions", json!({"prompt": 5}).to_string(), 400, "invalid request"),
        ("POST", "/v1/completions", json!({"prompt": "a", "max_tokens": "ten"}).to_string(), 400, "invalid type"),
        ("POST", "/v1/completions", json!({"prompt": "a", "temperature": -1}).to_string(), 400, "`temperature` must be a finite number >= 0, got -1"),
        ("POST", "/v1/completions", json!({"prompt": "a", "top_p": 0}).to_string(), 400, "`top_p` must be in (0, 1], got 0"),
        ("POST", "/v1/completions", json!({"prompt": "a", "top_p": 1.5}).to_string(), 400, "`top_p` must be in (0, 1], got 1.5"),
        ("POST", "/v1/completions", json!({"prompt": "a", "n": 0}).to_string(), 400, "`n` must be in [1, 256], got 0"),
        // One request cannot queue unbounded work (100,000 prompts were accepted).
        ("POST", "/v1/completions", json!({"prompt": vec!["a"; 100_000]}).to_string(), 400, "100000 prompts × n 1 = 100000 sequences; at most 4096"),
        ("POST", "/v1/completions", json!({"prompt": vec!["a"; 20], "n": 256}).to_string(), 400, "at most 4096 per request"),
        ("POST", "/v1/completions", json!({"prompt": "a", "max_tokens": 0}).to_string(), 400, "`max_tokens` must be at least 1, got 0"),
        ("POST", "/v1/completions", json!({"prompt": "a", "max_tokens": -3}).to_string(), 400, "invalid value"),
        ("POST", "/v1/completions", json!({"prompt": "a", "top_k": -5}).to_string(), 400, "`top_k` must be"),
        ("POST", "/v1/completions", json!({"prompt": "a", "min_p": 2}).to_string(), 400, "`min_p` must be in [0, 1], got 2"),
        ("POST", "/v1/completions", json!({"prompt": "a", "presence_penalty": 5}).to_string(), 400, "`presence_penalty` must be in [-2, 2], got 5"),
        ("POST", "/v1/completions", json!({"prompt": "a", "frequency_penalty": -3}).to_string(), 400, "`frequency_penalty` must be in [-2, 2], got -3"),
        ("POST", "/v1/completions", json!({"prompt": "a", "repetition_penalty": 0}).to_string(), 400, "`repetition_penalty` must be a finite number > 0, got 0"),
        ("POST", "/v1/completions", json!({"prompt": "a", "logprobs": 50}).to_string(), 400, "`logprobs` must be at most 20, got 50"),
        ("POST", "/v1/completions", json!({"prompt": "a", "stop": [""]}).to_string(), 400, "`stop` must be non-empty strings"),
        ("POST", "/v1/completions", json!({"prompt": "a", "min_tokens": 9, "max_tokens": 3}).to_string(), 400, "`min_tokens` must be at most max_tokens, got 9"),
        ("POST", "/v1/completions", json!({"prompt": ""}).to_string(), 400, "the prompt is empty"),
        ("POST", "/v1/completions", json!({"prompt": []}).to_string(), 400, "at least one"),
        ("POST", "/v1/completions", json!({"prompt": [1, 9999]}).to_string(), 400, "prompt token id 9999 is out of range"),
        ("POST", "/v1/completions", json!({"prompt": vec![1; 100], "max_tokens": 50}).to_string(), 400, "This model's maximum context length is 128 tokens. However, you requested 150 tokens (100 in the prompt, 50 for the completion)."),
        ("POST", "/v1/completions", json!({"prompt": "a", "model": "gpt-9"}).to_string(), 404, "The model `gpt-9` does not exist"),
        ("POST", "/v1/chat/completions", json!({"messages": []}).to_string(), 400, "`messages` must hold at least one message"),
        ("POST", "/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(), 400, "`messages[0].role` must be one of"),
        ("POST", "/v1/chat/completions", json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).to_string(), 400, "is not supported (only text)"),
        ("POST", "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}).to_string(), 400, "`top_logprobs` requires `logprobs: true`"),
        ("POST", "/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 500}).to_string(), 400, "maximum context length is 128 tokens"),
        ("POST", "/v1/chat/completions", json!({"messages": "hi"}).to_string(), 400, "invalid type"),
        ("POST", "/tokenize", json!({}).to_string(), 400, "give exactly one of `prompt` or `messages`"),
        ("POST", "/detokenize", json!({"tokens": [1, 100000]}).to_string(), 400, "token id 100000 is out of range"),
        ("GET", "/v1/nothing", String::new(), 404, "no route for GET /v1/nothing"),
        ("GET", "/v1/completions", String::new(), 405, ""),
        // Just over the 8 MiB limit (the server stops reading there).
        ("POST", "/v1/completions", format!("{{\"prompt\": \"{}\"}}", "a".repeat((8 << 20) + 64)), 413, "larger than the limit"),
    ];
    assert!(cases.len() >= 30);
    for (method, path, body, status, msg) in &cases {
        let r = c
            .request(method.parse().unwrap(), format!("{base}{path}"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), *status, "{method} {path} {}", &body[..body.len().min(80)]);
        if *status == 405 {
            continue;
        }
        let v: Value = r.json().await.unwrap_or_else(|e| panic!("{path}: not JSON: {e}"));
        let m = v["error"]["message"].as_str().unwrap_or_else(|| panic!("no envelope: {v}"));
        assert!(m.contains(msg), "{path} {}: {m:?} lacks {msg:?}", &body[..body.len().min(80)]);
        assert!(
            v["error"]["type"].is_string() && v["error"].get("param").is_some() && v["error"]["code"] == json!(status)
        );
    }
    let (st, ok) = post(&base, "/v1/completions", json!({"prompt": "a", "max_tokens": 2})).await;
    assert_eq!(st, 200, "the server still answers: {ok}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// The `error` object of an error envelope, checked to be the 500 of a failed engine step.
fn engine_error(v: &Value, bad: u32) -> &Value {
    let e = &v["error"];
    assert_eq!((e["type"].as_str(), &e["code"]), (Some("server_error"), &json!(500)), "{v}");
    assert!(e.get("param").is_some_and(Value::is_null), "{v}");
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(&format!("token id {bad} >= vocab size {bad}")) && msg.contains("aborted"), "{msg}");
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_engine_step_answers_500_or_an_sse_error_and_the_server_keeps_serving() {
    // Prefill chunks of 8 tokens: a long prompt's last chunk runs several steps after a short
    // prompt of the same request has started generating.
    let mut a = args("tiny-fault");
    a.engine.max_num_batched_tokens = 8;
    let (s, base) = start(tiny_dir("tiny-fault"), a).await;
    let bad = crate::engine::drop_last_embedding_row(&s.state.model);
    // Two prompts: [1, 2, 3] generates; the long one fails when its last chunk (holding the
    // bad id) runs, and that step also ran the short one's decode.
    let body = |first: u32| {
        let long: Vec<u32> = (first..first + 40).chain([bad]).collect();
        json!({"prompt": [[1, 2, 3], long], "max_tokens": 30, "ignore_eos": true, "temperature": 0})
    };
    let (st, out) = post(&base, "/v1/completions", body(10)).await;
    assert_eq!(st, 500, "{out}");
    engine_error(&out, bad);
    assert!(out.get("choices").is_none(), "no partial result: {out}");

    // Streamed (a new long prompt: no prefix-cache hits): the short prompt's chunks (one per
    // token, with logprobs, even when a token adds no text), then one error event, then
    // [DONE]; no finish_reason and no usage chunk.
    let mut sb = body(50);
    sb["stream"] = json!(true);
    sb["logprobs"] = json!(1);
    sb["stream_options"] = json!({"include_usage": true});
    let events = stream(&base, "/v1/completions", sb).await;
    let (done, rest) = events.split_last().unwrap();
    assert_eq!(done, "[DONE]");
    let (err, chunks) = rest.split_last().unwrap();
    engine_error(&serde_json::from_str(err).unwrap(), bad);
    assert!(!chunks.is_empty(), "the short prompt streamed before the failure: {events:?}");
    for c in chunks {
        let v: Value = serde_json::from_str(c).unwrap();
        assert!(v.get("error").is_none() && v["usage"].is_null(), "{v}");
        for choice in v["choices"].as_array().unwrap() {
            assert_eq!((choice["index"].as_u64(), &choice["finish_reason"]), (Some(0), &Value::Null), "{v}");
        }
    }

    // Chat: the tiny template closes every message with <|im_end|>, the bad id.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let (st, out) = post(&base, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(st, 500, "{out}");
    engine_error(&out, bad);
    let mut cs = chat;
    cs["stream"] = json!(true);
    let events = stream(&base, "/v1/chat/completions", cs).await;
    assert_eq!(events.len(), 2, "{events:?}");
    engine_error(&serde_json::from_str(&events[0]).unwrap(), bad);
    assert_eq!(events[1], "[DONE]");

    // The engine keeps serving, and the failed requests left no KV block behind.
    let (st, ok) = post(
        &base,
        "/v1/completions",
        json!({"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": true, "temperature": 0, "return_token_ids": true}),
    )
    .await;
    assert_eq!(st, 200, "{ok}");
    assert_eq!(ok["choices"][0]["token_ids"].as_array().unwrap().len(), 4);
    assert_eq!(ok["choices"][0]["finish_reason"], "length");
    let (usage, line) = free_blocks(&base, "tiny-fault").await;
    assert_eq!(usage, 0.0, "{line}");
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_below_the_greedy_temperature_cannot_be_rated() {
    let mut a = args("tiny-greedy");
    a.feedback.learn_from_feedback = true;
    a.feedback.feedback_dir = temp_dir("server-greedy-feedback");
    a.feedback.feedback_batch_size = 1000; // no learner step
    let (s, base) = start(tiny_dir("tiny-greedy"), a).await;
    assert!(engine::sampling::is_greedy_temperature(1e-6) && !engine::sampling::is_greedy_temperature(1e-4));
    let rate = |id: &Value| json!({"id": id, "choice": 0, "reward": 1.0});
    // Just below the threshold: the sampler took the argmax (μ = 0), so no rating.
    let body = json!({"prompt": "ab", "max_tokens": 3, "temperature": 1e-6, "return_token_ids": true});
    let (st, out) = post(&base, "/v1/completions", body).await;
    assert_eq!(st, 200, "{out}");
    assert!(out["choices"][0]["behavior_logprobs"].as_array().unwrap().iter().all(|lp| lp == &json!(0.0)), "{out}");
    let (st, fb) = post(&base, "/v1/feedback", rate(&out["id"])).await;
    assert_eq!(st, 400, "{fb}");
    assert!(fb["error"]["message"].as_str().unwrap().contains("generated greedily"), "{fb}");
    // Above it the response is sampled and can be rated.
    let body = json!({"prompt": "ab", "max_tokens": 3, "temperature": 1e-4, "seed": 1, "return_token_ids": true});
    let (_, out) = post(&base, "/v1/completions", body).await;
    let (st, fb) = post(&base, "/v1/feedback", rate(&out["id"])).await;
    assert_eq!(st, 200, "{fb}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// A client that never finishes its request headers is cut off after
/// `HEADER_READ_TIMEOUT` (10 s; before, such connections stayed open indefinitely), while a
/// complete request on another connection is answered meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_header_client_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (s, base) = start(tiny_dir("slow-header"), ServeArgs::default()).await;
    let mut slow = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").await.unwrap();
    let r = reqwest::get(format!("{base}/health")).await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "other clients are served meanwhile");
    let t = std::time::Instant::now();
    let timeout = server::serve::HEADER_READ_TIMEOUT;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(timeout * 3, slow.read_to_end(&mut buf)).await;
    let waited = t.elapsed();
    assert!(read.is_ok(), "the connection was still open after {waited:?}");
    assert!(waited >= timeout - Duration::from_secs(1), "closed after {waited:?}, before the timeout");
    s.shutdown(Duration::from_secs(5)).await;
}

/// A client that stops sending mid-body gets a 408 envelope after `BODY_IDLE_TIMEOUT` (10 s;
/// before, the connection and its task stayed open indefinitely).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_a_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (s, _base) = start(tiny_dir("slow-body"), ServeArgs::default()).await;
    let mut slow = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                Content-Length: 100\r\nConnection: close\r\n\r\n{\"prompt\": ";
    slow.write_all(head.as_bytes()).await.unwrap();
    let t = std::time::Instant::now();
    let timeout = server::api::body::BODY_IDLE_TIMEOUT;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(timeout * 3, slow.read_to_end(&mut buf)).await;
    let waited = t.elapsed();
    assert!(read.is_ok(), "no answer after {waited:?}");
    assert!(waited >= timeout - Duration::from_secs(1), "answered after {waited:?}, before the timeout");
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("the request body stalled: nothing arrived for 10 s after 11 bytes"), "{text}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// `bench serve` against a server that refuses its workload (prompts over the context) stops
/// after one untimed request, naming the server's error, and exits non-zero (vLLM's); it
/// sends `--api-key` from its first request (the model list) on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_stops_when_the_server_refuses_its_workload() {
    let a = ServeArgs { api_key: Some("k".into()), ..args("bench-refused") };
    let (s, base) = start(tiny_dir("bench-refused"), a).await;
    let bench = |key: &[&str]| {
        let mut v: Vec<String> = ["bench", "serve", "--base-url", &base, "--num-prompts", "4", "--input-len", "500"]
            .map(String::from)
            .to_vec();
        v.extend(key.iter().map(|k| k.to_string()));
        let run = move || std::process::Command::new(tests::rlserve_binary()).args(v).output().unwrap();
        async move {
            let out = tokio::task::spawn_blocking(run).await.unwrap();
            assert!(
                !out.status.success() && !String::from_utf8_lossy(&out.stdout).contains("Serving Benchmark Result")
            );
            String::from_utf8_lossy(&out.stderr).into_owned()
        }
    };
    let err = bench(&[]).await;
    assert!(err.contains("listing the served models at") && err.contains("401"), "{err}");
    let err = bench(&["--api-key", "k"]).await;
    assert!(err.contains("the initial test request failed") && err.contains("HTTP 400"), "{err}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// `bench latency`, `train` and `rl` write `--output-json` with the printed medians and the
/// runs they are the medians of.
#[test]
fn bench_output_json_holds_the_runs_and_their_medians() {
    let model = tiny_dir("bench-json");
    let (m, out) = (model.to_str().unwrap(), model.join("out.json"));
    let run = |args: &[&str]| -> Value {
        let o = out.to_str().unwrap();
        let r = std::process::Command::new(tests::rlserve_binary())
            .args(["bench"].iter().chain(args).chain(&["--model", m, "--output-json", o]))
            .output()
            .unwrap();
        assert!(r.status.success(), "{args:?}: {}", String::from_utf8_lossy(&r.stderr));
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
    };
    let median = |v: &Value| {
        let mut v: Vec<f64> = v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        v.sort_by(f64::total_cmp);
        (v[(v.len() - 1) / 2] + v[v.len() / 2]) / 2.0
    };
    let j = run(&["latency", "--prompt-tokens", "8", "--gen-tokens", "4", "--repetitions", "3"]);
    assert_eq!(j["decode_tokens_per_second_runs"].as_array().unwrap().len(), 3, "{j}");
    assert_eq!(j["decode_tokens_per_second"].as_f64().unwrap(), median(&j["decode_tokens_per_second_runs"]));
    assert_eq!(j["prefill_tokens_per_second"].as_f64().unwrap(), median(&j["prefill_tokens_per_second_runs"]));
    let j = run(&["train", "--num-seqs", "2", "--prompt-len", "4", "--completion-len", "4", "--steps", "2"]);
    let secs = j["seconds_per_step"].as_f64().unwrap();
    // Two runs: numpy's a + (b − a)/2 and this (a + b)/2 may differ in the last bit.
    let (want, rel) = (median(&j["step_seconds_runs"]), 1e-12);
    assert_eq!(j["tokens_per_step"].as_u64(), Some(16), "{j}");
    assert!((secs - want).abs() <= rel * want, "{secs} vs the runs' median {want}: {j}");
    assert_eq!(j["tokens_per_second"].as_f64().unwrap(), 16.0 / secs);
    let j = run(&[
        "rl",
        "--steps",
        "2",
        "--prompts-per-step",
        "1",
        "--num-generations",
        "2",
        "--max-completion-length",
        "4",
    ]);
    let runs = j["runs"].as_array().unwrap();
    assert_eq!(runs.iter().map(|r| r["max_staleness"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 2], "{j}");
    assert!(runs.iter().all(|r| r["steps_per_second"].as_f64() > Some(0.0)), "{j}");
}

/// CLI misuse ends with a message naming the flag and its rule (exit status 1 or clap's 2).
#[test]
fn cli_misuse_names_the_flag() {
    let model = tiny_dir("cli-misuse");
    let m = model.to_str().unwrap();
    let check = |args: &[&str], want: &str| {
        let out = std::process::Command::new(tests::rlserve_binary()).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{args:?}: {err:?} lacks {want:?}");
    };
    check(
        &["generate", "--model", m, "--prompt", "hi", "--temperature", "-1"],
        "`--temperature` must be a finite number >= 0, got -1",
    );
    check(
        &["generate", "--model", "/nonexistent-rlserve-model", "--prompt", "hi"],
        "--model /nonexistent-rlserve-model: not a folder",
    );
    check(&["serve", "--model", m, "--num-blocks", "0"], "'--num-blocks <NUM_BLOCKS>': must be at least 1, got 0");
    // vLLM's positional model folder is `--model`, checked alike; not both.
    check(&["serve", "/nonexistent-rlserve-model"], "--model /nonexistent-rlserve-model: not a folder");
    check(&["serve", m, "--model", m], "cannot be used with");
    check(
        &["serve", "--model", m, "--chat-template", "/nonexistent.jinja"],
        "--chat-template /nonexistent.jinja: no such file, and not a template",
    );
    check(&["serve", "--model", m, "--chat-template", "{% if %}"], "chat template");
    check(
        &["serve", "--model", m, "--max-model-len", "x"],
        "'--max-model-len <MAX_MODEL_LEN>': \"x\" is not a whole number",
    );
    // Benchmarks: a zero that would hang (a semaphore of 0 permits) or print NaN.
    check(&["bench", "serve", "--max-concurrency", "0"], "'--max-concurrency <MAX_CONCURRENCY>': must be at least 1");
    check(&["bench", "throughput", "--concurrency", "1,0"], "'--concurrency <CONCURRENCY>': must be at least 1");
    check(&["bench", "rl", "--steps", "0"], "'--steps <STEPS>': must be at least 1");
    check(&["bench", "rl", "--num-generations", "1"], "'--num-generations <NUM_GENERATIONS>': must be at least 2");
    check(
        &["bench", "train", "--model", m, "--num-seqs", "2", "--num-generations", "3"],
        "--num-generations 3 must divide --num-seqs 2",
    );
    check(&["bench", "throughput", "--max-num-seqs", "0"], "'--max-num-seqs <MAX_NUM_SEQS>': must be at least 1");
    check(&["bench", "throughput", "--curve-output-len", "0"], "'--curve-output-len <CURVE_OUTPUT_LEN>': must be at");
    check(&["bench", "serve", "--request-rate", "0"], "must be a number > 0 (or inf: all at once), got 0");
    check(&["bench", "serve", "--request-rate", "nan"], "must be a number > 0 (or inf: all at once), got NaN");
    check(
        &["bench", "throughput", "--model", m, "--output-json", "/nonexistent-rlserve/x.json"],
        "--output-json /nonexistent-rlserve/x.json: the folder /nonexistent-rlserve does not exist",
    );
    check(
        &["bench", "latency", "--model", m, "--prompt-tokens", "1000"],
        "--prompt-tokens 1000 plus --gen-tokens 128 exceed the model's context of 128 tokens",
    );
}

/// One decode loop: `rlserve generate --seed S` drives the engine, so at temperature 1 (and
/// with top-k) it prints what `/v1/completions` with `"seed": S` returns for the same
/// prompt; before, the CLI seeded its own loop and drew other tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_cli_draws_what_the_api_draws_for_the_same_seed() {
    let dir = default_model();
    let (_s, base) = start(dir.clone(), args("m")).await;
    let mut texts = vec![];
    for (seed, top_k) in [(5u64, 0), (11, 40), (12, 40)] {
        let out = std::process::Command::new(tests::rlserve_binary())
            .args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "My favourite animal is"])
            .args([
                "--temperature",
                "1",
                "--max-tokens",
                "12",
                "--seed",
                &seed.to_string(),
                "--top-k",
                &top_k.to_string(),
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let cli = String::from_utf8(out.stdout).unwrap();
        let body = json!({"model": "m", "prompt": "My favourite animal is", "temperature": 1.0, "max_tokens": 12,
                          "seed": seed, "top_k": top_k});
        let (status, r) = post(&base, "/v1/completions", body).await;
        assert_eq!(status, 200, "{r}");
        let api = r["choices"][0]["text"].as_str().unwrap().to_string();
        eprintln!("seed {seed}, top_k {top_k}: {api:?}");
        assert_eq!(cli.strip_suffix('\n').unwrap(), api, "seed {seed}, top_k {top_k}");
        texts.push(api);
    }
    assert!(texts[1] != texts[2] && texts.iter().all(|t| t.len() > 10), "the seed decides the text: {texts:?}");
}

/// SIGTERM to `rlserve serve` stops a running training job as `/stop` does: the current
/// step ends and is saved as the last checkpoint before the process exits (0), where before
/// the process exited at once and the job's steps since its last save were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_saves_a_running_jobs_last_step() {
    use std::io::BufRead;
    let dir = temp_dir("server-sigterm-job");
    let model = dir.join("model");
    TinySpec { seed: 52, ..Default::default() }.write(&model);
    std::fs::write(dir.join("data.jsonl"), "{\"prompt\": \"abc\"}\n").unwrap();
    let mut child = std::process::Command::new(tests::rlserve_binary())
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0", "--jobs-dir", dir.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr =
        line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or_else(|| panic!("{line}"));
    let base = format!("http://{addr}");
    let job = json!({"dataset": dir.join("data.jsonl"), "apply_chat_template": false, "num_generations": 2,
                     "max_steps": 1000000, "save_steps": 0, "output_dir": "out",
                     "rewards": [{"type": "length", "target": 2}], "learner": {"max_completion_length": 2}});
    let (st, out) = post(&base, "/v1/train/jobs", job).await;
    assert_eq!(st, 201, "{out}");
    let url = format!("{base}/v1/train/jobs/{}", out["id"].as_str().unwrap());
    let step =
        eventually(Duration::from_secs(10), async || get_json(&url).await["step"].as_u64(), |&s| s >= Some(2)).await;
    let step = step.filter(|&s| s >= 2).expect("the job trains");
    let kill = std::process::Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let exit = eventually(Duration::from_secs(30), async || child.try_wait().unwrap(), Option::is_some).await;
    let Some(exit) = exit else {
        let _ = child.kill();
        panic!("rlserve did not exit within 30 s of SIGTERM");
    };
    assert!(exit.success(), "{exit}");
    let saved: Vec<u64> = tests::checkpoint_steps(&dir.join("out")).into_iter().map(|(s, _)| s).collect();
    let lines = std::fs::read_to_string(dir.join("out/metrics.jsonl")).unwrap().lines().count() as u64;
    assert_eq!(saved, [lines], "the last step trained ({lines}) is saved");
    assert!(lines >= step, "{lines} steps, {step} seen before SIGTERM");
}
