//! The op set shared by every backend. Each function checks shapes and ranges, then calls
//! one method of the backend contract ([`crate::backend::BackendStorage`]) on the storage
//! of its tensors, which must all live on one device.
//!
//! Conventions: activations are `[rows, features]`; linear weights use the Hugging
//! Face layout `[out_features, in_features]`, so a linear layer is `x · Wᵀ`.

use crate::backend::BackendStorage;
use crate::error::shape_err;
use crate::indices::{Idx, Indices};
use crate::sample::{RowTask, SampleRow, Sampled, MAX_TOP_LOGPROBS};
use crate::tensor::Storage;
use crate::{Device, KernelError, Result, Tensor};
use std::ops::Range;

/// Runs `$body` with each named `&Storage` / `&mut Storage` bound to the same backend's
/// storage type; tensors on different devices are [`KernelError::DeviceMismatch`].
macro_rules! backend {
    ($op:expr; $($s:ident),+ => $body:expr) => {{
        #[allow(unreachable_patterns)]
        let r = match ($($s,)+) {
            ($(Storage::Cpu($s),)+) => $body,
            ($(Storage::Cuda($s),)+) => $body,
            _ => Err(KernelError::DeviceMismatch { op: $op }),
        };
        r
    }};
}

mod kv;
pub use kv::{read_kv, write_kv, KvLayout};

/// Every storage of `parts` as one backend's type (`pick` unwraps it), or
/// [`KernelError::DeviceMismatch`].
fn same_backend<'a, S>(
    parts: &[&'a Storage],
    pick: fn(&'a Storage) -> Option<&'a S>,
    op: &'static str,
) -> Result<Vec<&'a S>> {
    parts.iter().map(|s| pick(s).ok_or(KernelError::DeviceMismatch { op })).collect()
}

fn cpu_of(s: &Storage) -> Option<&crate::cpu::CpuStorage> {
    if let Storage::Cpu(x) = s {
        Some(x)
    } else {
        None
    }
}

fn cuda_of(s: &Storage) -> Option<&crate::cuda::CudaStorage> {
    if let Storage::Cuda(x) = s {
        Some(x)
    } else {
        None
    }
}

/// Wraps a backend result as a tensor of `shape`.
fn out<S: Into<Storage>>(r: Result<S>, shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::new(r?.into(), shape))
}

/// A linear layer's weight `[n, k]` in its backend's packed layout (see `cpu::matmul` for
/// the CPU's 64-column panels), the only copy of the weight the engine and learner keep;
/// only [`linear`], [`linear_grad_input`], [`unpack_weight`], [`scale_add_packed_into`] and
/// [`embedding_packed`] read it.
#[derive(Debug, Clone)]
pub struct PackedWeight {
    storage: Storage,
    n: usize,
    k: usize,
}

impl PackedWeight {
    /// `[out_features, in_features]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.n, self.k]
    }

    pub fn device(&self) -> Device {
        self.storage.device()
    }
}

/// Packs a `[n, k]` weight once, for many [`linear`] calls.
pub fn pack_weight(w: &Tensor) -> Result<PackedWeight> {
    let (n, k) = w.dims2("pack_weight")?;
    let s = &w.storage;
    let storage = backend!("pack_weight"; s => s.pack_weight(n, k).map(Storage::from))?;
    Ok(PackedWeight { storage, n, k })
}

/// The `[n, k]` row-major weight back from its packed form.
pub fn unpack_weight(w: &PackedWeight) -> Result<Tensor> {
    let (n, k, s) = (w.n, w.k, &w.storage);
    out(backend!("unpack_weight"; s => s.unpack_weight(n, k).map(Storage::from)), &[n, k])
}

/// `d ← s·w + d` for two weights packed alike, `w` only read: the optimizer's new weight
/// prepared in its step `d` outside the write guard, then made the served one by
/// [`commit_packed`] under it.
pub fn scale_add_packed_into(w: &PackedWeight, s: f32, d: &mut PackedWeight) -> Result<()> {
    if w.shape() != d.shape() {
        return Err(shape_err("scale_add_packed_into", format!("{:?} vs {:?}", w.shape(), d.shape())));
    }
    let (a, b) = (&w.storage, &mut d.storage);
    backend!("scale_add_packed_into"; a, b => a.scale_add_into(s, b))
}

/// `d ← s·w + d` elementwise (same shapes), `w` only read: [`scale_add_packed_into`] for
/// unpacked weights (norms, biases, an untied embedding); then [`commit`].
pub fn scale_add_into(w: &Tensor, s: f32, d: &mut Tensor) -> Result<()> {
    if w.shape() != d.shape() {
        return Err(shape_err("scale_add_into", format!("{:?} vs {:?}", w.shape(), d.shape())));
    }
    let (a, b) = (&w.storage, &mut d.storage);
    backend!("scale_add_into"; a, b => a.scale_add_into(s, b))
}

