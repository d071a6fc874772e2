//! The CUDA side of [`crate::ops::sample`]: the rows packed into the two buffers
//! `kernels/cuda/sampler.cu` reads (its header gives the layout), two launches (`sampler`
//! over the draws, `sample_logprobs` over every row: [`launch`]), one download of
//! `[rows, 3 + 2K]` results ([`read`]). The logits stay on the device.

use super::device::{row_cfg, CudaDevice};
use super::runtime::{r, w, Arg, DevBuf};
use super::storage::int;
use crate::sample::{Draw, RowTask, SampleRow, Sampled};
use crate::Result;

/// Threads per block of `sampler` (its header: any power of two ≤ 1024): 1024 on a GPU (the
/// truncating draws' in-block sort of ≥ vocab keys); 64 on the emulated device, which runs a
/// host thread per CUDA thread (1024 made the emulated engine tests 5× slower). The draw
/// does not depend on it beyond the prefix sums' rounding (sampler.cu's header).
fn sampler_threads(dev: &CudaDevice) -> u32 {
    if dev.rt().emulated() {
        64
    } else {
        1024
    }
}

/// Threads per block of `sample_logprobs`: `token_logprobs`' (the same f64 sum order, so
/// the raw log-probabilities are the learner's ℓ bitwise).
const LOGPROB_THREADS: u32 = 256;

/// `rows` in the kernels' packed form.
pub(super) struct Packed {
    pub(super) meta: Vec<i32>,
    pub(super) wide: Vec<u64>,
    /// Entry `j` of the kernels is `rows[order[j]]` (the draws first).
    order: Vec<usize>,
    /// Draws, and top log-probabilities per row (K).
    d: usize,
    k: usize,
    /// The K the results buffer has room for (≥ `k`; [`Packed::fixed`]).
    k_room: usize,
    /// Whether some draw truncates (then `sampler` sorts: the `keys` scratch).
    truncates: bool,
}

impl Packed {
    /// The same rows with buffers that any rows of the same count fit: results with room for
    /// `k_room` top log-probabilities per row, the sort scratch whether or not a draw
    /// truncates. A graph captured over these launches then serves every later step of the
    /// same entry count (the kernels read K, the lists and the parameters from `meta` and
    /// `wide`, not from the launch). Errors when `k` exceeds `k_room`.
    pub(super) fn fixed(mut self, k_room: usize) -> Result<Self> {
        if self.k > k_room {
            return Err(crate::KernelError::Cuda(format!(
                "{} top log-probabilities exceed the room for {k_room}",
                self.k
            )));
        }
        (self.k_room, self.truncates) = (k_room, true);
        Ok(self)
    }
}

pub(super) fn pack(rows: &[SampleRow]) -> Result<Packed> {
    let draw = |i: &usize| match &rows[*i].task {
        RowTask::Draw(d) => Some(d),
        RowTask::Score(_) => None,
    };
    let mut order: Vec<usize> = (0..rows.len()).filter(|i| draw(i).is_some()).collect();
    let draws: Vec<&Draw> = order.iter().filter_map(draw).collect();
    let d = order.len();
    order.extend((0..rows.len()).filter(|i| draw(i).is_none()));
    let n = order.len();
    let k = rows.iter().map(|r| r.top_logprobs).max().unwrap_or(0);
    let total = |f: fn(&Draw) -> usize| draws.iter().map(|x| f(x)).sum::<usize>();
    let (n_rep, n_out, n_bias, n_mask) = (
        total(|x| x.rep_tokens.len()),
        total(|x| x.out_counts.len()),
        total(|x| x.bias.len()),
        total(|x| x.mask.len()),
    );
    let mut meta = Vec::with_capacity(7 + 4 * n + 4 * (d + 1) + n_rep + 2 * n_out + 3 * n_bias + n_mask);
    meta.extend([n, d, k, n_rep, n_out, n_bias, n_mask].map(|x| x as i32));
    for &i in &order {
        meta.push(int(rows[i].row)?);
    }
    meta.extend(order.iter().map(|&i| match rows[i].task {
        RowTask::Score(t) => t as i32,
        RowTask::Draw(_) => 0,
    }));
    meta.extend(order.iter().map(|&i| rows[i].top_logprobs as i32));
    meta.extend(order.iter().map(|i| draw(i).is_some_and(|x| x.untouched()) as i32));
    let offsets = |meta: &mut Vec<i32>, len: fn(&Draw) -> usize| {
        let mut at = 0;
        meta.push(0);
        for x in &draws {
            at += len(x);
            meta.push(at as i32);
        }
    };
    offsets(&mut meta, |x| x.rep_tokens.len());
    offsets(&mut meta, |x| x.out_counts.len());
    offsets(&mut meta, |x| x.bias.len());
    offsets(&mut meta, |x| x.mask.len());
    let ids = |v: &mut Vec<i32>, it: &mut dyn Iterator<Item = u32>| v.extend(it.map(|t| t as i32));
    ids(&mut meta, &mut draws.iter().flat_map(|x| x.rep_tokens.iter().copied()));
    ids(&mut meta, &mut draws.iter().flat_map(|x| x.out_counts.iter().map(|c| c.0)));
    ids(&mut meta, &mut draws.iter().flat_map(|x| x.out_counts.iter().map(|c| c.1)));
    ids(&mut meta, &mut draws.iter().flat_map(|x| x.bias.iter().map(|b| b.0)));
    let bits = draws.iter().flat_map(|x| x.bias.iter().map(|b| b.1.to_bits()));
    ids(&mut meta, &mut bits.flat_map(|w| [w as u32, (w >> 32) as u32]));
    ids(&mut meta, &mut draws.iter().flat_map(|x| x.mask.iter().copied()));
    // `RlsSampleParams`: six f32 and two i32 in 4 words, then seed and step (48 bytes).
    let mut wide = Vec::with_capacity(6 * d);
    let word = |a: u32, b: u32| a as u64 | (b as u64) << 32;
    for x in &draws {
        let p = &x.params;
        wide.extend([
            word(p.temperature.to_bits(), p.top_p.to_bits()),
            word(p.min_p.to_bits(), p.repetition_penalty.to_bits()),
            word(p.presence_penalty.to_bits(), p.frequency_penalty.to_bits()),
            word(p.top_k as u32, p.pad as u32),
            p.seed,
            p.step,
        ]);
    }
    Ok(Packed { meta, wide, order, d, k, k_room: k, truncates: draws.iter().any(|x| x.truncates() && !x.is_greedy()) })
}

