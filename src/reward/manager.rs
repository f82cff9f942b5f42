//! The reward manager: builds the configured sources (verl's default when none are listed),
//! scores a batch of responses with every source, combines them by weight, applies the `dapo`
//! overlong penalty, and applies `reward.on_error` to failed calls.
//! verl: `verl/experimental/reward_loop/reward_manager/{naive,dapo}.py`, legacy `batch.py`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};

use super::model_source::{RewardModel, RewardModelOptions, RunningStats};
use super::python::{CallError, PoolSettings, PythonFunction, PythonPool};
use super::{Builtin, NativeRegistry, RewardError, RewardFn, ScoreRequest, ScoreResult};
use crate::config::reward::SourceSpec;
use crate::config::reward::{Gate, GateAction};
use crate::config::{OnError, RewardConfig, RewardManagerName};

enum Kind {
    Builtin(Builtin),
    Python(Box<PythonPool>),
    Native(Arc<dyn RewardFn>, Map<String, Value>),
    Model(Box<RewardModel>),
}

/// One weighted source.
pub struct Source {
    pub name: String,
    pub weight: f64,
    /// What it runs, for messages (`compute_score (rewards.py)`, `built-in gsm8k`, ...).
    pub label: String,
    /// A veto on this source's score.
    pub gate: Option<Gate>,
    kind: Kind,
}

/// DAPO's overlong-response penalty (`reward_kwargs.overlong_buffer_cfg`, `max_resp_len`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlong {
    pub len: f64,
    pub penalty_factor: f64,
    pub max_resp_len: f64,
    pub log: bool,
}

/// One response's reward.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SampleReward {
    /// The final reward; `None` when the sample is skipped (`on_error=skip`) or failed.
    pub score: Option<f64>,
    /// Each source's score (`None` where it failed).
    pub per_source: Vec<(String, Option<f64>)>,
    /// Extra values reported by the scorers (`acc`, `pred`, ...).
    pub extra: Map<String, Value>,
    /// The failure message, if a source failed.
    pub error: Option<String>,
    /// Left out of the policy update (`on_error=skip`).
    pub skipped: bool,
    /// Sources whose gate fired on this sample.
    pub gated: Vec<String>,
    /// Left out of the policy update by a `skip_update` gate.
    pub gate_skip: bool,
}

/// Counters since the manager started (`reward/errors`, `reward/timeouts`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RewardStats {
    pub errors: usize,
    pub timeouts: usize,
}

/// What happens to a failed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// `reward.on_error`.
    Config(OnError),
    /// Keep going and report each failure on its sample (the `reward score` tool).
    Collect,
}

/// Where reward models run and what they read (from the trainer's configuration).
#[derive(Debug, Clone)]
pub struct ModelContext {
    /// `trainer.device` (a source's own `device` wins).
    pub device: String,
    /// `data.prompt_key`: the chat messages a reward model sees before the response.
    pub prompt_key: String,
}

impl Default for ModelContext {
    fn default() -> Self {
        Self {
            device: "cpu".into(),
            prompt_key: "prompt".into(),
        }
    }
}

pub struct RewardManager {
    pub sources: Vec<Source>,
    policy: FailurePolicy,
    overlong: Option<Overlong>,
    pub stats: RewardStats,
}

/// A scored batch (verl's reward output): each response's reward, the scores placed on
/// tokens, and the rows left out of the update.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardBatch {
    pub rewards: Vec<SampleReward>,
    /// `token_level_scores`: each response's score on its last token (see
    /// [`super::placement`]); a row without a score holds zeros.
    pub token_level_scores: Vec<Vec<f32>>,
    /// Rows without a score (`on_error=skip`) or vetoed by a `skip_update` gate.
    pub excluded: Vec<bool>,
}

fn num(v: Option<&Value>, key: &str) -> Result<Option<f64>, RewardError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| {
            RewardError::Config(format!(
                "reward.reward_kwargs.{key} must be a number, got {x}"
            ))
        }),
    }
}

impl RewardManager {
    /// Builds the sources of `cfg`, starting Python workers (which loads the user's functions:
    /// a missing file or function fails here, before any model is loaded).
    pub fn from_config(cfg: &RewardConfig, native: &NativeRegistry) -> Result<Self, RewardError> {
        Self::from_config_with(cfg, native, &ModelContext::default())
    }

