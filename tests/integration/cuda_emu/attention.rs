//! The attention kernels (decode, prefill, backward) against the CPU backend, and their batch
//! invariance.

use super::{bitwise, close, cpu, ffi, geom, host, i32s, rnd};
use kernels::ops::{self, AttnBatch, AttnSeq, KvLayout};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::ops::Range;

/// Positions per decode partition (the host's choice; small here so rows span several).
const PARTITION: usize = 16;
/// RLS_PREFILL_TQ / RLS_PREFILL_TK of paged_attention.cu.
const TQ: usize = 8;
const TK: usize = 32;

/// The per-row metadata of the attention kernels: (block tables concatenated, row_table,
/// row_pos) for sequences `(start_pos, rows, block table)`.
fn attn_meta(seqs: &[(usize, Range<usize>, Vec<u32>)]) -> (Vec<u32>, Vec<i32>, Vec<i32>) {
    let t = seqs.iter().map(|s| s.1.end).max().unwrap_or(0);
    let (mut flat, mut row_table, mut row_pos) = (vec![], vec![0; t], vec![0; t]);
    for (start_pos, rows, table) in seqs {
        for r in rows.clone() {
            row_table[r] = i32::try_from(flat.len()).unwrap();
            row_pos[r] = i32::try_from(start_pos + r - rows.start).unwrap();
        }
        flat.extend(table);
    }
    (flat, row_table, row_pos)
}

/// Shapes of one attention call: heads, KV heads, head_dim, block size.
#[derive(Clone, Copy, Debug)]
struct AttnShape {
    h: usize,
    kvh: usize,
    d: usize,
    bs: usize,
}

/// paged_attention_split + paged_attention_reduce (decode path) on rows described by `meta`.
fn attn_decode(q: &[f32], k: &[f32], v: &[f32], meta: &(Vec<u32>, Vec<i32>, Vec<i32>), s: AttnShape) -> Vec<f32> {
    let (flat, row_table, row_pos) = meta;
    let t = row_pos.len();
    let max_parts = row_pos.iter().map(|&p| (p as usize + 1).div_ceil(PARTITION)).max().unwrap();
    let (mut po, mut pml) = (vec![0.0; t * s.h * max_parts * s.d], vec![0.0; t * s.h * max_parts * 2]);
    let mut out = vec![0.0; t * s.h * s.d];
    let scale = 1.0 / (s.d as f32).sqrt();
    unsafe {
        ffi::emu_paged_attention_split(
            geom([s.h, t, max_parts], [64, 1, 1]).as_ptr(),
            PARTITION * 4,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            flat.as_ptr(),
            row_table.as_ptr(),
            row_pos.as_ptr(),
            po.as_mut_ptr(),
            pml.as_mut_ptr(),
            s.h as i32,
            s.kvh as i32,
            s.d as i32,
            s.bs as i32,
            PARTITION as i32,
            max_parts as i32,
            scale,
        );
        ffi::emu_paged_attention_reduce(
            geom([s.h, t, 1], [32, 1, 1]).as_ptr(),
            0,
            po.as_ptr(),
            pml.as_ptr(),
            row_pos.as_ptr(),
            out.as_mut_ptr(),
            s.h as i32,
            s.d as i32,
            PARTITION as i32,
            max_parts as i32,
        );
    }
    out
}

/// paged_attention_prefill on `tiles` (first row, row count) of one sequence each.
fn attn_prefill(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    meta: &(Vec<u32>, Vec<i32>, Vec<i32>),
    tiles: &[(usize, usize)],
    s: AttnShape,
) -> Vec<f32> {
    let (flat, row_table, row_pos) = meta;
    let t = row_pos.len();
    let tiles = i32s(tiles.iter().flat_map(|&(a, n)| [a, n]));
    let mut out = vec![0.0; t * s.h * s.d];
    let smem = (2 * TQ * s.d + 2 * TK * s.d + TQ * TK + 3 * TQ) * 4;
    unsafe {
        ffi::emu_paged_attention_prefill(
            geom([s.h, tiles.len() / 2, 1], [64, 1, 1]).as_ptr(),
            smem,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            flat.as_ptr(),
            row_table.as_ptr(),
            row_pos.as_ptr(),
            tiles.as_ptr(),
            out.as_mut_ptr(),
            s.h as i32,
            s.kvh as i32,
            s.d as i32,
            s.bs as i32,
            1.0 / (s.d as f32).sqrt(),
        );
    }
    out
}

