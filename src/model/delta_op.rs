//! The gated delta rule as one op over host memory (CPU, f32/f64) with a hand-written
//! backward, for training: token by token per (row, head), states kept only at every
//! [`CHECKPOINT`]-th token and recomputed inside a stretch during backward (memory linear in
//! the sequence, no `[chunk, chunk]` terms). `delta.rs`'s chunk-wise composition is the
//! reference it is tested against.
//!
//! ```text
//! forward, per token:  a = e^g;  m = (a·S)ᵀk;  δ = β(v − m);  S ← a·S + k δᵀ;  o = Sᵀq
//! backward, per token (G = ∂L/∂S_t + q ∂oᵀ, P = a·S_{t−1}):
//!   ∂q = S_t ∂o            ∂k = G δ + P ∂m        ∂δ = Gᵀk
//!   ∂β = ∂δ·(v − m)        ∂v = β ∂δ              ∂m = −β ∂δ
//!   ∂P = G + k ∂mᵀ         ∂g = a·⟨∂P, S_{t−1}⟩   ∂S_{t−1} = a·∂P
//! ```
//!
//! Inputs are packed side by side, `[b, h, t, 2·dk + dv + 2]`: q (normalised and scaled), k,
//! v, g, β; the output is `[b, h, t, dv]`.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::kernels::elem::{pairwise, Elem};
use crate::kernels::simd::vectorized;
use crate::kernels::storage::Host;

/// Tokens between kept states in the backward's recomputation.
const CHECKPOINT: usize = 64;

/// The op: sizes of q/k heads and v heads.
pub(crate) struct DeltaRule {
    pub(crate) dk: usize,
    pub(crate) dv: usize,
}

impl DeltaRule {
    fn width(&self) -> usize {
        2 * self.dk + self.dv + 2
    }

    /// `[b, h, t, width]` → (rows·heads, t).
    fn dims(&self, shape: &Shape) -> Result<(usize, usize)> {
        let (b, h, t, w) = shape.dims4()?;
        if w != self.width() {
            candle_core::bail!(
                "delta rule: packed inputs of width {w}, expected {}",
                self.width()
            );
        }
        Ok((b * h, t))
    }

    /// One sequence's outputs `[t, dv]` from its packed inputs `x` `[t, width]`.
    #[inline(always)]
    pub(super) fn forward_one<T: Elem>(&self, x: &[T], out: &mut [T]) {
        let (dk, dv, w) = (self.dk, self.dv, self.width());
        let mut s = vec![T::zero(); dk * dv];
        let mut delta = vec![T::zero(); dv];
        for (row, o) in x.chunks_exact(w).zip(out.chunks_exact_mut(dv)) {
            step(&mut s, &mut delta, row, (dk, dv), Some(o), None);
        }
    }

