use crate::cuda::{CudaBuffer, CudaDevice};
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
    /// The CUDA device with this ordinal, or [`KernelError::CudaUnavailable`].
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Device::Cuda(CudaDevice::new(ordinal)?))
    }
}

/// Tensor storage: one variant per backend.
#[derive(Debug, Clone)]
pub enum Storage {
    Cpu(Vec<f32>),
    Cuda(CudaBuffer),
}

/// A dense row-major f32 tensor on one device.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub(crate) storage: Storage,
    shape: Vec<usize>,
}

impl Tensor {
    /// Wraps host data. Errors when `data.len()` is not the product of `shape`.
    pub fn from_vec(data: Vec<f32>, shape: &[usize]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(shape_err("from_vec", format!("{} values for shape {shape:?}", data.len())));
        }
        Ok(Self { storage: Storage::Cpu(data), shape: shape.to_vec() })
    }

    /// A zero-filled tensor on `device`.
    pub fn zeros(shape: &[usize], device: &Device) -> Self {
        let n = shape.iter().product();
        match device {
            Device::Cpu => Self { storage: Storage::Cpu(vec![0.0; n]), shape: shape.to_vec() },
            Device::Cuda(d) => match *d {},
        }
    }

    /// Copies the tensor to `device`.
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        match (&self.storage, device) {
            (Storage::Cpu(_), Device::Cpu) => Ok(self.clone()),
            (Storage::Cuda(b), _) => match *b {},
            (_, Device::Cuda(d)) => match *d {},
        }
    }

    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::Cpu(_) => Device::Cpu,
            Storage::Cuda(b) => match *b {},
        }
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

    /// Host copy of the data.
    pub fn to_vec(&self) -> Vec<f32> {
        match &self.storage {
            Storage::Cpu(v) => v.clone(),
            Storage::Cuda(b) => match *b {},
        }
    }

    /// Borrow the host data (CPU tensors only).
    pub fn as_slice(&self) -> Result<&[f32]> {
        match &self.storage {
            Storage::Cpu(v) => Ok(v),
            Storage::Cuda(b) => match *b {},
        }
    }

    /// Borrow the host data mutably (CPU tensors only).
    pub fn as_mut_slice(&mut self) -> Result<&mut [f32]> {
        match &mut self.storage {
            Storage::Cpu(v) => Ok(v),
            Storage::Cuda(b) => match *b {},
        }
    }

    /// Row `i` of a 2-D CPU tensor as a host copy.
    pub fn row(&self, i: usize) -> Result<Vec<f32>> {
        let (r, c) = self.dims2("row")?;
        if i >= r {
            return Err(shape_err("row", format!("row {i} of {r}")));
        }
        Ok(self.as_slice()?[i * c..(i + 1) * c].to_vec())
    }

    pub(crate) fn same_device(&self, other: &Tensor, op: &'static str) -> Result<()> {
        match (&self.storage, &other.storage) {
            (Storage::Cpu(_), Storage::Cpu(_)) => Ok(()),
            _ => Err(KernelError::DeviceMismatch { op }),
        }
    }
}
