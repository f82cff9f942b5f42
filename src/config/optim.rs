//! `actor_rollout_ref.actor.optim.*` and `critic.optim.*`: the optimizer (Adam or AdamW, with
//! f32 moments as `torch.optim` keeps them or block-quantised ones as `torchao.optim`'s
//! low-bit classes do) and its learning-rate schedule.
//! verl: `verl/trainer/config/optim/fsdp.yaml`, `verl/workers/config/optimizer.py`
//! (`build_optimizer`), `verl/utils/torch_functional.py` (schedules).

use serde::{Deserialize, Serialize};

use super::fields::{negative_unset, nonpositive_none, null_default};
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
    /// The optimizer class: AdamW (verl's default) or Adam from torch.optim, or one of
    /// torchao.optim's low-bit Adam classes (see optimizer_impl).
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
    /// Adam epsilon (not a verl key; torch's AdamW default). verl users set it through
    /// `override_optimizer_config.eps`, which loading copies here.
    pub eps: f64,
    /// The module verl imports the optimizer class from: `torch.optim` (f32 moments) or
    /// `torchao.optim` (`AdamW8bit`, `Adam8bit`, `AdamW4bit`, `Adam4bit`, `AdamWFp8`, `AdamFp8`,
    /// `_AdamW`).
    pub optimizer_impl: String,
    /// The cosine schedule counts steps from 0 (verl's default) or, when false, from 1
    /// (torchtitan's convention): the rate of step t is the rate at t + 1.
    pub zero_indexed_step: bool,
    /// Keyword arguments verl passes to the optimizer class on top of lr, weight decay and betas.
    /// Loading copies `lr`, `eps`, `weight_decay`, `betas` onto the keys above (the override wins,
    /// as in verl) and `decoupled_weight_decay` onto `optimizer` (Adam or AdamW); implementation
    /// switches (`foreach`, `fused`, offload settings) have no effect; `amsgrad` and `maximize`
    /// are refused.
    #[serde(deserialize_with = "null_default::deserialize")]
    pub override_optimizer_config: OptimizerOverrides,
}

/// `optim.override_optimizer_config`: the arguments that change the update.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerOverrides {
    /// Peak learning rate (replaces optim.lr).
    pub lr: Option<f64>,
    /// Adam epsilon (replaces optim.eps).
    pub eps: Option<f64>,
    /// Weight decay (replaces optim.weight_decay).
    pub weight_decay: Option<f64>,
    /// Adam betas (replace optim.betas).
    pub betas: Option<[f64; 2]>,
    /// torch's `Adam(decoupled_weight_decay=True)` is AdamW; Megatron's `adam` takes it too.
    pub decoupled_weight_decay: Option<bool>,
    /// Elements per quantisation block of torchao's low-bit moments (256 for 8-bit and FP8,
    /// 128 for 4-bit).
    pub block_size: Option<usize>,
}

/// How the moments are kept between steps (named so in checkpoints' optim.json).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MomentFormat {
    /// f32, as `torch.optim` keeps them.
    #[default]
    F32,
    /// torchao's 8-bit dynamic-tree codes with one f32 scale per block.
    Int8,
    /// torchao's 4-bit codes (dynamic map for the first moment, linear for the second), two per
    /// byte, one f32 scale per block.
    Int4,
    /// FP8 E4M3 codes with one f32 scale per block.
    Fp8,
}

/// The update an `optim` section asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerChoice {
    /// AdamW's decoupled weight decay (`p ← p·(1 − lr·wd)`), or Adam's L2 term (`g ← g + wd·p`).
    pub decoupled: bool,
    pub moments: MomentFormat,
    /// Elements per quantisation block (unused for f32 moments).
    pub block_size: usize,
    /// torchao's form of the update (moments interpolated with `lerp`, all constants in f32)
    /// rather than torch.optim's: the same mathematics, other rounding.
    pub torchao_form: bool,
}

