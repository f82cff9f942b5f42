//! `actor_rollout_ref.actor.*`: the policy update (PPO clip, loss aggregation, entropy and KL
//! losses, mini/micro batching). verl: `verl/trainer/config/actor/actor.yaml`, `ActorConfig`.

use serde::{Deserialize, Serialize};

use super::algorithm::{KlKind, KlPenalty};
use super::model::FsdpConfig;
use super::optim::OptimConfig;
use crate::defaults;

/// `loss_agg_mode`: how per-token losses become one number (verl's `agg_loss`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LossAggMode {
    /// Sum over valid tokens / number of valid tokens.
    #[serde(rename = "token-mean")]
    TokenMean,
    /// Sum over valid tokens.
    #[serde(rename = "token-sum")]
    TokenSum,
    /// Per-sequence token sum, averaged over sequences.
    #[serde(rename = "seq-mean-token-sum")]
    SeqMeanTokenSum,
    /// Per-sequence token mean, averaged over sequences.
    #[serde(rename = "seq-mean-token-mean")]
    SeqMeanTokenMean,
    /// seq-mean-token-sum divided by loss_scale_factor (default: the padded response length),
    /// verl 1dda039; on the default (b178a3c dp_actor) path b178a3c's: the sequences' token sums
    /// added, not averaged, then divided (see `algo::AggNorm::legacy_sum_norm`).
    #[serde(rename = "seq-mean-token-sum-norm")]
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// verl's string for this mode.
    pub fn as_str(self) -> &'static str {
        match self {
            LossAggMode::TokenMean => "token-mean",
            LossAggMode::TokenSum => "token-sum",
            LossAggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            LossAggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            LossAggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }
}

/// `policy_loss.loss_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyLossMode {
    Vanilla,
    Gspo,
    Gpg,
    ClipCov,
    KlCov,
    Sapo,
    Cispo,
    GeoMean,
    DppoTv,
    DppoKl,
    Dro,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossConfig {
    /// vanilla | gspo | gpg | clip_cov | kl_cov | sapo | cispo | geo_mean | dppo_tv | dppo_kl
    /// | dro.
    pub loss_mode: PolicyLossMode,
    /// clip_cov: fraction of tokens whose gradient is cut.
    pub clip_cov_ratio: f64,
    /// clip_cov: lower covariance bound.
    pub clip_cov_lb: f64,
    /// clip_cov: upper covariance bound.
    pub clip_cov_ub: f64,
    /// kl_cov: fraction of tokens that get the KL term.
    pub kl_cov_ratio: f64,
    /// kl_cov: coefficient of that KL term.
    pub ppo_kl_coef: f64,
    /// dro: coefficient β of the quadratic log-ratio penalty (logp − old)²; must be > 0 with dro.
    pub dro_beta: Option<f64>,
}

