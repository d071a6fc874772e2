//! Online RL on the tiny model: training jobs with max_staleness 0 and 2 learn a toy reward
//! within bounds on staleness, ℓ = μ at sampling, rollouts, feedback durability across a
//! restart, job configs (TOML = JSON, unknown keys, `[learner]` defaults), and a 4xx for
//! each malformed rollout, feedback or job request.

use engine::{EngineConfig, EngineHandle, LLMEngine, Model, SharedModel, Tokenizer};
use kernels::Device;
use rl::{job_learner_defaults, Job, JobConfig, JobState, LearnerSlot, RlContext, RlMetrics};
use serde_json::{json, Value};
use server::serve::{build_state, ServeArgs, Server};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tests::tiny::TinySpec;
use tests::{eventually, get_json, temp_dir};

pub(crate) fn tiny(name: &str, seed: u64) -> PathBuf {
    let dir = temp_dir(name);
    TinySpec { seed, ..Default::default() }.write(&dir);
    dir
}

/// P(first completion byte is ASCII) after the prompt "abc", from the model's logits.
fn p_ascii(model: &Model, tok: &Tokenizer) -> f32 {
    let ids = tok.encode("abc", false).unwrap();
    let lp = kernels::ops::log_softmax(&model.forward(&ids, &mut model.new_cache(16).unwrap(), false).unwrap())
        .unwrap()
        .to_vec()
        .unwrap();
    (0..lp.len() as u32)
        .filter(|&t| tok.decode(&[t], false).is_ok_and(|s| s.len() == 1 && s.is_ascii()))
        .map(|t| lp[t as usize].exp())
        .sum()
}

/// Runs a job on the tiny model: reward 1 when the completion starts with an ASCII character.
/// [`job_steps`] steps, the generator running ahead as `generate_ahead` says.
fn run_job(name: &str, max_staleness: u64, generate_ahead: &str) -> (Arc<Job>, f32, f32) {
    let dir = tiny(name, 71);
    // Overlapping from the first step (no on-policy warm start): the async path under test.
    let steps = format!("max_steps = {}\ngenerate_ahead = \"{generate_ahead}\"", job_steps(max_staleness));
    let learner = format!("max_staleness = {max_staleness}\non_policy_warmup_steps = 0");
    let (job, start, end, _) = run_job_in(&dir, &steps, &learner);
    (job, start, end)
}

/// Steps of [`run_job`]: 12, plus 2 per step of staleness. A batch trained `k` versions after
/// the weights that sampled it carries no feedback from the last `k` updates, and which
/// version samples which token depends on how the generator and the learner interleave
/// (the machine's load): at `max_staleness = 2` and 12 steps the final P(ASCII) ranged
/// 0.89–0.95 across runs of the full suite, so the async job gets the steps its lag costs.
fn job_steps(max_staleness: u64) -> u64 {
    12 + 2 * max_staleness
}

/// HF-named weights: name → (shape, values).
type Weights = std::collections::BTreeMap<String, Vec<f32>>;

/// The RL context of the tiny model in `dir` (engine thread started), and the runtime its
/// handle belongs to (keep it alive while the context is used).
pub(crate) fn context(dir: &Path) -> (RlContext, tokio::runtime::Runtime) {
    context_on(dir, &Device::Cpu)
}

/// [`context`] with the model on `device`.
fn context_on(dir: &Path, device: &Device) -> (RlContext, tokio::runtime::Runtime) {
    let tok = Arc::new(Tokenizer::from_dir(dir).unwrap());
    let model = SharedModel::new(Model::load(dir, device).unwrap());
    let engine =
        LLMEngine::new(model.clone(), tok.clone(), EngineConfig { num_blocks: Some(64), ..Default::default() })
            .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ctx = RlContext {
        engine: EngineHandle::spawn(engine),
        model,
        tokenizer: tok,
        model_dir: dir.to_path_buf(),
        runtime: rt.handle().clone(),
        metrics: RlMetrics::new("tiny"),
        learner: LearnerSlot::default(),
        max_model_len: 128,
        version_record: None,
    };
    (ctx, rt)
}

/// A job on the tiny model in `dir` with extra TOML lines at the top level and in
/// `[learner]`; also returns the final weights.
pub(crate) fn run_job_in(dir: &Path, extra: &str, learner_extra: &str) -> (Arc<Job>, f32, f32, Weights) {
    run_job_on(dir, &Device::Cpu, extra, learner_extra)
}

/// [`run_job_in`] with the model on `device`.
fn run_job_on(dir: &Path, device: &Device, extra: &str, learner_extra: &str) -> (Arc<Job>, f32, f32, Weights) {
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let (ctx, _rt) = context_on(dir, device);
    let (model, tok) = (ctx.model.clone(), ctx.tokenizer.clone());
    let start = p_ascii(&model.read(), &tok);
    let cfg = JobConfig::from_toml(&format!(
        r#"
        dataset = "{}"
        apply_chat_template = false
        num_generations = 8
        prompts_per_step = 1
        {extra}
        output_dir = "{}"
        rewards = [{{ type = "regex", pattern = '^[\x00-\x7F]' }}]
        [learner]
        max_completion_length = 2
        learning_rate = 2e-2
        {learner_extra}
        "#,
        data.display(),
        dir.join("run").display()
    ))
    .unwrap();
    let job = Job::start("job".into(), cfg, ctx, false).unwrap();
    job.wait();
    let end = p_ascii(&model.read(), &tok);
    let weights = model.read().named_weights().unwrap().into_iter().map(|(n, t)| (n, t.to_vec().unwrap())).collect();
    (job, start, end, weights)
}

