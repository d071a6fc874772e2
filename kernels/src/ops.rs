//! The op set shared by every backend. Each function checks shapes, then dispatches
//! on the storage. CPU implementations live in [`crate::cpu`].
//!
//! Conventions: activations are `[rows, features]`; linear weights use the Hugging
//! Face layout `[out_features, in_features]`, so a linear layer is `x · Wᵀ`.

use crate::cpu;
use crate::error::shape_err;
use crate::tensor::Storage;
use crate::{Result, Tensor};

fn cpu2<'a>(a: &'a Tensor, b: &'a Tensor, op: &'static str) -> Result<(&'a [f32], &'a [f32])> {
    a.same_device(b, op)?;
    match (&a.storage, &b.storage) {
        (Storage::Cpu(x), Storage::Cpu(y)) => Ok((x, y)),
        (Storage::Cuda(c), _) | (_, Storage::Cuda(c)) => match *c {},
    }
}

fn cpu_mut<'a>(a: &'a mut Tensor) -> &'a mut Vec<f32> {
    match &mut a.storage {
        Storage::Cpu(x) => x,
        Storage::Cuda(c) => match *c {},
    }
}

/// A linear layer's weight `[n, k]` packed for [`linear`] (see `cpu::matmul` for the
/// panel layout and the batch-invariant reduction order).
#[derive(Debug, Clone)]
pub struct PackedWeight {
    data: Tensor,
    n: usize,
    k: usize,
    /// `Wᵀ` packed, built on the first backward use (the learner's input gradients).
    transposed: std::sync::OnceLock<Box<PackedWeight>>,
}

impl PackedWeight {
    /// `[out_features, in_features]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.n, self.k]
    }
}

/// Packs a `[n, k]` weight once, for many [`linear`] calls.
pub fn pack_weight(w: &Tensor) -> Result<PackedWeight> {
    let (n, k) = w.dims2("pack_weight")?;
    let data = cpu::matmul::pack(w.as_slice()?, n, k);
    let len = data.len();
    Ok(PackedWeight { data: Tensor::from_vec(data, &[len])?, n, k, transposed: Default::default() })
}

impl PackedWeight {
    /// `Wᵀ [k, n]` packed, cached after the first call.
    fn t(&self) -> Result<&PackedWeight> {
        if let Some(t) = self.transposed.get() {
            return Ok(t);
        }
        let wt = cpu::matmul::transpose(&cpu::matmul::unpack(self.data.as_slice()?, self.n, self.k), self.n, self.k);
        let data = cpu::matmul::pack(&wt, self.k, self.n);
        let len = data.len();
        let t = PackedWeight {
            data: Tensor::from_vec(data, &[len])?,
            n: self.k,
            k: self.n,
            transposed: Default::default(),
        };
        Ok(self.transposed.get_or_init(|| Box::new(t)))
    }
}

/// The `[n, k]` row-major weight back from its packed form.
pub fn unpack_weight(w: &PackedWeight) -> Result<Tensor> {
    let data = cpu::matmul::unpack(w.data.as_slice()?, w.n, w.k);
    Tensor::from_vec(data, &[w.n, w.k])
}

/// The packed storage of `w`, for an elementwise in-place change whose operand was laid out
/// by [`pack_rows`] (the learner's `p ← s·p + Δ`). Drops the cached `Wᵀ`.
pub fn packed_data_mut(w: &mut PackedWeight) -> Result<&mut [f32]> {
    w.transposed = Default::default();
    w.data.as_mut_slice()
}

/// `[n, k]` row-major values laid out like a packed weight's storage (zero padding).
pub fn pack_rows(w: &[f32], n: usize, k: usize) -> Result<Vec<f32>> {
    if w.len() != n * k {
        return Err(shape_err("pack_rows", format!("{} values for [{n}, {k}]", w.len())));
    }
    Ok(cpu::matmul::pack(w, n, k))
}

