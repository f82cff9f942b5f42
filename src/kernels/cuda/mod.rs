//! The project's own CUDA kernels (cargo feature `cuda`), beside the CPU ones of this folder:
//! token sampling per row ([`sample_rows`]), AdamW and gradient accumulation in place
//! ([`adamw_in_place`], [`add_in_place`]), and the device memory pool's statistics
//! ([`memory`]). The `.cu` sources are compiled to PTX by `build.rs` and loaded once per device.
//! Each is tested against its CPU counterpart on a GPU (`model::cuda_tests`).

use candle_core::cuda::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Layout, Result, Storage, Tensor};

use super::adamw::AdamWRule;

const SAMPLING: &str = include_str!(concat!(env!("OUT_DIR"), "/sampling.ptx"));
const OPTIM: &str = include_str!(concat!(env!("OUT_DIR"), "/optim.ptx"));

/// The CUDA device of `t`, or an error naming `what`.
fn cuda_device(t: &Tensor, what: &str) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        d => candle_core::bail!("{what}: a CUDA tensor was expected, got one on {d:?}"),
    }
}

/// Runs `f` on the f32 device slice of a contiguous CUDA tensor (from its first element).
fn with_f32<R>(
    t: &Tensor,
    what: &str,
    f: impl FnOnce(&CudaSlice<f32>, usize) -> Result<R>,
) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(c) = &*s else {
        candle_core::bail!("{what}: a CUDA tensor was expected");
    };
    if !l.is_contiguous() {
        candle_core::bail!("{what}: the tensor must be contiguous");
    }
    f(c.as_cuda_slice::<f32>()?, l.start_offset())
}

/// Grid for an element-wise kernel over `n` values (grid-stride loops inside).
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 32);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A tensor holding a copy of CUDA storage viewed through `l` (what a custom op's `cuda_fwd`
/// receives), contiguous and outside any autograd graph.
pub fn tensor_of(s: &CudaStorage, l: &Layout) -> Result<Tensor> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    // SAFETY: every element is written by the copy below.
    let mut dst = unsafe { s.device().alloc_uninit(l.shape(), s.dtype())? };
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok(Tensor::from_storage(
        Storage::Cuda(dst),
        l.shape().clone(),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// A contiguous copy of the CUDA tensor `t`'s values as storage (a custom op's result).
pub fn storage_of(t: &Tensor) -> Result<CudaStorage> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    let (s, l) = t.storage_and_layout();
    let Storage::Cuda(c) = &*s else {
        candle_core::bail!("storage_of: a CUDA tensor was expected");
    };
    // SAFETY: every element is written by the copy below.
    let mut dst = unsafe { c.device().alloc_uninit(l.shape(), c.dtype())? };
    c.copy_strided_src(&mut dst, 0, l)?;
    Ok(dst)
}

/// A zero scalar of `dtype` on `s`'s device.
pub fn zero_scalar(s: &CudaStorage, dtype: DType) -> Result<CudaStorage> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    s.device().zeros_impl(&candle_core::Shape::from(()), dtype)
}

/// How each row chooses its token (the CPU's `rollout::sample_row` rule).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    /// Largest logit, lowest index among equals; the log-prob at temperature 1.
    pub greedy: bool,
    pub temperature: f32,
    /// Keep the k most likely (0 = all).
    pub top_k: u32,
    /// Keep the smallest most-likely set reaching this probability (>= 1 = all).
    pub top_p: f64,
}

