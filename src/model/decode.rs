//! Fast no-grad decoding on the CPU: the model's weights packed once per generation call in the
//! layout the matrix products want, and one step function that runs a *ragged* batch — each
//! sequence brings its own new tokens (a whole prompt when it enters, one token while it decodes)
//! and its own key/value cache, with no padding anywhere. This is what continuous batching
//! (`rollout::scheduler`) drives.
//!
//! The math is the transformer of `transformer.rs` (same RMSNorm, half-split RoPE, grouped-query
//! attention, SiLU-gated MLP); only the evaluation differs:
//! - weights are stored transposed and concatenated (`[in, out]` row-major; q|k|v in one
//!   product, gate|up in another), so the AVX-512 kernels of `gemm` run on contiguous panels;
//! - products go straight to `gemm` on preallocated buffers, the residual adds fused into them;
//! - attention is a loop per (token, head) over that sequence's cache, in parallel (rayon),
//!   reading the cache in place; only the last new token of each sequence reaches the LM head.
//!
//! f32 and f64 models on the CPU take this path; others use the tensor composition.

use candle_core::{DType, Result, Tensor, WithDType};
use rayon::prelude::*;

use super::block::{Attention, Mixer, Mlp};
use super::config::ModelArgs;
use super::transformer::CausalLm;
use crate::kernels::attend::{attend, Kv};
use crate::kernels::bf16::{self, PackedB};
use crate::kernels::elem::{Bf16, Elem, KvElem};
use crate::kernels::gemm::gemm_strided;
use crate::kernels::simd::{vectorized, Par};
use crate::kernels::storage::Host;
use crate::kernels::team;

#[path = "decode_delta.rs"]
mod delta;
use delta::DeltaMats;

/// What runs on a packed model: [`with_packed`] picks the element types and hands over the
/// model's weights packed for them, so callers (the scheduler) name no element type.
pub trait Decoder {
    type Out;
    /// Runs with `packed` (weights in `T`) and caches of `C` elements.
    fn run<T: Elem, C: KvElem<T>>(self, packed: Packed<T>) -> Result<Self::Out>;
}

/// Runs `d` on `model` packed for decoding, `None` when this path does not serve the model
/// (not the CPU, or not f32/f64: the caller uses the tensor composition). The types: f64
/// models decode in f64; f32 models in f32, with bf16 products ([`CausalLm::bf16_matmuls`])
/// keeping keys and values in bf16 too (half the bytes read per step, as vLLM's bf16 cache).
/// Whether [`with_packed`] serves `model`.
/// DeepSeek-V3's latent attention, DeepSeek's routing (DeepSeek-V3, GLM-4.5) and GPT-OSS's
/// sinks and experts are not packed here: they decode through the composition, whose cache keeps each position's keys
/// and values (DeepSeek-V3: its latent and rope key).
pub fn serves(model: &CausalLm) -> bool {
    crate::kernels::supported(model.device(), model.dtype()) && !model.args.composition_only()
}

pub fn with_packed<D: Decoder>(model: &CausalLm, d: D) -> Option<Result<D::Out>> {
    if !serves(model) {
        return None;
    }
    Some(match model.dtype() {
        DType::F64 => Packed::<f64>::new(model).and_then(|p| d.run::<f64, f64>(p)),
        _ if model.bf16_matmuls() => Packed::<f32>::new(model).and_then(|p| d.run::<f32, Bf16>(p)),
        _ => Packed::<f32>::new(model).and_then(|p| d.run::<f32, f32>(p)),
    })
}

struct Layer<T> {
    ln1: Vec<T>,
    ln2: Vec<T>,
    /// Attention, or a Gated DeltaNet (Qwen3.5 and kin).
    mixer: Mixed<T>,
    /// Gemma's norms of the attention and MLP outputs (`[hidden]` each).
    sandwich: Option<(Vec<T>, Vec<T>)>,
    /// Positions this layer's queries see (sliding-window layers).
    window: Option<usize>,
    /// Whether the layer uses the local RoPE table.
    local_rope: bool,
    /// `[hidden, 2·intermediate]`: gate columns, then up columns (dense layers).
    gate_up: Mat<T>,
    /// `[intermediate, hidden]`.
    down: Mat<T>,
    /// A layer of experts (Qwen3-MoE) instead of `gate_up` / `down`.
    experts: Option<ExpertMats<T>>,
}

/// A layer of experts packed for decoding: the router and each expert's gated MLP.
struct ExpertMats<T> {
    /// `[hidden, experts]`, in the model's dtype (never bf16: the routing is that of the full
    /// forward, whose router product is not mixed).
    router: Mat<T>,
    /// Per expert: `[hidden, 2·moe_intermediate]` (gate, up) and `[moe_intermediate, hidden]`.
    experts: Vec<(Mat<T>, Mat<T>)>,
    top_k: usize,
    norm_topk_prob: bool,
    inter: usize,
    /// A shared expert (Qwen3-Next, Qwen3.5-MoE).
    shared: Option<SharedMats<T>>,
}

/// A shared expert packed: `[hidden, 2·width]` (gate, up), `[width, hidden]`, its gate
/// `[hidden, 1]`, and its width.
struct SharedMats<T> {
    gate_up: Mat<T>,
    down: Mat<T>,
    gate: Mat<T>,
    width: usize,
}

/// A right-hand matrix `[k, n]` of the decode products: row-major in the model's dtype, or
/// packed once into bf16 tiles (`kernels::bf16`) (f32 models with [`CausalLm::bf16_matmuls`]).
enum Mat<T> {
    Plain(Vec<T>),
    Amx(PackedB),
}

impl<T: Elem> Mat<T> {
    /// The right-hand matrix `x·Wᵀ` needs for weights `ws` (`[out_i, in]` each, one `in`) side
    /// by side: `[in, Σ out_i]`. For the bf16 kernel the tiles are packed straight from the
    /// weights stacked as stored (a row copy, then the pack reads the transpose); otherwise
    /// transposed into row-major [`packed_columns`].
    fn from_weights(ws: &[&Tensor], bf16: bool) -> Result<Self> {
        if bf16 && T::DTYPE == DType::F32 {
            // Packed from the weights' own storage where it is f32 and contiguous (a copy
            // otherwise), as the rows of [Σ out_i, in].
            let k = common_inputs(ws)?;
            let ws: Vec<Tensor> = ws
                .iter()
                .map(|w| w.to_dtype(DType::F32)?.contiguous())
                .collect::<Result<_>>()?;
            let refs: Vec<&Tensor> = ws.iter().collect();
            let host = Host::new(&refs)?;
            let parts: Vec<&[f32]> = (0..ws.len())
                .map(|i| host.slice::<f32>(i))
                .collect::<Result<_>>()?;
            return Ok(Mat::Amx(PackedB::from_rows(&parts, k, Par::Rayon)));
        }
        Ok(Mat::Plain(packed_columns(ws)?))
    }

    /// `dst[m, n] (+)= a[m, k] · self`.
    fn apply(&self, dst: &mut [T], a: &[T], m: usize, k: usize, n: usize, acc: bool) {
        match self {
            Mat::Plain(b) => matmul(dst, a, b, m, k, n, acc),
            Mat::Amx(p) => {
                let (a32, d32) = (T::f32s(a), T::f32s_mut(dst));
                let (Some(a32), Some(d32)) = (a32, d32) else {
                    unreachable!("bf16 packs are built for f32 models only")
                };
                bf16::gemm_packed(d32, m, a32, k, 1, p, acc, Par::Rayon);
            }
        }
    }
}

