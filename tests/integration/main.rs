//! The one integration-test binary of rlserve; one module per area.

mod algos;
mod conformance;
mod engine;
mod gguf;
mod kernels;
mod learner;
mod model;
mod reference;
mod rl;
mod rl_algos;
mod sampling;
mod server;
