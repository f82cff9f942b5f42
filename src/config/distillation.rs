//! `distillation.*`: on-policy distillation from a frozen teacher (verl-project/verl 1dda039:
//! `verl/trainer/config/distillation/distillation.yaml`, `verl/workers/config/distillation.py`).
//!
//! The keys and defaults are those of verl's YAML file (which differ from its dataclass
//! defaults: `topk` 32, no clamps, `use_policy_gradient` false). verl serves each teacher from
//! an inference server of its own (`n_gpus_per_node`, `nnodes`, `num_replicas`, `inference.*`:
//! no effect here); main_ppo loads each teacher in the trainer's process, frozen, as it loads the
//! reference policy, and runs its forward over the step's responses.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::model::Precision;
use super::PolicyLossMode;
use crate::defaults;

/// `distillation.distillation_loss.loss_mode`: verl's registered distillation losses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DistillLossMode {
    /// Single-sample estimator k1 = log π − log π_T (verl's `kl`).
    #[serde(rename = "kl")]
    Kl,
    /// The same estimator, verl's other spelling.
    #[serde(rename = "k1")]
    K1,
    /// |log π − log π_T|.
    #[serde(rename = "abs")]
    Abs,
    /// ½ (log π − log π_T)² (verl's `mse`).
    #[serde(rename = "mse")]
    Mse,
    /// The same estimator, verl's other spelling.
    #[serde(rename = "k2")]
    K2,
    /// exp(log π_T − log π) − (log π_T − log π) − 1 (verl's `low_var_kl`).
    #[serde(rename = "low_var_kl")]
    LowVarKl,
    /// The same estimator, verl's other spelling.
    #[serde(rename = "k3")]
    K3,
    /// Forward KL over the teacher's top-k tokens: Σ_k p_T(k) (log p_T(k) − log π(k)).
    #[serde(rename = "forward_kl_topk")]
    ForwardKlTopk,
}

impl DistillLossMode {
    /// verl's name.
    pub fn as_str(self) -> &'static str {
        match self {
            DistillLossMode::Kl => "kl",
            DistillLossMode::K1 => "k1",
            DistillLossMode::Abs => "abs",
            DistillLossMode::Mse => "mse",
            DistillLossMode::K2 => "k2",
            DistillLossMode::LowVarKl => "low_var_kl",
            DistillLossMode::K3 => "k3",
            DistillLossMode::ForwardKlTopk => "forward_kl_topk",
        }
    }

    /// Whether the loss reads the teacher's top-k tokens (verl's `use_topk`) rather than its
    /// log-prob of the sampled token (`use_estimator`).
    pub fn uses_topk(self) -> bool {
        self == DistillLossMode::ForwardKlTopk
    }
}

/// `distillation.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationConfig {
    /// Distil from the teacher(s) below: the teacher's log-probs of each response enter the actor's loss.
    pub enabled: bool,
    /// The distillation loss and how it combines with the policy loss.
    pub distillation_loss: DistillationLossConfig,
    /// The teachers by name. One entry (`teacher_model`) serves every row; with more, `teacher_model` is dropped (as verl pops it) and each row goes to the teacher whose `key` equals the row's `teacher_key` column.
    pub teacher_models: BTreeMap<String, TeacherModelConfig>,
    /// The dataset column whose value picks a row's teacher when there are several (verl's routing key).
    pub teacher_key: String,
}

defaults!(DistillationConfig {
    enabled: false,
    distillation_loss: DistillationLossConfig::default(),
    teacher_models: BTreeMap::from([("teacher_model".to_string(), TeacherModelConfig::default())]),
    teacher_key: "data_source".into(),
});

/// `distillation.distillation_loss.*` (verl's `DistillationLossConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationLossConfig {
    /// kl | k1 | abs | mse | k2 | low_var_kl | k3 (single-sample estimators on the sampled token, the teacher's log-prob of it against the policy's) | forward_kl_topk (forward KL over the teacher's topk tokens).
    pub loss_mode: DistillLossMode,
    /// forward_kl_topk: how many of the teacher's most likely tokens per position.
    pub topk: Option<usize>,
    /// Keep the task's policy loss (and its entropy and KL terms) and add the distillation loss times distillation_loss_coef; false = the distillation loss alone.
    pub use_task_rewards: bool,
    /// Weight of the distillation loss when use_task_rewards (1 otherwise).
    pub distillation_loss_coef: f64,
    /// Clamp each token's distillation loss to [-loss_max_clamp, loss_max_clamp]; null = no clamp.
    pub loss_max_clamp: Option<f64>,
    /// forward_kl_topk: floor of the top-k log-probs (both sides) before the KL; null = none.
    pub log_prob_min_clamp: Option<f64>,
    /// Use minus each token's distillation loss as its advantage in a clipped policy-gradient loss (policy_loss_mode); false = backpropagate the loss itself (k1 is then refused).
    pub use_policy_gradient: bool,
    /// The policy-gradient loss with use_policy_gradient: vanilla only (as in verl).
    pub policy_loss_mode: PolicyLossMode,
    /// PPO clip range of that loss (when clip_ratio_low / clip_ratio_high are null).
    pub clip_ratio: f64,
    /// Lower clip range of that loss; null = clip_ratio.
    pub clip_ratio_low: Option<f64>,
    /// Upper clip range of that loss; null = clip_ratio.
    pub clip_ratio_high: Option<f64>,
}

