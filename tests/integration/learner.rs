//! The learner's forward and backward against JAX autodiff (float64) on tiny models
//! (fixtures from tests/fixtures/make_learner_reference.py), and ℓ = the engine's logprob.

use engine::learner::{self, Grads};
use engine::{EngineConfig, LLMEngine, Model, SamplingParams};
use kernels::Device;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use std::sync::Arc;

#[derive(Deserialize)]
struct Seq {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    weights: Vec<f32>,
    logprobs: Vec<f64>,
}

#[derive(Deserialize)]
struct Batch {
    temperature: f32,
    loss: f64,
    batch: Vec<Seq>,
}

/// Runs forward + backward of `L = Σ w·ℓ` on fixture `name` and compares with JAX.
fn check(name: &str) {
    let dir = tests::fixture(&format!("learner/{name}"));
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let b: Batch = serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let mut grads = Grads::default();
    let mut loss = 0.0f64;
    for s in &b.batch {
        let f = learner::forward(&model, &s.prompt, &s.completion, b.temperature).unwrap();
        for (got, want) in f.logprobs.iter().zip(&s.logprobs) {
            assert!((*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{name}: ℓ {got} vs JAX {want}");
        }
        loss += f.logprobs.iter().zip(&s.weights).map(|(l, w)| (*l as f64) * (*w as f64)).sum::<f64>();
        f.backward(&model, &s.weights, &mut grads).unwrap();
    }
    assert!((loss - b.loss).abs() <= 1e-5 * b.loss.abs(), "{name}: loss {loss} vs JAX {}", b.loss);
    let bytes = std::fs::read(dir.join("grads.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(want.names().len(), grads.tensors.len(), "{name}: same set of gradient tensors");
    for (tname, view) in want.tensors() {
        assert_eq!(view.dtype(), Dtype::F64);
        let w: Vec<f64> = view.data().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
        let (shape, g) = grads.tensors.get(&tname).unwrap_or_else(|| panic!("{name}: no gradient for {tname}"));
        assert_eq!(shape, view.shape(), "{tname}");
        let err: f64 = g.iter().zip(&w).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt();
        let norm: f64 = w.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(err <= 1e-4 * norm.max(1e-12), "{name}: {tname}: relative L2 error {:.2e}", err / norm);
    }
}

#[test]
fn gradients_match_jax_autodiff() {
    check("llama_tied");
    check("llama_untied");
    check("qwen2_bias");
}

#[test]
fn learner_logprobs_equal_engine_logprobs_bitwise() {
    let dir = tests::default_model();
    let model = Arc::new(Model::load(&dir, &Device::Cpu).unwrap());
    let tok = Arc::new(engine::Tokenizer::from_dir(&dir).unwrap());
    let prompt = tok.encode("The three primary colors are", false).unwrap();
    let mut e = LLMEngine::new(model.clone(), tok, EngineConfig::default());
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
    let f = learner::forward(&model, &prompt, &ids, 1.0).unwrap();
    let max_diff = f.logprobs.iter().zip(&mu).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    eprintln!("max |ℓ − μ| = {max_diff:e} over {} tokens", ids.len());
    assert_eq!(f.logprobs, raw, "ℓ equals the engine's raw logprob bitwise");
    assert_eq!(max_diff, 0.0, "T = 1, no truncation: ℓ = μ bitwise");
}
