//! The training objectives: each turns the forward's outputs (ℓ per token, entropies, final
//! hidden rows) into a loss and its derivatives ([`crate::OutputGrads`]).
//!
//! - [`grpo`]: the clipped policy-gradient family (GRPO, GSPO, DAPO, BNPO, Dr. GRPO) with KL
//!   estimators and off-policy corrections; [`advantages`]: group-relative advantages;
//! - RLHF-PPO with a value head and GAE ([`ppo`], [`gae`], [`value_head`]);
//! - DPO / IPO from preference pairs ([`dpo`]);
//! - the Tinker training API's built-in losses, summed over tokens ([`tinker`]).

pub mod advantages;
pub mod dpo;
pub mod gae;
pub mod grpo;
pub mod ppo;
pub mod tinker;
pub mod value_head;
