//! One decoder layer's forward and backward written out by hand over host memory (CPU, f32 and
//! f64), for training without candle's autograd inside a layer.
//!
//! candle's backward allocates a zero tensor and an addition for every node of the graph and
//! copies for every `narrow`/`cat`/broadcast; on a SmolLM2 layer that bookkeeping took more time
//! than the matrix products. Here the layer is a fixed sequence of products (gemm) and fused
//! element-wise loops, and its backward is the same sequence reversed, with the attention
//! probabilities recomputed one (row, KV head) at a time so that no `[batch, heads, seq, seq]`
//! tensor ever exists. [`super::block::block_forward`] stays the reference: the tests
//! compare against it and against finite differences.
//!
//! ```text
//! h1 = rms(x)·ln1                 q,k,v = h1·Wqᵀ(+bq), h1·Wkᵀ(+bk), h1·Wvᵀ(+bv)
//! (Qwen3: q ← rms(q_h)·qn, k ← rms(k_h)·kn over each head's hd values)
//! q̃ = q⊙cos + R(q)⊙sin, k̃ alike   R([u1, u2]) = [−u2, u1]  (Rᵀ([u1, u2]) = [u2, −u1])
//! P = softmax(q̃·k̃ᵀ/√d + bias)     a = P·v  (query head h reads KV head h / (heads/kv_heads))
//! x2 = x + a·Woᵀ                  h2 = rms(x2)·ln2
//! y = x2 + (silu(h2·Wgᵀ) ⊙ h2·Wuᵀ)·Wdᵀ
//! Gemma: every norm scales by 1 + w; x2 = x + rms(a·Woᵀ)·pa, y = x2 + rms(mlp)·pf; GELU (tanh)
//! for silu; scores scaled by query_pre_attn_scalar^-½; sliding layers see `window` keys.
//! Qwen3.5's full-attention layers: q_proj gives each head hd queries then hd gate values z,
//! a ← a ⊙ σ(z) before Wo (∂a = ∂a_g ⊙ σ(z), ∂z = ∂a_g ⊙ a ⊙ σ(z)(1 − σ(z))); RoPE turns the
//! first `rotary_dim` values of each head and passes the rest; every norm scales by 1 + w.
//! Qwen3-MoE: the MLP is a layer of experts, y = x2 + Σ_j w_j·mlp_{e_j}(h2) over each token's
//! top-k experts e_j of p = softmax(h2·Rᵀ), each expert run on the rows routed to it only
//! ([`moe_fwd`], [`moe_bwd`]); Qwen3.5-MoE and Qwen3-Next add a shared expert on every token,
//! + σ(h2·w_sᵀ)·mlp_s(h2) (∂ of the gate's logit: σ′·Σ(dy ⊙ mlp_s(h2))).
//!
//! rms backward, with x̂ = x·r, r = (mean x² + ε)^−½, gh the gradient of h = x̂⊙w:
//!   ∂w = Σ_rows gh⊙x̂,   ∂x = r·(gh⊙w − x̂·mean(gh⊙w⊙x̂))
//! attention backward per head: dP = dA·vᵀ, dS = P⊙(dP − rowsum(P⊙dP)),
//!   dq̃ = dS·k̃/√d, dk̃ += dSᵀ·q̃/√d, dv += Pᵀ·dA
//! silu′(z) = σ(z)·(1 + z·(1 − σ(z)))
//! ```

use candle_core::{Result, WithDType};
use rayon::prelude::*;

use crate::kernels::elem::{dot, max, sigmoid, sum, Elem};
use crate::kernels::gemm::{gemm_mixed, gemm_new, SharedA, SharedB};
use crate::kernels::simd::{par_map2, par_zip, par_zip2, vectorized, Par, CHUNK};

/// The sizes of one layer call: `rows = batch·seq` tokens, no KV cache (keys = queries).
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub batch: usize,
    pub seq: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub eps: f64,
    /// What norm weights add to their scale (Gemma: 1, `x̂·(1 + w)`).
    pub norm_offset: f64,
    /// The MLP's gate: GELU with the tanh approximation (Gemma) instead of SiLU.
    pub gelu: bool,
    /// The factor on attention scores (`head_dim^-½`, Gemma `query_pre_attn_scalar^-½`).
    pub attn_scale: f64,
    /// Keys a query sees in packed sequences (sliding-window layers; padded calls carry the
    /// window in their bias).
    pub window: Option<usize>,
    /// Matrix products with bf16 operands and f32 sums (f32 layers on the CPU: `kernels::bf16`).
    pub bf16: bool,
    /// The values of each head that RoPE turns, the first ones (`head_dim` unless partial:
    /// Qwen3.5's `partial_rotary_factor`); the rotary tables are `[rows, rotary_dim]`.
    pub rotary_dim: usize,
    /// A sigmoid output gate (Qwen3.5): `q_proj` is `[heads·2·hd, hidden]`, each head's `hd`
    /// queries then its `hd` gate values `z`, and `a ← a ⊙ σ(z)` before `o_proj`.
    pub output_gate: bool,
}

impl Dims {
    fn rows(&self) -> usize {
        self.batch * self.seq
    }
    fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// A linear layer's weight `[out, in]` and optional bias `[out]`, borrowed.
#[derive(Clone, Copy)]
pub(super) struct Lin<'a, T> {
    pub w: &'a [T],
    pub b: Option<&'a [T]>,
    /// A LoRA adapter on the side: `y += s·(x·Aᵀ)·Bᵀ`.
    pub ad: Option<Adapter<'a, T>>,
    /// Whether the base weight and bias train (false for a LoRA model's frozen base: their
    /// gradients, the largest product of the backward, are not computed).
    pub train_base: bool,
    /// Products with bf16 operands (as [`Dims::bf16`]).
    pub bf16: bool,
}

/// A LoRA adapter, borrowed: `A` `[r, in]`, `B` `[out, r]`, scale `s`, and the mask of its
/// input dropout in this forward (training forwards with `lora_dropout` only).
#[derive(Clone, Copy)]
pub(super) struct Adapter<'a, T> {
    pub a: &'a [T],
    pub b: &'a [T],
    pub scale: T,
    pub dropout: Option<super::proj::Dropout>,
}

/// One linear layer's gradients; `None` where the tensor does not train or does not exist, or
/// the layer took no part.
pub(super) struct LinGrad<T> {
    pub w: Option<Vec<T>>,
    pub b: Option<Vec<T>>,
    pub a: Option<Vec<T>>,
    pub bb: Option<Vec<T>>,
}

impl<T> LinGrad<T> {
    /// No gradient: a linear layer that took no part in the forward (an expert no token was
    /// routed to), as PyTorch leaves such a module's `.grad` unset.
    fn none() -> Self {
        LinGrad {
            w: None,
            b: None,
            a: None,
            bb: None,
        }
    }
}

/// A layer's weights, borrowed from their storage.
#[derive(Clone)]
pub(super) struct Weights<'a, T> {
    pub ln1: &'a [T],
    pub ln2: &'a [T],
    /// Per-head RMSNorm weights of q and k (`[head_dim]` each), where the layer has them.
    pub qk_norm: Option<(&'a [T], &'a [T])>,
    /// Gemma's norms of the attention and MLP outputs (`[hidden]` each).
    pub sandwich: Option<(&'a [T], &'a [T])>,
    /// q, k, v, o.
    pub attn: [Lin<'a, T>; 4],
    pub mlp: Ffn<'a, T>,
}

