//! Checkpoint folders: `POST /v1/checkpoints` only under `--checkpoint-dir`, paths that leave
//! it (`..`, absolute, symbolic links) and existing folders rlserve did not write are a 400
//! and stay untouched; an rlserve checkpoint is replaced; a crash's `.partial` leftover is
//! cleared only when it is rlserve's; nothing is deleted recursively.

use learner::checkpoint::{check_replaceable, partial_path, remove, MARKER};
use serde_json::{json, Value};
use server::serve::ServeArgs;
use std::path::Path;
use std::time::Duration;
use tests::temp_dir;

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_checkpoints_stay_under_the_root_and_replace_only_their_own() {
    use crate::server::{args, post, start, tiny_dir};
    // Off without --checkpoint-dir.
    let (s, base) = start(tiny_dir("ckpt-off"), args("ckpt-off")).await;
    let (st, e) = post(&base, "/v1/checkpoints", json!({"path": "x"})).await;
    assert_eq!(st, 404, "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("--checkpoint-dir"), "{e}");
    s.shutdown(Duration::from_secs(5)).await;

    let top = temp_dir("ckpt-http");
    let root = top.join("root");
    let outside = top.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let (s, base) =
        start(tiny_dir("ckpt-on"), ServeArgs { checkpoint_dir: Some(root.clone()), ..args("ckpt-on") }).await;
    let (st, r) = post(&base, "/v1/checkpoints", json!({"path": "v1"})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["path"], json!(root.join("v1")));
    let written = names(&root.join("v1"));
    assert!(written.contains(&MARKER.to_string()) && written.contains(&"model.safetensors".to_string()), "{written:?}");
    assert!(engine::Model::load(&root.join("v1"), &kernels::Device::Cpu).is_ok());
    // An rlserve checkpoint is replaced (no `.partial` left behind); nested names work.
    let (st, r) = post(&base, "/v1/checkpoints", json!({"path": "v1"})).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(names(&root.join("v1")), written);
    assert!(!partial_path(&root.join("v1")).exists());
    let (st, r) = post(&base, "/v1/checkpoints", json!({"path": "runs/a/b"})).await;
    assert_eq!((st, r["path"].clone()), (200, json!(root.join("runs/a/b"))), "{r}");
    // Not inside another checkpoint.
    let (st, e) = post(&base, "/v1/checkpoints", json!({"path": "v1/inner"})).await;
    let m = e["error"]["message"].as_str().unwrap_or_default();
    assert_eq!((st, m), (400, "`path` v1/inner is inside the checkpoint v1: choose a path outside it"), "{e}");
    assert_eq!(names(&root.join("v1")), written);
    // The listing: both, by path, at the served version 0.
    let list: Value = reqwest::get(format!("{base}/v1/checkpoints")).await.unwrap().json().await.unwrap();
    let got: Vec<(&str, &Value)> =
        list["data"].as_array().unwrap().iter().map(|c| (c["path"].as_str().unwrap(), &c["version"])).collect();
    assert_eq!(got, [("runs/a/b", &json!(0)), ("v1", &json!(0))], "{list}");

    // Folders that are not rlserve checkpoints: a user's notes, a checkpoint a user added a
    // file to, an HF model folder, a plain file. All 400, all untouched.
    let mine = root.join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "keep me").unwrap();
    std::fs::copy(root.join("v1/model.safetensors"), root.join("runs/a/b/model.safetensors")).unwrap();
    std::fs::write(root.join("runs/a/b/README.md"), "my run").unwrap();
    let hf = root.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(root.join("v1").join(f), hf.join(f)).unwrap();
    }
    std::fs::write(root.join("afile"), "x").unwrap();
    let before = |p: &str| names(&root.join(p));
    let snapshot: Vec<(&str, Vec<String>)> = ["mine", "runs/a/b", "hf"].iter().map(|p| (*p, before(p))).collect();
    for (path, why) in [
        ("mine", "it holds `notes.txt`, which rlserve does not write"),
        ("runs/a/b", "it holds `README.md`, which rlserve does not write"),
        ("hf", "it has no rlserve_checkpoint.json"),
        ("afile", "it is a file"),
    ] {
        let (st, e) = post(&base, "/v1/checkpoints", json!({"path": path})).await;
        let m = e["error"]["message"].as_str().unwrap_or_default();
        assert_eq!((st, e["error"]["param"].as_str()), (400, Some("path")), "{path}: {e}");
        assert!(m.contains("is not an rlserve checkpoint") && m.contains(why), "{path}: {m}");
    }
    for (p, n) in &snapshot {
        assert_eq!(&before(p), n, "{p} untouched");
    }
    assert_eq!(std::fs::read_to_string(mine.join("notes.txt")).unwrap(), "keep me");

    // Paths that leave the root.
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    let abs = outside.join("abs");
    for (path, why) in [
        (json!("../escape"), "leaves it"),
        (json!("a/../../escape"), "leaves it"),
        (json!(abs), "leaves it"),
        (json!("./v1"), "leaves it"),
        (json!(""), "is empty"),
        (json!("link"), "symbolic link"),
        (json!("link/inner"), "symbolic link"),
    ] {
        let (st, e) = post(&base, "/v1/checkpoints", json!({"path": path})).await;
        let m = e["error"]["message"].as_str().unwrap_or_default();
        assert_eq!((st, e["error"]["param"].as_str()), (400, Some("path")), "{path}: {e}");
        assert!(m.contains("must be a folder name relative to --checkpoint-dir") && m.contains(why), "{path}: {m}");
    }
    assert!(names(&outside).is_empty(), "nothing written outside the root: {:?}", names(&outside));
    assert!(!top.join("escape").exists());
    let (st, e) = post(&base, "/v1/checkpoints", json!({"path": 5})).await;
    assert_eq!((st, e["error"]["param"].clone()), (400, Value::from("path")), "{e}");
    s.shutdown(Duration::from_secs(5)).await;
}

