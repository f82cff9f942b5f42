//! The Gated DeltaNet mixer between its input and output projections as one op over host
//! memory (CPU, f32/f64) with a hand-written backward, for training and no-cache forwards:
//! convolution, SiLU, q/k L2 norms, β and the decay, the recurrence ([`super::delta_op`]'s
//! token steps) and the gated RMSNorm, where the composition in [`super::delta`] (its
//! reference in the tests) runs some thirty candle ops forward and their backward passes, each
//! a fresh tensor.
//!
//! ```text
//! inputs  u [b, t, cd] (in_proj_qkv's output), zba [b, t, vd + 2·nv] (z, then b, then a),
//!         params [cd·K + 2·nv + dv] (conv weight [cd, K], dt_bias, A_log, norm weight)
//! p_t = Σ_j w_j ⊙ u_{t−K+1+j}   c = silu(p)   (u before the sequence's start is zero)
//! q̂ = c_q·ν_q, ν_q = (Σ c_q² + 1e-6)^−½ (per key head; k alike);  q ← q̂/√dk
//! β = σ(b)    g = −e^{A_log}·softplus(a + dt_bias)    o = recurrence(q, k, v, g, β)
//! y = ô ⊙ w_n ⊙ silu(z),  ô = o·ρ, ρ = (mean o² + ε)^−½   (per value head)
//! backward:
//!   ∂n = ∂y ⊙ silu(z)   ∂z = ∂y ⊙ ô ⊙ w_n ⊙ silu′(z)   ∂w_n = Σ ∂n ⊙ ô
//!   ∂o = ρ·(∂n ⊙ w_n − ô·mean(∂n ⊙ w_n ⊙ ô))
//!   ∂b = ∂β·β(1 − β)   ∂a = ∂dt_bias = ∂g·(−e^{A_log}·σ(a + dt_bias))   ∂A_log = ∂g·g
//!   ∂c_q = ν_q·(∂q̂ − q̂ (q̂·∂q̂)) (∂q̂ summed over the value heads reading the key head)
//!   ∂p = ∂c ⊙ silu′(p)   ∂u_s = Σ_j w_j ⊙ ∂p_{s+K−1−j}   ∂w_j = Σ_t ∂p_t ⊙ u_{t−K+1+j}
//! silu′(x) = σ(x)·(1 + x·(1 − σ(x)))
//! ```

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use super::config::LinearAttnArgs;
use super::delta_op::DeltaRule;
use crate::kernels::elem::{sigmoid, Elem};
use crate::kernels::simd::vectorized;
use crate::kernels::storage::{contiguous, Host};

/// The op: the layer's sizes and the gated norm's ε.
pub(crate) struct Mixer {
    pub(crate) nk: usize,
    pub(crate) nv: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) kw: usize,
    pub(crate) eps: f64,
}

/// Sizes of one call: `b` rows of `t` tokens.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    t: usize,
    nk: usize,
    nv: usize,
    dk: usize,
    dv: usize,
    kw: usize,
}

impl Dims {
    fn kd(&self) -> usize {
        self.nk * self.dk
    }
    fn vd(&self) -> usize {
        self.nv * self.dv
    }
    fn cd(&self) -> usize {
        2 * self.kd() + self.vd()
    }
    fn zw(&self) -> usize {
        self.vd() + 2 * self.nv
    }
    fn params(&self) -> usize {
        self.cd() * self.kw + 2 * self.nv + self.dv
    }
    /// The recurrence's packed row: q, k, v, g, β.
    fn width(&self) -> usize {
        2 * self.dk + self.dv + 2
    }
    fn rule(&self) -> DeltaRule {
        DeltaRule {
            dk: self.dk,
            dv: self.dv,
        }
    }
}

impl Mixer {
    pub(crate) fn new(la: &LinearAttnArgs, eps: f64) -> Mixer {
        Mixer {
            nk: la.num_key_heads,
            nv: la.num_value_heads,
            dk: la.key_head_dim,
            dv: la.value_head_dim,
            kw: la.conv_kernel,
            eps,
        }
    }

