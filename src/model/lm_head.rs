//! Fused operations with their own backward pass (candle `CustomOp`s), each next to the plain
//! composition of candle ops it replaces and is tested against.
//!
//! [`token_logprobs_fused`]: the LM head, log-softmax, gather of the target token and the
//! entropy in one pass over row chunks. Forward keeps nothing but its inputs and outputs (no
//! `[rows, vocab]` logits survive a chunk); backward (on the CPU) recomputes the logits in
//! blocks of vocabulary columns over all rows, taking each row's lse from its output
//! (`lse = z_t − log p(t)`), and forms the gradient of the logits in place:
//!
//! ```text
//! z = h · Wᵀ (row chunk),  p = softmax(z),  lse = log Σ exp z
//! log p(t) = z_t − lse                       ∂/∂z_j = δ_jt − p_j
//! H = −Σ p log p = lse − Σ p_j z_j           ∂H/∂z_j = −p_j (z_j − lse + H)
//! ∂L/∂h = dz · W,   ∂L/∂W = dzᵀ · h          (dz = g_lp ∂log p(t)/∂z + g_H ∂H/∂z)
//! Σ p² = Σ e² / (Σ e)²,  e = exp(z − max)     (when asked; forward only, no gradient)
//! ```
//!
//! CPU with f32/f64 runs it on host slices; on a GPU the same op runs as chunked tensor
//! operations (`forward_tensors` / `backward_tensors`, chunks of ~2^28 logits, bf16 products
//! when asked); half precision on the CPU uses the composition
//! (`CausalLm::token_logprobs_composed`). Inside a trainer's `grad_sink` scope the host path
//! adds `∂L/∂W` block by block into the weight's one accumulator instead of handing candle a
//! new `[vocab, hidden]` tensor.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;
use std::sync::Arc;

use super::grad_sink::Sink;
use crate::kernels::bf16::{self, PackedB};
use crate::kernels::elem::Elem;
use crate::kernels::gemm::{gemm_mixed, gemm_strided};
use crate::kernels::simd::{vectorized, Par};
use crate::kernels::storage::{contiguous, Host};

/// Row statistics of logits `z` (one row): (max-shifted log-sum-exp, Σ p z).
#[inline(always)]
fn row_stats<T: Elem>(z: &[T]) -> (T, T) {
    let mx = z
        .iter()
        .fold(T::neg_infinity(), |a, &v| num_traits::Float::max(a, v));
    // Σ e^(z−max) and Σ e^(z−max)·z in f64, in 16 interleaved partial sums (vector lanes): in
    // f32 each term below half an ulp of the running sum is dropped, which over a 49,152-token
    // vocabulary moved log-probs by up to ~2e-4.
    let (mut s, mut sz) = ([0f64; 16], [0f64; 16]);
    let n = z.len() / 16 * 16;
    for c in z[..n].chunks_exact(16) {
        for ((a, b), &v) in s.iter_mut().zip(sz.iter_mut()).zip(c) {
            let e = WithDType::to_f64((v - mx).exp_fast());
            *a += e;
            *b += e * WithDType::to_f64(v);
        }
    }
    let (mut s1, mut sz1) = (0f64, 0f64);
    for &v in &z[n..] {
        let e = WithDType::to_f64((v - mx).exp_fast());
        s1 += e;
        sz1 += e * WithDType::to_f64(v);
    }
    let s = s.iter().fold(s1, |a, &b| a + b);
    let sz = sz.iter().fold(sz1, |a, &b| a + b);
    (
        T::from_f64(WithDType::to_f64(mx) + s.ln()),
        T::from_f64(sz / s),
    )
}

/// [`row_stats`] and Σ p² = Σ e² / (Σ e)² with `e = exp(z − max)`, the sums in f64 in the same
/// 16 lanes (a function of its own, so that the pass without Σ p² keeps its loop).
#[inline(always)]
fn row_stats_sq<T: Elem>(z: &[T]) -> (T, T, f64) {
    let mx = z
        .iter()
        .fold(T::neg_infinity(), |a, &v| num_traits::Float::max(a, v));
    let (mut s, mut sz, mut s2) = ([0f64; 16], [0f64; 16], [0f64; 16]);
    let n = z.len() / 16 * 16;
    for c in z[..n].chunks_exact(16) {
        for (((a, b), q), &v) in s.iter_mut().zip(sz.iter_mut()).zip(s2.iter_mut()).zip(c) {
            let e = WithDType::to_f64((v - mx).exp_fast());
            *a += e;
            *b += e * WithDType::to_f64(v);
            *q += e * e;
        }
    }
    let (mut s1, mut sz1, mut s21) = (0f64, 0f64, 0f64);
    for &v in &z[n..] {
        let e = WithDType::to_f64((v - mx).exp_fast());
        s1 += e;
        sz1 += e * WithDType::to_f64(v);
        s21 += e * e;
    }
    let s = s.iter().fold(s1, |a, &b| a + b);
    let sz = sz.iter().fold(sz1, |a, &b| a + b);
    let s2 = s2.iter().fold(s21, |a, &b| a + b);
    (
        T::from_f64(WithDType::to_f64(mx) + s.ln()),
        T::from_f64(sz / s),
        s2 / (s * s),
    )
}

