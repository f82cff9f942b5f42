//! One decoder layer as a composition of candle ops that all have a backward pass (candle's
//! fused softmax / rms_norm / rope kernels have none: `docs/design.md`): Llama / Qwen2 / Qwen3 blocks
//! (RMSNorm, rotary attention with grouped KV heads, SiLU-gated MLP). [`block_forward`] is
//! the reference every fast path of a layer is tested against (the hand-written layer of
//! `layer.rs`, its recomputation, the decode engine), and the path on CUDA and in half
//! precision. Also the caller-owned [`KvCache`] of that path and the attention [`Mask`].
//!
//! Follows HF transformers' `modeling_llama.py` / `modeling_qwen2.py` (weight names and math).

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::Linear;

use super::attention::{attention, attention_composed, Keys};
use super::config::ModelArgs;
use super::delta::{DeltaNet, DeltaState};
use super::layer::{spans, Seg};
use super::mla::Mla;
use super::ops::sigmoid;
pub(crate) use super::ops::{rms_norm, upcast};
pub(crate) use super::proj::{apply, linear, mixed_matmul};
use super::proj::{base_matmul, mix64, Dropout, Proj};

/// Where a forward's sequences lie, for token mixers that run along each sequence (Gated
/// DeltaNet): a padded batch with its real tokens `[batch, seq]` (1 real, 0 padding, in the
/// hidden states' dtype; `None`: no padding), or sequences packed end to end,
/// `(first token, length)` each.
#[derive(Debug, Clone)]
pub(crate) enum Rows {
    Padded(Option<Tensor>),
    Packed(Arc<[(usize, usize)]>),
}

impl Rows {
    pub(crate) fn detach(&self) -> Rows {
        match self {
            Rows::Padded(r) => Rows::Padded(r.as_ref().map(Tensor::detach)),
            Rows::Packed(s) => Rows::Packed(s.clone()),
        }
    }
}

/// Which keys each query of a forward attends to.
#[derive(Debug, Clone)]
pub(crate) enum Mask {
    /// Additive bias `[batch, 1, seq, past + seq]`: 0 where allowed, −1e9 elsewhere.
    Bias(Tensor),
    /// Sequences packed end to end in a batch of one: causal inside each sequence, nothing
    /// across sequences except a shared prefix ([`Seg::prefix`]).
    Packed(Arc<[Seg]>),
}

impl Mask {
    /// The additive bias the op composition reads: the bias itself (already windowed), or for
    /// packed sequences a block-diagonal causal one `[1, 1, n, n]` (a sequence with a shared
    /// prefix also sees the prefix's tokens, counted before its own), each query seeing at
    /// most `window` positions (quadratic in the total length: the composition is the
    /// reference and the fallback, the hand-written layer never builds it).
    pub(crate) fn bias(
        &self,
        dtype: DType,
        device: &Device,
        window: Option<usize>,
    ) -> Result<Tensor> {
        match self {
            Mask::Bias(b) => Ok(b.clone()),
            Mask::Packed(segs) => {
                let n: usize = segs.iter().map(|s| s.len).sum();
                let mut bias = vec![-1e9f32; n * n];
                for s in segs.iter() {
                    let (p0, pl) = s.prefix.unwrap_or((0, 0));
                    for i in 0..s.len {
                        // Query i sits at position pl + i of the sequence it continues.
                        let last = pl + i;
                        let first = window.map_or(0, |w| (last + 1).saturating_sub(w));
                        let row = &mut bias[(s.start + i) * n..][..n];
                        for key in first..=last {
                            let col = if key < pl {
                                p0 + key
                            } else {
                                s.start + key - pl
                            };
                            row[col] = 0.0;
                        }
                    }
                }
                Tensor::from_vec(bias, (1, 1, n, n), &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(device)
            }
        }
    }

    /// What layer `l`'s composition reads: packed sequences stay sequences where the layer's
    /// attention is the blocked op ([`Block::blocked`]) and for a Gated DeltaNet layer (which
    /// reads no keys), anything else becomes the bias. Shared prefixes are read through the
    /// bias; a Gated DeltaNet layer cannot continue one (its state is not carried between
    /// sequences) and refuses them.
    pub(crate) fn layer_keys(&self, l: &Block, dtype: DType, device: &Device) -> Result<Keys> {
        if let Mask::Packed(segs) = self {
            match (spans(segs), l.blocked || l.delta().is_some()) {
                (Some(segments), true) => {
                    return Ok(Keys::Packed {
                        segments: segments.into(),
                        window: l.window,
                    })
                }
                (None, true) if l.delta().is_some() => candle_core::bail!(
                    "packed sequences with shared prefixes reached a Gated DeltaNet layer, \
                     which carries no state between sequences"
                ),
                _ => {}
            }
        }
        Ok(Keys::Bias(self.bias(dtype, device, l.window)?))
    }

    pub(crate) fn detach(&self) -> Mask {
        match self {
            Mask::Bias(b) => Mask::Bias(b.detach()),
            Mask::Packed(s) => Mask::Packed(s.clone()),
        }
    }
}

/// Keys and values of past positions, one entry per layer: `[batch, kv_heads, past, head_dim]`.
/// Owned by the caller, so one model serves many concurrent decodes.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Per layer: key and value buffers `[batch, kv_heads, capacity, head_dim]`, of which the
    /// first `len` positions are filled. New positions are written in place (no copy of the past).
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Per Gated DeltaNet layer (Qwen3.5): its convolution inputs and recurrent state.
    states: Vec<Option<DeltaState>>,
    len: usize,
    /// Positions the first allocation makes room for (0: as needed, doubling).
    reserve: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self::with_capacity(num_layers, 0)
    }

    /// A cache whose buffers hold `positions` from the start, so appends up to that length
    /// never reallocate (and copy) the past.
    pub fn with_capacity(num_layers: usize, positions: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            states: vec![None; num_layers],
            len: 0,
            reserve: positions,
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps only the rows `keep` (batch indices), e.g. after some sequences finished.
    pub fn select_rows(&mut self, keep: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.index_select(keep, 0)?;
            *v = v.index_select(keep, 0)?;
        }
        for s in self.states.iter_mut().flatten() {
            s.select_rows(keep)?;
        }
        Ok(())
    }

    /// Layer `i`'s DeltaNet state (none before its first call), to be read and replaced by a
    /// call over `t` new positions, after which [`KvCache::advance`] counts them.
    pub(crate) fn state(&mut self, i: usize) -> Result<&mut Option<DeltaState>> {
        let n = self.layers.len();
        self.states
            .get_mut(i)
            .ok_or_else(|| candle_core::Error::Msg(format!("cache of {n} layers has no layer {i}")))
    }

    /// Counts `t` new positions after a DeltaNet layer `i` took them (the last layer's call
    /// moves the length, as [`KvCache::append`] does for attention layers).
    pub(crate) fn advance(&mut self, i: usize, t: usize) {
        if i + 1 == self.layers.len() {
            self.len += t;
        }
    }

    /// Appends `k`, `v` `[batch, kv_heads, t, head_dim]` to layer `i` (growing the buffers by
    /// doubling when full) and returns views of all positions so far. The views are detached: no
    /// gradient flows through past positions and no autograd graph is kept alive by the cache.
    pub(crate) fn append(&mut self, i: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let past = self.len;
        let t = k.dim(2)?;
        let need = past + t;
        let (k, v) = (k.detach().contiguous()?, v.detach().contiguous()?);
        let last_layer = i + 1 == self.layers.len();
        let slot = &mut self.layers[i];
        let grow = match slot {
            Some((kb, _)) => kb.dim(2)? < need,
            None => true,
        };
        if grow {
            // (A latent attention layer keeps latents and rope keys of other widths.)
            let ((b, h, _, dk), (_, hv, _, dv)) = (k.dims4()?, v.dims4()?);
            let cap = match self.reserve >= need {
                true => self.reserve,
                false => (2 * need).max(need + 64),
            };
            let kb = Tensor::zeros((b, h, cap, dk), k.dtype(), k.device())?;
            let vb = Tensor::zeros((b, hv, cap, dv), v.dtype(), v.device())?;
            if let Some((ok, ov)) = slot.take() {
                kb.slice_set(&ok.narrow(2, 0, past)?.contiguous()?, 2, 0)?;
                vb.slice_set(&ov.narrow(2, 0, past)?.contiguous()?, 2, 0)?;
            }
            *slot = Some((kb, vb));
        }
        let (kb, vb) = slot.as_ref().expect("allocated above");
        kb.slice_set(&k, 2, past)?;
        vb.slice_set(&v, 2, past)?;
        if last_layer {
            self.len = need;
        }
        Ok((kb.narrow(2, 0, need)?, vb.narrow(2, 0, need)?))
    }
}