    fn dims(&self, u: &Shape, zba: &Shape, params: &Shape) -> Result<Dims> {
        let (b, t, cd) = u.dims3()?;
        let d = Dims {
            b,
            t,
            nk: self.nk,
            nv: self.nv,
            dk: self.dk,
            dv: self.dv,
            kw: self.kw,
        };
        if cd != d.cd() || zba.dims() != [b, t, d.zw()] || params.dims() != [d.params()] {
            candle_core::bail!(
                "DeltaNet mixer: inputs {u:?}, {zba:?}, {params:?} do not fit {} key heads, \
                 {} value heads of {}/{} and a convolution of {}",
                d.nk,
                d.nv,
                d.dk,
                d.dv,
                d.kw
            );
        }
        if d.nk == 0 || !d.nv.is_multiple_of(d.nk) || d.kw == 0 {
            candle_core::bail!(
                "DeltaNet mixer: {} value heads over {} key heads",
                d.nv,
                d.nk
            );
        }
        Ok(d)
    }
}

/// The parameters, split: conv weight transposed to `[K, cd]` (rows along the channels),
/// dt_bias, `−e^{A_log}`, A_log, norm weight.
struct Params<T> {
    wt: Vec<T>,
    dt: Vec<T>,
    neg_a: Vec<T>,
    norm: Vec<T>,
}

fn params<T: Elem>(d: &Dims, p: &[T]) -> Params<T> {
    let (cd, kw, nv) = (d.cd(), d.kw, d.nv);
    let mut wt = vec![T::zero(); kw * cd];
    for ch in 0..cd {
        for j in 0..kw {
            wt[j * cd + ch] = p[ch * kw + j];
        }
    }
    let rest = &p[cd * kw..];
    Params {
        wt,
        dt: rest[..nv].to_vec(),
        neg_a: rest[nv..2 * nv].iter().map(|&a| -a.exp()).collect(),
        norm: rest[2 * nv..].to_vec(),
    }
}

/// `log(1 + eˣ)` without overflow.
#[inline(always)]
fn softplus<T: Elem>(x: T) -> T {
    num_traits::Float::max(x, T::zero()) + (-x.abs()).exp().ln_1p()
}

/// What forward and backward both compute from the inputs: the convolution's outputs before
/// SiLU `p` and after `c` `[b, t, cd]`, the inverse norms of q and k `[b, t, nk]` each, and
/// the recurrence's packed inputs per (row, value head) `[b, nv, t, width]`.
struct Prepared<T> {
    p: Vec<T>,
    c: Vec<T>,
    inv_q: Vec<T>,
    inv_k: Vec<T>,
    x: Vec<T>,
}

fn prepare<T: Elem>(d: &Dims, u: &[T], zba: &[T], pr: &Params<T>) -> Prepared<T> {
    let (t, cd, kd, vd) = (d.t, d.cd(), d.kd(), d.vd());
    let (nk, nv, dk, dv) = (d.nk, d.nv, d.dk, d.dv);
    let n = d.b * t;
    let p = taps(d, u, &pr.wt, Dir::Forward); // p_t = Σ_j w_j ⊙ u_{t−K+1+j}
    let c: Vec<T> = p.par_iter().map(|&x| x * sigmoid(x)).collect();
    let inv = |off: usize| -> Vec<T> {
        c.par_chunks(cd)
            .flat_map_iter(|row| {
                row[off..off + kd].chunks_exact(dk).map(|h| {
                    let s = h.iter().fold(T::zero(), |a, &v| a + v * v);
                    T::one() / (s + T::from_f64(1e-6)).sqrt()
                })
            })
            .collect()
    };
    let (inv_q, inv_k) = (inv(0), inv(kd));
    let scale = T::from_f64(1.0 / (dk as f64).sqrt());
    let w = d.width();
    let r = nv / nk;
    let mut x = vec![T::zero(); n * nv * w];
    x.par_chunks_mut(t * w).enumerate().for_each(|(job, xs)| {
        let (bi, hv) = (job / nv, job % nv);
        let h = hv / r;
        for (ti, row) in xs.chunks_exact_mut(w).enumerate() {
            let ri = bi * t + ti;
            let cr = &c[ri * cd..][..cd];
            let (nq, nk_) = (inv_q[ri * nk + h] * scale, inv_k[ri * nk + h]);
            for (o, &v) in row[..dk].iter_mut().zip(&cr[h * dk..][..dk]) {
                *o = v * nq;
            }
            for (o, &v) in row[dk..2 * dk].iter_mut().zip(&cr[kd + h * dk..][..dk]) {
                *o = v * nk_;
            }
            row[2 * dk..2 * dk + dv].copy_from_slice(&cr[2 * kd + hv * dv..][..dv]);
            let zr = &zba[ri * d.zw()..][..d.zw()];
            let (bv, av) = (zr[vd + hv], zr[vd + nv + hv]);
            row[w - 2] = pr.neg_a[hv] * softplus(av + pr.dt[hv]);
            row[w - 1] = sigmoid(bv);
        }
    });
    Prepared {
        p,
        c,
        inv_q,
        inv_k,
        x,
    }
}

