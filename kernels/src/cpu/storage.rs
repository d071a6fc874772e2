//! The CPU backend's implementation of the contract ([`crate::backend`]).

use super::{attention, backward, elementwise, kv_blocked, logprob, matmul, optim, sampler, HostBuf};
use crate::backend::{BackendDevice, BackendStorage};
use crate::indices::Indices;
use crate::ops::{AdamWStep, AttnBatch, KvLayout};
use crate::sample::{SampleRow, Sampled};
use crate::Result;
use rayon::prelude::*;
use std::ops::Range;

/// Host memory; ops run on the rayon pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuDevice;

/// A host buffer of f32 (packed weights on huge pages, [`HostBuf::huge`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CpuStorage(pub HostBuf);

impl From<Vec<f32>> for CpuStorage {
    fn from(v: Vec<f32>) -> Self {
        Self(HostBuf::Vec(v))
    }
}

impl BackendDevice for CpuDevice {
    type Storage = CpuStorage;
    fn zeros(&self, n: usize) -> Result<CpuStorage> {
        Ok(vec![0.0; n].into())
    }
    fn upload(&self, data: &[f32]) -> Result<CpuStorage> {
        Ok(data.to_vec().into())
    }
}

/// Elements per rayon task of elementwise passes.
const CHUNK: usize = 1 << 16;

impl BackendStorage for CpuStorage {
    type Device = CpuDevice;
    fn device(&self) -> CpuDevice {
        CpuDevice
    }
    fn to_host(&self) -> Result<Vec<f32>> {
        Ok(self.0.to_vec())
    }

    fn pack_weight(&self, n: usize, k: usize) -> Result<Self> {
        Ok(Self(matmul::pack_weight(&self.0, n, k)))
    }
    fn unpack_weight(&self, n: usize, k: usize) -> Result<Self> {
        Ok(Self::from(matmul::unpack(&self.0, n, k)))
    }
    fn linear(&self, m: usize, k: usize, w: &Self, n: usize, bias: Option<&Self>) -> Result<Self> {
        let mut y = matmul::matmul_packed(&self.0, &w.0, m, n, k);
        if let Some(b) = bias {
            elementwise::add_bias(&mut y, &b.0);
        }
        Ok(Self::from(y))
    }
    fn linear_grad_weight(&self, x: &Self, m: usize, n: usize, k: usize) -> Result<Self> {
        Ok(Self::from(matmul::grad_weight(&self.0, &x.0, m, n, k)))
    }
    fn linear_grad_input(&self, w: &Self, m: usize, n: usize, k: usize) -> Result<Self> {
        Ok(Self::from(matmul::grad_input(&self.0, &w.0, m, n, k)))
    }