/// The model's RMSNorm: [`rms_norm`] with weight `w`, or `1 + w` for Gemma.
pub(crate) fn norm(x: &Tensor, w: &Tensor, a: &ModelArgs) -> Result<Tensor> {
    match a.arch.norm_offset() {
        0.0 => rms_norm(x, w, a.rms_norm_eps),
        off => rms_norm(x, &(w + off)?, a.rms_norm_eps),
    }
}

/// GELU with the tanh approximation, `½x(1 + tanh(√(2/π)(x + 0.044715 x³)))`, composed of ops
/// with exact backward passes (candle's own `gelu` differentiates with six-digit constants,
/// ~1e-6 relative off in f64).
pub(super) fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    let inner = ((x + ((x.sqr()? * x)? * 0.044_715)?)? * 0.797_884_560_802_865_4)?;
    (x * 0.5)? * (inner.tanh()? + 1.0)?
}

/// `[-x2, x1]` for `x = [x1, x2]` split in half on the last axis.
pub(super) fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// A SiLU- (GELU- for Gemma) gated MLP: `down(act(gate(x)) ⊙ up(x))`.
#[derive(Clone)]
pub(crate) struct Gated {
    pub(crate) gate: Proj,
    pub(crate) up: Proj,
    pub(crate) down: Proj,
}

impl Gated {
    fn map(&self, f: &impl Fn(&Proj) -> Proj) -> Gated {
        Gated {
            gate: f(&self.gate),
            up: f(&self.up),
            down: f(&self.down),
        }
    }
}

/// A layer's mixture of experts (Qwen3-MoE, [`super::config::MoeArgs`]).
#[derive(Clone)]
pub(crate) struct Experts {
    /// The router `mlp.gate.weight` `[experts, hidden]`.
    pub(crate) router: Tensor,
    /// `mlp.experts.N`, each a gated MLP of width `moe_intermediate_size`.
    pub(crate) experts: Vec<Gated>,
    pub(crate) top_k: usize,
    pub(crate) norm_topk_prob: bool,
    /// Every expert on every token ([`experts_dense`], the reference) instead of each on its
    /// tokens ([`experts_grouped`]); set from [`super::Exec::dense_experts`].
    pub(crate) dense: bool,
    /// The shared expert of Qwen3-Next / Qwen3.5-MoE.
    pub(crate) shared: Option<Shared>,
    /// DeepSeek-V3's routing and shared experts, `None` for the softmax router.
    pub(crate) deepseek: Option<Box<DeepseekMoe>>,
    /// GPT-OSS's router bias `mlp.router.bias` `[experts]`, added to the router's logits.
    pub(crate) router_bias: Option<Tensor>,
    /// GPT-OSS's clamped SwiGLU `(alpha, limit)` in the experts; `None`: SiLU-gated.
    pub(crate) swiglu: Option<(f64, f64)>,
}

