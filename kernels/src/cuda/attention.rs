//! Host side of the attention kernels (paged_attention.cu, attention_backward.cu): the
//! per-row metadata, the choice of kernel per sequence, and the launches.

use super::device::{cuda_err, launch};
use super::storage::{int, ints, CudaStorage};
use crate::backend::{BackendDevice, BackendStorage};
use crate::ops::AttnSeq;
use crate::Result;
use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ops::Range;

/// Positions per decode partition (paged_attention_split); fixed, so a row's sums never
/// depend on the batch.
const PARTITION: usize = 256;
/// Threads per block of the attention kernels (a multiple of 32).
const THREADS: u32 = 128;
/// RLS_PREFILL_TQ / RLS_PREFILL_TK of paged_attention.cu.
const TQ: usize = 8;
const TK: usize = 32;

fn cfg(grid: (usize, usize, usize), threads: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    }
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
        let f = dev.function("paged_attention.cu", "paged_attention_prefill")?;
        if smem > 48 * 1024 {
            f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32).map_err(cuda_err)?;
        }
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&q.buf).arg(&k.buf).arg(&v.buf).arg(&tables).arg(&rt).arg(&rp).arg(&tl).arg(&mut out.buf);
        b.arg(&h).arg(&kvh).arg(&d).arg(&bs).arg(&scale);
        launch(b, cfg((n_heads, tiles.len() / 2, 1), THREADS, smem))?;
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
        let f = dev.function("paged_attention.cu", "paged_attention_split")?;
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&qd.buf).arg(&k.buf).arg(&v.buf).arg(&tables).arg(&rt).arg(&rp).arg(&mut part_out).arg(&mut part_ml);
        b.arg(&h).arg(&kvh).arg(&d).arg(&bs).arg(&pi).arg(&mp).arg(&scale);
        launch(b, cfg((n_heads, nd, max_parts), THREADS, PARTITION * 4))?;
        let f = dev.function("paged_attention.cu", "paged_attention_reduce")?;
        let mut b = dev.stream().launch_builder(&f);
        b.arg(&part_out).arg(&part_ml).arg(&rp).arg(&mut od.buf).arg(&h).arg(&d).arg(&pi).arg(&mp);
        launch(b, cfg((n_heads, nd, 1), head_dim.div_ceil(32) as u32 * 32, 0))?;
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
    let f = dev.function("attention_backward.cu", "attention_backward_stats")?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&q.buf).arg(&k.buf).arg(&v.buf).arg(&da.buf).arg(&rs).arg(&mut stats).arg(&h).arg(&kvh).arg(&d).arg(&scale);
    launch(b, cfg((n_heads, t, 1), THREADS, 0))?;
    let f = dev.function("attention_backward.cu", "attention_backward_dq")?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&q.buf).arg(&k.buf).arg(&v.buf).arg(&da.buf).arg(&rs).arg(&stats).arg(&mut dq.buf);
    b.arg(&h).arg(&kvh).arg(&d).arg(&scale);
    launch(b, cfg((n_heads, t, 1), THREADS, (th + head_dim) * 4))?;
    let f = dev.function("attention_backward.cu", "attention_backward_dkdv")?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(&q.buf).arg(&k.buf).arg(&v.buf).arg(&da.buf).arg(&rs).arg(&re).arg(&stats).arg(&mut dk.buf).arg(&mut dv.buf);
    b.arg(&h).arg(&kvh).arg(&d).arg(&scale);
    launch(b, cfg((n_kv_heads, t, 1), THREADS, (2 * th + 2 * head_dim) * 4))?;
    Ok((dq, dk, dv))
}
