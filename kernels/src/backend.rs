//! The backend contract: every op of [`crate::ops`], once per device.
//!
//! A backend is a storage type (a flat buffer of f32 on its device, whatever its layout)
//! implementing [`BackendStorage`], and a device type implementing [`BackendDevice`].
//! [`crate::ops`] checks shapes and ranges, then calls exactly one method here with the
//! dimensions spelled out, so an implementation may assume valid arguments. A backend
//! that lacks an op does not compile; the CUDA stub (`cuda_stub.rs`) implements the whole
//! contract over uninhabited types.
//!
//! Conventions (all backends):
//! - Buffers are row-major `[rows, cols]` f32 unless a method says otherwise; the only
//!   backend-owned layout is a *packed* linear weight ([`BackendStorage::pack_weight`]),
//!   which only [`BackendStorage::linear`], [`BackendStorage::linear_grad_input`],
//!   [`BackendStorage::unpack_weight`], [`BackendStorage::gather_packed_rows`] and the
//!   elementwise [`BackendStorage::scale_add_inplace`] (between two buffers packed alike)
//!   read: it is the only copy of a linear weight.
//! - Index arguments (token ids, positions, KV slots, row lists) are [`Indices`] and the
//!   attention's sequences an [`AttnBatch`]: host values that a device backend uploads once
//!   and keeps resident for the rest of the step (docs/ARCHITECTURE.md, "The step's indices").
//! - Results that the host consumes as a few numbers per row (log-probabilities,
//!   entropies, a sum of squares) are returned on the host.
//! - Batch invariance: a row's result must not depend on the other rows of the call
//!   (fixed reduction order per row). The engine's alone = batched guarantee and the
//!   learner's ℓ = μ check rest on it.

use crate::indices::Indices;
use crate::ops::{AdamWStep, AttnBatch, KvLayout};
use crate::sample::{SampleRow, Sampled};
use crate::{KernelError, Result};
use std::fmt::Debug;
use std::ops::Range;

/// A device of one backend: allocates and uploads.
pub trait BackendDevice: Clone + Debug + Send + Sync {
    type Storage: BackendStorage<Device = Self>;
    /// `n` zeros.
    fn zeros(&self, n: usize) -> Result<Self::Storage>;
    /// A copy of host data.
    fn upload(&self, data: &[f32]) -> Result<Self::Storage>;
}

/// A buffer of f32 on one device and every op over such buffers.
pub trait BackendStorage: Clone + Debug + Send + Sync + Sized {
    type Device: BackendDevice<Storage = Self>;
    fn device(&self) -> Self::Device;
    /// Host copy of the buffer (in its own layout).
    fn to_host(&self) -> Result<Vec<f32>>;

    // Linear layers.
    /// Packs a row-major weight `[n, k]` into this backend's layout for [`Self::linear`].
    fn pack_weight(&self, n: usize, k: usize) -> Result<Self>;
    /// Row-major `[n, k]` back from [`Self::pack_weight`]'s layout.
    fn unpack_weight(&self, n: usize, k: usize) -> Result<Self>;
    /// `y [m, n] = x [m, k] · Wᵀ (+ bias [n])`, `w` packed `[n, k]`. Batch-invariant.
    fn linear(&self, m: usize, k: usize, w: &Self, n: usize, bias: Option<&Self>) -> Result<Self>;
    /// `dW [n, k] = dyᵀ [n, m] · x [m, k]` (row-major; `self` is `dy`).
    fn linear_grad_weight(&self, x: &Self, m: usize, n: usize, k: usize) -> Result<Self>;
    /// `dx [m, k] = dy [m, n] · W [n, k]` with `w` packed `[n, k]` (`self` is `dy`); each
    /// output one fixed-order reduction over `n`.
    fn linear_grad_input(&self, w: &Self, m: usize, n: usize, k: usize) -> Result<Self>;

