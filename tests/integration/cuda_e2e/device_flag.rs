//! `--device cpu|cuda|cuda:N|cuda-emu`: the one parser (`server::device::DeviceSpec`), opening a device
//! this machine does not have, and the `rlserve` binary's exit status and message on every
//! command that loads a model.

use server::device::DeviceSpec;
use std::process::Command;

#[test]
fn parses_cpu_cuda_ordinals_and_the_emulated_device() {
    assert_eq!(DeviceSpec::parse("cpu"), Ok(DeviceSpec::Cpu));
    assert_eq!(DeviceSpec::parse("cuda"), Ok(DeviceSpec::Cuda(0)));
    assert_eq!(DeviceSpec::parse("cuda:0"), Ok(DeviceSpec::Cuda(0)));
    assert_eq!(DeviceSpec::parse("cuda:7"), Ok(DeviceSpec::Cuda(7)));
    assert_eq!(DeviceSpec::parse("cuda:12"), Ok(DeviceSpec::Cuda(12)));
    assert_eq!(DeviceSpec::parse("cuda-emu"), Ok(DeviceSpec::CudaEmu));
    assert_eq!(DeviceSpec::Cuda(3).to_string(), "cuda:3");
    assert_eq!(DeviceSpec::CudaEmu.to_string(), "cuda-emu");
    assert_eq!(DeviceSpec::default(), DeviceSpec::Cpu);
}

#[test]
fn rejects_anything_else_naming_the_value() {
    let bad_values = [
        "gpu",
        "",
        "CPU",
        "cuda:",
        "cuda:x",
        "cuda:+1",
        "cuda:-1",
        "cuda:1:2",
        " cuda",
        "cuda0",
        "cuda_emu",
        "cuda-emu:0",
    ];
    for bad in bad_values.into_iter().chain(["cuda:99999999999999999999"]) {
        let e = DeviceSpec::parse(bad).unwrap_err();
        assert_eq!(e, format!("--device must be cpu, cuda, cuda:N or cuda-emu, got {bad:?}"));
    }
}

#[test]
fn opening_cpu_gives_the_cpu_and_cuda_without_a_gpu_is_a_clear_error() {
    assert!(matches!(DeviceSpec::Cpu.open().unwrap(), kernels::Device::Cpu));
    match DeviceSpec::Cuda(0).open() {
        // A GPU machine with a `cuda` build: nothing to check here.
        Ok(_) => eprintln!("skipped: this machine has a GPU"),
        Err(e) => {
            let e = e.to_string();
            // The kernels crate's missing-library error (or the driver's when the libraries
            // load but no GPU answers). The tests build the CUDA backend (the emulated
            // device needs it), so the stub's "built without" error is kernels' own unit test.
            assert!(e.starts_with("--device cuda:0: CUDA"), "{e}");
        }
    }
}