/// `w` takes `new`'s values (weights packed alike), `new` is left with values to drop: the
/// optimizer's commit under the write guard, a buffer swap where possible
/// ([`BackendStorage::commit_from`]); `keep_address`: something reads `w`'s f32 values at a
/// recorded address (a tied embedding's lookup in a CUDA graph), so they are copied in.
pub fn commit_packed(w: &mut PackedWeight, new: &mut PackedWeight, keep_address: bool) -> Result<()> {
    if w.shape() != new.shape() {
        return Err(shape_err("commit_packed", format!("{:?} vs {:?}", w.shape(), new.shape())));
    }
    let (a, b) = (&mut w.storage, &mut new.storage);
    backend!("commit_packed"; a, b => a.commit_from(b, keep_address))
}

/// [`commit_packed`] for unpacked weights (same shapes).
pub fn commit(w: &mut Tensor, new: &mut Tensor, keep_address: bool) -> Result<()> {
    if w.shape() != new.shape() {
        return Err(shape_err("commit", format!("{:?} vs {:?}", w.shape(), new.shape())));
    }
    let (a, b) = (&mut w.storage, &mut new.storage);
    backend!("commit"; a, b => a.commit_from(b, keep_address))
}

/// `a ← s·a + d` elementwise (same shapes).
pub fn scale_add_inplace(a: &mut Tensor, s: f32, d: &Tensor) -> Result<()> {
    if a.shape() != d.shape() {
        return Err(shape_err("scale_add", format!("{:?} vs {:?}", a.shape(), d.shape())));
    }
    let (a, b) = (&mut a.storage, &d.storage);
    backend!("scale_add"; a, b => a.scale_add_inplace(s, b))
}

/// `s · x` elementwise.
pub fn scale(x: &Tensor, s: f32) -> Result<Tensor> {
    let a = &x.storage;
    out(backend!("scale"; a => a.scale(s).map(Storage::from)), x.shape())
}

/// `Σ x²` over every element, in f64.
pub fn sum_squares(x: &Tensor) -> Result<f64> {
    sum_squares_all(&[x])
}

/// `Σ x²` over every element of every tensor, in f64 (the global gradient norm): on a device
/// one pass per tensor and one read back for all of them (not one per tensor). Tensors on
/// different devices are [`KernelError::DeviceMismatch`].
pub fn sum_squares_all(xs: &[&Tensor]) -> Result<f64> {
    let Some(first) = xs.first() else { return Ok(0.0) };
    let st: Vec<&Storage> = xs.iter().map(|t| &t.storage).collect();
    match &first.storage {
        Storage::Cpu(_) => BackendStorage::sum_squares(&same_backend(&st, cpu_of, "sum_squares")?),
        Storage::Cuda(_) => BackendStorage::sum_squares(&same_backend(&st, cuda_of, "sum_squares")?),
    }
}

/// Linear layer `y = x · Wᵀ (+ bias)`: `x [m, k]`, `w` packed `[n, k]`, `bias [n]` → `[m, n]`.
/// Batch-invariant: row `i` of `y` is bitwise the same for any `m`.
pub fn linear(x: &Tensor, w: &PackedWeight, bias: Option<&Tensor>) -> Result<Tensor> {
    let (m, k) = x.dims2("linear")?;
    if k != w.k {
        return Err(shape_err("linear", format!("x is [{m}, {k}] but w is [{}, {}]", w.n, w.k)));
    }
    let n = w.n;
    let (a, ws) = (&x.storage, &w.storage);
    match bias {
        Some(b) => {
            if b.len() != n {
                return Err(shape_err("linear", format!("bias has {} values, expected {n}", b.len())));
            }
            let b = &b.storage;
            out(backend!("linear"; a, ws, b => a.linear(m, k, ws, n, Some(b)).map(Storage::from)), &[m, n])
        }
        None => out(backend!("linear"; a, ws => a.linear(m, k, ws, n, None).map(Storage::from)), &[m, n]),
    }
}

/// `y = x · Wᵀ (+ bias)` with an unpacked `w [n, k]` (packs it first; for one-off products).
pub fn matmul_t(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (m, k) = x.dims2("matmul_t")?;
    let (n, k2) = w.dims2("matmul_t")?;
    if k != k2 {
        return Err(shape_err("matmul_t", format!("x is [{m}, {k}] but w is [{n}, {k2}]")));
    }
    linear(x, &pack_weight(w)?, bias)
}

/// RMSNorm `y = x / sqrt(mean(x²) + eps) · w` per row (Zhang & Sennrich 2019, eq. 4;
/// HF `LlamaRMSNorm`): `x [m, d]`, `w [d]` → `[m, d]`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let (m, d) = x.dims2("rms_norm")?;
    if w.len() != d {
        return Err(shape_err("rms_norm", format!("weight has {} values, rows have {d}", w.len())));
    }
    let (a, b) = (&x.storage, &w.storage);
    out(backend!("rms_norm"; a, b => a.rms_norm(b, m, d, eps).map(Storage::from)), &[m, d])
}

