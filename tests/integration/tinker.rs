//! The Tinker API's server-side rules over HTTP (the SDK's own run is tests/tinker_client.py
//! in .ci/run): the key in `X-API-Key` with or without the SDK's `tml-` prefix, futures and
//! their long poll, one training client at a time (a second session is refused until the
//! first finishes; a session's new client replaces its previous one, whose calls then name
//! it), `seq_id` de-duplication, an optimizer step as a new policy version (out-of-range AdamW
//! parameters refused), and clear errors for a wrong base model, a body that is not protobuf and an endpoint rlserve
//! does not implement.

use crate::rl::{start_server, tiny};
use serde_json::{json, Value};
use server::serve::ServeArgs;
use std::time::Duration;
use tests::eventually;

struct Client {
    base: String,
    key: Option<&'static str>,
}

impl Client {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let mut r = reqwest::Client::new().post(format!("{}/api/v1/{path}", self.base)).json(&body);
        if let Some(k) = self.key {
            r = r.header("X-API-Key", k);
        }
        let r = r.send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Posts a call that returns a future and polls it to its JSON result.
    async fn result(&self, path: &str, body: Value) -> Value {
        let (st, f) = self.post(path, body).await;
        assert_eq!(st, 200, "{path}: {f}");
        self.poll(f["request_id"].as_str().unwrap()).await
    }

