//! API fidelity over HTTP on the tiny model: `logit_bias` (applied, in μ, not in the raw
//! logprobs, validated), fields the server does not implement are a 400 naming them,
//! explicit nulls are absent fields, range and type errors name their field, assistant
//! prefill, and the role on the first chunk of every streamed chat choice.

use crate::server::{args, post, start, stream, tiny_dir};
use serde_json::{json, Value};
use std::time::Duration;

/// The error envelope's `(status, param, message)`.
async fn error(base: &str, path: &str, body: Value) -> (u16, Value, String) {
    let (st, v) = post(base, path, body).await;
    (st, v["error"]["param"].clone(), v["error"]["message"].as_str().unwrap_or_default().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_moves_the_sampled_distribution_and_is_validated() {
    let (s, base) = start(tiny_dir("tiny-bias"), args("tiny-bias")).await;
    // +100 on "A" (id 32): every draw is "A", μ ≈ 0, and the raw logprob is the model's own.
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 4, "seed": 5, "logprobs": 0, "return_token_ids": true,
                      "logit_bias": {"32": 100}, "ignore_eos": true});
    let (st, out) = post(&base, "/v1/completions", body).await;
    assert_eq!(st, 200, "{out}");
    let c = &out["choices"][0];
    assert_eq!(c["token_ids"], json!([32, 32, 32, 32]));
    assert_eq!(c["text"], "AAAA");
    assert!(c["behavior_logprobs"].as_array().unwrap().iter().all(|m| m.as_f64().unwrap() > -1e-3), "{c}");
    let raw = c["logprobs"]["token_logprobs"][0].as_f64().unwrap();
    let (_, pl) =
        post(&base, "/v1/completions", json!({"prompt": [1, 2, 3, 32], "max_tokens": 1, "prompt_logprobs": 0})).await;
    let unbiased = pl["choices"][0]["prompt_logprobs"][3]["32"]["logprob"].as_f64().unwrap();
    assert_eq!(raw, unbiased, "logprobs are the raw model's");
    assert!(raw < -1.0, "without the bias \"A\" is unlikely: {raw}");
    // Greedy follows the bias too (chat, −100 on every byte but "B").
    let bias: serde_json::Map<String, Value> =
        (0..259).filter(|&t| t != 33).map(|t| (t.to_string(), json!(-100))).collect();
    let chat =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logit_bias": bias});
    let (st, out) = post(&base, "/v1/chat/completions", chat).await;
    assert_eq!((st, out["choices"][0]["message"]["content"].as_str()), (200, Some("BBB")), "{out}");
    // Beyond ±100 a bias is clamped (vLLM, OpenAI), not refused: +1000 on "A" draws "A" as +100 does.
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2, "seed": 5, "logit_bias": {"32": 1000, "33": -1e9}});
    let (st, out) = post(&base, "/v1/completions", body).await;
    assert_eq!((st, out["choices"][0]["text"].as_str()), (200, Some("AA")), "{out}");
    for (bias, param, msg) in [
        (json!("nonsense"), "logit_bias", "invalid type: string \"nonsense\", expected a map"),
        (json!({"5": "x"}), "logit_bias.5", "invalid type: string \"x\", expected a number"),
        (json!({"abc": 1}), "logit_bias", "`logit_bias` keys must be token ids (non-negative integers), got \"abc\""),
        (json!({"-1": 1}), "logit_bias", "keys must be token ids"),
        (
            json!({"259": 1}),
            "logit_bias",
            "`logit_bias` holds token id 259, which is out of range: the vocabulary has 259 tokens",
        ),
    ] {
        let (st, p, m) = error(&base, "/v1/completions", json!({"prompt": "a", "logit_bias": bias})).await;
        assert_eq!((st, p.as_str()), (400, Some(param)), "{bias}: {m}");
        assert!(m.contains(msg), "{bias}: {m:?} lacks {msg:?}");
    }
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_nulls_ranges_and_types_name_their_field() {
    let (s, base) = start(tiny_dir("tiny-fields"), args("tiny-fields")).await;
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let cmpl = |extra: Value| {
        let mut b = json!({"prompt": "hi", "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {}}}]);
    // (path, body, param, message fragment)
    let cases = vec![
        // Tools: "auto" (their default) needs a parser; rendered only by a template that
        // renders them (this one does not).
        ("/v1/chat/completions", chat(json!({"tools": tools})), "tool_choice", "`--tool-call-parser hermes`"),
        (
            "/v1/chat/completions",
            chat(json!({"tools": tools, "tool_choice": "none"})),
            "tools",
            "this model's chat template does not render tools",
        ),
        ("/v1/chat/completions", chat(json!({"tool_choice": "auto"})), "tool_choice", "`tool_choice` needs `tools`"),
        ("/v1/chat/completions", chat(json!({"tools": [], "tool_choice": "auto"})), "tool_choice", "needs `tools`"),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]})),
            "tools[0].function.parameters",
            "invalid type: integer `3`, expected a map",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_object"}})),
            "response_format",
            "`response_format` is not supported",
        ),
        ("/v1/chat/completions", chat(json!({"echo": true})), "echo", "`echo` is not supported"),
        ("/v1/chat/completions", chat(json!({"frobnicate": 1})), "frobnicate", "`frobnicate` is not supported"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x", "weight": 1}]}),
            "messages[0].weight",
            "`messages[0].weight` is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
            "`messages[0].tool_calls` is only for assistant messages, not user",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": "}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
            "must be a JSON string of the arguments: EOF while parsing",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls[0].id",
            "missing field `id`",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]}),
            "messages[0].content[0].cache",
            "not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "messages[0].content[0].text",
            "`messages[0].content[0].text` is missing (a \"text\" part)",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}]}),
            "messages[0].content[1].type",
            "`messages[0].content[1].type` \"image_url\" is not supported (only text)",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages[0].role",
            "`messages[0].role` must be one of system, user, assistant, tool, developer; got \"robot\"",
        ),
        ("/v1/chat/completions", json!({"max_tokens": 2}), "messages", "missing field `messages`"),
        // A prompt over the context on its own is the field at fault, not `max_tokens`.
        (
            "/v1/completions",
            json!({"prompt": vec![5; 200], "max_tokens": 1}),
            "prompt",
            "maximum context length is 128",
        ),
        (
            "/v1/completions",
            json!({"prompt": vec![5; 100], "max_tokens": 100}),
            "max_tokens",
            "(100 in the prompt, 100",
        ),
        ("/v1/completions", cmpl(json!({"suffix": "end"})), "suffix", "`suffix` is not supported"),
        // Untagged unions say what they accept (not serde's "untagged enum" wording).
        ("/v1/completions", cmpl(json!({"stop": 5})), "stop", "a string or a list of strings"),
        ("/v1/completions", json!({"prompt": ["a", 1]}), "prompt", "a list of token ids or a list of token-id lists"),
        (
            "/v1/rollouts",
            json!({"prompts": [[-1]]}),
            "prompts[0]",
            "a list of token ids or {\"messages\": [...], \"tools\": [...]}",
        ),
        ("/v1/completions", cmpl(json!({"best_of": 2})), "best_of", "`best_of` is not supported"),
        ("/v1/completions", cmpl(json!({"top_logprobs": 2})), "top_logprobs", "`top_logprobs` is not supported"),
        (
            "/v1/completions",
            cmpl(json!({"stream_options": {"include_usage": true, "x": 1}})),
            "stream_options.x",
            "unknown field `x`",
        ),
        ("/v1/rollouts", json!({"prompts": ["a"], "tools": tools}), "tools", "`tools` is not supported"),
        ("/v1/rollouts", json!({"prompts": [{"messages": [], "extra": 1}]}), "prompts[0].extra", "not supported"),
        // A rollout prompt's errors name it.
        (
            "/v1/rollouts",
            json!({"prompts": ["a", {"messages": [{"role": "user", "content": "x"}, {"role": "tool"}]}]}),
            "prompts[1].messages[1].content",
            "`prompts[1].messages[1].content` is required for a tool message",
        ),
        ("/v1/rollouts", json!({"prompts": [{"messages": []}]}), "prompts[0].messages", "must hold at least one"),
        (
            "/tokenize",
            json!({"prompt": "a", "tools": tools}),
            "tools",
            "`tools` applies to `messages`, not to `prompt`",
        ),
        (
            "/tokenize",
            json!({"prompt": "a", "chat_template_kwargs": {"x": 1}}),
            "chat_template_kwargs",
            "applies to `messages`",
        ),
        ("/v1/feedback", json!({"id": "x", "choice": 0, "reward": 1, "note": "hi"}), "note", "not supported"),
        // vLLM's combinations: no stream_options or prompt_logprobs without / with a stream.
        ("/v1/completions", cmpl(json!({"stream_options": {}})), "stream_options", "only be set when `stream` is true"),
        (
            "/v1/completions",
            cmpl(json!({"stream": true, "prompt_logprobs": 1})),
            "prompt_logprobs",
            "not available when `stream` is true",
        ),
        ("/v1/completions", cmpl(json!({"seed": -2})), "seed", "`seed` must be in [0, 2^64) or -1 (random), got -2"),
        // Ranges name the field at fault.
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
            "`top_logprobs` must be at most 20, got 21",
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stop_token_ids": [3, 259]})),
            "stop_token_ids",
            "`stop_token_ids` holds token id 259, which is out of range: the vocabulary has 259 tokens",
        ),
        ("/v1/completions", cmpl(json!({"stop_token_ids": [100000]})), "stop_token_ids", "token id 100000"),
        (
            "/v1/chat/completions",
            chat(json!({"continue_final_message": true})),
            "continue_final_message",
            "needs `add_generation_prompt: false`",
        ),
        // Type errors name the field (with its path).
        (
            "/v1/completions",
            cmpl(json!({"max_tokens": "ten"})),
            "max_tokens",
            "invalid type: string \"ten\", expected an integer in [0, 2^64)",
        ),
        (
            "/v1/completions",
            cmpl(json!({"n": -1})),
            "n",
            "invalid value: integer `-1`, expected an integer in [0, 2^64)",
        ),
        ("/v1/completions", cmpl(json!({"echo": "yes"})), "echo", "expected a boolean"),
        ("/v1/completions", cmpl(json!({"stream": 1})), "stream", "expected a boolean"),
        (
            "/v1/completions",
            cmpl(json!({"temperature": [1]})),
            "temperature",
            "invalid type: sequence, expected a number",
        ),
        (
            "/v1/completions",
            cmpl(json!({"seed": 1.5})),
            "seed",
            "invalid type: floating point `1.5`, expected an integer",
        ),
        ("/v1/completions", cmpl(json!({"seed": 1e20})), "seed", "floating point `1e+20`, expected an integer"),
        ("/v1/completions", cmpl(json!({"max_tokens": 1e23})), "max_tokens", "expected an integer in [0, 2^64)"),
        (
            "/v1/completions",
            cmpl(json!({"stop_token_ids": [-3]})),
            "stop_token_ids[0]",
            "invalid value: integer `-3`, expected an integer in [0, 2^32)",
        ),
        ("/v1/chat/completions", chat(json!({"logprobs": 1})), "logprobs", "expected a boolean"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
            "a string or a list of parts like {\"type\": \"text\", \"text\": \"...\"}",
        ),
        ("/v1/chat/completions", json!({"messages": [{"content": "x"}]}), "messages[0].role", "missing field `role`"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": null}]}),
            "messages[0].content",
            "`messages[0].content` is required for a user message",
        ),
        ("/v1/completions", json!([1, 2]), "", "the request body must be a JSON object, got an array"),
    ];
    for (path, body, param, msg) in &cases {
        let (st, p, m) = error(&base, path, body.clone()).await;
        assert_eq!(st, 400, "{path} {body}: {m}");
        let want = if param.is_empty() { Value::Null } else { json!(param) };
        assert_eq!(&p, &want, "{path} {body}: {m}");
        assert!(m.contains(msg), "{path} {body}: {m:?} lacks {msg:?}");
    }
    // Explicit nulls are absent fields (OpenAI clients send them).
    let nulls = [
        "stream",
        "echo",
        "logprobs",
        "return_token_ids",
        "n",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "user",
        "stream_options",
        "logit_bias",
        "model",
        "suffix",
        "tools",
        "stop_token_ids",
        "add_special_tokens",
    ];
    let mut body = cmpl(json!({}));
    for k in nulls {
        body[k] = Value::Null;
    }
    let (st, out) = post(&base, "/v1/completions", body).await;
    assert_eq!(st, 200, "{out}");
    // Whole numbers written as floats are those integers (pydantic's lax mode, as vLLM).
    let body = json!({"prompt": "hi", "max_tokens": 3.0, "n": 2.0, "ignore_eos": true, "seed": 7.0});
    let (st, out) = post(&base, "/v1/completions", body).await;
    assert_eq!((st, &out["usage"]["completion_tokens"]), (200, &json!(6)), "{out}");
    let mut body = chat(json!({}));
    for k in [
        "stream",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "continue_final_message",
        "return_token_ids",
        "max_completion_tokens",
        "tools",
        "response_format",
        "tool_choice",
    ] {
        body[k] = Value::Null;
    }
    body["messages"] = json!([{"role": "user", "content": "hi", "name": null, "tool_calls": null},
                             {"role": "assistant", "content": null, "refusal": null}]);
    let (st, out) = post(&base, "/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["choices"][0]["message"]["role"], "assistant");
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assistant_prefill_is_continued_over_http() {
    let (s, base) = start(tiny_dir("tiny-prefill"), args("tiny-prefill")).await;
    let msgs = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]);
    let tok = |extra: Value| {
        let mut b = json!({"messages": msgs});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let (_, open) =
        post(&base, "/tokenize", tok(json!({"continue_final_message": true, "add_generation_prompt": false}))).await;
    let (_, closed) = post(&base, "/tokenize", tok(json!({"add_generation_prompt": false}))).await;
    let (_, reopened) = post(&base, "/tokenize", tok(json!({}))).await;
    let ids = |v: &Value| -> Vec<u64> { serde_json::from_value(v["tokens"].clone()).unwrap() };
    let (open, closed, reopened) = (ids(&open), ids(&closed), ids(&reopened));
    // "…<|im_start|>assistant\nSure:" | "<|im_end|>\n" | "<|im_start|>assistant\n".
    let sure: Vec<u64> = "Sure:".bytes().map(|b| (b - 33) as u64).collect();
    assert!(open.ends_with(&sure), "{open:?}");
    let (_, newline) = post(&base, "/tokenize", json!({"prompt": "\n", "add_special_tokens": false})).await;
    assert_eq!(closed[..open.len()], open[..]);
    assert_eq!(json!(closed[open.len()..]), json!([258, newline["tokens"][0]]), "<|im_end|>, then a newline");
    assert_eq!(reopened[..closed.len()], closed[..]);
    assert_eq!(reopened[closed.len()], 257);
    let body = json!({"messages": msgs, "continue_final_message": true, "add_generation_prompt": false,
                      "max_tokens": 3, "temperature": 0, "return_token_ids": true});
    let (st, out) = post(&base, "/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["prompt_token_ids"], json!(open), "the engine continues the prefill");
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_streamed_chat_choice_starts_with_the_role() {
    let (s, base) = start(tiny_dir("tiny-role"), args("tiny-role")).await;
    // EOS (258) first: three choices that finish without any text.
    for bias in [json!({"258": 100}), json!({})] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2, "seed": 1,
                          "stream": true, "logit_bias": bias});
        let events = stream(&base, "/v1/chat/completions", body).await;
        let mut seen = std::collections::BTreeSet::new();
        for e in events.iter().filter(|e| *e != "[DONE]") {
            let v: Value = serde_json::from_str(e).unwrap();
            for c in v["choices"].as_array().unwrap() {
                let first = seen.insert(c["index"].as_u64().unwrap());
                assert_eq!(c["delta"]["role"].as_str().is_some(), first, "role on the first chunk only: {v}");
                if first {
                    assert_eq!(c["delta"]["role"], "assistant");
                }
            }
        }
        assert_eq!(seen.len(), 3, "{bias}: {events:?}");
        if bias != json!({}) {
            let texts = crate::server::stream_texts(&events);
            assert!(texts.iter().all(String::is_empty), "{texts:?}");
        }
    }
    s.shutdown(Duration::from_secs(5)).await;
}

