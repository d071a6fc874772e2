//! `rlserve bench throughput`: `--num-prompts` requests of `--input-len` tokens each
//! generating `--output-len` tokens (`ignore_eos`), all submitted at once to the engine,
//! like `vllm bench throughput`; then the curve of output tokens/s at fixed concurrency.
//! Each run's engine has a KV pool sized to the workload and written before its clock
//! starts ([`engine::EngineConfig::kv_cache_prefault`]), as llama-batched-bench's is.

use super::peak_rss_mib;
use crate::cli::{load, ModelArgs};
use anyhow::Result;
use clap::Args;
use engine::{EngineConfig, LLMEngine, SamplingParams};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Flags of `bench throughput`.
#[derive(Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub workload: super::WorkloadArgs,
    /// Samples per prompt (a GRPO group); the samples share the prompt's KV blocks.
    #[arg(long, default_value_t = 1, value_parser = server::serve::positive)]
    pub n: usize,
    /// Every request gets the same prompt instead of a random one.
    #[arg(long)]
    pub fixed_prompt: bool,
    /// Output tokens/s at these concurrencies after the main run.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64", value_parser = server::serve::positive)]
    pub concurrency: Vec<usize>,
    /// Skip the concurrency curve.
    #[arg(long)]
    pub no_curve: bool,
    /// Decode steps per concurrency point.
    #[arg(long, default_value_t = 32, value_parser = server::serve::positive)]
    pub curve_output_len: usize,
    /// Most sequences per step in the main run (each point of the concurrency curve runs
    /// exactly its concurrency).
    #[arg(long, default_value_t = 64, value_parser = server::serve::positive)]
    pub max_num_seqs: usize,
    /// Most tokens per step (prefill chunks and decodes together).
    #[arg(long, default_value_t = 2048, value_parser = server::serve::positive)]
    pub max_num_batched_tokens: usize,
    /// Decode without CUDA graphs (vLLM's flag; the CPU has none).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

struct RunResult {
    secs: f64,
    prompt_tokens: usize,
    output_tokens: usize,
    prefill_tokens: u64,
    requests: usize,
    /// Output tokens, steps and seconds of the steps that computed no prompt token.
    decode_tokens: usize,
    decode_steps: usize,
    decode_secs: f64,
    /// What the device was asked over the decode steps (CUDA only).
    decode_counters: Option<kernels::DeviceCounters>,
}

