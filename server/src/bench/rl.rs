//! `rlserve bench rl`: the same short training job on the built-in arithmetic task with
//! `max_staleness` 0 (synchronous) and 2 (generation overlaps training), without the job's
//! reference forward for the `kl` metric unless asked (`--log-kl-to-initial`), each from the
//! freshly loaded model: RL steps/s, seconds per step after the first (whose first touches
//! of the learner's fresh buffers take seconds on some VMs), rollout and train tokens/s, the
//! engine's pause per update (write-guard hold: mean, max), and the learner's and the
//! engine's idle fractions; then the per-step split of the steps after the first.

use crate::cli::ModelArgs;
use anyhow::Result;
use clap::Args;
use engine::{EngineConfig, EngineHandle, LLMEngine, Model, SharedModel, Tokenizer};
use rl::{Job, JobConfig, LearnerSlot, RlContext, RlMetrics};
use std::sync::Arc;
use std::time::Instant;

/// Flags of `bench rl`.
#[derive(Args)]
pub struct RlBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Steps per job (the first, which builds the learner's caches, counts in steps/s but not
    /// in the seconds per step after it or the split).
    #[arg(long, default_value_t = 6, value_parser = server::serve::positive)]
    pub steps: usize,
    #[arg(long, default_value_t = 4, value_parser = server::serve::positive)]
    pub prompts_per_step: usize,
    /// Answers per prompt: a GRPO group, so at least 2.
    #[arg(long, default_value_t = 8, value_parser = group_size)]
    pub num_generations: usize,
    #[arg(long, default_value_t = 32, value_parser = server::serve::positive)]
    pub max_completion_length: usize,
    /// The staleness bounds to compare.
    #[arg(long, value_delimiter = ',', default_value = "0,2")]
    pub max_staleness: Vec<u64>,
    /// Keep the job's default `log_kl_to_initial = true`: a second forward per step, through
    /// a frozen copy of the initial weights, for the `kl` metric. Off by default here, as in
    /// TRL at `beta = 0`, which keeps no reference model.
    #[arg(long)]
    pub log_kl_to_initial: bool,
    /// Write the results as JSON to this file: one object per `max_staleness`, the table's
    /// figures under their column names.
    #[arg(long)]
    pub output_json: Option<std::path::PathBuf>,
}

/// `--num-generations`: a whole number >= 2 (a group of one has no advantage).
fn group_size(s: &str) -> std::result::Result<usize, String> {
    match server::serve::positive(s)? {
        1 => Err("must be at least 2 (GRPO compares a prompt's answers), got 1".into()),
        n => Ok(n),
    }
}

