//! The rlserve server: OpenAI-compatible HTTP API over the engine and the `rl` crate
//! (rollouts, training jobs, feedback), Prometheus metrics, and the `serve` command. The
//! `rlserve` binary (`main.rs`) adds the other commands.

pub mod api;
pub mod device;
pub mod metrics;
pub mod serve;
pub mod tinker;
pub mod ui;
