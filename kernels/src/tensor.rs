use crate::backend::{BackendDevice, BackendStorage};
use crate::cpu::{CpuDevice, CpuStorage};
use crate::cuda::{CudaDevice, CudaMark, CudaStorage};
use crate::error::shape_err;
use crate::{KernelError, Result};

/// Where a tensor's storage lives.
#[derive(Debug, Clone)]
pub enum Device {
    /// Host memory; ops run on the rayon pool.
    Cpu,
    /// A CUDA device (only constructible with the `cuda` feature).
    Cuda(CudaDevice),
}

impl Device {
    /// The CUDA device with this ordinal (f32, cuBLAS: [`CudaOptions::default`]), or
    /// [`KernelError::CudaUnavailable`].
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Self::cuda_with(ordinal, CudaOptions::default())
    }

    /// [`Self::cuda`] with [`CudaOptions`] (`--batch-invariant`, `--dtype bfloat16`).
    pub fn cuda_with(ordinal: usize, options: CudaOptions) -> Result<Self> {
        Ok(Device::Cuda(CudaDevice::new(ordinal, options)?))
    }

    /// The emulated CUDA device (the `cuda-emu` feature: [`crate::cuda::emu`]): the CUDA
    /// backend's code paths over host memory, for tests without a GPU. Errors in a build
    /// without the feature.
    pub fn cuda_emu(options: CudaOptions) -> Result<Self> {
        #[cfg(feature = "cuda-emu")]
        return Ok(Device::Cuda(CudaDevice::emulated(options)));
        #[cfg(not(feature = "cuda-emu"))]
        {
            let _ = options;
            Err(KernelError::Cuda(
                "this build has no emulated CUDA device (the kernels crate's cuda-emu feature)".into(),
            ))
        }
    }

    /// `n` zeros on this device.
    pub(crate) fn zeros_storage(&self, n: usize) -> Result<Storage> {
        match self {
            Device::Cpu => CpuDevice.zeros(n).map(Storage::Cpu),
            Device::Cuda(d) => d.zeros(n).map(Storage::Cuda),
        }
    }

    /// The CUDA device's counters ([`DeviceCounters`]); `None` on the CPU.
    pub fn counters(&self) -> Option<DeviceCounters> {
        match self {
            Device::Cpu => None,
            #[allow(unreachable_patterns)]
            Device::Cuda(d) => Some(d.counters()),
        }
    }

    /// A mark after the work queued on this device so far; two marks time the work queued
    /// between them on the device ([`DeviceMark::seconds_until`]), which on a GPU is not
    /// the host's time to queue it. CPU: the host clock (ops run when called); CUDA: an
    /// event with timing recorded on the stream. Errors: inside a graph capture, a CUDA
    /// error.
    pub fn mark(&self) -> Result<DeviceMark> {
        match self {
            Device::Cpu => Ok(DeviceMark::Host(std::time::Instant::now())),
            #[allow(unreachable_patterns)]
            Device::Cuda(d) => d.mark().map(DeviceMark::Cuda),
        }
    }

    /// A copy of host data on this device.
    pub(crate) fn upload(&self, data: &[f32]) -> Result<Storage> {
        match self {
            Device::Cpu => CpuDevice.upload(data).map(Storage::Cpu),
            Device::Cuda(d) => d.upload(data).map(Storage::Cuda),
        }
    }
}

/// A point in a device's queue of work ([`Device::mark`]).
pub enum DeviceMark {
    /// The host clock (the CPU).
    Host(std::time::Instant),
    /// A CUDA event on the device's stream.
    Cuda(CudaMark),
}

impl DeviceMark {
    /// Seconds of device time from this mark to `end`, after waiting for the work queued
    /// before `end` (on a GPU a sync). Errors: marks of two devices, a CUDA error (also one
    /// left by earlier asynchronous work).
    pub fn seconds_until(&self, end: &DeviceMark) -> Result<f64> {
        match (self, end) {
            (DeviceMark::Host(a), DeviceMark::Host(b)) => Ok(b.saturating_duration_since(*a).as_secs_f64()),
            (DeviceMark::Cuda(a), DeviceMark::Cuda(b)) => a.seconds_until(b),
            _ => Err(KernelError::Cuda("timing marks of two devices (the CPU and a GPU)".into())),
        }
    }
}

/// How a CUDA device computes ([`Device::cuda_with`]); the default is f32 weights and cuBLAS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// `--batch-invariant`: the forward GEMMs are gemm.cu's fixed-order `linear_bi` (the CPU
    /// GEMM's FMA chains) instead of cuBLAS, and every attention row takes the split-KV
    /// kernels, so a token's logits do not depend on its batch (ℓ = μ on the GPU). Computes
    /// in f32 ([`Self::bf16_weights`] is ignored).
    pub batch_invariant: bool,
    /// `--dtype bfloat16`: every linear weight gets a bf16 serving copy next to its f32
    /// master, made at its first forward use; `linear` is a cuBLAS bf16 GEMM over it (the
    /// activations rounded to bf16, f32 accumulation and output) and each optimizer update
    /// rewrites master and copy in one launch. The backward and the learner's state stay f32.
    pub bf16_weights: bool,
}