/// vLLM's defaults: `stream_options: {}` means `include_usage: true` (the last chunk before
/// `[DONE]` carries the usage, the others `"usage": null` as OpenAI documents), and `seed:
/// -1` is a random seed. `continuous_usage_stats` puts the usage so far in every chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_options_default_to_usage_and_seed_minus_one_is_random() {
    let (s, base) = start(tiny_dir("tiny-vllm-defaults"), args("tiny-vllm-defaults")).await;
    let chunks = async |options: Value| {
        let body = json!({"prompt": "ab", "max_tokens": 3, "stream": true, "stream_options": options, "ignore_eos": true,
                          // A chunk per token, even one that ends inside a character.
                          "return_token_ids": true});
        let events = crate::server::stream(&base, "/v1/completions", body).await;
        assert_eq!(events.last().unwrap(), "[DONE]");
        events[..events.len() - 1].iter().map(|e| serde_json::from_str::<Value>(e).unwrap()).collect::<Vec<_>>()
    };
    let plain = chunks(Value::Null).await;
    assert!(plain.iter().all(|c| c.get("usage").is_none()), "{plain:?}");
    let usage = chunks(json!({})).await;
    let (last, others) = usage.split_last().unwrap();
    assert_eq!((&last["choices"], &last["usage"]["completion_tokens"]), (&json!([]), &json!(3)), "{usage:?}");
    assert!(others.iter().all(|c| c["usage"].is_null() && c.get("usage").is_some()), "{others:?}");
    let continuous = chunks(json!({"continuous_usage_stats": true})).await;
    let so_far: Vec<u64> = continuous.iter().map(|c| c["usage"]["completion_tokens"].as_u64().unwrap()).collect();
    assert_eq!(so_far, [1, 2, 3, 3], "{continuous:?}");
    assert!(continuous.iter().all(|c| c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"]));
    let (st, out) = post(&base, "/v1/completions", json!({"prompt": "ab", "max_tokens": 3, "seed": -1})).await;
    assert_eq!(st, 200, "{out}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// `echo` with `logprobs` scores the prompt as vLLM does (lm-eval's `local-completions`
/// reads `token_logprobs[ctxlen:]`): the prompt's tokens come first in `logprobs`, the
/// first with `null`, each other with its raw log-probability given the tokens before it
/// (the `prompt_logprobs` of the same prompt), then the generated token; offsets from 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_with_logprobs_scores_the_prompt() {
    let (s, base) = start(tiny_dir("tiny-echo"), args("tiny-echo")).await;
    let prompt = json!([40, 41, 42, 43, 44]);
    let body = json!({"prompt": prompt, "max_tokens": 1, "echo": true, "logprobs": 1, "temperature": 0, "n": 2});
    let (st, out) = post(&base, "/v1/completions", body).await;
    assert_eq!(st, 200, "{out}");
    let lp = &out["choices"][0]["logprobs"];
    // Every one of the `n` choices covers the echoed prompt.
    let second = &out["choices"][1]["logprobs"];
    assert_eq!(second["token_logprobs"].as_array().unwrap()[..5], lp["token_logprobs"].as_array().unwrap()[..5]);
    assert_eq!(second["text_offset"], lp["text_offset"], "{out}");
    let got = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(got.len(), 6, "5 prompt tokens and 1 generated: {lp}");
    assert!(got[0].is_null() && lp["top_logprobs"][0].is_null(), "{lp}");
    assert_eq!(lp["tokens"].as_array().unwrap()[..5], json!(["I", "J", "K", "L", "M"]).as_array().unwrap()[..]);
    assert_eq!(lp["text_offset"].as_array().unwrap()[..3], json!([0, 1, 2]).as_array().unwrap()[..]);
    let (_, pl) =
        post(&base, "/v1/completions", json!({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})).await;
    for i in 1..5 {
        let want = &pl["choices"][0]["prompt_logprobs"][i][(40 + i).to_string()]["logprob"];
        assert_eq!(&got[i], want, "prompt token {i}");
    }
    assert!(got[5].as_f64().unwrap() < 0.0);
    // Without echo, only the generated token.
    let (_, plain) = post(&base, "/v1/completions", json!({"prompt": prompt, "max_tokens": 1, "logprobs": 1})).await;
    assert_eq!(plain["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().len(), 1);
    s.shutdown(Duration::from_secs(5)).await;
}

/// vLLM's `chat_template_kwargs` reach the template (Qwen3's `enable_thinking: false` closes
/// an empty think block after the generation prompt), on `/tokenize` and chat; a key that
/// would replace the template's own variables is a 400 naming it. A message's `name` reaches
/// it as `message.name`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_reach_the_template() {
    let dir = tiny_dir("tiny-kwargs");
    let path = dir.join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let think = "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}";
    let names = "{% for m in messages %}{% if m.name is defined %}{{ '[' + m.name + ']' }}{% endif %}{% endfor %}";
    cfg["chat_template"] = json!(format!("{names}{}{think}", tests::tiny::CHAT_TEMPLATE));
    std::fs::write(&path, cfg.to_string()).unwrap();
    let (s, base) = start(dir, args("tiny-kwargs")).await;
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let (_, plain) = post(&base, "/tokenize", json!({"messages": msgs})).await;
    let kwargs = json!({"enable_thinking": false});
    let (st, thinking) = post(&base, "/tokenize", json!({"messages": msgs, "chat_template_kwargs": kwargs})).await;
    assert_eq!(st, 200, "{thinking}");
    let (a, b) = (plain["tokens"].as_array().unwrap(), thinking["tokens"].as_array().unwrap());
    assert_eq!(b[..a.len()], a[..], "the same conversation, then the closed think block");
    let (_, tail) = post(&base, "/detokenize", json!({"tokens": b[a.len()..]})).await;
    assert_eq!(tail["prompt"], "<think>\n\n</think>\n\n");
    let body = json!({"messages": msgs, "max_tokens": 2, "chat_template_kwargs": kwargs, "return_token_ids": true});
    let (st, out) = post(&base, "/v1/chat/completions", body).await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["prompt_token_ids"], thinking["tokens"], "chat renders what /tokenize does");
    let (st, p, m) =
        error(&base, "/tokenize", json!({"messages": msgs, "chat_template_kwargs": {"messages": []}})).await;
    assert_eq!((st, p.as_str()), (400, Some("chat_template_kwargs")), "{m}");
    assert!(m.contains("`chat_template_kwargs.messages` would replace the template's own `messages`"), "{m}");
    let named = json!([{"role": "user", "content": "hi", "name": "bob"}]);
    let (st, with_name) = post(&base, "/tokenize", json!({"messages": named})).await;
    assert_eq!(st, 200, "{with_name}");
    let (_, text) = post(&base, "/detokenize", json!({"tokens": with_name["tokens"]})).await;
    let (_, plain_text) = post(&base, "/detokenize", json!({"tokens": plain["tokens"]})).await;
    assert_eq!(text["prompt"], format!("[bob]{}", plain_text["prompt"].as_str().unwrap()));
    s.shutdown(Duration::from_secs(5)).await;
}

/// A tiny model that answers `<think>r</think>c` and stops, whatever the prompt
/// ([`chain_model`]; `<think>` and `</think>` are ids 259 and 260, not special, so they stay
/// in the text as Qwen3's do).
fn thinking_model(name: &str) -> std::path::PathBuf {
    chain_model(name, &["<think>", "</think>"], &["\n", "<think>", "r", "</think>", "c", "<|im_end|>"])
}

/// A tiny model that writes `chain[1..]` after a prompt ending in `chain[0]` and stops,
/// whatever the prompt: `added` become added tokens (ids 259, …; not special), the layers
/// add nothing (`o_proj` and `down_proj` are zero), so the last hidden state is the current
/// token's embedding and the next token a function of the current one: each token of the
/// chain has an embedding along its own axis, which the LM-head row of its successor reads.
/// Every chain token but the last must be distinct, and a single token.
fn chain_model(name: &str, added: &[&str], chain: &[&str]) -> std::path::PathBuf {
    let dir = tests::temp_dir(name);
    let spec = tests::tiny::TinySpec { tied: false, ..Default::default() };
    let mut w = spec.weights();
    let h = spec.hidden;
    let vocab = tests::tiny::VOCAB + added.len();
    for (name, (shape, v)) in w.iter_mut() {
        if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
            v.fill(0.0);
        }
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            shape[0] = vocab;
            v.resize(vocab * h, 0.0);
        }
        if name == "lm_head.weight" || name == "model.norm.weight" {
            v.fill(if name == "model.norm.weight" { 1.0 } else { 0.0 });
        }
    }
    spec.write_weights(&dir, w.clone());
    let mut tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let tokens: Vec<_> = added.iter().map(|t| tokenizers::AddedToken::from(*t, false)).collect();
    tok.add_tokens(&tokens);
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let id = |t: &str| {
        let ids = tok.encode(t, false).unwrap().get_ids().to_vec();
        assert_eq!(ids.len(), 1, "{t:?} is one token");
        ids[0] as usize
    };
    let chain: Vec<usize> = chain.iter().map(|t| id(t)).collect();
    assert!(chain.len() <= h, "one axis per chain token");
    let embed = &mut w.get_mut("model.embed_tokens.weight").unwrap().1;
    for (axis, pair) in chain.windows(2).enumerate() {
        let row = &mut embed[pair[0] * h..(pair[0] + 1) * h];
        row.fill(0.0);
        row[axis] = 4.0;
    }
    let lm = &mut w.get_mut("lm_head.weight").unwrap().1;
    for (axis, pair) in chain.windows(2).enumerate() {
        lm[pair[1] * h + axis] = 6.0;
    }
    spec.write_weights(&dir, w);
    // write_weights wrote the plain tiny tokenizer again.
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = json!(vocab);
    // Room for the tool fixture's longest conversation (one token per byte).
    config["max_position_embeddings"] = json!(4096);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

/// `--reasoning-parser qwen3` over HTTP on an answer that thinks (`<think>r</think>c`, from
/// [`thinking_model`]): `reasoning_content` is "r" and `content` "c", whole and streamed
/// alike (the deltas add up to them), while the token ids keep every generated token, the
/// tags included; without the parser the tags are in `content`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoning_parser_splits_a_thinking_answer() {
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0.0,
                      "return_token_ids": true});
    let a = server::serve::ServeArgs {
        reasoning_parser: Some(server::api::reasoning::ReasoningParser::Qwen3),
        ..args("tiny-thinking")
    };
    let (s, base) = start(thinking_model("tiny-thinking"), a).await;
    let (st, out) = post(&base, "/v1/chat/completions", body.clone()).await;
    assert_eq!(st, 200, "{out}");
    let choice = &out["choices"][0];
    assert_eq!(
        (choice["message"]["reasoning_content"].as_str(), choice["message"]["content"].as_str()),
        (Some("r"), Some("c")),
        "{out}"
    );
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["token_ids"].as_array().unwrap().len(), 5, "<think> r </think> c and the end token: {out}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in stream(&base, "/v1/chat/completions", streamed).await.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let delta = &v["choices"][0]["delta"];
        reasoning += delta["reasoning_content"].as_str().unwrap_or("");
        content += delta["content"].as_str().unwrap_or("");
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("r", "c"));
    s.shutdown(Duration::from_secs(5)).await;
    let (s, base) = start(thinking_model("tiny-thinking-off"), args("tiny-thinking-off")).await;
    let (_, out) = post(&base, "/v1/chat/completions", body).await;
    assert_eq!(out["choices"][0]["message"]["content"], "<think>r</think>c", "{out}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// `--reasoning-parser qwen3` over HTTP (the split itself is unit-tested in
/// `server::api::reasoning`): an answer that does not open with `<think>` is all `content`
/// and has no `reasoning_content`, also when it begins like the tag ("<<<<": the stream holds
/// the first "<" until it knows), and the streamed deltas add up to the whole message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoning_parser_leaves_answers_without_thinking_alone() {
    let a = server::serve::ServeArgs {
        reasoning_parser: Some(server::api::reasoning::ReasoningParser::Qwen3),
        ..args("tiny-reasoning")
    };
    let (s, base) = start(tiny_dir("tiny-reasoning"), a).await;
    for bias in [json!({}), json!({"27": 100})] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 3,
                          "ignore_eos": true, "logit_bias": bias});
        let (st, out) = post(&base, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{out}");
        let msg = &out["choices"][0]["message"];
        assert!(msg.get("reasoning_content").is_none(), "{msg}");
        if bias != json!({}) {
            assert_eq!(msg["content"], "<<<<");
        }
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = stream(&base, "/v1/chat/completions", streamed).await;
        let text: String = events
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .map(|v| {
                assert!(v["choices"][0]["delta"].get("reasoning_content").is_none(), "{v}");
                v["choices"][0]["delta"]["content"].as_str().unwrap_or("").to_string()
            })
            .collect();
        assert_eq!(text, msg["content"].as_str().unwrap(), "{events:?}");
    }
    s.shutdown(Duration::from_secs(5)).await;
}