/// The fused LM-head op: inputs hidden `[rows, hidden]` and the output weight `[vocab, hidden]`
/// (both contiguous); output `[rows, 2]` = (log-prob of the target, entropy), `[rows, 3]` with
/// Σ p² as the third column when `with_sum_pi_squared` (no gradient flows from it).
struct LogProbs {
    targets: Vec<u32>,
    chunk: usize,
    with_entropy: bool,
    with_sum_pi_squared: bool,
    /// Products with bf16 operands and f32 sums (f32 on CPUs with a bf16 kernel), the weight packed once per
    /// pass for all chunks.
    bf16: bool,
    /// Off the CPU: the weight (sharing its storage, outside autograd) and the targets on its
    /// device, for [`LogProbs::forward_tensors`] (the op's inputs arrive as bare storage).
    device: Option<(Tensor, Tensor)>,
    /// The tensor path's chunks hold at least this many logits (`chunk` rows otherwise).
    min_chunk_logits: usize,
    /// Where the host path's backward puts the weight's gradient when a scope armed the
    /// weight (see `grad_sink`); `None`: it hands it to candle.
    sink: Option<Arc<Sink>>,
}

/// `W` `[vocab, hid]` packed once per forward for the bf16 products `x·Wᵀ` of every row
/// chunk, when they apply.
struct Packs {
    t: Option<PackedB>,
}

impl Packs {
    fn new<T: Elem>(bf16: bool, w: &[T], hid: usize) -> Self {
        let vocab = w.len() / hid.max(1);
        match T::f32s(w) {
            Some(w) if bf16 && bf16::available() => Packs {
                t: Some(PackedB::new(w, 1, hid, hid, vocab, Par::Rayon)),
            },
            _ => Packs { t: None },
        }
    }

    /// `dst[m, vocab] = a[m, ·] · Wᵀ` through the pack when there is one, else in `T`.
    fn logits<T: Elem>(&self, dst: &mut [T], m: usize, a: &[T], w: &[T], hid: usize) {
        let vocab = w.len() / hid;
        if let (Some(p), Some(a32)) = (self.t.as_ref(), T::f32s(a)) {
            let d32 = T::f32s_mut(dst).expect("one element type");
            bf16::gemm_packed(d32, m, a32, hid, 1, p, false, Par::Rayon);
        } else {
            gemm_strided(dst, m, vocab, hid, a, hid, 1, w, 1, hid, false, Par::Rayon);
        }
    }
}

impl LogProbs {
    /// Output columns: log-prob, entropy, and Σ p² when asked.
    fn cols(&self) -> usize {
        2 + usize::from(self.with_sum_pi_squared)
    }

    fn forward<T: Elem>(&self, h: &[T], w: &[T], hid: usize) -> Result<Vec<T>> {
        let n = self.targets.len();
        let vocab = w.len() / hid;
        let cols = self.cols();
        let mut out = vec![T::zero(); n * cols]; // [n, cols]
        let packs = Packs::new(self.bf16, w, hid);
        // One logits buffer for every chunk, each chunk's product overwriting it.
        let mut zbuf = vec![T::zero(); self.chunk.min(n) * vocab];
        for start in (0..n).step_by(self.chunk) {
            let c = self.chunk.min(n - start);
            let z = &mut zbuf[..c * vocab]; // [c, vocab]
            let hc = &h[start * hid..(start + c) * hid];
            packs.logits(z, c, hc, w, hid);
            let tg = &self.targets[start..start + c];
            out[start * cols..(start + c) * cols]
                .par_chunks_mut(cols)
                .zip(z.par_chunks(vocab))
                .zip(tg.par_iter())
                .for_each(|((o, zr), &t)| {
                    let (lse, mean_z) = if self.with_sum_pi_squared {
                        let (lse, mean_z, sq) = vectorized(
                            #[inline(always)]
                            || row_stats_sq(zr),
                        );
                        o[2] = T::from_f64(sq);
                        (lse, mean_z)
                    } else {
                        vectorized(
                            #[inline(always)]
                            || row_stats(zr),
                        )
                    };
                    o[0] = zr[t as usize] - lse;
                    o[1] = if self.with_entropy {
                        lse - mean_z
                    } else {
                        T::zero()
                    };
                });
        }
        Ok(out)
    }