/// A model's weights packed for decoding (a copy: pack again after the weights change).
pub struct Packed<T> {
    args: ModelArgs,
    /// `[vocab, hidden]`.
    embed: Vec<T>,
    layers: Vec<Layer<T>>,
    norm: Vec<T>,
    /// `[hidden, vocab]`.
    out: Mat<T>,
    inv_freq: Vec<f64>,
    /// The sliding layers' own RoPE frequencies (Gemma 3), when they have them.
    inv_freq_local: Option<Vec<f64>>,
}

/// Keys and values of one sequence, per layer `[positions, kv_heads, head_dim]` row-major, so a
/// new position is one contiguous append. Capacity is reserved up front by the scheduler.
/// Elements are `C`: the model's type, or [`Bf16`].
///
/// A sliding-window layer keeps only the positions its future queries can see: once it holds
/// twice its window, the older half is dropped (one copy per `window` steps), so its memory is
/// bounded by the window (or by a longer prompt's prefill) rather than by the sequence.
pub struct SeqCache<C> {
    k: Vec<Vec<C>>,
    v: Vec<Vec<C>>,
    /// Per Gated DeltaNet layer: the last `K − 1` convolution inputs `[K − 1, conv_dim]` and
    /// the recurrent state `[nv, dk, dv]` (empty until the layer first runs; empty for
    /// attention layers).
    conv: Vec<Vec<C>>,
    rec: Vec<Vec<C>>,
    /// Per layer: the position of its first kept row (0 unless a window dropped some).
    first: Vec<usize>,
    /// Per layer: its sliding window, `None` for full attention.
    window: Vec<Option<usize>>,
    len: usize,
}

impl<C: Copy> SeqCache<C> {
    /// An empty cache with room for `positions` (no reallocation up to there; a sliding layer
    /// reserves what it keeps at most, twice its window).
    pub fn with_capacity(args: &ModelArgs, positions: usize) -> Self {
        let row = args.num_key_value_heads * args.head_dim;
        let window: Vec<Option<usize>> = (0..args.num_hidden_layers)
            .map(|i| args.window(i))
            .collect();
        let mk = || {
            window
                .iter()
                .enumerate()
                .map(|(i, w)| match args.is_linear(i) {
                    true => Vec::new(),
                    false => {
                        Vec::with_capacity(row * w.map_or(positions, |w| positions.min(2 * w)))
                    }
                })
                .collect()
        };
        let none = || vec![Vec::new(); args.num_hidden_layers];
        Self {
            k: mk(),
            v: mk(),
            conv: none(),
            rec: none(),
            first: vec![0; args.num_hidden_layers],
            window,
            len: 0,
        }
    }

    /// Positions held (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes one position takes over all layers (keys and values).
    pub fn bytes_per_position(args: &ModelArgs) -> usize {
        kv_bytes_per_position(args, std::mem::size_of::<C>())
    }

    /// The most bytes a sequence's cache holds over its life: `prompt` positions prefilled at
    /// once, `total` in the end. Full layers hold `total`; a sliding layer at most twice its
    /// window (or the prompt, when longer).
    pub fn bytes_needed(args: &ModelArgs, prompt: usize, total: usize) -> usize {
        let elem = std::mem::size_of::<C>();
        let row = 2 * args.num_key_value_heads * args.head_dim * elem;
        let state = args
            .linear_attn
            .as_ref()
            .map_or(0, |la| DeltaMats::<f32>::state_elems(la) * elem);
        (0..args.num_hidden_layers)
            .map(|i| match (args.is_linear(i), args.window(i)) {
                (true, _) => state,
                (false, Some(w)) => total.min(prompt.max(2 * w)) * row,
                (false, None) => total * row,
            })
            .sum::<usize>()
    }

    /// Becomes a copy of `other` (a cache of the same model), keeping this cache's reserved
    /// room.
    fn copy_from(&mut self, other: &SeqCache<C>) {
        let pairs = [
            (&mut self.k, &other.k),
            (&mut self.v, &other.v),
            (&mut self.conv, &other.conv),
            (&mut self.rec, &other.rec),
        ];
        for (mine, theirs) in pairs {
            for (m, t) in mine.iter_mut().zip(theirs) {
                m.clear();
                m.extend_from_slice(t);
            }
        }
        self.first.clone_from(&other.first);
        self.len = other.len;
    }

    /// Rows layer `layer` keeps (its memory, in positions).
    pub fn kept(&self, layer: usize) -> usize {
        self.len - self.first[layer]
    }

    /// Drops the rows of sliding layer `layer` that no later query can see, once it holds
    /// twice its window (keeping the last `window`).
    fn trim(&mut self, layer: usize, width: usize) {
        let Some(w) = self.window[layer] else {
            return;
        };
        let kept = self.len - self.first[layer];
        if kept >= 2 * w {
            let drop = kept - w;
            self.k[layer].drain(..drop * width);
            self.v[layer].drain(..drop * width);
            self.first[layer] += drop;
        }
    }
}

/// Key/value bytes one position takes over all layers, for elements of `elem_bytes` (any cache
/// layout: the packed path's per-sequence caches and the composition's padded ones; a latent
/// attention model's compressed cache).
pub fn kv_bytes_per_position(args: &ModelArgs, elem_bytes: usize) -> usize {
    let attention = (0..args.num_hidden_layers)
        .filter(|&i| !args.is_linear(i))
        .count();
    if let Some(m) = &args.mla {
        // Latent attention keeps one latent and one rope key per position and layer.
        return attention * (m.kv_lora_rank + m.qk_rope_head_dim) * elem_bytes;
    }
    2 * attention * args.num_key_value_heads * args.head_dim * elem_bytes
}

/// The inputs (`in`) that the weights `[out_i, in]` share; an error when they differ or a
/// weight is not a matrix (0 for none).
fn common_inputs(ws: &[&Tensor]) -> Result<usize> {
    let inp = ws.first().map(|w| w.dim(1)).transpose()?.unwrap_or(0);
    for w in ws {
        let (_, i) = w.dims2()?;
        if i != inp {
            candle_core::bail!("packing weights with {i} and {inp} inputs side by side");
        }
    }
    Ok(inp)
}

/// Weights `[out_i, in]` (as stored) side by side as the columns of one `[in, Σ out_i]`
/// row-major matrix: each transposed into its own column range. Blocked over 64 input rows
/// per task, so each task's destination stays in cache (candle's strided copy of a transposed
/// view took seconds per model).
fn packed_columns<T: Elem>(ws: &[&Tensor]) -> Result<Vec<T>> {
    let mut srcs = Vec::with_capacity(ws.len());
    let mut outs = Vec::with_capacity(ws.len());
    let inp = common_inputs(ws)?;
    for w in ws {
        srcs.push(flat::<T>(w)?);
        outs.push(w.dim(0)?);
    }
    let total: usize = outs.iter().sum();
    let mut dst = vec![T::zero(); inp * total];
    if total == 0 {
        return Ok(dst);
    }
    const ROWS: usize = 64;
    dst.par_chunks_mut(ROWS * total)
        .enumerate()
        .for_each(|(block, chunk)| {
            let (i0, rows) = (block * ROWS, chunk.len() / total);
            let mut col0 = 0;
            for (src, &out) in srcs.iter().zip(&outs) {
                for o in 0..out {
                    let from = &src[o * inp + i0..][..rows];
                    for (r, &v) in from.iter().enumerate() {
                        chunk[r * total + col0 + o] = v;
                    }
                }
                col0 += out;
            }
        });
    Ok(dst)
}

