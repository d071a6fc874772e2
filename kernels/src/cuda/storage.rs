//! [`CudaStorage`]: the backend contract over device buffers, one kernel launch (or cuBLAS
//! call) per op, with the launch configurations the `.cu` headers specify.

use super::attention;
use super::device::{row_cfg, stride_cfg, CudaDevice};
use super::runtime::{r, w, Arg, DevBuf, GemmArgs, LaunchCfg};
use crate::backend::BackendStorage;
use crate::ops::{AdamWStep, AttnBatch, KvLayout};
use crate::Indices;
use crate::{KernelError, Result};
use std::ops::Range;
use std::sync::OnceLock;

/// Threads per block of the row kernels (one block per row).
const ROW_THREADS: u32 = 256;

/// Elements per block of the sum of squares' first stage (the CPU's chunk).
const SQ_CHUNK: usize = 65536;

/// A device buffer of f32 (the allocation has at least one element).
#[derive(Clone)]
pub struct CudaStorage {
    dev: CudaDevice,
    pub(super) buf: DevBuf<f32>,
    /// The bf16 serving copy of a linear weight on a device in bf16 mode: made from `buf` by
    /// the first `linear` that reads this weight (so optimizer deltas, packed like weights but
    /// never multiplied, get none), rewritten from the new `buf` by `commit_from` (the
    /// optimizer's commit; the copy keeps its address, which decode graphs record) and by
    /// `scale_add_inplace`, read by `linear`.
    pub(super) bf16: OnceLock<DevBuf<u16>>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({:?}, {} f32)", self.dev, self.buf.len())
    }
}

/// A dimension as the kernels' `int`.
pub(super) fn int(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| KernelError::Cuda(format!("dimension {x} exceeds the kernels' 32-bit int")))
}

/// Host indices as the kernels' `int` / `unsigned` arrays.
pub(super) fn ints(v: impl IntoIterator<Item = usize>) -> Result<Vec<i32>> {
    v.into_iter().map(int).collect()
}

impl CudaStorage {
    pub(super) fn new(dev: CudaDevice, buf: DevBuf<f32>) -> Self {
        Self { dev, buf, bf16: OnceLock::new() }
    }

    /// `n` values of `x` as bf16 bits (f32_to_bf16 of elementwise.cu).
    fn to_bf16(dev: &CudaDevice, x: &DevBuf<f32>, n: usize) -> Result<DevBuf<u16>> {
        let mut y = dev.alloc_any::<u16>(n)?;
        dev.launch("elementwise.cu", "f32_to_bf16", stride_cfg(n), &mut [r(x), w(&mut y), Arg::I64(n as i64)])?;
        Ok(y)
    }

    /// The weight's bf16 serving copy, made on first use (see the field).
    fn bf16_copy(&self) -> Result<&DevBuf<u16>> {
        if self.bf16.get().is_none() {
            // Two readers racing here both convert; one copy is kept (the same values).
            let _ = self.bf16.set(Self::to_bf16(&self.dev, &self.buf, self.to_len())?);
        }
        Ok(self.bf16.get().expect("set above"))
    }

    /// A zeroed buffer of `n` on the same device.
    /// `n` f32 on this device for an output the op writes in full (no zero fill).
    pub(super) fn uninit_like(&self, n: usize) -> Result<Self> {
        Ok(self.dev.storage(self.dev.alloc_any(n)?))
    }

    /// Elements of the buffer (the allocation may be larger).
    pub(super) fn to_len(&self) -> usize {
        self.buf.len()
    }

    /// `y = s·x` (elementwise.cu `scale`).
    fn scale_into(&self, s: f32) -> Result<Self> {
        let n = self.to_len();
        let mut y = self.uninit_like(n)?;
        let args = &mut [r(&self.buf), w(&mut y.buf), Arg::F32(s), Arg::I64(n as i64)];
        self.dev.launch("elementwise.cu", "scale", stride_cfg(n), args)?;
        Ok(y)
    }

