//! An encoder reward model: DeBERTa-v2 / v3 with a sequence-classification head, as
//! transformers' `DebertaV2ForSequenceClassification` (`models/deberta_v2/modeling_deberta_v2.py`)
//! computes it in eval mode. Inference only (no dropout, no gradients), f32.
//!
//! The encoder is a post-norm transformer whose attention adds disentangled relative-position
//! terms to the content-to-content scores: content→position (`c2p`, queries against projected
//! relative-position embeddings) and position→content (`p2c`, keys against them), each read at
//! the bucketed distance `i - j`, all three divided by `sqrt(head_dim · (1 + #terms))`.
//! DeBERTa-v3 shares the content q/k projections with the position ones (`share_att_key`),
//! buckets distances logarithmically beyond `position_buckets / 2` and layer-normalises the
//! relative embeddings (`norm_rel_ebd: layer_norm`); DeBERTa-v2 checkpoints may add absolute
//! position and token-type embeddings, a smaller embedding width (`embed_proj`) and a 1-D
//! convolution after the first layer. The head pools the first token ([CLS]) through
//! `pooler.dense` and its activation, then `classifier`.
//!
//! Tensor names are transformers' (`deberta.embeddings.word_embeddings.weight`,
//! `deberta.encoder.layer.N.attention.self.query_proj.weight`, `pooler.dense.weight`,
//! `classifier.weight`, ...); old checkpoints' LayerNorm `gamma` / `beta` are read as
//! `weight` / `bias`.

use std::collections::HashMap;

use candle_core::{DType, Device, Result as CResult, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, Module};
use serde_json::Value;

use super::ModelError;

/// The `architectures` entry this file implements.
pub const ARCHITECTURE: &str = "DebertaV2ForSequenceClassification";

/// An activation named in `config.json` (transformers' `ACT2FN` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// `gelu`: the exact (erf) GELU.
    Gelu,
    /// `gelu_new`, `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
    Relu,
    Tanh,
}

impl Act {
    fn parse(key: &str, v: Option<&Value>, default: Act) -> Result<Act, String> {
        match v {
            None | Some(Value::Null) => Ok(default),
            Some(Value::String(s)) => match s.as_str() {
                "gelu" => Ok(Act::Gelu),
                "gelu_new" | "gelu_pytorch_tanh" => Ok(Act::GeluTanh),
                "relu" => Ok(Act::Relu),
                "tanh" => Ok(Act::Tanh),
                other => Err(format!(
                    "config.json: {key} {other:?} is not supported (gelu, gelu_new, gelu_pytorch_tanh, relu, tanh)"
                )),
            },
            Some(other) => Err(format!("config.json: {key} must be a string, found {other}")),
        }
    }

    fn apply(self, x: &Tensor) -> CResult<Tensor> {
        match self {
            Act::Gelu => x.gelu_erf(),
            Act::GeluTanh => x.gelu(),
            Act::Relu => x.relu(),
            Act::Tanh => x.tanh(),
        }
    }
}

/// The 1-D convolution some DeBERTa-v2 checkpoints run after the first layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConvSettings {
    pub kernel_size: usize,
    pub groups: usize,
    pub act: Act,
}

/// What a DeBERTa-v2/v3 `config.json` sets, with transformers' defaults where a key is absent.
#[derive(Debug, Clone, PartialEq)]
pub struct DebertaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub embedding_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub hidden_act: Act,
    pub layer_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub position_biased_input: bool,
    pub relative_attention: bool,
    /// Distances are clamped (or bucketed) within this many positions.
    pub max_relative_positions: i64,
    /// Log buckets when positive.
    pub position_buckets: i64,
    pub share_att_key: bool,
    pub c2p: bool,
    pub p2c: bool,
    pub norm_rel_embeddings: bool,
    pub conv: Option<ConvSettings>,
    pub pooler_hidden_size: usize,
    pub pooler_act: Act,
    pub num_labels: usize,
    pub pad_token_id: u32,
}

fn usize_key(v: &Value, key: &str, default: Option<usize>) -> Result<usize, String> {
    match v.get(key) {
        None | Some(Value::Null) => {
            default.ok_or_else(|| format!("config.json: no `{key}` (a DeBERTa-v2 config has it)"))
        }
        Some(x) => x
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| format!("config.json: {key} must be a non-negative integer, found {x}")),
    }
}