    /// [`RewardManager::from_config`] with reward models placed and fed as `ctx` says.
    pub fn from_config_with(
        cfg: &RewardConfig,
        native: &NativeRegistry,
        ctx: &ModelContext,
    ) -> Result<Self, RewardError> {
        let settings = PoolSettings {
            python: cfg.python.clone(),
            num_workers: cfg.num_workers,
            timeout: Duration::from_secs_f64(cfg.timeout_s),
        };
        let batch = cfg.reward_manager.name == RewardManagerName::Batch;
        let mut sources = Vec::new();
        if cfg.sources.is_empty() {
            let custom = &cfg.custom_reward_function;
            match &custom.path {
                Some(path) => {
                    let name = custom.name.clone().unwrap_or_else(|| "compute_score".into());
                    let func = PythonFunction { path: path.clone(), name: name.clone(), kwargs: custom.reward_kwargs.clone(), batch };
                    let pool = PythonPool::start(func, settings.clone())?;
                    sources.push(Source { label: format!("{name} ({path})"), name, weight: 1.0, gate: None, kind: Kind::Python(Box::new(pool)) });
                }
                None if batch => {
                    return Err(RewardError::Config(
                        "reward.reward_manager.name=batch calls a batch function (data_sources, solution_strs, ground_truths, extra_infos) and has no built-in default; set reward.custom_reward_function.path".into(),
                    ))
                }
                None => sources.push(Source { name: "default".into(), weight: 1.0, label: "built-in scorers by data_source".into(), gate: None, kind: Kind::Builtin(Builtin::Default) }),
            }
        } else {
            for (i, s) in cfg.sources.iter().enumerate() {
                let at = format!("reward.sources[{i}] ({})", s.name);
                let spec = s
                    .spec()
                    .map_err(|rule| RewardError::Config(format!("{at}: {rule}")))?;
                let (label, kind) = match spec {
                    SourceSpec::Builtin { scorer } => {
                        let b = Builtin::from_name(scorer, &s.kwargs)
                            .map_err(|e| RewardError::Config(format!("{at}: {e}")))?;
                        (format!("built-in {scorer}"), Kind::Builtin(b))
                    }
                    SourceSpec::Python { path, function } => {
                        let func = PythonFunction {
                            path: path.to_string(),
                            name: function.to_string(),
                            kwargs: s.kwargs.clone(),
                            batch,
                        };
                        let pool = PythonPool::start(func, settings.clone())
                            .map_err(|e| RewardError::Config(format!("{at}: {e}")))?;
                        (format!("{function} ({path})"), Kind::Python(Box::new(pool)))
                    }
                    SourceSpec::Native { function } => {
                        let f = native
                            .get(function)
                            .map_err(|e| RewardError::Config(format!("{at}: {e}")))?;
                        (
                            format!("native {function}"),
                            Kind::Native(f, s.kwargs.clone()),
                        )
                    }
                    SourceSpec::Model { path } => {
                        let rm = RewardModel::load(&RewardModelOptions {
                            path,
                            device: s.device.as_deref().unwrap_or(&ctx.device),
                            micro_batch_size: s.micro_batch_size.unwrap_or(8),
                            normalize: s.normalize,
                            clip: s.clip,
                            prompt_key: &ctx.prompt_key,
                        })
                        .map_err(|e| RewardError::Config(format!("{at}: {e}")))?;
                        (format!("reward model {path}"), Kind::Model(Box::new(rm)))
                    }
                };
                sources.push(Source {
                    name: s.name.clone(),
                    weight: s.weight,
                    label,
                    gate: s.gate,
                    kind,
                });
            }
        }
        // verl's `reward_model.enable`: the model's score is added to the rule/custom reward.
        let rm = &cfg.reward_model;
        if rm.enable {
            let path = rm.model_path.as_deref().ok_or_else(|| {
                RewardError::Config(
                    "reward.reward_model.enable=True needs reward.reward_model.model_path (legacy: reward_model.model.path)".into(),
                )
            })?;
            let model = RewardModel::load(&RewardModelOptions {
                path,
                device: &ctx.device,
                micro_batch_size: 8,
                normalize: false,
                clip: None,
                prompt_key: &ctx.prompt_key,
            })?;
            sources.push(Source {
                name: "reward_model".into(),
                weight: 1.0,
                label: format!("reward model {path}"),
                gate: None,
                kind: Kind::Model(Box::new(model)),
            });
        }
        let overlong = if cfg.reward_manager.name == RewardManagerName::Dapo {
            Self::overlong(&cfg.reward_kwargs)?
        } else {
            None
        };
        Ok(Self {
            sources,
            policy: FailurePolicy::Config(cfg.on_error),
            overlong,
            stats: RewardStats::default(),
        })
    }

