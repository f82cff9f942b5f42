//! `algorithm.*`: advantage estimator, discounting, KL in the reward and its controller.
//! verl: `verl/trainer/config/algorithm.py` (`AlgoConfig`, `KLControlConfig`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::defaults;

/// `algorithm.adv_estimator`: how advantages are estimated (verl's `AdvantageEstimator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvEstimator {
    /// Generalised advantage estimation with a critic.
    Gae,
    /// Group-normalised outcome reward (needs n > 1 responses per prompt to be useful).
    #[serde(alias = "grpo_vectorized")]
    Grpo,
    /// REINFORCE leave-one-out baseline (a group of one keeps its score).
    Rloo,
    /// RLOO as verl's vectorised version computes it (a group of one gets 0).
    RlooVectorized,
    /// Discounted returns, whitened over the batch.
    ReinforcePlusPlus,
    /// Group-mean baseline, then whitened over the batch.
    ReinforcePlusPlusBaseline,
    /// Greedy-rollout baseline.
    Remax,
    /// Length-weighted group baseline.
    Opo,
    /// Pass@k: only the best response of a group gets (best - second best).
    GrpoPassk,
    /// GPG: group-mean baseline scaled by batch size over non-zero scores.
    Gpg,
    /// GDPO: each reward component (`gdpo_reward_keys`) group-normalised on its own, weighted,
    /// summed and whitened over the batch.
    Gdpo,
    /// Optimal token baseline: reward-to-go minus a per-step group baseline weighted by each
    /// response's cumulative path variance Σ(1 − 2π_t + Σπ²) (needs
    /// `actor_rollout_ref.actor.calculate_sum_pi_squared`).
    OptimalTokenBaseline,
    /// The optimal token baseline over each response's k-th token in the update instead of its
    /// k-th position (verl's variant for tool-interleaved responses; the same as
    /// `optimal_token_baseline` unless tokens inside a response are left out of the mask).
    TirOptimalTokenBaseline,
}

impl AdvEstimator {
    /// verl's string for this estimator.
    pub fn as_str(self) -> &'static str {
        match self {
            AdvEstimator::Gae => "gae",
            AdvEstimator::Grpo => "grpo",
            AdvEstimator::Rloo => "rloo",
            AdvEstimator::RlooVectorized => "rloo_vectorized",
            AdvEstimator::ReinforcePlusPlus => "reinforce_plus_plus",
            AdvEstimator::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            AdvEstimator::Remax => "remax",
            AdvEstimator::Opo => "opo",
            AdvEstimator::GrpoPassk => "grpo_passk",
            AdvEstimator::Gpg => "gpg",
            AdvEstimator::Gdpo => "gdpo",
            AdvEstimator::OptimalTokenBaseline => "optimal_token_baseline",
            AdvEstimator::TirOptimalTokenBaseline => "tir_optimal_token_baseline",
        }
    }
}

/// The estimator of KL(π‖π_ref) per token (`kl_penalty`, `kl_loss_type`), verl's
/// `core_algos.kl_penalty`. A trailing `+` (`k3+`) keeps the value of the named estimator but
/// takes the gradient of `k2` (straight-through).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KlPenalty {
    pub kind: KlKind,
    pub straight_through: bool,
    /// The spelling the user chose (`kl` and `k1` are the same estimator), kept for round trips.
    spelling: &'static str,
}

/// The KL estimators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlKind {
    /// `logp - ref` (k1).
    K1,
    /// `|logp - ref|`.
    Abs,
    /// `0.5 (logp - ref)^2` (k2).
    K2,
    /// `exp(ref - logp) - (ref - logp) - 1`, clamped (k3, low variance).
    K3,
}

const KL_SPELLINGS: [(&str, KlKind); 7] = [
    ("kl", KlKind::K1),
    ("k1", KlKind::K1),
    ("abs", KlKind::Abs),
    ("mse", KlKind::K2),
    ("k2", KlKind::K2),
    ("low_var_kl", KlKind::K3),
    ("k3", KlKind::K3),
];

