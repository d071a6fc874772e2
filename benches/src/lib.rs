//! What the kernel micro-benchmarks (`benches/benches/*.rs`, criterion) share: the default
//! model's shapes (SmolLM2-135M) and deterministic pseudo-random inputs.
//!
//! `cargo bench -p benches` runs them all; `cargo bench -p benches --bench linear -- --quick`
//! one group, briefly. The crate is not a default workspace member, so `cargo test` and CI do
//! not build criterion.

use kernels::Tensor;

/// `hidden_size` of the default model.
pub const HIDDEN: usize = 576;
/// `intermediate_size` of the default model.
pub const INTERMEDIATE: usize = 1536;
/// `vocab_size` of the default model (the LM head's rows).
pub const VOCAB: usize = 49152;
/// Query heads of the default model.
pub const N_HEADS: usize = 9;
/// Key/value heads of the default model (grouped-query attention, 3 queries per KV head).
pub const N_KV_HEADS: usize = 3;
/// `head_dim` of the default model.
pub const HEAD_DIM: usize = 64;
/// `rms_norm_eps` of the default model.
pub const RMS_NORM_EPS: f32 = 1e-5;
/// The engine's default KV block size (tokens per block).
pub const BLOCK_SIZE: usize = 16;
/// Rows of a decode step (one token of one sequence).
pub const DECODE_ROWS: usize = 1;
/// Rows of a prefill chunk.
pub const PREFILL_ROWS: usize = 128;

/// Row counts of the GEMM benchmarks (`benches/gemm.rs`, `benches/sgemm_numpy.py`): one
/// decode row, a 64-sequence decode batch, the GRPO learner batch of one prompt × 8
/// generations (30 prompt tokens once + 8 × 16 completion tokens), a 512-token prefill, a
/// learner batch of 8 × 256.
pub const GEMM_ROWS: [usize; 5] = [1, 64, 158, 512, 2048];

/// `(name, n, k)` of the default model's distinct GEMM shapes, `W [n, k]` (out × in
/// features): the q and o projections (576 → 576), k/v (576 → 192), gate/up (576 → 1536),
/// down (1536 → 576) and the LM head (576 → 49152). `benches/sgemm_numpy.py` lists the same.
pub fn gemm_shapes() -> [(&'static str, usize, usize); 5] {
    [
        ("q_proj", N_HEADS * HEAD_DIM, HIDDEN),
        ("kv_proj", N_KV_HEADS * HEAD_DIM, HIDDEN),
        ("up_proj", INTERMEDIATE, HIDDEN),
        ("down_proj", HIDDEN, INTERMEDIATE),
        ("lm_head", VOCAB, HIDDEN),
    ]
}

/// A `shape` tensor of values uniform in [-1, 1), the same for the same `seed` (splitmix64,
/// so the benchmarks need no RNG crate and every run times the same data).
pub fn random_tensor(shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    let mut state = seed;
    let data = (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            // The top 24 bits as a fraction in [0, 1), mapped to [-1, 1).
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape).expect("the data has the shape's length")
}

/// Floating-point operations of `linear` on `[m, k] × [n, k]ᵀ` (one multiply and one add per
/// term), the throughput unit of the GEMM benchmarks.
pub fn linear_flops(m: usize, n: usize, k: usize) -> u64 {
    2 * (m * n * k) as u64
}
