//! CPU backend: rayon for parallelism, a batch-invariant register-tiled matmul, and
//! runtime-detected AVX2/FMA for dot products.

pub mod attention;
pub mod backward;
pub mod elementwise;
pub mod matmul;
pub mod simd;
