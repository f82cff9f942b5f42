//! `critic.*`: the value model and its update. verl: `verl/trainer/config/critic/critic.yaml`,
//! `CriticConfig`. Keys that verl fills from the actor with `${oc.select:...}` are `Option`s here,
//! resolved in `resolve.rs`.

use serde::{Deserialize, Serialize};

use super::actor::{CheckpointContents, LossAggMode};
use super::model::ModelConfig;
use super::optim::OptimConfig;
use crate::defaults;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CriticConfig {
    /// null = on for adv_estimator=gae, off otherwise.
    pub enable: Option<bool>,
    /// Optimizer of the value model.
    pub optim: OptimConfig,
    /// Backbone of the value model (a new value head is added).
    pub model: ModelConfig,
    /// Prompts per critic mini-batch; null = actor.ppo_mini_batch_size.
    pub ppo_mini_batch_size: Option<usize>,
    /// Deprecated global micro-batch size; use ppo_micro_batch_size_per_gpu.
    pub ppo_micro_batch_size: Option<usize>,
    /// Sequences per forward/backward pass of the critic.
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Token-budget micro-batches; null = actor.use_dynamic_bsz.
    pub use_dynamic_bsz: Option<bool>,
    /// Token budget per micro-batch when use_dynamic_bsz.
    pub ppo_max_token_len_per_gpu: usize,
    /// Token budget of the value (forward-only) pass; null = ppo_max_token_len_per_gpu.
    pub forward_max_token_len_per_gpu: Option<usize>,
    /// Sequences per forward pass when computing values; null = ppo_micro_batch_size_per_gpu.
    pub forward_micro_batch_size_per_gpu: Option<usize>,
    /// Passes over each step's data; null = actor.ppo_epochs.
    pub ppo_epochs: Option<usize>,
    /// Shuffle before mini-batching; null = actor.shuffle.
    pub shuffle: Option<bool>,
    /// Seed of that shuffle.
    pub data_loader_seed: u64,
    /// Value clip range around the old values.
    pub cliprange_value: f64,
    /// Loss aggregation; null = actor.loss_agg_mode.
    pub loss_agg_mode: Option<LossAggMode>,
    /// Divisor of seq-mean-token-sum-norm; null = actor.loss_scale_factor.
    pub loss_scale_factor: Option<f64>,
    /// Checkpoint contents.
    pub checkpoint: CheckpointContents,
    /// Gradient-norm clip (reported as critic/grad_norm).
    pub grad_clip: f64,
    /// A new value head's weights (main_ppo's key; a head saved with the critic is read as it is): normal = N(0, 0.02²) as transformers initialises `score` (verl's critic); zero = every value starts at 0, so the first advantages are the whitened returns.
    pub value_head_init: ValueHeadInit,
}

/// `critic.value_head_init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ValueHeadInit {
    Normal,
    Zero,
}

defaults!(CriticConfig {
    enable: None,
    optim: OptimConfig::with_lr(1e-5),
    model: ModelConfig::default(),
    ppo_mini_batch_size: None,
    ppo_micro_batch_size: None,
    ppo_micro_batch_size_per_gpu: None,
    use_dynamic_bsz: None,
    ppo_max_token_len_per_gpu: 32768,
    forward_max_token_len_per_gpu: None,
    forward_micro_batch_size_per_gpu: None,
    ppo_epochs: None,
    shuffle: None,
    data_loader_seed: 42,
    cliprange_value: 0.5,
    loss_agg_mode: None,
    loss_scale_factor: None,
    checkpoint: CheckpointContents::default(),
    grad_clip: 1.0,
    value_head_init: ValueHeadInit::Normal,
});
