//! Qwen3.5's Gated DeltaNet layer (transformers' `Qwen3_5GatedDeltaNet`) as a composition of
//! candle ops with exact backward passes (training through candle's autograd, decoding with a
//! (convolution, recurrent) state per row in [`super::KvCache`]). On the CPU in f32/f64,
//! training and no-cache forwards run the mixer between the projections as one hand-written op
//! (`delta_mix`), whose reference is this composition with the recurrence as `delta_op`; the
//! chunk-wise form below is in turn `delta_op`'s reference.
//!
//! ```text
//! x (normed, padding rows zeroed)          [b, t, hidden]
//! c = silu(conv_K(x·W_qkvᵀ))               [b, t, 2·nk·dk + nv·dv], depthwise, causal:
//!     c_t = Σ_j w_j ⊙ u_{t−K+1+j} over the last K inputs (the state holds the K − 1 before t)
//! q, k, v = split(c); q, k ← q/‖q‖, k/‖k‖ (+1e-6 under the root); q ← q/√dk
//! value head h reads key head h / (nv/nk)
//! β = σ(x·W_bᵀ)   g = −exp(A_log)·softplus(x·W_aᵀ + dt_bias)        [b, t, nv]
//! S_t = exp(g_t)·S_{t−1} + k_t ⊗ β_t(v_t − S_{t−1}ᵀ·exp(g_t)·k_t)  S: [dk, dv] per head
//! o_t = S_tᵀ q_t
//! y = (rms(o)·w_norm ⊙ silu(x·W_zᵀ)) per head, then ·W_outᵀ          [b, t, hidden]
//! ```
//!
//! Training runs the recurrence chunk-wise (transformers' `torch_chunk_gated_delta_rule`, the
//! WY/UT form): inside a chunk of C tokens with cumulative decays γ_i = Σ_{j≤i} g_j,
//! `L_ij = β_i (k_i·k_j) e^{γ_i−γ_j}` (i > j), `U = (I + L)⁻¹ (β ⊙ V)`,
//! `W = (I + L)⁻¹ (β e^{γ} ⊙ K)`; with the state S entering the chunk,
//! `V' = U − W S`, `O = (e^{γ} ⊙ Q) S + [(Q Kᵀ) ⊙ e^{γ_i−γ_j}]_{i≥j} V'`,
//! `S ← e^{γ_C} S + (e^{γ_C−γ} ⊙ K)ᵀ V'`. `(I + L)⁻¹` of the strictly lower (nilpotent) L is
//! `(I − L)(I + L²)(I + L⁴)…`, a few batched products instead of a triangular solve (which
//! candle lacks). [`recurrent`] is the token-by-token form the tests hold it to.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

use super::config::{LinearAttnArgs, ModelArgs};
use super::ops::{rms_norm, sigmoid, upcast};
use super::proj::Proj;
use super::proj::{apply, linear};

/// Chunk length of the chunk-wise recurrence (transformers' and FLA's default).
const CHUNK: usize = 64;

/// Where a DeltaNet's per-token inputs come from.
#[derive(Clone)]
pub(crate) enum Inputs {
    /// Qwen3.5: `in_proj_qkv` `[2·nk·dk + nv·dv, hidden]` (q, k, v in the convolution's order),
    /// `in_proj_z` `[nv·dv, hidden]` (the output gate), `in_proj_b`, `in_proj_a` `[nv, hidden]`.
    Split {
        qkv: Proj,
        z: Proj,
        b: Proj,
        a: Proj,
    },
    /// Qwen3-Next: `in_proj_qkvz` `[nk·(2·dk + 2·r·dv), hidden]` and `in_proj_ba`
    /// `[nk·2r, hidden]` (r = nv/nk), rows grouped per key head: `[q, k, v_1..v_r, z_1..z_r]`
    /// and `[b_1..b_r, a_1..a_r]`.
    Grouped { qkvz: Proj, ba: Proj },
}

