//! `trainer.*`: run length, logging, validation and checkpoint cadence, device.
//! verl: `verl/trainer/config/ppo_trainer.yaml` (trainer section).

use serde::{Deserialize, Serialize};

use super::fields::{nonpositive_none, OneOrMany};
use crate::defaults;

/// `trainer.resume_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Resume from the newest checkpoint in default_local_dir, if any.
    Auto,
    /// Always start fresh.
    Disable,
    /// Resume from resume_from_path (a global_step_N folder).
    ResumePath,
}

/// `trainer.use_legacy_worker_impl`: which of verl's two update paths the loss normalisation
/// follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LegacyWorkerImpl {
    /// verl's default: the `dp_actor` / `dp_critic` workers (same as `enable`).
    Auto,
    /// The `dp_actor` / `dp_critic` workers.
    Enable,
    /// verl's newer engine workers (`workers/utils/losses.py`).
    Disable,
}

impl LegacyWorkerImpl {
    /// True for `disable`: losses normalised by mini-batch-wide counts.
    pub fn global_norm(self) -> bool {
        self == LegacyWorkerImpl::Disable
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainerConfig {
    /// Passes over the training data.
    pub total_epochs: usize,
    /// Training steps; -1/null = steps per epoch × total_epochs.
    #[serde(with = "nonpositive_none")]
    pub total_training_steps: Option<u64>,
    /// Project name (metrics and checkpoint folder).
    pub project_name: String,
    /// Experiment name (metrics and checkpoint folder).
    pub experiment_name: String,
    /// Metric sinks: console, file, tensorboard (a string or a list).
    pub logger: OneOrMany,
    /// HTTPS proxy of the wandb tracker (`wandb.Settings(https_proxy=...)`, as verl's tracking
    /// reads it); null = none.
    pub wandb_proxy: Option<String>,
    /// Validation samples printed after each validation.
    pub log_val_generations: usize,
    /// Folder for one JSONL of rollouts per step; null = none.
    pub rollout_data_dir: Option<String>,
    /// Folder for one JSONL of validation generations per validation; null = none.
    pub validation_data_dir: Option<String>,
    /// Save a checkpoint every N steps (and at the last step); -1 = never.
    #[serde(with = "nonpositive_none")]
    pub save_freq: Option<u64>,
    /// auto | disable | resume_path.
    pub resume_mode: ResumeMode,
    /// Checkpoint folder for resume_mode=resume_path (must contain global_step_).
    pub resume_from_path: Option<String>,
    /// Validate before the first step.
    pub val_before_train: bool,
    /// Validate, then exit.
    pub val_only: bool,
    /// Validate every N steps (and at the last step); -1 = never.
    #[serde(with = "nonpositive_none")]
    pub test_freq: Option<u64>,
    /// Steps of critic-only updates before the actor starts updating.
    pub critic_warmup: usize,
    /// Delete the checkpoint after loading it.
    pub del_local_ckpt_after_load: bool,
    /// Checkpoint root; null = checkpoints/{project_name}/{experiment_name}.
    pub default_local_dir: Option<String>,
    /// Keep at most this many actor checkpoints; null = all.
    pub max_actor_ckpt_to_keep: Option<usize>,
    /// Keep at most this many critic checkpoints; null = all.
    pub max_critic_ckpt_to_keep: Option<usize>,
    /// auto | cpu | cuda | cuda:N (verl's default is cuda; auto = cuda when built with it and present, else cpu).
    pub device: String,
    /// Seed of model initialisation and everything not seeded elsewhere (not a verl key).
    pub seed: u64,
    /// Reorder each step's responses by workload (prompt + response tokens) before the updates, as
    /// verl's _balance_batch does for its data-parallel ranks, and log global_seqlen/*. With one
    /// rank the order is short, long, ..., long, short: it changes which rows share a
    /// mini-batch (and so the updates), as in verl.
    pub balance_batch: bool,
    /// auto | enable | disable. auto/enable (verl's default dp_actor/dp_critic workers): each
    /// micro-batch's loss is aggregated over that micro-batch alone and multiplied by
    /// 1/gradient_accumulation (rows_in_micro/mini-batch rows with use_dynamic_bsz);
    /// seq-mean-token-sum-norm sums the sequences and divides by the response length (b178a3c;
    /// loss_scale_factor is not read); with one mini-batch and one epoch the old log-prob is the
    /// current one, detached. disable (verl's engine workers, the only ones in verl 1dda039):
    /// losses normalised by the whole mini-batch's token / sequence counts, so micro-batches add
    /// up to the mini-batch loss; seq-mean-token-sum-norm is the mean over sequences divided by
    /// loss_scale_factor (1dda039).
    pub use_legacy_worker_impl: LegacyWorkerImpl,
    /// Nodes of a data-parallel run; with n_gpus_per_node, nnodes × n_gpus_per_node must equal
    /// the processes the launcher started (mpirun -np, srun -n). null = whatever the launcher
    /// started (verl's defaults are 1 and 8).
    pub nnodes: Option<usize>,
    /// Processes (GPUs) per node; see nnodes. null = the launcher's.
    pub n_gpus_per_node: Option<usize>,
}

defaults!(TrainerConfig {
    total_epochs: 30,
    total_training_steps: None,
    project_name: "verl_examples".into(),
    experiment_name: "gsm8k".into(),
    logger: OneOrMany::Many(vec!["console".into(), "wandb".into()]),
    wandb_proxy: None,
    log_val_generations: 0,
    rollout_data_dir: None,
    validation_data_dir: None,
    save_freq: None,
    resume_mode: ResumeMode::Auto,
    resume_from_path: None,
    val_before_train: true,
    val_only: false,
    test_freq: None,
    critic_warmup: 0,
    del_local_ckpt_after_load: false,
    default_local_dir: None,
    max_actor_ckpt_to_keep: None,
    max_critic_ckpt_to_keep: None,
    device: "auto".into(),
    seed: 42,
    balance_batch: true,
    use_legacy_worker_impl: LegacyWorkerImpl::Auto,
    nnodes: None,
    n_gpus_per_node: None,
});
