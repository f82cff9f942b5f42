//! The architecture hyper-parameters of an HF `config.json` (Llama family: Llama 2/3, SmolLM2,
//! Mistral-style GQA; Qwen2/Qwen2.5).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Which block layout the weights follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    /// `LlamaForCausalLM` (also SmolLM2, Mistral without sliding window): no projection biases
    /// unless `attention_bias`.
    Llama,
    /// `Qwen2ForCausalLM`: biases on the q/k/v projections.
    Qwen2,
}

/// Architectures this implementation loads.
pub const SUPPORTED: [&str; 6] = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "MistralForSequenceClassification",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelArgs {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 always; Llama when `attention_bias`).
    pub qkv_bias: bool,
    pub max_position_embeddings: usize,
    /// Labels of a sequence-classification head (`num_labels`), when the checkpoint has one.
    pub num_labels: Option<usize>,
}

fn get_usize(v: &Value, key: &str) -> Result<usize, String> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| format!("config.json: missing or non-integer `{key}`"))
}

impl ModelArgs {
    /// Reads an HF `config.json` value (after `override_config` entries were applied).
    pub fn from_hf(v: &Value) -> Result<Self, String> {
        let archs: Vec<&str> = v
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch = if archs.iter().any(|a| a.starts_with("Qwen2")) || model_type == "qwen2" {
            Arch::Qwen2
        } else if archs
            .iter()
            .any(|a| a.starts_with("Llama") || a.starts_with("Mistral"))
            || matches!(model_type, "llama" | "mistral")
        {
            Arch::Llama
        } else {
            return Err(format!(
                "config.json: unsupported architecture {:?} (model_type {model_type:?}); supported: {}",
                archs,
                SUPPORTED.join(", ")
            ));
        };
        if let Some(rs) = v.get("rope_scaling").filter(|r| !r.is_null()) {
            return Err(format!(
                "config.json: rope_scaling {rs} is not supported yet (plain RoPE only)"
            ));
        }
        let hidden_size = get_usize(v, "hidden_size")?;
        let heads = get_usize(v, "num_attention_heads")?;
        let kv = v
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(heads);
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(hidden_size / heads.max(1));
        if heads == 0 || kv == 0 || heads % kv != 0 {
            return Err(format!("config.json: num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv})"));
        }
        Ok(Self {
            arch,
            vocab_size: get_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size: get_usize(v, "intermediate_size")?,
            num_hidden_layers: get_usize(v, "num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim,
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope_theta: v
                .get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(10000.0),
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2
                || v.get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            num_labels: v
                .get("num_labels")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
        })
    }

    /// An HF `config.json` describing these arguments (for saving).
    pub fn to_hf(&self) -> Value {
        let (arch, model_type) = match self.arch {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        };
        serde_json::json!({
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        })
    }

    /// A tiny configuration for tests.
    pub fn tiny(arch: Arch, vocab_size: usize) -> Self {
        Self {
            arch,
            vocab_size,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_word_embeddings: arch == Arch::Llama,
            qkv_bias: arch == Arch::Qwen2,
            max_position_embeddings: 512,
            num_labels: None,
        }
    }
}
