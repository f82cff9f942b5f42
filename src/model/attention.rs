//! Attention without a `[batch, heads, seq, seq]` tensor kept for backward: one custom op on
//! (q, k, v) whose forward runs block by block over the queries (each block's scores over all
//! of its keys, so its softmax is exact without rescaling) and keeps nothing but its output,
//! and whose backward recomputes each block's probabilities from q and k
//! (FlashAttention's recomputation, with the query block as the unit):
//!
//! ```text
//! S = scale·Q·Kᵀ + bias,  P = softmax(S),  O = P·V
//! dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ⊙ (dP − rowsum(dO ⊙ O)),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q
//! ```
//!
//! Grouped-query attention stacks the query heads that share a key/value head along the query
//! axis (no copy of K or V per query head), as the composition of `block.rs` does; the
//! products are the device's (cuBLAS on a GPU), the softmax is f32. Packed sequences
//! (verl's `use_remove_padding`) run sequence by sequence, each causal on its own, with no
//! `[n, n]` mask. Memory: one block's `[batch, heads, block, keys]` scores at a time.
//! [`attention_composed`] is the plain composition the op is tested against (same function).

use std::sync::Arc;

use candle_core::{CustomOp3, DType, Layout, Result, Shape, Tensor, D};

/// Which keys each query sees.
#[derive(Debug, Clone)]
pub(crate) enum Keys {
    /// An additive bias `[batch, 1, queries, keys]`: 0 where allowed, −1e9 elsewhere.
    Bias(Tensor),
    /// Sequences packed end to end (batch 1), `(first token, length)` each: causal inside a
    /// sequence, each query seeing at most `window` positions (its own included).
    Packed {
        segments: Arc<[(usize, usize)]>,
        window: Option<usize>,
    },
}

/// Half-precision scores in f32 for the softmax; f32 and f64 stay as they are.
fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// The additive bias of one packed sequence of `len` tokens: `[len, len]`, 0 where key `j`
/// may be seen from query `i` (`j <= i`, and `i − j < window`), −1e9 elsewhere; built on `q`'s
/// device.
fn causal_bias(len: usize, window: Option<usize>, like: &Tensor) -> Result<Tensor> {
    let dev = like.device();
    let i = Tensor::arange(0u32, len as u32, dev)?.to_dtype(DType::F32)?;
    let diff = i.unsqueeze(1)?.broadcast_sub(&i.unsqueeze(0)?)?; // [len, len]: i − j
    let mut allowed = diff.ge(0f64)?;
    if let Some(w) = window {
        allowed = (allowed.to_dtype(DType::U8)? * diff.lt(w as f64)?.to_dtype(DType::U8)?)?;
    }
    let zero = Tensor::zeros((len, len), DType::F32, dev)?;
    let blocked = Tensor::full(-1e9f32, (len, len), dev)?;
    allowed.where_cond(&zero, &blocked)?.to_dtype(like.dtype())
}

/// Softmax attention of `q` `[b, nh, t, hd]` over `k`, `v` `[b, nkv, s, hd]` with `bias`
/// (broadcast to `[b, nh, t, s]`), as a plain composition of candle ops with `probs` in f32:
/// `[b, nh, t, hd]`. The reference the blocked op is tested against, and the path of a
/// forward with a KV cache.
pub(crate) fn attention_composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    attention_special(q, k, v, bias, scale, None, None)
}

