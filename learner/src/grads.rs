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

    /// `sqrt(Σ g²)` over every tensor (before clipping), accumulated in f64.
    pub fn global_norm(&self) -> Result<f64> {
        let mut s = 0.0;
        for g in self.tensors.values() {
            s += ops::sum_squares(g)?;
        }
        Ok(s.sqrt())
    }
}
