//! Gradients by typed parameter id ([`ParamKey`]), accumulated across sequences, on the
//! model's device.

use crate::algos::value_head::{self, HeadParam};
use crate::Result;
use engine::model::ParamId;
use kernels::{ops, Tensor};
use std::collections::BTreeMap;

/// The typed id of a trained tensor: what gradients ([`Grads`]) and AdamW moments
/// ([`crate::optim::AdamW`]) are keyed by. Its [`std::fmt::Display`] is the tensor's name in
/// files (the HF name, or the value head's) and [`ParamKey::parse`] the inverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParamKey {
    /// A weight of the served model: its row of the parameter table
    /// (`engine::model::params`).
    Model(ParamId),
    /// A tensor of PPO's value head ([`crate::algos::value_head`]).
    ValueHead(HeadParam),
}

impl ParamKey {
    /// The key of a tensor name written by [`std::fmt::Display`]; `None` for any other name.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            value_head::WEIGHT => Some(Self::ValueHead(HeadParam::Weight)),
            value_head::BIAS => Some(Self::ValueHead(HeadParam::Bias)),
            _ => ParamId::parse(name).map(Self::Model),
        }
    }
}

impl From<ParamId> for ParamKey {
    fn from(id: ParamId) -> Self {
        Self::Model(id)
    }
}

impl From<HeadParam> for ParamKey {
    fn from(p: HeadParam) -> Self {
        Self::ValueHead(p)
    }
}

impl std::fmt::Display for ParamKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Model(id) => id.fmt(f),
            Self::ValueHead(p) => f.write_str(p.name()),
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct Grads {
    /// Gradient of each parameter, shaped like its HF weight.
    pub tensors: BTreeMap<ParamKey, Tensor>,
    /// Wall-clock seconds the backward passes that produced them took.
    pub backward_seconds: f64,
}

impl Grads {
    /// Adds `g` to the gradient of `key` (taken as is the first time).
    pub fn add(&mut self, key: impl Into<ParamKey>, g: Tensor) -> Result<()> {
        match self.tensors.entry(key.into()) {
            std::collections::btree_map::Entry::Occupied(mut acc) => ops::add_inplace(acc.get_mut(), &g)?,
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(g);
            }
        }
        Ok(())
    }

    /// Adds row `i` of `src` to row `rows[i]` of the gradient of `key` (zeros of `shape`
    /// the first time): an embedding's gradient without a dense `[vocab, hidden]` temporary.
    pub fn scatter_add_rows(
        &mut self,
        key: impl Into<ParamKey>,
        shape: &[usize],
        rows: &kernels::Indices,
        src: &Tensor,
    ) -> Result<()> {
        let acc = match self.tensors.entry(key.into()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(Tensor::zeros(shape, &src.device())?),
        };
        ops::scatter_add_rows(acc, rows, src)?;
        Ok(())
    }

    /// `sqrt(Σ g²)` over every tensor (before clipping), accumulated in f64.
    pub fn global_norm(&self) -> Result<f64> {
        Ok(ops::sum_squares_all(&self.tensors.values().collect::<Vec<_>>())?.sqrt())
    }
}
