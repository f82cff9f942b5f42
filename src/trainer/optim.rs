//! AdamW (and Adam) as one fused pass per parameter over host memory, with moments kept between
//! steps and saved in checkpoints (candle-nn's AdamW builds a dozen temporary tensors per
//! parameter and has no state to save), plus verl's learning-rate schedules and gradient-norm
//! clipping.
//!
//! Update (PyTorch's `torch.optim.AdamW`): `p ← p·(1 − lr·wd)`, `m ← β1·m + (1−β1)·g`,
//! `v ← β2·v + (1−β2)·g²`, `p ← p − lr/(1−β1ᵗ) · m / (√v/√(1−β2ᵗ) + ε)`; `torch.optim.Adam` adds
//! `wd·p` to the gradient instead of decaying. The moments are f32, or with `torchao.optim`'s
//! low-bit classes (`optim.optimizer_impl=torchao.optim optim.optimizer=AdamW8bit`, ...)
//! block-quantised as torchao keeps them, ~2 bytes per parameter for both instead of 8
//! (`kernels::adam_lowbit`).
//! Schedules: verl's `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup`
//! (`verl/utils/torch_functional.py`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::config::{LrSchedulerType, MomentFormat, OptimConfig, OptimizerChoice};
use crate::kernels::adam_lowbit::{BlockMoment, Codec, TorchAoRule};
use crate::kernels::adamw::{AdamWBf16Rule, AdamWRule, InPlace};

/// The learning rate of each training step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub base_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub kind: LrSchedulerType,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
    /// The cosine schedule counts from 0 (verl's default) or from 1 (`zero_indexed_step=false`,
    /// torchtitan's convention); verl's constant schedule always counts from 0.
    pub zero_indexed: bool,
}

impl LrSchedule {
    /// From `optim.*`; warm-up is `lr_warmup_steps`, else `lr_warmup_steps_ratio × total`.
    pub fn new(o: &OptimConfig, total_steps: u64) -> Self {
        let total = o.total_training_steps.unwrap_or(total_steps);
        let warmup = o
            .lr_warmup_steps
            .unwrap_or((o.lr_warmup_steps_ratio * total as f64) as u64);
        Self {
            base_lr: o.lr,
            warmup_steps: warmup,
            total_steps: total,
            kind: o.scheduler(),
            min_lr_ratio: o.min_lr_ratio,
            num_cycles: o.num_cycles,
            zero_indexed: o.zero_indexed_step,
        }
    }

    /// The rate at scheduler step `step` (0 before the first `step()` call, as PyTorch counts).
    pub fn lr(&self, step: u64) -> f64 {
        let step = match self.kind {
            LrSchedulerType::Cosine if !self.zero_indexed => step + 1,
            _ => step,
        };
        let w = self.warmup_steps;
        if step < w {
            return self.base_lr * step as f64 / (w.max(1)) as f64;
        }
        match self.kind {
            LrSchedulerType::Constant => self.base_lr,
            LrSchedulerType::Cosine => {
                let progress =
                    (step - w) as f64 / (self.total_steps.saturating_sub(w).max(1)) as f64;
                let x = (std::f64::consts::PI * self.num_cycles * 2.0 * progress).cos();
                let coef = (1.0 - self.min_lr_ratio) * 0.5;
                let intercept = (1.0 + self.min_lr_ratio) * 0.5;
                self.base_lr * (x * coef + intercept).max(self.min_lr_ratio)
            }
        }
    }
}

/// The L2 norm of all gradients (before clipping, as verl reports `grad_norm`) and, when it is
/// finite and above `max_norm`, every gradient scaled by `max_norm / (norm + 1e-6)`.
/// A non-finite norm is returned as is: the caller skips the step, as verl does.
///
/// The training update does not scale here: it hands [`clip_coef`] to [`AdamW::step_scaled`],
/// which multiplies each gradient as it reads it (no second copy of every gradient).
pub fn clip_grad_norm(
    vars: &[(String, Var)],
    grads: &mut GradStore,
    max_norm: f64,
) -> candle_core::Result<f64> {
    let norm = grad_norm(vars, grads)?;
    let scale = clip_coef(norm, max_norm);
    if scale != 1.0 {
        for (_, v) in vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), (g * scale)?);
            }
        }
    }
    Ok(norm)
}

/// The L2 norm of the gradients of `vars` (those that have one), squares summed in f64.
/// Gradients on a GPU are reduced there into one f64 scalar, read back once (one
/// synchronisation per step, not one per parameter).
pub fn grad_norm(vars: &[(String, Var)], grads: &GradStore) -> candle_core::Result<f64> {
    let present: Vec<&Tensor> = vars
        .iter()
        .filter_map(|(_, v)| grads.get(v.as_tensor()))
        .collect();
    if !present.is_empty() && present.iter().all(|g| g.dtype() == DType::BF16) {
        // torch's clip_grad_norm_ on bf16 gradients: each tensor's norm comes back as a bf16
        // value, and the norm of those norms too.
        let mut sq = 0f64;
        for g in present {
            let n = round_bf16(sum_of_squares(g)?.sqrt());
            sq += n * n;
        }
        return Ok(round_bf16(sq.sqrt()));
    }
    let mut sq = 0f64;
    let mut on_device: Option<Tensor> = None;
    for (_, v) in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            if g.device().is_cpu() {
                sq += sum_of_squares(g)?;
            } else {
                let s = g.to_dtype(DType::F64)?.sqr()?.sum_all()?;
                on_device = Some(match on_device {
                    Some(acc) => (acc + s)?,
                    None => s,
                });
            }
        }
    }
    if let Some(s) = on_device {
        sq += s.to_scalar::<f64>()?;
    }
    Ok(sq.sqrt())
}

/// `x` rounded to the nearest bf16 value.
fn round_bf16(x: f64) -> f64 {
    f64::from(crate::kernels::bf16::round_bf16(x as f32))
}

/// [`clip_coef`] as torch computes it for bf16 gradients: `max_norm / (norm + 1e-6)` in bf16
/// arithmetic (each operation rounded to bf16), at most 1.
pub fn clip_coef_bf16(norm: f64, max_norm: f64) -> f64 {
    if clip_coef(norm, max_norm) == 1.0 {
        return 1.0;
    }
    round_bf16(max_norm / round_bf16(norm + 1e-6)).min(1.0)
}

