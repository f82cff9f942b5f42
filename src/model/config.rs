//! The architecture hyper-parameters of an HF `config.json` (Llama family: Llama 2/3, SmolLM2,
//! Mistral-style GQA; Qwen2/Qwen2.5; Qwen3), in the layout of transformers 4 (`rope_theta`,
//! `rope_scaling`) or 5 (`rope_parameters`), and the rotary frequencies they define
//! (transformers' `modeling_rope_utils`: default and llama3).

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
    /// `Qwen3ForCausalLM`: an RMSNorm over each head of q and of k before RoPE (`q_norm`,
    /// `k_norm`, weight `[head_dim]`), an explicit `head_dim`, biases only with `attention_bias`.
    Qwen3,
}

impl Arch {
    /// Whether each head of q and k goes through an RMSNorm before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3)
    }

    /// The `architectures` entry and `model_type` a causal LM of this layout is saved with.
    pub fn hf_names(self) -> (&'static str, &'static str) {
        match self {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
        }
    }
}

/// The `architectures` (`config.json`) this implementation loads, and the block layout each
/// follows: causal LMs, and the token- and sequence-classification models critics and reward
/// models are (their backbone plus a `score` head).
pub const ARCHITECTURES: [(&str, Arch); 12] = [
    ("LlamaForCausalLM", Arch::Llama),
    ("LlamaForTokenClassification", Arch::Llama),
    ("LlamaForSequenceClassification", Arch::Llama),
    ("MistralForCausalLM", Arch::Llama),
    ("MistralForTokenClassification", Arch::Llama),
    ("MistralForSequenceClassification", Arch::Llama),
    ("Qwen2ForCausalLM", Arch::Qwen2),
    ("Qwen2ForTokenClassification", Arch::Qwen2),
    ("Qwen2ForSequenceClassification", Arch::Qwen2),
    ("Qwen3ForCausalLM", Arch::Qwen3),
    ("Qwen3ForTokenClassification", Arch::Qwen3),
    ("Qwen3ForSequenceClassification", Arch::Qwen3),
];

/// `model_type`s read when a config has no `architectures`.
const MODEL_TYPES: [(&str, Arch); 4] = [
    ("llama", Arch::Llama),
    ("mistral", Arch::Llama),
    ("qwen2", Arch::Qwen2),
    ("qwen3", Arch::Qwen3),
];

/// The block layout of a config: from `architectures` (every entry must be one this
/// implementation loads), else from `model_type`; anything else is refused by name with the
/// supported list (no fallback to Llama).
pub fn arch_of(v: &Value) -> Result<Arch, String> {
    let archs: Vec<&str> = v
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let model_type = v.get("model_type").and_then(Value::as_str);
    let supported = || {
        ARCHITECTURES
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if archs.is_empty() {
        return match model_type.and_then(|t| MODEL_TYPES.iter().find(|(m, _)| *m == t)) {
            Some(&(_, a)) => Ok(a),
            None => Err(format!(
                "config.json: model_type {model_type:?} (no `architectures`) is not a supported architecture; supported: {}",
                supported()
            )),
        };
    }
    let mut found = None;
    for name in &archs {
        match ARCHITECTURES.iter().find(|(n, _)| n == name) {
            Some(&(_, a)) if found.is_none_or(|f| f == a) => found = Some(a),
            Some(_) => {
                return Err(format!(
                    "config.json: architectures {archs:?} name different layouts"
                ))
            }
            None => {
                return Err(format!(
                    "config.json: architecture `{name}` is not supported; supported: {}",
                    supported()
                ))
            }
        }
    }
    Ok(found.expect("architectures is not empty"))
}

/// RoPE frequency scaling (`rope_type` other than `default`). Only Llama 3.x's is supported;
/// other types are refused when the config is read.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.1+: wavelengths longer than `original_max_position_embeddings / low_freq_factor`
    /// are stretched by `factor`, shorter than `.. / high_freq_factor` kept, and the band
    /// between interpolated smoothly (transformers' `_compute_llama3_parameters`).
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: u64,
    },
}

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
    /// RoPE scaling; `None` = plain RoPE (`rope_type: default`).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 always; Llama and Qwen3 when `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama and Qwen3 when `attention_bias`;
    /// never in Qwen2).
    #[serde(default)]
    pub o_bias: bool,
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

