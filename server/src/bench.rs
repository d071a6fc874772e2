//! `rlserve bench latency`: prefill tokens/s on a fixed-length prompt and single-stream
//! decode tokens/s, plus peak RSS, printed like `llama-bench` (pp/tg).
//! `rlserve bench throughput`: offline batched generation through the engine, printed like
//! `vllm bench throughput`, plus the output-tokens/s curve over concurrency.

use crate::cli::{load, ModelArgs};
use anyhow::Result;
use clap::Args;
use engine::generate::generate;
use engine::SamplingParams;
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Prefill and single-stream decode tokens/s (llama-bench style).
    Latency(BenchArgs),
    /// Batched generation throughput through the engine (vllm bench throughput style).
    Throughput(ThroughputArgs),
    /// Load a running server over HTTP (vllm bench serve style).
    Serve(crate::bench_serve::BenchServeArgs),
    /// One learner step (forward + backward + AdamW): tokens/s and peak RSS.
    Train(crate::bench_train::TrainBenchArgs),
    /// A short RL job at max_staleness 0 vs 2: steps/s, tokens/s, engine pause, idle fractions.
    Rl(crate::bench_rl::RlBenchArgs),
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Latency(a) => latency(a),
        BenchCommand::Throughput(a) => crate::bench_throughput::run(a),
        BenchCommand::Serve(a) => crate::bench_serve::run(a),
        BenchCommand::Train(a) => crate::bench_train::run(a),
        BenchCommand::Rl(a) => crate::bench_rl::run(a),
    }
}

pub use crate::bench_throughput::ThroughputArgs;

/// The request workload shared by `bench throughput` and `bench serve` (vLLM's flags).
#[derive(Args, Clone, Debug)]
pub struct WorkloadArgs {
    /// Number of requests.
    #[arg(long, default_value_t = 64)]
    pub num_prompts: usize,
    /// Prompt tokens per request (random ids).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Generated tokens per request (EOS ignored).
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prefill measurement (llama-bench `-p`).
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens to decode for the decode measurement (llama-bench `-n`).
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repetitions: usize,
}

/// Peak resident set size of this process in MiB (`VmHWM`, Linux only).
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn latency(a: BenchArgs) -> Result<()> {
    anyhow::ensure!(
        a.prompt_tokens >= 1 && a.gen_tokens >= 2 && a.repetitions >= 1,
        "--prompt-tokens >= 1, --gen-tokens >= 2 and --repetitions >= 1 are required"
    );
    let dir = a.model.resolve()?;
    let (_, model) = load(&dir)?;
    let vocab = model.config.vocab_size as u32;
    // Deterministic pseudo-random prompt (token ids in the ordinary-text range).
    let prompt: Vec<u32> =
        (0..a.prompt_tokens as u32).map(|i| 100 + (i.wrapping_mul(2654435761) % (vocab - 100))).collect();
    let threads = rayon::current_num_threads();
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    // Greedy, never stopping early: decode exactly gen_tokens.
    let params = SamplingParams { temperature: 0.0, ..Default::default() };
    for _ in 0..a.repetitions {
        let mut cache = model.new_cache(a.prompt_tokens)?;
        let t = Instant::now();
        model.forward(&prompt, &mut cache, false)?;
        pp.push(a.prompt_tokens as f64 / t.elapsed().as_secs_f64());
        let (_, stats) = generate(&model, &prompt[..1], &params, a.gen_tokens, &[], |_| {})?;
        tg.push(stats.decode_tokens_per_s());
    }
    println!("| model | threads | test | t/s |");
    println!("| --- | --- | --- | --- |");
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    println!("| {name} f32 (rlserve) | {threads} | pp{} | {:.1} |", a.prompt_tokens, median(pp));
    println!("| {name} f32 (rlserve) | {threads} | tg{} | {:.1} |", a.gen_tokens, median(tg));
    if let Some(rss) = peak_rss_mib() {
        println!("peak RSS: {rss:.0} MiB");
    }
    Ok(())
}
