//! DeepSeek-V3's hyper-parameters (transformers 5.24's `deepseek_v3`, `DeepseekV3ForCausalLM`;
//! also what the Kimi-K2 and Moonlight checkpoints name): multi-head latent attention
//! ([`MlaArgs`]), its experts' routing ([`DeepseekRouting`]), and yarn RoPE, which this
//! implementation reads for this family only.
//!
//! Yarn (transformers' `_compute_yarn_parameters`), for rotary width `d`, base `θ`, `factor`
//! `s` and the pre-training context `L`:
//!
//! ```text
//! f_i = θ^(−2i/d)                      the plain frequencies, i < d/2
//! c(r) = d·ln(L / (2π·r)) / (2·ln θ)   the dimension turning r times over L
//! lo = max(⌊c(beta_fast)⌋, 0), hi = min(⌈c(beta_slow)⌉, d − 1)   (no rounding when !truncate)
//! ramp_i = clamp((i − lo) / (hi − lo), 0, 1)
//! inv_i = f_i/s · ramp_i + f_i · (1 − ramp_i)
//! m(s, k) = 0.1·k·ln s + 1 (1 for s ≤ 1)
//! cos/sin tables × attention_factor, default m(s, mscale) / m(s, mscale_all_dim) when both
//! are set and non-zero, else m(s, 1)
//! ```
//!
//! and DeepSeek's attention multiplies its softmax scale `(nope + rope)^−½` by
//! `m(s, mscale_all_dim)²` when `mscale_all_dim` is set and non-zero.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{get_usize, MoeArgs, RopeScaling};

/// Multi-head latent attention (transformers' `DeepseekV3Attention`): queries from `q_proj`
/// `[heads·(nope + rope), hidden]`, or with `q_lora_rank` through `q_a_proj` `[q_lora_rank,
/// hidden]`, the RMSNorm `q_a_layernorm` and `q_b_proj`; keys and values from one latent per
/// token: `kv_a_proj_with_mqa` `[kv_lora_rank + rope, hidden]` gives the latent (normed by
/// `kv_a_layernorm`) and one rope key shared by every head, and `kv_b_proj`
/// `[heads·(nope + v), kv_lora_rank]` expands the latent into each head's no-rope key and value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaArgs {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rope values of q and k come in interleaved pairs `(x0, x1), (x2, x3), …` (each pair
    /// turned by one frequency) rather than as two halves; transformers' default true.
    pub rope_interleave: bool,
    /// DeepSeek's multi-token-prediction layers (`num_nextn_predict_layers`), stored after the
    /// decoder layers as `model.layers.{num_hidden_layers + j}.*`: transformers' model has no
    /// such modules (it drops their tensors on load); here tensors found there are kept as read
    /// and saved back, never run or trained.
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
}

impl MlaArgs {
    /// The width of each head's query and key: `nope + rope`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    pub(super) fn from_hf(v: &Value) -> Result<Self, String> {
        let q_lora_rank = match v.get("q_lora_rank") {
            None | Some(Value::Null) => None,
            Some(x) => Some(x.as_u64().filter(|&r| r > 0).ok_or_else(|| {
                format!("config.json: q_lora_rank must be a positive integer or null, found {x}")
            })? as usize),
        };
        let a = Self {
            q_lora_rank,
            kv_lora_rank: get_usize(v, "kv_lora_rank")?,
            qk_nope_head_dim: get_usize(v, "qk_nope_head_dim")?,
            qk_rope_head_dim: get_usize(v, "qk_rope_head_dim")?,
            v_head_dim: get_usize(v, "v_head_dim")?,
            num_nextn_predict_layers: match v.get("num_nextn_predict_layers") {
                None | Some(Value::Null) => 0,
                Some(x) => x.as_u64().ok_or_else(|| format!("config.json: num_nextn_predict_layers must be a non-negative integer, found {x}"))? as usize,
            },
            rope_interleave: match v.get("rope_interleave") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(x) => {
                    return Err(format!(
                        "config.json: rope_interleave must be true or false, found {x}"
                    ))
                }
            },
        };
        if a.kv_lora_rank == 0 || a.v_head_dim == 0 || a.qk_head_dim() == 0 {
            return Err("config.json: kv_lora_rank, v_head_dim and qk_nope_head_dim + qk_rope_head_dim must be positive".into());
        }
        if a.qk_rope_head_dim == 0 || !a.qk_rope_head_dim.is_multiple_of(2) {
            return Err(format!(
                "config.json: qk_rope_head_dim ({}) must be a positive even number",
                a.qk_rope_head_dim
            ));
        }
        Ok(a)
    }

    pub(super) fn write_hf(&self, o: &mut serde_json::Map<String, Value>) {
        o.insert("q_lora_rank".into(), serde_json::json!(self.q_lora_rank));
        o.insert("kv_lora_rank".into(), self.kv_lora_rank.into());
        o.insert("qk_nope_head_dim".into(), self.qk_nope_head_dim.into());
        o.insert("qk_rope_head_dim".into(), self.qk_rope_head_dim.into());
        o.insert("v_head_dim".into(), self.v_head_dim.into());
        o.insert("rope_interleave".into(), self.rope_interleave.into());
        o.insert(
            "num_nextn_predict_layers".into(),
            self.num_nextn_predict_layers.into(),
        );
    }
}