/// Where transformers keeps the RoPE settings: `rope_parameters` (transformers ≥ 5: theta,
/// type and the scaling's fields together) and the older top-level `rope_theta` with a
/// `rope_scaling` object (`rope_type`, or `type` before 4.45). Both may be present (files
/// written for both versions); where they disagree on a value the file is refused rather than
/// one silently winning.
fn read_rope(v: &Value) -> Result<(f64, Option<RopeScaling>), String> {
    let params = match v.get("rope_parameters") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => {
            if let Some((k, _)) = o.iter().find(|(_, x)| x.is_object()) {
                return Err(format!(
                    "config.json: rope_parameters.{k}: RoPE settings per attention type are not supported (one rope_parameters object for every layer only)"
                ));
            }
            Some(o)
        }
        Some(other) => {
            return Err(format!(
                "config.json: rope_parameters must be an object, found {other}"
            ))
        }
    };
    let legacy = match v.get("rope_scaling") {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => Some(o),
        Some(other) => {
            return Err(format!(
                "config.json: rope_scaling must be an object or null, found {other}"
            ))
        }
    };
    let number = |key: &str, x: &Value| -> Result<f64, String> {
        x.as_f64()
            .ok_or_else(|| format!("config.json: {key} must be a number, found {x}"))
    };
    // rope_theta: top level and/or rope_parameters.rope_theta.
    let top = v
        .get("rope_theta")
        .filter(|x| !x.is_null())
        .map(|x| number("rope_theta", x))
        .transpose()?;
    let nested = params
        .and_then(|p| p.get("rope_theta"))
        .filter(|x| !x.is_null())
        .map(|x| number("rope_parameters.rope_theta", x))
        .transpose()?;
    let theta = match (top, nested) {
        (Some(a), Some(b)) if a != b => {
            return Err(format!(
                "config.json: rope_theta ({a}) and rope_parameters.rope_theta ({b}) disagree; keep one or make them equal"
            ))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => 10000.0,
    };
    // The scaling type and its fields, from either object.
    let kind_of = |o: &serde_json::Map<String, Value>,
                   name: &str|
     -> Result<Option<(String, String)>, String> {
        for key in ["rope_type", "type"] {
            match o.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(t)) => return Ok(Some((t.clone(), format!("{name}.{key}")))),
                Some(x) => {
                    return Err(format!(
                        "config.json: {name}.{key} must be a string, found {x}"
                    ))
                }
            }
        }
        Ok(None)
    };
    let from_params = match params {
        Some(p) => kind_of(p, "rope_parameters")?.map(|k| (k, p, "rope_parameters")),
        None => None,
    };
    let from_legacy = match legacy {
        Some(p) => Some((
            kind_of(p, "rope_scaling")?.ok_or(
                "config.json: rope_scaling has no rope_type (or type); say which RoPE scaling it is",
            )?,
            p,
            "rope_scaling",
        )),
        None => None,
    };
    let chosen = match (from_params, from_legacy) {
        (Some(a), Some(b)) => {
            if a.0 .0 != b.0 .0 {
                return Err(format!(
                    "config.json: {} ({:?}) and {} ({:?}) disagree",
                    a.0 .1, a.0 .0, b.0 .1, b.0 .0
                ));
            }
            // The same type: every scaling field present in both must agree.
            for (k, x) in b.1 {
                if let Some(y) = a.1.get(k) {
                    if k != "type" && k != "rope_type" && x != y {
                        return Err(format!(
                            "config.json: rope_scaling.{k} ({x}) and rope_parameters.{k} ({y}) disagree"
                        ));
                    }
                }
            }
            Some(a)
        }
        (a, b) => a.or(b),
    };
    let Some(((kind, kind_key), fields, name)) = chosen else {
        return Ok((theta, None));
    };
    let field = |k: &str| -> Result<f64, String> {
        let key = format!("{name}.{k}");
        match fields.get(k) {
            None | Some(Value::Null) => Err(format!(
                "config.json: {key} is missing; rope_type {kind:?} needs it"
            )),
            Some(x) => number(&key, x),
        }
    };
    let scaling = match kind.as_str() {
        "default" => None,
        "llama3" => {
            let (factor, low, high) = (
                field("factor")?,
                field("low_freq_factor")?,
                field("high_freq_factor")?,
            );
            let context = field("original_max_position_embeddings")?;
            if context.fract() != 0.0 || context <= 0.0 {
                return Err(format!("config.json: {name}.original_max_position_embeddings ({context}) must be a positive integer"));
            }
            if !(factor > 0.0 && low > 0.0 && high > low) {
                return Err(format!(
                    "config.json: {name}: llama3 RoPE needs factor > 0 and 0 < low_freq_factor < high_freq_factor (got {factor}, {low}, {high})"
                ));
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: context as u64,
            })
        }
        other => {
            return Err(format!(
                "config.json: {kind_key} {other:?} is not supported (supported: \"default\", \"llama3\"); it changes the rotary frequencies, so the model cannot run without it"
            ))
        }
    };
    Ok((theta, scaling))
}

