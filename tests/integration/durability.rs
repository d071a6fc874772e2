//! Crash safety with `kill -9`: a server process (`rlserve-test-child`) is killed while
//! ratings arrive and its feedback learner checkpoints, and while a training job
//! checkpoints. After a restart on the same folders no acknowledged rating is missing from
//! the log or from the replayed window, no checkpoint folder is half-written, and the policy
//! version never goes back.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tests::temp_dir;
use tests::tiny::TinySpec;

/// A server child process and its base URL.
struct Proc {
    child: Child,
    base: String,
}

impl Proc {
    /// Starts `rlserve-test-child MODEL FEEDBACK` and waits for its address line.
    fn start(model: &Path, feedback: &Path) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rlserve-test-child"))
            .args([model, feedback])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting the server process");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or_else(|| {
            panic!("no address in the server's first line: {line:?}");
        });
        Proc { base: format!("http://{addr}"), child }
    }

    /// SIGKILL: no destructor, no flush, no shutdown handler runs.
    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn post(c: &reqwest::blocking::Client, base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = c.post(format!("{base}{path}")).json(body).send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// The policy version the server reports now.
fn version(c: &reqwest::blocking::Client, base: &str) -> u64 {
    let m = c.get(format!("{base}/metrics")).send().unwrap().text().unwrap();
    let line = m.lines().find(|l| l.starts_with("rlserve:policy_version")).expect("a policy version gauge");
    line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
}

/// A checkpoint folder is complete: its state, weights and optimizer files parse.
fn assert_complete(dir: &Path) {
    let state = learner::checkpoint::load_state(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    assert!(state["version"].is_u64(), "{}: {state}", dir.display());
    engine::Model::load(dir, &kernels::Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    learner::checkpoint::load_optimizer(dir, &kernels::Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
}

fn model(name: &str, seed: u64) -> PathBuf {
    let dir = temp_dir(name);
    TinySpec { seed, ..Default::default() }.write(&dir);
    dir
}

#[test]
fn kill_9_while_ratings_arrive_loses_no_acknowledged_rating() {
    let (dir, fb) = (model("crash-feedback-model", 97), temp_dir("crash-feedback-log"));
    let c = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let mut acknowledged: Vec<String> = vec![];
    let mut last_version = 0;
    for round in 0..3 {
        let p = Proc::start(&dir, &fb);
        let v = version(&c, &p.base);
        assert!(v >= last_version, "round {round}: version went back from {last_version} to {v}");
        // Every rating acknowledged before the last kill was replayed: rating it again is a
        // duplicate (409), never unknown (404).
        for id in &acknowledged {
            let (st, out) = post(&c, &p.base, "/v1/feedback", &json!({"id": id, "preferred": 0}));
            assert_eq!(st, 409, "round {round}: rating of `{id}` was lost: {out}");
        }
        // Rate groups of two for a while (the learner steps and checkpoints every group),
        // then kill -9 at once, in the middle of it all.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(1500 + 400 * round) {
            let body = json!({"prompt": "ab", "max_tokens": 4, "n": 2, "temperature": 1.0});
            let (st, r) = post(&c, &p.base, "/v1/completions", &body);
            assert_eq!(st, 200, "{r}");
            let id = r["id"].as_str().unwrap().to_string();
            let (st, out) = post(&c, &p.base, "/v1/feedback", &json!({"id": id, "preferred": 1}));
            assert_eq!(st, 200, "{out}");
            acknowledged.push(id);
        }
        last_version = version(&c, &p.base);
        p.kill9();
        // Every acknowledged rating is in the log; the learner's checkpoint is complete or absent.
        let log = std::fs::read_to_string(fb.join("feedback.jsonl")).unwrap();
        for id in &acknowledged {
            assert!(log.contains(&format!("\"{id}\"")), "round {round}: `{id}` missing from the log");
        }
        if fb.join("checkpoint").exists() {
            assert_complete(&fb.join("checkpoint"));
        }
    }
    assert!(last_version > 0, "the feedback learner stepped");
    assert!(acknowledged.len() >= 6, "{} ratings", acknowledged.len());
}

#[test]
fn kill_9_while_a_job_checkpoints_leaves_only_complete_checkpoints() {
    let (dir, fb) = (model("crash-job-model", 98), temp_dir("crash-job-feedback"));
    let out = temp_dir("crash-job-run");
    let c = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();
    let job = |resume: bool| {
        let mut j = json!({"max_steps": 6, "num_generations": 4, "prompts_per_step": 1, "save_steps": 1,
                           "save_total_limit": 10, "output_dir": out, "rewards": [{"type": "length", "target": 2}],
                           "learner": {"max_completion_length": 4, "learning_rate": 1e-2}});
        if resume {
            j["resume_from_checkpoint"] = json!("latest");
        }
        j
    };
    let p = Proc::start(&dir, &fb);
    let (st, r) = post(&c, &p.base, "/v1/train/jobs", &job(false));
    assert_eq!(st, 201, "{r}");
    // Kill as soon as the second checkpoint exists: the learner is writing the third.
    let t0 = Instant::now();
    while !out.join("checkpoint-2").exists() {
        assert!(t0.elapsed() < Duration::from_secs(120), "no second checkpoint");
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed_at = version(&c, &p.base);
    p.kill9();
    let checkpoints = |d: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("checkpoint-"))
            .filter(|p| p.extension().is_none())
            .collect();
        v.sort();
        v
    };
    let before = checkpoints(&out);
    assert!(before.len() >= 2, "{before:?}");
    for ck in &before {
        assert_complete(ck);
    }
    // Resume from the latest checkpoint in a fresh process: the job ends at step 6, its
    // versions continue upward, and every checkpoint is complete.
    let p = Proc::start(&dir, &fb);
    let start = version(&c, &p.base);
    let (st, r) = post(&c, &p.base, "/v1/train/jobs", &job(true));
    assert_eq!(st, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_string();
    let t0 = Instant::now();
    let status = loop {
        let s: Value = c.get(format!("{}/v1/train/jobs/{id}", p.base)).send().unwrap().json().unwrap();
        if s["status"] != "running" {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "the resumed job did not finish: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!((status["status"].as_str(), status["step"].as_u64()), (Some("completed"), Some(6)), "{status}");
    let end = version(&c, &p.base);
    assert!(end > start && end > killed_at.saturating_sub(1), "versions {killed_at} (killed) → {start} → {end}");
    for ck in checkpoints(&out) {
        assert_complete(&ck);
    }
    drop(p);
}