/// [`attention_composed`] with GPT-OSS's sink logits `sinks` `[nh]` and Gemma 2's soft-capping
/// `softcap`. Soft-capping turns each scaled score `s` into `c·tanh(s/c)` before the mask is
/// added. With sinks each head's scores get one more column holding its sink, the softmax runs
/// over keys and sink, and the sink's probability is dropped, so a head may attend to less than
/// a whole position: `p_j = exp(s_j) / (exp(sink) + Σ_i exp(s_i))`. `[b, nh, t, hd]`.
pub(crate) fn attention_special(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f64,
    sinks: Option<&Tensor>,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let (nkv, s) = (k.dim(1)?, k.dim(2)?);
    let rep = nh / nkv;
    let dtype = q.dtype();
    // The `rep` query heads of a KV head stacked along the query axis: [b, nkv, rep·t, hd].
    let qg = q.contiguous()?.reshape((b, nkv, rep * t, hd))?;
    let scores = (qg.matmul(&k.t()?)? * scale)?; // [b, nkv, rep·t, s]
    let scores = match softcap {
        Some(c) => ((scores / c)?.tanh()? * c)?,
        None => scores,
    };
    let scores = upcast(&scores.reshape((b, nh, t, s))?.broadcast_add(bias)?)?; // [b, nh, t, s]
    let probs = match sinks {
        Some(sinks) => {
            let sink = sinks
                .to_dtype(scores.dtype())?
                .reshape((1, nh, 1, 1))?
                .broadcast_as((b, nh, t, 1))?; // [b, nh, t, 1]
            let all = Tensor::cat(&[&scores, &sink], 3)?; // [b, nh, t, s + 1]
            candle_nn::ops::softmax(&all, D::Minus1)?.narrow(3, 0, s)?
        }
        None => candle_nn::ops::softmax(&scores, D::Minus1)?,
    };
    let probs = probs.to_dtype(dtype)?.contiguous()?;
    probs
        .reshape((b, nkv, rep * t, s))?
        .matmul(&v.contiguous()?)? // [b, nkv, rep·t, hd]
        .reshape((b, nh, t, hd))
}

/// The blocked op on `q`, `k`, `v` (shapes as [`attention_composed`]): same values, and a
/// backward that keeps no scores.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: Keys,
    scale: f64,
) -> Result<Tensor> {
    attention_blocked(q, k, v, keys, scale, None)
}

/// [`attention`] with query blocks of `block` rows (`None`: sized so that one block's scores
/// take about 256 MiB).
pub(crate) fn attention_blocked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: Keys,
    scale: f64,
    block: Option<usize>,
) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let (b2, nkv, s, hd2) = k.dims4()?;
    if (b2, hd2) != (b, hd) || v.dims4()? != (b, nkv, s, hd) || nkv == 0 || nh % nkv != 0 {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not make grouped-query attention",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    match &keys {
        Keys::Bias(bias) => {
            let (bb, one, tq, sk) = bias.dims4()?;
            if (bb != b && bb != 1) || one != 1 || tq != t || sk != s {
                candle_core::bail!(
                    "attention: bias {:?} for q {:?} and k {:?}",
                    bias.dims(),
                    q.dims(),
                    k.dims()
                );
            }
        }
        Keys::Packed { segments, .. } => {
            let n: usize = segments.iter().map(|s| s.1).sum();
            if b != 1 || n != t || t != s {
                candle_core::bail!(
                    "attention: packed sequences of {n} tokens for q {:?} and k {:?}",
                    q.dims(),
                    k.dims()
                );
            }
        }
    }
    let block = block.unwrap_or_else(|| {
        let per_row = (b * nh * s).max(1) * 4 * 3; // scores, probs and a product in f32
        ((256usize << 20) / per_row).clamp(16, t.max(16))
    });
    let op = Attention { keys, scale, block };
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

struct Attention {
    keys: Keys,
    scale: f64,
    block: usize,
}

/// One query block's probabilities `[b, nkv, rep·tq, s]` and its stacked queries
/// `[b, nkv, rep·tq, hd]`: `q` `[b, nh, tq, hd]`, `bias` broadcast to `[b, nh, tq, s]`.
fn probs(q: &Tensor, k: &Tensor, bias: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
    let (b, nh, tq, hd) = q.dims4()?;
    let (nkv, s) = (k.dim(1)?, k.dim(2)?);
    let rep = nh / nkv;
    let qg = q.contiguous()?.reshape((b, nkv, rep * tq, hd))?;
    let scores = (qg.matmul(&k.t()?)? * scale)?
        .reshape((b, nh, tq, s))?
        .broadcast_add(bias)?;
    let p = candle_nn::ops::softmax_last_dim(&upcast(&scores)?)?
        .to_dtype(q.dtype())?
        .reshape((b, nkv, rep * tq, s))?;
    Ok((p, qg))
}