/// Rows `idx` of `w` `[out, in]` (a weight's rows regrouped at packing).
fn rows(w: &Tensor, idx: Vec<u32>) -> Result<Tensor> {
    let n = idx.len();
    w.index_select(&Tensor::from_vec(idx, n, w.device())?, 0)
}

fn flat<T: Elem>(w: &Tensor) -> Result<Vec<T>> {
    w.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1()
}

/// `dst[m, n] (+)= a[m, k] · b[k, n]`, all row-major and contiguous; `acc` adds to `dst`.
fn matmul<T: Elem>(dst: &mut [T], a: &[T], b: &[T], m: usize, k: usize, n: usize, acc: bool) {
    gemm_strided(dst, m, n, k, a, k, 1, b, n, 1, acc, Par::Rayon);
}

/// Elements below which a decode step's element-wise loop runs on the calling thread: a
/// step of 32 rows has ~18k values per 576-wide activation, a few microseconds of work, less
/// than waking a pool thread for it costs (each wake-up is a futex and a context switch;
/// ~360 such loops and products per SmolLM2 step).
const JOB: usize = 1 << 15;

/// Rows of `width` per parallel job ([`JOB`] elements at least).
fn rows_per_job(width: usize) -> usize {
    JOB.div_ceil(width.max(1))
}

/// `x += rms(out)·w` per row (Gemma's norm of a sub-layer's output before its residual add),
/// through the scratch rows `tmp`.
fn add_normed<T: Elem>(x: &mut [T], out: &[T], w: &[T], tmp: &mut [T], eps: f64) {
    rms_norm(tmp, out, w, eps);
    team::chunks(x, JOB, |i, c| {
        c.iter_mut()
            .zip(&tmp[i * JOB..])
            .for_each(|(v, &o)| *v += o)
    });
}

/// GELU with the tanh approximation: `½z(1 + tanh(√(2/π)(z + 0.044715 z³)))`.
#[inline(always)]
/// A layer of experts on the normed rows `hn` (`[m, hidden]`), added into `x`: each row routed
/// as the training layer routes it (`layer::route_row`: softmax, top-k most probable first,
/// ties by index, weights renormalised with `norm_topk_prob`), and each expert's gated MLP on
/// the rows routed to it only.
fn experts_step<T: Elem>(e: &ExpertMats<T>, x: &mut [T], hn: &[T], m: usize, h: usize) {
    let n = e.experts.len();
    let mut logits = vec![T::zero(); m * n];
    e.router.apply(&mut logits, hn, m, h, n, false);
    let mut rows_of: Vec<Vec<(usize, T)>> = vec![Vec::new(); n];
    let (mut chosen, mut weights) = (vec![0usize; e.top_k], vec![T::zero(); e.top_k]);
    for (r, row) in logits.chunks_mut(n).enumerate() {
        super::layer::route_row(row, &mut chosen, &mut weights, e.norm_topk_prob);
        for (&i, &w) in chosen.iter().zip(&weights) {
            rows_of[i].push((r, w));
        }
    }
    let inter = e.inter;
    for ((gate_up, down), rows) in e.experts.iter().zip(&rows_of) {
        if rows.is_empty() {
            continue;
        }
        let k = rows.len();
        let mut xin = vec![T::zero(); k * h];
        for (j, &(r, _)) in rows.iter().enumerate() {
            xin[j * h..(j + 1) * h].copy_from_slice(&hn[r * h..(r + 1) * h]);
        }
        let mut gu = vec![T::zero(); k * 2 * inter];
        gate_up.apply(&mut gu, &xin, k, h, 2 * inter, false);
        let mut act = vec![T::zero(); k * inter];
        gated_act(&mut act, &gu, inter, false);
        let mut out = vec![T::zero(); k * h];
        down.apply(&mut out, &act, k, inter, h, false);
        for (j, &(r, w)) in rows.iter().enumerate() {
            for (xv, &ov) in x[r * h..(r + 1) * h]
                .iter_mut()
                .zip(&out[j * h..(j + 1) * h])
            {
                *xv += w * ov;
            }
        }
    }
    if let Some(SharedMats {
        gate_up,
        down,
        gate,
        width,
    }) = &e.shared
    {
        // x += sigmoid(hn·w_gate) · down(silu(gate(hn)) ⊙ up(hn)), every row.
        let width = *width;
        let mut gu = vec![T::zero(); m * 2 * width];
        gate_up.apply(&mut gu, hn, m, h, 2 * width, false);
        let mut act = vec![T::zero(); m * width];
        gated_act(&mut act, &gu, width, false);
        let mut out = vec![T::zero(); m * h];
        down.apply(&mut out, &act, m, width, h, false);
        let mut g = vec![T::zero(); m];
        gate.apply(&mut g, hn, m, h, 1, false);
        team::rows(x, h, rows_per_job(h), |r, xr| {
            let s = T::one() / (T::one() + (-g[r]).exp_fast());
            let or = &out[r * h..][..h];
            xr.iter_mut().zip(or).for_each(|(xv, &ov)| *xv += s * ov);
        });
    }
}