    /// One sequence's input gradients `dx` `[t, width]` from `x` and the outputs' gradient
    /// `go` `[t, dv]`.
    ///
    /// Per token two passes over the state's rows `i` (vectors along `dv`, sums in 16 lanes),
    /// with `v − m` kept from the stretch's recomputation:
    /// A: `G_i = ∂S_i + q_i ∂o`; `∂q_i = S_i·∂o`; `∂δ += k_i G_i`; `∂k_i = β G_i·(v − m)`;
    /// B: `∂P_i = G_i + k_i ∂m`; `∂k_i += a P_i·∂m`; `∂a += ∂P_i·P_i`; `∂S_i ← a ∂P_i`.
    #[inline(always)]
    pub(super) fn backward_one<T: Elem>(&self, x: &[T], go: &[T], dx: &mut [T]) {
        let (dk, dv, w) = (self.dk, self.dv, self.width());
        let t = x.len() / w;
        let n = dk * dv;
        // States at the start of every stretch.
        let starts = t.div_ceil(CHECKPOINT);
        let mut kept = vec![T::zero(); starts * n];
        let mut s = vec![T::zero(); n];
        let mut delta = vec![T::zero(); dv];
        for (i, row) in x.chunks_exact(w).enumerate() {
            if i % CHECKPOINT == 0 {
                kept[i / CHECKPOINT * n..][..n].copy_from_slice(&s);
            }
            step(&mut s, &mut delta, row, (dk, dv), None, None);
        }
        // Backward, stretch by stretch from the end: the stretch's states (and each token's
        // v − m) recomputed, then its tokens in reverse.
        let mut ds = vec![T::zero(); n]; // ∂L/∂S_t
        let mut states = vec![T::zero(); (CHECKPOINT + 1) * n];
        let mut vms = vec![T::zero(); CHECKPOINT * dv];
        let (mut dm, mut dd) = (vec![T::zero(); dv], vec![T::zero(); dv]);
        for c in (0..starts).rev() {
            let first = c * CHECKPOINT;
            let len = CHECKPOINT.min(t - first);
            states[..n].copy_from_slice(&kept[c * n..][..n]);
            for j in 0..len {
                let (done, rest) = states.split_at_mut((j + 1) * n);
                rest[..n].copy_from_slice(&done[j * n..]);
                let row = &x[(first + j) * w..][..w];
                let vm = Some(&mut vms[j * dv..][..dv]);
                step(&mut rest[..n], &mut delta, row, (dk, dv), None, vm);
            }
            for j in (0..len).rev() {
                let i = first + j;
                let row = &x[i * w..][..w];
                let (q, k) = (&row[..dk], &row[dk..2 * dk]);
                let (gl, beta) = (row[w - 2], row[w - 1]);
                let a = gl.exp();
                let prev = &states[j * n..][..n];
                let cur = &states[(j + 1) * n..][..n];
                let vm = &vms[j * dv..][..dv];
                let d_o = &go[i * dv..][..dv];
                let out = &mut dx[i * w..][..w];
                let (dq, rest) = out.split_at_mut(dk);
                let (dkk, rest) = rest.split_at_mut(dk);
                let dvv = &mut rest[..dv];
                // Pass A.
                dd.fill(T::zero());
                for (((dsr, cr), (&qi, &ki)), (dqi, dki)) in ds
                    .chunks_exact(dv)
                    .zip(cur.chunks_exact(dv))
                    .zip(q.iter().zip(k))
                    .zip(dq.iter_mut().zip(dkk.iter_mut()))
                {
                    let (sq, sk) = pass_a((dsr, cr, d_o, vm), &mut dd, qi, ki);
                    *dqi = sq;
                    *dki = beta * sk;
                }
                // ∂β, ∂v, ∂m.
                let mut dbeta = T::zero();
                for (((&d, &r), dvo), m) in dd.iter().zip(vm).zip(dvv.iter_mut()).zip(dm.iter_mut())
                {
                    dbeta += d * r;
                    *dvo = beta * d;
                    *m = -beta * d;
                }
                // Pass B.
                let mut da = T::zero();
                for (((dsr, pr), (&qi, &ki)), dki) in ds
                    .chunks_exact_mut(dv)
                    .zip(prev.chunks_exact(dv))
                    .zip(q.iter().zip(k))
                    .zip(dkk.iter_mut())
                {
                    let (sp, sa) = pass_b(dsr, (pr, d_o, &dm), (qi, ki, a));
                    *dki += a * sp;
                    da += sa;
                }
                out[w - 2] = a * da;
                out[w - 1] = dbeta;
            }
        }
    }
}

/// Lanes of partial sums (16, so that the compiler keeps them in vector registers; a single
/// running sum is one long dependency chain).
type Lanes<T> = [T; 16];

/// The backward's pass A over one state row `i` (slices along `dv`): with `G = ∂S_i + q_i ∂o`,
/// adds `k_i G` to `dd` and returns `(S_i·∂o, G·(v − m))`.
#[inline(always)]
fn pass_a<T: Elem>(
    (ds, cur, d_o, vm): (&[T], &[T], &[T], &[T]),
    dd: &mut [T],
    qi: T,
    ki: T,
) -> (T, T) {
    let (mut l0, mut l1): (Lanes<T>, Lanes<T>) = ([T::zero(); 16], [T::zero(); 16]);
    let n = ds.len() / 16 * 16;
    let blocks = ds[..n]
        .chunks_exact(16)
        .zip(cur[..n].chunks_exact(16))
        .zip(d_o[..n].chunks_exact(16).zip(vm[..n].chunks_exact(16)))
        .zip(dd[..n].chunks_exact_mut(16));
    for (((s, c), (o, v)), d) in blocks {
        for j in 0..16 {
            let g = s[j] + qi * o[j];
            d[j] += ki * g;
            l0[j] += c[j] * o[j];
            l1[j] += g * v[j];
        }
    }
    let (mut t0, mut t1) = (T::zero(), T::zero());
    for j in n..ds.len() {
        let g = ds[j] + qi * d_o[j];
        dd[j] += ki * g;
        t0 += cur[j] * d_o[j];
        t1 += g * vm[j];
    }
    (pairwise(l0) + t0, pairwise(l1) + t1)
}