defaults!(PolicyLossConfig {
    loss_mode: PolicyLossMode::Vanilla,
    clip_cov_ratio: 0.0002,
    clip_cov_lb: 1.0,
    clip_cov_ub: 5.0,
    kl_cov_ratio: 0.0002,
    ppo_kl_coef: 0.1,
    dro_beta: None,
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointContents {
    /// What a checkpoint holds: model, optimizer, extra (RNG, scheduler), hf_model.
    pub save_contents: Vec<String>,
    /// What a resume reads; null = save_contents.
    pub load_contents: Option<Vec<String>>,
}

defaults!(CheckpointContents {
    save_contents: vec!["model".into(), "optimizer".into(), "extra".into()],
    load_contents: None,
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ActorConfig {
    /// Optimizer and learning-rate schedule.
    pub optim: OptimConfig,
    /// Prompts per PPO mini-batch (multiplied by rollout.n: each update sees mini × n responses).
    pub ppo_mini_batch_size: usize,
    /// Deprecated global micro-batch size in responses; use ppo_micro_batch_size_per_gpu.
    pub ppo_micro_batch_size: Option<usize>,
    /// Responses per forward/backward pass (gradient accumulation inside a mini-batch).
    pub ppo_micro_batch_size_per_gpu: Option<usize>,
    /// Form micro-batches by a token budget instead of a fixed count.
    pub use_dynamic_bsz: bool,
    /// Token budget per micro-batch when use_dynamic_bsz.
    pub ppo_max_token_len_per_gpu: usize,
    /// PPO clip range ε; used for a side only where clip_ratio_low/high is null.
    pub clip_ratio: f64,
    /// Lower clip range ε_low (ratio ≥ 1 − ε_low); null = clip_ratio. 0.2 as in verl, so
    /// changing only clip_ratio changes nothing: set these (or null them) to move the clip.
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range ε_high (ratio ≤ 1 + ε_high); null = clip_ratio. 0.2 as in verl.
    pub clip_ratio_high: Option<f64>,
    /// Dual-clip bound c for negative advantages (> 1).
    pub clip_ratio_c: f64,
    /// SAPO gate temperature for positive advantages.
    pub tau_pos: f64,
    /// SAPO gate temperature for negative advantages.
    pub tau_neg: f64,
    /// Policy loss variant.
    pub policy_loss: PolicyLossConfig,
    /// token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.
    pub loss_agg_mode: LossAggMode,
    /// Divisor of seq-mean-token-sum-norm; null = the padded response length
    /// (rollout.response_length).
    pub loss_scale_factor: Option<f64>,
    /// Entropy bonus coefficient (loss -= coeff × entropy).
    pub entropy_coeff: f64,
    /// Compute entropy in the update even when entropy_coeff is 0 (for the metric).
    pub calculate_entropy: bool,
    /// Compute Σπ² (the sum of the squared token probabilities) at every response position in
    /// the old-log-prob pass, by the fused LM head: the optimal-token-baseline estimators need
    /// it, and with it the variance_proxy/* metrics are logged.
    pub calculate_sum_pi_squared: bool,
    /// Add a KL(actor‖ref) loss term (needs the reference model).
    pub use_kl_loss: bool,
    /// Coefficient of the KL loss.
    pub kl_loss_coef: f64,
    /// KL estimator of the KL loss.
    pub kl_loss_type: KlPenalty,
    /// Passes over each step's data.
    pub ppo_epochs: usize,
    /// Shuffle the responses before splitting into mini-batches.
    pub shuffle: bool,
    /// Seed of that shuffle.
    pub data_loader_seed: u64,
    /// Checkpoint contents.
    pub checkpoint: CheckpointContents,
    /// Gradient-norm clip (reported as actor/grad_norm).
    pub grad_clip: f64,
    /// Mixed precision of the actor's forward and backward passes (and old log-probs).
    pub fsdp_config: FsdpConfig,
    /// Compute each group's shared prompt once per micro-batch (verl's PrefixGrouper): the
    /// responses of a prompt continue one copy of it in the update's forward and backward and
    /// in the log-prob passes (old, reference, critic, teachers), the prompt's gradients
    /// gathered over them. The same numbers as without it (up to rounding); the sequences are
    /// packed whatever `model.use_remove_padding` says. Models with Gated DeltaNet layers,
    /// CUDA and half precision compute every response with its own prompt (logged).
    pub use_prefix_grouper: bool,
    /// A vision-language model's vision tower receives no gradient and no update (its weights
    /// are saved back as read); the language model trains on its features.
    pub freeze_vision_tower: bool,
}

defaults!(ActorConfig {
    optim: OptimConfig::with_lr(1e-6),
    ppo_mini_batch_size: 256,
    ppo_micro_batch_size: None,
    ppo_micro_batch_size_per_gpu: None,
    use_dynamic_bsz: false,
    ppo_max_token_len_per_gpu: 16384,
    clip_ratio: 0.2,
    clip_ratio_low: Some(0.2),
    clip_ratio_high: Some(0.2),
    clip_ratio_c: 3.0,
    tau_pos: 1.0,
    tau_neg: 1.05,
    policy_loss: PolicyLossConfig::default(),
    loss_agg_mode: LossAggMode::TokenMean,
    loss_scale_factor: None,
    entropy_coeff: 0.0,
    calculate_entropy: false,
    calculate_sum_pi_squared: false,
    use_kl_loss: false,
    kl_loss_coef: 0.001,
    kl_loss_type: KlPenalty::new(KlKind::K3, false),
    ppo_epochs: 1,
    shuffle: false,
    data_loader_seed: 42,
    checkpoint: CheckpointContents::default(),
    grad_clip: 1.0,
    fsdp_config: FsdpConfig::default(),
    use_prefix_grouper: false,
    freeze_vision_tower: false,
});

impl ActorConfig {
    /// The lower clip range in effect.
    pub fn clip_low(&self) -> f64 {
        self.clip_ratio_low.unwrap_or(self.clip_ratio)
    }
    /// The upper clip range in effect.
    pub fn clip_high(&self) -> f64 {
        self.clip_ratio_high.unwrap_or(self.clip_ratio)
    }
}
