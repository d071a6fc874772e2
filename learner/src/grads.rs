//! Gradients by HF tensor name, accumulated across sequences, on the model's device.

use crate::Result;
use kernels::{ops, Tensor};
use std::collections::BTreeMap;

#[derive(Debug, Default, Clone)]
pub struct Grads {
    /// HF name → gradient, shaped like the HF weight.
    pub tensors: BTreeMap<String, Tensor>,
    /// Wall-clock seconds the backward passes that produced them took.
    pub backward_seconds: f64,
}

impl Grads {
    /// Adds `g` to the gradient of `name` (taken as is the first time).
    pub fn add(&mut self, name: &str, g: Tensor) -> Result<()> {
        match self.tensors.get_mut(name) {
            Some(acc) => ops::add_inplace(acc, &g)?,
            None => {
                self.tensors.insert(name.to_string(), g);
            }
        }
        Ok(())
    }

    /// Adds row `i` of `src` to row `rows[i]` of the gradient of `name` (zeros of `shape`
    /// the first time): an embedding's gradient without a dense `[vocab, hidden]` temporary.
    pub fn scatter_add_rows(
        &mut self,
        name: &str,
        shape: &[usize],
        rows: &kernels::Indices,
        src: &Tensor,
    ) -> Result<()> {
        if !self.tensors.contains_key(name) {
            self.tensors.insert(name.to_string(), Tensor::zeros(shape, &src.device())?);
        }
        let acc = self.tensors.get_mut(name).expect("inserted");
        ops::scatter_add_rows(acc, rows, src)?;
        Ok(())
    }

    /// `sqrt(Σ g²)` over every tensor (before clipping), accumulated in f64.
    pub fn global_norm(&self) -> Result<f64> {
        Ok(ops::sum_squares_all(&self.tensors.values().collect::<Vec<_>>())?.sqrt())
    }
}
