//! The paged KV cache's storage layouts, and the ops that write and read its slots
//! ([`super::paged_attention`] attends over them).

use super::check_scatter;
use crate::backend::BackendStorage;
use crate::error::shape_err;
use crate::indices::Idx;
use crate::tensor::Storage;
use crate::{Device, KernelError, Result, Tensor};

/// How a K and a V cache `[num_slots, n_kv_heads·head_dim]` (slots in blocks of
/// `block_size`) store their slots. The element count is the same in both; only the order
/// inside a block differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLayout {
    /// Slot `s` is row `s` of K and of V (every backend; also any plain `[t, ·]` K/V).
    Rows,
    /// Per block of `block_size` slots (a multiple of [`KvLayout::STRIP`]), K
    /// `[n_kv_heads, head_dim, block_size]` and V `[n_kv_heads, block_size, head_dim]`
    /// (vLLM's head-major blocks): a head's keys of a block are columns, 16 to a 64-byte line,
    /// so scores read them without a transpose; its values are rows, contiguous. CPU only.
    /// Element `e` of head `g` of slot `s = b·block_size + i` is at
    /// `b·block_size·c + g·head_dim·block_size + e·block_size + i` in K and
    /// `b·block_size·c + g·block_size·head_dim + i·head_dim + e` in V (`c = n_kv_heads·head_dim`).
    Blocked,
}

impl KvLayout {
    /// Keys per strip that [`KvLayout::Blocked`]'s block sizes are multiples of.
    pub const STRIP: usize = 16;

    /// The layout `device` attends fastest with blocks of `block_size`:
    /// [`KvLayout::Blocked`] on the CPU when `block_size` is a multiple of 16, else
    /// [`KvLayout::Rows`].
    pub fn for_device(device: &Device, block_size: usize) -> Self {
        match device {
            Device::Cpu if block_size > 0 && block_size.is_multiple_of(Self::STRIP) => KvLayout::Blocked,
            _ => KvLayout::Rows,
        }
    }

    /// Checks that a cache of `slots` slots in blocks of `block_size` can have this layout.
    pub(crate) fn check(self, op: &'static str, device: &Device, slots: usize, block_size: usize) -> Result<()> {
        if self == KvLayout::Rows {
            return Ok(());
        }
        if !matches!(device, Device::Cpu) {
            return Err(KernelError::Unsupported { op, detail: "the Blocked KV layout is CPU-only".into() });
        }
        if block_size == 0 || !block_size.is_multiple_of(Self::STRIP) || !slots.is_multiple_of(block_size) {
            return Err(shape_err(
                op,
                format!("Blocked KV layout: block_size {block_size} must be a multiple of 16 dividing {slots} slots"),
            ));
        }
        Ok(())
    }
}

/// Writes row `i` of `k`, `v [n, n_kv_heads·head_dim]` into slot `slots[i]` of the caches
/// `k_cache`, `v_cache [num_slots, n_kv_heads·head_dim]` laid out as `layout` (blocks of
/// `block_size`): the KV append of a forward step.
#[allow(clippy::too_many_arguments)]
pub fn write_kv<'a>(
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
    slots: impl Into<Idx<'a>>,
    k: &Tensor,
    v: &Tensor,
    layout: KvLayout,
    block_size: usize,
    n_kv_heads: usize,
) -> Result<()> {
    let slots = slots.into();
    for (cache, src, keys) in [(k_cache, k, true), (v_cache, v, false)] {
        let c = check_scatter("write_kv", cache, &slots, src)?;
        layout.check("write_kv", &cache.device(), cache.dims2("write_kv")?.0, block_size)?;
        let (d, s) = (&mut cache.storage, &src.storage);
        match layout {
            KvLayout::Rows => backend!("write_kv"; d, s => d.scatter_rows(&slots, s, c))?,
            KvLayout::Blocked => {
                let head_dim = head_dim("write_kv", c, n_kv_heads)?;
                backend!("write_kv"; d, s => d.scatter_kv_blocked(&slots, s, block_size, n_kv_heads, head_dim, keys))?
            }
        }
    }
    Ok(())
}

/// Slots `slots` of the caches `k_cache`, `v_cache` (laid out as `layout`, blocks of
/// `block_size`) as rows: `(k, v)`, each `[slots.len(), n_kv_heads·head_dim]`. With
/// [`write_kv`], copies slots (a forked sequence's partial block).
pub fn read_kv<'a>(
    k_cache: &Tensor,
    v_cache: &Tensor,
    slots: impl Into<Idx<'a>>,
    layout: KvLayout,
    block_size: usize,
    n_kv_heads: usize,
) -> Result<(Tensor, Tensor)> {
    let slots = slots.into();
    let read = |cache: &Tensor, keys: bool| -> Result<Tensor> {
        let (l, c) = cache.dims2("read_kv")?;
        if let Some(bad) = slots.max().filter(|&s| s as usize >= l) {
            return Err(shape_err("read_kv", format!("slot {bad} >= {l} cache slots")));
        }
        layout.check("read_kv", &cache.device(), l, block_size)?;
        let a = &cache.storage;
        let storage = match layout {
            KvLayout::Rows => backend!("read_kv"; a => a.gather_rows(&slots, c).map(Storage::from))?,
            KvLayout::Blocked => {
                let head_dim = head_dim("read_kv", c, n_kv_heads)?;
                backend!("read_kv"; a =>
                    a.gather_kv_blocked(&slots, block_size, n_kv_heads, head_dim, keys).map(Storage::from))?
            }
        };
        Ok(Tensor::new(storage, &[slots.len(), c]))
    };
    Ok((read(k_cache, true)?, read(v_cache, false)?))
}

/// `c / n_kv_heads`, or a shape error when it does not divide.
fn head_dim(op: &'static str, c: usize, n_kv_heads: usize) -> Result<usize> {
    if n_kv_heads == 0 || !c.is_multiple_of(n_kv_heads) {
        return Err(shape_err(op, format!("{c} K/V columns are not {n_kv_heads} heads")));
    }
    Ok(c / n_kv_heads)
}
