//! Host side of the attention kernels (paged_attention.cu, attention_backward.cu): the
//! per-row metadata, the choice of kernel per sequence, and the launches.

use super::device::CudaDevice;
use super::runtime::{r, w, Arg, DevBuf, LaunchCfg};
use super::storage::{int, ints, CudaStorage};
use crate::backend::BackendDevice;
use crate::ops::AttnBatch;
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

/// An [`AttnBatch`]'s metadata on the device, built and uploaded by the first layer of a
/// step ([`CudaDevice::attn_meta`]) and read by every layer.
pub struct AttnMeta {
    /// The block tables, concatenated.
    tables: DevBuf<u32>,
    prefill: Option<PrefillMeta>,
    decode: Option<DecodeMeta>,
}

/// The tiled prefill kernel's rows: every row's offset into `tables` and position, and the
/// tiles `(first row, rows)` of the sequences with more than one row.
struct PrefillMeta {
    row_table: DevBuf<i32>,
    row_pos: DevBuf<i32>,
    tiles: DevBuf<i32>,
    n_tiles: usize,
}

/// The split-KV kernels' rows, compacted: `rows` (`None` when they are all the rows of `q`
/// in order, as in a decode-only step: no gather or scatter), their table offsets and
/// positions, and the most partitions a row needs.
struct DecodeMeta {
    rows: Option<DevBuf<u32>>,
    n: usize,
    row_table: DevBuf<i32>,
    row_pos: DevBuf<i32>,
    max_parts: usize,
}

/// Partitions of the split-KV kernels for a context of `max_context` positions (a captured
/// graph's fixed grid: partitions past a row's context write nothing and are not read).
pub(super) fn partitions(max_context: usize) -> usize {
    max_context.div_ceil(PARTITION).max(1)
}

impl AttnMeta {
    /// A decode-only step's metadata over a step plan's views: `n` one-row sequences, all
    /// the rows of `q` in order; `row_table[r]` is row `r`'s offset into `tables`; the grid
    /// covers `max_parts` partitions whatever the rows' positions (a graph's launches do not
    /// change from step to step).
    pub(super) fn decode_only(
        tables: DevBuf<u32>,
        row_table: DevBuf<i32>,
        row_pos: DevBuf<i32>,
        n: usize,
        max_parts: usize,
    ) -> Self {
        let decode = DecodeMeta { rows: None, n, row_table, row_pos, max_parts };
        Self { tables, prefill: None, decode: Some(decode) }
    }