/// DeepSeek-V3's side of a layer of experts ([`super::config::DeepseekRouting`]).
#[derive(Clone)]
pub(crate) struct DeepseekMoe {
    /// `mlp.gate.e_score_correction_bias` `[experts]`, detached: it only chooses experts.
    pub(crate) bias: Tensor,
    pub(crate) n_group: usize,
    pub(crate) topk_group: usize,
    pub(crate) scale: f64,
    /// `mlp.shared_experts`: one gated MLP on every token, added without a gate.
    pub(crate) shared: Gated,
}

/// A shared expert: `mlp.shared_expert` (a gated MLP on every token) scaled by
/// `sigmoid(x·wᵀ)` of `mlp.shared_expert_gate` `[1, hidden]`.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) mlp: Gated,
    pub(crate) gate: Proj,
}

impl Shared {
    /// Its output on `x` `[b, t, hidden]`.
    fn forward(&self, x: &Tensor, mixed: bool) -> Result<Tensor> {
        let g = sigmoid(&apply(&self.gate, x, mixed)?)?; // [b, t, 1]
        gated(&self.mlp, x, false, mixed)?.broadcast_mul(&g)
    }
}

/// What follows a layer's attention.
#[derive(Clone)]
pub(crate) enum Mlp {
    Dense(Gated),
    Experts(Experts),
}

/// A layer's self-attention (`self_attn.*`).
#[derive(Clone)]
pub(crate) struct Attention {
    /// `[heads·head_dim, hidden]`, or `[heads·2·head_dim, hidden]` with an output gate (each
    /// head's queries, then its gate values: Qwen3.5).
    pub(crate) q: Proj,
    pub(crate) k: Proj,
    pub(crate) v: Proj,
    pub(crate) o: Proj,
    /// Qwen3's RMSNorm over each head of q and of k before RoPE (`self_attn.q_norm`,
    /// `self_attn.k_norm`, `[head_dim]` each).
    pub(crate) qk_norm: Option<(Tensor, Tensor)>,
    /// GPT-OSS's sink logits `self_attn.sinks` `[heads]`: one more entry of each head's
    /// softmax, whose probability is dropped ([`super::attention::attention_special`]).
    pub(crate) sinks: Option<Tensor>,
    /// Gemma 2's `attn_logit_softcapping`: scores become `c·tanh(s/c)` before the mask.
    pub(crate) softcap: Option<f64>,
}

/// What mixes a layer's tokens.
#[derive(Clone)]
pub(crate) enum Mixer {
    Attention(Attention),
    /// Qwen3.5's Gated DeltaNet (`linear_attn.*`).
    Delta(DeltaNet),
    /// DeepSeek-V3's multi-head latent attention (`self_attn.*`).
    Mla(Mla),
}

#[derive(Clone)]
pub(crate) struct Block {
    pub(crate) ln1: Tensor,
    pub(crate) ln2: Tensor,
    /// Gemma's norms of the attention's and the MLP's outputs before their residual adds
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`); `ln2` is then its
    /// `pre_feedforward_layernorm`.
    pub(crate) sandwich: Option<(Tensor, Tensor)>,
    /// How many positions this layer's queries see (sliding-window layers), `None`: all.
    pub(crate) window: Option<usize>,
    /// Whether the layer's RoPE has frequencies of its own (Gemma 3's local layers).
    pub(crate) local_rope: bool,
    /// The composition's projections as bf16 products ([`super::proj::bf16_matmul`]): an f32
    /// model with bf16 products asked for on a device whose products the hand-written layer
    /// does not serve (CUDA; on the CPU, the Gated DeltaNet hybrids, through the CPU's bf16
    /// kernels); set from [`super::Exec::bf16`] by `CausalLm::set_exec`.
    pub(crate) mixed: bool,
    /// Attention without a cache as the blocked op of `attention.rs` (no `[batch, heads, seq,
    /// seq]` tensor kept for backward, packed sequences without a mask) rather than the plain
    /// composition: off the CPU unless [`super::Exec::composed`]; set by `CausalLm::set_exec`.
    pub(crate) blocked: bool,
    pub(crate) mixer: Mixer,
    pub(crate) mlp: Mlp,
}

impl Block {
    /// The layer with its weights cut from the autograd graph (same storage).
    pub(crate) fn detached(&self) -> Block {
        self.map_proj(Proj::detached)
    }