    fn overlong(kw: &Map<String, Value>) -> Result<Option<Overlong>, RewardError> {
        let Some(cfg) = kw.get("overlong_buffer_cfg") else {
            return Ok(None);
        };
        if !cfg.get("enable").and_then(Value::as_bool).unwrap_or(false) {
            return Ok(None);
        }
        let len = num(cfg.get("len"), "overlong_buffer_cfg.len")?.unwrap_or(0.0);
        let penalty_factor = num(
            cfg.get("penalty_factor"),
            "overlong_buffer_cfg.penalty_factor",
        )?
        .unwrap_or(1.0);
        let max_resp_len = num(kw.get("max_resp_len"), "max_resp_len")?.ok_or_else(|| {
            RewardError::Config(
                "reward.reward_kwargs.max_resp_len is required with overlong_buffer_cfg.enable"
                    .into(),
            )
        })?;
        if !(len > 0.0 && max_resp_len >= len) {
            return Err(RewardError::Config(format!(
                "overlong buffer: need max_resp_len ({max_resp_len}) >= overlong_buffer_cfg.len ({len}) > 0"
            )));
        }
        let log = cfg.get("log").and_then(Value::as_bool).unwrap_or(false);
        Ok(Some(Overlong {
            len,
            penalty_factor,
            max_resp_len,
            log,
        }))
    }

    /// Each source's weight, by name.
    pub fn weights(&self) -> std::collections::BTreeMap<String, f64> {
        self.sources
            .iter()
            .map(|s| (s.name.clone(), s.weight))
            .collect()
    }

