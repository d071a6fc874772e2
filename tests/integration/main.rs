//! The one integration-test binary of rlserve; one module per area.

mod conformance;
mod durability;
mod engine;
mod fuzz;
mod gguf;
mod kernels;
mod learner;
mod load;
mod model;
mod reference;
mod rl;
mod sampling;
mod server;
