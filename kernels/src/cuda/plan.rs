//! The step plan and CUDA graphs (docs/ARCHITECTURE.md, "Step plans and graphs").
//!
//! A [`StepPlan`] is one device buffer of `u32` words, allocated once and never moved, and a
//! host staging vector (uploaded through page-locked memory). A step writes its inputs (token ids, positions, KV slots, row
//! tables, block tables, the sampler's packed rows) into the staging as sections, uploads
//! them in **one** host→device copy, and the ops read them through views of the buffer
//! ([`StepPlan::indices`], [`StepPlan::decode_attn`], [`StepPlan::sample`]): a view's address
//! is the same every step, which is what a captured graph ([`CudaGraph`]) needs, since a
//! graph replays its kernels with the pointers they were captured with.

use super::attention::{partitions, AttnMeta};
use super::device::CudaDevice;
use super::runtime::{DevBuf, GraphExec, GraphPool, HostStaging};
use super::sample::{launch, pack, read, Packed};
use crate::ops::AttnBatch;
use crate::sample::{SampleRow, Sampled};
use crate::{Indices, KernelError, Result, Tensor};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// A step's inputs in one device buffer at a fixed address (see the module doc). A step's
/// sections are built in `staging` (host values the ops also read for their checks), then
/// go up through `pinned`: page-locked host memory of the plan's capacity, allocated once,
/// so the upload is one DMA (vLLM stages its step inputs in pinned buffers too). That copy
/// is asynchronous on a GPU; the next step rewrites `pinned` only after this step's
/// download, which waits for the stream.
pub struct StepPlan {
    dev: CudaDevice,
    buf: Arc<Mutex<DevBuf<u32>>>,
    capacity: usize,
    staging: Vec<u32>,
    pinned: Mutex<HostStaging>,
    /// Positions a row may reach: the split-KV grid covers them in every step.
    max_context: usize,
}

/// The sampler's rows of a step, staged in a [`StepPlan`] ([`StepPlan::stage_sample`]).
pub struct StagedSample {
    packed: Packed,
    meta: Range<usize>,
    /// In words of the plan (an even start: the `u64` values are 8-byte aligned).
    wide: Range<usize>,
}

impl StepPlan {
    /// A plan of `words` 32-bit words on `dev`, for rows whose context is at most
    /// `max_context` positions.
    pub fn new(dev: &CudaDevice, words: usize, max_context: usize) -> Result<Self> {
        let buf = dev.alloc_any::<u32>(words)?;
        Ok(Self {
            dev: dev.clone(),
            buf: Arc::new(Mutex::new(buf)),
            capacity: words,
            staging: Vec::with_capacity(words),
            pinned: Mutex::new(dev.rt().host_staging(words)?),
            max_context,
        })
    }

    /// Empties the staging for a new step.
    pub fn clear(&mut self) {
        self.staging.clear();
    }

    /// Appends a section to the staging; returns its word range in the plan.
    pub fn push(&mut self, words: impl IntoIterator<Item = u32>) -> Range<usize> {
        let start = self.staging.len();
        self.staging.extend(words);
        start..self.staging.len()
    }

    /// Words staged so far (the next section's offset).
    pub fn len(&self) -> usize {
        self.staging.len()
    }

    pub fn is_empty(&self) -> bool {
        self.staging.is_empty()
    }

    /// Whether the staged words fit the device buffer.
    pub fn fits(&self) -> bool {
        self.staging.len() <= self.capacity
    }

    /// The staged words to the device: one host→device copy. Errors when they do not fit.
    pub fn upload(&self) -> Result<()> {
        if !self.fits() {
            return Err(KernelError::Cuda(format!(
                "a step plan of {} words exceeds its buffer of {}",
                self.staging.len(),
                self.capacity
            )));
        }
        let mut buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        let mut pinned = self.pinned.lock().unwrap_or_else(|e| e.into_inner());
        self.dev.rt().htod_staged(&mut pinned, &self.staging, &mut buf)
    }

    /// A view of words `range` as elements of `U`.
    fn view<U: super::runtime::Elem>(&self, range: Range<usize>) -> Result<DevBuf<U>> {
        let keep: Arc<dyn std::any::Any + Send + Sync> = self.buf.clone();
        let buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        let n = range.len() * 4 / std::mem::size_of::<U>();
        self.dev.rt().view(&buf, range.start, n, keep)
    }

    /// The staged section `range` as [`Indices`] whose device copy is the plan's view (no
    /// upload of their own; the host values are the staged ones, for the ops' checks).
    pub fn indices(&self, range: Range<usize>) -> Result<Indices> {
        let idx = Indices::new(self.staging[range.clone()].to_vec());
        self.dev.set_resident(&idx, self.view(range)?);
        Ok(idx)
    }

