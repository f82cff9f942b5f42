//! The architecture hyper-parameters of an HF `config.json` (Llama family: Llama 2/3, SmolLM2,
//! Mistral-style GQA, Seed-OSS; Qwen2/Qwen2.5, MiMo; Qwen3; Qwen3-MoE; Gemma 3 text; DeepSeek-V3,
//! whose own keys `config_deepseek.rs` reads, and GLM-4.5, whose experts are DeepSeek's; GPT-OSS), in the layout of transformers 4 (`rope_theta`,
//! `rope_scaling`) or 5 (`rope_parameters`), and the rotary frequencies they define
//! (transformers' `modeling_rope_utils`: default, llama3, linear, and yarn for DeepSeek-V3).

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[path = "config_deepseek.rs"]
mod deepseek;
pub use deepseek::{DeepseekRouting, MlaArgs};

/// Which block layout the weights follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Arch {
    /// `LlamaForCausalLM` (also SmolLM2, Mistral without sliding window): no projection biases
    /// unless `attention_bias`.
    Llama,
    /// `Qwen2ForCausalLM`: biases on the q/k/v projections.
    Qwen2,
    /// `SeedOssForCausalLM` (transformers' `seed_oss`, ByteDance Seed-OSS): Llama's layer with
    /// q/k/v biases from `attention_bias` (default true) and an o_proj bias from
    /// `attention_out_bias` (default false), each on its own; an explicit `head_dim`.
    SeedOss,
    /// `MiMoForCausalLM` (Xiaomi MiMo, remote code `modeling_mimo.py` of the hub's
    /// XiaomiMiMo/MiMo-7B-*): Qwen2's model, whose forward it inherits unchanged, plus
    /// `num_nextn_predict_layers` multi-token-prediction layers `model.mtp_layers.N.*` that the
    /// forward never runs. Those are read and kept (saved back as read), not trained.
    MiMo,
    /// `Qwen3ForCausalLM`: an RMSNorm over each head of q and of k before RoPE (`q_norm`,
    /// `k_norm`, weight `[head_dim]`), an explicit `head_dim`, biases only with `attention_bias`.
    Qwen3,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention, and on its sparse layers a mixture of experts
    /// (`mlp.gate` router `[experts, hidden]`, `mlp.experts.N.{gate,up,down}_proj`) in place of
    /// the dense MLP ([`MoeArgs`]).
    Qwen3Moe,
    /// `Qwen2MoeForCausalLM` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with q/k/v
    /// biases from `qkv_bias` (default true), and Qwen3-MoE's experts (`decoder_sparse_step`,
    /// `mlp_only_layers`, `norm_topk_prob`, default false) with a shared expert behind a sigmoid
    /// gate on every sparse layer ([`MoeArgs`]).
    Qwen2Moe,
    /// `Gemma3ForCausalLM` (text): q/k norms as Qwen3; every RMSNorm scales by `1 + w`; norms
    /// after the attention and around the MLP (`post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`); a GELU (tanh) gated MLP;
    /// embeddings times √hidden; scores scaled by `query_pre_attn_scalar^-½`; sliding-window
    /// layers with their own RoPE base between global ones (`layer_types`).
    Gemma3,
    /// `Gemma2ForCausalLM`: Gemma 3's layer without q/k norms, one RoPE base for every layer,
    /// sliding and full layers alternating (sliding first), and soft-capped scores
    /// (`attn_logit_softcapping`: `c·tanh(s/c)` before the mask) and logits
    /// (`final_logit_softcapping`).
    Gemma2,
    /// `Qwen3_5ForCausalLM` (and the text part of `Qwen3_5ForConditionalGeneration`): three of
    /// every four layers Gated DeltaNet (`linear_attn`, [`LinearAttnArgs`]), the others full
    /// attention with a sigmoid output gate read from a doubled `q_proj`, q/k norms and rotary
    /// embeddings over the first `partial_rotary_factor` of each head; every RMSNorm but the
    /// DeltaNet's gated one scales by `1 + w`.
    Qwen3_5,
    /// `Qwen3_5MoeForCausalLM` (and the text part of `Qwen3_5MoeForConditionalGeneration`):
    /// Qwen3.5's layers with a mixture of experts on every layer (softmax router, top-k
    /// renormalised) plus a shared expert scaled by `sigmoid(x·w_gate)` ([`MoeArgs`]).
    Qwen3_5Moe,
    /// `Qwen3NextForCausalLM`: Qwen3.5's layers with the DeltaNet's inputs from two fused
    /// projections grouped per key head (`in_proj_qkvz`, `in_proj_ba`), and Qwen3-MoE's
    /// experts (`decoder_sparse_step`, `mlp_only_layers`, `norm_topk_prob`) with a shared expert.
    Qwen3Next,
    /// `DeepseekV3ForCausalLM` (transformers' `deepseek_v3`; DeepSeek-V3, Kimi-K2, Moonlight):
    /// multi-head latent attention ([`MlaArgs`]) and, after `first_k_dense_replace` dense
    /// layers, experts with DeepSeek's group-limited sigmoid routing and shared experts
    /// ([`DeepseekRouting`]).
    DeepseekV3,
    /// `Glm4MoeForCausalLM` (transformers' `glm4_moe`; GLM-4.5, GLM-4.5-Air, GLM-4.6): grouped
    /// query attention with q/k/v biases from `attention_bias` (never on o_proj), per-head q/k
    /// RMSNorms when `use_qk_norm`, rotary embeddings over the first `partial_rotary_factor`
    /// (default 0.5) of each head in two halves; after `first_k_dense_replace` dense layers,
    /// DeepSeek-V3's experts, routing and shared experts ([`DeepseekRouting`]). Its
    /// multi-token-prediction layers (`model.layers.{num_hidden_layers + j}`) are kept as
    /// read, as DeepSeek's are.
    Glm4Moe,
    /// `GptOssForCausalLM` (transformers' `gpt_oss`; gpt-oss-20b/120b in bf16): grouped-query
    /// attention with q/k/v/o biases (`attention_bias`, default true) and a learned sink
    /// logit per head (`self_attn.sinks`) that joins every softmax's denominator; sliding-window
    /// layers alternating with full ones (`layer_types`, sliding first by default); yarn RoPE;
    /// every layer a mixture of experts with a biased router (softmax over the chosen logits)
    /// and biased experts under a clamped SwiGLU ([`ClampedSwiglu`]), stored fused
    /// (`mlp.experts.gate_up_proj` `[experts, hidden, 2·inter]` with gate and up columns
    /// interleaved, `mlp.experts.down_proj` `[experts, inter, hidden]`, and their biases).
    GptOss,
    /// `Qwen2_5_VLForConditionalGeneration` (transformers' `qwen2_5_vl`): Qwen2's layer (q/k/v
    /// biases) under multimodal rotary positions ([`Mrope`]: each frequency turns with the
    /// token's temporal, row or column position), and a vision tower ([`VisionArgs`],
    /// `model::vision`) whose merged patch features replace the image placeholder tokens'
    /// embeddings. The text settings may sit in `text_config` (transformers 5) or at the top
    /// (the hub's checkpoints).
    Qwen2_5Vl,
    /// `Qwen3VLForConditionalGeneration` (transformers' `qwen3_vl`): Qwen3's layer (q/k norms)
    /// under interleaved multimodal rotary positions, a vision tower with learned position
    /// embeddings and DeepStack features added to the image tokens' hidden states after the
    /// first layers ([`VisionArgs`]). Its checkpoints name the language model
    /// `model.language_model.*` and the tower `model.visual.*`.
    Qwen3Vl,
    /// `Qwen3VLMoeForConditionalGeneration` (transformers' `qwen3_vl_moe`): Qwen3-VL over
    /// Qwen3-MoE's layers (`decoder_sparse_step`, `mlp_only_layers`; the router always
    /// renormalises its top k), the experts stored fused per layer
    /// (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
    Qwen3VlMoe,
}

/// Which keys a layer's queries attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LayerKind {
    /// Every earlier position.
    Full,
    /// The last `sliding_window` positions, its own included.
    Sliding,
    /// No attention: a Gated DeltaNet layer (Qwen3.5's `linear_attention`), whose token mixer
    /// is a recurrence over the sequence.
    Linear,
}

impl LayerKind {
    /// A hybrid's layers without a list (transformers' and llama.cpp's default pattern): every
    /// `every`-th layer full attention, the others Gated DeltaNet. `every` > 0.
    pub fn full_every(layers: usize, every: usize) -> Vec<LayerKind> {
        (0..layers)
            .map(|i| match (i + 1) % every {
                0 => LayerKind::Full,
                _ => LayerKind::Linear,
            })
            .collect()
    }
}

/// Multimodal rotary positions (M-RoPE): a token has a temporal, a row and a column position
/// (all three equal for text), and rotary frequency `j` turns with the axis
/// [`Mrope::axis_of`] gives (`model::vision`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mrope {
    /// How many of the `head_dim / 2` frequencies each axis takes: `[temporal, height, width]`.
    pub section: Vec<usize>,
    /// Qwen3-VL's layout: the axes' frequencies interleaved rather than consecutive.
    pub interleaved: bool,
}

/// Which family's vision tower: Qwen2.5-VL's (RMSNorms, SiLU-gated MLPs, window attention) or
/// Qwen3-VL's (LayerNorms, GELU-tanh MLPs, learned position embeddings, DeepStack).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VisionStyle {
    Qwen2_5,
    Qwen3,
}

/// The vision tower of a vision-language model (`vision_config`), and the token ids of its
/// placeholders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VisionArgs {
    pub style: VisionStyle,
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// The side of an attention window, in pixels (Qwen2.5-VL).
    pub window_size: usize,
    /// The blocks that attend over whole frames; the others attend within windows (Qwen2.5-VL;
    /// Qwen3-VL's blocks all attend over whole frames).
    pub fullatt_block_indexes: Vec<usize>,
    /// Qwen3-VL: the learned position grid's size (a square), and the blocks whose output,
    /// merged by a merger of its own, is added to the language model's layer `k` output at the
    /// image tokens (the `k`-th listed block feeds layer `k`).
    pub num_position_embeddings: usize,
    pub deepstack_visual_indexes: Vec<usize>,
    /// The width of the merged features: the language model's hidden size.
    pub out_hidden_size: usize,
    /// The base of the tower's 2-D rotary frequencies.
    pub rope_theta: f64,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    /// `vision_config` as read, written back unchanged on save.
    pub raw: Value,
    /// The tower is frozen (`actor.freeze_vision_tower`): its weights are kept as read, never
    /// trained ([`ModelArgs::kept_as_read`]). Not a config.json setting.
    #[serde(default)]
    pub frozen: bool,
}

/// Where a vision-language model's vision tower is named (the hub's layout, which transformers
/// reads and writes).
pub const VISUAL: &str = "visual.";

