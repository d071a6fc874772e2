//! `rlserve bench …`: one module per subcommand (`latency`, `throughput`, `serve`, `train`,
//! `rl`), and what they share (the request workload, peak RSS, the median). The criterion
//! micro-benchmarks of single kernels are the `benches` crate.

mod latency;
mod rl;
mod serve;
mod throughput;
mod train;

use anyhow::Result;
use clap::Args;

/// `rlserve bench` subcommands.
#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Prefill and single-stream decode tokens/s (llama-bench style).
    Latency(latency::BenchArgs),
    /// Batched generation throughput through the engine (vllm bench throughput style).
    Throughput(throughput::ThroughputArgs),
    /// Load a running server over HTTP (vllm bench serve style).
    Serve(serve::BenchServeArgs),
    /// One learner step (forward + backward + AdamW): tokens/s and peak RSS.
    Train(train::TrainBenchArgs),
    /// A short RL job at max_staleness 0 vs 2: steps/s, tokens/s, engine pause, idle fractions.
    Rl(rl::RlBenchArgs),
}

/// Runs one bench subcommand.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Latency(a) => latency::run(a),
        BenchCommand::Throughput(a) => throughput::run(a),
        BenchCommand::Serve(a) => serve::run(a),
        BenchCommand::Train(a) => train::run(a),
        BenchCommand::Rl(a) => rl::run(a),
    }
}

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

/// Peak resident set size of this process in MiB (`VmHWM`, Linux only).
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// One line of what a CUDA device was asked per step (`counters` summed over `steps`
/// steps; [`kernels::DeviceCounters`]); nothing on the CPU.
pub fn print_device_per_step(what: &str, counters: Option<kernels::DeviceCounters>, steps: usize) {
    let (Some(c), true) = (counters, steps > 0) else { return };
    let per = |x: u64| x as f64 / steps as f64;
    println!(
        "Device per {what}: {:.1} host→device copies ({:.0} B), {:.1} device→host copies ({:.0} B), {:.1} allocations, {:.1} kernel launches, {:.1} cuBLAS GEMMs, {:.1} graph launches, {:.1} host syncs",
        per(c.htod_copies),
        per(c.htod_bytes),
        per(c.dtoh_copies),
        per(c.dtoh_bytes),
        per(c.allocations),
        per(c.launches),
        per(c.gemms),
        per(c.graph_launches),
        per(c.syncs)
    );
}

/// The median of `v` (the upper middle value for an even count); `v` must not be empty.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