impl KlPenalty {
    pub fn new(kind: KlKind, straight_through: bool) -> Self {
        let spelling = KL_SPELLINGS
            .iter()
            .find(|(_, k)| *k == kind)
            .map(|(s, _)| *s)
            .unwrap_or("kl");
        Self {
            kind,
            straight_through,
            spelling,
        }
    }
}

impl FromStr for KlPenalty {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (base, straight_through) = match s.strip_suffix('+') {
            Some(b) => (b, true),
            None => (s, false),
        };
        if base == "full" {
            return Err("`full` (the exact KL over the vocabulary) is not implemented by verl either; use one of kl, k1, abs, mse, k2, low_var_kl, k3 (optionally with a trailing +)".into());
        }
        KL_SPELLINGS
            .iter()
            .find(|(name, _)| *name == base)
            .map(|(name, kind)| KlPenalty { kind: *kind, straight_through, spelling: name })
            .ok_or_else(|| {
                format!("unknown KL estimator `{s}`, expected one of kl, k1, abs, mse, k2, low_var_kl, k3 (optionally with a trailing +)")
            })
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}",
            self.spelling,
            if self.straight_through { "+" } else { "" }
        )
    }
}

impl Serialize for KlPenalty {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for KlPenalty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// `algorithm.kl_ctrl.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KlCtrlType {
    /// β stays `kl_coef`.
    Fixed,
    /// β follows `target_kl` with a proportional controller over `horizon`.
    Adaptive,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlConfig {
    /// fixed | adaptive.
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    /// Initial (fixed: constant) KL coefficient β.
    pub kl_coef: f64,
    /// Adaptive controller horizon in samples.
    pub horizon: f64,
    /// Adaptive controller target KL.
    pub target_kl: f64,
}

defaults!(KlCtrlConfig {
    kind: KlCtrlType::Fixed,
    kl_coef: 0.001,
    horizon: 10000.0,
    target_kl: 0.1
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlgorithmConfig {
    /// Discount factor.
    pub gamma: f64,
    /// GAE lambda.
    pub lam: f64,
    /// gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | opo | grpo_passk | gpg | gdpo | optimal_token_baseline | tir_optimal_token_baseline.
    pub adv_estimator: AdvEstimator,
    /// GRPO: divide by the group std (false = Dr.GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    /// Subtract β·KL(actor‖ref) from the token rewards.
    pub use_kl_in_reward: bool,
    /// KL estimator for the reward penalty.
    pub kl_penalty: KlPenalty,
    /// KL coefficient controller.
    pub kl_ctrl: KlCtrlConfig,
    /// gdpo: the reward components, keys of the dict the reward function returns (each
    /// response's value under each key is normalised within its group on its own).
    pub gdpo_reward_keys: Option<Vec<String>>,
    /// gdpo: one weight per key of gdpo_reward_keys; null = 1 each.
    pub gdpo_reward_weights: Option<Vec<f64>>,
    /// DAPO's dynamic sampling: groups whose responses all score the same are dropped.
    pub filter_groups: FilterGroupsConfig,
    /// Importance weights and rejection between the rollout's log-probs and the trainer's.
    pub rollout_correction: RolloutCorrectionConfig,
    /// PF-PPO: after GAE, train on the step's responses drawn again in proportion to a weight
    /// of their scores (`algo::pf_ppo`); `adv_estimator=gae` only.
    pub use_pf_ppo: bool,
    /// PF-PPO's weights.
    pub pf_ppo: PfPpoConfig,
}

/// `algorithm.pf_ppo.reweight_method`: each response's resampling weight from its score s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PfPpoReweight {
    /// |s|^weight_pow.
    Pow,
    /// 1 for the batch's highest and lowest scores, 0 for the rest.
    MaxMin,
    /// 0.4 for the highest score, 0.1 for the rest.
    MaxRandom,
}

/// `algorithm.pf_ppo` (verl: a free dict read with `reweight_method` and `weight_pow`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PfPpoConfig {
    /// pow | max_min | max_random.
    pub reweight_method: PfPpoReweight,
    /// The exponent of `pow`.
    pub weight_pow: f64,
}

defaults!(PfPpoConfig {
    reweight_method: PfPpoReweight::Pow,
    weight_pow: 2.0,
});

/// A threshold given as a number or as a string (`"0.5_5.0"`, `"0.5_2.0,0.1"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Threshold {
    Number(f64),
    Text(String),
}