/// What follows the attention: one gated MLP, or a mixture of experts.
// A view built once per layer call: the dense variant's size costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub(super) enum Ffn<'a, T> {
    /// gate, up, down (`Dims::inter` wide).
    Dense([Lin<'a, T>; 3]),
    Experts(Moe<'a, T>),
}

/// A layer of experts (Qwen3-MoE): a router and `experts` gated MLPs (SiLU, `Dims::inter`
/// wide), each token sent to its `top_k` most probable experts.
#[derive(Clone)]
pub(super) struct Moe<'a, T> {
    /// `[experts, hidden]`; its product stays in the layer's precision (no bf16 operands), as
    /// the composition's and the decode engine's router.
    pub router: &'a [T],
    pub train_router: bool,
    /// Per expert: gate, up, down.
    pub experts: Vec<[Lin<'a, T>; 3]>,
    pub top_k: usize,
    /// Routing weights renormalised to sum to 1 over a token's chosen experts.
    pub norm_topk_prob: bool,
    /// A shared expert on every token (Qwen3.5-MoE, Qwen3-Next): its gate, up and down (its own
    /// width, `shared_expert_intermediate_size`) and its gate's projection `[1, hidden]`.
    pub shared: Option<([Lin<'a, T>; 3], Lin<'a, T>)>,
}

impl<T> Ffn<'_, T> {
    /// The MLP's projections in the order of [`Grads::lin`] after the attention's.
    fn lins(&self) -> Vec<Lin<'_, T>>
    where
        T: Copy,
    {
        match self {
            Ffn::Dense(l) => l.to_vec(),
            Ffn::Experts(m) => {
                let mut all: Vec<Lin<T>> = m.experts.iter().flatten().copied().collect();
                if let Some((mlp, gate)) = &m.shared {
                    all.extend(mlp.iter().copied().chain([*gate]));
                }
                all
            }
        }
    }
}

/// Gradients in [`Weights`]' order: `ln1`, `ln2`, the q/k and sandwich norms, the router,
/// then each linear's (q, k, v, o, then the MLP's gate, up, down, expert by expert).
pub(super) struct Grads<T> {
    pub ln1: Vec<T>,
    pub ln2: Vec<T>,
    pub qk_norm: Option<(Vec<T>, Vec<T>)>,
    pub sandwich: Option<(Vec<T>, Vec<T>)>,
    /// A layer of experts' router, where it trains.
    pub router: Option<Vec<T>>,
    pub lin: Vec<LinGrad<T>>,
}

/// The per-row rotary tables `[rows, head_dim]` and which rows attend to which.
#[derive(Clone, Copy)]
pub(super) struct Context<'a, T> {
    pub cos: &'a [T],
    pub sin: &'a [T],
    pub attn: Attn<'a, T>,
}

/// Which keys each query row attends to.
#[derive(Clone, Copy)]
pub(super) enum Attn<'a, T> {
    /// `batch` rows of `seq` tokens each (padded), an additive bias `[batch, seq, seq]` holding
    /// causality and padding.
    Bias(&'a [T]),
    /// Sequences laid end to end over the rows (verl's `use_remove_padding`), in order and
    /// covering every row: causal inside each sequence, nothing across sequences except a
    /// shared prefix ([`Seg::prefix`]). `Dims::batch` is 1 and `Dims::seq` the total.
    Packed(&'a [Seg]),
}

/// One packed sequence: `len` rows from `start`. With a `prefix` `(first row, length)` (an
/// earlier sequence of the same call, itself without one) the sequence continues it: its rows
/// see every prefix row and then their own rows causally, as if the prefix were copied in
/// front of them (a GRPO group's responses sharing their prompt, computed once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seg {
    pub start: usize,
    pub len: usize,
    pub prefix: Option<(usize, usize)>,
}

impl Seg {
    /// A sequence of its own (no shared prefix).
    pub(crate) fn alone((start, len): (usize, usize)) -> Seg {
        Seg {
            start,
            len,
            prefix: None,
        }
    }
}

/// The sequences as `(first token, length)` pairs when none continues a shared prefix.
pub(crate) fn spans(segs: &[Seg]) -> Option<Vec<(usize, usize)>> {
    segs.iter()
        .map(|s| s.prefix.is_none().then_some((s.start, s.len)))
        .collect()
}

/// Whether packed sequences are non-empty and laid end to end from token 0 over all `n`
/// tokens, and each shared prefix is a whole earlier sequence that has none itself; the broken
/// rule otherwise.
pub(super) fn check_segments(segs: &[Seg], n: usize) -> std::result::Result<(), String> {
    let mut next = 0;
    for (i, s) in segs.iter().enumerate() {
        let (a, l) = (s.start, s.len);
        if a != next || l == 0 {
            return Err(format!(
                "sequence {i} is ({a}, {l}); sequences must be non-empty and laid end to end \
                 from token 0"
            ));
        }
        if let Some(p) = s.prefix {
            let whole = segs[..i]
                .iter()
                .any(|e| (e.start, e.len) == p && e.prefix.is_none());
            if !whole {
                return Err(format!(
                    "sequence {i}'s prefix {p:?} is not an earlier sequence without a prefix \
                     of its own"
                ));
            }
        }
        next = a + l;
    }
    if next != n {
        return Err(format!("the sequences cover {next} of {n} tokens"));
    }
    Ok(())
}

/// One attention block: the query rows `start..start + t`, their bias `[t, t]` (padded rows)
/// or none (causal), and the shared prefix rows they also see.
#[derive(Clone, Copy)]
struct Block<'a, T> {
    start: usize,
    t: usize,
    bias: Option<&'a [T]>,
    prefix: Option<(usize, usize)>,
}

impl<T> Block<'_, T> {
    /// How many keys each query row of the block has: the prefix's, then the block's own.
    fn keys(&self) -> usize {
        self.prefix.map_or(0, |p| p.1) + self.t
    }
}

/// The attention blocks of a call: each padded row, or each packed sequence.
fn blocks<'a, T>(d: &Dims, cx: &Context<'a, T>) -> Vec<Block<'a, T>> {
    let t = d.seq;
    match cx.attn {
        Attn::Bias(b) => (0..d.batch)
            .map(|r| Block {
                start: r * t,
                t,
                bias: Some(&b[r * t * t..][..t * t]),
                prefix: None,
            })
            .collect(),
        Attn::Packed(segs) => segs
            .iter()
            .map(|s| Block {
                start: s.start,
                t: s.len,
                bias: None,
                prefix: s.prefix,
            })
            .collect(),
    }
}

/// KV head `g`'s columns of `x` `[rows, width]` (keys or values) at the rows block `blk`
/// reads, as `(slice, row stride)`: in place without a prefix, else gathered into `buf` as
/// `[prefix rows; own rows]` `[keys, hd]`.
fn key_rows<'a, T: Elem>(
    x: &'a [T],
    width: usize,
    blk: &Block<T>,
    (g, hd): (usize, usize),
    buf: &'a mut Vec<T>,
) -> (&'a [T], usize) {
    let Some((p0, pl)) = blk.prefix else {
        return (&x[blk.start * width + g * hd..], width);
    };
    buf.clear();
    for row in (p0..p0 + pl).chain(blk.start..blk.start + blk.t) {
        buf.extend_from_slice(&x[row * width + g * hd..][..hd]);
    }
    (&buf[..], hd)
}

/// What the backward needs from the forward: recomputed in backward, or kept from the forward
/// when recomputation is off.
pub(super) struct Acts<T> {
    r1: Vec<T>, // [rows]
    h1: Vec<T>, // [rows, hidden]
    q: Vec<T>,  // [rows, heads·hd], rotated
    k: Vec<T>,  // [rows, kv·hd], rotated
    /// With q/k norms: q and k before them, and each head's `r`.
    qk_pre: Option<QkPre<T>>,
    /// With sandwich norms: the attention and MLP outputs before them, and their `r`.
    sandwich: Option<SandwichPre<T>>,
    v: Vec<T>, // [rows, kv·hd]
    /// The input of `o_proj` `[rows, heads·hd]`: the attention's output, gated where the layer
    /// has an output gate.
    a: Vec<T>,
    /// With an output gate: its values and the attention's output before it.
    gate: Option<GateActs<T>>,
    x2: Vec<T>, // [rows, hidden]
    r2: Vec<T>, // [rows]
    h2: Vec<T>, // [rows, hidden]
    mlp: MlpActs<T>,
}

/// The MLP's activations: the gate and up products `[rows, inter]` of the dense MLP, or the
/// routing and each expert's products over its tokens.
enum MlpActs<T> {
    Dense { gate: Vec<T>, up: Vec<T> },
    Experts(MoeActs<T>),
}

struct MoeActs<T> {
    /// The router's logits `[rows, experts]` (an output of the layer for the load-balancing
    /// loss).
    logits: Vec<T>,
    /// The router's probabilities `[rows, experts]`.
    probs: Vec<T>,
    /// Each token's experts, most probable first, `[rows, top_k]`.
    chosen: Vec<usize>,
    /// Their routing weights `[rows, top_k]` (renormalised with `norm_topk_prob`).
    weights: Vec<T>,
    per: Vec<ExpertActs<T>>,
    shared: Option<SharedActs<T>>,
}

/// The shared expert's products over every token: its gate's logit `[rows]`, its gate and up
/// `[rows, width]`, its output `[rows, hidden]` before the gate.
struct SharedActs<T> {
    logit: Vec<T>,
    gate: Vec<T>,
    up: Vec<T>,
    y: Vec<T>,
}

/// One expert's tokens in routing order, the slot of each in `chosen` (`token·top_k + j`),
/// and its products over them: gate and up `[m, inter]`, output `[m, hidden]` before the
/// routing weight.
struct ExpertActs<T> {
    tokens: Vec<usize>,
    slots: Vec<usize>,
    gate: Vec<T>,
    up: Vec<T>,
    y: Vec<T>,
}

/// The output gate's values `z` and the attention's output before the gate (`[rows, heads·hd]`
/// each).
struct GateActs<T> {
    z: Vec<T>,
    pre: Vec<T>,
}

/// q and k before their per-head norms (`[rows, heads·hd]`, `[rows, kv·hd]`) and each head's
/// `r` (`[rows·heads]`, `[rows·kv]`).
struct QkPre<T> {
    q: Vec<T>,
    k: Vec<T>,
    rq: Vec<T>,
    rk: Vec<T>,
}

/// The attention output `a·Woᵀ` and the MLP output before Gemma's norms of them (`[rows,
/// hidden]`) and their rows' `r`.
struct SandwichPre<T> {
    attn: Vec<T>,
    ra: Vec<T>,
    mlp: Vec<T>,
    rm: Vec<T>,
}

fn c<T: Elem>(v: f64) -> T {
    T::from_f64(v)
}