/// Samples one token per row of `logits` `[rows, vocab]` (f32, on a CUDA device) with `u[row]`,
/// a uniform in [0, 1) from the row's own random stream (unused when greedy). Returns each row's
/// token and its log-probability under `softmax(logits / temperature)` over the whole
/// vocabulary; only these `rows × 8` bytes are copied to the host.
pub fn sample_rows(logits: &Tensor, s: RowSampling, u: &[f64]) -> Result<(Vec<u32>, Vec<f32>)> {
    let dev = cuda_device(logits, "sample_rows")?;
    let (rows, vocab) = logits.dims2()?;
    if rows == 0 {
        return Ok((Vec::new(), Vec::new()));
    }
    if u.len() != rows {
        candle_core::bail!("sample_rows: {} uniforms for {rows} rows", u.len());
    }
    if logits.dtype() != DType::F32 {
        candle_core::bail!("sample_rows: f32 logits expected, got {:?}", logits.dtype());
    }
    if vocab >= u32::MAX as usize {
        candle_core::bail!("sample_rows: a vocabulary of {vocab} does not fit 32-bit ids");
    }
    let logits = logits.contiguous()?;
    let func = dev.get_or_load_custom_func("sample_rows", "main_ppo_sampling", SAMPLING)?;
    let u_dev = dev.clone_htod(u)?;
    let mut tokens = dev.alloc_zeros::<u32>(rows)?;
    let mut lps = dev.alloc_zeros::<f32>(rows)?;
    with_f32(&logits, "sample_rows", |src, off| {
        let src = src.slice(off..);
        let (ld, vocab32) = (vocab as u64, vocab as u32);
        let greedy = i32::from(s.greedy);
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&ld);
        b.arg(&vocab32);
        b.arg(&s.temperature);
        b.arg(&greedy);
        b.arg(&s.top_k);
        b.arg(&s.top_p);
        b.arg(&u_dev);
        b.arg(&mut tokens);
        b.arg(&mut lps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads rows × vocab f32 logits from `src` and rows uniforms, and
        // writes rows tokens and log-probs, all allocated above with those sizes.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    })?;
    Ok((dev.clone_dtoh(&tokens)?, dev.clone_dtoh(&lps)?))
}

/// AdamW's update ([`AdamWRule`]) of the f32 parameter `p` in place on its device, with its
/// moments `m`, `v` (f32 tensors of `p`'s shape, on the device, updated in place, owned by the
/// optimizer alone) and the gradient `g`. One kernel; the same bits as the CPU rule.
pub fn adamw_in_place(
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    rule: AdamWRule,
) -> Result<()> {
    if rule.l2 != 0.0 {
        candle_core::bail!("adamw-cuda: the kernel is AdamW's; Adam's L2 term runs on the host");
    }
    struct Op<'a> {
        m: &'a Tensor,
        v: &'a Tensor,
        g: &'a Tensor,
        rule: AdamWRule,
    }
    impl candle_core::InplaceOp1 for Op<'_> {
        fn name(&self) -> &'static str {
            "adamw-cuda"
        }
        fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("adamw-cuda: the parameter is on the CPU (kernels::adamw serves it)")
        }
        fn cuda_fwd(&self, p: &mut CudaStorage, l: &Layout) -> Result<()> {
            let n = l.shape().elem_count();
            if !l.is_contiguous() {
                candle_core::bail!("adamw-cuda: the parameter must be contiguous");
            }
            for (t, what) in [(self.m, "m"), (self.v, "v"), (self.g, "gradient")] {
                if t.elem_count() != n || t.dtype() != DType::F32 {
                    candle_core::bail!(
                        "adamw-cuda: {what} has {} {:?} values for {n} f32 parameters",
                        t.elem_count(),
                        t.dtype()
                    );
                }
            }
            let dev = p.device.clone();
            let func = dev.get_or_load_custom_func("adamw_f32", "main_ppo_optim", OPTIM)?;
            let off = l.start_offset();
            let ps = p.as_cuda_slice_mut::<f32>()?;
            let mut pv = ps.slice_mut(off..off + n);
            with_f32(self.m, "adamw-cuda m", |m, mo| {
                with_f32(self.v, "adamw-cuda v", |v, vo| {
                    with_f32(self.g, "adamw-cuda gradient", |g, go| {
                        let (m, v, g) = (m.slice(mo..), v.slice(vo..), g.slice(go..));
                        let r = self.rule;
                        let n64 = n as u64;
                        let consts = [
                            r.b1,
                            r.b2,
                            r.eps,
                            r.step_size,
                            r.sqrt_bc2,
                            r.decay,
                            r.grad_scale,
                        ];
                        let mut b = func.builder();
                        b.arg(&mut pv);
                        // The moments are written through their views: the optimizer owns them.
                        b.arg(&m);
                        b.arg(&v);
                        b.arg(&g);
                        b.arg(&n64);
                        for c in &consts {
                            b.arg(c);
                        }
                        // SAFETY: p, m, v and g each hold n f32 values (checked above).
                        unsafe { b.launch(elementwise(n)) }.w()?;
                        Ok(())
                    })
                })
            })
        }
    }
    for t in [m, v] {
        if !t.is_contiguous() {
            candle_core::bail!("adamw-cuda: the moments must be contiguous");
        }
    }
    let g = g.to_dtype(DType::F32)?.contiguous()?;
    p.inplace_op1(&Op { m, v, g: &g, rule })
}