defaults!(DistillationLossConfig {
    loss_mode: DistillLossMode::K3,
    topk: Some(32),
    use_task_rewards: true,
    distillation_loss_coef: 1.0,
    loss_max_clamp: None,
    log_prob_min_clamp: None,
    use_policy_gradient: false,
    policy_loss_mode: PolicyLossMode::Vanilla,
    clip_ratio: 0.2,
    clip_ratio_low: Some(0.2),
    clip_ratio_high: Some(0.2),
});

/// One teacher, `distillation.teacher_models.<name>.*` (verl's `DistillationTeacherModelConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherModelConfig {
    /// The value of the teacher_key column this teacher serves (needed with several teachers; one teacher serves every row).
    pub key: Option<String>,
    /// The teacher: an HF model folder, a hub id or a .gguf file, of any supported family; its tokenizer must be the student's.
    pub model_path: Option<String>,
    /// How the teacher's forward runs.
    pub inference: TeacherInferenceConfig,
}

defaults!(TeacherModelConfig {
    key: None,
    model_path: None,
    inference: TeacherInferenceConfig::default(),
});

/// `distillation.teacher_models.<name>.inference.*`: the keys of verl's teacher inference server
/// that change what is computed (the others have no effect here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherInferenceConfig {
    /// Precision of the teacher's products: fp32 or bf16; null = actor_rollout_ref.rollout.dtype (verl's interpolation).
    pub dtype: Option<Precision>,
    /// The teacher's context limit: prompt + response + 1 must fit (verl's rule); null = the model's own limit only.
    pub max_model_len: Option<usize>,
}

defaults!(TeacherInferenceConfig {
    dtype: None,
    max_model_len: None,
});

/// One teacher as the trainer loads it.
#[derive(Debug, Clone, PartialEq)]
pub struct TeacherPlan {
    /// Its entry under `distillation.teacher_models`.
    pub name: String,
    /// The routing value it serves (`None`: the only teacher, every row).
    pub key: Option<String>,
    pub model_path: String,
    /// bf16 products.
    pub bf16: bool,
}

/// `distillation.*` checked (present when `distillation.enabled`).
#[derive(Debug, Clone, PartialEq)]
pub struct DistillPlan {
    pub loss: DistillationLossConfig,
    /// The clip range of the policy-gradient form, nulls resolved to `clip_ratio`.
    pub clip_low: f64,
    pub clip_high: f64,
    /// `topk` with forward_kl_topk, else None.
    pub topk: Option<usize>,
    pub teachers: Vec<TeacherPlan>,
    /// The dataset column routing rows to teachers (read with several teachers).
    pub teacher_key: String,
}