/// One Gated DeltaNet token mixer's weights (`model.layers.N.linear_attn.*`).
#[derive(Clone)]
pub(crate) struct DeltaNet {
    pub(crate) inputs: Inputs,
    /// `out_proj` `[hidden, nv·dv]`.
    pub(crate) out: Proj,
    /// `conv1d.weight` `[conv_dim, 1, K]` (depthwise, no bias).
    pub(crate) conv: Tensor,
    /// `dt_bias` `[nv]`.
    pub(crate) dt_bias: Tensor,
    /// `A_log` `[nv]`.
    pub(crate) a_log: Tensor,
    /// `norm.weight` `[dv]`: the gated RMSNorm's scale (no `1 +`).
    pub(crate) norm: Tensor,
}

/// A row batch's recurrent memory of one DeltaNet layer between decode calls: the last
/// `K − 1` convolution inputs `[b, K − 1, conv_dim]` and the state `S` `[b, nv, dk, dv]`.
#[derive(Debug, Clone)]
pub struct DeltaState {
    pub(crate) conv: Tensor,
    pub(crate) rec: Tensor,
}

impl DeltaState {
    pub(crate) fn select_rows(&mut self, keep: &Tensor) -> Result<()> {
        self.conv = self.conv.index_select(keep, 0)?;
        self.rec = self.rec.index_select(keep, 0)?;
        Ok(())
    }
}

impl DeltaNet {
    /// Reads (or, from a `VarMap`, creates) the weights under `vb` (`...linear_attn`).
    pub(crate) fn new(vb: &VarBuilder, args: &ModelArgs, la: &LinearAttnArgs) -> Result<Self> {
        let h = args.hidden_size;
        let nv = la.num_value_heads;
        let randn = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let inputs = match la.grouped {
            false => Inputs::Split {
                qkv: linear(vb, h, la.conv_dim(), false, "in_proj_qkv")?,
                z: linear(vb, h, la.value_dim(), false, "in_proj_z")?,
                b: linear(vb, h, nv, false, "in_proj_b")?,
                a: linear(vb, h, nv, false, "in_proj_a")?,
            },
            true => Inputs::Grouped {
                qkvz: linear(vb, h, la.conv_dim() + la.value_dim(), false, "in_proj_qkvz")?,
                ba: linear(vb, h, 2 * nv, false, "in_proj_ba")?,
            },
        };
        Ok(Self {
            inputs,
            out: linear(vb, la.value_dim(), h, false, "out_proj")?,
            conv: vb.get_with_hints((la.conv_dim(), 1, la.conv_kernel), "conv1d.weight", randn)?,
            dt_bias: vb.get_with_hints(nv, "dt_bias", Init::Const(1.0))?,
            // A = 1 for a fresh layer (transformers draws A from [0.01, 16]).
            a_log: vb.get_with_hints(nv, "A_log", Init::Const(0.0))?,
            norm: vb.get_with_hints(la.value_head_dim, "norm.weight", Init::Const(1.0))?,
        })
    }

    /// The projections with their names under `linear_attn.`, in a fixed order.
    pub(crate) fn projs_mut(&mut self) -> Vec<(&'static str, &mut Proj)> {
        let mut all = match &mut self.inputs {
            Inputs::Split { qkv, z, b, a } => vec![
                ("linear_attn.in_proj_qkv", qkv),
                ("linear_attn.in_proj_z", z),
                ("linear_attn.in_proj_b", b),
                ("linear_attn.in_proj_a", a),
            ],
            Inputs::Grouped { qkvz, ba } => vec![
                ("linear_attn.in_proj_qkvz", qkvz),
                ("linear_attn.in_proj_ba", ba),
            ],
        };
        all.push(("linear_attn.out_proj", &mut self.out));
        all
    }

    pub(crate) fn projs(&self) -> Vec<&Proj> {
        let mut all = match &self.inputs {
            Inputs::Split { qkv, z, b, a } => vec![qkv, z, b, a],
            Inputs::Grouped { qkvz, ba } => vec![qkvz, ba],
        };
        all.push(&self.out);
        all
    }

