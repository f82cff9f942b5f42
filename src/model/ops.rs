//! Element-wise pieces shared by the layers: compositions of candle ops with a backward pass,
//! and `swiglu`, one op with its own backward on the CPU beside the composition it replaces.

use candle_core::{DType, Result, Tensor, D};

/// `x · rsqrt(mean(x²) + eps) · w`, computed in f32.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = upcast(x)?;
    let inv = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    x32.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(w)
}

/// Half-precision values in f32 for softmax-type reductions; f32 and f64 stay as they are.
pub(crate) fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// `1 / (1 + e^{−x})`, composed of ops with backward passes.
pub(crate) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `silu(gate) ⊙ up` (`[.., n]` each, one shape) as one op on the CPU (f32/f64) with its
/// backward in one pass, `∂gate = g ⊙ up ⊙ silu′(gate)`, `∂up = g ⊙ silu(gate)`,
/// `silu′(x) = σ(x)(1 + x(1 − σ(x)))`; candle's `silu` and product take about ten tensors of
/// that size forward and backward. Elsewhere the composition (the tests' reference).
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let cpu = crate::kernels::supported(gate.device(), gate.dtype());
    if cpu && gate.shape() == up.shape() && gate.dtype() == up.dtype() {
        return gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu);
    }
    gate.silu()? * up
}

struct SwiGlu;

fn swiglu_fwd<T: crate::kernels::elem::Elem>(g: &[T], u: &[T]) -> Vec<T> {
    let mut out = vec![T::zero(); g.len()];
    crate::kernels::simd::par_zip2(&mut out, g, u, |_, x, y| {
        x * crate::kernels::elem::sigmoid(x) * y
    });
    out
}

fn swiglu_bwd<T: crate::kernels::elem::Elem>(g: &[T], u: &[T], d: &[T]) -> (Vec<T>, Vec<T>) {
    use rayon::prelude::*;
    let (mut dg, mut du) = (vec![T::zero(); g.len()], vec![T::zero(); g.len()]);
    let n = crate::kernels::simd::CHUNK;
    dg.par_chunks_mut(n)
        .zip(du.par_chunks_mut(n))
        .zip(g.par_chunks(n).zip(u.par_chunks(n)).zip(d.par_chunks(n)))
        .for_each(|((dg, du), ((g, u), d))| {
            crate::kernels::simd::vectorized(
                #[inline(always)]
                || {
                    for i in 0..g.len() {
                        let s = crate::kernels::elem::sigmoid(g[i]);
                        du[i] = d[i] * g[i] * s;
                        dg[i] = d[i] * u[i] * s * (T::one() + g[i] * (T::one() - s));
                    }
                },
            )
        });
    (dg, du)
}

impl candle_core::CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use crate::kernels::storage::contiguous;
        use candle_core::CpuStorage as S;
        let what = "swiglu: inputs";
        let out = match (s1, s2) {
            (S::F32(_), S::F32(_)) => S::F32(swiglu_fwd::<f32>(
                contiguous(s1, l1, what)?,
                contiguous(s2, l2, what)?,
            )),
            (S::F64(_), S::F64(_)) => S::F64(swiglu_fwd::<f64>(
                contiguous(s1, l1, what)?,
                contiguous(s2, l2, what)?,
            )),
            _ => candle_core::bail!("swiglu: f32 or f64 inputs of one dtype only"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let host = crate::kernels::storage::Host::new(&[gate, up, &grad])?;
        let (dg, du) = match gate.dtype() {
            DType::F32 => {
                let (a, b) = swiglu_bwd::<f32>(host.slice(0)?, host.slice(1)?, host.slice(2)?);
                (
                    Tensor::from_vec(a, gate.shape(), gate.device())?,
                    Tensor::from_vec(b, up.shape(), up.device())?,
                )
            }
            DType::F64 => {
                let (a, b) = swiglu_bwd::<f64>(host.slice(0)?, host.slice(1)?, host.slice(2)?);
                (
                    Tensor::from_vec(a, gate.shape(), gate.device())?,
                    Tensor::from_vec(b, up.shape(), up.device())?,
                )
            }
            d => candle_core::bail!("swiglu: f32 or f64 only, got {d:?}"),
        };
        Ok((Some(dg), Some(du)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    /// The op's values and both input gradients equal the composition `silu(gate) · up`
    /// under candle's autograd (f64 within 1e-13; f32 within 1e-6 relative: the op's
    /// polynomial e^x against libm's).
    #[test]
    fn swiglu_equals_the_composition_with_its_gradients() {
        for (dtype, tol) in [(DType::F64, 1e-13), (DType::F32, 1e-6)] {
            let n = 3 * crate::kernels::simd::CHUNK / 2 + 7; // two parallel chunks and a tail
            let t = |seed: u64, scale: f64| {
                let v = Tensor::from_vec(crate::testing::uniform(n, seed), n, &Device::Cpu);
                (v.unwrap() * scale).unwrap().to_dtype(dtype).unwrap()
            };
            let (g, u) = (
                Var::from_tensor(&t(1, 8.0)).unwrap(),
                Var::from_tensor(&t(2, 1.0)).unwrap(),
            );
            let w = t(3, 1.0);
            let a = super::swiglu(g.as_tensor(), u.as_tensor()).unwrap();
            let b = (g.as_tensor().silu().unwrap() * u.as_tensor()).unwrap();
            let scale =
                |x: &Tensor| crate::testing::max_abs_diff(x, &x.zeros_like().unwrap()).max(1.0);
            assert!(
                crate::testing::max_abs_diff(&a, &b) <= tol * scale(&b),
                "{dtype:?}: values"
            );
            let ga = (&a * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (&b * &w).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&g, &u] {
                let (x, y) = (
                    ga.get(v.as_tensor()).unwrap(),
                    gb.get(v.as_tensor()).unwrap(),
                );
                let d = crate::testing::max_abs_diff(x, y);
                assert!(d <= tol * scale(y), "{dtype:?}: gradient off by {d:e}");
            }
        }
    }
}
