//! `data.*`: which files to read, how prompts are built, batched, filtered and shuffled.
//! verl: `verl/trainer/config/data/legacy_data.yaml`.

use serde::{Deserialize, Serialize};

use super::fields::{nonpositive_none, FreeMap, OneOrMany};
use crate::defaults;

/// What to do with a prompt longer than `data.max_prompt_length` (verl's legacy
/// `RLHFDataset.truncation` semantics; the newest verl always left-truncates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncation {
    /// Stop with an error naming the file and row.
    Error,
    /// Keep the last `max_prompt_length` tokens.
    Left,
    /// Keep the first `max_prompt_length` tokens.
    Right,
    /// Keep the first `max_prompt_length / 2` and the last `max_prompt_length - max_prompt_length / 2` tokens.
    Middle,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Tokenizer path; null = the actor model's tokenizer.
    pub tokenizer: Option<String>,
    /// Training data: a path or a list of paths (.parquet, .jsonl, .json).
    pub train_files: OneOrMany,
    /// Validation data: a path or a list of paths.
    pub val_files: OneOrMany,
    /// Keep at most this many training rows (-1 = all): a random subset when data.shuffle
    /// (NumPy's `default_rng(seed).choice`, the rows verl keeps), else the first rows.
    #[serde(with = "nonpositive_none")]
    pub train_max_samples: Option<u64>,
    /// Keep at most this many validation rows (-1 = all): chosen like train_max_samples
    /// (data.shuffle decides, as in verl).
    #[serde(with = "nonpositive_none")]
    pub val_max_samples: Option<u64>,
    /// Column holding the chat prompt (a list of {role, content}).
    pub prompt_key: String,
    /// Column naming the reward source of each row.
    pub reward_fn_key: String,
    /// Prompt length budget in tokens (after the chat template).
    pub max_prompt_length: usize,
    /// Response length budget in tokens.
    pub max_response_length: usize,
    /// Prompts per training step.
    pub train_batch_size: usize,
    /// Prompts per validation batch; null = the whole validation set at once.
    pub val_batch_size: Option<usize>,
    /// Shuffle the training data each epoch; also makes *_max_samples keep a seeded random subset.
    pub shuffle: bool,
    /// Seed of the training shuffle and of the *_max_samples subset; null = 1 (verl's shuffle
    /// fallback; verl draws an unseeded subset then, here it stays reproducible).
    pub seed: Option<u64>,
    /// verl shuffles its validation loader with it; validation here runs in file order. It
    /// does not choose the val_max_samples subset (data.shuffle does).
    pub validation_shuffle: bool,
    /// Drop prompts longer than max_prompt_length when the dataset is built.
    pub filter_overlong_prompts: bool,
    /// What to do with a prompt longer than max_prompt_length: error | left | right | middle.
    pub truncation: Truncation,
    /// Extra variables for the chat template (e.g. enable_thinking).
    pub apply_chat_template_kwargs: FreeMap,
}

defaults!(DataConfig {
    tokenizer: None,
    train_files: OneOrMany::One("~/data/rlhf/gsm8k/train.parquet".into()),
    val_files: OneOrMany::One("~/data/rlhf/gsm8k/test.parquet".into()),
    train_max_samples: None,
    val_max_samples: None,
    prompt_key: "prompt".into(),
    reward_fn_key: "data_source".into(),
    max_prompt_length: 512,
    max_response_length: 512,
    train_batch_size: 1024,
    val_batch_size: None,
    shuffle: true,
    seed: None,
    validation_shuffle: false,
    filter_overlong_prompts: false,
    truncation: Truncation::Error,
    apply_chat_template_kwargs: FreeMap::new(),
});