#[test]
fn a_partial_folder_or_checkpoint_is_removed_only_when_rlserve_wrote_it() {
    let top = temp_dir("ckpt-remove");
    assert_eq!(partial_path(&top.join("model.v2")), top.join("model.v2.partial"), "appended, not an extension");
    // A crash's leftover: the marker and some files.
    let left = top.join("c.partial");
    std::fs::create_dir_all(&left).unwrap();
    std::fs::write(left.join(MARKER), "{").unwrap();
    std::fs::write(left.join("model.safetensors"), "half").unwrap();
    remove(&left).unwrap();
    assert!(!left.exists());
    // Written before the marker existed: model, optimizer and trainer state.
    let legacy = top.join("legacy");
    std::fs::create_dir_all(&legacy).unwrap();
    for f in ["model.safetensors", "optimizer.safetensors", "trainer_state.json", "config.json"] {
        std::fs::write(legacy.join(f), "x").unwrap();
    }
    check_replaceable(&legacy).unwrap();
    remove(&legacy).unwrap();
    assert!(!legacy.exists());
    // Empty and absent folders are fine; a subfolder, an unknown file or no marker is not.
    let empty = top.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    remove(&empty).unwrap();
    remove(&top.join("absent")).unwrap();
    let nested = top.join("nested");
    std::fs::create_dir_all(nested.join("model.safetensors")).unwrap();
    std::fs::write(nested.join(MARKER), "{}").unwrap();
    let e = remove(&nested).unwrap_err().to_string();
    assert!(e.contains("it holds `model.safetensors`, which rlserve does not write"), "{e}");
    assert!(nested.join("model.safetensors").is_dir() && nested.join(MARKER).exists());
    let user = top.join("user.partial");
    std::fs::create_dir_all(&user).unwrap();
    std::fs::write(user.join("tokenizer.json"), "mine").unwrap();
    let e = remove(&user).unwrap_err().to_string();
    assert!(e.contains("has no rlserve_checkpoint.json"), "{e}");
    assert_eq!(std::fs::read_to_string(user.join("tokenizer.json")).unwrap(), "mine");
}
