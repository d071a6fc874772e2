//! The rlserve server: OpenAI-compatible HTTP API over the engine, Prometheus metrics,
//! and the `serve` command. The `rlserve` binary (`main.rs`) adds the other commands.

pub mod api;
pub mod metrics;
pub mod rl;
pub mod serve;
