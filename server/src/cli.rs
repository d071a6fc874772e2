//! Command-line interface and the `generate` command.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use engine::generate::generate as run_generation;
use engine::{ChatMessage, Model, SamplingParams, Tokenizer};
use kernels::{CudaOptions, Device};
use server::device::DeviceSpec;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "rlserve", version, about = "Serve an LLM and train it online, in one process")]
pub struct Cli {
    /// Worker threads for model math (default: all cores).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Download and convert the default model (SmolLM2-135M-Instruct) into $RLSERVE_MODELS_DIR (default ./models).
    FetchModel,
    /// Serve the OpenAI-compatible HTTP API (the main job).
    Serve(ServeCommand),
    /// Run a training job (online RL on the served model) from a TOML config; serves the
    /// HTTP API meanwhile unless --no-serve.
    Train(crate::train::TrainArgs),
    /// One learner step on a JSONL batch; prints the step metrics as JSON.
    TrainStep(crate::train_step::TrainStepArgs),
    /// Generate a completion for one prompt, streaming it to stdout.
    // `--temperature -1` reaches the sampling checks (a range error naming the flag)
    // instead of reading as an unknown flag.
    #[command(allow_negative_numbers = true)]
    Generate(GenerateArgs),
    /// Benchmarks: `latency`, `throughput`, `serve`, `train`, `rl` (kernel micro-benchmarks: `cargo bench -p benches`).
    #[command(subcommand)]
    Bench(crate::bench::BenchCommand),
}

/// `--device`: where the model's weights, its KV cache and all of its math live (shared by
/// every command that loads a model; `ModelArgs` holds it, `train` takes it directly).
#[derive(Args, Clone, Debug)]
pub struct DeviceArg {
    /// Device for the model: cpu, cuda (= cuda:0) or cuda:N. CUDA needs a build with
    /// `--features cuda` and the NVIDIA driver, libnvrtc and libcublas at run time.
    #[arg(long, default_value = "cpu", value_parser = DeviceSpec::parse)]
    pub device: DeviceSpec,
    /// CUDA: batch-invariant kernels (a fixed-order GEMM instead of cuBLAS, split-KV
    /// attention for every row), so a token's logits do not depend on its batch and the
    /// learner's logprobs equal the sampler's bitwise; slower. The CPU is always
    /// batch-invariant (the flag changes nothing there).
    #[arg(long)]
    pub batch_invariant: bool,
    /// Compute type of the linear layers (vLLM's `--dtype`): `auto` is bfloat16 on CUDA (a
    /// bf16 serving copy of each linear weight next to its f32 master, which the learner
    /// updates; cuBLAS bf16 GEMMs with f32 accumulation) and float32 on the CPU or with
    /// `--batch-invariant`.
    #[arg(long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,
}

/// `--dtype` values.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Auto,
    Bfloat16,
    Float32,
}

impl DeviceArg {
    /// Opens the device (see [`DeviceSpec::open`]): commands call it before loading anything,
    /// so a bad `cuda` fails at start with the kernels crate's error.
    pub fn open(&self) -> Result<Device> {
        let cuda = matches!(self.device, DeviceSpec::Cuda(_) | DeviceSpec::CudaEmu);
        let bf16_weights = match self.dtype {
            Dtype::Bfloat16 if !cuda => {
                bail!("--dtype bfloat16 needs --device cuda (the CPU backend computes in float32)")
            }
            Dtype::Bfloat16 if self.batch_invariant => {
                bail!("--batch-invariant computes in float32: drop --dtype bfloat16 (or use --dtype auto)")
            }
            Dtype::Bfloat16 => true,
            Dtype::Auto => cuda && !self.batch_invariant,
            Dtype::Float32 => false,
        };
        self.device.open_with(CudaOptions { batch_invariant: self.batch_invariant, bf16_weights })
    }
}

/// Where the model comes from and where it runs (shared by the commands that load one).
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// HF model folder (config.json, *.safetensors, tokenizer.json). Default: the default model, fetched if missing.
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub device: DeviceArg,
}

impl ModelArgs {
    /// The opened `--device` and the model folder (the device first: a CUDA error comes
    /// before any download).
    pub fn open(&self) -> Result<(Device, PathBuf)> {
        let device = self.device.open()?;
        Ok((device, self.resolve()?))
    }

    /// The model folder, fetching the default model when `--model` is absent.
    pub fn resolve(&self) -> Result<PathBuf> {
        match &self.model {
            Some(p) => {
                if !p.is_dir() {
                    bail!(
                        "--model {}: not a folder (an HF model folder: config.json, *.safetensors, tokenizer.json)",
                        p.display()
                    );
                }
                if !p.join("config.json").exists() {
                    bail!("--model {}: no config.json in this folder", p.display());
                }
                Ok(p.clone())
            }
            None => Ok(engine::fetch::ensure_default_model(&|m| eprintln!("{m}"))?),
        }
    }
}

#[derive(Args)]
pub struct ServeCommand {
    /// The model folder, as `vllm serve MODEL` takes it (the same as `--model`).
    #[arg(value_name = "MODEL", conflicts_with = "model")]
    pub model_folder: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub serve: server::serve::ServeArgs,
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k cutoff; 0 or -1 = off.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub top_k: i32,
    /// RNG seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Decode without CUDA graphs (vLLM's flag; the CPU has none).
    #[arg(long)]
    pub enforce_eager: bool,
}

/// Loads tokenizer and model from `dir`, the model onto `device`.
pub fn load(dir: &Path, device: &Device) -> Result<(Tokenizer, Model)> {
    let tok = Tokenizer::from_dir(dir)?;
    let model = Model::load(dir, device).with_context(|| format!("loading {}", dir.display()))?;
    Ok((tok, model))
}

/// Tokenizes `prompt`: with `chat` as one user message of a chat request (its text is plain
/// text), else as a completions prompt.
pub fn encode_prompt(tok: &Tokenizer, prompt: &str, chat: bool) -> Result<Vec<u32>> {
    let ids = if chat {
        tok.encode_chat(&[ChatMessage::new("user", prompt)], engine::ChatOptions::default())?
    } else {
        tok.encode(prompt, true)?
    };
    if ids.is_empty() {
        bail!("--prompt is empty after tokenization");
    }
    Ok(ids)
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        max_tokens: Some(a.max_tokens),
        ..Default::default()
    };
    params.validate().map_err(|e| anyhow::anyhow!("{}", e.to_string().replacen('`', "`--", 1).replace('_', "-")))?;
    let (device, dir) = a.model.open()?;
    let (tok, model) = load(&dir, &device)?;
    let prompt = encode_prompt(&tok, &a.prompt, a.chat)?;
    let ctx = model.config.max_position_embeddings;
    if prompt.len() + a.max_tokens > ctx {
        bail!(
            "the prompt ({} tokens) plus --max-tokens {} exceeds the model's context of {ctx} tokens",
            prompt.len(),
            a.max_tokens
        );
    }
    let mut stdout = std::io::stdout();
    let model = engine::SharedModel::new(model);
    let (_, stats) = run_generation(&model, std::sync::Arc::new(tok), &prompt, &params, a.enforce_eager, |o| {
        let _ = stdout.write_all(o.text.as_bytes());
        let _ = stdout.flush();
    })?;
    println!();
    eprintln!(
        "prompt: {} tokens ({:.1} tok/s), generation: {} tokens ({:.1} tok/s)",
        stats.prompt_tokens,
        stats.prefill_tokens_per_s(),
        stats.generated_tokens,
        stats.decode_tokens_per_s()
    );
    Ok(())
}
