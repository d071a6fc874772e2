//! K/V storage: one `[num_slots, n_kv_heads·head_dim]` K and V tensor per layer, addressed
//! by slot (`block · block_size + offset` for the paged pool). The single-sequence
//! [`super::Model::forward`] uses it as a contiguous cache and tracks `len`.

use super::ModelConfig;
use kernels::{ops, Device, Tensor};

pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Storage for `capacity` token slots on `device`.
    pub fn new(c: &ModelConfig, capacity: usize, device: &Device) -> kernels::Result<Self> {
        let kv = c.num_key_value_heads * c.head_dim;
        let layers = (0..c.num_hidden_layers)
            .map(|_| Ok((Tensor::zeros(&[capacity, kv], device)?, Tensor::zeros(&[capacity, kv], device)?)))
            .collect::<kernels::Result<_>>()?;
        Ok(Self { layers, len: 0, capacity })
    }

    /// Bytes of K/V storage per token slot: `2 · layers · kv_heads · head_dim · 4`.
    pub fn bytes_per_slot(c: &ModelConfig) -> usize {
        2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * std::mem::size_of::<f32>()
    }

    /// Tokens cached so far by the single-sequence forward.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of token slots.
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

    /// Copies the K and V of slot `from` into slot `to` in every layer, for each pair.
    pub(crate) fn copy_slots(&mut self, pairs: &[(u32, u32)]) -> kernels::Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let (from, to): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
        for (k, v) in &mut self.layers {
            let (ks, vs) = (ops::embedding(k, &from)?, ops::embedding(v, &from)?);
            ops::scatter_rows(k, &to, &ks)?;
            ops::scatter_rows(v, &to, &vs)?;
        }
        Ok(())
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