/// `y[rows, out] = x[rows, in]·Wᵀ (+ b)`.
fn linear_fwd<T: Elem>(l: Lin<T>, x: &[T], rows: usize, inp: usize) -> Vec<T> {
    linear_fwd_on(l, &input_a(l, x, rows, inp), rows, inp)
}

/// `x` `[rows, inp]` as the left operand of products `x·Wᵀ`: packed once for every
/// projection that reads it (`linear_fwd_on`).
fn input_a<'a, T: Elem>(l: Lin<T>, x: &'a [T], rows: usize, inp: usize) -> SharedA<'a, T> {
    SharedA::new(l.bf16, x, (inp, 1), rows, inp)
}

/// [`linear_fwd`] on an input prepared by [`input_a`].
fn linear_fwd_on<T: Elem>(l: Lin<T>, xa: &SharedA<T>, rows: usize, inp: usize) -> Vec<T> {
    let out = l.w.len() / inp;
    let x = xa.plain();
    let mut y = xa.product(l.bf16, l.w, (1, inp), out);
    if let Some(b) = l.b {
        y.par_chunks_mut(out).for_each(|row| {
            vectorized(
                #[inline(always)]
                || {
                    for (o, &bb) in row.iter_mut().zip(b) {
                        *o += bb;
                    }
                },
            )
        });
    }
    if let Some(ad) = l.ad {
        // y += (s·x·Aᵀ) [rows, r] · Bᵀ [r, out]; with B = 0 this adds exact zeros.
        let r = ad.a.len() / inp;
        let xd = dropped_input(ad, x);
        let xs = adapter_input(ad, xd.as_deref().unwrap_or(x), rows, inp, l.bf16);
        gemm_mixed(
            l.bf16,
            &mut y,
            rows,
            out,
            r,
            &xs,
            r,
            1,
            ad.b,
            1,
            r,
            true,
            Par::Rayon,
        );
    }
    y
}

/// The adapter's view of `x` `[rows, in]` under dropout, `x ⊙ m / (1 − p)`; `None` without.
fn dropped_input<T: Elem>(ad: Adapter<T>, x: &[T]) -> Option<Vec<T>> {
    ad.dropout.map(|d| {
        let mut v = x.to_vec();
        d.apply(&mut v);
        v
    })
}

/// `s·x·Aᵀ` `[rows, r]` (`x` already through the adapter's dropout).
fn adapter_input<T: Elem>(ad: Adapter<T>, x: &[T], rows: usize, inp: usize, bf16: bool) -> Vec<T> {
    let r = ad.a.len() / inp;
    let mut xs = vec![T::zero(); rows * r];
    gemm_mixed(
        bf16,
        &mut xs,
        rows,
        r,
        inp,
        x,
        inp,
        1,
        ad.a,
        1,
        inp,
        false,
        Par::Rayon,
    );
    scale_in_place(&mut xs, ad.scale);
    xs
}

/// Gradients of a linear layer from `dy [rows, out]`: `∂W = dyᵀ·x`, `∂b = Σ_rows dy` (when the
/// base trains), and `dx += dy·W` (into a fresh `dx`: [`linear_bwd_new`]); with an adapter
/// (`xd` = `x` through its dropout, `xs = s·xd·Aᵀ`): `∂B = dyᵀ·xs`, `∂A = s·(dy·B)ᵀ·xd` and
/// `dx += (s·(dy·B)·A) ⊙ m / (1 − p)`.
fn linear_bwd<T: Elem>(
    l: Lin<T>,
    xb: &SharedB<T>,
    dy: &[T],
    rows: usize,
    inp: usize,
    dx: &mut [T],
) -> LinGrad<T> {
    let out = l.w.len() / inp;
    gemm_mixed(
        l.bf16,
        dx,
        rows,
        inp,
        out,
        dy,
        out,
        1,
        l.w,
        inp,
        1,
        true,
        Par::Rayon,
    );
    linear_grads(l, xb, dy, rows, inp, dx)
}

/// [`linear_bwd`] with `dx` a fresh `[rows, inp]` buffer, written by its product (not
/// zero-filled first).
fn linear_bwd_new<T: Elem>(
    l: Lin<T>,
    xb: &SharedB<T>,
    dy: &[T],
    rows: usize,
    inp: usize,
) -> (Vec<T>, LinGrad<T>) {
    let out = l.w.len() / inp;
    let mut dx = gemm_new(l.bf16, rows, inp, out, dy, out, 1, l.w, inp, 1, Par::Rayon);
    let g = linear_grads(l, xb, dy, rows, inp, &mut dx);
    (dx, g)
}

/// `x` `[rows, inp]` as the right operand of the weight gradients `∂Wᵢ = dyᵢᵀ·x` of the
/// projections `ls` that read it: packed once for all of them (nothing packed when none of
/// their base weights trains).
fn input_b<'a, T: Elem>(ls: &[Lin<T>], x: &'a [T], rows: usize, inp: usize) -> SharedB<'a, T> {
    let train = ls.iter().any(|l| l.train_base);
    SharedB::new(ls[0].bf16, x, (inp, 1), rows, inp, train)
}

/// The weights' gradients of [`linear_bwd`] once `dx` holds the base's input gradient: the
/// base weight's, and the adapter's (which adds its own share to `dx`).
fn linear_grads<T: Elem>(
    l: Lin<T>,
    xb: &SharedB<T>,
    dy: &[T],
    rows: usize,
    inp: usize,
    dx: &mut [T],
) -> LinGrad<T> {
    let out = l.w.len() / inp;
    let mut g = base_grads(l, xb, dy, inp);
    if let Some(ad) = l.ad {
        let (da, db) = adapter_bwd(ad, l.bf16, (xb.plain(), dy), (rows, inp, out), dx);
        g.a = Some(da);
        g.bb = Some(db);
    }
    g
}

/// The base weight's gradients of [`linear_bwd`] (`∂W = dyᵀ·x`, `∂b = Σ_rows dy`), when it
/// trains; the adapter's left unset.
fn base_grads<T: Elem>(l: Lin<T>, xb: &SharedB<T>, dy: &[T], inp: usize) -> LinGrad<T> {
    let out = l.w.len() / inp;
    let mut g = LinGrad {
        w: None,
        b: None,
        a: None,
        bb: None,
    };
    if l.train_base {
        g.w = Some(xb.product(l.bf16, dy, (1, out), out));
        g.b = l.b.map(|_| column_sums(dy, out));
    }
    g
}

/// The LoRA adapter's part of [`linear_bwd`]: the gradients of A `[r, inp]` and B `[out, r]`
/// (returned as `(dA, dB)`), and its share of the input gradient added to `dx`, back through
/// the adapter's dropout mask where it has one.
fn adapter_bwd<T: Elem>(
    ad: Adapter<T>,
    bf16: bool,
    (x, dy): (&[T], &[T]),
    (rows, inp, out): (usize, usize, usize),
    dx: &mut [T],
) -> (Vec<T>, Vec<T>) {
    let r = ad.a.len() / inp;
    let xd = dropped_input(ad, x);
    let xa = xd.as_deref().unwrap_or(x);
    let xs = adapter_input(ad, xa, rows, inp, bf16);
    let mut db = vec![T::zero(); out * r];
    gemm_mixed(
        bf16,
        &mut db,
        out,
        r,
        rows,
        dy,
        1,
        out,
        &xs,
        r,
        1,
        false,
        Par::Rayon,
    );
    drop(xs);
    let mut dxa = vec![T::zero(); rows * r]; // s·dy·B
    gemm_mixed(
        bf16,
        &mut dxa,
        rows,
        r,
        out,
        dy,
        out,
        1,
        ad.b,
        r,
        1,
        false,
        Par::Rayon,
    );
    scale_in_place(&mut dxa, ad.scale);
    let mut da = vec![T::zero(); r * inp];
    gemm_mixed(
        bf16,
        &mut da,
        r,
        inp,
        rows,
        &dxa,
        1,
        r,
        xa,
        inp,
        1,
        false,
        Par::Rayon,
    );
    drop(xd);
    match ad.dropout {
        None => gemm_mixed(
            bf16,
            dx,
            rows,
            inp,
            r,
            &dxa,
            r,
            1,
            ad.a,
            inp,
            1,
            true,
            Par::Rayon,
        ),
        Some(d) => {
            // The adapter's input gradient goes back through the same mask.
            let mut dxd = vec![T::zero(); rows * inp];
            gemm_mixed(
                bf16,
                &mut dxd,
                rows,
                inp,
                r,
                &dxa,
                r,
                1,
                ad.a,
                inp,
                1,
                false,
                Par::Rayon,
            );
            d.apply(&mut dxd);
            par_zip(dx, &dxd, |o, v| o + v);
        }
    }
    (da, db)
}

fn column_sums<T: Elem>(m: &[T], cols: usize) -> Vec<T> {
    let mut s = vec![T::zero(); cols];
    vectorized(
        #[inline(always)]
        || {
            for row in m.chunks(cols) {
                for (a, &b) in s.iter_mut().zip(row) {
                    *a += b;
                }
            }
        },
    );
    s
}

/// `v ← v·s`, in parallel chunks, vectorized.
fn scale_in_place<T: Elem>(v: &mut [T], s: T) {
    v.par_chunks_mut(CHUNK).for_each(|c| {
        vectorized(
            #[inline(always)]
            || c.iter_mut().for_each(|x| *x *= s),
        )
    });
}

