//! CPU backend: rayon for parallelism, a batch-invariant register-tiled matmul, and
//! runtime-detected AVX-512 / AVX2+FMA kernels (GEMM tiles, attention rows). [`storage`] implements the contract.

pub mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_avx2;
#[cfg(target_arch = "x86_64")]
mod attention_avx512;
pub mod attention_rows;
pub mod backward;
pub mod elementwise;
#[cfg(target_arch = "x86_64")]
mod gemm_avx2;
#[cfg(target_arch = "x86_64")]
mod gemm_avx512;
pub mod gemm_tile;
mod host_buf;
pub mod hot_pool;
mod kv_blocked;
pub mod logprob;
pub mod matmul;
pub mod optim;
pub mod sampler;
pub mod simd;
mod storage;

pub use host_buf::HostBuf;
pub use storage::{CpuDevice, CpuStorage};
