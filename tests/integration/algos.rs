//! PPO and DPO in the learner: GAE against hand-computed tables, the PPO and DPO losses
//! against JAX autodiff (fixtures from tests/fixtures/make_ppo_reference.py and
//! make_dpo_reference.py), their gradients through a tiny model and a value head, PPO's
//! epochs × mini-batches and the value head in checkpoints, and `rlserve train-step`.

use engine::{Model, SharedModel};
use kernels::Device;
use learner::algos::grpo::{policy_loss, LossType, OffPolicyCorrection, SampleLogprobs};
use learner::algos::{dpo, gae, ppo, value_head};
use learner::{checkpoint, Grads, ParamKey, TrainConfig, TrainSample, Trainer};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use std::path::Path;

fn close(got: f64, want: f64, tol: f64, what: &str) {
    assert!((got - want).abs() <= tol * want.abs().max(1.0), "{what}: {got} vs {want}");
}

fn all_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        close(*g, *w, 1e-9, &format!("{what}[{i}]"));
    }
}

#[test]
fn gae_matches_hand_computed_tables() {
    // rewards [0, 0, 1], values [0.5, 0.2, 0.4], γ = 0.9 (V after the last token = 0):
    // δ = [0 + 0.9·0.2 − 0.5, 0 + 0.9·0.4 − 0.2, 1 − 0.4] = [−0.32, 0.16, 0.6].
    let (r, v) = ([0.0, 0.0, 1.0], [0.5, 0.2, 0.4]);
    // λ = 0: the one-step TD errors.
    all_close(&gae::gae(&r, &v, 0.9, 0.0), &[-0.32, 0.16, 0.6], "lam 0");
    // λ = 1: discounted return − value: G = [0.81, 0.9, 1].
    all_close(&gae::gae(&r, &v, 0.9, 1.0), &[0.81 - 0.5, 0.9 - 0.2, 0.6], "lam 1");
    // λ = 0.5: Â₂ = 0.6, Â₁ = 0.16 + 0.45·0.6 = 0.43, Â₀ = −0.32 + 0.45·0.43 = −0.1265.
    all_close(&gae::gae(&r, &v, 0.9, 0.5), &[-0.1265, 0.43, 0.6], "lam 0.5");
    // γ = 1, λ = 1: undiscounted return − value.
    all_close(&gae::gae(&r, &v, 1.0, 1.0), &[0.5, 0.8, 0.6], "gamma 1 lam 1");
    // A completion of one token: Â = r − V whatever γ and λ.
    for (g, l) in [(1.0, 0.95), (0.5, 0.0), (0.99, 1.0)] {
        all_close(&gae::gae(&[2.0], &[0.5], g, l), &[1.5], "length 1");
    }
    all_close(&gae::returns(&[-0.1265, 0.43, 0.6], &v), &[0.3735, 0.63, 1.0], "returns = Â + V");
    // KL penalty on every token (k1 of π_old against π_ref), the score at the last token.
    let rw = gae::token_rewards(1.0, &[-1.0, -2.0], Some(&[-1.5, -1.0]), 0.1);
    all_close(&rw, &[-0.05, 0.1 + 1.0], "token rewards");
    all_close(&gae::token_rewards(1.0, &[-1.0, -2.0], None, 0.1), &[0.0, 1.0], "no reference");
    // Whitening: unbiased variance ([1, 2, 3]: mean 2, variance 1).
    let mut x = [1.0, 2.0, 3.0];
    gae::whiten(&mut x);
    let s = 1.0 / (1.0f64 + 1e-8).sqrt();
    all_close(&x, &[-s, 0.0, s], "whiten");
    assert_eq!(gae::explained_variance(&[1.0, 2.0, 4.0], &[1.0, 2.0, 4.0]), 1.0);
    close(gae::explained_variance(&[7.0 / 3.0; 3], &[1.0, 2.0, 4.0]), 0.0, 1e-12, "mean prediction");
    assert!(gae::explained_variance(&[0.0, 0.0], &[1.0, 1.0]).is_nan(), "constant returns");
}

#[derive(Deserialize)]
struct PpoCase {
    gamma: f32,
    lam: f32,
    kl_coef: f32,
    off_policy_correction: String,
    beta: f32,
    loss: f64,
    grad_logp: Vec<f64>,
    grad_values: Vec<f64>,
    advantages: Vec<Vec<f64>>,
    returns: Vec<Vec<f64>>,
    value_clipfrac: f64,
}