/// Rotary position embedding in place, HF `rotate_half` layout (Su et al. 2021, eq. 34):
/// within each head, dims `i` and `i + head_dim/2` rotate by `positions[row] · inv_freq[i]`.
/// `x [m, n_heads·head_dim]`, `cos`/`sin [max_pos, head_dim/2]`, `positions.len() == m`.
pub fn rope_inplace<'a>(
    x: &mut Tensor,
    positions: impl Into<Idx<'a>>,
    cos: &Tensor,
    sin: &Tensor,
    head_dim: usize,
) -> Result<()> {
    let positions = positions.into();
    let (m, c) = x.dims2("rope")?;
    let (max_pos, half) = cos.dims2("rope")?;
    if positions.len() != m || half * 2 != head_dim || c % head_dim != 0 || sin.shape() != cos.shape() {
        return Err(shape_err(
            "rope",
            format!("x [{m}, {c}], {} positions, tables [{max_pos}, {half}], head_dim {head_dim}", positions.len()),
        ));
    }
    if let Some(p) = positions.max().filter(|&p| p as usize >= max_pos) {
        return Err(shape_err("rope", format!("position {p} beyond table of {max_pos}")));
    }
    let (a, cs, ss) = (&mut x.storage, &cos.storage, &sin.storage);
    backend!("rope"; a, cs, ss => a.rope_inplace(&positions, cs, ss, c, head_dim))
}

/// SwiGLU `silu(gate) · up` (Shazeer 2020, eq. 5) on a fused projection:
/// `gate_up [m, 2i]` holds `gate` in columns `0..i` and `up` in `i..2i` → `[m, i]`.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    let (m, c) = gate_up.dims2("silu_mul")?;
    if c % 2 != 0 {
        return Err(shape_err("silu_mul", format!("gate_up has {c} columns, expected an even number")));
    }
    let a = &gate_up.storage;
    out(backend!("silu_mul"; a => a.silu_mul(m, c / 2).map(Storage::from)), &[m, c / 2])
}

/// Splits the columns of `x [m, c]` into tensors of the given widths (which sum to `c`).
pub fn split_cols(x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let (m, c) = x.dims2("split_cols")?;
    if widths.iter().sum::<usize>() != c {
        return Err(shape_err("split_cols", format!("widths {widths:?} do not sum to {c}")));
    }
    let a = &x.storage;
    let parts: Vec<Storage> =
        backend!("split_cols"; a => a.split_cols(m, widths).map(|v| v.into_iter().map(Storage::from).collect()))?;
    Ok(parts.into_iter().zip(widths).map(|(s, &w)| Tensor::new(s, &[m, w])).collect())
}

/// Rows `range` of `x [m, c]` → `[range.len(), c]` (a 1-D tensor is one row of `c`).
pub fn rows(x: &Tensor, range: Range<usize>) -> Result<Tensor> {
    let (m, c) = x.dims2("rows")?;
    if range.start > range.end || range.end > m {
        return Err(shape_err("rows", format!("rows {range:?} of {m}")));
    }
    let a = &x.storage;
    let n = range.len();
    out(backend!("rows"; a => a.slice(range.start * c..range.end * c).map(Storage::from)), &[n, c])
}

/// Splits the rows of `x [m, c]` into tensors of the given heights (which sum to `m`).
pub fn split_rows(x: &Tensor, heights: &[usize]) -> Result<Vec<Tensor>> {
    let (m, _) = x.dims2("split_rows")?;
    if heights.iter().sum::<usize>() != m {
        return Err(shape_err("split_rows", format!("heights {heights:?} do not sum to {m}")));
    }
    let mut start = 0;
    heights
        .iter()
        .map(|&h| {
            start += h;
            rows(x, start - h..start)
        })
        .collect()
}

/// Stacks 2-D tensors with equal column counts along rows: `[r_i, c]` → `[Σ r_i, c]`.
pub fn cat_rows(parts: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else { return Err(shape_err("cat_rows", "no tensors")) };
    let c = first.dims2("cat_rows")?.1;
    let mut rows = 0;
    for t in parts {
        let (r, c2) = t.dims2("cat_rows")?;
        if c2 != c {
            return Err(shape_err("cat_rows", format!("{c2} columns, expected {c}")));
        }
        rows += r;
    }
    let st: Vec<&Storage> = parts.iter().map(|t| &t.storage).collect();
    let s = match &first.storage {
        Storage::Cpu(_) => BackendStorage::cat(&same_backend(&st, cpu_of, "cat_rows")?).map(Storage::from)?,
        Storage::Cuda(_) => BackendStorage::cat(&same_backend(&st, cuda_of, "cat_rows")?).map(Storage::from)?,
    };
    Ok(Tensor::new(s, &[rows, c]))
}