/// A tower's heads must split `hidden` evenly into widths its 2-D rotary embedding turns
/// (a multiple of 4).
fn check_vision_heads(hidden: usize, heads: usize) -> Result<(), String> {
    if !hidden.is_multiple_of(heads) || !(hidden / heads).is_multiple_of(4) {
        return Err(format!(
            "config.json: vision_config.hidden_size ({hidden}) over vision_config.num_heads ({heads}) must give a head width divisible by 4 (its 2-D rotary embedding)"
        ));
    }
    Ok(())
}

impl VisionArgs {
    /// Reads `vision_config` and the placeholder ids of a vision-language `config.json` value
    /// (`top`; `text` its language model's settings).
    fn from_hf(top: &Value, text: &Value, arch: Arch) -> Result<Self, String> {
        let v = top
            .get("vision_config")
            .filter(|x| x.is_object())
            .ok_or("config.json: a vision-language model needs a vision_config object")?;
        let style = match arch {
            Arch::Qwen3Vl | Arch::Qwen3VlMoe | Arch::Qwen3_5 | Arch::Qwen3_5Moe => {
                VisionStyle::Qwen3
            }
            _ => VisionStyle::Qwen2_5,
        };
        let qwen3 = style == VisionStyle::Qwen3;
        let key = |k: &str| format!("vision_config.{k}");
        let size = |k: &str, default: usize| -> Result<usize, String> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => match x.as_u64() {
                    Some(n) if n > 0 => Ok(n as usize),
                    _ => Err(format!(
                        "config.json: {} must be a positive integer, found {x}",
                        key(k)
                    )),
                },
            }
        };
        let (act, family) = match qwen3 {
            true => ("gelu_pytorch_tanh", "Qwen3-VL"),
            false => ("silu", "Qwen2.5-VL"),
        };
        let found = v.get("hidden_act").and_then(Value::as_str).unwrap_or(act);
        if found != act {
            return Err(format!(
                "config.json: {} {found:?} is not supported ({family}'s tower: {act:?})",
                key("hidden_act")
            ));
        }
        let depth = size("depth", if qwen3 { 27 } else { 32 })?;
        let blocks = |k: &str, default: &[usize]| -> Result<Vec<usize>, String> {
            let list: Vec<usize> = match v.get(k) {
                None | Some(Value::Null) => default.to_vec(),
                Some(x) => x
                    .as_array()
                    .and_then(|a| a.iter().map(|i| i.as_u64().map(|i| i as usize)).collect())
                    .ok_or(format!(
                        "config.json: {} must be a list of block indices, found {x}",
                        key(k)
                    ))?,
            };
            match list.iter().find(|&&i| i >= depth) {
                Some(i) => Err(format!(
                    "config.json: {} names block {i} of a tower of depth {depth}",
                    key(k)
                )),
                None => Ok(list),
            }
        };
        let fullatt = match qwen3 {
            true => Vec::new(),
            false => blocks("fullatt_block_indexes", &[7, 15, 23, 31])?,
        };
        // Qwen3.5's tower has no DeepStack.
        let deepstack = match arch {
            Arch::Qwen3Vl | Arch::Qwen3VlMoe => blocks("deepstack_visual_indexes", &[8, 16, 24])?,
            _ => Vec::new(),
        };
        let positions = size("num_position_embeddings", 2304)?;
        let side = (positions as f64).sqrt().round() as usize;
        if qwen3 && side * side != positions {
            return Err(format!(
                "config.json: {} ({positions}) must be a square: the learned position grid",
                key("num_position_embeddings")
            ));
        }
        let (hidden, heads) = (
            size("hidden_size", if qwen3 { 1152 } else { 3584 })?,
            size("num_heads", 16)?,
        );
        check_vision_heads(hidden, heads)?;
        let theta = match v.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
            Some(x) => json_number(&key("rope_parameters.rope_theta"), x)?,
            None => 10000.0,
        };
        let id = |k: &str, default: u32| -> Result<u32, String> {
            match top.get(k).or_else(|| text.get(k)) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_u64()
                    .map(|n| n as u32)
                    .ok_or(format!("config.json: {k} must be a token id, found {x}")),
            }
        };
        Ok(Self {
            style,
            depth,
            hidden_size: hidden,
            intermediate_size: size("intermediate_size", if qwen3 { 4304 } else { 3420 })?,
            num_heads: heads,
            in_channels: size("in_channels", 3)?,
            patch_size: size("patch_size", if qwen3 { 16 } else { 14 })?,
            temporal_patch_size: size("temporal_patch_size", 2)?,
            spatial_merge_size: size("spatial_merge_size", 2)?,
            window_size: size("window_size", 112)?,
            fullatt_block_indexes: fullatt,
            num_position_embeddings: positions,
            deepstack_visual_indexes: deepstack,
            out_hidden_size: size("out_hidden_size", 3584)?,
            rope_theta: theta,
            image_token_id: id("image_token_id", 151655)?,
            video_token_id: id("video_token_id", 151656)?,
            vision_start_token_id: id("vision_start_token_id", 151652)?,
            vision_end_token_id: id("vision_end_token_id", 151653)?,
            raw: v.clone(),
            frozen: false,
        })
    }
}

impl Arch {
    /// Whether each head of q and k goes through an RMSNorm before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(
            self,
            Arch::Qwen3
                | Arch::Qwen3Moe
                | Arch::Qwen3Vl
                | Arch::Qwen3VlMoe
                | Arch::Gemma3
                | Arch::Qwen3_5
                | Arch::Qwen3_5Moe
                | Arch::Qwen3Next
        )
    }

    /// Whether rotary embeddings may turn only part of each head (`partial_rotary_factor`).
    pub fn partial_rotary(self) -> bool {
        self.hybrid() || self == Arch::Glm4Moe
    }

    /// The Gated DeltaNet / gated-attention hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).
    pub fn hybrid(self) -> bool {
        matches!(self, Arch::Qwen3_5 | Arch::Qwen3_5Moe | Arch::Qwen3Next)
    }

    /// Gemma's layer: `(1 + w)` norms, sandwich norms, GELU (tanh) MLP, scaled embeddings.
    pub fn gemma(self) -> bool {
        matches!(self, Arch::Gemma3 | Arch::Gemma2)
    }

    /// What RMSNorm weights add to their scale: 1 for Gemma (`x̂·(1 + w)`), else 0.
    pub fn norm_offset(self) -> f64 {
        if self.gemma() || self.hybrid() {
            1.0
        } else {
            0.0
        }
    }

    /// The `architectures` entry and `model_type` a causal LM of this layout is saved with.
    pub fn hf_names(self) -> (&'static str, &'static str) {
        match self {
            Arch::Llama => ("LlamaForCausalLM", "llama"),
            Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
            Arch::SeedOss => ("SeedOssForCausalLM", "seed_oss"),
            Arch::MiMo => ("MiMoForCausalLM", "mimo"),
            Arch::Qwen3 => ("Qwen3ForCausalLM", "qwen3"),
            Arch::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            Arch::Qwen2Moe => ("Qwen2MoeForCausalLM", "qwen2_moe"),
            Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
            Arch::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
            Arch::Qwen3_5 => ("Qwen3_5ForCausalLM", "qwen3_5_text"),
            Arch::Qwen3_5Moe => ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
            Arch::Qwen3Next => ("Qwen3NextForCausalLM", "qwen3_next"),
            Arch::DeepseekV3 => ("DeepseekV3ForCausalLM", "deepseek_v3"),
            Arch::Glm4Moe => ("Glm4MoeForCausalLM", "glm4_moe"),
            Arch::GptOss => ("GptOssForCausalLM", "gpt_oss"),
            Arch::Qwen2_5Vl => ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl"),
            Arch::Qwen3Vl => ("Qwen3VLForConditionalGeneration", "qwen3_vl"),
            Arch::Qwen3VlMoe => ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
        }
    }

    /// Whether each attention head has a learned sink logit in its softmax (GPT-OSS).
    pub fn sinks(self) -> bool {
        self == Arch::GptOss
    }

    /// The vision-language layouts: a vision tower beside the language model.
    pub fn vision(self) -> bool {
        matches!(self, Arch::Qwen2_5Vl | Arch::Qwen3Vl | Arch::Qwen3VlMoe)
    }
}

/// The `architectures` (`config.json`) this implementation loads, and the block layout each
/// follows: causal LMs, and the token- and sequence-classification models critics and reward
/// models are (their backbone plus a `score` head).
pub const ARCHITECTURES: [(&str, Arch); 48] = [
    ("LlamaForCausalLM", Arch::Llama),
    ("LlamaForTokenClassification", Arch::Llama),
    ("LlamaForSequenceClassification", Arch::Llama),
    ("MistralForCausalLM", Arch::Llama),
    ("MistralForTokenClassification", Arch::Llama),
    ("MistralForSequenceClassification", Arch::Llama),
    ("Qwen2ForCausalLM", Arch::Qwen2),
    ("Qwen2ForTokenClassification", Arch::Qwen2),
    ("Qwen2ForSequenceClassification", Arch::Qwen2),
    ("SeedOssForCausalLM", Arch::SeedOss),
    ("SeedOssForTokenClassification", Arch::SeedOss),
    ("SeedOssForSequenceClassification", Arch::SeedOss),
    ("MiMoForCausalLM", Arch::MiMo),
    ("Qwen3ForCausalLM", Arch::Qwen3),
    ("Qwen3ForTokenClassification", Arch::Qwen3),
    ("Qwen3ForSequenceClassification", Arch::Qwen3),
    ("Qwen3MoeForCausalLM", Arch::Qwen3Moe),
    ("Qwen3MoeForTokenClassification", Arch::Qwen3Moe),
    ("Qwen3MoeForSequenceClassification", Arch::Qwen3Moe),
    ("Qwen2MoeForCausalLM", Arch::Qwen2Moe),
    ("Qwen2MoeForTokenClassification", Arch::Qwen2Moe),
    ("Qwen2MoeForSequenceClassification", Arch::Qwen2Moe),
    ("Gemma3ForCausalLM", Arch::Gemma3),
    ("Gemma3TextForTokenClassification", Arch::Gemma3),
    ("Gemma3TextForSequenceClassification", Arch::Gemma3),
    ("Gemma2ForCausalLM", Arch::Gemma2),
    ("Gemma2ForTokenClassification", Arch::Gemma2),
    ("Gemma2ForSequenceClassification", Arch::Gemma2),
    ("Qwen3_5ForCausalLM", Arch::Qwen3_5),
    ("Qwen3_5ForConditionalGeneration", Arch::Qwen3_5),
    ("Qwen3_5ForTokenClassification", Arch::Qwen3_5),
    ("Qwen3_5TextForSequenceClassification", Arch::Qwen3_5),
    ("Qwen3_5ForSequenceClassification", Arch::Qwen3_5),
    ("Qwen3_5MoeForCausalLM", Arch::Qwen3_5Moe),
    ("Qwen3_5MoeForConditionalGeneration", Arch::Qwen3_5Moe),
    ("Qwen3NextForCausalLM", Arch::Qwen3Next),
    ("Qwen3NextForTokenClassification", Arch::Qwen3Next),
    ("Qwen3NextForSequenceClassification", Arch::Qwen3Next),
    ("DeepseekV3ForCausalLM", Arch::DeepseekV3),
    ("DeepseekV3ForTokenClassification", Arch::DeepseekV3),
    ("DeepseekV3ForSequenceClassification", Arch::DeepseekV3),
    ("Glm4MoeForCausalLM", Arch::Glm4Moe),
    ("GptOssForCausalLM", Arch::GptOss),
    ("GptOssForTokenClassification", Arch::GptOss),
    ("GptOssForSequenceClassification", Arch::GptOss),
    ("Qwen2_5_VLForConditionalGeneration", Arch::Qwen2_5Vl),
    ("Qwen3VLForConditionalGeneration", Arch::Qwen3Vl),
    ("Qwen3VLMoeForConditionalGeneration", Arch::Qwen3VlMoe),
];

