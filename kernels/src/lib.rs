//! Device ops for rlserve.
//!
//! The seam: a [`Tensor`] owns its storage on one [`Device`]; every op in [`ops`] takes
//! tensors, checks shapes, and dispatches on the storage to the CPU implementation
//! ([`cpu`], rayon + the `gemm` crate + AVX2/FMA dot products) or to the CUDA backend.
//! CUDA lands in a later issue: without the `cuda` feature, [`cuda`] is a stub whose
//! device type is uninhabited, so CPU-only builds compile every match arm and
//! [`Device::cuda`] returns [`KernelError::CudaUnavailable`].
//!
//! All tensors are row-major f32. Shapes are written `[rows, cols]`.

pub mod cpu;
#[cfg(feature = "cuda")]
compile_error!("the CUDA backend lands in the CUDA issue; build without `--features cuda`");
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
mod error;
pub mod ops;
mod tensor;

pub use error::KernelError;
pub use tensor::{Device, Storage, Tensor};

/// Result type of every op.
pub type Result<T> = std::result::Result<T, KernelError>;
