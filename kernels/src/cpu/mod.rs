//! CPU backend: rayon for parallelism, the `gemm` crate for matrix products, and
//! runtime-detected AVX2/FMA for dot products.

pub mod attention;
pub mod elementwise;
pub mod matmul;
pub mod simd;