    /// The weights that are not projections: norm, convolution, dt_bias, A_log.
    pub(crate) fn plain(&self) -> [&Tensor; 4] {
        [&self.norm, &self.conv, &self.dt_bias, &self.a_log]
    }

    /// The layer with projections mapped by `f` and the other weights detached.
    pub(crate) fn map(&self, f: &impl Fn(&Proj) -> Proj) -> DeltaNet {
        DeltaNet {
            inputs: match &self.inputs {
                Inputs::Split { qkv, z, b, a } => Inputs::Split {
                    qkv: f(qkv),
                    z: f(z),
                    b: f(b),
                    a: f(a),
                },
                Inputs::Grouped { qkvz, ba } => Inputs::Grouped {
                    qkvz: f(qkvz),
                    ba: f(ba),
                },
            },
            out: f(&self.out),
            conv: self.conv.detach(),
            dt_bias: self.dt_bias.detach(),
            a_log: self.a_log.detach(),
            norm: self.norm.detach(),
        }
    }

    /// Cuts the non-projection weights from autograd (a LoRA model's frozen base).
    pub(crate) fn freeze_plain(&mut self) {
        for t in [
            &mut self.conv,
            &mut self.dt_bias,
            &mut self.a_log,
            &mut self.norm,
        ] {
            *t = t.detach();
        }
    }

    /// The mixer on `x` `[b, t, hidden]` (the layer's normed input). `real` `[b, t]` (x's
    /// dtype, 1 real, 0 padding) zeroes padding rows first, as transformers does, so that
    /// left padding leaves the state at zero. With `state`, the recurrence starts from it (none
    /// yet: zeros) and it is replaced by the state after the last token.
    pub(crate) fn forward(
        &self,
        la: &LinearAttnArgs,
        eps: f64,
        x: &Tensor,
        real: Option<&Tensor>,
        state: Option<&mut Option<DeltaState>>,
        mixed: bool,
    ) -> Result<Tensor> {
        let x = match real {
            Some(r) => x.broadcast_mul(&r.unsqueeze(2)?)?,
            None => x.clone(),
        };
        // u: the convolution's input [b, t, cd] (q, k, v); z [b, t, nv·dv]; β and the
        // decay's input [b, t, nv].
        let ins = self.inputs(la, &x, mixed)?;
        // Training and no-cache forwards on the CPU: the mixer as one op (`delta_mix`).
        let fused = state.is_none() && crate::kernels::supported(x.device(), x.dtype());
        let y = self.mix(la, eps, ins, state, fused)?; // [b, t, nv·dv]
        apply(&self.out, &y, mixed)
    }

