//! The CUDA device: options and the runtime (the driver, or the emulated device) that every
//! op of its storages goes through ([`super::runtime`]).

use super::attention::AttnMeta;
use super::runtime::{Arg, Backend, DevBuf, Elem, LaunchCfg, Runtime};
use super::storage::CudaStorage;
use crate::backend::BackendDevice;
use crate::ops::AttnBatch;
use crate::{CudaOptions, Indices, Result};
use std::fmt;
use std::sync::{Arc, Weak};

/// One GPU (or the emulated device): every op of its storages runs on its one stream, in
/// order.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    /// `0`, `1`, ... or `emulated`.
    label: String,
    options: CudaOptions,
    rt: Runtime,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match (self.batch_invariant(), self.bf16_weights()) {
            (true, _) => ", batch-invariant",
            (false, true) => ", bf16",
            (false, false) => "",
        };
        write!(f, "CudaDevice({}{mode})", self.inner.label)
    }
}

impl CudaDevice {
    /// The GPU with this ordinal, its kernels compiled (or read from the PTX cache) for its
    /// architecture, computing as `options` says ([`CudaOptions`]). Errors: a missing
    /// library, no such device, an NVRTC failure (with its log).
    pub fn new(ordinal: usize, options: CudaOptions) -> Result<Self> {
        let rt = Runtime::new(Backend::Driver(super::runtime::Driver::new(ordinal)?));
        Ok(Self { inner: Arc::new(Inner { label: ordinal.to_string(), options, rt }) })
    }

    /// The emulated CUDA device ([`super::emu`]): the same host code over host memory, the
    /// kernels run through the SIMT emulation, cuBLAS replaced by the reference GEMM.
    #[cfg(feature = "cuda-emu")]
    pub fn emulated(options: CudaOptions) -> Self {
        let rt = Runtime::new(Backend::Emu(super::emu::Emu::new()));
        Self { inner: Arc::new(Inner { label: "emulated".into(), options, rt }) }
    }

    /// Whether this is the emulated device.
    pub fn is_emulated(&self) -> bool {
        !matches!(self.inner.rt.backend, Backend::Driver(_))
    }

    /// Whether the forward GEMM and attention are the batch-invariant kernels (gemm.cu's
    /// `linear_bi`; the split-KV attention for every row) rather than cuBLAS and the tiled
    /// prefill kernel.
    pub fn batch_invariant(&self) -> bool {
        self.inner.options.batch_invariant
    }

    /// Whether `linear` reads a bf16 serving copy of the weight ([`CudaOptions::bf16_weights`];
    /// never in the batch-invariant mode, which computes in f32).
    pub fn bf16_weights(&self) -> bool {
        self.inner.options.bf16_weights && !self.inner.options.batch_invariant
    }

    /// What the host has asked of this device so far ([`crate::DeviceCounters`]).
    pub fn counters(&self) -> crate::DeviceCounters {
        self.inner.rt.counters()
    }

    /// A mark after the work queued on this device so far: [`crate::DeviceMark`].
    pub fn mark(&self) -> Result<CudaMark> {
        Ok(CudaMark { dev: self.clone(), mark: self.inner.rt.mark()? })
    }