    /// The gradient of hidden `[rows, hidden]` from the forward's outputs `res` and their
    /// gradient `g` `[rows, cols]` (a Σ p² column's gradient is not read); with `gw` (the weight
    /// is trained: not a LoRA model's frozen output embedding) the weight's `[vocab, hidden]`
    /// too, written into `gw.0`, or added to it when `gw.1`.
    ///
    /// The vocabulary in blocks of columns, every row at once: each block's logits
    /// `z = h·W_bᵀ` `[rows, block]` are recomputed and turned into `dz` in place, then
    /// `∂h += dz·W_b` and `∂W_b = dzᵀ·h` — each block of the weight's gradient written once,
    /// with all rows summed inside the product (row chunks instead add every chunk's part into
    /// the whole `[vocab, hidden]` gradient: 32 passes over 1 GB for 512 positions of a
    /// 248k-token vocabulary in chunks of 16). Each row's log-sum-exp comes from its forward
    /// output, `lse = z_t − log p(t)` (one dot product per row), its entropy from `res`.
    fn backward<T: Elem>(
        &self,
        (h, w, res): (&[T], &[T], &[T]),
        g: &[T],
        hid: usize,
        mut gw: Option<(&mut [T], bool)>,
    ) -> Vec<T> {
        let n = self.targets.len();
        let vocab = w.len() / hid.max(1);
        let cols = self.cols();
        let mut gh = vec![T::zero(); n * hid];
        if n == 0 || vocab == 0 {
            return gh;
        }
        // Per row: lse, H, and the gradients of log p(t) and H.
        let stats: Vec<[T; 4]> = (0..n)
            .into_par_iter()
            .map(|r| {
                let t = self.targets[r] as usize;
                let zt = self.target_logit(&h[r * hid..][..hid], &w[t * hid..][..hid]);
                let (ent, g_h) = match self.with_entropy {
                    true => (res[r * cols + 1], g[r * cols + 1]),
                    false => (T::zero(), T::zero()),
                };
                [zt - res[r * cols], ent, g[r * cols], g_h]
            })
            .collect();
        // Columns per block: about as many logits as the forward's row chunks hold, in whole
        // 64-column groups.
        let block = (self.chunk * vocab / n)
            .next_multiple_of(64)
            .clamp(64, vocab.next_multiple_of(64))
            .min(vocab);
        let mut buf = vec![T::zero(); n * block]; // [n, block], reused
        for v0 in (0..vocab).step_by(block) {
            let vb = block.min(vocab - v0);
            let wb = &w[v0 * hid..(v0 + vb) * hid]; // [vb, hid]
            let z = &mut buf[..n * vb];
            // z = h [n, hid] · W_bᵀ [hid, vb]
            gemm_mixed(
                self.bf16,
                z,
                n,
                vb,
                hid,
                h,
                hid,
                1,
                wb,
                1,
                hid,
                false,
                Par::Rayon,
            );
            z.par_chunks_mut(vb)
                .zip(stats.par_iter())
                .zip(self.targets.par_iter())
                .for_each(|((zr, &[lse, ent, g_lp, g_h]), &t)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for v in zr.iter_mut() {
                                let p = (*v - lse).exp_fast();
                                *v = -g_lp * p - g_h * p * (*v - lse + ent);
                            }
                        },
                    );
                    let t = t as usize;
                    if (v0..v0 + vb).contains(&t) {
                        zr[t - v0] += g_lp;
                    }
                });
            // ∂h += dz [n, vb] · W_b [vb, hid]
            gemm_mixed(
                self.bf16,
                &mut gh,
                n,
                hid,
                vb,
                z,
                vb,
                1,
                wb,
                hid,
                1,
                true,
                Par::Rayon,
            );
            // ∂W_b = dzᵀ [vb, n] · h [n, hid]
            if let Some((gw, add)) = gw.as_mut() {
                let gwb = &mut gw[v0 * hid..(v0 + vb) * hid];
                gemm_mixed(
                    self.bf16,
                    gwb,
                    vb,
                    hid,
                    n,
                    z,
                    1,
                    vb,
                    h,
                    hid,
                    1,
                    *add,
                    Par::Rayon,
                );
            }
        }
        gh
    }

    /// `z_t = h·W[t]`: in f64 over bf16-rounded operands where the products are bf16 (as the
    /// kernel's, up to the order of its f32 sums), else in the element type.
    fn target_logit<T: Elem>(&self, h: &[T], wt: &[T]) -> T {
        match (T::f32s(h), T::f32s(wt)) {
            (Some(a), Some(b)) if self.bf16 && bf16::available() => {
                let r = |x: f32| f64::from(bf16::round_bf16(x));
                T::from_f64(a.iter().zip(b).map(|(&x, &y)| r(x) * r(y)).sum())
            }
            _ => crate::kernels::elem::dot(h, wt),
        }
    }
}