/// What the host has asked of a CUDA device since it was opened ([`Device::counters`]); the
/// difference of two readings is what the work between them cost. A device→host copy waits
/// for the stream, so it is also a host synchronisation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Host→device copies, and their bytes.
    pub htod_copies: u64,
    pub htod_bytes: u64,
    /// Device→host copies, and their bytes.
    pub dtoh_copies: u64,
    pub dtoh_bytes: u64,
    /// Device buffers allocated (each a stream-ordered allocation on a GPU).
    pub allocations: u64,
    /// Of those, the ones zero-filled (a memset each).
    pub zero_fills: u64,
    /// Kernel launches (not counting cuBLAS's own).
    pub launches: u64,
    /// cuBLAS GEMM calls.
    pub gemms: u64,
    /// Times the host waited for the stream.
    pub syncs: u64,
    /// CUDA graph launches (each replays a captured step: its kernels and GEMMs are not
    /// counted again above).
    pub graph_launches: u64,
}

impl DeviceCounters {
    fn zip(self, b: Self, f: fn(u64, u64) -> u64) -> Self {
        DeviceCounters {
            htod_copies: f(self.htod_copies, b.htod_copies),
            htod_bytes: f(self.htod_bytes, b.htod_bytes),
            dtoh_copies: f(self.dtoh_copies, b.dtoh_copies),
            dtoh_bytes: f(self.dtoh_bytes, b.dtoh_bytes),
            allocations: f(self.allocations, b.allocations),
            zero_fills: f(self.zero_fills, b.zero_fills),
            launches: f(self.launches, b.launches),
            gemms: f(self.gemms, b.gemms),
            syncs: f(self.syncs, b.syncs),
            graph_launches: f(self.graph_launches, b.graph_launches),
        }
    }
}

/// What was asked between two readings (`later − earlier`).
impl std::ops::Sub for DeviceCounters {
    type Output = DeviceCounters;
    fn sub(self, b: Self) -> Self {
        self.zip(b, |x, y| x - y)
    }
}

impl std::ops::Add for DeviceCounters {
    type Output = DeviceCounters;
    fn add(self, b: Self) -> Self {
        self.zip(b, |x, y| x + y)
    }
}

/// Element type of a tensor. Every tensor is f32; a CUDA device in bf16 mode keeps a bf16
/// serving copy inside each linear weight's storage ([`CudaOptions::bf16_weights`]), not
/// as a tensor of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DType {
    F32,
}

/// Tensor storage: one variant per backend (see [`crate::backend`]).
#[derive(Debug, Clone)]
pub enum Storage {
    Cpu(CpuStorage),
    Cuda(CudaStorage),
}

impl From<CpuStorage> for Storage {
    fn from(s: CpuStorage) -> Self {
        Storage::Cpu(s)
    }
}

impl From<CudaStorage> for Storage {
    fn from(s: CudaStorage) -> Self {
        Storage::Cuda(s)
    }
}

impl Storage {
    #[allow(unreachable_code)] // the CUDA stub's device is uninhabited
    pub(crate) fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(s) => Device::Cuda(s.device()),
        }
    }

    pub(crate) fn to_host(&self) -> Result<Vec<f32>> {
        match self {
            Storage::Cpu(s) => s.to_host(),
            Storage::Cuda(s) => s.to_host(),
        }
    }
}

/// A dense row-major tensor on one device.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub(crate) storage: Storage,
    shape: Vec<usize>,
    dtype: DType,
}

impl Tensor {
    pub(crate) fn new(storage: Storage, shape: &[usize]) -> Self {
        Self { storage, shape: shape.to_vec(), dtype: DType::F32 }
    }

    /// Wraps host data. Errors when `data.len()` is not the product of `shape`.
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(shape_err("from_vec", format!("{} values for shape {shape:?}", data.len())));
        }
        Ok(Self::new(Storage::Cpu(CpuStorage::from(data)), shape))
    }

    /// A zero-filled tensor on `device`.
    pub fn zeros(shape: &[usize], device: &Device) -> Result<Self> {
        Ok(Self::new(device.zeros_storage(shape.iter().product())?, shape))
    }

    /// Copies the tensor to `device` (a clone when it is there already).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        match (&self.storage, device) {
            (Storage::Cpu(_), Device::Cpu) => Ok(self.clone()),
            (Storage::Cpu(s), d) => Ok(Self::new(d.upload(&s.0)?, &self.shape)),
            (Storage::Cuda(s), _) => Ok(Self::new(device.upload(&s.to_host()?)?, &self.shape)),
        }
    }

    pub fn device(&self) -> Device {
        self.storage.device()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(rows, cols)` of a 2-D tensor; a 1-D tensor is one row.
    pub fn dims2(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape.as_slice() {
            [c] => Ok((1, *c)),
            [r, c] => Ok((*r, *c)),
            s => Err(shape_err(op, format!("expected a 1-D or 2-D tensor, got {s:?}"))),
        }
    }

    /// Reinterprets the shape (same number of elements).
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        if shape.iter().product::<usize>() != self.len() {
            return Err(shape_err("reshape", format!("{:?} -> {shape:?}", self.shape)));
        }
        self.shape = shape.to_vec();
        Ok(self)
    }

    /// Host copy of the data, from any device.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        self.storage.to_host()
    }

    /// Borrows the data of a host tensor, for tests and tools; device tensors are an error
    /// (model code uses [`Self::to_vec`] or an op instead).
    pub fn as_slice(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::Cpu(s) => Ok(&s.0),
            Storage::Cuda(_) => Err(KernelError::NotOnHost),
        }
    }

    /// Row `i` of a 2-D tensor as a host copy.
    pub fn row(&self, i: usize) -> Result<Vec<f32>> {
        let (r, _) = self.dims2("row")?;
        if i >= r {
            return Err(shape_err("row", format!("row {i} of {r}")));
        }
        crate::ops::rows(self, i..i + 1)?.to_vec()
    }
}
