//! verl's config groups as the built-in defaults stand in for them: when no folder of the search
//! path holds one of verl's own configs (`ppo_trainer`, `ppo_megatron_trainer`, a group option
//! such as `actor/megatron_actor`), its built-in stand-in here is used. Each states only what
//! differs from the built-in defaults (which are verl's `ppo_trainer` with `model_engine: dp`):
//! the engine's name, and the optimizer defaults an engine changes (Megatron's `adam`, VeOmni's
//! cosine schedule). The layout mirrors verl 1dda039 (`verl/trainer/config`), with the groups of
//! b178a3c that later went away (`reward_model`, `reward_manager`).

/// `(config path, YAML text)`; the path is `group/option` or a top-level name.
const BUILTIN: &[(&str, &str)] = &[
    (
        "ppo_trainer",
        "defaults:
  - model_engine: dp
  - actor@actor_rollout_ref.actor: ${model_engine}_actor
  - data@data: legacy_data
  - ref@actor_rollout_ref.ref: ${model_engine}_ref
  - rollout@actor_rollout_ref.rollout: rollout
  - model@actor_rollout_ref.model: hf_model
  - critic@critic: ${model_engine}_critic
  - model@critic.model: hf_model
  - legacy_reward_impl
  - reward@reward: reward
  - algorithm@algorithm.rollout_correction: rollout_correction
  - distillation@distillation: distillation
  - transfer_queue@transfer_queue: transfer_queue
  - _self_
",
    ),
    (
        "ppo_megatron_trainer",
        "defaults:
  - ppo_trainer
  - override model_engine: megatron
  - _self_
",
    ),
    ("legacy_reward_impl", ""),
    ("reward_manager", ""),
    ("model_engine/dp", "# @package _global_\nmodel_engine: dp\n"),
    (
        "model_engine/megatron",
        "# @package _global_\nmodel_engine: megatron\n",
    ),
    (
        "model_engine/veomni",
        "# @package _global_\nmodel_engine: veomni\n",
    ),
    (
        "model_engine/torchtitan",
        "# @package _global_\nmodel_engine: torchtitan\n",
    ),
    ("actor/actor", ""),
    ("actor/dp_actor", "strategy: fsdp\n"),
    (
        "actor/megatron_actor",
        "defaults:\n  - ../optim@optim: megatron\n  - _self_\nstrategy: megatron\n",
    ),
    (
        "actor/veomni_actor",
        "defaults:\n  - ../optim@optim: veomni\n  - _self_\nstrategy: veomni\n",
    ),
    (
        "actor/torchtitan_actor",
        "defaults:\n  - ../optim@optim: torchtitan\n  - _self_\nstrategy: torchtitan\n",
    ),
    ("ref/ref", ""),
    ("ref/dp_ref", "strategy: fsdp\n"),
    ("ref/megatron_ref", "strategy: megatron\n"),
    ("ref/veomni_ref", "strategy: veomni\n"),
    ("ref/torchtitan_ref", "strategy: torchtitan\n"),
    ("critic/critic", ""),
    ("critic/dp_critic", "strategy: fsdp\n"),
    (
        "critic/megatron_critic",
        "defaults:\n  - ../optim@optim: megatron\n  - _self_\nstrategy: megatron\n",
    ),
    (
        "critic/veomni_critic",
        "defaults:\n  - ../optim@optim: veomni\n  - _self_\nstrategy: veomni\n",
    ),
    (
        "critic/torchtitan_critic",
        "defaults:\n  - ../optim@optim: torchtitan\n  - _self_\nstrategy: torchtitan\n",
    ),
    ("optim/fsdp", ""),
    ("optim/megatron", "optimizer: adam\n"),
    (
        "optim/veomni",
        "optimizer: adamw\nlr_scheduler_type: cosine\n",
    ),
    ("optim/torchtitan", "decay_type: linear\n"),
    ("engine/fsdp", ""),
    ("engine/megatron", ""),
    ("engine/veomni", ""),
    ("engine/torchtitan", ""),
    ("data/legacy_data", ""),
    ("rollout/rollout", ""),
    ("model/hf_model", ""),
    ("reward/reward", ""),
    ("algorithm/rollout_correction", ""),
    ("distillation/distillation", ""),
    ("transfer_queue/transfer_queue", ""),
    ("profiler/profiler", ""),
    ("npu_profile/npu_profile", ""),
    ("reward_model/reward_model", ""),
    ("reward_model/dp_reward_model", ""),
    ("reward_model/megatron_reward_model", ""),
    ("reward_model/dp_reward_loop", ""),
    ("reward_model/megatron_reward_loop", ""),
];

/// The built-in stand-in for verl's config `path` (`group/option` or a top-level name).
pub(super) fn builtin(path: &str) -> Option<&'static str> {
    BUILTIN.iter().find(|(p, _)| *p == path).map(|(_, t)| *t)
}

/// verl's options of `group` (for messages).
pub(super) fn options(group: &str) -> Vec<&'static str> {
    BUILTIN
        .iter()
        .filter_map(|(p, _)| p.strip_prefix(group)?.strip_prefix('/'))
        .collect()
}

/// Whether `name` is one of verl's config groups (a command-line `name=option` selects it).
pub(super) fn is_group(name: &str) -> bool {
    !options(name).is_empty()
}
