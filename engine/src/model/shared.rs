//! The weights shared by the serving engine and the learner (DESIGN-NOTES §1): one
//! [`Model`] behind an `RwLock`. An engine step and the learner's forward/backward hold
//! read guards; the optimizer's in-place write holds the write guard, so it lands between
//! engine steps, and bumps [`Model::version`] before releasing it.

use super::Model;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// A cloneable handle to the one set of served (and trained) weights.
#[derive(Clone)]
pub struct SharedModel(Arc<RwLock<Model>>);

impl SharedModel {
    pub fn new(model: Model) -> Self {
        Self(Arc::new(RwLock::new(model)))
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