/// The factor gradient clipping multiplies every gradient by: `max_norm / (norm + 1e-6)` when
/// `norm` is finite and above `max_norm > 0`, else 1 (PyTorch's `clip_grad_norm_`, as verl).
pub fn clip_coef(norm: f64, max_norm: f64) -> f64 {
    if norm.is_finite() && max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

/// `Σ g²` in f64: read in place for a contiguous f32 tensor on the CPU (the training case;
/// converting a 135M-parameter gradient to f64 and squaring it as tensors allocated 2 GB per
/// step), through tensor ops otherwise.
fn sum_of_squares(g: &Tensor) -> candle_core::Result<f64> {
    {
        let (storage, layout) = g.storage_and_layout();
        if let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)), Some((a, b))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(sum_of_squares_f32(&v[a..b]));
        }
    }
    g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

/// `Σ x²` of f32 values in f64, summed in index order: the same bits as the tensor route
/// (`to_dtype(F64)`, `sqr`, `sum_all` adds sequentially), so a norm, and so clipping, does not
/// depend on which route ran. One pass, no allocation (~0.1 s for 135M values).
fn sum_of_squares_f32(x: &[f32]) -> f64 {
    x.iter().fold(0f64, |s, &v| {
        let v = f64::from(v);
        s + v * v
    })
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Meta {
    step: u64,
    betas: [f64; 2],
    eps: f64,
    weight_decay: f64,
    /// How the moments were saved: `f32`, or torchao's `int8`, `int4`, `fp8` codes (files
    /// written before low-bit moments existed hold f32).
    #[serde(default)]
    moments: MomentFormat,
    #[serde(default)]
    block_size: usize,
}

fn codec(f: MomentFormat) -> Option<Codec> {
    match f {
        MomentFormat::F32 => None,
        MomentFormat::Int8 => Some(Codec::Map8),
        MomentFormat::Int4 => Some(Codec::Map4),
        MomentFormat::Fp8 => Some(Codec::Fp8),
    }
}

/// One moment of one parameter: host f32 values, block-quantised host codes (torchao's low-bit
/// classes), or (for an f32 parameter on a GPU under torch's AdamW) an f32 tensor on its
/// device, updated there in place and copied to the host only for checkpoints; zeros not yet
/// allocated before the first step or load.
enum Moment {
    Zero,
    Host(Vec<f32>),
    /// bf16 bit patterns: torch's AdamW state of a bf16 parameter (`model_dtype=bf16`).
    HostBf16(Vec<u16>),
    Blocks(BlockMoment),
    Device(Tensor),
}

impl Moment {
    /// Zeros for `var` under `choice` (`signed`: the first moment). Quantised when the choice
    /// keeps low-bit moments and the parameter has at least 4096 values in whole blocks
    /// (torchao's rule, after bitsandbytes); on its device when that is a GPU, the parameter is
    /// f32 and the update is torch's AdamW; host f32 otherwise.
    fn zeros(var: &Var, choice: &OptimizerChoice, signed: bool) -> candle_core::Result<Self> {
        let p = var.as_tensor();
        let n = p.elem_count();
        if let Some(c) = Self::codec_for(choice, n) {
            return Ok(Moment::Blocks(BlockMoment::zeros(
                c,
                signed,
                choice.block_size,
                n,
            )));
        }
        Ok(match Self::on_device(p, choice) {
            true => Moment::Device(Tensor::zeros(p.shape(), DType::F32, p.device())?),
            false if Self::bf16_state(p, choice) => Moment::HostBf16(vec![0u16; n]),
            false => Moment::Host(vec![0f32; n]),
        })
    }

    /// Whether `p`'s moments are bf16, as torch's AdamW keeps them for a bf16 parameter (its
    /// `zeros_like(p)`); torchao's classes keep their own formats.
    fn bf16_state(p: &Tensor, choice: &OptimizerChoice) -> bool {
        p.dtype() == DType::BF16 && !choice.torchao_form
    }

    /// The codec of a parameter of `n` values under `choice`, when its moments are quantised.
    fn codec_for(choice: &OptimizerChoice, n: usize) -> Option<Codec> {
        let b = choice.block_size;
        codec(choice.moments).filter(|_| n >= 4096 && b > 0 && n.is_multiple_of(b))
    }

    /// Allocates the zeros of a [`Moment::Zero`] for `var`.
    fn allocate(
        &mut self,
        var: &Var,
        choice: &OptimizerChoice,
        signed: bool,
    ) -> candle_core::Result<()> {
        if matches!(self, Moment::Zero) {
            *self = Moment::zeros(var, choice, signed)?;
        }
        Ok(())
    }

    /// Whether `p`'s moments live on its device (AdamW runs there, `kernels::cuda`).
    fn on_device(p: &Tensor, choice: &OptimizerChoice) -> bool {
        cfg!(feature = "cuda")
            && p.device().is_cuda()
            && p.dtype() == DType::F32
            && choice.decoupled
            && !choice.torchao_form
    }

    /// The values in f32 on the host of a moment of `n` values.
    fn to_host(&self, n: usize) -> candle_core::Result<Vec<f32>> {
        match self {
            Moment::Zero => Ok(vec![0f32; n]),
            Moment::Host(v) => Ok(v.clone()),
            Moment::HostBf16(v) => Ok(v
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect()),
            Moment::Blocks(b) => Ok(b.to_f32()),
            Moment::Device(t) => t.flatten_all()?.to_vec1(),
        }
    }

    /// Replaces the values with `t`'s (a checkpoint's f32 tensor of `var`'s shape; quantised
    /// when this moment keeps codes).
    fn set(
        &mut self,
        var: &Var,
        choice: &OptimizerChoice,
        signed: bool,
        t: &Tensor,
    ) -> candle_core::Result<()> {
        let t = t.to_dtype(DType::F32)?;
        self.allocate(var, choice, signed)?;
        match self {
            Moment::Zero => unreachable!("allocated above"),
            Moment::Host(v) => *v = t.flatten_all()?.to_vec1()?,
            Moment::HostBf16(v) => {
                let x: Vec<f32> = t.flatten_all()?.to_vec1()?;
                *v = x.into_iter().map(crate::kernels::bf16::bf16_bits).collect();
            }
            Moment::Blocks(b) => b.set_f32(&t.flatten_all()?.to_vec1::<f32>()?),
            Moment::Device(d) => *d = t.to_device(d.device())?.reshape(d.shape())?.contiguous()?,
        }
        Ok(())
    }
}

impl Moment {
    /// Values held (none before the first step or load; a device moment's on its device).
    fn len(&self) -> Option<usize> {
        match self {
            Moment::Zero => None,
            Moment::Host(v) => Some(v.len()),
            Moment::HostBf16(v) => Some(v.len()),
            Moment::Blocks(b) => Some(b.len()),
            Moment::Device(t) => Some(t.elem_count()),
        }
    }
}

/// The element-wise rule of one step.
#[derive(Clone, Copy)]
enum Rule {
    /// torch's rule in f32, and the same step as torch takes it on a bf16 parameter.
    Torch(AdamWRule, AdamWBf16Rule),
    TorchAo(TorchAoRule),
}

impl Rule {
    /// The step over host slices of one parameter.
    fn apply(
        &self,
        p: &mut [f32],
        m: &mut Moment,
        v: &mut Moment,
        g: &[f32],
    ) -> candle_core::Result<()> {
        let n = p.len();
        if g.len() != n || m.len() != Some(n) || v.len() != Some(n) {
            candle_core::bail!(
                "optimizer: {n} parameters, {} gradients, moments of {:?} and {:?} values",
                g.len(),
                m.len(),
                v.len()
            );
        }
        match (self, m, v) {
            (Rule::Torch(r, _), Moment::Host(m), Moment::Host(v)) => r.apply(p, m, v, g),
            (Rule::Torch(_, r), Moment::HostBf16(m), Moment::HostBf16(v)) => r.apply(p, m, v, g),
            (Rule::TorchAo(r), Moment::Host(m), Moment::Host(v)) => r.apply(p, m, v, g),
            (Rule::TorchAo(r), Moment::Blocks(m), Moment::Blocks(v)) => r.apply_blocks(p, m, v, g),
            _ => candle_core::bail!("optimizer: moments kept in a form the update does not read"),
        }
        Ok(())
    }
}

/// AdamW (or Adam, with f32 or block-quantised moments, as `optim.*` chooses) over named
/// variables.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Moment>,
    v: Vec<Moment>,
    /// Optimizer steps taken.
    pub step: u64,
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
    choice: OptimizerChoice,
}

