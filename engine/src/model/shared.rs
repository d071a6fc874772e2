//! The weights shared by the serving engine and the learner (ARCHITECTURE.md, invariant 10):
//! one [`Model`] behind an `RwLock`. An engine step and the learner's forward/backward hold
//! read guards; the optimizer prepares the new weights under a read guard and swaps them in
//! under the write guard, so the write lands between engine steps, and bumps
//! [`Model::version`] before releasing it.

use super::Model;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A cloneable handle to the one set of served (and trained) weights; the second field is
/// the writers' lock ([`Self::lock_updates`]).
#[derive(Clone)]
pub struct SharedModel(Arc<RwLock<Model>>, Arc<Mutex<()>>);

impl SharedModel {
    pub fn new(model: Model) -> Self {
        Self(Arc::new(RwLock::new(model)), Arc::default())
    }

    /// Serializes the writers of the weights: held from the read a write is prepared from
    /// (the optimizer computes the new weights under a read guard) until its write guard is
    /// released, so that no other write lands in between and is overwritten.
    pub fn lock_updates(&self) -> MutexGuard<'_, ()> {
        self.1.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A read guard (engine step, learner forward/backward, checkpoint export). A panic in
    /// another holder does not poison the weights for the others.
    pub fn read(&self) -> RwLockReadGuard<'_, Model> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The write guard (the optimizer's in-place update).
    pub fn write(&self) -> RwLockWriteGuard<'_, Model> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The policy version of the weights now.
    pub fn version(&self) -> u64 {
        self.read().version
    }
}
