//! `kill -9` durability, on a server in a child process (this test binary run as
//! `crash::child_server`): killed while ratings arrive and the feedback learner steps and
//! checkpoints, no acknowledged rating is missing from the log or from the restarted
//! server (it answers 409 "already rated"), the log takes new ratings after a torn last
//! line, and the policy version never goes back; killed while a job checkpoints every step,
//! every `checkpoint-<step>` folder is complete and loads, and the resumed job's version is
//! above every version served before.

use serde_json::{json, Value};
use server::serve::{build_state, ServeArgs, Server};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tests::tiny::TinySpec;
use tests::{eventually, get_json, temp_dir};

/// The child: serves `spec` (`model`, `addr_file`, optional `feedback_dir`) until killed.
#[test]
#[ignore = "the child process of the kill -9 tests; does nothing unless RLSERVE_CRASH_CHILD is set"]
fn child_server() {
    let Ok(spec) = std::env::var("RLSERVE_CRASH_CHILD") else { return };
    let spec: Value = serde_json::from_str(&spec).unwrap();
    let mut a = ServeArgs::default();
    if let Some(j) = spec["jobs_dir"].as_str() {
        a.jobs_dir = j.into();
    }
    if let Some(fb) = spec["feedback_dir"].as_str() {
        a.feedback.learn_from_feedback = true;
        a.feedback.feedback_dir = fb.into();
        a.feedback.feedback_batch_size = 2;
        a.feedback.feedback_save_steps = 1;
        a.feedback.feedback_window = 4096;
        a.feedback.learning_rate = Some(1e-2);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let model = PathBuf::from(spec["model"].as_str().unwrap());
        let state = tokio::task::spawn_blocking(move || build_state(&model, &a)).await.unwrap().unwrap();
        let s = Server::start(state, "127.0.0.1", 0).await.unwrap();
        let file = PathBuf::from(spec["addr_file"].as_str().unwrap());
        std::fs::write(file.with_extension("tmp"), s.addr.to_string()).unwrap();
        std::fs::rename(file.with_extension("tmp"), &file).unwrap();
        std::future::pending::<()>().await;
    });
}

/// A child server process and its base URL.
struct Child9 {
    child: Child,
    base: String,
}

impl Child9 {
    async fn start(dir: &Path, model: &Path, feedback: Option<&Path>) -> Self {
        let addr_file = dir.join("addr");
        let _ = std::fs::remove_file(&addr_file);
        let spec = json!({"model": model, "addr_file": addr_file, "feedback_dir": feedback, "jobs_dir": dir});
        let log = std::fs::File::create(dir.join("child.log")).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "crash::child_server", "--nocapture", "--test-threads", "1"])
            .env("RLSERVE_CRASH_CHILD", spec.to_string())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let addr =
            eventually(Duration::from_secs(30), async || std::fs::read_to_string(&addr_file).ok(), Option::is_some);
        let Some(addr) = addr.await else {
            panic!("the child server did not start: {}", std::fs::read_to_string(dir.join("child.log")).unwrap())
        };
        Self { child, base: format!("http://{addr}") }
    }

    /// SIGKILL, and reap.
    fn kill9(self) {
        drop(self);
    }
}

/// A failing test never leaves its child behind.
impl Drop for Child9 {
    fn drop(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }
}