/// `model_type`s read when a config has no `architectures`.
const MODEL_TYPES: [(&str, Arch); 21] = [
    ("llama", Arch::Llama),
    ("mistral", Arch::Llama),
    ("qwen2", Arch::Qwen2),
    ("seed_oss", Arch::SeedOss),
    ("mimo", Arch::MiMo),
    ("qwen3", Arch::Qwen3),
    ("qwen3_moe", Arch::Qwen3Moe),
    ("qwen2_moe", Arch::Qwen2Moe),
    ("gemma3_text", Arch::Gemma3),
    ("gemma2", Arch::Gemma2),
    ("qwen3_5_text", Arch::Qwen3_5),
    ("qwen3_5", Arch::Qwen3_5),
    ("qwen3_5_moe_text", Arch::Qwen3_5Moe),
    ("qwen3_5_moe", Arch::Qwen3_5Moe),
    ("qwen3_next", Arch::Qwen3Next),
    ("deepseek_v3", Arch::DeepseekV3),
    ("glm4_moe", Arch::Glm4Moe),
    ("gpt_oss", Arch::GptOss),
    ("qwen2_5_vl", Arch::Qwen2_5Vl),
    ("qwen3_vl", Arch::Qwen3Vl),
    ("qwen3_vl_moe", Arch::Qwen3VlMoe),
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
            None if ENCODER_ARCHITECTURES.contains(name) => {
                return Err(format!(
                    "config.json: architecture `{name}` is an encoder, loaded only as a reward model (a `type: model` reward source or reward_model.model.path); causal LMs supported here: {}",
                    supported()
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

/// Encoder architectures, loaded as reward models only (`model::deberta`).
pub const ENCODER_ARCHITECTURES: [&str; 1] = [super::deberta::ARCHITECTURE];

/// How a reward model's checkpoint is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RewardArch {
    /// A causal LM backbone with a `score` head (`*ForSequenceClassification` of [`ARCHITECTURES`]).
    Causal(Arch),
    /// `DebertaV2ForSequenceClassification` ([`super::deberta`]).
    DebertaV2,
}

/// The kind of reward model a `config.json` describes: a DeBERTa-v2/v3 encoder, else a causal
/// layout of [`ARCHITECTURES`]; any other architecture (BERT, RoBERTa, DeBERTa v1, ...) is
/// refused by name with the list of sequence-classification architectures supported.
pub fn reward_arch_of(v: &Value) -> Result<RewardArch, String> {
    let archs: Vec<&str> = v
        .get("architectures")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if archs.contains(&super::deberta::ARCHITECTURE) {
        if archs.len() > 1 {
            return Err(format!(
                "config.json: architectures {archs:?} name different layouts"
            ));
        }
        return Ok(RewardArch::DebertaV2);
    }
    if let Some(name) = archs
        .iter()
        .find(|n| !ARCHITECTURES.iter().any(|(a, _)| a == *n))
    {
        let supported: Vec<&str> = ARCHITECTURES
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| n.ends_with("ForSequenceClassification"))
            .chain(ENCODER_ARCHITECTURES)
            .collect();
        return Err(format!(
            "config.json: architecture `{name}` is not supported as a reward model; supported: {}",
            supported.join(", ")
        ));
    }
    arch_of(v).map(RewardArch::Causal)
}

/// RoPE frequency scaling (`rope_type` other than `default`): Llama 3.x's, linear (Gemma 3's
/// global layers) and yarn (DeepSeek-V3 only, `config_deepseek.rs`); other types are refused
/// when the config is read.
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
    /// Every frequency divided by `factor` (positions interpolated linearly).
    Linear { factor: f64 },
    /// YaRN (transformers' `_compute_yarn_parameters`, formulas in `config_deepseek.rs`):
    /// frequencies between plain and divided by `factor` along a ramp over the dimensions,
    /// and the cos/sin tables multiplied by an attention factor.
    Yarn {
        factor: f64,
        original_max_position_embeddings: u64,
        beta_fast: f64,
        beta_slow: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mscale_all_dim: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attention_factor: Option<f64>,
        truncate: bool,
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
    /// Biases on q/k/v (Qwen2 and MiMo always; Llama, Qwen3 and Seed-OSS when
    /// `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama and Qwen3 when `attention_bias`,
    /// Seed-OSS when `attention_out_bias`; never in Qwen2 or MiMo).
    #[serde(default)]
    pub o_bias: bool,
    pub max_position_embeddings: usize,
    /// Labels of a sequence-classification head (`num_labels`), when the checkpoint has one.
    pub num_labels: Option<usize>,
    /// Attention scores are scaled by `query_pre_attn_scalar^-½` (Gemma); `None`: `head_dim^-½`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// How many positions a sliding-window layer sees (its own included).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Each layer's attention; empty = every layer full.
    #[serde(default)]
    pub layer_types: Vec<LayerKind>,
    /// The RoPE base of sliding layers (Gemma 3's local layers, plain RoPE); `None`: the same
    /// frequencies as the full layers.
    #[serde(default)]
    pub rope_local_theta: Option<f64>,
    /// The mixture of experts of a Qwen3-MoE model; `None`: every layer has the dense MLP.
    #[serde(default)]
    pub moe: Option<MoeArgs>,
    /// Rotary embeddings turn the first `rotary_dim` values of each head (Qwen3.5's
    /// `partial_rotary_factor`); `None`: the whole head.
    #[serde(default)]
    pub rotary_dim: Option<usize>,
    /// Qwen3.5's attention output gate: `q_proj` gives each head its queries and as many gate
    /// values, and the attention's output is multiplied by `sigmoid(gate)` before `o_proj`.
    #[serde(default)]
    pub attn_output_gate: bool,
    /// The Gated DeltaNet layers' sizes (Qwen3.5), `None` for models without such layers.
    #[serde(default)]
    pub linear_attn: Option<LinearAttnArgs>,
    /// MiMo's multi-token-prediction layers (`num_nextn_predict_layers`): their weights
    /// (`model.mtp_layers.N.*`, see [`mtp_layer_tensors`]) are loaded, frozen and saved back;
    /// the model's forward does not run them (as MiMo's own forward does not).
    #[serde(default)]
    pub mtp_layers: usize,
    /// Dropout in training mode, read so that training can refuse it rather than leave it out
    /// (the model here has none): `attention_dropout` on the attention probabilities (every
    /// family's attention in transformers) and Seed-OSS's `residual_dropout` on the attention's
    /// and the MLP's outputs. 0 in inference, where transformers applies neither.
    #[serde(default)]
    pub attention_dropout: f64,
    #[serde(default)]
    pub residual_dropout: f64,
    /// `auto_map` of a checkpoint whose modeling code is its own (MiMo's `modeling_mimo.py`,
    /// loaded by transformers with `trust_remote_code`), written back so a saved folder loads
    /// the same way.
    #[serde(default)]
    pub auto_map: Option<Value>,
    /// The Python files `auto_map` names, file name → text, as read beside `config.json`
    /// (`weights::hf::read_config`) and written beside the saved one.
    #[serde(default)]
    pub remote_code: std::collections::BTreeMap<String, String>,
    /// DeepSeek-V3's multi-head latent attention (`head_dim` is then its rope width, as
    /// transformers sets it); `None`: the attention of `q_proj`/`k_proj`/`v_proj`.
    #[serde(default)]
    pub mla: Option<MlaArgs>,
    /// Per-head q/k RMSNorms in a family where they are optional (GLM-4.5's `use_qk_norm`);
    /// the families that always have them say so through [`Arch::qk_norm`].
    #[serde(default)]
    pub use_qk_norm: bool,
    /// GLM-4.5's multi-token-prediction layers (`num_nextn_predict_layers`, stored as
    /// `model.layers.{num_hidden_layers + j}.*`), kept as read like DeepSeek's
    /// ([`MlaArgs::num_nextn_predict_layers`]).
    #[serde(default)]
    pub trailing_mtp_layers: usize,
    /// Gemma 2's soft-capping: attention scores become `c·tanh(s/c)` before the mask
    /// (`attn_logit_softcapping`), the LM head's logits likewise (`final_logit_softcapping`).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Multimodal rotary positions (vision-language models); `None`: one position per token.
    #[serde(default)]
    pub mrope: Option<Mrope>,
    /// The vision tower of a vision-language model.
    #[serde(default)]
    pub vision: Option<VisionArgs>,
}

/// Where MiMo's multi-token-prediction layers are named: kept as read, never trained here.
pub const MTP_PREFIX: &str = "model.mtp_layers.";

/// Checkpoint tensors read, kept and saved back as read but never trained: MiMo's
/// multi-token-prediction layers, and DeepSeek-V3's score-correction biases (a buffer in
/// transformers, which no loss reaches: they only choose experts). DeepSeek's own
/// multi-token-prediction layers are told by their index ([`ModelArgs::kept_as_read`]).
pub fn kept_as_read(name: &str) -> bool {
    name.starts_with(MTP_PREFIX) || name.ends_with(".mlp.gate.e_score_correction_bias")
}

/// The tensors of one MiMo multi-token-prediction layer (`model.mtp_layers.N.` + name) and
/// their shapes for `(hidden, q width, kv width, intermediate)`: RMSNorms of the previous
/// hidden state and of the next token's embedding, `input_proj` `[hidden, 2·hidden]` over
/// their concatenation, then a Qwen2 decoder layer (q/k/v biases, no o_proj bias) and a final
/// RMSNorm (MiMo's `MiMoMTPLayers`).
pub fn mtp_layer_tensors(
    hidden: usize,
    q: usize,
    kv: usize,
    inter: usize,
) -> Vec<(&'static str, Vec<usize>)> {
    let h = hidden;
    vec![
        ("token_layernorm.weight", vec![h]),
        ("hidden_layernorm.weight", vec![h]),
        ("input_proj.weight", vec![h, 2 * h]),
        ("input_layernorm.weight", vec![h]),
        ("self_attn.q_proj.weight", vec![q, h]),
        ("self_attn.q_proj.bias", vec![q]),
        ("self_attn.k_proj.weight", vec![kv, h]),
        ("self_attn.k_proj.bias", vec![kv]),
        ("self_attn.v_proj.weight", vec![kv, h]),
        ("self_attn.v_proj.bias", vec![kv]),
        ("self_attn.o_proj.weight", vec![h, q]),
        ("post_attention_layernorm.weight", vec![h]),
        ("mlp.gate_proj.weight", vec![inter, h]),
        ("mlp.up_proj.weight", vec![inter, h]),
        ("mlp.down_proj.weight", vec![h, inter]),
        ("final_layernorm.weight", vec![h]),
    ]
}

/// Qwen3.5's Gated DeltaNet (transformers' `Qwen3_5GatedDeltaNet`): `in_proj_qkv` gives q, k
/// (`num_key_heads × key_head_dim` each) and v (`num_value_heads × value_head_dim`), which go
/// through a causal depthwise convolution of width `conv_kernel` and SiLU; q and k are
/// L2-normalised, each value head reads key head `j / (value heads / key heads)`; per value
/// head a decay `g = −exp(A_log)·softplus(a + dt_bias)` and a write strength `β = σ(b)` drive
/// the delta rule `S ← exp(g)·S + k ⊗ β(v − Sᵀk)`, output `Sᵀq/√d_k`, then an RMSNorm gated by
/// `silu(z)` and `out_proj`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearAttnArgs {
    pub num_key_heads: usize,
    pub num_value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
    /// Qwen3-Next's inputs: `in_proj_qkvz` and `in_proj_ba`, their rows grouped per key head
    /// (`[q, k, v…, z…]` and `[b…, a…]` for each key head's value heads), instead of Qwen3.5's
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    #[serde(default)]
    pub grouped: bool,
}

impl LinearAttnArgs {
    /// The width of `in_proj_qkv`'s output and of the convolution: `2·keys + values`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }

    fn from_hf(v: &Value, grouped: bool) -> Result<Self, String> {
        let a = Self {
            grouped,
            num_key_heads: get_usize(v, "linear_num_key_heads")?,
            num_value_heads: get_usize(v, "linear_num_value_heads")?,
            key_head_dim: get_usize(v, "linear_key_head_dim")?,
            value_head_dim: get_usize(v, "linear_value_head_dim")?,
            conv_kernel: get_usize(v, "linear_conv_kernel_dim")?,
        };
        if a.num_key_heads == 0
            || a.num_value_heads == 0
            || !a.num_value_heads.is_multiple_of(a.num_key_heads)
        {
            return Err(format!("config.json: linear_num_value_heads ({}) must be a positive multiple of linear_num_key_heads ({})", a.num_value_heads, a.num_key_heads));
        }
        if a.key_head_dim == 0 || a.value_head_dim == 0 || a.conv_kernel == 0 {
            return Err("config.json: linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim must be positive".into());
        }
        Ok(a)
    }
}

/// Qwen3.5's `layer_types` (`linear_attention`, `full_attention`), or transformers' default:
/// every `full_attention_interval`-th layer (default 4) full, the others linear.
fn read_hybrid_layers(v: &Value, layers: usize) -> Result<Vec<LayerKind>, String> {
    let kinds: Vec<LayerKind> = match v.get("layer_types") {
        None | Some(Value::Null) => {
            let every = v
                .get("full_attention_interval")
                .map(|x| {
                    x.as_u64().filter(|&i| i > 0).ok_or_else(|| {
                        format!("config.json: full_attention_interval must be a positive integer, found {x}")
                    })
                })
                .transpose()?
                .unwrap_or(4) as usize;
            LayerKind::full_every(layers, every)
        }
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("full_attention") => Ok(LayerKind::Full),
                Some("linear_attention") => Ok(LayerKind::Linear),
                _ => Err(format!("config.json: layer_types[{i}] {t} is not supported (linear_attention, full_attention)")),
            })
            .collect::<Result<_, _>>()?,
        Some(x) => return Err(format!("config.json: layer_types must be a list, found {x}")),
    };
    if kinds.len() != layers {
        return Err(format!(
            "config.json: layer_types lists {} layers for num_hidden_layers {layers}",
            kinds.len()
        ));
    }
    Ok(kinds)
}

