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
    /// Prompts per generation batch with `algorithm.filter_groups.enable` (DAPO's dynamic
    /// sampling draws batches of this size until `train_batch_size` groups are kept); null =
    /// train_batch_size. Without filtering it must equal train_batch_size.
    pub gen_batch_size: Option<usize>,
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
    /// verl's loader worker processes. With a custom sampler (`data.sampler.class_path`) it must
    /// be 0, as verl asserts (workers would draw batches before a curriculum sampler's update);
    /// otherwise it has no effect here (the loader runs in the trainer's process).
    pub dataloader_num_workers: usize,
    /// A custom sampler class that orders the training data instead of data.shuffle.
    pub sampler: SamplerConfig,
    /// Column holding each row's images (vision-language models): a list of encoded images
    /// (`{"bytes": ..}` as verl's geo3k parquet stores them, `{"path": ..}`, `{"image": ..}`,
    /// raw bytes or a path), one per `<image>` in the prompt, in order.
    pub image_key: String,
    /// Column holding each row's videos; a row with videos is refused (video input is not
    /// supported).
    pub video_key: String,
    /// The vision tower's patch side in pixels (14 for Qwen2-VL and Qwen2.5-VL, 16 for
    /// Qwen3-VL): with the 2×2 merge it gives the multiple image sides are resized to before
    /// the processor runs (as verl's `process_image` asks qwen-vl-utils).
    pub image_patch_size: usize,
    /// Settings passed to the processor (`min_pixels`, `max_pixels`: the image area bounds
    /// in pixels); other keys are refused.
    pub mm_processor_kwargs: FreeMap,
}

/// `data.sampler.*` (verl's custom sampler, `create_rl_sampler`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplerConfig {
    /// The module of the sampler class: `pkg://package.module` (imported by name) or a Python file; null = data.shuffle orders the data.
    pub class_path: Option<String>,
    /// The sampler class (built as `cls(data_source=dataset, data_config=data)`, run in a Python worker on reward.python; see the data chapter).
    pub class_name: Option<String>,
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
    gen_batch_size: None,
    val_batch_size: None,
    shuffle: true,
    seed: None,
    validation_shuffle: false,
    filter_overlong_prompts: false,
    truncation: Truncation::Error,
    apply_chat_template_kwargs: FreeMap::new(),
    dataloader_num_workers: 8,
    sampler: SamplerConfig::default(),
    image_key: "images".into(),
    video_key: "videos".into(),
    image_patch_size: 14,
    mm_processor_kwargs: FreeMap::new(),
});

/// The longest prompt + response budget accepted whatever the model (2^20 tokens, far beyond
/// any context the supported models have): a budget above it is a typo, and honouring it would
/// ask for terabytes of padding and KV cache before any model could refuse it.
pub const MAX_SEQUENCE_TOKENS: usize = 1 << 20;

/// Rules on the token budgets that need no model: each of them, and their sum, at most
/// [`MAX_SEQUENCE_TOKENS`]. `prompt_length` / `response_length` are the resolved budgets
/// (`actor_rollout_ref.rollout.prompt_length` / `response_length` when set, else the `data.*` keys).
pub fn length_errors(prompt_length: usize, response_length: usize) -> Vec<String> {
    let mut errors = Vec::new();
    for (key, v) in [
        ("data.max_prompt_length", prompt_length),
        ("data.max_response_length", response_length),
    ] {
        if v > MAX_SEQUENCE_TOKENS {
            errors.push(format!(
                "`{key}` ({v}) is larger than any model's context; at most {MAX_SEQUENCE_TOKENS} tokens are accepted"
            ));
        }
    }
    let total = prompt_length.saturating_add(response_length);
    if errors.is_empty() && total > MAX_SEQUENCE_TOKENS {
        errors.push(format!(
            "`data.max_prompt_length` ({prompt_length}) + `data.max_response_length` ({response_length}) = {total} tokens; at most {MAX_SEQUENCE_TOKENS} are accepted"
        ));
    }
    errors
}

/// Prompt plus response must fit the model's context (`max_position_embeddings` of the model
/// that `model_key` = `model_path` names): a longer sequence has positions the model never saw,
/// and its caches and logits grow with the budget, not with the data.
pub fn check_model_context(
    prompt_length: usize,
    response_length: usize,
    max_position_embeddings: usize,
    model_key: &str,
    model_path: &str,
) -> Result<(), super::ConfigError> {
    let total = prompt_length.saturating_add(response_length);
    if total <= max_position_embeddings {
        return Ok(());
    }
    Err(super::ConfigError::Value {
        key: "data.max_prompt_length".into(),
        message: format!(
            "`data.max_prompt_length` ({prompt_length}) + `data.max_response_length` ({response_length}) = {total} tokens, \
             longer than the context of the model `{model_key}` = {model_path} (max_position_embeddings = {max_position_embeddings}); \
             lower them to sum to at most {max_position_embeddings} (data.filter_overlong_prompts drops prompts longer than \
             data.max_prompt_length, so it then keeps every sequence within the model's context)"
        ),
    })
}

#[cfg(test)]
mod length_tests {
    use super::*;

    #[test]
    fn huge_budgets_are_refused_without_a_model() {
        assert!(length_errors(512, 512).is_empty());
        assert!(length_errors(MAX_SEQUENCE_TOKENS - 1, 1).is_empty());
        let e = length_errors(4_000_000_000, 512);
        assert!(
            e.len() == 1 && e[0].contains("data.max_prompt_length") && e[0].contains("4000000000"),
            "{e:?}"
        );
        let e = length_errors(512, usize::MAX);
        assert!(e[0].contains("data.max_response_length"), "{e:?}");
        // Each fits, the sum does not.
        let e = length_errors(MAX_SEQUENCE_TOKENS, 1);
        assert!(e[0].contains("+"), "{e:?}");
    }

    #[test]
    fn the_model_context_bounds_prompt_plus_response() {
        check_model_context(8000, 192, 8192, "actor_rollout_ref.model.path", "m.gguf").unwrap();
        let e = check_model_context(8000, 193, 8192, "actor_rollout_ref.model.path", "m.gguf")
            .unwrap_err()
            .to_string();
        for want in [
            "data.max_prompt_length` (8000)",
            "data.max_response_length` (193)",
            "max_position_embeddings = 8192",
            "actor_rollout_ref.model.path` = m.gguf",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        // No overflow at the extremes.
        assert!(check_model_context(usize::MAX, usize::MAX, 8192, "k", "p").is_err());
    }
}
