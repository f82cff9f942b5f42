//! One linear projection of a layer, with its LoRA adapter when it has one.
//!
//! A projection `y = x·Wᵀ (+ b)` with an adapter computes `y + s·(x·Aᵀ)·Bᵀ`, with `A` `[r, in]`
//! and `B` `[out, r]` trainable and `W` frozen; `s = alpha / r` (or `alpha / √r` with
//! `use_rslora`). PEFT's `lora_dropout` masks the adapter's input in training forwards
//! ([`Dropout`]). Which projections get adapters, and the adapter files, are `weights::peft`.

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};

use crate::kernels::elem::Elem;
use crate::kernels::storage::{storage_of, tensor_of, Host};

/// A low-rank update of one projection: `A` `[r, in]`, `B` `[out, r]`, scale `s`.
#[derive(Clone)]
pub struct Lora {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
    /// The mask of this forward's adapter dropout; set only on the per-forward copy of a layer
    /// that a training forward runs (see `CausalLm::set_adapter_dropout`), never on the model.
    pub dropout: Option<Dropout>,
}

/// PEFT's `lora_dropout` on one projection in one forward: the adapter sees `x ⊙ m / (1 − p)`
/// (`y = x·Wᵀ + s·(dropout(x)·Aᵀ)·Bᵀ`; the base sees `x`), with `m_i` = 1 with probability
/// `1 − p`. The mask is a function of `seed` and the element's index in the row-major
/// `[rows, in]` input (a counter-based hash), so the forward, the backward and a recomputation
/// all draw the same mask without storing it, on any number of threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dropout {
    pub p: f64,
    pub seed: u64,
}

/// SplitMix64's output function: a bijective mix of 64 bits.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Dropout {
    /// Whether element `i` of the input is kept: a uniform draw in [0, 1) from `(seed, i)`
    /// against `p`.
    pub fn keeps(&self, i: usize) -> bool {
        let u = (mix64(self.seed ^ mix64(i as u64)) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        u >= self.p
    }

    /// `v ⊙ m / (1 − p)` in place (`v` row-major `[rows, in]`, element `i` masked by `keeps(i)`).
    pub fn apply<T: Elem>(&self, v: &mut [T]) {
        use rayon::prelude::*;
        let s = T::from_f64(1.0 / (1.0 - self.p));
        const CHUNK: usize = 1 << 14;
        v.par_chunks_mut(CHUNK).enumerate().for_each(|(c, chunk)| {
            for (j, x) in chunk.iter_mut().enumerate() {
                *x = if self.keeps(c * CHUNK + j) {
                    *x * s
                } else {
                    T::zero()
                };
            }
        });
    }

    /// The mask `m / (1 − p)` as a tensor of `shape` (the candle composition's form).
    pub fn mask(
        &self,
        shape: &[usize],
        dtype: candle_core::DType,
        device: &Device,
    ) -> Result<Tensor> {
        let mut m = vec![1f64; shape.iter().product()];
        self.apply(&mut m);
        Tensor::from_vec(m, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }
}

/// One linear projection of a layer: the base weight and, with LoRA, its adapter.
#[derive(Clone)]
pub struct Proj {
    pub base: Linear,
    pub lora: Option<Lora>,
}

impl Proj {
    pub fn new(base: Linear) -> Self {
        Self { base, lora: None }
    }

    /// The base weight `[out, in]`.
    pub fn weight(&self) -> &Tensor {
        self.base.weight()
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.base.bias()
    }

    /// The same projection cut from autograd (same storage).
    pub fn detached(&self) -> Proj {
        Proj {
            base: Linear::new(self.weight().detach(), self.bias().map(Tensor::detach)),
            lora: self.lora.as_ref().map(|l| Lora {
                a: l.a.detach(),
                b: l.b.detach(),
                scale: l.scale,
                dropout: l.dropout,
            }),
        }
    }

    /// `W + s·B·A` `[out, in]` (detached), or `W` itself without an adapter.
    pub fn merged_weight(&self) -> Result<Tensor> {
        match &self.lora {
            None => Ok(self.weight().detach()),
            Some(l) => {
                let delta = (l.b.detach().matmul(&l.a.detach())? * l.scale)?; // [out, in]
                self.weight().detach() + delta.to_dtype(self.weight().dtype())?
            }
        }
    }
}

/// `x·Wᵀ` `[n, in] → [n, out]` for a frozen `W` `[out, in]` on the CPU, as one op whose backward
/// returns only the input's gradient `g·W`. candle's matmul backward also computes `gᵀ·x` for
/// the weight even when nothing needs it: for a LoRA model's frozen base that is a third of the
/// projections' training FLOPs spent on a result thrown away.
struct FrozenMatmul {
    w: Tensor,
}

impl candle_core::CustomOp1 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let x = tensor_of(s, l)?; // [n, in]
        let y = x.matmul(&self.w.t()?)?; // [n, out]
        Ok((storage_of(&y)?, y.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.matmul(&self.w)?)) // [n, out]·[out, in]
    }
}

