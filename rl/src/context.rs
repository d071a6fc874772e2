//! What online RL runs against: the serving engine, the weights it serves, and the right to
//! update them (one learner at a time).

use super::metrics::RlMetrics;
use engine::{EngineHandle, SharedModel, Tokenizer};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The served model as a job or the feedback learner sees it.
#[derive(Clone)]
pub struct RlContext {
    /// Rollouts and evaluations are requests to this engine (served alongside users').
    pub engine: EngineHandle,
    /// The served weights, which the learner updates in place.
    pub model: SharedModel,
    /// The served model's tokenizer (datasets are tokenized with it).
    pub tokenizer: Arc<Tokenizer>,
    /// The served model's folder (config and tokenizer files are copied into checkpoints).
    pub model_dir: PathBuf,
    /// Runs `http` rewards and waits for rollouts from the job's plain threads.
    pub runtime: tokio::runtime::Handle,
    /// Where learner steps, evaluations and feedback counters are recorded.
    pub metrics: RlMetrics,
    /// One learner at a time writes the weights (a job, or the feedback learner).
    pub learner: LearnerSlot,
    /// The engine's context limit (prompt + completion).
    pub max_model_len: usize,
    /// The server-wide record of served versions, when the server keeps state across
    /// restarts (`<feedback-dir>/policy_version` with `--learn-from-feedback`, restored at
    /// start): every learner (a job, the feedback learner, Tinker's `optim_step`) records
    /// each update's version here before applying it ([`Self::record_version`]), so a
    /// restart labels the served weights above every version any of them served
    /// (ARCHITECTURE.md, invariant on versions).
    pub version_record: Option<PathBuf>,
}

impl RlContext {
    /// Records in [`Self::version_record`] (fsynced), when there is one, that the served
    /// weights are about to become `version`; call it holding the learner slot, before the
    /// update. The record only rises (a lower `version` leaves it as it is).
    pub fn record_version(&self, version: u64) -> super::Result<()> {
        let Some(path) = &self.version_record else { return Ok(()) };
        let recorded = std::fs::read_to_string(path).ok().and_then(|t| t.trim().parse::<u64>().ok());
        match recorded {
            Some(r) if r >= version => Ok(()),
            _ => super::learner_loop::write_version(path, version),
        }
    }
}

/// The right to train the served weights: one holder at a time (a job, or one feedback
/// learner step). Cloning shares the slot; [`LearnerSlot::try_acquire`] takes it.
#[derive(Clone, Default)]
pub struct LearnerSlot(Arc<AtomicBool>);

/// Holding the slot; released on drop.
pub struct LearnerGuard(Arc<AtomicBool>);

impl LearnerSlot {
    /// Takes the slot, or `None` while another learner holds it.
    pub fn try_acquire(&self) -> Option<LearnerGuard> {
        self.0
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .ok()
            .map(|_| LearnerGuard(self.0.clone()))
    }

    /// Takes the slot, polling every `poll` until the holder releases it.
    pub fn acquire(&self, poll: std::time::Duration) -> LearnerGuard {
        loop {
            match self.try_acquire() {
                Some(g) => return g,
                None => std::thread::sleep(poll),
            }
        }
    }
}

impl Drop for LearnerGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}