#[derive(Deserialize)]
struct PpoFixture {
    epsilon: f32,
    tis_cap: f32,
    cliprange_value: f32,
    vf_coef: f32,
    logp: Vec<Vec<f32>>,
    old: Vec<Vec<f32>>,
    behavior: Vec<Vec<f32>>,
    #[serde(rename = "ref")]
    reference: Vec<Vec<f32>>,
    values_old: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    scores: Vec<f32>,
    cases: Vec<PpoCase>,
}

#[test]
fn ppo_losses_match_jax_autodiff() {
    let f: PpoFixture =
        serde_json::from_str(&std::fs::read_to_string(tests::fixture("learner/ppo_losses.json")).unwrap()).unwrap();
    assert!(f.logp.iter().any(|l| l.len() == 1), "a completion of one token is covered");
    for c in &f.cases {
        let what = format!("γ {} λ {} kl_coef {} {} β {}", c.gamma, c.lam, c.kl_coef, c.off_policy_correction, c.beta);
        let cfg = TrainConfig {
            loss_type: LossType::Ppo,
            epsilon: f.epsilon,
            epsilon_high: f.epsilon,
            tis_cap: f.tis_cap,
            cliprange_value: f.cliprange_value,
            vf_coef: f.vf_coef,
            gamma: c.gamma,
            lam: c.lam,
            kl_coef: c.kl_coef,
            beta: c.beta,
            off_policy_correction: serde_json::from_value(serde_json::json!(c.off_policy_correction)).unwrap(),
            ..Default::default()
        };
        let inputs: Vec<ppo::PpoInput> = (0..f.logp.len())
            .map(|i| ppo::PpoInput {
                old_logp: &f.old[i],
                ref_logp: Some(&f.reference[i]),
                values: &f.values_old[i],
                score: f.scores[i],
            })
            .collect();
        let t = ppo::targets(&inputs, &cfg);
        for i in 0..f.logp.len() {
            for (k, (g, w)) in t.advantages[i].iter().zip(&c.advantages[i]).enumerate() {
                close(*g as f64, *w, 1e-5, &format!("{what}: whitened advantage [{i}][{k}]"));
            }
            for (k, (g, w)) in t.returns[i].iter().zip(&c.returns[i]).enumerate() {
                close(*g as f64, *w, 1e-5, &format!("{what}: return [{i}][{k}]"));
            }
        }
        let samples: Vec<SampleLogprobs> = (0..f.logp.len())
            .map(|i| SampleLogprobs {
                logp: &f.logp[i],
                behavior: &f.behavior[i],
                ref_logp: Some(&f.reference[i]),
                prox_logp: Some(&f.old[i]),
                advantage: 0.0,
                token_advantages: Some(&t.advantages[i]),
            })
            .collect();
        let (stats, dl) = policy_loss(&samples, &cfg);
        let (vl, clipfrac, dv) =
            ppo::value_loss(&f.values.concat(), &f.values_old.concat(), &t.returns.concat(), cfg.cliprange_value);
        close(stats.loss + cfg.vf_coef as f64 * vl, c.loss, 1e-5, &format!("{what}: loss"));
        close(clipfrac, c.value_clipfrac, 1e-12, &format!("{what}: value clip fraction"));
        let dl = dl.concat();
        assert_eq!((dl.len(), dv.len()), (c.grad_logp.len(), c.grad_values.len()));
        for (g, w) in dl.iter().zip(&c.grad_logp) {
            assert!((*g as f64 - w).abs() <= 1e-5 * w.abs().max(1e-2), "{what}: dL/dℓ {g} vs JAX {w}");
        }
        for (g, w) in dv.iter().zip(&c.grad_values) {
            let g = *g as f64 * cfg.vf_coef as f64;
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1e-2), "{what}: dL/dV {g} vs JAX {w}");
        }
    }
    assert!(f.cases.iter().any(|c| c.value_clipfrac > 0.0), "the fixture exercises value clipping");
    assert!(f.cases.iter().any(|c| c.lam == 0.0) && f.cases.iter().any(|c| c.lam == 1.0));
}

