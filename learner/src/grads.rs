//! Gradients by HF tensor name, accumulated across sequences.

use std::collections::BTreeMap;

#[derive(Debug, Default, Clone)]
pub struct Grads {
    /// name → (shape, values), row-major f32.
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

impl Grads {
    /// Adds `g` to the gradient of `name` (created at zero with `shape`).
    pub fn add(&mut self, name: &str, shape: &[usize], g: &[f32]) {
        let e = self.tensors.entry(name.to_string()).or_insert_with(|| (shape.to_vec(), vec![0.0; g.len()]));
        debug_assert_eq!(e.0, shape);
        for (a, b) in e.1.iter_mut().zip(g) {
            *a += b;
        }
    }

    /// `sqrt(Σ g²)` over every tensor (before clipping).
    pub fn global_norm(&self) -> f64 {
        self.tensors.values().flat_map(|(_, v)| v.iter()).map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt()
    }
}