/// The rotary width of a Qwen3.5 or GLM-4.5 head: `head_dim · partial_rotary_factor`
/// (transformers' default `default`: 0.25 for Qwen3.5, 0.5 for GLM-4.5), from `rope_parameters`
/// or the top level; an even number of values up to the head's.
fn read_rotary_dim(v: &Value, head_dim: usize, default: f64) -> Result<usize, String> {
    let nested = v.pointer("/rope_parameters/partial_rotary_factor");
    let top = v.get("partial_rotary_factor");
    let pick = |x: Option<&Value>| x.filter(|x| !x.is_null()).cloned();
    let factor = match (pick(nested), pick(top)) {
        (Some(a), Some(b)) if a.as_f64() != b.as_f64() => {
            return Err(format!("config.json: partial_rotary_factor ({b}) and rope_parameters.partial_rotary_factor ({a}) disagree"))
        }
        (Some(a), _) | (None, Some(a)) => a
            .as_f64()
            .ok_or_else(|| format!("config.json: partial_rotary_factor must be a number, found {a}"))?,
        (None, None) => default,
    };
    let dim = (head_dim as f64 * factor) as usize;
    if !(factor > 0.0 && factor <= 1.0) || dim == 0 || !dim.is_multiple_of(2) {
        return Err(format!("config.json: partial_rotary_factor {factor} gives {dim} rotary values of a {head_dim}-value head; it must give an even number between 2 and head_dim"));
    }
    Ok(dim)
}

/// Qwen3-MoE's experts (transformers' `Qwen3MoeSparseMoeBlock`): each token's router
/// probabilities `softmax(x·Wᵣᵀ)` over `num_experts`, its `num_experts_per_tok` most probable
/// experts (renormalised to sum 1 when `norm_topk_prob`), and the sum of those experts'
/// SiLU-gated MLPs (width `moe_intermediate_size`) weighted by them. Layer `i` is sparse unless
/// it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`; the others keep the
/// dense MLP of width `intermediate_size`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeArgs {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub moe_intermediate_size: usize,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// `router_aux_loss_coef` where `output_router_logits` is true: training adds this times
    /// the router's load-balancing loss to the actor's loss (as transformers adds it to a loss
    /// from labels); `None`: no such term.
    #[serde(default)]
    pub router_aux_loss_coef: Option<f64>,
    /// A shared expert beside the routed ones (Qwen3-Next, Qwen3.5-MoE): a gated MLP of this
    /// width on every token, scaled by `sigmoid(x·w)` of its gate `mlp.shared_expert_gate`
    /// `[1, hidden]`, added to the experts' sum.
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    /// DeepSeek-V3's routing and shared experts; `None`: the softmax router.
    #[serde(default)]
    pub deepseek: Option<DeepseekRouting>,
    /// GPT-OSS's experts ([`ClampedSwiglu`]): a router bias, biased experts, the clamped
    /// SwiGLU and the fused interleaved layout; `None`: bias-free SiLU-gated experts.
    #[serde(default)]
    pub swiglu: Option<ClampedSwiglu>,
}

/// GPT-OSS's experts (transformers' `GptOssMLP`): router logits `x·Wᵣᵀ + bᵣ`, the top
/// `num_experts_per_tok` of them, their softmax as weights (the full softmax renormalised over
/// the chosen, the same numbers); each expert `down(act(gate, up)) + b_down` on
/// `gate = x·W_gᵀ + b_g`, `up = x·W_uᵀ + b_u` with
/// `act = (clamp(up, −limit, limit) + 1) · g·σ(alpha·g)`, `g = min(gate, limit)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClampedSwiglu {
    /// `swiglu_alpha` (1.702).
    pub alpha: f64,
    /// `swiglu_limit` (7.0).
    pub limit: f64,
}

/// `router_aux_loss_coef` where a Qwen3-MoE config's `output_router_logits` is true
/// (transformers' default coefficient 0.001 where the key is absent); `None` where it is false
/// or absent.
fn router_aux_loss_coef(v: &Value) -> Result<Option<f64>, String> {
    match v.get("output_router_logits") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
        Some(Value::Bool(true)) => match v.get("router_aux_loss_coef") {
            None | Some(Value::Null) => Ok(Some(0.001)),
            Some(c) => c
                .as_f64()
                .filter(|c| c.is_finite() && *c >= 0.0)
                .map(Some)
                .ok_or_else(|| {
                    format!(
                        "config.json: router_aux_loss_coef must be a non-negative number, found {c}"
                    )
                }),
        },
        Some(x) => Err(format!(
            "config.json: output_router_logits must be true or false, found {x}"
        )),
    }
}

impl MoeArgs {
    /// The mixture's keys of an HF `config.json` (the inverse of `from_hf`).
    fn write_hf(&self, o: &mut serde_json::Map<String, Value>) {
        if let Some(d) = &self.deepseek {
            return deepseek::write_moe_hf(self, d, o);
        }
        if let Some(c) = &self.swiglu {
            o.insert("num_local_experts".into(), self.num_experts.into());
            o.insert(
                "num_experts_per_tok".into(),
                self.num_experts_per_tok.into(),
            );
            o.insert("swiglu_alpha".into(), c.alpha.into());
            o.insert("swiglu_limit".into(), c.limit.into());
            o.insert(
                "output_router_logits".into(),
                self.router_aux_loss_coef.is_some().into(),
            );
            if let Some(c) = self.router_aux_loss_coef {
                o.insert("router_aux_loss_coef".into(), c.into());
            }
            return;
        }
        o.insert("num_experts".into(), serde_json::json!(self.num_experts));
        o.insert(
            "num_experts_per_tok".into(),
            serde_json::json!(self.num_experts_per_tok),
        );
        o.insert(
            "norm_topk_prob".into(),
            serde_json::json!(self.norm_topk_prob),
        );
        o.insert(
            "moe_intermediate_size".into(),
            serde_json::json!(self.moe_intermediate_size),
        );
        o.insert(
            "decoder_sparse_step".into(),
            serde_json::json!(self.decoder_sparse_step),
        );
        o.insert(
            "mlp_only_layers".into(),
            serde_json::json!(self.mlp_only_layers),
        );
        o.insert(
            "output_router_logits".into(),
            serde_json::json!(self.router_aux_loss_coef.is_some()),
        );
        if let Some(c) = self.router_aux_loss_coef {
            o.insert("router_aux_loss_coef".into(), serde_json::json!(c));
        }
        if let Some(w) = self.shared_expert_intermediate_size {
            o.insert("shared_expert_intermediate_size".into(), w.into());
        }
    }

