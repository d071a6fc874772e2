//! Checkpoints: `model.safetensors` with HF names (loadable by the engine and by
//! transformers, with the model's `config.json` and tokenizer files copied beside it),
//! `optimizer.safetensors` (AdamW moments `exp_avg.<name>`, `exp_avg_sq.<name>`) and
//! `trainer_state.json` (optimizer step, policy version, and whatever the caller adds: a
//! job's RNG and dataset position), and for PPO `value_head.safetensors` (`v_head.weight`,
//! `v_head.bias`: the learner's critic, not part of the served model). Written into `<dir>.partial`, synced, then renamed over
//! `<dir>`: a crash never leaves a half-written checkpoint under the final name.

use super::algos::value_head::{self, ValueHead};
use super::optim::AdamW;
use crate::error::{LearnerError, Result};
pub use engine::model::write_f32_safetensors as write_tensors;
use engine::Model;
use kernels::{Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// Saves the model's weights (HF names), the optimizer state and `state` (merged into
/// `{"step", "version"}`) to `dir`, copying the config and tokenizer files from `source`
/// (the model folder). Hold a read guard on a shared model while calling.
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
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| LearnerError::io(&tmp, e))?;
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        if source.join(f).exists() {
            std::fs::copy(source.join(f), tmp.join(f)).map_err(|e| LearnerError::io(source.join(f), e))?;
        }
    }
    write_named(&tmp.join("model.safetensors"), model.named_weights()?.iter().map(|(n, t)| (n.clone(), t)))?;
    if let Some(head) = value_head {
        write_named(&tmp.join(value_head::FILE), head.named().into_iter())?;
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
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| LearnerError::io(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| LearnerError::io(dir, e))?;
    // The rename itself is durable once the parent directory is synced.
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        let _ = std::fs::File::open(parent).and_then(|f| f.sync_all());
    }
    Ok(())
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
    serde_json::from_str(&std::fs::read_to_string(&sp).map_err(|e| LearnerError::io(&sp, e))?)
        .map_err(|e| LearnerError::Checkpoint { path: sp, msg: format!("invalid JSON: {e}") })
}

/// Loads the AdamW state saved by [`save`] onto `device`.
pub fn load_optimizer(dir: &Path, device: &Device) -> Result<AdamW> {
    let path = dir.join("optimizer.safetensors");
    let bytes = std::fs::read(&path).map_err(|e| LearnerError::io(&path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| LearnerError::Checkpoint { path: path.clone(), msg: format!("invalid safetensors file: {e}") })?;
    let mut opt = AdamW::default();
    for (name, view) in st.tensors() {
        let v: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let v = Tensor::from_vec(v, view.shape())?.to_device(device)?;
        if let Some(n) = name.strip_prefix("exp_avg_sq.") {
            opt.v.insert(n.to_string(), v);
        } else if let Some(n) = name.strip_prefix("exp_avg.") {
            opt.m.insert(n.to_string(), v);
        }
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
