//! `rlserve`: serve an LLM and train it online. This commands: `fetch-model`,
//! `generate`, `bench`.

mod bench;
mod bench_throughput;
mod cli;

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
        cli::Command::Generate(g) => cli::generate(g),
        cli::Command::Bench(b) => bench::run(b),
    }
}