    /// Reads the experts' keys of a Qwen3-MoE config (`num_experts`, or transformers 5's
    /// `num_local_experts`).
    fn from_hf(v: &Value, layers: usize, arch: Arch) -> Result<Self, String> {
        let experts = match (v.get("num_experts"), v.get("num_local_experts")) {
            (Some(a), Some(b)) if !a.is_null() && !b.is_null() && a != b => {
                return Err(format!(
                    "config.json: num_experts ({a}) and num_local_experts ({b}) disagree"
                ))
            }
            (Some(a), _) if !a.is_null() => a,
            (_, Some(b)) if !b.is_null() => b,
            _ => return Err("config.json: missing `num_experts` (a Qwen3-MoE config names how many experts each sparse layer has)".into()),
        };
        let num_experts = experts.as_u64().filter(|&e| e > 0).ok_or_else(|| {
            format!("config.json: num_experts must be a positive integer, found {experts}")
        })? as usize;
        let k = get_usize(v, "num_experts_per_tok")?;
        if k == 0 || k > num_experts {
            return Err(format!(
                "config.json: num_experts_per_tok ({k}) must be between 1 and num_experts ({num_experts})"
            ));
        }
        let shared = match arch {
            Arch::Qwen3Moe | Arch::Qwen3VlMoe | Arch::GptOss => None,
            _ => Some(get_usize(v, "shared_expert_intermediate_size")?),
        };
        if arch == Arch::Qwen3_5Moe {
            // Every layer has experts and the router always renormalises its top k.
            return Ok(Self {
                num_experts,
                num_experts_per_tok: k,
                norm_topk_prob: true,
                moe_intermediate_size: get_usize(v, "moe_intermediate_size")?,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
                router_aux_loss_coef: router_aux_loss_coef(v)?,
                shared_expert_intermediate_size: shared,
                deepseek: None,
                swiglu: None,
            });
        }
        if arch == Arch::GptOss {
            // Experts on every layer, of width intermediate_size; the weights are the softmax
            // of the chosen logits, i.e. renormalised.
            let number =
                |key: &str, default: f64| Ok::<_, String>(positive(v, key)?.unwrap_or(default));
            return Ok(Self {
                num_experts,
                num_experts_per_tok: k,
                norm_topk_prob: true,
                moe_intermediate_size: get_usize(v, "intermediate_size")?,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
                router_aux_loss_coef: router_aux_loss_coef(v)?,
                shared_expert_intermediate_size: None,
                deepseek: None,
                swiglu: Some(ClampedSwiglu {
                    alpha: number("swiglu_alpha", 1.702)?,
                    limit: number("swiglu_limit", 7.0)?,
                }),
            });
        }
        let step = v
            .get("decoder_sparse_step")
            .map(|x| {
                x.as_u64().filter(|&s| s > 0).ok_or_else(|| {
                    format!(
                        "config.json: decoder_sparse_step must be a positive integer, found {x}"
                    )
                })
            })
            .transpose()?
            .unwrap_or(1) as usize;
        let only = match v.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| match x.as_u64() {
                    Some(i) if (i as usize) < layers => Ok(i as usize),
                    _ => Err(format!("config.json: mlp_only_layers entry {x} is not a layer index below num_hidden_layers ({layers})")),
                })
                .collect::<Result<_, _>>()?,
            Some(x) => return Err(format!("config.json: mlp_only_layers must be a list, found {x}")),
        };
        Ok(Self {
            num_experts,
            num_experts_per_tok: k,
            // transformers' default: false for Qwen3-MoE, true for Qwen3-Next; Qwen3-VL-MoE's
            // router always renormalises.
            norm_topk_prob: arch == Arch::Qwen3VlMoe
                || v.get("norm_topk_prob")
                    .and_then(Value::as_bool)
                    .unwrap_or(arch == Arch::Qwen3Next),
            moe_intermediate_size: get_usize(v, "moe_intermediate_size")?,
            decoder_sparse_step: step,
            mlp_only_layers: only,
            router_aux_loss_coef: router_aux_loss_coef(v)?,
            shared_expert_intermediate_size: shared,
            deepseek: None,
            swiglu: None,
        })
    }

    /// The number of layers with experts among `layers`.
    pub fn sparse_layers(&self, layers: usize) -> usize {
        (0..layers).filter(|&i| self.sparse(i)).count()
    }

    /// Whether layer `i` has experts (else the dense MLP).
    pub fn sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// A dropout probability of config.json (0 when absent or null): a number in [0, 1).
fn dropout(v: &Value, key: &str) -> Result<f64, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(0.0),
        Some(x) => x
            .as_f64()
            .filter(|p| (0.0..1.0).contains(p))
            .ok_or_else(|| {
                format!("config.json: {key} must be a probability in [0, 1), found {x}")
            }),
    }
}

fn get_usize(v: &Value, key: &str) -> Result<usize, String> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| format!("config.json: missing or non-integer `{key}`"))
}

/// A RoPE base and its scaling.
type Rope = (f64, Option<RopeScaling>);

/// `x` as a number, or an error naming config.json's `key`.
fn json_number(key: &str, x: &Value) -> Result<f64, String> {
    x.as_f64()
        .ok_or_else(|| format!("config.json: {key} must be a number, found {x}"))
}

/// Where transformers keeps the RoPE settings: `rope_parameters` (transformers ≥ 5: theta,
/// type and the scaling's fields together) and the older top-level `rope_theta` with a
/// `rope_scaling` object (`rope_type`, or `type` before 4.45). Both may be present (files
/// written for both versions); where they disagree on a value the file is refused rather than
/// one silently winning.
fn read_rope(v: &Value) -> Result<Rope, String> {
    let max_positions = v.get("max_position_embeddings").and_then(Value::as_u64);
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
    // rope_theta: top level and/or rope_parameters.rope_theta.
    let top = v
        .get("rope_theta")
        .filter(|x| !x.is_null())
        .map(|x| json_number("rope_theta", x))
        .transpose()?;
    let nested = params
        .and_then(|p| p.get("rope_theta"))
        .filter(|x| !x.is_null())
        .map(|x| json_number("rope_parameters.rope_theta", x))
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
    if kind == "yarn" {
        return Ok((theta, Some(deepseek::yarn_of(fields, name, max_positions)?)));
    }
    let scaling = rope_scaling_of(fields, name, (&kind, &kind_key))?;
    Ok((theta, scaling))
}

/// The scaling of RoPE type `kind` (read from `kind_key`) from the fields of the `name`
/// object (`rope_parameters` or `rope_scaling`): `None` for `default`; an unsupported type is
/// refused, since it changes the rotary frequencies.
fn rope_scaling_of(
    fields: &serde_json::Map<String, Value>,
    name: &str,
    (kind, kind_key): (&str, &str),
) -> Result<Option<RopeScaling>, String> {
    let field = |k: &str| -> Result<f64, String> {
        let key = format!("{name}.{k}");
        match fields.get(k) {
            None | Some(Value::Null) => Err(format!(
                "config.json: {key} is missing; rope_type {kind:?} needs it"
            )),
            Some(x) => json_number(&key, x),
        }
    };
    Ok(match kind {
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
        "linear" => {
            let factor = field("factor")?;
            if factor <= 0.0 {
                return Err(format!("config.json: {name}.factor ({factor}) must be positive"));
            }
            Some(RopeScaling::Linear { factor })
        }
        other => {
            return Err(format!(
                "config.json: {kind_key} {other:?} is not supported (supported: \"default\", \"llama3\", \"linear\", and \"yarn\" for DeepseekV3); it changes the rotary frequencies, so the model cannot run without it"
            ))
        }
    })
}

/// Gemma 3's RoPE: the full layers' settings and the sliding layers' base. transformers 5
/// writes `rope_parameters: {full_attention: {...}, sliding_attention: {...}}`; transformers 4
/// `rope_theta` (default 1e6), `rope_scaling` and `rope_local_base_freq` (default 1e4). The
/// sliding layers run plain RoPE.
fn read_gemma_rope(v: &Value) -> Result<(Rope, Option<f64>), String> {
    let nested = v
        .get("rope_parameters")
        .and_then(Value::as_object)
        .filter(|o| o.values().any(Value::is_object));
    let Some(per_kind) = nested else {
        let mut flat = v.clone();
        if flat.get("rope_theta").is_none_or(Value::is_null)
            && v.pointer("/rope_parameters/rope_theta").is_none()
        {
            flat["rope_theta"] = serde_json::json!(1e6);
        }
        let local = v
            .get("rope_local_base_freq")
            .and_then(Value::as_f64)
            .unwrap_or(1e4);
        return Ok((read_rope(&flat)?, Some(local)));
    };
    for k in per_kind.keys() {
        if k != "full_attention" && k != "sliding_attention" {
            return Err(format!(
                "config.json: rope_parameters.{k} is not a layer type (full_attention, sliding_attention)"
            ));
        }
    }
    let one = |kind: &str, theta: f64| -> Result<Rope, String> {
        let mut p = per_kind.get(kind).cloned().unwrap_or(serde_json::json!({}));
        if p.get("rope_theta").is_none() {
            p["rope_theta"] = serde_json::json!(theta);
        }
        read_rope(&serde_json::json!({ "rope_parameters": p }))
            .map_err(|e| e.replace("rope_parameters", &format!("rope_parameters.{kind}")))
    };
    let full = one("full_attention", 1e6)?;
    let (local, scaling) = one("sliding_attention", 1e4)?;
    if scaling.is_some() {
        return Err(
            "config.json: rope_parameters.sliding_attention: RoPE scaling on sliding layers is not supported"
                .into(),
        );
    }
    Ok((full, Some(local)))
}

/// The sliding window and each layer's attention: `layer_types` (`full_attention`,
/// `sliding_attention`; Gemma 3 defaults to every sixth layer full), Mistral's `sliding_window`
/// on every layer, Qwen2/3's `use_sliding_window` on the layers from `max_window_layers` on.
fn read_windows(
    v: &Value,
    arch: Arch,
    layers: usize,
) -> Result<(Option<usize>, Vec<LayerKind>), String> {
    if arch.hybrid() {
        return Ok((None, read_hybrid_layers(v, layers)?));
    }
    let qwen = matches!(
        arch,
        Arch::Qwen2 | Arch::MiMo | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe
    );
    let use_window = v.get("use_sliding_window").and_then(Value::as_bool);
    let window = match v.get("sliding_window") {
        None | Some(Value::Null) => None,
        // transformers' Qwen2-MoE writes 0 where use_sliding_window is off.
        Some(_) if qwen && use_window != Some(true) => None,
        Some(x) => match x.as_u64() {
            Some(w) if w > 0 => Some(w as usize),
            _ => {
                return Err(format!(
                    "config.json: sliding_window must be a positive integer or null, found {x}"
                ))
            }
        },
    };
    let listed: Option<Vec<LayerKind>> = match v.get("layer_types") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("full_attention") => Ok(LayerKind::Full),
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    _ => Err(format!("config.json: layer_types[{i}] {t} is not supported (full_attention, sliding_attention)")),
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(x) => return Err(format!("config.json: layer_types must be a list, found {x}")),
    };
    let kinds = match (arch, listed) {
        // Qwen: `use_sliding_window` decides; `layer_types` as transformers derives it.
        (_, _) if qwen && use_window != Some(true) => Vec::new(),
        // Seed-OSS's attention has no window (transformers reads no `sliding_window` there).
        (Arch::SeedOss, _) => Vec::new(),
        (_, Some(l)) => l,
        // GPT-OSS and Gemma 2: sliding and full layers alternate, sliding first; Qwen2-MoE
        // likewise below max_window_layers, full above.
        (Arch::GptOss | Arch::Gemma2, None) => alternating(layers, layers),
        (Arch::Qwen2Moe, None) => {
            let below = v.get("max_window_layers").and_then(Value::as_u64);
            alternating(layers, below.unwrap_or(28) as usize)
        }
        (Arch::Gemma3, None) => {
            let pattern = v
                .get("sliding_window_pattern")
                .and_then(Value::as_u64)
                .unwrap_or(6) as usize;
            (0..layers)
                .map(|i| match (i + 1) % pattern.max(1) {
                    0 => LayerKind::Full,
                    _ => LayerKind::Sliding,
                })
                .collect()
        }
        _ if qwen => {
            let from = v
                .get("max_window_layers")
                .and_then(Value::as_u64)
                .unwrap_or(layers as u64) as usize;
            (0..layers)
                .map(|i| match i >= from {
                    true => LayerKind::Sliding,
                    false => LayerKind::Full,
                })
                .collect()
        }
        // Mistral (and Llama configs that carry one): the window applies to every layer.
        _ => match window {
            Some(_) => vec![LayerKind::Sliding; layers],
            None => Vec::new(),
        },
    };
    if !kinds.is_empty() && kinds.len() != layers {
        return Err(format!(
            "config.json: layer_types lists {} layers for num_hidden_layers {layers}",
            kinds.len()
        ));
    }
    if kinds.contains(&LayerKind::Sliding) && window.is_none() {
        return Err("config.json: sliding_attention layers need a sliding_window".into());
    }
    let kinds = if kinds.iter().all(|k| *k == LayerKind::Full) {
        Vec::new()
    } else {
        kinds
    };
    Ok((window.filter(|_| !kinds.is_empty()), kinds))
}

