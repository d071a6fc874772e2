//! Device ops for rlserve.
//!
//! The seam: a [`Tensor`] owns its storage on one [`Device`]; every op in [`ops`] takes
//! tensors, checks shapes, and calls one method of the backend contract
//! ([`backend::BackendStorage`]) on the tensors' storage: the CPU backend ([`cpu`], rayon +
//! AVX2/FMA) or the CUDA backend ([`cuda`] with the `cuda` feature: the kernels of
//! `kernels/cuda/*.cu` through cudarc and NVRTC, cuBLAS for the GEMMs). Without the `cuda`
//! feature, [`cuda`] is a stub whose types are uninhabited but implement the whole contract,
//! so CPU-only builds compile every match arm and [`Device::cuda`] returns
//! [`KernelError::CudaUnavailable`].
//!
//! All tensors are row-major f32 ([`DType`]). Shapes are written `[rows, cols]`.

pub mod backend;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
mod error;
mod indices;
pub mod ops;
pub mod sample;
mod tensor;

pub use error::KernelError;
pub use indices::{Idx, Indices};
pub use tensor::{CudaOptions, DType, Device, DeviceCounters, DeviceMark, Storage, Tensor};

/// Result type of every op.
pub type Result<T> = std::result::Result<T, KernelError>;
