//! The sampler kernel against the engine's CPU sampler.

use super::{ffi, per_row, rnd, stride};
use engine::sampling::{sample, splitmix64, SampleContext, SamplingParams};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One sampler row: parameters and the sequence's context.
struct SampleRow {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    eos: Vec<u32>,
    seed: u64,
}

/// The sampler kernel on `rows` of `logits [rows, vocab]`: `(token, behaviour log-prob)` per
/// row. The host part here (distinct token lists, counts, masks) is what the CUDA backend's
/// host side will do.
fn gpu_sample(logits: &[f32], vocab: usize, rows: &[SampleRow]) -> Vec<(u32, f32)> {
    let m = rows.len();
    let (mut params, mut offs) = (vec![], [vec![0i32], vec![0], vec![0], vec![0]]);
    let (mut rep, mut outt, mut cnt, mut bias_t, mut bias_v, mut mask) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for r in rows {
        let p = &r.params;
        params.push(ffi::SampleParams {
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            top_k: p.top_k,
            pad: 0,
            seed: r.seed,
            step: r.output.len() as u64,
        });
        let mut seen: Vec<u32> = r.prompt.iter().chain(&r.output).copied().collect();
        seen.sort_unstable();
        seen.dedup();
        rep.extend(seen);
        let mut counts = std::collections::BTreeMap::<u32, i32>::new();
        for &t in &r.output {
            *counts.entry(t).or_default() += 1;
        }
        outt.extend(counts.keys());
        cnt.extend(counts.values());
        for &(t, b) in &p.logit_bias {
            bias_t.push(t);
            bias_v.push(b);
        }
        if r.output.len() < p.min_tokens {
            mask.extend(r.eos.iter().chain(&p.stop_token_ids));
        }
        for (o, len) in offs.iter_mut().zip([rep.len(), outt.len(), bias_t.len(), mask.len()]) {
            o.push(len as i32);
        }
    }
    let sort_len = vocab.next_power_of_two();
    let (mut work, mut keys, mut cum) = (vec![0.0f32; m * vocab], vec![0u64; m * sort_len], vec![0.0f64; m * vocab]);
    let (mut token, mut logprob) = (vec![0i32; m], vec![0.0f32; m]);
    unsafe {
        ffi::emu_sampler(
            per_row(m, 64).as_ptr(),
            0,
            logits.as_ptr(),
            m as i32,
            vocab as i32,
            params.as_ptr(),
            offs[0].as_ptr(),
            rep.as_ptr(),
            offs[1].as_ptr(),
            outt.as_ptr(),
            cnt.as_ptr(),
            offs[2].as_ptr(),
            bias_t.as_ptr(),
            bias_v.as_ptr(),
            offs[3].as_ptr(),
            mask.as_ptr(),
            work.as_mut_ptr(),
            keys.as_mut_ptr(),
            cum.as_mut_ptr(),
            sort_len as i32,
            token.as_mut_ptr(),
            logprob.as_mut_ptr(),
        );
    }
    token.iter().zip(logprob).map(|(&t, l)| (t as u32, l)).collect()
}

/// The sampler kernel draws the CPU sampler's token from the same RNG stream, for every
/// truncation and penalty, over many seeds and steps (vocab 300: rows of flat-ish logits, so
/// different uniforms pick different tokens), and returns its behaviour log-prob (1e-6:
/// the prefix sums are a blocked scan here, sequential on the CPU).
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
            rows.push(SampleRow {
                params: params.clone(),
                prompt,
                output,
                eos: vec![2],
                seed: s * 1_000_003 + ci as u64,
            });
            logits.extend(rnd(vocab, 100 + s).iter().map(|x| x * 1.5 + if ci == 6 { 0.0 } else { 0.2 }));
        }
    }
    let got = gpu_sample(&logits, vocab, &rows);
    let mut distinct = std::collections::HashSet::new();
    for (i, (r, (tok, lp))) in rows.iter().zip(got).enumerate() {
        let ctx = SampleContext { prompt_ids: &r.prompt, output_ids: &r.output, eos_token_ids: &r.eos, seed: r.seed };
        let want = sample(&logits[i * vocab..(i + 1) * vocab], &r.params, &ctx);
        assert_eq!(tok, want.token, "row {i} ({:?}): token", r.params);
        assert!(
            (lp - want.behavior_logprob).abs() <= 1e-6 * (1.0 + want.behavior_logprob.abs()),
            "row {i}: logprob {lp} vs {}",
            want.behavior_logprob
        );
        distinct.insert(tok);
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
