//! The network: what the causal LM *is* and how its forwards run. Imports only `kernels`;
//! files on disk are `weights`.
//!
//! - `config`: architecture hyper-parameters (`ModelArgs`) from an HF `config.json` value,
//! - `ops`: element-wise compositions with backward passes (RMSNorm, sigmoid, upcasts),
//! - `proj`: one projection with its LoRA adapter and adapter dropout,
//! - `attention`: attention as one op that keeps no scores (blocked over queries, recomputed
//!   in backward; packed sequences without a mask), beside the plain composition,
//! - `block`: one decoder layer as a composition of candle ops (the reference), the attention
//!   mask and the composition's KV cache,
//! - `layer` + `recompute`: the hand-written layer (forward and backward) and per-layer
//!   recomputation on candle's autograd,
//! - `delta` + `delta_op`: Qwen3.5's Gated DeltaNet token mixer (chunk-wise delta rule, its
//!   decode state; the recurrence as one hand-written op with its backward on the CPU),
//! - `grad_sink`: weight gradients summed in one buffer each, in place, by the backward
//!   passes of the embedding lookup, the hand-written layer and the LM head (a trainer's scope),
//! - `lm_head`: the fused LM head + log-softmax + gather + entropy, beside its composition,
//! - `transformer`: `CausalLm` (embedding → layers → norm → head) and its execution settings,
//! - `heads`: the critic's value head and a reward model's score head,
//! - `deberta`: an encoder reward model (DeBERTa-v2/v3 sequence classification), inference only,
//! - `decode`: the no-grad decoding engine over ragged batches that rollout drives,
//! - `vision`: a vision-language model's vision tower and its multimodal rotary positions.

mod attention;
pub mod block;
pub mod config;
pub mod deberta;
pub mod decode;
mod delta;
mod delta_mix;
mod delta_op;
pub mod grad_sink;
pub mod heads;
mod layer;
pub mod lm_head;
mod mla;
mod ops;
pub mod proj;
mod recompute;
pub mod transformer;
pub mod vision;

use std::path::Path;

/// A problem with a model's files or settings: the message names the file (or key), tensor and
/// expectation.
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

pub use block::KvCache;
pub use config::{Arch, ModelArgs};
pub use heads::{ScoreHead, ValueHead};
pub use lm_head::{HeadOut, HeadStats};
pub use transformer::{CausalLm, Exec};

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
#[cfg(test)]
mod tests;

/// The device `trainer.device` names (`auto`: CUDA when built with it and present, else CPU).
pub fn device(spec: &str) -> Result<candle_core::Device, ModelError> {
    device_at(spec, 0)
}

/// [`device`] for a data-parallel rank: `auto` and `cuda` take GPU `local_rank` (one GPU per
/// rank of a node); `cuda:N` stays the GPU it names.
pub fn device_at(spec: &str, local_rank: usize) -> Result<candle_core::Device, ModelError> {
    let cuda = |i: usize| {
        let d = candle_core::Device::new_cuda(i).map_err(|e| ModelError::File { file: format!("trainer.device={spec}"), message: format!("CUDA device {i} is not available: {e} (build with --features cuda on a machine with an NVIDIA GPU)") })?;
        // Freed tensors stay in the memory pool for the next allocation (the pool would hand
        // them back to the driver at every synchronisation otherwise).
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(c) = &d {
            crate::kernels::cuda::memory::keep_freed_memory(c)?;
        }
        Ok(d)
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
