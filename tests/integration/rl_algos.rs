//! PPO and DPO in online RL on the tiny model: a PPO job learns the toy reward with a value
//! head; a DPO job on a JSONL of token-id pairs learns a preference that holds on held-out
//! pairs; a `chosen`/`rejected` rating trains the served model with DPO.

use super::rl::{
    context, feedback_args, feedback_checkpoint_written, post, run_job_in, served_version_reaches, start_server, tiny,
};
use engine::Model;
use kernels::Device;
use learner::TrainSample;
use rl::{Job, JobConfig, JobState};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// Height in pixels of a PNG (its IHDR chunk).
fn png_height(png: &[u8]) -> u32 {
    assert!(png.starts_with(b"\x89PNG"));
    u32::from_be_bytes(png[20..24].try_into().unwrap())
}

#[test]
fn a_ppo_job_learns_the_toy_reward_with_a_value_head() {
    let dir = tiny("rl-ppo", 71);
    let learner = "loss_type = \"ppo\"\nnum_ppo_epochs = 2\nnum_mini_batches = 2";
    let (job, start, end, _) = run_job_in(&dir, "max_steps = 12", learner);
    let st = job.status();
    assert_eq!((st.status, st.error.as_deref(), st.step), (JobState::Completed, None, 12));
    assert_eq!(st.version, 48, "2 epochs × 2 mini-batches: 4 versions per step");
    eprintln!("PPO: P(ASCII first byte) {start:.3} → {end:.3}");
    assert!(end > 0.9 && end > start + 0.3, "P(ASCII first byte) went {start} → {end}");
    let first = st.history.first().unwrap();
    let last = st.history.last().unwrap();
    for r in &st.history {
        let ppo = r.learner.ppo.as_ref().expect("PPO metrics every step");
        assert!(ppo.value_loss.is_finite() && r.learner.num_updates == 4 && r.learner.staleness_max == 0);
    }
    let (v0, v1) = (first.learner.ppo.as_ref().unwrap().values_mean, last.learner.ppo.as_ref().unwrap().values_mean);
    eprintln!("PPO: reward {:.3} → {:.3}, values_mean {v0:.3} → {v1:.3}", first.reward, last.reward);
    assert_eq!(v0, 0.0, "the value head starts at zero");
    assert!(v1 > 0.3, "the value head learned to predict the (now mostly 1) reward: {v1}");
    // The schedule's length is max_steps × updates per step; the log and plot carry PPO's panels.
    assert_eq!(
        JobConfig::from_toml(&format!("max_steps = 12\n[learner]\n{learner}")).unwrap().train_config().total_steps,
        Some(48)
    );
    let log = std::fs::read_to_string(st.output_dir.join("metrics.jsonl")).unwrap();
    assert!(log.lines().filter(|l| l.contains("\"kind\":\"train\"")).all(|l| l.contains("\"explained_variance\"")));
    assert_eq!(png_height(&std::fs::read(st.output_dir.join("metrics.png")).unwrap()), rl::plot::height(7));
    assert!(st.output_dir.join("checkpoint-12").join(learner::algos::value_head::FILE).exists());
}

/// A pair line: the prompt and completions as token ids.
fn pair_line(prompt: &[u32], chosen: &[u32], rejected: &[u32]) -> String {
    json!({"prompt": prompt, "chosen": chosen, "rejected": rejected}).to_string() + "\n"
}

/// Pairs whose chosen completion is made of tokens 65..71 and rejected of 200..206, after
/// random prompts: `n` lines from `seed`.
fn toy_pairs(n: usize, seed: u64) -> String {
    let mut s = seed;
    let mut next = |m: u64| {
        s = engine::sampling::splitmix64(s);
        s % m
    };
    (0..n)
        .map(|_| {
            let prompt: Vec<u32> = (0..3 + next(4)).map(|_| next(256) as u32).collect();
            let (a, b) = (next(3) as u32 * 2, next(3) as u32 * 2);
            pair_line(&prompt, &[65 + a, 66 + a], &[200 + b, 201 + b])
        })
        .collect()
}