/// The gated product `f(gate) ⊙ up` (`[rows, inter]` each), `f` = SiLU or GELU (tanh).
fn gated<T: Elem>(gate: &[T], up: &[T], gelu: bool) -> Vec<T> {
    if gelu {
        par_map2(gate, up, |z, u| gelu_tanh(z).0 * u)
    } else {
        par_map2(gate, up, |z, u| z * sigmoid(z) * u)
    }
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_C: f64 = 0.044_715;

/// GELU with the tanh approximation and its derivative at `z`:
/// `g = ½z(1 + tanh u)`, `u = √(2/π)(z + 0.044715 z³)`,
/// `g′ = ½(1 + tanh u) + ½z(1 − tanh² u)·√(2/π)(1 + 3·0.044715 z²)`.
#[inline(always)]
fn gelu_tanh<T: Elem>(z: T) -> (T, T) {
    let (k0, k1, half) = (c::<T>(SQRT_2_OVER_PI), c::<T>(GELU_C), c::<T>(0.5));
    let th = (k0 * (z + k1 * z * z * z)).tanh();
    let g = half * z * (T::one() + th);
    let dg = half * (T::one() + th)
        + half * z * (T::one() - th * th) * k0 * (T::one() + c::<T>(3.0) * k1 * z * z);
    (g, dg)
}

/// `h = x·r·(w + off)` per row with `r = 1/√(mean x² + ε)`; returns `(h, r)`.
fn rms_fwd<T: Elem>(x: &[T], w: &[T], eps: f64, off: f64) -> (Vec<T>, Vec<T>) {
    let hid = w.len();
    let off: T = c(off);
    let mut h = vec![T::zero(); x.len()];
    let mut r = vec![T::zero(); x.len() / hid];
    h.par_chunks_mut(hid)
        .zip(r.par_iter_mut())
        .zip(x.par_chunks(hid))
        .for_each(|((hr, rr), xr)| {
            vectorized(
                #[inline(always)]
                || {
                    let ss = dot(xr, xr);
                    *rr = (ss / c(hid as f64) + c(eps)).sqrt().recip();
                    for ((o, &xv), &wv) in hr.iter_mut().zip(xr).zip(w) {
                        *o = xv * *rr * (wv + off);
                    }
                },
            )
        });
    (h, r)
}

/// RMSNorm backward (scale `w + off`): adds `∂x` into `dx` and returns `∂w`.
fn rms_bwd<T: Elem>(x: &[T], r: &[T], w: &[T], gh: &[T], dx: &mut [T], off: f64) -> Vec<T> {
    let hid = w.len();
    let off: T = c(off);
    let inv_h: T = c(1.0 / hid as f64);
    dx.par_chunks_mut(hid)
        .zip(x.par_chunks(hid))
        .zip(gh.par_chunks(hid))
        .zip(r.par_iter())
        .for_each(|(((dxr, xr), gr), &rr)| {
            vectorized(
                #[inline(always)]
                || {
                    let dot = xr
                        .iter()
                        .zip(gr)
                        .zip(w)
                        .fold(T::zero(), |s, ((&xv, &g), &wv)| {
                            s + g * (wv + off) * xv * rr
                        });
                    let m = dot * inv_h;
                    for (((d, &xv), &g), &wv) in dxr.iter_mut().zip(xr).zip(gr).zip(w) {
                        *d += rr * (g * (wv + off) - xv * rr * m);
                    }
                },
            )
        });
    // ∂w = Σ_rows gh ⊙ x̂, summed per thread over row blocks.
    let rows = r.len();
    let block = rows
        .div_ceil(rayon::current_num_threads().max(1) * 4)
        .max(1);
    (0..rows.div_ceil(block))
        .into_par_iter()
        .map(|bi| {
            let mut s = vec![T::zero(); hid];
            vectorized(
                #[inline(always)]
                || {
                    for row in bi * block..((bi + 1) * block).min(rows) {
                        let rr = r[row];
                        let (xr, gr) = (&x[row * hid..][..hid], &gh[row * hid..][..hid]);
                        for ((a, &xv), &g) in s.iter_mut().zip(xr).zip(gr) {
                            *a += g * xv * rr;
                        }
                    }
                },
            );
            s
        })
        .reduce(
            || vec![T::zero(); hid],
            |mut a, b| {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y;
                }
                a
            },
        )
}

/// Rotates the first `rd` values `u` of each head (`hd` values) of `m [rows, heads·hd]` in
/// place, with tables `[rows, rd]`: `u⊙cos + R(u)⊙sin`; with `transpose` applies the adjoint,
/// `u⊙cos + Rᵀ(u⊙sin)` (the backward). The other `hd − rd` values pass (partial rotary).
fn rope<T: Elem>(
    m: &mut [T],
    width: usize,
    (hd, rd): (usize, usize),
    cx: &Context<T>,
    transpose: bool,
) {
    let half = rd / 2;
    m.par_chunks_mut(width).enumerate().for_each(|(row, mr)| {
        let (cs, sn) = (&cx.cos[row * rd..][..rd], &cx.sin[row * rd..][..rd]);
        vectorized(
            #[inline(always)]
            || {
                for u in mr.chunks_mut(hd) {
                    let (u1, u2) = u[..rd].split_at_mut(half);
                    let (c1, c2) = cs.split_at(half);
                    let (s1, s2) = sn.split_at(half);
                    for j in 0..half {
                        let (a, b) = (u1[j], u2[j]);
                        if transpose {
                            u1[j] = a * c1[j] + b * s2[j];
                            u2[j] = b * c2[j] - a * s1[j];
                        } else {
                            u1[j] = a * c1[j] - b * s1[j];
                            u2[j] = b * c2[j] + a * s2[j];
                        }
                    }
                }
            },
        )
    });
}

/// Splits `m [rows, heads·2·hd]`, each head's `hd` queries then its `hd` gate values, into
/// queries and gate values `[rows, heads·hd]` each.
fn split_heads<T: Elem>(m: &[T], hd: usize) -> (Vec<T>, Vec<T>) {
    let half = m.len() / 2;
    let (mut q, mut z) = (vec![T::zero(); half], vec![T::zero(); half]);
    q.par_chunks_mut(hd)
        .zip(z.par_chunks_mut(hd))
        .zip(m.par_chunks(2 * hd))
        .for_each(|((q, z), m)| {
            q.copy_from_slice(&m[..hd]);
            z.copy_from_slice(&m[hd..]);
        });
    (q, z)
}

/// The inverse of [`split_heads`]: `[rows, heads·2·hd]` from queries and gate values.
fn join_heads<T: Elem>(q: &[T], z: &[T], hd: usize) -> Vec<T> {
    let mut m = vec![T::zero(); 2 * q.len()];
    m.par_chunks_mut(2 * hd)
        .zip(q.par_chunks(hd))
        .zip(z.par_chunks(hd))
        .for_each(|((m, q), z)| {
            m[..hd].copy_from_slice(q);
            m[hd..].copy_from_slice(z);
        });
    m
}

/// The output gate's backward: with `da` the gradient of `a ⊙ σ(z)`, returns
/// `∂z = da ⊙ a ⊙ σ(z)(1 − σ(z))` and leaves `∂a = da ⊙ σ(z)` in `da`.
fn gate_bwd<T: Elem>(da: &mut [T], z: &[T], pre: &[T]) -> Vec<T> {
    let mut dz = vec![T::zero(); da.len()];
    dz.par_chunks_mut(CHUNK)
        .zip(da.par_chunks_mut(CHUNK))
        .zip(z.par_chunks(CHUNK).zip(pre.par_chunks(CHUNK)))
        .for_each(|((dz, da), (z, pre))| {
            vectorized(
                #[inline(always)]
                || {
                    for (((dz, da), &z), &a) in dz.iter_mut().zip(da.iter_mut()).zip(z).zip(pre) {
                        let s = sigmoid(z);
                        *dz = *da * a * s * (T::one() - s);
                        *da *= s;
                    }
                },
            )
        });
    dz
}

/// The softmax probabilities `P [rep·t, keys]` of the `rep` query heads that read KV head `g`
/// in attention block `blk`, from its keys `kk` (`[keys, hd]` at the given row stride):
/// scores `q̃·k̃ᵀ/√d` plus the bias, or without one causal after the shared prefix (row `i`
/// sees keys `0..=prefix + i`), max-shifted per row.
fn probs<T: Elem>(
    d: &Dims,
    acts: &Acts<T>,
    blk: &Block<T>,
    g: usize,
    kk: (&[T], usize),
    p: &mut [T],
) {
    let (t, kn) = (blk.t, blk.keys());
    let (hd, rep) = (d.head_dim, d.heads / d.kv_heads);
    let qw = d.q_width();
    let scale: T = c(d.attn_scale);
    for j in 0..rep {
        let h = g * rep + j;
        let s = &mut p[j * t * kn..][..t * kn];
        let q = &acts.q[blk.start * qw + h * hd..];
        gemm_mixed(
            d.bf16,
            s,
            t,
            kn,
            hd,
            q,
            qw,
            1,
            kk.0,
            1,
            kk.1,
            false,
            Par::None,
        );
        match blk.bias {
            Some(b) => softmax_rows(s, b, t, scale),
            None => softmax_causal(s, kn, kn - t, scale, d.window),
        }
    }
}