/// Keys that would change the computation in ways this implementation does not follow: refused
/// by name instead of silently ignored.
fn refuse_unsupported(v: &Value) -> Result<(), String> {
    for key in [
        "partial_rotary_factor",
        "rope_parameters.partial_rotary_factor",
    ] {
        let x = match key.split_once('.') {
            Some((a, b)) => v.get(a).and_then(|o| o.get(b)),
            None => v.get(key),
        };
        if let Some(x) = x.filter(|x| !x.is_null()) {
            if x.as_f64() != Some(1.0) {
                return Err(format!(
                    "config.json: {key} ({x}) is not supported (rotary embeddings over the whole head only)"
                ));
            }
        }
    }
    if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(format!(
                "config.json: hidden_act {act:?} is not supported (SwiGLU with silu only)"
            ));
        }
    }
    if v.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
        return Err(
            "config.json: mlp_bias true is not supported (MLP projections without bias only)"
                .into(),
        );
    }
    if v.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err(
            "config.json: use_sliding_window true is not supported (full attention only)".into(),
        );
    }
    Ok(())
}

impl ModelArgs {
    /// Reads an HF `config.json` value (after `override_config` entries were applied).
    pub fn from_hf(v: &Value) -> Result<Self, String> {
        let arch = arch_of(v)?;
        let attention_bias = v
            .get("attention_bias")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let (rope_theta, rope_scaling) = read_rope(v)?;
        refuse_unsupported(v)?;
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
            rope_theta,
            rope_scaling,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: arch != Arch::Qwen2 && attention_bias,
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

    /// RoPE inverse frequencies `[head_dim / 2]`: `θ^(−2i/d)`, then the scaling's adjustment.
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let plain = (0..self.head_dim / 2).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d));
        match self.rope_scaling {
            None => plain.collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: context,
            }) => plain
                .map(|f| (f, context as f64))
                .map(|(f, context)| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < context / high {
                        f
                    } else if wavelen > context / low {
                        f / factor
                    } else {
                        let smooth = (context / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect(),
        }
    }

    /// The RoPE settings as transformers 5 writes them (`rope_parameters`).
    fn rope_parameters(&self) -> Value {
        let mut p = match self.rope_scaling {
            None => serde_json::json!({"rope_type": "default"}),
            Some(s) => serde_json::to_value(s).expect("plain numbers"),
        };
        p["rope_theta"] = serde_json::json!(self.rope_theta);
        p
    }

    /// An HF `config.json` describing these arguments (for saving). The RoPE settings are
    /// written in both layouts, `rope_theta` + `rope_scaling` (transformers 4) and
    /// `rope_parameters` (transformers 5), with the same values, so both read it alike.
    pub fn to_hf(&self) -> Value {
        let (arch, model_type) = self.arch.hf_names();
        let rope_scaling = match self.rope_scaling {
            None => Value::Null,
            Some(_) => {
                let mut p = self.rope_parameters();
                if let Some(o) = p.as_object_mut() {
                    o.remove("rope_theta");
                }
                p
            }
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
            "rope_scaling": rope_scaling,
            "rope_parameters": self.rope_parameters(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias && self.arch != Arch::Qwen2,
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
            rope_scaling: None,
            tie_word_embeddings: arch == Arch::Llama,
            qkv_bias: arch == Arch::Qwen2,
            o_bias: false,
            max_position_embeddings: 512,
            num_labels: None,
        }
    }
}