/// `layers` layer kinds: sliding for the even layers below `below`, full for the others.
fn alternating(layers: usize, below: usize) -> Vec<LayerKind> {
    (0..layers)
        .map(|i| match i % 2 == 0 && i < below {
            true => LayerKind::Sliding,
            false => LayerKind::Full,
        })
        .collect()
}

/// Keys that would change the computation in ways this implementation does not follow: refused
/// by name instead of silently ignored.
fn refuse_unsupported(v: &Value, arch: Arch) -> Result<(), String> {
    // Qwen3.5 reads its partial rotary factor ([`read_rotary_dim`]).
    let partial_rotary_keys = match arch {
        _ if arch.partial_rotary() => &[][..],
        _ => &[
            "partial_rotary_factor",
            "rope_parameters.partial_rotary_factor",
        ][..],
    };
    for key in partial_rotary_keys {
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
    // Gemma names it `hidden_activation` (GELU, tanh approximation); the others `hidden_act`.
    let (act_key, want) = if arch.gemma() {
        ("hidden_activation", "gelu_pytorch_tanh")
    } else {
        ("hidden_act", "silu")
    };
    if let Some(act) = v.get(act_key).and_then(Value::as_str) {
        if act != want {
            return Err(format!(
                "config.json: {act_key} {act:?} is not supported (a gated MLP with {want} only)"
            ));
        }
    }
    for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
        if let Some(x) = v.get(key).filter(|x| !x.is_null() && arch != Arch::Gemma2) {
            return Err(format!(
                "config.json: {key} ({x}) is not supported (logits without tanh soft-capping only)"
            ));
        }
    }
    if v.get("use_bidirectional_attention")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(
            "config.json: use_bidirectional_attention true is not supported (causal attention only)"
                .into(),
        );
    }
    // DeepSeek-V3's and Kimi-K2's hub weights are fp8 blocks with `weight_scale_inv` scales:
    // read as plain numbers they would be wrong weights.
    if let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        // GPT-OSS's published experts: MXFP4 blocks and scales, dequantized as they are read
        // (`weights::hf`); every other tensor of those checkpoints is bf16.
        if !(arch == Arch::GptOss && method == "mxfp4") {
            return Err(format!(
            "config.json: quantization_config (quant_method {method:?}) is not supported: weights are read as unquantized bf16/f16/f32 tensors; dequantize the checkpoint first (for DeepSeek-V3's fp8 weights, its fp8_cast_bf16 conversion; GPT-OSS's mxfp4 experts are read) and drop the key"
        ));
        }
    }
    if v.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
        return Err(
            "config.json: mlp_bias true is not supported (MLP projections without bias only)"
                .into(),
        );
    }
    Ok(())
}

/// The settings of the language model: a multimodal Qwen3.5 checkpoint keeps them in
/// `text_config` (with tied embeddings possibly said only at the top level); others at the top.
fn text_settings(v: &Value, arch: Arch) -> std::borrow::Cow<'_, Value> {
    match v.get("text_config").filter(|t| t.is_object()) {
        Some(t) if arch.hybrid() || arch.vision() => {
            let mut t = t.clone();
            if t.get("tie_word_embeddings").is_none() {
                if let Some(tie) = v.get("tie_word_embeddings") {
                    t["tie_word_embeddings"] = tie.clone();
                }
            }
            std::borrow::Cow::Owned(t)
        }
        _ => std::borrow::Cow::Borrowed(v),
    }
}

/// `(q/k/v bias, o_proj bias)`: Qwen2 and MiMo always have q/k/v biases and never an o_proj
/// bias; Seed-OSS has q/k/v biases by default (`attention_bias`) and the output projection's
/// its own key (`attention_out_bias`); the others take both from `attention_bias`.
fn read_biases(v: &Value, arch: Arch) -> Result<(bool, bool), String> {
    let attention_bias = flag(
        v,
        "attention_bias",
        matches!(arch, Arch::SeedOss | Arch::GptOss),
    )?;
    Ok(match arch {
        Arch::Qwen2 | Arch::MiMo | Arch::Qwen2_5Vl => (true, false),
        Arch::SeedOss => (attention_bias, flag(v, "attention_out_bias", false)?),
        Arch::Glm4Moe => (attention_bias, false),
        Arch::Qwen2Moe => (flag(v, "qkv_bias", true)?, false),
        _ => (attention_bias, attention_bias),
    })
}

/// The RoPE settings of `arch`: Gemma 3's two bases, or one base and scaling; yarn only where
/// the family's attention follows it (DeepSeek-V3, GPT-OSS).
fn read_family_rope(v: &Value, arch: Arch) -> Result<(Rope, Option<f64>), String> {
    let rope = match arch {
        Arch::Gemma3 => read_gemma_rope(v)?,
        // The hub's Qwen2.5-VL configs say `rope_scaling: {type: mrope, mrope_section}`: plain
        // frequencies, split over the three position axes ([`read_mrope`]).
        _ if arch.vision() => {
            let mut plain = v.clone();
            for key in ["rope_scaling", "rope_parameters"] {
                for kind in ["type", "rope_type"] {
                    if plain[key][kind] == "mrope" {
                        plain[key][kind] = "default".into();
                    }
                }
            }
            (read_rope(&plain)?, None)
        }
        _ => (read_rope(v)?, None),
    };
    if matches!(rope.0 .1, Some(RopeScaling::Yarn { .. }))
        && !matches!(arch, Arch::DeepseekV3 | Arch::GptOss)
    {
        return Err("config.json: rope_type \"yarn\" (rope_parameters or rope_scaling) is supported for DeepseekV3 and GptOss only (not with other families' attention)".into());
    }
    Ok(rope)
}

/// `(num_key_value_heads, head_dim)`. Latent attention (`mla`) expands its keys and values
/// for every head, so num_key_value_heads names nothing there, and its rotary tables span its
/// rope values (transformers sets head_dim so).
fn read_kv_heads(
    v: &Value,
    mla: Option<&MlaArgs>,
    hidden_size: usize,
    heads: usize,
) -> (usize, usize) {
    let read = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
    match mla {
        Some(m) => (heads, m.qk_rope_head_dim),
        None => (
            read("num_key_value_heads").unwrap_or(heads),
            read("head_dim").unwrap_or(hidden_size / heads.max(1)),
        ),
    }
}

/// A vision-language model's rotary sections and vision tower (`None`s for other layouts):
/// `top` the whole config, `text` its language model's settings.
fn read_vision(
    top: &Value,
    text: &Value,
    arch: Arch,
    rotary_dim: usize,
    hidden_size: usize,
) -> Result<(Option<Mrope>, Option<VisionArgs>), String> {
    if !multimodal(top, arch) {
        return Ok((None, None));
    }
    let vision = VisionArgs::from_hf(top, text, arch)?;
    if vision.out_hidden_size != hidden_size {
        return Err(format!("config.json: vision_config.out_hidden_size ({}) must equal the language model's hidden_size ({hidden_size}): the tower's features replace token embeddings", vision.out_hidden_size));
    }
    // Qwen3.5's sections are always interleaved, [11, 11, 10] unless the config says.
    let mrope = match arch.hybrid() {
        true if text["rope_parameters"].get("mrope_section").is_none() => Mrope {
            section: vec![11, 11, 10],
            interleaved: true,
        },
        true => Mrope {
            interleaved: true,
            ..read_mrope(text, rotary_dim)?
        },
        false => read_mrope(text, rotary_dim)?,
    };
    Ok((Some(mrope), Some(vision)))
}

/// Whether a config describes a vision-language model: a vision-language layout, or a
/// Qwen3.5 (MoE) `...ForConditionalGeneration` with a `vision_config` (the hub's Qwen3.5
/// checkpoints, natively multimodal).
pub fn multimodal(top: &Value, arch: Arch) -> bool {
    let conditional = top["architectures"].as_array().is_some_and(|a| {
        a.iter().any(|x| {
            x.as_str()
                .is_some_and(|n| n.ends_with("ForConditionalGeneration"))
        })
    });
    let tower = top.get("vision_config").is_some_and(Value::is_object);
    arch.vision() || (arch.hybrid() && conditional && tower)
}

/// The multimodal rotary sections of a vision-language model's text settings
/// (`rope_parameters.mrope_section`, or the hub's `rope_scaling.mrope_section`) over its
/// `head_dim / 2` rotary frequencies (`head_dim`: the rotary width); `mrope_interleaved` as
/// Qwen3-VL says.
fn read_mrope(v: &Value, head_dim: usize) -> Result<Mrope, String> {
    let found = ["rope_parameters", "rope_scaling"]
        .iter()
        .find_map(|k| v.get(k)?.get("mrope_section").map(|s| (*k, s)));
    let Some((key, section)) = found else {
        return Err("config.json: a vision-language model needs rope_parameters.mrope_section (how the rotary frequencies split over temporal, height and width positions)".into());
    };
    let section: Vec<usize> = section
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as usize)
                .collect()
        })
        .filter(|s: &Vec<usize>| s.len() == 3)
        .ok_or(format!(
            "config.json: {key}.mrope_section must be three non-negative integers, found {section}"
        ))?;
    let interleaved = v[key]["mrope_interleaved"].as_bool().unwrap_or(false);
    // Consecutive sections split the frequencies exactly (transformers splits the tensor by
    // them); interleaved ones only mark which frequencies follow the row and the column.
    if !interleaved && section.iter().sum::<usize>() != head_dim / 2 {
        return Err(format!(
            "config.json: {key}.mrope_section {section:?} must sum to the rotary frequencies, {}",
            head_dim / 2
        ));
    }
    Ok(Mrope {
        section,
        interleaved,
    })
}

