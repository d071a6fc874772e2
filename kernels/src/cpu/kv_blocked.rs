//! Slot writes and reads of a [`crate::ops::KvLayout::Blocked`] K or V cache (the layout's
//! offsets are defined there).

/// The geometry of a Blocked cache: slots per block, KV heads, head dimension, and whether
/// it holds keys (`[heads, head_dim, block_size]` per block) or values
/// (`[heads, block_size, head_dim]`).
pub struct Blocks {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub keys: bool,
}

impl Blocks {
    /// Offset of element `e` of head `g` of slot `s`.
    #[inline]
    pub fn offset(&self, s: usize, g: usize, e: usize) -> usize {
        let (bs, d) = (self.block_size, self.head_dim);
        let base = (s / bs) * bs * self.n_kv_heads * d + g * d * bs;
        if self.keys {
            base + e * bs + s % bs
        } else {
            base + (s % bs) * d + e
        }
    }
}

/// Row `i` of `src [n, heads·head_dim]` into slot `slots[i]` of `cache`.
pub fn scatter(cache: &mut [f32], slots: &[u32], src: &[f32], b: &Blocks) {
    let c = b.n_kv_heads * b.head_dim;
    for (row, &s) in src.chunks_exact(c).zip(slots) {
        for g in 0..b.n_kv_heads {
            for e in 0..b.head_dim {
                cache[b.offset(s as usize, g, e)] = row[g * b.head_dim + e];
            }
        }
    }
}

/// Slots `slots` of `cache` as rows `[slots.len(), heads·head_dim]`.
pub fn gather(cache: &[f32], slots: &[u32], b: &Blocks) -> Vec<f32> {
    let mut out = Vec::with_capacity(slots.len() * b.n_kv_heads * b.head_dim);
    for &s in slots {
        for g in 0..b.n_kv_heads {
            out.extend((0..b.head_dim).map(|e| cache[b.offset(s as usize, g, e)]));
        }
    }
    out
}