/// Compares `grads` with a JAX fixture's float64 gradients (relative L2 error per tensor).
fn assert_grads_match(what: &str, grads: &Grads, path: &Path) {
    let bytes = std::fs::read(path).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(want.names().len(), grads.tensors.len(), "{what}: same set of gradient tensors");
    for (name, view) in want.tensors() {
        assert_eq!(view.dtype(), Dtype::F64);
        let w: Vec<f64> = view.data().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
        let key = ParamKey::parse(&name).unwrap_or_else(|| panic!("{what}: {name} is not a parameter name"));
        let g = grads.tensors.get(&key).unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
        assert_eq!(g.shape(), view.shape(), "{what}: {name}");
        let g = g.to_vec().unwrap();
        let err: f64 = g.iter().zip(&w).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt();
        let norm: f64 = w.iter().map(|b| b * b).sum::<f64>().sqrt();
        assert!(norm > 0.0, "{what}: {name}: the fixture's gradient is zero");
        assert!(err <= 1e-4 * norm, "{what}: {name}: relative L2 error {:.2e}", err / norm);
    }
}

#[test]
fn ppo_gradients_through_a_tiny_model_and_value_head_match_jax() {
    #[derive(Deserialize)]
    struct F {
        temperature: f32,
        gamma: f32,
        lam: f32,
        kl_coef: f32,
        epsilon: f32,
        cliprange_value: f32,
        vf_coef: f32,
        loss: f64,
        batch: Vec<TrainSample>,
        returns: Vec<Vec<f64>>,
    }
    let dir = tests::fixture("learner/ppo");
    let f: F = serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let model = Model::load(&tests::fixture("learner/llama_tied"), &Device::Cpu).unwrap();
    let cfg = TrainConfig {
        loss_type: LossType::Ppo,
        temperature: f.temperature,
        gamma: f.gamma,
        lam: f.lam,
        kl_coef: f.kl_coef,
        epsilon: f.epsilon,
        epsilon_high: f.epsilon,
        cliprange_value: f.cliprange_value,
        vf_coef: f.vf_coef,
        value_head_path: Some(dir.join("value_head.safetensors")),
        ..Default::default()
    };
    let mut trainer = Trainer::new(&model, cfg).unwrap();
    let (m, grads) = trainer.gradients(&model, &f.batch).unwrap();
    close(m.loss.loss, f.loss, 1e-5, "loss");
    assert!(m.loss.clip_ratio > 0.0, "some ratios against μ are clipped");
    let ppo = m.ppo.expect("PPO metrics");
    let returns: Vec<f64> = f.returns.concat();
    close(ppo.returns_mean, returns.iter().sum::<f64>() / returns.len() as f64, 1e-5, "returns_mean");
    assert_eq!((ppo.value_clipfrac, ppo.non_score_reward), (0.0, 0.0), "π = π_old = π_ref, V = V_old");
    assert!(
        grads.tensors.contains_key(&value_head::HeadParam::Weight.into())
            && grads.tensors.contains_key(&value_head::HeadParam::Bias.into())
    );
    assert_grads_match("ppo", &grads, &dir.join("grads.safetensors"));
}

