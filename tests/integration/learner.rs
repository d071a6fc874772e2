//! The learner's forward and backward against JAX autodiff (float64) on tiny models
//! (fixtures from tests/fixtures/make_learner_reference.py; Qwen3's against PyTorch
//! autodiff on transformers' own model, tests/fixtures/make_qwen3_reference.py), and ℓ = the
//! engine's logprob.

use engine::{EngineConfig, LLMEngine, Model, SamplingParams};
use kernels::{Device, Tensor};
use learner::{self, Grads, ParamKey, Recompute};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use std::sync::Arc;

#[derive(Deserialize)]
struct Seq {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    weights: Vec<f32>,
    entropy_weights: Vec<f32>,
    hidden_weights: Vec<Vec<f32>>,
    logprobs: Vec<f64>,
}

#[derive(Deserialize)]
struct Batch {
    temperature: f32,
    loss: f64,
    batch: Vec<Seq>,
}

/// Runs forward + backward of `L = Σ w·ℓ + Σ u·H + Σ U·h` (h: the final hidden rows) on
/// fixture `name`, one sequence at a time (`packed = false`) or as one packed batch
/// (keeping less for backward as `recompute` says), compares with JAX, and returns ℓ, the
/// entropies and the gradients.
fn check(name: &str, packed: bool, recompute: Recompute) -> (Vec<f32>, Vec<f32>, Grads) {
    let dir = tests::fixture(&format!("learner/{name}"));
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let b: Batch = serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let mut grads = Grads::default();
    let mut loss = 0.0f64;
    let (mut logprobs, mut entropies) = (vec![], vec![]);
    let mut check_fwd = |f: &learner::SeqForward, w: &[f32], u: &[f32], hw: &[f32], want: &[f64], grads: &mut Grads| {
        logprobs.extend(&f.logprobs);
        entropies.extend(&f.entropies);
        assert_eq!(f.logprobs.len(), want.len(), "{name}: one ℓ per completion token");
        for (got, want) in f.logprobs.iter().zip(want) {
            assert!((*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{name}: ℓ {got} vs JAX {want}");
        }
        loss += f.logprobs.iter().zip(w).map(|(l, w)| (*l as f64) * (*w as f64)).sum::<f64>();
        loss += f.entropies.iter().zip(u).map(|(h, u)| (*h as f64) * (*u as f64)).sum::<f64>();
        let hidden = f.hidden().to_vec().unwrap();
        assert_eq!(hidden.len(), hw.len(), "{name}: one hidden row per completion token");
        loss += hidden.iter().zip(hw).map(|(h, u)| (*h as f64) * (*u as f64)).sum::<f64>();
        let dh = kernels::Tensor::from_vec(hw.to_vec(), f.hidden().shape()).unwrap();
        let g = learner::OutputGrads { dl_dlogp: w, dl_dentropy: Some(u), dl_dhidden: Some(&dh) };
        f.backward(&model, &g, grads).unwrap();
    };
    if packed {
        let seqs: Vec<(&[u32], &[u32])> =
            b.batch.iter().map(|s| (s.prompt.as_slice(), s.completion.as_slice())).collect();
        let f = learner::forward_batch_with(&model, &seqs, b.temperature, recompute).unwrap();
        let cat = |g: fn(&Seq) -> Vec<f32>| b.batch.iter().flat_map(g).collect::<Vec<f32>>();
        let want: Vec<f64> = b.batch.iter().flat_map(|s| s.logprobs.clone()).collect();
        let hw = cat(|s| s.hidden_weights.concat());
        check_fwd(&f, &cat(|s| s.weights.clone()), &cat(|s| s.entropy_weights.clone()), &hw, &want, &mut grads);
    } else {
        for s in &b.batch {
            let f = learner::forward(&model, &s.prompt, &s.completion, b.temperature).unwrap();
            check_fwd(&f, &s.weights, &s.entropy_weights, &s.hidden_weights.concat(), &s.logprobs, &mut grads);
        }
    }
    assert!((loss - b.loss).abs() <= 1e-5 * b.loss.abs(), "{name}: loss {loss} vs JAX {}", b.loss);
    let bytes = std::fs::read(dir.join("grads.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(want.names().len(), grads.tensors.len(), "{name}: same set of gradient tensors");
    for (tname, view) in want.tensors() {
        assert_eq!(view.dtype(), Dtype::F64);
        let w: Vec<f64> = view.data().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
        let key = ParamKey::parse(&tname).unwrap_or_else(|| panic!("{name}: {tname} is not a parameter name"));
        let g = grads.tensors.get(&key).unwrap_or_else(|| panic!("{name}: no gradient for {tname}"));
        assert_eq!(g.shape(), view.shape(), "{tname}");
        let g = g.to_vec().unwrap();
        assert_eq!(g.len(), w.len(), "{tname}");
        let err: f64 = g.iter().zip(&w).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt();
        let norm: f64 = w.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(
            err <= 1e-4 * norm.max(1e-12),
            "{name} (packed {packed}): {tname}: relative L2 error {:.2e}",
            err / norm
        );
    }
    (logprobs, entropies, grads)
}

#[test]
fn gradients_match_jax_autodiff() {
    let host = |g: &Grads| -> Vec<(String, Vec<f32>)> {
        g.tensors.iter().map(|(n, t)| (n.to_string(), t.to_vec().unwrap())).collect()
    };
    for name in ["llama_tied", "llama_untied", "qwen2_bias", "qwen3_tied", "qwen3_untied"] {
        check(name, false, Recompute::default());
        let (lp, ent, packed) = check(name, true, Recompute::default());
        // Gradient checkpointing recomputes the same activations: bitwise equal gradients.
        let (_, _, recomputed) = check(name, true, Recompute { layers: true, head_rows: None });
        assert_eq!(host(&packed), host(&recomputed), "{name}: checkpointing changed the gradients");
        // The LM head 5 rows at a time over the 12 completion tokens (chunks 5, 5, 2 across
        // the sequences' boundaries), in forward and backward: ℓ, the entropies and every
        // gradient but the head's bitwise the same; the head's (the embedding's when tied)
        // is summed chunk by chunk, against JAX in `check` and near the one-chunk sum here.
        let (lp5, ent5, chunked) = check(name, true, Recompute { layers: true, head_rows: Some(5) });
        assert_eq!((&lp, &ent), (&lp5, &ent5), "{name}: ℓ and entropies with the head in chunks");
        let untied = packed.tensors.keys().any(|k| k.to_string() == "lm_head.weight");
        let head = if untied { "lm_head.weight" } else { "model.embed_tokens.weight" };
        for ((n, a), (_, b)) in host(&packed).iter().zip(host(&chunked)) {
            if n != head {
                assert_eq!(a, &b, "{name}: {n} with the head in chunks");
                continue;
            }
            let err = a.iter().zip(&b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
            let norm = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            assert!(err <= 1e-6 * norm, "{name}: {n}: relative L2 {:.2e} with the head in chunks", err / norm);
        }
    }
}

/// HF Llama/Qwen2 embed with `nn.Embedding(vocab, hidden, padding_idx = pad_token_id)`, whose
/// lookup passes no gradient to the pad row (PyTorch's documented semantics). On the untied
/// fixture with `pad_token_id` set to a token of its prompts: that row of the embedding
/// gradient is exactly 0 (and nonzero without `pad_token_id`), every other gradient value is
/// bitwise what it is without it.
#[test]
fn the_pad_tokens_embedding_row_gets_no_lookup_gradient() {
    let src = tests::fixture("learner/llama_untied");
    let b: Batch = serde_json::from_str(&std::fs::read_to_string(src.join("batch.json")).unwrap()).unwrap();
    let pad = b.batch[0].prompt[0];
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let h = config["hidden_size"].as_u64().unwrap() as usize;
    let grads = |pad_token_id: Option<u32>| -> Vec<(String, Vec<f32>)> {
        let dir = tests::temp_dir(&format!("pad-{pad_token_id:?}"));
        let mut config = config.clone();
        config["pad_token_id"] = pad_token_id.map_or(serde_json::Value::Null, |p| p.into());
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
        let model = Model::load(&dir, &Device::Cpu).unwrap();
        let seqs: Vec<(&[u32], &[u32])> = b.batch.iter().map(|s| (&s.prompt[..], &s.completion[..])).collect();
        let w: Vec<f32> = b.batch.iter().flat_map(|s| s.weights.clone()).collect();
        let f = learner::forward_batch(&model, &seqs, b.temperature).unwrap();
        let mut g = Grads::default();
        f.backward(&model, &learner::OutputGrads::logprobs(&w), &mut g).unwrap();
        g.tensors.iter().map(|(n, t)| (n.to_string(), t.to_vec().unwrap())).collect()
    };
    let (with, without) = (grads(Some(pad)), grads(None));
    let row = |g: &[f32]| g[pad as usize * h..(pad as usize + 1) * h].to_vec();
    for ((name, a), (_, b)) in with.iter().zip(&without) {
        if name == "model.embed_tokens.weight" {
            assert!(row(a).iter().all(|&x| x == 0.0), "the pad row gets no lookup gradient");
            assert!(row(b).iter().any(|&x| x != 0.0), "without pad_token_id it does (token {pad} is an input)");
            let rest = |g: &[f32]| [&g[..pad as usize * h], &g[(pad as usize + 1) * h..]].concat();
            assert_eq!(rest(a), rest(b), "the other rows are unchanged");
        } else {
            assert_eq!(a, b, "{name} does not depend on pad_token_id");
        }
    }
}

/// A loss whose derivatives are all zero (a GRPO batch of zero-variance groups) skips the
/// backward: its zeros have exactly the names and shapes the backward gives, and equal the
/// backward's own output for zero derivatives (forced through it by a zero `dL/dh`), tied
/// and untied, with q/k/v biases and without.
#[test]
fn an_all_zero_loss_gradient_gives_the_backwards_zeros_without_running_it() {
    use tests::tiny::TinySpec;
    for (tied, architecture) in [(true, "LlamaForCausalLM"), (false, "Qwen2ForCausalLM")] {
        let dir = tests::temp_dir(&format!("learner-zero-{tied}"));
        TinySpec { seed: 64, tied, architecture, ..Default::default() }.write(&dir);
        let model = Model::load(&dir, &Device::Cpu).unwrap();
        let (prompt, c1, c2) = (vec![1u32, 2, 3], vec![4u32, 5, 6], vec![7u32, 8]);
        let f = learner::forward_batch(&model, &[(&prompt, &c1), (&prompt, &c2)], 1.0).unwrap();
        let grads = |g: &learner::OutputGrads| -> Vec<(String, Vec<usize>, Vec<f32>)> {
            let mut out = Grads::default();
            f.backward(&model, g, &mut out).unwrap();
            out.tensors.iter().map(|(n, t)| (n.to_string(), t.shape().to_vec(), t.to_vec().unwrap())).collect()
        };
        let (dl, zeros) = (vec![0.5f32, -1.0, 0.25, 2.0, -0.5], vec![0.0f32, -0.0, 0.0, 0.0, -0.0]);
        let full = grads(&learner::OutputGrads::logprobs(&dl));
        let skipped = grads(&learner::OutputGrads::logprobs(&zeros));
        let h = model.config.hidden_size;
        let dh = Tensor::zeros(&[5, h], &Device::Cpu).unwrap();
        let run = grads(&learner::OutputGrads { dl_dhidden: Some(&dh), ..learner::OutputGrads::logprobs(&zeros) });
        let names =
            |g: &[(String, Vec<usize>, Vec<f32>)]| g.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect::<Vec<_>>();
        assert_eq!(names(&skipped), names(&full), "{architecture}: names and shapes");
        let mut shapes = model.weight_shapes();
        shapes.sort();
        let weights: Vec<_> =
            model.named_weights().unwrap().into_iter().map(|(n, t)| (n, t.shape().to_vec())).collect();
        assert_eq!(shapes, weights, "{architecture}: weight_shapes lists named_weights");
        assert!(full.iter().any(|(_, _, v)| v.iter().any(|&x| x != 0.0)));
        assert_eq!(skipped, run, "{architecture}: the backward of zero derivatives is zeros");
        assert!(skipped.iter().all(|(_, _, v)| v.iter().all(|&x| x == 0.0)));
    }
}

/// Prefix sharing: samples with the same prompt share its rows in the packed batch (a GRPO
/// group). ℓ and the entropies equal the per-sample forward bitwise (each row's reductions
/// are unchanged), and the gradients equal the sum of per-sample gradients (the path checked
/// against JAX above) up to summation order, with and without gradient checkpointing.
#[test]
fn shared_prompts_give_the_per_sample_logprobs_and_gradients() {
    let model = Model::load(&tests::fixture("learner/llama_tied"), &Device::Cpu).unwrap();
    let (p1, p2): (Vec<u32>, Vec<u32>) = (vec![54, 40, 32, 7, 9], vec![34, 35]);
    let batch: Vec<(&[u32], Vec<u32>)> =
        vec![(&p1, vec![3, 4, 5]), (&p2, vec![8, 1]), (&p1, vec![6, 6, 2, 11]), (&p1, vec![5]), (&p2, vec![9])];
    let seqs: Vec<(&[u32], &[u32])> = batch.iter().map(|(p, c)| (*p, c.as_slice())).collect();
    let n: usize = batch.iter().map(|(_, c)| c.len()).sum();
    let w: Vec<f32> = (0..n).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.3).collect();
    let u: Vec<f32> = (0..n).map(|i| ((i * 3 % 4) as f32 - 1.5) * 0.1).collect();
    let temp = 0.7;
    // Reference: one sample at a time, gradients summed.
    let (mut want_g, mut want_lp, mut want_h, mut off) = (Grads::default(), vec![], vec![], 0);
    for (p, c) in &seqs {
        let f = learner::forward(&model, p, c, temp).unwrap();
        let g = learner::OutputGrads {
            dl_dentropy: Some(&u[off..off + c.len()]),
            ..learner::OutputGrads::logprobs(&w[off..off + c.len()])
        };
        f.backward(&model, &g, &mut want_g).unwrap();
        want_lp.extend(f.logprobs.clone());
        want_h.extend(f.entropies.clone());
        off += c.len();
    }
    for recompute in [Recompute::default(), Recompute { layers: true, head_rows: Some(4) }] {
        let checkpointing = recompute.layers;
        let f = learner::forward_batch_with(&model, &seqs, temp, recompute).unwrap();
        assert_eq!((&f.logprobs, &f.entropies), (&want_lp, &want_h), "shared prompts change no logprob");
        let mut got = Grads::default();
        let g = learner::OutputGrads { dl_dentropy: Some(&u), ..learner::OutputGrads::logprobs(&w) };
        f.backward(&model, &g, &mut got).unwrap();
        assert_eq!(got.tensors.keys().collect::<Vec<_>>(), want_g.tensors.keys().collect::<Vec<_>>());
        for (name, t) in &got.tensors {
            let (a, b) = (t.to_vec().unwrap(), want_g.tensors[name].to_vec().unwrap());
            let err = a.iter().zip(&b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
            let norm = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
            assert!(
                err <= 1e-5 * norm.max(1e-12),
                "{name} (checkpointing {checkpointing}): relative L2 {:.2e}",
                err / norm
            );
        }
    }
}

/// The default model (SmolLM2) and a tiny Qwen3 (q/k norms): the learner's ℓ of the engine's
/// sampled tokens equals their raw log-probability and μ bitwise (T = 1, no truncation).
#[test]
fn learner_logprobs_equal_engine_logprobs_bitwise() {
    let qwen3 = tests::temp_dir("learner-qwen3");
    tests::tiny::TinySpec { architecture: "Qwen3ForCausalLM", ..Default::default() }.write(&qwen3);
    for dir in [tests::default_model(), qwen3] {
        logprobs_equal(&dir);
    }
}

fn logprobs_equal(dir: &std::path::Path) {
    let model = engine::SharedModel::new(Model::load(dir, &Device::Cpu).unwrap());
    let tok = Arc::new(engine::Tokenizer::from_dir(dir).unwrap());
    let prompt = tok.encode("The three primary colors are", false).unwrap();
    let mut e = LLMEngine::new(model.clone(), tok, EngineConfig::default()).unwrap();
    e.add_request(
        "r",
        prompt.clone(),
        SamplingParams { seed: Some(3), max_tokens: Some(12), ignore_eos: true, ..Default::default() },
    )
    .unwrap();
    let (mut ids, mut raw, mut mu) = (vec![], vec![], vec![]);
    while e.has_unfinished() {
        for o in e.step().unwrap() {
            for t in o.tokens {
                ids.push(t.token_id);
                raw.push(t.raw_logprob);
                mu.push(t.behavior_logprob);
            }
        }
    }
    let f = learner::forward(&model.read(), &prompt, &ids, 1.0).unwrap();
    let max_diff = f.logprobs.iter().zip(&mu).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    eprintln!("{dir:?}: max |ℓ − μ| = {max_diff:e} over {} tokens", ids.len());
    assert_eq!(f.logprobs, raw, "ℓ equals the engine's raw logprob bitwise");
    assert_eq!(max_diff, 0.0, "T = 1, no truncation: ℓ = μ bitwise");
}

#[test]
fn losses_match_jax_autodiff() {
    use learner::algos::grpo::*;
    #[derive(Deserialize)]
    struct Case {
        loss_type: String,
        importance_sampling_level: String,
        beta: f32,
        kl_estimator: String,
        off_policy_correction: String,
        use_prox: bool,
        loss: f64,
        grad: Vec<f64>,
    }
    #[derive(Deserialize)]
    struct F {
        epsilon: f32,
        epsilon_high: f32,
        max_completion_length: usize,
        tis_cap: f32,
        mis_low: f32,
        mis_high: f32,
        logp: Vec<Vec<f32>>,
        prox: Vec<Vec<f32>>,
        behavior: Vec<Vec<f32>>,
        #[serde(rename = "ref")]
        reference: Vec<Vec<f32>>,
        advantages: Vec<f32>,
        cases: Vec<Case>,
    }
    let f: F = serde_json::from_str(&std::fs::read_to_string(tests::fixture("learner/losses.json")).unwrap()).unwrap();
    fn name<T: serde::de::DeserializeOwned>(s: &str) -> T {
        serde_json::from_value(serde_json::json!(s)).unwrap()
    }
    // Every option that ships is in the fixture.
    let covered = |field: fn(&Case) -> &str, all: &[&str]| {
        for want in all {
            assert!(f.cases.iter().any(|c| field(c) == *want), "no fixture case for {want}");
        }
    };
    covered(|c| &c.loss_type, &["grpo", "dapo", "bnpo", "dr_grpo"]);
    covered(|c| &c.kl_estimator, &["k1", "k2", "k3"]);
    covered(|c| &c.off_policy_correction, &["ppo_clip", "tis", "decoupled", "mis"]);
    for c in &f.cases {
        let cfg = learner::TrainConfig {
            loss_type: name(&c.loss_type),
            importance_sampling_level: name(&c.importance_sampling_level),
            epsilon: f.epsilon,
            epsilon_high: f.epsilon_high,
            beta: c.beta,
            kl_estimator: name(&c.kl_estimator),
            off_policy_correction: name(&c.off_policy_correction),
            tis_cap: f.tis_cap,
            mis_low: f.mis_low,
            mis_high: f.mis_high,
            max_completion_length: f.max_completion_length,
            ..Default::default()
        };
        let samples: Vec<SampleLogprobs> = (0..f.logp.len())
            .map(|i| SampleLogprobs {
                logp: &f.logp[i],
                behavior: &f.behavior[i],
                ref_logp: Some(&f.reference[i]),
                prox_logp: c.use_prox.then(|| f.prox[i].as_slice()),
                advantage: f.advantages[i],
                token_advantages: None,
            })
            .collect();
        let (stats, grads) = policy_loss(&samples, &cfg);
        let what = format!(
            "{} / {} / beta {} {} / {} (prox {})",
            c.loss_type, c.importance_sampling_level, c.beta, c.kl_estimator, c.off_policy_correction, c.use_prox
        );
        assert!(
            (stats.loss - c.loss).abs() <= 1e-5 * c.loss.abs().max(1e-3),
            "{what}: loss {} vs JAX {}",
            stats.loss,
            c.loss
        );
        let got: Vec<f32> = grads.concat();
        assert_eq!(got.len(), c.grad.len(), "{what}: one gradient per token");
        for (g, w) in got.iter().zip(&c.grad) {
            assert!((*g as f64 - w).abs() <= 1e-5 * w.abs().max(1e-2), "{what}: dL/dℓ {g} vs JAX {w}");
        }
    }
}

#[test]
fn advantages_by_hand() {
    use learner::algos::advantages::{compute_advantages, ScaleRewards};
    // Group 0: [1, 0] → mean 0.5, unbiased std √0.5; group 1: [1, 1] (zero std); group 2: one sample.
    let a = compute_advantages(&[1.0, 0.0, 1.0, 1.0, 3.0], &[0, 0, 1, 1, 2], ScaleRewards::Group, true);
    let s = 0.5f64.sqrt() + 1e-4;
    assert!((a.advantages[0] as f64 - 0.5 / s).abs() < 1e-6 && (a.advantages[1] as f64 + 0.5 / s).abs() < 1e-6);
    assert_eq!(&a.advantages[2..], &[0.0, 0.0, 0.0]);
    assert!((a.frac_reward_zero_std - 2.0 / 3.0).abs() < 1e-12, "groups 1 and 2 have zero std");
    assert_eq!(a.keep, vec![true, true, false, false, false]);
    let none = compute_advantages(&[2.0, 4.0], &[7, 7], ScaleRewards::None, false);
    assert_eq!(none.advantages, vec![-1.0, 1.0]);
    assert!(a.advantages.iter().all(|x| x.is_finite()));
}

#[test]
fn adamw_step_by_hand() {
    use learner::{optim::AdamW, TrainConfig};
    let t = |v: f32| kernels::Tensor::from_vec(vec![v], &[1]).unwrap();
    let key = ParamKey::Model(engine::model::ParamId::model(engine::model::ParamKind::FinalNorm));
    let mut params = std::collections::BTreeMap::from([(key, t(1.0))]);
    let mut g = Grads::default();
    g.add(key, t(0.5)).unwrap();
    let cfg = TrainConfig { learning_rate: 0.1, weight_decay: 0.1, max_grad_norm: 0.25, ..Default::default() };
    let mut opt = AdamW::default();
    let (norm, lr) = opt.step(&mut params, &g, &cfg).unwrap();
    // Clipped g = 0.25·0.5/(0.5 + 1e-6); m̂ = g, v̂ = g² → step 0.1·g/(g + 1e-8) ≈ 0.1; decay first: 1·(1 − 0.01).
    assert_eq!((norm, lr), (0.5, 0.1));
    let w = params[&key].to_vec().unwrap()[0] as f64;
    let gc = 0.25 * 0.5 / (0.5 + 1e-6);
    assert!((w - (0.99 - 0.1 * gc / (gc + 1e-8))).abs() < 1e-6, "{w}");
    // Second step, no clipping (|g| = 0.1): m = 0.9·m₁ + 0.1·g, v = 0.999·v₁ + 0.001·g², bias-corrected.
    let mut g2 = Grads::default();
    g2.add(key, t(0.1)).unwrap();
    opt.step(&mut params, &g2, &cfg).unwrap();
    let (m, v) = (0.9 * 0.1 * gc + 0.1 * 0.1, 0.999 * 0.001 * gc * gc + 0.001 * 0.01);
    let (mh, vh) = (m / (1.0 - 0.81), v / (1.0 - 0.999f64.powi(2)));
    let want = w * (1.0 - 0.1 * 0.1) - 0.1 * mh / (vh.sqrt() + 1e-8);
    let got = params[&key].to_vec().unwrap()[0] as f64;
    assert!((got - want).abs() < 1e-6, "step 2: {got} vs {want}");
}

#[test]
fn lr_schedules_follow_hugging_face() {
    use learner::{optim::Schedule, TrainConfig};
    // lr at optimizer steps 1..=11 for lr 1, 10 total steps: HF's multiplier at scheduler step 0..=10.
    let check = |kind: Schedule, warmup: u64, want: &[f64]| {
        let c = TrainConfig {
            learning_rate: 1.0,
            lr_scheduler_type: kind,
            warmup_steps: warmup,
            total_steps: Some(10),
            ..Default::default()
        };
        let got: Vec<f64> = (1..=11).map(|s| c.lr_at(s)).collect();
        assert_eq!(got.len(), want.len());
        for (s, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() < 1e-12, "{kind:?} warmup {warmup}, step {}: {g} vs {w}", s + 1);
        }
    };
    let e = |x: f64| x / 8.0;
    // get_linear_schedule_with_warmup: s/2 while s < 2, then (10 − s)/8, reaching 0 at s = 10.
    check(Schedule::Linear, 2, &[0.0, 0.5, 1.0, e(7.0), e(6.0), e(5.0), e(4.0), e(3.0), e(2.0), e(1.0), 0.0]);
    check(Schedule::Linear, 0, &[1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]);
    // constant ignores warmup_steps; constant_with_warmup honours it.
    check(Schedule::Constant, 2, &[1.0; 11]);
    check(Schedule::ConstantWithWarmup, 2, &[0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    // cosine: ½(1 + cos(π s / 10)) → 1 at s = 0, ½ at s = 5, 0 at s = 10.
    let cos: Vec<f64> = (0..=10).map(|s| 0.5 * (1.0 + (std::f64::consts::PI * s as f64 / 10.0).cos())).collect();
    assert!((cos[5] - 0.5).abs() < 1e-12 && cos[10].abs() < 1e-12);
    check(Schedule::Cosine, 0, &cos);
}

#[test]
fn a_tiny_model_learns_a_toy_reward() {
    for architecture in ["LlamaForCausalLM", "Qwen3ForCausalLM"] {
        learns_a_toy_reward(architecture);
    }
}

fn learns_a_toy_reward(architecture: &'static str) {
    use learner::{TrainConfig, TrainSample, Trainer};
    use tests::tiny::TinySpec;
    // Reward 1 when the first completion token is a byte < 128. Start: P ≈ 0.5.
    let dir = tests::temp_dir("learner-toy");
    TinySpec { seed: 61, architecture, ..Default::default() }.write(&dir);
    let tok = Arc::new(engine::Tokenizer::from_dir(&dir).unwrap());
    let model = engine::SharedModel::new(Model::load(&dir, &Device::Cpu).unwrap());
    let prompt = vec![1u32, 2, 3];
    let p_good = |m: &Model| {
        let lp = kernels::ops::log_softmax(&m.forward(&prompt, &mut m.new_cache(8).unwrap(), false).unwrap()).unwrap();
        lp.as_slice().unwrap()[..128].iter().map(|x| x.exp()).sum::<f32>()
    };
    let start = p_good(&model.read());
    let cfg = TrainConfig { learning_rate: 2e-2, ..Default::default() };
    let mut trainer = Trainer::new(&model.read(), cfg).unwrap();
    for step in 0..12u64 {
        let mut e =
            LLMEngine::new(model.clone(), tok.clone(), EngineConfig { num_blocks: Some(64), ..Default::default() })
                .unwrap();
        e.add_request(
            "g",
            prompt.clone(),
            SamplingParams { n: 8, seed: Some(step), max_tokens: Some(2), ignore_eos: true, ..Default::default() },
        )
        .unwrap();
        let mut samples: Vec<TrainSample> = (0..8)
            .map(|_| TrainSample {
                prompt_ids: prompt.clone(),
                completion_ids: vec![],
                behavior_logprobs: vec![],
                advantage: None,
                reward: None,
                group: Some(0),
                versions: None,
                finish_reason: None,
            })
            .collect();
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                for t in o.tokens {
                    samples[o.index].completion_ids.push(t.token_id);
                    samples[o.index].behavior_logprobs.push(t.behavior_logprob);
                }
            }
        }
        drop(e);
        for s in &mut samples {
            s.reward = Some(if s.completion_ids[0] < 128 { 1.0 } else { 0.0 });
        }
        let (metrics, _) = trainer.step(&model, &samples).unwrap();
        assert_eq!((metrics.version, model.version()), (step + 1, step + 1));
        assert!(metrics.loss.loss.is_finite() && metrics.grad_norm.is_finite());
    }
    let end = p_good(&model.read());
    eprintln!("{architecture}: P(first token < 128): {start:.3} → {end:.3}");
    // Learned: the probability of a rewarded first token above 0.9 and that of an
    // unrewarded one down at least tenfold.
    assert!(end > 0.9 && 1.0 - end < (1.0 - start) / 10.0, "{architecture}: P(first token < 128) went {start} → {end}");
}

/// A sample of prompt `[1, 2]` and a two-token `completion` sampled at μ = −5 per token,
/// with `advantage`.
fn two_token_sample(completion: Vec<u32>, advantage: f32) -> learner::TrainSample {
    learner::TrainSample {
        prompt_ids: vec![1, 2],
        completion_ids: completion,
        behavior_logprobs: vec![-5.0, -5.0],
        advantage: Some(advantage),
        reward: None,
        group: None,
        versions: None,
        finish_reason: None,
    }
}

/// The served update (steps laid out like the fused, packed weights in one pass, the tied
/// LM head's step shared with the embedding, applied in place) equals AdamW on the HF
/// tensors bitwise, over two steps (the moments carried), tied and untied, with q/k/v
/// biases and without.
#[test]
fn the_served_update_is_adamw_on_the_hf_tensors() {
    use learner::{optim::AdamW, TrainConfig, Trainer};
    use tests::tiny::TinySpec;
    for (tied, architecture) in [(true, "LlamaForCausalLM"), (false, "Qwen2ForCausalLM")] {
        let what = format!("tied {tied}, {architecture}");
        let dir = tests::temp_dir(&format!("learner-update-{tied}"));
        TinySpec { seed: 63, tied, architecture, ..Default::default() }.write(&dir);
        let model = Model::load(&dir, &Device::Cpu).unwrap();
        let cfg = TrainConfig { learning_rate: 1e-2, weight_decay: 0.1, max_grad_norm: 0.5, ..Default::default() };
        let mut trainer = Trainer::new(&model, cfg.clone()).unwrap();
        let mut params: std::collections::BTreeMap<ParamKey, Tensor> =
            model.named_weights().unwrap().into_iter().map(|(n, t)| (ParamKey::parse(&n).unwrap(), t)).collect();
        let model = engine::SharedModel::new(model);
        let mut reference = AdamW::default();
        for (step, advantage) in [(1, 1.0), (2, -0.5)] {
            let batch = [two_token_sample(vec![3, 4], advantage), two_token_sample(vec![5, 6], advantage)];
            let (_, grads) = trainer.step(&model, &batch).unwrap();
            reference.step(&mut params, &grads, &cfg).unwrap();
            let served = model.read().named_weights().unwrap();
            assert_eq!(served.len(), params.len(), "{what}");
            for (name, v) in &served {
                let p = &params[&ParamKey::parse(name).unwrap()];
                assert_eq!(v.to_vec().unwrap(), p.to_vec().unwrap(), "{what}, step {step}: {name}");
            }
        }
    }
}

/// A gradient that is not finite (one NaN entry, as an overflowing importance ratio times a
/// zero advantage gives) is refused before anything changes: the served weights, their
/// version and the optimizer's step count stay as they were, and the next good gradient
/// trains (`torch.amp.GradScaler` skips such a step the same way).
#[test]
fn a_non_finite_gradient_changes_nothing() {
    use learner::{LearnerError, TrainConfig, Trainer};
    use tests::tiny::TinySpec;
    let dir = tests::temp_dir("learner-non-finite");
    TinySpec { seed: 64, ..Default::default() }.write(&dir);
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let mut trainer = Trainer::new(&model, TrainConfig { learning_rate: 1e-2, ..Default::default() }).unwrap();
    let model = engine::SharedModel::new(model);
    let sample = |advantage: f32| two_token_sample(vec![3, 4], advantage);
    let weights = || -> Vec<(String, Vec<f32>)> {
        model.read().named_weights().unwrap().into_iter().map(|(n, t)| (n, t.to_vec().unwrap())).collect()
    };
    let before = weights();
    let (_, grads) = trainer.gradients(&model.read(), &[sample(1.0)]).unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut poisoned = Grads { tensors: grads.tensors.clone(), backward_seconds: 0.0 };
        let (_, g) = poisoned.tensors.iter_mut().last().unwrap();
        let mut v = g.to_vec().unwrap();
        v[0] = bad;
        *g = Tensor::from_vec(v, g.shape()).unwrap();
        let e = trainer.update(&model, &poisoned).unwrap_err();
        assert!(matches!(e, LearnerError::NonFiniteGradient { .. }), "{e}");
        assert!(e.to_string().contains("no update was applied and the weights are unchanged"), "{e}");
        assert!(weights() == before, "the weights moved");
        assert_eq!((model.version(), trainer.optimizer.step), (0, 0));
    }
    trainer.update(&model, &grads).unwrap();
    assert_eq!((model.version(), trainer.optimizer.step), (1, 1));
    assert!(weights() != before);
    // A sample's non-finite advantage or reward is refused when it is read (`train-step`).
    assert_eq!(sample(f32::NAN).validate(259).unwrap_err(), "`advantage` NaN is not a finite number");
}

#[test]
fn checkpoints_round_trip_and_load_in_the_engine() {
    use learner::{checkpoint, TrainConfig, Trainer};
    use tests::tiny::TinySpec;
    let dir = tests::temp_dir("learner-ckpt-model");
    TinySpec { seed: 62, tied: false, ..Default::default() }.write(&dir);
    // A template in `chat_template.jinja` (transformers ≥ 4.50's way) travels with it.
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages | length }}").unwrap();
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let mut trainer = Trainer::new(&model, TrainConfig { learning_rate: 1e-2, ..Default::default() }).unwrap();
    let batch = vec![two_token_sample(vec![3, 4], 1.0)];
    let initial = model.named_weights().unwrap();
    let model = engine::SharedModel::new(model);
    trainer.step(&model, &batch).unwrap();
    let host = |t: &kernels::Tensor| t.to_vec().unwrap();
    let out = tests::temp_dir("learner-ckpt").join("step-1");
    checkpoint::save(&out, &dir, &model.read(), &trainer.optimizer, serde_json::json!({"position": 7})).unwrap();
    assert!(!out.with_extension("partial").exists());
    let msgs = [engine::ChatMessage::new("user", "hi")];
    let tok = engine::Tokenizer::from_dir(&out).unwrap();
    assert_eq!(tok.apply_chat_template(&msgs, false).unwrap(), "1");
    // The engine loads the checkpoint and sees exactly the trained weights, which moved.
    let loaded = Model::load(&out, &Device::Cpu).unwrap();
    let trained = model.read().named_weights().unwrap();
    let loaded = loaded.named_weights().unwrap();
    assert_eq!(loaded.len(), trained.len());
    for (name, v) in &loaded {
        assert_eq!(host(v), host(&trained[name]), "{name}");
        assert_ne!(host(v), host(&initial[name]), "{name} was updated in place");
    }
    let state = checkpoint::load_state(&out).unwrap();
    assert_eq!(
        (state["step"].as_u64(), state["version"].as_u64(), state["position"].as_u64()),
        (Some(1), Some(1), Some(7))
    );
    let opt = checkpoint::load_optimizer(&out, &Device::Cpu).unwrap();
    assert_eq!(opt.step, 1);
    let moments = |m: &std::collections::BTreeMap<ParamKey, kernels::Tensor>| -> Vec<(ParamKey, Vec<usize>, Vec<f32>)> {
        m.iter().map(|(n, t)| (*n, t.shape().to_vec(), host(t))).collect()
    };
    assert_eq!(moments(&opt.m), moments(&trainer.optimizer.m));
    assert_eq!(moments(&opt.v), moments(&trainer.optimizer.v));
    assert_eq!(opt.m.len(), trained.len(), "a moment per trained tensor");
}

#[test]
fn staleness_truncation_and_overlong_shaping() {
    use learner::{TrainConfig, TrainSample, Trainer};
    use tests::tiny::TinySpec;
    let dir = tests::temp_dir("learner-stale");
    TinySpec { seed: 63, ..Default::default() }.write(&dir);
    let mut model = Model::load(&dir, &Device::Cpu).unwrap();
    let mut cfg = TrainConfig {
        max_staleness: Some(1),
        mask_truncated_completions: true,
        overlong_buffer_len: Some(4),
        ..Default::default()
    };
    cfg.max_completion_length = 10;
    let mut t = Trainer::new(&model, cfg).unwrap();
    // Overlong: L − B = 6; |y| = 8 → (6 − 8)/4 = −0.5; |y| = 12 → −1 (capped); |y| ≤ 6 → 0.
    assert_eq!((t.overlong_penalty(6), t.overlong_penalty(8), t.overlong_penalty(12)), (0.0, -0.5, -1.0));
    model.version = 3;
    let s = |versions: Vec<u64>, finish: &str| TrainSample {
        prompt_ids: vec![1],
        completion_ids: vec![5; versions.len()],
        behavior_logprobs: vec![-5.0; versions.len()],
        advantage: Some(1.0),
        reward: None,
        group: None,
        versions: Some(versions),
        finish_reason: Some(finish.into()),
    };
    let batch = vec![s(vec![2, 3], "stop"), s(vec![1, 3], "stop"), s(vec![3], "length")];
    let (m, _) = t.gradients(&model, &batch).unwrap();
    // Staleness 3 − min(versions): 1, 2, 0 → the second is dropped (> 1), the third is truncated.
    assert_eq!((m.staleness_max, m.num_stale_dropped, m.num_truncated_masked, m.samples), (2, 1, 1, 1));
    assert!((m.staleness_mean - 1.0).abs() < 1e-12);
}
