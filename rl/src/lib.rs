//! Online RL in the serving process: rollouts, training jobs, rewards, feedback learning.
//! The engine and the learner share one set of weights ([`engine::SharedModel`]).

pub mod config;
pub mod dataset;
pub mod feedback;
pub mod job;
mod plot;
pub mod report;
pub mod rewards;
pub mod rollout;