/// `s ← softmax(s·scale)` over keys `0..=off + i` of each row `i` of `cols` keys (the last
/// `window` of them when given), zero elsewhere (a packed sequence after `off` shared prefix
/// keys: causal, no padding), vectorized.
fn softmax_causal<T: Elem>(s: &mut [T], cols: usize, off: usize, scale: T, window: Option<usize>) {
    vectorized(
        #[inline(always)]
        || {
            for (i, srow) in s.chunks_mut(cols).enumerate() {
                let last = off + i;
                let first = window.map_or(0, |w| (last + 1).saturating_sub(w));
                let (old, rest) = srow.split_at_mut(first);
                old.fill(T::zero());
                let (live, dead) = rest.split_at_mut(last + 1 - first);
                for v in live.iter_mut() {
                    *v *= scale;
                }
                let mx = max(live);
                for v in live.iter_mut() {
                    *v = (*v - mx).exp_fast();
                }
                let inv = sum(live).recip();
                for v in live.iter_mut() {
                    *v *= inv;
                }
                dead.fill(T::zero());
            }
        },
    )
}

/// `s ← softmax(s·scale + bias)` per row of `t`, max-shifted, vectorized.
fn softmax_rows<T: Elem>(s: &mut [T], bias: &[T], t: usize, scale: T) {
    vectorized(
        #[inline(always)]
        || softmax_rows_body(s, bias, t, scale),
    )
}

#[inline(always)]
fn softmax_rows_body<T: Elem>(s: &mut [T], bias: &[T], t: usize, scale: T) {
    for (srow, brow) in s.chunks_mut(t).zip(bias.chunks(t)) {
        for (v, &b) in srow.iter_mut().zip(brow) {
            *v = *v * scale + b;
        }
        let mx = max(srow);
        for v in srow.iter_mut() {
            *v = (*v - mx).exp_fast();
        }
        let inv = sum(srow).recip();
        for v in srow.iter_mut() {
            *v *= inv;
        }
    }
}

/// `dS = P ⊙ (dP − rowsum(P ⊙ dP))·scale` in place of `dP` (`ds`), rows of `t`, vectorized.
fn softmax_bwd_rows<T: Elem>(ds: &mut [T], p: &[T], t: usize, scale: T) {
    vectorized(
        #[inline(always)]
        || softmax_bwd_rows_body(ds, p, t, scale),
    )
}

#[inline(always)]
fn softmax_bwd_rows_body<T: Elem>(ds: &mut [T], p: &[T], t: usize, scale: T) {
    for (drow, prow) in ds.chunks_mut(t).zip(p.chunks(t)) {
        let dp = dot(drow, prow);
        for (d, &pv) in drow.iter_mut().zip(prow) {
            *d = pv * (*d - dp) * scale;
        }
    }
}

/// The forward, keeping what the backward needs; returns `(y, acts)`.
fn run<T: Elem>(w: &Weights<T>, d: &Dims, x: &[T], cx: &Context<T>) -> (Vec<T>, Acts<T>) {
    let (n, hid, hd) = (d.rows(), d.hidden, d.head_dim);
    let qw = d.q_width();
    let [lq, lk, lv, lo] = w.attn;
    let off = d.norm_offset;
    let (h1, r1) = rms_fwd(x, w.ln1, d.eps, off);
    let h1a = input_a(lq, &h1, n, hid);
    let (mut q, z) = match d.output_gate {
        false => (linear_fwd_on(lq, &h1a, n, hid), None),
        true => {
            let (q, z) = split_heads(&linear_fwd_on(lq, &h1a, n, hid), hd);
            (q, Some(z))
        }
    };
    let mut k = linear_fwd_on(lk, &h1a, n, hid);
    let v = linear_fwd_on(lv, &h1a, n, hid);
    drop(h1a);
    let qk_pre = w.qk_norm.map(|(qn, kn)| {
        // rms_fwd's rows are the chunks of its weight's width: one per (token, head).
        let (qh, rq) = rms_fwd(&q, qn, d.eps, off);
        let (kh, rk) = rms_fwd(&k, kn, d.eps, off);
        QkPre {
            q: std::mem::replace(&mut q, qh),
            k: std::mem::replace(&mut k, kh),
            rq,
            rk,
        }
    });
    rope(&mut q, qw, (hd, d.rotary_dim), cx, false);
    rope(&mut k, d.kv_width(), (hd, d.rotary_dim), cx, false);
    let mut acts = Acts {
        r1,
        h1,
        q,
        k,
        qk_pre,
        sandwich: None,
        v,
        a: Vec::new(),
        gate: None,
        x2: Vec::new(),
        r2: Vec::new(),
        h2: Vec::new(),
        mlp: MlpActs::Dense {
            gate: Vec::new(),
            up: Vec::new(),
        },
    };
    let mut a = attention_fwd(d, &acts, cx);
    // The output gate: a ← a ⊙ σ(z), the ungated output kept for backward.
    acts.gate = z.map(|z| {
        let pre = a.clone();
        par_zip(&mut a, &z, |av, zv| av * sigmoid(zv));
        GateActs { z, pre }
    });
    let ao = linear_fwd(lo, &a, n, qw);
    let (mut x2, ao_ra) = match w.sandwich {
        Some((pa, _)) => {
            let (an, ra) = rms_fwd(&ao, pa, d.eps, off);
            (an, Some((ao, ra)))
        }
        None => (ao, None),
    };
    par_zip(&mut x2, x, |o, xv| o + xv);
    let (h2, r2) = rms_fwd(&x2, w.ln2, d.eps, off);
    let (mut y, mlp) = match &w.mlp {
        Ffn::Dense([lg, lu, ld]) => {
            let h2a = input_a(*lg, &h2, n, hid);
            let gate = linear_fwd_on(*lg, &h2a, n, hid);
            let up = linear_fwd_on(*lu, &h2a, n, hid);
            drop(h2a);
            let act = gated(&gate, &up, d.gelu);
            (
                linear_fwd(*ld, &act, n, d.inter),
                MlpActs::Dense { gate, up },
            )
        }
        Ffn::Experts(m) => {
            let (y, acts) = moe_fwd(m, d, &h2);
            (y, MlpActs::Experts(acts))
        }
    };
    if let (Some((_, pf)), Some((attn, ra))) = (w.sandwich, ao_ra) {
        let (yn, rm) = rms_fwd(&y, pf, d.eps, off);
        let mlp = std::mem::replace(&mut y, yn);
        acts.sandwich = Some(SandwichPre { attn, ra, mlp, rm });
    }
    par_zip(&mut y, &x2, |o, xv| o + xv);
    acts.a = a;
    acts.x2 = x2;
    acts.r2 = r2;
    acts.h2 = h2;
    acts.mlp = mlp;
    (y, acts)
}

/// The attention's output `a = P·v` `[rows, heads·hd]` from the rotated queries and keys and
/// the values in `acts`, per (attention block, KV head): each task writes its own heads'
/// columns of its own rows.
fn attention_fwd<T: Elem>(d: &Dims, acts: &Acts<T>, cx: &Context<T>) -> Vec<T> {
    let (n, hd, rep, qw) = (d.rows(), d.head_dim, d.heads / d.kv_heads, d.q_width());
    let kw = d.kv_width();
    let mut a = vec![T::zero(); n * qw];
    let blks = blocks(d, cx);
    let parts: Vec<(usize, usize, Vec<T>)> = (0..blks.len() * d.kv_heads)
        .into_par_iter()
        .map(|task| {
            let (bi, g) = (task / d.kv_heads, task % d.kv_heads);
            let blk = &blks[bi];
            let (t, kn) = (blk.t, blk.keys());
            let (mut kb, mut vb) = (Vec::new(), Vec::new());
            let kk = key_rows(&acts.k, kw, blk, (g, hd), &mut kb); // [kn, hd]
            let vv = key_rows(&acts.v, kw, blk, (g, hd), &mut vb); // [kn, hd]
            let mut p = vec![T::zero(); rep * t * kn];
            probs(d, acts, blk, g, kk, &mut p);
            let mut out = vec![T::zero(); rep * t * hd]; // [rep, t, hd]
            for j in 0..rep {
                gemm_mixed(
                    d.bf16,
                    &mut out[j * t * hd..][..t * hd],
                    t,
                    hd,
                    kn,
                    &p[j * t * kn..][..t * kn],
                    kn,
                    1,
                    vv.0,
                    vv.1,
                    1,
                    false,
                    Par::None,
                );
            }
            (bi, g, out)
        })
        .collect();
    for (bi, g, out) in parts {
        let (start, t) = (blks[bi].start, blks[bi].t);
        for j in 0..rep {
            let h = g * rep + j;
            for i in 0..t {
                a[(start + i) * qw + h * hd..][..hd]
                    .copy_from_slice(&out[(j * t + i) * hd..][..hd]);
            }
        }
    }
    a
}

