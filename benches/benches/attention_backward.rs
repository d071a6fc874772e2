//! `ops::attention_backward` (the learner's causal attention backward, probabilities
//! recomputed) at the default model's head layout: a learner batch of 8 sequences of 256
//! tokens packed in one call. Throughput is in attended (query row, key) pairs per head group.

use benches::{random_tensor, HEAD_DIM, N_HEADS, N_KV_HEADS};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kernels::ops;
use std::hint::black_box;

/// Sequences per learner batch and tokens per sequence.
const SEQS: usize = 8;
const TOKENS: usize = 256;

fn backward(c: &mut Criterion) {
    let t = SEQS * TOKENS;
    let q = random_tensor(&[t, N_HEADS * HEAD_DIM], 20);
    let k = random_tensor(&[t, N_KV_HEADS * HEAD_DIM], 21);
    let v = random_tensor(&[t, N_KV_HEADS * HEAD_DIM], 22);
    let da = random_tensor(&[t, N_HEADS * HEAD_DIM], 23);
    let spans: Vec<_> = (0..SEQS).map(|s| s * TOKENS..(s + 1) * TOKENS).collect();
    let mut group = c.benchmark_group("attention_backward");
    group.sample_size(10);
    group.throughput(Throughput::Elements((SEQS * TOKENS * (TOKENS + 1) / 2) as u64));
    group.bench_function(format!("{SEQS}x{TOKENS}tokens"), |b| {
        b.iter(|| {
            ops::attention_backward(black_box(&q), &k, &v, &da, &spans, N_HEADS, N_KV_HEADS, HEAD_DIM)
                .expect("attention backward")
        })
    });
    group.finish();
}

criterion_group!(benches, backward);
criterion_main!(benches);
