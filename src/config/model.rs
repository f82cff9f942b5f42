//! `actor_rollout_ref.model.*` and `critic.model.*`: where the weights, tokenizer and chat
//! template come from. verl: `verl/trainer/config/model/hf_model.yaml`.

use serde::{Deserialize, Serialize};

use super::fields::FreeMap;
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
}

defaults!(ModelConfig {
    path: "~/models/deepseek-llm-7b-chat".into(),
    tokenizer_path: None,
    custom_chat_template: None,
    override_config: FreeMap::new(),
    enable_gradient_checkpointing: true,
});
