//! Checkpoints: `model.safetensors` with HF names (loadable by the engine and by
//! transformers, with the model's `config.json` and tokenizer files copied beside it),
//! `optimizer.safetensors` (AdamW moments `exp_avg.<name>`, `exp_avg_sq.<name>`),
//! `trainer_state.json` (optimizer step, policy version, and whatever the caller adds: a
//! job's RNG and dataset position), for PPO `value_head.safetensors` (`v_head.weight`,
//! `v_head.bias`: the learner's critic, not part of the served model), and the marker
//! [`MARKER`]. Written into `<dir>.partial` (marker first), every file and the folder
//! synced, then renamed over
//! `<dir>`: a crash never leaves a half-written checkpoint under the final name.
//!
//! Nothing rlserve did not write is ever deleted: a folder is replaced (or pruned) only
//! when it is empty or holds rlserve's checkpoint files and nothing else, and then only
//! those files are removed, by name, before the empty folder itself ([`remove`]).

use super::algos::value_head::{self, ValueHead};
use super::optim::AdamW;
use crate::error::{LearnerError, Result};
use crate::ParamKey;
pub use engine::model::write_f32_safetensors as write_tensors;
use engine::Model;
use kernels::{Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The file that marks a folder as an rlserve checkpoint.
pub const MARKER: &str = "rlserve_checkpoint.json";

/// The model folder's files a checkpoint copies.
const COPIED: [&str; 5] =
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"];

/// Every file name a checkpoint may hold.
const FILES: [&str; 10] = [
    MARKER,
    value_head::FILE,
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
    "optimizer.safetensors",
    "trainer_state.json",
];

/// `<dir>.partial`: the name with `.partial` appended (never an extension replaced).
pub fn partial_path(dir: &Path) -> PathBuf {
    sibling(dir, ".partial")
}

/// `dir` with `suffix` appended to its name.
fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Whether `dir` may be replaced or removed: it is absent or empty, or it is a checkpoint
/// rlserve wrote (the marker, or — written before the marker existed — `model.safetensors`,
/// `optimizer.safetensors` and `trainer_state.json`) holding no file rlserve does not write.
pub fn check_replaceable(dir: &Path) -> Result<()> {
    let not_ours = |msg: String| Err(LearnerError::NotRlserve { path: dir.to_path_buf(), msg });
    let entries = match std::fs::read_dir(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            return not_ours("it is a file, not a checkpoint folder".into())
        }
        Err(e) => return Err(LearnerError::io(dir, e)),
        Ok(rd) => rd.collect::<std::io::Result<Vec<_>>>().map_err(|e| LearnerError::io(dir, e))?,
    };
    if std::fs::symlink_metadata(dir).map_err(|e| LearnerError::io(dir, e))?.file_type().is_symlink() {
        return not_ours("it is a symbolic link".into());
    }
    let mut names = vec![];
    for e in &entries {
        let name = e.file_name().to_string_lossy().into_owned();
        let is_file = e.file_type().map_err(|err| LearnerError::io(e.path(), err))?.is_file();
        if !is_file || !FILES.contains(&name.as_str()) {
            return not_ours(format!("it holds `{name}`, which rlserve does not write"));
        }
        names.push(name);
    }
    let has = |f: &str| names.iter().any(|n| n == f);
    let legacy = ["model.safetensors", "optimizer.safetensors", "trainer_state.json"].iter().all(|f| has(f));
    if !names.is_empty() && !has(MARKER) && !legacy {
        return not_ours(format!("it has no {MARKER}"));
    }
    Ok(())
}

/// Removes the checkpoint folder `dir` after [`check_replaceable`]. It is first renamed to
/// `<dir>.old`, so a crash never leaves a half-deleted folder under a checkpoint's name;
/// then its files are removed by name and the empty folder (never a recursive delete).
/// Absent is fine.
pub fn remove(dir: &Path) -> Result<()> {
    check_replaceable(dir)?;
    if !dir.exists() {
        return Ok(());
    }
    let old = sibling(dir, ".old");
    delete_files(&old)?;
    std::fs::rename(dir, &old).map_err(|e| LearnerError::io(dir, e))?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    delete_files(&old)
}

/// Deletes an rlserve checkpoint folder's files by name, then the empty folder.
fn delete_files(dir: &Path) -> Result<()> {
    check_replaceable(dir)?;
    if !dir.exists() {
        return Ok(());
    }
    for f in FILES.iter().filter(|f| **f != MARKER).chain([&MARKER]) {
        match std::fs::remove_file(dir.join(f)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(LearnerError::io(dir.join(f), e)),
            _ => {}
        }
    }
    std::fs::remove_dir(dir).map_err(|e| LearnerError::io(dir, e))
}