    fn rms_norm(&self, w: &Self, m: usize, d: usize, eps: f32) -> Result<Self> {
        let mut y = vec![0.0f32; m * d];
        elementwise::rms_norm(&self.0, &w.0, &mut y, d, eps);
        Ok(Self::from(y))
    }
    fn rms_norm_backward(&self, w: &Self, dy: &Self, m: usize, d: usize, eps: f32) -> Result<(Self, Self)> {
        let (mut dx, mut dw) = (vec![0.0f32; m * d], vec![0.0f32; d]);
        backward::rms_norm_backward(&self.0, &w.0, &dy.0, &mut dx, &mut dw, d, eps);
        Ok((Self::from(dx), Self::from(dw)))
    }
    fn rope_inplace(&mut self, positions: &Indices, cos: &Self, sin: &Self, c: usize, head_dim: usize) -> Result<()> {
        elementwise::rope(&mut self.0, positions.host(), &cos.0, &sin.0, c, head_dim);
        Ok(())
    }
    fn silu_mul(&self, _m: usize, i: usize) -> Result<Self> {
        Ok(Self::from(elementwise::silu_mul(&self.0, i)))
    }
    fn silu_mul_backward(&self, da: &Self, m: usize, i: usize) -> Result<Self> {
        let mut d = vec![0.0f32; m * 2 * i];
        backward::silu_mul_backward(&self.0, &da.0, &mut d, i);
        Ok(Self::from(d))
    }
    fn add_inplace(&mut self, b: &Self) -> Result<()> {
        elementwise::add_inplace(&mut self.0, &b.0);
        Ok(())
    }
    fn scale_add_inplace(&mut self, s: f32, d: &Self) -> Result<()> {
        self.0.par_chunks_mut(CHUNK).zip(d.0.par_chunks(CHUNK)).for_each(|(p, d)| elementwise::scale_add(p, s, d));
        Ok(())
    }
    fn scale_add_into(&self, s: f32, d: &mut Self) -> Result<()> {
        d.0.par_chunks_mut(CHUNK).zip(self.0.par_chunks(CHUNK)).for_each(|(d, w)| elementwise::scale_add_into(w, s, d));
        Ok(())
    }
    /// Swaps the buffers: the weight is then the step's buffer (a `Vec` from the allocator,
    /// where the loaded weight was [`HostBuf::huge`]; see `optim::adamw_delta_packed`).
    /// `keep_address` does not apply: no CPU kernel keeps a buffer's address between calls
    /// (a CUDA graph does), so a swap is always safe here.
    fn commit_from(&mut self, new: &mut Self, _keep_address: bool) -> Result<()> {
        std::mem::swap(&mut self.0, &mut new.0);
        Ok(())
    }
    fn scale(&self, s: f32) -> Result<Self> {
        Ok(Self::from(self.0.par_iter().map(|v| v * s).collect::<Vec<f32>>()))
    }
    fn sum_squares(parts: &[&Self]) -> Result<f64> {
        // Per-chunk partials collected in order, then summed in order, then the tensors in
        // order: the same bits whatever the thread count or work stealing.
        let one = |p: &Self| -> f64 {
            p.0.par_chunks(CHUNK).map(elementwise::sum_squares).collect::<Vec<f64>>().iter().sum()
        };
        Ok(parts.iter().fold(0.0, |s, p| s + one(p)))
    }
    fn sum_rows(&self, _m: usize, n: usize) -> Result<Self> {
        let mut s = vec![0.0f32; n];
        for row in self.0.chunks(n) {
            elementwise::add_inplace(&mut s, row);
        }
        Ok(Self::from(s))
    }
    fn softmax(&self, _m: usize, n: usize) -> Result<Self> {
        let mut y = self.0.to_vec();
        elementwise::softmax_rows(&mut y, n);
        Ok(Self::from(y))
    }
    fn log_softmax(&self, _m: usize, n: usize) -> Result<Self> {
        let mut y = self.0.to_vec();
        elementwise::log_softmax_rows(&mut y, n);
        Ok(Self::from(y))
    }

