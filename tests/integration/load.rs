//! Load with faults: many concurrent streamed requests (chat and completions) where every
//! fifth client disconnects after its first chunk and every tenth sends a malformed body.
//! No answer is 5xx (nor an SSE error event), every complete stream ends with a finish reason
//! and `[DONE]`, every KV block is free afterwards (`/metrics`), the engine is alive, and the
//! p50/p99 time to first token is printed. CI runs 256 clients on the tiny model; the
//! ignored soak runs 256 on the default model:
//! `cargo test -p tests --test integration load::soak -- --ignored --nocapture`.

use futures_util::StreamExt;
use serde_json::{json, Value};
use server::serve::ServeArgs;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tests::eventually;

/// What one client saw.
#[derive(Debug)]
enum Outcome {
    /// A complete stream: time to its first chunk.
    Done(Duration),
    /// Left after the first chunk.
    Left,
    /// A malformed body answered with 400.
    Rejected,
}

async fn client(base: String, i: usize, max_tokens: usize) -> Result<Outcome, String> {
    let c = reqwest::Client::new();
    let chat = i.is_multiple_of(2);
    let path = if chat { "/v1/chat/completions" } else { "/v1/completions" };
    if i % 10 == 3 {
        let bad = [r#"{"messages": ["#, r#"{"prompt": 5}"#, r#"{"prompt": "a", "n": -1}"#][i % 3];
        let r = c.post(format!("{base}{path}")).header("content-type", "application/json").body(bad).send().await;
        let status = r.map_err(|e| format!("client {i}: {e}"))?.status().as_u16();
        return if status == 400 { Ok(Outcome::Rejected) } else { Err(format!("client {i}: malformed → {status}")) };
    }
    let mut body = json!({"max_tokens": max_tokens, "stream": true, "ignore_eos": true, "seed": i,
                          "stream_options": {"include_usage": true}});
    if chat {
        body["messages"] = json!([{"role": "user", "content": format!("Tell me about the number {i}.")}]);
    } else {
        body["prompt"] = json!(format!("Number {i} is"));
    }
    let start = Instant::now();
    let r = c.post(format!("{base}{path}")).json(&body).send().await.map_err(|e| format!("client {i}: {e}"))?;
    if r.status() != 200 {
        return Err(format!("client {i}: status {}", r.status()));
    }
    let mut stream = r.bytes_stream();
    let (mut buf, mut events, mut ttft) = (String::new(), Vec::<String>::new(), None);
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| format!("client {i}: stream cut: {e}"))?));
        while let Some(end) = buf.find("\n\n") {
            let ev: String = buf.drain(..end + 2).collect();
            if let Some(data) = ev.lines().find_map(|l| l.strip_prefix("data: ")) {
                ttft.get_or_insert_with(|| start.elapsed());
                events.push(data.to_string());
            }
        }
        if i.is_multiple_of(5) && !events.is_empty() {
            return Ok(Outcome::Left); // dropping the stream disconnects
        }
    }
    if events.iter().any(|e| e.contains("\"error\"")) {
        return Err(format!("client {i}: error event: {events:?}"));
    }
    let n = events.len();
    let finished = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .any(|v| v["choices"].as_array().is_some_and(|cs| cs.iter().any(|c| c["finish_reason"] == "length")));
    if n < 3 || events[n - 1] != "[DONE]" || !events[n - 2].contains("\"usage\"") || !finished {
        return Err(format!("client {i}: incomplete stream: {events:?}"));
    }
    Ok(Outcome::Done(ttft.unwrap()))
}

/// `rlserve:<name>{...} value` from `/metrics`.
async fn metric(base: &str, name: &str) -> f64 {
    let m = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    let line = m.lines().find(|l| l.starts_with(&format!("rlserve:{name}{{"))).unwrap_or("x NaN");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

async fn run_load(model: PathBuf, name: &str, clients: usize, max_tokens: usize) {
    let a = ServeArgs { served_model_name: Some(name.into()), ..Default::default() };
    let (s, base) = crate::server::start(model, a).await;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..clients).map(|i| tokio::spawn(client(base.clone(), i, max_tokens))).collect();
    let mut ttfts = vec![];
    let (mut left, mut rejected) = (0, 0);
    for t in tasks {
        match t.await.expect("a client task panicked") {
            Ok(Outcome::Done(d)) => ttfts.push(d),
            Ok(Outcome::Left) => left += 1,
            Ok(Outcome::Rejected) => rejected += 1,
            Err(e) => panic!("{e}"),
        }
    }
    let wall = t0.elapsed();
    // Every request ends (the disconnected ones aborted) and frees its KV blocks.
    let now = async || (metric(&base, "num_requests_running").await, metric(&base, "kv_cache_usage_perc").await);
    let (running, usage) = eventually(Duration::from_secs(10), now, |&n| n == (0.0, 0.0)).await;
    assert_eq!((running, usage), (0.0, 0.0), "requests still running / KV blocks in use after the run");
    assert_eq!(reqwest::get(format!("{base}/health")).await.unwrap().status(), 200, "the engine is alive");
    ttfts.sort();
    let pct = |p: f64| ttfts[((ttfts.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3;
    eprintln!(
        "load {name}: {clients} clients ({} complete, {left} disconnected, {rejected} malformed) in {:.2} s; \
         TTFT p50 {:.1} ms, p99 {:.1} ms",
        ttfts.len(),
        wall.as_secs_f64(),
        pct(0.5),
        pct(0.99)
    );
    assert_eq!((left, rejected), (clients.div_ceil(5), clients / 10 + usize::from(clients % 10 > 3)));
    assert!(pct(0.99).is_finite() && ttfts.len() + left + rejected == clients);
    s.shutdown(Duration::from_secs(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_with_disconnects_and_malformed_bodies() {
    run_load(crate::server::tiny_dir("tiny-load"), "tiny-load", 256, 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "soak: 256 streams on the default model (about a minute on 2 cores)"]
async fn soak() {
    run_load(tests::default_model(), "smol-load", 256, 48).await;
}