/// A tiny model that answers `Checking.` and two Hermes tool calls, whatever the prompt
/// ([`chain_model`]); [`tool_args`] serve it with the tool fixture's chat template.
fn tool_model(name: &str) -> std::path::PathBuf {
    const CALL_1: &str = "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"tz\": 1.0}}\n</tool_call>";
    const CALL_2: &str = "\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": [1, 2]}}\n</tool_call>";
    chain_model(name, &["Checking.", CALL_1, CALL_2], &["\n", "Checking.", CALL_1, CALL_2, "<|im_end|>"])
}

/// `--tool-call-parser hermes --chat-template tests/fixtures/tool_chat/template.jinja`.
fn tool_args() -> server::serve::ServeArgs {
    server::serve::ServeArgs {
        tool_call_parser: Some(server::api::tools::ToolParser::Hermes),
        chat_template: Some(tests::fixture("tool_chat/template.jinja").to_str().unwrap().into()),
        ..args("t")
    }
}

/// The fixture's conversations (tests/fixtures/make_tool_chat_reference.py) as an OpenAI
/// client sends them: call arguments as JSON strings.
fn tool_fixture_cases() -> Vec<(Value, Value, Value, String)> {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(tests::fixture("tool_chat/reference.json")).unwrap()).unwrap();
    let cases = r["cases"].as_array().unwrap().iter();
    cases
        .map(|c| {
            let mut msgs = c["messages"].clone();
            for m in msgs.as_array_mut().unwrap() {
                for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
                    call["function"]["arguments"] = json!(call["function"]["arguments"].to_string());
                }
            }
            (msgs, c["tools"].clone(), c["add_generation_prompt"].clone(), c["text"].as_str().unwrap().to_string())
        })
        .collect()
}