    /// The layer's attention; an error for a Gated DeltaNet layer (for paths that serve
    /// attention layers only).
    pub(crate) fn attention(&self) -> Result<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Ok(a),
            Mixer::Delta(_) => candle_core::bail!(
                "a Gated DeltaNet layer reached a path that serves attention layers only"
            ),
            Mixer::Mla(_) => candle_core::bail!(
                "a latent attention layer reached a path that serves q/k/v attention layers only"
            ),
        }
    }

    /// The layer's latent attention, `None` for other layers.
    pub(crate) fn mla(&self) -> Option<&Mla> {
        match &self.mixer {
            Mixer::Mla(m) => Some(m),
            _ => None,
        }
    }

    /// The layer's Gated DeltaNet, `None` for an attention layer.
    pub(crate) fn delta(&self) -> Option<&DeltaNet> {
        match &self.mixer {
            Mixer::Delta(d) => Some(d),
            Mixer::Attention(_) | Mixer::Mla(_) => None,
        }
    }

    /// The layer's experts, `None` for a dense layer.
    pub(crate) fn experts(&self) -> Option<&Experts> {
        match &self.mlp {
            Mlp::Experts(e) => Some(e),
            Mlp::Dense(_) => None,
        }
    }

    /// The projections with their HF module names (`self_attn.q_proj`, `mlp.down_proj`,
    /// `mlp.experts.3.up_proj`): attention first, then the MLP's, each gate, up, down.
    pub(crate) fn projs_mut(&mut self) -> Vec<(String, &mut Proj)> {
        let mut all: Vec<(String, &mut Proj)> = match &mut self.mixer {
            Mixer::Attention(a) => vec![
                ("self_attn.q_proj".into(), &mut a.q),
                ("self_attn.k_proj".into(), &mut a.k),
                ("self_attn.v_proj".into(), &mut a.v),
                ("self_attn.o_proj".into(), &mut a.o),
            ],
            Mixer::Delta(d) => d
                .projs_mut()
                .into_iter()
                .map(|(n, p)| (n.to_string(), p))
                .collect(),
            Mixer::Mla(m) => m
                .projs_mut()
                .into_iter()
                .map(|(n, p)| (n.to_string(), p))
                .collect(),
        };
        match &mut self.mlp {
            Mlp::Dense(g) => all.extend([
                ("mlp.gate_proj".into(), &mut g.gate),
                ("mlp.up_proj".into(), &mut g.up),
                ("mlp.down_proj".into(), &mut g.down),
            ]),
            Mlp::Experts(x) => {
                for (e, g) in x.experts.iter_mut().enumerate() {
                    all.extend([
                        (format!("mlp.experts.{e}.gate_proj"), &mut g.gate),
                        (format!("mlp.experts.{e}.up_proj"), &mut g.up),
                        (format!("mlp.experts.{e}.down_proj"), &mut g.down),
                    ]);
                }
                if let Some(s) = &mut x.shared {
                    all.extend([
                        ("mlp.shared_expert.gate_proj".into(), &mut s.mlp.gate),
                        ("mlp.shared_expert.up_proj".into(), &mut s.mlp.up),
                        ("mlp.shared_expert.down_proj".into(), &mut s.mlp.down),
                        ("mlp.shared_expert_gate".into(), &mut s.gate),
                    ]);
                }
                if let Some(d) = &mut x.deepseek {
                    all.extend([
                        ("mlp.shared_experts.gate_proj".into(), &mut d.shared.gate),
                        ("mlp.shared_experts.up_proj".into(), &mut d.shared.up),
                        ("mlp.shared_experts.down_proj".into(), &mut d.shared.down),
                    ]);
                }
            }
        }
        all
    }

    /// The projections in [`Block::projs_mut`]'s order.
    pub(crate) fn projs(&self) -> Vec<&Proj> {
        let mut all = match &self.mixer {
            Mixer::Attention(a) => vec![&a.q, &a.k, &a.v, &a.o],
            Mixer::Delta(d) => d.projs(),
            Mixer::Mla(m) => m.projs(),
        };
        match &self.mlp {
            Mlp::Dense(g) => all.extend([&g.gate, &g.up, &g.down]),
            Mlp::Experts(x) => {
                for g in &x.experts {
                    all.extend([&g.gate, &g.up, &g.down]);
                }
                if let Some(s) = &x.shared {
                    all.extend([&s.mlp.gate, &s.mlp.up, &s.mlp.down, &s.gate]);
                }
                if let Some(d) = &x.deepseek {
                    all.extend([&d.shared.gate, &d.shared.up, &d.shared.down]);
                }
            }
        }
        all
    }

    /// Whether any projection carries an adapter.
    pub(crate) fn has_adapters(&self) -> bool {
        self.projs().iter().any(|p| p.lora.is_some())
    }

    /// This layer for one training forward with adapter dropout `p`: each adapter gets its
    /// mask seed from `forward_seed`, the layer index and the projection's index.
    pub(crate) fn with_dropout(&self, p: f64, forward_seed: u64, layer: usize) -> Block {
        let mut b = self.clone();
        for (j, (_, proj)) in b.projs_mut().into_iter().enumerate() {
            if let Some(l) = proj.lora.as_mut() {
                // (layer, projection) in distinct bits; a dense layer's seven projections
                // keep the low byte alone.
                let j = j as u64;
                let id = (((layer as u64) << 8) | (j & 0xff)) ^ ((j >> 8) << 48);
                let seed = mix64(forward_seed ^ id);
                l.dropout = Some(Dropout { p, seed });
            }
        }
        b
    }

    /// The layer's norm weights: `ln1`, `ln2`, then q/k norms where the layer has them.
    pub(crate) fn norms(&self) -> Vec<&Tensor> {
        let mut n = vec![&self.ln1, &self.ln2];
        if let Mixer::Attention(Attention {
            qk_norm: Some((q, k)),
            ..
        }) = &self.mixer
        {
            n.extend([q, k]);
        }
        if let Some(m) = self.mla() {
            n.extend(m.norms());
        }
        if let Some((a, m)) = &self.sandwich {
            n.extend([a, m]);
        }
        n
    }

    /// The weights that are not projections: the norms, a DeltaNet's norm, convolution,
    /// `dt_bias` and `A_log`, then the router of a layer of experts.
    pub(crate) fn plain_weights(&self) -> Vec<&Tensor> {
        let mut w = self.norms();
        if let Some(d) = self.delta() {
            w.extend(d.plain());
        }
        if let Mixer::Attention(Attention { sinks: Some(s), .. }) = &self.mixer {
            w.push(s);
        }
        if let Some(x) = self.experts() {
            w.push(&x.router);
            w.extend(&x.router_bias);
        }
        w
    }

    /// Whether any weight of the layer receives gradients.
    pub(crate) fn trains(&self) -> bool {
        self.plain_weights().iter().any(|n| n.track_op())
            || self
                .projs()
                .iter()
                .any(|p| p.weight().track_op() || p.lora.as_ref().is_some_and(|l| l.a.track_op()))
    }

    /// Cuts every weight but the adapters from autograd (norms, router, base projections).
    pub(crate) fn freeze_base(&mut self) {
        self.ln1 = self.ln1.detach();
        self.ln2 = self.ln2.detach();
        match &mut self.mixer {
            Mixer::Attention(a) => {
                a.qk_norm = a.qk_norm.as_ref().map(|(q, k)| (q.detach(), k.detach()));
                a.sinks = a.sinks.as_ref().map(Tensor::detach);
            }
            Mixer::Delta(d) => d.freeze_plain(),
            Mixer::Mla(m) => m.freeze_norms(),
        }
        self.sandwich = self
            .sandwich
            .as_ref()
            .map(|(a, m)| (a.detach(), m.detach()));
        if let Mlp::Experts(x) = &mut self.mlp {
            x.router = x.router.detach();
            x.router_bias = x.router_bias.as_ref().map(Tensor::detach);
        }
        for (_, p) in self.projs_mut() {
            p.base = Linear::new(p.base.weight().detach(), p.base.bias().map(Tensor::detach));
        }
    }

    /// The layer with each projection replaced by `f` of it, norms and router detached.
    pub(crate) fn map_proj(&self, f: impl Fn(&Proj) -> Proj) -> Block {
        let lin = |l: &Proj| f(l);
        Block {
            ln1: self.ln1.detach(),
            ln2: self.ln2.detach(),
            sandwich: self
                .sandwich
                .as_ref()
                .map(|(a, m)| (a.detach(), m.detach())),
            window: self.window,
            local_rope: self.local_rope,
            mixed: self.mixed,
            blocked: self.blocked,
            mixer: match &self.mixer {
                Mixer::Attention(a) => Mixer::Attention(Attention {
                    q: lin(&a.q),
                    k: lin(&a.k),
                    v: lin(&a.v),
                    o: lin(&a.o),
                    qk_norm: a.qk_norm.as_ref().map(|(q, k)| (q.detach(), k.detach())),
                    sinks: a.sinks.as_ref().map(Tensor::detach),
                    softcap: a.softcap,
                }),
                Mixer::Delta(d) => Mixer::Delta(d.map(&lin)),
                Mixer::Mla(m) => Mixer::Mla(m.map(&lin)),
            },
            mlp: match &self.mlp {
                Mlp::Dense(g) => Mlp::Dense(g.map(&lin)),
                Mlp::Experts(x) => Mlp::Experts(Experts {
                    router: x.router.detach(),
                    experts: x.experts.iter().map(|g| g.map(&lin)).collect(),
                    top_k: x.top_k,
                    norm_topk_prob: x.norm_topk_prob,
                    dense: x.dense,
                    shared: x.shared.as_ref().map(|s| Shared {
                        mlp: s.mlp.map(&lin),
                        gate: lin(&s.gate),
                    }),
                    deepseek: x.deepseek.as_ref().map(|d| {
                        Box::new(DeepseekMoe {
                            shared: d.shared.map(&lin),
                            ..(**d).clone()
                        })
                    }),
                    router_bias: x.router_bias.as_ref().map(Tensor::detach),
                    swiglu: x.swiglu,
                }),
            },
        }
    }
}