impl AdamW {
    /// Over `vars` (sorted by name, so checkpoints line up), with `optim.*`'s optimizer, betas,
    /// eps and weight decay. An optimizer the section cannot name is an error (resolving the
    /// config reports it first, with the key).
    pub fn new(vars: HashMap<String, Var>, o: &OptimConfig) -> candle_core::Result<Self> {
        let choice = o.choice().map_err(candle_core::Error::Msg)?;
        let sorted: BTreeMap<String, Var> = vars.into_iter().collect();
        let vars: Vec<(String, Var)> = sorted.into_iter().collect();
        let m = vars.iter().map(|_| Moment::Zero).collect();
        let v = vars.iter().map(|_| Moment::Zero).collect();
        Ok(Self {
            vars,
            m,
            v,
            step: 0,
            betas: o.betas,
            eps: o.eps,
            weight_decay: o.weight_decay,
            choice,
        })
    }

    /// The block-quantised moments of the variable `name` (tests and diagnostics).
    pub fn block_moments(&self, name: &str) -> Option<(&BlockMoment, &BlockMoment)> {
        let i = self.vars.iter().position(|(n, _)| n == name)?;
        match (&self.m[i], &self.v[i]) {
            (Moment::Blocks(m), Moment::Blocks(v)) => Some((m, v)),
            _ => None,
        }
    }

    /// The f32 host moments of the variable `name` (tests and diagnostics).
    pub fn host_moments(&self, name: &str) -> Option<(&[f32], &[f32])> {
        let i = self.vars.iter().position(|(n, _)| n == name)?;
        match (&self.m[i], &self.v[i]) {
            (Moment::Host(m), Moment::Host(v)) => Some((m, v)),
            _ => None,
        }
    }