    // Row-wise and elementwise ops.
    /// RMSNorm of `[m, d]` rows with weight `w [d]`.
    fn rms_norm(&self, w: &Self, m: usize, d: usize, eps: f32) -> Result<Self>;
    /// `(dx [m, d], dw [d])` of [`Self::rms_norm`] given `dy` (`self` is `x`).
    fn rms_norm_backward(&self, w: &Self, dy: &Self, m: usize, d: usize, eps: f32) -> Result<(Self, Self)>;
    /// Rotate-half RoPE in place on `[positions.len(), c]` rows of heads of `head_dim`;
    /// `cos`/`sin` are `[max_pos, head_dim / 2]`.
    fn rope_inplace(&mut self, positions: &Indices, cos: &Self, sin: &Self, c: usize, head_dim: usize) -> Result<()>;
    /// `silu(gate) · up` of `[m, 2i]` rows → `[m, i]`.
    fn silu_mul(&self, m: usize, i: usize) -> Result<Self>;
    /// `d gate_up [m, 2i]` of [`Self::silu_mul`] given `da [m, i]` (`self` is `gate_up`).
    fn silu_mul_backward(&self, da: &Self, m: usize, i: usize) -> Result<Self>;
    /// `self += b` (equal lengths).
    fn add_inplace(&mut self, b: &Self) -> Result<()>;
    /// `self ← s · self + d` (equal lengths, same layout: packed weights too).
    fn scale_add_inplace(&mut self, s: f32, d: &Self) -> Result<()>;
    /// `d ← s · self + d` (equal lengths, same layout), `self` only read: the optimizer's
    /// new weight prepared in its step's buffer outside the write guard. The arithmetic of
    /// [`Self::scale_add_inplace`] (`a·s + d`), so the same bits.
    fn scale_add_into(&self, s: f32, d: &mut Self) -> Result<()>;
    /// Makes `new`'s values this buffer's (equal lengths, same layout), leaving `new` with
    /// values to drop: the optimizer's commit under the write guard. The buffers are
    /// swapped where that is safe and as fast (CPU: always; CUDA: the
    /// weight has a bf16 serving copy and `keep_address` is false, i.e. no kernel or graph
    /// reads its f32 values at a recorded address), else `new` is copied in; a bf16 serving
    /// copy keeps its address and is rewritten from the new values.
    fn commit_from(&mut self, new: &mut Self, keep_address: bool) -> Result<()>;
    /// `s · self`.
    fn scale(&self, s: f32) -> Result<Self>;
    /// `Σ x²` over every element of every part, in f64 (each part's sum, then the parts in
    /// order; a device reads the result back once for all parts).
    fn sum_squares(parts: &[&Self]) -> Result<f64>;
    /// Column sums of `[m, n]` → `[n]`.
    fn sum_rows(&self, m: usize, n: usize) -> Result<Self>;
    /// Row-wise softmax of `[m, n]`.
    fn softmax(&self, m: usize, n: usize) -> Result<Self>;
    /// Row-wise log-softmax of `[m, n]`.
    fn log_softmax(&self, m: usize, n: usize) -> Result<Self>;

    // Copies between rows and columns.
    /// Rows `ids` of `[_, c]` → `[ids.len(), c]` (embedding lookup, row selection).
    fn gather_rows(&self, ids: &Indices, c: usize) -> Result<Self>;
    /// Rows `ids` (each < n) of a packed weight `[n, k]` ([`Self::pack_weight`]'s layout) as
    /// row-major `[ids.len(), k]`: a tied embedding's lookup in its LM head.
    fn gather_packed_rows(&self, ids: &Indices, n: usize, k: usize) -> Result<Self>;
    /// Row `i` of `src [n, c]` into row `rows[i]` of `self [_, c]`.
    fn scatter_rows(&mut self, rows: &Indices, src: &Self, c: usize) -> Result<()>;
    /// Row `i` of `src [n, c]` added to row `rows[i]` of `self` (in row order; repeats add up).
    fn scatter_add_rows(&mut self, rows: &Indices, src: &Self, c: usize) -> Result<()>;
    /// Column blocks of `[m, Σ widths]` → one `[m, w]` per width.
    fn split_cols(&self, m: usize, widths: &[usize]) -> Result<Vec<Self>>;
    /// `[m, c_i]` parts → `[m, Σ c_i]`; `parts` are `(buffer, c_i)`.
    fn cat_cols(parts: &[(&Self, usize)], m: usize) -> Result<Self>;
    /// Buffers concatenated (row-major `[r_i, c]` parts → `[Σ r_i, c]`).
    fn cat(parts: &[&Self]) -> Result<Self>;
    /// The elements `range` of the buffer (row-major rows `a..b` of `[_, c]` are `a·c..b·c`).
    fn slice(&self, range: Range<usize>) -> Result<Self>;

