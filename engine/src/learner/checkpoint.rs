//! Checkpoints: `model.safetensors` with HF names (loadable by the engine and by
//! transformers, with the model's `config.json` and tokenizer files copied beside it),
//! `optimizer.safetensors` (AdamW moments `exp_avg.<name>`, `exp_avg_sq.<name>`) and
//! `trainer_state.json` (step). Written into `<dir>.partial`, synced, then renamed over
//! `<dir>`: a crash never leaves a half-written checkpoint under the final name.

use super::optim::AdamW;
use crate::error::{ModelError, Result};
pub use crate::model::write_f32_safetensors as write_tensors;
use std::collections::BTreeMap;
use std::path::Path;

/// Saves weights (with `shapes` by name), optimizer state and step to `dir`, copying the
/// config and tokenizer files from `source` (the model folder).
pub fn save(
    dir: &Path,
    source: &Path,
    params: &BTreeMap<String, Vec<f32>>,
    shapes: &BTreeMap<String, Vec<usize>>,
    opt: &AdamW,
) -> Result<()> {
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        if source.join(f).exists() {
            std::fs::copy(source.join(f), tmp.join(f)).map_err(|e| ModelError::io(source.join(f), e))?;
        }
    }
    let w: BTreeMap<String, (Vec<usize>, &[f32])> =
        params.iter().map(|(n, v)| (n.clone(), (shapes[n].clone(), v.as_slice()))).collect();
    write_tensors(&tmp.join("model.safetensors"), &w)?;
    let mut o: BTreeMap<String, (Vec<usize>, &[f32])> = BTreeMap::new();
    for (n, v) in &opt.m {
        o.insert(format!("exp_avg.{n}"), (shapes[n].clone(), v.as_slice()));
    }
    for (n, v) in &opt.v {
        o.insert(format!("exp_avg_sq.{n}"), (shapes[n].clone(), v.as_slice()));
    }
    write_tensors(&tmp.join("optimizer.safetensors"), &o)?;
    let state = serde_json::json!({ "step": opt.step });
    std::fs::write(tmp.join("trainer_state.json"), state.to_string()).map_err(|e| ModelError::io(&tmp, e))?;
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))
}

/// Loads the AdamW state saved by [`save`].
pub fn load_optimizer(dir: &Path) -> Result<AdamW> {
    let path = dir.join("optimizer.safetensors");
    let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| ModelError::Safetensors { path: path.clone(), msg: e.to_string() })?;
    let mut opt = AdamW::default();
    for (name, view) in st.tensors() {
        let v: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        if let Some(n) = name.strip_prefix("exp_avg_sq.") {
            opt.v.insert(n.to_string(), v);
        } else if let Some(n) = name.strip_prefix("exp_avg.") {
            opt.m.insert(n.to_string(), v);
        }
    }
    let sp = dir.join("trainer_state.json");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&sp).map_err(|e| ModelError::io(&sp, e))?)
            .map_err(|source| ModelError::Json { path: sp, source })?;
    opt.step = state["step"].as_u64().unwrap_or(0);
    Ok(opt)
}
