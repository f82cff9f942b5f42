//! CPU storage seen as host slices, for custom ops and in-place updates: copies between a
//! storage and a tensor ([`tensor_of`], [`storage_of`]), the f32 operands of an in-place op
//! ([`f32_operands`], shared by AdamW and gradient accumulation), `acc += t` in place
//! ([`add_in_place`]), and the NaN / infinity scan of tensors read from files ([`non_finite`]).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, Layout, Result, Tensor};

/// Read guards on the storage of CPU tensors, viewed as contiguous host slices of `T` (custom
/// ops' backward passes read their operands in place through it).
pub struct Host<'a>(Vec<(candle_core::StorageRef<'a>, &'a Layout)>);

impl<'a> Host<'a> {
    pub fn new(ts: &[&'a Tensor]) -> Result<Self> {
        Ok(Host(ts.iter().map(|t| t.storage_and_layout()).collect()))
    }

    /// Tensor `i` as a slice; an error unless it is on the CPU, of `T` and contiguous.
    pub fn slice<T: candle_core::WithDType>(&self, i: usize) -> Result<&[T]> {
        let (s, l) = &self.0[i];
        let candle_core::Storage::Cpu(cpu) = &**s else {
            candle_core::bail!("host view: tensors must be on the CPU");
        };
        match l.contiguous_offsets() {
            Some((a, b)) => Ok(&cpu.as_slice::<T>()?[a..b]),
            None => candle_core::bail!("host view: tensors must be contiguous"),
        }
    }
}

/// The slice of CPU storage that layout `l` views, when it views it contiguously (a custom op's
/// `cpu_fwd` operands); an error naming `what` otherwise, or when the storage is not of `T`.
pub fn contiguous<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    what: &str,
) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle_core::bail!("{what} must be contiguous"),
    }
}

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

/// Where a tensor holds NaN or ±infinity: how many such values, the row-major index of the
/// first, and that value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NonFinite {
    pub count: usize,
    pub first: usize,
    pub value: f64,
}

/// The NaN and infinite values of `t`, `None` when there are none (always for integer dtypes).
/// One pass over the values as they lie in host memory, by bit pattern (an exponent of all
/// ones), with no copy of a contiguous CPU tensor (what a safetensors or GGUF read gives); a
/// tensor elsewhere is copied to the host first, a strided one made contiguous.
pub fn non_finite(t: &Tensor) -> Result<Option<NonFinite>> {
    if !t.dtype().is_float() {
        return Ok(None);
    }
    if !t.device().is_cpu() {
        return non_finite(&t.to_device(&Device::Cpu)?);
    }
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let (candle_core::Storage::Cpu(s), Some((a, b))) = (&*storage, layout.contiguous_offsets())
    else {
        candle_core::bail!("non_finite: a contiguous CPU tensor was expected");
    };
    Ok(match s {
        CpuStorage::F32(v) => scan(&v[a..b], |x| x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
            .map(|(count, first)| (count, first, f64::from(v[a + first]))),
        CpuStorage::F64(v) => scan(&v[a..b], |x| {
            x.to_bits() & 0x7ff0_0000_0000_0000 == 0x7ff0_0000_0000_0000
        })
        .map(|(count, first)| (count, first, v[a + first])),
        CpuStorage::BF16(v) => scan(&v[a..b], |x| x.to_bits() & 0x7f80 == 0x7f80)
            .map(|(count, first)| (count, first, v[a + first].to_f64())),
        CpuStorage::F16(v) => scan(&v[a..b], |x| x.to_bits() & 0x7c00 == 0x7c00)
            .map(|(count, first)| (count, first, v[a + first].to_f64())),
        // The 8-bit and smaller float formats: through f32 (rare, small files).
        _ => {
            drop(storage);
            return non_finite(&t.to_dtype(DType::F32)?);
        }
    }
    .map(|(count, first, value)| NonFinite {
        count,
        first,
        value,
    }))
}

/// `(count, first index)` of the elements of `v` that are `bad`. Counted per block without
/// branches (the loop vectorises), blocks on rayon's threads for large tensors; only the first
/// block with a count is searched for the index.
fn scan<T: Copy + Send + Sync>(v: &[T], bad: impl Fn(T) -> bool + Sync) -> Option<(usize, usize)> {
    use rayon::prelude::*;
    const BLOCK: usize = 1 << 14;
    let count = |c: &[T]| c.iter().map(|&x| usize::from(bad(x))).sum::<usize>();
    let counts: Vec<usize> = if v.len() >= 1 << 20 {
        v.par_chunks(BLOCK).map(count).collect()
    } else {
        v.chunks(BLOCK).map(count).collect()
    };
    let block = counts.iter().position(|&c| c > 0)?;
    let at = v[block * BLOCK..].iter().position(|&x| bad(x))?;
    Some((counts.iter().sum(), block * BLOCK + at))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NaN and both infinities are found in every float dtype, in a strided view and off the
    /// first block; finite extremes (the largest value, subnormals) and integers are not.
    #[test]
    fn non_finite_finds_nan_and_infinities_in_every_float_dtype() {
        let n = (1 << 20) + 5;
        let mut v = vec![1.5f64; n];
        v[3] = f64::MIN_POSITIVE / 4.0;
        v[4] = 65504.0; // f16's largest finite value
        v[(1 << 14) + 7] = f64::NEG_INFINITY;
        v[n - 1] = f64::NAN;
        v[n - 2] = f64::INFINITY;
        let t = Tensor::from_vec(v, n, &Device::Cpu).unwrap();
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::F16] {
            let got = non_finite(&t.to_dtype(dtype).unwrap()).unwrap().unwrap();
            assert_eq!((got.count, got.first), (3, (1 << 14) + 7), "{dtype:?}");
            assert!(got.value.is_infinite(), "{dtype:?}");
        }
        let clean =
            Tensor::new(&[[0f32, -2.0], [f32::MAX, f32::MIN_POSITIVE]], &Device::Cpu).unwrap();
        assert_eq!(non_finite(&clean).unwrap(), None);
        let m = Tensor::new(&[[1f32, f32::NAN], [2.0, 3.0]], &Device::Cpu).unwrap();
        let got = non_finite(&m.t().unwrap()).unwrap().unwrap();
        assert_eq!(
            (got.count, got.first),
            (1, 2),
            "row-major index of the view"
        );
        assert!(got.value.is_nan());
        let ints = Tensor::new(&[u32::MAX, 0], &Device::Cpu).unwrap();
        assert_eq!(non_finite(&ints).unwrap(), None);
    }
}