/// Concatenates 2-D tensors with equal row counts along columns: `[m, c_i]` → `[m, Σ c_i]`.
pub fn cat_cols(parts: &[&Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else { return Err(shape_err("cat_cols", "no tensors")) };
    let m = first.dims2("cat_cols")?.0;
    let mut widths = Vec::with_capacity(parts.len());
    for t in parts {
        let (r, c) = t.dims2("cat_cols")?;
        if r != m {
            return Err(shape_err("cat_cols", format!("{r} rows, expected {m}")));
        }
        widths.push(c);
    }
    let total: usize = widths.iter().sum();
    let st: Vec<&Storage> = parts.iter().map(|t| &t.storage).collect();
    fn with_widths<'a, S>(v: Vec<&'a S>, widths: &[usize]) -> Vec<(&'a S, usize)> {
        v.into_iter().zip(widths.iter().copied()).collect()
    }
    let s = match &first.storage {
        Storage::Cpu(_) => BackendStorage::cat_cols(&with_widths(same_backend(&st, cpu_of, "cat_cols")?, &widths), m)
            .map(Storage::from)?,
        Storage::Cuda(_) => BackendStorage::cat_cols(&with_widths(same_backend(&st, cuda_of, "cat_cols")?, &widths), m)
            .map(Storage::from)?,
    };
    Ok(Tensor::new(s, &[m, total]))
}

/// `a += b` elementwise (residual connection); same shapes.
pub fn add_inplace(a: &mut Tensor, b: &Tensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(shape_err("add", format!("{:?} vs {:?}", a.shape(), b.shape())));
    }
    let (x, y) = (&mut a.storage, &b.storage);
    backend!("add"; x, y => x.add_inplace(y))
}

/// Column sums of `x [m, n]` → `[n]` (a bias gradient).
pub fn sum_rows(x: &Tensor) -> Result<Tensor> {
    let (m, n) = x.dims2("sum_rows")?;
    let a = &x.storage;
    out(backend!("sum_rows"; a => a.sum_rows(m, n).map(Storage::from)), &[n])
}

/// Row-wise softmax `exp(x - max) / Σ exp(x - max)`: `[m, n]` → `[m, n]`.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let (m, n) = x.dims2("softmax")?;
    let a = &x.storage;
    out(backend!("softmax"; a => a.softmax(m, n).map(Storage::from)), x.shape())
}

/// Row-wise log-softmax `x - max - log Σ exp(x - max)`: `[m, n]` → `[m, n]`.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let (m, n) = x.dims2("log_softmax")?;
    let a = &x.storage;
    out(backend!("log_softmax"; a => a.log_softmax(m, n).map(Storage::from)), x.shape())
}

/// One sequence of a [`paged_attention`] batch.
#[derive(Debug, Clone)]
pub struct AttnSeq<'a> {
    /// The rows of `q` that belong to this sequence (its new tokens).
    pub rows: Range<usize>,
    /// Position of the first of those rows; row `rows.start + i` sits at `start_pos + i`,
    /// and the sequence's context is `start_pos + rows.len()` tokens.
    pub start_pos: usize,
    /// Block ids of the sequence's KV: position `p` is in block `block_table[p / block_size]`.
    pub block_table: &'a [u32],
}

/// The sequences of one attention call, built once per step (the engine) or batch (the
/// learner) and read by every layer: rows, positions and block tables are checked here once,
/// and on a CUDA device the per-row metadata (block tables, row tables, the decode/prefill
/// split) is built and uploaded by the first layer and read by the rest (docs/ARCHITECTURE.md,
/// "The step's indices"). Rows `0..rows()` of `q` must each belong to exactly one sequence.
pub struct AttnBatch {
    /// (rows, start_pos, range of `tables`) per sequence.
    seqs: Vec<(Range<usize>, usize, Range<usize>)>,
    /// The block tables, concatenated.
    tables: Vec<u32>,
    block_size: usize,
    rows: usize,
    max_block: Option<u32>,
    /// The device's metadata (the first CUDA layer builds it).
    #[cfg(feature = "cuda")]
    pub(crate) resident: std::sync::OnceLock<crate::cuda::ResidentAttn>,
}

impl AttnBatch {
    /// Errors: `block_size` 0, a sequence with fewer blocks than its context needs, a row in
    /// two sequences or in none of `0..max row`.
    pub fn new(seqs: &[AttnSeq], block_size: usize) -> Result<Self> {
        let bad = |d: String| Err(shape_err("attention", d));
        if block_size == 0 {
            return bad("block_size 0".into());
        }
        let rows = seqs.iter().map(|s| s.rows.end).max().unwrap_or(0);
        let mut covered = vec![false; rows];
        let (mut out, mut tables) = (Vec::with_capacity(seqs.len()), Vec::new());
        for (si, s) in seqs.iter().enumerate() {
            let context = s.start_pos + s.rows.len();
            if s.block_table.len() * block_size < context {
                return bad(format!(
                    "sequence {si}: {} blocks of {block_size} for {context} positions",
                    s.block_table.len()
                ));
            }
            for r in s.rows.clone() {
                if std::mem::replace(&mut covered[r], true) {
                    return bad(format!("row {r} belongs to two sequences"));
                }
            }
            out.push((s.rows.clone(), s.start_pos, tables.len()..tables.len() + s.block_table.len()));
            tables.extend_from_slice(s.block_table);
        }
        if covered.contains(&false) {
            return bad("a row of q belongs to no sequence".into());
        }
        let max_block = tables.iter().copied().max();
        Ok(Self {
            seqs: out,
            tables,
            block_size,
            rows,
            max_block,
            #[cfg(feature = "cuda")]
            resident: std::sync::OnceLock::new(),
        })
    }

