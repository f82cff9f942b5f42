//! Per-layer recomputation ("gradient checkpointing") on candle's autograd.
//!
//! A training forward normally keeps every intermediate tensor of every layer until backward
//! (~258 MB per SmolLM2 layer at 8 × 256 tokens). With recomputation a layer is one custom op:
//! its forward runs the layer without building a graph and keeps only its input; its backward
//! runs the layer again with a graph, backpropagates the incoming gradient through it, and hands
//! out the gradients of the input and of the layer's weights.
//!
//! candle's custom ops only return gradients for their own (at most three) inputs, so the
//! weights' gradients travel through *carrier* ops: each weight `w` feeds a carrier whose value
//! is a zero scalar; the carriers are summed into a `tie` scalar, which is the layer op's second
//! input. Backward visits consumers before their inputs, so the layer op's backward runs first
//! (it leaves the weights' gradients in a shared stash), then each carrier's backward returns
//! its weight's gradient from the stash. The result is the gradient of the plain forward (same
//! ops, same order), with one layer's activations alive at a time.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Tensor, Var,
};

use super::block::{block_forward_routed, Block, Mask, Rows};
use super::config::ModelArgs;
use super::grad_sink::{self, Sink};
use super::layer;
use super::proj::Proj;
use crate::kernels::elem::Elem;
use crate::kernels::storage::{storage_of, tensor_of, Host};

type Stash = Arc<Mutex<Vec<Option<Tensor>>>>;

/// The weights of a layer that receive gradients (frozen base weights of a LoRA model do
/// not; its adapters do), in a fixed order.
fn weights(b: &Block) -> Vec<Tensor> {
    let mut w: Vec<Tensor> = b.plain_weights().into_iter().cloned().collect();
    for l in b.projs() {
        w.push(l.weight().clone());
        if let Some(bias) = l.bias() {
            w.push(bias.clone());
        }
        if let Some(a) = &l.lora {
            w.push(a.a.clone());
            w.push(a.b.clone());
        }
    }
    w.retain(Tensor::track_op);
    w
}

/// Runs `f` on [`super::layer`]'s view of layer `l` (weights borrowed from their storage) for
/// input `x` `[batch, seq, hidden]` with rotary tables and the attention mask: a bias
/// `[batch, 1, seq, seq]`, or packed sequences (batch 1).
#[allow(clippy::too_many_arguments)]
fn with_layer<T: Elem, R>(
    args: &ModelArgs,
    l: &Block,
    dims: (usize, usize),
    cos: &Tensor,
    sin: &Tensor,
    mask: &Mask,
    bf16: bool,
    f: impl FnOnce(&layer::Weights<T>, &layer::Dims, &layer::Context<T>) -> Result<R>,
) -> Result<R> {
    let (batch, seq) = dims;
    if let Mask::Bias(m) = mask {
        if m.dims() != [batch, 1, seq, seq] {
            candle_core::bail!(
                "fused decoder layer: attention bias {:?} is not [{batch}, 1, {seq}, {seq}]",
                m.dims()
            );
        }
    }
    // q, k, v, o, then the MLP's gate, up, down (expert by expert in a layer of experts).
    let lins = l.projs();
    // Host views: ln1, ln2, cos, sin, the projections' weights, per projection its bias and
    // adapter (A, B) where present, the q/k norms and the sandwich norms where present, the
    // router of a layer of experts, then the attention bias when there is one.
    let mut ts: Vec<&Tensor> = vec![&l.ln1, &l.ln2, cos, sin];
    for p in &lins {
        ts.push(p.weight());
    }
    for p in &lins {
        ts.extend(p.bias());
        if let Some(ad) = &p.lora {
            ts.extend([&ad.a, &ad.b]);
        }
    }
    let qk = &l.attention()?.qk_norm;
    if let Some((qn, kn)) = qk {
        ts.extend([qn, kn]);
    }
    if let Some((pa, pf)) = &l.sandwich {
        ts.extend([pa, pf]);
    }
    let experts = l.experts();
    if let Some(x) = experts {
        ts.push(&x.router);
    }
    if let Mask::Bias(m) = mask {
        ts.push(m);
    }
    let host = Host::new(&ts)?;
    // Biases and adapters follow ln1, ln2, cos, sin and the projections' weights.
    let mut next = 4 + lins.len();
    let lin = host_lins::<T>(&host, &lins, &mut next, bf16)?;
    let qk_norm = match qk {
        Some(_) => {
            next += 2;
            Some((host.slice::<T>(next - 2)?, host.slice::<T>(next - 1)?))
        }
        None => None,
    };
    let sandwich = match l.sandwich {
        Some(_) => {
            next += 2;
            Some((host.slice::<T>(next - 2)?, host.slice::<T>(next - 1)?))
        }
        None => None,
    };
    let mlp = match experts {
        None => layer::Ffn::Dense([lin[4], lin[5], lin[6]]),
        Some(x) => {
            next += 1;
            // The experts' gate, up, down each, then the shared expert's and its gate.
            let routed = &lin[4..4 + 3 * x.experts.len()];
            let shared = &lin[4 + 3 * x.experts.len()..];
            layer::Ffn::Experts(layer::Moe {
                router: host.slice::<T>(next - 1)?,
                train_router: x.router.track_op(),
                experts: routed.chunks(3).map(|g| [g[0], g[1], g[2]]).collect(),
                top_k: x.top_k,
                norm_topk_prob: x.norm_topk_prob,
                shared: match (&x.shared, shared) {
                    (None, []) => None,
                    (Some(_), &[g, u, d, gate]) => Some(([g, u, d], gate)),
                    _ => candle_core::bail!(
                        "fused decoder layer: {} projections after the experts",
                        shared.len()
                    ),
                },
            })
        }
    };
    let w = layer::Weights {
        ln1: host.slice::<T>(0)?,
        ln2: host.slice::<T>(1)?,
        qk_norm,
        sandwich,
        attn: [lin[0], lin[1], lin[2], lin[3]],
        mlp,
    };
    let d = layer_dims(args, l, dims, bf16);
    let cx = layer::Context {
        cos: host.slice::<T>(2)?,
        sin: host.slice::<T>(3)?,
        attn: match mask {
            Mask::Bias(_) => layer::Attn::Bias(host.slice::<T>(next)?),
            Mask::Packed(segs) => layer::Attn::Packed(segs),
        },
    };
    f(&w, &d, &cx)
}

