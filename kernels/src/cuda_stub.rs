//! Stub of the CUDA backend for builds without the `cuda` feature.
//!
//! [`CudaDevice`] and [`CudaStorage`] are uninhabited and implement the whole backend
//! contract: a contract method this file lacks is a compile error, code that matches on
//! [`crate::Storage::Cuda`] compiles, and [`CudaDevice::new`] (the only way to reach the
//! device) returns [`KernelError::CudaUnavailable`].

use crate::backend::{BackendDevice, BackendStorage};
use crate::indices::Indices;
use crate::ops::{AdamWStep, AttnBatch, KvLayout};
use crate::{KernelError, Result};
use std::ops::Range;

/// A CUDA device (uninhabited in this build).
#[derive(Debug, Clone)]
pub enum CudaDevice {}

/// A device buffer of f32 (uninhabited in this build).
#[derive(Debug, Clone)]
pub enum CudaStorage {}

impl CudaDevice {
    /// Always fails: this build has no CUDA backend.
    pub fn new(_ordinal: usize, _options: crate::CudaOptions) -> Result<Self> {
        Err(KernelError::CudaUnavailable)
    }

    pub fn counters(&self) -> crate::DeviceCounters {
        match *self {}
    }

    pub fn graph_pool(&self) -> CudaGraphPool {
        match *self {}
    }