/// One decoder layer on `x` `[batch, seq, hidden]` with rotary tables `cos`/`sin`
/// `[batch, 1, seq, head_dim]` and attention bias `mask` `[batch, 1, seq, past + seq]`; with a
/// cache, its past keys and values are read and the new ones appended. (The tests' form of
/// [`block_forward_routed`].)
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward(
    a: &ModelArgs,
    l: &Block,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    cache: Option<(&mut KvCache, usize)>,
) -> Result<Tensor> {
    let keys = Keys::Bias(mask.clone());
    block_forward_routed(a, l, x, cos, sin, &keys, &Rows::Padded(None), cache, None)
}

/// [`block_forward`] with the keys each query sees as [`Keys`] (a bias, or packed sequences
/// where the layer's attention is the blocked op) and where the sequences lie ([`Rows`], which a
/// Gated DeltaNet layer reads); with `router`, a layer of experts appends its router logits
/// `[batch·seq, experts]` (with their graph) to it (a dense layer nothing).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward_routed(
    a: &ModelArgs,
    l: &Block,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    keys: &Keys,
    rows: &Rows,
    cache: Option<(&mut KvCache, usize)>,
    router: Option<&mut Vec<Tensor>>,
) -> Result<Tensor> {
    let h = norm(x, &l.ln1, a)?;
    let mixed = match &l.mixer {
        Mixer::Attention(at) => self_attention(a, l, at, &h, (cos, sin), keys, cache)?,
        Mixer::Delta(d) => delta_mix(a, d, &h, rows, cache, l.mixed)?,
        Mixer::Mla(m) => latent_attention(a, l, m, &h, (cos, sin), keys, cache)?,
    };
    let mixed = match &l.sandwich {
        Some((post, _)) => norm(&mixed, post, a)?,
        None => mixed,
    };
    let x = (x + mixed)?;
    let h = norm(&x, &l.ln2, a)?;
    let mlp = mlp_routed(l, &h, a.arch.gemma(), router)?;
    let mlp = match &l.sandwich {
        Some((_, post)) => norm(&mlp, post, a)?,
        None => mlp,
    };
    x + mlp
}