    /// Packed sequences without a cache (the learner's): sequence `s` is rows `spans[s]` at
    /// positions `0..len`, with one-slot blocks (its own rows).
    pub fn packed(spans: &[Range<usize>]) -> Result<Self> {
        let tables: Vec<Vec<u32>> = spans.iter().map(|s| (s.start as u32..s.end as u32).collect()).collect();
        let seqs: Vec<AttnSeq> =
            spans.iter().zip(&tables).map(|(s, t)| AttnSeq { rows: s.clone(), start_pos: 0, block_table: t }).collect();
        Self::new(&seqs, 1)
    }

    /// The sequences, borrowing the block tables.
    pub fn seqs(&self) -> Vec<AttnSeq<'_>> {
        self.seqs
            .iter()
            .map(|(rows, start_pos, t)| AttnSeq {
                rows: rows.clone(),
                start_pos: *start_pos,
                block_table: &self.tables[t.clone()],
            })
            .collect()
    }

    /// Rows of `q` (the largest row end of the sequences).
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
}

/// Causal grouped-query attention over a paged KV cache (PagedAttention, Kwon et al. 2023):
/// `softmax(q kᵀ / sqrt(head_dim)) v` (Vaswani et al. 2017, eq. 1; GQA: Ainslie et al. 2023).
/// `q [t, n_heads·head_dim]` with `t = batch.rows()`; `k`, `v [num_blocks·block_size,
/// n_kv_heads·head_dim]` laid out as `layout`; a query at position `p` attends positions
/// `0..=p` of its sequence, position `j` stored in slot
/// `block_table[j / block_size] · block_size + j % block_size`. Returns `[t, n_heads·head_dim]`.
/// Each (row, head) is computed by the same code in the same order whatever the batch and
/// the layout: batch-invariant, equal to dense.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: &AttnBatch,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    layout: KvLayout,
) -> Result<Tensor> {
    let (t, qc) = q.dims2("attention")?;
    let (l, kc) = k.dims2("attention")?;
    let block_size = batch.block_size;
    let bad = |d: String| Err(shape_err("attention", d));
    if qc != n_heads * head_dim
        || kc != n_kv_heads * head_dim
        || k.shape() != v.shape()
        || n_kv_heads == 0
        || !n_heads.is_multiple_of(n_kv_heads)
        || t != batch.rows
    {
        return bad(format!(
            "q [{t}, {qc}] for {} rows of sequences, k/v [{l}, {kc}], heads {n_heads}/{n_kv_heads}, head_dim {head_dim}",
            batch.rows
        ));
    }
    if let Some(b) = batch.max_block.filter(|&b| (b as usize + 1) * block_size > l) {
        return bad(format!("block {b} beyond {l} cache slots"));
    }
    layout.check("attention", &k.device(), l, block_size)?;
    let (a, ks, vs) = (&q.storage, &k.storage, &v.storage);
    out(
        backend!("attention"; a, ks, vs =>
            a.paged_attention(ks, vs, batch, n_heads, n_kv_heads, head_dim, layout).map(Storage::from)),
        &[t, qc],
    )
}

/// Causal attention of one sequence over a contiguous cache: query row `i` sits at position
/// `past + i` and position `j` in row `j` of `k`/`v` ([`paged_attention`] with one block).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (t, l) = (q.dims2("attention")?.0, k.dims2("attention")?.0);
    let batch = AttnBatch::new(&[AttnSeq { rows: 0..t, start_pos: past, block_table: &[0] }], l.max(1))?;
    paged_attention(q, k, v, &batch, n_heads, n_kv_heads, head_dim, KvLayout::Rows)
}

/// Causal attention over packed sequences without a cache (the learner's forward): sequence
/// `s` is rows `spans[s]` of `q`, `k`, `v`, at positions `0..len` ([`paged_attention`] with
/// one-slot blocks).
pub fn attention_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spans: &[Range<usize>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    paged_attention(q, k, v, &AttnBatch::packed(spans)?, n_heads, n_kv_heads, head_dim, KvLayout::Rows)
}

/// Embedding gather: rows `ids` of `table [vocab, d]` → `[ids.len(), d]` (also any row
/// selection). Errors on an id ≥ vocab.
pub fn embedding<'a>(table: &Tensor, ids: impl Into<Idx<'a>>) -> Result<Tensor> {
    let ids = ids.into();
    let (vocab, d) = table.dims2("embedding")?;
    if let Some(bad) = ids.max().filter(|&i| i as usize >= vocab) {
        return Err(shape_err("embedding", format!("token id {bad} >= vocab size {vocab}")));
    }
    let a = &table.storage;
    out(backend!("embedding"; a => a.gather_rows(&ids, d).map(Storage::from)), &[ids.len(), d])
}