/// verl's rules for `distillation.*` (`DistillationConfig.__post_init__`,
/// `DistillationLossConfig.__post_init__`, `DistillationTeacherModelConfig`), each violation
/// pushed to `errors`; the plan when enabled and nothing is broken. `context`: prompt plus
/// response budget (verl's `required_context_len` less its one generated token).
pub(super) fn rules(
    errors: &mut Vec<String>,
    warnings: &mut Vec<String>,
    cfg: &super::Config,
    context: usize,
) -> Option<DistillPlan> {
    const K: &str = "distillation";
    let d = &cfg.distillation;
    if !d.enabled {
        return None;
    }
    let l = &d.distillation_loss;
    let before = errors.len();
    if l.policy_loss_mode != PolicyLossMode::Vanilla {
        errors.push(format!(
            "`{K}.distillation_loss.policy_loss_mode` is {}: only vanilla is implemented for the distillation policy gradient (verl raises NotImplementedError)",
            serde_yaml_ng::to_string(&l.policy_loss_mode).unwrap_or_default().trim()
        ));
    }
    let k1 = matches!(l.loss_mode, DistillLossMode::K1 | DistillLossMode::Kl);
    if k1 && !l.use_policy_gradient {
        errors.push(format!("`{K}.distillation_loss.loss_mode={}` with `use_policy_gradient=false`: backpropagating k1 directly is wrong, as its gradient does not depend on the teacher's log-probs (verl's rule); set use_policy_gradient=true or another loss_mode", l.loss_mode.as_str()));
    }
    if l.loss_mode.uses_topk() && l.use_policy_gradient {
        warnings.push(format!("`{K}.distillation_loss.loss_mode=forward_kl_topk` with `use_policy_gradient=true`: the update then moves only the sampled token's log-prob, so most of the top-k signal (how the other tokens should move) is unused; forward_kl_topk works best as a supervised loss (verl's warning)"));
    }
    let topk = match (l.loss_mode.uses_topk(), l.topk) {
        (false, _) => None,
        (true, Some(k)) if k > 0 => Some(k),
        (true, other) => {
            errors.push(format!(
                "`{K}.distillation_loss.topk` is {}: forward_kl_topk needs a number of tokens >= 1",
                other.map_or("null".into(), |k| k.to_string())
            ));
            None
        }
    };
    for (key, v) in [
        ("distillation_loss_coef", Some(l.distillation_loss_coef)),
        ("loss_max_clamp", l.loss_max_clamp),
        ("log_prob_min_clamp", l.log_prob_min_clamp),
        ("clip_ratio", Some(l.clip_ratio)),
        ("clip_ratio_low", l.clip_ratio_low),
        ("clip_ratio_high", l.clip_ratio_high),
    ] {
        if v.is_some_and(|v| !v.is_finite()) {
            errors.push(format!(
                "`{K}.distillation_loss.{key}` must be a finite number"
            ));
        }
    }
    if l.distillation_loss_coef < 0.0 {
        errors.push(format!(
            "`{K}.distillation_loss.distillation_loss_coef` is {}: it must be >= 0 (a negative weight would train the student away from its teacher; 0 keeps only the task's loss)",
            l.distillation_loss_coef
        ));
    }
    if l.loss_max_clamp.is_some_and(|c| c < 0.0) {
        errors.push(format!(
            "`{K}.distillation_loss.loss_max_clamp` must be >= 0 (the loss is clamped to [-c, c])"
        ));
    }
    let teachers = teachers(errors, cfg, context);
    (errors.len() == before).then(|| DistillPlan {
        loss: l.clone(),
        clip_low: l.clip_ratio_low.unwrap_or(l.clip_ratio),
        clip_high: l.clip_ratio_high.unwrap_or(l.clip_ratio),
        topk,
        teachers,
        teacher_key: d.teacher_key.clone(),
    })
}

/// The teachers of `distillation.teacher_models` as verl resolves them: the one entry
/// `teacher_model` serves every row; with more entries `teacher_model` is dropped and each of
/// the others needs a `key` (unique) and a `model_path`.
fn teachers(errors: &mut Vec<String>, cfg: &super::Config, context: usize) -> Vec<TeacherPlan> {
    const K: &str = "distillation.teacher_models";
    let d = &cfg.distillation;
    let single = d.teacher_models.len() == 1;
    let mut out: Vec<TeacherPlan> = Vec::new();
    for (name, t) in &d.teacher_models {
        if !single && name == "teacher_model" {
            continue;
        }
        let Some(path) = &t.model_path else {
            errors.push(format!("`{K}.{name}.model_path` must be set: it names the teacher (an HF model folder, a hub id or a .gguf file)"));
            continue;
        };
        let key = if single {
            None
        } else {
            match &t.key {
                Some(k) if out.iter().any(|o| o.key.as_deref() == Some(k)) => {
                    errors.push(format!("`{K}.{name}.key` = {k}: another teacher has this key already (keys route rows by `distillation.teacher_key`)"));
                    continue;
                }
                Some(k) => Some(k.clone()),
                None => {
                    errors.push(format!("`{K}.{name}.key` must be set with several teachers: the value of the `distillation.teacher_key` column ({}) whose rows this teacher scores", d.teacher_key));
                    continue;
                }
            }
        };
        if let Some(max) = t.inference.max_model_len.filter(|&m| context + 1 > m) {
            errors.push(format!("`{K}.{name}.inference.max_model_len` = {max}: the teacher reads the prompt and the whole response and scores one more token, {context} + 1 positions (verl's rule)"));
        }
        let precision = t
            .inference
            .dtype
            .unwrap_or(cfg.actor_rollout_ref.rollout.dtype);
        out.push(TeacherPlan {
            name: name.clone(),
            key,
            model_path: path.clone(),
            bf16: precision.is_bf16(),
        });
    }
    out
}