/// Rotary embedding of `x` `[b, heads, t, head_dim]` with tables `[b, 1, t, rd]`: the first
/// `rd` values of each head turned, the rest passed through (partial rotary, Qwen3.5).
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (hd, rd) = (x.dim(3)?, cos.dim(3)?);
    let turn = |r: &Tensor| r.broadcast_mul(cos)? + rotate_half(r)?.broadcast_mul(sin)?;
    match rd == hd {
        true => turn(x),
        // (candle's cat along an inner axis of strided inputs returns a strided result.)
        false => Tensor::cat(
            &[&turn(&x.narrow(3, 0, rd)?)?, &x.narrow(3, rd, hd - rd)?],
            3,
        )?
        .contiguous(),
    }
}

/// The attention of layer `l` on its normed input `h` `[b, t, hidden]`, through `o_proj`.
fn self_attention(
    a: &ModelArgs,
    l: &Block,
    at: &Attention,
    h: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    keys: &Keys,
    cache: Option<(&mut KvCache, usize)>,
) -> Result<Tensor> {
    let (b, t, _) = h.dims3()?;
    let (nh, nkv, hd) = (a.num_attention_heads, a.num_key_value_heads, a.head_dim);
    let (q, gate) = match a.attn_output_gate {
        false => (apply(&at.q, h, l.mixed)?.reshape((b, t, nh, hd))?, None),
        true => {
            // Per head: hd queries, then hd gate values.
            let qg = apply(&at.q, h, l.mixed)?.reshape((b, t, nh, 2 * hd))?;
            let gate = qg.narrow(3, hd, hd)?.reshape((b, t, nh * hd))?;
            (qg.narrow(3, 0, hd)?, Some(gate))
        }
    }; // q: [b, t, nh, hd]
    let k = apply(&at.k, h, l.mixed)?.reshape((b, t, nkv, hd))?; // [b, t, nkv, hd]
    let (q, k) = match &at.qk_norm {
        // Each head normed over its hd values.
        Some((qn, kn)) => (norm(&q, qn, a)?, norm(&k, kn, a)?),
        None => (q, k),
    };
    let q = q.transpose(1, 2)?; // [b, nh, t, hd]
    let k = k.transpose(1, 2)?; // [b, nkv, t, hd]
    let v = apply(&at.v, h, l.mixed)?
        .reshape((b, t, nkv, hd))?
        .transpose(1, 2)?;
    let q = rope(&q, cos, sin)?;
    let k = rope(&k, cos, sin)?;
    let cached = cache.is_some();
    let (k, v) = match cache {
        Some((c, i)) => c.append(i, &k, &v)?,
        None => (k, v),
    };
    // [b, nh, t, hd]; grouped queries share their KV head without a copy of K/V. The blocked
    // op also serves a prefill (many queries over a cache), never a one-token decode step.
    let blocked = l.blocked && (!cached || t > 1);
    let special = at.sinks.is_some() || at.softcap.is_some();
    let attn = match keys {
        Keys::Bias(bias) if special => {
            let (sinks, cap) = (at.sinks.as_ref(), at.softcap);
            super::attention::attention_special(&q, &k, &v, bias, a.attn_scale(), sinks, cap)?
        }
        keys if blocked => attention(&q, &k, &v, keys.clone(), a.attn_scale())?,
        Keys::Bias(bias) => attention_composed(&q, &k, &v, bias, a.attn_scale())?,
        Keys::Packed { .. } => candle_core::bail!(
            "packed sequences reach the composition's attention only through the blocked op"
        ),
    };
    let attn = attn.transpose(1, 2)?.reshape((b, t, nh * hd))?; // [b, t, nh·hd]
    let attn = match gate {
        Some(g) => (attn * sigmoid(&g)?)?,
        None => attn,
    };
    apply(&at.o, &attn, l.mixed)
}

/// The latent attention of layer `l` on its normed input `h` `[b, t, hidden]`, through
/// `o_proj`; with a cache, the new positions' latents and rope keys are appended to it (as a
/// layer's keys and values) and every cached one is attended.
fn latent_attention(
    a: &ModelArgs,
    l: &Block,
    m: &Mla,
    h: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    keys: &Keys,
    cache: Option<(&mut KvCache, usize)>,
) -> Result<Tensor> {
    let Some(ma) = a.mla.as_ref() else {
        candle_core::bail!("a latent attention layer in a model without its settings")
    };
    let Keys::Bias(bias) = keys else {
        candle_core::bail!("latent attention reads packed sequences through a bias only")
    };
    // q [b, nh, t, n + r], latent [b, 1, t, c], k_rot [b, 1, t, r]
    let (q, latent, k_rot) = m.compress(a, ma, h, (cos, sin), l.mixed)?;
    let (latent, k_rot) = match cache {
        Some((c, i)) => c.append(i, &latent, &k_rot)?,
        None => (latent, k_rot),
    };
    m.attend(a, ma, &q, &latent, &k_rot, bias, l.mixed)
}

/// A Gated DeltaNet layer's mixer on its normed input `h` `[b, t, hidden]`: packed sequences
/// one by one (each from a zero state), a padded batch at once with padding zeroed; with a
/// cache, its state continues and is replaced.
fn delta_mix(
    a: &ModelArgs,
    d: &DeltaNet,
    h: &Tensor,
    rows: &Rows,
    cache: Option<(&mut KvCache, usize)>,
    mixed: bool,
) -> Result<Tensor> {
    let Some(la) = a.linear_attn.as_ref() else {
        candle_core::bail!("a Gated DeltaNet layer in a model without linear_attn settings")
    };
    let eps = a.rms_norm_eps;
    match (rows, cache) {
        (Rows::Packed(_), Some(_)) => {
            candle_core::bail!("packed sequences do not decode with a cache")
        }
        (Rows::Packed(segs), None) => {
            let parts = segs
                .iter()
                .map(|&(s, n)| d.forward(la, eps, &h.narrow(1, s, n)?, None, None, mixed))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 1)
        }
        (Rows::Padded(real), Some((c, i))) => {
            let y = d.forward(la, eps, h, real.as_ref(), Some(c.state(i)?), mixed)?;
            c.advance(i, h.dim(1)?);
            Ok(y)
        }
        (Rows::Padded(real), None) => d.forward(la, eps, h, real.as_ref(), None, mixed),
    }
}

