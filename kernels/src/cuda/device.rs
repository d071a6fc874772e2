//! The CUDA device: context, stream, compiled kernels and the cuBLAS handle.

use super::compile;
use super::storage::CudaStorage;
use crate::backend::BackendDevice;
use crate::{CudaOptions, KernelError, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig,
};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// Any CUDA-side failure as a [`KernelError::Cuda`].
pub(super) fn cuda_err(e: impl fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("{e:?}"))
}

/// One GPU: every op of its storages runs on its one stream, in order.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    options: CudaOptions,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// Loaded modules by source file name.
    modules: HashMap<&'static str, Arc<CudaModule>>,
    /// Kernels looked up so far, by name.
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match (self.batch_invariant(), self.bf16_weights()) {
            (true, _) => ", batch-invariant",
            (false, true) => ", bf16",
            (false, false) => "",
        };
        write!(f, "CudaDevice({}{mode})", self.inner.ordinal)
    }
}

/// Errors unless libcuda, libnvrtc and libcublas can be loaded (cudarc's calls would panic
/// without them).
fn check_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries.
    let present = unsafe {
        [
            ("libcuda", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = present.iter().filter(|p| !p.1).map(|p| p.0).collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(KernelError::CudaLibraryMissing(missing.join("/")))
}

impl CudaDevice {
    /// The GPU with this ordinal, its kernels compiled (or read from the PTX cache) for its
    /// architecture, computing as `options` says ([`CudaOptions`]). Errors: a missing
    /// library, no such device, an NVRTC failure (with its log).
    pub fn new(ordinal: usize, options: CudaOptions) -> Result<Self> {
        check_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
        let mut modules = HashMap::new();
        for (name, ptx) in compile::compile_all(major, minor)? {
            modules.insert(name, ctx.load_module(ptx).map_err(cuda_err)?);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_err)?;
        let inner = Inner { ordinal, options, stream, blas, modules, functions: Mutex::default() };
        Ok(Self { inner: Arc::new(inner) })
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

    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    pub(super) fn blas(&self) -> &CudaBlas {
        &self.inner.blas
    }

    /// Kernel `name` of source `file` (looked up once).
    pub(super) fn function(&self, file: &'static str, name: &'static str) -> Result<CudaFunction> {
        let mut cache = self.inner.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let module = self.inner.modules.get(file).ok_or_else(|| KernelError::Cuda(format!("no module {file}")))?;
        let f = module.load_function(name).map_err(cuda_err)?;
        cache.insert(name, f.clone());
        Ok(f)
    }

    /// Host values of any device type as a device buffer.
    pub(super) fn upload_any<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream().clone_htod(data).map_err(cuda_err)
    }

    /// `n` zeroed values of any device type.
    pub(super) fn zeros_any<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.stream().alloc_zeros(n.max(1)).map_err(cuda_err)
    }

    pub(super) fn storage(&self, buf: CudaSlice<f32>, len: usize) -> CudaStorage {
        CudaStorage::new(self.clone(), buf, len)
    }
}

/// Submits a kernel built with [`CudaStream::launch_builder`].
pub(super) fn launch(mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    // SAFETY: every kernel's argument list is built next to its launch, in the order of the
    // kernel's signature (documented in its .cu header), with buffers of the sizes it reads.
    unsafe { args.launch(cfg) }.map(|_| ()).map_err(cuda_err)
}

/// Threads per block of the grid-stride kernels.
pub(super) const THREADS: u32 = 256;

/// A grid-stride launch over `n` items (at most 4096 blocks; the kernels loop over the rest).
pub(super) fn stride_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 4096) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block of `threads` per row, for `rows` rows (grid y/z = 1).
pub(super) fn row_cfg(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;
    fn zeros(&self, n: usize) -> Result<CudaStorage> {
        Ok(self.storage(self.zeros_any(n)?, n))
    }
    fn upload(&self, data: &[f32]) -> Result<CudaStorage> {
        Ok(self.storage(self.upload_any(data)?, data.len()))
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