/// f64 stays f64, anything else computes in f32.
fn wide(d: DType) -> DType {
    match d {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// The same op as tensor operations on any device (the path on a GPU): per chunk of rows the
/// logits `[c, vocab]` in f32 (bf16 products when asked), their row statistics, and in
/// backward the logits again and `dz` formed from them; nothing of size `[rows, vocab]`
/// outlives a chunk.
impl LogProbs {
    /// `z = h_c · Wᵀ` in f32: `[c, vocab]`.
    fn chunk_logits(&self, hc: &Tensor, w: &Tensor) -> Result<Tensor> {
        let z = match self.bf16 {
            true => super::block::mixed_matmul(hc, w)?,
            false => hc.matmul(&w.t()?)?,
        };
        z.to_dtype(wide(hc.dtype()))
    }

    /// (lse, Σ p z) of each row of `z` `[c, vocab]`: `[c, 1]` each, and `e = exp(z − max)`
    /// `[c, vocab]`, `Σ e` `[c, 1]`.
    fn chunk_stats(z: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let mx = z.max_keepdim(1)?;
        let e = z.broadcast_sub(&mx)?.exp()?;
        let s = e.sum_keepdim(1)?;
        let lse = (mx + s.log()?)?;
        let mean_z = (&e * z)?.sum_keepdim(1)?.div(&s)?;
        Ok((lse, mean_z, e, s))
    }

    /// The rows a chunk of the tensor path holds: `chunk`, or more to reach
    /// `min_chunk_logits` (2^28 on a GPU: 1 GiB of f32 logits, large products).
    fn device_chunk(&self, vocab: usize) -> usize {
        self.chunk.max(self.min_chunk_logits / vocab.max(1)).max(1)
    }

    /// Forward: `[rows, cols]` = (log-prob of the target, entropy or 0, and Σ p² when asked), in
    /// `h`'s dtype. Σ p² = Σ e² / (Σ e)², summed in the logits' dtype (f32, f64 for f64).
    fn forward_tensors(&self, h: &Tensor, w: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let n = h.dim(0)?;
        let chunk = self.device_chunk(w.dim(0)?);
        let mut outs = Vec::new();
        for start in (0..n).step_by(chunk) {
            let c = chunk.min(n - start);
            let z = self.chunk_logits(&h.narrow(0, start, c)?, w)?; // [c, vocab]
            let (lse, mean_z, e, s) = Self::chunk_stats(&z)?;
            let tg = targets.narrow(0, start, c)?.unsqueeze(1)?; // [c, 1]
            let lp = (z.gather(&tg, 1)? - &lse)?;
            let ent = match self.with_entropy {
                true => (lse - mean_z)?,
                false => lp.zeros_like()?,
            };
            let mut parts = vec![lp, ent];
            if self.with_sum_pi_squared {
                // Σ e² / (Σ e)²: [c, 1]
                parts.push(e.sqr()?.sum_keepdim(1)?.div(&s.sqr()?)?);
            }
            outs.push(Tensor::cat(&parts, 1)?);
        }
        Tensor::cat(&outs, 0)?.to_dtype(h.dtype())
    }

    /// Backward: gradients of `h` and (when `need_w`) `w` from `g` `[rows, 2]`.
    fn backward_tensors(
        &self,
        h: &Tensor,
        w: &Tensor,
        targets: &Tensor,
        g: &Tensor,
        need_w: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let n = h.dim(0)?;
        let chunk = self.device_chunk(w.dim(0)?);
        let g = g.to_dtype(wide(h.dtype()))?;
        let mut gh = Vec::new();
        let mut gw: Option<Tensor> = None;
        for start in (0..n).step_by(chunk) {
            let c = chunk.min(n - start);
            let hc = h.narrow(0, start, c)?;
            let z = self.chunk_logits(&hc, w)?; // [c, vocab]
            let (lse, mean_z, e, s) = Self::chunk_stats(&z)?;
            let p = e.broadcast_div(&s)?;
            let gc = g.narrow(0, start, c)?;
            let g_lp = gc.narrow(1, 0, 1)?; // [c, 1]
                                            // dz = −g_lp p − g_H p (z − lse + H) + g_lp at the target
            let mut coef = g_lp.neg()?.broadcast_as(z.shape())?.contiguous()?;
            if self.with_entropy {
                let g_h = gc.narrow(1, 1, 1)?;
                let ent = (&lse - &mean_z)?;
                let shifted = z.broadcast_sub(&lse)?.broadcast_add(&ent)?; // z − lse + H
                coef = (coef - shifted.broadcast_mul(&g_h)?)?;
            }
            let tg = targets.narrow(0, start, c)?.unsqueeze(1)?;
            let dz = (p * coef)?.scatter_add(&tg, &g_lp.contiguous()?, 1)?; // [c, vocab]
            let dz = dz.to_dtype(h.dtype())?;
            // ∂h = dz · W,  ∂W += dzᵀ · h_c
            let ghc = match self.bf16 {
                true => super::block::mixed_matmul(&dz, &w.t()?)?,
                false => dz.matmul(w)?,
            };
            gh.push(ghc);
            if need_w {
                let d = match self.bf16 {
                    true => super::block::mixed_matmul(&dz.t()?, &hc.t()?)?,
                    false => dz.t()?.matmul(&hc)?,
                };
                gw = Some(match gw {
                    Some(a) => (a + d)?,
                    None => d,
                });
            }
        }
        Ok((Tensor::cat(&gh, 0)?, gw))
    }
}

impl CustomOp2 for LogProbs {
    fn name(&self) -> &'static str {
        "fused-lm-head-logprobs"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if let Some((w, targets)) = &self.device {
            // The tensor path on CPU tensors (tests compare it with the host-slice path).
            let h = crate::kernels::storage::tensor_of(s1, l1)?;
            let out = self.forward_tensors(&h, w, targets)?;
            return Ok((
                crate::kernels::storage::storage_of(&out)?,
                out.shape().clone(),
            ));
        }
        let (rows, hid) = l1.shape().dims2()?;
        let (_, hid2) = l2.shape().dims2()?;
        if hid != hid2 || rows != self.targets.len() {
            candle_core::bail!(
                "fused log-probs: hidden {:?}, weight {:?}, {} targets",
                l1.shape(),
                l2.shape(),
                self.targets.len()
            );
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(self.forward::<f32>(
                contiguous(s1, l1, "fused log-probs: hidden")?,
                contiguous(s2, l2, "fused log-probs: weight")?,
                hid,
            )?),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(self.forward::<f64>(
                contiguous(s1, l1, "fused log-probs: hidden")?,
                contiguous(s2, l2, "fused log-probs: weight")?,
                hid,
            )?),
            _ => candle_core::bail!("fused log-probs: f32 or f64 inputs of one dtype only"),
        };
        Ok((out, Shape::from((rows, self.cols()))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let Some((w, targets)) = &self.device else {
            candle_core::bail!("fused log-probs: the device path was not prepared");
        };
        let h = crate::kernels::cuda::tensor_of(s1, l1)?;
        let out = self.forward_tensors(&h, w, targets)?;
        Ok((crate::kernels::cuda::storage_of(&out)?, out.shape().clone()))
    }

    fn bwd(
        &self,
        h: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if let Some((_, targets)) = &self.device {
            let (gh, gw) = self.backward_tensors(
                &h.detach(),
                &w.detach(),
                targets,
                &grad.detach(),
                w.track_op(),
            )?;
            return Ok((Some(gh), gw));
        }
        fn run<T: Elem>(
            op: &LogProbs,
            h: &Tensor,
            w: &Tensor,
            res: &Tensor,
            grad: &Tensor,
        ) -> Result<(Tensor, Option<Tensor>)> {
            let (rows, hid) = h.dims2()?;
            let vocab = w.dim(0)?;
            let need_w = w.track_op();
            // Read in place (the weight is the whole vocabulary: no copy of it per backward).
            let ts = [h, w, res, grad].map(Tensor::contiguous);
            let [h, w, res, grad] = ts;
            let (h, w, res, grad) = (h?, w?, res?, grad?);
            let host = Host::new(&[&h, &w, &res, &grad])?;
            let ins = (host.slice(0)?, host.slice(1)?, host.slice(2)?);
            let g = host.slice(3)?;
            let sink = super::grad_sink::open(&op.sink);
            let (gh, gw) = match (sink, need_w) {
                (_, false) => (op.backward::<T>(ins, g, hid, None), None),
                // The weight's gradient goes into its sink (added after the first pass);
                // candle receives none.
                (Some(sink), true) => {
                    let mut gh = Vec::new();
                    sink.with::<T>(|sum, add| {
                        gh = op.backward::<T>(ins, g, hid, Some((sum, add)));
                    })?;
                    (gh, None)
                }
                (None, true) => {
                    let mut gw = vec![T::zero(); vocab * hid];
                    let gh = op.backward::<T>(ins, g, hid, Some((&mut gw, false)));
                    (gh, Some(Tensor::from_vec(gw, (vocab, hid), w.device())?))
                }
            };
            Ok((Tensor::from_vec(gh, (rows, hid), h.device())?, gw))
        }
        let (gh, gw) = match h.dtype() {
            DType::F64 => run::<f64>(self, h, w, res, grad)?,
            _ => run::<f32>(self, h, w, res, grad)?,
        };
        Ok((Some(gh), gw))
    }
}

/// What the head computes besides each target's log-prob.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeadStats {
    /// The entropy of each position's distribution (differentiable).
    pub entropy: bool,
    /// Σ_j p_j² of each position's distribution (detached: no gradient flows from it).
    pub sum_pi_squared: bool,
}

/// The head's outputs, `[rows]` each (`[batch, seq]` from `CausalLm::token_stats`).
#[derive(Debug, Clone)]
pub struct HeadOut {
    pub log_probs: Tensor,
    pub entropy: Option<Tensor>,
    pub sum_pi_squared: Option<Tensor>,
}

/// Log-probabilities of `targets` `[rows]` under logits `hidden · weightᵀ` and, when asked, the
/// entropy of each row's distribution: `[rows]` each. `hidden` `[rows, hidden]`, `weight`
/// `[vocab, hidden]`; `chunk` rows at a time. Differentiable in both inputs.
pub fn token_logprobs_fused(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk: usize,
    with_entropy: bool,
    bf16: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let stats = HeadStats {
        entropy: with_entropy,
        sum_pi_squared: false,
    };
    let out = token_stats_fused(hidden, weight, targets, chunk, stats, bf16)?;
    Ok((out.log_probs, out.entropy))
}

/// [`token_logprobs_fused`] with the statistics `stats` asks for (Σ p² among them).
pub fn token_stats_fused(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk: usize,
    stats: HeadStats,
    bf16: bool,
) -> Result<HeadOut> {
    let targets: Vec<u32> = targets.to_dtype(DType::U32)?.flatten_all()?.to_vec1()?;
    let vocab = weight.dim(0)?;
    if let Some(&t) = targets.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("target token id {t} outside the vocabulary ({vocab})");
    }
    // Off the CPU the op runs as chunked tensor operations on the weight's device, ~2^28
    // logits per chunk.
    let tensors = (!weight.device().is_cpu()).then_some(1 << 28);
    token_logprobs_op(hidden, weight, targets, chunk, stats, bf16, tensors)
}

/// [`token_stats_fused`] with the path chosen: `tensors` runs the op as chunked tensor
/// operations (the GPU path) on any device, chunks of at least that many logits.
fn token_logprobs_op(
    hidden: &Tensor,
    weight: &Tensor,
    targets: Vec<u32>,
    chunk: usize,
    stats: HeadStats,
    bf16: bool,
    tensors: Option<usize>,
) -> Result<HeadOut> {
    let device = match tensors {
        None => None,
        Some(_) => Some((
            weight.detach(),
            Tensor::from_vec(targets.clone(), targets.len(), weight.device())?,
        )),
    };
    let op = LogProbs {
        targets,
        chunk: chunk.max(1),
        with_entropy: stats.entropy,
        with_sum_pi_squared: stats.sum_pi_squared,
        bf16,
        sink: match device {
            None => super::grad_sink::sink_of(weight),
            Some(_) => None,
        },
        device,
        min_chunk_logits: tensors.unwrap_or(0),
    };
    let out = hidden.contiguous()?.apply_op2(&weight.contiguous()?, op)?; // [rows, 2 or 3]
    let column = |k: usize| out.narrow(1, k, 1)?.squeeze(1); // [rows]
    Ok(HeadOut {
        log_probs: column(0)?,
        entropy: stats.entropy.then(|| column(1)).transpose()?,
        sum_pi_squared: stats
            .sum_pi_squared
            .then(|| column(2).map(|t| t.detach()))
            .transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::{token_logprobs_fused, token_logprobs_op};

    /// Which implementation a test runs.
    #[derive(Clone, Copy, PartialEq)]
    enum Path {
        /// The op on host slices (the CPU path).
        Host,
        /// The op as chunked tensor operations (the GPU path), here on the CPU.
        Tensors,
        /// The plain composition of candle ops.
        Composed,
    }

    fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| (rng.random::<f64>() * 2.0 - 1.0) * scale)
            .collect()
    }

    /// L = Σ a·log p(t) + b·H over rows; rows with a = b = 0 stand for padding.
    struct Case {
        rows: usize,
        hid: usize,
        vocab: usize,
        h: Vec<f64>,
        w: Vec<f64>,
        t: Vec<u32>,
        a: Vec<f64>,
        b: Vec<f64>,
    }

    fn case(seed: u64) -> Case {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let rows = rng.random_range(3..12);
        let hid = rng.random_range(2..9);
        let vocab = rng.random_range(3..40);
        let mut a = randn(&mut rng, rows, 1.0);
        let mut b = randn(&mut rng, rows, 1.0);
        for r in 0..rows / 3 {
            a[r * 3] = 0.0; // padding rows: no weight in the loss
            b[r * 3] = 0.0;
        }
        Case {
            rows,
            hid,
            vocab,
            h: randn(&mut rng, rows * hid, 1.5),
            w: randn(&mut rng, vocab * hid, 1.5),
            t: (0..rows)
                .map(|_| rng.random_range(0..vocab as u32))
                .collect(),
            a,
            b,
        }
    }

    /// Loss and gradients (hidden, weight) with the fused op or the composition, in `dtype`.
    fn run(c: &Case, dtype: DType, path: Path, chunk: usize) -> (f64, Vec<f64>, Vec<f64>) {
        let dev = Device::Cpu;
        let h = Var::from_tensor(
            &Tensor::from_vec(c.h.clone(), (c.rows, c.hid), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(
            &Tensor::from_vec(c.w.clone(), (c.vocab, c.hid), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
        .unwrap();
        let t = Tensor::from_vec(c.t.clone(), c.rows, &dev).unwrap();
        let (lp, ent) = if path == Path::Host {
            token_logprobs_fused(h.as_tensor(), w.as_tensor(), &t, chunk, true, false).unwrap()
        } else if path == Path::Tensors {
            let (h, w) = (h.as_tensor(), w.as_tensor());
            let stats = super::HeadStats {
                entropy: true,
                sum_pi_squared: false,
            };
            let out = token_logprobs_op(h, w, c.t.clone(), chunk, stats, false, Some(0)).unwrap();
            (out.log_probs, out.entropy)
        } else {
            // The composition of transformer.rs, on the same [rows, hidden] layout.
            let z = h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
            let lsm = candle_nn::ops::log_softmax(&z, 1).unwrap();
            let lp = lsm
                .gather(&t.unsqueeze(1).unwrap(), 1)
                .unwrap()
                .squeeze(1)
                .unwrap();
            let ent = (lsm.exp().unwrap() * &lsm)
                .unwrap()
                .sum(1)
                .unwrap()
                .neg()
                .unwrap();
            (lp, Some(ent))
        };
        let a = Tensor::from_vec(c.a.clone(), c.rows, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let b = Tensor::from_vec(c.b.clone(), c.rows, &dev)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let loss = ((lp * a).unwrap() + (ent.unwrap() * b).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let v = |x: &Tensor| -> Vec<f64> {
            x.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        (
            loss.to_dtype(DType::F64).unwrap().to_scalar().unwrap(),
            v(grads.get(h.as_tensor()).unwrap()),
            v(grads.get(w.as_tensor()).unwrap()),
        )
    }

    /// Central finite differences of the fused forward in f64 against its backward.
    #[test]
    fn fused_logprobs_gradients_match_finite_differences() {
        for seed in 0..6 {
            let c = case(seed);
            let chunk = 1 + seed as usize % 4;
            let (_, gh, gw) = run(&c, DType::F64, Path::Host, chunk);
            let eps = 1e-6;
            let fd = |c2: &Case| run(c2, DType::F64, Path::Host, chunk).0;
            for i in (0..c.h.len()).step_by(3) {
                let (mut p, mut m) = (case(seed), case(seed));
                p.h[i] += eps;
                m.h[i] -= eps;
                let want = (fd(&p) - fd(&m)) / (2.0 * eps);
                assert!(
                    (gh[i] - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "seed {seed} dh[{i}]: {} vs {want}",
                    gh[i]
                );
            }
            for i in (0..c.w.len()).step_by(5) {
                let (mut p, mut m) = (case(seed), case(seed));
                p.w[i] += eps;
                m.w[i] -= eps;
                let want = (fd(&p) - fd(&m)) / (2.0 * eps);
                assert!(
                    (gw[i] - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "seed {seed} dW[{i}]: {} vs {want}",
                    gw[i]
                );
            }
            // Padding rows get exactly zero gradient.
            for r in (0..c.rows).filter(|r| c.a[*r] == 0.0 && c.b[*r] == 0.0) {
                assert!(gh[r * c.hid..(r + 1) * c.hid].iter().all(|&g| g == 0.0));
            }
        }
    }

    /// A vocabulary the backward takes in several column blocks (64 columns each, and a
    /// partial last block) with targets in different blocks: the host op's loss and gradients
    /// equal the tensor path's (f64, 1e-12), whose mathematics is the composition's, and
    /// finite differences of the loss (1e-6).
    #[test]
    fn the_backward_in_vocabulary_blocks_is_exact() {
        let mut c = case(40);
        let mut rng = ChaCha8Rng::seed_from_u64(41);
        c.vocab = 150;
        c.w = randn(&mut rng, c.vocab * c.hid, 1.5);
        c.t = (0..c.rows).map(|r| (r * 37 % 150) as u32).collect();
        let (l1, gh1, gw1) = run(&c, DType::F64, Path::Host, 1);
        let (l2, gh2, gw2) = run(&c, DType::F64, Path::Tensors, 1);
        assert!(
            (l1 - l2).abs() <= 1e-12 * l1.abs().max(1.0),
            "loss {l1} vs {l2}"
        );
        for (x, y) in gh1.iter().zip(&gh2).chain(gw1.iter().zip(&gw2)) {
            assert!((x - y).abs() <= 1e-12 * y.abs().max(1.0), "{x} vs {y}");
        }
        let eps = 1e-6;
        for i in (0..c.w.len()).step_by(37) {
            let (mut p, mut m) = (clone(&c), clone(&c));
            p.w[i] += eps;
            m.w[i] -= eps;
            let fd = |x: &Case| run(x, DType::F64, Path::Host, 1).0;
            let want = (fd(&p) - fd(&m)) / (2.0 * eps);
            assert!(
                (gw1[i] - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "dW[{i}]: {} vs {want}",
                gw1[i]
            );
        }
    }

    fn clone(c: &Case) -> Case {
        Case {
            rows: c.rows,
            hid: c.hid,
            vocab: c.vocab,
            h: c.h.clone(),
            w: c.w.clone(),
            t: c.t.clone(),
            a: c.a.clone(),
            b: c.b.clone(),
        }
    }

    /// f32: the fused op equals the composition (values ≤ 1e-5 relative, gradients ≤ 1e-4).
    #[test]
    fn fused_logprobs_equal_the_composition_in_f32() {
        for seed in 10..20 {
            let c = case(seed);
            let (l1, gh1, gw1) = run(&c, DType::F32, Path::Host, 1 + seed as usize % 5);
            let (l2, gh2, gw2) = run(&c, DType::F32, Path::Composed, 0);
            assert!(
                (l1 - l2).abs() <= 1e-5 * l2.abs().max(1.0),
                "loss {l1} vs {l2}"
            );
            for (x, y) in gh1.iter().zip(&gh2).chain(gw1.iter().zip(&gw2)) {
                assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "grad {x} vs {y}");
            }
        }
    }

    /// The op as chunked tensor operations (the path on a GPU, run here on the CPU) equals the
    /// host-slice op whose backward is checked against finite differences above: loss and
    /// every gradient within 1e-12 in f64, in chunks of 2 rows.
    #[test]
    fn the_tensor_path_equals_the_host_op() {
        for seed in 30..36 {
            let c = case(seed);
            let (l1, gh1, gw1) = run(&c, DType::F64, Path::Host, 2);
            let (l2, gh2, gw2) = run(&c, DType::F64, Path::Tensors, 2);
            assert!(
                (l1 - l2).abs() <= 1e-12 * l1.abs().max(1.0),
                "loss {l1} vs {l2}"
            );
            for (x, y) in gh1.iter().zip(&gh2).chain(gw1.iter().zip(&gw2)) {
                assert!(
                    (x - y).abs() <= 1e-12 * y.abs().max(1.0),
                    "seed {seed}: {x} vs {y}"
                );
            }
        }
    }

    /// Σ p² straight from its definition: the logits `h·Wᵀ` and the softmax in plain f64 loops.
    fn direct_sum_pi_squared(c: &Case) -> Vec<f64> {
        (0..c.rows)
            .map(|r| {
                let z: Vec<f64> = (0..c.vocab)
                    .map(|j| {
                        (0..c.hid)
                            .map(|k| c.h[r * c.hid + k] * c.w[j * c.hid + k])
                            .sum()
                    })
                    .collect();
                let mx = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = z.iter().map(|v| (v - mx).exp()).sum();
                z.iter().map(|v| ((v - mx).exp() / total).powi(2)).sum()
            })
            .collect()
    }

    /// Σ p² of the fused head, on host slices and as chunked tensor operations, equals the
    /// softmax computed directly (f64, 1e-12), flat and peaked distributions, vocabularies
    /// below and above one 16-lane block, chunks of 1–4 rows; asking for it changes neither the
    /// log-probs nor the entropies (bit for bit on host slices), and it carries no gradient.
    #[test]
    fn sum_pi_squared_equals_the_softmax_on_both_paths() {
        let stats = super::HeadStats {
            entropy: true,
            sum_pi_squared: true,
        };
        for seed in 40..48 {
            let mut c = case(seed);
            if seed % 2 == 1 {
                // peaked rows: Σ p² near 1
                c.h.iter_mut().for_each(|x| *x *= 6.0);
            }
            let want = direct_sum_pi_squared(&c);
            let dev = Device::Cpu;
            let h = Tensor::from_vec(c.h.clone(), (c.rows, c.hid), &dev).unwrap();
            let w =
                Var::from_tensor(&Tensor::from_vec(c.w.clone(), (c.vocab, c.hid), &dev).unwrap())
                    .unwrap();
            let chunk = 1 + seed as usize % 4;
            for tensors in [None, Some(0)] {
                let w = w.as_tensor();
                let out =
                    token_logprobs_op(&h, w, c.t.clone(), chunk, stats, false, tensors).unwrap();
                let sq: Vec<f64> = out.sum_pi_squared.as_ref().unwrap().to_vec1().unwrap();
                for (r, (g, e)) in sq.iter().zip(&want).enumerate() {
                    assert!(
                        (g - e).abs() <= 1e-12,
                        "seed {seed} {tensors:?} row {r}: {g} vs {e}"
                    );
                }
                let plain = super::HeadStats {
                    entropy: true,
                    sum_pi_squared: false,
                };
                let base =
                    token_logprobs_op(&h, w, c.t.clone(), chunk, plain, false, tensors).unwrap();
                let v = |t: &Tensor| t.to_vec1::<f64>().unwrap();
                let (lp, lp0) = (v(&out.log_probs), v(&base.log_probs));
                let (ent, ent0) = (
                    v(out.entropy.as_ref().unwrap()),
                    v(base.entropy.as_ref().unwrap()),
                );
                if tensors.is_none() {
                    assert_eq!((&lp, &ent), (&lp0, &ent0), "seed {seed}");
                }
                for (a, b) in lp.iter().zip(&lp0).chain(ent.iter().zip(&ent0)) {
                    assert!(
                        (a - b).abs() <= 1e-12,
                        "seed {seed} {tensors:?}: {a} vs {b}"
                    );
                }
                // Σ p² is detached: a loss on it alone has no gradient to the weight.
                let loss = out.sum_pi_squared.unwrap().sum_all().unwrap();
                assert!(loss.backward().unwrap().get(w).is_none(), "seed {seed}");
            }
        }
    }

    /// In f32 (the CPU's training dtype) Σ p² of the host path keeps f64 sums: within 1e-6 of
    /// the f64 softmax over a 49,152-token vocabulary with one dominant logit.
    #[test]
    fn sum_pi_squared_in_f32_over_a_large_vocabulary() {
        let (vocab, hid) = (49_152, 2);
        let mut w = vec![0f32; vocab * hid];
        for j in 0..vocab {
            w[j * hid] = -17.0 + (j % 7) as f32 * 0.5;
        }
        w[123 * hid] = 0.0;
        w[124 * hid + 1] = -1.0;
        let h = [1f32, 1.0, 1.0, 0.0]; // two rows
        let z = |r: usize, j: usize| {
            f64::from(h[r * 2]) * f64::from(w[j * hid])
                + f64::from(h[r * 2 + 1]) * f64::from(w[j * hid + 1])
        };
        let dev = Device::Cpu;
        let ht = Tensor::from_vec(h.to_vec(), (2, hid), &dev).unwrap();
        let wt = Tensor::from_vec(w.clone(), (vocab, hid), &dev).unwrap();
        let stats = super::HeadStats {
            entropy: false,
            sum_pi_squared: true,
        };
        let out = token_logprobs_op(&ht, &wt, vec![0, 1], 1, stats, false, None).unwrap();
        let got: Vec<f32> = out.sum_pi_squared.unwrap().to_vec1().unwrap();
        for (r, g) in got.iter().enumerate() {
            let zs: Vec<f64> = (0..vocab).map(|j| z(r, j)).collect();
            let mx = zs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = zs.iter().map(|v| (v - mx).exp()).sum();
            let want: f64 = zs.iter().map(|v| ((v - mx).exp() / total).powi(2)).sum();
            assert!(
                (f64::from(*g) - want).abs() < 1e-6,
                "row {r}: {g} vs {want}"
            );
        }
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error() {
        let dev = Device::Cpu;
        let h = Tensor::zeros((2, 3), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((4, 3), DType::F32, &dev).unwrap();
        let t = Tensor::new(&[1u32, 4], &dev).unwrap();
        let err = token_logprobs_fused(&h, &w, &t, 2, false, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("target token id 4 outside the vocabulary (4)"),
            "{err}"
        );
    }

    /// A vocabulary where f32 accumulation loses the tail: one logit 0 and 49,151 at −17
    /// (e^−17 ≈ 4.1e-8 is under half an ulp of 1). Closed form: lse = ln(1 + 49151·e^−17),
    /// Σ p z = −17·49151·e^−17 / (1 + 49151·e^−17).
    #[test]
    fn row_statistics_keep_the_vocabulary_tail_in_f32() {
        let n = 49_151f64;
        let tail = n * (-17f64).exp();
        let mut z = vec![-17f32; 49_152];
        z[123] = 0.0;
        let (lse, mean_z) = super::row_stats(&z);
        let (want_lse, want_mean) = ((1.0 + tail).ln(), -17.0 * tail / (1.0 + tail));
        assert!(want_lse > 1e-3, "the case must matter: {want_lse}");
        assert!((lse as f64 - want_lse).abs() < 1e-6, "{lse} vs {want_lse}");
        assert!(
            (mean_z as f64 - want_mean).abs() < 1e-5,
            "{mean_z} vs {want_mean}"
        );
    }
}