#[test]
fn dpo_losses_match_jax_autodiff() {
    #[derive(Deserialize)]
    struct Case {
        loss_type: String,
        beta: f32,
        label_smoothing: f32,
        loss: f64,
        grad: Vec<f64>,
        stats: std::collections::BTreeMap<String, f64>,
    }
    #[derive(Deserialize)]
    struct F {
        logp: Vec<Vec<f32>>,
        #[serde(rename = "ref")]
        reference: Vec<Vec<f32>>,
        pairs: Vec<(usize, usize)>,
        cases: Vec<Case>,
    }
    let f: F =
        serde_json::from_str(&std::fs::read_to_string(tests::fixture("learner/dpo_losses.json")).unwrap()).unwrap();
    let logp: Vec<&[f32]> = f.logp.iter().map(Vec::as_slice).collect();
    let reference: Vec<&[f32]> = f.reference.iter().map(Vec::as_slice).collect();
    for c in &f.cases {
        let what = format!("{} β {} ε {}", c.loss_type, c.beta, c.label_smoothing);
        let cfg = TrainConfig {
            loss_type: serde_json::from_value(serde_json::json!(c.loss_type)).unwrap(),
            beta: c.beta,
            label_smoothing: c.label_smoothing,
            ..Default::default()
        };
        let (loss, st, grads) = dpo::dpo_loss(&logp, &reference, &f.pairs, &cfg);
        close(loss, c.loss, 1e-6, &format!("{what}: loss"));
        let got = serde_json::to_value(&st).unwrap();
        for (k, want) in &c.stats {
            close(got[k].as_f64().unwrap(), *want, 1e-6, &format!("{what}: {k}"));
        }
        assert_eq!(st.pairs, f.pairs.len());
        let g = grads.concat();
        assert_eq!(g.len(), c.grad.len());
        for (g, w) in g.iter().zip(&c.grad) {
            assert!((*g as f64 - w).abs() <= 1e-5 * w.abs().max(1e-3), "{what}: dL/dℓ {g} vs JAX {w}");
        }
    }
    let covered =
        |t: &str, smoothing: bool| f.cases.iter().any(|c| c.loss_type == t && (c.label_smoothing > 0.0) == smoothing);
    assert!(covered("dpo", false) && covered("dpo", true) && covered("ipo", false));
}

#[test]
fn dpo_gradients_through_a_tiny_model_match_jax() {
    #[derive(Deserialize)]
    struct Case {
        name: String,
        loss_type: String,
        beta: f32,
        label_smoothing: f32,
        loss: f64,
    }
    #[derive(Deserialize)]
    struct F {
        temperature: f32,
        batch: Vec<TrainSample>,
        cases: Vec<Case>,
    }
    let dir = tests::fixture("learner/dpo");
    let f: F = serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let model = Model::load(&tests::fixture("learner/llama_tied"), &Device::Cpu).unwrap();
    for c in &f.cases {
        let cfg = TrainConfig {
            loss_type: serde_json::from_value(serde_json::json!(c.loss_type)).unwrap(),
            beta: c.beta,
            label_smoothing: c.label_smoothing,
            temperature: f.temperature,
            ..Default::default()
        };
        let mut trainer = Trainer::new(&model, cfg).unwrap();
        let (m, grads) = trainer.gradients(&model, &f.batch).unwrap();
        close(m.loss.loss, c.loss, 1e-6, &c.name);
        let d = m.dpo.expect("DPO metrics");
        // A pair, and a ranked group of three: 1 + 3 pairs. At the start π = π_ref.
        assert_eq!((d.pairs, d.rewards_margins, d.rewards_accuracies), (4, 0.0, 0.0), "{}", c.name);
        assert_grads_match(&c.name, &grads, &dir.join(format!("grads_{}.safetensors", c.name)));
    }
}

#[test]
fn preference_pairs_come_from_groups_with_different_rewards() {
    let s = |group: Option<u64>, reward: Option<f32>| TrainSample {
        prompt_ids: vec![1],
        completion_ids: vec![2],
        behavior_logprobs: vec![],
        advantage: None,
        reward,
        group,
        versions: None,
        finish_reason: None,
    };
    let batch = [
        s(Some(0), Some(0.0)),
        s(Some(0), Some(1.0)),
        s(Some(1), Some(1.0)),
        s(Some(1), Some(1.0)), // a tie: no pair
        s(Some(2), Some(0.5)),
        s(Some(2), Some(1.0)),
        s(Some(2), Some(-1.0)),
        s(None, Some(1.0)), // no group: no pair
        s(Some(3), None),
    ];
    let refs: Vec<&TrainSample> = batch.iter().collect();
    assert_eq!(dpo::pairs(&refs), vec![(1, 0), (5, 4), (4, 6), (5, 6)]);
}

/// A tiny model, and `n` samples after the prompt [1, 2, 3] with rewards by their first token.
fn tiny_batch(name: &str, n: usize) -> (std::path::PathBuf, Vec<TrainSample>) {
    let dir = tests::temp_dir(name);
    tests::tiny::TinySpec { seed: 91, ..Default::default() }.write(&dir);
    let batch = (0..n)
        .map(|i| TrainSample {
            prompt_ids: vec![1, 2, 3],
            completion_ids: vec![10 + i as u32 * 40, 7],
            behavior_logprobs: vec![-5.5, -5.4],
            advantage: None,
            reward: Some((i % 2) as f32),
            group: None,
            versions: Some(vec![0, 0]),
            finish_reason: Some("stop".into()),
        })
        .collect();
    (dir, batch)
}

