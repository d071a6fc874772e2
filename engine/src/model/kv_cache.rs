//! A dense per-sequence KV cache: one `[capacity, n_kv_heads·head_dim]` K and V tensor per layer.
//! (The paged block pool of the engine issue replaces it for serving.)

use super::ModelConfig;
use kernels::{Device, Tensor};

pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    pub fn new(c: &ModelConfig, capacity: usize, device: &Device) -> Self {
        let kv = c.num_key_value_heads * c.head_dim;
        let layers = (0..c.num_hidden_layers)
            .map(|_| (Tensor::zeros(&[capacity, kv], device), Tensor::zeros(&[capacity, kv], device)))
            .collect();
        Self { layers, len: 0, capacity }
    }

    /// Tokens cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every cached token (the buffers are reused).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    pub(crate) fn layer_mut(&mut self, l: usize) -> (&mut Tensor, &mut Tensor) {
        let (k, v) = &mut self.layers[l];
        (k, v)
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
