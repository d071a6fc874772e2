//! PPO's critic: a linear value head `V = h · wᵀ + b` on the final hidden state `h` (after
//! the last RMSNorm, [`crate::SeqForward::hidden`]) of every row that predicts a completion
//! token, as TRL's `AutoModelForCausalLMWithValueHead`: the critic shares the policy's
//! trunk, and the value loss reaches the trunk through `dL/dh`
//! ([`crate::OutputGrads::dl_dhidden`]).
//!
//! The head belongs to the learner, not to the served model: it is trained by the same
//! AdamW step (its own keys, [`HeadParam`], in the optimizer state and in the gradient
//! norm; named [`WEIGHT`] and [`BIAS`] in files) and saved beside the model in a checkpoint as [`FILE`].

use crate::error::{LearnerError, Result};
use crate::Grads;
use kernels::{ops, Device, Tensor};
use std::path::Path;

/// Tensor name of the head's weight `[1, hidden]`.
pub const WEIGHT: &str = "v_head.weight";
/// Tensor name of the head's bias `[1]`.
pub const BIAS: &str = "v_head.bias";
/// The head's file in a checkpoint folder.
pub const FILE: &str = "value_head.safetensors";

/// One of the head's tensors (its part of [`crate::ParamKey`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HeadParam {
    /// `[1, hidden]`.
    Weight,
    /// `[1]`.
    Bias,
}

impl HeadParam {
    /// The tensor's name in files ([`WEIGHT`], [`BIAS`]).
    pub fn name(self) -> &'static str {
        match self {
            HeadParam::Weight => WEIGHT,
            HeadParam::Bias => BIAS,
        }
    }
}

/// The value head's parameters, on the model's device.
#[derive(Debug, Clone)]
pub struct ValueHead {
    /// `[1, hidden]`.
    pub weight: Tensor,
    /// `[1]`.
    pub bias: Tensor,
}

impl ValueHead {
    /// A head that predicts 0 everywhere (zero weight and bias).
    pub fn zeros(hidden: usize, device: &Device) -> Result<Self> {
        Ok(Self { weight: Tensor::zeros(&[1, hidden], device)?, bias: Tensor::zeros(&[1], device)? })
    }

    /// Loads [`WEIGHT`] and [`BIAS`] from `path`: a checkpoint folder (its [`FILE`]) or a
    /// safetensors file. Shapes are checked against `hidden`.
    pub fn load(path: &Path, hidden: usize, device: &Device) -> Result<Self> {
        let file = if path.is_dir() { path.join(FILE) } else { path.to_path_buf() };
        let bytes = engine::files::read_bounded(&file, engine::files::MAX_SMALL_FILE_BYTES)
            .map_err(|e| LearnerError::io(&file, e))?;
        let bad = |msg: String| LearnerError::Checkpoint { path: file.clone(), msg };
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("invalid safetensors: {e}")))?;
        let get = |name: &str, shape: &[usize]| -> Result<Tensor> {
            let v = st.tensor(name).map_err(|_| bad(format!("no tensor `{name}`")))?;
            if v.dtype() != safetensors::Dtype::F32 || v.shape() != shape {
                return Err(bad(format!("`{name}` must be F32 {shape:?}, got {:?} {:?}", v.dtype(), v.shape())));
            }
            let data = v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            Ok(Tensor::from_vec(data, shape)?.to_device(device)?)
        };
        Ok(Self { weight: get(WEIGHT, &[1, hidden])?, bias: get(BIAS, &[1])? })
    }

    /// The head's tensors.
    pub fn params(&self) -> [(HeadParam, &Tensor); 2] {
        [(HeadParam::Weight, &self.weight), (HeadParam::Bias, &self.bias)]
    }

    /// `V_i = h_i · wᵀ + b` for every row of `hidden [N, hidden]`.
    pub fn values(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        Ok(ops::matmul_t(hidden, &self.weight, Some(&self.bias))?.to_vec()?)
    }

    /// Backward of [`Self::values`] for `dL/dV` per row: adds `dL/dw = dVᵀ · h` and
    /// `dL/db = Σ dV` to `grads` under [`WEIGHT`] / [`BIAS`] and returns `dL/dh = dV · w`
    /// `[N, hidden]` for the trunk.
    pub fn backward(&self, hidden: &Tensor, dl_dv: &[f32], grads: &mut Grads) -> Result<Tensor> {
        let n = dl_dv.len();
        let dv = Tensor::from_vec(dl_dv.to_vec(), &[n, 1])?.to_device(&hidden.device())?;
        grads.add(HeadParam::Weight, ops::linear_grad_weight(&dv, hidden)?)?;
        grads.add(HeadParam::Bias, ops::sum_rows(&dv)?)?;
        let w_t = self.weight.clone().reshape(&[self.weight.len(), 1])?;
        Ok(ops::matmul_t(&dv, &w_t, None)?)
    }

    /// `p ← decay·p + Δ` for the head's tensors with AdamW's deltas (taken from `take`).
    pub fn apply(&mut self, decay: f32, take: &mut dyn FnMut(HeadParam) -> Option<Tensor>) -> Result<()> {
        for (part, p) in [(HeadParam::Weight, &mut self.weight), (HeadParam::Bias, &mut self.bias)] {
            if let Some(d) = take(part) {
                ops::scale_add_inplace(p, decay, &d)?;
            }
        }
        Ok(())
    }
}