/// DeepSeek-V3's router (transformers' `DeepseekV3TopkRouter`) and the layout of its experts:
/// scores `sigmoid(x·Wᵣᵀ)`; the experts are chosen on `scores + e_score_correction_bias` (a
/// buffer of the checkpoint, never trained): the experts fall in `n_group` groups, each group
/// ranked by the sum of its two best biased scores, only the best `topk_group` groups'
/// experts stay candidates, and the best `num_experts_per_tok` of those are chosen. Their
/// weights are the unbiased scores, divided by their sum (+1e-20) when `norm_topk_prob`, times
/// `routed_scaling_factor`. Every MoE layer also runs `n_shared_experts` shared experts as one
/// gated MLP `mlp.shared_experts` of width `n_shared_experts · moe_intermediate_size`, without a
/// gate. The first `first_k_dense_replace` layers keep the dense MLP.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekRouting {
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub n_shared_experts: usize,
    pub first_k_dense_replace: usize,
}

/// DeepSeek-V3's experts from config.json. transformers 5.24 reads no `moe_layer_freq` (every
/// layer from `first_k_dense_replace` on has experts), so a file asking for another spacing is
/// refused rather than run as transformers would run it against its own intent; and it adds no
/// load-balancing loss to the causal LM's loss, so `output_router_logits` asks for none here.
pub(super) fn moe_from_hf(v: &Value, layers: usize) -> Result<MoeArgs, String> {
    if let Some(f) = v.get("moe_layer_freq").filter(|f| !f.is_null()) {
        if f.as_u64() != Some(1) {
            return Err(format!("config.json: moe_layer_freq {f} is not supported (transformers' DeepseekV3 puts experts on every layer from first_k_dense_replace on: 1 only)"));
        }
    }
    let experts = get_usize(v, "n_routed_experts")?;
    let k = get_usize(v, "num_experts_per_tok")?;
    if k == 0 || k > experts {
        return Err(format!(
            "config.json: num_experts_per_tok ({k}) must be between 1 and n_routed_experts ({experts})"
        ));
    }
    let n_group = get_usize(v, "n_group")?;
    let topk_group = get_usize(v, "topk_group")?;
    if n_group == 0 || !experts.is_multiple_of(n_group) || experts / n_group < 2 {
        return Err(format!("config.json: n_group ({n_group}) must divide n_routed_experts ({experts}) into groups of two experts or more"));
    }
    if topk_group == 0 || topk_group > n_group || k > topk_group * (experts / n_group) {
        return Err(format!("config.json: topk_group ({topk_group}) must be between 1 and n_group ({n_group}) and leave num_experts_per_tok ({k}) experts to choose from"));
    }
    let scale = match v.get("routed_scaling_factor") {
        None | Some(Value::Null) => 1.0,
        Some(x) => x.as_f64().filter(|s| s.is_finite()).ok_or_else(|| {
            format!("config.json: routed_scaling_factor must be a number, found {x}")
        })?,
    };
    let first = get_usize(v, "first_k_dense_replace")?;
    Ok(MoeArgs {
        num_experts: experts,
        num_experts_per_tok: k,
        norm_topk_prob: v
            .get("norm_topk_prob")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        moe_intermediate_size: get_usize(v, "moe_intermediate_size")?,
        decoder_sparse_step: 1,
        mlp_only_layers: (0..first.min(layers)).collect(),
        router_aux_loss_coef: None,
        shared_expert_intermediate_size: None,
        swiglu: None,
        deepseek: Some(DeepseekRouting {
            n_group,
            topk_group,
            routed_scaling_factor: scale,
            n_shared_experts: get_usize(v, "n_shared_experts")?,
            first_k_dense_replace: first,
        }),
    })
}

