//! DeepSeek-V3's multi-head latent attention (transformers 5.24's `DeepseekV3Attention`) as a
//! composition of ops that all have a backward pass. Per token and layer, with `nh` heads,
//! `n` = `qk_nope_head_dim`, `r` = `qk_rope_head_dim`, `v` = `v_head_dim`, `c` =
//! `kv_lora_rank`:
//!
//! ```text
//! q        = q_proj(h)  or  q_b_proj(rms(q_a_proj(h)))        [nh, n + r]
//! [ĉ, kr]  = kv_a_proj_with_mqa(h)                            [c + r]
//! c        = rms(ĉ)   (kv_a_layernorm)                        [c], the latent
//! q_r, kr  = RoPE of the rope part of q (each head) and of kr (one for every head)
//! [k_n, v] = kv_b_proj(c) per head                            [nh, n], [nh, v]
//! k        = [k_n, kr],  q = [q_n, q_r]
//! out      = o_proj(softmax(q·kᵀ·scale + mask)·v)              scale: `ModelArgs::attn_scale`
//! ```
//!
//! The two low-rank norms use ε = 1e-6 whatever `rms_norm_eps` says (transformers builds them
//! with the norm's default). With `rope_interleave` the rope values come in pairs `(x0, x1),
//! (x2, x3), …`: they are reordered evens-then-odds before the half-split rotation, which
//! turns each pair by one frequency and leaves the result in the half-split order, as
//! transformers' interleaved rotation does (q and k alike, so scores do not see the order).
//!
//! What a decode cache keeps per token is the latent `c` and the rotated `kr` (`c + r`
//! values, transformers' cache too), not the expanded keys and values (`nh·(n + r + v)`): each
//! step expands the cached latents again through `kv_b_proj`.