/// `acc += t` in `acc`'s own device storage when both are contiguous f32 CUDA tensors of one
/// shape (gradient accumulation without a new tensor per micro-batch); `false` (nothing done)
/// otherwise. The caller guarantees that no other tensor shares `acc`'s storage.
pub fn add_in_place(acc: &Tensor, t: &Tensor) -> Result<bool> {
    struct Op<'a>(&'a Tensor);
    impl candle_core::InplaceOp1 for Op<'_> {
        fn name(&self) -> &'static str {
            "grad-accumulate-cuda"
        }
        fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
            candle_core::bail!("grad-accumulate-cuda: CPU tensors go through kernels::storage")
        }
        fn cuda_fwd(&self, a: &mut CudaStorage, l: &Layout) -> Result<()> {
            let n = l.shape().elem_count();
            let dev = a.device.clone();
            let func = dev.get_or_load_custom_func("add_assign_f32", "main_ppo_optim", OPTIM)?;
            let off = l.start_offset();
            let s = a.as_cuda_slice_mut::<f32>()?;
            let mut av = s.slice_mut(off..off + n);
            with_f32(self.0, "grad-accumulate-cuda", |g, go| {
                let g = g.slice(go..go + n);
                let n64 = n as u64;
                let mut b = func.builder();
                b.arg(&mut av);
                b.arg(&g);
                b.arg(&n64);
                // SAFETY: both hold n f32 values (checked by the caller).
                unsafe { b.launch(elementwise(n)) }.w()?;
                Ok(())
            })
        }
    }
    let fits = acc.device().is_cuda()
        && t.device().same_device(acc.device())
        && acc.dtype() == DType::F32
        && t.dtype() == DType::F32
        && acc.shape() == t.shape()
        && acc.is_contiguous()
        && t.is_contiguous();
    if fits {
        acc.inplace_op1(&Op(t))?;
    }
    Ok(fits)
}

/// The device's stream-ordered memory pool, where candle allocates every CUDA tensor: peak
/// statistics in PyTorch's sense (`max_memory_allocated`: bytes in tensors at the fullest;
/// `max_memory_reserved`: bytes the pool held from the driver at the fullest).
pub mod memory {
    use candle_core::cuda::cudarc::driver::{result, sys};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, Result};

    fn pool(dev: &CudaDevice) -> Result<sys::CUmemoryPool> {
        let stream = dev.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().w()?;
        // SAFETY: the device handle comes from a live context.
        unsafe { result::device::get_mem_pool(ctx.cu_device()) }.w()
    }

    fn get(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: these attributes are 64-bit values (cuuint64_t).
        unsafe { result::mem_pool::get_attribute(pool, attr, (&mut v as *mut u64).cast()) }.w()?;
        Ok(v)
    }

    fn set(pool: sys::CUmemoryPool, attr: sys::CUmemPool_attribute, mut v: u64) -> Result<()> {
        // SAFETY: as in `get`.
        unsafe { result::mem_pool::set_attribute(pool, attr, (&mut v as *mut u64).cast()) }.w()
    }

    /// Keeps freed memory in the pool instead of returning it to the driver at every
    /// synchronisation (the pool's default threshold is 0), as PyTorch's caching allocator
    /// does: the trainer frees and reallocates gigabytes per step.
    pub fn keep_freed_memory(dev: &CudaDevice) -> Result<()> {
        set(
            pool(dev)?,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            u64::MAX,
        )
    }

    /// (peak bytes in use, peak bytes reserved) since the last [`reset_peaks`].
    pub fn peaks(dev: &CudaDevice) -> Result<(u64, u64)> {
        let p = pool(dev)?;
        Ok((
            get(p, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            get(
                p,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            )?,
        ))
    }

    /// (bytes in use, bytes reserved) now.
    pub fn current(dev: &CudaDevice) -> Result<(u64, u64)> {
        let p = pool(dev)?;
        Ok((
            get(
                p,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            )?,
            get(
                p,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            )?,
        ))
    }

    /// Starts the peaks again from the current use (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peaks(dev: &CudaDevice) -> Result<()> {
        let p = pool(dev)?;
        set(
            p,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        )?;
        set(
            p,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            0,
        )
    }

    /// (free, total) bytes of the device as the driver reports them.
    pub fn device_info(dev: &CudaDevice) -> Result<(usize, usize)> {
        dev.cuda_stream().context().bind_to_thread().w()?;
        result::mem_get_info().w()
    }
}