    /// The mixer between the projections: from the per-token inputs ([`DeltaNet::inputs`]) to
    /// the gated norm's output `[b, t, nv·dv]`, as one op (`fused`: CPU f32/f64, no state) or
    /// as the composition of candle ops (its reference).
    pub(crate) fn mix(
        &self,
        la: &LinearAttnArgs,
        eps: f64,
        (u, z, b_in, a_in): (Tensor, Tensor, Tensor, Tensor),
        state: Option<&mut Option<DeltaState>>,
        fused: bool,
    ) -> Result<Tensor> {
        let (b, t, _) = u.dims3()?;
        let (nk, nv, dk, dv, kw) = (
            la.num_key_heads,
            la.num_value_heads,
            la.key_head_dim,
            la.value_head_dim,
            la.conv_kernel,
        );
        let cd = la.conv_dim();
        if fused {
            let zba = Tensor::cat(&[&z, &b_in, &a_in], 2)?;
            let params = Tensor::cat(
                &[
                    &self.conv.flatten_all()?,
                    &self.dt_bias,
                    &self.a_log,
                    &self.norm,
                ],
                0,
            )?;
            let op = super::delta_mix::Mixer::new(la, eps);
            return u.contiguous()?.apply_op3(&zba, &params, op);
        }
        let prev = match state.as_deref().and_then(Option::as_ref) {
            Some(s) => s.conv.clone(),
            None => Tensor::zeros((b, kw - 1, cd), u.dtype(), u.device())?,
        };
        let up = Tensor::cat(&[&prev, &u], 1)?; // [b, t + K − 1, cd]
        let w = self.conv.reshape((cd, kw))?; // [cd, K]
        let mut c = up
            .narrow(1, 0, t)?
            .broadcast_mul(&w.narrow(1, 0, 1)?.squeeze(1)?)?;
        for j in 1..kw {
            c = (c + up
                .narrow(1, j, t)?
                .broadcast_mul(&w.narrow(1, j, 1)?.squeeze(1)?)?)?;
        }
        let c = c.silu()?; // [b, t, cd]
        let kd = la.key_dim();
        let r = nv / nk;
        let heads = |y: Tensor, n: usize, d: usize| -> Result<Tensor> {
            // [b, t, n·d] → [b, nv, t, d], key heads repeated for their value heads.
            let y = y.reshape((b, t, n, d))?;
            let y = match n == nv {
                true => y,
                false => y
                    .unsqueeze(3)?
                    .broadcast_as((b, t, n, r, d))?
                    .reshape((b, t, nv, d))?,
            };
            y.transpose(1, 2)?.contiguous()
        };
        let q = l2norm(&c.narrow(2, 0, kd)?.reshape((b, t, nk, dk))?)?;
        let k = l2norm(&c.narrow(2, kd, kd)?.reshape((b, t, nk, dk))?)?;
        let q = heads(
            (q * (1.0 / (dk as f64).sqrt()))?.reshape((b, t, kd))?,
            nk,
            dk,
        )?;
        let k = heads(k.reshape((b, t, kd))?, nk, dk)?; // [b, nv, t, dk]
        let v = heads(c.narrow(2, 2 * kd, la.value_dim())?, nv, dv)?; // [b, nv, t, dv]
        let beta = sigmoid(&b_in)?.transpose(1, 2)?.contiguous()?; // [b, nv, t]
        let a = a_in.broadcast_add(&self.dt_bias)?;
        let g = softplus(&a)?
            .broadcast_mul(&self.a_log.exp()?)?
            .neg()?
            .transpose(1, 2)?
            .contiguous()?; // [b, nv, t]
        let o = match state {
            // No cache on the CPU (the composition as `delta_mix`'s reference): the
            // hand-written recurrence (`delta_op`, its own backward, states kept every 64 tokens).
            None if crate::kernels::supported(q.device(), q.dtype()) => {
                let x = Tensor::cat(&[&q, &k, &v, &g.unsqueeze(3)?, &beta.unsqueeze(3)?], 3)?;
                x.apply_op1(super::delta_op::DeltaRule { dk, dv })? // [b, nv, t, dv]
            }
            _ => {
                let s0 = state.as_deref().and_then(Option::as_ref).map(|s| &s.rec);
                let (o, s) = chunked(&q, &k, &v, &g, &beta, s0, CHUNK)?; // [b, nv, t, dv]
                if let Some(slot) = state {
                    *slot = Some(DeltaState {
                        conv: up.narrow(1, t, kw - 1)?.detach().contiguous()?,
                        rec: s.detach(),
                    });
                }
                o
            }
        };
        let o = o.transpose(1, 2)?; // [b, t, nv, dv]
        let z = z.reshape((b, t, nv, dv))?;
        let y = (rms_norm(&o, &self.norm, eps)? * upcast(&z)?.silu()?.to_dtype(o.dtype())?)?;
        y.reshape((b, t, nv * dv))
    }
}