impl OptimConfig {
    /// verl's defaults with a given peak learning rate (the actor's is 1e-6, the critic's 1e-5).
    pub fn with_lr(lr: f64) -> Self {
        Self {
            lr,
            ..Self::default()
        }
    }

    /// The optimizer `optimizer_impl` and `optimizer` name, as verl's `build_optimizer` imports
    /// it; an error names what is not implemented.
    pub fn choice(&self) -> Result<OptimizerChoice, String> {
        let name = self.optimizer.as_str();
        let torch = |decoupled| OptimizerChoice {
            decoupled,
            moments: MomentFormat::F32,
            block_size: 0,
            torchao_form: false,
        };
        let choice = match self.optimizer_impl.as_str() {
            "torch.optim" => match name.to_ascii_lowercase().as_str() {
                "adamw" => torch(true),
                "adam" => torch(false),
                _ => return Err(format!(
                    "`optimizer` {name:?} from torch.optim is not implemented: AdamW and Adam are (torchao.optim's low-bit Adam classes too)"
                )),
            },
            "torchao.optim" | "torchao.prototype.low_bit_optim" => {
                let (decoupled, moments, block) = match name {
                    "AdamW8bit" => (true, MomentFormat::Int8, 256),
                    "Adam8bit" => (false, MomentFormat::Int8, 256),
                    "AdamW4bit" => (true, MomentFormat::Int4, 128),
                    "Adam4bit" => (false, MomentFormat::Int4, 128),
                    "AdamWFp8" => (true, MomentFormat::Fp8, 256),
                    "AdamFp8" => (false, MomentFormat::Fp8, 256),
                    "_AdamW" => (true, MomentFormat::F32, 0),
                    _ => return Err(format!(
                        "`optimizer` {name:?} is not one of torchao.optim's Adam classes: AdamW8bit, Adam8bit, AdamW4bit, Adam4bit, AdamWFp8, AdamFp8, _AdamW"
                    )),
                };
                let block_size = self.override_optimizer_config.block_size.unwrap_or(block);
                let int4 = moments == MomentFormat::Int4;
                if moments != MomentFormat::F32 && (block_size == 0 || (int4 && block_size % 2 == 1)) {
                    return Err(format!(
                        "`override_optimizer_config.block_size` ({block_size}) must be positive{}",
                        if int4 { " and even (4-bit codes are stored two per byte)" } else { "" }
                    ));
                }
                OptimizerChoice {
                    decoupled,
                    moments,
                    block_size,
                    torchao_form: true,
                }
            }
            "bitsandbytes.optim" => return Err(format!(
                "bitsandbytes' optimizers are not implemented (their 8-bit states are their own format); torchao.optim's AdamW8bit keeps 8-bit block-wise moments (`optimizer_impl=torchao.optim optimizer=AdamW8bit`), `{name}` aside"
            )),
            other => return Err(format!(
                "`optimizer_impl` {other:?} is not implemented: torch.optim (AdamW, Adam) and torchao.optim (AdamW8bit, Adam8bit, AdamW4bit, Adam4bit, AdamWFp8, AdamFp8, _AdamW) are"
            )),
        };
        if let Some(d) = self.override_optimizer_config.decoupled_weight_decay {
            if d != choice.decoupled {
                return Err(format!(
                    "`override_optimizer_config.decoupled_weight_decay` ({d}) disagrees with `optimizer` {name:?} ({}): torchao's classes take no such argument; choose the Adam or AdamW class",
                    if choice.decoupled { "decoupled" } else { "L2 weight decay" }
                ));
            }
        }
        if self.override_optimizer_config.block_size.is_some()
            && choice.moments == MomentFormat::F32
        {
            return Err(format!(
                "`override_optimizer_config.block_size` is an argument of torchao.optim's low-bit classes, not of {}.{name} (f32 moments)",
                self.optimizer_impl
            ));
        }
        Ok(choice)
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
    optimizer_impl: "torch.optim".into(),
    zero_indexed_step: true,
    override_optimizer_config: OptimizerOverrides::default(),
});
