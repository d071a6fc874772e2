//! `ops::rms_norm` over rows of the default model's hidden size (576), for a decode step
//! (1 row) and a prefill chunk (128 rows). Throughput is in normalised values.

use benches::{random_tensor, DECODE_ROWS, HIDDEN, PREFILL_ROWS, RMS_NORM_EPS};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kernels::ops;
use std::hint::black_box;

fn rms_norm(c: &mut Criterion) {
    let w = random_tensor(&[HIDDEN], 20);
    let mut group = c.benchmark_group("rms_norm");
    for rows in [DECODE_ROWS, PREFILL_ROWS] {
        let x = random_tensor(&[rows, HIDDEN], 21);
        group.throughput(Throughput::Elements((rows * HIDDEN) as u64));
        group.bench_function(format!("m{rows}x{HIDDEN}"), |b| {
            b.iter(|| ops::rms_norm(black_box(&x), &w, RMS_NORM_EPS).expect("rms_norm"))
        });
    }
    group.finish();
}

criterion_group!(benches, rms_norm);
criterion_main!(benches);