/// The recurrence's outputs `[b, nv, t, dv]`.
fn recur<T: Elem>(d: &Dims, x: &[T]) -> Vec<T> {
    let (t, w, dv) = (d.t, d.width(), d.dv);
    let rule = d.rule();
    let mut o = vec![T::zero(); d.b * d.nv * t * dv];
    o.par_chunks_mut(t * dv)
        .zip(x.par_chunks(t * w))
        .for_each(|(o, xs)| {
            vectorized(
                #[inline(always)]
                || rule.forward_one(xs, o),
            )
        });
    o
}

/// `ρ = (mean o² + ε)^−½` of one value head's output.
#[inline(always)]
fn inv_rms<T: Elem>(o: &[T], eps: T) -> T {
    let ms = o.iter().fold(T::zero(), |a, &v| a + v * v) / T::from_f64(o.len() as f64);
    T::one() / (ms + eps).sqrt()
}

fn forward<T: Elem>(m: &Mixer, d: &Dims, u: &[T], zba: &[T], p: &[T]) -> Vec<T> {
    let pr = params(d, p);
    let prep = prepare(d, u, zba, &pr);
    let o = recur(d, &prep.x);
    let (t, nv, dv, vd, zw) = (d.t, d.nv, d.dv, d.vd(), d.zw());
    let eps = T::from_f64(m.eps);
    let mut y = vec![T::zero(); d.b * t * vd];
    y.par_chunks_mut(vd).enumerate().for_each(|(ri, yr)| {
        let (bi, ti) = (ri / t, ri % t);
        let zr = &zba[ri * zw..][..vd];
        for (hv, (yh, zh)) in yr.chunks_exact_mut(dv).zip(zr.chunks_exact(dv)).enumerate() {
            let oh = &o[((bi * nv + hv) * t + ti) * dv..][..dv];
            let rho = inv_rms(oh, eps);
            for (((y, &ov), &w), &z) in yh.iter_mut().zip(oh).zip(&pr.norm).zip(zh) {
                *y = ov * rho * w * z * sigmoid(z);
            }
        }
    });
    y
}

/// Which way [`taps`] runs the causal convolution over a row's tokens.
#[derive(Clone, Copy)]
enum Dir {
    /// `out_t += Σ_j w_j ⊙ src_{t−K+1+j}` (the forward over u).
    Forward,
    /// `out_s += Σ_j w_j ⊙ src_{s+K−1−j}` (its transpose: ∂u from ∂p).
    Back,
}

/// The depthwise causal convolution's taps over `src` `[b, t, cd]` into a fresh `[b, t, cd]`,
/// rows in parallel (each reads the K rows of its sequence it needs), tokens outside the
/// sequence read as zero.
fn taps<T: Elem>(d: &Dims, src: &[T], wt: &[T], dir: Dir) -> Vec<T> {
    let (t, cd, kw) = (d.t, d.cd(), d.kw);
    let mut out = vec![T::zero(); d.b * t * cd];
    out.par_chunks_mut(cd).enumerate().for_each(|(r, row)| {
        vectorized(
            #[inline(always)]
            || {
                let ti = r % t;
                for j in 0..kw {
                    let at = match dir {
                        Dir::Forward => (ti + j + 1).checked_sub(kw),
                        Dir::Back => Some(ti + kw - 1 - j).filter(|&s| s < t),
                    };
                    let Some(at) = at else { continue };
                    let sr = &src[(r - ti + at) * cd..][..cd];
                    for ((o, &w), &x) in row.iter_mut().zip(&wt[j * cd..][..cd]).zip(sr) {
                        *o += w * x;
                    }
                }
            },
        )
    });
    out
}