/// [`embedding`] of the rows of a packed weight `w [vocab, d]`: a tied embedding's lookup
/// in its LM head (the model's one copy of the matrix). Bitwise
/// `embedding(&unpack_weight(w), ids)`. Errors on an id ≥ vocab.
pub fn embedding_packed<'a>(w: &PackedWeight, ids: impl Into<Idx<'a>>) -> Result<Tensor> {
    let ids = ids.into();
    let (vocab, d) = (w.n, w.k);
    if let Some(bad) = ids.max().filter(|&i| i as usize >= vocab) {
        return Err(shape_err("embedding_packed", format!("token id {bad} >= vocab size {vocab}")));
    }
    let a = &w.storage;
    out(backend!("embedding_packed"; a => a.gather_packed_rows(&ids, vocab, d).map(Storage::from)), &[ids.len(), d])
}

fn check_scatter(op: &'static str, dst: &Tensor, rows: &Indices, src: &Tensor) -> Result<usize> {
    let (l, c) = dst.dims2(op)?;
    let (n, c2) = src.dims2(op)?;
    if c != c2 || rows.len() != n || rows.max().is_some_and(|s| s as usize >= l) {
        return Err(shape_err(
            op,
            format!("{} rows (max {:?}) of [{l}, {c}] from [{n}, {c2}]", rows.len(), rows.max()),
        ));
    }
    Ok(c)
}

/// Writes row `i` of `src [n, c]` into row `rows[i]` of `dst [L, c]` (KV-cache append).
pub fn scatter_rows<'a>(dst: &mut Tensor, rows: impl Into<Idx<'a>>, src: &Tensor) -> Result<()> {
    let rows = rows.into();
    let c = check_scatter("scatter_rows", dst, &rows, src)?;
    let (d, s) = (&mut dst.storage, &src.storage);
    backend!("scatter_rows"; d, s => d.scatter_rows(&rows, s, c))
}

/// Adds row `i` of `src [n, c]` to row `rows[i]` of `dst [L, c]`, in order (the embedding's
/// backward: repeated ids accumulate).
pub fn scatter_add_rows<'a>(dst: &mut Tensor, rows: impl Into<Idx<'a>>, src: &Tensor) -> Result<()> {
    let rows = rows.into();
    let c = check_scatter("scatter_add_rows", dst, &rows, src)?;
    let (d, s) = (&mut dst.storage, &src.storage);
    backend!("scatter_add_rows"; d, s => d.scatter_add_rows(&rows, s, c))
}

/// Gradient of [`linear`] w.r.t. its input: `dx [m, k] = dy [m, n] · W [n, k]`, reading the
/// weight row-major (see [`PackedWeight`]: no transpose is ever built).
pub fn linear_grad_input(dy: &Tensor, w: &PackedWeight) -> Result<Tensor> {
    let (m, n) = dy.dims2("linear_grad_input")?;
    if n != w.n {
        return Err(shape_err("linear_grad_input", format!("dy has {n} columns, w is [{}, {}]", w.n, w.k)));
    }
    let k = w.k;
    let (a, b) = (&dy.storage, &w.storage);
    out(backend!("linear_grad_input"; a, b => a.linear_grad_input(b, m, n, k).map(Storage::from)), &[m, k])
}

/// Gradient of [`linear`] w.r.t. its weight: `dW [n, k] = dyᵀ · x` (HF layout).
pub fn linear_grad_weight(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (m, n) = dy.dims2("linear_grad_weight")?;
    let (m2, k) = x.dims2("linear_grad_weight")?;
    if m != m2 {
        return Err(shape_err("linear_grad_weight", format!("dy has {m} rows, x has {m2}")));
    }
    let (a, b) = (&dy.storage, &x.storage);
    out(backend!("linear_grad_weight"; a, b => a.linear_grad_weight(b, m, n, k).map(Storage::from)), &[n, k])
}

/// Gradients of [`rms_norm`]: returns `(dx [m, d], dw [d])`.
pub fn rms_norm_backward(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let (m, d) = x.dims2("rms_norm_backward")?;
    if dy.shape() != x.shape() || w.len() != d {
        return Err(shape_err(
            "rms_norm_backward",
            format!("x {:?}, dy {:?}, w {:?}", x.shape(), dy.shape(), w.shape()),
        ));
    }
    let (a, ws, g) = (&x.storage, &w.storage, &dy.storage);
    let (dx, dw): (Storage, Storage) = backend!("rms_norm_backward"; a, ws, g =>
        a.rms_norm_backward(ws, g, m, d, eps).map(|(x, w)| (x.into(), w.into())))?;
    Ok((Tensor::new(dx, &[m, d]), Tensor::new(dw, &[d])))
}