/// `p ← s·p + d`, elementwise, in parallel (equal lengths).
pub fn scale_add_inplace(p: &mut [f32], s: f32, d: &[f32]) -> Result<()> {
    use rayon::prelude::*;
    if p.len() != d.len() {
        return Err(shape_err("scale_add_inplace", format!("{} vs {} values", p.len(), d.len())));
    }
    p.par_chunks_mut(1 << 16).zip(d.par_chunks(1 << 16)).for_each(|(p, d)| {
        for (p, d) in p.iter_mut().zip(d) {
            *p = *p * s + d;
        }
    });
    Ok(())
}

/// Linear layer `y = x · Wᵀ (+ bias)`: `x [m, k]`, `w` packed `[n, k]`, `bias [n]` → `[m, n]`.
/// Batch-invariant: row `i` of `y` is bitwise the same for any `m`.
pub fn linear(x: &Tensor, w: &PackedWeight, bias: Option<&Tensor>) -> Result<Tensor> {
    let (m, k) = x.dims2("linear")?;
    if k != w.k {
        return Err(shape_err("linear", format!("x is [{m}, {k}] but w is [{}, {}]", w.n, w.k)));
    }
    let (xs, ws) = cpu2(x, &w.data, "linear")?;
    let mut y = vec![0.0f32; m * w.n];
    cpu::matmul::matmul_packed(xs, ws, &mut y, m, w.n, k);
    if let Some(b) = bias {
        let (_, bs) = cpu2(x, b, "linear")?;
        if bs.len() != w.n {
            return Err(shape_err("linear", format!("bias has {} values, expected {}", bs.len(), w.n)));
        }
        cpu::elementwise::add_bias(&mut y, bs);
    }
    Tensor::from_vec(y, &[m, w.n])
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
    let (xs, ws) = cpu2(x, w, "rms_norm")?;
    if ws.len() != d {
        return Err(shape_err("rms_norm", format!("weight has {} values, rows have {d}", ws.len())));
    }
    let mut y = vec![0.0f32; m * d];
    cpu::elementwise::rms_norm(xs, ws, &mut y, d, eps);
    Tensor::from_vec(y, &[m, d])
}

/// Rotary position embedding in place, HF `rotate_half` layout (Su et al. 2021, eq. 34):
/// within each head, dims `i` and `i + head_dim/2` rotate by `positions[row] · inv_freq[i]`.
/// `x [m, n_heads·head_dim]`, `cos`/`sin [max_pos, head_dim/2]`, `positions.len() == m`.
pub fn rope_inplace(x: &mut Tensor, positions: &[usize], cos: &Tensor, sin: &Tensor, head_dim: usize) -> Result<()> {
    let (m, c) = x.dims2("rope")?;
    let (max_pos, half) = cos.dims2("rope")?;
    if positions.len() != m || half * 2 != head_dim || c % head_dim != 0 || sin.shape() != cos.shape() {
        return Err(shape_err(
            "rope",
            format!("x [{m}, {c}], {} positions, tables [{max_pos}, {half}], head_dim {head_dim}", positions.len()),
        ));
    }
    if let Some(&p) = positions.iter().find(|&&p| p >= max_pos) {
        return Err(shape_err("rope", format!("position {p} beyond table of {max_pos}")));
    }
    let (cs, ss) = cpu2(cos, sin, "rope")?;
    cpu::elementwise::rope(cpu_mut(x), positions, cs, ss, c, head_dim);
    Ok(())
}

/// SwiGLU `silu(gate) · up` (Shazeer 2020, eq. 5) on a fused projection:
/// `gate_up [m, 2i]` holds `gate` in columns `0..i` and `up` in `i..2i` → `[m, i]`.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    let (m, c) = gate_up.dims2("silu_mul")?;
    if c % 2 != 0 {
        return Err(shape_err("silu_mul", format!("gate_up has {c} columns, expected an even number")));
    }
    let y = cpu::elementwise::silu_mul(gate_up.as_slice()?, c / 2);
    Tensor::from_vec(y, &[m, c / 2])
}