/// Gradients of u, zba and params from `gy` `[b, t, vd]`.
fn backward<T: Elem>(
    m: &Mixer,
    d: &Dims,
    (u, zba, p): (&[T], &[T], &[T]),
    gy: &[T],
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let pr = params(d, p);
    let prep = prepare(d, u, zba, &pr);
    let o = recur(d, &prep.x);
    let (go, gnorm) = norm_bwd(m, d, &pr, (zba, &o), gy);
    let mut gzba = gate_bwd(m, d, &pr, (zba, &o), gy);
    let dx = recur_bwd(d, &prep.x, &go);
    drop(go);
    let gp = inputs_bwd(d, &prep, &dx, (zba, &pr), &mut gzba);
    let gu = taps(d, &gp, &pr.wt, Dir::Back);
    let gparams = params_bwd(d, (u, &gp), (&prep.x, &dx), &gzba, &gnorm);
    (gu, gzba, gparams)
}

/// The gated norm's backward to its input: `∂o` `[b, nv, t, dv]` (value heads' jobs in
/// parallel) and `∂w_n` `[dv]` (summed over the jobs).
fn norm_bwd<T: Elem>(
    m: &Mixer,
    d: &Dims,
    pr: &Params<T>,
    (zba, o): (&[T], &[T]),
    gy: &[T],
) -> (Vec<T>, Vec<T>) {
    let (t, nv, dv, vd, zw) = (d.t, d.nv, d.dv, d.vd(), d.zw());
    let eps = T::from_f64(m.eps);
    let mut go = vec![T::zero(); o.len()];
    let gnorm = go
        .par_chunks_mut(t * dv)
        .enumerate()
        .map(|(job, gos)| {
            let (bi, hv) = (job / nv, job % nv);
            let mut gn_w = vec![T::zero(); dv];
            for (ti, g) in gos.chunks_exact_mut(dv).enumerate() {
                let ri = bi * t + ti;
                let oh = &o[(job * t + ti) * dv..][..dv];
                let zh = &zba[ri * zw + hv * dv..][..dv];
                let gyh = &gy[ri * vd + hv * dv..][..dv];
                let rho = inv_rms(oh, eps);
                // ∂n = ∂y ⊙ silu(z), then mean(∂n ⊙ w ⊙ ô).
                let mut dot = T::zero();
                for j in 0..dv {
                    let gn = gyh[j] * zh[j] * sigmoid(zh[j]);
                    gn_w[j] += gn * oh[j] * rho;
                    dot += gn * pr.norm[j] * oh[j] * rho;
                    g[j] = gn;
                }
                let mean = dot / T::from_f64(dv as f64);
                for j in 0..dv {
                    g[j] = rho * (g[j] * pr.norm[j] - oh[j] * rho * mean);
                }
            }
            gn_w
        })
        .reduce(
            || vec![T::zero(); dv],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, &y)| *x += y);
                a
            },
        );
    (go, gnorm)
}

/// The gate's backward: `∂z = ∂y ⊙ ô ⊙ w_n ⊙ silu′(z)` into a fresh `[b, t, zw]` (its b and a
/// columns are filled by [`inputs_bwd`]).
fn gate_bwd<T: Elem>(
    m: &Mixer,
    d: &Dims,
    pr: &Params<T>,
    (zba, o): (&[T], &[T]),
    gy: &[T],
) -> Vec<T> {
    let (t, nv, dv, vd, zw) = (d.t, d.nv, d.dv, d.vd(), d.zw());
    let eps = T::from_f64(m.eps);
    let mut gzba = vec![T::zero(); d.b * t * zw];
    gzba.par_chunks_mut(zw).enumerate().for_each(|(ri, gz)| {
        let (bi, ti) = (ri / t, ri % t);
        for hv in 0..nv {
            let oh = &o[((bi * nv + hv) * t + ti) * dv..][..dv];
            let rho = inv_rms(oh, eps);
            let at = hv * dv;
            for j in 0..dv {
                let z = zba[ri * zw + at + j];
                let s = sigmoid(z);
                let dsilu = s * (T::one() + z * (T::one() - s));
                gz[at + j] = gy[ri * vd + at + j] * oh[j] * rho * pr.norm[j] * dsilu;
            }
        }
    });
    gzba
}