/// Completes a [`save`] interrupted while it replaced `dir`: when `dir` is missing and
/// `<dir>.old` holds a complete checkpoint, it is renamed back.
pub fn recover(dir: &Path) -> Result<()> {
    let old = sibling(dir, ".old");
    if !dir.exists() && old.join("trainer_state.json").exists() {
        check_replaceable(&old)?;
        std::fs::rename(&old, dir).map_err(|e| LearnerError::io(dir, e))?;
    }
    Ok(())
}

/// Saves the model's weights (HF names), the optimizer state and `state` (merged into
/// `{"step", "version"}`) to `dir`, copying the config and tokenizer files from `source`
/// (the model folder). Hold a read guard on a shared model while calling. An existing `dir`
/// (or `<dir>.partial`) that is not an rlserve checkpoint is an error, and nothing is
/// deleted.
pub fn save(dir: &Path, source: &Path, model: &Model, opt: &AdamW, state: serde_json::Value) -> Result<()> {
    save_with(dir, source, model, opt, None, state)
}

/// [`save`] for a trainer: its optimizer state and, for PPO, its value head.
pub fn save_trainer(
    dir: &Path,
    source: &Path,
    model: &Model,
    trainer: &crate::Trainer,
    state: serde_json::Value,
) -> Result<()> {
    save_with(dir, source, model, &trainer.optimizer, trainer.value_head.as_ref(), state)
}

fn save_with(
    dir: &Path,
    source: &Path,
    model: &Model,
    opt: &AdamW,
    value_head: Option<&ValueHead>,
    state: serde_json::Value,
) -> Result<()> {
    check_replaceable(dir)?;
    let tmp = partial_path(dir);
    remove(&tmp)?;
    std::fs::create_dir_all(&tmp).map_err(|e| LearnerError::io(&tmp, e))?;
    let copied: Vec<&str> = COPIED.into_iter().filter(|f| source.join(f).exists()).collect();
    let mut files: Vec<&str> = copied.clone();
    files.extend(["model.safetensors", "optimizer.safetensors", "trainer_state.json"]);
    if value_head.is_some() {
        files.push(value_head::FILE);
    }
    // The marker first: a folder left by a crash is recognisably rlserve's.
    let marker = serde_json::json!({"format": "rlserve checkpoint", "files": files});
    write_synced(&tmp.join(MARKER), marker.to_string().as_bytes())?;
    sync_dir(&tmp)?;
    for f in copied {
        std::fs::copy(source.join(f), tmp.join(f)).map_err(|e| LearnerError::io(source.join(f), e))?;
    }
    write_named(&tmp.join("model.safetensors"), model.named_weights()?.iter().map(|(n, t)| (n.clone(), t)))?;
    if let Some(head) = value_head {
        write_named(&tmp.join(value_head::FILE), head.params().into_iter().map(|(p, t)| (p.name().to_string(), t)))?;
    }
    let moments = opt.m.iter().map(|(n, t)| (format!("exp_avg.{n}"), t));
    write_named(
        &tmp.join("optimizer.safetensors"),
        moments.chain(opt.v.iter().map(|(n, t)| (format!("exp_avg_sq.{n}"), t))),
    )?;
    let mut st = serde_json::json!({ "step": opt.step, "version": model.version });
    if let (Some(o), serde_json::Value::Object(extra)) = (st.as_object_mut(), state) {
        o.extend(extra);
    }
    write_synced(&tmp.join("trainer_state.json"), st.to_string().as_bytes())?;
    for f in &files {
        sync_file(&tmp.join(f))?;
    }
    sync_dir(&tmp)?;
    // An existing checkpoint is swapped out by renames (to `<dir>.old`, which [`recover`]
    // puts back after a crash between them), so `dir` is always absent or complete.
    let old = sibling(dir, ".old");
    let replacing = dir.exists();
    if replacing {
        delete_files(&old)?;
        std::fs::rename(dir, &old).map_err(|e| LearnerError::io(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| LearnerError::io(dir, e))?;
    // The renames are durable once the parent directory is synced.
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    if replacing {
        delete_files(&old)?;
    }
    Ok(())
}

fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| LearnerError::io(path, e))
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(|e| LearnerError::io(dir, e))
}