/// Layer `l`'s MLP on its normed input `h` `[batch, seq, hidden]`.
pub(crate) fn mlp(l: &Block, h: &Tensor, gelu: bool) -> Result<Tensor> {
    mlp_routed(l, h, gelu, None)
}

/// [`mlp`], appending a layer of experts' router logits `[batch·seq, experts]` to `router`.
fn mlp_routed(
    l: &Block,
    h: &Tensor,
    gelu: bool,
    router: Option<&mut Vec<Tensor>>,
) -> Result<Tensor> {
    match &l.mlp {
        Mlp::Dense(g) => gated(g, h, gelu, l.mixed),
        Mlp::Experts(e) if e.dense => experts_dense(e, h, l.mixed, router),
        Mlp::Experts(e) => experts_grouped(e, h, l.mixed, router),
    }
}

/// The gated MLP on `h` `[batch, seq, hidden]`: `down(act(gate(h)) ⊙ up(h))`, act GELU (tanh)
/// for Gemma, else SiLU.
fn gated(g: &Gated, h: &Tensor, gelu: bool, mixed: bool) -> Result<Tensor> {
    let gate = apply(&g.gate, h, mixed)?;
    let up = apply(&g.up, h, mixed)?;
    let act = match gelu {
        true => (gelu_tanh(&gate)? * up)?,
        false => super::ops::swiglu(&gate, &up)?,
    };
    apply(&g.down, &act, mixed)
}

/// The router of a layer of experts on `x` `[n, hidden]`: each token's `top_k` experts
/// (`[n, top_k]`, most probable first) and their weights `[n, top_k]` in `x`'s dtype
/// (softmax in f32 or f64, renormalised over the chosen when `norm_topk_prob`), the weights
/// with their gradient to the router and to `x`; and the router's logits `[n, experts]`.
pub(crate) fn route(e: &Experts, x: &Tensor) -> Result<(Vec<u32>, Tensor, Tensor)> {
    if let Some(d) = &e.deepseek {
        return route_groups(e.top_k, e.norm_topk_prob, d, &e.router, x);
    }
    let (n, _) = x.dims2()?;
    let k = e.top_k;
    let logits = base_matmul(x, &e.router)?; // [n, experts]
    let logits = match &e.router_bias {
        Some(b) => logits.broadcast_add(b)?,
        None => logits,
    };
    let probs = candle_nn::ops::softmax(&upcast(&logits)?, D::Minus1)?; // [n, experts]
    let p: Vec<f64> = probs.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let experts = e.experts.len();
    let mut chosen = Vec::with_capacity(n * k);
    let mut order: Vec<u32> = Vec::with_capacity(experts);
    for row in p.chunks(experts) {
        order.clear();
        order.extend(0..experts as u32);
        // Most probable first; equal probabilities by expert index (ties have measure zero
        // for trained routers; this keeps the choice deterministic).
        order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        chosen.extend_from_slice(&order[..k]);
    }
    let idx = Tensor::from_vec(chosen.clone(), (n, k), x.device())?;
    let top = probs.contiguous()?.gather(&idx, 1)?; // [n, k]
    let top = if e.norm_topk_prob {
        top.broadcast_div(&top.sum_keepdim(1)?)?
    } else {
        top
    };
    Ok((chosen, top.to_dtype(x.dtype())?, logits))
}

/// DeepSeek-V3's router on `x` `[n, hidden]` (transformers' `DeepseekV3TopkRouter`, see
/// [`super::config::DeepseekRouting`]): the chosen experts `[n, top_k]`, their weights
/// `[n, top_k]` in `x`'s dtype with their gradient (scores `sigmoid(x·Wᵣᵀ)` in f32 or wider,
/// gathered, renormalised when `norm`, scaled), and the router's logits `[n, experts]`. The
/// choice reads the scores plus the correction bias and is a constant of the graph; equal
/// values go to the lower index.
pub(crate) fn route_groups(
    k: usize,
    norm: bool,
    d: &DeepseekMoe,
    router: &Tensor,
    x: &Tensor,
) -> Result<(Vec<u32>, Tensor, Tensor)> {
    let (n, _) = x.dims2()?;
    let logits = upcast(x)?.matmul(&upcast(router)?.t()?)?; // [n, experts]
    let scores = sigmoid(&logits)?; // [n, experts]
    let s: Vec<f64> = scores.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
    let bias: Vec<f64> = d.bias.to_dtype(DType::F64)?.to_vec1()?;
    let experts = bias.len();
    let per = experts / d.n_group;
    let best_first = |v: &[f64], a: usize, b: usize| v[b].total_cmp(&v[a]).then(a.cmp(&b));
    let mut chosen = Vec::with_capacity(n * k);
    for row in s.chunks(experts) {
        let biased: Vec<f64> = row.iter().zip(&bias).map(|(a, b)| a + b).collect();
        // Each group's worth: the sum of its two best biased scores.
        let worth: Vec<f64> = biased
            .chunks(per)
            .map(|g| {
                let mut g = g.to_vec();
                g.sort_by(|a, b| b.total_cmp(a));
                g[0] + g[1]
            })
            .collect();
        let mut groups: Vec<usize> = (0..d.n_group).collect();
        groups.sort_by(|&a, &b| best_first(&worth, a, b));
        let mut open: Vec<usize> = groups[..d.topk_group]
            .iter()
            .flat_map(|&g| g * per..(g + 1) * per)
            .collect();
        open.sort_by(|&a, &b| best_first(&biased, a, b));
        chosen.extend(open[..k].iter().map(|&e| e as u32));
    }
    let idx = Tensor::from_vec(chosen.clone(), (n, k), x.device())?;
    let top = scores.contiguous()?.gather(&idx, 1)?; // [n, k]
    let top = match norm {
        true => top.broadcast_div(&(top.sum_keepdim(1)? + 1e-20)?)?,
        false => top,
    };
    let top = (top * d.scale)?;
    Ok((chosen, top.to_dtype(x.dtype())?, logits))
}