/// The hand-written layer's view of projections `lins`: each one's weight (host slice `4 + i`)
/// and, from slice `next` on, its bias and adapter (A, B) where present; `next` moves past them.
fn host_lins<'a, T: Elem>(
    host: &'a Host,
    lins: &[&Proj],
    next: &mut usize,
    bf16: bool,
) -> Result<Vec<layer::Lin<'a, T>>> {
    let mut out = Vec::with_capacity(lins.len());
    for (i, p) in lins.iter().enumerate() {
        let mut take = || {
            *next += 1;
            host.slice::<T>(*next - 1)
        };
        let b = match p.bias() {
            Some(_) => Some(take()?),
            None => None,
        };
        let ad = match &p.lora {
            Some(ad) => Some(layer::Adapter {
                a: take()?,
                b: take()?,
                scale: T::from_f64(ad.scale),
                dropout: ad.dropout,
            }),
            None => None,
        };
        out.push(layer::Lin {
            w: host.slice::<T>(4 + i)?,
            b,
            ad,
            train_base: p.weight().track_op(),
            bf16,
        });
    }
    Ok(out)
}

/// The sizes of a call of layer `l` on `(batch, seq)` tokens (a layer of experts' MLP width is
/// `moe_intermediate_size`).
fn layer_dims(
    args: &ModelArgs,
    l: &Block,
    (batch, seq): (usize, usize),
    bf16: bool,
) -> layer::Dims {
    layer::Dims {
        batch,
        seq,
        hidden: args.hidden_size,
        heads: args.num_attention_heads,
        kv_heads: args.num_key_value_heads,
        head_dim: args.head_dim,
        inter: match (&args.moe, l.experts()) {
            (Some(m), Some(_)) => m.moe_intermediate_size,
            _ => args.intermediate_size,
        },
        eps: args.rms_norm_eps,
        norm_offset: args.arch.norm_offset(),
        gelu: args.arch.gemma(),
        attn_scale: args.attn_scale(),
        window: l.window,
        bf16,
        rotary_dim: args.rotary_dim(),
        output_gate: args.attn_output_gate,
    }
}

/// Layer `l` on `x` without a graph through the hand-written layer (CPU f32/f64; the caller
/// checks), the no-grad forward used for rollout log-probs and the reference.
pub(super) fn fused_forward(
    args: &ModelArgs,
    l: &Block,
    x: &Tensor,
    rope_mask: (&Tensor, &Tensor, &Mask),
    bf16: bool,
) -> Result<Tensor> {
    let (cos, sin, mask) = rope_mask;
    let (b, t, h) = x.dims3()?;
    let x = x.contiguous()?;
    fn go<T: Elem>(
        args: &ModelArgs,
        l: &Block,
        x: &Tensor,
        c: (&Tensor, &Tensor, &Mask),
        bf16: bool,
    ) -> Result<Vec<T>> {
        let (b, t, _) = x.dims3()?;
        let host = Host::new(&[x])?;
        let xs = host.slice::<T>(0)?;
        with_layer(args, l, (b, t), c.0, c.1, c.2, bf16, |w, d, cx| {
            layer::forward(w, d, xs, cx)
        })
    }
    let y = match x.dtype() {
        DType::F32 => Tensor::from_vec(
            go::<f32>(args, l, &x, (cos, sin, mask), bf16)?,
            (b, t, h),
            x.device(),
        )?,
        DType::F64 => Tensor::from_vec(
            go::<f64>(args, l, &x, (cos, sin, mask), bf16)?,
            (b, t, h),
            x.device(),
        )?,
        d => candle_core::bail!("fused decoder layer: unsupported dtype {d:?}"),
    };
    Ok(y)
}

/// The layer as one op on `(x, tie)`.
struct Layer {
    args: ModelArgs,
    block: Block,
    cos: Tensor,
    sin: Tensor,
    mask: Mask,
    /// Where the sequences lie (read by a Gated DeltaNet layer).
    rows: Rows,
    stash: Stash,
    /// The sinks of the weights that had one when the forward ran, in the stash's order (the
    /// hand-written backward sums their gradients there).
    sinks: Vec<Option<Arc<Sink>>>,
    /// Without recomputation: the forward's activations (`layer::Acts<T>`), kept for backward.
    keep: bool,
    kept: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// The hand-written layer (f32/f64) rather than the composition.
    fused: bool,
    /// Its matrix products with bf16 operands (f32 layers on CPUs with a bf16 kernel).
    bf16: bool,
    /// The number of router logits each token's output row carries after its hidden state (a
    /// layer of experts whose logits the loss reads: `[batch, seq, hidden + experts]`); 0: none.
    router: usize,
}

/// Rows of `hidden` values and rows of `extra` values laid side by side, `[rows, hidden +
/// extra]`.
fn side_by_side<T: Copy>(y: &[T], hidden: usize, z: &[T], extra: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(y.len() + z.len());
    for (a, b) in y.chunks(hidden).zip(z.chunks(extra)) {
        out.extend_from_slice(a);
        out.extend_from_slice(b);
    }
    out
}

impl Layer {
    /// The hand-written forward; keeps the activations when recomputation is off; with
    /// `router`, each output row carries the token's router logits after its hidden state.
    fn fused_fwd<T: Elem>(&self, xs: &[T], (b, t): (usize, usize)) -> Result<Vec<T>> {
        with_layer(
            &self.args,
            &self.block,
            (b, t),
            &self.cos,
            &self.sin,
            &self.mask,
            self.bf16,
            |w, d, cx| {
                if !self.keep && self.router == 0 {
                    return layer::forward(w, d, xs, cx);
                }
                let (mut y, acts) = layer::forward_keep(w, d, xs, cx)?;
                if self.router > 0 {
                    let Some(logits) = layer::router_logits(&acts) else {
                        candle_core::bail!("fused decoder layer: router logits of a dense layer");
                    };
                    y = side_by_side(&y, d.hidden, logits, self.router);
                }
                if self.keep {
                    *self.kept.lock().map_err(|_| {
                        candle_core::Error::Msg("kept activations poisoned".into())
                    })? = Some(Box::new(acts));
                }
                Ok(y)
            },
        )
    }

    /// The composition without a graph (or with one from `x` when it is a variable), with the
    /// router logits side by side when the op hands them out: `[b, t, hidden (+ experts)]`.
    fn composed(&self, block: &Block, x: &Tensor) -> Result<Tensor> {
        let mut router = Vec::new();
        let y = block_forward_routed(
            &self.args,
            block,
            x,
            &self.cos,
            &self.sin,
            &self.mask.layer_keys(&self.block, x.dtype(), x.device())?,
            &self.rows,
            None,
            (self.router > 0).then_some(&mut router),
        )?;
        match router.pop() {
            Some(logits) if self.router > 0 => {
                let (b, t, _) = y.dims3()?;
                Tensor::cat(&[&y, &logits.reshape((b, t, self.router))?], 2)
            }
            _ => Ok(y),
        }
    }

