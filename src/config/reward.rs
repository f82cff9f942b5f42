//! `reward.*`: where scores come from and how they are combined. verl:
//! `verl/trainer/config/reward/reward.yaml` (`RewardConfig`); `sources`, `python`, `timeout_s`
//! and `on_error` are main_ppo's own keys (verl has no weighted sources nor failure policy).

use serde::{Deserialize, Serialize};

use super::fields::FreeMap;
use crate::defaults;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomRewardFunction {
    /// Python file (or pkg://module.path) defining the reward function; null = built-in scorers.
    pub path: Option<String>,
    /// Name of the function in that file.
    pub name: Option<String>,
    /// Keyword arguments added to every call (they win over call-time values).
    pub reward_kwargs: FreeMap,
}

defaults!(CustomRewardFunction {
    path: None,
    name: Some("compute_score".into()),
    reward_kwargs: FreeMap::new(),
});

/// `reward.reward_manager.name`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardManagerName {
    /// One call per response. verl's `remote` (scoring in separate processes) is what this
    /// implementation always does, so `remote` is accepted as a synonym.
    #[serde(alias = "remote")]
    Naive,
    /// One call per batch with lists (data_sources, solution_strs, ground_truths, extra_infos).
    Batch,
    /// naive plus DAPO's overlong-response penalty (reward_kwargs.overlong_buffer_cfg).
    Dapo,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardManagerConfig {
    /// register (a built-in manager by name); verl's importlib (a Python class) is not supported.
    pub source: String,
    /// naive | batch | dapo.
    pub name: RewardManagerName,
}

defaults!(RewardManagerConfig {
    source: "register".into(),
    name: RewardManagerName::Naive
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// Score responses with a sequence-classification reward model.
    pub enable: bool,
    /// Reward model location (HF directory, .gguf or hub id).
    pub model_path: Option<String>,
}

defaults!(RewardModelConfig {
    enable: false,
    model_path: None
});

/// What a failing reward call does to the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Stop the run with the error (a rerun resumes from the newest checkpoint).
    Raise,
    /// Score the sample 0.
    Zero,
    /// Leave the sample out of the update.
    Skip,
}

/// Kind of a weighted reward source.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RewardSourceType {
    /// A built-in rule scorer (`scorer`: gsm8k, math, math_dapo, search_r1, default).
    Builtin,
    /// A Python function (`path`, `function`) run in the worker pool.
    Python,
    /// A Rust function registered in the binary (`function`).
    Native,
    /// A sequence-classification reward model (`path`: HF directory with a `score` head).
    Model,
}

/// What a gate does to a sample whose source scored below `below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateAction {
    /// Leave the sample out of the policy update (loss mask and advantage zeroed).
    SkipUpdate,
    /// Set the sample's total reward to 0.
    ZeroReward,
    /// Add `penalty` to the sample's total reward.
    Penalty,
}

/// A veto on one source's score (e.g. a safety classifier).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gate {
    /// The gate fires when the source's (weighted-before) score is below this.
    pub below: f64,
    /// skip_update | zero_reward | penalty.
    pub action: GateAction,
    /// Added to the total reward by `action: penalty` (usually negative).
    #[serde(default)]
    pub penalty: f64,
}

/// One entry of `reward.sources`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardSource {
    /// Name used in metrics (`reward/<name>/mean`) and outputs.
    pub name: String,
    /// Weight of this source in the final reward.
    #[serde(default = "one")]
    pub weight: f64,
    /// builtin | python | native.
    #[serde(rename = "type")]
    pub kind: RewardSourceType,
    /// builtin: the scorer's name.
    #[serde(default)]
    pub scorer: Option<String>,
    /// python: the file (or pkg://module).
    #[serde(default)]
    pub path: Option<String>,
    /// python / native: the function's name.
    #[serde(default)]
    pub function: Option<String>,
    /// Keyword arguments of the scorer or function.
    #[serde(default)]
    pub kwargs: FreeMap,
    /// model: responses scored per forward pass.
    #[serde(default)]
    pub micro_batch_size: Option<usize>,
    /// model: device of the reward model (null = trainer.device).
    #[serde(default)]
    pub device: Option<String>,
    /// model: normalise scores by the running mean and standard deviation of all scores so far.
    #[serde(default)]
    pub normalize: bool,
    /// model: clip the (normalised) score to [-clip, clip].
    #[serde(default)]
    pub clip: Option<f64>,
    /// Any source: a veto when its score is below a threshold.
    #[serde(default)]
    pub gate: Option<Gate>,
}

