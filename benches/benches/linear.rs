//! `ops::linear` (packed GEMM, `x [m, k] · Wᵀ`) at the default model's projection shapes,
//! for a decode step (m = 1) and a prefill chunk (m = 128). Throughput is in FLOP/s
//! (criterion prints it as elem/s).

use benches::{
    linear_flops, random_tensor, DECODE_ROWS, HEAD_DIM, HIDDEN, INTERMEDIATE, N_HEADS, N_KV_HEADS, PREFILL_ROWS, VOCAB,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kernels::ops;
use std::hint::black_box;

/// `(name, out_features n, in_features k)` of the projections of one layer, and the LM head.
fn projections() -> [(&'static str, usize, usize); 5] {
    [
        ("qkv_proj", (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM, HIDDEN),
        ("o_proj", HIDDEN, N_HEADS * HEAD_DIM),
        ("gate_up_proj", 2 * INTERMEDIATE, HIDDEN),
        ("down_proj", HIDDEN, INTERMEDIATE),
        ("lm_head", VOCAB, HIDDEN),
    ]
}

fn linear(c: &mut Criterion) {
    for (rows, phase) in [(DECODE_ROWS, "decode"), (PREFILL_ROWS, "prefill")] {
        let mut group = c.benchmark_group(format!("linear/{phase}_m{rows}"));
        group.sample_size(20);
        for (i, (name, n, k)) in projections().into_iter().enumerate() {
            // The engine runs the LM head only on the rows it samples from, never on a whole
            // prefill chunk.
            if name == "lm_head" && rows != DECODE_ROWS {
                continue;
            }
            let w = ops::pack_weight(&random_tensor(&[n, k], 2 * i as u64)).expect("packing");
            let x = random_tensor(&[rows, k], 2 * i as u64 + 1);
            group.throughput(Throughput::Elements(linear_flops(rows, n, k)));
            group.bench_function(BenchmarkId::new(name, format!("{n}x{k}")), |b| {
                b.iter(|| ops::linear(black_box(&x), black_box(&w), None).expect("linear"))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, linear);
criterion_main!(benches);