/// `algorithm.rollout_correction` (verl 1dda039): how the trainer corrects for the rollout
/// sampling from numbers other than its own (bf16 decode against the f32 update here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutCorrectionConfig {
    /// Importance weights old/rollout multiplying each token's loss: null (none; the
    /// diagnostics are logged anyway) | token | sequence (the product over the response).
    pub rollout_is: Option<String>,
    /// A number: weights truncated there (TIS); "lower_upper": weights outside zeroed (IcePop);
    /// required with rollout_is.
    pub rollout_is_threshold: Option<Threshold>,
    /// Divide the weights by their batch mean.
    pub rollout_is_batch_normalize: bool,
    /// Rejection: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3,
    /// seq_max_k2|k3; a token or sequence outside its bound leaves the loss; null = none.
    pub rollout_rs: Option<String>,
    /// One bound per rollout_rs option, comma-separated, or one for all: "lower_upper" ratio
    /// bounds (or one number u for [1/u, u]) for k1, an upper bound for k2/k3.
    pub rollout_rs_threshold: Option<Threshold>,
    /// Use the rollout's log-probs as the old ones: no old-log-prob pass.
    pub bypass_mode: bool,
    /// The loss in bypass mode: ppo_clip (the ratio to the rollout policy, clipped) | reinforce
    /// (log-prob times advantage times the IS weights).
    pub loss_type: String,
}

defaults!(RolloutCorrectionConfig {
    rollout_is: None,
    rollout_is_threshold: Some(Threshold::Number(2.0)),
    rollout_is_batch_normalize: false,
    rollout_rs: None,
    rollout_rs_threshold: None,
    bypass_mode: false,
    loss_type: "ppo_clip".into(),
});

/// `algorithm.filter_groups`: DAPO's dynamic sampling. Each step generates batches of
/// `data.gen_batch_size` prompts, drops every group whose responses share one value of
/// `metric` (no GRPO signal), and keeps generating until `data.train_batch_size` groups remain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterGroupsConfig {
    /// Turn dynamic sampling on.
    pub enable: bool,
    /// What a group's responses must differ in: `reward` (the summed reward before any KL
    /// penalty, verl 0.9's default), acc | score | seq_reward | seq_final_reward, or any key of
    /// the dict the reward function returns. null (verl 1dda039's default) is refused when
    /// filtering is on.
    pub metric: Option<String>,
    /// Generation batches one step may draw before the run stops with an error; <= 0 = no limit.
    pub max_num_gen_batches: i64,
    /// verl's bound on generation batches in flight at once (its asynchronous trainer); here
    /// batches are generated one after another, so it only has to be >= 1.
    pub max_inflight_gen_batches: i64,
}

defaults!(FilterGroupsConfig {
    enable: false,
    metric: Some("reward".into()),
    max_num_gen_batches: 0,
    max_inflight_gen_batches: 1,
});

defaults!(AlgorithmConfig {
    gamma: 1.0,
    lam: 1.0,
    adv_estimator: AdvEstimator::Gae,
    norm_adv_by_std_in_grpo: true,
    use_kl_in_reward: false,
    kl_penalty: KlPenalty::new(KlKind::K1, false),
    kl_ctrl: KlCtrlConfig::default(),
    gdpo_reward_keys: None,
    gdpo_reward_weights: None,
    filter_groups: FilterGroupsConfig::default(),
    rollout_correction: RolloutCorrectionConfig::default(),
    use_pf_ppo: false,
    pf_ppo: PfPpoConfig::default(),
});