/// Writes named tensors (copied to the host) as one f32 safetensors file.
pub fn write_named<'a>(path: &Path, tensors: impl Iterator<Item = (String, &'a Tensor)>) -> Result<()> {
    let host = tensors.map(|(n, t)| Ok((n, (t.shape().to_vec(), t.to_vec()?)))).collect::<Result<BTreeMap<_, _>>>()?;
    let view = host.iter().map(|(n, (s, v))| (n.clone(), (s.clone(), v.as_slice()))).collect();
    Ok(write_tensors(path, &view)?)
}

/// Writes `bytes` to `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| LearnerError::io(path, e))?;
    f.write_all(bytes).and_then(|_| f.sync_all()).map_err(|e| LearnerError::io(path, e))
}

/// The `trainer_state.json` saved by [`save`].
pub fn load_state(dir: &Path) -> Result<serde_json::Value> {
    let sp = dir.join("trainer_state.json");
    let text = engine::files::read_bounded_string(&sp, engine::files::MAX_SMALL_FILE_BYTES)
        .map_err(|e| LearnerError::io(&sp, e))?;
    serde_json::from_str(&text).map_err(|e| LearnerError::Checkpoint { path: sp, msg: format!("invalid JSON: {e}") })
}

/// Loads the AdamW state saved by [`save`] onto `device`.
pub fn load_optimizer(dir: &Path, device: &Device) -> Result<AdamW> {
    let path = dir.join("optimizer.safetensors");
    let bytes = engine::files::read_bounded(&path, engine::files::MAX_CHECKPOINT_BYTES)
        .map_err(|e| LearnerError::io(&path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| LearnerError::Checkpoint { path: path.clone(), msg: format!("invalid safetensors file: {e}") })?;
    let bad = |msg: String| LearnerError::Checkpoint { path: path.clone(), msg };
    let mut opt = AdamW::default();
    for (name, view) in st.tensors() {
        let (moments, param) = match (name.strip_prefix("exp_avg_sq."), name.strip_prefix("exp_avg.")) {
            (Some(p), _) => (&mut opt.v, p),
            (None, Some(p)) => (&mut opt.m, p),
            _ => return Err(bad(format!("`{name}` is neither `exp_avg.<parameter>` nor `exp_avg_sq.<parameter>`"))),
        };
        let key = ParamKey::parse(param).ok_or_else(|| bad(format!("`{name}`: `{param}` is not a parameter name")))?;
        let v: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        moments.insert(key, Tensor::from_vec(v, view.shape())?.to_device(device)?);
    }
    opt.step = load_state(dir)?["step"].as_u64().unwrap_or(0);
    Ok(opt)
}

/// The value head saved by [`save_trainer`] in `dir`, if the checkpoint has one.
pub fn load_value_head(dir: &Path, hidden: usize, device: &Device) -> Result<Option<ValueHead>> {
    let path = dir.join(value_head::FILE);
    if !path.exists() {
        return Ok(None);
    }
    ValueHead::load(&path, hidden, device).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Moments are read back under their typed keys; a moment whose name is no parameter's is
    /// a load error naming it (it used to be kept under its string, never stepped).
    #[test]
    fn optimizer_moments_load_by_parameter_key() {
        let dir = std::env::temp_dir().join(format!("rlserve-optimizer-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("trainer_state.json"), r#"{"step": 3}"#).unwrap();
        let write = |names: &[&str]| {
            let one = [0.5f32];
            let t: BTreeMap<String, (Vec<usize>, &[f32])> =
                names.iter().map(|n| (n.to_string(), (vec![1], &one[..]))).collect();
            write_tensors(&dir.join("optimizer.safetensors"), &t).unwrap();
        };
        write(&["exp_avg.model.norm.weight", "exp_avg_sq.model.norm.weight", "exp_avg.v_head.bias"]);
        let opt = load_optimizer(&dir, &Device::Cpu).unwrap();
        let norm = ParamKey::Model(engine::model::ParamId::model(engine::model::ParamKind::FinalNorm));
        let head = ParamKey::ValueHead(value_head::HeadParam::Bias);
        assert_eq!(
            (opt.step, opt.m.keys().collect::<Vec<_>>(), opt.v.keys().collect::<Vec<_>>()),
            (3, vec![&norm, &head], vec![&norm])
        );
        for (name, why) in [
            (
                "exp_avg.model.layers.0.mlp.gate_proj.bias",
                "`model.layers.0.mlp.gate_proj.bias` is not a parameter name",
            ),
            ("momentum.model.norm.weight", "is neither `exp_avg.<parameter>` nor `exp_avg_sq.<parameter>`"),
        ] {
            write(&[name]);
            let e = load_optimizer(&dir, &Device::Cpu).unwrap_err().to_string();
            assert!(e.contains(name) && e.contains(why), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
