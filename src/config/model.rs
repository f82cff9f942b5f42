//! `actor_rollout_ref.model.*` and `critic.model.*`: where the weights, tokenizer and chat
//! template come from. verl: `verl/trainer/config/model/hf_model.yaml`.

use serde::{Deserialize, Serialize};

use super::fields::{FreeMap, OneOrMany};
use crate::defaults;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// An HF model directory, a .gguf file, or a hub id.
    pub path: String,
    /// Tokenizer location; null = the model path.
    pub tokenizer_path: Option<String>,
    /// Jinja chat template that replaces the tokenizer's own.
    pub custom_chat_template: Option<String>,
    /// Entries that replace fields of the model's config.json (e.g. rope_theta).
    pub override_config: FreeMap,
    /// Recompute each layer in backward instead of keeping its activations (CPU): same gradients, much less memory, about one extra forward.
    pub enable_gradient_checkpointing: bool,
    /// Train and score sequences packed end to end instead of padded to the micro-batch's longest prompt and response (CPU f32 models; elsewhere padded): same results, no work on padding.
    pub use_remove_padding: bool,
    /// LoRA rank; 0 = off (full fine-tuning). Positive: frozen base, trainable adapters (e.g. 32).
    pub lora_rank: usize,
    /// LoRA scaling factor: adapters are scaled by lora_alpha / lora_rank.
    pub lora_alpha: usize,
    /// Projections that get adapters: all-linear, a list of module names (q_proj, ...), or a regular expression matching whole names.
    pub target_modules: OneOrMany,
    /// Projections left without adapters (list of names or a regular expression); null = none.
    pub exclude_modules: Option<OneOrMany>,
    /// A PEFT adapter folder (ours or PEFT's) to start from; its adapter_config.json sets rank, alpha and targets.
    pub lora_adapter_path: Option<String>,
    /// critic.model only (verl's critic keeps it here): the critic's mixed precision; the actor's is actor_rollout_ref.actor.fsdp_config.
    pub fsdp_config: FsdpConfig,
}

/// Precision of a model's matrix products: verl's `fsdp_config.mixed_precision.param_dtype`
/// (`bf16`/`fp32`) and `rollout.dtype` (`bfloat16`/`float32`) spellings are both accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Precision {
    /// f32 products (our default on the CPU).
    #[serde(rename = "fp32", alias = "float32")]
    Fp32,
    /// bf16 operands, f32 sums, f32 weights and optimizer state (verl's default on GPUs); on
    /// the CPU it runs on AMX tiles or AVX512-BF16 dot products where the CPU has them, and as
    /// f32 elsewhere; on CUDA as bf16 cuBLAS products of the f32 weights.
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
}

impl Precision {
    pub fn is_bf16(self) -> bool {
        self == Precision::Bf16
    }
}

/// verl's `fsdp_config.mixed_precision` (its other keys have no effect here: weights, gradient
/// reductions and buffers are f32).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MixedPrecision {
    /// Precision of the forward and backward products: fp32 (our default) or bf16 (verl's default on GPUs; on the CPU AMX, AVX512-BF16, BFDOT, or bf16 operands widened for f32 FMA; cuBLAS on CUDA).
    pub param_dtype: Precision,
}

defaults!(MixedPrecision {
    param_dtype: Precision::Fp32,
});

/// The part of verl's `fsdp_config` that applies to one process: the weights' dtype and the
/// products' precision.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// The dtype the weights are loaded, kept and updated in (verl's `model_dtype`): fp32 (default), or bf16: weights, gradients and AdamW's moments in bf16, as torch.optim.AdamW keeps the state of bf16 parameters; products bf16 with f32 sums.
    pub model_dtype: Precision,
    /// Mixed precision of the model's products.
    pub mixed_precision: MixedPrecision,
}

defaults!(FsdpConfig {
    model_dtype: Precision::Fp32,
    mixed_precision: MixedPrecision::default(),
});

impl FsdpConfig {
    /// The candle dtype of the weights `model_dtype` asks for.
    pub fn weights_dtype(&self) -> candle_core::DType {
        match self.model_dtype {
            Precision::Fp32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
        }
    }
}

impl ModelConfig {
    /// Whether the model trains LoRA adapters (verl: lora_rank > 0 or a lora_adapter_path).
    pub fn is_lora(&self) -> bool {
        self.lora_rank > 0 || self.lora_adapter_path.is_some()
    }
}

defaults!(ModelConfig {
    path: "~/models/deepseek-llm-7b-chat".into(),
    tokenizer_path: None,
    custom_chat_template: None,
    override_config: FreeMap::new(),
    enable_gradient_checkpointing: true,
    use_remove_padding: true,
    lora_rank: 0,
    lora_alpha: 16,
    target_modules: OneOrMany::One("all-linear".into()),
    exclude_modules: None,
    lora_adapter_path: None,
    fsdp_config: FsdpConfig::default(),
});