    /// The hand-written backward: the input's gradient is returned, the weights' go to the stash
    /// in [`weights`]' order.
    fn fused_bwd<T: Elem>(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let x = x.contiguous()?;
        // The hidden states' gradient, and the router logits' where the op hands them out.
        let (grad, glogits) = match self.router {
            0 => (grad.contiguous()?, None),
            e => (
                grad.narrow(2, 0, h)?.contiguous()?,
                Some(grad.narrow(2, h, e)?.contiguous()?),
            ),
        };
        let mut ts = vec![&x, &grad];
        ts.extend(glogits.as_ref());
        let host = Host::new(&ts)?;
        let (xs, gs) = (host.slice::<T>(0)?, host.slice::<T>(1)?);
        let gl = match glogits {
            Some(_) => Some(host.slice::<T>(2)?),
            None => None,
        };
        let kept = self
            .kept
            .lock()
            .map_err(|_| candle_core::Error::Msg("kept activations poisoned".into()))?
            .take()
            .and_then(|a| a.downcast::<layer::Acts<T>>().ok())
            .map(|a| *a);
        let (gx, g) = with_layer(
            &self.args,
            &self.block,
            (b, t),
            &self.cos,
            &self.sin,
            &self.mask,
            self.bf16,
            |w, d, cx| layer::backward(w, d, xs, cx, gs, kept, gl),
        )?;
        // Every weight of the layer (adapters included) with its gradient, in `weights`' order;
        // `weights` lists only those that train, and so does the stash.
        let mut all = vec![
            (self.block.ln1.clone(), Some(g.ln1)),
            (self.block.ln2.clone(), Some(g.ln2)),
        ];
        if let Some((qn, kn)) = &self.block.attention()?.qk_norm {
            let (gq, gk) = g.qk_norm.map_or((None, None), |(q, k)| (Some(q), Some(k)));
            all.extend([(qn.clone(), gq), (kn.clone(), gk)]);
        }
        if let Some((pa, pf)) = &self.block.sandwich {
            let (ga, gf) = g.sandwich.map_or((None, None), |(a, f)| (Some(a), Some(f)));
            all.extend([(pa.clone(), ga), (pf.clone(), gf)]);
        }
        if let Some(x) = self.block.experts() {
            all.push((x.router.clone(), g.router));
        }
        for (p, lg) in self.block.projs().into_iter().zip(g.lin) {
            all.push((p.weight().clone(), lg.w));
            if let Some(t) = p.bias() {
                all.push((t.clone(), lg.b));
            }
            if let Some(ad) = &p.lora {
                all.push((ad.a.clone(), lg.a));
                all.push((ad.b.clone(), lg.bb));
            }
        }
        all.retain(|(w, _)| w.track_op());
        let mut stash = self
            .stash
            .lock()
            .map_err(|_| candle_core::Error::Msg("recompute stash poisoned".into()))?;
        if all.len() != stash.len() {
            candle_core::bail!(
                "fused decoder layer: {} gradients for {} weights",
                all.len(),
                stash.len()
            );
        }
        // `None`: the weight took no part (an expert no token was routed to). A weight with an
        // open sink (`grad_sink`) sums its gradient there and its carrier hands candle none
        // (here and in the composition's backward below).
        for ((slot, (w, gv)), sink) in stash.iter_mut().zip(all).zip(&self.sinks) {
            *slot = match (gv, grad_sink::open(sink)) {
                (Some(gv), Some(sink)) => {
                    sink.add(gv)?;
                    None
                }
                (gv, _) => gv
                    .map(|gv| Tensor::from_vec(gv, w.shape(), w.device()))
                    .transpose()?,
            };
        }
        Tensor::from_vec(gx, (b, t, h), x.device())
    }
}

impl CustomOp2 for Layer {
    fn name(&self) -> &'static str {
        "recomputed-decoder-layer"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if self.fused {
            // The input read in place and the output handed over as storage: no copies.
            let (b, t, _) = l1.shape().dims3()?;
            let Some((lo, hi)) = l1.contiguous_offsets() else {
                candle_core::bail!("recomputed layer: the input must be contiguous");
            };
            let y = match s1 {
                CpuStorage::F32(v) => CpuStorage::F32(self.fused_fwd(&v[lo..hi], (b, t))?),
                CpuStorage::F64(v) => CpuStorage::F64(self.fused_fwd(&v[lo..hi], (b, t))?),
                _ => candle_core::bail!("fused decoder layer: unsupported dtype {:?}", s1.dtype()),
            };
            let (_, _, h) = l1.shape().dims3()?;
            return Ok((y, (b, t, h + self.router).into()));
        }
        let x = tensor_of(s1, l1)?;
        let y = self.composed(&self.block.detached(), &x)?;
        Ok((storage_of(&y)?, y.shape().clone()))
    }

    /// On a GPU the layer runs as the composition (no hand-written CUDA layer): the input is
    /// copied into a tensor, the layer run without a graph, the output copied out.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::cuda::{storage_of, tensor_of};
        let x = tensor_of(s1, l1)?;
        let y = self.composed(&self.block.detached(), &x)?;
        Ok((storage_of(&y)?, y.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        tie: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if self.fused {
            let gx = match x.dtype() {
                DType::F32 => self.fused_bwd::<f32>(x, grad)?,
                _ => self.fused_bwd::<f64>(x, grad)?,
            };
            return Ok((Some(gx), Some(tie.zeros_like()?)));
        }
        // The layer again, this time with a graph from a fresh leaf input to the weights.
        let input = Var::from_tensor(&x.detach())?;
        let y = self.composed(&self.block, input.as_tensor())?;
        // d(Σ y·g)/dθ = gᵀ ∂y/∂θ: the incoming gradient pushed through the layer.
        let mut g = (y * grad.detach())?.sum_all()?.backward()?;
        let mut stash = self
            .stash
            .lock()
            .map_err(|_| candle_core::Error::Msg("recompute stash poisoned".into()))?;
        let ws = weights(&self.block);
        for ((slot, w), sink) in stash.iter_mut().zip(ws).zip(&self.sinks) {
            *slot = match (g.remove(&w), grad_sink::open(sink)) {
                (Some(gw), Some(sink)) => {
                    sink.add_tensor(&gw)?;
                    None
                }
                (gw, _) => gw,
            };
        }
        Ok((g.remove(input.as_tensor()), Some(tie.zeros_like()?)))
    }
}

/// Carries weight `index`'s gradient from the stash to the weight.
struct Carrier {
    index: usize,
    stash: Stash,
}

