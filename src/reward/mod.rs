//! The reward stage: turns (data_source, response text, ground truth, extra_info) into scores.
//!
//! - `pystr`: the Python string semantics the scorers need,
//! - `scorers`: verl's built-in rule scorers and the `default` data_source dispatch,
//! - `native`: Rust reward functions registered by name,
//! - `tools`: the multi-turn agent loop's tools, run in sandboxed Python workers,
//! - `sampler`: verl's custom data sampler class (`data.sampler`), run in a Python worker beside
//!   the others and handed to the loader by the trainer.

pub mod manager;
pub mod model_source;
pub mod native;
pub mod pair_source;
pub mod placement;
pub mod pystr;
pub mod python;
pub mod sampler;
pub mod scorers;
pub mod tools;

use serde_json::{Map, Value};

pub use manager::{FailurePolicy, ModelContext, RewardBatch, RewardManager, SampleReward};
pub use native::{NativeRegistry, RewardFn};
pub use scorers::Builtin;

/// One response to score, with what a reward function may ask for.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ScoreRequest {
    pub data_source: String,
    pub solution_str: String,
    pub ground_truth: Value,
    pub extra_info: Value,
    /// The whole dataset row (for `data` / `row` / `item` parameters).
    pub row: Value,
}

impl ScoreRequest {
    /// The request for `solution_str`, a response to `sample`'s prompt.
    pub fn new(sample: &crate::data::Sample, solution_str: String) -> Self {
        Self {
            data_source: sample.data_source.clone(),
            solution_str,
            ground_truth: sample.ground_truth.clone(),
            extra_info: sample.extra_info.clone(),
            row: sample.raw.clone(),
        }
    }

    /// What a reward function sees.
    pub fn input(&self) -> ScoreInput<'_> {
        ScoreInput {
            data_source: &self.data_source,
            solution_str: &self.solution_str,
            ground_truth: &self.ground_truth,
            extra_info: &self.extra_info,
        }
    }
}

/// What a reward function sees for one response (verl's keyword arguments).
#[derive(Debug, Clone, Copy)]
pub struct ScoreInput<'a> {
    pub data_source: &'a str,
    /// The decoded response only, special tokens removed.
    pub solution_str: &'a str,
    pub ground_truth: &'a Value,
    pub extra_info: &'a Value,
}

/// A score and the extra values a scorer reported (`acc`, `pred`, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreResult {
    pub score: f64,
    pub extra: Map<String, Value>,
}

impl ScoreResult {
    /// A plain numeric score.
    pub fn number(score: f64) -> Self {
        Self {
            score,
            extra: Map::new(),
        }
    }
}

/// A reward problem: a bad configuration (found at start-up) or a failed scoring call.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    #[error("reward configuration: {0}")]
    Config(String),
    #[error("{0}")]
    Score(String),
}

#[cfg(test)]
mod pair_tests;