    /// Bytes the moments hold now (zero before the first step).
    pub fn state_bytes(&self) -> usize {
        self.m
            .iter()
            .chain(&self.v)
            .map(|m| match m {
                Moment::Zero => 0,
                Moment::Host(v) => v.len() * 4,
                Moment::HostBf16(v) => v.len() * 2,
                Moment::Blocks(b) => b.codes.len() + b.scale.len() * 4,
                Moment::Device(t) => t.elem_count() * 4,
            })
            .sum()
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The factor clipping multiplies the gradients by for a gradient norm `norm` ([`grad_norm`]):
    /// in bf16 arithmetic when every parameter is bf16 (torch's, on bf16 gradients), else
    /// [`clip_coef`].
    pub fn clip_scale(&self, norm: f64, max_norm: f64) -> f64 {
        let bf16 = |(_, v): &(String, Var)| v.as_tensor().dtype() == DType::BF16;
        match !self.vars.is_empty() && self.vars.iter().all(bf16) {
            true => clip_coef_bf16(norm, max_norm),
            false => clip_coef(norm, max_norm),
        }
    }

    /// One update with learning rate `lr`. Parameters without a gradient are left alone.
    ///
    /// An f32 parameter on the CPU is updated in place in its own storage (one pass reading the
    /// gradient and moments once); any other parameter goes through a host copy and `Var::set`.
    /// Both give the same numbers: the element-wise rule is one function, [`AdamWRule::apply`].
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> candle_core::Result<()> {
        self.step_scaled(grads, lr, 1.0)
    }

    /// [`AdamW::step`] with every gradient multiplied by `grad_scale` as it is read (gradient
    /// clipping's [`clip_coef`]); the product is rounded to f32 as `g · scale` on the tensor
    /// would be, and a scale of 1 changes nothing.
    pub fn step_scaled(
        &mut self,
        grads: &GradStore,
        lr: f64,
        grad_scale: f64,
    ) -> candle_core::Result<()> {
        self.step += 1;
        let rule = self.rule(lr, grad_scale);
        let choice = self.choice;
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let p = var.as_tensor();
            self.m[i].allocate(var, &choice, true)?;
            self.v[i].allocate(var, &choice, false)?;
            #[cfg(feature = "cuda")]
            if let (Moment::Device(m), Moment::Device(v), Rule::Torch(r, _)) =
                (&self.m[i], &self.v[i], rule)
            {
                crate::kernels::cuda::adamw_in_place(p, m, v, g, r)?;
                continue;
            }
            let (m, v) = (&mut self.m[i], &mut self.v[i]);
            if p.device().is_cpu() && p.dtype() == DType::F32 && p.is_contiguous() {
                let g = g
                    .to_dtype(DType::F32)?
                    .to_device(&Device::Cpu)?
                    .contiguous()?;
                let op = InPlace {
                    step: std::cell::RefCell::new(|p: &mut [f32], g: &[f32]| {
                        rule.apply(p, m, v, g)
                    }),
                };
                p.inplace_op2(&g, &op)?;
                continue;
            }
            let g: Vec<f32> = g
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1()?;
            let mut host: Vec<f32> = p
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1()?;
            rule.apply(&mut host, m, v, &g)?;
            var.set(
                &Tensor::from_vec(host, p.shape(), &Device::Cpu)?
                    .to_dtype(p.dtype())?
                    .to_device(p.device())?,
            )?;
        }
        Ok(())
    }

    /// The constants of step `self.step` at learning rate `lr`: torch.optim's (folded in f64,
    /// rounded to f32) or torchao's (each computed in f32, as its f32 tensors do).
    fn rule(&self, lr: f64, grad_scale: f64) -> Rule {
        let t = self.step as i32;
        let (b1, b2) = (self.betas[0], self.betas[1]);
        let wd = self.weight_decay;
        let decoupled = self.choice.decoupled;
        if self.choice.torchao_form {
            let (lr32, wd32, b1_32, b2_32) = (lr as f32, wd as f32, b1 as f32, b2 as f32);
            let step = self.step as f32;
            return Rule::TorchAo(TorchAoRule {
                lr: lr32,
                lr_wd: if decoupled { lr32 * wd32 } else { 0.0 },
                l2: if decoupled { 0.0 } else { wd32 },
                w1: (1.0 - b1) as f32,
                w2: (1.0 - b2) as f32,
                bc1: 1.0 - b1_32.powf(step),
                sqrt_bc2: (1.0 - b2_32.powf(step)).sqrt(),
                eps: self.eps as f32,
                grad_scale: grad_scale as f32,
            });
        }
        let decay = if decoupled { 1.0 - lr * wd } else { 1.0 };
        let l2 = if decoupled { 0.0 } else { wd as f32 };
        let (step_size, sqrt_bc2) = (lr / (1.0 - b1.powi(t)), (1.0 - b2.powi(t)).sqrt());
        Rule::Torch(
            AdamWRule {
                b1: b1 as f32,
                b2: b2 as f32,
                eps: self.eps as f32,
                step_size: step_size as f32,
                sqrt_bc2: sqrt_bc2 as f32,
                decay: decay as f32,
                grad_scale: grad_scale as f32,
                l2,
            },
            // Each constant as torch's kernels read its Python float: rounded to f32 once.
            AdamWBf16Rule {
                decay: decay as f32,
                w1: (1.0 - b1) as f32,
                b2: b2 as f32,
                w2: (1.0 - b2) as f32,
                sqrt_bc2: sqrt_bc2 as f32,
                eps: self.eps as f32,
                neg_step_size: -step_size as f32,
                grad_scale: grad_scale as f32,
                l2,
            },
        )
    }

    /// Writes the moments (`<dir>/optim.safetensors`: `m.<name>` and `v.<name>` in f32, or for
    /// block-quantised moments `m.<name>.codes` (u8) and `m.<name>.scale` (f32 per block)) and
    /// the step and format (`<dir>/optim.json`).
    pub fn save(&self, dir: &Path) -> candle_core::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut map = HashMap::new();
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (slot, prefix) in [(&self.m[i], "m"), (&self.v[i], "v")] {
                let key = format!("{prefix}.{name}");
                if let Moment::Blocks(b) = slot {
                    let (nc, ns) = (b.codes.len(), b.scale.len());
                    map.insert(
                        format!("{key}.codes"),
                        Tensor::from_vec(b.codes.clone(), nc, &Device::Cpu)?,
                    );
                    map.insert(
                        format!("{key}.scale"),
                        Tensor::from_vec(b.scale.clone(), ns, &Device::Cpu)?,
                    );
                    continue;
                }
                map.insert(
                    key,
                    Tensor::from_vec(
                        slot.to_host(var.elem_count())?,
                        var.as_tensor().shape(),
                        &Device::Cpu,
                    )?,
                );
            }
        }
        crate::weights::save_safetensors(&map, &dir.join("optim.safetensors"))
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let meta = Meta {
            step: self.step,
            betas: self.betas,
            eps: self.eps,
            weight_decay: self.weight_decay,
            moments: self.choice.moments,
            block_size: self.choice.block_size,
        };
        std::fs::write(
            dir.join("optim.json"),
            serde_json::to_string_pretty(&meta).map_err(candle_core::Error::wrap)?,
        )?;
        Ok(())
    }

    /// Restores what [`AdamW::save`] wrote; every variable's moments must be there. Codes saved
    /// in this run's format are restored as they are (a resumed run continues bit for bit);
    /// moments saved in another format (f32 from torch's AdamW, other codes or blocks) are
    /// read back to f32 and stored in this run's.
    pub fn load(&mut self, dir: &Path) -> candle_core::Result<()> {
        // Every failure names the file (a truncated or garbled save is found by name).
        let named = |f: &Path, e: &dyn std::fmt::Display| {
            candle_core::Error::Msg(format!("{}: {e}", f.display()))
        };
        let meta_path = dir.join("optim.json");
        let text = std::fs::read_to_string(&meta_path).map_err(|e| named(&meta_path, &e))?;
        let meta: Meta = serde_json::from_str(&text).map_err(|e| named(&meta_path, &e))?;
        let moments = dir.join("optim.safetensors");
        let tensors = candle_core::safetensors::load(&moments, &Device::Cpu)
            .map_err(|e| named(&moments, &e))?;
        let choice = self.choice;
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (slot, prefix) in [(&mut self.m[i], "m"), (&mut self.v[i], "v")] {
                let key = format!("{prefix}.{name}");
                let signed = prefix == "m";
                if tensors.contains_key(&format!("{key}.codes")) {
                    let saved = saved_blocks(
                        &moments,
                        &tensors,
                        &key,
                        meta.moments,
                        meta.block_size,
                        signed,
                        var.elem_count(),
                    )?;
                    let same = Moment::codec_for(&choice, var.elem_count()) == Some(saved.codec)
                        && choice.block_size == saved.block;
                    if same {
                        *slot = Moment::Blocks(saved);
                    } else {
                        let t = Tensor::from_vec(
                            saved.to_f32(),
                            var.as_tensor().shape(),
                            &Device::Cpu,
                        )?;
                        slot.set(var, &choice, signed, &t)?;
                    }
                    continue;
                }
                let t = tensors.get(&key).ok_or_else(|| {
                    candle_core::Error::Msg(format!("{}: no `{key}`", dir.display()))
                })?;
                if t.dims() != var.as_tensor().dims() {
                    return Err(candle_core::Error::Msg(format!(
                        "{}: `{key}` has shape {:?}, the parameter {:?}",
                        dir.display(),
                        t.dims(),
                        var.as_tensor().dims()
                    )));
                }
                check_moment(&moments, &key, t, !signed)?;
                slot.set(var, &choice, signed, t)?;
            }
        }
        self.step = meta.step;
        Ok(())
    }
}