fn check_job(job: &Job, k: u64, start: f32, end: f32) {
    let st = job.status();
    let steps = job_steps(k);
    assert_eq!((st.status, st.error.as_deref(), st.step, st.version), (JobState::Completed, None, steps, steps));
    eprintln!("max_staleness {k}: P(ASCII first byte) {start:.3} → {end:.3}");
    assert!(end > 0.9 && end > start + 0.3, "P(ASCII first byte) went {start} → {end}");
    for r in &st.history {
        assert!(r.learner.staleness_max <= k, "step {}: staleness {} > {k}", r.step, r.learner.staleness_max);
        assert_eq!(r.learner.num_stale_dropped, 0, "nothing is generated and then thrown away");
        assert!(r.learner.pause_seconds > 0.0 && r.learner.loss.loss.is_finite());
    }
    // The job's outputs: the JSONL log, the plot, and the final checkpoint.
    let log = std::fs::read_to_string(st.output_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(log.lines().filter(|l| l.contains("\"kind\":\"train\"")).count() as u64, steps);
    assert!(std::fs::read(st.output_dir.join("metrics.png")).unwrap().starts_with(b"\x89PNG"));
    assert!(st.output_dir.join(format!("checkpoint-{steps}/model.safetensors")).exists());
}

#[test]
fn a_synchronous_job_learns_and_its_logprobs_equal_the_samplers() {
    let (job, start, end) = run_job("rl-sync", 0, "as_needed");
    check_job(&job, 0, start, end);
    // Staleness 0, T = 1, no truncation: the learner's ℓ equals the recorded μ bitwise.
    for r in &job.status().history {
        assert_eq!((r.learner.staleness_max, r.learner.loss.mismatch_max), (0, 0.0), "step {}", r.step);
    }
}

/// The same job on the emulated CUDA device (`--batch-invariant`): engine, learner, AdamW
/// and the in-place update under the write guard all take the CUDA code paths; it learns
/// as on the CPU, and ℓ = μ bitwise.
#[test]
fn a_synchronous_job_learns_on_the_emulated_cuda_device() {
    let dir = tiny("rl-sync-emu", 71);
    let dev = Device::cuda_emu(kernels::CudaOptions { batch_invariant: true, bf16_weights: false }).unwrap();
    let (job, start, end, _) = run_job_on(&dir, &dev, &format!("max_steps = {}", job_steps(0)), "max_staleness = 0");
    check_job(&job, 0, start, end);
    for r in &job.status().history {
        assert_eq!((r.learner.staleness_max, r.learner.loss.mismatch_max), (0, 0.0), "step {}", r.step);
    }
}

/// The TRL parity issue's failure mode in miniature: the reward needs a short exact answer
/// (one digit, then EOS: `^[0-9]$` on the text, plus a `length` reward with target 2 that
/// scores −1 at the `max_completion_length` limit of 4, since special tokens are invisible
/// in the text: "7" + three `<|im_start|>` would otherwise match). The tiny model gets a prior in which a correct
/// sample is rare but not hopeless (P ≈ 0.06–0.10 at the start, computed below): its
/// embeddings carry a constant feature (column 0 = 5) that the untied LM head reads only
/// for the digits (weight 1) and EOS (1.5). With the parity settings (dapo, β = 0, 8
/// generations of one prompt, `max_staleness` 0 and 1), each of three models must reach a
/// 5-step mean reward ≥ 0.9 within 40 steps and end with 2-token completions (digit + EOS).
#[test]
fn jobs_learn_a_short_exact_answer_under_a_length_limit() {
    // max_staleness 0 is deterministic; at 1 the versions that sampled each step depend on
    // timing (model 2 there needs 13–31 steps over repeated runs, so it is left out).
    for (seed, k) in [(1, 0), (2, 0), (7, 0), (1, 1), (7, 1)] {
        let rewards = short_answer_job(seed, k);
        let window = rewards.windows(5).position(|w| w.iter().sum::<f64>() / 5.0 >= 0.9);
        eprintln!("seed {seed}, max_staleness {k}: 5-step mean ≥ 0.9 from step {window:?} + 5; rewards {rewards:?}");
        assert!(
            window.is_some(),
            "seed {seed}, max_staleness {k}: no 5-step mean reward ≥ 0.9 in 40 steps: {rewards:?}"
        );
    }
}

/// Runs the short-answer job on the tiny model of `seed`; returns the reward of every step.
fn short_answer_job(seed: u64, max_staleness: u64) -> Vec<f64> {
    let dir = temp_dir(&format!("rl-short-answer-{seed}"));
    let spec = TinySpec { tied: false, seed, ..Default::default() };
    tests::tiny::write_tokenizer(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let digits = tok.encode("0123456789", false).unwrap();
    assert_eq!(digits.len(), 10);
    const EOS: usize = 258;
    let mut w = spec.weights();
    for (name, (_, v)) in w.iter_mut() {
        for (t, row) in v.chunks_mut(spec.hidden).enumerate() {
            match name.as_str() {
                "model.embed_tokens.weight" => row[0] = 5.0,
                "lm_head.weight" if t == EOS => row[0] = 1.5,
                "lm_head.weight" => row[0] = if digits.contains(&(t as u32)) { 1.0 } else { 0.0 },
                _ => break,
            }
        }
    }
    spec.write_weights(&dir, w);
    // P(one digit, then EOS) at the start, from the model's logits.
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let prompt = tok.encode("abc", false).unwrap();
    let probs = |ids: &[u32]| -> Vec<f32> {
        let z = model.forward(ids, &mut model.new_cache(16).unwrap(), false).unwrap();
        kernels::ops::log_softmax(&z).unwrap().to_vec().unwrap().iter().map(|x| x.exp()).collect()
    };
    let first = probs(&prompt);
    let p0: f32 = digits.iter().map(|&d| first[d as usize] * probs(&[prompt.clone(), vec![d]].concat())[EOS]).sum();
    assert!((0.03..0.15).contains(&p0), "seed {seed}: P(correct sample) = {p0} at the start");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let (ctx, _rt) = context(&dir);
    let cfg = JobConfig::from_toml(&format!(
        r#"
        dataset = "{}"
        apply_chat_template = false
        num_generations = 8
        prompts_per_step = 1
        max_steps = 40
        output_dir = "{}"
        rewards = [{{ type = "regex", pattern = '^[0-9]$' }}, {{ type = "length", target = 2 }}]
        log_completions = true
        [learner]
        max_completion_length = 4
        loss_type = "dapo"
        beta = 0.0
        learning_rate = 1e-2
        max_staleness = {max_staleness}
        "#,
        data.display(),
        dir.join("run").display(),
    ))
    .unwrap();
    let job = Job::start("job".into(), cfg, ctx, false).unwrap();
    job.wait();
    let st = job.status();
    assert_eq!((st.status, st.error.as_deref()), (JobState::Completed, None));
    let last = st.history.last().unwrap();
    assert!(last.learner.completion_length_mean <= 2.25, "seed {seed}: completions end long: {last:?}");
    // `log_completions`: every rollout, and the step means of its rewards are the history's.
    let log = std::fs::read_to_string(dir.join("run/completions.jsonl")).unwrap();
    let lines: Vec<Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 40 * 8);
    for r in &st.history {
        let step: Vec<&Value> = lines.iter().filter(|l| l["step"] == r.step).collect();
        let mean = step.iter().map(|l| l["reward"].as_f64().unwrap()).sum::<f64>() / step.len() as f64;
        assert!((mean - r.reward).abs() < 1e-9, "step {}: logged rewards {mean} vs {}", r.step, r.reward);
        let short = |l: &&Value| l["finish_reason"] == "stop" && l["completion"].as_str().unwrap().len() == 1;
        assert!(step.iter().filter(|l| l["reward"] == 1.0).all(short), "a reward-1 sample is a digit + EOS");
    }
    st.history.iter().map(|r| r.reward).collect()
}

#[test]
fn a_job_resumed_from_a_checkpoint_ends_where_an_uninterrupted_one_does() {
    // Uninterrupted: 6 steps. Interrupted: 3 steps (checkpoint-3), then a new process-like
    // start from the original weights with resume_from_checkpoint = "latest" up to 6. A
    // linear schedule: unset, its length is the job's max_steps, so the interrupted runs
    // name it (total_steps = 6) to follow the same schedule.
    let linear = "lr_scheduler_type = \"linear\"";
    let whole = tiny("rl-resume-whole", 78);
    let (uninterrupted, _, _, want) = run_job_in(&whole, "max_steps = 6", linear);
    let lrs: Vec<f64> = uninterrupted.status().history.iter().map(|r| r.learner.learning_rate).collect();
    let expected: Vec<f64> = (0..6).map(|s| 2e-2 * (6 - s) as f64 / 6.0).collect();
    assert_eq!(lrs.len(), 6);
    for (got, want) in lrs.iter().zip(&expected) {
        assert!((got - want).abs() < 1e-12, "linear decay to 0 at max_steps: {lrs:?} vs {expected:?}");
    }
    let cut = tiny("rl-resume-cut", 78);
    let cut_learner = format!("{linear}\ntotal_steps = 6");
    let (first, ..) = run_job_in(&cut, "max_steps = 3", &cut_learner);
    assert!(cut.join("run/checkpoint-3/trainer_state.json").exists());
    let (job, _, _, got) = run_job_in(&cut, "max_steps = 6\nresume_from_checkpoint = \"latest\"", &cut_learner);
    let st = job.status();
    assert_eq!((st.status, st.step, st.version, st.history.len()), (JobState::Completed, 6, 6, 3), "{:?}", st.error);
    assert_eq!(first.status().version, 3);
    let status = serde_json::to_value(st.latest.as_ref().unwrap()).unwrap();
    assert_eq!((&status["step"], &status["optimizer_step"]), (&json!(6), &json!(6)));
    // Loading a checkpoint never moves a live model's version back (no stale prefix-cache hits).
    let live = SharedModel::new(Model::load(&cut, &Device::Cpu).unwrap());
    live.write().version = 10;
    rl::load_weights(&live, &cut.join("run/checkpoint-3"), 3).unwrap();
    assert_eq!(live.version(), 11);
    assert_eq!(want.len(), got.len());
    for (name, v) in &want {
        assert_eq!(v, &got[name], "{name}: resumed weights differ");
    }
}

/// One-step-stale learning went wrong at the start of the parity task (docs/ARCHITECTURE.md,
/// "Off-policy learning"): Adam's first updates are its largest moves, and at
/// `max_staleness = 1` the batch after the first update was sampled before it. So a job at
/// `max_staleness ≥ 1` generates its first `1 / (1 − β₁)` = 10 steps on-policy (ℓ = μ
/// bitwise: no mismatch), then overlaps within the bound; with the warm start turned off the
/// second step already trains on samples of the version before.
#[test]
fn an_async_job_starts_on_policy_for_adams_first_steps() {
    for (warmup, name) in [("", "rl-warm-start"), ("on_policy_warmup_steps = 0", "rl-no-warm-start")] {
        let dir = tiny(name, 71);
        let (job, ..) = run_job_in(&dir, "max_steps = 14", &format!("max_staleness = 1\n{warmup}"));
        let st = job.status();
        assert_eq!((st.status, st.step), (JobState::Completed, 14), "{name}");
        let stale: Vec<(u64, u64, f64)> =
            st.history.iter().map(|r| (r.step, r.learner.staleness_max, r.learner.loss.mismatch_mean)).collect();
        eprintln!("{name}: (step, staleness, |ℓ − μ|) {stale:?}");
        assert!(stale.iter().all(|&(_, s, _)| s <= 1), "{name}: beyond the bound: {stale:?}");
        // Measured here: without the warm start step 2's tokens are ~7.8 nats off (the whole
        // first Adam step), with it the first stale steps (11+) ~1e-4.
        if warmup.is_empty() {
            for &(step, s, mm) in &stale[..10] {
                assert_eq!((s, mm), (0, 0.0), "{name}: step {step} of the warm start is not on-policy");
            }
            assert!(stale[10..].iter().all(|&(_, _, mm)| mm < 0.01), "{name}: {stale:?}");
        } else {
            assert_eq!(stale[1].1, 1, "{name}: step 2 trains on the samples of version 0");
            assert!(stale[1].2 > 1.0, "{name}: Adam's first step moved the policy little: {stale:?}");
        }
    }
}

/// At `max_staleness = 2`, with every batch as stale as the bound allows (the generator
/// starts each batch as soon as it may) and with the default `"as_needed"` (one batch ahead,
/// more only while generation is the slower side): both learn within the bound.
#[test]
fn an_async_job_with_max_staleness_2_learns() {
    for ahead in ["to_max_staleness", "as_needed"] {
        let (job, start, end) = run_job(&format!("rl-async-{ahead}"), 2, ahead);
        check_job(&job, 2, start, end);
    }
}

pub(crate) async fn start_server(dir: PathBuf, args: ServeArgs) -> (Server, String) {
    let state = tokio::task::spawn_blocking(move || build_state(&dir, &args)).await.unwrap().unwrap();
    let s = Server::start(state, "127.0.0.1", 0).await.unwrap();
    let base = format!("http://{}", s.addr);
    (s, base)
}

pub(crate) async fn post(base: &str, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{base}{path}")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Waits (at most 10 s) for the feedback learner's checkpoint in the feedback folder `log`.
pub(crate) async fn feedback_checkpoint_written(log: &Path) {
    let saved = async || log.join("checkpoint/trainer_state.json").exists();
    assert!(eventually(Duration::from_secs(10), saved, |&s| s).await, "no feedback checkpoint in {}", log.display());
}

/// Posts `body` to `/v1/completions` until its tokens come from policy version `want` (at
/// most 10 s); returns the last version seen.
pub(crate) async fn served_version_reaches(base: &str, body: &Value, want: u64) -> u64 {
    let version = async || post(base, "/v1/completions", body.clone()).await.1["choices"][0]["versions"][0].as_u64();
    eventually(Duration::from_secs(10), version, |&v| v == Some(want)).await.unwrap()
}

pub(crate) fn feedback_args(dir: &Path, window: usize) -> ServeArgs {
    let mut a = ServeArgs::default();
    a.feedback.learn_from_feedback = true;
    a.feedback.feedback_dir = dir.to_path_buf();
    a.feedback.feedback_window = window;
    a.feedback.feedback_batch_size = 1000; // no learner step in this test
    a
}

/// With `--learn-from-feedback` the feedback folder's `policy_version` records every
/// learner's updates, a job's too: after a restart (the job's weights are not the feedback
/// checkpoint's) the served version is above every version served before, so it never goes
/// back and never names the job's weights and others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_versions_are_recorded_for_the_feedback_learners_restart() {
    let dir = tiny("rl-version-record", 84);
    let log = temp_dir("rl-version-record-log");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let args = || ServeArgs { jobs_dir: dir.clone(), ..feedback_args(&log, 8) };
    let (s, base) = start_server(dir.clone(), args()).await;
    let job = json!({"dataset": data, "apply_chat_template": false, "num_generations": 2, "max_steps": 2,
                     "output_dir": "out", "rewards": [{"type": "length", "target": 2}],
                     "learner": {"max_completion_length": 2}});
    let (st, out) = post(&base, "/v1/train/jobs", job).await;
    assert_eq!(st, 201, "{out}");
    let url = format!("{base}/v1/train/jobs/{}", out["id"].as_str().unwrap());
    let status =
        eventually(Duration::from_secs(10), async || get_json(&url).await, |s| s["status"] == "completed").await;
    assert_eq!((&status["status"], &status["version"]), (&json!("completed"), &json!(2)), "{status}");
    assert_eq!(std::fs::read_to_string(log.join("policy_version")).unwrap(), "2");
    s.shutdown(Duration::from_secs(5)).await;
    let (s, base) = start_server(dir.clone(), args()).await;
    let now: Value = reqwest::get(format!("{base}/v1/status")).await.unwrap().json().await.unwrap();
    assert_eq!(now["version"], 3, "the restarted server's weights are not the job's v2: {now}");
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollouts_return_tokens_logprobs_and_versions() {
    let (s, base) = start_server(tiny("rl-rollouts", 72), ServeArgs::default()).await;
    let (st, out) = post(
        &base,
        "/v1/rollouts",
        json!({"prompts": ["ab", [1, 2, 3], {"messages": [{"role": "user", "content": "hi"}]}],
               "num_generations": 3, "max_tokens": 5, "seed": 1, "ignore_eos": true}),
    )
    .await;
    assert_eq!(st, 200, "{out}");
    let rs = out["rollouts"].as_array().unwrap();
    assert_eq!(rs.len(), 9);
    for r in rs {
        let n = r["completion_ids"].as_array().unwrap().len();
        assert_eq!(n, 5);
        for k in ["behavior_logprobs", "raw_logprobs", "versions"] {
            assert_eq!(r[k].as_array().unwrap().len(), n, "{k}");
        }
        assert_eq!(r["finish_reason"], "length");
        // T = 1, no truncation: μ = raw logprob.
        assert_eq!(r["behavior_logprobs"], r["raw_logprobs"]);
        assert!(r["versions"].as_array().unwrap().iter().all(|v| v == 0));
    }
    assert_eq!(rs[3]["prompt_token_ids"], json!([1, 2, 3]));
    assert_eq!(rs[8]["prompt_token_ids"][0], 257, "chat prompts go through the template");
    assert_eq!((rs[4]["prompt_index"].as_u64(), rs[4]["index"].as_u64()), (Some(1), Some(1)));
    assert_eq!(out["usage"]["completion_tokens"], 45);
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rl_requests_get_a_4xx_that_says_why() {
    let jobs = temp_dir("rl-bad-jobs");
    std::fs::create_dir_all(jobs.join("empty")).unwrap();
    std::os::unix::fs::symlink("/tmp", jobs.join("out")).unwrap();
    let args = ServeArgs { jobs_dir: jobs.clone(), ..ServeArgs::default() };
    let (s, base) = start_server(tiny("rl-bad", 73), args).await;
    // A sparse file one byte over the dataset limit (no disk used).
    let huge = temp_dir("rl-bad-huge").join("huge.jsonl");
    // TRL's column name for the answer: `exact_answer` would score every row 0.
    let no_answer = temp_dir("rl-bad-no-answer").join("rows.jsonl");
    std::fs::write(&no_answer, "{\"prompt\": \"What is 2 + 3?\", \"solution\": \"5\"}\n").unwrap();
    let no_answer = no_answer.to_str().unwrap();
    std::fs::File::create(&huge).unwrap().set_len(engine::files::MAX_DATASET_BYTES + 1).unwrap();
    let cases: Vec<(&str, Value, u16, &str)> = vec![
        ("/v1/rollouts", json!({"prompts": []}), 400, "`prompts`"),
        ("/v1/rollouts", json!({"max_tokens": 3}), 400, "prompts"),
        ("/v1/rollouts", json!({"prompts": [[1, 99999]]}), 400, "99999"),
        ("/v1/rollouts", json!({"prompts": ["a"], "temperature": -1}), 400, "temperature"),
        (
            "/v1/rollouts",
            json!({"prompts": ["a"], "num_generations": 0}),
            400,
            "`num_generations` must be in [1, 256], got 0",
        ),
        ("/v1/rollouts", json!({"prompts": ["a"], "n": 0}), 400, "`n` must be in [1, 256], got 0"),
        (
            "/v1/rollouts",
            json!({"prompts": ["a"], "n": 2, "num_generations": 4}),
            400,
            "`num_generations` (4) and `n` (2) name the same count: give one of them",
        ),
        (
            "/v1/rollouts",
            json!({"prompts": ["a"], "num_generations": 100000000}),
            400,
            "`num_generations` must be in [1, 256], got 100000000",
        ),
        ("/v1/rollouts", json!({"prompts": vec!["a"; 20], "num_generations": 256}), 400, "at most 4096"),
        ("/v1/train/jobs", json!({"num_generations": 1}), 400, "group needs two"),
        ("/v1/train/jobs", json!({"learner": {"max_completion_length": 100000}}), 400, "context of 128"),
        ("/v1/train/jobs", json!({"dataset": "builtin:nope"}), 400, "builtin:arithmetic"),
        ("/v1/train/jobs", json!({"eval_dataset": "/nope.jsonl"}), 400, "`eval_dataset` /nope.jsonl"),
        // Job outputs stay under --jobs-dir: absolute paths, `..` and links out are refused
        // before anything is created.
        (
            "/v1/train/jobs",
            json!({"output_dir": "/proc/forbidden"}),
            400,
            "`output_dir` must be a folder name relative to --jobs-dir",
        ),
        ("/v1/train/jobs", json!({"output_dir": "/"}), 400, "leaves it"),
        ("/v1/train/jobs", json!({"output_dir": "../../x"}), 400, "leaves it"),
        ("/v1/train/jobs", json!({"output_dir": "out/run"}), 400, "leads out of it through a symbolic link"),
        ("/v1/train/jobs", json!({"output_dir": "out"}), 400, "is a symbolic link"),
        (
            "/v1/train/jobs",
            json!({"resume_from_checkpoint": "/etc"}),
            400,
            "`resume_from_checkpoint` must be a folder name",
        ),
        ("/v1/train/jobs", json!({"max_steps": 1_000_000_000_000u64}), 400, "`max_steps` must be in [1, 10000000]"),
        ("/v1/train/jobs", json!({"max_steps": u64::MAX}), 400, "`max_steps` must be in [1, 10000000]"),
        ("/v1/train/jobs", json!({"prompts_per_step": 100000}), 400, "`prompts_per_step` must be in [1, 4096]"),
        (
            "/v1/train/jobs",
            json!({"resume_from_checkpoint": "latest", "output_dir": "empty", "learner": {"max_completion_length": 8}}),
            400,
            "no checkpoint",
        ),
        ("/v1/train/jobs", json!({"num_generations": 0}), 400, "`num_generations`"),
        ("/v1/train/jobs", json!({"learning_rat": 1e-5}), 400, "unknown field `learning_rat`"),
        ("/v1/train/jobs", json!({"learning_rate": 1e-5}), 400, "unknown field `learning_rate`"),
        ("/v1/train/jobs", json!({"learner": {"learning_rat": 1e-5}}), 400, "unknown field `learning_rat`"),
        ("/v1/train/jobs", json!({"learner": {"total_steps": 0}}), 400, "`learner.total_steps`"),
        (
            "/v1/train/jobs",
            json!({"prompts_per_step": 4096, "num_generations": 256}),
            400,
            "`prompts_per_step` × `num_generations` must be <= 4096 sequences per step, got 4096 × 256 = 1048576",
        ),
        (
            "/v1/train/jobs",
            json!({"max_steps": "5"}),
            400,
            "`max_steps`: invalid type: string \"5\", expected an integer in [0, 2^64)",
        ),
        (
            "/v1/train/jobs",
            json!({"learner": {"loss_type": "ppo2"}}),
            400,
            "`learner.loss_type`: unknown variant `ppo2`",
        ),
        (
            "/v1/train/jobs",
            json!({"learner": {"learning_rate": -1}}),
            400,
            "`learner.learning_rate` must be >= 0, got -1",
        ),
        (
            "/v1/train/jobs",
            json!({"learner": {"adam_beta1": 1.5}}),
            400,
            "`learner.adam_beta1` must be in [0, 1), got 1.5",
        ),
        ("/v1/train/jobs", json!({"dataset": "/nonexistent.jsonl"}), 400, "/nonexistent.jsonl"),
        // Read whole, /dev/zero took 20 GB and the server with it: now a 400 naming the file
        // (the cases after it show the server still serves).
        ("/v1/train/jobs", json!({"dataset": "/dev/zero"}), 400, "`dataset` /dev/zero: not a regular file"),
        ("/v1/train/jobs", json!({"eval_dataset": "/dev/zero"}), 400, "`eval_dataset` /dev/zero: not a regular file"),
        ("/v1/train/jobs", json!({"dataset": &huge}), 400, "bytes exceed the limit of 1073741824"),
        ("/v1/train/jobs", json!({"rewards": [{"type": "regex", "pattern": "("}]}), 400, "regex"),
        ("/v1/train/jobs", json!({"rewards": [{"type": "http", "url": "ftp://x"}]}), 400, "http://"),
        ("/v1/train/jobs", json!({"learner": {"temperature": 0}}), 400, "`learner.temperature`"),
        // An empty clip range panicked the learner and left a job running for good.
        (
            "/v1/train/jobs",
            json!({"learner": {"epsilon": 0.5, "epsilon_high": -0.8}}),
            400,
            "`learner.epsilon_high` must be a finite number >= 0, got -0.8",
        ),
        (
            "/v1/train/jobs",
            json!({"learner": {"beta": -5}}),
            400,
            "`learner.beta` must be a finite number >= 0, got -5",
        ),
        ("/v1/train/jobs", json!([]), 400, "the job config must be a JSON object (the TOML's keys), got an array"),
        (
            "/v1/train/jobs",
            json!({"dataset": no_answer, "rewards": [{"type": "exact_answer"}]}),
            400,
            "`rewards[0]` (exact_answer) reads each row's `answer`",
        ),
        ("/v1/train/jobs", json!({"model": "/elsewhere"}), 400, "served model"),
        ("/v1/train/jobs/nope/stop", json!({}), 404, "nope"),
        ("/v1/feedback", json!({"id": "x", "preferred": 0}), 404, "--learn-from-feedback"),
    ];
    for (path, body, status, needle) in cases {
        let (st, out) = post(&base, path, body.clone()).await;
        let msg = out["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(st, status, "{path} {body}: {out}");
        assert!(msg.contains(needle), "{path} {body}: {msg:?} lacks {needle:?}");
    }
    let (_, out) = post(&base, "/v1/train/jobs", json!({"learner": {"loss_type": "ppo2"}})).await;
    assert_eq!(out["error"]["param"], "learner.loss_type", "{out}");
    let r = reqwest::get(format!("{base}/v1/train/jobs/job-unknown")).await.unwrap();
    assert_eq!(r.status(), 404);
    let r = reqwest::get(format!("{base}/v1/rollouts")).await.unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("GET is not allowed"), "{v}");
    s.shutdown(Duration::from_secs(5)).await;
    // With --admin-key the RL endpoints need it; on a public address they need one at all.
    let args = ServeArgs { admin_key: Some("sekret".into()), ..Default::default() };
    let (s, base) = start_server(tiny("rl-admin", 74), args).await;
    let (st, out) = post(&base, "/v1/rollouts", json!({"prompts": ["a"]})).await;
    assert_eq!(st, 401, "{out}");
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/rollouts"))
        .bearer_auth("sekret")
        .json(&json!({"prompts": ["a"], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    s.shutdown(Duration::from_secs(5)).await;
    let public = ServeArgs { host: "0.0.0.0".into(), ..Default::default() };
    let (s, base) = start_server(tiny("rl-public", 75), public).await;
    let (st, out) = post(&base, "/v1/rollouts", json!({"prompts": ["a"]})).await;
    assert_eq!(st, 403, "{out}");
    s.shutdown(Duration::from_secs(5)).await;
    let dir = tiny("rl-public-fb", 76);
    let mut a = feedback_args(&temp_dir("rl-public-fb-log"), 8);
    a.host = "0.0.0.0".into();
    let err = tokio::task::spawn_blocking(move || build_state(&dir, &a).err().unwrap().to_string()).await.unwrap();
    assert!(err.contains("--admin-key"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn feedback_is_durable_and_validated() {
    let dir = tiny("rl-feedback", 77);
    let log = temp_dir("rl-feedback-log");
    let (s, base) = start_server(dir.clone(), feedback_args(&log, 2)).await;
    let body = json!({"prompt": "ab", "max_tokens": 3, "n": 2, "seed": 4});
    let (_, a) = post(&base, "/v1/completions", body.clone()).await;
    let a = a["id"].as_str().unwrap().to_string();
    let (_, g) = post(&base, "/v1/completions", json!({"prompt": "ab", "max_tokens": 2, "temperature": 0})).await;
    let greedy = g["id"].as_str().unwrap().to_string();
    let (st, out) = post(&base, "/v1/feedback", json!({"id": a, "choice": 0, "reward": 1.0})).await;
    assert_eq!(st, 200, "{out}");
    let cases: Vec<(Value, u16, &str)> = vec![
        (json!({"id": a, "choice": 0, "reward": 0.5}), 409, "already rated"),
        (json!({"id": a, "choice": 5, "reward": 0.5}), 400, "`choice` 5"),
        (json!({"id": a, "choice": 1, "reward": 3.0}), 400, "[-1, 1]"),
        (json!({"id": a, "choice": 1}), 400, "`preferred`"),
        (json!({"id": "cmpl-nope", "preferred": 0}), 404, "unknown response id"),
        (json!({"id": a, "choice": 1, "reward": 0.5, "extra": 1}), 400, "extra"),
        (json!({"id": greedy, "preferred": 0}), 400, "greedily"),
    ];
    for (b, status, needle) in &cases {
        let (st, out) = post(&base, "/v1/feedback", b.clone()).await;
        let msg = out["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(st, *status, "{b}: {out}");
        assert!(msg.contains(needle), "{b}: {msg:?} lacks {needle:?}");
    }
    s.shutdown(Duration::from_secs(5)).await;
    // Restart: the log is replayed, so the rating is remembered and the response still known.
    let (s, base) = start_server(dir, feedback_args(&log, 2)).await;
    let (st, out) = post(&base, "/v1/feedback", json!({"id": a, "choice": 0, "reward": 0.5})).await;
    assert_eq!(st, 409, "{out}");
    let (st, out) = post(&base, "/v1/feedback", json!({"id": a, "choice": 1, "reward": -1.0})).await;
    assert_eq!(st, 200, "{out}");
    assert_eq!(out["samples_ready"], 2, "both choices rated: one group of two");
    let (st, out) = post(&base, "/v1/feedback", json!({"id": a, "preferred": 0})).await;
    assert_eq!(st, 409, "a fully rated response: {out}");
    // The window holds 2 responses: a third pushes the oldest out (410 Gone).
    let mut ids = vec![];
    for _ in 0..3 {
        let (_, r) = post(&base, "/v1/completions", body.clone()).await;
        ids.push(r["id"].as_str().unwrap().to_string());
    }
    let (st, out) = post(&base, "/v1/feedback", json!({"id": ids[0], "preferred": 1})).await;
    assert_eq!(st, 410, "{out}");
    let (st, _) = post(&base, "/v1/feedback", json!({"id": ids[2], "preferred": 1})).await;
    assert_eq!(st, 200);
    s.shutdown(Duration::from_secs(5)).await;
    let lines = std::fs::read_to_string(log.join("feedback.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 3, "one durable line per accepted rating");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rated_responses_train_the_served_model_and_survive_a_restart() {
    let dir = tiny("rl-feedback-train", 79);
    let log = temp_dir("rl-feedback-train-log");
    let mut args = feedback_args(&log, 16);
    let export = temp_dir("rl-feedback-export");
    args.checkpoint_dir = Some(export.clone());
    args.feedback.feedback_batch_size = 2;
    args.feedback.feedback_save_steps = 1;
    args.feedback.learning_rate = Some(1e-2);
    let (s, base) = start_server(dir.clone(), args.clone()).await;
    let body = json!({"prompt": "ab", "max_tokens": 3, "n": 2, "seed": 4, "return_token_ids": true});
    let (_, a) = post(&base, "/v1/completions", body.clone()).await;
    assert_eq!(a["choices"][0]["versions"], json!([0, 0, 0]));
    let (st, out) = post(&base, "/v1/feedback", json!({"id": a["id"], "preferred": 1})).await;
    assert_eq!((st, &out["samples_ready"]), (200, &json!(2)), "{out}");
    // The learner steps on the group of two; later requests are answered by version 1.
    let version = served_version_reaches(&base, &body, 1).await;
    assert_eq!(version, 1, "the feedback learner did not update the served weights");
    // The served weights export as a checkpoint the engine loads.
    let out = export.join("v1");
    let (st, r) = post(&base, "/v1/checkpoints", json!({"path": "v1"})).await;
    assert_eq!((st, &r["version"]), (200, &json!(1)), "{r}");
    let state = learner::checkpoint::load_state(&out).unwrap();
    assert_eq!(state["version"], 1);
    assert!(Model::load(&out, &Device::Cpu).is_ok());
    let (st, _) = post(&base, "/v1/checkpoints", json!({"path": ""})).await;
    assert_eq!(st, 400);
    feedback_checkpoint_written(&log).await;
    let metrics = reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("rlserve:feedback_accepted_total"), "{metrics}");
    s.shutdown(Duration::from_secs(5)).await;
    // A restart serves the trained weights (the feedback checkpoint) at version 1.
    let (s, base) = start_server(dir, args).await;
    let (_, r) = post(&base, "/v1/completions", body).await;
    assert_eq!(r["choices"][0]["versions"], json!([1, 1, 1]));
    s.shutdown(Duration::from_secs(5)).await;
}

#[test]
fn exact_answer_reads_the_final_answer() {
    use rl::rewards::exact_answer;
    let check = |completion: &str, answer: Value, want: bool| {
        assert_eq!(exact_answer(completion, Some(&answer)), want, "{completion:?} vs {answer}");
    };
    check("#### 42", json!("42"), true);
    check("so 3 + 4 = 7.\n#### 7 (and 8 later)", json!(7), true);
    check("The answer is \\boxed{12}.", json!("12"), true);
    check("1,000 apples", json!("1000"), true);
    check("3 + 4 = 7.", json!("7"), true);
    check("3 + 4 = 7. Then 9", json!("7"), false);
    check("#### 5.0", json!("5"), true);
    check("no number here", json!("5"), false);
    assert!(!exact_answer("#### 5", None), "no `answer` field: no reward");
    // `first_number`: the first number of the text is the answer.
    use rl::rewards::answer_matches;
    assert!(answer_matches("12", Some(&json!(12)), true));
    assert!(answer_matches(" 12.\nSo 6 + 6 = 12", Some(&json!("12")), true));
    assert!(!answer_matches("6 + 6 = 12", Some(&json!(12)), true), "6 is the first number");
    assert!(answer_matches("6 + 6 = 12", Some(&json!(12)), false), "the last number is 12");
    assert!(!answer_matches("twelve", Some(&json!(12)), true));
}

#[test]
fn dataset_order_is_a_seeded_permutation_per_epoch() {
    let dir = tiny("rl-dataset", 80);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let data = dir.join("d.jsonl");
    std::fs::write(&data, (0..7).map(|i| format!("{{\"prompt\": \"p{i}\"}}\n")).collect::<String>()).unwrap();
    let ex = rl::dataset::load("dataset", data.to_str().unwrap(), &tok, Default::default()).unwrap();
    let order = |seed, epoch: u64| -> Vec<String> {
        (0..7).map(|i| rl::dataset::at(&ex, seed, epoch * 7 + i).prompt_text.clone()).collect()
    };
    let mut e0 = order(1, 0);
    assert_eq!(order(1, 0), e0, "deterministic: a resumed job continues the same order");
    assert_ne!(order(1, 1), e0, "reshuffled each epoch");
    e0.sort();
    assert_eq!(e0, (0..7).map(|i| format!("p{i}")).collect::<Vec<_>>(), "each epoch visits every example once");
    let err = rl::dataset::load("dataset", "builtin:nope", &tok, Default::default()).unwrap_err().to_string();
    assert!(err.contains("builtin:arithmetic"), "{err}");
}

/// `data_seed` fixes the prompt order and `seed` the samples: a job with another `seed` and
/// the first one's `data_seed` sees the same prompts step by step and samples other
/// completions; without `data_seed`, `seed` also reorders the prompts.
#[test]
fn data_seed_fixes_the_prompt_order_and_seed_the_samples() {
    let dir = tiny("rl-data-seed", 82);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, (0..7).map(|i| format!("{{\"prompt\": \"p{i}\"}}\n")).collect::<String>()).unwrap();
    // (step, prompt) and completion of every rollout, in the log's order.
    let run = |name: &str, seeds: &str| -> (Vec<(u64, String)>, Vec<String>) {
        let (ctx, _rt) = context(&dir);
        let out = dir.join(name);
        let cfg = JobConfig::from_toml(&format!(
            r#"
            dataset = "{}"
            apply_chat_template = false
            num_generations = 2
            prompts_per_step = 2
            max_steps = 3
            {seeds}
            output_dir = "{}"
            log_completions = true
            rewards = [{{ type = "regex", pattern = '^[\x00-\x7F]' }}]
            [learner]
            max_completion_length = 4
            "#,
            data.display(),
            out.display()
        ))
        .unwrap();
        let job = Job::start(name.into(), cfg, ctx, false).unwrap();
        job.wait();
        assert_eq!(job.status().status, JobState::Completed, "{name}");
        let log = std::fs::read_to_string(out.join("completions.jsonl")).unwrap();
        let lines: Vec<Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 3 * 2 * 2, "{name}");
        let prompts =
            lines.iter().map(|l| (l["step"].as_u64().unwrap(), l["prompt"].as_str().unwrap().into())).collect();
        (prompts, lines.iter().map(|l| l["completion"].as_str().unwrap().into()).collect())
    };
    let (prompts_a, samples_a) = run("a", "seed = 1");
    let (prompts_b, samples_b) = run("b", "seed = 2\ndata_seed = 1");
    let (prompts_c, _) = run("c", "seed = 2");
    assert_eq!(prompts_a, prompts_b, "one data_seed, one prompt order");
    assert_ne!(samples_a, samples_b, "another seed, other samples");
    assert_ne!(prompts_c, prompts_b, "without data_seed, seed orders the prompts");
    assert_eq!(run("a2", "seed = 1\ndata_seed = 1"), (prompts_a, samples_a), "data_seed = seed is the default");
}

/// A new run refuses an `output_dir` holding an earlier run (its pruning would otherwise
/// delete its own checkpoints, whose steps are lower than the old run's); with
/// `overwrite_output_dir` the earlier run's files are removed first; resuming is allowed.
#[test]
fn a_new_run_refuses_an_output_dir_with_an_earlier_run() {
    let dir = tiny("rl-earlier-run", 83);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let out = dir.join("run");
    let start = |extra: &str| {
        let (ctx, rt) = context(&dir);
        let cfg = JobConfig::from_toml(&format!(
            r#"
            dataset = "{}"
            apply_chat_template = false
            num_generations = 2
            save_steps = 1
            save_total_limit = 2
            output_dir = "{}"
            rewards = [{{ type = "length", target = 2 }}]
            {extra}
            [learner]
            max_completion_length = 2
            "#,
            data.display(),
            out.display()
        ))
        .unwrap();
        let r = Job::start("job".into(), cfg, ctx, false);
        if let Ok(job) = &r {
            job.wait();
            assert_eq!((job.status().status, job.status().error), (JobState::Completed, None), "{extra}");
        }
        drop(rt);
        r
    };
    let listing = || {
        let mut v: Vec<String> =
            std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    };
    let lines = || std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().count();
    // An empty metrics.jsonl (a run stopped before its first step) is no earlier run.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("metrics.jsonl"), "").unwrap();
    start("max_steps = 3").unwrap();
    assert_eq!(listing(), ["checkpoint-2", "checkpoint-3", "metrics.jsonl", "metrics.png", "policy_version"]);
    let e = start("max_steps = 1").err().expect("an earlier run is refused");
    assert!(matches!(&e, rl::RlError::Invalid { param: Some(p), .. } if p == "output_dir"), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("holds an earlier run (checkpoint-2, checkpoint-3, metrics.jsonl)"), "{msg}");
    assert!(msg.contains("`overwrite_output_dir` = true"), "{msg}");
    assert_eq!(
        listing(),
        ["checkpoint-2", "checkpoint-3", "metrics.jsonl", "metrics.png", "policy_version"],
        "a refused run changes nothing"
    );
    // Resuming continues the run in place.
    start("max_steps = 4\nresume_from_checkpoint = \"latest\"").unwrap();
    assert_eq!(listing(), ["checkpoint-3", "checkpoint-4", "metrics.jsonl", "metrics.png", "policy_version"]);
    assert_eq!(lines(), 4, "the resumed run's metrics follow the first three steps");
    // Overwriting starts over: the new run's checkpoints are the ones kept.
    start("max_steps = 1\noverwrite_output_dir = true").unwrap();
    assert_eq!(
        (listing(), lines()),
        (vec!["checkpoint-1".to_string(), "metrics.jsonl".into(), "metrics.png".into(), "policy_version".into()], 1)
    );
}

/// A job's `chat_template_kwargs` (TOML table) reach the template of every prompt (Qwen3's
/// `enable_thinking = false` closes an empty think block after the generation prompt), a
/// line's own object is laid over them key by key, and a bad one is an error naming the
/// line.
#[test]
fn job_and_line_chat_template_kwargs_reach_the_template() {
    let dir = tiny("rl-kwargs", 81);
    let path = dir.join("tokenizer_config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let think = "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}";
    cfg["chat_template"] = json!(format!("{}{think}", tests::tiny::CHAT_TEMPLATE));
    std::fs::write(&path, cfg.to_string()).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let job = JobConfig::from_toml("chat_template_kwargs = { enable_thinking = false }\n").unwrap();
    assert_eq!(job.chat_template_kwargs["enable_thinking"], json!(false));
    let data = dir.join("d.jsonl");
    let lines = [
        json!({"prompt": "a"}),
        json!({"prompt": "b", "chat_template_kwargs": {"enable_thinking": true}}),
        json!({"messages": [{"role": "user", "content": "c"}]}),
    ];
    std::fs::write(&data, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let load = |kwargs| {
        let t =
            rl::dataset::Templating { apply_chat_template: true, system_prompt: None, chat_template_kwargs: kwargs };
        rl::dataset::load("dataset", data.to_str().unwrap(), &tok, t)
    };
    let closed = "<think>\n\n</think>\n\n";
    let texts =
        |ex: Vec<rl::dataset::Example>| ex.into_iter().map(|e| e.prompt_text.ends_with(closed)).collect::<Vec<_>>();
    assert_eq!(texts(load(Some(&job.chat_template_kwargs)).unwrap()), [true, false, true]);
    assert_eq!(texts(load(None).unwrap()), [false, false, false]);
    // The ids are the rendered text's (the template's markers as special tokens).
    let ex = load(Some(&job.chat_template_kwargs)).unwrap();
    assert_eq!(tok.decode(&ex[0].prompt_ids, false).unwrap(), ex[0].prompt_text);
    assert!(!ex[0].fields.contains_key("chat_template_kwargs"), "not a reward field");
    std::fs::write(&data, "{\"prompt\": \"a\"}\n{\"prompt\": \"b\", \"chat_template_kwargs\": 3}\n").unwrap();
    let err = load(None).unwrap_err().to_string();
    assert!(err.contains("line 2: `chat_template_kwargs` must be an object"), "{err}");
    std::fs::write(&data, "{\"prompt\": \"a\", \"chat_template_kwargs\": {\"messages\": 1}}\n").unwrap();
    let err = load(None).unwrap_err().to_string();
    assert!(err.contains("line 1") && err.contains("would replace the template's own `messages`"), "{err}");
}

#[test]
fn job_configs_reject_unknown_keys_and_keep_the_job_learner_defaults() {
    use learner::TrainConfig;
    // TOML (`rlserve train`) and JSON (`POST /v1/train/jobs`) go through one type.
    let from_toml = JobConfig::from_toml("max_steps = 7\n[learner]\nbeta = 0.04\nlearning_rate = 3e-6\n").unwrap();
    let from_json =
        JobConfig::from_json(json!({"max_steps": 7, "learner": {"beta": 0.04, "learning_rate": 3e-6}})).unwrap();
    assert_eq!(from_toml, from_json);
    // The job's learner defaults differ from the learner's own...
    let d = job_learner_defaults();
    assert_eq!(
        (d.learning_rate, d.max_completion_length, d.max_staleness, d.log_kl_to_initial),
        (1e-5, 64, Some(0), true)
    );
    let plain = TrainConfig::default();
    assert_ne!(
        (plain.learning_rate, plain.max_completion_length, plain.max_staleness, plain.log_kl_to_initial),
        (d.learning_rate, d.max_completion_length, d.max_staleness, d.log_kl_to_initial)
    );
    // ...and hold for every key a partial [learner] table leaves out, and when it is absent.
    assert_eq!(from_toml.learner, TrainConfig { beta: 0.04, learning_rate: 3e-6, ..d.clone() });
    assert_eq!(JobConfig::from_toml("max_steps = 7").unwrap().learner, d);
    assert_eq!(JobConfig::from_json(json!({"learner": {}})).unwrap().learner, d);
    // Unset total_steps: the schedule ends with the run.
    assert_eq!(from_toml.train_config().total_steps, Some(7));
    let given = JobConfig::from_json(json!({"max_steps": 7, "learner": {"total_steps": 100}})).unwrap();
    assert_eq!(given.train_config().total_steps, Some(100));
    // Unknown keys, at the top level and inside [learner], in TOML and JSON: rejected as
    // invalid input (HTTP 400), naming the key.
    let cases: [(rl::Result<JobConfig>, &str); 6] = [
        (JobConfig::from_toml("max_step = 3"), "max_step"),
        (JobConfig::from_toml("max_steps = 3\n[learner]\nlerning_rate = 1e-5"), "lerning_rate"),
        (JobConfig::from_toml("[learner]\nmax_steps = 3"), "max_steps"),
        (JobConfig::from_json(json!({"max_step": 3})), "max_step"),
        (JobConfig::from_json(json!({"learner": {"lerning_rate": 1e-5}})), "lerning_rate"),
        // A learner key at the top level is not a job key.
        (JobConfig::from_json(json!({"temperature": 0.7})), "temperature"),
    ];
    for (r, key) in cases {
        let e = r.expect_err(key);
        let msg = e.to_string();
        assert!(matches!(e, rl::RlError::Invalid { .. }), "{key}: {e:?}");
        assert!(msg.contains(&format!("unknown field `{key}`")), "{key}: {msg}");
    }
    // The example config parses, with its [learner] table.
    let text = std::fs::read_to_string(tests::workspace_root().join("examples/arithmetic.toml")).unwrap();
    let example = JobConfig::from_toml(&text).unwrap();
    assert_eq!((example.learner.max_completion_length, example.learner.max_staleness), (16, Some(1)));
    assert_eq!((example.max_steps, example.learner.log_kl_to_initial), (20, true));
    // The TRL-parity example: TRL's on-policy settings (benches/trl_compare).
    let text = std::fs::read_to_string(tests::workspace_root().join("examples/trl_parity.toml")).unwrap();
    let parity = JobConfig::from_toml(&text).unwrap();
    let l = &parity.learner;
    assert_eq!((parity.max_steps, l.max_staleness, l.log_kl_to_initial, l.beta), (80, Some(0), false, 0.0));
}

/// A stop aborts the rollouts a job has in flight: a step of 4096 sequences (the cap) of up
/// to 100 tokens, generated one at a time (`max_num_seqs` 1), would take minutes; after the
/// stop the job ends within seconds (no checkpoint step to finish: none was trained), and
/// the engine is left with no request and no KV block in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_a_job_aborts_its_rollouts_in_flight() {
    let dir = tiny("rl-stop-inflight", 82);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let mut a = ServeArgs { jobs_dir: dir.clone(), ..ServeArgs::default() };
    a.engine.max_num_seqs = 1;
    let (s, base) = start_server(dir.clone(), a).await;
    let job = json!({"dataset": data, "apply_chat_template": false, "num_generations": 8, "prompts_per_step": 512,
                     "max_steps": 3, "output_dir": "out", "rewards": [{"type": "length", "target": 2}],
                     "learner": {"max_completion_length": 100}});
    let (st, out) = post(&base, "/v1/train/jobs", job).await;
    assert_eq!(st, 201, "{out}");
    let id = out["id"].as_str().unwrap();
    let engine = |v: &Value| (v["engine"]["num_requests_running"].clone(), v["engine"]["num_requests_waiting"].clone());
    let status = || async { reqwest::get(format!("{base}/v1/status")).await.unwrap().json::<Value>().await.unwrap() };
    let queued = |s: &Value| s["engine"]["num_requests_waiting"].as_u64() > Some(1000);
    let seen = eventually(Duration::from_secs(5), status, queued).await;
    assert!(seen["engine"]["num_requests_waiting"].as_u64() > Some(1000), "the step's rollouts are queued: {seen}");
    let (st, out) = post(&base, &format!("/v1/train/jobs/{id}/stop"), json!({})).await;
    assert_eq!(st, 200, "{out}");
    let url = format!("{base}/v1/train/jobs/{id}");
    let job = eventually(Duration::from_secs(20), async || get_json(&url).await, |j| j["status"] == "stopped").await;
    assert_eq!((&job["status"], &job["step"]), (&json!("stopped"), &json!(0)), "{job}");
    let idle = |now: &Value| engine(now) == (json!(0), json!(0)) && now["engine"]["kv_cache_usage"] == 0.0;
    let now = eventually(Duration::from_secs(5), status, idle).await;
    assert_eq!(engine(&now), (json!(0), json!(0)), "the aborted requests left the engine: {now}");
    assert_eq!(now["engine"]["kv_cache_usage"], 0.0, "and freed their KV blocks: {now}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// A stop that comes while the learner waits for its next batch (the rollouts being
/// generated are aborted, so that batch never arrives) still saves the last step trained as
/// the run's last checkpoint. Generation dominates here (128 sequences of up to 100 tokens,
/// 2 at a time, against a tiny learner step), so the stop lands during step 2's rollouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_between_steps_saves_the_last_step_trained() {
    let dir = tiny("rl-stop-between", 85);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let mut a = ServeArgs { jobs_dir: dir.clone(), ..ServeArgs::default() };
    a.engine.max_num_seqs = 2;
    let (s, base) = start_server(dir.clone(), a).await;
    let job = json!({"dataset": data, "apply_chat_template": false, "num_generations": 8, "prompts_per_step": 16,
                     "max_steps": 1000, "save_steps": 0, "output_dir": "out",
                     "rewards": [{"type": "length", "target": 2}], "learner": {"max_completion_length": 100}});
    let (st, out) = post(&base, "/v1/train/jobs", job).await;
    assert_eq!(st, 201, "{out}");
    let url = format!("{base}/v1/train/jobs/{}", out["id"].as_str().unwrap());
    eventually(Duration::from_secs(120), async || get_json(&url).await, |j| j["step"].as_u64() >= Some(1)).await;
    let (st, out) = post(&base, &format!("{url}/stop").replace(&base, ""), json!({})).await;
    assert_eq!(st, 200, "{out}");
    let job = eventually(Duration::from_secs(120), async || get_json(&url).await, |j| j["status"] == "stopped").await;
    let step = job["step"].as_u64().unwrap();
    assert_eq!(job["status"], "stopped", "{job}");
    assert!(step >= 1, "{job}");
    let saved: Vec<u64> = tests::checkpoint_steps(&dir.join("out")).into_iter().map(|(s, _)| s).collect();
    assert_eq!(saved, [step], "the last step trained is saved");
    s.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_job_gets_409_while_one_runs() {
    let dir = tiny("rl-busy", 81);
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n").unwrap();
    let (s, base) = start_server(dir.clone(), ServeArgs { jobs_dir: dir.clone(), ..ServeArgs::default() }).await;
    let job = |out: &str| {
        json!({"dataset": data, "apply_chat_template": false, "num_generations": 2, "prompts_per_step": 1,
               "max_steps": 100000, "output_dir": out, "rewards": [{"type": "length", "target": 2}],
               "learner": {"max_completion_length": 2}})
    };
    let (st, first) = post(&base, "/v1/train/jobs", job("a")).await;
    assert_eq!(st, 201, "{first}");
    let (st, out) = post(&base, "/v1/train/jobs", job("b")).await;
    assert_eq!(st, 409, "{out}");
    assert!(dir.join("a").is_dir() && !dir.join("b").exists(), "a refused job creates nothing");
    assert!(out["error"]["message"].as_str().unwrap().contains("already updating the weights"), "{out}");
    let id = first["id"].as_str().unwrap();
    let (st, out) = post(&base, &format!("/v1/train/jobs/{id}/stop"), json!({})).await;
    assert_eq!(st, 200, "{out}");
    let url = format!("{base}/v1/train/jobs/{id}");
    let status = eventually(Duration::from_secs(20), async || get_json(&url).await, |s| s["status"] == "stopped").await;
    assert_eq!(status["status"], "stopped", "{status}");
    let r = reqwest::get(format!("{base}/v1/train/jobs/{id}/plot")).await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.bytes().await.unwrap().starts_with(b"\x89PNG"));
    // The slot is free again.
    let (st, second) = post(&base, "/v1/train/jobs", job("b")).await;
    assert_eq!(st, 201, "{second}");
    let (st, _) = post(&base, &format!("/v1/train/jobs/{}/stop", second["id"].as_str().unwrap()), json!({})).await;
    assert_eq!(st, 200);
    let list: Value = reqwest::get(format!("{base}/v1/train/jobs")).await.unwrap().json().await.unwrap();
    assert_eq!(list["data"].as_array().unwrap().len(), 2, "{list}");
    s.shutdown(Duration::from_secs(5)).await;
}

/// A rated answer that ended at a stop string trains on the tokens the policy generated,
/// through the token that completed the stop string, as vLLM returns `token_ids` and TRL and
/// verl train on them: the stop is the policy's end-of-answer action, like EOS, and cutting
/// it would teach the model answers that never end. The user rated the text without it (the
/// API's text), and the sample is marked `finish_reason: "stop"`, so it is never treated as
/// truncated. Checked on the default model: the same seeded request without and with a stop
/// string taken from its own text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rating_of_an_answer_cut_at_a_stop_string_trains_the_tokens_generated() {
    let log = temp_dir("rl-feedback-stop-log");
    let (s, base) = start_server(tests::default_model(), feedback_args(&log, 4)).await;
    let body = json!({"prompt": "My three favourite fruits are", "max_tokens": 16, "seed": 9, "temperature": 1.0,
                      "return_token_ids": true});
    let (_, full) = post(&base, "/v1/completions", body.clone()).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    // A word from the middle of the answer.
    let stop = text.split_whitespace().nth(2).unwrap_or_else(|| panic!("a longer answer: {text:?}")).to_string();
    let mut with_stop = body.clone();
    with_stop["stop"] = json!([stop]);
    let (_, cut) = post(&base, "/v1/completions", with_stop).await;
    let choice = &cut["choices"][0];
    assert_eq!(choice["finish_reason"], "stop", "{cut}");
    let shown = choice["text"].as_str().unwrap();
    assert_eq!(shown, &text[..text.find(&stop).unwrap()], "the text ends before the stop string");
    let ids: Vec<u64> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    let all: Vec<u64> = serde_json::from_value(full["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(ids[..], all[..ids.len()], "the same draws up to the stop");
    let (_, decoded) = post(&base, "/detokenize", json!({"tokens": ids})).await;
    assert!(decoded["prompt"].as_str().unwrap().contains(&stop), "the tokens hold the stop string: {decoded}");
    let (st, out) = post(&base, "/v1/feedback", json!({"id": cut["id"], "choice": 0, "reward": 1.0})).await;
    assert_eq!(st, 200, "{out}");
    s.shutdown(Duration::from_secs(5)).await;
    let line: Value =
        serde_json::from_str(std::fs::read_to_string(log.join("feedback.jsonl")).unwrap().trim()).unwrap();
    let sample = &line["choices"][0];
    assert_eq!(sample["completion_ids"], json!(ids), "the trained tokens are the ones generated: {line}");
    assert_eq!(sample["finish_reason"], "stop");
}