impl DeltaNet {
    /// The per-token inputs of `x` `[b, t, hidden]`: the convolution's input `[b, t, 2·nk·dk +
    /// nv·dv]` (all q, then k, then v), z `[b, t, nv·dv]`, β's and the decay's inputs
    /// `[b, t, nv]` (value heads in order, a key head's r value heads together).
    fn inputs(
        &self,
        la: &LinearAttnArgs,
        x: &Tensor,
        mixed: bool,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        match &self.inputs {
            Inputs::Split { qkv, z, b, a } => Ok((
                apply(qkv, x, mixed)?,
                apply(z, x, mixed)?,
                apply(b, x, mixed)?,
                apply(a, x, mixed)?,
            )),
            Inputs::Grouped { qkvz, ba } => {
                let (bs, t, _) = x.dims3()?;
                let (nk, dk, dv) = (la.num_key_heads, la.key_head_dim, la.value_head_dim);
                let r = la.num_value_heads / nk;
                let g = apply(qkvz, x, mixed)?.reshape((bs, t, nk, 2 * dk + 2 * r * dv))?;
                let part = |at: usize, n: usize| g.narrow(3, at, n)?.reshape((bs, t, nk * n));
                let u = Tensor::cat(&[part(0, dk)?, part(dk, dk)?, part(2 * dk, r * dv)?], 2)?;
                let z = part(2 * dk + r * dv, r * dv)?;
                let ba = apply(ba, x, mixed)?.reshape((bs, t, nk, 2 * r))?;
                let b = ba.narrow(3, 0, r)?.reshape((bs, t, nk * r))?;
                let a = ba.narrow(3, r, r)?.reshape((bs, t, nk * r))?;
                Ok((u.contiguous()?, z, b, a))
            }
        }
    }
}

/// `x / √(Σx² + 1e-6)` over the last axis (transformers' `l2norm`, FLA's epsilon).
fn l2norm(x: &Tensor) -> Result<Tensor> {
    let inv = (x.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)
}

/// `log(1 + eˣ)` as `max(x, 0) + log(1 + e^{−|x|})` (no overflow for large x).
fn softplus(x: &Tensor) -> Result<Tensor> {
    x.relu()? + (x.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// `a·b` over any number of leading batch axes (`[.., m, k]·[.., k, n]`), as one batched
/// product of 3-D views (candle's product takes at most one run of batch strides).
fn bmm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ad, bd) = (a.dims(), b.dims());
    let r = ad.len();
    if r <= 3 {
        return a.contiguous()?.matmul(&b.contiguous()?);
    }
    let batch: usize = ad[..r - 2].iter().product();
    let (m, k, n) = (ad[r - 2], ad[r - 1], bd[r - 1]);
    let y = a
        .contiguous()?
        .reshape((batch, m, k))?
        .matmul(&b.contiguous()?.reshape((batch, k, n))?)?;
    let mut shape = ad[..r - 1].to_vec();
    shape.push(n);
    y.reshape(shape)
}

