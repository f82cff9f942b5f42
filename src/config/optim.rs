//! `actor_rollout_ref.actor.optim.*` and `critic.optim.*`: AdamW and its learning-rate schedule.
//! verl: `verl/trainer/config/optim/fsdp.yaml`, `verl/utils/torch_functional.py` (schedules).

use serde::{Deserialize, Serialize};

use super::fields::{negative_unset, nonpositive_none};
use crate::defaults;

/// Learning-rate schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedulerType {
    /// Linear warm-up, then constant.
    Constant,
    /// Linear warm-up, then cosine decay to `min_lr_ratio * lr` over `num_cycles`.
    Cosine,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimConfig {
    /// Optimizer; only AdamW exists here (verl's default).
    pub optimizer: String,
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up steps as a fraction of the total steps (used when lr_warmup_steps is -1).
    pub lr_warmup_steps_ratio: f64,
    /// Total optimizer-schedule steps; -1 = the trainer's total training steps.
    #[serde(with = "nonpositive_none")]
    pub total_training_steps: Option<u64>,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Warm-up steps; 0 = no warm-up; -1 (any negative) = use lr_warmup_steps_ratio.
    #[serde(with = "negative_unset")]
    pub lr_warmup_steps: Option<u64>,
    /// Adam betas [beta1, beta2].
    pub betas: [f64; 2],
    /// Gradient-norm clip (verl's engine spelling; `grad_clip` on the actor/critic is the other).
    pub clip_grad: f64,
    /// Final learning rate of the cosine schedule, as a fraction of lr.
    pub min_lr_ratio: f64,
    /// Cosine cycles over the decay (0.5 = half a cosine, down to min_lr_ratio).
    pub num_cycles: f64,
    /// constant | cosine.
    pub lr_scheduler_type: LrSchedulerType,
    /// Deprecated verl alias of lr_scheduler_type; when set it wins.
    pub warmup_style: Option<LrSchedulerType>,
    /// Adam epsilon (not a verl key; torch's AdamW default).
    pub eps: f64,
}

impl OptimConfig {
    /// verl's defaults with a given peak learning rate (the actor's is 1e-6, the critic's 1e-5).
    pub fn with_lr(lr: f64) -> Self {
        Self {
            lr,
            ..Self::default()
        }
    }

    /// The schedule in effect, honouring the deprecated `warmup_style`.
    pub fn scheduler(&self) -> LrSchedulerType {
        self.warmup_style.unwrap_or(self.lr_scheduler_type)
    }
}

defaults!(OptimConfig {
    optimizer: "AdamW".into(),
    lr: 1e-6,
    lr_warmup_steps_ratio: 0.0,
    total_training_steps: None,
    weight_decay: 0.01,
    lr_warmup_steps: None,
    betas: [0.9, 0.999],
    clip_grad: 1.0,
    min_lr_ratio: 0.0,
    num_cycles: 0.5,
    lr_scheduler_type: LrSchedulerType::Constant,
    warmup_style: None,
    eps: 1e-8,
});
