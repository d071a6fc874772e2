//! `rlserve bench train`: one learner step (forward + backward + AdamW) on `--num-seqs`
//! sequences of `--prompt-len` + `--completion-len` random tokens; tokens/s and peak RSS.
//! `benches/train_step_torch.py` runs the same step in PyTorch for comparison.

use super::{median, peak_rss_mib};
use crate::cli::ModelArgs;
use anyhow::Result;
use clap::Args;
use engine::Model;
use learner::{forward, TrainConfig, TrainSample, Trainer};

/// Flags of `bench train`.
#[derive(Args)]
pub struct TrainBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 8, value_parser = server::serve::positive)]
    pub num_seqs: usize,
    #[arg(long, default_value_t = 128, value_parser = server::serve::positive)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 128, value_parser = server::serve::positive)]
    pub completion_len: usize,
    /// Sequences per prompt: groups of this many share one prompt (a GRPO group; the
    /// learner then runs the prompt's rows once); must divide `--num-seqs`.
    #[arg(long, default_value_t = 1, value_parser = server::serve::positive)]
    pub num_generations: usize,
    /// Keep only layer inputs and recompute activations in backward, the LM head's logits
    /// in chunks of rows (`learner::Recompute::checkpointing`).
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Timed steps (after one warm-up step); the median is reported.
    #[arg(long, default_value_t = 2, value_parser = server::serve::positive)]
    pub steps: usize,
    /// Write the results as JSON to this file (the medians and every timed step).
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
}

/// Runs `bench train`.
pub fn run(a: TrainBenchArgs) -> Result<()> {
    anyhow::ensure!(
        a.num_seqs.is_multiple_of(a.num_generations),
        "--num-generations {} must divide --num-seqs {}: every prompt gets a whole group",
        a.num_generations,
        a.num_seqs
    );
    super::check_output_json(a.output_json.as_deref())?;
    let (device, dir) = a.model.open()?;
    let model = Model::load(&dir, &device)?;
    let vocab = model.config.vocab_size as u64;
    let tok = |i: u64| (100 + engine::sampling::splitmix64(i) % (vocab - 100)) as u32;
    let mut batch = Vec::new();
    for s in 0..a.num_seqs as u64 {
        let group = s / a.num_generations as u64;
        let prompt: Vec<u32> = (0..a.prompt_len as u64).map(|j| tok(group << 32 | j)).collect();
        let completion: Vec<u32> = (0..a.completion_len as u64).map(|j| tok(s << 32 | (1 << 20) | j)).collect();
        // μ = ℓ (on-policy): ratios are 1, no token is clipped, every gradient is computed.
        let mu = forward(&model, &prompt, &completion, 1.0)?.logprobs;
        batch.push(TrainSample {
            prompt_ids: prompt,
            completion_ids: completion,
            behavior_logprobs: mu,
            advantage: Some(if s % 2 == 0 { 1.0 } else { -1.0 }),
            reward: None,
            group: None,
            versions: None,
            finish_reason: None,
        });
    }
    let mut trainer =
        Trainer::new(&model, TrainConfig { gradient_checkpointing: a.gradient_checkpointing, ..Default::default() })?;
    let tokens = a.num_seqs * (a.prompt_len + a.completion_len);
    let (mut times, mut phases) = (Vec::new(), Vec::new());
    let model = engine::SharedModel::new(model);
    for i in 0..=a.steps {
        let t = std::time::Instant::now();
        let (m, _) = trainer.step(&model, &batch)?;
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
            phases.push([m.forward_seconds, m.backward_seconds, m.optimizer_seconds, m.pause_seconds]);
        }
    }
    let secs = median(times.clone());
    let phase = |j: usize| median(phases.iter().map(|p| p[j]).collect());
    println!(
        "train step: {} seqs × ({} + {}) tokens, {} per prompt, {} threads",
        a.num_seqs,
        a.prompt_len,
        a.completion_len,
        a.num_generations,
        rayon::current_num_threads()
    );
    println!("fwd+bwd+AdamW: {secs:.2} s/step, {:.1} tokens/s", tokens as f64 / secs);
    println!(
        "split (medians): forward {:.2} s, backward {:.2} s, optimizer {:.2} s, pause (write guard) {:.3} s",
        phase(0),
        phase(1),
        phase(2),
        phase(3)
    );
    let rss = peak_rss_mib();
    if let Some(rss) = rss {
        println!("peak RSS: {rss:.0} MiB");
    }
    if let Some(path) = &a.output_json {
        let j = serde_json::json!({
            "num_seqs": a.num_seqs, "prompt_len": a.prompt_len, "completion_len": a.completion_len,
            "num_generations": a.num_generations, "gradient_checkpointing": a.gradient_checkpointing,
            "threads": rayon::current_num_threads(), "tokens_per_step": tokens,
            "seconds_per_step": secs, "tokens_per_second": tokens as f64 / secs, "step_seconds_runs": times,
            "forward_seconds": phase(0), "backward_seconds": phase(1), "optimizer_seconds": phase(2),
            "pause_seconds": phase(3), "peak_rss_mib": rss,
        });
        super::write_output_json(path, &j)?;
    }
    Ok(())
}
