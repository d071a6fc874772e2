//! Reading tensors from `model.safetensors` or sharded `model-*.safetensors` +
//! `model.safetensors.index.json`. F32, BF16 and F16 are converted to f32 on load.

use crate::error::{ModelError, Result};
use kernels::Tensor;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The safetensors files of one model folder, memory-mapped.
pub struct WeightFiles {
    files: Vec<(PathBuf, Mmap)>,
    /// tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl WeightFiles {
    /// Opens `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let names: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| ModelError::Json { path: index_path.clone(), source })?;
            let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::Config {
                path: index_path.clone(),
                msg: "missing object `weight_map`".into(),
            })?;
            let mut shards: Vec<PathBuf> = map.values().filter_map(|f| f.as_str()).map(|f| dir.join(f)).collect();
            shards.sort();
            shards.dedup();
            shards
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in names {
            let file = std::fs::File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the file is opened read-only; rlserve never writes a model file it is serving
            // (checkpoints are written to a temp file and renamed).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&mmap)
                .map_err(|e| ModelError::Safetensors { path: path.clone(), msg: e.to_string() })?;
            for name in st.names() {
                index.insert(name.to_string(), files.len());
            }
            files.push((path, mmap));
        }
        Ok(Self { files, index })
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Loads `name` as f32, checking it has shape `expected`.
    pub fn load(&self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let Some(&fi) = self.index.get(name) else {
            let path = self.files.first().map(|f| f.0.clone()).unwrap_or_default();
            return Err(ModelError::MissingTensor { path, name: name.into(), expected: expected.to_vec() });
        };
        let (path, mmap) = &self.files[fi];
        let st = SafeTensors::deserialize(mmap)
            .map_err(|e| ModelError::Safetensors { path: path.clone(), msg: e.to_string() })?;
        let view = st.tensor(name).map_err(|e| ModelError::Safetensors { path: path.clone(), msg: e.to_string() })?;
        if view.shape() != expected {
            return Err(ModelError::ShapeMismatch {
                path: path.clone(),
                name: name.into(),
                expected: expected.to_vec(),
                actual: view.shape().to_vec(),
            });
        }
        let bytes = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(ModelError::UnsupportedDtype {
                    path: path.clone(),
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok(Tensor::from_vec(data, expected)?)
    }
}

/// Writes f32 tensors `name → (shape, values)` as one safetensors file (metadata
/// `format: pt`, readable by transformers) and syncs it to disk.
pub fn write_f32_safetensors(
    path: &Path,
    tensors: &std::collections::BTreeMap<String, (Vec<usize>, &[f32])>,
) -> Result<()> {
    use safetensors::tensor::TensorView;
    let err = |msg: String| ModelError::Safetensors { path: path.into(), msg };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, v))| (n.clone(), s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b).map_err(|e| err(e.to_string()))?)))
        .collect::<Result<_>>()?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, &Some(meta), path).map_err(|e| err(e.to_string()))?;
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| ModelError::io(path, e))
}