async fn post(base: &str, path: &str, body: Value) -> Result<(u16, Value), reqwest::Error> {
    let r = reqwest::Client::new().post(format!("{base}{path}")).json(&body).send().await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// The version of a fresh sampled token (asks the server).
async fn served_version(base: &str) -> Option<u64> {
    let body = json!({"prompt": "ab", "max_tokens": 1, "return_token_ids": true});
    let (_, out) = post(base, "/v1/completions", body).await.ok()?;
    out["choices"][0]["versions"][0].as_u64()
}

fn tiny(name: &str) -> (PathBuf, PathBuf) {
    let dir = temp_dir(name);
    let model = dir.join("model");
    TinySpec { seed: 91, ..Default::default() }.write(&model);
    (dir, model)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_ratings_arrive_loses_no_acknowledged_rating() {
    let (dir, model) = tiny("crash-feedback");
    let fb = dir.join("feedback");
    let server = Child9::start(&dir, &model, Some(&fb)).await;
    let base = server.base.clone();
    let mut ids = vec![];
    for i in 0..80 {
        let body = json!({"prompt": format!("q{i}"), "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": i});
        let (st, out) = post(&base, "/v1/completions", body).await.unwrap();
        assert_eq!(st, 200, "{out}");
        ids.push(out["id"].as_str().unwrap().to_string());
    }
    // Raters, and a watcher of the served version; the kill lands after 24 acknowledged.
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let max_seen = Arc::new(AtomicU64::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let raters: Vec<_> = ids
        .chunks(10)
        .map(|chunk| {
            let (chunk, acked, base) = (chunk.to_vec(), acked.clone(), base.clone());
            tokio::spawn(async move {
                for (k, id) in chunk.iter().enumerate() {
                    let body = if k % 2 == 0 {
                        json!({"id": id, "preferred": k % 3 % 2})
                    } else {
                        json!({"id": id, "choice": 0, "reward": 0.5})
                    };
                    match post(&base, "/v1/feedback", body).await {
                        Ok((200, _)) => acked.lock().unwrap().push(id.clone()),
                        Ok((st, out)) => panic!("rating {id}: {st} {out}"),
                        Err(_) => return, // the server is gone
                    }
                }
            })
        })
        .collect();
    let watcher = {
        let (base, max_seen, killed) = (base.clone(), max_seen.clone(), killed.clone());
        tokio::spawn(async move {
            while !killed.load(Ordering::SeqCst) {
                if let Some(v) = served_version(&base).await {
                    max_seen.fetch_max(v, Ordering::SeqCst);
                }
            }
        })
    };
    while acked.lock().unwrap().len() < 24 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    killed.store(true, Ordering::SeqCst);
    server.kill9();
    for r in raters {
        r.await.unwrap();
    }
    watcher.await.unwrap();
    let acked = acked.lock().unwrap().clone();
    let before = max_seen.load(Ordering::SeqCst);

    // Every acknowledged rating is in the log (a torn last line may follow them).
    let text = std::fs::read_to_string(fb.join("feedback.jsonl")).unwrap();
    let logged: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect();
    for id in &acked {
        assert!(logged.contains(id), "acknowledged rating {id} is not in the log");
    }
    // The feedback checkpoint is absent or complete under its final name.
    let ckpt = fb.join("checkpoint");
    if ckpt.exists() {
        learner::checkpoint::check_replaceable(&ckpt).unwrap();
        assert!(engine::Model::load(&ckpt, &kernels::Device::Cpu).is_ok(), "a half-written checkpoint");
    }

    // A kill in the middle of an append leaves a torn line (never acknowledged): made sure
    // of here, whatever the moment of this kill was.
    let mut f = std::fs::OpenOptions::new().append(true).open(fb.join("feedback.jsonl")).unwrap();
    std::io::Write::write_all(&mut f, b"{\"seq\": 999, \"id\": \"cmpl-torn\", \"rat").unwrap();
    drop(f);

    // Restarted: the server knows every acknowledged rating, serves no older version, and
    // appends new ratings on lines of their own.
    let server = Child9::start(&dir, &model, Some(&fb)).await;
    let base = server.base.clone();
    for id in &acked {
        let (st, out) = post(&base, "/v1/feedback", json!({"id": id, "preferred": 0})).await.unwrap();
        assert_eq!(st, 409, "{id} after the restart: {out}");
    }
    let after = served_version(&base).await.unwrap();
    assert!(after >= before, "version went back: {before} served before the kill, {after} after");
    let unrated = ids.iter().find(|id| !logged.contains(id)).expect("some responses were never rated").clone();
    // Not in the restarted window (it was only in memory): 404, and no log damage.
    let (st, _) = post(&base, "/v1/feedback", json!({"id": unrated, "preferred": 0})).await.unwrap();
    assert_eq!(st, 404);
    let body = json!({"prompt": "new", "max_tokens": 2, "n": 2, "temperature": 1.0});
    let (_, out) = post(&base, "/v1/completions", body).await.unwrap();
    let (st, r) = post(&base, "/v1/feedback", json!({"id": out["id"], "preferred": 1})).await.unwrap();
    assert_eq!(st, 200, "{r}");
    let text = std::fs::read_to_string(fb.join("feedback.jsonl")).unwrap();
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).expect("the new rating has a line of its own");
    assert_eq!(last["id"], out["id"]);
    // Killed again, as if before any checkpoint was durable: the base weights are served
    // again, under a version above every one served before.
    let before = served_version(&base).await.unwrap().max(after);
    server.kill9();
    learner::checkpoint::remove(&fb.join("checkpoint")).unwrap();
    let server = Child9::start(&dir, &model, Some(&fb)).await;
    let after = served_version(&server.base).await.unwrap();
    assert!(after > before, "version went back: {before} served before the kill, {after} after");
    server.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_while_a_job_checkpoints_leaves_only_complete_checkpoints() {
    let (dir, model) = tiny("crash-job");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n{\"prompt\": \"xyz\"}\n").unwrap();
    let out = dir.join("job");
    let job = |resume: bool| {
        let mut j = json!({"dataset": data, "apply_chat_template": false, "num_generations": 2, "prompts_per_step": 2,
            "max_steps": 100000, "save_steps": 1, "save_total_limit": 3, "output_dir": "job",
            "rewards": [{"type": "length", "target": 2}], "learner": {"max_completion_length": 3, "learning_rate": 1e-3}});
        if resume {
            j["resume_from_checkpoint"] = json!("latest");
        }
        j
    };
    let server = Child9::start(&dir, &model, None).await;
    let (st, created) = post(&server.base, "/v1/train/jobs", job(false)).await.unwrap();
    assert_eq!(st, 201, "{created}");
    let served = async || served_version(&server.base).await.unwrap_or(0);
    let before = eventually(Duration::from_secs(60), served, |&v| v >= 6).await;
    assert!(before >= 6, "the job did not step");
    server.kill9();

    let mut steps = vec![];
    for (step, p) in tests::checkpoint_steps(&out) {
        let name = p.display();
        learner::checkpoint::check_replaceable(&p).unwrap();
        let state = learner::checkpoint::load_state(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(state["job_step"], json!(step), "{name}");
        assert!(engine::Model::load(&p, &kernels::Device::Cpu).is_ok(), "{name} is half-written");
        learner::checkpoint::load_optimizer(&p, &kernels::Device::Cpu).unwrap();
        steps.push(step);
    }
    assert!(!steps.is_empty(), "no checkpoint survived");
    // Resumed from the latest: no version below one served before the kill.
    let server = Child9::start(&dir, &model, None).await;
    let (st, resumed) = post(&server.base, "/v1/train/jobs", job(true)).await.unwrap();
    assert_eq!(st, 201, "{resumed}");
    let url = format!("{}/v1/train/jobs/{}", server.base, resumed["id"].as_str().unwrap());
    let latest = steps.iter().max().copied();
    let status =
        eventually(Duration::from_secs(10), async || get_json(&url).await, |s| s["step"].as_u64() >= latest).await;
    let resumed_version = status["version"].as_u64().unwrap();
    let after = served_version(&server.base).await.unwrap();
    assert!(
        resumed_version >= before && after >= before,
        "version went back: {before} before the kill; the resumed job at {resumed_version}, serving {after}"
    );
    server.kill9();
}
