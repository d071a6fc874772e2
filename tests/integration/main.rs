//! The one integration-test binary of rlserve; one module per area.

mod algos;
mod api;
mod chat_tokens;
mod checkpoints;
mod conformance;
mod crash;
mod cross_site;
mod cuda_e2e;
mod cuda_emu;
mod engine;
mod fuzz;
mod gguf;
mod kernels;
mod learner;
mod load;
mod model;
mod plot;
mod prompt_logprobs;
mod reference;
mod rl;
mod rl_algos;
mod sampling;
mod server;
mod tinker;
mod ui;