/// Runs `bench rl`.
pub fn run(a: RlBenchArgs) -> Result<()> {
    super::check_output_json(a.output_json.as_deref())?;
    let (device, dir) = a.model.open()?;
    let tok = Arc::new(Tokenizer::from_dir(&dir)?);
    let rt = tokio::runtime::Runtime::new()?;
    println!(
        "bench rl: {} steps × {} prompts × {} generations, ≤ {} completion tokens, {} threads",
        a.steps,
        a.prompts_per_step,
        a.num_generations,
        a.max_completion_length,
        rayon::current_num_threads()
    );
    println!(
        "| max_staleness | steps/s | s/step after step 1 | rollout tok/s | train tok/s | pause mean (s) | pause max (s) | learner idle | engine idle | staleness max |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let (mut splits, mut rows) = (Vec::new(), Vec::new());
    for &k in &a.max_staleness {
        let model = SharedModel::new(Model::load(&dir, &device)?);
        let engine = LLMEngine::new(model.clone(), tok.clone(), EngineConfig::default())?;
        let max_model_len = engine.max_model_len();
        let out = tempdir(k)?;
        let ctx = RlContext {
            engine: EngineHandle::spawn(engine),
            model,
            tokenizer: tok.clone(),
            model_dir: dir.clone(),
            runtime: rt.handle().clone(),
            metrics: RlMetrics::new("bench"),
            learner: LearnerSlot::default(),
            max_model_len,
            version_record: None,
        };
        let cfg = JobConfig::from_toml(&format!(
            "max_steps = {}\nprompts_per_step = {}\nnum_generations = {}\noutput_dir = {:?}\nsave_steps = 1000000\n[learner]\nmax_completion_length = {}\nmax_staleness = {k}\nlog_kl_to_initial = {}\n",
            a.steps,
            a.prompts_per_step,
            a.num_generations,
            out.display().to_string(),
            a.max_completion_length,
            a.log_kl_to_initial
        ))?;
        let t0 = Instant::now();
        let job = Job::start(format!("bench-{k}"), cfg, ctx, false)?;
        job.wait();
        let wall = t0.elapsed().as_secs_f64();
        let st = job.status();
        if let Some(e) = st.error {
            anyhow::bail!("max_staleness {k}: the job failed: {e}");
        }
        let h = &st.history;
        let sum = |f: &dyn Fn(&rl::report::StepRecord) -> f64| h.iter().map(f).sum::<f64>();
        let pauses: Vec<f64> = h.iter().filter(|r| r.updated).map(|r| r.learner.pause_seconds).collect();
        // Seconds per step after the first (None for a one-step job).
        let after_first = match (h.first(), h.last()) {
            (Some(a), Some(b)) if h.len() > 1 => Some((b.elapsed_seconds - a.elapsed_seconds) / (h.len() - 1) as f64),
            _ => None,
        };
        let row = serde_json::json!({
            "max_staleness": k,
            "steps_per_second": h.len() as f64 / wall,
            "seconds_per_step_after_step_1": after_first,
            "rollout_tokens_per_second": sum(&|r| r.timing.rollout_tokens as f64) / wall,
            "train_tokens_per_second": sum(&|r| r.learner.tokens_per_s * r.learner.step_seconds) / wall,
            "pause_mean_seconds": pauses.iter().sum::<f64>() / pauses.len().max(1) as f64,
            "pause_max_seconds": pauses.iter().cloned().fold(0.0, f64::max),
            "learner_idle_fraction": sum(&|r| r.timing.learner_wait_seconds) / wall,
            "engine_idle_fraction": sum(&|r| r.timing.admission_wait_seconds) / wall,
            "staleness_max": h.iter().map(|r| r.learner.staleness_max).max().unwrap_or(0),
        });
        let f = |key: &str| row[key].as_f64().unwrap_or(f64::NAN);
        println!(
            "| {k} | {:.3} | {} | {:.1} | {:.1} | {:.3} | {:.3} | {:.2} | {:.2} | {} |",
            f("steps_per_second"),
            after_first.map_or("-".into(), |x| format!("{x:.2}")),
            f("rollout_tokens_per_second"),
            f("train_tokens_per_second"),
            f("pause_mean_seconds"),
            f("pause_max_seconds"),
            f("learner_idle_fraction"),
            f("engine_idle_fraction"),
            row["staleness_max"],
        );
        rows.push(row);
        // The split over the steps after the first (all of them when there is one).
        let rest = if h.len() > 1 { &h[1..] } else { &h[..] };
        let n = rest.len().max(1) as f64;
        let mean = |f: &dyn Fn(&rl::report::StepRecord) -> f64| rest.iter().map(f).sum::<f64>() / n;
        splits.push(format!(
            "| {k} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.2} |",
            after_first.unwrap_or(wall / n),
            mean(&|r| r.timing.generation_seconds),
            mean(&|r| r.learner.forward_seconds),
            mean(&|r| r.learner.backward_seconds),
            mean(&|r| r.learner.optimizer_seconds),
            mean(&|r| r.learner.pause_seconds),
            mean(&|r| r.learner.step_seconds),
        ));
        let _ = std::fs::remove_dir_all(&out);
    }
    match a.steps {
        1 => println!("\nthe one step, its first-touch warm-up included, seconds:"),
        _ => println!("\nper step after the first, seconds (means):"),
    }
    println!(
        "| max_staleness | wall | generation | learner forward | learner backward | optimizer | pause | learner step |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for s in splits {
        println!("{s}");
    }
    println!("train tok/s counts prompt + completion tokens through forward + backward + AdamW;");
    println!(
        "optimizer = gradient norm + AdamW moments + laying the step out (outside the write guard), pause = under it;"
    );
    println!("learner idle = time waiting for a batch, engine idle = generator time waiting for admission (staleness bound).");
    if let Some(path) = &a.output_json {
        let j = serde_json::json!({
            "steps": a.steps, "prompts_per_step": a.prompts_per_step, "num_generations": a.num_generations,
            "max_completion_length": a.max_completion_length, "threads": rayon::current_num_threads(), "runs": rows,
        });
        super::write_output_json(path, &j)?;
    }
    Ok(())
}

fn tempdir(k: u64) -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("rlserve-bench-rl-{}-{k}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
