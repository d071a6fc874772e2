//! `ops::paged_attention` at the default model's head layout (9 query heads, 3 KV heads,
//! head_dim 64, blocks of 16): a decode step of 64 sequences of 256 context tokens each, and
//! the prefill of one 128-token prompt, over each KV layout. Block tables interleave the
//! sequences' blocks, as a pool shared by many sequences does. Throughput is in attended
//! (query row, key) pairs.

use benches::{random_tensor, BLOCK_SIZE, HEAD_DIM, N_HEADS, N_KV_HEADS, PREFILL_ROWS};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kernels::ops::{self, AttnBatch, AttnSeq, KvLayout};
use kernels::Tensor;
use std::hint::black_box;

/// Both cache layouts (the values are random, so either reading of them is a cache).
const LAYOUTS: [KvLayout; 2] = [KvLayout::Rows, KvLayout::Blocked];

/// Decode batch: sequences, and the context of each (its new token included).
const DECODE_SEQS: usize = 64;
const DECODE_CONTEXT: usize = 256;

/// Block tables of `seqs` sequences of `blocks` blocks each, interleaved in one pool: block
/// `j` of sequence `s` is pool block `j · seqs + s`.
fn block_tables(seqs: usize, blocks: usize) -> Vec<Vec<u32>> {
    (0..seqs).map(|s| (0..blocks).map(|j| (j * seqs + s) as u32).collect()).collect()
}

/// A K and a V pool of `blocks` blocks.
fn kv_pool(blocks: usize) -> (Tensor, Tensor) {
    let shape = [blocks * BLOCK_SIZE, N_KV_HEADS * HEAD_DIM];
    (random_tensor(&shape, 10), random_tensor(&shape, 11))
}

fn decode(c: &mut Criterion) {
    let blocks = DECODE_CONTEXT.div_ceil(BLOCK_SIZE);
    let tables = block_tables(DECODE_SEQS, blocks);
    let (k, v) = kv_pool(DECODE_SEQS * blocks);
    let q = random_tensor(&[DECODE_SEQS, N_HEADS * HEAD_DIM], 12);
    // Each sequence's one new row sits at its last position.
    let seqs: Vec<AttnSeq> = tables
        .iter()
        .enumerate()
        .map(|(s, t)| AttnSeq { rows: s..s + 1, start_pos: DECODE_CONTEXT - 1, block_table: t })
        .collect();
    let seqs = AttnBatch::new(&seqs, BLOCK_SIZE).expect("sequences");
    let mut group = c.benchmark_group("paged_attention");
    group.sample_size(20);
    group.throughput(Throughput::Elements((DECODE_SEQS * DECODE_CONTEXT) as u64));
    for layout in LAYOUTS {
        group.bench_function(format!("decode_{DECODE_SEQS}seqs_ctx{DECODE_CONTEXT}_{layout:?}"), |b| {
            b.iter(|| {
                ops::paged_attention(black_box(&q), &k, &v, &seqs, N_HEADS, N_KV_HEADS, HEAD_DIM, layout)
                    .expect("attention")
            })
        });
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    let blocks = PREFILL_ROWS.div_ceil(BLOCK_SIZE);
    let tables = block_tables(1, blocks);
    let (k, v) = kv_pool(blocks);
    let q = random_tensor(&[PREFILL_ROWS, N_HEADS * HEAD_DIM], 13);
    let seqs = [AttnSeq { rows: 0..PREFILL_ROWS, start_pos: 0, block_table: &tables[0] }];
    let seqs = AttnBatch::new(&seqs, BLOCK_SIZE).expect("sequences");
    let mut group = c.benchmark_group("paged_attention");
    group.sample_size(20);
    // Causal: row i attends i + 1 keys.
    group.throughput(Throughput::Elements((PREFILL_ROWS * (PREFILL_ROWS + 1) / 2) as u64));
    for layout in LAYOUTS {
        group.bench_function(format!("prefill_1seq_{PREFILL_ROWS}tokens_{layout:?}"), |b| {
            b.iter(|| {
                ops::paged_attention(black_box(&q), &k, &v, &seqs, N_HEADS, N_KV_HEADS, HEAD_DIM, layout)
                    .expect("attention")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, decode, prefill);
criterion_main!(benches);