#[test]
fn a_dpo_job_learns_a_preference_that_holds_on_held_out_pairs() {
    let dir = tiny("rl-dpo", 83);
    std::fs::write(dir.join("pairs.jsonl"), toy_pairs(24, 1)).unwrap();
    std::fs::write(dir.join("held_out.jsonl"), toy_pairs(12, 2)).unwrap();
    let (ctx, _rt) = context(&dir);
    let cfg = JobConfig::from_toml(&format!(
        r#"
        dataset = "{d}/pairs.jsonl"
        eval_dataset = "{d}/held_out.jsonl"
        prompts_per_step = 4
        max_steps = 12
        output_dir = "{d}/run"
        [learner]
        loss_type = "dpo"
        beta = 0.1
        learning_rate = 1e-2
        "#,
        d = dir.display()
    ))
    .unwrap();
    let job = Job::start("dpo".into(), cfg, ctx, false).unwrap();
    job.wait();
    let st = job.status();
    assert_eq!((st.status, st.error.as_deref(), st.step, st.version), (JobState::Completed, None, 12, 12));
    let (before, after) = (&st.evals[0], st.evals.last().unwrap());
    let (b, a) = (before.preferences.as_ref().unwrap(), after.preferences.as_ref().unwrap());
    eprintln!(
        "DPO held-out: rewards/accuracies {:.2} → {:.2}, margins {:.3} → {:.3}, logps/accuracies {:.2} → {:.2}, loss {:.3} → {:.3}",
        b.stats.rewards_accuracies,
        a.stats.rewards_accuracies,
        b.stats.rewards_margins,
        a.stats.rewards_margins,
        b.stats.logps_accuracies,
        a.stats.logps_accuracies,
        b.loss,
        a.loss
    );
    // Before the first step π = π_ref: every implicit reward is 0 and the loss is log 2.
    assert_eq!((before.step, b.stats.pairs, b.stats.rewards_margins, b.stats.rewards_accuracies), (0, 12, 0.0, 0.0));
    assert!((b.loss - std::f64::consts::LN_2).abs() < 1e-9);
    assert_eq!((after.step, after.eval_accuracy), (12, Some(a.stats.rewards_accuracies)));
    assert!(a.stats.rewards_accuracies >= 0.9 && a.stats.rewards_margins > 0.0 && a.loss < b.loss);
    assert!(
        a.stats.logps_accuracies > b.stats.logps_accuracies,
        "the policy itself now prefers the chosen completions"
    );
    for r in &st.history {
        let d = r.learner.dpo.as_ref().expect("DPO metrics every step");
        assert_eq!((d.pairs, r.learner.samples, r.reward), (4, 8, d.rewards_margins));
    }
    assert_eq!(png_height(&std::fs::read(st.output_dir.join("metrics.png")).unwrap()), rl::plot::height(7));
    // A dataset without pairs is refused for DPO, naming the example.
    let (ctx, _rt2) = context(&dir);
    std::fs::write(dir.join("prompts.jsonl"), "{\"prompt\": [1, 2]}\n").unwrap();
    let bad = JobConfig::from_json(json!({
        "dataset": dir.join("prompts.jsonl"), "output_dir": dir.join("bad"),
        "learner": {"loss_type": "dpo", "beta": 0.1}}))
    .unwrap();
    let err = Job::start("bad".into(), bad, ctx, false).err().unwrap().to_string();
    assert!(err.contains("example 1 has no `chosen` and `rejected`"), "{err}");
    let err = JobConfig::from_json(json!({"learner": {"loss_type": "dpo"}})).unwrap_err().to_string();
    assert!(err.contains("`learner.beta` (DPO's β) must be > 0"), "{err}");
}