/// Each token of a ragged step as (sequence, position, id), `[M]` each; an empty sequence or an
/// id outside the vocabulary is an error.
type Layout = (Vec<usize>, Vec<usize>, Vec<u32>);
fn token_layout<C>(tokens: &[&[u32]], caches: &[&mut SeqCache<C>], vocab: usize) -> Result<Layout> {
    let (mut seq, mut pos, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for (s, (t, c)) in tokens.iter().zip(caches.iter()).enumerate() {
        if t.is_empty() {
            candle_core::bail!("sequence {s} brings no token");
        }
        for (j, &id) in t.iter().enumerate() {
            if id as usize >= vocab {
                candle_core::bail!("token id {id} outside the vocabulary ({vocab})");
            }
            seq.push(s);
            pos.push(c.len + j);
            ids.push(id);
        }
    }
    Ok((seq, pos, ids))
}

/// Rotary tables for tokens at positions `pos`: `(cos, sin)` `[M, head_dim / 2]` each, computed
/// in f64 and rounded once to T (the transformer's values).
fn rotary_tables<T: Elem>(pos: &[usize], freqs: &[f64]) -> (Vec<T>, Vec<T>) {
    let half = freqs.len();
    let mut cos = vec![T::zero(); pos.len() * half];
    let mut sin = vec![T::zero(); pos.len() * half];
    for (i, &p) in pos.iter().enumerate() {
        for (f, &inv) in freqs.iter().enumerate() {
            let ang = p as f64 * inv;
            cos[i * half + f] = T::from_f64(ang.cos());
            sin[i * half + f] = T::from_f64(ang.sin());
        }
    }
    (cos, sin)
}

/// `m[r] += b` for every row `r` of `m` (rows of `b.len()`).
fn add_to_rows<T: Elem>(m: &mut [T], b: &[T]) {
    team::rows(m, b.len(), rows_per_job(b.len()), |_, row| {
        row.iter_mut().zip(b).for_each(|(v, &bb)| *v += bb);
    });
}

/// RoPE on the first `rd` values of the q and k heads of every token's `q|k|v` row (`(dq, dkv,
/// hd, rd)` widths; half-split layout, as HF), after each head's RMSNorm where the model has
/// q/k norms.
fn norm_and_rotate<T: Elem>(
    qkv: &mut [T],
    (dq, dkv, hd, rd): (usize, usize, usize, usize),
    qk_norm: Option<&(Vec<T>, Vec<T>)>,
    (cos, sin): &(Vec<T>, Vec<T>),
    eps: f64,
) {
    let half = rd / 2;
    let (eps, hd_t) = (T::from_f64(eps), T::from_f64(hd as f64));
    team::rows(qkv, dq + 2 * dkv, rows_per_job(dq + 2 * dkv), |i, row| {
        let (c, s) = (&cos[i * half..][..half], &sin[i * half..][..half]);
        vectorized(
            #[inline(always)]
            || {
                for (j, head) in row[..dq + dkv].chunks_mut(hd).enumerate() {
                    if let Some((qn, kn)) = qk_norm {
                        let w = if j * hd < dq { qn } else { kn };
                        let ss = head.iter().fold(T::zero(), |s, &v| s + v * v);
                        let inv = (ss / hd_t + eps).sqrt().recip();
                        for (v, &wv) in head.iter_mut().zip(w) {
                            *v = *v * inv * wv;
                        }
                    }
                    // The first rd values turn (all of them unless partial rotary).
                    let (x1, x2) = head[..2 * half].split_at_mut(half);
                    for f in 0..half {
                        let (u, w) = (x1[f], x2[f]);
                        x1[f] = u * c[f] - w * s[f];
                        x2[f] = w * c[f] + u * s[f];
                    }
                }
            },
        )
    });
}

/// Attention of layer `li` for every token `i` (of sequence `seq[i]` at position `pos[i]`) into
/// `att` `[M, dq]`: its query heads over its sequence's keys 0..=pos[i] (causal, no padding;
/// a sliding-window layer the last `window` of them), one job per token, each cached row read
/// once, in order. Row r of a layer's cache holds position `first[li] + r` (a sliding layer's
/// cache starts at the oldest position a query can still see).
#[allow(clippy::too_many_arguments)]
fn attend_tokens<T: Elem, C: KvElem<T>>(
    att: &mut [T],
    qkv: &[T],
    caches: &[&mut SeqCache<C>],
    li: usize,
    (seq, pos): (&[usize], &[usize]),
    (dq, dkv, hd): (usize, usize, usize),
    window: Option<usize>,
    scale: T,
) {
    let dqkv = dq + 2 * dkv;
    team::rows(att, dq, 1, |i, out| {
        let c = &caches[seq[i]];
        let first = window.map_or(0, |w| (pos[i] + 1).saturating_sub(w));
        let at = first - c.first[li];
        let kv = Kv {
            ks: &c.k[li][at * dkv..],
            vs: &c.v[li][at * dkv..],
            n: pos[i] + 1 - first,
            width: dkv,
        };
        attend(&qkv[i * dqkv..][..dq], &kv, hd, scale, out);
    });
}

/// The gated MLP's activation: `act[m, inter] = f(gate) ⊙ up` from `gu` `[m, 2·inter]` (gate
/// columns, then up columns), `f` GELU (tanh) for Gemma, else SiLU; rows in parallel.
fn gated_act<T: Elem>(act: &mut [T], gu: &[T], inter: usize, gelu: bool) {
    team::rows(act, inter, rows_per_job(inter), |r, o| {
        let (g, u) = gu[r * 2 * inter..][..2 * inter].split_at(inter);
        vectorized(
            #[inline(always)]
            || {
                if gelu {
                    for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
                        *oi = gelu_tanh(gi) * ui;
                    }
                } else {
                    for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
                        *oi = gi / (T::one() + (-gi).exp_fast()) * ui;
                    }
                }
            },
        )
    });
}

fn gelu_tanh<T: Elem>(z: T) -> T {
    let k0 = T::from_f64(0.797_884_560_802_865_4);
    let k1 = T::from_f64(0.044_715);
    T::from_f64(0.5) * z * (T::one() + (k0 * (z + k1 * z * z * z)).tanh())
}

/// `out[r] = x[r] · rsqrt(mean(x[r]²) + eps) · w` for each row of width `w.len()`.
fn rms_norm<T: Elem>(out: &mut [T], x: &[T], w: &[T], eps: f64) {
    let h = w.len();
    let eps = T::from_f64(eps);
    let n = T::from_f64(h as f64);
    team::rows(out, h, rows_per_job(h), |r, o| {
        let xr = &x[r * h..][..h];
        vectorized(
            #[inline(always)]
            || {
                let ss = xr.iter().fold(T::zero(), |acc, &v| acc + v * v);
                let inv = (ss / n + eps).sqrt().recip();
                for ((oi, &xi), &wi) in o.iter_mut().zip(xr).zip(w) {
                    *oi = xi * inv * wi;
                }
            },
        )
    });
}

/// What every layer of a step reads: the tokens' sequences and positions, each sequence's
/// `(first row, tokens)`, the rotary tables (global and, for Gemma 3's sliding layers, local).
struct StepCx<T> {
    m: usize,
    seq: Vec<usize>,
    pos: Vec<usize>,
    spans: Vec<(usize, usize)>,
    global: (Vec<T>, Vec<T>),
    local: Option<(Vec<T>, Vec<T>)>,
}

/// A step's buffers, reused by every layer: the normed input `[M, hidden]`, q|k|v rows, the
/// attention output and its gate `[M, heads·head_dim]`, and a layer output before Gemma's
/// sandwich norm `[M, hidden]`.
struct Bufs<T> {
    hn: Vec<T>,
    qkv: Vec<T>,
    att: Vec<T>,
    gates: Vec<T>,
    out_pre: Vec<T>,
}

impl<T: Elem> Bufs<T> {
    fn new(a: &ModelArgs, m: usize) -> Self {
        let h = a.hidden_size;
        let dq = a.num_attention_heads * a.head_dim;
        let dkv = a.num_key_value_heads * a.head_dim;
        let zeros = |n: usize| vec![T::zero(); n];
        Self {
            hn: zeros(m * h),
            qkv: zeros(m * (dq + 2 * dkv)),
            att: zeros(m * dq),
            gates: zeros(if a.attn_output_gate { m * dq } else { 0 }),
            out_pre: zeros(if a.arch.gemma() { m * h } else { 0 }),
        }
    }
}

/// A layer's mixer packed: attention or a Gated DeltaNet.
enum Mixed<T> {
    Attention(AttnMats<T>),
    Delta(DeltaMats<T>),
}

/// An attention layer's matrices packed (adapters folded in).
struct AttnMats<T> {
    /// `[hidden, (heads + 2·kv_heads)·head_dim]`: q, k, v output columns side by side.
    qkv: Mat<T>,
    /// `[(heads + 2·kv_heads)·head_dim]` (Qwen2 and `attention_bias` models).
    qkv_bias: Option<Vec<T>>,
    /// Qwen3's per-head RMSNorm weights of q and k (`[head_dim]` each).
    qk_norm: Option<(Vec<T>, Vec<T>)>,
    /// `[hidden, heads·head_dim]`: the output gate (Qwen3.5's doubled `q_proj`).
    gate: Option<Mat<T>>,
    /// `[heads·head_dim, hidden]`.
    o: Mat<T>,
    /// `[hidden]`: the output projection's bias (`attention_bias` models but Qwen2).
    o_bias: Option<Vec<T>>,
}