/// DeepSeek-V3's expert keys of config.json (the inverse of [`moe_from_hf`]).
pub(super) fn write_moe_hf(
    m: &MoeArgs,
    d: &DeepseekRouting,
    o: &mut serde_json::Map<String, Value>,
) {
    o.insert("n_routed_experts".into(), m.num_experts.into());
    o.insert("num_experts_per_tok".into(), m.num_experts_per_tok.into());
    o.insert("norm_topk_prob".into(), m.norm_topk_prob.into());
    o.insert(
        "moe_intermediate_size".into(),
        m.moe_intermediate_size.into(),
    );
    o.insert("n_group".into(), d.n_group.into());
    o.insert("topk_group".into(), d.topk_group.into());
    o.insert(
        "routed_scaling_factor".into(),
        d.routed_scaling_factor.into(),
    );
    o.insert("n_shared_experts".into(), d.n_shared_experts.into());
    o.insert(
        "first_k_dense_replace".into(),
        d.first_k_dense_replace.into(),
    );
}

/// Yarn's `m(s, k)`: `0.1·k·ln s + 1`, 1 for `s ≤ 1`.
fn yarn_m(s: f64, k: f64) -> f64 {
    if s <= 1.0 {
        1.0
    } else {
        0.1 * k * s.ln() + 1.0
    }
}

/// The yarn scaling of `fields` (`rope_parameters` or `rope_scaling`, named `name`).
pub(super) fn yarn_of(
    fields: &serde_json::Map<String, Value>,
    name: &str,
    max_positions: Option<u64>,
) -> Result<RopeScaling, String> {
    let opt = |k: &str| -> Result<Option<f64>, String> {
        match fields.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => super::json_number(&format!("{name}.{k}"), x).map(Some),
        }
    };
    let factor = opt("factor")?.ok_or_else(|| {
        format!("config.json: {name}.factor is missing; rope_type \"yarn\" needs it")
    })?;
    let context = match opt("original_max_position_embeddings")? {
        Some(c) => c,
        None => max_positions.ok_or_else(|| format!("config.json: {name}.original_max_position_embeddings is missing (and no max_position_embeddings)"))? as f64,
    };
    if factor.is_nan() || factor <= 0.0 || context.fract() != 0.0 || context <= 0.0 {
        return Err(format!("config.json: {name}: yarn needs factor > 0 and a positive integer original_max_position_embeddings (got {factor}, {context})"));
    }
    let truncate = match fields.get("truncate") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(x) => {
            return Err(format!(
                "config.json: {name}.truncate must be true or false, found {x}"
            ))
        }
    };
    // transformers takes 32 and 1 where these are absent, null or zero.
    let nonzero = |x: Option<f64>, d: f64| x.filter(|&b| b != 0.0).unwrap_or(d);
    Ok(RopeScaling::Yarn {
        factor,
        original_max_position_embeddings: context as u64,
        beta_fast: nonzero(opt("beta_fast")?, 32.0),
        beta_slow: nonzero(opt("beta_slow")?, 1.0),
        mscale: opt("mscale")?,
        mscale_all_dim: opt("mscale_all_dim")?,
        attention_factor: opt("attention_factor")?,
        truncate,
    })
}