    /// `C = op(A) · op(B)` of `out` elements in cuBLAS's column-major terms (see
    /// [`BackendStorage::linear`]).
    fn gemm(&self, g: GemmArgs, a: &DevBuf<f32>, b: &DevBuf<f32>, out: usize) -> Result<Self> {
        let mut y = self.uninit_like(out)?;
        self.dev.rt().sgemm(&g, a, b, &mut y.buf)?;
        Ok(y)
    }

    /// Row-major `y [m, n] = x [m, k] · Wᵀ` as column-major `yᵀ = W · xᵀ`: A = W read
    /// transposed (`lda = k`), B = xᵀ (`ldb = k`), C = yᵀ (`ldc = n`).
    fn linear_args(m: usize, k: usize, n: usize) -> Result<GemmArgs> {
        let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
        Ok(GemmArgs {
            trans_a: true,
            trans_b: false,
            m: ni,
            n: mi,
            k: ki,
            alpha: 1.0,
            lda: ki,
            ldb: ki,
            beta: 0.0,
            ldc: ni,
        })
    }

    /// `linear` without bias through cuBLAS SGEMM (see [`BackendStorage::linear`]).
    fn linear_cublas(&self, m: usize, k: usize, w: &Self, n: usize) -> Result<Self> {
        self.gemm(Self::linear_args(m, k, n)?, &w.buf, &self.buf, m * n)
    }

    /// `linear` without bias in bf16: `x` rounded to bf16, then `cublasGemmEx` with A = the
    /// weight's bf16 copy and B = x (both `CUDA_R_16BF`), C = y in f32, f32 accumulation:
    /// the mapping of [`Self::linear_cublas`] with other element types.
    fn linear_bf16(&self, m: usize, k: usize, w: &Self, n: usize) -> Result<Self> {
        let w16 = w.bf16_copy()?;
        let x16 = Self::to_bf16(&self.dev, &self.buf, m * k)?;
        let mut y = self.uninit_like(m * n)?;
        self.dev.rt().gemm_bf16(&Self::linear_args(m, k, n)?, w16, &x16, &mut y.buf)?;
        Ok(y)
    }

    /// `linear` without bias through gemm.cu's `linear_bi` (`--batch-invariant`): `y[i, j]`
    /// is the CPU's FMA chain over `k`, whatever `m`.
    fn linear_bi(&self, m: usize, k: usize, wt: &Self, n: usize) -> Result<Self> {
        let mut y = self.uninit_like(m * n)?;
        let cfg = LaunchCfg { grid: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1), block: (16, 16, 1), smem: 0 };
        let args =
            &mut [r(&self.buf), r(&wt.buf), w(&mut y.buf), Arg::I32(int(m)?), Arg::I32(int(n)?), Arg::I32(int(k)?)];
        self.dev.launch("gemm.cu", "linear_bi", cfg, args)?;
        Ok(y)
    }

    /// `copy_cols(src, src_cols, src_off, dst, dst_cols, dst_off, m, w)` of copy.cu.
    #[allow(clippy::too_many_arguments)]
    fn copy_cols(
        src: &Self,
        src_cols: usize,
        src_off: usize,
        dst: &mut Self,
        dst_cols: usize,
        dst_off: usize,
        m: usize,
        width: usize,
    ) -> Result<()> {
        let a = [int(src_cols)?, int(src_off)?, int(dst_cols)?, int(dst_off)?, int(m)?, int(width)?];
        let args = &mut [
            r(&src.buf),
            Arg::I32(a[0]),
            Arg::I32(a[1]),
            w(&mut dst.buf),
            Arg::I32(a[2]),
            Arg::I32(a[3]),
            Arg::I32(a[4]),
            Arg::I32(a[5]),
        ];
        src.dev.launch("copy.cu", "copy_cols", stride_cfg(m * width), args)
    }

    /// A row kernel `name(x, y, m, n)` (softmax.cu).
    fn rowwise(&self, name: &'static str, m: usize, n: usize) -> Result<Self> {
        let mut y = self.uninit_like(m * n)?;
        let args = &mut [r(&self.buf), w(&mut y.buf), Arg::I32(int(m)?), Arg::I32(int(n)?)];
        self.dev.launch("softmax.cu", name, row_cfg(m, ROW_THREADS), args)?;
        Ok(y)
    }

    /// A scatter kernel `name(dst, rows, src, n, c)` of embedding.cu.
    /// Kernel `name` of embedding.cu (`scatter_rows`, `scatter_add_rows`): row `i` of `src`
    /// into (or added to) row `rows[i]` of `self`, for the `n` device-resident `rows`.
    pub(super) fn scatter(
        &mut self,
        name: &'static str,
        rows: &DevBuf<u32>,
        n: usize,
        src: &Self,
        c: usize,
    ) -> Result<()> {
        self.bf16.take(); // a bf16 copy would be stale (scale_add_inplace and commit_from keep it)
        let dev = self.dev.clone();
        let args = &mut [w(&mut self.buf), r(rows), r(&src.buf), Arg::I32(int(n)?), Arg::I32(int(c)?)];
        dev.launch("embedding.cu", name, stride_cfg(n * c), args)
    }

    /// Rows `ids[0..n]` (device-resident) of `self [_, c]` → `[n, c]`.
    pub(super) fn gather(&self, ids: &DevBuf<u32>, n: usize, c: usize) -> Result<Self> {
        let mut y = self.uninit_like(n * c)?;
        let args = &mut [r(&self.buf), r(ids), w(&mut y.buf), Arg::I32(int(n)?), Arg::I32(int(c)?)];
        self.dev.launch("embedding.cu", "gather_rows", stride_cfg(n * c), args)?;
        Ok(y)
    }

    pub(super) fn device_ref(&self) -> &CudaDevice {
        &self.dev
    }
}