/// `x·Wᵀ` `[n, in] → [n, out]` on the CPU with bf16 operands and f32 sums (the AMX or
/// AVX512-BF16 kernels of `kernels::bf16`, as the hand-written layer's products under verl's
/// mixed precision), as one op: backward `∂x = g·W` and, when `W` trains, `∂W = gᵀ·x`, both in
/// the same precision. The op composition's products on the CPU for models the hand-written
/// layer does not serve (the Gated DeltaNet hybrids).
struct Bf16Linear;

impl candle_core::CustomOp2 for Bf16Linear {
    fn name(&self) -> &'static str {
        "bf16-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &candle_core::CpuStorage,
        xl: &candle_core::Layout,
        ws: &candle_core::CpuStorage,
        wl: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (n, inp) = xl.shape().dims2()?;
        let (out, win) = wl.shape().dims2()?;
        let (Some((x0, x1)), Some((w0, w1))) = (xl.contiguous_offsets(), wl.contiguous_offsets())
        else {
            candle_core::bail!("bf16 linear: contiguous operands only");
        };
        if win != inp {
            candle_core::bail!("bf16 linear: x [{n}, {inp}] against W [{out}, {win}]");
        }
        let (x, w) = (
            &xs.as_slice::<f32>()?[x0..x1],
            &ws.as_slice::<f32>()?[w0..w1],
        );
        let mut y = vec![0f32; n * out];
        crate::kernels::gemm::gemm_mixed(
            true,
            &mut y,
            n,
            out,
            inp,
            x,
            inp,
            1,
            w,
            1,
            inp,
            false,
            crate::kernels::simd::Par::Rayon,
        );
        Ok((candle_core::CpuStorage::F32(y), (n, out).into()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, inp) = x.dims2()?;
        let out = w.dim(0)?;
        let (x, grad) = (x.contiguous()?, grad.contiguous()?);
        let host = Host::new(&[&x, w, &grad])?;
        let (xs, ws, gs) = (
            host.slice::<f32>(0)?,
            host.slice::<f32>(1)?,
            host.slice::<f32>(2)?,
        );
        let par = crate::kernels::simd::Par::Rayon;
        let mut dx = vec![0f32; n * inp];
        crate::kernels::gemm::gemm_mixed(
            true, &mut dx, n, inp, out, gs, out, 1, ws, inp, 1, false, par,
        );
        let dw = match w.track_op() {
            true => {
                let mut dw = vec![0f32; out * inp];
                crate::kernels::gemm::gemm_mixed(
                    true, &mut dw, out, inp, n, gs, 1, out, xs, inp, 1, false, par,
                );
                Some(Tensor::from_vec(dw, (out, inp), w.device())?)
            }
            false => None,
        };
        drop(host);
        Ok((Some(Tensor::from_vec(dx, (n, inp), x.device())?), dw))
    }
}

/// `x·Wᵀ` `[n, in]` with bf16 operands and f32 sums: the CPU's bf16 kernels as one op
/// ([`Bf16Linear`]) for f32 CPU tensors where the CPU has them, else ([`mixed_matmul`]) both
/// operands cast to bf16 (cuBLAS on a GPU).
pub(crate) fn bf16_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let cpu = x.device().is_cpu() && x.dtype() == candle_core::DType::F32;
    if cpu && crate::kernels::bf16::available() {
        return x.contiguous()?.apply_op2(&w.contiguous()?, Bf16Linear);
    }
    mixed_matmul(x, w)
}

/// `x·Wᵀ` for `x` `[n, in]`: through [`FrozenMatmul`] when `W` is frozen, `x` needs a gradient
/// and everything is on the CPU in f32/f64; a plain product otherwise.
pub fn base_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let frozen = !w.track_op() && x.track_op() && crate::kernels::supported(x.device(), x.dtype());
    if frozen {
        x.contiguous()?.apply_op1(FrozenMatmul { w: w.clone() })
    } else {
        x.matmul(&w.t()?)
    }
}

pub(crate) fn linear(
    vb: &VarBuilder,
    inp: usize,
    out: usize,
    bias: bool,
    name: &str,
) -> Result<Proj> {
    let w = vb.get_with_hints(
        (out, inp),
        &format!("{name}.weight"),
        Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        },
    )?;
    let b = if bias {
        Some(vb.get_with_hints(out, &format!("{name}.bias"), Init::Const(0.0))?)
    } else {
        None
    };
    Ok(Proj::new(Linear::new(w, b)))
}

