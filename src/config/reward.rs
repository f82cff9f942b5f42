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
    /// verl's GDPO manager: naive, with `extra_info["experiment_name"]` set to
    /// `trainer.experiment_name` in every call (the components gdpo reads are the dict's keys,
    /// as with naive).
    Gdpo,
    /// verl's PRIME manager: `compute_score(data_source, solution_str, ground_truth,
    /// extra_info)` called by position; a number, or a sequence whose first item is the score;
    /// a failed or timed-out call scores 0 (`reward.on_error` and `reward.timeout_s` default to
    /// zero and 300 s with it, as verl's manager scores them).
    Prime,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardManagerConfig {
    /// register (a built-in manager by name); verl's importlib (a Python class) is not supported.
    pub source: String,
    /// naive | batch | dapo | gdpo | prime.
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

/// What a reward source runs, with the fields its type needs: the typed form of a
/// `reward.sources` entry once its type's rule holds. The wire format stays flat (`type` plus
/// optional fields) so that serde's errors name the field; [`RewardConfig::plan`] is the one
/// place the per-type rule is written, and the reward stage receives only this form.
#[derive(Debug, Clone, PartialEq)]
pub enum SourceKind {
    /// A built-in rule scorer and its keyword arguments.
    Builtin { scorer: String, kwargs: FreeMap },
    /// A Python function (`path`, or `pkg://module`) run in the worker pool.
    Python {
        path: String,
        function: String,
        kwargs: FreeMap,
    },
    /// A Rust function registered in the binary.
    Native { function: String, kwargs: FreeMap },
    /// A sequence-classification reward model.
    Model {
        path: String,
        /// null = `trainer.device`.
        device: Option<String>,
        micro_batch_size: usize,
        normalize: bool,
        clip: Option<f64>,
    },
}

/// A reward source whose rules hold.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckedSource {
    /// Its name in metrics (`reward/<name>/mean`).
    pub name: String,
    /// Its place in `reward.sources` (None for verl's default sources and the legacy
    /// `reward_model`), for messages.
    pub index: Option<usize>,
    pub weight: f64,
    /// What it runs, for messages (`compute_score (rewards.py)`, `built-in gsm8k`, ...).
    pub label: String,
    pub gate: Option<Gate>,
    pub kind: SourceKind,
}

/// DAPO's overlong-response penalty (`reward_kwargs.overlong_buffer_cfg`, `max_resp_len`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlong {
    pub len: f64,
    pub penalty_factor: f64,
    pub max_resp_len: f64,
    pub log: bool,
}

/// The reward stage as `reward.*` describes it, every rule checked: the sources (verl's
/// default ones when `reward.sources` is empty), the calling convention and the failure policy.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardPlan {
    pub sources: Vec<CheckedSource>,
    /// `reward_manager.name=batch`: Python functions receive lists.
    pub batch: bool,
    /// `reward_manager.name=prime`: Python functions are called by position and may return a
    /// sequence led by the score.
    pub positional: bool,
    /// `reward_manager.name=dapo` with `overlong_buffer_cfg.enable`.
    pub overlong: Option<Overlong>,
    /// Python interpreter, worker count and per-call time limit of the Python sources.
    pub python: String,
    pub num_workers: usize,
    pub timeout_s: f64,
    pub on_error: OnError,
}

