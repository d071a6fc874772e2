//! `rlserve`: serve an LLM and train it online (`serve`, `train`, `train-step`,
//! `fetch-model`, `generate`, `bench`).

mod bench;
mod cli;
mod train;
mod train_step;

use anyhow::Result;

/// mimalloc, told never to purge, keeps freed memory for reuse: with glibc the model's large
/// per-op buffers are fresh mmaps each time (page faults, zeroing, TLB shootdowns: about 20%
/// of a training step).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use clap::Parser;

fn main() {
    // Never return freed memory to the OS (`mi_option_purge_delay` = -1), unless the user
    // set MIMALLOC_PURGE_DELAY.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        /// `mi_option_purge_delay` in mimalloc.h: the option right before `mi_option_use_numa_nodes`.
        const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = libmimalloc_sys::mi_option_use_numa_nodes - 1;
        // SAFETY: sets a process-wide allocator option; valid at any time.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
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
        cli::Command::Serve(mut s) => {
            init_tracing();
            s.model.model = s.model.model.or(s.model_folder.take());
            let (device, dir) = s.model.open()?;
            s.serve.device = Some(device);
            let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            rt.block_on(server::serve::run(&dir, s.serve))
        }
        cli::Command::Generate(g) => cli::generate(g),
        cli::Command::TrainStep(t) => train_step::run(t),
        cli::Command::Train(t) => {
            init_tracing();
            train::run(t)
        }
        cli::Command::Bench(b) => bench::run(b),
    }
}

fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
}