impl BackendStorage for CudaStorage {
    type Device = CudaDevice;
    fn device(&self) -> CudaDevice {
        self.dev.clone()
    }
    fn to_host(&self) -> Result<Vec<f32>> {
        self.dev.rt().dtoh(&self.buf)
    }

    // Weights stay row-major `[n, k]` on the GPU: cuBLAS reads them as they are.
    fn pack_weight(&self, _n: usize, _k: usize) -> Result<Self> {
        Ok(Self::new(self.dev.clone(), self.buf.clone()))
    }
    /// The f32 master (a bf16 copy is not carried over).
    fn unpack_weight(&self, _n: usize, _k: usize) -> Result<Self> {
        Ok(Self::new(self.dev.clone(), self.buf.clone()))
    }
    /// Row-major `y [m, n] = x [m, k] · Wᵀ`. Batch-invariant mode: gemm.cu's `linear_bi` (the
    /// CPU's FMA chains). bf16 mode: a cuBLAS bf16 GEMM over the weight's serving copy.
    /// Otherwise column-major `yᵀ = W · xᵀ`: cuBLAS SGEMM with A = W read transposed
    /// (`lda = k`), B = xᵀ (`ldb = k`), C = yᵀ (`ldc = n`).
    fn linear(&self, m: usize, k: usize, w: &Self, n: usize, bias: Option<&Self>) -> Result<Self> {
        let mut y = if self.dev.batch_invariant() {
            self.linear_bi(m, k, w, n)?
        } else if self.dev.bf16_weights() {
            self.linear_bf16(m, k, w, n)?
        } else {
            self.linear_cublas(m, k, w, n)?
        };
        if let Some(bias) = bias {
            let args = &mut [super::runtime::w(&mut y.buf), r(&bias.buf), Arg::I32(int(m)?), Arg::I32(int(n)?)];
            self.dev.launch("elementwise.cu", "add_bias", stride_cfg(m * n), args)?;
        }
        Ok(y)
    }
    /// Row-major `dW [n, k] = dyᵀ · x` is column-major `dWᵀ [k, n] = xᵀ · dy`: A = xᵀ
    /// (`lda = k`), B = dy read transposed (`ldb = n`), C = dWᵀ (`ldc = k`).
    fn linear_grad_weight(&self, x: &Self, m: usize, n: usize, k: usize) -> Result<Self> {
        let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
        let g = GemmArgs {
            trans_a: false,
            trans_b: true,
            m: ki,
            n: ni,
            k: mi,
            alpha: 1.0,
            lda: ki,
            ldb: ni,
            beta: 0.0,
            ldc: ki,
        };
        self.gemm(g, &x.buf, &self.buf, n * k)
    }
    /// Row-major `dx [m, k] = dy [m, n] · W [n, k]` is column-major `dxᵀ = Wᵀ · dyᵀ`: A = Wᵀ
    /// (`lda = k`), B = dyᵀ (`ldb = n`), C = dxᵀ (`ldc = k`).
    fn linear_grad_input(&self, w: &Self, m: usize, n: usize, k: usize) -> Result<Self> {
        let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
        let g = GemmArgs {
            trans_a: false,
            trans_b: false,
            m: ki,
            n: mi,
            k: ni,
            alpha: 1.0,
            lda: ki,
            ldb: ni,
            beta: 0.0,
            ldc: ki,
        };
        self.gemm(g, &w.buf, &self.buf, m * k)
    }

