//! The causal LM (Llama / Qwen2 families), its heads and caches.
//!
//! - `config`: architecture hyper-parameters from an HF `config.json`,
//! - `transformer`: the differentiable decoder, caller-owned KV cache, chunked log-probs,
//! - `gguf`: llama.cpp files (dequantised; tokenizer and chat template from the metadata),
//! - `hf`: HF directories (config.json + safetensors, sharded or not), load and save.

pub mod config;
pub mod gguf;
pub mod hf;
pub mod transformer;

use std::path::Path;

/// A problem with model files: the message names the file, tensor and expectation.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{file}: {message}")]
    File { file: String, message: String },
    #[error("{file}: no tensor `{name}` in the checkpoint")]
    Missing { name: String, file: String },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    pub(crate) fn file(path: &Path, message: String) -> Self {
        ModelError::File {
            file: path.display().to_string(),
            message,
        }
    }
}

pub use config::{Arch, ModelArgs};
pub use transformer::{CausalLm, KvCache};

#[cfg(test)]
mod tests;