    // Attention.
    /// Causal GQA attention of queries `self [t, n_heads·head_dim]` over paged K/V
    /// `[num_slots, n_kv_heads·head_dim]` laid out as `layout`; position `p` of a sequence
    /// lives in slot `block_table[p / block_size] · block_size + p % block_size`.
    #[allow(clippy::too_many_arguments)]
    fn paged_attention(
        &self,
        k: &Self,
        v: &Self,
        batch: &AttnBatch,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        layout: KvLayout,
    ) -> Result<Self>;
    /// Row `i` of `src [n, n_kv_heads·head_dim]` into slot `slots[i]` of `self`, a K cache
    /// (`keys`) or a V cache in [`KvLayout::Blocked`] with blocks of `block_size`.
    fn scatter_kv_blocked(
        &mut self,
        _slots: &Indices,
        _src: &Self,
        _block_size: usize,
        _n_kv_heads: usize,
        _head_dim: usize,
        _keys: bool,
    ) -> Result<()> {
        Err(KernelError::Unsupported { op: "write_kv", detail: "the Blocked KV layout is CPU-only".into() })
    }
    /// Slots `slots` of `self`, a K cache (`keys`) or a V cache in [`KvLayout::Blocked`] with
    /// blocks of `block_size`, as rows `[slots.len(), n_kv_heads·head_dim]`.
    fn gather_kv_blocked(
        &self,
        _slots: &Indices,
        _block_size: usize,
        _n_kv_heads: usize,
        _head_dim: usize,
        _keys: bool,
    ) -> Result<Self> {
        Err(KernelError::Unsupported { op: "read_kv", detail: "the Blocked KV layout is CPU-only".into() })
    }
    /// `(dq, dk, dv)` of causal attention over packed sequences: sequence `s` is rows
    /// `spans[s]` of `q [t, H·D]`, `k`/`v [t, KVH·D]`, at positions `0..len` (`self` is `q`).
    fn attention_backward(
        &self,
        k: &Self,
        v: &Self,
        da: &Self,
        spans: &[Range<usize>],
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(Self, Self, Self)>;

    // Log-probabilities (the sampler's and the learner's formula).
    /// For logits `[m, v]` and one token per row: `(log softmax(z/T)[token], entropy of
    /// softmax(z/T))` per row, on the host.
    fn token_logprobs(&self, v: usize, tokens: &[u32], temperature: f32) -> Result<(Vec<f32>, Vec<f32>)>;
    /// `dz [m, v]` for a loss with `dL/dℓ_i = dl_dlogp[i]` and `dL/dH_i = dl_dentropy[i]`
    /// on the rows of [`Self::token_logprobs`] (`entropies` its second output).
    fn token_logprobs_backward(
        &self,
        v: usize,
        tokens: &[u32],
        temperature: f32,
        dl_dlogp: &[f32],
        dl_dentropy: Option<&[f32]>,
        entropies: &[f32],
    ) -> Result<Self>;

    // Sampling.
    /// The rows of [`crate::ops::sample`] over logits `self [m, v]`, in `rows`' order (rows
    /// checked: in range, ids below `v`, top counts ≤ 20); only the results reach the host.
    fn sample(&self, v: usize, rows: &[SampleRow]) -> Result<Vec<Sampled>>;

    // Optimizer.
    /// One AdamW moment update with gradient `self`: advances `m`, `v` in place and returns
    /// the step `Δ` (see [`AdamWStep`]).
    fn adamw_delta(&self, m: &mut Self, v: &mut Self, step: &AdamWStep) -> Result<Self>;
    /// [`Self::adamw_delta`] over a weight stacked from row blocks `parts = (g, m, v)`
    /// (`[r_i, k]` each, in order): the stacked step in [`Self::pack_weight`]'s layout.
    fn adamw_delta_packed(parts: &mut [(&Self, &mut Self, &mut Self)], k: usize, step: &AdamWStep) -> Result<Self>;
}