fn int_key(v: &Value, key: &str, default: i64) -> Result<i64, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_i64()
            .ok_or_else(|| format!("config.json: {key} must be an integer, found {x}")),
    }
}

fn bool_key(v: &Value, key: &str, default: bool) -> Result<bool, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| format!("config.json: {key} must be true or false, found {x}")),
    }
}

impl DebertaConfig {
    /// Reads a `DebertaV2Config` as transformers does (same defaults, same `-1 = unset`
    /// rules); what this implementation cannot compute is refused naming the key.
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let hidden_size = usize_key(v, "hidden_size", Some(1536))?;
        let num_heads = usize_key(v, "num_attention_heads", Some(24))?;
        if num_heads == 0 || hidden_size % num_heads != 0 {
            return Err(format!(
                "config.json: hidden_size ({hidden_size}) must be a multiple of num_attention_heads ({num_heads})"
            ));
        }
        let head_dim = usize_key(v, "attention_head_size", Some(hidden_size / num_heads))?;
        let max_position_embeddings = usize_key(v, "max_position_embeddings", Some(512))?;
        let relative_attention = bool_key(v, "relative_attention", false)?;
        let mut max_relative_positions = int_key(v, "max_relative_positions", -1)?;
        if max_relative_positions < 1 {
            max_relative_positions = max_position_embeddings as i64;
        }
        let pos_att: Vec<String> = match v.get("pos_att_type") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => s.split('|').map(|x| x.trim().to_lowercase()).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str().map(|s| s.trim().to_lowercase()).ok_or_else(|| {
                        format!("config.json: pos_att_type entries must be strings, found {x}")
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(format!(
                "config.json: pos_att_type must be a list or a `|`-separated string, found {other}"
            ))
            }
        };
        let norm_rel = match v.get("norm_rel_ebd") {
            None | Some(Value::Null) => "none".to_string(),
            Some(Value::String(s)) => s.to_lowercase(),
            Some(other) => {
                return Err(format!(
                    "config.json: norm_rel_ebd must be a string, found {other}"
                ))
            }
        };
        let conv_kernel = usize_key(v, "conv_kernel_size", Some(0))?;
        let conv = if conv_kernel > 0 {
            if conv_kernel % 2 == 0 {
                return Err(format!(
                    "config.json: conv_kernel_size ({conv_kernel}) must be odd (the convolution keeps the sequence length)"
                ));
            }
            let groups = usize_key(v, "conv_groups", Some(1))?;
            if groups == 0 || hidden_size % groups != 0 {
                return Err(format!(
                    "config.json: conv_groups ({groups}) must divide hidden_size ({hidden_size})"
                ));
            }
            Some(ConvSettings {
                kernel_size: conv_kernel,
                groups,
                act: Act::parse("conv_act", v.get("conv_act"), Act::Tanh)?,
            })
        } else {
            None
        };
        let pooler_hidden_size = usize_key(v, "pooler_hidden_size", Some(hidden_size))?;
        if pooler_hidden_size != hidden_size {
            return Err(format!(
                "config.json: pooler_hidden_size ({pooler_hidden_size}) must equal hidden_size ({hidden_size}) (transformers' pooler reads the hidden state of that width)"
            ));
        }
        let num_labels = match v.get("num_labels") {
            Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                format!("config.json: num_labels must be a positive integer, found {x}")
            })?,
            None => match v.get("id2label") {
                Some(Value::Object(m)) => m.len(),
                _ => 2,
            },
        };
        if num_labels == 0 {
            return Err("config.json: num_labels is 0: no score to read".into());
        }
        Ok(Self {
            vocab_size: usize_key(v, "vocab_size", Some(128100))?,
            hidden_size,
            embedding_size: usize_key(v, "embedding_size", Some(hidden_size))?,
            num_layers: usize_key(v, "num_hidden_layers", Some(24))?,
            num_heads,
            head_dim,
            intermediate_size: usize_key(v, "intermediate_size", Some(6144))?,
            hidden_act: Act::parse("hidden_act", v.get("hidden_act"), Act::Gelu)?,
            layer_norm_eps: v
                .get("layer_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-7),
            max_position_embeddings,
            type_vocab_size: usize_key(v, "type_vocab_size", Some(0))?,
            position_biased_input: bool_key(v, "position_biased_input", false)?,
            relative_attention,
            max_relative_positions,
            position_buckets: int_key(v, "position_buckets", -1)?,
            share_att_key: bool_key(v, "share_att_key", false)?,
            c2p: pos_att.iter().any(|p| p == "c2p"),
            p2c: pos_att.iter().any(|p| p == "p2c"),
            norm_rel_embeddings: norm_rel.split('|').any(|x| x.trim() == "layer_norm"),
            conv,
            pooler_hidden_size,
            pooler_act: Act::parse("pooler_hidden_act", v.get("pooler_hidden_act"), Act::Gelu)?,
            num_labels,
            pad_token_id: usize_key(v, "pad_token_id", Some(0))? as u32,
        })
    }

    /// How many relative-position embeddings the attention reads on each side (`att_span`).
    pub fn att_span(&self) -> i64 {
        if self.position_buckets > 0 {
            self.position_buckets
        } else {
            self.max_relative_positions
        }
    }

    /// The relative position of query `i` to key `j` as the attention reads it: `i - j`,
    /// log-bucketed when `position_buckets` is set.
    pub fn relative_position(&self, i: usize, j: usize) -> i64 {
        let r = i as i64 - j as i64;
        if self.position_buckets > 0 && self.max_relative_positions > 0 {
            log_bucket(r, self.position_buckets, self.max_relative_positions)
        } else {
            r
        }
    }
}

