//! The CPU backend's buffers: a `Vec<f32>`, or, for the packed weights that every decode
//! step streams whole from memory, a 2 MiB-aligned allocation advised onto transparent huge
//! pages ([`HostBuf::huge`]).
//!
//! Why: a decode step reads all of the model's weights once (538 MB for the default model,
//! f32) and is bound by memory bandwidth. Through 4 KiB pages every 4 KiB of weights costs a
//! TLB miss and a page walk. With 2 MiB pages a pass of the default model's 30 layers'
//! projections and LM head at m = 1 took 17.9–18.9 ms against 21.6–23.1 (separate processes,
//! alternating, development VM); in the whole decode step the gain was about 2 % (49 → 50
//! tok/s), most of it the LM head's 3.8 → 3.6 ms. Linux backs a range with huge pages only
//! where it is 2 MiB-aligned and advised (`madvise(MADV_HUGEPAGE)`, the setting most
//! distributions ship: `/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`), which a
//! `Vec`'s allocation never is with the system allocator. (rlserve's mimalloc advises its own
//! segments, so there a large `Vec` is on huge pages too: the optimizer's steps, which
//! become the weights at the commit, are `Vec`s so that they reuse freed memory.)

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// A host f32 buffer; derefs to `[f32]`.
pub enum HostBuf {
    Vec(Vec<f32>),
    Huge(HugeBuf),
}

/// The huge page size on x86-64 and aarch64 (4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

impl HostBuf {
    /// A buffer of `len` values written by `init`, which gets its pointer and must write all
    /// `len` values. From `HUGE_PAGE / 2` bytes on it is a [`HugeBuf`]: 2 MiB-aligned, its
    /// whole 2 MiB pages advised onto huge pages, and its last partial page too when at
    /// least half of it is used (at most 1 MiB of the huge page left unused); smaller
    /// buffers are a `Vec`.
    ///
    /// # Safety
    /// `init` writes every one of the `len` values before returning.
    pub unsafe fn huge(len: usize, init: impl FnOnce(*mut f32)) -> HostBuf {
        let bytes = len * size_of::<f32>();
        if bytes < HUGE_PAGE / 2 {
            let mut v = Vec::with_capacity(len);
            init(v.as_mut_ptr());
            // SAFETY: `init` wrote all `len` values (caller).
            unsafe { v.set_len(len) };
            return HostBuf::Vec(v);
        }
        let tail = bytes % HUGE_PAGE;
        let advised = if tail >= HUGE_PAGE / 2 { bytes.next_multiple_of(HUGE_PAGE) } else { bytes - tail };
        let layout = Layout::from_size_align(advised.max(bytes), HUGE_PAGE).expect("a valid layout");
        // SAFETY: the layout's size is nonzero (bytes ≥ 1 MiB).
        let ptr = unsafe { alloc::alloc(layout) }.cast::<f32>();
        let Some(ptr) = NonNull::new(ptr) else { alloc::handle_alloc_error(layout) };
        // Before the first touch, so that the faults map huge pages. A hint: on failure (or
        // with huge pages off) the buffer is ordinary memory.
        #[cfg(target_os = "linux")]
        // SAFETY: [ptr, ptr + advised) lies inside the allocation, which starts page-aligned.
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), advised, libc::MADV_HUGEPAGE)
        };
        init(ptr.as_ptr());
        HostBuf::Huge(HugeBuf { ptr, len, layout })
    }
}

impl From<Vec<f32>> for HostBuf {
    fn from(v: Vec<f32>) -> Self {
        HostBuf::Vec(v)
    }
}

impl Deref for HostBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            HostBuf::Vec(v) => v,
            // SAFETY: ptr holds len initialised values ([`HostBuf::huge`]), owned by self.
            HostBuf::Huge(h) => unsafe { std::slice::from_raw_parts(h.ptr.as_ptr(), h.len) },
        }
    }
}

impl DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            HostBuf::Vec(v) => v,
            // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
            HostBuf::Huge(h) => unsafe { std::slice::from_raw_parts_mut(h.ptr.as_ptr(), h.len) },
        }
    }
}

impl Clone for HostBuf {
    /// The same kind of buffer (a copy of a packed weight is on huge pages too).
    fn clone(&self) -> Self {
        match self {
            HostBuf::Vec(v) => HostBuf::Vec(v.clone()),
            // SAFETY: the copy writes all len values.
            HostBuf::Huge(h) => unsafe {
                HostBuf::huge(h.len, |dst| std::ptr::copy_nonoverlapping(h.ptr.as_ptr(), dst, h.len))
            },
        }
    }
}

impl PartialEq for HostBuf {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if matches!(self, HostBuf::Huge(_)) { "huge" } else { "vec" };
        write!(f, "HostBuf::{kind}[{} values]", self.len())
    }
}

/// The allocation behind [`HostBuf::Huge`]: `len` initialised values at a 2 MiB-aligned
/// `ptr`, freed with `layout`.
pub struct HugeBuf {
    ptr: NonNull<f32>,
    len: usize,
    layout: Layout,
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in [`HostBuf::huge`] with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr().cast(), self.layout) }
    }
}

// SAFETY: HugeBuf owns its allocation like a Vec does.
unsafe impl Send for HugeBuf {}
unsafe impl Sync for HugeBuf {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both kinds hold what `init` wrote, compare and clone by value, and the huge kind is
    /// 2 MiB-aligned (small buffers stay a `Vec`).
    #[test]
    fn huge_buffers_hold_their_values_and_are_aligned() {
        for len in [3usize, 200_000, 300_000, 1_000_000] {
            // SAFETY: the closure writes all len values.
            let buf = unsafe { HostBuf::huge(len, |p| (0..len).for_each(|i| *p.add(i) = i as f32)) };
            assert_eq!(buf.len(), len);
            assert!(buf.iter().enumerate().all(|(i, &v)| v == i as f32), "len {len}");
            assert_eq!(matches!(buf, HostBuf::Huge(_)), len * 4 >= HUGE_PAGE / 2, "len {len}");
            if let HostBuf::Huge(h) = &buf {
                assert_eq!(h.ptr.as_ptr() as usize % HUGE_PAGE, 0);
            }
            let mut copy = buf.clone();
            assert_eq!(copy, buf);
            copy[len - 1] = -1.0;
            assert_ne!(copy, buf);
            assert_eq!(buf[len - 1], (len - 1) as f32);
        }
    }
}