/// Splits the columns of `x [m, c]` into tensors of the given widths (which sum to `c`).
pub fn split_cols(x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let (m, c) = x.dims2("split_cols")?;
    if widths.iter().sum::<usize>() != c {
        return Err(shape_err("split_cols", format!("widths {widths:?} do not sum to {c}")));
    }
    let xs = x.as_slice()?;
    let mut start = 0;
    widths
        .iter()
        .map(|&w| {
            let data = xs.chunks(c).flat_map(|row| &row[start..start + w]).copied().collect();
            start += w;
            Tensor::from_vec(data, &[m, w])
        })
        .collect()
}

/// Stacks 2-D tensors with equal column counts along rows: `[r_i, c]` → `[Σ r_i, c]`.
pub fn cat_rows(parts: &[&Tensor]) -> Result<Tensor> {
    let c = parts.first().map(|t| t.dims2("cat_rows")).transpose()?.map_or(0, |d| d.1);
    let mut data = Vec::new();
    let mut rows = 0;
    for t in parts {
        let (r, c2) = t.dims2("cat_rows")?;
        if c2 != c {
            return Err(shape_err("cat_rows", format!("{c2} columns, expected {c}")));
        }
        data.extend_from_slice(t.as_slice()?);
        rows += r;
    }
    Tensor::from_vec(data, &[rows, c])
}

/// `a += b` elementwise (residual connection); same shapes.
pub fn add_inplace(a: &mut Tensor, b: &Tensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(shape_err("add", format!("{:?} vs {:?}", a.shape(), b.shape())));
    }
    let bs = match &b.storage {
        Storage::Cpu(v) => v,
        Storage::Cuda(c) => match *c {},
    };
    cpu::elementwise::add_inplace(cpu_mut(a), bs);
    Ok(())
}

/// Row-wise softmax `exp(x - max) / Σ exp(x - max)`: `[m, n]` → `[m, n]`.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let (m, n) = x.dims2("softmax")?;
    let mut y = x.as_slice()?.to_vec();
    cpu::elementwise::softmax_rows(&mut y, n);
    Tensor::from_vec(y, &[m, n])
}

/// Row-wise log-softmax `x - max - log Σ exp(x - max)`: `[m, n]` → `[m, n]`.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let (m, n) = x.dims2("log_softmax")?;
    let mut y = x.as_slice()?.to_vec();
    cpu::elementwise::log_softmax_rows(&mut y, n);
    Tensor::from_vec(y, &[m, n])
}

/// One sequence of a [`paged_attention`] batch.
#[derive(Debug, Clone)]
pub struct AttnSeq<'a> {
    /// The rows of `q` that belong to this sequence (its new tokens).
    pub rows: std::ops::Range<usize>,
    /// Position of the first of those rows; row `rows.start + i` sits at `start_pos + i`.
    pub start_pos: usize,
    /// KV-cache slot of every position `0..start_pos + rows.len()` (block table expanded).
    pub slots: &'a [u32],
}