/// Decode and prefill kernels against the CPU's paged attention on a mixed batch (a decode
/// row, a prefill of 11 rows, a chunked prefill of 3 rows at position 20) over shuffled
/// blocks; then each kernel's batch invariance: a row computed alone equals the same row
/// in the batch, bitwise. Tolerance 2e-6: the kernels sum dot products, exponentials and
/// the weighted values in other orders than the CPU (warp trees, partitions, tiles).
fn check_attention(s: AttnShape) {
    let specs = [(37usize, 1usize), (0, 11), (20, 3)];
    let blocks_needed: usize = specs.iter().map(|(p, n)| (p + n).div_ceil(s.bs)).sum();
    let mut pool: Vec<u32> = (0..blocks_needed as u32 + 2).collect();
    pool.shuffle(&mut StdRng::seed_from_u64(70));
    let (mut seqs, mut row) = (vec![], 0);
    for (start, n) in specs {
        let table: Vec<u32> = pool.drain(..(start + n).div_ceil(s.bs)).collect();
        seqs.push((start, row..row + n, table));
        row += n;
    }
    let t = row;
    let slots = (blocks_needed + 2) * s.bs;
    let (qc, kc) = (s.h * s.d, s.kvh * s.d);
    let (q, k, v) = (rnd(t * qc, 71), rnd(slots * kc, 72), rnd(slots * kc, 73));
    let attn: Vec<AttnSeq> =
        seqs.iter().map(|(p, r, tb)| AttnSeq { rows: r.clone(), start_pos: *p, block_table: tb }).collect();
    let want = ops::paged_attention(
        &cpu(&q, &[t, qc]),
        &cpu(&k, &[slots, kc]),
        &cpu(&v, &[slots, kc]),
        &AttnBatch::new(&attn, s.bs).unwrap(),
        s.h,
        s.kvh,
        s.d,
        KvLayout::Rows,
    )
    .unwrap();
    let want = host(&want);
    let meta = attn_meta(&seqs);
    let decode = attn_decode(&q, &k, &v, &meta, s);
    close(&decode, &want, 2e-6, &format!("decode attention {s:?}"));
    let tiles: Vec<(usize, usize)> =
        seqs.iter().flat_map(|(_, r, _)| r.clone().step_by(TQ).map(move |a| (a, TQ.min(r.end - a)))).collect();
    let prefill = attn_prefill(&q, &k, &v, &meta, &tiles, s);
    close(&prefill, &want, 2e-6, &format!("prefill attention {s:?}"));

    for r in [0, 5, 11, t - 1] {
        let alone_meta = (meta.0.clone(), vec![meta.1[r]], vec![meta.2[r]]);
        let q1 = &q[r * qc..(r + 1) * qc];
        let what = format!("row {r} alone vs batched {s:?}");
        bitwise(&attn_decode(q1, &k, &v, &alone_meta, s), &decode[r * qc..(r + 1) * qc], &format!("decode {what}"));
        bitwise(
            &attn_prefill(q1, &k, &v, &alone_meta, &[(0, 1)], s),
            &prefill[r * qc..(r + 1) * qc],
            &format!("prefill {what}"),
        );
    }
}

#[test]
fn paged_attention_kernels() {
    check_attention(AttnShape { h: 2, kvh: 2, d: 64, bs: 16 });
    check_attention(AttnShape { h: 3, kvh: 1, d: 128, bs: 32 });
}

/// The three attention-backward kernels on packed spans (with a row in no span) against
/// the CPU. Tolerance 1e-5: sequential dot products here, SIMD ones on the CPU, and the
/// softmax sums as a tree.
fn check_attention_backward(h: usize, kvh: usize, d: usize) {
    let spans = [0..7usize, 8..19];
    let t = 19;
    let (qc, kc) = (h * d, kvh * d);
    let (q, k, v, da) = (rnd(t * qc, 80), rnd(t * kc, 81), rnd(t * kc, 82), rnd(t * qc, 83));
    let (mut row_start, mut row_end) = (vec![-1i32; t], vec![-1i32; t]);
    for sp in &spans {
        for r in sp.clone() {
            row_start[r] = sp.start as i32;
            row_end[r] = sp.end as i32;
        }
    }
    let (mut stats, mut dq, mut dk, mut dv) =
        (vec![0.0; t * h * 3], vec![1.0; t * qc], vec![1.0; t * kc], vec![1.0; t * kc]);
    let (th, scale) = (32usize, 1.0 / (d as f32).sqrt());
    unsafe {
        let g = geom([h, t, 1], [th, 1, 1]);
        let args = (q.as_ptr(), k.as_ptr(), v.as_ptr(), da.as_ptr(), row_start.as_ptr());
        ffi::emu_attention_backward_stats(
            g.as_ptr(),
            0,
            args.0,
            args.1,
            args.2,
            args.3,
            args.4,
            stats.as_mut_ptr(),
            h as i32,
            kvh as i32,
            d as i32,
            scale,
        );
        ffi::emu_attention_backward_dq(
            g.as_ptr(),
            (th + d) * 4,
            args.0,
            args.1,
            args.2,
            args.3,
            args.4,
            stats.as_ptr(),
            dq.as_mut_ptr(),
            h as i32,
            kvh as i32,
            d as i32,
            scale,
        );
        ffi::emu_attention_backward_dkdv(
            geom([kvh, t, 1], [th, 1, 1]).as_ptr(),
            (2 * th + 2 * d) * 4,
            args.0,
            args.1,
            args.2,
            args.3,
            args.4,
            row_end.as_ptr(),
            stats.as_ptr(),
            dk.as_mut_ptr(),
            dv.as_mut_ptr(),
            h as i32,
            kvh as i32,
            d as i32,
            scale,
        );
    }
    let (wq, wk, wv) = ops::attention_backward(
        &cpu(&q, &[t, qc]),
        &cpu(&k, &[t, kc]),
        &cpu(&v, &[t, kc]),
        &cpu(&da, &[t, qc]),
        &spans,
        h,
        kvh,
        d,
    )
    .unwrap();
    close(&dq, &host(&wq), 1e-5, "attention_backward dq");
    close(&dk, &host(&wk), 1e-5, "attention_backward dk");
    close(&dv, &host(&wv), 1e-5, "attention_backward dv");
}

#[test]
fn attention_backward_kernels() {
    check_attention_backward(2, 2, 64);
    check_attention_backward(3, 1, 128);
}