impl<T: Elem> AttnMats<T> {
    /// `nw` turns a norm weight into the scale it applies.
    fn new(
        at: &Attention,
        a: &ModelArgs,
        bf16: bool,
        nw: &impl Fn(&Tensor) -> Result<Vec<T>>,
    ) -> Result<Self> {
        // Adapters are folded in here, once per packing: W + s·B·A (`[out, in]` each).
        let [q, k, v, o] = [&at.q, &at.k, &at.v, &at.o].map(|p| p.merged_weight());
        let (q, k, v, o) = (q?, k?, v?, o?);
        // A gated attention's q_proj holds, per head, hd query rows then hd gate rows.
        let (q, gate) = match a.attn_output_gate {
            false => (q, None),
            true => {
                let (nh, hd) = (a.num_attention_heads as u32, a.head_dim as u32);
                let pick = |at: u32| {
                    let idx = (0..nh).flat_map(|h| (0..hd).map(move |j| h * 2 * hd + at + j));
                    rows(&q, idx.collect())
                };
                (pick(0)?, Some(Mat::from_weights(&[&pick(hd)?], bf16)?))
            }
        };
        Ok(Self {
            qkv: Mat::from_weights(&[&q, &k, &v], bf16)?,
            qkv_bias: match (at.q.bias(), at.k.bias(), at.v.bias()) {
                (Some(q), Some(k), Some(v)) => Some(flat(&Tensor::cat(&[q, k, v], 0)?)?),
                _ => None,
            },
            qk_norm: match &at.qk_norm {
                Some((q, k)) => Some((nw(q)?, nw(k)?)),
                None => None,
            },
            gate,
            o_bias: at.o.bias().map(flat).transpose()?,
            o: Mat::from_weights(&[&o], bf16)?,
        })
    }
}

impl<T: Elem> Packed<T> {
    /// Packs `model`'s current weights (no LM head = error: decoding needs logits).
    pub fn new(model: &CausalLm) -> Result<Self> {
        let a = &model.args;
        let bf16 = model.bf16_matmuls();
        let mut layers = Vec::with_capacity(a.num_hidden_layers);
        // Norm weights as the scale they apply (`1 + w` for Gemma), folded in once.
        let off = a.arch.norm_offset();
        let nw = |w: &Tensor| -> Result<Vec<T>> {
            match off {
                0.0 => flat(w),
                o => flat(&(w + o)?),
            }
        };
        for b in model.blocks() {
            let mixer = match &b.mixer {
                Mixer::Attention(at) => Mixed::Attention(AttnMats::new(at, a, bf16, &nw)?),
                Mixer::Delta(d) => {
                    let Some(la) = &a.linear_attn else {
                        candle_core::bail!("a Gated DeltaNet layer without linear_attn settings")
                    };
                    Mixed::Delta(DeltaMats::new(d, la, bf16)?)
                }
                Mixer::Mla(_) => {
                    candle_core::bail!("latent attention layers decode through the composition")
                }
            };
            let (gate_up, down, experts) = match &b.mlp {
                Mlp::Dense(g) => {
                    let [gate, up, down] = [&g.gate, &g.up, &g.down].map(|p| p.merged_weight());
                    (
                        Mat::from_weights(&[&gate?, &up?], bf16)?,
                        Mat::from_weights(&[&down?], bf16)?,
                        None,
                    )
                }
                Mlp::Experts(e) => {
                    let mut mats = Vec::with_capacity(e.experts.len());
                    for g in &e.experts {
                        let [gate, up, down] = [&g.gate, &g.up, &g.down].map(|p| p.merged_weight());
                        mats.push((
                            Mat::from_weights(&[&gate?, &up?], bf16)?,
                            Mat::from_weights(&[&down?], bf16)?,
                        ));
                    }
                    let inter = e
                        .experts
                        .first()
                        .map_or(Ok(0), |g| g.down.weight().dim(1))?;
                    let shared = match &e.shared {
                        Some(sh) => {
                            let [g, u, d, sg] = [&sh.mlp.gate, &sh.mlp.up, &sh.mlp.down, &sh.gate]
                                .map(|p| p.merged_weight());
                            let d = d?;
                            let width = d.dim(1)?;
                            Some(SharedMats {
                                gate_up: Mat::from_weights(&[&g?, &u?], bf16)?,
                                down: Mat::from_weights(&[&d], bf16)?,
                                gate: Mat::from_weights(&[&sg?], bf16)?,
                                width,
                            })
                        }
                        None => None,
                    };
                    let experts = ExpertMats {
                        router: Mat::from_weights(&[&e.router], false)?,
                        experts: mats,
                        top_k: e.top_k,
                        norm_topk_prob: e.norm_topk_prob,
                        inter,
                        shared,
                    };
                    (
                        Mat::Plain(Vec::new()),
                        Mat::Plain(Vec::new()),
                        Some(experts),
                    )
                }
            };
            layers.push(Layer {
                ln1: nw(&b.ln1)?,
                ln2: nw(&b.ln2)?,
                mixer,
                sandwich: match &b.sandwich {
                    Some((pa, pf)) => Some((nw(pa)?, nw(pf)?)),
                    None => None,
                },
                window: b.window,
                local_rope: b.local_rope,
                gate_up,
                down,
                experts,
            });
        }
        Ok(Self {
            args: a.clone(),
            embed: flat(model.embedding())?,
            layers,
            norm: nw(model.final_norm())?,
            out: Mat::from_weights(&[model.output_weight()?], bf16)?,
            inv_freq: model.inv_freq(),
            inv_freq_local: model
                .blocks()
                .iter()
                .position(|b| b.local_rope)
                .map(|i| a.inv_freq_of(i)),
        })
    }

    pub fn args(&self) -> &ModelArgs {
        &self.args
    }

