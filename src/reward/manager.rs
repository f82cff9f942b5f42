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
use crate::config::reward::{CheckedSource, Gate, GateAction, RewardPlan, SourceKind};
use crate::config::OnError;

pub use crate::config::reward::Overlong;

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

impl Source {
    /// Starts what `s` runs: Python workers, a registered function, a loaded reward model.
    fn build(
        s: &CheckedSource,
        (batch, positional): (bool, bool),
        settings: &PoolSettings,
        native: &NativeRegistry,
        ctx: &ModelContext,
    ) -> Result<Self, RewardError> {
        let kind = match &s.kind {
            SourceKind::Builtin { scorer, kwargs } => {
                Kind::Builtin(Builtin::from_name(scorer, kwargs)?)
            }
            SourceKind::Python {
                path,
                function,
                kwargs,
            } => {
                let func = PythonFunction {
                    path: path.clone(),
                    name: function.clone(),
                    kwargs: kwargs.clone(),
                    batch,
                    positional,
                };
                Kind::Python(Box::new(PythonPool::start(func, settings.clone())?))
            }
            SourceKind::Native { function, kwargs } => {
                Kind::Native(native.get(function)?, kwargs.clone())
            }
            SourceKind::Model {
                path,
                device,
                micro_batch_size,
                normalize,
                clip,
            } => Kind::Model(Box::new(RewardModel::load(&RewardModelOptions {
                path,
                device: device.as_deref().unwrap_or(&ctx.device),
                micro_batch_size: *micro_batch_size,
                normalize: *normalize,
                clip: *clip,
                prompt_key: &ctx.prompt_key,
            })?)),
        };
        Ok(Self {
            name: s.name.clone(),
            weight: s.weight,
            label: s.label.clone(),
            gate: s.gate,
            kind,
        })
    }

    /// Calls this source on every request (`timeouts` counts the calls that ran out of time).
    /// Each item's result. With `abort`, an error for the whole call when a built-in scorer has
    /// no rule for an item's data source (the configuration's to fix, whatever
    /// `reward.on_error` says); without (the `reward score` tool), that item's failure.
    fn call(
        &mut self,
        items: &[ScoreRequest],
        timeouts: &mut usize,
        abort: bool,
    ) -> Result<Vec<Result<ScoreResult, CallError>>, RewardError> {
        let exception = |e: RewardError| CallError::Exception {
            message: e.to_string(),
            traceback: String::new(),
        };
        Ok(match &mut self.kind {
            Kind::Python(pool) => {
                let before = pool.stats.timeouts;
                let r = pool.score(items);
                *timeouts += pool.stats.timeouts - before;
                r
            }
            Kind::Builtin(b) => {
                let mut out = Vec::with_capacity(items.len());
                for it in items {
                    out.push(match b.score(&it.input()) {
                        Err(RewardError::Config(m)) if abort => {
                            return Err(RewardError::Config(format!(
                                "reward source `{}` ({}): {m}",
                                self.name, self.label
                            )))
                        }
                        r => r.map_err(exception),
                    });
                }
                out
            }
            Kind::Native(f, kw) => items
                .iter()
                .map(|it| f.score(&it.input(), kw).map_err(exception))
                .collect(),
            Kind::Model(m) => m.score(items),
        })
    }
}

/// One response's reward.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
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
    /// The score before DAPO's overlong penalty (`None` when the sample has no score).
    #[serde(default)]
    pub unpenalised: Option<f64>,
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