/// Causal grouped-query attention over a paged KV cache (PagedAttention, Kwon et al. 2023):
/// `softmax(q kᵀ / sqrt(head_dim)) v` (Vaswani et al. 2017, eq. 1; GQA: Ainslie et al. 2023).
/// `q [t, n_heads·head_dim]`; `k`, `v [num_slots, n_kv_heads·head_dim]`; a query at position
/// `p` attends the keys at `slots[0..=p]` of its sequence. Returns `[t, n_heads·head_dim]`.
/// Each (row, head) is computed by the same code in the same order whatever the batch, so
/// results are batch-invariant and equal to dense attention.
pub fn paged_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    seqs: &[AttnSeq],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let (t, qc) = q.dims2("attention")?;
    let (l, kc) = k.dims2("attention")?;
    let bad = |d: String| Err(shape_err("attention", d));
    if qc != n_heads * head_dim
        || kc != n_kv_heads * head_dim
        || k.shape() != v.shape()
        || n_kv_heads == 0
        || n_heads % n_kv_heads != 0
    {
        return bad(format!("q [{t}, {qc}], k/v [{l}, {kc}], heads {n_heads}/{n_kv_heads}, head_dim {head_dim}"));
    }
    let mut row_seq = vec![usize::MAX; t];
    for (si, s) in seqs.iter().enumerate() {
        if s.rows.end > t || s.slots.len() < s.start_pos + s.rows.len() {
            return bad(format!(
                "sequence {si}: rows {:?} of {t}, {} slots for {} positions",
                s.rows,
                s.slots.len(),
                s.start_pos + s.rows.len()
            ));
        }
        if let Some(&bad_slot) = s.slots.iter().find(|&&x| x as usize >= l) {
            return bad(format!("sequence {si}: slot {bad_slot} >= {l} cache slots"));
        }
        row_seq[s.rows.clone()].fill(si);
    }
    if row_seq.contains(&usize::MAX) {
        return bad("a row of q belongs to no sequence".into());
    }
    let (qs, ks) = cpu2(q, k, "attention")?;
    let (_, vs) = cpu2(q, v, "attention")?;
    let mut out = vec![0.0f32; t * qc];
    cpu::attention::paged_attention(qs, ks, vs, &mut out, seqs, &row_seq, n_heads, n_kv_heads, head_dim);
    Tensor::from_vec(out, &[t, qc])
}

/// Causal attention over a contiguous cache: [`paged_attention`] for one sequence whose
/// positions `0..L` sit in slots `0..L`. Query row `i` sits at position `past + i`.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let t = q.dims2("attention")?.0;
    let slots: Vec<u32> = (0..(past + t) as u32).collect();
    paged_attention(q, k, v, &[AttnSeq { rows: 0..t, start_pos: past, slots: &slots }], n_heads, n_kv_heads, head_dim)
}

/// Embedding gather: rows `ids` of `table [vocab, d]` → `[ids.len(), d]`. Errors on an id ≥ vocab.
pub fn embedding(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    let (vocab, d) = table.dims2("embedding")?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(shape_err("embedding", format!("token id {bad} >= vocab size {vocab}")));
    }
    let ts = table.as_slice()?;
    let mut y = Vec::with_capacity(ids.len() * d);
    for &i in ids {
        y.extend_from_slice(&ts[i as usize * d..(i as usize + 1) * d]);
    }
    Tensor::from_vec(y, &[ids.len(), d])
}

/// Writes row `i` of `src [n, c]` into row `slots[i]` of `dst [L, c]` (KV-cache append).
pub fn scatter_rows(dst: &mut Tensor, slots: &[u32], src: &Tensor) -> Result<()> {
    let (l, c) = dst.dims2("scatter_rows")?;
    let (n, c2) = src.dims2("scatter_rows")?;
    if c != c2 || slots.len() != n || slots.iter().any(|&s| s as usize >= l) {
        return Err(shape_err(
            "scatter_rows",
            format!("{} slots (max {:?}) of [{l}, {c}] from [{n}, {c2}]", slots.len(), slots.iter().max()),
        ));
    }
    let s = match &src.storage {
        Storage::Cpu(v) => v,
        Storage::Cuda(b) => match *b {},
    };
    let d = cpu_mut(dst);
    for (i, &slot) in slots.iter().enumerate() {
        d[slot as usize * c..(slot as usize + 1) * c].copy_from_slice(&s[i * c..(i + 1) * c]);
    }
    Ok(())
}

/// Gradient of [`linear`] w.r.t. its input: `dx [m, k] = dy [m, n] · W [n, k]`, run as a
/// packed product with `Wᵀ` (packed once per weight and cached).
pub fn linear_grad_input(dy: &Tensor, w: &PackedWeight) -> Result<Tensor> {
    let (_, n) = dy.dims2("linear_grad_input")?;
    if n != w.n {
        return Err(shape_err("linear_grad_input", format!("dy has {n} columns, w is [{}, {}]", w.n, w.k)));
    }
    linear(dy, w.t()?, None)
}