/// ℓ summed over a sample's completion under the model in `dir`.
fn logprob(dir: &Path, s: &TrainSample) -> f64 {
    let m = Model::load(dir, &Device::Cpu).unwrap();
    learner::forward(&m, &s.prompt_ids, &s.completion_ids, 1.0).unwrap().logprobs.iter().map(|&x| x as f64).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chosen_rejected_rating_trains_the_served_model_with_dpo() {
    let dir = tiny("rl-feedback-dpo", 84);
    let log = tests::temp_dir("rl-feedback-dpo-log");
    let learner_cfg = log.join("learner.toml");
    std::fs::write(&learner_cfg, "loss_type = \"dpo\"\nbeta = 0.1\n").unwrap();
    let mut args = feedback_args(&log, 16);
    args.feedback.feedback_batch_size = 2;
    args.feedback.feedback_save_steps = 1;
    args.feedback.learning_rate = Some(1e-2);
    args.feedback.learner_config = Some(learner_cfg);
    let (s, base) = start_server(dir.clone(), args).await;
    let body = json!({"prompt": "ab", "max_tokens": 3, "n": 2, "seed": 4, "return_token_ids": true});
    let (_, a) = post(&base, "/v1/completions", body.clone()).await;
    let (_, one) = post(&base, "/v1/completions", json!({"prompt": "ab", "max_tokens": 3})).await;
    let id = a["id"].clone();
    let cases: Vec<(Value, u16, &str)> = vec![
        (json!({"id": id, "chosen": 0, "rejected": 0}), 400, "two different choices"),
        (json!({"id": id, "chosen": 0, "rejected": 5}), 400, "`rejected` 5 is out of range"),
        (json!({"id": id, "chosen": 1}), 400, "`chosen` and `rejected`"),
        (json!({"id": id, "chosen": 1, "rejected": 0, "reward": 1.0}), 400, "give one of"),
        (
            json!({"id": one["id"], "chosen": 1, "rejected": 0}),
            400,
            "`chosen` 1 is out of range: the response has 1 choice",
        ),
        (
            json!({"id": one["id"], "preferred": 0}),
            400,
            "has one choice: `preferred` picks one of several answers; rate this one with `choice` and `reward`",
        ),
        (
            json!({"id": one["id"], "choice": 0, "reward": 1.0}),
            400,
            "has one choice; the feedback learner's loss_type \"dpo\" trains on preference pairs",
        ),
    ];
    for (b, status, needle) in &cases {
        let (st, out) = post(&base, "/v1/feedback", b.clone()).await;
        let msg = out["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(st, *status, "{b}: {out}");
        assert!(msg.contains(needle), "{b}: {msg:?} lacks {needle:?}");
    }
    // Listed with the jobs, the feedback learner is not one: no stop, no plot.
    let (st, out) = post(&base, "/v1/train/jobs/feedback/stop", json!({})).await;
    let msg = out["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(st, 400, "{out}");
    assert!(msg.contains("`feedback` is the feedback learner, not a training job; it cannot be stopped"), "{msg}");
    let (st, out) = post(&base, "/v1/feedback", json!({"id": id, "chosen": 1, "rejected": 0})).await;
    assert_eq!((st, &out["samples_ready"]), (200, &json!(2)), "{out}");
    let (st, out) = post(&base, "/v1/feedback", json!({"id": id, "choice": 0, "reward": 1.0})).await;
    assert_eq!(st, 409, "a preference rates the whole response: {out}");
    let version = served_version_reaches(&base, &body, 1).await;
    assert_eq!(version, 1, "the DPO feedback learner did not update the served weights");
    feedback_checkpoint_written(&log).await;
    s.shutdown(Duration::from_secs(5)).await;
    // The durable log holds the pair; the trained weights prefer the chosen choice more.
    let text = std::fs::read_to_string(log.join("feedback.jsonl")).unwrap();
    let line: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!((&line["pair"], &line["ratings"]), (&json!(true), &json!([[1, 1.0], [0, 0.0]])));
    let choices: Vec<TrainSample> = serde_json::from_value(line["choices"].clone()).unwrap();
    let trained = log.join("checkpoint");
    let before = logprob(&dir, &choices[1]) - logprob(&dir, &choices[0]);
    let after = logprob(&trained, &choices[1]) - logprob(&trained, &choices[0]);
    eprintln!("log π(chosen) − log π(rejected): {before:.4} → {after:.4}");
    assert!(after > before + 0.01, "{before} → {after}");
}

#[test]
fn the_ppo_and_dpo_example_configs_parse_and_the_pairs_load() {
    let root = tests::workspace_root();
    let read = |name: &str| JobConfig::from_toml(&std::fs::read_to_string(root.join(name)).unwrap()).unwrap();
    let ppo = read("examples/ppo.toml");
    assert_eq!((ppo.learner.loss_type, ppo.learner.updates_per_batch()), (learner::algos::grpo::LossType::Ppo, 4));
    assert_eq!(ppo.train_config().total_steps, Some(ppo.max_steps * 4));
    let dpo = read("examples/dpo.toml");
    assert_eq!((dpo.learner.loss_type, dpo.learner.beta), (learner::algos::grpo::LossType::Dpo, 0.1));
    let dir = tiny("rl-dpo-example", 85);
    let tok = engine::Tokenizer::from_dir(&dir).unwrap();
    for (spec, n) in [(&dpo.dataset, 160), (dpo.eval_dataset.as_ref().unwrap(), 40)] {
        let ex = rl::dataset::load("dataset", root.join(spec).to_str().unwrap(), &tok, templated()).unwrap();
        assert_eq!(ex.len(), n);
        let pair = ex[0].pair.as_ref().expect("a preference pair");
        // Text completions end with the EOS token, as TRL's.
        assert_eq!(pair.chosen.last(), tok.eos_token_ids.first());
        assert_ne!(pair.chosen, pair.rejected);
    }
}

/// The dataset templating of a job with the default keys (`apply_chat_template = true`).
fn templated() -> rl::dataset::Templating<'static> {
    rl::dataset::Templating { apply_chat_template: true, ..Default::default() }
}
