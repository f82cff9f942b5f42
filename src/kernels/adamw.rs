//! AdamW's element-wise rule over host f32 slices (PyTorch's `torch.optim.AdamW`, one fused
//! pass per parameter; the optimizer with its state, groups and files is `trainer::optim`):
//!
//! ```text
//! p ← p·(1 − lr·wd),  m ← β1·m + (1−β1)·g,  v ← β2·v + (1−β2)·g²
//! p ← p − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)
//! ```
//!
//! torch's Adam (`weight_decay` as an L2 term) is the same rule with `g ← g + wd·p` first and no
//! decay. [`InPlace`] runs a step on a CPU f32 parameter in its own storage, with the gradient
//! as the second operand.

use rayon::prelude::*;

/// The element-wise AdamW rule of one step (constants folded from lr, betas and the step).
#[derive(Debug, Clone, Copy)]
pub struct AdamWRule {
    pub b1: f32,
    pub b2: f32,
    pub eps: f32,
    pub step_size: f32,
    pub sqrt_bc2: f32,
    pub decay: f32,
    /// Multiplies each gradient before use (1 = none).
    pub grad_scale: f32,
    /// torch's Adam (coupled weight decay): `g ← g + l2·p` before the moments, with `decay` 1;
    /// 0 for AdamW.
    pub l2: f32,
}

impl AdamWRule {
    /// Updates `p`, `m`, `v` (all of `g`'s length) in parallel chunks; element-wise, so the
    /// result is identical to one sequential loop.
    pub fn apply(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        const CHUNK: usize = 1 << 15;
        let rule = *self;
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(|(((p, m), v), g)| {
                #[cfg(target_arch = "x86_64")]
                match super::cpu::isa() {
                    // SAFETY: `isa` answers AVX-512 only on a CPU with AVX-512F.
                    super::cpu::Isa::Avx512 => {
                        return unsafe { adamw_chunk_avx512(p, m, v, g, rule) }
                    }
                    // SAFETY: `isa` answers AVX2 only on a CPU with AVX2 and FMA.
                    super::cpu::Isa::Avx2 => return unsafe { adamw_chunk_avx2(p, m, v, g, rule) },
                    _ => {}
                }
                adamw_chunk(p, m, v, g, rule);
            });
    }
}

/// The AdamW rule over one chunk; a plain loop the compiler vectorises for the target it is
/// compiled for.
#[inline(always)]
fn adamw_chunk(p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], rule: AdamWRule) {
    let AdamWRule {
        b1,
        b2,
        eps,
        step_size,
        sqrt_bc2,
        decay,
        grad_scale,
        l2,
    } = rule;
    let n = p.len().min(m.len()).min(v.len()).min(g.len());
    let (p, m, v, g) = (&mut p[..n], &mut m[..n], &mut v[..n], &g[..n]);
    for k in 0..n {
        let mut gk = g[k] * grad_scale;
        if l2 != 0.0 {
            gk += l2 * p[k];
        }
        m[k] = b1 * m[k] + (1.0 - b1) * gk;
        v[k] = b2 * v[k] + (1.0 - b2) * gk * gk;
        p[k] = p[k] * decay - step_size * m[k] / (v[k].sqrt() / sqrt_bc2 + eps);
    }
}

/// [`adamw_chunk`] compiled with AVX-512 (16 lanes), chosen at run time; the same IEEE
/// operations in the same order, so results are bit-identical to the plain loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn adamw_chunk_avx512(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    rule: AdamWRule,
) {
    adamw_chunk(p, m, v, g, rule)
}

/// [`adamw_chunk`] compiled with AVX2 (8 lanes), chosen at run time; bit-identical to the
/// plain loop as the AVX-512 form is (`fma` is enabled, but Rust never fuses on its own).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn adamw_chunk_avx2(
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    rule: AdamWRule,
) {
    adamw_chunk(p, m, v, g, rule)
}

/// torch.optim.AdamW's step on a bf16 parameter with bf16 moments (the state torch creates for
/// a bf16 parameter, as verl's FSDP engine keeps it under `model_dtype=bf16`): each tensor
/// operation of torch's single-tensor step (the foreach step makes the same operations) is
/// computed in f32 and its result rounded to bf16, in torch's order, with torch's constants
/// (Python floats, cast to f32 where the kernel reads them):
///
/// ```text
/// g ← bf16(g·clip)            only when clipping scales (torch multiplies the bf16 grads)
/// g ← bf16(g + l2·p)          torch's Adam (coupled decay) only
/// p ← bf16(p·(1 − lr·wd))
/// m ← bf16(fma(w1, g − m, m))                    lerp_(g, 1 − β1) (w1 < ½)
/// v ← bf16(v·β2);  v ← bf16(fma(w2·g, g, v))      mul_(β2).addcmul_(g, g, 1 − β2)
/// d ← bf16(bf16(bf16(√v) / √(1 − β2ᵗ)) + ε)       sqrt(), / , add_(ε)
/// p ← bf16(p + (−lr/(1 − β1ᵗ))·m / d)             addcdiv_
/// ```
///
/// Values travel as bf16 bit patterns (`u16`) for the moments and as f32 holding bf16 values
/// for the parameter and gradient.
#[derive(Debug, Clone, Copy)]
pub struct AdamWBf16Rule {
    pub decay: f32,
    pub w1: f32,
    pub b2: f32,
    pub w2: f32,
    pub sqrt_bc2: f32,
    pub eps: f32,
    pub neg_step_size: f32,
    pub grad_scale: f32,
    pub l2: f32,
}