/// The recurrence's input gradients `[b, nv, t, width]` from its outputs' `go`.
fn recur_bwd<T: Elem>(d: &Dims, x: &[T], go: &[T]) -> Vec<T> {
    let (t, w, dv) = (d.t, d.width(), d.dv);
    let rule = d.rule();
    let mut dx = vec![T::zero(); x.len()];
    dx.par_chunks_mut(t * w)
        .zip(x.par_chunks(t * w).zip(go.par_chunks(t * dv)))
        .for_each(|(dxs, (xs, gs))| {
            vectorized(
                #[inline(always)]
                || rule.backward_one(xs, gs, dxs),
            )
        });
    dx
}

/// From the recurrence's input gradients `dx`: `∂b`, `∂a` into `gzba`'s b and a columns, and
/// `∂p = ∂c ⊙ silu′(p)` `[b, t, cd]` (q and k through their norms and scale, summed over the
/// value heads that read each key head).
fn inputs_bwd<T: Elem>(
    d: &Dims,
    prep: &Prepared<T>,
    dx: &[T],
    (zba, pr): (&[T], &Params<T>),
    gzba: &mut [T],
) -> Vec<T> {
    let (t, nk, nv, dk, dv) = (d.t, d.nk, d.nv, d.dk, d.dv);
    let (kd, vd, cd, zw, w) = (d.kd(), d.vd(), d.cd(), d.zw(), d.width());
    let r = nv / nk;
    let scale = T::from_f64(1.0 / (dk as f64).sqrt());
    let mut gp = vec![T::zero(); d.b * t * cd];
    gp.par_chunks_mut(cd)
        .zip(gzba.par_chunks_mut(zw))
        .enumerate()
        .for_each(|(ri, (gc, gz))| {
            let (bi, ti) = (ri / t, ri % t);
            for hv in 0..nv {
                let h = hv / r;
                let at = ((bi * nv + hv) * t + ti) * w;
                let (dxr, xr) = (&dx[at..][..w], &prep.x[at..][..w]);
                for (a, &g) in gc[h * dk..][..dk].iter_mut().zip(&dxr[..dk]) {
                    *a += g * scale;
                }
                for (a, &g) in gc[kd + h * dk..][..dk].iter_mut().zip(&dxr[dk..2 * dk]) {
                    *a += g;
                }
                gc[2 * kd + hv * dv..][..dv].copy_from_slice(&dxr[2 * dk..2 * dk + dv]);
                let beta = xr[w - 1];
                gz[vd + hv] = dxr[w - 1] * beta * (T::one() - beta);
                let a_in = zba[ri * zw + vd + nv + hv];
                gz[vd + nv + hv] = dxr[w - 2] * pr.neg_a[hv] * sigmoid(a_in + pr.dt[hv]);
            }
            // L2 norms: ∂c_q = ν(∂q̂ − q̂(q̂·∂q̂)), q̂ = c_q·ν.
            let cr = &prep.c[ri * cd..][..cd];
            for (part, inv) in [(0, &prep.inv_q), (kd, &prep.inv_k)] {
                for h in 0..nk {
                    let nu = inv[ri * nk + h];
                    let (g, cq) = (&mut gc[part + h * dk..][..dk], &cr[part + h * dk..][..dk]);
                    let proj = g
                        .iter()
                        .zip(cq)
                        .fold(T::zero(), |a, (&gv, &cv)| a + gv * cv * nu);
                    for (gv, &cv) in g.iter_mut().zip(cq) {
                        *gv = nu * (*gv - cv * nu * proj);
                    }
                }
            }
            for (gv, &x) in gc.iter_mut().zip(&prep.p[ri * cd..][..cd]) {
                let s = sigmoid(x);
                *gv *= s * (T::one() + x * (T::one() - s));
            }
        });
    gp
}