/// A linear layer on `[batch, seq, in]` as one `[batch·seq, in] × [in, out]` product (candle's
/// `Linear` on 3-D input runs one small product per batch row, which is several times slower).
/// With an adapter, `s·(dropout(x)·Aᵀ)·Bᵀ` is added (PEFT's `lora.Linear`; dropout only
/// where this forward's copy of the layer carries a mask).
pub(crate) fn apply(l: &Proj, x: &Tensor, mixed: bool) -> Result<Tensor> {
    let (b, t, i) = x.dims3()?;
    let x2 = x.reshape((b * t, i))?; // [b·t, in]
    let y = match mixed {
        true => bf16_matmul(&x2, l.weight())?,
        false => base_matmul(&x2, l.weight())?,
    }; // [b·t, out]
    let y = match l.bias() {
        Some(bias) => y.broadcast_add(bias)?,
        None => y,
    };
    let y = match &l.lora {
        // [b·t, in]·[in, r]·[r, out], scaled: with B = 0 this adds exact zeros.
        Some(a) => {
            let xa = match &a.dropout {
                Some(d) => (&x2 * d.mask(x2.dims(), x2.dtype(), x2.device())?)?,
                None => x2.clone(),
            };
            (y + (xa.matmul(&a.a.t()?)?.matmul(&a.b.t()?)? * a.scale)?)?
        }
        None => y,
    };
    y.reshape((b, t, ()))
}

/// `x·Wᵀ` `[n, in] → [n, out]` with both operands rounded to bf16 and the product returned in
/// `x`'s dtype (verl's mixed precision on a GPU: f32 master weights, bf16 products on cuBLAS
/// with f32 accumulation). The casts are differentiable, so the f32 weight receives the
/// gradient of the bf16 product in f32.
pub(crate) fn mixed_matmul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    x.to_dtype(DType::BF16)?
        .matmul(&w.to_dtype(DType::BF16)?.t()?)?
        .to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// The CPU's bf16 linear op against f64 products of the bf16-rounded operands (the
    /// definition of a bf16 product with wide sums): output and both gradients (∂x = g·W,
    /// ∂W = gᵀ·x, their operands rounded too) within 1e-5 relative; a frozen W gets none.
    #[test]
    fn the_bf16_linear_op_is_the_product_of_rounded_operands() {
        if !crate::kernels::bf16::available() {
            eprintln!("skipped: MAIN_PPO_BF16_KERNEL=none");
            return;
        }
        let dev = Device::Cpu;
        let r = |n: usize, seed: u64| -> Vec<f32> {
            crate::testing::uniform(n, seed)
                .into_iter()
                .map(|x| x as f32)
                .collect()
        };
        let (n, inp, out) = (37, 70, 45);
        let (xv, wv, gv) = (r(n * inp, 1), r(out * inp, 2), r(n * out, 3));
        let x = Var::from_vec(xv.clone(), (n, inp), &dev).unwrap();
        let w = Var::from_vec(wv.clone(), (out, inp), &dev).unwrap();
        let g = Tensor::from_vec(gv.clone(), (n, out), &dev).unwrap();
        let y = super::bf16_matmul(x.as_tensor(), w.as_tensor()).unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let rd = |v: &[f32]| -> Vec<f64> {
            v.iter()
                .map(|&a| f64::from(crate::kernels::bf16::round_bf16(a)))
                .collect()
        };
        let (xr, wr, gr) = (rd(&xv), rd(&wv), rd(&gv));
        // y = x·Wᵀ, ∂x = g·W, ∂W = gᵀ·x over rounded operands.
        let mut want_y = vec![0f64; n * out];
        let mut want_dx = vec![0f64; n * inp];
        let mut want_dw = vec![0f64; out * inp];
        for i in 0..n {
            for o in 0..out {
                for k in 0..inp {
                    want_y[i * out + o] += xr[i * inp + k] * wr[o * inp + k];
                    want_dx[i * inp + k] += gr[i * out + o] * wr[o * inp + k];
                    want_dw[o * inp + k] += gr[i * out + o] * xr[i * inp + k];
                }
            }
        }
        let close = |got: &Tensor, want: &[f64], what: &str| {
            let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
            let scale = want.iter().fold(0f64, |s, v| s.max(v.abs()));
            for (a, b) in got.iter().zip(want) {
                assert!(
                    (f64::from(*a) - b).abs() <= 1e-5 * scale,
                    "{what}: {a} vs {b}"
                );
            }
        };
        close(&y, &want_y, "y");
        close(grads.get(x.as_tensor()).unwrap(), &want_dx, "dx");
        close(grads.get(w.as_tensor()).unwrap(), &want_dw, "dW");
        let frozen = w.as_tensor().detach();
        let y = super::bf16_matmul(x.as_tensor(), &frozen).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&frozen).is_none());
        assert!(grads.get(x.as_tensor()).is_some());
    }
}
