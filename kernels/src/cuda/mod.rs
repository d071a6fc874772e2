//! The CUDA backend (`cuda` feature): the kernels of `kernels/cuda/*.cu`, compiled at run time
//! with NVRTC (PTX cached on disk, [`compile`]), launched through cudarc, and cuBLAS for the
//! GEMMs. libcuda, libnvrtc and libcublas are loaded at run time: building needs no CUDA,
//! and [`CudaDevice::new`] fails with a clear error when a library is missing.
//!
//! Every request to the driver goes through one seam, [`runtime`]: with the `cuda-emu`
//! feature the same host code runs on the emulated device ([`emu`], [`CudaDevice::emulated`]),
//! which is how CI tests it. Layout: weights are not packed (row-major `[n, k]`, cuBLAS reads
//! them as they are); `linear` and `linear_grad_weight` are cuBLAS SGEMMs, which are not
//! batch-invariant, except in the `--batch-invariant` mode ([`CudaDevice::batch_invariant`]),
//! where `linear` is gemm.cu's fixed-order kernel and every attention row runs the split-KV
//! kernels.

mod attention;
mod compile;
mod device;
#[cfg(feature = "cuda-emu")]
pub mod emu;
mod plan;
mod runtime;
mod sample;
mod storage;

pub use device::{CudaDevice, CudaMark, ResidentAttn, ResidentIndices};
pub use plan::{CudaGraph, CudaGraphPool, SampleOut, StagedSample, StepPlan};
pub use storage::CudaStorage;