/// The layer of experts on `h` `[batch, seq, hidden]`, each expert computed for the tokens
/// routed to it only: per expert, its tokens gathered `[m, hidden]`, its gated MLP, the rows
/// scaled by their routing weights and added back at their tokens.
pub(crate) fn experts_grouped(
    e: &Experts,
    h: &Tensor,
    mixed: bool,
    router: Option<&mut Vec<Tensor>>,
) -> Result<Tensor> {
    let (b, t, hs) = h.dims3()?;
    let x = h.reshape((b * t, hs))?; // [n, hidden]
    let (chosen, weights, logits) = route(e, &x)?;
    if let Some(r) = router {
        r.push(logits);
    }
    let weights = weights.flatten_all()?; // [n·k], token-major
    let k = e.top_k;
    // Per expert: its tokens, and where each token's weight for it sits in `weights`.
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); e.experts.len()];
    let mut slots: Vec<Vec<u32>> = vec![Vec::new(); e.experts.len()];
    for (s, &ex) in chosen.iter().enumerate() {
        tokens[ex as usize].push((s / k) as u32);
        slots[ex as usize].push(s as u32);
    }
    let mut out = x.zeros_like()?;
    for (g, (tok, slot)) in e.experts.iter().zip(tokens.into_iter().zip(slots)) {
        if tok.is_empty() {
            continue;
        }
        let m = tok.len();
        let tok = Tensor::from_vec(tok, m, x.device())?;
        let slot = Tensor::from_vec(slot, m, x.device())?;
        let xe = x.index_select(&tok, 0)?.unsqueeze(0)?; // [1, m, hidden]
        let ye = expert(e, g, &xe, mixed)?.squeeze(0)?; // [m, hidden]
        let we = weights.index_select(&slot, 0)?.unsqueeze(1)?; // [m, 1]
        out = out.index_add(&tok, &ye.broadcast_mul(&we)?, 0)?;
    }
    let out = out.reshape((b, t, hs))?;
    shared_experts(e, h, out, mixed)
}

/// One expert `g` of `e` on `x` `[1, m, hidden]`: the SiLU-gated MLP, or GPT-OSS's clamped
/// SwiGLU ([`super::config::ClampedSwiglu`]; its biases are the projections').
fn expert(e: &Experts, g: &Gated, x: &Tensor, mixed: bool) -> Result<Tensor> {
    let Some((alpha, limit)) = e.swiglu else {
        return gated(g, x, false, mixed);
    };
    let gate = apply(&g.gate, x, mixed)?.minimum(limit)?;
    let up = apply(&g.up, x, mixed)?.clamp(-limit, limit)?;
    let glu = (&gate * sigmoid(&(&gate * alpha)?)?)?;
    apply(&g.down, &((up + 1.0)? * glu)?, mixed)
}

/// `out` `[b, t, hidden]` plus the shared experts' output on `h`: Qwen's gated shared
/// expert, or DeepSeek's ungated shared experts.
fn shared_experts(e: &Experts, h: &Tensor, out: Tensor, mixed: bool) -> Result<Tensor> {
    let out = match &e.shared {
        Some(s) => (out + s.forward(h, mixed)?)?,
        None => out,
    };
    match &e.deepseek {
        Some(d) => out + gated(&d.shared, h, false, mixed)?,
        None => Ok(out),
    }
}

/// [`experts_grouped`] computed densely: every expert on every token, weighted by the routing
/// weight it has there (zero for the experts a token was not routed to). The same function
/// with `experts / top_k` times the products: the reference the grouped path is tested and
/// measured against.
pub(crate) fn experts_dense(
    e: &Experts,
    h: &Tensor,
    mixed: bool,
    router: Option<&mut Vec<Tensor>>,
) -> Result<Tensor> {
    let (b, t, hs) = h.dims3()?;
    let n = b * t;
    let x = h.reshape((n, hs))?;
    let (chosen, weights, logits) = route(e, &x)?;
    if let Some(r) = router {
        r.push(logits);
    }
    let k = e.top_k;
    let experts = e.experts.len();
    // [n·experts]: routing weights scattered to their experts, zero elsewhere.
    let mut at = Vec::with_capacity(n * k);
    for (s, &ex) in chosen.iter().enumerate() {
        at.push(((s / k) * experts) as u32 + ex);
    }
    let at = Tensor::from_vec(at, n * k, x.device())?;
    let dense = Tensor::zeros(n * experts, weights.dtype(), x.device())?
        .index_add(&at, &weights.flatten_all()?, 0)?
        .reshape((n, experts))?;
    let mut out = x.zeros_like()?;
    for (i, g) in e.experts.iter().enumerate() {
        let ye = expert(e, g, &x.unsqueeze(0)?, mixed)?.squeeze(0)?; // [n, hidden]
        out = (out + ye.broadcast_mul(&dense.narrow(1, i, 1)?)?)?;
    }
    let out = out.reshape((b, t, hs))?;
    shared_experts(e, h, out, mixed)
}
