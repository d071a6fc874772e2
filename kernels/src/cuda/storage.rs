//! [`CudaStorage`]: the backend contract over device buffers, one kernel launch (or cuBLAS
//! call) per op, with the launch configurations the `.cu` headers specify.

use super::attention;
use super::device::{cuda_err, launch, row_cfg, stride_cfg, CudaDevice};
use crate::backend::{BackendDevice, BackendStorage};
use crate::ops::{AdamWStep, AttnSeq, KvLayout};
use crate::{KernelError, Result};
use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use std::ops::Range;
use std::sync::OnceLock;

/// Threads per block of the row kernels (one block per row).
const ROW_THREADS: u32 = 256;

/// Elements per block of the sum of squares' first stage (the CPU's chunk).
const SQ_CHUNK: usize = 65536;

/// A device buffer of `len` f32 (the allocation has at least one element).
#[derive(Clone)]
pub struct CudaStorage {
    dev: CudaDevice,
    pub(super) buf: CudaSlice<f32>,
    len: usize,
    /// The bf16 serving copy of a linear weight on a device in bf16 mode: made from `buf` by
    /// the first `linear` that reads this weight (so optimizer deltas, packed like weights but
    /// never multiplied, get none), rewritten with `buf` by every `scale_add_inplace` (the
    /// optimizer's update, one launch), read by `linear`.
    bf16: OnceLock<CudaSlice<u16>>,
}

