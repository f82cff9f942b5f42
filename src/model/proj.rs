//! One linear projection of a layer, with its LoRA adapter when it has one.
//!
//! A projection `y = x·Wᵀ (+ b)` with an adapter computes `y + s·(x·Aᵀ)·Bᵀ`, with `A` `[r, in]`
//! and `B` `[out, r]` trainable and `W` frozen; `s = alpha / r` (or `alpha / √r` with
//! `use_rslora`). PEFT's `lora_dropout` masks the adapter's input in training forwards
//! ([`Dropout`]). Which projections get adapters, and the adapter files, are `weights::peft`.

use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};

use crate::kernels::elem::Elem;
use crate::kernels::storage::{storage_of, tensor_of};

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
        true => mixed_matmul(&x2, l.weight())?,
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