/// Gradient of [`silu_mul`] w.r.t. its fused input `[m, 2i]`, given `da [m, i]`.
pub fn silu_mul_backward(gate_up: &Tensor, da: &Tensor) -> Result<Tensor> {
    let (m, c) = gate_up.dims2("silu_mul_backward")?;
    if c % 2 != 0 || da.shape() != [m, c / 2] {
        return Err(shape_err("silu_mul_backward", format!("gate_up {:?}, da {:?}", gate_up.shape(), da.shape())));
    }
    let (a, b) = (&gate_up.storage, &da.storage);
    out(backend!("silu_mul_backward"; a, b => a.silu_mul_backward(b, m, c / 2).map(Storage::from)), &[m, c])
}

/// Gradients of [`attention_packed`] given `da` (shaped like `q`): returns `(dq, dk, dv)`
/// shaped like `q`, `k`, `v`. Probabilities are recomputed, by the forward's code.
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    da: &Tensor,
    spans: &[Range<usize>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (t, qc) = q.dims2("attention_backward")?;
    let (t2, kc) = k.dims2("attention_backward")?;
    if t != t2
        || qc != n_heads * head_dim
        || kc != n_kv_heads * head_dim
        || v.shape() != k.shape()
        || da.shape() != q.shape()
        || n_kv_heads == 0
        || !n_heads.is_multiple_of(n_kv_heads)
        || spans.iter().any(|s| s.start > s.end || s.end > t)
    {
        return Err(shape_err(
            "attention_backward",
            format!("q {:?}, k {:?}, v {:?}, da {:?}, spans {spans:?}", q.shape(), k.shape(), v.shape(), da.shape()),
        ));
    }
    let (a, ks, vs, g) = (&q.storage, &k.storage, &v.storage, &da.storage);
    let (dq, dk, dv): (Storage, Storage, Storage) = backend!("attention_backward"; a, ks, vs, g =>
        a.attention_backward(ks, vs, g, spans, n_heads, n_kv_heads, head_dim)
            .map(|(q, k, v)| (q.into(), k.into(), v.into())))?;
    Ok((Tensor::new(dq, &[t, qc]), Tensor::new(dk, &[t, kc]), Tensor::new(dv, &[t, kc])))
}

fn check_tokens(op: &'static str, logits: &Tensor, tokens: &[u32]) -> Result<(usize, usize)> {
    let (m, v) = logits.dims2(op)?;
    if tokens.len() != m {
        return Err(shape_err(op, format!("{} tokens for {m} rows", tokens.len())));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= v) {
        return Err(shape_err(op, format!("token id {t} >= vocab size {v}")));
    }
    Ok((m, v))
}

/// For `logits [m, v]` and one token per row: `ℓ = log softmax(z / T)[token]` and the
/// entropy `H = −Σ p log p` of `p = softmax(z / T)` (nats), per row, on the host. The
/// formula of the sampler's log-probabilities (DESIGN-NOTES §3).
pub fn token_logprobs(logits: &Tensor, tokens: &[u32], temperature: f32) -> Result<(Vec<f32>, Vec<f32>)> {
    let (_, v) = check_tokens("token_logprobs", logits, tokens)?;
    let a = &logits.storage;
    backend!("token_logprobs"; a => a.token_logprobs(v, tokens, temperature))
}

/// Samples or scores rows of a step's logits `[m, v]` on their device ([`crate::sample`]:
/// the rule, the log-probabilities and what comes back). One result per entry of `rows`, in
/// order. Errors: a row past `m`, an id (scored token, penalty, bias or mask list) at or past
/// `v`, or more than [`MAX_TOP_LOGPROBS`] top log-probabilities.
pub fn sample(logits: &Tensor, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
    let (m, v) = logits.dims2("sample")?;
    check_sample_rows(m, v, rows)?;
    if rows.is_empty() {
        return Ok(vec![]);
    }
    let a = &logits.storage;
    backend!("sample"; a => a.sample(v, rows))
}

/// [`sample`]'s checks of `rows` over logits `[m, v]`.
pub(crate) fn check_sample_rows(m: usize, v: usize, rows: &[SampleRow]) -> Result<()> {
    for (i, r) in rows.iter().enumerate() {
        let bad = |what: String| Err(shape_err("sample", format!("row {i}: {what}")));
        if r.row >= m {
            return bad(format!("logit row {} >= {m} rows", r.row));
        }
        if r.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(format!("{} top log-probabilities > {MAX_TOP_LOGPROBS}", r.top_logprobs));
        }
        let ids: Box<dyn Iterator<Item = u32> + '_> = match &r.task {
            RowTask::Score(t) => Box::new(std::iter::once(*t)),
            RowTask::Draw(d) => Box::new(
                d.rep_tokens
                    .iter()
                    .copied()
                    .chain(d.out_counts.iter().map(|c| c.0))
                    .chain(d.bias.iter().map(|b| b.0))
                    .chain(d.mask.iter().copied()),
            ),
        };
        if let Some(t) = ids.into_iter().find(|&t| t as usize >= v) {
            return bad(format!("token id {t} >= vocab size {v}"));
        }
    }
    Ok(())
}