/// A saved block-quantised moment (`<key>.codes`, `<key>.scale`) of a parameter of `n` values,
/// checked against the format `optim.json` names: the lengths its blocks imply, finite
/// non-negative scales, and no NaN code (FP8).
fn saved_blocks(
    file: &Path,
    tensors: &HashMap<String, Tensor>,
    key: &str,
    format: MomentFormat,
    block: usize,
    signed: bool,
    n: usize,
) -> candle_core::Result<BlockMoment> {
    let err = |m: String| candle_core::Error::Msg(format!("{}: {m}", file.display()));
    let Some(c) = codec(format) else {
        return Err(err(format!(
            "`{key}.codes` is saved, but optim.json says the moments are f32"
        )));
    };
    if block == 0 || !n.is_multiple_of(block) || (c == Codec::Map4 && block % 2 == 1) {
        return Err(err(format!(
            "optim.json's block_size {block} does not divide `{key}`'s {n} values into whole blocks"
        )));
    }
    let scale_t = tensors
        .get(&format!("{key}.scale"))
        .ok_or_else(|| err(format!("`{key}.codes` without `{key}.scale`")))?;
    let codes: Vec<u8> = tensors[&format!("{key}.codes")]
        .to_dtype(DType::U8)?
        .flatten_all()?
        .to_vec1()?;
    let scale: Vec<f32> = scale_t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let (want_codes, want_scales) = (BlockMoment::code_bytes(c, n), n / block);
    if codes.len() != want_codes || scale.len() != want_scales {
        return Err(err(format!(
            "`{key}` holds {} code bytes and {} scales; {n} values in {block}-value {format:?} blocks need {want_codes} and {want_scales}",
            codes.len(),
            scale.len(),
        )));
    }
    if let Some(bad) = scale.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
        return Err(err(format!(
            "`{key}.scale` holds {bad}: a block's scale is a finite maximum magnitude"
        )));
    }
    if c == Codec::Fp8 && codes.iter().any(|&x| x & 0x7f == 0x7f) {
        return Err(err(format!("`{key}.codes` holds an FP8 NaN code")));
    }
    Ok(BlockMoment {
        codec: c,
        signed,
        block,
        codes,
        scale,
    })
}

