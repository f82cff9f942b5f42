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
use candle_nn::{Init, Linear, VarBuilder};

use super::config::ModelArgs;
use super::proj::{base_matmul, mix64, Dropout, Proj};

/// Which keys each query of a forward attends to.
#[derive(Debug, Clone)]
pub(crate) enum Mask {
    /// Additive bias `[batch, 1, seq, past + seq]`: 0 where allowed, −1e9 elsewhere.
    Bias(Tensor),
    /// Sequences packed end to end in a batch of one, `(first token, length)` each: causal
    /// inside each sequence, nothing across sequences.
    Packed(Arc<[(usize, usize)]>),
}

impl Mask {
    /// The additive bias the op composition reads: the bias itself (already windowed), or for
    /// packed sequences a block-diagonal causal one `[1, 1, n, n]`, each query seeing at most
    /// `window` positions (quadratic in the total length: the composition is the reference and
    /// the fallback, the hand-written layer never builds it).
    pub(crate) fn bias(
        &self,
        dtype: DType,
        device: &Device,
        window: Option<usize>,
    ) -> Result<Tensor> {
        match self {
            Mask::Bias(b) => Ok(b.clone()),
            Mask::Packed(segs) => {
                let n: usize = segs.iter().map(|s| s.1).sum();
                let mut bias = vec![-1e9f32; n * n];
                for &(a, l) in segs.iter() {
                    for i in 0..l {
                        let first = window.map_or(0, |w| (i + 1).saturating_sub(w));
                        bias[(a + i) * n + a + first..][..=i - first].fill(0.0);
                    }
                }
                Tensor::from_vec(bias, (1, 1, n, n), &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(device)
            }
        }
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
    len: usize,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            len: 0,
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
        Ok(())
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
            let (b, h, _, d) = k.dims4()?;
            let cap = (2 * need).max(need + 64);
            let kb = Tensor::zeros((b, h, cap, d), k.dtype(), k.device())?;
            let vb = Tensor::zeros((b, h, cap, d), v.dtype(), v.device())?;
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

pub(crate) fn linear(
    vb: &VarBuilder,
    inp: usize,
    out: usize,
    bias: bool,
    name: &str,
) -> Result<Proj> {
    let w = vb.get_with_hints(
        (out, inp),
        &format!("{name}.weight"),
        Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        },
    )?;
    let b = if bias {
        Some(vb.get_with_hints(out, &format!("{name}.bias"), Init::Const(0.0))?)
    } else {
        None
    };
    Ok(Proj::new(Linear::new(w, b)))
}

/// A linear layer on `[batch, seq, in]` as one `[batch·seq, in] × [in, out]` product (candle's
/// `Linear` on 3-D input runs one small product per batch row, which is several times slower).
/// With an adapter, `s·(dropout(x)·Aᵀ)·Bᵀ` is added (PEFT's `lora.Linear`; dropout only
/// where this forward's copy of the layer carries a mask).
fn apply(l: &Proj, x: &Tensor) -> Result<Tensor> {
    let (b, t, i) = x.dims3()?;
    let x2 = x.reshape((b * t, i))?; // [b·t, in]
    let y = base_matmul(&x2, l.weight())?; // [b·t, out]
    let y = match l.bias() {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    };
    let y = match &l.lora {
        // [b·t, in]·[in, r]·[r, out], scaled: with B = 0 this adds exact zeros.
        Some(a) => {
            let xa = match &a.dropout {
                Some(d) => (&x2 * d.mask(x2.dims(), x2.dtype(), x2.device())?)?,
                None => x2.clone(),
            };
            (y + (xa.matmul(&a.a.t()?)?.matmul(&a.b.t()?)? * a.scale)?)?
        }
        None => y,
    };
    y.reshape((b, t, ()))
}

/// `x · rsqrt(mean(x²) + eps) · w`, computed in f32.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = upcast(x)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(w)
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
fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    let inner = ((x + ((x.sqr()? * x)? * 0.044_715)?)? * 0.797_884_560_802_865_4)?;
    (x * 0.5)? * (inner.tanh()? + 1.0)?
}

/// Half-precision values in f32 for softmax-type reductions; f32 and f64 stay as they are.
pub(crate) fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// `[-x2, x1]` for `x = [x1, x2]` split in half on the last axis.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

#[derive(Clone)]
pub(crate) struct Block {
    pub(crate) ln1: Tensor,
    pub(crate) ln2: Tensor,
    /// Qwen3's RMSNorm over each head of q and of k before RoPE (`self_attn.q_norm`,
    /// `self_attn.k_norm`, `[head_dim]` each).
    pub(crate) qk_norm: Option<(Tensor, Tensor)>,
    /// Gemma's norms of the attention's and the MLP's outputs before their residual adds
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`); `ln2` is then its
    /// `pre_feedforward_layernorm`.
    pub(crate) sandwich: Option<(Tensor, Tensor)>,
    /// How many positions this layer's queries see (sliding-window layers), `None`: all.
    pub(crate) window: Option<usize>,
    /// Whether the layer's RoPE has frequencies of its own (Gemma 3's local layers).
    pub(crate) local_rope: bool,
    pub(crate) q: Proj,
    pub(crate) k: Proj,
    pub(crate) v: Proj,
    pub(crate) o: Proj,
    pub(crate) gate: Proj,
    pub(crate) up: Proj,
    pub(crate) down: Proj,
}

impl Block {
    /// The layer with its weights cut from the autograd graph (same storage).
    pub(crate) fn detached(&self) -> Block {
        self.map_proj(Proj::detached)
    }

    /// The seven projections with their HF module names (`self_attn.q_proj`, `mlp.down_proj`).
    pub(crate) fn projs_mut(&mut self) -> [(&'static str, &mut Proj); 7] {
        [
            ("self_attn.q_proj", &mut self.q),
            ("self_attn.k_proj", &mut self.k),
            ("self_attn.v_proj", &mut self.v),
            ("self_attn.o_proj", &mut self.o),
            ("mlp.gate_proj", &mut self.gate),
            ("mlp.up_proj", &mut self.up),
            ("mlp.down_proj", &mut self.down),
        ]
    }

    pub(crate) fn projs(&self) -> [&Proj; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
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
                let seed = mix64(forward_seed ^ (((layer as u64) << 8) | j as u64));
                l.dropout = Some(Dropout { p, seed });
            }
        }
        b
    }

    /// The layer's norm weights: `ln1`, `ln2`, then q/k norms where the layer has them.
    pub(crate) fn norms(&self) -> Vec<&Tensor> {
        let mut n = vec![&self.ln1, &self.ln2];
        if let Some((q, k)) = &self.qk_norm {
            n.extend([q, k]);
        }
        if let Some((a, m)) = &self.sandwich {
            n.extend([a, m]);
        }
        n
    }

    /// Whether any weight of the layer receives gradients.
    pub(crate) fn trains(&self) -> bool {
        self.norms().iter().any(|n| n.track_op())
            || self
                .projs()
                .iter()
                .any(|p| p.weight().track_op() || p.lora.as_ref().is_some_and(|l| l.a.track_op()))
    }

    /// The layer with each projection replaced by `f` of it, norms detached.
    pub(crate) fn map_proj(&self, f: impl Fn(&Proj) -> Proj) -> Block {
        let lin = |l: &Proj| f(l);
        Block {
            ln1: self.ln1.detach(),
            ln2: self.ln2.detach(),
            qk_norm: self.qk_norm.as_ref().map(|(q, k)| (q.detach(), k.detach())),
            sandwich: self
                .sandwich
                .as_ref()
                .map(|(a, m)| (a.detach(), m.detach())),
            window: self.window,
            local_rope: self.local_rope,
            q: lin(&self.q),
            k: lin(&self.k),
            v: lin(&self.v),
            o: lin(&self.o),
            gate: lin(&self.gate),
            up: lin(&self.up),
            down: lin(&self.down),
        }
    }
}

/// One decoder layer on `x` `[batch, seq, hidden]` with rotary tables `cos`/`sin`
/// `[batch, 1, seq, head_dim]` and attention bias `mask` `[batch, 1, seq, past + seq]`; with a
/// cache, its past keys and values are read and the new ones appended.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_forward(
    a: &ModelArgs,
    dtype: DType,
    l: &Block,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    mask: &Tensor,
    cache: Option<(&mut KvCache, usize)>,
) -> Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let (nh, nkv, hd) = (a.num_attention_heads, a.num_key_value_heads, a.head_dim);
    let h = norm(x, &l.ln1, a)?;
    let q = apply(&l.q, &h)?.reshape((b, t, nh, hd))?; // [b, t, nh, hd]
    let k = apply(&l.k, &h)?.reshape((b, t, nkv, hd))?; // [b, t, nkv, hd]
    let (q, k) = match &l.qk_norm {
        // Each head normed over its hd values.
        Some((qn, kn)) => (norm(&q, qn, a)?, norm(&k, kn, a)?),
        None => (q, k),
    };
    let q = q.transpose(1, 2)?; // [b, nh, t, hd]
    let k = k.transpose(1, 2)?; // [b, nkv, t, hd]
    let v = apply(&l.v, &h)?.reshape((b, t, nkv, hd))?.transpose(1, 2)?;
    let q = (q.broadcast_mul(cos)? + rotate_half(&q)?.broadcast_mul(sin)?)?;
    let k = (k.broadcast_mul(cos)? + rotate_half(&k)?.broadcast_mul(sin)?)?;
    let (k, v) = match cache {
        Some((c, i)) => c.append(i, &k, &v)?,
        None => (k, v),
    };
    let s = k.dim(2)?;
    let rep = nh / nkv;
    // Grouped-query attention without copying K/V per query head: the `rep` query heads that
    // share a KV head are stacked along the query axis, [b, nkv, rep·t, hd].
    let qg = q.contiguous()?.reshape((b, nkv, rep * t, hd))?;
    let scores = (qg.matmul(&k.t()?)? * a.attn_scale())?; // [b, nkv, rep·t, s]
    let scores = scores.reshape((b, nh, t, s))?.broadcast_add(mask)?; // [b, nh, t, s]
    let probs = candle_nn::ops::softmax(&upcast(&scores)?, D::Minus1)?.to_dtype(dtype)?;
    let attn = probs
        .reshape((b, nkv, rep * t, s))?
        .matmul(&v.contiguous()?)?; // [b, nkv, rep·t, hd]
    let attn = attn
        .reshape((b, nh, t, hd))?
        .transpose(1, 2)?
        .reshape((b, t, nh * hd))?; // [b, t, nh·hd]
    let attn = apply(&l.o, &attn)?;
    let attn = match &l.sandwich {
        Some((post, _)) => norm(&attn, post, a)?,
        None => attn,
    };
    let x = (x + attn)?;
    let h = norm(&x, &l.ln2, a)?;
    let gate = apply(&l.gate, &h)?;
    // Gemma: GELU with its tanh approximation; the others SiLU.
    let gate = if a.arch.gemma() {
        gelu_tanh(&gate)?
    } else {
        gate.silu()?
    };
    let mlp = apply(&l.down, &(gate * apply(&l.up, &h)?)?)?;
    let mlp = match &l.sandwich {
        Some((_, post)) => norm(&mlp, post, a)?,
        None => mlp,
    };
    x + mlp
}
