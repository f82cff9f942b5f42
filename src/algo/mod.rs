//! The PPO mathematics, ported from verl's `verl/trainer/ppo/core_algos.py` and
//! `verl/utils/torch_functional.py`: pure functions on candle tensors (CPU or CUDA), no I/O.
//!
//! - [`masked`]: masked sum / mean / variance / whitening over `[batch, response_len]`,
//! - [`advantage`]: the advantage estimators (`algorithm.adv_estimator`),
//! - [`policy`]: policy losses (`actor.policy_loss.loss_mode`) and [`agg::agg_loss`],
//! - [`value`]: the clipped value loss and entropy,
//! - [`kl`]: KL estimators, KL in the reward, KL controllers, KL loss,
//! - [`filter`]: DAPO's group filter (which groups carry a signal),
//! - [`distill`]: on-policy distillation's loss against a teacher's log-probs,
//! - [`pf_ppo`]: PF-PPO's score weights and resampling of the step's responses.
//!
//! Tensors are `[batch, response_len]` unless noted; masks are 0/1 in the values' dtype.
//! Estimators need no gradient and run as one pass over host memory; losses are tensor
//! expressions that candle's autograd differentiates.

pub mod advantage;
pub mod agg;
pub mod distill;
pub mod filter;
pub mod kl;
pub mod masked;
pub mod pf_ppo;
pub mod policy;
pub mod rollout_corr;
pub mod value;

pub use advantage::{advantages, compute_advantage, AdvantageInputs, HostInputs, Mat};
pub use agg::agg_loss;
pub use agg::AggNorm;
pub use kl::{apply_kl_penalty, kl_loss, kl_penalty, KlController};
pub use masked::{masked_mean, masked_sum, masked_var, masked_whiten};
pub use policy::{policy_loss, policy_loss_weighted, PolicyLossOutput, PolicyLossParams};
pub use value::{entropy_from_logits, value_loss};

/// An error in the inputs of an algorithm (shapes, empty masks, missing inputs).
pub type Result<T> = candle_core::Result<T>;

pub(crate) fn bail<T>(msg: impl Into<String>) -> Result<T> {
    Err(candle_core::Error::Msg(msg.into()))
}

#[cfg(test)]
mod golden;
#[cfg(test)]
mod grads;
#[cfg(test)]
mod props;
#[cfg(test)]
mod verl_1dda039;
