//! The GEMMs of the default model at the row counts of decode (m = 1), a decode batch
//! (m = 64), a prefill chunk (m = 512) and a learner batch (m = 2048), forward
//! (`ops::linear`, `y [m, n] = x [m, k] · Wᵀ`), weight gradient
//! (`ops::linear_grad_weight`, `dW [n, k] = dyᵀ · x`) and input gradient
//! (`ops::linear_grad_input`, `dx [m, k] = dy · W`). Throughput is in FLOP/s (criterion
//! prints it as elem/s); `benches/sgemm_numpy.py` times numpy/OpenBLAS `sgemm` on the same
//! shapes and `benches/gemm_vs_numpy.sh` runs both and prints the ratios.
//!
//! Filter one group with `cargo bench -p benches --bench gemm -- gemm/fwd_m512`.

use benches::{gemm_shapes, linear_flops, random_tensor, GEMM_ROWS};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kernels::ops;
use std::hint::black_box;
use std::time::Duration;

fn gemm(c: &mut Criterion) {
    for m in GEMM_ROWS {
        for pass in ["fwd", "dw", "dx"] {
            let mut group = c.benchmark_group(format!("gemm/{pass}_m{m}"));
            group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
            for (i, (name, n, k)) in gemm_shapes().into_iter().enumerate() {
                let seed = 3 * i as u64;
                let x = random_tensor(&[m, k], seed);
                group.throughput(Throughput::Elements(linear_flops(m, n, k)));
                let id = BenchmarkId::new(name, format!("{n}x{k}"));
                if pass == "fwd" {
                    let w = ops::pack_weight(&random_tensor(&[n, k], seed + 1)).expect("packing");
                    group.bench_function(id, |b| b.iter(|| ops::linear(black_box(&x), &w, None).expect("linear")));
                } else if pass == "dx" {
                    let w = ops::pack_weight(&random_tensor(&[n, k], seed + 1)).expect("packing");
                    let dy = random_tensor(&[m, n], seed + 2);
                    group.bench_function(id, |b| {
                        b.iter(|| ops::linear_grad_input(black_box(&dy), &w).expect("linear_grad_input"))
                    });
                } else {
                    let dy = random_tensor(&[m, n], seed + 2);
                    group.bench_function(id, |b| {
                        b.iter(|| ops::linear_grad_weight(black_box(&dy), &x).expect("linear_grad_weight"))
                    });
                }
            }
            group.finish();
        }
    }
}

criterion_group!(benches, gemm);
criterion_main!(benches);