/// Gradient of [`linear`] w.r.t. its weight: `dW [n, k] = dyᵀ · x` (HF layout), run as a
/// packed product `dyᵀ [n, m] · (xᵀ [k, m])ᵀ`.
pub fn linear_grad_weight(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (m, n) = dy.dims2("linear_grad_weight")?;
    let (m2, k) = x.dims2("linear_grad_weight")?;
    if m != m2 {
        return Err(shape_err("linear_grad_weight", format!("dy has {m} rows, x has {m2}")));
    }
    let dyt = cpu::matmul::transpose(dy.as_slice()?, m, n);
    let packed = cpu::matmul::pack(&cpu::matmul::transpose(x.as_slice()?, m, k), k, m);
    let mut dw = vec![0.0f32; n * k];
    cpu::matmul::matmul_packed(&dyt, &packed, &mut dw, n, k, m);
    Tensor::from_vec(dw, &[n, k])
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
    let (mut dx, mut dw) = (vec![0.0f32; m * d], vec![0.0f32; d]);
    cpu::backward::rms_norm_backward(x.as_slice()?, w.as_slice()?, dy.as_slice()?, &mut dx, &mut dw, d, eps);
    Ok((Tensor::from_vec(dx, &[m, d])?, Tensor::from_vec(dw, &[d])?))
}

/// Gradient of [`silu_mul`] w.r.t. its fused input `[m, 2i]`, given `da [m, i]`.
pub fn silu_mul_backward(gate_up: &Tensor, da: &Tensor) -> Result<Tensor> {
    let (m, c) = gate_up.dims2("silu_mul_backward")?;
    if da.shape() != [m, c / 2] {
        return Err(shape_err("silu_mul_backward", format!("gate_up {:?}, da {:?}", gate_up.shape(), da.shape())));
    }
    let mut d = vec![0.0f32; m * c];
    cpu::backward::silu_mul_backward(gate_up.as_slice()?, da.as_slice()?, &mut d, c / 2);
    Tensor::from_vec(d, &[m, c])
}

/// Gradients of causal [`attention`] over one sequence at positions `0..t` (no cache):
/// returns `(dq, dk, dv)` shaped like `q`, `k`, `v`.
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    da: &Tensor,
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
        || n_heads % n_kv_heads != 0
    {
        return Err(shape_err(
            "attention_backward",
            format!("q {:?}, k {:?}, v {:?}, da {:?}", q.shape(), k.shape(), v.shape(), da.shape()),
        ));
    }
    let (mut dq, mut dk, mut dv) = (vec![0.0f32; t * qc], vec![0.0f32; t * kc], vec![0.0f32; t * kc]);
    cpu::backward::attention_backward(
        q.as_slice()?,
        k.as_slice()?,
        v.as_slice()?,
        da.as_slice()?,
        &mut dq,
        &mut dk,
        &mut dv,
        t,
        n_heads,
        n_kv_heads,
        head_dim,
    );
    Ok((Tensor::from_vec(dq, &[t, qc])?, Tensor::from_vec(dk, &[t, kc])?, Tensor::from_vec(dv, &[t, kc])?))
}

/// Concatenates 2-D tensors with equal row counts along columns: `[m, c_i]` → `[m, Σ c_i]`.
pub fn cat_cols(parts: &[&Tensor]) -> Result<Tensor> {
    let m = parts.first().map(|t| t.dims2("cat_cols")).transpose()?.map_or(0, |d| d.0);
    let mut widths = Vec::with_capacity(parts.len());
    for t in parts {
        let (r, c) = t.dims2("cat_cols")?;
        if r != m {
            return Err(shape_err("cat_cols", format!("{r} rows, expected {m}")));
        }
        widths.push(c);
    }
    let total: usize = widths.iter().sum();
    let mut data = Vec::with_capacity(m * total);
    for i in 0..m {
        for (t, &c) in parts.iter().zip(&widths) {
            data.extend_from_slice(&t.as_slice()?[i * c..(i + 1) * c]);
        }
    }
    Tensor::from_vec(data, &[m, total])
}
