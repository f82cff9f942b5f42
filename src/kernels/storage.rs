//! CPU storage seen as host slices, for custom ops and in-place updates: copies between a
//! storage and a tensor ([`tensor_of`], [`storage_of`]), the f32 operands of an in-place op
//! ([`f32_operands`], shared by AdamW and gradient accumulation), and `acc += t` in place
//! ([`add_in_place`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Tensor};

/// A tensor holding a copy of CPU storage viewed through `l`.
pub fn tensor_of(s: &CpuStorage, l: &Layout) -> Result<Tensor> {
    let Some((a, b)) = l.contiguous_offsets() else {
        candle_core::bail!("tensor_of: the storage must be viewed contiguously");
    };
    let dev = Device::Cpu;
    match s {
        CpuStorage::F32(v) => Tensor::from_slice(&v[a..b], l.shape(), &dev),
        CpuStorage::F64(v) => Tensor::from_slice(&v[a..b], l.shape(), &dev),
        CpuStorage::BF16(v) => Tensor::from_slice(&v[a..b], l.shape(), &dev),
        CpuStorage::F16(v) => Tensor::from_slice(&v[a..b], l.shape(), &dev),
        _ => candle_core::bail!("tensor_of: unsupported dtype {:?}", s.dtype()),
    }
}

/// A copy of `t`'s values as CPU storage of its dtype (the result of a custom op's `cpu_fwd`).
pub fn storage_of(t: &Tensor) -> Result<CpuStorage> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => CpuStorage::F32(t.to_vec1()?),
        DType::F64 => CpuStorage::F64(t.to_vec1()?),
        DType::BF16 => CpuStorage::BF16(t.to_vec1()?),
        DType::F16 => CpuStorage::F16(t.to_vec1()?),
        d => candle_core::bail!("storage_of: unsupported dtype {d:?}"),
    })
}

/// The two operands of an in-place op on CPU f32 storage, as the slices their layouts view;
/// an error naming `op` when either is not f32 or not contiguous.
pub fn f32_operands<'a>(
    op: &str,
    s1: &'a mut candle_core::CpuStorage,
    l1: &candle_core::Layout,
    s2: &'a candle_core::CpuStorage,
    l2: &candle_core::Layout,
) -> candle_core::Result<(&'a mut [f32], &'a [f32])> {
    use candle_core::CpuStorage::F32;
    let (F32(a), F32(b)) = (s1, s2) else {
        candle_core::bail!("{op}: f32 operands only");
    };
    let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
    else {
        candle_core::bail!("{op}: contiguous operands only");
    };
    Ok((&mut a[a0..a1], &b[b0..b1]))
}

/// `acc += t` in `acc`'s own storage when both are contiguous f32 on the CPU with one shape
/// (the training case: no new gigabyte of gradients per micro-batch), or both on one GPU
/// (`cuda::add_in_place`); `false` (nothing done) otherwise. The caller guarantees that no
/// other tensor shares `acc`'s storage.
pub fn add_in_place(acc: &Tensor, t: &Tensor) -> candle_core::Result<bool> {
    #[cfg(feature = "cuda")]
    if acc.device().is_cuda() {
        return super::cuda::add_in_place(acc, t);
    }
    struct AddAssign;
    impl candle_core::InplaceOp2 for AddAssign {
        fn name(&self) -> &'static str {
            "grad-accumulate"
        }
        fn cpu_fwd(
            &self,
            s1: &mut candle_core::CpuStorage,
            l1: &candle_core::Layout,
            s2: &candle_core::CpuStorage,
            l2: &candle_core::Layout,
        ) -> candle_core::Result<()> {
            let (a, b) = f32_operands("grad-accumulate", s1, l1, s2, l2)?;
            if a.len() != b.len() {
                candle_core::bail!("grad-accumulate: {} and {} values", a.len(), b.len());
            }
            super::simd::par_zip(a, b, |x, y| x + y);
            Ok(())
        }
    }
    let fits = acc.device().is_cpu()
        && t.device().is_cpu()
        && acc.dtype() == candle_core::DType::F32
        && t.dtype() == candle_core::DType::F32
        && acc.shape() == t.shape()
        && acc.is_contiguous()
        && t.is_contiguous();
    if fits {
        acc.inplace_op2(t, &AddAssign)?;
    }
    Ok(fits)
}
