//! CPU backend: rayon for parallelism, a batch-invariant register-tiled matmul, and
//! runtime-detected AVX2/FMA for dot products. [`storage`] implements the contract.

pub mod attention;
pub mod backward;
pub mod elementwise;
pub mod logprob;
pub mod matmul;
pub mod optim;
pub mod simd;
mod storage;

pub use storage::{CpuDevice, CpuStorage};
