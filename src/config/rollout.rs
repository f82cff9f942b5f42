//! `actor_rollout_ref.rollout.*`: sampling settings and the log-prob pass over rollouts.
//! verl: `verl/trainer/config/rollout/rollout.yaml`, `RolloutConfig`, `SamplingConfig`.

use serde::{Deserialize, Serialize};

use super::fields::negative_none;
use super::model::Precision;
use crate::defaults;

/// `rollout.val_kwargs`: sampling for validation (greedy by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    /// Top-k cut-off; -1 (or 0) = off.
    pub top_k: i64,
    /// Nucleus cut-off in (0, 1].
    pub top_p: f64,
    /// Softmax temperature; 0 = greedy, > 0 samples (whatever do_sample says, as in verl).
    pub temperature: f64,
    /// Responses per prompt.
    pub n: usize,
    /// Accepted for verl's configs and not read by the rollout (verl's agent loop ignores it
    /// too): temperature alone decides between greedy and sampling.
    pub do_sample: bool,
}

defaults!(SamplingConfig {
    top_k: -1,
    top_p: 1.0,
    temperature: 0.0,
    n: 1,
    do_sample: false
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Softmax temperature of training rollouts (0 = greedy); old, reference and update
    /// log-probs divide the logits by it too, as verl does.
    pub temperature: f64,
    /// Top-k cut-off; -1 (or 0) = off.
    pub top_k: i64,
    /// Nucleus cut-off in (0, 1].
    pub top_p: f64,
    /// Accepted for verl's configs and not read by the rollout (verl's agent loop ignores it
    /// too): temperature alone decides between greedy and sampling.
    pub do_sample: bool,
    /// Responses per prompt.
    pub n: usize,
    /// Seed of the sampler.
    pub seed: u64,
    /// Prompt budget; null = data.max_prompt_length.
    #[serde(with = "negative_none")]
    pub prompt_length: Option<u64>,
    /// Response budget; null = data.max_response_length.
    #[serde(with = "negative_none")]
    pub response_length: Option<u64>,
    /// Keep generating past EOS up to response_length.
    pub ignore_eos: bool,
    /// Sequences generated at once at most (continuous batching: finished ones make room).
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled in one generation step at most.
    pub max_num_batched_tokens: usize,
    /// Key/value cache memory of the sequences in flight at most, in GB, on the CPU (ours; on CUDA gpu_memory_utilization sizes it).
    pub kv_cache_memory_gb: f64,
    /// On CUDA, the share of the GPU's memory that generation's keys and values may fill, less what the run already holds there (verl's vLLM setting); the CPU reads kv_cache_memory_gb.
    pub gpu_memory_utilization: f64,
    /// Deprecated global micro-batch size of the old-log-prob pass; use the _per_gpu key.
    pub log_prob_micro_batch_size: Option<usize>,
    /// Sequences per forward pass when recomputing old log-probs.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Token-budget micro-batches for that pass; null = actor.use_dynamic_bsz.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// Token budget for that pass; null = actor.ppo_max_token_len_per_gpu.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    /// Validation sampling.
    pub val_kwargs: SamplingConfig,
    /// Precision of generation's products: float32 (our default on the CPU) or bfloat16 (verl's default; AMX tiles or AVX512-BF16 on the CPU, cuBLAS on CUDA).
    pub dtype: Precision,
    /// Keep each sampled token's log-probability (`rollout_log_probs`): rollout correction
    /// needs them, and with them every step logs how far the rollout's numbers are from the
    /// trainer's (`training/rollout_probs_diff_*`, `rollout_corr/*` diagnostics).
    pub calculate_log_probs: bool,
}

defaults!(RolloutConfig {
    temperature: 1.0,
    top_k: -1,
    top_p: 1.0,
    do_sample: true,
    n: 1,
    seed: 42,
    prompt_length: None,
    response_length: None,
    ignore_eos: false,
    max_num_seqs: 256,
    max_num_batched_tokens: 8192,
    kv_cache_memory_gb: 2.0,
    gpu_memory_utilization: 0.5,
    log_prob_micro_batch_size: None,
    log_prob_micro_batch_size_per_gpu: None,
    log_prob_use_dynamic_bsz: None,
    log_prob_max_token_len_per_gpu: None,
    val_kwargs: SamplingConfig::default(),
    dtype: Precision::Fp32,
    calculate_log_probs: true,
});