/// [`crate::backend::BackendStorage::sample`] on `logits [_, v]`.
pub(super) fn sample(dev: &CudaDevice, logits: &DevBuf<f32>, v: usize, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
    let p = pack(rows)?;
    let (meta, wide) = (dev.upload_any(&p.meta)?, dev.upload_any(&p.wide)?);
    let out = launch(dev, logits, v, &p, &meta, &wide)?;
    read(dev, &out, &p, rows)
}

/// The sampler's launches over `rows` packed as `p`, whose `meta` and `wide` are on the
/// device (uploaded for this call, or a step plan's views); no host copy, so they may be
/// captured into a graph. Their results `[n, 3 + 2K]` stay on the device for [`read`]. The
/// scratch of a truncating draw (`keys`) is allocated when some draw of `p` truncates, or
/// always after [`Packed::fixed`].
pub(super) fn launch(
    dev: &CudaDevice,
    logits: &DevBuf<f32>,
    v: usize,
    p: &Packed,
    meta: &DevBuf<i32>,
    wide: &DevBuf<u64>,
) -> Result<DevBuf<f32>> {
    let n = p.order.len();
    let mut out = dev.alloc_any::<f32>(n * (3 + 2 * p.k_room))?;
    let vi = int(v)?;
    if p.d > 0 {
        let sort_len = v.next_power_of_two();
        let (mut work, mut cum) = (dev.alloc_any::<f32>(p.d * v)?, dev.alloc_any::<f64>(p.d * v)?);
        let mut keys = if p.truncates { Some(dev.alloc_any::<u64>(p.d * sort_len)?) } else { None };
        let args = &mut [
            r(logits),
            Arg::I32(vi),
            r(meta),
            r(wide),
            w(&mut work),
            keys.as_mut().map_or(Arg::Null(0), w),
            w(&mut cum),
            Arg::I32(int(sort_len)?),
            w(&mut out),
        ];
        dev.launch("sampler.cu", "sampler", row_cfg(p.d, sampler_threads(dev)), args)?;
    }
    let args = &mut [r(logits), Arg::I32(vi), r(meta), r(wide), w(&mut out)];
    dev.launch("sampler.cu", "sample_logprobs", row_cfg(n, LOGPROB_THREADS), args)?;
    Ok(out)
}

/// The results [`launch`] left in `out` for `rows` packed as `p`: one download of
/// `n · (3 + 2K)` values (K: `p`'s, whatever room `out` has).
pub(super) fn read(dev: &CudaDevice, out: &DevBuf<f32>, p: &Packed, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
    let stride = 3 + 2 * p.k;
    let host = dev.rt().dtoh_prefix(out, p.order.len() * stride)?;
    let mut res = vec![None; rows.len()];
    for (j, o) in host.chunks(stride).enumerate() {
        let i = p.order[j];
        let top = (0..rows[i].top_logprobs).map(|r| (o[3 + 2 * r].to_bits(), o[4 + 2 * r])).collect();
        res[i] = Some(Sampled { token: o[0].to_bits(), behavior_logprob: o[1], raw_logprob: o[2], top_logprobs: top });
    }
    Ok(res.into_iter().map(|s| s.expect("every row has an entry")).collect())
}