/// Gemma 2's soft-capping value `key` (absent or null: none); other families refuse the key
/// ([`refuse_unsupported`]).
fn softcap(v: &Value, arch: Arch, key: &str) -> Result<Option<f64>, String> {
    match arch {
        Arch::Gemma2 => positive(v, key),
        _ => Ok(None),
    }
}

/// A positive finite number of config.json (`None` when absent or null).
fn positive(v: &Value, key: &str) -> Result<Option<f64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match json_number(key, x)? {
            c if c.is_finite() && c > 0.0 => Ok(Some(c)),
            _ => Err(format!(
                "config.json: {key} must be a positive number or null, found {x}"
            )),
        },
    }
}

/// A true/false key of config.json (`default` when absent or null).
fn flag(v: &Value, key: &str, default: bool) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(x) => Err(format!(
            "config.json: {key} must be true or false, found {x}"
        )),
    }
}

/// MiMo's and GLM-4.5's `num_nextn_predict_layers` (absent or null: none).
fn read_mtp_layers(v: &Value) -> Result<usize, String> {
    match v.get("num_nextn_predict_layers") {
        None | Some(Value::Null) => Ok(0),
        Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
            format!(
                "config.json: num_nextn_predict_layers must be a non-negative integer, found {x}"
            )
        }),
    }
}

impl ModelArgs {
    /// Reads an HF `config.json` value (after `override_config` entries were applied).
    pub fn from_hf(v: &Value) -> Result<Self, String> {
        let arch = arch_of(v)?;
        let top = v;
        let text = text_settings(v, arch);
        let v = text.as_ref();
        let (qkv_bias, o_bias) = read_biases(v, arch)?;
        let gemma = arch.gemma();
        let ((rope_theta, rope_scaling), rope_local_theta) = read_family_rope(v, arch)?;
        refuse_unsupported(v, arch)?;
        let deepseek = arch == Arch::DeepseekV3;
        let mla = deepseek.then(|| MlaArgs::from_hf(v)).transpose()?;
        let hidden_size = get_usize(v, "hidden_size")?;
        let heads = get_usize(v, "num_attention_heads")?;
        let (kv, head_dim) = read_kv_heads(v, mla.as_ref(), hidden_size, heads);
        let layers = get_usize(v, "num_hidden_layers")?;
        let windows = read_windows(v, arch, layers)?;
        if heads == 0 || kv == 0 || heads % kv != 0 {
            return Err(format!("config.json: num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv})"));
        }
        let rotary_dim = match arch {
            Arch::Glm4Moe => Some(read_rotary_dim(v, head_dim, 0.5)?),
            _ if arch.hybrid() => Some(read_rotary_dim(v, head_dim, 0.25)?),
            _ => None,
        };
        let rotary = rotary_dim.unwrap_or(head_dim);
        let (mrope, vision) = read_vision(top, v, arch, rotary, hidden_size)?;
        Ok(Self {
            arch,
            vocab_size: get_usize(v, "vocab_size")?,
            hidden_size,
            // Qwen3.5-MoE's configs have no dense MLP width (every layer is experts).
            intermediate_size: match (v.get("intermediate_size"), arch) {
                (None, Arch::Qwen3_5Moe) => get_usize(v, "moe_intermediate_size")?,
                _ => get_usize(v, "intermediate_size")?,
            },
            num_hidden_layers: layers,
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
            qkv_bias,
            o_bias,
            max_position_embeddings: v
                .get("max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096) as usize,
            num_labels: v
                .get("num_labels")
                .and_then(Value::as_u64)
                .map(|x| x as usize),
            query_pre_attn_scalar: if gemma {
                Some(
                    v.get("query_pre_attn_scalar")
                        .and_then(Value::as_f64)
                        .unwrap_or(256.0),
                )
            } else {
                None
            },
            sliding_window: windows.0,
            layer_types: windows.1,
            rope_local_theta,
            moe: match arch {
                Arch::Qwen3Moe
                | Arch::Qwen2Moe
                | Arch::Qwen3Next
                | Arch::Qwen3_5Moe
                | Arch::Qwen3VlMoe
                | Arch::GptOss => Some(MoeArgs::from_hf(v, layers, arch)?),
                Arch::DeepseekV3 | Arch::Glm4Moe => Some(deepseek::moe_from_hf(v, layers)?),
                _ => None,
            },
            rotary_dim,
            attn_output_gate: arch.hybrid(),
            linear_attn: match arch.hybrid() {
                true => Some(LinearAttnArgs::from_hf(v, arch == Arch::Qwen3Next)?),
                false => None,
            },
            auto_map: v.get("auto_map").filter(|m| m.is_object()).cloned(),
            remote_code: Default::default(),
            attention_dropout: dropout(v, "attention_dropout")?,
            residual_dropout: match arch {
                Arch::SeedOss => dropout(v, "residual_dropout")?,
                _ => 0.0,
            },
            mtp_layers: match arch {
                Arch::MiMo => read_mtp_layers(v)?,
                _ => 0,
            },
            mla,
            // GLM-4.5's optional q/k norms and its multi-token-prediction layers.
            use_qk_norm: arch == Arch::Glm4Moe && flag(v, "use_qk_norm", false)?,
            attn_logit_softcapping: softcap(v, arch, "attn_logit_softcapping")?,
            final_logit_softcapping: softcap(v, arch, "final_logit_softcapping")?,
            trailing_mtp_layers: (arch == Arch::Glm4Moe)
                .then(|| read_mtp_layers(v))
                .transpose()?
                .unwrap_or(0),
            mrope,
            vision,
        })
    }

    /// [`kept_as_read`], and DeepSeek's multi-token-prediction layers
    /// (`model.layers.{num_hidden_layers + j}.*`, [`MlaArgs::num_nextn_predict_layers`]).
    pub fn kept_as_read(&self, name: &str) -> bool {
        let frozen_tower = self.vision.as_ref().is_some_and(|v| v.frozen);
        kept_as_read(name)
            || self.deepseek_mtp_layer(name)
            || (frozen_tower && name.starts_with(VISUAL))
    }

    /// Whether `name` is a tensor of one of DeepSeek's or GLM-4.5's multi-token-prediction
    /// layers.
    pub fn deepseek_mtp_layer(&self, name: &str) -> bool {
        let extra = match &self.mla {
            Some(m) => m.num_nextn_predict_layers,
            None => self.trailing_mtp_layers,
        };
        if extra == 0 {
            return false;
        }
        let index = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(i, _)| i.parse::<usize>().ok());
        let l = self.num_hidden_layers;
        index.is_some_and(|i| i >= l && i < l + extra)
    }

    /// Whether each head of q and k goes through an RMSNorm before RoPE.
    pub fn qk_norm(&self) -> bool {
        self.arch.qk_norm() || self.use_qk_norm
    }

    /// Whether the experts are GPT-OSS's ([`ClampedSwiglu`]): biased, stored fused and
    /// interleaved, out of PEFT's reach.
    pub fn gpt_oss_experts(&self) -> bool {
        self.moe.as_ref().is_some_and(|m| m.swiglu.is_some())
    }

    /// Whether attention runs as its own composition over a bias: DeepSeek-V3's latent
    /// attention, GPT-OSS's sinks, Gemma 2's soft-capped scores (never the blocked op).
    pub fn special_attention(&self) -> bool {
        self.mla.is_some() || self.arch.sinks() || self.attn_logit_softcapping.is_some()
    }

    /// Whether the model runs as the op composition alone, which the packed decode engine does
    /// not serve: special attention ([`Self::special_attention`]), DeepSeek's routing, or
    /// soft-capped logits.
    pub fn composition_only(&self) -> bool {
        self.special_attention()
            || self.deepseek_routing()
            || self.final_logit_softcapping.is_some()
    }

    /// Whether the experts route as DeepSeek-V3's (group-limited sigmoid top-k with shared
    /// experts: DeepSeek-V3 and GLM-4.5), which only the op composition computes.
    pub fn deepseek_routing(&self) -> bool {
        self.moe.as_ref().is_some_and(|m| m.deepseek.is_some())
    }

