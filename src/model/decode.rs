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

use candle_core::{DType, Device, Result, Tensor, WithDType};
use rayon::prelude::*;

use super::config::ModelArgs;
use super::transformer::CausalLm;

/// Element types of the fast path.
pub trait Elem: WithDType + num_traits::Float + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for f64 {}

/// Whether `model` can decode through [`Packed`] (CPU, f32 or f64).
pub fn supported(model: &CausalLm) -> bool {
    matches!(model.device(), Device::Cpu) && matches!(model.dtype(), DType::F32 | DType::F64)
}

struct Layer<T> {
    ln1: Vec<T>,
    ln2: Vec<T>,
    /// `[hidden, (heads + 2·kv_heads)·head_dim]`: q, k, v output columns side by side.
    qkv: Vec<T>,
    /// `[(heads + 2·kv_heads)·head_dim]` (Qwen2 and `attention_bias` models).
    qkv_bias: Option<Vec<T>>,
    /// `[heads·head_dim, hidden]`.
    o: Vec<T>,
    /// `[hidden, 2·intermediate]`: gate columns, then up columns.
    gate_up: Vec<T>,
    /// `[intermediate, hidden]`.
    down: Vec<T>,
}

/// A model's weights packed for decoding (a copy: pack again after the weights change).
pub struct Packed<T> {
    args: ModelArgs,
    /// `[vocab, hidden]`.
    embed: Vec<T>,
    layers: Vec<Layer<T>>,
    norm: Vec<T>,
    /// `[hidden, vocab]`.
    out: Vec<T>,
    inv_freq: Vec<f64>,
}

/// Keys and values of one sequence, per layer `[positions, kv_heads, head_dim]` row-major, so a
/// new position is one contiguous append. Capacity is reserved up front by the scheduler.
pub struct SeqCache<T> {
    k: Vec<Vec<T>>,
    v: Vec<Vec<T>>,
    len: usize,
}