/// `[n, n]` of 1 where `keep(i, j)`, else 0, in `dtype` on `device`.
fn tri(
    n: usize,
    keep: impl Fn(usize, usize) -> bool,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor> {
    let v: Vec<f64> = (0..n * n)
        .map(|x| f64::from(u8::from(keep(x / n, x % n))))
        .collect();
    Tensor::from_vec(v, (n, n), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)
}

/// The gated delta rule chunk-wise: `q`, `k` `[b, h, t, dk]` (normalised, q scaled), `v`
/// `[b, h, t, dv]`, `g`, `beta` `[b, h, t]`, from state `s0` `[b, h, dk, dv]` (zeros when
/// `None`). Returns the outputs `[b, h, t, dv]` and the state after the last token.
pub(crate) fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    s0: Option<&Tensor>,
    chunk: usize,
) -> Result<(Tensor, Tensor)> {
    let (b, h, t, dk) = q.dims4()?;
    let dv = v.dim(3)?;
    let (dtype, dev) = (q.dtype(), q.device());
    let c = chunk.min(t).max(1);
    let pad = (c - t % c) % c;
    let n = (t + pad) / c;
    let padded = |x: &Tensor| -> Result<Tensor> {
        match pad {
            0 => Ok(x.clone()),
            _ => x.pad_with_zeros(2, 0, pad),
        }
    };
    let (q, k, v, g, beta) = (
        padded(q)?,
        padded(k)?,
        padded(v)?,
        padded(g)?,
        padded(beta)?,
    );
    let q = q.reshape((b, h, n, c, dk))?;
    let k = k.reshape((b, h, n, c, dk))?;
    let v = v.reshape((b, h, n, c, dv))?;
    let beta = beta.reshape((b, h, n, c, 1))?;
    let cum = g.reshape((b, h, n, c))?.cumsum(3)?; // γ [b, h, n, c]
    let lower = tri(c, |i, j| i >= j, dtype, dev)?;
    let strict = tri(c, |i, j| i > j, dtype, dev)?;
    // e^{γ_i − γ_j} for i ≥ j, 0 above the diagonal (the exponent clamped there so nothing
    // overflows before the mask).
    let diff = cum.unsqueeze(4)?.broadcast_sub(&cum.unsqueeze(3)?)?; // [b, h, n, c, c]
    let decay = diff.minimum(0.0)?.exp()?.broadcast_mul(&lower)?;
    let kb = k.broadcast_mul(&beta)?;
    let vb = v.broadcast_mul(&beta)?;
    let kt = k.transpose(3, 4)?.contiguous()?; // [b, h, n, dk, c]
    let l = (bmm(&kb, &kt)? * &decay)?.broadcast_mul(&strict)?; // [b, h, n, c, c]
                                                                // (I + L)⁻¹ = (I − L)(I + L²)(I + L⁴)… (L is nilpotent: L^c = 0).
    let eye = tri(c, |i, j| i == j, dtype, dev)?;
    let mut inv = eye.broadcast_sub(&l)?;
    let (mut p, mut covered) = (l, 2usize);
    while covered < c {
        p = bmm(&p, &p)?;
        inv = bmm(&inv, &p.broadcast_add(&eye)?)?;
        covered *= 2;
    }
    let ecum = cum.exp()?.unsqueeze(4)?; // e^{γ} [b, h, n, c, 1]
    let u = bmm(&inv, &vb)?; // [b, h, n, c, dv]
    let w = bmm(&inv, &kb.broadcast_mul(&ecum)?)?; // [b, h, n, c, dk]
    let intra = (bmm(&q, &kt)? * &decay)?; // [b, h, n, c, c]
    let qd = q.broadcast_mul(&ecum)?;
    let last = cum.narrow(3, c - 1, 1)?; // γ_C [b, h, n, 1]
    let kd = k.broadcast_mul(&last.broadcast_sub(&cum)?.exp()?.unsqueeze(4)?)?;
    let chunk_decay = last.exp()?.unsqueeze(4)?; // [b, h, n, 1, 1]
    let mut s = match s0 {
        Some(s) => s.clone(),
        None => Tensor::zeros((b, h, dk, dv), dtype, dev)?,
    };
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let at = |x: &Tensor| x.narrow(2, i, 1)?.squeeze(2)?.contiguous();
        let v_new = (at(&u)? - bmm(&at(&w)?, &s)?)?; // [b, h, c, dv]
        let o = (bmm(&at(&qd)?, &s)? + bmm(&at(&intra)?, &v_new)?)?;
        outs.push(o);
        let kdt = at(&kd)?.transpose(2, 3)?.contiguous()?; // [b, h, dk, c]
        s = (s.broadcast_mul(&at(&chunk_decay)?)? + bmm(&kdt, &v_new)?)?;
    }
    let o = Tensor::cat(&outs, 2)?.narrow(2, 0, t)?; // [b, h, t, dv]
    Ok((o, s))
}