impl CustomOp1 for Carrier {
    fn name(&self) -> &'static str {
        "recomputed-layer-weight"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        let zero = storage_of(&Tensor::zeros((), s.dtype(), &Device::Cpu)?)?;
        Ok((zero, Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let zero = crate::kernels::cuda::zero_scalar(s, s.dtype())?;
        Ok((zero, Shape::from(())))
    }

    /// The weight's gradient, or none where the layer's backward left none (a weight that took
    /// no part, such as an expert no token was routed to: as with plain autograd, the
    /// optimizer then skips it).
    fn bwd(&self, _w: &Tensor, _res: &Tensor, _grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(self
            .stash
            .lock()
            .map_err(|_| candle_core::Error::Msg("recompute stash poisoned".into()))?
            .get_mut(self.index)
            .and_then(Option::take))
    }
}

/// Layer `l` on `x` `[batch, seq, hidden]` as one op (CPU or CUDA tensors): with `recompute` its
/// backward runs the layer again; without, the hand-written layer (f32/f64) keeps its
/// activations from the forward. (The tests' form of [`block_routed`].)
#[cfg(test)]
pub(super) fn block(
    args: &ModelArgs,
    l: &Block,
    x: &Tensor,
    rope_mask: (&Tensor, &Tensor, &Mask),
    recompute: bool,
    fused: bool,
    bf16: bool,
) -> Result<Tensor> {
    let flags = (recompute, fused, bf16);
    let rows = Rows::Padded(None);
    Ok(block_routed(args, l, x, rope_mask, &rows, flags, false)?.0)
}

/// Layer `l` on `x` `[batch, seq, hidden]` as one op (CPU or CUDA tensors): with `recompute` its
/// backward runs the layer again; without, the hand-written layer (f32/f64) keeps its
/// activations from the forward. With `router`, a layer of experts' router logits `[batch·seq,
/// experts]` (with their gradient path) come beside the output.
pub(super) fn block_routed(
    args: &ModelArgs,
    l: &Block,
    x: &Tensor,
    rope_mask: (&Tensor, &Tensor, &Mask),
    rows: &Rows,
    (recompute, fused, bf16): (bool, bool, bool),
    router: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let router = match l.experts() {
        Some(e) if router => e.experts.len(),
        _ => 0,
    };
    let (cos, sin, mask) = rope_mask;
    let ws = weights(l);
    let stash: Stash = Arc::new(Mutex::new(vec![None; ws.len()]));
    let mut tie: Option<Tensor> = None;
    for (index, w) in ws.iter().enumerate() {
        let c = w.apply_op1(Carrier {
            index,
            stash: stash.clone(),
        })?;
        tie = Some(match tie {
            Some(t) => (t + c)?,
            None => c,
        });
    }
    let tie = match tie {
        Some(t) => t,
        None => Tensor::zeros((), x.dtype(), x.device())?,
    };
    let out = x.contiguous()?.apply_op2(
        &tie,
        Layer {
            args: args.clone(),
            block: l.clone(),
            cos: cos.detach(),
            sin: sin.detach(),
            mask: mask.detach(),
            rows: rows.detach(),
            stash,
            sinks: ws.iter().map(grad_sink::sink_of).collect(),
            keep: !recompute,
            kept: Mutex::new(None),
            fused: fused && crate::kernels::supported(x.device(), x.dtype()),
            bf16,
            router,
        },
    )?;
    if router == 0 {
        return Ok((out, None));
    }
    let (b, t, h) = x.dims3()?;
    let y = out.narrow(2, 0, h)?.contiguous()?;
    let logits = out.narrow(2, h, router)?.reshape((b * t, router))?;
    Ok((y, Some(logits)))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::{block, fused_forward, weights, Mask};
    use crate::model::block::block_forward;
    use crate::model::{Arch, ModelArgs};

    /// Gradients of a padded batch's summed log-probs and entropies with and without
    /// recomputation, for the hand-written layers and for the composition: every weight's
    /// gradient agrees to 1e-6 relative (f32 and f64), and with recomputation every weight still
    /// receives a non-zero gradient.
    #[test]
    fn recomputation_gives_the_same_gradients() {
        for (arch, dtype) in [
            (Arch::Llama, DType::F64),
            (Arch::Qwen2, DType::F64),
            (Arch::Qwen3, DType::F64),
            (Arch::Gemma3, DType::F64),
            (Arch::Qwen3Moe, DType::F64),
            (Arch::Llama, DType::F32),
            (Arch::Qwen3Moe, DType::F32),
        ] {
            let args = ModelArgs::tiny(arch, 30);
            let (vm, mut m) = crate::testing::tiny_model(&args, dtype, 0.3);
            let dev = Device::Cpu;
            // Row 1 is left-padded by 2.
            let ids = Tensor::new(&[[3u32, 7, 1, 9, 4, 2], [0, 0, 5, 6, 8, 11]], &dev).unwrap();
            let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]], &dev).unwrap();
            let mask = Tensor::new(&[[1u32, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], &dev).unwrap();
            let grads = |m: &crate::model::CausalLm| {
                let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
                let (lp, ent) = m.token_logprobs(&h, &ids, 4, true).unwrap();
                named_grads(&vm, &lp, &ent.unwrap())
            };
            for composed in [false, true] {
                m.set_exec(crate::model::Exec {
                    composed,
                    recompute: false,
                    ..m.exec()
                });
                let plain = grads(&m);
                m.set_exec(crate::model::Exec {
                    recompute: true,
                    ..m.exec()
                });
                let again = grads(&m);
                for ((name, a), (_, b)) in plain.iter().zip(&again) {
                    let scale = a.iter().fold(0f64, |s, x| s.max(x.abs()));
                    assert!(scale > 0.0 || unrouted(name), "{name}: zero gradient");
                    for (x, y) in a.iter().zip(b) {
                        assert!(
                            (x - y).abs() <= 1e-6 * scale,
                            "{arch:?} {dtype:?} composed {composed} {name}: {x} vs {y}"
                        );
                    }
                }
            }
        }
    }

    /// Inputs for one layer call: x `[2, 6, hidden]`, rotary tables for row 0 at positions
    /// 0..6 and row 1 left-padded by 2, the causal + padding bias (`masked` where a key is
    /// hidden), and an output gradient.
    fn layer_inputs(
        args: &ModelArgs,
        dtype: DType,
        masked: f64,
    ) -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
        let dev = Device::Cpu;
        // Tables over the values RoPE turns (a quarter of each head on Qwen3.5).
        let (b, t, rd) = (2usize, 6usize, args.rotary_dim());
        let pos = [[0u32, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]];
        let real = [[1u8, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]];
        let inv: Vec<f64> = (0..rd / 2)
            .map(|i| 1.0 / args.rope_theta.powf(2.0 * i as f64 / rd as f64))
            .collect();
        let (mut cos, mut sin, mut bias) = (Vec::new(), Vec::new(), Vec::new());
        for (pr, kr) in pos.iter().zip(&real) {
            for (i, &p) in pr.iter().enumerate() {
                for _ in 0..2 {
                    for f in &inv {
                        cos.push((p as f64 * f).cos());
                        sin.push((p as f64 * f).sin());
                    }
                }
                for (j, &k) in kr.iter().enumerate() {
                    bias.push(if j > i || k == 0 { masked } else { 0.0 });
                }
            }
        }
        let wave = |n: usize, k: f64| -> Vec<f64> {
            (0..n)
                .map(|i| ((i as f64 * k).sin() * 1.3 + 0.1).tanh())
                .collect()
        };
        let h = args.hidden_size;
        let mk = |v: Vec<f64>, shape: &[usize]| {
            Tensor::from_vec(v, shape, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        (
            mk(wave(b * t * h, 0.37), &[b, t, h]),
            mk(cos, &[b, 1, t, rd]),
            mk(sin, &[b, 1, t, rd]),
            mk(bias, &[b, 1, t, t]),
            mk(wave(b * t * h, 1.91), &[b, t, h]),
        )
    }

    /// Whether a weight may get a zero gradient from a handful of tokens: an expert's
    /// projection (no token may have been routed to it).
    fn unrouted(name: &str) -> bool {
        name.contains(".experts.")
    }

    /// Weight `name`'s gradient; an expert no token was routed to has none (zeros here), any
    /// other weight without one fails the test.
    fn grad_or_zero(g: &candle_core::backprop::GradStore, name: &str, var: &Var) -> Vec<f64> {
        match g.get(var.as_tensor()) {
            Some(t) => to_f64(t),
            None if unrouted(name) => vec![0.0; var.elem_count()],
            None => panic!("{name}: no gradient"),
        }
    }

    /// Every weight's gradient (by name, sorted) of the summed log-probs `lp` plus the summed
    /// entropies `ent`.
    fn named_grads(vm: &candle_nn::VarMap, lp: &Tensor, ent: &Tensor) -> Vec<(String, Vec<f64>)> {
        let loss = (lp.sum_all().unwrap() + ent.sum_all().unwrap()).unwrap();
        let g = loss.backward().unwrap();
        let mut grads: Vec<(String, Vec<f64>)> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(name, var)| (name.clone(), grad_or_zero(&g, name, var)))
            .collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        grads
    }

    fn to_f64(t: &Tensor) -> Vec<f64> {
        t.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// The first attention layer of `args` (layer 1 of the tiny hybrids, 0 elsewhere).
    fn first_attention(args: &ModelArgs) -> usize {
        (0..args.num_hidden_layers)
            .find(|&i| !args.is_linear(i))
            .expect("an attention layer")
    }

    /// The hand-written layer against candle's autograd through `block_forward` (the op
    /// composition it replaces), f32, every family (Qwen2's q/k/v bias, Qwen3's q/k norms,
    /// Gemma's sandwich norms, Qwen3-MoE's layer of experts: 8 experts, top 2, renormalised;
    /// the full-attention layer of Qwen3.5 and Qwen3-Next: output gate, partial rotary
    /// embeddings, `1 + w` norms), GQA, a left-padded row: outputs within 1e-5 and every
    /// gradient within 1e-4 of the tensor's largest value.
    #[test]
    fn the_hand_written_layer_equals_the_composition() {
        let hybrids = [Arch::Qwen3_5, Arch::Qwen3Next, Arch::Qwen3_5Moe];
        for arch in crate::testing::DECODER_ARCHS.into_iter().chain(hybrids) {
            let args = ModelArgs::tiny(arch, 30);
            let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
            let l = &m.blocks()[first_attention(&args)];
            assert!(super::super::transformer::hand_written(l), "{arch:?}");
            let (x, cos, sin, mask, g) = layer_inputs(&args, DType::F32, -1e9);
            // Reference: the composition with a graph.
            let xv = Var::from_tensor(&x).unwrap();
            let y_ref = block_forward(&args, l, xv.as_tensor(), &cos, &sin, &mask, None).unwrap();
            let grads = (&y_ref * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            // An expert no token was routed to gets no gradient from the composition.
            let mut want = vec![("x".to_string(), to_f64(grads.get(xv.as_tensor()).unwrap()))];
            for (k, w) in weights(l).iter().enumerate() {
                let g = grads
                    .get(w)
                    .map_or_else(|| vec![0.0; w.elem_count()], to_f64);
                want.push((format!("weight {k}"), g));
            }
            // The experts' projections come last, then a shared expert's four.
            let ws = weights(l).len();
            let shared = l
                .experts()
                .map_or(0, |x| 4 * usize::from(x.shared.is_some()));
            let experts_to = ws - shared;
            let experts_from = experts_to - l.experts().map_or(0, |x| 3 * x.experts.len());
            // Ours: the recomputing op through candle's backward (carriers included).
            let xv2 = Var::from_tensor(&x).unwrap();
            let y = block(
                &args,
                l,
                xv2.as_tensor(),
                (&cos, &sin, &Mask::Bias(mask.clone())),
                true,
                true,
                false,
            )
            .unwrap();
            let g2 = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let mut got = vec![("x".to_string(), to_f64(g2.get(xv2.as_tensor()).unwrap()))];
            for (k, w) in weights(l).iter().enumerate() {
                // Both paths leave a weight that took no part without a gradient.
                let (r, o) = (grads.get(w), g2.get(w));
                assert_eq!(
                    r.is_some(),
                    o.is_some(),
                    "{arch:?} weight {k}: gradient presence"
                );
                let g = o.map_or_else(|| vec![0.0; w.elem_count()], to_f64);
                got.push((format!("weight {k}"), g));
            }
            let (a, b) = (to_f64(&y_ref), to_f64(&y));
            let scale = a.iter().fold(0f64, |s, v| s.max(v.abs()));
            for (u, v) in a.iter().zip(&b) {
                assert!((u - v).abs() <= 1e-5 * scale, "{arch:?} output: {u} vs {v}");
            }
            let mut routed = 0;
            for (i, ((name, a), (_, b))) in want.iter().zip(&got).enumerate() {
                let scale = a.iter().fold(0f64, |s, v| s.max(v.abs()));
                // `want` starts with x: weight k is entry k + 1.
                let expert = i > experts_from && i <= experts_to;
                assert!(scale > 0.0 || expert, "{arch:?} {name}: zero gradient");
                routed += usize::from(expert && scale > 0.0);
                for (u, v) in a.iter().zip(b) {
                    assert!((u - v).abs() <= 1e-4 * scale, "{arch:?} {name}: {u} vs {v}");
                }
            }
            // 12 tokens, 2 experts each: most of the 8 experts see some.
            assert!(
                experts_to == experts_from || routed >= 12,
                "{arch:?}: {routed} expert weights"
            );
        }
    }

    /// bf16 products (verl's mixed precision, `kernels::bf16`): output and gradients within bf16's rounding
    /// of the f32 layer's (relative error of the whole tensor ≤ 5e-2: an operand rounded to bf16
    /// is off by ≤ 2⁻⁹ of itself, so a product by ≤ 2·2⁻⁹ ≈ 4e-3, and a weight's gradient comes
    /// through up to a dozen products of forward and backward; a product in a wrong layout would
    /// be off by ~100 %), not
    /// equal to them (the bf16 path ran), and recomputation on and off give the same bits.
    #[test]
    fn bf16_products_stay_within_bf16_rounding_of_f32() {
        if !crate::kernels::bf16::available() {
            eprintln!("skipped: MAIN_PPO_BF16_KERNEL=none");
            return;
        }
        let args = ModelArgs::tiny(Arch::Qwen2, 30);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let l = &m.blocks()[0];
        let (x, cos, sin, mask, g) = layer_inputs(&args, DType::F32, -1e9);
        let run = |recompute: bool, bf16: bool| {
            let xv = Var::from_tensor(&x).unwrap();
            let bias = Mask::Bias(mask.clone());
            let rm = (&cos, &sin, &bias);
            let y = block(&args, l, xv.as_tensor(), rm, recompute, true, bf16).unwrap();
            let gr = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let mut out = vec![to_f64(&y), to_f64(gr.get(xv.as_tensor()).unwrap())];
            out.extend(weights(l).iter().map(|w| to_f64(gr.get(w).unwrap())));
            out
        };
        let (f32s, bf) = (run(true, false), run(true, true));
        assert_eq!(
            bf,
            run(false, true),
            "recomputation changed the bf16 results"
        );
        let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
        let mut any_diff = false;
        for (k, (a, b)) in f32s.iter().zip(&bf).enumerate() {
            let d: Vec<f64> = a.iter().zip(b).map(|(u, v)| u - v).collect();
            let rel = norm(&d) / norm(a);
            assert!(rel <= 5e-2, "tensor {k}: bf16 is {rel:.3e} away from f32");
            any_diff |= rel > 0.0;
        }
        assert!(
            any_diff,
            "bf16 products gave the f32 bits: the bf16 path did not run"
        );
    }

    /// The hand-written backward against central finite differences of `Σ y·g` in f64, for
    /// every input value and a spread of entries of every weight: Qwen2 (biases included) and
    /// Qwen3-MoE (q/k norms, the router and every expert; the routing stays put under the
    /// small steps, so the loss is smooth there).
    #[test]
    fn the_hand_written_backward_matches_finite_differences() {
        for (arch, tensors) in [
            (Arch::Qwen2, 12),
            (Arch::Qwen3Moe, 33),
            (Arch::Qwen3_5, 11),
            (Arch::Qwen3_5Moe, 37),
        ] {
            finite_differences(arch, tensors);
        }
    }

    /// [`the_hand_written_backward_matches_finite_differences`] for one family whose first
    /// attention layer has `tensors` weights.
    fn finite_differences(arch: Arch, tensors: usize) {
        let args = ModelArgs::tiny(arch, 30);
        let (vm, m) = crate::testing::tiny_model(&args, DType::F64, 0.3);
        let li = first_attention(&args);
        let l = m.blocks()[li].clone();
        // A mask value of −30 (the bias is an ordinary additive input to the layer, so the check
        // holds for any value): near −1e9 a score's change would be lost to the spacing of f64
        // numbers there, and a fully masked (padding) query row would blur the differences.
        let (x, cos, sin, mask, g) = layer_inputs(&args, DType::F64, -30.0);
        let loss = |x: &Tensor| -> f64 {
            let y = fused_forward(&args, &l, x, (&cos, &sin, &Mask::Bias(mask.clone())), false)
                .unwrap();
            (y * &g).unwrap().sum_all().unwrap().to_scalar().unwrap()
        };
        let xv = Var::from_tensor(&x).unwrap();
        let y = block(
            &args,
            &l,
            xv.as_tensor(),
            (&cos, &sin, &Mask::Bias(mask.clone())),
            true,
            true,
            false,
        )
        .unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let eps = 1e-6;
        let check = |name: &str, analytic: f64, plus: f64, minus: f64| {
            let fd = (plus - minus) / (2.0 * eps);
            assert!(
                (analytic - fd).abs() <= 1e-6 * (1.0 + fd.abs()),
                "{name}: analytic {analytic} vs finite difference {fd}"
            );
        };
        let gx = to_f64(grads.get(xv.as_tensor()).unwrap());
        let xs = to_f64(&x);
        for k in 0..xs.len() {
            let bump = |d: f64| {
                let mut v = xs.clone();
                v[k] += d;
                loss(&Tensor::from_vec(v, x.shape(), x.device()).unwrap())
            };
            check(&format!("x[{k}]"), gx[k], bump(eps), bump(-eps));
        }
        let vars = vm.data().lock().unwrap().clone();
        let mut checked = 0;
        let prefix = format!("layers.{li}.");
        for (name, var) in vars.iter().filter(|(n, _)| n.contains(&prefix)) {
            let ga = grad_or_zero(&grads, name, var);
            let w0 = to_f64(var.as_tensor());
            for k in (0..w0.len()).step_by(w0.len().div_ceil(7)) {
                let bump = |d: f64| {
                    let mut v = w0.clone();
                    v[k] += d;
                    var.set(&Tensor::from_vec(v, var.shape(), var.device()).unwrap())
                        .unwrap();
                    let r = loss(&x);
                    var.set(&Tensor::from_vec(w0.clone(), var.shape(), var.device()).unwrap())
                        .unwrap();
                    r
                };
                check(&format!("{name}[{k}]"), ga[k], bump(eps), bump(-eps));
            }
            checked += 1;
        }
        assert_eq!(checked, tensors, "{arch:?}: the weights of layer 0");
    }

    /// Hidden states `h` `[positions, hidden]` as f64, and every weight's gradient (by name,
    /// sorted) of the summed log-probs of `targets` `[1, positions]` plus the entropies.
    fn states_and_grads(
        vm: &candle_nn::VarMap,
        m: &crate::model::CausalLm,
        h: &Tensor,
        targets: &Tensor,
    ) -> StatesAndGrads {
        let (lp, ent) = m
            .token_logprobs(&h.unsqueeze(0).unwrap(), targets, 4, true)
            .unwrap();
        (to_f64(h), to_f64(&lp), named_grads(vm, &lp, &ent.unwrap()))
    }

    /// Hidden states, the targets' log-probs, and each weight's gradient by name.
    type StatesAndGrads = (Vec<f64>, Vec<f64>, Vec<(String, Vec<f64>)>);

    /// The largest `|a − b|` as a fraction of `b`'s largest magnitude (`b` all zero: any
    /// difference is enormous).
    fn worst(a: &[f64], b: &[f64]) -> f64 {
        let (d, scale) = crate::testing::worst_of(a, b);
        d / scale
    }

    /// [`states_and_grads`] of a layout under test (`got`) against the reference layout's
    /// (`want`): hidden states and log-probs within `vtol` and each gradient within `gtol` of
    /// its tensor's largest value; every gradient non-zero except an expert no token reached.
    /// Prints the worst fractions found.
    fn assert_agree(
        what: &str,
        got: StatesAndGrads,
        want: StatesAndGrads,
        (vtol, gtol): (f64, f64),
    ) {
        let hidden = worst(&got.0, &want.0);
        assert!(
            hidden <= vtol,
            "{what}: hidden states differ by {hidden:e} of the largest"
        );
        let lp = worst(&got.1, &want.1);
        assert!(
            lp <= vtol,
            "{what}: log-probs differ by {lp:e} of the largest"
        );
        let mut grads = 0f64;
        for ((name, a), (_, b)) in got.2.iter().zip(&want.2) {
            assert!(
                b.iter().any(|&x| x != 0.0) || unrouted(name),
                "{what} {name}: zero gradient"
            );
            let g = worst(a, b);
            assert!(
                g <= gtol,
                "{what} {name}: gradient differs by {g:e} of its largest"
            );
            grads = grads.max(g);
        }
        println!("{what}: worst hidden {hidden:.1e}, log-prob {lp:.1e}, gradient {grads:.1e}");
    }

    /// Sequences packed end to end (`forward_hidden_packed`) against the same sequences in a
    /// left-padded batch (`forward_hidden`, the reference): hidden states at every real token,
    /// and every weight's gradient of a loss over those tokens (log-probs and entropies), for
    /// the hand-written layer with and without recomputation and for the composition (which
    /// masks with a block-diagonal bias); f64 to 1e-9 relative, f32 to 1e-5 (values) and 1e-4
    /// (gradients), bf16 products within bf16 rounding (2e-2).
    #[test]
    fn packed_sequences_equal_the_padded_batch() {
        let seqs: [&[u32]; 3] = [&[3, 7, 1, 9, 4, 2], &[5, 6, 8, 11], &[12, 2, 9, 9, 1]];
        let t = 6;
        let dev = Device::Cpu;
        // Padded: each row left-padded to 6; packed: end to end, 15 tokens.
        let (mut ids, mut pos, mut mask, mut real) = (vec![], vec![], vec![], vec![]);
        let (mut pids, mut ppos, mut segs) = (vec![], vec![], vec![]);
        for (r, s) in seqs.iter().enumerate() {
            let lead = t - s.len();
            for k in 0..t {
                ids.push(if k < lead { 0 } else { s[k - lead] });
                pos.push(k.saturating_sub(lead) as u32);
                mask.push(u32::from(k >= lead));
                if k >= lead {
                    real.push((r * t + k) as u32);
                }
            }
            segs.push((pids.len(), s.len()));
            pids.extend_from_slice(s);
            ppos.extend(0..s.len() as u32);
        }
        let n = pids.len();
        let ids = Tensor::from_vec(ids, (3, t), &dev).unwrap();
        let pos = Tensor::from_vec(pos, (3, t), &dev).unwrap();
        let mask = Tensor::from_vec(mask, (3, t), &dev).unwrap();
        let real = Tensor::new(real.as_slice(), &dev).unwrap();
        let targets = Tensor::from_vec(
            pids.iter().map(|&i| (i * 7 + 3) % 30).collect::<Vec<u32>>(),
            (1, n),
            &dev,
        )
        .unwrap();
        let pids = Tensor::new(pids.as_slice(), &dev).unwrap();
        let ppos = Tensor::new(ppos.as_slice(), &dev).unwrap();
        for (arch, dtype, bf16) in [
            (Arch::Llama, DType::F64, false),
            (Arch::Qwen2, DType::F64, false),
            (Arch::Qwen3, DType::F64, false),
            (Arch::Qwen3, DType::F32, true),
            (Arch::Gemma3, DType::F64, false),
            (Arch::Gemma3, DType::F32, true),
            (Arch::Qwen3Moe, DType::F64, false),
            (Arch::Qwen3Moe, DType::F32, true),
            (Arch::Llama, DType::F32, false),
            (Arch::Llama, DType::F32, true),
            // The hybrids: Gated DeltaNet layers read the packed sequences as they are.
            (Arch::Qwen3_5, DType::F64, false),
            (Arch::Qwen3_5, DType::F32, true),
            (Arch::Qwen3Next, DType::F64, false),
            (Arch::Qwen3_5Moe, DType::F64, false),
        ] {
            let args = ModelArgs::tiny(arch, 30);
            let (vm, mut m) = crate::testing::tiny_model(&args, dtype, 0.3);
            m.set_exec(crate::model::Exec { bf16, ..m.exec() });
            let (vtol, gtol) = match (dtype, bf16) {
                (DType::F64, _) => (1e-9, 1e-9),
                (_, false) => (1e-5, 1e-4),
                _ => (2e-2, 2e-2),
            };
            // [n, h] at the real tokens in packed order, and the weights' gradients of a loss.
            let run = |m: &crate::model::CausalLm, packed: bool| {
                let h = if packed {
                    m.forward_hidden_packed(&pids, &ppos, &segs).unwrap()
                } else {
                    let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
                    let hid = h.dim(2).unwrap();
                    h.reshape((3 * t, hid))
                        .unwrap()
                        .index_select(&real, 0)
                        .unwrap()
                };
                states_and_grads(&vm, m, &h, &targets)
            };
            for (composed, recompute) in [(false, false), (false, true), (true, true)] {
                m.set_exec(crate::model::Exec {
                    composed,
                    recompute,
                    ..m.exec()
                });
                let what = format!(
                    "{arch:?} {dtype:?} bf16 {bf16} composed {composed} recompute {recompute}"
                );
                assert_agree(&what, run(&m, true), run(&m, false), (vtol, gtol));
            }
        }
    }

    /// Packed sequences that do not lay end to end are refused with the rule.
    #[test]
    fn packed_sequences_must_cover_the_tokens_in_order() {
        let args = ModelArgs::tiny(Arch::Llama, 30);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        let dev = Device::Cpu;
        let ids = Tensor::new(&[1u32, 2, 3, 4], &dev).unwrap();
        let pos = Tensor::new(&[0u32, 1, 0, 1], &dev).unwrap();
        for (segs, rule) in [
            (vec![(0, 2), (3, 1)], "end to end"),
            (vec![(0, 2), (2, 0), (2, 2)], "non-empty"),
            (vec![(0, 2)], "cover 2 of 4"),
        ] {
            let e = m
                .forward_hidden_packed(&ids, &pos, &segs)
                .unwrap_err()
                .to_string();
            assert!(e.contains(rule), "{segs:?}: {e}");
        }
    }

    /// Two groups (prompt A with three responses, prompt B with one) and a lone sequence, laid
    /// out grouped (each prompt once, each response continuing it) and alone (each response
    /// after its own copy of the prompt), with each layout's response-predicting tokens.
    struct GroupedLayouts {
        grouped: Packing,
        alone: Packing,
        targets: Vec<u32>,
    }

    /// Packed ids and positions, the sequences, which one each continues (grouped layout)
    /// and the tokens that predict response tokens.
    #[derive(Default)]
    struct Packing {
        ids: Vec<u32>,
        pos: Vec<u32>,
        segs: Vec<(usize, usize)>,
        cont: Vec<Option<usize>>,
        at: Vec<u32>,
    }

    fn grouped_layouts() -> GroupedLayouts {
        let a: &[u32] = &[3, 7, 1, 9];
        let b: &[u32] = &[5, 6, 8];
        let rows: [(&[u32], &[u32]); 4] = [
            (a, &[4, 2, 11]),
            (a, &[12, 2]),
            (a, &[9, 9, 1, 5, 3]),
            (b, &[13, 14, 2]),
        ];
        let lone: &[u32] = &[6, 1, 2];
        let mut g = Packing::default();
        let mut u = Packing::default();
        let mut targets = vec![];
        let mut prompt_seg: Vec<(&[u32], usize)> = vec![];
        for (p, r) in rows {
            // Grouped: the prompt once, then each response continuing it.
            let j = match prompt_seg.iter().find(|(q, _)| *q == p) {
                Some(&(_, j)) => j,
                None => {
                    g.segs.push((g.ids.len(), p.len()));
                    g.cont.push(None);
                    g.ids.extend_from_slice(p);
                    g.pos.extend(0..p.len() as u32);
                    prompt_seg.push((p, g.segs.len() - 1));
                    g.segs.len() - 1
                }
            };
            let (p0, pl) = g.segs[j];
            let start = g.ids.len();
            g.segs.push((start, r.len() - 1));
            g.cont.push(Some(j));
            g.ids.extend_from_slice(&r[..r.len() - 1]);
            g.pos.extend(pl as u32..(pl + r.len() - 1) as u32);
            g.at.push((p0 + pl - 1) as u32);
            g.at.extend((start..start + r.len() - 1).map(|k| k as u32));
            // Alone: prompt and response end to end.
            let ustart = u.ids.len();
            u.ids.extend_from_slice(p);
            u.ids.extend_from_slice(&r[..r.len() - 1]);
            u.segs.push((ustart, p.len() + r.len() - 1));
            u.pos.extend(0..(p.len() + r.len() - 1) as u32);
            u.at.extend((0..r.len()).map(|k| (ustart + p.len() - 1 + k) as u32));
            targets.extend_from_slice(r);
        }
        g.segs.push((g.ids.len(), lone.len()));
        g.cont.push(None);
        g.ids.extend_from_slice(lone);
        g.pos.extend(0..lone.len() as u32);
        u.segs.push((u.ids.len(), lone.len()));
        u.ids.extend_from_slice(lone);
        u.pos.extend(0..lone.len() as u32);
        GroupedLayouts {
            grouped: g,
            alone: u,
            targets,
        }
    }

    /// Responses continuing their group's prompt (`forward_hidden_grouped`, the prompt computed
    /// once) against each response after its own copy of the prompt (`forward_hidden_packed`,
    /// itself equal to the padded batch above): hidden states at every response-predicting
    /// token (the prompt's last one and each response token but the last), and every weight's
    /// gradient of a loss over them (each copy of the prompt collects its own gradient in the
    /// reference; the shared prompt collects them all). The hand-written layer with and without
    /// recomputation, and the composition (the bias opens the prefix to its continuations);
    /// Gemma 3's sliding window (4) reaches back across the prompt; the targets' log-probs too.
    /// f64 to 1e-9 relative, f32 to 1e-5 (measured: hidden states and log-probs bit-equal,
    /// gradients within 8.3e-7 of each tensor's largest value), bf16 products within 2e-2.
    #[test]
    fn grouped_responses_equal_each_response_after_its_own_prompt() {
        let dev = Device::Cpu;
        let GroupedLayouts {
            grouped: g,
            alone: u,
            targets,
        } = grouped_layouts();
        let (gids, gpos, gsegs, cont, gat) = (g.ids, g.pos, g.segs, g.cont, g.at);
        let (uids, upos, usegs, uat) = (u.ids, u.pos, u.segs, u.at);
        let k = targets.len();
        let t = |v: &[u32]| Tensor::new(v, &dev).unwrap();
        let targets = Tensor::from_vec(targets, (1, k), &dev).unwrap();
        for (arch, dtype, bf16) in [
            (Arch::Llama, DType::F64, false),
            (Arch::Qwen3, DType::F64, false),
            (Arch::Qwen3, DType::F32, false),
            (Arch::Qwen3, DType::F32, true),
            (Arch::Gemma3, DType::F64, false),
            (Arch::Qwen3Moe, DType::F64, false),
            (Arch::Qwen2, DType::F32, true),
        ] {
            let args = ModelArgs::tiny(arch, 30);
            let (vm, mut m) = crate::testing::tiny_model(&args, dtype, 0.3);
            m.set_exec(crate::model::Exec { bf16, ..m.exec() });
            let (vtol, gtol) = match (dtype, bf16) {
                (DType::F64, _) => (1e-9, 1e-9),
                (_, false) => (1e-5, 1e-5),
                _ => (2e-2, 2e-2),
            };
            let run = |m: &crate::model::CausalLm, grouped: bool| {
                let h = if grouped {
                    m.forward_hidden_grouped(&t(&gids), &t(&gpos), &gsegs, &cont)
                        .unwrap()
                        .index_select(&t(&gat), 0)
                        .unwrap()
                } else {
                    m.forward_hidden_packed(&t(&uids), &t(&upos), &usegs)
                        .unwrap()
                        .index_select(&t(&uat), 0)
                        .unwrap()
                };
                states_and_grads(&vm, m, &h, &targets)
            };
            for (composed, recompute) in [(false, false), (false, true), (true, false)] {
                m.set_exec(crate::model::Exec {
                    composed,
                    recompute,
                    ..m.exec()
                });
                assert_eq!(m.shares_prefixes(), !composed, "{arch:?}");
                let what = format!(
                    "{arch:?} {dtype:?} bf16 {bf16} composed {composed} recompute {recompute}"
                );
                assert_agree(&what, run(&m, true), run(&m, false), (vtol, gtol));
            }
        }
    }

    /// A continuation must name an earlier sequence that continues none, and a model with
    /// Gated DeltaNet layers (whose state is not carried between sequences) refuses one.
    #[test]
    fn grouped_sequences_are_checked() {
        let dev = Device::Cpu;
        let ids = Tensor::new(&[1u32, 2, 3, 4, 5], &dev).unwrap();
        let pos = Tensor::new(&[0u32, 1, 2, 2, 3], &dev).unwrap();
        let segs = [(0, 2), (2, 1), (3, 2)];
        let args = ModelArgs::tiny(Arch::Llama, 30);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        for (cont, rule) in [
            (vec![None, Some(2), None], "not an earlier sequence"),
            (vec![None, Some(0), Some(1)], "not an earlier sequence"),
            (vec![None, Some(0)], "3 sequences but 2"),
        ] {
            let e = m
                .forward_hidden_grouped(&ids, &pos, &segs, &cont)
                .unwrap_err()
                .to_string();
            assert!(e.contains(rule), "{cont:?}: {e}");
        }
        let ok = m.forward_hidden_grouped(&ids, &pos, &segs, &[None, Some(0), Some(0)]);
        assert_eq!(ok.unwrap().dims(), &[5, args.hidden_size]);
        let args = ModelArgs::tiny(Arch::Qwen3_5, 30);
        let (_vm, m) = crate::testing::tiny_model(&args, DType::F32, 0.3);
        assert!(!m.shares_prefixes());
        let e = m
            .forward_hidden_grouped(&ids, &pos, &segs, &[None, Some(0), None])
            .unwrap_err()
            .to_string();
        assert!(e.contains("Gated DeltaNet"), "{e}");
    }
}
