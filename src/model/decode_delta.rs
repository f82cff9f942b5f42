//! The packed decode engine's Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the
//! same function as `delta.rs`'s composition, run token by token from each sequence's state.
//!
//! ```text
//! [u | z | b | a] = h·[W_qkv | W_z | W_b | W_a]            one product for all tokens
//! per sequence, token by token:  c = silu(Σ_j w_j ⊙ window_j)   window = last K − 1 inputs + u
//! q, k ← L2-normalised per key head (q also / √dk), v; β = σ(b), g = −exp(A_log)·softplus(a + dt)
//! per (sequence, value head), token by token:
//!   S ← e^g·S;  δ = β(v − Sᵀk);  S ← S + k ⊗ δ;  o = Sᵀq      S: [dk, dv]
//! y = rms(o)·w ⊙ silu(z) per head;  x += y·W_outᵀ
//! ```
//!
//! A sequence's state lives in its [`SeqCache`]: the last `K − 1` convolution inputs
//! `[K − 1, conv_dim]` and `S` per value head `[nv, dk, dv]`, in the cache's element type (bf16
//! for a bf16 cache, as vLLM keeps a bf16 model's recurrent state). Jobs run in parallel over
//! (sequence, value head), so a single long prompt is still spread over the heads.

use candle_core::{Result, WithDType};
use rayon::prelude::*;

use super::{flat, rows, Mat, SeqCache};
use crate::kernels::elem::{Elem, KvElem};
use crate::kernels::simd::vectorized;
use crate::model::config::LinearAttnArgs;
use crate::model::delta::{DeltaNet, Inputs};
use crate::model::delta_op::token;

/// One DeltaNet layer packed for decoding.
pub(super) struct DeltaMats<T> {
    /// `[hidden, conv_dim + nv·dv + 2·nv]`: q|k|v (the convolution's channel order), z, b, a.
    inp: Mat<T>,
    /// `[nv·dv, hidden]`.
    out: Mat<T>,
    /// `[conv_dim, K]`.
    conv: Vec<T>,
    dt_bias: Vec<T>,
    /// `−exp(A_log)` `[nv]`.
    neg_a: Vec<T>,
    /// The gated RMSNorm's scale `[dv]` (no `1 +`).
    norm: Vec<T>,
    la: LinearAttnArgs,
}

impl<T: Elem> DeltaMats<T> {
    /// Packs `d` (adapters folded in); Qwen3-Next's grouped projections are reordered into the
    /// convolution's channel order.
    pub(super) fn new(d: &DeltaNet, la: &LinearAttnArgs, bf16: bool) -> Result<Self> {
        let [qkv, z, b, a] = match &d.inputs {
            Inputs::Split { qkv, z, b, a } => [
                qkv.merged_weight()?,
                z.merged_weight()?,
                b.merged_weight()?,
                a.merged_weight()?,
            ],
            Inputs::Grouped { qkvz, ba } => {
                let (nk, dk, dv) = (la.num_key_heads, la.key_head_dim, la.value_head_dim);
                let r = la.num_value_heads / nk;
                let g = (2 * dk + 2 * r * dv) as u32;
                let pick = |at: usize, n: usize, group: u32| -> Vec<u32> {
                    (0..nk as u32)
                        .flat_map(|h| (0..n as u32).map(move |j| h * group + at as u32 + j))
                        .collect()
                };
                let (w, wba) = (qkvz.merged_weight()?, ba.merged_weight()?);
                let q = pick(0, dk, g);
                let k = pick(dk, dk, g);
                let v = pick(2 * dk, r * dv, g);
                let zi = pick(2 * dk + r * dv, r * dv, g);
                let qkv: Vec<u32> = q.into_iter().chain(k).chain(v).collect();
                [
                    rows(&w, qkv)?,
                    rows(&w, zi)?,
                    rows(&wba, pick(0, r, 2 * r as u32))?,
                    rows(&wba, pick(r, r, 2 * r as u32))?,
                ]
            }
        };
        let neg_a: Vec<T> = flat::<T>(&d.a_log)?
            .into_iter()
            .map(|x| T::from_f64(-<T as WithDType>::to_f64(x).exp()))
            .collect();
        Ok(Self {
            inp: Mat::from_weights(&[&qkv, &z, &b, &a], bf16)?,
            out: Mat::from_weights(&[&d.out.merged_weight()?], bf16)?,
            conv: flat(&d.conv.flatten_all()?)?,
            dt_bias: flat(&d.dt_bias)?,
            neg_a,
            norm: flat(&d.norm)?,
            la: la.clone(),
        })
    }

