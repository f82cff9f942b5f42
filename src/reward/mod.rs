//! The reward stage: turns (data_source, response text, ground truth, extra_info) into scores.
//!
//! - `pystr`: the Python string semantics the scorers need,
//! - `scorers`: verl's built-in rule scorers and the `default` data_source dispatch,
//! - `native`: Rust reward functions registered by name.

pub mod manager;
pub mod model_source;
pub mod native;
pub mod placement;
pub mod pystr;
pub mod python;
pub mod scorers;

use serde_json::{Map, Value};

pub use manager::{FailurePolicy, ModelContext, RewardManager, SampleReward};
pub use native::{NativeRegistry, RewardFn};
pub use python::Item;
pub use scorers::Builtin;

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