#[test]
fn a_ppo_step_takes_epochs_times_mini_batches_updates_and_checkpoints_its_value_head() {
    let (dir, batch) = tiny_batch("algos-ppo-step", 4);
    let model = SharedModel::new(Model::load(&dir, &Device::Cpu).unwrap());
    let cfg = TrainConfig {
        loss_type: LossType::Ppo,
        num_ppo_epochs: 3,
        num_mini_batches: 2,
        learning_rate: 1e-2,
        off_policy_correction: OffPolicyCorrection::Tis,
        ..Default::default()
    };
    let mut trainer = Trainer::new(&model.read(), cfg).unwrap();
    let head0 = trainer.value_head.as_ref().unwrap().weight.to_vec().unwrap();
    assert!(head0.iter().all(|&w| w == 0.0), "the value head starts at zero");
    let (m, grads) = trainer.step(&model, &batch).unwrap();
    assert_eq!((m.num_updates, m.version, m.step, model.version()), (6, 6, 6, 6));
    assert!(grads.tensors.contains_key(&value_head::HeadParam::Weight.into()));
    let ppo = m.ppo.as_ref().unwrap();
    assert!(ppo.value_loss > 0.0 && ppo.returns_mean.is_finite() && m.loss.loss.is_finite(), "{m:?}");
    let head = trainer.value_head.as_ref().unwrap();
    assert_ne!(head.weight.to_vec().unwrap(), head0, "the value head was trained");
    // A second batch: the value head predicts the rewards better than zeros did.
    let (m2, _) = trainer.step(&model, &batch).unwrap();
    assert_eq!(m2.version, 12);
    assert!(
        m2.ppo.as_ref().unwrap().value_loss < ppo.value_loss,
        "{} → {}",
        ppo.value_loss,
        m2.ppo.unwrap().value_loss
    );
    // The checkpoint holds the head (not in the served model) and its AdamW moments.
    let out = tests::temp_dir("algos-ppo-ckpt").join("c");
    checkpoint::save_trainer(&out, &dir, &model.read(), &trainer, serde_json::json!({})).unwrap();
    let loaded = checkpoint::load_value_head(&out, 32, &Device::Cpu).unwrap().expect("value_head.safetensors");
    let head = trainer.value_head.as_ref().unwrap();
    assert_eq!(loaded.weight.to_vec().unwrap(), head.weight.to_vec().unwrap());
    assert_eq!(loaded.bias.to_vec().unwrap(), head.bias.to_vec().unwrap());
    let served = Model::load(&out, &Device::Cpu).unwrap().named_weights().unwrap();
    assert!(!served.contains_key(value_head::WEIGHT), "the value head is not part of the served model");
    let opt = checkpoint::load_optimizer(&out, &Device::Cpu).unwrap();
    assert!(
        opt.m.contains_key(&value_head::HeadParam::Weight.into())
            && opt.v.contains_key(&value_head::HeadParam::Bias.into())
    );
    // A trainer started from the checkpoint's head.
    let cfg = TrainConfig { loss_type: LossType::Ppo, value_head_path: Some(out.clone()), ..Default::default() };
    let again = Trainer::new(&model.read(), cfg).unwrap();
    assert_eq!(again.value_head.unwrap().weight.to_vec().unwrap(), head.weight.to_vec().unwrap());
}

