//! The web pages' server side (the pages themselves run in a real browser:
//! tests/browser/test_ui.py, run by .ci/run): the pages and their files served with their
//! content types and caching, `--no-ui`, `/v1/status`, the streamed per-token versions the
//! chat shows, and the feedback learner listed like a job.

use crate::rl::{feedback_args, tiny};
use crate::server::{args, post, start, stream, tiny_dir};
use serde_json::{json, Value};
use server::serve::ServeArgs;
use std::time::Duration;

async fn get(url: &str, headers: &[(&str, &str)]) -> reqwest::Response {
    let mut r = reqwest::Client::new().get(url);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap()
}

/// `/`, `/dashboard` and every file they load answer 200 with their content type; the
/// vendored files are cached for good, the pages revalidated (304 on a matching ETag); every
/// answer forbids framing; an unknown file is the 404 envelope; `--no-ui` serves no page and
/// leaves the API as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_are_served_with_their_types_and_caching() {
    let (s, base) = start(tiny_dir("ui-pages"), args("ui-pages")).await;
    let cases = [
        ("/", "text/html; charset=utf-8", "no-cache"),
        ("/dashboard", "text/html; charset=utf-8", "no-cache"),
        ("/ui/chat.js", "text/javascript; charset=utf-8", "no-cache"),
        (
            "/ui/vendor/uplot-1.6.32/uPlot.esm.js",
            "text/javascript; charset=utf-8",
            "public, max-age=31536000, immutable",
        ),
        (
            "/ui/vendor/marked-18.3.0/marked.esm.js",
            "text/javascript; charset=utf-8",
            "public, max-age=31536000, immutable",
        ),
    ];
    for (path, content_type, cache) in cases {
        let r = get(&format!("{base}{path}"), &[]).await;
        assert_eq!(r.status(), 200, "{path}");
        assert_eq!(r.headers()["content-type"], content_type, "{path}");
        assert_eq!(r.headers()["cache-control"], cache, "{path}");
        assert!(r.headers()["content-security-policy"].to_str().unwrap().contains("frame-ancestors 'none'"), "{path}");
        let tag = r.headers()["etag"].to_str().unwrap().to_string();
        assert_eq!(get(&format!("{base}{path}"), &[("if-none-match", &tag)]).await.status(), 304, "{path}");
    }
    let page = get(&format!("{base}/"), &[]).await.text().await.unwrap();
    assert!(page.contains(r#"<script type="module" src="/ui/chat.js">"#), "{page}");
    let r = get(&format!("{base}/ui/nope.js"), &[]).await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["message"], "no page or file /ui/nope.js");
    s.shutdown(Duration::from_secs(5)).await;

    let (s, base) = start(tiny_dir("ui-off"), ServeArgs { no_ui: true, ..args("ui-off") }).await;
    assert_eq!(get(&format!("{base}/"), &[]).await.status(), 404);
    assert_eq!(get(&format!("{base}/dashboard"), &[]).await.status(), 404);
    assert_eq!(get(&format!("{base}/v1/models"), &[]).await.status(), 200, "the API is unchanged");
    s.shutdown(Duration::from_secs(5)).await;
}

/// `/v1/status` (what the pages poll): the model, its version, the engine's counters (the
/// generation counter moves by the tokens a request generated), the feedback counters with
/// `--learn-from-feedback` (`null` without); streamed chat chunks carry their tokens' ids,
/// μ and policy versions with `return_token_ids`, as the non-streamed answer does; the
/// feedback learner is listed as job `feedback`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_streamed_versions_and_the_feedback_job() {
    let dir = tiny("ui-status", 52);
    let fb = tests::temp_dir("ui-status-feedback");
    let (s, base) = start(dir, feedback_args(&fb, 16)).await;
    let status = || async { get(&format!("{base}/v1/status"), &[]).await.json::<Value>().await.unwrap() };
    let before = status().await;
    assert_eq!((before["object"].as_str(), before["version"].as_u64()), (Some("status"), Some(0)));
    assert_eq!(before["feedback"]["batch_size"], 1000);
    assert_eq!(before["feedback"]["accepted"], 0);
    assert_eq!(before["admin_key_required"], false);
    // Sampled at T = 1 from random weights over a byte-level vocabulary: some tokens are
    // bytes of a character not complete yet, whose chunk has no text but still carries their
    // ids and versions.
    let mut textless = 0;
    let mut first_id = None;
    for seed in 0..6 {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": true,
            "temperature": 1.0, "seed": seed, "stream": true, "return_token_ids": true});
        let events = stream(&base, "/v1/chat/completions", body).await;
        let chunks: Vec<Value> =
            events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
        let choice = |c: &Value| c["choices"][0].clone();
        let list = |c: &Value, k: &str| choice(c)[k].as_array().cloned().unwrap_or_default();
        let versions: Vec<Value> = chunks.iter().flat_map(|c| list(c, "versions")).collect();
        let ids: Vec<Value> = chunks.iter().flat_map(|c| list(c, "token_ids")).collect();
        assert_eq!((versions, ids.len()), (vec![json!(0); 5], 5), "seed {seed}: {events:?}");
        let no_text = |c: &Value| choice(c)["delta"] == json!({}) && choice(c)["finish_reason"].is_null();
        textless += chunks.iter().filter(|c| no_text(c) && !list(c, "token_ids").is_empty()).count();
        first_id.get_or_insert(chunks[0]["id"].as_str().unwrap().to_string());
    }
    assert!(textless > 0, "no chunk with tokens but no text: the case is not exercised");
    let after = status().await;
    let generated = |v: &Value| v["engine"]["generation_tokens_total"].as_u64().unwrap();
    assert_eq!(generated(&after) - generated(&before), 30);
    assert_eq!(after["engine"]["num_requests_running"], 0);
    let (st, _) = post(&base, "/v1/feedback", json!({"id": first_id, "choice": 0, "reward": 1.0})).await;
    assert_eq!(st, 200);
    assert_eq!(status().await["feedback"]["accepted"], 1);
    let jobs: Value = get(&format!("{base}/v1/train/jobs"), &[]).await.json().await.unwrap();
    assert!(
        jobs["data"].as_array().unwrap().iter().any(|j| j["id"] == "feedback" && j["status"] == "running"),
        "{jobs}"
    );
    let job: Value = get(&format!("{base}/v1/train/jobs/feedback"), &[]).await.json().await.unwrap();
    assert_eq!((job["id"].as_str(), job["history"].as_array().map(|h| h.len())), (Some("feedback"), Some(0)));
    s.shutdown(Duration::from_secs(5)).await;

    let (s, base) = start(tiny_dir("ui-status-off"), args("ui-status-off")).await;
    let v: Value = get(&format!("{base}/v1/status"), &[]).await.json().await.unwrap();
    assert_eq!(v["feedback"], Value::Null);
    s.shutdown(Duration::from_secs(5)).await;
}