    fn rms_norm(&self, wt: &Self, m: usize, d: usize, eps: f32) -> Result<Self> {
        let mut y = self.uninit_like(m * d)?;
        let args = &mut [r(&self.buf), r(&wt.buf), w(&mut y.buf), Arg::I32(int(m)?), Arg::I32(int(d)?), Arg::F32(eps)];
        self.dev.launch("rms_norm.cu", "rms_norm", row_cfg(m, ROW_THREADS), args)?;
        Ok(y)
    }
    fn rms_norm_backward(&self, wt: &Self, dy: &Self, m: usize, d: usize, eps: f32) -> Result<(Self, Self)> {
        let (mut dx, mut dw) = (self.uninit_like(m * d)?, self.uninit_like(d)?);
        let mut rstd = self.dev.alloc_any::<f64>(m)?;
        let (mi, di) = (int(m)?, int(d)?);
        let args = &mut [
            r(&self.buf),
            r(&wt.buf),
            r(&dy.buf),
            w(&mut dx.buf),
            w(&mut rstd),
            Arg::I32(mi),
            Arg::I32(di),
            Arg::F32(eps),
        ];
        self.dev.launch("rms_norm.cu", "rms_norm_backward", row_cfg(m, ROW_THREADS), args)?;
        let args = &mut [r(&self.buf), r(&dy.buf), r(&rstd), w(&mut dw.buf), Arg::I32(mi), Arg::I32(di)];
        self.dev.launch("rms_norm.cu", "rms_norm_backward_dw", stride_cfg(d), args)?;
        Ok((dx, dw))
    }
    fn rope_inplace(&mut self, positions: &Indices, cos: &Self, sin: &Self, c: usize, head_dim: usize) -> Result<()> {
        self.bf16.take(); // a bf16 copy would be stale (scale_add_inplace and commit_from keep it)
        if positions.is_empty() {
            return Ok(());
        }
        let dev = self.dev.clone();
        let pos = dev.indices(positions)?;
        let (mi, ci, hi) = (int(positions.len())?, int(c)?, int(head_dim)?);
        let args =
            &mut [w(&mut self.buf), r(&*pos), r(&cos.buf), r(&sin.buf), Arg::I32(mi), Arg::I32(ci), Arg::I32(hi)];
        dev.launch("rope.cu", "rope", stride_cfg(positions.len() * c / 2), args)
    }
    fn silu_mul(&self, m: usize, i: usize) -> Result<Self> {
        let mut y = self.uninit_like(m * i)?;
        let args = &mut [r(&self.buf), w(&mut y.buf), Arg::I32(int(m)?), Arg::I32(int(i)?)];
        self.dev.launch("elementwise.cu", "silu_mul", stride_cfg(m * i), args)?;
        Ok(y)
    }
    fn silu_mul_backward(&self, da: &Self, m: usize, i: usize) -> Result<Self> {
        let mut d = self.uninit_like(m * 2 * i)?;
        let args = &mut [r(&self.buf), r(&da.buf), w(&mut d.buf), Arg::I32(int(m)?), Arg::I32(int(i)?)];
        self.dev.launch("elementwise.cu", "silu_mul_backward", stride_cfg(m * i), args)?;
        Ok(d)
    }
    fn add_inplace(&mut self, other: &Self) -> Result<()> {
        self.bf16.take(); // a bf16 copy would be stale (scale_add_inplace and commit_from keep it)
        let n = self.to_len();
        let dev = self.dev.clone();
        let args = &mut [w(&mut self.buf), r(&other.buf), Arg::I64(n as i64)];
        dev.launch("elementwise.cu", "add_inplace", stride_cfg(n), args)
    }
    /// The packed layout is row-major here: [`Self::scale_add_inplace`].
    /// `a ← s·a + d`; a weight with a bf16 serving copy gets both rewritten in one launch
    /// (`scale_add_inplace_bf16`).
    fn scale_add_inplace(&mut self, s: f32, d: &Self) -> Result<()> {
        let n = self.to_len();
        let Self { dev, buf, bf16 } = self;
        match bf16.get_mut() {
            Some(copy) => {
                let args = &mut [w(buf), Arg::F32(s), r(&d.buf), w(copy), Arg::I64(n as i64)];
                dev.launch("elementwise.cu", "scale_add_inplace_bf16", stride_cfg(n), args)
            }
            None => {
                let args = &mut [w(buf), Arg::F32(s), r(&d.buf), Arg::I64(n as i64)];
                dev.launch("elementwise.cu", "scale_add_inplace", stride_cfg(n), args)
            }
        }
    }
    fn scale_add_into(&self, s: f32, d: &mut Self) -> Result<()> {
        let n = self.to_len();
        let args = &mut [r(&self.buf), Arg::F32(s), w(&mut d.buf), Arg::I64(n as i64)];
        self.dev.launch("elementwise.cu", "scale_add_into", stride_cfg(n), args)
    }
    /// A weight with a bf16 serving copy and `keep_address` false: the f32 buffers swap and
    /// the copy is rewritten (6 B per value); with `keep_address`: master and copy written in
    /// one pass (10 B); without a copy: a device copy (8 B).
    fn commit_from(&mut self, new: &mut Self, keep_address: bool) -> Result<()> {
        let n = self.to_len();
        let Self { dev, buf, bf16 } = self;
        match bf16.get_mut() {
            Some(copy) if !keep_address => {
                std::mem::swap(buf, &mut new.buf);
                dev.launch("elementwise.cu", "f32_to_bf16", stride_cfg(n), &mut [r(buf), w(copy), Arg::I64(n as i64)])
            }
            Some(copy) => {
                let args = &mut [r(&new.buf), w(buf), w(copy), Arg::I64(n as i64)];
                dev.launch("elementwise.cu", "copy_bf16", stride_cfg(n), args)
            }
            None => dev.rt().dtod(&new.buf, 0, buf, 0, n),
        }
    }
    fn scale(&self, s: f32) -> Result<Self> {
        self.scale_into(s)
    }
    fn sum_squares(parts: &[&Self]) -> Result<f64> {
        let Some(first) = parts.first() else { return Ok(0.0) };
        let dev = &first.dev;
        // Chunk sums of each tensor into one reused buffer (the stream orders the uses),
        // each tensor's total into its slot, the slots summed: one host read for them all.
        let chunks = |p: &Self| p.to_len().div_ceil(SQ_CHUNK).max(1);
        let mut partial = dev.alloc_any::<f64>(parts.iter().map(|p| chunks(p)).max().unwrap_or(1))?;
        let mut totals = dev.alloc_any::<f64>(parts.len())?;
        for (i, p) in parts.iter().enumerate() {
            let (len, n) = (p.to_len(), chunks(p));
            let args = &mut [r(&p.buf), Arg::I64(len as i64), Arg::I64(SQ_CHUNK as i64), w(&mut partial)];
            dev.launch("reduce.cu", "sum_squares_partial", row_cfg(n, ROW_THREADS), args)?;
            let args = &mut [r(&partial), Arg::I32(int(n)?), w(&mut totals), Arg::I32(int(i)?)];
            dev.launch("reduce.cu", "sum_f64", row_cfg(1, ROW_THREADS), args)?;
        }
        let mut total = dev.alloc_any::<f64>(1)?;
        let args = &mut [r(&totals), Arg::I32(int(parts.len())?), w(&mut total), Arg::I32(0)];
        dev.launch("reduce.cu", "sum_f64", row_cfg(1, ROW_THREADS), args)?;
        Ok(dev.rt().dtoh(&total)?[0])
    }
    fn sum_rows(&self, m: usize, n: usize) -> Result<Self> {
        let mut y = self.uninit_like(n)?;
        let args = &mut [r(&self.buf), w(&mut y.buf), Arg::I32(int(m)?), Arg::I32(int(n)?)];
        self.dev.launch("reduce.cu", "sum_rows", stride_cfg(n), args)?;
        Ok(y)
    }
    fn softmax(&self, m: usize, n: usize) -> Result<Self> {
        self.rowwise("softmax_rows", m, n)
    }
    fn log_softmax(&self, m: usize, n: usize) -> Result<Self> {
        self.rowwise("log_softmax_rows", m, n)
    }