/// Refuses a saved moment that would make every later update NaN: a NaN or infinite value
/// (named with [`crate::weights::check_finite`]), or a negative second moment (`v` is a mean of
/// squares; its square root would be NaN).
fn check_moment(file: &Path, key: &str, t: &Tensor, second: bool) -> candle_core::Result<()> {
    crate::weights::check_finite(file, key, t)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    if second && t.elem_count() > 0 {
        let low = t
            .to_dtype(DType::F32)?
            .flatten_all()?
            .min(0)?
            .to_scalar::<f32>()?;
        if low < 0.0 {
            return Err(candle_core::Error::Msg(format!(
                "{}: `{key}` holds a negative value ({low}): a second moment is a mean of squares and never negative",
                file.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn cfg() -> OptimConfig {
        OptimConfig {
            lr: 0.1,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
            ..OptimConfig::default()
        }
    }

    /// PyTorch's AdamW written out for one scalar parameter, in f64.
    fn reference(p0: f64, grads: &[f64], lr: f64, wd: f64) -> f64 {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            p *= 1.0 - lr * wd;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let denom = v.sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            p -= lr / (1.0 - b1.powi(t)) * m / denom;
        }
        p
    }

    /// Loss Σ c·p² so the gradient is 2·c·p; returns the grads.
    fn grads_of(var: &Var, c: &Tensor) -> GradStore {
        (var.as_tensor().sqr().unwrap() * c)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
    }

    #[test]
    fn adamw_matches_the_pytorch_update() {
        let init = [1.5f32, -0.3, 0.0, 2.0];
        let var = Var::from_tensor(&Tensor::new(&init, &Device::Cpu).unwrap()).unwrap();
        let c = Tensor::new(&[1.0f32, 3.0, 0.5, -2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(HashMap::from([("w".to_string(), var.clone())]), &cfg()).unwrap();
        let mut history: Vec<Vec<f64>> = vec![Vec::new(); 4];
        for _ in 0..5 {
            let p: Vec<f32> = var.as_tensor().to_vec1().unwrap();
            let cs: Vec<f32> = c.to_vec1().unwrap();
            for k in 0..4 {
                history[k].push(2.0 * cs[k] as f64 * p[k] as f64);
            }
            opt.step(&grads_of(&var, &c), 0.1).unwrap();
        }
        let got: Vec<f32> = var.as_tensor().to_vec1().unwrap();
        for k in 0..4 {
            let want = reference(init[k] as f64, &history[k], 0.1, 0.01);
            assert!(
                (got[k] as f64 - want).abs() < 1e-5,
                "param {k}: {} vs {want}",
                got[k]
            );
        }
        assert_eq!(opt.step, 5);
    }

    /// torch.optim.Adam (`weight_decay` added to the gradient, no decay of the weights) written
    /// out in f64 for one scalar parameter.
    fn adam_reference(p0: f64, grads: &[f64], lr: f64, wd: f64) -> f64 {
        let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8);
        let (mut p, mut m, mut v) = (p0, 0.0, 0.0);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            let g = g + wd * p;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let denom = v.sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            p -= lr / (1.0 - b1.powi(t)) * m / denom;
        }
        p
    }

    /// `optimizer=Adam` follows torch.optim.Adam (coupled weight decay) and differs from AdamW
    /// with a large weight decay, in place on an f32 parameter and through the host copy of an
    /// f64 one.
    #[test]
    fn adam_matches_the_pytorch_update() {
        let init = [1.5f64, -0.3, 0.0, 2.0];
        let cs = [1.0f64, 3.0, 0.5, -2.0];
        let adam = OptimConfig {
            optimizer: "Adam".into(),
            weight_decay: 0.5,
            ..cfg()
        };
        for dtype in [DType::F32, DType::F64] {
            let t = Tensor::new(&init, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let var = Var::from_tensor(&t).unwrap();
            let c = Tensor::new(&cs, &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let mut opt =
                AdamW::new(HashMap::from([("w".to_string(), var.clone())]), &adam).unwrap();
            let values = |v: &Var| -> Vec<f64> {
                v.as_tensor()
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            let mut history: Vec<Vec<f64>> = vec![Vec::new(); 4];
            for _ in 0..5 {
                let p = values(&var);
                for k in 0..4 {
                    history[k].push(2.0 * cs[k] * p[k]);
                }
                opt.step(&grads_of(&var, &c), 0.1).unwrap();
            }
            let got = values(&var);
            for k in 0..4 {
                let want = adam_reference(init[k], &history[k], 0.1, 0.5);
                let adamw = reference(init[k], &history[k], 0.1, 0.5);
                assert!(
                    (got[k] - want).abs() < 1e-5,
                    "{dtype:?} param {k}: {} vs {want}",
                    got[k]
                );
                if init[k] != 0.0 {
                    assert!(
                        (want - adamw).abs() > 1e-4,
                        "param {k}: Adam and AdamW agree"
                    );
                }
            }
        }
    }

    /// The in-place path (f32 on the CPU) and the host-copy path (any other dtype) apply the
    /// same rule: an f64 parameter and an f32 one with the same start and gradients end equal
    /// to f32 precision, both against the scalar reference above; and the in-place update is
    /// seen through a view that shares the parameter's storage (the actor's no-grad view).
    #[test]
    fn in_place_and_host_paths_agree() {
        let init = [0.7f64, -1.2, 0.05, 3.0, -0.4];
        let cs = [2.0f64, -1.0, 4.0, 0.25, 1.5];
        let dev = Device::Cpu;
        let v32 = Var::from_tensor(
            &Tensor::new(&init, &dev)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap(),
        )
        .unwrap();
        let v64 = Var::from_tensor(&Tensor::new(&init, &dev).unwrap()).unwrap();
        let view = v32.as_tensor().detach();
        let c32 = Tensor::new(&cs, &dev)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let c64 = Tensor::new(&cs, &dev).unwrap();
        let mut o32 = AdamW::new(HashMap::from([("w".to_string(), v32.clone())]), &cfg()).unwrap();
        let mut o64 = AdamW::new(HashMap::from([("w".to_string(), v64.clone())]), &cfg()).unwrap();
        let mut history: Vec<Vec<f64>> = vec![Vec::new(); init.len()];
        for _ in 0..4 {
            let p: Vec<f64> = v64.as_tensor().to_vec1().unwrap();
            for k in 0..init.len() {
                history[k].push(2.0 * cs[k] * p[k]);
            }
            o32.step(&grads_of(&v32, &c32), 0.05).unwrap();
            o64.step(&grads_of(&v64, &c64), 0.05).unwrap();
        }
        let a: Vec<f32> = v32.as_tensor().to_vec1().unwrap();
        let b: Vec<f64> = v64.as_tensor().to_vec1().unwrap();
        let seen: Vec<f32> = view.to_vec1().unwrap();
        for k in 0..init.len() {
            let want = reference(init[k], &history[k], 0.05, 0.01);
            assert!(
                (a[k] as f64 - want).abs() < 1e-5,
                "f32 param {k}: {} vs {want}",
                a[k]
            );
            assert!(
                (b[k] - want).abs() < 1e-5,
                "f64 param {k}: {} vs {want}",
                b[k]
            );
            assert_eq!(
                seen[k], a[k],
                "the shared-storage view missed the update at {k}"
            );
        }
    }

    #[test]
    fn saved_state_resumes_identically() {
        let c = Tensor::new(&[1.0f32, -1.0, 0.25], &Device::Cpu).unwrap();
        let make =
            || Var::from_tensor(&Tensor::new(&[0.5f32, 1.0, -2.0], &Device::Cpu).unwrap()).unwrap();
        let straight = make();
        let mut a =
            AdamW::new(HashMap::from([("p".to_string(), straight.clone())]), &cfg()).unwrap();
        for _ in 0..4 {
            a.step(&grads_of(&straight, &c), 0.05).unwrap();
        }
        let resumed = make();
        let mut b =
            AdamW::new(HashMap::from([("p".to_string(), resumed.clone())]), &cfg()).unwrap();
        for _ in 0..2 {
            b.step(&grads_of(&resumed, &c), 0.05).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        b.save(dir.path()).unwrap();
        let mut c2 =
            AdamW::new(HashMap::from([("p".to_string(), resumed.clone())]), &cfg()).unwrap();
        c2.load(dir.path()).unwrap();
        for _ in 0..2 {
            c2.step(&grads_of(&resumed, &c), 0.05).unwrap();
        }
        let x: Vec<f32> = straight.as_tensor().to_vec1().unwrap();
        let y: Vec<f32> = resumed.as_tensor().to_vec1().unwrap();
        assert_eq!(x, y, "bit-identical after save, load and two more steps");
    }

    #[test]
    fn a_truncated_or_garbled_optimizer_file_is_named() {
        let var = Var::from_tensor(&Tensor::new(&[0.5f32, 1.0], &Device::Cpu).unwrap()).unwrap();
        let make = || AdamW::new(HashMap::from([("p".to_string(), var.clone())]), &cfg()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        make().save(dir.path()).unwrap();
        let moments = dir.path().join("optim.safetensors");
        let full = std::fs::read(&moments).unwrap();
        std::fs::write(&moments, &full[..full.len() / 2]).unwrap();
        let e = make().load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("optim.safetensors"), "{e}");
        std::fs::write(&moments, &full).unwrap();
        std::fs::write(dir.path().join("optim.json"), "{\"step\": ").unwrap();
        let e = make().load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("optim.json"), "{e}");
        std::fs::remove_file(dir.path().join("optim.json")).unwrap();
        let e = make().load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("optim.json"), "{e}");
    }

    /// A moment that is NaN or infinite (or a negative second moment, whose square root is
    /// NaN) would turn every later update into NaN: it is refused on load, naming the file and
    /// the key.
    #[test]
    fn a_non_finite_moment_is_refused_naming_the_file_and_key() {
        let var =
            Var::from_tensor(&Tensor::new(&[0.5f32, 1.0, -2.0], &Device::Cpu).unwrap()).unwrap();
        let c = Tensor::new(&[1.0f32, -1.0, 0.25], &Device::Cpu).unwrap();
        let make = || AdamW::new(HashMap::from([("p".to_string(), var.clone())]), &cfg()).unwrap();
        let mut a = make();
        a.step(&grads_of(&var, &c), 0.05).unwrap();
        let dir = tempfile::tempdir().unwrap();
        a.save(dir.path()).unwrap();
        let moments = dir.path().join("optim.safetensors");
        let full = std::fs::read(&moments).unwrap();
        for (key, at, value, says) in [
            ("m.p", 1, f32::NAN, "index 1"),
            ("v.p", 2, f32::INFINITY, "index 2"),
            ("v.p", 0, -1.0, "negative"),
        ] {
            std::fs::write(&moments, &full).unwrap();
            let mut tensors = candle_core::safetensors::load(&moments, &Device::Cpu).unwrap();
            let mut v: Vec<f32> = tensors[key].to_vec1().unwrap();
            v[at] = value;
            tensors.insert(key.into(), Tensor::new(v.as_slice(), &Device::Cpu).unwrap());
            candle_core::safetensors::save(&tensors, &moments).unwrap();
            let e = make().load(dir.path()).unwrap_err().to_string();
            assert!(
                e.contains("optim.safetensors")
                    && e.contains(&format!("`{key}`"))
                    && e.contains(says),
                "{key}[{at}] = {value}: {e}"
            );
        }
    }

    #[test]
    fn gradient_clipping() {
        let var = Var::from_tensor(&Tensor::new(&[3.0f32, 4.0], &Device::Cpu).unwrap()).unwrap();
        let vars = vec![("p".to_string(), var.clone())];
        // Loss Σ p²/2: gradient = p = (3, 4), norm 5.
        let grads = || {
            (var.as_tensor().sqr().unwrap() * 0.5)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
        };
        let mut g = grads();
        let norm = clip_grad_norm(&vars, &mut g, 1.0).unwrap();
        assert!((norm - 5.0).abs() < 1e-6, "the norm before clipping");
        let clipped: Vec<f32> = g.get(var.as_tensor()).unwrap().to_vec1().unwrap();
        assert!((clipped[0] - 0.6).abs() < 1e-5 && (clipped[1] - 0.8).abs() < 1e-5);
        let mut g = grads();
        clip_grad_norm(&vars, &mut g, 10.0).unwrap();
        assert_eq!(
            g.get(var.as_tensor()).unwrap().to_vec1::<f32>().unwrap(),
            vec![3.0, 4.0],
            "under the limit: unchanged"
        );
    }

    /// `Σ x²` through candle's tensor ops in f64: the reference route.
    fn f64_sum_of_squares(t: &Tensor) -> f64 {
        t.to_dtype(DType::F64)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    }

    /// The in-place sum of squares gives the tensor composition's bits (f64, summed in order),
    /// on a contiguous gradient and on a transposed one (which takes the tensor route).
    #[test]
    fn grad_norm_reads_f32_gradients_in_place() {
        let vals: Vec<f32> = (0..70_001u32)
            .map(|i| ((i.wrapping_mul(2654435761) % 20001) as f32 / 10000.0 - 1.0) * 3.0)
            .collect();
        let as_tensor = f64_sum_of_squares(&Tensor::new(vals.as_slice(), &Device::Cpu).unwrap());
        assert_eq!(sum_of_squares_f32(&vals).to_bits(), as_tensor.to_bits());
        let flat = Tensor::from_vec(vals[..70_000].to_vec(), (700, 100), &Device::Cpu).unwrap();
        let a = Var::from_tensor(&flat).unwrap();
        let b = Var::from_tensor(&flat.t().unwrap().contiguous().unwrap()).unwrap();
        // Loss Σ a²/2 + Σ (bᵀ)²/2: gradients a (contiguous) and b.
        let loss = ((a.as_tensor().sqr().unwrap().sum_all().unwrap()
            + b.as_tensor().t().unwrap().sqr().unwrap().sum_all().unwrap())
        .unwrap()
            * 0.5)
            .unwrap();
        let grads = loss.backward().unwrap();
        let vars = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let reference: f64 = [a.as_tensor(), b.as_tensor()]
            .iter()
            .map(|t| f64_sum_of_squares(grads.get(t).unwrap()))
            .sum::<f64>()
            .sqrt();
        let norm = grad_norm(&vars, &grads).unwrap();
        assert_eq!(norm.to_bits(), reference.to_bits(), "{norm} vs {reference}");
        assert!(
            (norm - reference).abs() <= 1e-12 * reference,
            "{norm} vs {reference}"
        );
    }

    /// Clipping inside the step equals clipping the gradients first, bit for bit.
    #[test]
    fn scaled_step_equals_the_step_on_scaled_gradients() {
        let init: Vec<f32> = (0..257).map(|i| (i as f32 * 0.37).sin()).collect();
        let c = Tensor::from_vec(
            (0..257)
                .map(|i| (i as f32 * 0.11).cos() * 4.0)
                .collect::<Vec<f32>>(),
            257,
            &Device::Cpu,
        )
        .unwrap();
        let make =
            || Var::from_tensor(&Tensor::new(init.as_slice(), &Device::Cpu).unwrap()).unwrap();
        let (x, y) = (make(), make());
        let mut ox = AdamW::new(HashMap::from([("w".to_string(), x.clone())]), &cfg()).unwrap();
        let mut oy = AdamW::new(HashMap::from([("w".to_string(), y.clone())]), &cfg()).unwrap();
        for _ in 0..3 {
            let mut gx = grads_of(&x, &c);
            let vx = vec![("w".to_string(), x.clone())];
            let norm = clip_grad_norm(&vx, &mut gx, 1.0).unwrap();
            ox.step(&gx, 0.05).unwrap();
            let gy = grads_of(&y, &c);
            let vy = vec![("w".to_string(), y.clone())];
            let coef = clip_coef(grad_norm(&vy, &gy).unwrap(), 1.0);
            assert!(coef < 1.0 && norm > 1.0, "the case clips");
            oy.step_scaled(&gy, 0.05, coef).unwrap();
            let (px, py): (Vec<f32>, Vec<f32>) = (
                x.as_tensor().to_vec1().unwrap(),
                y.as_tensor().to_vec1().unwrap(),
            );
            assert_eq!(
                px.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                py.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn schedules() {
        let o = OptimConfig {
            lr: 1.0,
            lr_warmup_steps: Some(4),
            ..OptimConfig::default()
        };
        let s = LrSchedule::new(&o, 100);
        // Hand values: linear warm-up 0, 1/4, 2/4, 3/4, then constant.
        assert_eq!(
            [s.lr(0), s.lr(1), s.lr(2), s.lr(3), s.lr(4), s.lr(99)],
            [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
        );
        let o = OptimConfig {
            lr: 1.0,
            lr_warmup_steps_ratio: 0.1,
            lr_scheduler_type: LrSchedulerType::Cosine,
            min_lr_ratio: 0.2,
            ..OptimConfig::default()
        };
        let s = LrSchedule::new(&o, 110);
        assert_eq!(s.warmup_steps, 11);
        // Cosine over the 99 steps after warm-up: start 1, middle (1+0.2)/2 = 0.6, end 0.2.
        assert!((s.lr(11) - 1.0).abs() < 1e-12);
        assert!((s.lr(11 + 99 / 2) - 0.6).abs() < 0.02);
        assert!((s.lr(110) - 0.2).abs() < 1e-12);
        // zero_indexed_step=false (verl's cosine schedule counting from 1): every rate is the
        // next step's; the constant schedule has no such switch in verl.
        let one = LrSchedule::new(
            &OptimConfig {
                zero_indexed_step: false,
                ..o.clone()
            },
            110,
        );
        for t in [0, 5, 11, 60, 109] {
            assert_eq!(one.lr(t), s.lr(t + 1), "step {t}");
        }
        assert_eq!(one.lr(0), 1.0 / 11.0);
        let constant = LrSchedule::new(
            &OptimConfig {
                lr: 1.0,
                lr_warmup_steps: Some(4),
                zero_indexed_step: false,
                ..OptimConfig::default()
            },
            100,
        );
        assert_eq!(constant.lr(0), 0.0);
        // The deprecated warmup_style wins.
        let o = OptimConfig {
            lr_scheduler_type: LrSchedulerType::Constant,
            warmup_style: Some(LrSchedulerType::Cosine),
            ..OptimConfig::default()
        };
        assert_eq!(LrSchedule::new(&o, 10).kind, LrSchedulerType::Cosine);
    }

    /// verl's `fsdp_workers`: `num_warmup_steps = lr_warmup_steps`, and only when that is
    /// negative `int(lr_warmup_steps_ratio × total)`. So 0 is "no warm-up" even with a ratio.
    #[test]
    fn zero_warmup_steps_means_none_and_negative_means_the_ratio() {
        let sched = |yaml: &str| {
            let o: OptimConfig = serde_yaml_ng::from_str(yaml).unwrap();
            LrSchedule::new(&o, 100)
        };
        let s = sched("{lr: 1.0, lr_warmup_steps: 0, lr_warmup_steps_ratio: 0.1}");
        assert_eq!(s.warmup_steps, 0);
        assert_eq!(s.lr(0), 1.0, "the first update runs at the full rate");
        for minus in ["-1", "-5", "null"] {
            let s = sched(&format!(
                "{{lr: 1.0, lr_warmup_steps: {minus}, lr_warmup_steps_ratio: 0.1}}"
            ));
            assert_eq!(s.warmup_steps, 10, "{minus}: int(0.1 × 100)");
        }
        let s = sched("{lr: 1.0, lr_warmup_steps: 3, lr_warmup_steps_ratio: 0.1}");
        assert_eq!(s.warmup_steps, 3);
        // Written back in verl's spelling.
        let o: OptimConfig = serde_yaml_ng::from_str("{lr_warmup_steps: -1}").unwrap();
        assert!(serde_yaml_ng::to_string(&o)
            .unwrap()
            .contains("lr_warmup_steps: -1"));
    }
}