/// Checks the slices against the sizes, so that a mismatch is an error, not an out-of-bounds.
fn check<T: Elem>(w: &Weights<T>, d: &Dims, x: &[T], cx: &Context<T>) -> Result<()> {
    let (n, hid) = (d.rows(), d.hidden);
    let (qw, kw, it) = (d.q_width(), d.kv_width(), d.inter);
    let qp = if d.output_gate { 2 * qw } else { qw };
    let mut shapes = vec![(qp, hid), (kw, hid), (kw, hid), (hid, qw)];
    let mlps = match &w.mlp {
        Ffn::Dense(_) => 1,
        Ffn::Experts(m) => m.experts.len(),
    };
    for _ in 0..mlps {
        shapes.extend([(it, hid), (it, hid), (hid, it)]);
    }
    if let Ffn::Experts(Moe {
        shared: Some(([lg, ..], _)),
        ..
    }) = &w.mlp
    {
        let si = lg.w.len() / hid.max(1);
        shapes.extend([(si, hid), (si, hid), (hid, si), (1, hid)]);
    }
    let lins: Vec<Lin<T>> = w.attn.iter().copied().chain(w.mlp.lins()).collect();
    let rd = d.rotary_dim;
    let mut ok = rd.is_multiple_of(2)
        && rd > 0
        && rd <= d.head_dim
        && w.qk_norm
            .is_none_or(|(q, k)| q.len() == d.head_dim && k.len() == d.head_dim)
        && d.kv_heads > 0
        && d.heads.is_multiple_of(d.kv_heads)
        && w.ln1.len() == hid
        && w.ln2.len() == hid
        && w.sandwich
            .is_none_or(|(a, m)| a.len() == hid && m.len() == hid)
        && x.len() == n * hid
        && cx.cos.len() == n * rd
        && cx.sin.len() == n * rd
        && match cx.attn {
            Attn::Bias(b) => b.len() == d.batch * d.seq * d.seq,
            Attn::Packed(segs) => d.batch == 1 && check_segments(segs, n).is_ok(),
        }
        && match &w.mlp {
            Ffn::Dense(_) => true,
            Ffn::Experts(m) => {
                m.router.len() == m.experts.len() * hid
                    && m.top_k >= 1
                    && m.top_k <= m.experts.len()
            }
        };
    for (l, (o, i)) in lins.iter().zip(shapes) {
        ok &= l.w.len() == o * i && l.b.is_none_or(|b| b.len() == o);
        if let Some(ad) = &l.ad {
            let r = ad.a.len() / i.max(1);
            ok &= r > 0 && ad.a.len() == r * i && ad.b.len() == o * r;
        }
    }
    if !ok {
        candle_core::bail!("fused decoder layer: weights or inputs do not match {d:?}");
    }
    Ok(())
}

/// A layer of experts' router logits `[rows, experts]` from the forward's activations.
pub(super) fn router_logits<T>(acts: &Acts<T>) -> Option<&[T]> {
    match &acts.mlp {
        MlpActs::Experts(a) => Some(&a.logits),
        MlpActs::Dense { .. } => None,
    }
}

/// The layer's output `y [rows, hidden]`.
pub(super) fn forward<T: Elem>(
    w: &Weights<T>,
    d: &Dims,
    x: &[T],
    cx: &Context<T>,
) -> Result<Vec<T>> {
    check(w, d, x, cx)?;
    Ok(run(w, d, x, cx).0)
}

/// The layer's output and the activations its backward needs (training without recomputation).
pub(super) fn forward_keep<T: Elem>(
    w: &Weights<T>,
    d: &Dims,
    x: &[T],
    cx: &Context<T>,
) -> Result<(Vec<T>, Acts<T>)> {
    check(w, d, x, cx)?;
    Ok(run(w, d, x, cx))
}

/// The gradient of the input and of every weight from the output's gradient `gy [rows, hidden]`,
/// with the activations kept by [`forward_keep`] or, without them, recomputed first (the same
/// arithmetic either way, so both give the same bits).
///
/// `glogits` `[rows, experts]`: the gradient of a layer of experts' router logits where the
/// loss reads them (the router's load-balancing loss).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<T: Elem>(
    w: &Weights<T>,
    d: &Dims,
    x: &[T],
    cx: &Context<T>,
    gy: &[T],
    kept: Option<Acts<T>>,
    glogits: Option<&[T]>,
) -> Result<(Vec<T>, Grads<T>)> {
    check(w, d, x, cx)?;
    if gy.len() != x.len() {
        candle_core::bail!(
            "fused decoder layer: output gradient has {} values, not {}",
            gy.len(),
            x.len()
        );
    }
    let acts = match kept {
        Some(a) if a.h1.len() == x.len() => a,
        Some(_) => {
            candle_core::bail!("fused decoder layer: kept activations are for another input")
        }
        None => run(w, d, x, cx).1,
    };
    let (n, hid, hd) = (d.rows(), d.hidden, d.head_dim);
    let (qw, kw) = (d.q_width(), d.kv_width());
    let [lq, lk, lv, lo] = w.attn;
    let off = d.norm_offset;
    // MLP: y = x2 + mlp(h2) (Gemma: x2 + rms(mlp(h2))·pf).
    let (dmlp, dpf) = match (w.sandwich, &acts.sandwich) {
        (Some((_, pf)), Some(sw)) => {
            let mut dm = vec![T::zero(); n * hid];
            let g = rms_bwd(&sw.mlp, &sw.rm, pf, gy, &mut dm, off);
            (Some(dm), Some(g))
        }
        _ => (None, None),
    };
    let mut dh2 = vec![T::zero(); n * hid];
    let dy = dmlp.as_deref().unwrap_or(gy);
    let (glin_mlp, grouter) = match (&w.mlp, &acts.mlp) {
        (Ffn::Dense(l), MlpActs::Dense { gate, up }) => {
            let g = gated_mlp_bwd(*l, d.inter, &acts.h2, gate, up, d.gelu, dy, &mut dh2);
            (Vec::from(g), None)
        }
        (Ffn::Experts(m), MlpActs::Experts(a)) => {
            if glogits.is_some_and(|g| g.len() != a.logits.len()) {
                candle_core::bail!("fused decoder layer: router logits' gradient of another shape");
            }
            moe_bwd(m, d, &acts.h2, a, dy, glogits, &mut dh2)
        }
        _ => candle_core::bail!("fused decoder layer: kept activations are for another MLP"),
    };
    drop(dmlp);
    let mut dx2 = gy.to_vec();
    let dln2 = rms_bwd(&acts.x2, &acts.r2, w.ln2, &dh2, &mut dx2, off);
    drop(dh2);
    // Attention output: x2 = x + a·Woᵀ (Gemma: x + rms(a·Woᵀ)·pa).
    let (dao, dpa) = match (w.sandwich, &acts.sandwich) {
        (Some((pa, _)), Some(sw)) => {
            let mut da = vec![T::zero(); n * hid];
            let g = rms_bwd(&sw.attn, &sw.ra, pa, &dx2, &mut da, off);
            (Some(da), Some(g))
        }
        _ => (None, None),
    };
    let ab = input_b(&[lo], &acts.a, n, qw);
    let (mut da, go) = linear_bwd_new(lo, &ab, dao.as_deref().unwrap_or(&dx2), n, qw);
    drop(ab);
    drop(dao);
    // Through the output gate: ∂z, and ∂a of the ungated output in place.
    let dz = acts.gate.as_ref().map(|g| gate_bwd(&mut da, &g.z, &g.pre));
    let (dq, dk, dv) = attention_bwd(d, &acts, cx, &da);
    drop(da);
    let (mut dq, mut dk) = (dq, dk);
    rope(&mut dq, qw, (hd, d.rotary_dim), cx, true);
    rope(&mut dk, kw, (hd, d.rotary_dim), cx, true);
    let dqk_norm = match (w.qk_norm, &acts.qk_pre) {
        (Some((qn, kn)), Some(pre)) => {
            let (mut dqp, mut dkp) = (vec![T::zero(); dq.len()], vec![T::zero(); dk.len()]);
            let gqn = rms_bwd(&pre.q, &pre.rq, qn, &dq, &mut dqp, off);
            let gkn = rms_bwd(&pre.k, &pre.rk, kn, &dk, &mut dkp, off);
            (dq, dk) = (dqp, dkp);
            Some((gqn, gkn))
        }
        _ => None,
    };
    // With an output gate, q_proj's output holds each head's queries then its gate values.
    let dq = match dz {
        Some(dz) => join_heads(&dq, &dz, hd),
        None => dq,
    };
    let h1b = input_b(&[lq, lk, lv], &acts.h1, n, hid);
    let (mut dh1, gq) = linear_bwd_new(lq, &h1b, &dq, n, hid);
    let gk = linear_bwd(lk, &h1b, &dk, n, hid, &mut dh1);
    let gv = linear_bwd(lv, &h1b, &dv, n, hid, &mut dh1);
    drop(h1b);
    let mut dx = dx2;
    let dln1 = rms_bwd(x, &acts.r1, w.ln1, &dh1, &mut dx, off);
    Ok((
        dx,
        Grads {
            ln1: dln1,
            ln2: dln2,
            qk_norm: dqk_norm,
            sandwich: dpa.zip(dpf),
            router: grouter,
            lin: [gq, gk, gv, go].into_iter().chain(glin_mlp).collect(),
        },
    ))
}