    pub fn capture<R, E: From<KernelError>>(
        &self,
        _: &CudaGraphPool,
        _: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(CudaGraph, R), E> {
        match *self {}
    }

    pub fn step_plan(&self, _: usize, _: usize) -> Result<StepPlan> {
        match *self {}
    }

    pub fn mark(&self) -> Result<CudaMark> {
        match *self {}
    }
}

/// A point in a device's queue (uninhabited in this build).
pub enum CudaMark {}

impl CudaMark {
    pub fn seconds_until(&self, _: &CudaMark) -> Result<f64> {
        match *self {}
    }
}

/// A captured graph (uninhabited in this build).
pub enum CudaGraph {}

impl CudaGraph {
    pub fn replay(&self) -> Result<()> {
        match *self {}
    }
}

/// A graph pool (uninhabited in this build).
pub enum CudaGraphPool {}

/// Staged sampler rows (uninhabited in this build).
pub enum StagedSample {}

/// The sampler's results on the device (uninhabited in this build).
pub enum SampleOut {}

/// A step plan (uninhabited in this build).
pub enum StepPlan {}

impl StepPlan {
    pub fn clear(&mut self) {
        match *self {}
    }
    pub fn push(&mut self, _: impl IntoIterator<Item = u32>) -> Range<usize> {
        match *self {}
    }
    pub fn len(&self) -> usize {
        match *self {}
    }
    pub fn is_empty(&self) -> bool {
        match *self {}
    }
    pub fn fits(&self) -> bool {
        match *self {}
    }
    pub fn upload(&self) -> Result<()> {
        match *self {}
    }
    pub fn indices(&self, _: Range<usize>) -> Result<Indices> {
        match *self {}
    }
    pub fn decode_attn(&self, _: AttnBatch, _: Range<usize>, _: Range<usize>) -> Result<AttnBatch> {
        match *self {}
    }
    pub fn words_mut(&mut self, _: Range<usize>) -> &mut [u32] {
        match *self {}
    }
    pub fn stage_sample(
        &mut self,
        _: usize,
        _: usize,
        _: &[crate::sample::SampleRow],
        _: usize,
    ) -> Result<StagedSample> {
        match *self {}
    }
    pub fn sample_launch(&self, _: &crate::Tensor, _: &StagedSample) -> Result<SampleOut> {
        match *self {}
    }
    pub fn sample_read(
        &self,
        _: &SampleOut,
        _: &StagedSample,
        _: &[crate::sample::SampleRow],
    ) -> Result<Vec<crate::sample::Sampled>> {
        match *self {}
    }
}

impl BackendDevice for CudaDevice {
    type Storage = CudaStorage;
    fn zeros(&self, _: usize) -> Result<CudaStorage> {
        match *self {}
    }
    fn upload(&self, _: &[f32]) -> Result<CudaStorage> {
        match *self {}
    }
}

impl BackendStorage for CudaStorage {
    type Device = CudaDevice;
    fn device(&self) -> CudaDevice {
        match *self {}
    }
    fn to_host(&self) -> Result<Vec<f32>> {
        match *self {}
    }
    fn pack_weight(&self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn unpack_weight(&self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn linear_grad_input(&self, _: &Self, _: usize, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn linear(&self, _: usize, _: usize, _: &Self, _: usize, _: Option<&Self>) -> Result<Self> {
        match *self {}
    }
    fn linear_grad_weight(&self, _: &Self, _: usize, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn rms_norm(&self, _: &Self, _: usize, _: usize, _: f32) -> Result<Self> {
        match *self {}
    }
    fn rms_norm_backward(&self, _: &Self, _: &Self, _: usize, _: usize, _: f32) -> Result<(Self, Self)> {
        match *self {}
    }
    fn rope_inplace(&mut self, _: &Indices, _: &Self, _: &Self, _: usize, _: usize) -> Result<()> {
        match *self {}
    }
    fn silu_mul(&self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn silu_mul_backward(&self, _: &Self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn add_inplace(&mut self, _: &Self) -> Result<()> {
        match *self {}
    }
    fn scale_add_inplace(&mut self, _: f32, _: &Self) -> Result<()> {
        match *self {}
    }
    fn scale_add_into(&self, _: f32, _: &mut Self) -> Result<()> {
        match *self {}
    }
    fn commit_from(&mut self, _: &mut Self, _: bool) -> Result<()> {
        match *self {}
    }
    fn gather_packed_rows(&self, _: &Indices, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn scale(&self, _: f32) -> Result<Self> {
        match *self {}
    }
    fn sum_squares(parts: &[&Self]) -> Result<f64> {
        match parts.first() {
            None => Ok(0.0),
            Some(p) => match **p {},
        }
    }
    fn sum_rows(&self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn softmax(&self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn log_softmax(&self, _: usize, _: usize) -> Result<Self> {
        match *self {}
    }
    fn gather_rows(&self, _: &Indices, _: usize) -> Result<Self> {
        match *self {}
    }
    fn scatter_rows(&mut self, _: &Indices, _: &Self, _: usize) -> Result<()> {
        match *self {}
    }
    fn scatter_add_rows(&mut self, _: &Indices, _: &Self, _: usize) -> Result<()> {
        match *self {}
    }
    fn split_cols(&self, _: usize, _: &[usize]) -> Result<Vec<Self>> {
        match *self {}
    }
    fn cat_cols(parts: &[(&Self, usize)], _: usize) -> Result<Self> {
        match parts.first() {
            Some(p) => match *p.0 {},
            None => Err(KernelError::CudaUnavailable),
        }
    }
    fn cat(parts: &[&Self]) -> Result<Self> {
        match parts.first() {
            Some(p) => match **p {},
            None => Err(KernelError::CudaUnavailable),
        }
    }
    fn slice(&self, _: Range<usize>) -> Result<Self> {
        match *self {}
    }
    fn paged_attention(
        &self,
        _: &Self,
        _: &Self,
        _: &AttnBatch,
        _: usize,
        _: usize,
        _: usize,
        _: KvLayout,
    ) -> Result<Self> {
        match *self {}
    }
    fn attention_backward(
        &self,
        _: &Self,
        _: &Self,
        _: &Self,
        _: &[Range<usize>],
        _: usize,
        _: usize,
        _: usize,
    ) -> Result<(Self, Self, Self)> {
        match *self {}
    }
    fn token_logprobs(&self, _: usize, _: &[u32], _: f32) -> Result<(Vec<f32>, Vec<f32>)> {
        match *self {}
    }
    fn sample(&self, _: usize, _: &[crate::sample::SampleRow]) -> Result<Vec<crate::sample::Sampled>> {
        match *self {}
    }
    fn token_logprobs_backward(
        &self,
        _: usize,
        _: &[u32],
        _: f32,
        _: &[f32],
        _: Option<&[f32]>,
        _: &[f32],
    ) -> Result<Self> {
        match *self {}
    }
    fn adamw_delta(&self, _: &mut Self, _: &mut Self, _: &AdamWStep) -> Result<Self> {
        match *self {}
    }
    fn adamw_delta_packed(_: &mut [(&Self, &mut Self, &mut Self)], _: usize, _: &AdamWStep) -> Result<Self> {
        Err(KernelError::CudaUnavailable)
    }
}

#[cfg(test)]
mod tests {
    /// A CPU-only build names the missing feature (run by `.ci/run`: `cargo test -p kernels`
    /// without features; the workspace's `cargo test` builds the CUDA backend).
    #[test]
    fn cuda_is_reported_unavailable_without_the_feature() {
        let e = crate::Device::cuda(0).unwrap_err();
        assert_eq!(e.to_string(), "CUDA requested but rlserve was built without the `cuda` feature");
        let e = crate::Device::cuda_emu(crate::CudaOptions::default()).unwrap_err();
        assert!(e.to_string().contains("cuda-emu"), "{e}");
    }
}
