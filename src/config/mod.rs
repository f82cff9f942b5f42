//! The typed configuration, mirroring verl's `ppo_trainer.yaml`.
//!
//! Stages (see `load.rs` and `resolve.rs`):
//! 1. defaults (each section's `Default`) as a YAML tree,
//! 2. the user's YAML file merged on top, then the command-line overrides applied,
//! 3. legacy keys mapped, `${...}` interpolations resolved, verl keys without effect here set
//!    aside (reported once), then the tree deserialised into [`Config`] (unknown keys rejected,
//!    errors carry the dotted path),
//! 4. [`resolve::resolve`] applies verl's cross-key rules and derives the batch plan.

pub mod actor;
pub mod algorithm;
pub mod catalogue;
pub mod compat;
pub mod critic;
pub mod data;
pub mod distillation;
mod engines;
pub mod fields;
mod groups;
mod hydra;
mod interpolate;
pub mod load;
pub mod model;
pub mod optim;
pub mod overrides;
pub mod reference;
pub mod resolve;
pub mod reward;
pub mod rollout;
pub mod rollout_corr;
mod schema;
pub mod sft;
pub mod trainer;
pub mod tree;

use serde::{Deserialize, Serialize};

pub use actor::{ActorConfig, LossAggMode, PolicyLossMode};
pub use algorithm::{
    AdvEstimator, AlgorithmConfig, FilterGroupsConfig, KlCtrlType, KlKind, KlPenalty, PfPpoConfig,
    PfPpoReweight, RolloutCorrectionConfig, Threshold,
};
pub use critic::CriticConfig;
pub use data::{DataConfig, Truncation};
pub use distillation::{DistillLossMode, DistillPlan, DistillationConfig, TeacherPlan};
pub use load::{load, ConfigSource, Loaded};
pub use model::ModelConfig;
pub use optim::{LrSchedulerType, MomentFormat, OptimConfig, OptimizerChoice, OptimizerOverrides};
pub use reference::RefConfig;
pub use resolve::{
    resolve, sequence_budgets, BypassLoss, FilterPlan, MicroBatching, Plan, RolloutCorrPlan, Seeds,
    Temperatures, UpdatePlan,
};
pub use reward::{OnError, RewardConfig, RewardManagerName, RewardSource, RewardSourceType};
pub use rollout::{
    AgentConfig, AgentLoopName, CustomAsyncServerConfig, MultiTurnConfig, RolloutConfig,
    SamplingConfig, SanityCheckMode, ToolFormat, TruncateSide,
};
pub use sft::{load_sft, resolve_sft, LoadedSft, SftConfig, SftPlan, SftTruncation};
pub use trainer::{LegacyWorkerImpl, ResumeMode, TrainerConfig};

use crate::defaults;

/// `actor_rollout_ref.*`: the policy, its rollout and its reference share one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    /// The policy model (weights, tokenizer, chat template).
    pub model: ModelConfig,
    /// The policy update.
    pub actor: ActorConfig,
    /// Generation.
    pub rollout: RolloutConfig,
    /// The reference policy's log-prob pass.
    #[serde(rename = "ref")]
    pub reference: RefConfig,
    /// Seconds a data-parallel rank waits for the others in one collective before it exits
    /// with an error (a rank died or hung); verl's NCCL timeout.
    pub nccl_timeout: u64,
}

defaults!(ActorRolloutRefConfig {
    model: ModelConfig::default(),
    actor: ActorConfig::default(),
    rollout: RolloutConfig::default(),
    reference: RefConfig::default(),
    nccl_timeout: 600,
});

/// The whole configuration of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub data: DataConfig,
    pub actor_rollout_ref: ActorRolloutRefConfig,
    pub critic: CriticConfig,
    pub reward: RewardConfig,
    pub algorithm: AlgorithmConfig,
    pub distillation: DistillationConfig,
    pub trainer: TrainerConfig,
}

defaults!(Config {
    data: DataConfig::default(),
    actor_rollout_ref: ActorRolloutRefConfig::default(),
    critic: CriticConfig::default(),
    reward: RewardConfig::default(),
    algorithm: AlgorithmConfig::default(),
    distillation: DistillationConfig::default(),
    trainer: TrainerConfig::default(),
});

impl Config {
    /// The configuration as YAML (what `--cfg job` prints).
    pub fn to_yaml(&self) -> String {
        serde_yaml_ng::to_string(self)
            .unwrap_or_else(|e| format!("# cannot serialise config: {e}\n"))
    }
}

/// Everything that can go wrong while reading a configuration. Each message names the key
/// (dotted path), the file or the override, and the rule.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: {message}")]
    File { file: String, message: String },
    #[error("override `{raw}`: {message}")]
    Override { raw: String, message: String },
    #[error("unknown key `{key}`{hint}")]
    UnknownKey { key: String, hint: String },
    #[error("{key}: {message}")]
    Value { key: String, message: String },
    #[error("{key} = {value}: not supported by main_ppo ({why})")]
    Unsupported {
        key: String,
        value: String,
        why: String,
    },
    /// Broken rules, one per entry (shown on one line when there is one).
    #[error("{}", invalid_lines(.0))]
    Invalid(Vec<String>),
}

fn invalid_lines(rules: &[String]) -> String {
    match rules {
        [one] => format!("invalid configuration: {one}"),
        many => format!("invalid configuration:\n  - {}", many.join("\n  - ")),
    }
}

#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_hydra;
