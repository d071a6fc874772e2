//! `rlserve bench latency`: prefill tokens/s on a fixed-length prompt and single-stream
//! decode tokens/s, plus peak RSS, printed like `llama-bench` (pp/tg).

use super::{median, peak_rss_mib};
use crate::cli::{load, ModelArgs};
use anyhow::Result;
use clap::Args;
use engine::generate::generate;
use engine::SamplingParams;
use std::time::Instant;

/// Flags of `bench latency`.
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
    /// Decode without CUDA graphs (vLLM's flag; the CPU has none).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Write the results as JSON to this file (the medians and every repetition).
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
}

/// Runs `bench latency`.
pub fn run(a: BenchArgs) -> Result<()> {
    anyhow::ensure!(
        a.prompt_tokens >= 1 && a.gen_tokens >= 2 && a.repetitions >= 1,
        "--prompt-tokens >= 1, --gen-tokens >= 2 and --repetitions >= 1 are required"
    );
    super::check_output_json(a.output_json.as_deref())?;
    let (device, dir) = a.model.open()?;
    let (tok, model) = load(&dir, &device)?;
    let context = model.max_positions();
    anyhow::ensure!(
        a.prompt_tokens + a.gen_tokens <= context,
        "--prompt-tokens {} plus --gen-tokens {} exceed the model's context of {context} tokens",
        a.prompt_tokens,
        a.gen_tokens
    );
    let (tok, shared) = (std::sync::Arc::new(tok), engine::SharedModel::new(model));
    let vocab = shared.read().config.vocab_size as u32;
    // Deterministic pseudo-random prompt (token ids in the ordinary-text range).
    let prompt: Vec<u32> =
        (0..a.prompt_tokens as u32).map(|i| 100 + (i.wrapping_mul(2654435761) % (vocab - 100))).collect();
    let threads = rayon::current_num_threads();
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    let mut decode_counters = device.counters().map(|_| kernels::DeviceCounters::default());
    // Greedy, never stopping early: decode exactly gen_tokens, through the engine (the
    // serving path: scheduler, paged KV, sampling on the device).
    let params =
        SamplingParams { temperature: 0.0, max_tokens: Some(a.gen_tokens), ignore_eos: true, ..Default::default() };
    for _ in 0..a.repetitions {
        {
            let model = shared.read();
            let mut cache = model.new_cache(a.prompt_tokens)?;
            let t = Instant::now();
            // The last row's logits copied to the host: on a GPU this waits for the forward.
            model.forward(&prompt, &mut cache, false)?.to_vec()?;
            pp.push(a.prompt_tokens as f64 / t.elapsed().as_secs_f64());
        }
        let c0 = device.counters();
        let (_, stats) = generate(&shared, tok.clone(), &prompt[..1], &params, a.enforce_eager, |_| {})?;
        tg.push(stats.decode_tokens_per_s());
        if let (Some(sum), Some(c0), Some(c1)) = (decode_counters.as_mut(), c0, device.counters()) {
            *sum = *sum + (c1 - c0);
        }
    }
    println!("| model | threads | test | t/s |");
    println!("| --- | --- | --- | --- |");
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let (pp_median, tg_median) = (median(pp.clone()), median(tg.clone()));
    println!("| {name} f32 (rlserve) | {threads} | pp{} | {pp_median:.1} |", a.prompt_tokens);
    println!("| {name} f32 (rlserve) | {threads} | tg{} | {tg_median:.1} |", a.gen_tokens);
    if let Some(path) = &a.output_json {
        let j = serde_json::json!({
            "model": name, "threads": threads, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
            "prefill_tokens_per_second": pp_median, "decode_tokens_per_second": tg_median,
            "prefill_tokens_per_second_runs": pp, "decode_tokens_per_second_runs": tg,
        });
        super::write_output_json(path, &j)?;
    }
    // One prefill of the first token, then gen_tokens − 1 decode steps, per repetition.
    super::print_device_per_step("generated token", decode_counters, a.gen_tokens * a.repetitions);
    if let Some(rss) = peak_rss_mib() {
        println!("peak RSS: {rss:.0} MiB");
    }
    Ok(())
}
