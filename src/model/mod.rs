//! The causal LM (Llama / Qwen2 families), its heads and caches.
//!
//! - `config`: architecture hyper-parameters from an HF `config.json`,
//! - `transformer`: the differentiable decoder, caller-owned KV cache, chunked log-probs.

pub mod config;
pub mod transformer;

pub use config::{Arch, ModelArgs};
pub use transformer::{CausalLm, KvCache};

#[cfg(test)]
mod tests;