    /// A sequence with one query row (decode) runs the split-KV kernels, a longer one
    /// (prefill, chunked prefill, the learner's spans) the tiled prefill kernel; with
    /// `--batch-invariant` every row runs the split-KV kernels.
    fn build(dev: &CudaDevice, batch: &AttnBatch) -> Result<Self> {
        let t = batch.rows();
        let (mut flat, mut row_table, mut row_pos) = (Vec::<u32>::new(), vec![0usize; t], vec![0usize; t]);
        let (mut decode_rows, mut tiles) = (Vec::<u32>::new(), Vec::<usize>::new());
        for s in batch.seqs() {
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
        let prefill = if tiles.is_empty() {
            None
        } else {
            Some(PrefillMeta {
                row_table: dev.upload_any(&ints(row_table.iter().copied())?)?,
                row_pos: dev.upload_any(&ints(row_pos.iter().copied())?)?,
                n_tiles: tiles.len() / 2,
                tiles: dev.upload_any(&ints(tiles)?)?,
            })
        };
        let decode = if decode_rows.is_empty() {
            None
        } else {
            let pos: Vec<usize> = decode_rows.iter().map(|&r| row_pos[r as usize]).collect();
            let tab: Vec<usize> = decode_rows.iter().map(|&r| row_table[r as usize]).collect();
            let all_in_order = decode_rows.len() == t && decode_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
            Some(DecodeMeta {
                rows: if all_in_order { None } else { Some(dev.upload_any(&decode_rows)?) },
                n: decode_rows.len(),
                max_parts: pos.iter().map(|p| (p + 1).div_ceil(PARTITION)).max().unwrap_or(1),
                row_table: dev.upload_any(&ints(tab)?)?,
                row_pos: dev.upload_any(&ints(pos)?)?,
            })
        };
        Ok(Self { tables: dev.upload_any(&flat)?, prefill, decode })
    }
}

/// Paged attention ([`crate::ops::paged_attention`]) through the batch's resident metadata
/// ([`AttnMeta::build`] says which rows take which kernel). The choice depends on the row's
/// own sequence only, so rows stay batch-invariant; with `--batch-invariant` every row runs
/// the split-KV kernels, whose sums depend on the row's position alone: a token decoded by
/// the engine and the same token in the learner's packed batch get the same bits.
pub(super) fn paged_attention(
    q: &CudaStorage,
    k: &CudaStorage,
    v: &CudaStorage,
    batch: &AttnBatch,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<CudaStorage> {
    let dev = q.device_ref();
    let meta = dev.attn_meta(batch, || AttnMeta::build(dev, batch))?;
    let qc = n_heads * head_dim;
    let t = q.to_len() / qc;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let (h, kvh, d, bs) = (int(n_heads)?, int(n_kv_heads)?, int(head_dim)?, int(batch.block_size())?);
    let mut out = match &meta.decode {
        Some(dm) if dm.rows.is_none() => None, // the split-KV output is the whole output
        _ => Some(q.uninit_like(t * qc)?),
    };
    if let (Some(p), Some(out)) = (&meta.prefill, out.as_mut()) {
        let smem = (2 * TQ * head_dim + 2 * TK * head_dim + TQ * TK + 3 * TQ) * 4;
        if smem > 48 * 1024 {
            dev.rt().set_max_dynamic_smem("paged_attention.cu", "paged_attention_prefill", smem as u32)?;
        }
        let args = &mut [
            r(&q.buf),
            r(&k.buf),
            r(&v.buf),
            r(&meta.tables),
            r(&p.row_table),
            r(&p.row_pos),
            r(&p.tiles),
            w(&mut out.buf),
            Arg::I32(h),
            Arg::I32(kvh),
            Arg::I32(d),
            Arg::I32(bs),
            Arg::F32(scale),
        ];
        let c = cfg((n_heads, p.n_tiles, 1), THREADS, smem);
        dev.launch("paged_attention.cu", "paged_attention_prefill", c, args)?;
    }
    if let Some(dm) = &meta.decode {
        // The decode rows, gathered into a compact batch and scattered back (unless they
        // are all the rows, in order).
        let nd = dm.n;
        let gathered;
        let qd = match &dm.rows {
            Some(rows) => {
                gathered = q.gather(rows, nd, qc)?;
                &gathered
            }
            None => q,
        };
        let mut part_out = dev.alloc_any::<f32>(nd * n_heads * dm.max_parts * head_dim)?;
        let mut part_ml = dev.alloc_any::<f32>(nd * n_heads * dm.max_parts * 2)?;
        let mut od = q.uninit_like(nd * qc)?;
        let (pi, mp) = (int(PARTITION)?, int(dm.max_parts)?);
        let args = &mut [
            r(&qd.buf),
            r(&k.buf),
            r(&v.buf),
            r(&meta.tables),
            r(&dm.row_table),
            r(&dm.row_pos),
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
        let c = cfg((n_heads, nd, dm.max_parts), THREADS, PARTITION * 4);
        dev.launch("paged_attention.cu", "paged_attention_split", c, args)?;
        let args = &mut [
            r(&part_out),
            r(&part_ml),
            r(&dm.row_pos),
            w(&mut od.buf),
            Arg::I32(h),
            Arg::I32(d),
            Arg::I32(pi),
            Arg::I32(mp),
        ];
        let c = cfg((n_heads, nd, 1), head_dim.div_ceil(32) as u32 * 32, 0);
        dev.launch("paged_attention.cu", "paged_attention_reduce", c, args)?;
        match (&dm.rows, out.as_mut()) {
            (Some(rows), Some(out)) => out.scatter("scatter_rows", rows, nd, &od, qc)?,
            _ => return Ok(od),
        }
    }
    Ok(out.expect("allocated unless every row is a decode row"))
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
    let mut stats = dev.alloc_any::<f32>(t * n_heads * 3)?;
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
