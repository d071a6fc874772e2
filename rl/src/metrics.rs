//! RL's Prometheus series, recorded through the `metrics` facade: the process-wide exporter
//! is installed by the server (`/metrics`); without one these calls record nothing. Names
//! as vLLM's (`rlserve:` prefix), labelled with `model_name`.

use super::report::{EvalRecord, StepRecord};
use learner::TrainSample;
use metrics::{counter, gauge, histogram, Label};

/// Records RL metrics labelled with one served model's name.
#[derive(Debug, Clone)]
pub struct RlMetrics {
    model: String,
}

/// The feedback store's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FeedbackCounts {
    /// Ratings accepted (in the durable log).
    pub accepted: u64,
    /// Ratings refused (4xx).
    pub rejected: u64,
    /// Samples the feedback learner has trained on.
    pub trained: u64,
    /// Samples waiting for the next learner step.
    pub ready: usize,
}

impl RlMetrics {
    /// Metrics labelled `model_name = model_name`.
    pub fn new(model_name: &str) -> Self {
        Self { model: model_name.to_string() }
    }

    fn label(&self) -> Label {
        Label::new("model_name", self.model.clone())
    }

    /// One training step (a job's or the feedback learner's): every numeric field of the
    /// record as a `rlserve:train_*` gauge, the engine pause, and the staleness of every
    /// trained token.
    pub fn learner_step(&self, r: &StepRecord, samples: &[TrainSample]) {
        let m = || vec![self.label()];
        if r.updated {
            histogram!("rlserve:engine_pause_seconds", m()).record(r.learner.pause_seconds);
            counter!("rlserve:train_steps_total", m()).increment(1);
            counter!("rlserve:train_tokens_total", m()).increment(r.learner.loss.tokens as u64);
        }
        if let Ok(serde_json::Value::Object(o)) = serde_json::to_value(r) {
            for (k, v) in o {
                let x = match v {
                    serde_json::Value::Number(n) => n.as_f64(),
                    serde_json::Value::Bool(b) => Some(b as u8 as f64),
                    _ => None,
                };
                if let Some(x) = x {
                    // DPO's TRL names (`rewards/chosen`) are not Prometheus names.
                    gauge!(format!("rlserve:train_{}", k.replace('/', "_")), m()).set(x);
                }
            }
        }
        gauge!("rlserve:entropy_collapse_alarm", m()).set(r.entropy_collapse as u8 as f64);
        for s in samples {
            if let (Some(v), true) = (s.versions.as_ref().and_then(|v| v.iter().min()), r.updated) {
                // Staleness against the version the batch started from.
                let start = r.learner.version.saturating_sub(r.learner.num_updates.max(1));
                let staleness = start.saturating_sub(*v) as f64;
                let h = histogram!("rlserve:trained_token_staleness", m());
                for _ in 0..s.completion_ids.len() {
                    h.record(staleness);
                }
            }
        }
    }

    /// The feedback store's counters (refreshed at scrape time).
    pub fn feedback(&self, c: FeedbackCounts) {
        let m = || vec![self.label()];
        counter!("rlserve:feedback_accepted_total", m()).absolute(c.accepted);
        counter!("rlserve:feedback_rejected_total", m()).absolute(c.rejected);
        counter!("rlserve:feedback_trained_samples_total", m()).absolute(c.trained);
        gauge!("rlserve:feedback_samples_ready", m()).set(c.ready as f64);
    }

    /// A greedy evaluation of a training job.
    pub fn eval(&self, r: &EvalRecord) {
        gauge!("rlserve:eval_reward", vec![self.label()]).set(r.eval_reward);
        if let Some(a) = r.eval_accuracy {
            gauge!("rlserve:eval_accuracy", vec![self.label()]).set(a);
        }
    }
}