    /// The layer for every token of a ragged step: `hn` `[M, hidden]` (normed input), the
    /// output added into `x`. `spans[s]` is sequence `s`'s `(first row, tokens)`; its state in
    /// `caches[s]` (layer `li`) is read and advanced.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step<C: KvElem<T>>(
        &self,
        li: usize,
        hn: &[T],
        x: &mut [T],
        (m, h): (usize, usize),
        spans: &[(usize, usize)],
        caches: &mut [&mut SeqCache<C>],
        eps: f64,
    ) {
        let la = &self.la;
        let (cd, vd) = (la.conv_dim(), la.value_dim());
        let width = cd + vd + 2 * la.num_value_heads;
        let mut proj = vec![T::zero(); m * width]; // [M, cd | vd | nv | nv]
        self.inp.apply(&mut proj, hn, m, h, width, false);
        let mut c = self.convolve(li, &proj, width, spans, caches); // [M, cd]
        normalise_qk(&mut c, la);
        let mut y = self.recur(li, &c, (&proj, width), spans, caches); // [M, nv·dv]
        self.gated_norm(&mut y, (&proj, width), eps);
        self.out.apply(x, &y, m, vd, h, true);
    }

    /// The causal convolution and SiLU of every token's `u` (the first `conv_dim` values of
    /// its `proj` row of `width`), token by token per sequence from and into its state:
    /// `[M, conv_dim]`.
    fn convolve<C: KvElem<T>>(
        &self,
        li: usize,
        proj: &[T],
        width: usize,
        spans: &[(usize, usize)],
        caches: &mut [&mut SeqCache<C>],
    ) -> Vec<T> {
        let (cd, kw) = (self.la.conv_dim(), self.la.conv_kernel);
        let mut c = vec![T::zero(); spans.iter().map(|s| s.1).sum::<usize>() * cd];
        for (&(first, n), cache) in spans.iter().zip(caches.iter_mut()) {
            let state = &mut cache.conv[li];
            if state.is_empty() {
                state.resize((kw - 1) * cd, C::store(T::zero()));
            }
            for i in first..first + n {
                let u = &proj[i * width..][..cd];
                let out = &mut c[i * cd..][..cd];
                for ch in 0..cd {
                    let w = &self.conv[ch * kw..][..kw];
                    let mut acc = w[kw - 1] * u[ch];
                    for j in 0..kw - 1 {
                        acc += w[j] * state[j * cd + ch].load();
                    }
                    out[ch] = acc / (T::one() + (-acc).exp_fast());
                }
                if kw > 1 {
                    state.copy_within(cd.., 0);
                    for (s, &v) in state[(kw - 2) * cd..].iter_mut().zip(u) {
                        *s = C::store(v);
                    }
                }
            }
        }
        c
    }

    /// The delta rule per (sequence, value head) over the sequence's tokens, from and into its
    /// state: the outputs `[M, nv·dv]` in token order. `c` holds each token's normalised q, k
    /// and v; `proj` (rows of `width`) its β and decay inputs after `conv_dim + nv·dv` values.
    fn recur<C: KvElem<T>>(
        &self,
        li: usize,
        c: &[T],
        (proj, width): (&[T], usize),
        spans: &[(usize, usize)],
        caches: &mut [&mut SeqCache<C>],
    ) -> Vec<T> {
        let la = &self.la;
        let (nv, dk, dv) = (la.num_value_heads, la.key_head_dim, la.value_head_dim);
        let (cd, vd, kd) = (la.conv_dim(), la.value_dim(), la.key_dim());
        let r = nv / la.num_key_heads;
        let mut jobs: Vec<(usize, usize, &mut [C])> = Vec::new();
        for (s, cache) in caches.iter_mut().enumerate() {
            let st = &mut cache.rec[li];
            if st.is_empty() {
                st.resize(nv * dk * dv, C::store(T::zero()));
            }
            for (hh, part) in st.chunks_mut(dk * dv).enumerate() {
                jobs.push((s, hh, part));
            }
        }
        // Each rayon thread keeps one state [dk, dv] and one δ [dv] in T for all its jobs.
        let scratch = || (vec![T::zero(); dk * dv], vec![T::zero(); dv]);
        let outs: Vec<Vec<T>> = jobs
            .into_par_iter()
            .map_init(scratch, |(st, delta), (s, hh, part)| {
                let (first, n) = spans[s];
                st.iter_mut()
                    .zip(part.iter())
                    .for_each(|(x, v)| *x = v.load());
                let mut o = vec![T::zero(); n * dv];
                vectorized(
                    #[inline(always)]
                    || {
                        for (t, oi) in o.chunks_exact_mut(dv).enumerate() {
                            let row = &c[(first + t) * cd..][..cd];
                            let qkv = (
                                &row[hh / r * dk..][..dk],
                                &row[kd + hh / r * dk..][..dk],
                                &row[2 * kd + hh * dv..][..dv],
                            );
                            let p = &proj[(first + t) * width + cd + vd..];
                            let beta = T::one() / (T::one() + (-p[hh]).exp_fast());
                            let z = p[nv + hh] + self.dt_bias[hh];
                            let sp = num_traits::Float::max(z, T::zero())
                                + (T::one() + (-z.abs()).exp_fast()).ln();
                            let decay = (self.neg_a[hh] * sp).exp_fast();
                            token(st, delta, qkv, (decay, beta), Some(oi), None);
                        }
                    },
                );
                part.iter_mut()
                    .zip(st.iter())
                    .for_each(|(x, &v)| *x = C::store(v));
                o
            })
            .collect();
        let m = spans.iter().map(|s| s.1).sum::<usize>();
        let mut y = vec![T::zero(); m * vd];
        for (job, o) in outs.iter().enumerate() {
            let ((first, n), hh) = (spans[job / nv], job % nv);
            for t in 0..n {
                y[(first + t) * vd + hh * dv..][..dv].copy_from_slice(&o[t * dv..][..dv]);
            }
        }
        y
    }

    /// Each value head's output `y` `[M, nv·dv]` through the RMSNorm (scale `norm`) gated by
    /// `silu(z)`, z from `proj` (rows of `width`) after `conv_dim` values.
    fn gated_norm(&self, y: &mut [T], (proj, width): (&[T], usize), eps: f64) {
        let (cd, vd, dv) = (
            self.la.conv_dim(),
            self.la.value_dim(),
            self.la.value_head_dim,
        );
        let (eps, dv_t) = (T::from_f64(eps), T::from_f64(dv as f64));
        y.par_chunks_mut(vd).enumerate().for_each(|(i, row)| {
            let z = &proj[i * width + cd..][..vd];
            for (head, zh) in row.chunks_mut(dv).zip(z.chunks(dv)) {
                let ss = head.iter().fold(T::zero(), |s, &v| s + v * v);
                let inv = (ss / dv_t + eps).sqrt().recip();
                for ((v, &w), &g) in head.iter_mut().zip(&self.norm).zip(zh) {
                    *v = *v * inv * w * (g / (T::one() + (-g).exp_fast()));
                }
            }
        });
    }

    /// Elements of a sequence's state in this layer: `(K − 1)·conv_dim + nv·dk·dv`.
    pub(super) fn state_elems(la: &LinearAttnArgs) -> usize {
        (la.conv_kernel - 1) * la.conv_dim()
            + la.num_value_heads * la.key_head_dim * la.value_head_dim
    }
}

/// q and k of every token's convolution output row (`[M, conv_dim]`) L2-normalised per key
/// head (FLA's 1e-6 under the root), q also scaled by `dk^-½`.
fn normalise_qk<T: Elem>(c: &mut [T], la: &LinearAttnArgs) {
    let (nk, dk, kd) = (la.num_key_heads, la.key_head_dim, la.key_dim());
    let scale = T::from_f64(1.0 / (dk as f64).sqrt());
    c.par_chunks_mut(la.conv_dim()).for_each(|row| {
        for (j, head) in row[..2 * kd].chunks_mut(dk).enumerate() {
            let ss = head.iter().fold(T::zero(), |s, &v| s + v * v);
            let mut inv = (ss + T::from_f64(1e-6)).sqrt().recip();
            if j < nk {
                inv *= scale;
            }
            head.iter_mut().for_each(|v| *v *= inv);
        }
    });
}
