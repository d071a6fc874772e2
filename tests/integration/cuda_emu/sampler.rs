//! The sampler kernel against the engine's CPU sampler.

use super::{ffi, rnd, stride};
use engine::sampling::{draw_for, splitmix64, SampleContext, SamplingParams};
use kernels::ops;
use kernels::sample::{RowTask, SampleRow, Sampled};
use kernels::{CudaOptions, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One sampler row: parameters and the sequence's context.
struct Row {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    eos: Vec<u32>,
    seed: u64,
}

/// `ops::sample` on the emulated device (the CUDA host code: packing, the `sampler` and
/// `sample_logprobs` launches, one download) and on the CPU (the engine's sampler), over the
/// same logits `[rows, vocab]`: per row a draw with its parameters (and 3 top
/// log-probabilities on every other row), then a scored row per draw row with 5.
fn both(logits: &[f32], vocab: usize, rows: &[Row]) -> (Vec<Sampled>, Vec<Sampled>) {
    let mut task: Vec<SampleRow> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let ctx =
                SampleContext { prompt_ids: &r.prompt, output_ids: &r.output, eos_token_ids: &r.eos, seed: r.seed };
            SampleRow { row: i, task: RowTask::Draw(draw_for(&r.params, &ctx, vocab)), top_logprobs: 3 * (i % 2) }
        })
        .collect();
    task.extend((0..rows.len()).map(|i| SampleRow {
        row: i,
        task: RowTask::Score((i * 37 % vocab) as u32),
        top_logprobs: 5,
    }));
    let host = Tensor::from_vec(logits.to_vec(), &[rows.len(), vocab]).unwrap();
    let dev = Device::cuda_emu(CudaOptions::default()).unwrap();
    let before = dev.counters().unwrap();
    let got = ops::sample(&host.to_device(&dev).unwrap(), &task).unwrap();
    let used = dev.counters().unwrap() - before;
    // The logits' upload, the two packed buffers, one download of [rows, 3 + 2·5] results.
    assert_eq!((used.htod_copies, used.dtoh_copies), (3, 1), "{used:?}");
    assert_eq!(used.dtoh_bytes as usize, task.len() * (3 + 2 * 5) * 4, "{used:?}");
    (got, ops::sample(&host, &task).unwrap())
}

/// The CUDA sampler draws the CPU sampler's token from the same RNG stream, for every
/// truncation and penalty, over many seeds and steps (vocab 300: rows of flat-ish logits, so
/// different uniforms pick different tokens), and returns its μ (1e-6: the prefix sums are
/// a blocked scan there, sequential on the CPU), its raw log-probability and the top raw
/// log-probabilities (1e-6: the partition's f64 sum order), for draws and scored tokens.
/// Untouched draws (T = 1, nothing else) have μ = raw bitwise on both.
#[test]
fn sampler_kernel_draws_the_cpu_samplers_token() {
    let vocab = 300;
    let base = SamplingParams::default();
    let cases = [
        SamplingParams { temperature: 1.0, ..base.clone() },
        SamplingParams { temperature: 0.7, top_k: 20, ..base.clone() },
        SamplingParams { temperature: 1.3, top_p: 0.9, ..base.clone() },
        SamplingParams { temperature: 0.8, min_p: 0.05, ..base.clone() },
        SamplingParams { temperature: 1.1, top_k: 50, top_p: 0.8, min_p: 0.02, ..base.clone() },
        SamplingParams {
            temperature: 0.9,
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            logit_bias: vec![(5, 3.0), (9, -100.0), (5, 1.5)],
            min_tokens: 10,
            stop_token_ids: vec![17],
            ..base.clone()
        },
        SamplingParams::greedy(),
    ];
    let mut rng = StdRng::seed_from_u64(90);
    let (mut rows, mut logits) = (vec![], vec![]);
    for (ci, params) in cases.iter().enumerate() {
        for s in 0..8u64 {
            let output: Vec<u32> = (0..(s as usize * 3 % 13)).map(|_| rng.gen_range(0..40)).collect();
            let prompt: Vec<u32> = (0..6).map(|_| rng.gen_range(0..vocab as u32)).collect();
            rows.push(Row { params: params.clone(), prompt, output, eos: vec![2], seed: s * 1_000_003 + ci as u64 });
            logits.extend(rnd(vocab, 100 + s).iter().map(|x| x * 1.5 + if ci == 6 { 0.0 } else { 0.2 }));
        }
    }
    let (got, want) = both(&logits, vocab, &rows);
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * (1.0 + b.abs());
    let mut distinct = std::collections::HashSet::new();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let what = rows.get(i).map_or("a scored row".to_string(), |r| format!("{:?}", r.params));
        assert_eq!(g.token, w.token, "row {i} ({what}): token");
        assert!(close(g.behavior_logprob, w.behavior_logprob), "row {i} ({what}): μ {g:?} vs {w:?}");
        assert!(close(g.raw_logprob, w.raw_logprob), "row {i} ({what}): raw {g:?} vs {w:?}");
        assert_eq!(g.top_logprobs.len(), w.top_logprobs.len(), "row {i}");
        for (a, b) in g.top_logprobs.iter().zip(&w.top_logprobs) {
            assert!(a.0 == b.0 && close(a.1, b.1), "row {i} ({what}): top {a:?} vs {b:?}");
        }
        if i < 8 {
            assert_eq!(g.behavior_logprob.to_bits(), g.raw_logprob.to_bits(), "row {i}: untouched μ = raw");
            assert_eq!(w.behavior_logprob.to_bits(), w.raw_logprob.to_bits(), "row {i}: untouched μ = raw");
        }
        if i < rows.len() {
            distinct.insert(g.token);
        }
    }
    // The draws are not all the argmax: the RNG stream decides them.
    assert!(distinct.len() > 20, "only {} distinct tokens", distinct.len());
}

/// The kernel's uniform is the CPU sampler's, bitwise: rand 0.8 `StdRng` (ChaCha12 seeded by
/// PCG32) from `splitmix64(seed ^ splitmix64(step))`, over seeds and steps with every bit
/// pattern class (0, small, large, all ones).
#[test]
fn sampler_rng_stream_equals_rand_stdrng() {
    let mut seeds: Vec<u64> = vec![0, 1, 42, u64::MAX, 0x8000_0000_0000_0000];
    let mut r = StdRng::seed_from_u64(7);
    seeds.extend((0..60).map(|_| r.gen::<u64>()));
    let steps: Vec<u64> = (0..seeds.len() as u64).map(|i| i * i * 31).collect();
    let mut out = vec![0.0f64; seeds.len()];
    unsafe {
        ffi::emu_sampler_uniforms(
            stride(seeds.len()).as_ptr(),
            0,
            seeds.as_ptr(),
            steps.as_ptr(),
            out.as_mut_ptr(),
            seeds.len() as i32,
        )
    };
    for ((&seed, &step), got) in seeds.iter().zip(&steps).zip(out) {
        let want = StdRng::seed_from_u64(splitmix64(seed ^ splitmix64(step))).gen::<f64>();
        assert_eq!(got.to_bits(), want.to_bits(), "seed {seed}, step {step}");
    }
}