/// A gated MLP's backward on its input `x` `[m, hidden]` with the forward's gate and up
/// products `[m, inter]`, from the output's gradient `dy` `[m, hidden]`: adds `∂x` into `dx`
/// and returns the gradients of gate, up and down.
#[allow(clippy::too_many_arguments)]
fn gated_mlp_bwd<T: Elem>(
    [lg, lu, ld]: [Lin<T>; 3],
    inter: usize,
    x: &[T],
    gate: &[T],
    up: &[T],
    gelu: bool,
    dy: &[T],
    dx: &mut [T],
) -> [LinGrad<T>; 3] {
    let hid = lg.w.len() / inter;
    let m = gate.len() / inter;
    let act = gated(gate, up, gelu);
    let (mut dact, gd) = linear_bwd_new(ld, &input_b(&[ld], &act, m, inter), dy, m, inter);
    drop(act);
    // dact → (dgate, dup): dup = dact·f(z), then dact becomes dgate in place.
    let dup;
    if gelu {
        dup = par_map2(&dact, gate, |dg, z| dg * gelu_tanh(z).0);
        par_zip2(&mut dact, gate, up, |dg, z, u| dg * u * gelu_tanh(z).1);
    } else {
        dup = par_map2(&dact, gate, |dg, z| dg * z * sigmoid(z));
        par_zip2(&mut dact, gate, up, |dg, z, u| {
            let s = sigmoid(z);
            dg * u * s * (T::one() + z * (T::one() - s))
        });
    }
    let xb = input_b(&[lg, lu], x, m, hid);
    let gg = linear_bwd(lg, &xb, &dact, m, hid, dx);
    let gu = linear_bwd(lu, &xb, &dup, m, hid, dx);
    [gg, gu, gd]
}

/// Rows `rows` of `m` (`width` values each), in that order.
fn gather_rows<T: Copy>(m: &[T], rows: &[usize], width: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&m[r * width..][..width]);
    }
    out
}

/// A layer of experts on `h` `[rows, hidden]`:
///
/// ```text
/// p = softmax(h·Rᵀ)                      [rows, experts]
/// top-k experts per row, most probable first (equal probabilities: lower index first)
/// w_j = p_j (norm_topk_prob: p_j / Σ_chosen p)
/// y = Σ_j w_j · down(silu(gate(h)) ⊙ up(h))_{expert j}
/// ```
///
/// each expert computed on the rows routed to it only; returns `y` and what the backward needs.
fn moe_fwd<T: Elem>(m: &Moe<T>, d: &Dims, h: &[T]) -> (Vec<T>, MoeActs<T>) {
    let (n, hid, k) = (d.rows(), d.hidden, m.top_k);
    let e = m.experts.len();
    let mut logits = vec![T::zero(); n * e];
    gemm_mixed(
        false,
        &mut logits,
        n,
        e,
        hid,
        h,
        hid,
        1,
        m.router,
        1,
        hid,
        false,
        Par::Rayon,
    );
    let mut probs = logits.clone();
    let mut chosen = vec![0usize; n * k];
    let mut weights = vec![T::zero(); n * k];
    probs
        .par_chunks_mut(e)
        .zip(chosen.par_chunks_mut(k))
        .zip(weights.par_chunks_mut(k))
        .for_each(|((p, ch), wt)| route_row(p, ch, wt, m.norm_topk_prob));
    let mut groups: Vec<(Vec<usize>, Vec<usize>)> = vec![(Vec::new(), Vec::new()); e];
    for (s, &c) in chosen.iter().enumerate() {
        groups[c].0.push(s / k);
        groups[c].1.push(s);
    }
    let mut y = vec![T::zero(); n * hid];
    let mut per = Vec::with_capacity(e);
    for (&[lg, lu, ld], (tokens, slots)) in m.experts.iter().zip(groups) {
        let rows = tokens.len();
        if rows == 0 {
            per.push(ExpertActs {
                tokens,
                slots,
                gate: Vec::new(),
                up: Vec::new(),
                y: Vec::new(),
            });
            continue;
        }
        let xe = gather_rows(h, &tokens, hid); // [m, hidden]
        let xa = input_a(lg, &xe, rows, hid);
        let gate = linear_fwd_on(lg, &xa, rows, hid);
        let up = linear_fwd_on(lu, &xa, rows, hid);
        drop(xa);
        let act = gated(&gate, &up, false);
        let ye = linear_fwd(ld, &act, rows, d.inter); // [m, hidden]
        for (i, (&t, &s)) in tokens.iter().zip(&slots).enumerate() {
            let wv = weights[s];
            let (out, src) = (&mut y[t * hid..][..hid], &ye[i * hid..][..hid]);
            for (o, &v) in out.iter_mut().zip(src) {
                *o += wv * v;
            }
        }
        per.push(ExpertActs {
            tokens,
            slots,
            gate,
            up,
            y: ye,
        });
    }
    // The shared expert on every token, scaled by the sigmoid of its gate's logit.
    let shared = m.shared.as_ref().map(|([lg, lu, ld], lgate)| {
        let ha = input_a(*lg, h, n, hid);
        let logit = linear_fwd_on(*lgate, &ha, n, hid); // [n, 1]
        let gate = linear_fwd_on(*lg, &ha, n, hid);
        let up = linear_fwd_on(*lu, &ha, n, hid);
        drop(ha);
        let ys = linear_fwd(*ld, &gated(&gate, &up, false), n, gate.len() / n.max(1));
        y.par_chunks_mut(hid)
            .zip(ys.par_chunks(hid))
            .zip(logit.par_iter())
            .for_each(|((o, v), &z)| {
                let s = sigmoid(z);
                for (o, &v) in o.iter_mut().zip(v) {
                    *o += s * v;
                }
            });
        SharedActs {
            logit,
            gate,
            up,
            y: ys,
        }
    });
    let acts = MoeActs {
        logits,
        probs,
        chosen,
        weights,
        per,
        shared,
    };
    (y, acts)
}

/// One token's routing from its router logits `p` (`[experts]`, overwritten with their softmax):
/// its `chosen.len()` most probable experts, most probable first (equal probabilities: lower
/// index first, as the composition's `block::route`), into `chosen`, and their probabilities
/// (renormalised to sum 1 with `norm_topk_prob`) into `weights`. Shared by the training layer and
/// the decode engine, so both route alike.
pub(super) fn route_row<T: Elem>(
    p: &mut [T],
    chosen: &mut [usize],
    weights: &mut [T],
    norm_topk_prob: bool,
) {
    let mx = max(p);
    for v in p.iter_mut() {
        *v = (*v - mx).exp();
    }
    let inv = sum(p).recip();
    for v in p.iter_mut() {
        *v *= inv;
    }
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| {
        let (pa, pb) = (WithDType::to_f64(p[a]), WithDType::to_f64(p[b]));
        pb.total_cmp(&pa).then(a.cmp(&b))
    });
    chosen.copy_from_slice(&order[..chosen.len()]);
    for (w, &c) in weights.iter_mut().zip(chosen.iter()) {
        *w = p[c];
    }
    if norm_topk_prob {
        let s = weights.iter().fold(T::zero(), |s, &v| s + v);
        for w in weights.iter_mut() {
            *w /= s;
        }
    }
}

