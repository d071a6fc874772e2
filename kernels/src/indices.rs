//! Index arrays that device ops read (token ids, positions, KV slots, row lists): on the host,
//! and resident on a device after the first device op that reads them.
//!
//! A forward step reads the same indices in every layer (RoPE positions twice, the KV slots,
//! the attention metadata). Built once per step as [`Indices`] (and [`crate::ops::AttnBatch`]),
//! they are uploaded by the first device op that needs them and every later op of the step
//! reads the resident copy: a decode step's host→device copies no longer grow with the
//! number of layers (docs/ARCHITECTURE.md, "The step's indices"). The CPU backend reads the
//! host values. Ops take `impl Into<Idx>`, so a plain slice still works (uploaded per call).

use std::fmt;
#[cfg(feature = "cuda")]
use std::sync::OnceLock;

/// An index array of `u32` with its largest value (for the ops' range checks without a scan)
/// and, once a device op has read it, its copy on that device. Immutable: a new step builds
/// new indices. A clone shares nothing (it uploads again if a device reads it).
#[derive(Default)]
pub struct Indices {
    host: Vec<u32>,
    max: Option<u32>,
    /// The device copy: made by the first op on a CUDA device that reads these indices.
    #[cfg(feature = "cuda")]
    pub(crate) resident: OnceLock<crate::cuda::ResidentIndices>,
}

impl Indices {
    pub fn new(host: Vec<u32>) -> Self {
        let max = host.iter().copied().max();
        Self {
            host,
            max,
            #[cfg(feature = "cuda")]
            resident: OnceLock::new(),
        }
    }

    /// The values on the host.
    pub fn host(&self) -> &[u32] {
        &self.host
    }

    /// The largest value; `None` when empty.
    pub fn max(&self) -> Option<u32> {
        self.max
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }
}

impl Clone for Indices {
    fn clone(&self) -> Self {
        Self::new(self.host.clone())
    }
}

impl fmt::Debug for Indices {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.host.fmt(f)
    }
}

impl PartialEq for Indices {
    fn eq(&self, other: &Self) -> bool {
        self.host == other.host
    }
}

impl From<Vec<u32>> for Indices {
    fn from(v: Vec<u32>) -> Self {
        Self::new(v)
    }
}

impl FromIterator<u32> for Indices {
    fn from_iter<I: IntoIterator<Item = u32>>(it: I) -> Self {
        Self::new(it.into_iter().collect())
    }
}

/// An op's index argument: built [`Indices`] (resident after first use) or a host slice
/// (copied into fresh indices for this call).
pub enum Idx<'a> {
    Built(&'a Indices),
    Fresh(Indices),
}

impl std::ops::Deref for Idx<'_> {
    type Target = Indices;
    fn deref(&self) -> &Indices {
        match self {
            Idx::Built(i) => i,
            Idx::Fresh(i) => i,
        }
    }
}

impl<'a> From<&'a Indices> for Idx<'a> {
    fn from(i: &'a Indices) -> Self {
        Idx::Built(i)
    }
}

impl From<&[u32]> for Idx<'_> {
    fn from(v: &[u32]) -> Self {
        Idx::Fresh(Indices::new(v.to_vec()))
    }
}

impl From<&Vec<u32>> for Idx<'_> {
    fn from(v: &Vec<u32>) -> Self {
        Idx::Fresh(Indices::new(v.clone()))
    }
}

impl<const N: usize> From<&[u32; N]> for Idx<'_> {
    fn from(v: &[u32; N]) -> Self {
        Idx::Fresh(Indices::new(v.to_vec()))
    }
}

impl From<Vec<u32>> for Idx<'_> {
    fn from(v: Vec<u32>) -> Self {
        Idx::Fresh(Indices::new(v))
    }
}
