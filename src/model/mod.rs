//! The causal LM (Llama / Qwen2 families), its heads and caches.
//!
//! - `config`: architecture hyper-parameters from an HF `config.json`,
//! - `transformer`: the differentiable decoder, caller-owned KV cache, chunked log-probs,
//! - `gguf`: llama.cpp files (dequantised; tokenizer and chat template from the metadata),
//! - `heads`: the critic's value head and a reward model's score head,
//! - `hf`: HF directories (config.json + safetensors, sharded or not), load and save,
//! - `lora`: LoRA adapters on the projections, PEFT's adapter folder (read and write).

pub mod alloc;
pub mod bf16;
pub mod config;
pub mod decode;
pub mod gguf;
pub mod heads;
pub mod hf;
pub mod hub;
mod layer;
pub mod lora;
pub mod ops;
mod recompute;
pub(crate) mod simd;
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
pub use heads::{ScoreHead, ValueHead};
pub use transformer::{CausalLm, KvCache};

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
#[cfg(test)]
mod props;
#[cfg(test)]
mod tests;

/// A model and its tokenizer from `path`: a `.gguf` file, an HF directory, or a hub id found in
/// the HF cache (downloaded with the `hub` feature); tokenizer from `tokenizer_path` when given.
pub fn load_model_and_tokenizer(
    path: &str,
    tokenizer_path: Option<&str>,
    overrides: &serde_json::Map<String, serde_json::Value>,
    dtype: candle_core::DType,
    device: &candle_core::Device,
    with_lm_head: bool,
) -> Result<(hf::Loaded, crate::data::TokenizerBundle), ModelError> {
    let expanded = crate::util::expand_home(path);
    let p = Path::new(&expanded);
    let tok_from = |fallback: Option<crate::data::TokenizerBundle>| -> Result<crate::data::TokenizerBundle, ModelError> {
        match tokenizer_path {
            Some(t) => crate::data::TokenizerBundle::from_dir(Path::new(&crate::util::expand_home(t))).map_err(|e| ModelError::File { file: t.to_string(), message: e.to_string() }),
            None => fallback.ok_or_else(|| ModelError::file(p, "no tokenizer".into())),
        }
    };
    if p.is_file() && expanded.ends_with(".gguf") {
        let (loaded, content) = gguf::load(p, dtype, device, with_lm_head)?;
        let tok = if tokenizer_path.is_some() {
            tok_from(None)?
        } else {
            gguf::tokenizer(&content, p)?
        };
        return Ok((loaded, tok));
    }
    if p.is_dir() {
        let loaded = hf::load_dir(p, overrides, dtype, device, with_lm_head)?;
        let own = if tokenizer_path.is_none() {
            Some(
                crate::data::TokenizerBundle::from_dir(p)
                    .map_err(|e| ModelError::file(p, e.to_string()))?,
            )
        } else {
            None
        };
        return Ok((loaded, tok_from(own)?));
    }
    if is_hub_id(path) {
        let dir = hub::resolve(path)?;
        let loaded = hf::load_dir(&dir, overrides, dtype, device, with_lm_head)?;
        let own = if tokenizer_path.is_none() {
            Some(
                crate::data::TokenizerBundle::from_dir(&dir)
                    .map_err(|e| ModelError::file(&dir, e.to_string()))?,
            )
        } else {
            None
        };
        return Ok((loaded, tok_from(own)?));
    }
    Err(ModelError::file(p, "no such model: expected an HF model directory (config.json, model.safetensors, tokenizer.json) or a .gguf file".into()))
}

/// The hyper-parameters of the model at `path` (as [`load_model_and_tokenizer`] would read
/// them) without reading any weights: a GGUF file's header, an HF directory's `config.json`
/// (with `overrides`), or a hub id's cached `config.json`. `Ok(None)` when there is nothing to
/// read without a download (a hub id not in the cache).
pub fn read_args(
    path: &str,
    overrides: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<ModelArgs>, ModelError> {
    let expanded = crate::util::expand_home(path);
    let p = Path::new(&expanded);
    if p.is_file() && expanded.ends_with(".gguf") {
        let (_, c) = gguf::open(p)?;
        return gguf::read_args(&c, p).map(Some);
    }
    if p.is_dir() {
        return hf::read_config(p, overrides).map(Some);
    }
    if is_hub_id(path) {
        return match hub::cached_snapshot(path, &hub::cache_dir()) {
            Ok(dir) => hf::read_config(&dir, overrides).map(Some),
            Err(_) => Ok(None),
        };
    }
    Ok(None)
}

/// `org/name` that is no local path and no `.gguf` file: a model-hub id.
pub fn is_hub_id(path: &str) -> bool {
    let expanded = crate::util::expand_home(path);
    !Path::new(&expanded).exists()
        && !path.starts_with(['/', '.', '~'])
        && path.matches('/').count() == 1
        && !path.ends_with(".gguf")
}

/// The device `trainer.device` names (`auto`: CUDA when built with it and present, else CPU).
pub fn device(spec: &str) -> Result<candle_core::Device, ModelError> {
    device_at(spec, 0)
}

/// [`device`] for a data-parallel rank: `auto` and `cuda` take GPU `local_rank` (one GPU per
/// rank of a node); `cuda:N` stays the GPU it names.
pub fn device_at(spec: &str, local_rank: usize) -> Result<candle_core::Device, ModelError> {
    let cuda = |i: usize| {
        candle_core::Device::new_cuda(i).map_err(|e| ModelError::File { file: format!("trainer.device={spec}"), message: format!("CUDA device {i} is not available: {e} (build with --features cuda on a machine with an NVIDIA GPU)") })
    };
    match spec {
        "cpu" => Ok(candle_core::Device::Cpu),
        "auto" => Ok(if candle_core::utils::cuda_is_available() {
            cuda(local_rank)?
        } else {
            candle_core::Device::Cpu
        }),
        "cuda" => cuda(local_rank),
        s => match s.strip_prefix("cuda:").and_then(|i| i.parse().ok()) {
            Some(i) => cuda(i),
            None => Err(ModelError::File {
                file: "trainer.device".into(),
                message: format!("`{s}` is not cpu, cuda, cuda:N or auto"),
            }),
        },
    }
}