impl std::fmt::Debug for CudaStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaStorage({:?}, {} f32)", self.dev, self.len)
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
    pub(super) fn new(dev: CudaDevice, buf: CudaSlice<f32>, len: usize) -> Self {
        Self { dev, buf, len, bf16: OnceLock::new() }
    }

    /// `n` values of `x` as bf16 bits (f32_to_bf16 of elementwise.cu).
    fn to_bf16(dev: &CudaDevice, x: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<u16>> {
        let mut y = dev.zeros_any::<u16>(n)?;
        let f = dev.function("elementwise.cu", "f32_to_bf16")?;
        let nl = n as i64;
        let mut b = dev.stream().launch_builder(&f);
        b.arg(x).arg(&mut y).arg(&nl);
        launch(b, stride_cfg(n))?;
        Ok(y)
    }

    /// The weight's bf16 serving copy, made on first use (see the field).
    fn bf16_copy(&self) -> Result<&CudaSlice<u16>> {
        if self.bf16.get().is_none() {
            // Two readers racing here both convert; one copy is kept (the same values).
            let _ = self.bf16.set(Self::to_bf16(&self.dev, &self.buf, self.len)?);
        }
        Ok(self.bf16.get().expect("set above"))
    }

    /// A zeroed buffer of `n` on the same device.
    fn zeros_like(&self, n: usize) -> Result<Self> {
        self.dev.zeros(n)
    }

    /// Elements of the buffer (the allocation may be larger).
    pub(super) fn to_len(&self) -> usize {
        self.len
    }

    /// `y = s·x` (elementwise.cu `scale`).
    fn scale_into(&self, s: f32) -> Result<Self> {
        let mut y = self.zeros_like(self.len)?;
        let f = self.dev.function("elementwise.cu", "scale")?;
        let n = self.len as i64;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&mut y.buf).arg(&s).arg(&n);
        launch(b, stride_cfg(self.len))?;
        Ok(y)
    }

    /// `C = op(A) · op(B)` of `out` elements in cuBLAS's column-major terms (see
    /// [`BackendStorage::linear`]).
    fn gemm(&self, cfg: GemmConfig<f32>, a: &CudaSlice<f32>, b: &CudaSlice<f32>, out: usize) -> Result<Self> {
        let mut y = self.zeros_like(out)?;
        // SAFETY: the dimensions and leading dimensions describe buffers of the sizes the
        // contract's shapes give (checked by ops).
        unsafe { self.dev.blas().gemm(cfg, a, b, &mut y.buf) }.map_err(cuda_err)?;
        Ok(y)
    }

    /// `linear` without bias through cuBLAS SGEMM (see [`BackendStorage::linear`]).
    fn linear_cublas(&self, m: usize, k: usize, w: &Self, n: usize) -> Result<Self> {
        let cfg = GemmConfig {
            transa: CUBLAS_OP_T,
            transb: CUBLAS_OP_N,
            m: int(n)?,
            n: int(m)?,
            k: int(k)?,
            alpha: 1.0,
            lda: int(k)?,
            ldb: int(k)?,
            beta: 0.0,
            ldc: int(n)?,
        };
        self.gemm(cfg, &w.buf, &self.buf, m * n)
    }

    /// `linear` without bias in bf16: `x` rounded to bf16, then `cublasGemmEx` with A = the
    /// weight's bf16 copy read transposed, B = x (both `CUDA_R_16BF`, `lda = ldb = k`), C = y
    /// in f32 (`ldc = n`), `CUBLAS_COMPUTE_32F` (f32 accumulation): the mapping of
    /// [`Self::linear_cublas`] with other element types.
    fn linear_bf16(&self, m: usize, k: usize, w: &Self, n: usize) -> Result<Self> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
        let w16 = w.bf16_copy()?;
        let x16 = Self::to_bf16(&self.dev, &self.buf, m * k)?;
        let mut y = self.zeros_like(m * n)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stream = self.dev.stream();
        {
            let (a, _a_in_use) = w16.device_ptr(stream);
            let (b, _b_in_use) = x16.device_ptr(stream);
            let (c, _c_in_use) = y.buf.device_ptr_mut(stream);
            // SAFETY: A is the [n, k] weight, B the [m, k] activations, C the [m, n] output
            // (row-major), all on this device's stream; the scalars are f32 as the compute type
            // requires; the records keep the buffers in use until the call is queued.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.dev.blas().handle(),
                    CUBLAS_OP_T,
                    CUBLAS_OP_N,
                    int(n)?,
                    int(m)?,
                    int(k)?,
                    (&alpha) as *const f32 as *const _,
                    a as *const _,
                    cudaDataType_t::CUDA_R_16BF,
                    int(k)?,
                    b as *const _,
                    cudaDataType_t::CUDA_R_16BF,
                    int(k)?,
                    (&beta) as *const f32 as *const _,
                    c as *mut _,
                    cudaDataType_t::CUDA_R_32F,
                    int(n)?,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(cuda_err)?;
        }
        Ok(y)
    }

    /// `linear` without bias through gemm.cu's `linear_bi` (`--batch-invariant`): `y[i, j]`
    /// is the CPU's FMA chain over `k`, whatever `m`.
    fn linear_bi(&self, m: usize, k: usize, w: &Self, n: usize) -> Result<Self> {
        let mut y = self.zeros_like(m * n)?;
        let f = self.dev.function("gemm.cu", "linear_bi")?;
        let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&w.buf).arg(&mut y.buf).arg(&mi).arg(&ni).arg(&ki);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(64) as u32, m.div_ceil(64) as u32, 1),
            block_dim: (16, 16, 1),
            shared_mem_bytes: 0,
        };
        launch(b, cfg)?;
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
        w: usize,
    ) -> Result<()> {
        let f = src.dev.function("copy.cu", "copy_cols")?;
        let a = [int(src_cols)?, int(src_off)?, int(dst_cols)?, int(dst_off)?, int(m)?, int(w)?];
        let mut b = src.dev.stream().launch_builder(&f);
        b.arg(&src.buf).arg(&a[0]).arg(&a[1]).arg(&mut dst.buf).arg(&a[2]).arg(&a[3]).arg(&a[4]).arg(&a[5]);
        launch(b, stride_cfg(m * w))
    }

    /// A row kernel `name(x, y, m, n)` (softmax.cu).
    fn rowwise(&self, name: &'static str, m: usize, n: usize) -> Result<Self> {
        let mut y = self.zeros_like(m * n)?;
        let f = self.dev.function("softmax.cu", name)?;
        let (mi, ni) = (int(m)?, int(n)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&mut y.buf).arg(&mi).arg(&ni);
        launch(b, row_cfg(m, ROW_THREADS))?;
        Ok(y)
    }

    /// A scatter kernel `name(dst, rows, src, n, c)` of embedding.cu.
    fn scatter(&mut self, name: &'static str, rows: &[u32], src: &Self, c: usize) -> Result<()> {
        self.bf16.take(); // a bf16 copy would be stale (only scale_add_inplace keeps it)
        if rows.is_empty() {
            return Ok(());
        }
        let ids = self.dev.upload_any(rows)?;
        let f = self.dev.function("embedding.cu", name)?;
        let (n, ci) = (int(rows.len())?, int(c)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&mut self.buf).arg(&ids).arg(&src.buf).arg(&n).arg(&ci);
        launch(b, stride_cfg(rows.len() * c))
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
        let mut v = self.dev.stream().clone_dtoh(&self.buf).map_err(cuda_err)?;
        v.truncate(self.len);
        Ok(v)
    }

    // Weights stay row-major `[n, k]` on the GPU: cuBLAS reads them as they are.
    fn pack_weight(&self, _n: usize, _k: usize) -> Result<Self> {
        Ok(Self::new(self.dev.clone(), self.buf.clone(), self.len))
    }
    /// The f32 master (a bf16 copy is not carried over).
    fn unpack_weight(&self, _n: usize, _k: usize) -> Result<Self> {
        Ok(Self::new(self.dev.clone(), self.buf.clone(), self.len))
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
            let f = self.dev.function("elementwise.cu", "add_bias")?;
            let (mi, ni) = (int(m)?, int(n)?);
            let mut b = self.dev.stream().launch_builder(&f);
            b.arg(&mut y.buf).arg(&bias.buf).arg(&mi).arg(&ni);
            launch(b, stride_cfg(m * n))?;
        }
        Ok(y)
    }
    /// Row-major `dW [n, k] = dyᵀ · x` is column-major `dWᵀ [k, n] = xᵀ · dy`: A = xᵀ
    /// (`lda = k`), B = dy read transposed (`ldb = n`), C = dWᵀ (`ldc = k`).
    fn linear_grad_weight(&self, x: &Self, m: usize, n: usize, k: usize) -> Result<Self> {
        let cfg = GemmConfig {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_T,
            m: int(k)?,
            n: int(n)?,
            k: int(m)?,
            alpha: 1.0,
            lda: int(k)?,
            ldb: int(n)?,
            beta: 0.0,
            ldc: int(k)?,
        };
        self.gemm(cfg, &x.buf, &self.buf, n * k)
    }
    /// Row-major `dx [m, k] = dy [m, n] · W [n, k]` is column-major `dxᵀ = Wᵀ · dyᵀ`: A = Wᵀ
    /// (`lda = k`), B = dyᵀ (`ldb = n`), C = dxᵀ (`ldc = k`).
    fn linear_grad_input(&self, w: &Self, m: usize, n: usize, k: usize) -> Result<Self> {
        let cfg = GemmConfig {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_N,
            m: int(k)?,
            n: int(m)?,
            k: int(n)?,
            alpha: 1.0,
            lda: int(k)?,
            ldb: int(n)?,
            beta: 0.0,
            ldc: int(k)?,
        };
        self.gemm(cfg, &w.buf, &self.buf, m * k)
    }

    fn rms_norm(&self, w: &Self, m: usize, d: usize, eps: f32) -> Result<Self> {
        let mut y = self.zeros_like(m * d)?;
        let f = self.dev.function("rms_norm.cu", "rms_norm")?;
        let (mi, di) = (int(m)?, int(d)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&w.buf).arg(&mut y.buf).arg(&mi).arg(&di).arg(&eps);
        launch(b, row_cfg(m, ROW_THREADS))?;
        Ok(y)
    }
    fn rms_norm_backward(&self, w: &Self, dy: &Self, m: usize, d: usize, eps: f32) -> Result<(Self, Self)> {
        let (mut dx, mut dw) = (self.zeros_like(m * d)?, self.zeros_like(d)?);
        let mut rstd = self.dev.zeros_any::<f64>(m)?;
        let (mi, di) = (int(m)?, int(d)?);
        let f = self.dev.function("rms_norm.cu", "rms_norm_backward")?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&w.buf).arg(&dy.buf).arg(&mut dx.buf).arg(&mut rstd).arg(&mi).arg(&di).arg(&eps);
        launch(b, row_cfg(m, ROW_THREADS))?;
        let f = self.dev.function("rms_norm.cu", "rms_norm_backward_dw")?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&dy.buf).arg(&rstd).arg(&mut dw.buf).arg(&mi).arg(&di);
        launch(b, stride_cfg(d))?;
        Ok((dx, dw))
    }
    fn rope_inplace(&mut self, positions: &[usize], cos: &Self, sin: &Self, c: usize, head_dim: usize) -> Result<()> {
        self.bf16.take(); // a bf16 copy would be stale (only scale_add_inplace keeps it)
        if positions.is_empty() {
            return Ok(());
        }
        let pos = self.dev.upload_any(&ints(positions.iter().copied())?)?;
        let f = self.dev.function("rope.cu", "rope")?;
        let (mi, ci, hi) = (int(positions.len())?, int(c)?, int(head_dim)?);
        let stream = self.dev.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut self.buf).arg(&pos).arg(&cos.buf).arg(&sin.buf).arg(&mi).arg(&ci).arg(&hi);
        launch(b, stride_cfg(positions.len() * c / 2))
    }
    fn silu_mul(&self, m: usize, i: usize) -> Result<Self> {
        let mut y = self.zeros_like(m * i)?;
        let f = self.dev.function("elementwise.cu", "silu_mul")?;
        let (mi, ii) = (int(m)?, int(i)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&mut y.buf).arg(&mi).arg(&ii);
        launch(b, stride_cfg(m * i))?;
        Ok(y)
    }
    fn silu_mul_backward(&self, da: &Self, m: usize, i: usize) -> Result<Self> {
        let mut d = self.zeros_like(m * 2 * i)?;
        let f = self.dev.function("elementwise.cu", "silu_mul_backward")?;
        let (mi, ii) = (int(m)?, int(i)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&da.buf).arg(&mut d.buf).arg(&mi).arg(&ii);
        launch(b, stride_cfg(m * i))?;
        Ok(d)
    }
    fn add_inplace(&mut self, other: &Self) -> Result<()> {
        self.bf16.take(); // a bf16 copy would be stale (only scale_add_inplace keeps it)
        let f = self.dev.function("elementwise.cu", "add_inplace")?;
        let n = self.len as i64;
        let stream = self.dev.stream().clone();
        let mut b = stream.launch_builder(&f);
        b.arg(&mut self.buf).arg(&other.buf).arg(&n);
        launch(b, stride_cfg(self.len))
    }
    /// The packed layout is row-major here: [`Self::scale_add_inplace`].
    fn scale_add_unpacked(&mut self, s: f32, d: &Self, _n: usize, _k: usize) -> Result<()> {
        self.scale_add_inplace(s, d)
    }
    /// `a ← s·a + d`; a weight with a bf16 serving copy gets both rewritten in one launch
    /// (`scale_add_inplace_bf16`).
    fn scale_add_inplace(&mut self, s: f32, d: &Self) -> Result<()> {
        let n = self.len as i64;
        let stream = self.dev.stream().clone();
        let Self { dev, buf, bf16, .. } = self;
        match bf16.get_mut() {
            Some(copy) => {
                let f = dev.function("elementwise.cu", "scale_add_inplace_bf16")?;
                let mut b = stream.launch_builder(&f);
                b.arg(buf).arg(&s).arg(&d.buf).arg(copy).arg(&n);
                launch(b, stride_cfg(n as usize))
            }
            None => {
                let f = dev.function("elementwise.cu", "scale_add_inplace")?;
                let mut b = stream.launch_builder(&f);
                b.arg(buf).arg(&s).arg(&d.buf).arg(&n);
                launch(b, stride_cfg(n as usize))
            }
        }
    }
    fn scale(&self, s: f32) -> Result<Self> {
        self.scale_into(s)
    }
    fn sum_squares(&self) -> Result<f64> {
        let parts = self.len.div_ceil(SQ_CHUNK).max(1);
        let mut partial = self.dev.zeros_any::<f64>(parts)?;
        let mut total = self.dev.zeros_any::<f64>(1)?;
        let (n, chunk, pi) = (self.len as i64, SQ_CHUNK as i64, int(parts)?);
        let f = self.dev.function("reduce.cu", "sum_squares_partial")?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&n).arg(&chunk).arg(&mut partial);
        launch(b, row_cfg(parts, ROW_THREADS))?;
        let f = self.dev.function("reduce.cu", "sum_f64")?;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&partial).arg(&pi).arg(&mut total);
        launch(b, row_cfg(1, ROW_THREADS))?;
        Ok(self.dev.stream().clone_dtoh(&total).map_err(cuda_err)?[0])
    }
    fn sum_rows(&self, m: usize, n: usize) -> Result<Self> {
        let mut y = self.zeros_like(n)?;
        let f = self.dev.function("reduce.cu", "sum_rows")?;
        let (mi, ni) = (int(m)?, int(n)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&mut y.buf).arg(&mi).arg(&ni);
        launch(b, stride_cfg(n))?;
        Ok(y)
    }
    fn softmax(&self, m: usize, n: usize) -> Result<Self> {
        self.rowwise("softmax_rows", m, n)
    }
    fn log_softmax(&self, m: usize, n: usize) -> Result<Self> {
        self.rowwise("log_softmax_rows", m, n)
    }

    fn gather_rows(&self, ids: &[u32], c: usize) -> Result<Self> {
        let mut y = self.zeros_like(ids.len() * c)?;
        if ids.is_empty() {
            return Ok(y);
        }
        let idx = self.dev.upload_any(ids)?;
        let f = self.dev.function("embedding.cu", "gather_rows")?;
        let (n, ci) = (int(ids.len())?, int(c)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&idx).arg(&mut y.buf).arg(&n).arg(&ci);
        launch(b, stride_cfg(ids.len() * c))?;
        Ok(y)
    }
    fn scatter_rows(&mut self, rows: &[u32], src: &Self, c: usize) -> Result<()> {
        self.scatter("scatter_rows", rows, src, c)
    }
    fn scatter_add_rows(&mut self, rows: &[u32], src: &Self, c: usize) -> Result<()> {
        self.scatter("scatter_add_rows", rows, src, c)
    }
    fn split_cols(&self, m: usize, widths: &[usize]) -> Result<Vec<Self>> {
        let c: usize = widths.iter().sum();
        let mut off = 0;
        widths
            .iter()
            .map(|&w| {
                let mut part = self.zeros_like(m * w)?;
                if m * w > 0 {
                    Self::copy_cols(self, c, off, &mut part, w, 0, m, w)?;
                }
                off += w;
                Ok(part)
            })
            .collect()
    }
    fn cat_cols(parts: &[(&Self, usize)], m: usize) -> Result<Self> {
        let first = parts.first().ok_or_else(|| KernelError::Cuda("cat_cols of no parts".into()))?.0;
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut out = first.zeros_like(m * total)?;
        let mut off = 0;
        for &(p, w) in parts {
            if m * w > 0 {
                Self::copy_cols(p, w, 0, &mut out, total, off, m, w)?;
            }
            off += w;
        }
        Ok(out)
    }
    fn cat(parts: &[&Self]) -> Result<Self> {
        let first = parts.first().ok_or_else(|| KernelError::Cuda("cat of no parts".into()))?;
        let total: usize = parts.iter().map(|p| p.len).sum();
        let mut out = first.zeros_like(total)?;
        let mut off = 0;
        let stream = first.dev.stream().clone();
        for p in parts {
            if p.len > 0 {
                stream
                    .memcpy_dtod(&p.buf.slice(..p.len), &mut out.buf.slice_mut(off..off + p.len))
                    .map_err(cuda_err)?;
            }
            off += p.len;
        }
        Ok(out)
    }
    fn slice(&self, range: Range<usize>) -> Result<Self> {
        let len = range.len();
        if len == 0 {
            return self.zeros_like(0);
        }
        let buf = self.dev.stream().clone_dtod(&self.buf.slice(range)).map_err(cuda_err)?;
        Ok(self.dev.storage(buf, len))
    }

    fn paged_attention(
        &self,
        k: &Self,
        v: &Self,
        seqs: &[AttnSeq],
        block_size: usize,
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
        attention::paged_attention(self, k, v, seqs, block_size, n_heads, n_kv_heads, head_dim)
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
        let (mut lp, mut ent) = (self.dev.zeros_any::<f32>(m)?, self.dev.zeros_any::<f32>(m)?);
        let f = self.dev.function("logprob.cu", "token_logprobs")?;
        let (mi, vi) = (int(m)?, int(v)?);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&toks).arg(&mi).arg(&vi).arg(&temperature).arg(&mut lp).arg(&mut ent);
        launch(b, row_cfg(m, ROW_THREADS))?;
        let s = self.dev.stream();
        let (mut lp, mut ent) = (s.clone_dtoh(&lp).map_err(cuda_err)?, s.clone_dtoh(&ent).map_err(cuda_err)?);
        lp.truncate(m);
        ent.truncate(m);
        Ok((lp, ent))
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
        let mut dz = self.zeros_like(m * v)?;
        if m == 0 {
            return Ok(dz);
        }
        let (toks, g, h) =
            (self.dev.upload_any(tokens)?, self.dev.upload_any(dl_dlogp)?, self.dev.upload_any(entropies)?);
        let e = dl_dentropy.map(|d| self.dev.upload_any(d)).transpose()?;
        let f = self.dev.function("logprob.cu", "token_logprobs_backward")?;
        let (mi, vi, null) = (int(m)?, int(v)?, 0u64);
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&toks).arg(&mi).arg(&vi).arg(&temperature).arg(&g);
        match &e {
            Some(e) => b.arg(e),
            None => b.arg(&null),
        };
        b.arg(&h).arg(&mut dz.buf);
        launch(b, row_cfg(m, ROW_THREADS))?;
        Ok(dz)
    }

    fn adamw_delta(&self, m: &mut Self, v: &mut Self, s: &AdamWStep) -> Result<Self> {
        let mut d = self.zeros_like(self.len)?;
        let f = self.dev.function("adamw.cu", "adamw_delta")?;
        let n = self.len as i64;
        let mut b = self.dev.stream().launch_builder(&f);
        b.arg(&self.buf).arg(&mut m.buf).arg(&mut v.buf).arg(&mut d.buf).arg(&n);
        b.arg(&s.lr)
            .arg(&s.beta1)
            .arg(&s.beta2)
            .arg(&s.eps)
            .arg(&s.bias_correction1)
            .arg(&s.bias_correction2)
            .arg(&s.clip);
        launch(b, stride_cfg(self.len))?;
        Ok(d)
    }
    /// The packed layout is row-major here: each part's step, concatenated.
    fn adamw_delta_packed(parts: &mut [(&Self, &mut Self, &mut Self)], _k: usize, s: &AdamWStep) -> Result<Self> {
        let steps = parts.iter_mut().map(|(g, m, v)| g.adamw_delta(m, v, s)).collect::<Result<Vec<_>>>()?;
        Self::cat(&steps.iter().collect::<Vec<_>>())
    }
}
