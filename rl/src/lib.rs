//! Online RL in the serving process: training jobs (config, datasets, rewards, rollouts,
//! the job runner, reports), and learning from user feedback. The engine and the learner
//! share one set of weights ([`engine::SharedModel`]); one learner loop
//! ([`learner_loop::LearnerLoop`]) serves jobs and feedback. No HTTP here: the server maps
//! [`RlError`] to HTTP statuses and installs the exporter of the metrics recorded here.

#![warn(missing_docs)]

pub mod config;
pub mod context;
pub mod dataset;
pub mod error;
pub mod feedback;
pub mod job;
mod job_run;
pub mod learner_loop;
pub mod metrics;
pub mod plot;
mod ratings;
pub mod report;
pub mod rewards;
pub mod rollout;

pub use config::{job_learner_defaults, GenerateAhead, JobConfig};
pub use context::{LearnerSlot, RlContext};
pub use error::{Result, RlError};
pub use feedback::{FeedbackConfig, FeedbackRecorder, FeedbackRequest, FeedbackStore, FEEDBACK_JOB_ID};
pub use job::{Job, JobState, JobStatus, Jobs};
pub use learner_loop::load_weights;
pub use metrics::RlMetrics;