    /// The packed layout is row-major here: [`Self::gather_rows`].
    fn gather_packed_rows(&self, ids: &Indices, _n: usize, k: usize) -> Result<Self> {
        self.gather_rows(ids, k)
    }
    fn gather_rows(&self, ids: &Indices, c: usize) -> Result<Self> {
        if ids.is_empty() {
            return self.uninit_like(0);
        }
        self.gather(&*self.dev.indices(ids)?, ids.len(), c)
    }
    fn scatter_rows(&mut self, rows: &Indices, src: &Self, c: usize) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let dev = self.dev.clone();
        self.scatter("scatter_rows", &*dev.indices(rows)?, rows.len(), src, c)
    }
    fn scatter_add_rows(&mut self, rows: &Indices, src: &Self, c: usize) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let dev = self.dev.clone();
        self.scatter("scatter_add_rows", &*dev.indices(rows)?, rows.len(), src, c)
    }
    fn split_cols(&self, m: usize, widths: &[usize]) -> Result<Vec<Self>> {
        let c: usize = widths.iter().sum();
        let mut off = 0;
        widths
            .iter()
            .map(|&wd| {
                let mut part = self.uninit_like(m * wd)?;
                if m * wd > 0 {
                    Self::copy_cols(self, c, off, &mut part, wd, 0, m, wd)?;
                }
                off += wd;
                Ok(part)
            })
            .collect()
    }
    fn cat_cols(parts: &[(&Self, usize)], m: usize) -> Result<Self> {
        let first = parts.first().ok_or_else(|| KernelError::Cuda("cat_cols of no parts".into()))?.0;
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut out = first.uninit_like(m * total)?;
        let mut off = 0;
        for &(p, wd) in parts {
            if m * wd > 0 {
                Self::copy_cols(p, wd, 0, &mut out, total, off, m, wd)?;
            }
            off += wd;
        }
        Ok(out)
    }
    fn cat(parts: &[&Self]) -> Result<Self> {
        let first = parts.first().ok_or_else(|| KernelError::Cuda("cat of no parts".into()))?;
        let total: usize = parts.iter().map(|p| p.to_len()).sum();
        let mut out = first.uninit_like(total)?;
        let mut off = 0;
        for p in parts {
            first.dev.rt().dtod(&p.buf, 0, &mut out.buf, off, p.to_len())?;
            off += p.to_len();
        }
        Ok(out)
    }
    fn slice(&self, range: Range<usize>) -> Result<Self> {
        Ok(self.dev.storage(self.dev.rt().clone_range(&self.buf, range)?))
    }

    fn paged_attention(
        &self,
        k: &Self,
        v: &Self,
        batch: &AttnBatch,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        layout: KvLayout,
    ) -> Result<Self> {
        if layout != KvLayout::Rows {
            return Err(KernelError::Unsupported {
                op: "attention",
                detail: "the Blocked KV layout is CPU-only".into(),
            });
        }
        attention::paged_attention(self, k, v, batch, n_heads, n_kv_heads, head_dim)
    }
    fn attention_backward(
        &self,
        k: &Self,
        v: &Self,
        da: &Self,
        spans: &[Range<usize>],
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Result<(Self, Self, Self)> {
        attention::attention_backward(self, k, v, da, spans, n_heads, n_kv_heads, head_dim)
    }

    fn token_logprobs(&self, v: usize, tokens: &[u32], temperature: f32) -> Result<(Vec<f32>, Vec<f32>)> {
        let m = tokens.len();
        if m == 0 {
            return Ok((vec![], vec![]));
        }
        let toks = self.dev.upload_any(tokens)?;
        let (mut lp, mut ent) = (self.dev.alloc_any::<f32>(m)?, self.dev.alloc_any::<f32>(m)?);
        let args = &mut [
            r(&self.buf),
            r(&toks),
            Arg::I32(int(m)?),
            Arg::I32(int(v)?),
            Arg::F32(temperature),
            w(&mut lp),
            w(&mut ent),
        ];
        self.dev.launch("logprob.cu", "token_logprobs", row_cfg(m, ROW_THREADS), args)?;
        Ok((self.dev.rt().dtoh(&lp)?, self.dev.rt().dtoh(&ent)?))
    }
    fn sample(&self, v: usize, rows: &[crate::sample::SampleRow]) -> Result<Vec<crate::sample::Sampled>> {
        super::sample::sample(&self.dev, &self.buf, v, rows)
    }
    fn token_logprobs_backward(
        &self,
        v: usize,
        tokens: &[u32],
        temperature: f32,
        dl_dlogp: &[f32],
        dl_dentropy: Option<&[f32]>,
        entropies: &[f32],
    ) -> Result<Self> {
        let m = tokens.len();
        let mut dz = self.uninit_like(m * v)?;
        if m == 0 {
            return Ok(dz);
        }
        let (toks, g, h) =
            (self.dev.upload_any(tokens)?, self.dev.upload_any(dl_dlogp)?, self.dev.upload_any(entropies)?);
        let e = dl_dentropy.map(|d| self.dev.upload_any(d)).transpose()?;
        let args = &mut [
            r(&self.buf),
            r(&toks),
            Arg::I32(int(m)?),
            Arg::I32(int(v)?),
            Arg::F32(temperature),
            r(&g),
            e.as_ref().map_or(Arg::Null(0), r),
            r(&h),
            w(&mut dz.buf),
        ];
        self.dev.launch("logprob.cu", "token_logprobs_backward", row_cfg(m, ROW_THREADS), args)?;
        Ok(dz)
    }

    fn adamw_delta(&self, m: &mut Self, v: &mut Self, s: &AdamWStep) -> Result<Self> {
        let n = self.to_len();
        let mut d = self.uninit_like(n)?;
        let args = &mut [
            r(&self.buf),
            w(&mut m.buf),
            w(&mut v.buf),
            w(&mut d.buf),
            Arg::I64(n as i64),
            Arg::F64(s.lr),
            Arg::F64(s.beta1),
            Arg::F64(s.beta2),
            Arg::F64(s.eps),
            Arg::F64(s.bias_correction1),
            Arg::F64(s.bias_correction2),
            Arg::F64(s.clip),
        ];
        self.dev.launch("adamw.cu", "adamw_delta", stride_cfg(n), args)?;
        Ok(d)
    }
    /// The packed layout is row-major here: each part's step, concatenated.
    fn adamw_delta_packed(parts: &mut [(&Self, &mut Self, &mut Self)], _k: usize, s: &AdamWStep) -> Result<Self> {
        let steps = parts.iter_mut().map(|(g, m, v)| g.adamw_delta(m, v, s)).collect::<Result<Vec<_>>>()?;
        Self::cat(&steps.iter().collect::<Vec<_>>())
    }
}