/// The backward's pass B over one state row `i`: with `∂P = ∂S_i + q_i ∂o + k_i ∂m`, sets
/// `∂S_i ← a ∂P` and returns `(P_i·∂m, ∂P·P_i)`.
#[inline(always)]
fn pass_b<T: Elem>(
    ds: &mut [T],
    (prev, d_o, dm): (&[T], &[T], &[T]),
    (qi, ki, a): (T, T, T),
) -> (T, T) {
    let (mut l0, mut l1): (Lanes<T>, Lanes<T>) = ([T::zero(); 16], [T::zero(); 16]);
    let n = ds.len() / 16 * 16;
    let blocks = ds[..n]
        .chunks_exact_mut(16)
        .zip(prev[..n].chunks_exact(16))
        .zip(d_o[..n].chunks_exact(16).zip(dm[..n].chunks_exact(16)));
    for ((s, p), (o, m)) in blocks {
        for j in 0..16 {
            let dp = s[j] + qi * o[j] + ki * m[j];
            l0[j] += p[j] * m[j];
            l1[j] += dp * p[j];
            s[j] = a * dp;
        }
    }
    let (mut t0, mut t1) = (T::zero(), T::zero());
    for j in n..ds.len() {
        let dp = ds[j] + qi * d_o[j] + ki * dm[j];
        t0 += prev[j] * dm[j];
        t1 += dp * prev[j];
        ds[j] = a * dp;
    }
    (pairwise(l0) + t0, pairwise(l1) + t1)
}

/// One token of the recurrence on state `s` `[dk, dv]` with packed inputs `row`; the output
/// `Sᵀq` goes to `out` and `v − (aS)ᵀk` to `vm` when given. `delta` is scratch `[dv]`.
#[inline(always)]
fn step<T: Elem>(
    s: &mut [T],
    delta: &mut [T],
    row: &[T],
    (dk, dv): (usize, usize),
    out: Option<&mut [T]>,
    vm: Option<&mut [T]>,
) {
    let w = row.len();
    let qkv = (&row[..dk], &row[dk..2 * dk], &row[2 * dk..2 * dk + dv]);
    token(s, delta, qkv, (row[w - 2].exp(), row[w - 1]), out, vm);
}

/// One token of the recurrence on state `s` `[dk, dv]` from its `q`, `k` `[dk]`, `v` `[dv]`,
/// decay `a = e^g` and write strength `β`; the output `Sᵀq` goes to `out` and `v − (aS)ᵀk` to
/// `vm` when given. `delta` is scratch `[dv]`. (The decode engine's DeltaNet layers run the
/// same function.) Every loop runs along `dv`, without sums across it, so that it vectorizes.
#[inline(always)]
pub(crate) fn token<T: Elem>(
    s: &mut [T],
    delta: &mut [T],
    (q, k, v): (&[T], &[T], &[T]),
    (a, beta): (T, T),
    out: Option<&mut [T]>,
    vm: Option<&mut [T]>,
) {
    let dv = v.len();
    // S ← a·S; δ = β(v − Sᵀk).
    delta.copy_from_slice(v);
    for (&kv, srow) in k.iter().zip(s.chunks_exact_mut(dv)) {
        for (d, sv) in delta.iter_mut().zip(srow.iter_mut()) {
            *sv *= a;
            *d -= kv * *sv;
        }
    }
    if let Some(vm) = vm {
        vm.copy_from_slice(delta);
    }
    delta.iter_mut().for_each(|d| *d *= beta);
    // S ← S + k δᵀ; o = Sᵀq.
    match out {
        Some(o) => {
            o.fill(T::zero());
            for ((&kv, &qv), srow) in k.iter().zip(q).zip(s.chunks_exact_mut(dv)) {
                for ((sv, &d), ov) in srow.iter_mut().zip(delta.iter()).zip(o.iter_mut()) {
                    *sv += kv * d;
                    *ov += qv * *sv;
                }
            }
        }
        None => {
            for (&kv, srow) in k.iter().zip(s.chunks_exact_mut(dv)) {
                for (sv, &d) in srow.iter_mut().zip(delta.iter()) {
                    *sv += kv * d;
                }
            }
        }
    }
}

impl DeltaRule {
    fn fwd<T: Elem>(&self, x: &[T], shape: &Shape) -> Result<Vec<T>> {
        let (jobs, t) = self.dims(shape)?;
        let (w, dv) = (self.width(), self.dv);
        let mut out = vec![T::zero(); jobs * t * dv];
        if out.is_empty() {
            return Ok(out);
        }
        out.par_chunks_mut(t * dv)
            .zip(x.par_chunks(t * w))
            .for_each(|(o, xs)| {
                vectorized(
                    #[inline(always)]
                    || self.forward_one(xs, o),
                )
            });
        Ok(out)
    }