/// Runs `requests` (prompt, parameters) to completion on a fresh engine.
fn run_batch(
    model: &engine::SharedModel,
    tok: &Arc<engine::Tokenizer>,
    cfg: &EngineConfig,
    requests: &[(Vec<u32>, SamplingParams)],
) -> Result<RunResult> {
    let mut e = LLMEngine::new(model.clone(), tok.clone(), cfg.clone())?;
    let t = Instant::now();
    for (i, (p, params)) in requests.iter().enumerate() {
        e.add_request(&format!("b{i}"), p.clone(), params.clone())?;
    }
    let (mut output_tokens, mut decode_tokens, mut decode_steps, mut decode_secs) = (0, 0, 0, 0.0);
    let device = model.read().device().clone();
    let mut decode_counters = device.counters().map(|_| kernels::DeviceCounters::default());
    while e.has_unfinished() {
        let (prefilled, t0, c0) = (e.stats().prefill_tokens, Instant::now(), device.counters());
        let n = e.step()?.iter().map(|o| o.tokens.len()).sum::<usize>();
        output_tokens += n;
        // A step that computed no prompt token is a pure decode step (llama-batched-bench's
        // T_TG phase).
        if e.stats().prefill_tokens == prefilled {
            decode_tokens += n;
            decode_secs += t0.elapsed().as_secs_f64();
            decode_steps += 1;
            if let (Some(sum), Some(c0), Some(c1)) = (decode_counters.as_mut(), c0, device.counters()) {
                *sum = *sum + (c1 - c0);
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    Ok(RunResult {
        secs,
        prompt_tokens: requests.iter().map(|(p, params)| p.len() * params.n).sum(),
        output_tokens,
        prefill_tokens: e.stats().prefill_tokens,
        requests: requests.len(),
        decode_tokens,
        decode_steps,
        decode_secs,
        decode_counters,
    })
}

/// Runs `bench throughput`.
pub fn run(a: ThroughputArgs) -> Result<()> {
    a.workload.check()?;
    super::check_output_json(a.output_json.as_deref())?;
    let (device, dir) = a.model.open()?;
    let (tok, model) = load(&dir, &device)?;
    let vocab = model.config.vocab_size as u64;
    let (model, tok) = (engine::SharedModel::new(model), Arc::new(tok));
    let w = &a.workload;
    let prompt = |i: u64, len: usize| -> Vec<u32> {
        (0..len as u64)
            .map(|j| (100 + engine::sampling::splitmix64(w.seed ^ (i << 32) ^ j) % (vocab - 100)) as u32)
            .collect()
    };
    let params = SamplingParams {
        n: a.n,
        temperature: 1.0,
        seed: Some(w.seed),
        max_tokens: Some(w.output_len),
        ignore_eos: true,
        ..Default::default()
    };
    let requests: Vec<(Vec<u32>, SamplingParams)> = (0..w.num_prompts)
        .map(|i| {
            let (input_len, output_len) = w.lengths(i);
            let p = prompt(if a.fixed_prompt { 0 } else { i as u64 }, input_len);
            (p, SamplingParams { max_tokens: Some(output_len), ..params.clone() })
        })
        .collect();
    // The KV pool holds the workload (as llama-batched-bench's `-c`) and is written before
    // the clock starts (llama.cpp clears its KV buffer at start): no timed step pays for
    // first touches of fresh pages.
    let block_size = EngineConfig::default().block_size;
    let blocks = |seqs: usize, len: usize| seqs * len.div_ceil(block_size);
    let curve_need = a.concurrency.iter().map(|&c| blocks(c, w.input_len.min(16) + a.curve_output_len)).max();
    let workload_need: usize = (0..w.num_prompts).map(|i| w.lengths(i)).map(|(i, o)| blocks(a.n, i + o)).sum();
    let num_blocks = workload_need.max(curve_need.unwrap_or(0));
    let cfg = EngineConfig {
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        num_blocks: Some(num_blocks),
        kv_cache_prefault: true,
        enforce_eager: a.enforce_eager,
        ..Default::default()
    };
    let lengths = |len: usize| match w.random_range_ratio {
        0.0 => format!("{len}"),
        r => format!("{len} ± {:.0}%", 100.0 * r),
    };
    eprintln!(
        "running {} requests × n={} ({} input, {} output tokens each), {} threads; KV pool {num_blocks} blocks of {block_size}, written before timing",
        w.num_prompts,
        a.n,
        lengths(w.input_len),
        lengths(w.output_len),
        rayon::current_num_threads()
    );
    let r = run_batch(&model, &tok, &cfg, &requests)?;
    let total = r.prompt_tokens + r.output_tokens;
    println!(
        "Throughput: {:.2} requests/s, {:.2} total tokens/s, {:.2} output tokens/s",
        r.requests as f64 / r.secs,
        total as f64 / r.secs,
        r.output_tokens as f64 / r.secs
    );
    println!(
        "Total num prompt tokens: {}  (prefill computed: {} tokens; {} came from the prefix cache)",
        r.prompt_tokens,
        r.prefill_tokens,
        (r.prompt_tokens as u64).saturating_sub(r.prefill_tokens)
    );
    println!("Total num output tokens: {}", r.output_tokens);
    // No decode-only step (every output one token long): no decode rate (JSON null).
    let decode_tps = (r.decode_steps > 0).then(|| r.decode_tokens as f64 / r.decode_secs.max(1e-9));
    match decode_tps {
        Some(tps) => println!(
            "Decode phase: {tps:.2} output tokens/s ({} tokens in {} steps without prefill, {:.1} ms/step)",
            r.decode_tokens,
            r.decode_steps,
            1e3 * r.decode_secs / r.decode_steps as f64
        ),
        None => println!("Decode phase: n/a (no step without prefill)"),
    }
    super::print_device_per_step("decode step", r.decode_counters, r.decode_steps);
    let mut curve = Vec::new();
    if !a.no_curve {
        println!("| concurrency | output tokens/s | speed-up vs 1 |");
        println!("| --- | --- | --- |");
        let mut base = None;
        for &c in &a.concurrency {
            let cp = SamplingParams { n: 1, max_tokens: Some(a.curve_output_len), ..params.clone() };
            let rs: Vec<(Vec<u32>, SamplingParams)> =
                (0..c as u64).map(|i| (prompt(1000 + i, w.input_len.min(16)), cp.clone())).collect();
            let cfgc = EngineConfig { max_num_seqs: c.max(1), ..cfg.clone() };
            let r = run_batch(&model, &tok, &cfgc, &rs)?;
            let tps = r.output_tokens as f64 / r.secs;
            let b = *base.get_or_insert(tps);
            println!("| {c} | {tps:.1} | {:.2}x |", tps / b);
            curve.push(json!({"concurrency": c, "output_tokens_per_s": tps}));
        }
    }
    let rss = peak_rss_mib();
    if let Some(rss) = rss {
        println!("peak RSS: {rss:.0} MiB");
    }
    if let Some(path) = &a.output_json {
        let j = json!({
            "elapsed_time": r.secs, "num_requests": r.requests, "n": a.n, "input_len": a.workload.input_len, "output_len": a.workload.output_len, "random_range_ratio": a.workload.random_range_ratio,
            "total_num_tokens": total, "prompt_tokens": r.prompt_tokens, "prefill_tokens_computed": r.prefill_tokens, "output_tokens": r.output_tokens,
            "requests_per_second": r.requests as f64 / r.secs, "tokens_per_second": total as f64 / r.secs, "output_tokens_per_second": r.output_tokens as f64 / r.secs,
            "decode_output_tokens_per_second": decode_tps, "decode_steps": r.decode_steps,
            "concurrency_curve": curve, "peak_rss_mib": rss, "threads": rayon::current_num_threads(),
        });
        super::write_output_json(path, &j)?;
    }
    Ok(())
}