/// transformers' `make_log_bucket_position`: distances within `bucket_size / 2` stay as they
/// are, longer ones map to `mid + ceil(ln(|r| / mid) / ln((max_position - 1) / mid) · (mid -
/// 1))` with their sign. Computed in f32 as torch computes it (its default dtype), so the
/// bucket boundaries fall where transformers' do.
pub fn log_bucket(relative: i64, bucket_size: i64, max_position: i64) -> i64 {
    let mid = bucket_size / 2;
    if relative.abs() <= mid {
        return relative;
    }
    let abs = relative.abs() as f32;
    let denom = (((max_position - 1) as f64 / mid as f64) as f32).ln();
    let log_pos = ((abs / mid as f32).ln() / denom * (mid - 1) as f32).ceil() + mid as f32;
    (log_pos * relative.signum() as f32) as i64
}

/// Reads the checkpoint's tensors by name (f32, on the model's device).
struct Tensors<'a> {
    map: &'a HashMap<String, Tensor>,
    file: &'a str,
    device: &'a Device,
}

impl Tensors<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        // transformers renames old checkpoints' LayerNorm `gamma` / `beta` on load.
        let alt = name
            .strip_suffix(".weight")
            .map(|s| format!("{s}.gamma"))
            .into_iter()
            .chain(name.strip_suffix(".bias").map(|s| format!("{s}.beta")));
        let t = std::iter::once(name.to_string())
            .chain(alt.filter(|_| name.contains("LayerNorm")))
            .find_map(|n| self.map.get(&n))
            .ok_or_else(|| ModelError::Missing {
                name: name.to_string(),
                file: self.file.to_string(),
            })?;
        if t.dims() != shape {
            return Err(ModelError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.dims().to_vec(),
            });
        }
        Ok(t.to_dtype(DType::F32)?.to_device(self.device)?)
    }

    fn linear(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear, ModelError> {
        let w = self.get(&format!("{prefix}.weight"), &[out, inp])?;
        let b = if bias {
            Some(self.get(&format!("{prefix}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear::new(w, b))
    }

    fn norm(&self, prefix: &str, size: usize, eps: f64) -> Result<LayerNorm, ModelError> {
        Ok(LayerNorm::new(
            self.get(&format!("{prefix}.weight"), &[size])?,
            self.get(&format!("{prefix}.bias"), &[size])?,
            eps,
        ))
    }

    fn embedding(&self, name: &str, rows: usize, width: usize) -> Result<Embedding, ModelError> {
        Ok(Embedding::new(self.get(name, &[rows, width])?, width))
    }
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    /// Separate position projections (`share_att_key: false`).
    pos_key: Option<Linear>,
    pos_query: Option<Linear>,
    attn_out: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
}

struct Conv {
    weight: Tensor, // [hidden, hidden / groups, kernel]
    bias: Tensor,   // [hidden]
    norm: LayerNorm,
    settings: ConvSettings,
}

/// `DebertaV2ForSequenceClassification`, eval mode.
pub struct DebertaV2Classifier {
    pub config: DebertaConfig,
    word: Embedding,
    position: Option<Embedding>,
    token_type: Option<Embedding>,
    embed_proj: Option<Linear>,
    embed_norm: LayerNorm,
    rel_embeddings: Option<Tensor>, // [2 · att_span, hidden], normalised when configured
    layers: Vec<Layer>,
    conv: Option<Conv>,
    pooler: Linear,
    classifier: Linear,
    device: Device,
}

impl DebertaV2Classifier {
    /// Builds the model from a checkpoint's tensors (transformers' names; `file` names the
    /// checkpoint in errors).
    pub fn new(
        config: DebertaConfig,
        tensors: &HashMap<String, Tensor>,
        file: &str,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let t = Tensors {
            map: tensors,
            file,
            device,
        };
        let (h, e, eps) = (c.hidden_size, c.embedding_size, c.layer_norm_eps);
        let all_heads = c.num_heads * c.head_dim;
        let emb = "deberta.embeddings";
        let word = t.embedding(&format!("{emb}.word_embeddings.weight"), c.vocab_size, e)?;
        let position = if c.position_biased_input {
            Some(t.embedding(
                &format!("{emb}.position_embeddings.weight"),
                c.max_position_embeddings,
                e,
            )?)
        } else {
            None
        };
        let token_type = if c.type_vocab_size > 0 {
            Some(t.embedding(
                &format!("{emb}.token_type_embeddings.weight"),
                c.type_vocab_size,
                e,
            )?)
        } else {
            None
        };
        let embed_proj = if e != h {
            Some(t.linear(&format!("{emb}.embed_proj"), h, e, false)?)
        } else {
            None
        };
        let embed_norm = t.norm(&format!("{emb}.LayerNorm"), h, eps)?;
        let enc = "deberta.encoder";
        let rel_embeddings = if c.relative_attention {
            let rows = 2 * c.att_span() as usize;
            let w = t.get(&format!("{enc}.rel_embeddings.weight"), &[rows, h])?;
            Some(if c.norm_rel_embeddings {
                t.norm(&format!("{enc}.LayerNorm"), h, eps)?.forward(&w)?
            } else {
                w
            })
        } else {
            None
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("{enc}.layer.{i}");
            let sa = format!("{p}.attention.self");
            let separate = c.relative_attention && !c.share_att_key;
            layers.push(Layer {
                query: t.linear(&format!("{sa}.query_proj"), all_heads, h, true)?,
                key: t.linear(&format!("{sa}.key_proj"), all_heads, h, true)?,
                value: t.linear(&format!("{sa}.value_proj"), all_heads, h, true)?,
                pos_key: if separate && c.c2p {
                    Some(t.linear(&format!("{sa}.pos_key_proj"), all_heads, h, true)?)
                } else {
                    None
                },
                pos_query: if separate && c.p2c {
                    Some(t.linear(&format!("{sa}.pos_query_proj"), all_heads, h, true)?)
                } else {
                    None
                },
                attn_out: t.linear(&format!("{p}.attention.output.dense"), h, all_heads, true)?,
                attn_norm: t.norm(&format!("{p}.attention.output.LayerNorm"), h, eps)?,
                up: t.linear(
                    &format!("{p}.intermediate.dense"),
                    c.intermediate_size,
                    h,
                    true,
                )?,
                down: t.linear(&format!("{p}.output.dense"), h, c.intermediate_size, true)?,
                out_norm: t.norm(&format!("{p}.output.LayerNorm"), h, eps)?,
            });
        }
        let conv = match c.conv {
            Some(s) => Some(Conv {
                weight: t.get(
                    &format!("{enc}.conv.conv.weight"),
                    &[h, h / s.groups, s.kernel_size],
                )?,
                bias: t.get(&format!("{enc}.conv.conv.bias"), &[h])?,
                norm: t.norm(&format!("{enc}.conv.LayerNorm"), h, eps)?,
                settings: s,
            }),
            None => None,
        };
        let pooler = t.linear(
            "pooler.dense",
            c.pooler_hidden_size,
            c.pooler_hidden_size,
            true,
        )?;
        let classifier = t.linear("classifier", c.num_labels, h, true)?;
        Ok(Self {
            word,
            position,
            token_type,
            embed_proj,
            embed_norm,
            rel_embeddings,
            layers,
            conv,
            pooler,
            classifier,
            device: device.clone(),
            config,
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Logits `[batch, num_labels]` of `input_ids`, `token_type_ids` and `attention_mask`
    /// (all `[batch, seq]` u32; 1 real, 0 padding). Rows are padded on the right: positions
    /// count from the first token, which is the pooled one.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        attention_mask: &Tensor,
    ) -> CResult<Tensor> {
        let c = &self.config;
        let (b, t) = input_ids.dims2()?;
        let dev = &self.device;
        let maskf = attention_mask.to_dtype(DType::F32)?; // [b, t]
                                                          // Embeddings: words (+ absolute positions) (+ token types), projected, normalised,
                                                          // padding zeroed.
        let mut x = self.word.forward(input_ids)?; // [b, t, e]
        if let Some(pos) = &self.position {
            if t > c.max_position_embeddings {
                candle_core::bail!(
                    "{t} tokens exceed max_position_embeddings ({}) of this model's absolute positions",
                    c.max_position_embeddings
                );
            }
            let ids = Tensor::arange(0u32, t as u32, dev)?;
            x = x.broadcast_add(&pos.forward(&ids)?.unsqueeze(0)?)?;
        }
        if let Some(tt) = &self.token_type {
            x = (x + tt.forward(token_type_ids)?)?;
        }
        if let Some(p) = &self.embed_proj {
            x = p.forward(&x)?;
        }
        let x = self.embed_norm.forward(&x)?;
        let embedded = x.broadcast_mul(&maskf.unsqueeze(2)?)?; // [b, t, h]

        // Pairwise mask m_i · m_j: [b, 1, t, t].
        let m = maskf.unsqueeze(2)?.broadcast_mul(&maskf.unsqueeze(1)?)?;
        let keep = m.unsqueeze(1)?.ne(0f32)?;
        let (c2p_idx, p2c_idx) = self.position_indices(b, t)?;
        let mut hidden = embedded.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            hidden = self.layer(layer, &hidden, &keep, &c2p_idx, &p2c_idx)?;
            if i == 0 {
                if let Some(conv) = &self.conv {
                    hidden = self.convolve(conv, &embedded, &hidden, &maskf)?;
                }
            }
        }
        // Pooler: the first token through dense + activation; then the classifier.
        let first = hidden.narrow(1, 0, 1)?.squeeze(1)?; // [b, h]
        let pooled = c.pooler_act.apply(&self.pooler.forward(&first)?)?;
        self.classifier.forward(&pooled) // [b, labels]
    }

    /// The gather indices into the `2 · att_span` relative embeddings, `[b, heads, t, t]`:
    /// c2p at `clamp(δ(i, j) + span)`, p2c at `clamp(-δ(i, j) + span)` (read transposed),
    /// where δ is the (bucketed) relative position.
    fn position_indices(&self, b: usize, t: usize) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let c = &self.config;
        if !c.relative_attention {
            return Ok((None, None));
        }
        let span = c.att_span();
        let clamp = |x: i64| x.clamp(0, 2 * span - 1) as u32;
        let mut c2p = Vec::with_capacity(t * t);
        let mut p2c = Vec::with_capacity(t * t);
        for i in 0..t {
            for j in 0..t {
                let r = c.relative_position(i, j);
                c2p.push(clamp(r + span));
                p2c.push(clamp(-r + span));
            }
        }
        let shape = (b, c.num_heads, t, t);
        let full = |v: Vec<u32>| -> CResult<Tensor> {
            Tensor::from_vec(v, (1, 1, t, t), &self.device)?
                .broadcast_as(shape)?
                .contiguous()
        };
        Ok((
            if c.c2p { Some(full(c2p)?) } else { None },
            if c.p2c { Some(full(p2c)?) } else { None },
        ))
    }

    /// `[b, t, heads·d] → [b, heads, t, d]`.
    fn heads(&self, x: &Tensor) -> CResult<Tensor> {
        let (b, t, _) = x.dims3()?;
        let c = &self.config;
        x.reshape((b, t, c.num_heads, c.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    fn layer(
        &self,
        l: &Layer,
        x: &Tensor,
        keep: &Tensor,
        c2p_idx: &Option<Tensor>,
        p2c_idx: &Option<Tensor>,
    ) -> CResult<Tensor> {
        let c = &self.config;
        let (b, t, _) = x.dims3()?;
        let q = self.heads(&l.query.forward(x)?)?; // [b, n, t, d]
        let k = self.heads(&l.key.forward(x)?)?;
        let v = self.heads(&l.value.forward(x)?)?;
        let factor = 1 + usize::from(c.c2p) + usize::from(c.p2c);
        let scale = ((c.head_dim * factor) as f32).sqrt() as f64;
        let mut scores = q.matmul(&(k.t()? / scale)?)?; // [b, n, t, t]
        if let Some(rel) = &self.rel_embeddings {
            let rel = rel.unsqueeze(0)?; // [1, 2s, h]
                                         // [1, n, 2s, d]
            let pos_heads = |proj: &Linear| self.heads(&proj.forward(&rel)?);
            if let Some(idx) = c2p_idx {
                let pk = pos_heads(l.pos_key.as_ref().unwrap_or(&l.key))?;
                let att = q.broadcast_matmul(&pk.t()?)?.contiguous()?; // [b, n, t, 2s]
                scores = (scores + (att.gather(idx, D::Minus1)? / scale)?)?;
            }
            if let Some(idx) = p2c_idx {
                let pq = pos_heads(l.pos_query.as_ref().unwrap_or(&l.query))?;
                let att = k.broadcast_matmul(&pq.t()?)?.contiguous()?; // [b, n, t(key), 2s]
                let att = att.gather(idx, D::Minus1)?.transpose(2, 3)?;
                scores = (scores + (att / scale)?)?;
            }
        }
        let floor = Tensor::full(f32::MIN, scores.shape(), &self.device)?;
        let scores = keep
            .broadcast_as(scores.shape())?
            .where_cond(&scores, &floor)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?;
        let ctx = probs.matmul(&v)?; // [b, n, t, d]
        let ctx = ctx
            .transpose(1, 2)?
            .reshape((b, t, c.num_heads * c.head_dim))?;
        let attn = l.attn_norm.forward(&(l.attn_out.forward(&ctx)? + x)?)?;
        let up = c.hidden_act.apply(&l.up.forward(&attn)?)?;
        l.out_norm.forward(&(l.down.forward(&up)? + attn)?)
    }

    /// transformers' `ConvLayer`: a same-length convolution of the embeddings, zeroed at
    /// padding, activated, added to the first layer's output, normalised, padding zeroed.
    fn convolve(
        &self,
        conv: &Conv,
        embedded: &Tensor,
        residual: &Tensor,
        maskf: &Tensor,
    ) -> CResult<Tensor> {
        let s = conv.settings;
        let x = embedded.transpose(1, 2)?.contiguous()?; // [b, h, t]
        let out = x
            .conv1d(&conv.weight, (s.kernel_size - 1) / 2, 1, 1, s.groups)?
            .broadcast_add(&conv.bias.reshape((1, (), 1))?)?
            .transpose(1, 2)?; // [b, t, h]
        let mask = maskf.unsqueeze(2)?;
        let out = s.act.apply(&out.broadcast_mul(&mask)?)?;
        let out = conv.norm.forward(&(residual + out)?.contiguous()?)?;
        out.broadcast_mul(&mask)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn deberta_config_refuses_what_it_cannot_compute_naming_the_key() {
        let base = json!({"hidden_size": 32, "num_attention_heads": 4, "vocab_size": 10});
        assert!(DebertaConfig::from_json(&base).is_ok());
        let with = |k: &str, v: Value| {
            let mut c = base.clone();
            c[k] = v;
            DebertaConfig::from_json(&c).unwrap_err()
        };
        assert!(with("hidden_act", json!("swish")).contains("hidden_act \"swish\""));
        assert!(with("conv_kernel_size", json!(2)).contains("conv_kernel_size"));
        assert!(with("num_attention_heads", json!(5)).contains("num_attention_heads"));
        assert!(with("pooler_hidden_size", json!(16)).contains("pooler_hidden_size"));
        // transformers' defaults: -1 positions mean max_position_embeddings.
        let c = DebertaConfig::from_json(&json!({"hidden_size": 32, "num_attention_heads": 4,
            "max_position_embeddings": 100, "max_relative_positions": -1,
            "pos_att_type": "p2c|c2p"}))
        .unwrap();
        assert_eq!((c.max_relative_positions, c.att_span()), (100, 100));
        assert!(c.c2p && c.p2c && c.num_labels == 2);
    }
}