    fn bwd_host<T: Elem>(&self, x: &[T], go: &[T], shape: &Shape) -> Result<Vec<T>> {
        let (jobs, t) = self.dims(shape)?;
        let (w, dv) = (self.width(), self.dv);
        let mut dx = vec![T::zero(); jobs * t * w];
        if dx.is_empty() {
            return Ok(dx);
        }
        dx.par_chunks_mut(t * w)
            .zip(x.par_chunks(t * w).zip(go.par_chunks(t * dv)))
            .for_each(|(d, (xs, gs))| {
                vectorized(
                    #[inline(always)]
                    || self.backward_one(xs, gs, d),
                )
            });
        Ok(dx)
    }
}

impl CustomOp1 for DeltaRule {
    fn name(&self) -> &'static str {
        "gated-delta-rule"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("delta rule: contiguous inputs only");
        };
        let (bs, h, t, _) = l.shape().dims4()?;
        let shape = Shape::from((bs, h, t, self.dv));
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(self.fwd(&v[a..b], l.shape())?),
            CpuStorage::F64(v) => CpuStorage::F64(self.fwd(&v[a..b], l.shape())?),
            _ => candle_core::bail!("delta rule: f32 or f64 only"),
        };
        Ok((out, shape))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (arg, grad) = (arg.contiguous()?, grad.contiguous()?);
        let host = Host::new(&[&arg, &grad])?;
        let dx = match arg.dtype() {
            candle_core::DType::F32 => {
                let d = self.bwd_host(host.slice::<f32>(0)?, host.slice(1)?, arg.shape())?;
                Tensor::from_vec(d, arg.shape(), arg.device())?
            }
            candle_core::DType::F64 => {
                let d = self.bwd_host(host.slice::<f64>(0)?, host.slice(1)?, arg.shape())?;
                Tensor::from_vec(d, arg.shape(), arg.device())?
            }
            d => candle_core::bail!("delta rule: f32 or f64 only, got {d:?}"),
        };
        Ok(Some(dx))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::DeltaRule;
    use crate::model::delta::chunked;

    /// q, k, v, g, β of [`crate::model::delta::tests::inputs`] (f64).
    fn inputs(b: usize, h: usize, t: usize, dk: usize, dv: usize) -> Vec<Tensor> {
        let [q, k, v, g, beta, _] = crate::model::delta::tests::inputs(b, h, t, dk, dv);
        vec![q, k, v, g, beta]
    }

    fn packed(x: &[Tensor]) -> Tensor {
        Tensor::cat(
            &[
                x[0].clone(),
                x[1].clone(),
                x[2].clone(),
                x[3].unsqueeze(3).unwrap(),
                x[4].unsqueeze(3).unwrap(),
            ],
            3,
        )
        .unwrap()
    }

    use crate::testing::max_abs_diff as max_diff;

    /// The op's outputs and the gradients of a weighted sum of them with respect to q, k, v, g
    /// and β equal the chunk-wise composition's under candle's autograd (f64, 1e-10), for
    /// lengths below, at and across the recomputation stretches (64), and value heads
    /// narrower and wider than the 16 lanes of the backward's sums.
    #[test]
    fn the_op_and_its_backward_equal_the_chunked_composition() {
        // dv = 20: one block of 16 lanes and a tail (dv = 3: the tail alone).
        for (t, dk, dv) in [
            (1, 4, 3),
            (5, 4, 3),
            (64, 4, 3),
            (70, 5, 20),
            (131, 4, 3),
            (131, 6, 20),
        ] {
            let x = inputs(2, 3, t, dk, dv);
            let vars: Vec<Var> = x.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            // Weights of the outputs [b, h, t, dv].
            let n = 2 * 3 * t * dv;
            let w = Tensor::from_vec(crate::testing::uniform(n, 7), (2, 3, t, dv), &Device::Cpu)
                .unwrap();
            let (want, _) = chunked(&ts[0], &ts[1], &ts[2], &ts[3], &ts[4], None, 16).unwrap();
            let gw = (&want * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let got = packed(&ts).apply_op1(DeltaRule { dk, dv }).unwrap();
            assert!(max_diff(&got, &want) < 1e-10, "t {t}: outputs");
            let gg = (&got * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for (i, v) in vars.iter().enumerate() {
                let (a, b) = (
                    gg.get(v.as_tensor()).unwrap(),
                    gw.get(v.as_tensor()).unwrap(),
                );
                let d = max_diff(a, b);
                assert!(d < 1e-10, "t {t}: input {i} gradient off by {d:e}");
            }
        }
    }
}
