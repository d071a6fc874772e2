//! Stub of the CUDA backend for builds without the `cuda` feature.
//!
//! [`CudaDevice`] and [`CudaBuffer`] are uninhabited: code that matches on
//! [`crate::Storage::Cuda`] compiles, and can never run.

use crate::{KernelError, Result};

/// A CUDA device (uninhabited in this build).
#[derive(Debug, Clone)]
pub enum CudaDevice {}

/// A device buffer of f32 (uninhabited in this build).
#[derive(Debug, Clone)]
pub enum CudaBuffer {}

impl CudaDevice {
    /// Always fails: this build has no CUDA backend.
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(KernelError::CudaUnavailable)
    }
}