/// A source's type with the fields that type needs: what `reward.sources[i]` means once its
/// rule holds. The wire format stays flat (`type` plus optional fields) so serde's errors name
/// the field; this is the one place the per-type rule is written.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceSpec<'a> {
    Builtin { scorer: &'a str },
    Python { path: &'a str, function: &'a str },
    Native { function: &'a str },
    Model { path: &'a str },
}

impl RewardSource {
    /// The typed source, or the rule its fields break (`has type builtin but no `scorer``).
    pub fn spec(&self) -> Result<SourceSpec<'_>, String> {
        let kind = serde_yaml_ng::to_string(&self.kind).unwrap_or_default();
        let need = |field, name, what| required(field, kind.trim(), name, what);
        Ok(match self.kind {
            RewardSourceType::Builtin => SourceSpec::Builtin {
                scorer: need(&self.scorer, "scorer", "")?,
            },
            RewardSourceType::Python => SourceSpec::Python {
                path: need(&self.path, "path", "")?,
                function: self.function.as_deref().unwrap_or("compute_score"),
            },
            RewardSourceType::Native => SourceSpec::Native {
                function: need(&self.function, "function", "")?,
            },
            RewardSourceType::Model => SourceSpec::Model {
                path: need(
                    &self.path,
                    "path",
                    " (an HF directory of a sequence-classification model)",
                )?,
            },
        })
    }
}

/// A field a source type needs, or the rule naming it.
fn required<'a>(
    field: &'a Option<String>,
    kind: &str,
    name: &str,
    what: &str,
) -> Result<&'a str, String> {
    field
        .as_deref()
        .ok_or_else(|| format!("has type {kind} but no `{name}`{what}"))
}

fn one() -> f64 {
    1.0
}

/// `reward.control`: the HTTP API that changes source weights during a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardControlConfig {
    /// Serve GET/POST /api/v1/reward/weights and GET /api/v1/status during training.
    pub enable: bool,
    /// Address to bind; a non-loopback address requires a token.
    pub host: String,
    /// Port to bind (0 = any free port, logged at start-up).
    pub port: u16,
    /// Bearer token every request must carry (Authorization: Bearer <token>); null = none.
    pub token: Option<String>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
}

defaults!(RewardControlConfig {
    enable: false,
    host: "127.0.0.1".into(),
    port: 8000,
    token: None,
    max_body_bytes: 65536,
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// Python reward worker processes.
    pub num_workers: usize,
    /// A user reward function (verl's signature).
    pub custom_reward_function: CustomRewardFunction,
    /// Reward manager.
    pub reward_manager: RewardManagerConfig,
    /// Reward model (sequence classification).
    pub reward_model: RewardModelConfig,
    /// Manager keyword arguments (dapo: overlong_buffer_cfg, max_resp_len).
    pub reward_kwargs: FreeMap,
    /// Weighted reward sources; empty = verl's behaviour (custom function, else built-in by data_source).
    pub sources: Vec<RewardSource>,
    /// Python interpreter of the reward workers.
    pub python: String,
    /// Seconds one reward call may take before its worker is killed and replaced.
    pub timeout_s: f64,
    /// raise | zero | skip: what a failed or timed-out reward call does.
    pub on_error: OnError,
    /// Live reward weights over HTTP.
    pub control: RewardControlConfig,
}

defaults!(RewardConfig {
    num_workers: 8,
    custom_reward_function: CustomRewardFunction::default(),
    reward_manager: RewardManagerConfig::default(),
    reward_model: RewardModelConfig::default(),
    reward_kwargs: FreeMap::new(),
    sources: Vec::new(),
    python: "python3".into(),
    timeout_s: 60.0,
    on_error: OnError::Raise,
    control: RewardControlConfig::default(),
});