#[test]
fn bad_ppo_and_dpo_settings_and_batches_are_refused() {
    let (dir, batch) = tiny_batch("algos-bad", 2);
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let err = |cfg: TrainConfig| Trainer::new(&model, cfg).err().expect("refused").to_string();
    let ppo = TrainConfig { loss_type: LossType::Ppo, ..Default::default() };
    assert!(err(TrainConfig { num_ppo_epochs: 0, ..ppo.clone() }).contains("`num_ppo_epochs` must be >= 1, got 0"));
    assert!(err(TrainConfig { lam: 1.5, ..ppo.clone() }).contains("`lam` must be in [0, 1], got 1.5"));
    let dpo = TrainConfig { loss_type: LossType::Dpo, ..Default::default() };
    assert!(err(dpo.clone()).contains("`beta` (DPO's β) must be > 0"), "{}", err(dpo.clone()));
    assert!(err(TrainConfig { beta: 0.1, label_smoothing: 0.5, ..dpo.clone() }).contains("`label_smoothing`"));
    let missing = TrainConfig { value_head_path: Some("/nonexistent".into()), ..ppo.clone() };
    assert!(err(missing).contains("/nonexistent"));
    // PPO needs a reward on every sample; DPO needs pairs; the policy losses need μ.
    let mut t = Trainer::new(&model, ppo).unwrap();
    let no_reward = vec![TrainSample { reward: None, advantage: Some(1.0), ..batch[0].clone() }];
    assert!(t.gradients(&model, &no_reward).unwrap_err().to_string().contains("needs a `reward`"));
    let mut t = Trainer::new(&model, TrainConfig { beta: 0.1, ..dpo }).unwrap();
    assert!(t.gradients(&model, &batch).unwrap_err().to_string().contains("no preference pair"));
    let mut t = Trainer::new(&model, TrainConfig::default()).unwrap();
    let no_mu = vec![TrainSample { behavior_logprobs: vec![], group: Some(0), ..batch[0].clone() }];
    assert!(t.gradients(&model, &no_mu).unwrap_err().to_string().contains("`behavior_logprobs` has 0 values"));
    // `sigmoid` is TRL's name of the DPO loss.
    let c: TrainConfig = toml_like(r#"{"loss_type": "sigmoid", "beta": 0.1}"#);
    assert_eq!(c.loss_type, LossType::Dpo);
}

fn toml_like(json: &str) -> TrainConfig {
    serde_json::from_str(json).unwrap()
}

#[test]
fn train_step_runs_ppo_and_dpo_from_a_config_file() {
    let (dir, batch) = tiny_batch("algos-train-step", 4);
    let bin = tests::rlserve_binary();
    let work = tests::temp_dir("algos-train-step-work");
    let lines = |b: &[TrainSample]| b.iter().map(|s| serde_json::to_string(s).unwrap() + "\n").collect::<String>();
    std::fs::write(work.join("ppo.jsonl"), lines(&batch)).unwrap();
    std::fs::write(
        work.join("ppo.toml"),
        "loss_type = \"ppo\"\nnum_ppo_epochs = 2\nnum_mini_batches = 2\ngamma = 0.99\nlam = 0.9\nvf_coef = 0.2\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&bin)
            .arg("train-step")
            .arg("--model")
            .arg(&dir)
            .args(args)
            .current_dir(&work)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let m = run(&["--batch", "ppo.jsonl", "--config", "ppo.toml", "--dump-grads", "g.safetensors", "--save", "ckpt"]);
    assert_eq!((&m["num_updates"], &m["version"]), (&serde_json::json!(4), &serde_json::json!(4)), "{m}");
    for k in ["value_loss", "value_clipfrac", "explained_variance", "returns_mean", "non_score_reward"] {
        assert!(m.get(k).is_some(), "{k} missing from {m}");
    }
    let grads = std::fs::read(work.join("g.safetensors")).unwrap();
    assert!(SafeTensors::deserialize(&grads).unwrap().names().iter().any(|n| *n == value_head::WEIGHT));
    assert!(work.join("ckpt").join(value_head::FILE).exists());
    // DPO: a pair is two lines of one group; μ may be left out.
    let pair: String = [(vec![65u32, 66], 1.0), (vec![200, 201], 0.0)]
        .iter()
        .map(|(c, r)| {
            serde_json::json!({"prompt_ids": [1, 2, 3], "completion_ids": c, "reward": r, "group": 0}).to_string()
                + "\n"
        })
        .collect();
    std::fs::write(work.join("dpo.jsonl"), pair).unwrap();
    std::fs::write(work.join("dpo.toml"), "loss_type = \"dpo\"\nbeta = 0.1\n").unwrap();
    let m = run(&["--batch", "dpo.jsonl", "--config", "dpo.toml"]);
    assert_eq!((&m["pairs"], &m["version"]), (&serde_json::json!(1), &serde_json::json!(1)), "{m}");
    assert!((m["loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-6, "log 2 at π = π_ref: {m}");
}