    /// Runs one ragged batch: sequence `i` continues `caches[i]` with the tokens `tokens[i]`
    /// (non-empty; positions `caches[i].len()..`). Appends their keys and values to the caches
    /// and returns the logits after each sequence's last new token, `[sequences, vocab]` f32.
    ///
    /// Sequences that enter together with the same prompt (empty caches, equal tokens: a GRPO
    /// group's `n` samples) are computed once; the others receive copies of that sequence's
    /// cache and logits — the values they would have computed, as every row of a step is
    /// computed independently of the others (batch invariance). The step's parallel loops run
    /// on [`team`]'s spinning threads (~150 loops per step) where all of them can
    /// ([`Packed::on_team`]).
    pub fn step<C: KvElem<T>>(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut SeqCache<C>],
    ) -> Result<Logits> {
        if tokens.len() != caches.len() {
            candle_core::bail!("{} token lists for {} caches", tokens.len(), caches.len());
        }
        // copy_of[i] = Some(j): sequence i enters with sequence j's prompt (j < i, j unique).
        let mut seen: std::collections::HashMap<&[u32], usize> = Default::default();
        let copy_of: Vec<Option<usize>> = tokens
            .iter()
            .zip(caches.iter())
            .enumerate()
            .map(|(i, (t, c))| match c.is_empty() && !t.is_empty() {
                true => match seen.entry(t) {
                    std::collections::hash_map::Entry::Occupied(e) => Some(*e.get()),
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(i);
                        None
                    }
                },
                false => None,
            })
            .collect();
        if copy_of.iter().all(Option::is_none) {
            return self.on_team(|| self.step_here(tokens, caches));
        }
        // The distinct sequences' step, then the copies; `row[i]`: sequence i's logits row.
        let mut row = vec![0; tokens.len()];
        let mut once: Vec<&[u32]> = Vec::new();
        let mut sub: Vec<&mut SeqCache<C>> = Vec::new();
        for (i, c) in caches.iter_mut().enumerate() {
            if copy_of[i].is_none() {
                row[i] = once.len();
                once.push(tokens[i]);
                sub.push(&mut **c);
            }
        }
        let logits = self.on_team(|| self.step_here(&once, &mut sub))?;
        drop(sub);
        for (i, j) in copy_of.iter().enumerate() {
            if let Some(j) = *j {
                row[i] = row[j];
                let (done, rest) = caches.split_at_mut(i);
                rest[0].copy_from(done[j]);
            }
        }
        let vocab = logits.vocab;
        let mut data = Vec::with_capacity(tokens.len() * vocab);
        for &r in &row {
            data.extend_from_slice(&logits[r]);
        }
        Ok(Logits { data, vocab })
    }

    /// Runs `f` (a step) in a [`team::session`] when every parallel loop of the step goes
    /// through the team: products on bf16 tiles, attention layers, dense MLPs. Products on the
    /// `gemm` crate (f32/f64 models, the experts' router) and the Gated DeltaNet recurrence
    /// parallelise through rayon, whose workers would share the cores with a spinning helper:
    /// those steps run as before, on rayon alone.
    fn on_team<R>(&self, f: impl FnOnce() -> R) -> R {
        let bf16 = matches!(self.out, Mat::Amx(_));
        let all = self
            .layers
            .iter()
            .all(|l| l.experts.is_none() && matches!(l.mixer, Mixed::Attention(_)));
        match bf16 && all {
            true => team::session(f),
            false => f(),
        }
    }

    fn step_here<C: KvElem<T>>(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut SeqCache<C>],
    ) -> Result<Logits> {
        let a = &self.args;
        let (h, inter) = (a.hidden_size, a.intermediate_size);
        let dkv = a.num_key_value_heads * a.head_dim;
        let (seq, pos, ids) = token_layout(tokens, caches, a.vocab_size)?;
        let m = ids.len();
        let cx = StepCx {
            m,
            // Each sequence's (first row, tokens) in the step's rows.
            spans: tokens
                .iter()
                .scan(0, |at, t| {
                    let span = (*at, t.len());
                    *at += t.len();
                    Some(span)
                })
                .collect(),
            global: rotary_tables::<T>(&pos, &self.inv_freq),
            local: self
                .inv_freq_local
                .as_deref()
                .map(|f| rotary_tables::<T>(&pos, f)),
            seq,
            pos,
        };
        let mut x = vec![T::zero(); m * h]; // [M, hidden]
        for (i, &id) in ids.iter().enumerate() {
            let r = id as usize * h;
            x[i * h..(i + 1) * h].copy_from_slice(&self.embed[r..r + h]);
        }
        if let Some(scale) = a.embed_scale() {
            let scale = T::from_f64(scale);
            team::chunks(&mut x, JOB, |_, c| c.iter_mut().for_each(|v| *v *= scale));
        }
        let mut bufs = Bufs::new(a, m);
        let mut gu = vec![T::zero(); m * 2 * inter]; // [M, 2·intermediate]
        let mut act = vec![T::zero(); m * inter]; // [M, intermediate]
        let gelu = a.arch.gemma();
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&mut bufs.hn, &x, &l.ln1, a.rms_norm_eps);
            match &l.mixer {
                Mixed::Delta(d) => d.step(
                    li,
                    &bufs.hn,
                    &mut x,
                    (m, h),
                    &cx.spans,
                    caches,
                    a.rms_norm_eps,
                ),
                Mixed::Attention(at) => {
                    self.attention(li, l, at, &cx, &mut bufs, &mut x, caches);
                }
            }
            let hn = &mut bufs.hn;
            rms_norm(hn, &x, &l.ln2, a.rms_norm_eps);
            if let Some(e) = &l.experts {
                experts_step(e, &mut x, hn, m, h);
                continue;
            }
            l.gate_up.apply(&mut gu, hn, m, h, 2 * inter, false);
            gated_act(&mut act, &gu, inter, gelu);
            match &l.sandwich {
                Some((_, pf)) => {
                    l.down.apply(&mut bufs.out_pre, &act, m, inter, h, false);
                    add_normed(&mut x, &bufs.out_pre, pf, hn, a.rms_norm_eps);
                }
                None => l.down.apply(&mut x, &act, m, inter, h, true),
            }
        }
        for (c, t) in caches.iter_mut().zip(tokens) {
            c.len += t.len();
            for li in 0..self.layers.len() {
                c.trim(li, dkv);
            }
        }
        Ok(self.last_logits(&x, tokens))
    }

    /// Attention layer `li` (`l`, its matrices `at`) for every token of the step, its output
    /// added into `x` (through Gemma's post-attention norm where the layer has one); the new
    /// keys and values join their sequences' caches. `bufs.hn` holds the normed input.
    #[allow(clippy::too_many_arguments)]
    fn attention<C: KvElem<T>>(
        &self,
        li: usize,
        l: &Layer<T>,
        at: &AttnMats<T>,
        cx: &StepCx<T>,
        bufs: &mut Bufs<T>,
        x: &mut [T],
        caches: &mut [&mut SeqCache<C>],
    ) {
        let a = &self.args;
        let (h, hd, m) = (a.hidden_size, a.head_dim, cx.m);
        let dq = a.num_attention_heads * hd;
        let dkv = a.num_key_value_heads * hd;
        let dqkv = dq + 2 * dkv;
        let Bufs {
            hn,
            qkv,
            att,
            gates,
            out_pre,
        } = bufs;
        at.qkv.apply(qkv, hn, m, h, dqkv, false);
        if let Some(b) = &at.qkv_bias {
            add_to_rows(qkv, b);
        }
        let tables = match (&cx.local, l.local_rope) {
            (Some(t), true) => t,
            _ => &cx.global,
        };
        let widths = (dq, dkv, hd, a.rotary_dim());
        norm_and_rotate(qkv, widths, at.qk_norm.as_ref(), tables, a.rms_norm_eps);
        // New keys and values join their sequence's cache, in token order.
        for (i, row) in qkv.chunks(dqkv).enumerate() {
            let c = &mut caches[cx.seq[i]];
            c.k[li].extend(row[dq..dq + dkv].iter().map(|&x| C::store(x)));
            c.v[li].extend(row[dq + dkv..].iter().map(|&x| C::store(x)));
        }
        let tokens_at = (cx.seq.as_slice(), cx.pos.as_slice());
        let scale = T::from_f64(a.attn_scale());
        attend_tokens(
            att,
            qkv,
            caches,
            li,
            tokens_at,
            (dq, dkv, hd),
            l.window,
            scale,
        );
        if let Some(g) = &at.gate {
            // Qwen3.5's output gate: att ⊙ sigmoid(h·W_gate).
            g.apply(gates, hn, m, h, dq, false);
            team::chunks(att, JOB, |i, c| {
                let g = &gates[i * JOB..];
                c.iter_mut()
                    .zip(g)
                    .for_each(|(v, &g)| *v /= T::one() + (-g).exp_fast())
            });
        }
        match &l.sandwich {
            Some((pa, _)) => {
                at.o.apply(out_pre, att, m, dq, h, false);
                if let Some(b) = &at.o_bias {
                    add_to_rows(out_pre, b);
                }
                add_normed(x, out_pre, pa, hn, a.rms_norm_eps);
            }
            None => {
                at.o.apply(x, att, m, dq, h, true);
                if let Some(b) = &at.o_bias {
                    add_to_rows(x, b);
                }
            }
        }
    }

    /// The logits of the last new token of each sequence (final norm, LM head) from the
    /// step's hidden states `x` `[M, hidden]`: `[S, vocab]`.
    fn last_logits(&self, x: &[T], tokens: &[&[u32]]) -> Logits {
        let (h, vocab) = (self.args.hidden_size, self.args.vocab_size);
        let mut last = Vec::with_capacity(tokens.len() * h); // [S, hidden]
        let mut end = 0;
        for t in tokens {
            end += t.len();
            last.extend_from_slice(&x[(end - 1) * h..end * h]);
        }
        let s = tokens.len();
        let mut ln = vec![T::zero(); s * h];
        rms_norm(&mut ln, &last, &self.norm, self.args.rms_norm_eps);
        let mut logits = vec![T::zero(); s * vocab]; // [S, vocab]
        self.out.apply(&mut logits, &ln, s, h, vocab, false);
        // In f32 the collect reuses `logits`' buffer (same size and alignment).
        let data = logits
            .into_iter()
            .map(|v| <T as WithDType>::to_f64(v) as f32)
            .collect();
        Logits { data, vocab }
    }
}

