//! `rlserve train --config job.toml`: runs a training job on the served model, serving the
//! HTTP API at the same time unless `--no-serve`. SIGINT/SIGTERM stops the job after the
//! current step (a checkpoint is saved); rerun with `resume_from_checkpoint = "latest"`.

use anyhow::{Context, Result};
use clap::Args;
use rl::{Job, JobConfig};
use server::serve::{build_state, shutdown_signal, ServeArgs, Server};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct TrainArgs {
    /// Job config (TOML): dataset, rewards, num_generations, max_steps, learner settings...
    #[arg(long)]
    pub config: PathBuf,
    /// Do not start the HTTP server while training.
    #[arg(long)]
    pub no_serve: bool,
    #[command(flatten)]
    pub device: crate::cli::DeviceArg,
    #[command(flatten)]
    pub serve: ServeArgs,
}

pub fn run(mut a: TrainArgs) -> Result<()> {
    a.serve.device = Some(a.device.open()?);
    let text =
        std::fs::read_to_string(&a.config).with_context(|| format!("reading --config {}", a.config.display()))?;
    let cfg = JobConfig::from_toml(&text).with_context(|| format!("--config {}", a.config.display()))?;
    let dir = match &cfg.model {
        Some(p) => p.clone(),
        None => engine::fetch::ensure_default_model(&|m| eprintln!("{m}"))?,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let state = tokio::task::block_in_place(|| build_state(&dir, &a.serve))?;
        let server = if a.no_serve {
            None
        } else {
            let s = Server::start(state.clone(), &a.serve.host, a.serve.port).await?;
            eprintln!("rlserve: serving `{}` on http://{} while training", s.state.model_name, s.addr);
            Some(s)
        };
        let ctx = state.rl.clone();
        let job = tokio::task::spawn_blocking(move || Job::start("job-cli".into(), cfg, ctx, true)).await??;
        state.jobs.insert(job.clone());
        let j = job.clone();
        let mut done = tokio::task::spawn_blocking(move || j.wait());
        tokio::select! {
            r = &mut done => r?,
            _ = shutdown_signal() => {
                eprintln!("stopping after the current step (a checkpoint is saved)...");
                job.request_stop();
                done.await?;
            }
        }
        let st = job.status();
        if let (Some(first), Some(last)) = (st.evals.first(), st.evals.last()) {
            eprintln!(
                "eval: reward {:.3} → {:.3}{} (steps {} → {})",
                first.eval_reward,
                last.eval_reward,
                match (first.eval_accuracy, last.eval_accuracy) {
                    (Some(a), Some(b)) => format!(", accuracy {a:.3} → {b:.3}"),
                    _ => String::new(),
                },
                first.step,
                last.step
            );
        }
        eprintln!(
            "job {:?} at step {}/{} (policy version {}); metrics in {}",
            st.status,
            st.step,
            st.max_steps,
            st.version,
            st.output_dir.join("metrics.jsonl").display()
        );
        if let Some(s) = server {
            s.shutdown(Duration::from_secs(5)).await;
        }
        match st.error {
            Some(e) => anyhow::bail!("training job failed: {e}"),
            None => Ok(()),
        }
    })
}