/// The parameters' gradient in their packed order: the conv weight `∂w_j = Σ_t ∂p_t ⊙
/// u_{t−K+1+j}`, `∂dt_bias` (the sum of `∂a`, which it enters as `a` does), `∂A_log = Σ ∂g·g`,
/// and the norm weight's `gnorm`.
fn params_bwd<T: Elem>(
    d: &Dims,
    (u, gp): (&[T], &[T]),
    (x, dx): (&[T], &[T]),
    gzba: &[T],
    gnorm: &[T],
) -> Vec<T> {
    let (t, nv, cd, kw, vd, zw, w) = (d.t, d.nv, d.cd(), d.kw, d.vd(), d.zw(), d.width());
    let n = d.b * t;
    let gwt: Vec<Vec<T>> = (0..kw)
        .into_par_iter()
        .map(|j| {
            let mut acc = vec![T::zero(); cd];
            vectorized(
                #[inline(always)]
                || {
                    for ri in 0..n {
                        let ti = ri % t;
                        let Some(src) = (ti + j + 1).checked_sub(kw) else {
                            continue;
                        };
                        let ur = &u[(ri - ti + src) * cd..][..cd];
                        let g = &gp[ri * cd..][..cd];
                        for ((a, &gv), &uv) in acc.iter_mut().zip(g).zip(ur) {
                            *a += gv * uv;
                        }
                    }
                },
            );
            acc
        })
        .collect();
    let mut out = vec![T::zero(); d.params()];
    for ch in 0..cd {
        for (j, g) in gwt.iter().enumerate() {
            out[ch * kw + j] = g[ch];
        }
    }
    let rest = &mut out[cd * kw..];
    for gz in gzba.chunks_exact(zw) {
        for (a, &g) in rest[..nv].iter_mut().zip(&gz[vd + nv..]) {
            *a += g;
        }
    }
    for (job, (xs, dxs)) in x
        .chunks_exact(t * w)
        .zip(dx.chunks_exact(t * w))
        .enumerate()
    {
        let hv = job % nv;
        for (xr, dxr) in xs.chunks_exact(w).zip(dxs.chunks_exact(w)) {
            rest[nv + hv] += dxr[w - 2] * xr[w - 2];
        }
    }
    rest[2 * nv..].copy_from_slice(gnorm);
    out
}