impl<T: Elem> SeqCache<T> {
    /// An empty cache with room for `positions` (no reallocation up to there).
    pub fn with_capacity(args: &ModelArgs, positions: usize) -> Self {
        let per = positions * args.num_key_value_heads * args.head_dim;
        let mk = || {
            (0..args.num_hidden_layers)
                .map(|_| Vec::with_capacity(per))
                .collect()
        };
        Self {
            k: mk(),
            v: mk(),
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
        kv_bytes_per_position(args, std::mem::size_of::<T>())
    }
}

/// Key/value bytes one position takes over all layers, for elements of `elem_bytes` (any cache
/// layout: the packed path's per-sequence caches and the composition's padded ones).
pub fn kv_bytes_per_position(args: &ModelArgs, elem_bytes: usize) -> usize {
    2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * elem_bytes
}

/// Weights `[out_i, in]` (as stored) side by side as the columns of one `[in, Σ out_i]`
/// row-major matrix: each transposed into its own column range. Blocked over 64 input rows
/// per task, so each task's destination stays in cache (candle's strided copy of a transposed
/// view took seconds per model).
fn packed_columns<T: Elem>(ws: &[&Tensor]) -> Result<Vec<T>> {
    let mut srcs = Vec::with_capacity(ws.len());
    let mut outs = Vec::with_capacity(ws.len());
    let inp = ws.first().map(|w| w.dim(1)).transpose()?.unwrap_or(0);
    for w in ws {
        let (out, i) = w.dims2()?;
        if i != inp {
            candle_core::bail!("packing weights with {i} and {inp} inputs side by side");
        }
        srcs.push(flat::<T>(w)?);
        outs.push(out);
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

/// A weight `[out, in]` transposed to `[in, out]` row-major.
fn transposed<T: Elem>(w: &Tensor) -> Result<Vec<T>> {
    packed_columns(&[w])
}

fn flat<T: Elem>(w: &Tensor) -> Result<Vec<T>> {
    w.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1()
}

/// `dst[m, n] (+)= a[m, k] · b[k, n]`, all row-major and contiguous; `acc` adds to `dst`.
fn matmul<T: Elem>(dst: &mut [T], a: &[T], b: &[T], m: usize, k: usize, n: usize, acc: bool) {
    super::ops::gemm_strided(dst, m, n, k, a, k, 1, b, n, 1, acc, super::ops::Par::Rayon);
}

/// `out[r] = x[r] · rsqrt(mean(x[r]²) + eps) · w` for each row of width `w.len()`.
fn rms_norm<T: Elem>(out: &mut [T], x: &[T], w: &[T], eps: f64) {
    let h = w.len();
    let eps = T::from_f64(eps);
    let n = T::from_f64(h as f64);
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(o, xr)| {
            let ss = xr.iter().fold(T::zero(), |acc, &v| acc + v * v);
            let inv = (ss / n + eps).sqrt().recip();
            for ((oi, &xi), &wi) in o.iter_mut().zip(xr).zip(w) {
                *oi = xi * inv * wi;
            }
        });
}

impl<T: Elem> Packed<T> {
    /// Packs `model`'s current weights (no LM head = error: decoding needs logits).
    pub fn new(model: &CausalLm) -> Result<Self> {
        let a = &model.args;
        let mut layers = Vec::with_capacity(a.num_hidden_layers);
        for b in model.blocks() {
            // Adapters are folded in here, once per packing: W + s·B·A (`[out, in]` each).
            let [q, k, v, o, gate, up, down] = b.projs().map(|p| p.merged_weight());
            let (q, k, v, o, gate, up, down) = (q?, k?, v?, o?, gate?, up?, down?);
            let qkv = packed_columns(&[&q, &k, &v])?;
            let qkv_bias = match (b.q.bias(), b.k.bias(), b.v.bias()) {
                (Some(q), Some(k), Some(v)) => Some(flat(&Tensor::cat(&[q, k, v], 0)?)?),
                _ => None,
            };
            let gate_up = packed_columns(&[&gate, &up])?;
            layers.push(Layer {
                ln1: flat(&b.ln1)?,
                ln2: flat(&b.ln2)?,
                qkv,
                qkv_bias,
                o: transposed(&o)?,
                gate_up,
                down: transposed(&down)?,
            });
        }
        Ok(Self {
            args: a.clone(),
            embed: flat(model.embedding())?,
            layers,
            norm: flat(model.final_norm())?,
            out: transposed(model.output_weight()?)?,
            inv_freq: model.inv_freq(),
        })
    }

    pub fn args(&self) -> &ModelArgs {
        &self.args
    }

    /// Runs one ragged batch: sequence `i` continues `caches[i]` with the tokens `tokens[i]`
    /// (non-empty; positions `caches[i].len()..`). Appends their keys and values to the caches
    /// and returns the logits after each sequence's last new token, `[sequences][vocab]` f32.
    pub fn step(
        &self,
        tokens: &[&[u32]],
        caches: &mut [&mut SeqCache<T>],
    ) -> Result<Vec<Vec<f32>>> {
        let a = &self.args;
        let (h, hd, nh, nkv) = (
            a.hidden_size,
            a.head_dim,
            a.num_attention_heads,
            a.num_key_value_heads,
        );
        let inter = a.intermediate_size;
        let rep = nh / nkv;
        let dq = nh * hd;
        let dkv = nkv * hd;
        let dqkv = dq + 2 * dkv;
        if tokens.len() != caches.len() {
            candle_core::bail!("{} token lists for {} caches", tokens.len(), caches.len());
        }
        // Token m belongs to sequence seq[m] at position pos[m]: [M].
        let mut seq = Vec::new();
        let mut pos = Vec::new();
        let mut ids = Vec::new();
        for (s, (t, c)) in tokens.iter().zip(caches.iter()).enumerate() {
            if t.is_empty() {
                candle_core::bail!("sequence {s} brings no token");
            }
            for (j, &id) in t.iter().enumerate() {
                if id as usize >= a.vocab_size {
                    candle_core::bail!("token id {id} outside the vocabulary ({})", a.vocab_size);
                }
                seq.push(s);
                pos.push(c.len + j);
                ids.push(id);
            }
        }
        let m = ids.len();
        // Rotary tables for each token: [M, head_dim / 2] (the transformer's f32 values).
        let half = hd / 2;
        let mut cos = vec![T::zero(); m * half];
        let mut sin = vec![T::zero(); m * half];
        for (i, &p) in pos.iter().enumerate() {
            for (f, &inv) in self.inv_freq.iter().enumerate() {
                let ang = p as f64 * inv;
                cos[i * half + f] = T::from_f64(ang.cos() as f32 as f64);
                sin[i * half + f] = T::from_f64(ang.sin() as f32 as f64);
            }
        }
        let mut x = vec![T::zero(); m * h]; // [M, hidden]
        for (i, &id) in ids.iter().enumerate() {
            let r = id as usize * h;
            x[i * h..(i + 1) * h].copy_from_slice(&self.embed[r..r + h]);
        }
        let mut hn = vec![T::zero(); m * h]; // [M, hidden]
        let mut qkv = vec![T::zero(); m * dqkv]; // [M, (nh + 2·nkv)·hd]
        let mut att = vec![T::zero(); m * dq]; // [M, nh·hd]
        let mut gu = vec![T::zero(); m * 2 * inter]; // [M, 2·intermediate]
        let mut act = vec![T::zero(); m * inter]; // [M, intermediate]
        let scale = T::from_f64(1.0 / (hd as f64).sqrt());
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&mut hn, &x, &l.ln1, a.rms_norm_eps);
            matmul(&mut qkv, &hn, &l.qkv, m, h, dqkv, false);
            if let Some(b) = &l.qkv_bias {
                qkv.par_chunks_mut(dqkv).for_each(|row| {
                    row.iter_mut().zip(b).for_each(|(v, &bb)| *v += bb);
                });
            }
            // RoPE on the q and k heads of every token (half-split layout, as HF).
            qkv.par_chunks_mut(dqkv).enumerate().for_each(|(i, row)| {
                let (c, s) = (
                    &cos[i * half..(i + 1) * half],
                    &sin[i * half..(i + 1) * half],
                );
                for head in row[..dq + dkv].chunks_mut(hd) {
                    let (x1, x2) = head.split_at_mut(half);
                    for f in 0..half {
                        let (u, w) = (x1[f], x2[f]);
                        x1[f] = u * c[f] - w * s[f];
                        x2[f] = w * c[f] + u * s[f];
                    }
                }
            });
            // New keys and values join their sequence's cache, in token order.
            for (i, row) in qkv.chunks(dqkv).enumerate() {
                let c = &mut caches[seq[i]];
                c.k[li].extend_from_slice(&row[dq..dq + dkv]);
                c.v[li].extend_from_slice(&row[dq + dkv..]);
            }
            // Attention: token i, head hh reads its sequence's keys 0..=pos[i] (causal, no pad).
            let views: Vec<(&[T], &[T])> = caches
                .iter()
                .map(|c| (c.k[li].as_slice(), c.v[li].as_slice()))
                .collect();
            att.par_chunks_mut(hd).enumerate().for_each(|(job, out)| {
                let (i, hh) = (job / nh, job % nh);
                let g = hh / rep;
                let q = &qkv[i * dqkv + hh * hd..i * dqkv + (hh + 1) * hd];
                let (ks, vs) = views[seq[i]];
                let n = pos[i] + 1;
                let mut w: Vec<T> = (0..n)
                    .map(|j| {
                        let k = &ks[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                        q.iter().zip(k).fold(T::zero(), |acc, (&u, &v)| acc + u * v) * scale
                    })
                    .collect();
                let mx = w
                    .iter()
                    .fold(T::neg_infinity(), |acc, &v| num_traits::Float::max(acc, v));
                let mut total = T::zero();
                for v in w.iter_mut() {
                    *v = (*v - mx).exp();
                    total += *v;
                }
                out.fill(T::zero());
                for (j, &p) in w.iter().enumerate() {
                    let v = &vs[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                    let p = p / total;
                    out.iter_mut().zip(v).for_each(|(o, &vv)| *o += p * vv);
                }
            });
            matmul(&mut x, &att, &l.o, m, dq, h, true);
            rms_norm(&mut hn, &x, &l.ln2, a.rms_norm_eps);
            matmul(&mut gu, &hn, &l.gate_up, m, h, 2 * inter, false);
            act.par_chunks_mut(inter)
                .zip(gu.par_chunks(2 * inter))
                .for_each(|(o, row)| {
                    let (g, u) = row.split_at(inter);
                    for ((oi, &gi), &ui) in o.iter_mut().zip(g).zip(u) {
                        *oi = gi / (T::one() + (-gi).exp()) * ui;
                    }
                });
            matmul(&mut x, &act, &l.down, m, inter, h, true);
        }
        for (c, t) in caches.iter_mut().zip(tokens) {
            c.len += t.len();
        }
        // The last new token of each sequence: final norm, LM head.
        let mut last = Vec::with_capacity(tokens.len() * h); // [S, hidden]
        let mut end = 0;
        for t in tokens {
            end += t.len();
            last.extend_from_slice(&x[(end - 1) * h..end * h]);
        }
        let s = tokens.len();
        let mut ln = vec![T::zero(); s * h];
        rms_norm(&mut ln, &last, &self.norm, a.rms_norm_eps);
        let vocab = a.vocab_size;
        let mut logits = vec![T::zero(); s * vocab]; // [S, vocab]
        matmul(&mut logits, &ln, &self.out, s, h, vocab, false);
        Ok(logits
            .chunks(vocab)
            .map(|r| {
                r.iter()
                    .map(|&v| <T as WithDType>::to_f64(v) as f32)
                    .collect()
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};

    /// Packing equals candle's concatenation of the transposed weights, on sizes that are not
    /// multiples of the 64-row block (the ragged last block).
    #[test]
    fn packed_columns_equals_the_concatenated_transposes() {
        let dev = Device::Cpu;
        let inp = 70;
        let mk = |out: usize, k: f32| {
            let v: Vec<f32> = (0..out * inp).map(|i| (i as f32 * k).sin()).collect();
            Tensor::from_vec(v, (out, inp), &dev).unwrap()
        };
        let (a, b, c) = (mk(3, 0.7), mk(130, 1.3), mk(5, 0.11));
        let got = super::packed_columns::<f32>(&[&a, &b, &c]).unwrap();
        let want: Vec<f32> = Tensor::cat(&[a.t().unwrap(), b.t().unwrap(), c.t().unwrap()], 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want);
        let one = super::transposed::<f32>(&b).unwrap();
        let want: Vec<f32> = b.t().unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(one, want);
    }
}