    /// The values of each head that rotary embeddings turn (`head_dim` unless partial).
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim.unwrap_or(self.head_dim)
    }

    /// Whether layer `layer` is a Gated DeltaNet (no attention).
    pub fn is_linear(&self, layer: usize) -> bool {
        self.layer_kind(layer) == LayerKind::Linear
    }

    /// Whether every layer of this model is an attention layer (no Gated DeltaNet layers: those
    /// of the hybrids run as the op composition around their mixer op, the attention layers on
    /// the hand-written layer).
    pub fn all_attention(&self) -> bool {
        self.linear_attn.is_none()
    }

    /// RoPE inverse frequencies `[head_dim / 2]`: `θ^(−2i/d)`, then the scaling's adjustment.
    pub fn inv_freq(&self) -> Vec<f64> {
        let rd = self.rotary_dim();
        let d = rd as f64;
        let plain = (0..rd / 2).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d));
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
            Some(RopeScaling::Linear { factor }) => plain.map(|f| f / factor).collect(),
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: context,
                beta_fast,
                beta_slow,
                truncate,
                ..
            }) => deepseek::yarn_inv_freq(
                rd,
                self.rope_theta,
                factor,
                context as f64,
                (beta_fast, beta_slow),
                truncate,
            ),
        }
    }

    /// The factor on the rotary cos/sin tables: yarn's attention factor, else 1.
    pub fn rope_table_scale(&self) -> f64 {
        match self.rope_scaling {
            Some(RopeScaling::Yarn {
                factor,
                mscale,
                mscale_all_dim,
                attention_factor,
                ..
            }) => deepseek::yarn_attention_factor(factor, mscale, mscale_all_dim, attention_factor),
            _ => 1.0,
        }
    }

    /// The RoPE inverse frequencies of layer `layer`: a sliding layer with its own base
    /// (`rope_local_theta`) uses plain RoPE at that base, every other layer [`Self::inv_freq`].
    pub fn inv_freq_of(&self, layer: usize) -> Vec<f64> {
        match (self.layer_kind(layer), self.rope_local_theta) {
            (LayerKind::Sliding, Some(theta)) => {
                let d = self.head_dim as f64;
                (0..self.head_dim / 2)
                    .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d))
                    .collect()
            }
            _ => self.inv_freq(),
        }
    }

    /// Whether some layer has RoPE frequencies of its own (one table per layer kind).
    pub fn local_rope(&self) -> bool {
        self.rope_local_theta.is_some() && self.layer_types.contains(&LayerKind::Sliding)
    }

    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        self.layer_types
            .get(layer)
            .copied()
            .unwrap_or(LayerKind::Full)
    }

    /// The window of layer `layer` (positions it sees, its own included), `None` for full
    /// attention.
    pub fn window(&self, layer: usize) -> Option<usize> {
        match self.layer_kind(layer) {
            LayerKind::Sliding => self.sliding_window,
            LayerKind::Full | LayerKind::Linear => None,
        }
    }

    /// The factor on attention scores: `query_pre_attn_scalar^-½`, DeepSeek's
    /// `(nope + rope)^-½` (times yarn's `mscale_all_dim` adjustment), else `head_dim^-½`.
    pub fn attn_scale(&self) -> f64 {
        if let Some(m) = &self.mla {
            let plain = 1.0 / (m.qk_head_dim() as f64).sqrt();
            return plain * deepseek::softmax_mscale(self.rope_scaling.as_ref());
        }
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .sqrt()
    }

    /// The factor on embeddings: Gemma's √hidden, rounded to f32 as transformers keeps it.
    pub fn embed_scale(&self) -> Option<f64> {
        self.arch
            .gemma()
            .then(|| f64::from((self.hidden_size as f64).sqrt() as f32))
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
        let mut out = serde_json::json!({
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
            "attention_bias": self.qkv_bias && !matches!(self.arch, Arch::Qwen2 | Arch::MiMo | Arch::Qwen2Moe),
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        });
        let kinds: Vec<&str> = (0..self.num_hidden_layers)
            .map(|i| match self.layer_kind(i) {
                LayerKind::Full => "full_attention",
                LayerKind::Sliding => "sliding_attention",
                LayerKind::Linear => "linear_attention",
            })
            .collect();
        if let Some(w) = self.sliding_window {
            out["sliding_window"] = serde_json::json!(w);
            out["layer_types"] = serde_json::json!(kinds);
            if matches!(
                self.arch,
                Arch::Qwen2 | Arch::MiMo | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe
            ) {
                out["use_sliding_window"] = serde_json::json!(true);
                let first = kinds.iter().position(|k| *k == "sliding_attention");
                out["max_window_layers"] = serde_json::json!(first.unwrap_or(kinds.len()));
            }
        }
        if let Some(m) = &self.moe {
            m.write_hf(out.as_object_mut().expect("an object"));
        }
        if let Some(l) = &self.linear_attn {
            let o = out.as_object_mut().expect("an object");
            o.insert("layer_types".into(), serde_json::json!(kinds));
            o.insert("linear_num_key_heads".into(), l.num_key_heads.into());
            o.insert("linear_num_value_heads".into(), l.num_value_heads.into());
            o.insert("linear_key_head_dim".into(), l.key_head_dim.into());
            o.insert("linear_value_head_dim".into(), l.value_head_dim.into());
            o.insert("linear_conv_kernel_dim".into(), l.conv_kernel.into());
            let factor = self.rotary_dim() as f64 / self.head_dim as f64;
            o.insert("partial_rotary_factor".into(), factor.into());
            out["rope_parameters"]["partial_rotary_factor"] = factor.into();
        }
        out["attention_dropout"] = self.attention_dropout.into();
        if let Some(m) = &self.auto_map {
            out["auto_map"] = m.clone();
        }
        if let Some(m) = &self.mla {
            m.write_hf(out.as_object_mut().expect("an object"));
        }
        match self.arch {
            Arch::SeedOss => {
                out["attention_out_bias"] = self.o_bias.into();
                out["residual_dropout"] = self.residual_dropout.into();
            }
            Arch::MiMo => out["num_nextn_predict_layers"] = self.mtp_layers.into(),
            Arch::Qwen2Moe => out["qkv_bias"] = self.qkv_bias.into(),
            Arch::GptOss => {
                // transformers would alternate the layers where the list is absent.
                out["layer_types"] = serde_json::json!(kinds);
                out["sliding_window"] = serde_json::json!(self.sliding_window);
            }
            Arch::Glm4Moe => {
                out["use_qk_norm"] = self.use_qk_norm.into();
                out["num_nextn_predict_layers"] = self.trailing_mtp_layers.into();
                let factor = self.rotary_dim() as f64 / self.head_dim as f64;
                out["partial_rotary_factor"] = factor.into();
                out["rope_parameters"]["partial_rotary_factor"] = factor.into();
            }
            _ => {}
        }
        if self.arch == Arch::Gemma3 {
            self.write_gemma_hf(out.as_object_mut().expect("an object"), &kinds);
        }
        if let (Some(v), Some(m)) = (&self.vision, &self.mrope) {
            out = self.write_vision_hf(out, v, m);
        }
        if self.arch == Arch::Gemma2 {
            let o = out.as_object_mut().expect("an object");
            o.remove("hidden_act");
            o.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
            o.insert("layer_types".into(), serde_json::json!(kinds));
            o.insert("query_pre_attn_scalar".into(), self.integral_scalar());
            o.insert(
                "attn_logit_softcapping".into(),
                serde_json::json!(self.attn_logit_softcapping),
            );
            o.insert(
                "final_logit_softcapping".into(),
                serde_json::json!(self.final_logit_softcapping),
            );
        }
        out
    }

    /// A vision-language config as transformers 5 writes it: the language model's settings
    /// `text` in `text_config` (its `rope_parameters` with the M-RoPE sections), the tower's
    /// `vision_config` as read, and the placeholder ids at the top.
    fn write_vision_hf(&self, mut text: Value, v: &VisionArgs, m: &Mrope) -> Value {
        let (arch, model_type, text_type) = match self.arch {
            Arch::Qwen3_5 => ("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5_text"),
            Arch::Qwen3_5Moe => (
                "Qwen3_5MoeForConditionalGeneration",
                "qwen3_5_moe",
                "qwen3_5_moe_text",
            ),
            _ => {
                let (arch, model_type) = self.arch.hf_names();
                (arch, model_type, "")
            }
        };
        let text_type = match text_type {
            "" => format!("{model_type}_text"),
            t => t.to_string(),
        };
        let o = text.as_object_mut().expect("an object");
        for k in ["architectures", "rope_scaling", "rope_theta"] {
            o.remove(k);
        }
        o.insert("model_type".into(), text_type.into());
        text["rope_parameters"]["mrope_section"] = serde_json::json!(m.section);
        if m.interleaved {
            text["rope_parameters"]["mrope_interleaved"] = true.into();
        }
        serde_json::json!({
            "architectures": [arch],
            "model_type": model_type,
            "text_config": text,
            "vision_config": v.raw,
            "image_token_id": v.image_token_id,
            "video_token_id": v.video_token_id,
            "vision_start_token_id": v.vision_start_token_id,
            "vision_end_token_id": v.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        })
    }

    /// `query_pre_attn_scalar` as transformers' Gemma config classes take it: an integer.
    fn integral_scalar(&self) -> Value {
        match self.query_pre_attn_scalar {
            Some(x) if x.fract() == 0.0 && x >= 0.0 => serde_json::json!(x as u64),
            x => serde_json::json!(x),
        }
    }

    /// Gemma 3's own keys: its activation, layer types, score scale, and the two RoPE bases.
    fn write_gemma_hf(&self, o: &mut serde_json::Map<String, Value>, kinds: &[&str]) {
        o.remove("hidden_act");
        o.insert("hidden_activation".into(), "gelu_pytorch_tanh".into());
        o.insert("layer_types".into(), serde_json::json!(kinds));
        o.insert("query_pre_attn_scalar".into(), self.integral_scalar());
        let local = self.rope_local_theta.unwrap_or(self.rope_theta);
        o.insert("rope_local_base_freq".into(), serde_json::json!(local));
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({
                "full_attention": self.rope_parameters(),
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
            }),
        );
    }

    /// A tiny configuration for tests.
    pub fn tiny(arch: Arch, vocab_size: usize) -> Self {
        let a = Self {
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
            tie_word_embeddings: matches!(arch, Arch::Llama | Arch::Gemma3 | Arch::Gemma2),
            qkv_bias: matches!(
                arch,
                Arch::Qwen2 | Arch::MiMo | Arch::SeedOss | Arch::Qwen2Moe
            ),
            o_bias: arch == Arch::SeedOss,
            max_position_embeddings: 512,
            num_labels: None,
            query_pre_attn_scalar: arch.gemma().then_some(12.0),
            sliding_window: arch.gemma().then_some(4),
            layer_types: match arch {
                Arch::Gemma3 | Arch::Gemma2 => vec![LayerKind::Sliding, LayerKind::Full],
                _ if arch.hybrid() => vec![LayerKind::Linear, LayerKind::Full],
                _ => Vec::new(),
            },
            rope_local_theta: (arch == Arch::Gemma3).then_some(1000.0),
            moe: matches!(
                arch,
                Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::Qwen3_5Moe | Arch::Qwen3Next
            )
            .then(|| MoeArgs {
                num_experts: 8,
                num_experts_per_tok: 2,
                norm_topk_prob: true,
                moe_intermediate_size: 16,
                decoder_sparse_step: 1,
                mlp_only_layers: match arch {
                    Arch::Qwen3_5Moe => Vec::new(),
                    _ => vec![1],
                },
                router_aux_loss_coef: None,
                shared_expert_intermediate_size: (arch != Arch::Qwen3Moe).then_some(12),
                deepseek: None,
                swiglu: None,
            }),
            rotary_dim: arch.hybrid().then_some(4),
            attn_output_gate: arch.hybrid(),
            linear_attn: arch.hybrid().then_some(LinearAttnArgs {
                grouped: arch == Arch::Qwen3Next,
                num_key_heads: 2,
                num_value_heads: 4,
                key_head_dim: 8,
                value_head_dim: 6,
                conv_kernel: 4,
            }),
            mtp_layers: usize::from(arch == Arch::MiMo),
            attention_dropout: 0.0,
            residual_dropout: 0.0,
            auto_map: None,
            remote_code: Default::default(),
            mla: None,
            use_qk_norm: false,
            trailing_mtp_layers: 0,
            attn_logit_softcapping: (arch == Arch::Gemma2).then_some(5.0),
            final_logit_softcapping: (arch == Arch::Gemma2).then_some(3.0),
            mrope: None,
            vision: None,
        };
        match arch {
            Arch::DeepseekV3 => deepseek::tiny(a),
            Arch::Glm4Moe => deepseek::tiny_glm(a),
            Arch::GptOss => Self::tiny_gpt_oss(a),
            _ => a,
        }
    }

    /// [`Self::tiny`]'s GPT-OSS: biased attention with sinks, a 4-position sliding layer then a
    /// full one, four biased experts of width 12 (top 2) under a clamp of 1.5.
    fn tiny_gpt_oss(a: Self) -> Self {
        Self {
            intermediate_size: 12,
            tie_word_embeddings: false,
            qkv_bias: true,
            o_bias: true,
            sliding_window: Some(4),
            layer_types: vec![LayerKind::Sliding, LayerKind::Full],
            moe: Some(MoeArgs {
                num_experts: 4,
                num_experts_per_tok: 2,
                norm_topk_prob: true,
                moe_intermediate_size: 12,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
                router_aux_loss_coef: None,
                shared_expert_intermediate_size: None,
                deepseek: None,
                swiglu: Some(ClampedSwiglu {
                    alpha: 1.702,
                    limit: 1.5,
                }),
            }),
            ..a
        }
    }
}