impl CustomOp3 for Mixer {
    fn name(&self) -> &'static str {
        "gated-deltanet-mixer"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(l1.shape(), l2.shape(), l3.shape())?;
        let shape = Shape::from((d.b, d.t, d.vd()));
        let out = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(forward::<f32>(
                self,
                &d,
                contiguous(s1, l1, "DeltaNet mixer: inputs")?,
                contiguous(s2, l2, "DeltaNet mixer: inputs")?,
                contiguous(s3, l3, "DeltaNet mixer: inputs")?,
            )),
            CpuStorage::F64(_) => CpuStorage::F64(forward::<f64>(
                self,
                &d,
                contiguous(s1, l1, "DeltaNet mixer: inputs")?,
                contiguous(s2, l2, "DeltaNet mixer: inputs")?,
                contiguous(s3, l3, "DeltaNet mixer: inputs")?,
            )),
            _ => candle_core::bail!("DeltaNet mixer: f32 or f64 only"),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        u: &Tensor,
        zba: &Tensor,
        p: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.dims(u.shape(), zba.shape(), p.shape())?;
        let ts = [u, zba, p, grad].map(|t| t.contiguous());
        let [u, zba, p, grad] = ts;
        let (u, zba, p, grad) = (u?, zba?, p?, grad?);
        let host = Host::new(&[&u, &zba, &p, &grad])?;
        let dev = u.device();
        macro_rules! run {
            ($t:ty) => {{
                let (gu, gz, gp) = backward::<$t>(
                    self,
                    &d,
                    (host.slice(0)?, host.slice(1)?, host.slice(2)?),
                    host.slice(3)?,
                );
                (
                    Tensor::from_vec(gu, u.shape(), dev)?,
                    Tensor::from_vec(gz, zba.shape(), dev)?,
                    Tensor::from_vec(gp, p.shape(), dev)?,
                )
            }};
        }
        let (gu, gz, gp) = match u.dtype() {
            DType::F32 => run!(f32),
            DType::F64 => run!(f64),
            t => candle_core::bail!("DeltaNet mixer: f32 or f64 only, got {t:?}"),
        };
        Ok((Some(gu), Some(gz), Some(gp)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};
    use candle_nn::Linear;

    use crate::model::config::LinearAttnArgs;
    use crate::model::delta::{DeltaNet, Inputs};
    use crate::model::proj::Proj;
    use crate::testing::{max_abs_diff, uniform};

    fn var(shape: &[usize], seed: u64, scale: f64) -> Var {
        let n: usize = shape.iter().product();
        let t = (Tensor::from_vec(uniform(n, seed), shape, &Device::Cpu).unwrap() * scale).unwrap();
        Var::from_tensor(&t).unwrap()
    }

    /// The op's output and the gradients of a weighted sum of it with respect to its four
    /// inputs (u, z, b, a) and four parameters (conv weight, dt_bias, A_log, norm weight)
    /// equal the candle composition's under autograd (f64, 1e-10; the composition's
    /// recurrence is `delta_op`, itself held to the chunk-wise form), for sequences shorter
    /// and longer than the convolution, two value heads per key head, and value heads wider
    /// than the 16 lanes of the recurrence's backward sums.
    #[test]
    fn the_mixer_op_equals_the_composition_with_its_gradients() {
        let la = LinearAttnArgs {
            num_key_heads: 2,
            num_value_heads: 4,
            key_head_dim: 3,
            value_head_dim: 20,
            conv_kernel: 4,
            grouped: false,
        };
        let (cd, vd, nv) = (la.conv_dim(), la.value_dim(), la.num_value_heads);
        let unused = || {
            Proj::new(Linear::new(
                Tensor::zeros((1, 1), candle_core::DType::F64, &Device::Cpu).unwrap(),
                None,
            ))
        };
        for (b, t) in [(1, 1), (2, 3), (2, 9)] {
            let params = [
                var(&[cd, 1, 4], 11, 0.5),
                var(&[nv], 12, 1.0),
                var(&[nv], 13, 1.0),
                var(&[la.value_head_dim], 14, 1.0),
            ];
            let d = DeltaNet {
                inputs: Inputs::Split {
                    qkv: unused(),
                    z: unused(),
                    b: unused(),
                    a: unused(),
                },
                out: unused(),
                conv: params[0].as_tensor().clone(),
                dt_bias: params[1].as_tensor().clone(),
                a_log: params[2].as_tensor().clone(),
                norm: params[3].as_tensor().clone(),
            };
            let ins = [
                var(&[b, t, cd], 21, 1.0),
                var(&[b, t, vd], 22, 1.0),
                var(&[b, t, nv], 23, 2.0),
                var(&[b, t, nv], 24, 2.0),
            ];
            let w = var(&[b, t, vd], 31, 1.0);
            let run = |fused: bool| {
                let [u, z, bb, a] = ins.each_ref().map(|v| v.as_tensor().clone());
                let y = d.mix(&la, 1e-6, (u, z, bb, a), None, fused).unwrap();
                let g = (&y * w.as_tensor())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let grads: Vec<Tensor> = ins
                    .iter()
                    .chain(&params)
                    .map(|v| g.get(v.as_tensor()).expect("a gradient").clone())
                    .collect();
                (y, grads)
            };
            let (y1, g1) = run(true);
            let (y2, g2) = run(false);
            let dy = max_abs_diff(&y1, &y2);
            assert!(dy < 1e-10, "b {b} t {t}: outputs off by {dy:e}");
            let names = ["u", "z", "b", "a", "conv", "dt_bias", "A_log", "norm"];
            for ((a, e), name) in g1.iter().zip(&g2).zip(names) {
                let diff = max_abs_diff(a, e);
                assert!(diff < 1e-10, "b {b} t {t}: ∂{name} off by {diff:e}");
            }
        }
    }
}
