//! `actor_rollout_ref.ref.*`: the frozen reference policy's log-prob pass.
//! verl: `verl/trainer/config/ref/ref.yaml`.

use serde::{Deserialize, Serialize};

use super::model::FsdpConfig;
use crate::defaults;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RefConfig {
    /// Deprecated global micro-batch size; use log_prob_micro_batch_size_per_gpu.
    pub log_prob_micro_batch_size: Option<usize>,
    /// Sequences per forward pass of the reference model.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Token-budget micro-batches; null = actor.use_dynamic_bsz.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// Token budget; null = actor.ppo_max_token_len_per_gpu.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    /// Mixed precision of the reference's forward passes.
    pub fsdp_config: FsdpConfig,
}

defaults!(RefConfig {
    log_prob_micro_batch_size: None,
    log_prob_micro_batch_size_per_gpu: None,
    log_prob_use_dynamic_bsz: None,
    log_prob_max_token_len_per_gpu: None,
    fsdp_config: FsdpConfig::default(),
});