impl RewardManager {
    /// Builds the sources of a checked reward plan ([`crate::config::RewardConfig::plan`]),
    /// starting Python workers (which loads the user's functions: a missing file or function
    /// fails here, before any model is loaded) and placing reward models as `ctx` says.
    pub fn new(
        plan: &RewardPlan,
        native: &NativeRegistry,
        ctx: &ModelContext,
    ) -> Result<Self, RewardError> {
        let settings = PoolSettings {
            python: plan.python.clone(),
            num_workers: plan.num_workers,
            timeout: Duration::from_secs_f64(plan.timeout_s),
        };
        let mut sources = Vec::new();
        for s in &plan.sources {
            let built = Source::build(s, (plan.batch, plan.positional), &settings, native, ctx);
            // A listed source's failure names its place in `reward.sources`.
            sources.push(match (built, s.index) {
                (Err(e), Some(i)) => {
                    return Err(RewardError::Config(format!(
                        "reward.sources[{i}] ({}): {e}",
                        s.name
                    )))
                }
                (built, _) => built?,
            });
        }
        Ok(Self {
            sources,
            policy: FailurePolicy::Config(plan.on_error),
            overlong: plan.overlong,
            stats: RewardStats::default(),
        })
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

    /// What to tell the user about `rows` (`(file, row, data_source, ground_truth)`) whose
    /// ground truth is a JSON number where a built-in source compares it as text (gsm8k): they
    /// score 0, in verl as here, and nothing else would say so. `None` when no row is such.
    pub fn numeric_ground_truth_warning<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a str, usize, &'a str, &'a Value)>,
    ) -> Option<String> {
        let scorers: Vec<(&str, &Builtin)> = self
            .sources
            .iter()
            .filter_map(|s| match &s.kind {
                Kind::Builtin(b) => Some((s.name.as_str(), b)),
                _ => None,
            })
            .collect();
        let mut count = 0usize;
        let mut first: Option<(&str, usize, &str, &Value, &str)> = None;
        for (file, row, source, gt) in rows {
            let Some((name, _)) = scorers
                .iter()
                .find(|(_, b)| gt.is_number() && b.is_gsm8k_for(source))
            else {
                continue;
            };
            count += 1;
            first.get_or_insert((file, row, source, gt, name));
        }
        let (file, row, source, gt, name) = first?;
        Some(format!(
            "{count} row(s) have a number as ground truth where the built-in gsm8k scorer compares text, so they score 0 (verl scores them 0 too); the first: {file}, row {row}, ground_truth {gt} (data_source `{source}`, reward source `{name}`). Write ground truths as strings (\"{gt}\")"
        ))
    }

    /// Whether a non-zero reward of a `data_source` row means a well-formed answer, the format
    /// rate validation reports: the reward is one built-in gsm8k source (with `format_score`
    /// credit, a well-formed wrong answer scores it; without, non-zero means right). A Python
    /// function with a floor (0.1 for any answer), other scorers or a weighted sum of sources
    /// give no such meaning.
    pub fn format_rate_applies(&self, data_source: &str) -> bool {
        match self.sources.as_slice() {
            [one] => matches!(&one.kind, Kind::Builtin(b) if b.is_gsm8k_for(data_source)),
            _ => false,
        }
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
        let mut out: Vec<SampleReward> =
            (0..items.len()).map(|_| SampleReward::default()).collect();
        let single = self.sources.len() == 1;
        for src in &mut self.sources {
            let abort = matches!(self.policy, FailurePolicy::Config(_));
            let results = src.call(items, &mut self.stats.timeouts, abort)?;
            for (i, (r, sample)) in results.into_iter().zip(out.iter_mut()).enumerate() {
                match r {
                    Ok(res) if res.score.is_finite() => sample.add_score(&src.name, res, single),
                    other => {
                        let err = match other {
                            Ok(res) => format!("returned a non-finite score ({})", res.score),
                            Err(e) => e.to_string(),
                        };
                        self.stats.errors += 1;
                        let msg = format!("reward source `{}` ({}) failed on sample {i} (data_source `{}`): {err}", src.name, src.label, items[i].data_source);
                        sample.add_failure(&src.name, msg, self.policy)?;
                    }
                }
            }
        }
        for (i, sample) in out.iter_mut().enumerate() {
            let len = response_lens.get(i).copied().unwrap_or(0);
            self.combine(sample, len);
        }
        Ok(out)
    }

    /// The final reward of a sample every source scored: the weighted sum, DAPO's overlong
    /// penalty for a response of `len` tokens, then the gates. A sample with a failed source
    /// keeps no score.
    fn combine(&self, sample: &mut SampleReward, len: usize) {
        if sample.skipped || sample.per_source.iter().any(|(_, s)| s.is_none()) {
            return;
        }
        let mut total: f64 = sample
            .per_source
            .iter()
            .zip(&self.sources)
            .map(|((_, s), src)| s.unwrap_or(0.0) * src.weight)
            .sum();
        sample.unpenalised = Some(total);
        if let Some(o) = self.overlong {
            let expected = o.max_resp_len - o.len;
            let exceed = len as f64 - expected;
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
}

impl SampleReward {
    /// Source `name`'s score and extras (prefixed with the source's name when there are
    /// several sources; a lone numeric result is also `acc`, as verl reports it).
    fn add_score(&mut self, name: &str, res: ScoreResult, single: bool) {
        self.per_source.push((name.to_string(), Some(res.score)));
        if res.extra.is_empty() && single {
            self.extra.insert("acc".into(), Value::from(res.score));
        }
        for (k, v) in res.extra {
            let key = if single { k } else { format!("{name}/{k}") };
            self.extra.insert(key, v);
        }
    }

    /// Source `name` failed with `msg`: `policy` decides whether the batch fails, the source
    /// scores 0, or the sample is skipped.
    fn add_failure(
        &mut self,
        name: &str,
        msg: String,
        policy: FailurePolicy,
    ) -> Result<(), RewardError> {
        let score = match policy {
            FailurePolicy::Config(OnError::Raise) => return Err(RewardError::Score(msg)),
            FailurePolicy::Config(OnError::Zero) => Some(0.0),
            FailurePolicy::Config(OnError::Skip) => {
                self.skipped = true;
                None
            }
            FailurePolicy::Collect => None,
        };
        self.per_source.push((name.to_string(), score));
        self.error.get_or_insert(msg);
        Ok(())
    }
}

#[cfg(test)]
#[path = "manager_tests.rs"]
mod tests;
