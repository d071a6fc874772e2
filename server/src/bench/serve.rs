//! `rlserve bench serve`: load a running server like `vllm bench serve`: random token-id
//! prompts sent as streaming completions at a Poisson `--request-rate` (default: all at
//! once) under an optional `--max-concurrency`; reports request/token throughput and
//! mean/median/p99 of TTFT, TPOT, ITL and end-to-end latency.

use anyhow::{bail, Context, Result};
use clap::Args;
use futures_util::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags of `bench serve`.
#[derive(Args, Clone)]
pub struct BenchServeArgs {
    /// Server base URL (without /v1).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    #[command(flatten)]
    pub workload: super::WorkloadArgs,
    /// Requests per second (Poisson arrivals); `inf` sends all at once.
    #[arg(long, default_value = "inf", value_parser = request_rate)]
    pub request_rate: f64,
    /// Most requests in flight at once.
    #[arg(long, value_parser = server::serve::positive)]
    pub max_concurrency: Option<usize>,
    #[arg(long)]
    pub api_key: Option<String>,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

/// `--request-rate`: a number > 0, or `inf`.
fn request_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if r > 0.0 => Ok(r),
        Ok(r) => Err(format!("must be a number > 0 (or inf: all at once), got {r}")),
        Err(_) => Err(format!("{s:?} is not a number")),
    }
}

#[derive(Default, Clone)]
struct Outcome {
    ok: bool,
    ttft: f64,
    e2e: f64,
    itls: Vec<f64>,
    output_tokens: usize,
    prompt_tokens: usize,
    error: String,
}

/// Mean, median and p99 in milliseconds (NaN for no values: printed as `n/a`, `null` in
/// the JSON).
fn summary(v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    (mean * 1e3, super::percentile(v.clone(), 0.5) * 1e3, super::percentile(v, 0.99) * 1e3)
}

