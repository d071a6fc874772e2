//! The learner's algorithms beyond the GRPO-family policy losses of `loss.rs`:
//! RLHF-PPO with a value head and GAE ([`ppo`], [`gae`], [`value_head`]) and DPO / IPO from
//! preference pairs ([`dpo`]).

pub mod dpo;
pub mod gae;
pub mod ppo;
pub mod value_head;