/// Yarn's inverse frequencies for rotary width `d` and base `theta` (the module header).
pub(super) fn yarn_inv_freq(
    d: usize,
    theta: f64,
    factor: f64,
    context: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f64> {
    let df = d as f64;
    let turns =
        |r: f64| df * (context / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (mut lo, mut hi) = (turns(beta_fast), turns(beta_slow));
    if truncate {
        lo = lo.floor();
        hi = hi.ceil();
    }
    let lo = lo.max(0.0);
    let mut hi = hi.min(df - 1.0);
    if lo == hi {
        hi += 0.001;
    }
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / theta.powf(2.0 * i as f64 / df);
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            f / factor * (1.0 - keep) + f * keep
        })
        .collect()
}

/// Yarn's factor on the cos/sin tables.
pub(super) fn yarn_attention_factor(
    factor: f64,
    mscale: Option<f64>,
    mscale_all_dim: Option<f64>,
    given: Option<f64>,
) -> f64 {
    if let Some(a) = given {
        return a;
    }
    match (
        mscale.filter(|&m| m != 0.0),
        mscale_all_dim.filter(|&m| m != 0.0),
    ) {
        (Some(m), Some(all)) => yarn_m(factor, m) / yarn_m(factor, all),
        _ => yarn_m(factor, 1.0),
    }
}

/// DeepSeek's factor on its softmax scale under a scaled RoPE: `m(factor, mscale_all_dim)²`
/// where `mscale_all_dim` is set and non-zero, else 1.
pub(super) fn softmax_mscale(s: Option<&RopeScaling>) -> f64 {
    match s {
        Some(RopeScaling::Yarn {
            factor,
            mscale_all_dim: Some(all),
            ..
        }) if *all != 0.0 => yarn_m(*factor, *all).powi(2),
        _ => 1.0,
    }
}

/// [`super::ModelArgs::tiny`]'s DeepSeek-V3: 4 heads of 8 + 4 query/key and 6 value values, a
/// 16-wide q latent and a 12-wide kv latent; layer 0 dense, layer 1 eight experts in four
/// groups (top 2 of the best 2 groups, renormalised, scaled 2.5) with one shared expert.
pub(super) fn tiny(a: super::ModelArgs) -> super::ModelArgs {
    super::ModelArgs {
        head_dim: 4,
        num_key_value_heads: a.num_attention_heads,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        mla: Some(MlaArgs {
            q_lora_rank: Some(16),
            kv_lora_rank: 12,
            qk_nope_head_dim: 8,
            qk_rope_head_dim: 4,
            v_head_dim: 6,
            rope_interleave: true,
            num_nextn_predict_layers: 0,
        }),
        moe: Some(tiny_routing(2, (4, 2), 2.5)),
        ..a
    }
}

/// [`super::ModelArgs::tiny`]'s GLM-4.5: grouped-query attention (4 heads of 8 over 2 KV
/// heads) with q/k/v biases, q/k norms and rotary embeddings over half of each head; layer 0
/// dense, layer 1 eight experts in two groups (top 3 of the best group, renormalised, scaled
/// 1.5) with one shared expert.
pub(super) fn tiny_glm(a: super::ModelArgs) -> super::ModelArgs {
    super::ModelArgs {
        tie_word_embeddings: false,
        qkv_bias: true,
        o_bias: false,
        use_qk_norm: true,
        rotary_dim: Some(a.head_dim / 2),
        moe: Some(tiny_routing(3, (2, 1), 1.5)),
        ..a
    }
}

/// The tiny models' DeepSeek experts: layer 0 dense, then eight experts of width 8, top `k`
/// renormalised in `(n_group, topk_group)` groups, scaled by `scale`, with one shared expert.
fn tiny_routing(k: usize, (n_group, topk_group): (usize, usize), scale: f64) -> MoeArgs {
    let first = 1;
    MoeArgs {
        num_experts: 8,
        num_experts_per_tok: k,
        norm_topk_prob: true,
        moe_intermediate_size: 8,
        decoder_sparse_step: 1,
        mlp_only_layers: (0..first).collect(),
        router_aux_loss_coef: None,
        shared_expert_intermediate_size: None,
        swiglu: None,
        deepseek: Some(DeepseekRouting {
            n_group,
            topk_group,
            routed_scaling_factor: scale,
            n_shared_experts: 1,
            first_k_dense_replace: first,
        }),
    }
}
