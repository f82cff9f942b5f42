//! verl RL datasets → tokenised, left-padded prompt batches.
//!
//! - `read`: parquet / JSONL / JSON files → one JSON object per row (verl's columns kept as is),
//! - `sample`: a row → [`Sample`] (prompt messages, data_source, ground truth, extra_info),
//! - `template`: the model's Jinja chat template (HF `apply_chat_template` semantics),
//! - `tokenizer`: tokenizer, chat template and special tokens of an HF model directory,
//! - `dataset`: rendering, tokenising, sample limits, overlong filtering and truncation,
//! - `loader`: the seeded, resumable batch order and left-padded collation, or the order of a
//!   custom sampler ([`IndexSampler`], verl's `data.sampler`; its Python worker is `reward::sampler`),
//! - `numpy_rng`: NumPy's seeded `choice`, for verl's exact `*_max_samples` subsets,
//! - `image`: images of vision-language prompts → `pixel_values` / `image_grid_thw` and the
//!   expanded `<|image_pad|>` placeholders (transformers' Qwen2-VL image processor, bit-exact
//!   but for JPEG decoding),
//! - `vision`: a vision-language row's images (`data.image_key`) and its prompt's `<image>`
//!   markers as the chat template's content items.
//!
//! verl: `verl/utils/dataset/rl_dataset.py` (`RLHFDataset`), `examples/data_preprocess/gsm8k.py`.

pub mod dataset;
pub mod image;
pub mod loader;
pub mod numpy_rng;
pub mod read;
pub mod sample;
pub mod sft;
pub mod template;
pub mod tokenizer;
pub mod vision;

pub use dataset::{AgentRendering, DatasetOptions, PromptDataset};
pub use loader::{collate, BatchLoader, IndexSampler, LoaderCursor, PromptBatch, SamplerCursor};
pub use read::read_rows;
pub use sample::Sample;
pub use template::ChatTemplate;
pub use tokenizer::{SpecialTokens, TokenizerBundle};

/// A problem with the user's data, tokenizer or template. Messages name the file, the row
/// (0-based, as pandas shows it) and the column.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{file}: {message}")]
    File { file: String, message: String },
    #[error("{file}, row {row}, column `{column}`: {message}")]
    Row {
        file: String,
        row: usize,
        column: String,
        message: String,
    },
    #[error("{0}")]
    Other(String),
}

#[cfg(test)]
mod tests;
