//! K/V storage: one `[num_slots, n_kv_heads·head_dim]` K and V tensor per layer, in blocks
//! of `block_size` slots laid out as the device attends fastest ([`KvLayout::for_device`]),
//! addressed by slot (`block · block_size + offset`). The single-sequence
//! [`super::Model::forward`] uses its blocks in order as one contiguous cache and tracks `len`.

use super::ModelConfig;
use kernels::ops::{self, KvLayout};
use kernels::{Device, Tensor};

pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
    block_size: usize,
    layout: KvLayout,
    n_kv_heads: usize,
}

impl KvCache {
    /// Storage for `num_blocks` blocks of `block_size` token slots on `device`. With
    /// `prefault`, host memory is written (zeros) before it is returned, so no slot's first
    /// write takes a page fault later ([`crate::EngineConfig::kv_cache_prefault`]); device
    /// memory is always resident.
    pub fn new(
        c: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        device: &Device,
        prefault: bool,
    ) -> kernels::Result<Self> {
        let (kv, capacity) = (c.num_key_value_heads * c.head_dim, num_blocks * block_size);
        let buffer = || match device {
            Device::Cpu if prefault => Tensor::from_vec(written_zeros(capacity * kv), &[capacity, kv]),
            _ => Tensor::zeros(&[capacity, kv], device),
        };
        let layers = (0..c.num_hidden_layers).map(|_| Ok((buffer()?, buffer()?))).collect::<kernels::Result<_>>()?;
        let layout = KvLayout::for_device(device, block_size);
        Ok(Self { layers, len: 0, capacity, block_size, layout, n_kv_heads: c.num_key_value_heads })
    }

    /// Slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// How the blocks are laid out (what [`ops::paged_attention`] is told).
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Writes row `i` of `k`, `v` into slot `slots[i]` of layer `l`.
    pub(crate) fn write(&mut self, l: usize, slots: &kernels::Indices, k: &Tensor, v: &Tensor) -> kernels::Result<()> {
        let (kc, vc) = &mut self.layers[l];
        ops::write_kv(kc, vc, slots, k, v, self.layout, self.block_size, self.n_kv_heads)
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

    /// Limits the tokens [`super::Model::forward`] may cache to `capacity` (at most the
    /// slots allocated).
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.min(self.capacity);
    }

    /// Forgets every cached token (the buffers are reused).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Layer `l`'s K and V caches.
    pub(crate) fn layer(&self, l: usize) -> (&Tensor, &Tensor) {
        let (k, v) = &self.layers[l];
        (k, v)
    }

    /// Copies the K and V of slot `from` into slot `to` in every layer, for each pair.
    pub(crate) fn copy_slots(&mut self, pairs: &[(u32, u32)]) -> kernels::Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let (from, to): (Vec<u32>, Vec<u32>) = pairs.iter().copied().unzip();
        let (from, to) = (kernels::Indices::new(from), kernels::Indices::new(to));
        let (layout, bs, heads) = (self.layout, self.block_size, self.n_kv_heads);
        for (k, v) in &mut self.layers {
            let (ks, vs) = ops::read_kv(k, v, &from, layout, bs, heads)?;
            ops::write_kv(k, v, &to, &ks, &vs, layout, bs, heads)?;
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