/// Runs `rlserve <args>`; returns (exit code, stderr).
fn rlserve(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(tests::rlserve_binary()).args(args).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Every command that loads a model takes `--device` and `--batch-invariant`: a bad device
/// is clap's usage error (exit 2) with the parser's message, not "unexpected argument"
/// (which an unknown `--batch-invariant`, read first, would be).
#[test]
fn every_model_command_takes_the_flag() {
    let dir = tests::temp_dir("cuda-e2e-flag");
    std::fs::write(dir.join("job.toml"), "max_steps = 1\n").unwrap();
    let (job, batch) = (dir.join("job.toml"), dir.join("batch.jsonl"));
    let (job, batch) = (job.to_str().unwrap(), batch.to_str().unwrap());
    let commands: [&[&str]; 8] = [
        &["serve"],
        &["train", "--config", job],
        &["train-step", "--batch", batch],
        &["generate", "--prompt", "hi"],
        &["bench", "latency"],
        &["bench", "throughput"],
        &["bench", "train"],
        &["bench", "rl"],
    ];
    for cmd in commands {
        let (code, err) = rlserve(&[cmd, &["--batch-invariant", "--device", "gpu"]].concat());
        assert_eq!(code, Some(2), "{cmd:?}: {err}");
        assert!(err.contains(r#"--device must be cpu, cuda, cuda:N or cuda-emu, got "gpu""#), "{cmd:?}: {err}");
    }
}

/// `--device cuda` in a CPU-only build (what `tests::rlserve_binary` builds) fails at start with the kernels crate's error, before the model is
/// read (the folder here does not exist): exit status 1, no panic.
#[test]
fn cuda_without_a_gpu_fails_at_start_without_a_panic() {
    let missing = tests::temp_dir("cuda-e2e-missing").join("no-such-model");
    let missing = missing.to_str().unwrap();
    for cmd in [&["generate", "--prompt", "hi"][..], &["bench", "latency"], &["serve"]] {
        let (code, err) = rlserve(&[cmd, &["--device", "cuda", "--model", missing]].concat());
        assert_eq!(code, Some(1), "{cmd:?}: {err}");
        assert!(err.contains("error: --device cuda:0: CUDA requested but"), "{cmd:?}: {err}");
        assert!(!err.contains("panicked"), "{cmd:?}: {err}");
        assert!(!err.contains("no-such-model"), "{cmd:?}: the device is opened before the model: {err}");
    }
}

/// `--dtype` (vLLM's flag): `bfloat16` needs CUDA and contradicts `--batch-invariant`; both
/// are start-up errors naming the flags (exit status 1, before the model is read); an unknown
/// value is clap's usage error.
#[test]
fn dtype_bfloat16_needs_cuda_and_no_batch_invariance() {
    let missing = tests::temp_dir("cuda-e2e-dtype").join("no-such-model");
    let missing = missing.to_str().unwrap();
    let cases: [(&[&str], i32, &str); 3] = [
        (&["--dtype", "bfloat16"], 1, "--dtype bfloat16 needs --device cuda"),
        (&["--device", "cuda", "--batch-invariant", "--dtype", "bfloat16"], 1, "--batch-invariant computes in float32"),
        (&["--dtype", "half"], 2, "invalid value 'half' for '--dtype"),
    ];
    for (flags, code, msg) in cases {
        let (got, err) = rlserve(&[&["generate", "--prompt", "hi", "--model", missing][..], flags].concat());
        assert_eq!(got, Some(code), "{flags:?}: {err}");
        assert!(err.contains(msg), "{flags:?}: {err}");
        assert!(!err.contains("panicked"), "{flags:?}: {err}");
    }
}

/// `rlserve train --device cuda-emu`: the CLI job (the `rl` job that `train` runs, on the
/// CUDA backend's host code) completes its two steps on a tiny model, writes one metrics
/// record per step with the policy version it produced, and reports the engine's pause per
/// update (the learner held the write guard for a measured, non-zero time).
#[test]
fn train_runs_a_short_job_on_the_emulated_device() {
    let dir = tests::temp_dir("cuda-e2e-train");
    let model = dir.join("model");
    tests::tiny::TinySpec::default().write(&model);
    std::fs::write(dir.join("data.jsonl"), "{\"prompt\": \"abc\"}\n").unwrap();
    let job = format!(
        "model = \"{}\"\ndataset = \"{}\"\napply_chat_template = false\nnum_generations = 4\nprompts_per_step = 1\n\
         max_steps = 2\noutput_dir = \"{}\"\nrewards = [{{ type = \"regex\", pattern = '^[a-z]' }}]\n\
         [learner]\nmax_completion_length = 2\n",
        model.display(),
        dir.join("data.jsonl").display(),
        dir.join("run").display()
    );
    std::fs::write(dir.join("job.toml"), job).unwrap();
    let (code, err) =
        rlserve(&["train", "--config", dir.join("job.toml").to_str().unwrap(), "--no-serve", "--device", "cuda-emu"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("job Completed at step 2/2 (policy version 2)"), "{err}");
    let metrics = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap();
    let steps: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == "train")
        .collect();
    assert_eq!(steps.len(), 2, "{metrics}");
    for (i, r) in steps.iter().enumerate() {
        assert_eq!((&r["step"], &r["version"]), (&(i + 1).into(), &(i + 1).into()), "{r}");
        let pause = r["pause_seconds"].as_f64().unwrap_or_else(|| panic!("no pause in {r}"));
        assert!(pause > 0.0, "{r}");
    }
}