/// [`moe_fwd`]'s backward from `dy` `[rows, hidden]`: adds `∂h` into `dh`; returns each
/// expert's (gate, up, down) gradients and the router's (where it trains).
///
/// ```text
/// ∂w_j = dy·y_j        (y_j: expert j's output before its weight)
/// norm_topk_prob: ∂p_j = (∂w_j − Σ_i ∂w_i·w_i) / Σ_chosen p, else ∂p_j = ∂w_j (0 off the chosen)
/// ∂logits = p ⊙ (∂p − Σ p⊙∂p) (+ `glogits`),   ∂R = ∂logitsᵀ·h,   ∂h += ∂logits·R
/// ```
fn moe_bwd<T: Elem>(
    m: &Moe<T>,
    d: &Dims,
    h: &[T],
    a: &MoeActs<T>,
    dy: &[T],
    glogits: Option<&[T]>,
    dh: &mut [T],
) -> (Vec<LinGrad<T>>, Option<Vec<T>>) {
    let (n, hid, k) = (d.rows(), d.hidden, m.top_k);
    let e = m.experts.len();
    let mut dw = vec![T::zero(); n * k];
    let mut grads = Vec::with_capacity(3 * e);
    for (&lins, ea) in m.experts.iter().zip(&a.per) {
        let rows = ea.tokens.len();
        if rows == 0 {
            // No token chose the expert: it gets no gradient.
            grads.extend([LinGrad::none(), LinGrad::none(), LinGrad::none()]);
            continue;
        }
        // The output's gradient at the expert's rows, times their routing weights.
        let mut dye = gather_rows(dy, &ea.tokens, hid); // [m, hidden]
        for (i, &s) in ea.slots.iter().enumerate() {
            let row = &mut dye[i * hid..][..hid];
            dw[s] = dot(row, &ea.y[i * hid..][..hid]);
            let wv = a.weights[s];
            row.iter_mut().for_each(|v| *v *= wv);
        }
        let xe = gather_rows(h, &ea.tokens, hid);
        let mut dxe = vec![T::zero(); rows * hid];
        let g = gated_mlp_bwd(lins, d.inter, &xe, &ea.gate, &ea.up, false, &dye, &mut dxe);
        for (i, &t) in ea.tokens.iter().enumerate() {
            let (out, src) = (&mut dh[t * hid..][..hid], &dxe[i * hid..][..hid]);
            for (o, &v) in out.iter_mut().zip(src) {
                *o += v;
            }
        }
        grads.extend(g);
    }
    if let (Some(shared), Some(sa)) = (&m.shared, &a.shared) {
        grads.extend(shared_bwd(*shared, sa, h, dy, dh));
    }
    let mut dl = vec![T::zero(); n * e]; // ∂logits [rows, experts]
    dl.par_chunks_mut(e).enumerate().for_each(|(r, dlr)| {
        let p = &a.probs[r * e..][..e];
        let (ch, dwr, wr) = (
            &a.chosen[r * k..][..k],
            &dw[r * k..][..k],
            &a.weights[r * k..][..k],
        );
        let (shift, inv) = if m.norm_topk_prob {
            let s = ch.iter().fold(T::zero(), |s, &c| s + p[c]);
            let c = dwr.iter().zip(wr).fold(T::zero(), |s, (&g, &w)| s + g * w);
            (c, s.recip())
        } else {
            (T::zero(), T::one())
        };
        for (&c, &g) in ch.iter().zip(dwr) {
            dlr[c] = (g - shift) * inv;
        }
        let pd = dot(p, dlr);
        for (v, &pv) in dlr.iter_mut().zip(p) {
            *v = pv * (*v - pd);
        }
        // The logits' own gradient (the load-balancing loss reads them).
        if let Some(g) = glogits {
            for (v, &gv) in dlr.iter_mut().zip(&g[r * e..][..e]) {
                *v += gv;
            }
        }
    });
    let gr = m.train_router.then(|| {
        let mut g = vec![T::zero(); e * hid];
        gemm_mixed(
            false,
            &mut g,
            e,
            hid,
            n,
            &dl,
            1,
            e,
            h,
            hid,
            1,
            false,
            Par::Rayon,
        );
        g
    });
    gemm_mixed(
        false,
        dh,
        n,
        hid,
        e,
        &dl,
        e,
        1,
        m.router,
        hid,
        1,
        true,
        Par::Rayon,
    );
    (grads, gr)
}

/// The shared expert's backward on the layer of experts' input `h` `[rows, hidden]` from the
/// output's gradient `dy`: ∂ of its output `dy·σ(z)`, of its gate's logit `σ′(z)·Σ dy ⊙ y_s`;
/// adds `∂h` into `dh` and returns the gradients of its gate, up, down and gate projection.
fn shared_bwd<T: Elem>(
    ([lg, lu, ld], lgate): ([Lin<T>; 3], Lin<T>),
    sa: &SharedActs<T>,
    h: &[T],
    dy: &[T],
    dh: &mut [T],
) -> [LinGrad<T>; 4] {
    let n = sa.logit.len();
    let hid = h.len() / n.max(1);
    let mut dys = dy.to_vec();
    let mut dz = vec![T::zero(); n];
    dys.par_chunks_mut(hid)
        .zip(sa.y.par_chunks(hid))
        .zip(sa.logit.par_iter().zip(dz.par_iter_mut()))
        .for_each(|((g, v), (&z, dz))| {
            let s = sigmoid(z);
            *dz = dot(g, v) * s * (T::one() - s);
            g.iter_mut().for_each(|x| *x *= s);
        });
    let si = sa.gate.len() / n.max(1);
    let [gg, gu, gd] = gated_mlp_bwd([lg, lu, ld], si, h, &sa.gate, &sa.up, false, &dys, dh);
    let hb = input_b(&[lgate], h, n, hid);
    [gg, gu, gd, linear_bwd(lgate, &hb, &dz, n, hid, dh)]
}

/// One (attention block, KV head)'s gradients: block, head, dq̃ of its `rep` heads
/// `[rep, t, hd]`, dk̃ and dv of the keys it reads `[keys, hd]`.
type Part<T> = (usize, usize, Vec<T>, Vec<T>, Vec<T>);

/// Gradients of the rotated queries and keys and of the values from `da [rows, heads·hd]`.
/// A shared prefix's keys and values gather the gradients of every block that reads them.
fn attention_bwd<T: Elem>(
    d: &Dims,
    acts: &Acts<T>,
    cx: &Context<T>,
    da: &[T],
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (n, hd, rep) = (d.rows(), d.head_dim, d.heads / d.kv_heads);
    let (qw, kw) = (d.q_width(), d.kv_width());
    let scale: T = c(d.attn_scale);
    let blks = blocks(d, cx);
    let parts: Vec<Part<T>> = (0..blks.len() * d.kv_heads)
        .into_par_iter()
        .map(|task| {
            let (bi, g) = (task / d.kv_heads, task % d.kv_heads);
            let blk = &blks[bi];
            let (r0, t, kn) = (blk.start, blk.t, blk.keys());
            let (mut kb, mut vb) = (Vec::new(), Vec::new());
            let kk = key_rows(&acts.k, kw, blk, (g, hd), &mut kb); // [kn, hd]
            let vv = key_rows(&acts.v, kw, blk, (g, hd), &mut vb); // [kn, hd]
            let mut p = vec![T::zero(); rep * t * kn];
            probs(d, acts, blk, g, kk, &mut p);
            let mut dq = vec![T::zero(); rep * t * hd]; // [rep, t, hd]
            let mut dk = vec![T::zero(); kn * hd];
            let mut dv = vec![T::zero(); kn * hd];
            let mut ds = vec![T::zero(); t * kn];
            for j in 0..rep {
                let h = g * rep + j;
                let pj = &p[j * t * kn..][..t * kn];
                let dao = &da[r0 * qw + h * hd..];
                let qq = &acts.q[r0 * qw + h * hd..];
                // dv += Pᵀ·dA
                gemm_mixed(
                    d.bf16,
                    &mut dv,
                    kn,
                    hd,
                    t,
                    pj,
                    1,
                    kn,
                    dao,
                    qw,
                    1,
                    j > 0,
                    Par::None,
                );
                // dP = dA·vᵀ
                gemm_mixed(
                    d.bf16,
                    &mut ds,
                    t,
                    kn,
                    hd,
                    dao,
                    qw,
                    1,
                    vv.0,
                    1,
                    vv.1,
                    false,
                    Par::None,
                );
                softmax_bwd_rows(&mut ds, pj, kn, scale);
                // dq̃ = dS·k̃ (scale folded into dS); dk̃ += dSᵀ·q̃
                gemm_mixed(
                    d.bf16,
                    &mut dq[j * t * hd..][..t * hd],
                    t,
                    hd,
                    kn,
                    &ds,
                    kn,
                    1,
                    kk.0,
                    kk.1,
                    1,
                    false,
                    Par::None,
                );
                gemm_mixed(
                    d.bf16,
                    &mut dk,
                    kn,
                    hd,
                    t,
                    &ds,
                    1,
                    kn,
                    qq,
                    qw,
                    1,
                    j > 0,
                    Par::None,
                );
            }
            (bi, g, dq, dk, dv)
        })
        .collect();
    scatter_grads(d, &blks, parts, n)
}

/// The per-(block, KV head) gradients of [`attention_bwd`] in place: dq̃ at each block's query
/// rows; dk̃ and dv added at the rows of the keys each block read (a shared prefix's rows gather
/// every block that continues it).
fn scatter_grads<T: Elem>(
    d: &Dims,
    blks: &[Block<T>],
    parts: Vec<Part<T>>,
    n: usize,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let (hd, rep) = (d.head_dim, d.heads / d.kv_heads);
    let (qw, kw) = (d.q_width(), d.kv_width());
    let mut dq = vec![T::zero(); n * qw];
    let mut dk = vec![T::zero(); n * kw];
    let mut dv = vec![T::zero(); n * kw];
    for (bi, g, pq, pk, pv) in parts {
        let blk = &blks[bi];
        let (r0, t) = (blk.start, blk.t);
        for i in 0..t {
            for j in 0..rep {
                let h = g * rep + j;
                dq[(r0 + i) * qw + h * hd..][..hd].copy_from_slice(&pq[(j * t + i) * hd..][..hd]);
            }
        }
        // Key i of the block: prefix rows first, then the block's own.
        let (p0, pl) = blk.prefix.unwrap_or((0, 0));
        for i in 0..blk.keys() {
            let row = if i < pl { p0 + i } else { r0 + i - pl };
            for (x, y) in dk[row * kw + g * hd..][..hd]
                .iter_mut()
                .zip(&pk[i * hd..][..hd])
            {
                *x += *y;
            }
            for (x, y) in dv[row * kw + g * hd..][..hd]
                .iter_mut()
                .zip(&pv[i * hd..][..hd])
            {
                *x += *y;
            }
        }
    }
    (dq, dk, dv)
}