/// The gated delta rule one token at a time (transformers' `torch_recurrent_gated_delta_rule`),
/// the definition [`chunked`] is tested against; same arguments and results.
#[cfg(test)]
pub(crate) fn recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    s0: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, h, t, dk) = q.dims4()?;
    let dv = v.dim(3)?;
    let mut s = match s0 {
        Some(s) => s.clone(),
        None => Tensor::zeros((b, h, dk, dv), q.dtype(), q.device())?,
    };
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let qt = q.narrow(2, i, 1)?.contiguous()?; // [b, h, 1, dk]
        let kt = k.narrow(2, i, 1)?.contiguous()?;
        let vt = v.narrow(2, i, 1)?.contiguous()?; // [b, h, 1, dv]
        let gt = g.narrow(2, i, 1)?.exp()?.unsqueeze(3)?; // [b, h, 1, 1]
        let bt = beta.narrow(2, i, 1)?.unsqueeze(3)?;
        s = s.broadcast_mul(&gt)?;
        let mem = bmm(&kt, &s)?; // [b, h, 1, dv]
        let delta = (vt - mem)?.broadcast_mul(&bt)?;
        s = (s + bmm(&kt.transpose(2, 3)?, &delta)?)?;
        outs.push(bmm(&qt, &s)?);
    }
    Ok((Tensor::cat(&outs, 2)?, s))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Random q, k (normalised), v, g ≤ 0, β in [0, 1) `[b, h, t, ·]` and a state (f64).
    pub(crate) fn inputs(b: usize, h: usize, t: usize, dk: usize, dv: usize) -> [Tensor; 6] {
        let r = |shape: &[usize], seed: u64| {
            let n: usize = shape.iter().product();
            Tensor::from_vec(crate::testing::uniform(n, seed), shape, &Device::Cpu).unwrap()
        };
        let q = l2norm(&r(&[b, h, t, dk], 1)).unwrap();
        let k = l2norm(&r(&[b, h, t, dk], 2)).unwrap();
        let v = r(&[b, h, t, dv], 3);
        let g = (r(&[b, h, t], 4).abs().unwrap() * -0.7).unwrap();
        let beta = ((r(&[b, h, t], 5) + 1.0).unwrap() * 0.5).unwrap();
        let s0 = r(&[b, h, dk, dv], 6);
        [q, k, v, g, beta, s0]
    }

    use crate::testing::max_abs_diff as max_diff;

    /// The chunk-wise recurrence equals the token-by-token one (f64, 1e-10) for lengths that
    /// are and are not multiples of the chunk, with and without an initial state.
    #[test]
    fn chunked_equals_the_token_by_token_recurrence() {
        for (t, chunk) in [(1, 4), (5, 4), (8, 4), (13, 4), (13, 64), (70, 16)] {
            let [q, k, v, g, beta, s0] = inputs(2, 3, t, 5, 4);
            for s in [None, Some(&s0)] {
                let (o1, f1) = chunked(&q, &k, &v, &g, &beta, s, chunk).unwrap();
                let (o2, f2) = recurrent(&q, &k, &v, &g, &beta, s).unwrap();
                let (d_o, d_s) = (max_diff(&o1, &o2), max_diff(&f1, &f2));
                assert!(
                    d_o < 1e-10 && d_s < 1e-10,
                    "t {t} chunk {chunk}: {d_o:e} {d_s:e}"
                );
            }
        }
    }

    /// Splitting a sequence and carrying the state equals running it whole (what decoding
    /// with a cache relies on).
    #[test]
    fn a_carried_state_continues_the_sequence() {
        let [q, k, v, g, beta, _] = inputs(1, 2, 11, 4, 3);
        let (whole, s_whole) = chunked(&q, &k, &v, &g, &beta, None, 4).unwrap();
        let cut = |x: &Tensor, a: usize, n: usize| x.narrow(2, a, n).unwrap();
        let (a, s) = chunked(
            &cut(&q, 0, 7),
            &cut(&k, 0, 7),
            &cut(&v, 0, 7),
            &cut(&g, 0, 7),
            &cut(&beta, 0, 7),
            None,
            4,
        )
        .unwrap();
        let (b, s2) = chunked(
            &cut(&q, 7, 4),
            &cut(&k, 7, 4),
            &cut(&v, 7, 4),
            &cut(&g, 7, 4),
            &cut(&beta, 7, 4),
            Some(&s),
            4,
        )
        .unwrap();
        let both = Tensor::cat(&[&a, &b], 2).unwrap();
        assert!(max_diff(&whole, &both) < 1e-12);
        assert!(max_diff(&s_whole, &s2) < 1e-12);
    }
}
