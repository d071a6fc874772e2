//! The training objectives: each turns the forward's outputs (ℓ per token, entropies, final
//! hidden rows) into a loss and its derivatives ([`crate::OutputGrads`]).
//!
//! - [`grpo`]: the clipped policy-gradient family (GRPO, GSPO, DAPO, BNPO, Dr. GRPO) with KL
//!   estimators and off-policy corrections;
//! - [`advantages`]: group-relative advantages from rewards.

pub mod advantages;
pub mod grpo;