    fn gather_packed_rows(&self, ids: &Indices, n: usize, k: usize) -> Result<Self> {
        Ok(Self::from(matmul::packed_rows(&self.0, n, k, ids.host())))
    }
    fn gather_rows(&self, ids: &Indices, c: usize) -> Result<Self> {
        let mut y = Vec::with_capacity(ids.len() * c);
        for &i in ids.host() {
            y.extend_from_slice(&self.0[i as usize * c..(i as usize + 1) * c]);
        }
        Ok(Self::from(y))
    }
    fn scatter_rows(&mut self, rows: &Indices, src: &Self, c: usize) -> Result<()> {
        for (i, &r) in rows.host().iter().enumerate() {
            self.0[r as usize * c..(r as usize + 1) * c].copy_from_slice(&src.0[i * c..(i + 1) * c]);
        }
        Ok(())
    }
    fn scatter_add_rows(&mut self, rows: &Indices, src: &Self, c: usize) -> Result<()> {
        for (i, &r) in rows.host().iter().enumerate() {
            elementwise::add_inplace(&mut self.0[r as usize * c..(r as usize + 1) * c], &src.0[i * c..(i + 1) * c]);
        }
        Ok(())
    }
    fn split_cols(&self, m: usize, widths: &[usize]) -> Result<Vec<Self>> {
        let c: usize = widths.iter().sum();
        let mut start = 0;
        Ok(widths
            .iter()
            .map(|&w| {
                let mut data = Vec::with_capacity(m * w);
                for row in self.0.chunks(c) {
                    data.extend_from_slice(&row[start..start + w]);
                }
                start += w;
                Self::from(data)
            })
            .collect())
    }
    fn cat_cols(parts: &[(&Self, usize)], m: usize) -> Result<Self> {
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut data = Vec::with_capacity(m * total);
        for i in 0..m {
            for (t, c) in parts {
                data.extend_from_slice(&t.0[i * c..(i + 1) * c]);
            }
        }
        Ok(Self::from(data))
    }
    fn cat(parts: &[&Self]) -> Result<Self> {
        Ok(Self::from(parts.iter().flat_map(|p| p.0.iter().copied()).collect::<Vec<f32>>()))
    }
    fn slice(&self, range: Range<usize>) -> Result<Self> {
        Ok(Self::from(self.0[range].to_vec()))
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
        let mut out = vec![0.0f32; self.0.len()];
        let geom = attention::Geometry { block_size: batch.block_size(), n_heads, n_kv_heads, head_dim, layout };
        attention::paged_attention(&self.0, &k.0, &v.0, &mut out, &batch.seqs(), &geom);
        Ok(Self::from(out))
    }
    fn scatter_kv_blocked(
        &mut self,
        slots: &Indices,
        src: &Self,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        keys: bool,
    ) -> Result<()> {
        kv_blocked::scatter(
            &mut self.0,
            slots.host(),
            &src.0,
            &kv_blocked::Blocks { block_size, n_kv_heads, head_dim, keys },
        );
        Ok(())
    }
    fn gather_kv_blocked(
        &self,
        slots: &Indices,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
        keys: bool,
    ) -> Result<Self> {
        let b = kv_blocked::Blocks { block_size, n_kv_heads, head_dim, keys };
        Ok(Self::from(kv_blocked::gather(&self.0, slots.host(), &b)))
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
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; self.0.len()], vec![0.0f32; k.0.len()], vec![0.0f32; v.0.len()]);
        backward::attention_backward(
            &self.0, &k.0, &v.0, &da.0, &mut dq, &mut dk, &mut dv, spans, n_heads, n_kv_heads, head_dim,
        );
        Ok((Self::from(dq), Self::from(dk), Self::from(dv)))
    }

    fn token_logprobs(&self, v: usize, tokens: &[u32], temperature: f32) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok(logprob::token_logprobs(&self.0, v, tokens, temperature))
    }
    fn sample(&self, v: usize, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
        // Each row a pure function of its logits and task: in parallel.
        Ok(rows
            .par_iter()
            .map(|r| sampler::sample_row(&self.0[r.row * v..(r.row + 1) * v], &r.task, r.top_logprobs))
            .collect())
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
        Ok(Self::from(logprob::token_logprobs_backward(
            &self.0,
            v,
            tokens,
            temperature,
            dl_dlogp,
            dl_dentropy,
            entropies,
        )))
    }

    fn adamw_delta(&self, m: &mut Self, v: &mut Self, s: &AdamWStep) -> Result<Self> {
        let mut d = vec![0.0f32; self.0.len()];
        optim::adamw_delta(&self.0, &mut m.0, &mut v.0, &mut d, s);
        Ok(Self::from(d))
    }
    fn adamw_delta_packed(parts: &mut [(&Self, &mut Self, &mut Self)], k: usize, s: &AdamWStep) -> Result<Self> {
        let mut ps: Vec<optim::Part> =
            parts.iter_mut().map(|(g, m, v)| (&g.0[..], &mut m.0[..], &mut v.0[..])).collect();
        Ok(Self::from(optim::adamw_delta_packed(&mut ps, k, s)))
    }
}
