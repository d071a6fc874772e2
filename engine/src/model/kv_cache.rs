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
    /// Storage for `capacity` token slots on `device`. With `prefault`, host memory is
    /// written (zeros) before it is returned, so no slot's first write takes a page fault
    /// later ([`crate::EngineConfig::kv_cache_prefault`]); device memory is always resident.
    pub fn new(c: &ModelConfig, capacity: usize, device: &Device, prefault: bool) -> kernels::Result<Self> {
        let kv = c.num_key_value_heads * c.head_dim;
        let buffer = || match device {
            Device::Cpu if prefault => Tensor::from_vec(written_zeros(capacity * kv), &[capacity, kv]),
            _ => Tensor::zeros(&[capacity, kv], device),
        };
        let layers = (0..c.num_hidden_layers).map(|_| Ok((buffer()?, buffer()?))).collect::<kernels::Result<_>>()?;
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

/// `n` zeros written one by one (in parallel), unlike `vec![0.0; n]`, whose pages the
/// allocator may take fresh from the OS and leave untouched until first use.
fn written_zeros(n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut v: Vec<f32> = Vec::with_capacity(n);
    v.spare_capacity_mut().par_chunks_mut(1 << 16).for_each(|c| c.fill(std::mem::MaybeUninit::new(0.0)));
    // SAFETY: all n values were written just above.
    unsafe { v.set_len(n) };
    v
}