/// A decode step's logits, one row of `vocab` f32 per sequence (`[sequences, vocab]`, one
/// buffer: a step of 32 SmolLM2 rows is 6.3 MB, copied row by row before).
pub struct Logits {
    data: Vec<f32>,
    vocab: usize,
}

impl Logits {
    /// The rows in sequence order.
    pub fn iter(&self) -> std::slice::Chunks<'_, f32> {
        self.data.chunks(self.vocab.max(1))
    }

    /// The rows, for a parallel pass.
    pub fn par_iter(&self) -> rayon::slice::Chunks<'_, f32> {
        self.data.par_chunks(self.vocab.max(1))
    }
}

impl std::ops::Index<usize> for Logits {
    type Output = [f32];
    fn index(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..][..self.vocab]
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    use super::Mat;
    use crate::kernels::simd::Par;

    /// Weights `[3, 70]`, `[130, 70]`, `[5, 70]`: out sizes that are not multiples of the
    /// 64-row block or a tile (the ragged last block).
    fn three_weights() -> (Tensor, Tensor, Tensor) {
        let mk = |out: usize, k: f32| {
            let v: Vec<f32> = (0..out * 70).map(|i| (i as f32 * k).sin()).collect();
            Tensor::from_vec(v, (out, 70), &Device::Cpu).unwrap()
        };
        (mk(3, 0.7), mk(130, 1.3), mk(5, 0.11))
    }

    /// Packing equals candle's concatenation of the transposed weights, on sizes that are not
    /// multiples of the 64-row block (the ragged last block).
    #[test]
    fn packed_columns_equals_the_concatenated_transposes() {
        let (a, b, c) = three_weights();
        let got = super::packed_columns::<f32>(&[&a, &b, &c]).unwrap();
        let want: Vec<f32> = Tensor::cat(&[a.t().unwrap(), b.t().unwrap(), c.t().unwrap()], 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want);
        let one = super::packed_columns::<f32>(&[&b]).unwrap();
        let want: Vec<f32> = b.t().unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(one, want);
    }

    /// The bf16 tiles packed straight from stacked `[out, in]` weights multiply exactly as the
    /// tiles of the transposed, concatenated `[in, out]` matrix (the pack they replace): the
    /// same products, bit for bit, on sizes that are not multiples of a tile.
    #[test]
    fn bf16_tiles_from_the_weights_equal_the_tiles_of_the_transpose() {
        if !crate::kernels::bf16::available() {
            eprintln!("skipped: no bf16 kernel on this machine");
            return;
        }
        let (a, b, c) = three_weights();
        let inp = a.dim(1).unwrap();
        for ws in [vec![&a, &b, &c], vec![&b]] {
            let n: usize = ws.iter().map(|w| w.dim(0).unwrap()).sum();
            let Mat::<f32>::Amx(direct) = Mat::<f32>::from_weights(&ws, true).unwrap() else {
                panic!("bf16 asked for");
            };
            let t = super::packed_columns::<f32>(&ws).unwrap(); // [in, n]
            let via_t = crate::kernels::bf16::PackedB::new(&t, n, 1, inp, n, Par::Rayon);
            let m = 9;
            let x: Vec<f32> = (0..m * inp).map(|i| (i as f32 * 0.37).cos()).collect();
            let (mut y1, mut y2) = (vec![0f32; m * n], vec![0f32; m * n]);
            crate::kernels::bf16::gemm_packed(&mut y1, m, &x, inp, 1, &direct, false, Par::Rayon);
            crate::kernels::bf16::gemm_packed(&mut y2, m, &x, inp, 1, &via_t, false, Par::Rayon);
            assert_eq!(y1, y2);
            assert!(y1.iter().any(|&v| v != 0.0));
        }
    }

    /// Decoding with bf16 products (`kernels::bf16`), with an f32 and with a bf16 key/value
    /// (and recurrent-state) cache: a 3-sequence ragged step's logits stay within bf16 rounding
    /// of the f32 step's (relative error of all logits ≤ 2e-2 for Qwen2: operands off by ≤ 2⁻⁹
    /// each, through a dozen products; ≤ 8e-2 for the DeltaNet hybrids), differ
    /// from them (the bf16 path ran), and each sequence's logits do not depend on the others in
    /// the batch (one-by-one steps give the same bits).
    #[test]
    fn bf16_decoding_stays_near_f32_and_is_batch_invariant() {
        use crate::model::{Arch, ModelArgs};
        if !crate::kernels::bf16::available() {
            eprintln!("skipped: MAIN_PPO_BF16_KERNEL=none");
            return;
        }
        // The hybrids' chains are longer (projection, convolution, L2 norm, recurrence, gated
        // norm; measured 2.6e-2 for Qwen3.5 and 6.1e-2 for Qwen3-Next on this tiny model).
        for (arch, bound) in [
            (Arch::Qwen2, 2e-2),
            (Arch::Qwen3_5, 8e-2),
            (Arch::Qwen3Next, 8e-2),
        ] {
            let mut args = ModelArgs::tiny(arch, 40);
            args.hidden_size = 64;
            args.intermediate_size = 96;
            let (_vm, mut m) = crate::testing::tiny_model(&args, candle_core::DType::F32, 0.3);
            let prompts: [&[u32]; 3] = [&[1, 2, 3, 4, 5], &[7, 8], &[9, 10, 11, 12, 13, 14, 15]];
            let run = |m: &crate::model::CausalLm, which: &[usize]| -> super::Logits {
                let p = super::Packed::<f32>::new(m).unwrap();
                let mut caches: Vec<super::SeqCache<f32>> = which
                    .iter()
                    .map(|_| super::SeqCache::with_capacity(&args, 16))
                    .collect();
                let mut refs: Vec<&mut super::SeqCache<f32>> = caches.iter_mut().collect();
                let toks: Vec<&[u32]> = which.iter().map(|&i| prompts[i]).collect();
                p.step(&toks, &mut refs).unwrap()
            };
            // The same with the cache in bf16, as the scheduler runs bf16 models.
            let run_bf = |m: &crate::model::CausalLm, which: &[usize]| -> super::Logits {
                let p = super::Packed::<f32>::new(m).unwrap();
                let mut caches: Vec<super::SeqCache<super::Bf16>> = which
                    .iter()
                    .map(|_| super::SeqCache::with_capacity(&args, 16))
                    .collect();
                let mut refs: Vec<&mut super::SeqCache<super::Bf16>> = caches.iter_mut().collect();
                let toks: Vec<&[u32]> = which.iter().map(|&i| prompts[i]).collect();
                p.step(&toks, &mut refs).unwrap()
            };
            let full = run(&m, &[0, 1, 2]);
            m.set_exec(crate::model::Exec {
                bf16: true,
                ..m.exec()
            });
            let bf = run(&m, &[0, 1, 2]);
            for (i, row) in bf.iter().enumerate() {
                assert_eq!(&run(&m, &[i])[0], row, "sequence {i} depends on its batch");
            }
            let bfc = run_bf(&m, &[0, 1, 2]);
            for (i, row) in bfc.iter().enumerate() {
                assert_eq!(
                    &run_bf(&m, &[i])[0],
                    row,
                    "sequence {i} depends on its batch"
                );
            }
            let (mut num, mut den) = (0f64, 0f64);
            for (a, b) in full.iter().flatten().zip(bfc.iter().flatten()) {
                num += ((a - b) as f64).powi(2);
                den += (*a as f64).powi(2);
            }
            let rel = (num / den).sqrt();
            assert!(
                rel <= bound,
                "{arch:?}: bf16 cache: logits {rel:.3e} away from f32"
            );
            let (mut num, mut den) = (0f64, 0f64);
            for (a, b) in full.iter().flatten().zip(bf.iter().flatten()) {
                num += ((a - b) as f64).powi(2);
                den += (*a as f64).powi(2);
            }
            let rel = (num / den).sqrt();
            assert!(
                rel > 0.0 && rel <= bound,
                "{arch:?}: bf16 logits {rel:.3e} away from f32"
            );
        }
    }