    async fn poll(&self, id: &str) -> Value {
        loop {
            let (st, v) = self.post("retrieve_future", json!({"request_id": id})).await;
            assert_eq!(st, 200, "{v}");
            if v["type"] != "try_again" {
                return v;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tinker_sessions_futures_and_the_one_training_client() {
    let args =
        ServeArgs { admin_key: Some("sekret".into()), served_model_name: Some("tiny".into()), ..Default::default() };
    let (s, base) = start_server(tiny("tinker-api", 81), args).await;
    let anon = Client { base: base.clone(), key: None };
    let (st, v) = anon.post("client/config", json!({"sdk_version": "0.38.0"})).await;
    assert_eq!(st, 401, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("X-API-Key: tml-<--admin-key>"), "{v}");
    // The SDK only sends tml- keys: `tml-<admin key>` and the admin key itself both work.
    for key in ["tml-sekret", "sekret"] {
        let (st, v) = Client { base: base.clone(), key: Some(key) }.post("client/config", json!({})).await;
        assert_eq!(
            (st, &v["use_pyqwest_transport"], &v["parallel_fwdbwd_chunks"]),
            (200, &json!(false), &json!(false))
        );
    }
    let c = Client { base: base.clone(), key: Some("tml-sekret") };
    let (_, v) = c.post("create_session", json!({"tags": [], "sdk_version": "0.38.0", "type": "create_session"})).await;
    let session = v["session_id"].as_str().unwrap().to_string();
    let (st, _) = c.post("session_heartbeat", json!({"session_id": session, "type": "session_heartbeat"})).await;
    assert_eq!(st, 200);
    let (st, _) = c.post("session_heartbeat", json!({"session_id": "session-x"})).await;
    assert_eq!(st, 410, "an unknown session's heartbeat stops the SDK's loop");

    // A wrong base model fails the future with a user error naming the served model.
    let model = |session: &str, base_model: &str| {
        json!({"session_id": session, "model_seq_id": 0, "base_model": base_model,
               "lora_config": {"rank": 8}, "type": "create_model"})
    };
    let v = c.result("create_model", model(&session, "Qwen/Qwen3-8B")).await;
    assert_eq!(v["category"], "user", "{v}");
    assert!(v["error"].as_str().unwrap().contains("this server trains the model it serves, `tiny`"), "{v}");
    let v = c.result("create_model", model(&session, "tiny")).await;
    let model_id = v["model_id"].as_str().unwrap().to_string();
    assert_eq!(model_id, format!("{session}:train:0"));
    let caps =
        reqwest::Client::new().get(format!("{base}/api/v1/get_server_capabilities")).header("X-API-Key", "tml-sekret");
    let caps: Value = caps.send().await.unwrap().json().await.unwrap();
    assert_eq!(caps, json!({"supported_models": [{"model_name": "tiny"}]}));
    let (st, info) = c.post("get_info", json!({"model_id": model_id})).await;
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["model_data"]["tokenizer_id"], info["model_data"]["model_name"]);

    // A second session cannot open another training client while this one is open.
    let (_, v) = c.post("create_session", json!({})).await;
    let other = v["session_id"].as_str().unwrap().to_string();
    let v = c.result("create_model", model(&other, "tiny")).await;
    assert!(v["error"].as_str().unwrap().contains("of another session is open"), "{v}");

    // optim_step (no gradients yet: the moments stay, the version still moves) and a retry of
    // its seq_id, which gets the same future.
    let step = json!({"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}, "type": "optim_step"});
    let (_, f1) = c.post("optim_step", step.clone()).await;
    let (_, f2) = c.post("optim_step", step).await;
    assert_eq!(f1["request_id"], f2["request_id"], "a retried seq_id is the same request");
    let v = c.poll(f1["request_id"].as_str().unwrap()).await;
    assert_eq!(v["metrics"]["policy_version:max"], 1.0, "{v}");
    assert_eq!(v["metrics"]["learning_rate:mean"], 1e-3, "{v}");
    // Out-of-range AdamW parameters fail the step with a user error naming the SDK's field;
    // the weights are not touched (the next step is version 2).
    for (params, want) in [
        (json!({"learning_rate": -1.0}), "`adam_params.learning_rate` must be >= 0, got -1"),
        (json!({"beta2": 1.0}), "`adam_params.beta2` must be in [0, 1), got 1"),
        (json!({"eps": 0.0}), "`adam_params.eps` must be > 0, got 0"),
        (json!({"grad_clip_norm": -0.5}), "`adam_params.grad_clip_norm` must be >= 0 (0: no clipping), got -0.5"),
    ] {
        let v = c.result("optim_step", json!({"model_id": model_id, "adam_params": params})).await;
        assert_eq!((v["category"].as_str(), v["error"].as_str()), (Some("user"), Some(want)), "{v}");
    }
    let v = c.result("optim_step", json!({"model_id": model_id, "adam_params": {"learning_rate": 0.0}})).await;
    assert_eq!(v["metrics"]["policy_version:max"], 2.0, "{v}");

    // A session's new training client replaces its previous one, whose calls then name it.
    let v = c
        .result(
            "create_model",
            json!({"session_id": session, "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 8}}),
        )
        .await;
    let newer = v["model_id"].as_str().unwrap().to_string();
    assert_eq!(newer, format!("{session}:train:1"), "{v}");
    let (st, v) = c.post("optim_step", json!({"model_id": model_id})).await;
    assert_eq!(st, 404, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.starts_with(&format!("training client `{model_id}` was replaced by `{newer}`")), "{v}");
    let (st, v) = c.post("get_info", json!({"model_id": model_id})).await;
    assert_eq!((st, v["error"]["message"].as_str()), (404, Some(msg)), "{v}");

    // forward_backward takes a protobuf body; anything else is a 400 naming the message.
    let r = reqwest::Client::new()
        .post(format!("{base}/api/v1/forward_backward"))
        .header("X-API-Key", "tml-sekret")
        .header("content-type", "application/x-protobuf")
        .body(vec![0xff, 0xff, 0xff])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("not a protobuf ForwardBackwardRequest"), "{v}");
    let (st, v) = c.post("training_runs", json!({})).await;
    assert_eq!(st, 404);
    assert!(v["error"]["message"].as_str().unwrap().contains("is not part of rlserve's Tinker API"), "{v}");
    let (st, v) = c.post("retrieve_future", json!({"request_id": "req-404"})).await;
    assert_eq!(st, 404, "{v}");

    // Once the first session finishes, the other session can train.
    let (st, _) = c.post(&format!("sessions/{session}/finish"), json!({"reason": {"type": "success"}})).await;
    assert_eq!(st, 200);
    // The finished client's worker hands the learner back when its queue is done.
    let open = async || c.result("create_model", model(&other, "tiny")).await;
    let opened = eventually(Duration::from_secs(5), open, |o| o.get("model_id").is_some()).await;
    assert_eq!(opened["model_id"], format!("{other}:train:0"), "{opened}");
    s.shutdown(Duration::from_secs(5)).await;
}