/// Over HTTP, tools and tool-call conversations reach the template as transformers renders
/// them (the fixture's text; a schema's `1.0` stays a float), for `/tokenize`, chat and
/// rollouts alike (the same prompt ids).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_conversations_reach_the_template_as_hf_renders_them() {
    let a = tool_args();
    let (s, base) = start(tool_model("tiny-tool-render"), a).await;
    for (msgs, tools, agp, text) in tool_fixture_cases() {
        let body = json!({"messages": msgs, "tools": tools, "add_generation_prompt": agp});
        let (st, t) = post(&base, "/tokenize", body).await;
        assert_eq!(st, 200, "{t}");
        let (_, d) = post(&base, "/detokenize", json!({"tokens": t["tokens"]})).await;
        assert_eq!(d["prompt"].as_str().unwrap(), text);
        if agp == json!(true) {
            let body = json!({"messages": msgs, "tools": tools, "max_tokens": 1, "return_token_ids": true});
            let (st, out) = post(&base, "/v1/chat/completions", body).await;
            assert_eq!((st, &out["prompt_token_ids"]), (200, &t["tokens"]), "{out}");
            let prompt =
                if tools.is_null() { json!({"messages": msgs}) } else { json!({"messages": msgs, "tools": tools}) };
            let (st, r) = post(&base, "/v1/rollouts", json!({"prompts": [prompt], "max_tokens": 1})).await;
            assert_eq!((st, &r["rollouts"][0]["prompt_token_ids"]), (200, &t["tokens"]), "{r}");
        }
    }
    // Numbers in tools render as Python writes them (exact float parsing, whole floats kept).
    let tools =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"x": 123456789.12345679, "y": 2.0}}}]);
    let (_, t) =
        post(&base, "/tokenize", json!({"messages": [{"role": "user", "content": "x"}], "tools": tools})).await;
    let (_, d) = post(&base, "/detokenize", json!({"tokens": t["tokens"]})).await;
    assert!(d["prompt"].as_str().unwrap().contains("{\"x\": 123456789.12345679, \"y\": 2.0}"), "{d}");
    // Text parts are joined by a newline, as vLLM joins them.
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]);
    let (_, p) = post(&base, "/tokenize", json!({"messages": parts})).await;
    let (_, j) = post(&base, "/tokenize", json!({"messages": [{"role": "user", "content": "a\nb"}]})).await;
    assert_eq!(p["tokens"], j["tokens"]);
    let bad = json!({"prompts": [{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "f"}]}]});
    let (st, e) = post(&base, "/v1/rollouts", bad).await;
    assert_eq!((st, &e["error"]["param"]), (400, &json!("prompts[0].tools[0].type")), "{e}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// `--tool-call-parser hermes` on an answer of text and two calls ([`tool_model`]): the
/// text is `content`, the calls `tool_calls` (arguments as Python's `json.dumps`), and
/// `finish_reason` is `tool_calls`; the streamed deltas add up to the same message;
/// `parallel_tool_calls: false` keeps the first call; a cut-off answer stays `length`;
/// `tool_choice: "none"` returns the raw text; the answer fed back with tool results renders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_are_parsed_out_of_answers_whole_and_streamed() {
    let a = tool_args();
    let (s, base) = start(tool_model("tiny-tool-calls"), a).await;
    let tools = json!([{"type": "function", "function": {"name": "now"}},
                       {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]);
    let body = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "time?"}], "tools": tools, "max_tokens": 10,
                           "temperature": 0.0});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let now = json!({"name": "now", "arguments": "{\"tz\": 1.0}"});
    let add = json!({"name": "add", "arguments": "{\"a\": [1, 2]}"});
    let (st, out) = post(&base, "/v1/chat/completions", body(json!({}))).await;
    assert_eq!(st, 200, "{out}");
    let choice = &out["choices"][0];
    let message = &choice["message"];
    assert_eq!((&message["content"], &choice["finish_reason"]), (&json!("Checking."), &json!("tool_calls")), "{out}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.iter().map(|c| c["function"].clone()).collect::<Vec<_>>(), vec![now.clone(), add.clone()]);
    for c in calls {
        assert_eq!(c["type"], "function");
        assert!(c["id"].as_str().unwrap().starts_with("chatcmpl-tool-"), "{c}");
    }
    assert_ne!(calls[0]["id"], calls[1]["id"]);

    // Streamed: content deltas and calls by index add up to the same message.
    let events = stream(&base, "/v1/chat/completions", body(json!({"stream": true}))).await;
    let (mut content, mut streamed, mut finish) = (String::new(), Vec::<Value>::new(), Value::Null);
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        let c = &v["choices"][0];
        content += c["delta"]["content"].as_str().unwrap_or("");
        for call in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], json!(streamed.len()), "{call}");
            streamed.push(call["function"].clone());
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    assert_eq!(
        (content.as_str(), streamed, finish),
        ("Checking.", vec![now.clone(), add.clone()], json!("tool_calls"))
    );

    let (_, out) = post(&base, "/v1/chat/completions", body(json!({"parallel_tool_calls": false}))).await;
    assert_eq!(out["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 1, "{out}");
    let (_, out) = post(&base, "/v1/chat/completions", body(json!({"max_tokens": 2}))).await;
    let choice = &out["choices"][0];
    assert_eq!((&choice["finish_reason"], &choice["message"]["tool_calls"][0]["function"]), (&json!("length"), &now));
    let (_, out) = post(&base, "/v1/chat/completions", body(json!({"tool_choice": "none"}))).await;
    let message = &out["choices"][0]["message"];
    assert!(message["tool_calls"].is_null(), "{out}");
    assert!(message["content"].as_str().unwrap().starts_with("Checking.<tool_call>\n{\"name\": \"now\""), "{out}");
    assert_eq!(out["choices"][0]["finish_reason"], "stop");

    // The assistant turn and the tool results go back in, as an OpenAI client sends them.
    let mut answer = post(&base, "/v1/chat/completions", body(json!({}))).await.1["choices"][0]["message"].clone();
    answer.as_object_mut().unwrap().retain(|_, v| !v.is_null());
    // As the OpenAI client accumulates streamed calls: each keeps its `index`.
    for (k, c) in answer["tool_calls"].as_array_mut().unwrap().iter_mut().enumerate() {
        c["index"] = json!(k);
    }
    let ids: Vec<Value> = answer["tool_calls"].as_array().unwrap().iter().map(|c| c["id"].clone()).collect();
    let msgs = json!([{"role": "user", "content": "time?"}, answer,
        {"role": "tool", "tool_call_id": ids[0], "content": "09:00"}, {"role": "tool", "tool_call_id": ids[1], "content": "3"}]);
    let (st, t) = post(&base, "/tokenize", json!({"messages": msgs, "tools": tools})).await;
    assert_eq!(st, 200, "{t}");
    let (_, d) = post(&base, "/detokenize", json!({"tokens": t["tokens"]})).await;
    let text = d["prompt"].as_str().unwrap();
    let turn = "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {\"tz\": 1.0}}\n</tool_call>";
    assert!(text.contains(turn), "{text}");
    assert!(text.contains(&format!("<tool_response id=\"{}\">\n3\n</tool_response>", ids[1].as_str().unwrap())));
    s.shutdown(Duration::from_secs(5)).await;
}

/// `--tool-call-parser llama3_json` on an answer that is one `{"name", "parameters"}` object
/// ([`chain_model`]): a call with no content, whole and streamed alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama3_json_calls_are_parsed_out_of_answers() {
    const CALL: &str = "{\"name\": \"now\", \"parameters\": {\"tz\": 1.0}}";
    let dir = chain_model("tiny-tool-llama3", &[CALL], &["\n", CALL, "<|im_end|>"]);
    let a =
        server::serve::ServeArgs { tool_call_parser: Some(server::api::tools::ToolParser::Llama3Json), ..tool_args() };
    let (s, base) = start(dir, a).await;
    let body = json!({"messages": [{"role": "user", "content": "t?"}], "max_tokens": 4, "temperature": 0.0,
                      "tools": [{"type": "function", "function": {"name": "now"}}]});
    let (st, out) = post(&base, "/v1/chat/completions", body.clone()).await;
    assert_eq!(st, 200, "{out}");
    let choice = &out["choices"][0];
    let now = json!({"name": "now", "arguments": "{\"tz\": 1.0}"});
    assert_eq!(
        (&choice["message"]["content"], &choice["finish_reason"]),
        (&Value::Null, &json!("tool_calls")),
        "{out}"
    );
    assert_eq!(choice["message"]["tool_calls"][0]["function"], now, "{out}");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let events = stream(&base, "/v1/chat/completions", streamed).await;
    let calls: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .flat_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default()
        })
        .map(|c| c["function"].clone())
        .collect();
    assert_eq!(calls, vec![now]);
    s.shutdown(Duration::from_secs(5)).await;
}