    /// Sequences entering a step with the same prompt share one prefill (`Packed::step`): each
    /// one's logits, through the prefill and three decode steps with different tokens per
    /// sequence, equal those of the sequence decoded alone, bit for bit (bf16 products: rows
    /// are batch-invariant, `bf16_decoding_stays_near_f32_and_is_batch_invariant`). Attention
    /// (Qwen2), Gated DeltaNet layers with their convolution and recurrent state (Qwen3.5), and
    /// sliding layers trimmed during the prefill (Gemma 3, prompt longer than twice its
    /// window); a copied cache that missed a field, or a logits row given to the wrong
    /// sequence, differs at some step.
    #[test]
    fn sequences_entering_with_one_prompt_share_its_prefill() {
        use crate::model::{Arch, ModelArgs};
        if !crate::kernels::bf16::available() {
            eprintln!("skipped: MAIN_PPO_BF16_KERNEL=none");
            return;
        }
        for arch in [Arch::Qwen2, Arch::Qwen3_5, Arch::Gemma3] {
            let mut args = ModelArgs::tiny(arch, 40);
            args.hidden_size = 64;
            args.intermediate_size = 96;
            let (_vm, mut m) = crate::testing::tiny_model(&args, candle_core::DType::F32, 0.3);
            m.set_exec(crate::model::Exec {
                bf16: true,
                ..m.exec()
            });
            let w = args.sliding_window.unwrap_or(4);
            let a: Vec<u32> = (0..2 * w as u32 + 3)
                .map(|i| (i * 5 + 2) % 39 + 1)
                .collect();
            let b: Vec<u32> = vec![7, 8, 9];
            // Sequences 0, 2 and 3 enter with prompt a, 1 with b; then each gets its own tokens.
            let prompts: [&[u32]; 4] = [&a, &b, &a, &a];
            let next = |s: usize, t: usize| (s * 11 + t * 3) as u32 % 39 + 1;
            let p = super::Packed::<f32>::new(&m).unwrap();
            // Logits of each step for sequences `which`, decoded together.
            let run = |which: &[usize]| -> Vec<Vec<Vec<f32>>> {
                let mut caches: Vec<super::SeqCache<super::Bf16>> = which
                    .iter()
                    .map(|_| super::SeqCache::with_capacity(&args, 32))
                    .collect();
                let mut steps = Vec::new();
                for t in 0..4 {
                    let toks: Vec<Vec<u32>> = which
                        .iter()
                        .map(|&s| match t {
                            0 => prompts[s].to_vec(),
                            _ => vec![next(s, t)],
                        })
                        .collect();
                    let toks: Vec<&[u32]> = toks.iter().map(|v| v.as_slice()).collect();
                    let mut refs: Vec<&mut super::SeqCache<super::Bf16>> =
                        caches.iter_mut().collect();
                    let l = p.step(&toks, &mut refs).unwrap();
                    steps.push(l.iter().map(|r| r.to_vec()).collect());
                }
                steps
            };
            let together = run(&[0, 1, 2, 3]);
            for s in 0..4 {
                let alone = run(&[s]);
                for (t, (all, one)) in together.iter().zip(&alone).enumerate() {
                    assert!(
                        all[s] == one[0],
                        "{arch:?}: sequence {s}, step {t}: logits differ from decoding it alone"
                    );
                }
            }
        }
    }

    /// A sliding-window layer's cache keeps at most twice its window (or a longer prompt's
    /// prefill) while full layers keep every position, and decoding with the dropped rows gone
    /// still gives the full forward's logits at every position (f64 weights; the step hands out
    /// f32 logits, so within 1e-6): Gemma 3 (window 4, a sliding and a full layer) and Mistral
    /// (window 3 on every layer), a prompt longer than twice the window, then one token a step
    /// up to 7 windows. `bytes_needed` covers what the cache held at its largest.
    #[test]
    fn sliding_layers_keep_only_their_window() {
        use crate::model::{Arch, ModelArgs};
        let mut mistral = ModelArgs::tiny(Arch::Llama, 40);
        mistral.sliding_window = Some(3);
        mistral.layer_types = vec![crate::model::config::LayerKind::Sliding; 2];
        for args in [ModelArgs::tiny(Arch::Gemma3, 40), mistral] {
            let (_vm, m) = crate::testing::tiny_model(&args, candle_core::DType::F64, 0.3);
            let w = args.sliding_window.unwrap();
            let seq: Vec<u32> = (0..7 * w as u32).map(|i| (i * 7 + 3) % 39 + 1).collect();
            let prompt = 2 * w + 3;
            // The reference: one full forward over the whole sequence.
            let n = seq.len();
            let ids = Tensor::from_vec(seq.clone(), (1, n), &candle_core::Device::Cpu).unwrap();
            let pos =
                Tensor::from_vec((0..n as u32).collect::<Vec<_>>(), (1, n), ids.device()).unwrap();
            let mask = Tensor::ones((1, n), candle_core::DType::U32, ids.device()).unwrap();
            let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
            let full: Vec<Vec<f64>> = m.logits(&h).unwrap().squeeze(0).unwrap().to_vec2().unwrap();
            let p = super::Packed::<f64>::new(&m).unwrap();
            let mut cache = super::SeqCache::<f64>::with_capacity(&args, n);
            let mut most = 0usize;
            let mut at = 0;
            while at < n {
                let take = if at == 0 { prompt } else { 1 };
                let logits = p.step(&[&seq[at..at + take]], &mut [&mut cache]).unwrap();
                at += take;
                for (li, kind) in (0..args.num_hidden_layers).map(|i| (i, args.window(i))) {
                    let kept = cache.kept(li);
                    match kind {
                        Some(w) => assert!(
                            kept <= prompt.max(2 * w - 1),
                            "layer {li} keeps {kept} at {at}"
                        ),
                        None => assert_eq!(kept, at, "full layer {li}"),
                    }
                }
                let bytes: usize = (0..args.num_hidden_layers)
                    .map(|li| cache.kept(li))
                    .sum::<usize>()
                    * 2
                    * args.num_key_value_heads
                    * args.head_dim
                    * 8;
                most = most.max(bytes);
                for (g, want) in logits[0].iter().zip(&full[at - 1]) {
                    assert!(
                        (f64::from(*g) - want).abs() <= 1e-6 * (1.0 + want.abs()),
                        "{:?} position {}: {g} vs {want}",
                        args.arch,
                        at - 1
                    );
                }
            }
            assert!(
                cache.kept(0) < n,
                "{:?}: the sliding layer dropped nothing",
                args.arch
            );
            let need = super::SeqCache::<f64>::bytes_needed(&args, prompt, n);
            assert!(most <= need, "{most} > {need}");
            assert!(need < super::SeqCache::<f64>::bytes_per_position(&args) * n);
        }
    }
}