use candle_core::{Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::config::{MlaArgs, ModelArgs};
use super::ops::{rms_norm, upcast};
use super::proj::{apply, linear, Proj};

/// ε of `q_a_layernorm` and `kv_a_layernorm`.
const LATENT_EPS: f64 = 1e-6;

/// How queries are made.
#[derive(Clone)]
pub(crate) enum Query {
    /// `q_proj` `[nh·(n + r), hidden]` (`q_lora_rank` null).
    Plain(Proj),
    /// `q_a_proj` `[q_lora_rank, hidden]`, `q_a_layernorm` `[q_lora_rank]`, `q_b_proj`
    /// `[nh·(n + r), q_lora_rank]`.
    LowRank { a: Proj, norm: Tensor, b: Proj },
}

/// A layer's latent attention (`self_attn.*`).
#[derive(Clone)]
pub(crate) struct Mla {
    pub(crate) q: Query,
    /// `kv_a_proj_with_mqa` `[c + r, hidden]`.
    pub(crate) kv_a: Proj,
    /// `kv_a_layernorm` `[c]`.
    pub(crate) kv_norm: Tensor,
    /// `kv_b_proj` `[nh·(n + v), c]`.
    pub(crate) kv_b: Proj,
    /// `o_proj` `[hidden, nh·v]`.
    pub(crate) o: Proj,
}

impl Mla {
    /// Reads `self_attn.*` through `vb` (biases on `q_a_proj`, `kv_a_proj_with_mqa` and
    /// `o_proj` where `attention_bias`: `qkv_bias` / `o_bias`).
    pub(crate) fn new(vb: &VarBuilder, a: &ModelArgs, m: &MlaArgs) -> Result<Self> {
        let (h, nh) = (a.hidden_size, a.num_attention_heads);
        let one = Init::Const(1.0);
        let q = match m.q_lora_rank {
            None => Query::Plain(linear(vb, h, nh * m.qk_head_dim(), false, "q_proj")?),
            Some(rank) => Query::LowRank {
                a: linear(vb, h, rank, a.qkv_bias, "q_a_proj")?,
                norm: vb.get_with_hints(rank, "q_a_layernorm.weight", one)?,
                b: linear(vb, rank, nh * m.qk_head_dim(), false, "q_b_proj")?,
            },
        };
        let c = m.kv_lora_rank;
        Ok(Self {
            q,
            kv_a: linear(
                vb,
                h,
                c + m.qk_rope_head_dim,
                a.qkv_bias,
                "kv_a_proj_with_mqa",
            )?,
            kv_norm: vb.get_with_hints(c, "kv_a_layernorm.weight", one)?,
            kv_b: linear(
                vb,
                c,
                nh * (m.qk_nope_head_dim + m.v_head_dim),
                false,
                "kv_b_proj",
            )?,
            o: linear(vb, nh * m.v_head_dim, h, a.o_bias, "o_proj")?,
        })
    }

    /// The projections with their HF module names, in [`Mla::projs`]' order.
    pub(crate) fn projs_mut(&mut self) -> Vec<(&'static str, &mut Proj)> {
        let mut all = match &mut self.q {
            Query::Plain(p) => vec![("self_attn.q_proj", p)],
            Query::LowRank { a, b, .. } => {
                vec![("self_attn.q_a_proj", a), ("self_attn.q_b_proj", b)]
            }
        };
        all.extend([
            ("self_attn.kv_a_proj_with_mqa", &mut self.kv_a),
            ("self_attn.kv_b_proj", &mut self.kv_b),
            ("self_attn.o_proj", &mut self.o),
        ]);
        all
    }

    /// The projections: q's, then `kv_a`, `kv_b`, `o`.
    pub(crate) fn projs(&self) -> Vec<&Proj> {
        let mut all = match &self.q {
            Query::Plain(p) => vec![p],
            Query::LowRank { a, b, .. } => vec![a, b],
        };
        all.extend([&self.kv_a, &self.kv_b, &self.o]);
        all
    }

    /// The norm weights: `q_a_layernorm` (where present), then `kv_a_layernorm`.
    pub(crate) fn norms(&self) -> Vec<&Tensor> {
        match &self.q {
            Query::Plain(_) => vec![&self.kv_norm],
            Query::LowRank { norm, .. } => vec![norm, &self.kv_norm],
        }
    }

    /// The attention with each projection replaced by `f` of it and its norms detached.
    pub(crate) fn map(&self, f: &impl Fn(&Proj) -> Proj) -> Mla {
        Mla {
            q: match &self.q {
                Query::Plain(p) => Query::Plain(f(p)),
                Query::LowRank { a, norm, b } => Query::LowRank {
                    a: f(a),
                    norm: norm.detach(),
                    b: f(b),
                },
            },
            kv_a: f(&self.kv_a),
            kv_norm: self.kv_norm.detach(),
            kv_b: f(&self.kv_b),
            o: f(&self.o),
        }
    }

    /// Cuts the norms from autograd (a frozen base under LoRA).
    pub(crate) fn freeze_norms(&mut self) {
        self.kv_norm = self.kv_norm.detach();
        if let Query::LowRank { norm, .. } = &mut self.q {
            *norm = norm.detach();
        }
    }

    /// The queries and what a cache keeps of `h` `[b, t, hidden]`, with rotary tables `cos`,
    /// `sin` `[b, 1, t, r]`: queries `[b, nh, t, n + r]`, latents `[b, 1, t, c]` and rotated
    /// rope keys `[b, 1, t, r]`.
    pub(crate) fn compress(
        &self,
        a: &ModelArgs,
        m: &MlaArgs,
        h: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        mixed: bool,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = h.dims3()?;
        let nh = a.num_attention_heads;
        let (n, r, c) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank);
        let q = match &self.q {
            Query::Plain(p) => apply(p, h, mixed)?,
            Query::LowRank { a: qa, norm, b: qb } => {
                let low = rms_norm(&apply(qa, h, mixed)?, norm, LATENT_EPS)?; // [b, t, rank]
                apply(qb, &low, mixed)?
            }
        }; // [b, t, nh·(n + r)]
        let q = q.reshape((b, t, nh, n + r))?.transpose(1, 2)?; // [b, nh, t, n + r]
        let q_rot = rotate(&q.narrow(3, n, r)?, cos, sin, m.rope_interleave)?;
        let q = Tensor::cat(&[&q.narrow(3, 0, n)?, &q_rot], 3)?; // [b, nh, t, n + r]
        let kv = apply(&self.kv_a, h, mixed)?; // [b, t, c + r]
        let latent = rms_norm(&kv.narrow(2, 0, c)?, &self.kv_norm, LATENT_EPS)?; // [b, t, c]
        let k_rot = kv.narrow(2, c, r)?.unsqueeze(1)?; // [b, 1, t, r]
        let k_rot = rotate(&k_rot, cos, sin, m.rope_interleave)?;
        Ok((q, latent.unsqueeze(1)?, k_rot))
    }

    /// The attention's output `[b, t, hidden]` for queries `q` `[b, nh, t, n + r]` over the
    /// `s` positions of `latent` `[b, 1, s, c]` and `k_rot` `[b, 1, s, r]`, with the additive
    /// bias `[b, 1, t, s]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &self,
        a: &ModelArgs,
        m: &MlaArgs,
        q: &Tensor,
        latent: &Tensor,
        k_rot: &Tensor,
        bias: &Tensor,
        mixed: bool,
    ) -> Result<Tensor> {
        let (b, nh, t, _) = q.dims4()?;
        let s = latent.dim(2)?;
        let (n, r, v) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        let kv = apply(&self.kv_b, &latent.squeeze(1)?, mixed)? // [b, s, nh·(n + v)]
            .reshape((b, s, nh, n + v))?
            .transpose(1, 2)?; // [b, nh, s, n + v]
        let k_rot = k_rot.broadcast_as((b, nh, s, r))?;
        let k = Tensor::cat(&[&kv.narrow(3, 0, n)?, &k_rot], 3)?.contiguous()?; // [b, nh, s, n + r]
        let val = kv.narrow(3, n, v)?.contiguous()?; // [b, nh, s, v]
        let scores = (q.contiguous()?.matmul(&k.t()?)? * a.attn_scale())?; // [b, nh, t, s]
        let scores = scores.broadcast_add(bias)?;
        let probs = candle_nn::ops::softmax(&upcast(&scores)?, D::Minus1)?.to_dtype(q.dtype())?;
        let out = probs.matmul(&val)?; // [b, nh, t, v]
        let out = out.transpose(1, 2)?.reshape((b, t, nh * v))?; // [b, t, nh·v]
        apply(&self.o, &out, mixed)
    }
}

/// The half-split rotation of `x` `[b, heads, t, r]` by tables `[b, 1, t, r]`, after
/// reordering interleaved pairs evens-then-odds when `interleaved`.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    let r = x.dim(3)?;
    let x = match interleaved {
        true => {
            let order: Vec<u32> = (0..r as u32)
                .step_by(2)
                .chain((1..r as u32).step_by(2))
                .collect();
            let order = Tensor::from_vec(order, r, x.device())?;
            x.contiguous()?.index_select(&order, 3)?
        }
        false => x.contiguous()?,
    };
    let half = r / 2;
    let turned = Tensor::cat(
        &[&x.narrow(3, half, half)?.neg()?, &x.narrow(3, 0, half)?],
        3,
    )?;
    x.broadcast_mul(cos)? + turned.broadcast_mul(sin)?
}