impl Attention {
    /// The independent groups of keys: all keys for a padded batch, each packed sequence's
    /// own, each with its query blocks.
    fn groups(&self, t: usize) -> Vec<Group> {
        let blocks = |len: usize, first: usize| {
            let mut out = Vec::new();
            let mut start = 0;
            while start < len {
                let n = self.block.min(len - start);
                out.push((first + start, n, start));
                start += n;
            }
            out
        };
        match &self.keys {
            Keys::Bias(_) => vec![Group {
                keys: None,
                blocks: blocks(t, 0),
            }],
            Keys::Packed { segments, .. } => segments
                .iter()
                .map(|&(a, l)| Group {
                    keys: Some((a, l)),
                    blocks: blocks(l, a),
                })
                .collect(),
        }
    }

    /// A group's keys and values, and the bias `[b|1, 1, n, keys]` of its block `(first, n,
    /// offset in the sequence)`.
    fn inputs(
        &self,
        g: &Group,
        (first, n, off): (usize, usize, usize),
        k: &Tensor,
        v: &Tensor,
        causal: &mut Option<Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match (&self.keys, g.keys) {
            (Keys::Bias(bias), _) => Ok((k.clone(), v.clone(), bias.narrow(2, first, n)?)),
            (Keys::Packed { window, segments }, Some((a, l))) => {
                // One causal template for the longest sequence, cut to each block.
                if causal.is_none() {
                    let longest = segments.iter().map(|s| s.1).max().unwrap_or(0);
                    *causal = Some(causal_bias(longest, *window, k)?);
                }
                let c = causal.as_ref().expect("built above");
                let bias = c
                    .narrow(0, off, n)?
                    .narrow(1, 0, l)?
                    .unsqueeze(0)?
                    .unsqueeze(0)?;
                Ok((k.narrow(2, a, l)?, v.narrow(2, a, l)?, bias))
            }
            (Keys::Packed { .. }, None) => {
                candle_core::bail!("attention: a packed group without keys")
            }
        }
    }

    /// The forward on plain tensors (no graph): `[b, nh, t, hd]`.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (b, nh, t, hd) = q.dims4()?;
        let mut causal = None;
        let mut outs = Vec::new();
        for g in self.groups(t) {
            for &blk in &g.blocks {
                let (kg, vg, bias) = self.inputs(&g, blk, k, v, &mut causal)?;
                let (first, n, _) = blk;
                let (pr, _) = probs(&q.narrow(2, first, n)?, &kg, &bias, self.scale)?;
                outs.push(pr.matmul(&vg.contiguous()?)?.reshape((b, nh, n, hd))?);
            }
        }
        Tensor::cat(&outs, 2)
    }
}