    /// `batch` (checked by [`AttnBatch::new`]: `n` one-row sequences, row `r` of `q` the
    /// `r`-th) with its device metadata set to the plan's views: `row_table` (each row's
    /// block table as a word offset into the plan) and `row_pos` (each row's position), the
    /// split-KV grid over `max_context` positions.
    pub fn decode_attn(&self, batch: AttnBatch, row_table: Range<usize>, row_pos: Range<usize>) -> Result<AttnBatch> {
        let n = batch.rows();
        let one_row_each = batch.seqs().iter().enumerate().all(|(i, s)| s.rows == (i..i + 1));
        if row_table.len() != n || row_pos.len() != n || !one_row_each {
            return Err(KernelError::Cuda(format!(
                "a decode plan of {} row tables and {} positions for {n} rows, one row per sequence: {}",
                row_table.len(),
                row_pos.len(),
                if one_row_each { "yes" } else { "no" }
            )));
        }
        let meta = AttnMeta::decode_only(
            self.view(0..self.capacity)?,
            self.view(row_table)?,
            self.view(row_pos)?,
            n,
            partitions(self.max_context),
        );
        self.dev.set_resident_attn(&batch, meta);
        Ok(batch)
    }

    /// The staged words `range`, to fill in after later sections were pushed (a table of
    /// offsets to them).
    pub fn words_mut(&mut self, range: Range<usize>) -> &mut [u32] {
        &mut self.staging[range]
    }

    /// Stages `rows` of a sampling call over logits `[m, v]` (checked as
    /// [`crate::ops::sample`] checks them), with buffers any rows of the same count fit
    /// when they ask for at most `k_room` top log-probabilities: launches over them
    /// ([`Self::sample_launch`]) can be captured once and replayed for every later step of
    /// that count. The parameters come first (a fixed size for the count), then the lists:
    /// a section pushed before them keeps its offset from step to step.
    pub fn stage_sample(&mut self, m: usize, v: usize, rows: &[SampleRow], k_room: usize) -> Result<StagedSample> {
        crate::ops::check_sample_rows(m, v, rows)?;
        let packed = pack(rows)?.fixed(k_room)?;
        if self.staging.len() % 2 == 1 {
            self.staging.push(0);
        }
        let wide = self.push(packed.wide.iter().flat_map(|w| [*w as u32, (*w >> 32) as u32]));
        let meta = self.push(packed.meta.iter().map(|&x| x as u32));
        Ok(StagedSample { packed, meta, wide })
    }

    /// The sampler's launches over `logits` for rows staged as `staged` (uploaded with the
    /// plan), reading the plan's views; no host copy, so they may be captured. The results
    /// stay on the device until [`Self::sample_read`].
    pub fn sample_launch(&self, logits: &Tensor, staged: &StagedSample) -> Result<SampleOut> {
        let (_, v) = logits.dims2("sample")?;
        let crate::Storage::Cuda(l) = &logits.storage else {
            return Err(KernelError::DeviceMismatch { op: "sample" });
        };
        let (meta, wide) = (self.view(staged.meta.clone())?, self.view(staged.wide.clone())?);
        Ok(SampleOut(launch(&self.dev, &l.buf, v, &staged.packed, &meta, &wide)?))
    }

    /// What the sampler wrote into `out` for `rows` (staged as `staged`): one download of
    /// the token, μ, the raw and the top log-probabilities per row.
    pub fn sample_read(&self, out: &SampleOut, staged: &StagedSample, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
        read(&self.dev, &out.0, &staged.packed, rows)
    }
}

/// The sampler's results on the device ([`StepPlan::sample_launch`]); a graph that captured
/// the launches keeps it, and each replay rewrites it.
pub struct SampleOut(DevBuf<f32>);

/// A captured CUDA graph ([`CudaDevice::capture`]): [`Self::replay`] runs its kernels again
/// with the pointers and scalars they were captured with, in one graph launch.
pub struct CudaGraph {
    dev: CudaDevice,
    exec: GraphExec,
}

impl CudaGraph {
    /// One graph launch on the device's stream.
    pub fn replay(&self) -> Result<()> {
        self.dev.rt().replay(&self.exec)
    }
}

/// The buffers of the graphs captured with it ([`GraphPool`]).
pub struct CudaGraphPool(pub(super) GraphPool);

impl CudaDevice {
    /// A pool for graphs that never run at the same time (see [`GraphPool`]).
    pub fn graph_pool(&self) -> CudaGraphPool {
        CudaGraphPool(GraphPool::default())
    }

    /// Captures the work `f` queues on this device into a graph (nothing runs until
    /// [`CudaGraph::replay`]); see `Runtime::capture` for what `f` may do.
    pub fn capture<R, E: From<KernelError>>(
        &self,
        pool: &CudaGraphPool,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(CudaGraph, R), E> {
        let (exec, out) = self.rt().capture(&pool.0, f)?;
        Ok((CudaGraph { dev: self.clone(), exec }, out))
    }

    /// A step plan on this device ([`StepPlan::new`]).
    pub fn step_plan(&self, words: usize, max_context: usize) -> Result<StepPlan> {
        StepPlan::new(self, words, max_context)
    }
}
