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
    /// Request `i`'s input and output lengths are drawn uniformly from
    /// `[len·(1 − r), len·(1 + r)]` (vLLM's `--random-range-ratio`, in [0, 1); 0: every
    /// request the given lengths). nano-vllm's benchmark (lengths uniform in 100–1024) is
    /// `--input-len 562 --output-len 562 --random-range-ratio 0.822`.
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
}

impl WorkloadArgs {
    /// Checks the flags: every length and count at least 1, the ratio in [0, 1).
    pub fn check(&self) -> Result<()> {
        anyhow::ensure!(
            self.num_prompts >= 1 && self.input_len >= 1 && self.output_len >= 1,
            "--num-prompts, --input-len and --output-len must be >= 1"
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&self.random_range_ratio),
            "--random-range-ratio must be in [0, 1), got {}",
            self.random_range_ratio
        );
        Ok(())
    }

    /// Request `i`'s `(input, output)` lengths (see `random_range_ratio`), a function of
    /// `seed` and `i` only.
    pub fn lengths(&self, i: usize) -> (usize, usize) {
        use engine::sampling::splitmix64;
        let r = self.random_range_ratio;
        let draw = |len: usize, salt: u64| {
            if r == 0.0 {
                return len;
            }
            let (lo, hi) = (((len as f64) * (1.0 - r)).round() as usize, ((len as f64) * (1.0 + r)).round() as usize);
            let h = splitmix64(self.seed ^ splitmix64(2 * i as u64 + salt));
            (lo + (h % (hi - lo + 1) as u64) as usize).max(1)
        };
        (draw(self.input_len, 0), draw(self.output_len, 1))
    }
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

/// `--output-json`'s folder, checked before a benchmark runs (not after it, when its
/// results would be lost).
pub fn check_output_json(path: Option<&std::path::Path>) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    anyhow::ensure!(dir.is_dir(), "--output-json {}: the folder {} does not exist", path.display(), dir.display());
    Ok(())
}

/// Writes `--output-json`.
pub fn write_output_json(path: &std::path::Path, j: &serde_json::Value) -> Result<()> {
    use anyhow::Context;
    std::fs::write(path, serde_json::to_string_pretty(j)?).with_context(|| format!("--output-json {}", path.display()))
}

/// The median of `v` (the mean of the two middle values for an even count, as
/// `numpy.median`); `v` must not be empty.
pub fn median(v: Vec<f64>) -> f64 {
    percentile(v, 0.5)
}

/// The `p`-quantile of `v` (`p` in [0, 1]) with linear interpolation between the closest
/// ranks, `numpy.percentile`'s default (what vLLM's `bench serve` reports); `v` must not be
/// empty.
pub fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let pos = p * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::{median, percentile, WorkloadArgs};

    /// numpy's values: `np.median([4, 1, 3, 2])` = 2.5, `np.percentile([1, 2, 3, 4, 5], 99)`
    /// = 4.96, `np.percentile([7], 99)` = 7.
    #[test]
    fn median_and_percentile_follow_numpy() {
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert!((percentile(vec![1.0, 2.0, 3.0, 4.0, 5.0], 0.99) - 4.96).abs() < 1e-12);
        assert_eq!(percentile(vec![7.0], 0.99), 7.0);
    }

    fn workload(input_len: usize, output_len: usize, random_range_ratio: f64) -> WorkloadArgs {
        WorkloadArgs { num_prompts: 256, input_len, output_len, seed: 0, random_range_ratio }
    }

    /// Ratio 0: every request the given lengths. nano-vllm's shape: 562 · (1 ∓ 0.822) rounds
    /// to 100 and 1024, every length within them, both lengths drawn apart, spread over the
    /// range (256 draws reach within 5% of each end), a function of (seed, i).
    #[test]
    fn lengths_are_uniform_in_vllms_range() {
        let w = workload(128, 64, 0.0);
        assert!((0..256).all(|i| w.lengths(i) == (128, 64)));
        let w = workload(562, 562, 0.822);
        let ls: Vec<(usize, usize)> = (0..256).map(|i| w.lengths(i)).collect();
        let all = ls.iter().flat_map(|&(a, b)| [a, b]);
        assert!(all.clone().all(|l| (100..=1024).contains(&l)), "{ls:?}");
        assert!(all.clone().min().unwrap() < 146 && all.clone().max().unwrap() > 978, "{ls:?}");
        assert!(ls.iter().filter(|(a, b)| a == b).count() < 8, "input and output drawn apart");
        assert_eq!(ls, (0..256).map(|i| w.lengths(i)).collect::<Vec<_>>());
        assert!(workload(562, 562, 1.0).check().is_err() && workload(0, 1, 0.0).check().is_err());
    }
}
