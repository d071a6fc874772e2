//! Host side of the attention kernels (paged_attention.cu, attention_backward.cu): the
//! per-row metadata, the choice of kernel per sequence, and the launches.

use super::runtime::{r, w, Arg, LaunchCfg};
use super::storage::{int, ints, CudaStorage};
use crate::backend::{BackendDevice, BackendStorage};
use crate::ops::AttnSeq;
use crate::Result;
use std::ops::Range;

/// Positions per decode partition (paged_attention_split); fixed, so a row's sums never
/// depend on the batch.
const PARTITION: usize = 256;
/// Threads per block of the attention kernels (a multiple of 32).
const THREADS: u32 = 128;
/// RLS_PREFILL_TQ / RLS_PREFILL_TK of paged_attention.cu.
const TQ: usize = 8;
const TK: usize = 32;

fn cfg(grid: (usize, usize, usize), threads: u32, smem: usize) -> LaunchCfg {
    LaunchCfg { grid: (grid.0 as u32, grid.1 as u32, grid.2 as u32), block: (threads, 1, 1), smem: smem as u32 }
}

/// Paged attention. A sequence with one query row (decode) runs the split-KV kernels, a
/// longer one (prefill, chunked prefill, the learner's spans) the tiled prefill kernel; the
/// choice depends on the row's own sequence only, so rows stay batch-invariant. With
/// `--batch-invariant` every row runs the split-KV kernels, whose sums depend on the row's
/// position alone: a token decoded by the engine and the same token in the learner's
/// packed batch get the same bits.
#[allow(clippy::too_many_arguments)]
pub(super) fn paged_attention(
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    seqs: &[AttnSeq],
    block_size: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<CudaStorage> {
    let dev = q.device_ref();
    let qc = n_heads * head_dim;
    let t = q.to_len() / qc;
    let (mut flat, mut row_table, mut row_pos) = (Vec::<u32>::new(), vec![0usize; t], vec![0usize; t]);
    let (mut decode_rows, mut tiles) = (Vec::<u32>::new(), Vec::<usize>::new());
    for s in seqs {
        for (i, r) in s.rows.clone().enumerate() {
            row_table[r] = flat.len();
            row_pos[r] = s.start_pos + i;
        }
        flat.extend_from_slice(s.block_table);
        if s.rows.len() == 1 || dev.batch_invariant() {
            decode_rows.extend(s.rows.clone().map(|r| r as u32));
        } else {
            for a in s.rows.clone().step_by(TQ) {
                tiles.extend([a, TQ.min(s.rows.end - a)]);
            }
        }
    }
    let mut out = dev.zeros(t * qc)?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (h, kvh, d, bs) = (int(n_heads)?, int(n_kv_heads)?, int(head_dim)?, int(block_size)?);
    let tables = dev.upload_any(&flat)?;
    if !tiles.is_empty() {
        let (rt, rp, tl) = (
            dev.upload_any(&ints(row_table.clone())?)?,
            dev.upload_any(&ints(row_pos.clone())?)?,
            dev.upload_any(&ints(tiles.clone())?)?,
        );
        let smem = (2 * TQ * head_dim + 2 * TK * head_dim + TQ * TK + 3 * TQ) * 4;
        if smem > 48 * 1024 {
            dev.rt().set_max_dynamic_smem("paged_attention.cu", "paged_attention_prefill", smem as u32)?;
        }
        let args = &mut [
            r(&q.buf),
            r(&k.buf),
            r(&v.buf),
            r(&tables),
            r(&rt),
            r(&rp),
            r(&tl),
            w(&mut out.buf),
            Arg::I32(h),
            Arg::I32(kvh),
            Arg::I32(d),
            Arg::I32(bs),
            Arg::F32(scale),
        ];
        let c = cfg((n_heads, tiles.len() / 2, 1), THREADS, smem);
        dev.launch("paged_attention.cu", "paged_attention_prefill", c, args)?;
    }
    if !decode_rows.is_empty() {
        // The decode rows, gathered into a compact batch and scattered back.
        let nd = decode_rows.len();
        let qd = q.gather_rows(&decode_rows, qc)?;
        let pos: Vec<usize> = decode_rows.iter().map(|&r| row_pos[r as usize]).collect();
        let tab: Vec<usize> = decode_rows.iter().map(|&r| row_table[r as usize]).collect();
        let max_parts = pos.iter().map(|p| (p + 1).div_ceil(PARTITION)).max().unwrap_or(1);
        let (rt, rp) = (dev.upload_any(&ints(tab)?)?, dev.upload_any(&ints(pos)?)?);
        let mut part_out = dev.zeros_any::<f32>(nd * n_heads * max_parts * head_dim)?;
        let mut part_ml = dev.zeros_any::<f32>(nd * n_heads * max_parts * 2)?;
        let mut od = dev.zeros(nd * qc)?;
        let (pi, mp) = (int(PARTITION)?, int(max_parts)?);
        let args = &mut [
            r(&qd.buf),
            r(&k.buf),
            r(&v.buf),
            r(&tables),
            r(&rt),
            r(&rp),
            w(&mut part_out),
            w(&mut part_ml),
            Arg::I32(h),
            Arg::I32(kvh),
            Arg::I32(d),
            Arg::I32(bs),
            Arg::I32(pi),
            Arg::I32(mp),
            Arg::F32(scale),
        ];
        let c = cfg((n_heads, nd, max_parts), THREADS, PARTITION * 4);
        dev.launch("paged_attention.cu", "paged_attention_split", c, args)?;
        let args = &mut [
            r(&part_out),
            r(&part_ml),
            r(&rp),
            w(&mut od.buf),
            Arg::I32(h),
            Arg::I32(d),
            Arg::I32(pi),
            Arg::I32(mp),
        ];
        let c = cfg((n_heads, nd, 1), head_dim.div_ceil(32) as u32 * 32, 0);
        dev.launch("paged_attention.cu", "paged_attention_reduce", c, args)?;
        out.scatter_rows(&decode_rows, &od, qc)?;
    }
    Ok(out)
}

/// Attention backward over packed spans: statistics, then dq, then dk/dv (three launches of
/// attention_backward.cu; rows in no span get zero gradients).
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward(
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    da: &CudaStorage,
    spans: &[Range<usize>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let dev = q.device_ref();
    let (qc, kc) = (n_heads * head_dim, n_kv_heads * head_dim);
    let t = q.to_len() / qc;
    let (mut dq, mut dk, mut dv) = (dev.zeros(t * qc)?, dev.zeros(t * kc)?, dev.zeros(t * kc)?);
    if t == 0 {
        return Ok((dq, dk, dv));
    }
    let (mut start, mut end) = (vec![-1i32; t], vec![-1i32; t]);
    for s in spans {
        for r in s.clone() {
            start[r] = int(s.start)?;
            end[r] = int(s.end)?;
        }
    }
    let (rs, re) = (dev.upload_any(&start)?, dev.upload_any(&end)?);
    let mut stats = dev.zeros_any::<f32>(t * n_heads * 3)?;
    let (h, kvh, d) = (int(n_heads)?, int(n_kv_heads)?, int(head_dim)?);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let th = THREADS as usize;
    let args = &mut [
        r(&q.buf),
        r(&k.buf),
        r(&v.buf),
        r(&da.buf),
        r(&rs),
        w(&mut stats),
        Arg::I32(h),
        Arg::I32(kvh),
        Arg::I32(d),
        Arg::F32(scale),
    ];
    dev.launch("attention_backward.cu", "attention_backward_stats", cfg((n_heads, t, 1), THREADS, 0), args)?;
    let args = &mut [
        r(&q.buf),
        r(&k.buf),
        r(&v.buf),
        r(&da.buf),
        r(&rs),
        r(&stats),
        w(&mut dq.buf),
        Arg::I32(h),
        Arg::I32(kvh),
        Arg::I32(d),
        Arg::F32(scale),
    ];
    let c = cfg((n_heads, t, 1), THREADS, (th + head_dim) * 4);
    dev.launch("attention_backward.cu", "attention_backward_dq", c, args)?;
    let args = &mut [
        r(&q.buf),
        r(&k.buf),
        r(&v.buf),
        r(&da.buf),
        r(&rs),
        r(&re),
        r(&stats),
        w(&mut dk.buf),
        w(&mut dv.buf),
        Arg::I32(h),
        Arg::I32(kvh),
        Arg::I32(d),
        Arg::F32(scale),
    ];
    let c = cfg((n_kv_heads, t, 1), THREADS, (2 * th + 2 * head_dim) * 4);
    dev.launch("attention_backward.cu", "attention_backward_dkdv", c, args)?;
    Ok((dq, dk, dv))
}