    /// Sets the weights of the named sources; an unknown name or a negative or non-finite
    /// weight changes nothing and is an error.
    pub fn set_weights(
        &mut self,
        weights: &std::collections::BTreeMap<String, f64>,
    ) -> Result<(), RewardError> {
        for (name, w) in weights {
            if !self.sources.iter().any(|s| &s.name == name) {
                return Err(RewardError::Config(format!(
                    "unknown reward source `{name}` (sources: {})",
                    self.sources
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
            if !(w.is_finite() && *w >= 0.0) {
                return Err(RewardError::Config(format!(
                    "the weight of `{name}` must be a finite number >= 0, got {w}"
                )));
            }
        }
        for s in &mut self.sources {
            if let Some(w) = weights.get(&s.name) {
                s.weight = *w;
            }
        }
        Ok(())
    }

    /// Running statistics of the normalising reward models, by source name (for checkpoints).
    pub fn model_stats(&self) -> std::collections::BTreeMap<String, RunningStats> {
        self.sources
            .iter()
            .filter_map(|s| match &s.kind {
                Kind::Model(m) => m.normalize.map(|st| (s.name.clone(), st)),
                _ => None,
            })
            .collect()
    }

    /// Restores what [`RewardManager::model_stats`] returned.
    pub fn restore_model_stats(
        &mut self,
        stats: &std::collections::BTreeMap<String, RunningStats>,
    ) {
        for s in &mut self.sources {
            if let (Kind::Model(m), Some(st)) = (&mut s.kind, stats.get(&s.name)) {
                if m.normalize.is_some() {
                    m.normalize = Some(*st);
                }
            }
        }
    }

    /// The manager with another failure policy (`reward.on_error` by default).
    pub fn with_policy(mut self, policy: FailurePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Scores `requests` and places the scores on their responses' tokens
    /// (`response_lens[i]` tokens each).
    pub fn score_batch(
        &mut self,
        requests: &[ScoreRequest],
        response_lens: &[usize],
    ) -> Result<RewardBatch, RewardError> {
        let rewards = self.score(requests, response_lens)?;
        let scores: Vec<f64> = rewards.iter().map(|r| r.score.unwrap_or(0.0)).collect();
        let token_level_scores =
            super::placement::place_rows(&scores, response_lens).map_err(RewardError::Score)?;
        let excluded = rewards
            .iter()
            .map(|r| r.skipped || r.score.is_none() || r.gate_skip)
            .collect();
        Ok(RewardBatch {
            rewards,
            token_level_scores,
            excluded,
        })
    }

    /// Process ids of every Python worker (for tests).
    pub fn python_pids(&self) -> Vec<u32> {
        self.sources
            .iter()
            .flat_map(|s| {
                if let Kind::Python(p) = &s.kind {
                    p.pids()
                } else {
                    Vec::new()
                }
            })
            .collect()
    }

    /// Scores `items` (with their response lengths in tokens, for the overlong penalty).
    /// Under `on_error=raise` the first failure is returned as an error naming the function,
    /// the sample and its data_source.
    pub fn score(
        &mut self,
        items: &[ScoreRequest],
        response_lens: &[usize],
    ) -> Result<Vec<SampleReward>, RewardError> {
        let policy = self.policy;
        let mut out: Vec<SampleReward> =
            (0..items.len()).map(|_| SampleReward::default()).collect();
        let single = self.sources.len() == 1;
        for src in &mut self.sources {
            let results: Vec<Result<ScoreResult, CallError>> = match &mut src.kind {
                Kind::Python(pool) => {
                    let before = pool.stats;
                    let r = pool.score(items);
                    self.stats.timeouts += pool.stats.timeouts - before.timeouts;
                    r
                }
                Kind::Builtin(b) => items
                    .iter()
                    .map(|it| {
                        b.score(&it.input()).map_err(|e| CallError::Exception {
                            message: e.to_string(),
                            traceback: String::new(),
                        })
                    })
                    .collect(),
                Kind::Native(f, kw) => items
                    .iter()
                    .map(|it| {
                        f.score(&it.input(), kw).map_err(|e| CallError::Exception {
                            message: e.to_string(),
                            traceback: String::new(),
                        })
                    })
                    .collect(),
                Kind::Model(m) => m.score(items),
            };
            for (i, (r, sample)) in results.into_iter().zip(out.iter_mut()).enumerate() {
                match r {
                    Ok(res) if res.score.is_finite() => {
                        sample.per_source.push((src.name.clone(), Some(res.score)));
                        if res.extra.is_empty() && single {
                            sample.extra.insert("acc".into(), Value::from(res.score));
                        }
                        for (k, v) in res.extra {
                            sample.extra.insert(
                                if single {
                                    k
                                } else {
                                    format!("{}/{k}", src.name)
                                },
                                v,
                            );
                        }
                    }
                    other => {
                        let err = match other {
                            Ok(res) => format!("returned a non-finite score ({})", res.score),
                            Err(e) => e.to_string(),
                        };
                        self.stats.errors += 1;
                        let msg = format!("reward source `{}` ({}) failed on sample {i} (data_source `{}`): {err}", src.name, src.label, items[i].data_source);
                        match policy {
                            FailurePolicy::Config(OnError::Raise) => {
                                return Err(RewardError::Score(msg))
                            }
                            FailurePolicy::Config(OnError::Zero) => {
                                sample.per_source.push((src.name.clone(), Some(0.0)))
                            }
                            FailurePolicy::Config(OnError::Skip) => {
                                sample.per_source.push((src.name.clone(), None));
                                sample.skipped = true;
                            }
                            FailurePolicy::Collect => {
                                sample.per_source.push((src.name.clone(), None))
                            }
                        }
                        sample.error.get_or_insert(msg);
                    }
                }
            }
        }
        let weights: Vec<f64> = self.sources.iter().map(|s| s.weight).collect();
        for (i, sample) in out.iter_mut().enumerate() {
            if sample.skipped || sample.per_source.iter().any(|(_, s)| s.is_none()) {
                continue;
            }
            let mut total: f64 = sample
                .per_source
                .iter()
                .zip(&weights)
                .map(|((_, s), w)| s.unwrap_or(0.0) * w)
                .sum();
            if let Some(o) = self.overlong {
                let len = response_lens.get(i).copied().unwrap_or(0) as f64;
                let expected = o.max_resp_len - o.len;
                let exceed = len - expected;
                let penalty = (-exceed / o.len * o.penalty_factor).min(0.0);
                total += penalty;
                if o.log {
                    sample
                        .extra
                        .insert("overlong_reward".into(), Value::from(penalty));
                    sample
                        .extra
                        .insert("overlong".into(), Value::from(exceed > 0.0));
                }
            }
            for (src, (_, score)) in self.sources.iter().zip(&sample.per_source) {
                let (Some(g), Some(score)) = (src.gate, score) else {
                    continue;
                };
                if *score < g.below {
                    sample.gated.push(src.name.clone());
                    match g.action {
                        GateAction::SkipUpdate => sample.gate_skip = true,
                        GateAction::ZeroReward => total = 0.0,
                        GateAction::Penalty => total += g.penalty,
                    }
                }
            }
            sample.score = Some(total);
        }
        Ok(out)
    }
}

#[cfg(test)]
#[path = "manager_tests.rs"]
mod tests;