/// Keys `(first, length)` of a packed sequence (`None`: all keys) and its query blocks
/// `(first query, count, offset inside the sequence)`.
struct Group {
    keys: Option<(usize, usize)>,
    blocks: Vec<(usize, usize, usize)>,
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "blocked-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &Layout,
        s2: &candle_core::CpuStorage,
        l2: &Layout,
        s3: &candle_core::CpuStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CpuStorage, Shape)> {
        use crate::kernels::storage::{storage_of, tensor_of};
        let o = self.forward(
            &tensor_of(s1, l1)?,
            &tensor_of(s2, l2)?,
            &tensor_of(s3, l3)?,
        )?;
        Ok((storage_of(&o)?, o.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::cuda::{storage_of, tensor_of};
        let o = self.forward(
            &tensor_of(s1, l1)?,
            &tensor_of(s2, l2)?,
            &tensor_of(s3, l3)?,
        )?;
        Ok((storage_of(&o)?, o.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (q, k, v, o, g) = (q.detach(), k.detach(), v.detach(), o.detach(), g.detach());
        let (b, nh, t, hd) = q.dims4()?;
        let nkv = k.dim(1)?;
        let rep = nh / nkv;
        let (mut dq, mut dk, mut dv) = (Vec::new(), Vec::new(), Vec::new());
        let mut causal = None;
        for grp in self.groups(t) {
            let (mut dkg, mut dvg): (Option<Tensor>, Option<Tensor>) = (None, None);
            for &blk in &grp.blocks {
                let (kg, vg, bias) = self.inputs(&grp, blk, &k, &v, &mut causal)?;
                let (first, n, _) = blk;
                // [b, nkv, rep·n, keys] and the stacked queries [b, nkv, rep·n, hd]
                let (pr, qg) = probs(&q.narrow(2, first, n)?, &kg, &bias, self.scale)?;
                let stack = |x: &Tensor| {
                    x.narrow(2, first, n)?
                        .contiguous()?
                        .reshape((b, nkv, rep * n, hd))
                };
                let (gb, ob) = (stack(&g)?, stack(&o)?);
                let dvb = pr.t()?.matmul(&gb)?; // [b, nkv, keys, hd]
                let dp = gb.matmul(&vg.contiguous()?.t()?)?; // [b, nkv, rep·n, keys]
                let rows = (&gb * &ob)?.sum_keepdim(D::Minus1)?; // [b, nkv, rep·n, 1]
                let ds = (pr * dp.broadcast_sub(&rows)?)?;
                dq.push((ds.matmul(&kg.contiguous()?)? * self.scale)?.reshape((b, nh, n, hd))?);
                let dkb = (ds.t()?.matmul(&qg)? * self.scale)?; // [b, nkv, keys, hd]
                dkg = Some(match dkg {
                    Some(a) => (a + dkb)?,
                    None => dkb,
                });
                dvg = Some(match dvg {
                    Some(a) => (a + dvb)?,
                    None => dvb,
                });
            }
            if let (Some(a), Some(c)) = (dkg, dvg) {
                dk.push(a);
                dv.push(c);
            }
        }
        Ok((
            Some(Tensor::cat(&dq, 2)?),
            Some(Tensor::cat(&dk, 2)?),
            Some(Tensor::cat(&dv, 2)?),
        ))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;

    fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| r.random_range(-1.0..1.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    }

    /// A left-padded causal bias `[b, 1, t, t]` (row 1 padded by `pad` tokens), −1e9 where a
    /// query may not look, as the model builds it.
    fn padded_bias(b: usize, t: usize, pad: usize, window: Option<usize>) -> Tensor {
        let mut v = vec![0f64; b * t * t];
        for r in 0..b {
            for i in 0..t {
                for j in 0..t {
                    let old = window.is_some_and(|w| j + w <= i);
                    if j > i || old || (r == 1 && j < pad) {
                        v[(r * t + i) * t + j] = -1e9;
                    }
                }
            }
        }
        Tensor::from_vec(v, (b, 1, t, t), &Device::Cpu).unwrap()
    }

    /// Σ o·w for a fixed random `w`, and the gradients of q, k, v.
    fn grads(o: &Tensor, w: &Tensor, vars: &[&Var]) -> Vec<Tensor> {
        let g = (o * w).unwrap().sum_all().unwrap().backward().unwrap();
        vars.iter()
            .map(|v| g.get(v.as_tensor()).unwrap().clone())
            .collect()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    /// Values and the gradients of q, k, v equal the composition's (reference: candle's
    /// autograd through `attention_composed`), f64 to 1e-12 and f32 to 1e-5, for grouped
    /// queries (6 heads over 2), a padded row, a sliding window, and blocks of 1, 3 and all
    /// queries.
    #[test]
    fn blocked_attention_equals_the_composition() {
        for dtype in [DType::F64, DType::F32] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
            for window in [None, Some(3)] {
                for block in [Some(1), Some(3), None] {
                    let (b, nh, nkv, t, hd) = (2, 6, 2, 7, 4);
                    let q = Var::from_tensor(&randn(&[b, nh, t, hd], 1, dtype)).unwrap();
                    let k = Var::from_tensor(&randn(&[b, nkv, t, hd], 2, dtype)).unwrap();
                    let v = Var::from_tensor(&randn(&[b, nkv, t, hd], 3, dtype)).unwrap();
                    let w = randn(&[b, nh, t, hd], 4, dtype);
                    let bias = padded_bias(b, t, 2, window).to_dtype(dtype).unwrap();
                    let scale = 0.5;
                    let want = attention_composed(&q, &k, &v, &bias, scale).unwrap();
                    let got = attention_blocked(&q, &k, &v, Keys::Bias(bias.clone()), scale, block)
                        .unwrap();
                    let ctx = format!("{dtype:?} window {window:?} block {block:?}");
                    assert!(
                        max_diff(&want, &got) < tol,
                        "values {ctx}: {}",
                        max_diff(&want, &got)
                    );
                    let gw = grads(&want, &w, &[&q, &k, &v]);
                    let gg = grads(&got, &w, &[&q, &k, &v]);
                    for (name, (a, c)) in ["q", "k", "v"].iter().zip(gw.iter().zip(&gg)) {
                        let d = max_diff(a, c);
                        assert!(d < tol, "d{name} {ctx}: {d}");
                    }
                }
            }
        }
    }

    /// Packed sequences (batch 1, three sequences end to end) give each sequence the values
    /// and gradients of attending over that sequence alone (the composition with a
    /// block-diagonal causal bias, f64, 1e-12), with and without a window, in blocks of 2.
    #[test]
    fn packed_sequences_attend_within_their_own_sequence() {
        let segs: Vec<(usize, usize)> = vec![(0, 3), (3, 5), (8, 1)];
        let (nh, nkv, n, hd) = (4, 2, 9, 3);
        for window in [None, Some(2)] {
            let q = Var::from_tensor(&randn(&[1, nh, n, hd], 5, DType::F64)).unwrap();
            let k = Var::from_tensor(&randn(&[1, nkv, n, hd], 6, DType::F64)).unwrap();
            let v = Var::from_tensor(&randn(&[1, nkv, n, hd], 7, DType::F64)).unwrap();
            let w = randn(&[1, nh, n, hd], 8, DType::F64);
            // The block-diagonal bias written out by hand.
            let mut bias = vec![-1e9f64; n * n];
            for &(a, l) in &segs {
                for i in 0..l {
                    for j in 0..=i {
                        if window.is_none_or(|w| i - j < w) {
                            bias[(a + i) * n + a + j] = 0.0;
                        }
                    }
                }
            }
            let bias = Tensor::from_vec(bias, (1, 1, n, n), &Device::Cpu).unwrap();
            let want = attention_composed(&q, &k, &v, &bias, 0.7).unwrap();
            let keys = Keys::Packed {
                segments: segs.clone().into(),
                window,
            };
            let got = attention_blocked(&q, &k, &v, keys, 0.7, Some(2)).unwrap();
            assert!(max_diff(&want, &got) < 1e-12, "window {window:?}");
            let gw = grads(&want, &w, &[&q, &k, &v]);
            let gg = grads(&got, &w, &[&q, &k, &v]);
            for (name, (a, c)) in ["q", "k", "v"].iter().zip(gw.iter().zip(&gg)) {
                assert!(
                    max_diff(a, c) < 1e-12,
                    "d{name} window {window:?}: {}",
                    max_diff(a, c)
                );
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let q = randn(&[1, 3, 4, 2], 1, DType::F32);
        let k = randn(&[1, 2, 4, 2], 2, DType::F32);
        let bias = Tensor::zeros((1, 1, 4, 4), DType::F32, &Device::Cpu).unwrap();
        let e = attention(&q, &k, &k, Keys::Bias(bias), 1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("grouped-query"), "{e}");
        let q = randn(&[2, 2, 4, 2], 1, DType::F32);
        let k = randn(&[2, 2, 4, 2], 2, DType::F32);
        let keys = Keys::Packed {
            segments: vec![(0, 4)].into(),
            window: None,
        };
        let e = attention(&q, &k, &k, keys, 1.0).unwrap_err().to_string();
        assert!(e.contains("packed"), "{e}");
    }
}