/// Gradient w.r.t. the logits of a loss with `dL/dℓ_i = dl_dlogp[i]` and (optionally)
/// `dL/dH_i = dl_dentropy[i]` on the rows of [`token_logprobs`]:
/// `dz_ij = dL/dℓ_i · (1[j = token_i] − p_ij) / T + dL/dH_i · (−p_ij (ln p_ij + H_i) / T)`.
/// `entropies` are the `H_i` [`token_logprobs`] returned. `[m, v]`.
pub fn token_logprobs_backward(
    logits: &Tensor,
    tokens: &[u32],
    temperature: f32,
    dl_dlogp: &[f32],
    dl_dentropy: Option<&[f32]>,
    entropies: &[f32],
) -> Result<Tensor> {
    let (m, v) = check_tokens("token_logprobs_backward", logits, tokens)?;
    if dl_dlogp.len() != m || entropies.len() != m || dl_dentropy.is_some_and(|d| d.len() != m) {
        return Err(shape_err("token_logprobs_backward", format!("per-row inputs must have {m} values")));
    }
    let a = &logits.storage;
    out(
        backend!("token_logprobs_backward"; a =>
            a.token_logprobs_backward(v, tokens, temperature, dl_dlogp, dl_dentropy, entropies).map(Storage::from)),
        &[m, v],
    )
}

/// The step-wide constants of one AdamW update (Loshchilov & Hutter 2019, Alg. 2; PyTorch
/// `torch.optim.AdamW`), for [`adamw_delta`].
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `1 − β₁ᵗ` and `1 − β₂ᵗ` at step `t`.
    pub bias_correction1: f64,
    pub bias_correction2: f64,
    /// Factor on every gradient (global-norm clipping; 1 when not clipped).
    pub clip: f64,
}

/// One AdamW moment update for gradient `g`: `g' = clip·g`, `m ← β₁m + (1−β₁)g'`,
/// `v ← β₂v + (1−β₂)g'²` (in place), and returns the step
/// `Δ = −(lr / (1−β₁ᵗ)) · m / (√v / √(1−β₂ᵗ) + ε)`, in f32 in PyTorch's operation order
/// (`torch.optim.AdamW`; see `cpu::optim`); the parameter update is then
/// `p ← (1 − lr·weight_decay)·p + Δ` ([`scale_add_inplace`], or for the served weights
/// [`scale_add_packed_into`] then [`commit_packed`]).
pub fn adamw_delta(g: &Tensor, m: &mut Tensor, v: &mut Tensor, step: &AdamWStep) -> Result<Tensor> {
    if m.shape() != g.shape() || v.shape() != g.shape() {
        return Err(shape_err("adamw", format!("g {:?}, m {:?}, v {:?}", g.shape(), m.shape(), v.shape())));
    }
    let (a, ms, vs) = (&g.storage, &mut m.storage, &mut v.storage);
    out(backend!("adamw"; a, ms, vs => a.adamw_delta(ms, vs, step).map(Storage::from)), g.shape())
}

/// One row block of a stacked linear weight for [`adamw_delta_packed`]: its gradient and
/// AdamW moments, `[r, k]` each.
pub struct AdamWPart<'a> {
    pub g: &'a Tensor,
    pub m: &'a mut Tensor,
    pub v: &'a mut Tensor,
}

/// [`adamw_delta`] for a linear weight stacked from row blocks (fused q/k/v, gate/up),
/// returned laid out like the served weight in one pass over the moments: bitwise
/// `pack_weight(cat_rows(Δ_i))`.
/// Errors: no parts, parts with different column counts, moments shaped unlike their
/// gradient, parts on different backends.
pub fn adamw_delta_packed(parts: &mut [AdamWPart<'_>], step: &AdamWStep) -> Result<PackedWeight> {
    let op = "adamw_delta_packed";
    let Some(first) = parts.first() else { return Err(shape_err(op, "no parts")) };
    let k = first.g.dims2(op)?.1;
    let mut n = 0;
    for p in parts.iter() {
        let (r, c) = p.g.dims2(op)?;
        if c != k || p.m.shape() != p.g.shape() || p.v.shape() != p.g.shape() {
            let detail =
                format!("g {:?}, m {:?}, v {:?} in a stack of {k} columns", p.g.shape(), p.m.shape(), p.v.shape());
            return Err(shape_err(op, detail));
        }
        n += r;
    }
    // The parts as one backend's buffers, then that backend's method.
    macro_rules! on {
        ($backend:ident) => {{
            let mut ps = Vec::with_capacity(parts.len());
            for p in parts.iter_mut() {
                match (&p.g.storage, &mut p.m.storage, &mut p.v.storage) {
                    (Storage::$backend(g), Storage::$backend(m), Storage::$backend(v)) => ps.push((g, m, v)),
                    _ => return Err(KernelError::DeviceMismatch { op }),
                }
            }
            Storage::from(BackendStorage::adamw_delta_packed(&mut ps, k, step)?)
        }};
    }
    let storage = match &first.g.storage {
        Storage::Cpu(_) => on!(Cpu),
        Storage::Cuda(_) => on!(Cuda),
    };
    Ok(PackedWeight { storage, n, k })
}