async fn one(client: reqwest::Client, url: String, key: Option<String>, body: Value) -> Outcome {
    let start = Instant::now();
    let mut o = Outcome::default();
    let mut req = client.post(&url).json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = match req.send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            o.error = format!("HTTP {}: {}", r.status(), r.text().await.unwrap_or_default());
            return o;
        }
        Err(e) => {
            o.error = e.to_string();
            return o;
        }
    };
    let mut last: Option<Instant> = None;
    let mut buf = String::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            o.error = "stream broke".into();
            return o;
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap_or_default();
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                o.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                o.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            }
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                match last {
                    None => o.ttft = (now - start).as_secs_f64(),
                    Some(t) => o.itls.push((now - t).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    o.e2e = start.elapsed().as_secs_f64();
    o.ok = true;
    o
}

/// Runs `bench serve`.
pub fn run(a: BenchServeArgs) -> Result<()> {
    a.workload.check()?;
    super::check_output_json(a.output_json.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(run_async(a))
}

async fn run_async(a: BenchServeArgs) -> Result<()> {
    let client = reqwest::Client::new();
    let base = a.base_url.trim_end_matches('/').to_string();
    let mut list = client.get(format!("{base}/v1/models"));
    if let Some(k) = &a.api_key {
        list = list.bearer_auth(k);
    }
    let models: Value = list
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| {
            format!("listing the served models at {base}/v1/models (--base-url is the server's root, without /v1)")
        })?
        .json()
        .await?;
    let model = models["data"][0]["id"].as_str().context("the server lists no model")?.to_string();
    let url = format!("{base}/v1/completions");
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.workload.seed);
    let request = |i: usize, rng: &mut rand::rngs::StdRng| {
        let (input_len, output_len) = a.workload.lengths(i);
        let prompt: Vec<u32> = (0..input_len).map(|_| rng.gen_range(100..20000)).collect();
        json!({"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": true, "temperature": 1.0, "seed": a.workload.seed + i as u64, "stream": true, "stream_options": {"include_usage": true}})
    };
    // As vLLM's `bench serve`: one untimed request first, so that a workload the server
    // refuses (a prompt over its context, a wrong key) stops here instead of timing failures.
    let test = one(client.clone(), url.clone(), a.api_key.clone(), request(0, &mut rng.clone())).await;
    if !test.ok {
        bail!("the initial test request failed, check the benchmark's arguments against the server: {}", test.error);
    }
    let sem = Arc::new(tokio::sync::Semaphore::new(a.max_concurrency.unwrap_or(usize::MAX >> 4)));
    let bar = ProgressBar::new(a.workload.num_prompts as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} requests [{elapsed_precise}]").expect("valid template"),
    );
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(a.workload.num_prompts);
    for i in 0..a.workload.num_prompts {
        let body = request(i, &mut rng);
        let permit = sem.clone().acquire_owned().await?;
        let (client, url, key, bar) = (client.clone(), url.clone(), a.api_key.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            let o = one(client, url, key, body).await;
            drop(permit);
            bar.inc(1);
            o
        }));
        // No wait after the last request: it would count in the duration.
        if a.request_rate.is_finite() && i + 1 < a.workload.num_prompts {
            let gap = -(1.0 - rng.gen::<f64>()).ln() / a.request_rate;
            tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        }
    }
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await?);
    }
    let duration = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let ok: Vec<&Outcome> = outs.iter().filter(|o| o.ok).collect();
    let failed: Vec<&Outcome> = outs.iter().filter(|o| !o.ok).collect();
    let out_tokens: usize = ok.iter().map(|o| o.output_tokens).sum();
    let in_tokens: usize = ok.iter().map(|o| o.prompt_tokens).sum();
    let ttft = summary(ok.iter().map(|o| o.ttft).collect());
    let tpot = summary(
        ok.iter().filter(|o| o.output_tokens > 1).map(|o| (o.e2e - o.ttft) / (o.output_tokens - 1) as f64).collect(),
    );
    let itl = summary(ok.iter().flat_map(|o| o.itls.clone()).collect());
    let e2e = summary(ok.iter().map(|o| o.e2e).collect());
    println!("============ Serving Benchmark Result ============");
    println!("{:<40}{:>10}", "Successful requests:", ok.len());
    println!("{:<40}{:>10}", "Failed requests:", failed.len());
    // A figure with no value (no request succeeded, or every output had one token) is n/a.
    let ms = |x: f64| if x.is_finite() { format!("{x:.2}") } else { "n/a".into() };
    println!("{:<40}{:>10.2}", "Benchmark duration (s):", duration);
    println!("{:<40}{:>10}", "Total input tokens:", in_tokens);
    println!("{:<40}{:>10}", "Total generated tokens:", out_tokens);
    println!("{:<40}{:>10.2}", "Request throughput (req/s):", ok.len() as f64 / duration);
    println!("{:<40}{:>10.2}", "Output token throughput (tok/s):", out_tokens as f64 / duration);
    println!("{:<40}{:>10.2}", "Total token throughput (tok/s):", (in_tokens + out_tokens) as f64 / duration);
    for (name, (mean, median, p99)) in [("TTFT", ttft), ("TPOT", tpot), ("ITL", itl), ("E2E", e2e)] {
        println!("{:<40}{:>10}", format!("Mean {name} (ms):"), ms(mean));
        println!("{:<40}{:>10}", format!("Median {name} (ms):"), ms(median));
        println!("{:<40}{:>10}", format!("P99 {name} (ms):"), ms(p99));
    }
    if let Some(e) = failed.first() {
        println!("first error: {}", e.error);
    }
    if let Some(path) = &a.output_json {
        let j = json!({
            "num_prompts": a.workload.num_prompts, "input_len": a.workload.input_len, "output_len": a.workload.output_len, "random_range_ratio": a.workload.random_range_ratio, "request_rate": a.request_rate, "max_concurrency": a.max_concurrency,
            "completed": ok.len(), "failed": failed.len(), "duration": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
            "request_throughput": ok.len() as f64 / duration, "output_throughput": out_tokens as f64 / duration, "total_token_throughput": (in_tokens + out_tokens) as f64 / duration,
            "mean_ttft_ms": ttft.0, "median_ttft_ms": ttft.1, "p99_ttft_ms": ttft.2, "mean_tpot_ms": tpot.0, "median_tpot_ms": tpot.1, "p99_tpot_ms": tpot.2,
            "mean_itl_ms": itl.0, "median_itl_ms": itl.1, "p99_itl_ms": itl.2, "mean_e2e_ms": e2e.0, "median_e2e_ms": e2e.1, "p99_e2e_ms": e2e.2,
        });
        super::write_output_json(path, &j)?;
    }
    if ok.is_empty() {
        bail!("no request succeeded ({} failed)", failed.len());
    }
    Ok(())
}