impl RewardConfig {
    /// The checked reward stage, or every rule `reward.*` breaks (each naming its key).
    pub fn plan(&self) -> Result<RewardPlan, Vec<String>> {
        let mut errors = Vec::new();
        let prime = self.reward_manager.name == RewardManagerName::Prime;
        let timeout_s = self.timeout_s.unwrap_or(if prime { 300.0 } else { 60.0 });
        if !(timeout_s > 0.0 && timeout_s.is_finite()) {
            errors.push(format!(
                "`reward.timeout_s` ({timeout_s}) must be a positive number of seconds"
            ));
        }
        if self.num_workers == 0 {
            errors.push("`reward.num_workers` must be at least 1".into());
        }
        let batch = self.reward_manager.name == RewardManagerName::Batch;
        let mut sources = if self.sources.is_empty() {
            self.verl_default_sources(batch, &mut errors)
        } else {
            self.listed_sources(&mut errors)
        };
        // verl's `reward_model.enable`: the model's score is added to the rule/custom reward.
        let rm = &self.reward_model;
        if rm.enable {
            match &rm.model_path {
                Some(path) => sources.push(CheckedSource {
                    name: "reward_model".into(),
                    index: None,
                    weight: 1.0,
                    label: format!("reward model {path}"),
                    gate: None,
                    kind: SourceKind::Model {
                        path: path.clone(),
                        device: None,
                        micro_batch_size: 8,
                        normalize: false,
                        clip: None,
                    },
                }),
                None => errors.push("`reward.reward_model.enable=True` needs `reward.reward_model.model_path` (legacy: `reward_model.model.path`)".into()),
            }
        }
        let overlong = if self.reward_manager.name == RewardManagerName::Dapo {
            overlong(&self.reward_kwargs).unwrap_or_else(|e| {
                errors.push(e);
                None
            })
        } else {
            None
        };
        if !errors.is_empty() {
            return Err(errors);
        }
        Ok(RewardPlan {
            sources,
            batch,
            positional: prime,
            overlong,
            python: self.python.clone(),
            num_workers: self.num_workers,
            timeout_s,
            on_error: self.on_error.unwrap_or(match prime {
                true => OnError::Zero,
                false => OnError::Raise,
            }),
        })
    }

    /// verl's sources when none are listed: the custom function, else the built-in scorers
    /// chosen by each row's data_source.
    fn verl_default_sources(&self, batch: bool, errors: &mut Vec<String>) -> Vec<CheckedSource> {
        let custom = &self.custom_reward_function;
        let name = custom.name.clone().unwrap_or_default();
        match &custom.path {
            Some(_) if name.is_empty() => {
                errors.push("`reward.custom_reward_function.path` is set but `reward.custom_reward_function.name` is empty".into());
                Vec::new()
            }
            Some(path) => vec![CheckedSource {
                label: format!("{name} ({path})"),
                name: name.clone(),
                index: None,
                weight: 1.0,
                gate: None,
                kind: SourceKind::Python {
                    path: path.clone(),
                    function: name,
                    kwargs: custom.reward_kwargs.clone(),
                },
            }],
            None if batch => {
                errors.push("`reward.reward_manager.name=batch` calls a batch function (data_sources, solution_strs, ground_truths, extra_infos) and has no built-in default; set `reward.custom_reward_function.path`".into());
                Vec::new()
            }
            None => vec![CheckedSource {
                name: "default".into(),
                index: None,
                weight: 1.0,
                label: "built-in scorers by data_source".into(),
                gate: None,
                kind: SourceKind::Builtin {
                    scorer: "default".into(),
                    kwargs: FreeMap::new(),
                },
            }],
        }
    }

    /// `reward.sources`, each entry's rules checked (names unique, weights and gates finite,
    /// the fields its type needs present).
    fn listed_sources(&self, errors: &mut Vec<String>) -> Vec<CheckedSource> {
        let mut names = std::collections::BTreeSet::new();
        let mut out = Vec::new();
        for (i, s) in self.sources.iter().enumerate() {
            let at = format!("reward.sources[{i}]");
            let before = errors.len();
            if s.name.is_empty() {
                errors.push(format!("`{at}.name` must not be empty"));
            } else if !names.insert(s.name.clone()) {
                errors.push(format!(
                    "`{at}.name` ({:?}) is used by another source; names must be unique",
                    s.name
                ));
            }
            if !(s.weight.is_finite() && s.weight >= 0.0) {
                errors.push(format!(
                    "`{at}.weight` ({}) must be a finite number >= 0",
                    s.weight
                ));
            }
            if let Some(g) = s.gate {
                if !g.below.is_finite() || !g.penalty.is_finite() {
                    errors.push(format!(
                        "`{at}.gate`: `below` and `penalty` must be finite numbers"
                    ));
                }
            }
            if s.micro_batch_size == Some(0) {
                errors.push(format!("`{at}.micro_batch_size` must be at least 1"));
            }
            match s.checked_kind() {
                Ok((label, kind)) if errors.len() == before => out.push(CheckedSource {
                    name: s.name.clone(),
                    index: Some(i),
                    weight: s.weight,
                    label,
                    gate: s.gate,
                    kind,
                }),
                Ok(_) => {}
                Err(rule) => errors.push(format!("`{at}` {rule}")),
            }
        }
        out
    }
}

