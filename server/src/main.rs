//! `rlserve`: serve an LLM and train it online. This commands: `fetch-model`,
//! `generate`, `bench`.

mod bench;
mod bench_serve;
mod bench_throughput;
mod bench_train;
mod cli;
mod train_step;

use anyhow::Result;
use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    if let Err(e) = run(args) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: cli::Cli) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global()?;
    }
    match args.command {
        cli::Command::FetchModel => {
            let dir = engine::fetch::ensure_default_model(&|m| eprintln!("{m}"))?;
            println!("{}", dir.display());
            Ok(())
        }
        cli::Command::Serve(s) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
                )
                .init();
            let dir = s.model.resolve()?;
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            rt.block_on(server::serve::run(&dir, s.serve))
        }
        cli::Command::Generate(g) => cli::generate(g),
        cli::Command::TrainStep(t) => train_step::run(t),
        cli::Command::Bench(b) => bench::run(b),
    }
}
