//! The CUDA backend (`cuda` feature): the kernels of `kernels/cuda/*.cu`, compiled at run time
//! with NVRTC (PTX cached on disk, [`compile`]), launched through cudarc, and cuBLAS for the
//! GEMMs. libcuda, libnvrtc and libcublas are loaded at run time: building needs no CUDA,
//! and [`CudaDevice::new`] fails with a clear error when a library is missing.
//!
//! Status: written and type-checked without a GPU (the kernels themselves are tested on
//! the CPU through the SIMT emulation, `tests/integration/cuda_emu.rs`); not yet run on a
//! device. Layout: weights are not packed (row-major `[n, k]`, cuBLAS reads them as they
//! are); `linear` and `linear_grad_weight` are cuBLAS SGEMMs, which are not batch-invariant,
//! except in the `--batch-invariant` mode ([`CudaDevice::batch_invariant`]), where `linear`
//! is gemm.cu's fixed-order kernel and every attention row runs the split-KV kernels.

mod attention;
mod compile;
mod device;
mod storage;

pub use device::CudaDevice;
pub use storage::CudaStorage;