impl RewardSource {
    /// What this entry runs and its label, or the rule its fields break (`has type builtin
    /// but no `scorer``).
    fn checked_kind(&self) -> Result<(String, SourceKind), String> {
        let kind = serde_yaml_ng::to_string(&self.kind).unwrap_or_default();
        let need = |field, name, what| required(field, kind.trim(), name, what).map(str::to_string);
        let kwargs = self.kwargs.clone();
        Ok(match self.kind {
            RewardSourceType::Builtin => {
                let scorer = need(&self.scorer, "scorer", "")?;
                (
                    format!("built-in {scorer}"),
                    SourceKind::Builtin { scorer, kwargs },
                )
            }
            RewardSourceType::Python => {
                let path = need(&self.path, "path", "")?;
                let function = self.function.clone().unwrap_or("compute_score".into());
                (
                    format!("{function} ({path})"),
                    SourceKind::Python {
                        path,
                        function,
                        kwargs,
                    },
                )
            }
            RewardSourceType::Native => {
                let function = need(&self.function, "function", "")?;
                (
                    format!("native {function}"),
                    SourceKind::Native { function, kwargs },
                )
            }
            RewardSourceType::Model => {
                let path = need(
                    &self.path,
                    "path",
                    " (an HF directory of a sequence-classification model)",
                )?;
                (
                    format!("reward model {path}"),
                    SourceKind::Model {
                        path,
                        device: self.device.clone(),
                        micro_batch_size: self.micro_batch_size.unwrap_or(8),
                        normalize: self.normalize,
                        clip: self.clip,
                    },
                )
            }
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

/// A number in `reward.reward_kwargs` (null = absent).
fn kwarg_num(v: Option<&serde_json::Value>, key: &str) -> Result<Option<f64>, String> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("`reward.reward_kwargs.{key}` must be a number, got {x}")),
    }
}

/// DAPO's overlong buffer from `reward.reward_kwargs`, when enabled.
fn overlong(kw: &FreeMap) -> Result<Option<Overlong>, String> {
    let Some(cfg) = kw.get("overlong_buffer_cfg") else {
        return Ok(None);
    };
    if !cfg
        .get("enable")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false)
    {
        return Ok(None);
    }
    let len = kwarg_num(cfg.get("len"), "overlong_buffer_cfg.len")?.unwrap_or(0.0);
    let penalty_factor = kwarg_num(
        cfg.get("penalty_factor"),
        "overlong_buffer_cfg.penalty_factor",
    )?
    .unwrap_or(1.0);
    let max_resp_len = kwarg_num(kw.get("max_resp_len"), "max_resp_len")?.ok_or_else(|| {
        "`reward.reward_kwargs.max_resp_len` is required with overlong_buffer_cfg.enable"
            .to_string()
    })?;
    if !(len > 0.0 && max_resp_len >= len) {
        return Err(format!(
            "overlong buffer: need `reward.reward_kwargs.max_resp_len` ({max_resp_len}) >= overlong_buffer_cfg.len ({len}) > 0"
        ));
    }
    let log = cfg
        .get("log")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    Ok(Some(Overlong {
        len,
        penalty_factor,
        max_resp_len,
        log,
    }))
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
    /// Seconds one reward call may take before its worker is killed and replaced; null: 60
    /// (300 with `reward_manager.name=prime`, verl's PRIME limit).
    pub timeout_s: Option<f64>,
    /// raise | zero | skip: what a failed or timed-out reward call does; null: raise (zero with
    /// `reward_manager.name=prime`, which scores failures 0 as verl's PRIME manager does).
    pub on_error: Option<OnError>,
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
    timeout_s: None,
    on_error: None,
    control: RewardControlConfig::default(),
});