    /// `idx` on this device: its resident copy (uploaded by the first call for these
    /// indices), or a fresh upload when another device holds the resident copy.
    pub(super) fn indices<'a>(&self, idx: &'a Indices) -> Result<Resident<'a, DevBuf<u32>>> {
        if let Some(r) = idx.resident.get() {
            if r.owner.ptr_eq(&Arc::downgrade(&self.inner)) {
                return Ok(Resident::Shared(&r.buf));
            }
            return Ok(Resident::Own(self.upload_any(idx.host())?));
        }
        let buf = self.upload_any(idx.host())?;
        let _ = idx.resident.set(ResidentIndices { owner: Arc::downgrade(&self.inner), buf });
        // Set just above (a racing setter's copy is as good).
        Ok(Resident::Shared(&idx.resident.get().expect("set").buf))
    }

    /// Sets `idx`'s device copy to `buf` (a step plan's view).
    pub(super) fn set_resident(&self, idx: &Indices, buf: DevBuf<u32>) {
        let _ = idx.resident.set(ResidentIndices { owner: Arc::downgrade(&self.inner), buf });
    }

    /// Sets `batch`'s device metadata to `meta` (a step plan's views).
    pub(super) fn set_resident_attn(&self, batch: &AttnBatch, meta: AttnMeta) {
        let _ = batch.resident.set(ResidentAttn { owner: Arc::downgrade(&self.inner), meta });
    }

    /// The attention metadata of `batch` on this device (built by `build` on first use, or
    /// per call when another device holds it).
    pub(super) fn attn_meta<'a>(
        &self,
        batch: &'a AttnBatch,
        build: impl FnOnce() -> Result<AttnMeta>,
    ) -> Result<Resident<'a, AttnMeta>> {
        if let Some(r) = batch.resident.get() {
            if r.owner.ptr_eq(&Arc::downgrade(&self.inner)) {
                return Ok(Resident::Shared(&r.meta));
            }
            return Ok(Resident::Own(build()?));
        }
        let meta = build()?;
        let _ = batch.resident.set(ResidentAttn { owner: Arc::downgrade(&self.inner), meta });
        Ok(Resident::Shared(&batch.resident.get().expect("set").meta))
    }

    pub(super) fn rt(&self) -> &Runtime {
        &self.inner.rt
    }

    /// Launches kernel `name` of source `file` ([`Runtime::launch`]). A grid with a zero
    /// dimension (no rows, no items) is no work and launches nothing: CUDA rejects such a
    /// grid, and rounding it up to one block would run a row kernel on a row that does not
    /// exist (the emulated device caught `rms_norm` reading past a 0-row input that way).
    pub(super) fn launch(
        &self,
        file: &'static str,
        name: &'static str,
        cfg: LaunchCfg,
        args: &mut [Arg<'_>],
    ) -> Result<()> {
        let (g, b) = (cfg.grid, cfg.block);
        if g.0 == 0 || g.1 == 0 || g.2 == 0 || b.0 == 0 || b.1 == 0 || b.2 == 0 {
            return Ok(());
        }
        self.inner.rt.launch(file, name, cfg, args)
    }

    /// Host values of any device type as a device buffer.
    pub(super) fn upload_any<T: Elem>(&self, data: &[T]) -> Result<DevBuf<T>> {
        self.inner.rt.htod(data)
    }

    /// `n` values of any device type for an output a kernel writes in full
    /// ([`Runtime::alloc`]: no zero fill).
    pub(super) fn alloc_any<T: Elem>(&self, n: usize) -> Result<DevBuf<T>> {
        self.inner.rt.alloc(n)
    }

    /// `n` zeroed values of any device type.
    pub(super) fn zeros_any<T: Elem>(&self, n: usize) -> Result<DevBuf<T>> {
        self.inner.rt.zeros(n)
    }

    pub(super) fn storage(&self, buf: DevBuf<f32>) -> CudaStorage {
        CudaStorage::new(self.clone(), buf)
    }
}

/// A point in a CUDA device's queue of work ([`CudaDevice::mark`]).
pub struct CudaMark {
    dev: CudaDevice,
    mark: super::runtime::Mark,
}

impl CudaMark {
    /// Seconds of device time from this mark to `end` (CUDA events); waits for `end`'s work.
    /// Errors: a mark of another device, a CUDA error.
    pub fn seconds_until(&self, end: &CudaMark) -> Result<f64> {
        if !Arc::ptr_eq(&self.dev.inner, &end.dev.inner) {
            return Err(crate::KernelError::Cuda("timing marks of two devices".into()));
        }
        self.dev.inner.rt.seconds_between(&self.mark, &end.mark)
    }
}

/// [`Indices`] resident on a device (see [`CudaDevice::indices`]).
pub struct ResidentIndices {
    owner: Weak<Inner>,
    buf: DevBuf<u32>,
}

/// An [`AttnBatch`]'s metadata resident on a device ([`CudaDevice::attn_meta`]).
pub struct ResidentAttn {
    owner: Weak<Inner>,
    meta: AttnMeta,
}

/// A device-side value that is either held by its owner for the step, or this call's own.
pub(super) enum Resident<'a, T> {
    Shared(&'a T),
    Own(T),
}

impl<T> std::ops::Deref for Resident<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Resident::Shared(t) => t,
            Resident::Own(t) => t,
        }
    }
}

/// Threads per block of the grid-stride kernels.
pub(super) const THREADS: u32 = 256;

/// A grid-stride launch over `n` items (at most 4096 blocks; the kernels loop over the rest).
pub(super) fn stride_cfg(n: usize) -> LaunchCfg {
    let blocks = n.div_ceil(THREADS as usize).min(4096) as u32;
    LaunchCfg { grid: (blocks, 1, 1), block: (THREADS, 1, 1), smem: 0 }
}

/// One block of `threads` per row, for `rows` rows (grid y/z = 1).
pub(super) fn row_cfg(rows: usize, threads: u32) -> LaunchCfg {
    LaunchCfg { grid: (rows as u32, 1, 1), block: (threads, 1, 1), smem: 0 }
}

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;
    fn zeros(&self, n: usize) -> Result<CudaStorage> {
        Ok(self.storage(self.zeros_any(n)?))
    }
    fn upload(&self, data: &[f32]) -> Result<CudaStorage> {
        Ok(self.storage(self.upload_any(data)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the driver library (this CI machine), asking for a GPU is a clear error, not
    /// a panic inside cudarc.
    #[test]
    fn missing_libraries_are_a_clear_error() {
        // SAFETY: only tries to dlopen libcuda.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            return; // a machine with a driver: nothing to check here
        }
        let e = CudaDevice::new(0, CudaOptions::default()).unwrap_err().to_string();
        assert!(e.contains("CUDA requested but libcuda"), "{e}");
    }
}
