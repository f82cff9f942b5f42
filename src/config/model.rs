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
    lora_rank: 0,
    lora_alpha: 16,
    target_modules: OneOrMany::One("all-linear".into()),
    exclude_modules: None,
    lora_adapter_path: None,
});