impl AdamWBf16Rule {
    /// The step over one parameter's values.
    pub fn apply(&self, p: &mut [f32], m: &mut [u16], v: &mut [u16], g: &[f32]) {
        use super::bf16::round_bf16 as r;
        let f = |b: u16| f32::from_bits((b as u32) << 16);
        let bits = super::bf16::bf16_bits;
        for k in 0..p.len().min(m.len()).min(v.len()).min(g.len()) {
            let mut gk = g[k];
            if self.grad_scale != 1.0 {
                gk = r(gk * self.grad_scale);
            }
            if self.l2 != 0.0 {
                gk = r(gk + self.l2 * p[k]);
            }
            let mut pk = p[k];
            if self.decay != 1.0 {
                pk = r(pk * self.decay);
            }
            let mk = f(m[k]);
            // torch's vectorised lerp: fma(w, end − start, start) for a weight below ½,
            // fma(w − 1, end − start, end) otherwise.
            let (coeff, base) = match self.w1.abs() < 0.5 {
                true => (self.w1, mk),
                false => (self.w1 - 1.0, gk),
            };
            let mk = r(coeff.mul_add(gk - mk, base));
            let vk = r(f(v[k]) * self.b2);
            // torch's vectorised addcmul: fma(value·t1, t2, self).
            let vk = r((self.w2 * gk).mul_add(gk, vk));
            let d = r(r(r(vk.sqrt()) / self.sqrt_bc2) + self.eps);
            p[k] = r(pk + self.neg_step_size * mk / d);
            m[k] = bits(mk);
            v[k] = bits(vk);
        }
    }
}

/// An optimizer step as an in-place op on a CPU f32 parameter's storage, with the gradient as
/// the second operand: `step(parameter, gradient)` runs on the two slices (moments and rule
/// captured by the closure).
pub struct InPlace<F: FnMut(&mut [f32], &[f32]) -> candle_core::Result<()>> {
    pub step: std::cell::RefCell<F>,
}

impl<F: FnMut(&mut [f32], &[f32]) -> candle_core::Result<()>> candle_core::InplaceOp2
    for InPlace<F>
{
    fn name(&self) -> &'static str {
        "adamw-step"
    }

    fn cpu_fwd(
        &self,
        s1: &mut candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let (p, g) = super::storage::f32_operands("adamw-step", s1, l1, s2, l2)?;
        if p.len() != g.len() {
            candle_core::bail!("adamw-step: {} parameters, {} gradients", p.len(), g.len());
        }
        (self.step.borrow_mut())(p, g)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// The AVX-512 and AVX2 builds of the rule give the plain loop's bits (no fused
    /// multiply-add is introduced; sqrt and division are correctly rounded in all), including
    /// a ragged tail; each form this CPU has is checked.
    #[test]
    fn vector_chunks_are_bit_identical_to_the_plain_loop() {
        use super::super::cpu::Isa;
        type Chunk = unsafe fn(&mut [f32], &mut [f32], &mut [f32], &[f32], AdamWRule);
        let forms: Vec<(Isa, Chunk)> = [
            (Isa::Avx512, adamw_chunk_avx512 as Chunk),
            (Isa::Avx2, adamw_chunk_avx2 as Chunk),
        ]
        .into_iter()
        .filter(|(isa, _)| isa.here())
        .collect();
        if forms.is_empty() {
            eprintln!("skipped: this CPU has neither AVX-512 nor AVX2");
            return;
        }
        let n = 1000 + 7;
        let mk = |s: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2654435761) ^ s) % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        };
        let (p0, g) = (mk(1), mk(2));
        let (m0, v0) = (mk(3), mk(4).iter().map(|x| x.abs()).collect::<Vec<_>>());
        // AdamW (decay, no L2 term) and Adam (L2 term, no decay).
        for (decay, l2) in [(0.9999, 0.0), (1.0, 0.01)] {
            let c = AdamWRule {
                b1: 0.9,
                b2: 0.999,
                eps: 1e-8,
                step_size: 0.013,
                sqrt_bc2: 0.031,
                decay,
                grad_scale: 0.37,
                l2,
            };
            let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
            adamw_chunk(&mut p1, &mut m1, &mut v1, &g, c);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for (isa, chunk) in &forms {
                let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
                // SAFETY: the CPU has the form's features (filtered above).
                unsafe { chunk(&mut p2, &mut m2, &mut v2, &g, c) };
                assert_eq!(bits(&p1), bits(&p2), "{isa:?}");
                assert_eq!(bits(&m1), bits(&m2), "{isa:?}");
                assert_eq!(bits(&v1), bits(&v2), "{isa:?}");
            }
        }
    }
}
