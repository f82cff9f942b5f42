//! Matrix products on host slices: `gemm`'s kernels (AVX-512 where the CPU has it) with
//! explicit strides, so that callers multiply transposed views without copying them, and the
//! mixed form that hands f32 operands to the bf16 kernels of [`super::bf16`] when asked.

use super::elem::Elem;
use super::simd::Par;

/// `dst[m, n] (+)= a[m, k] · b[k, n]` as [`gemm_strided`], with bf16 operands and f32 sums
/// ([`super::bf16`]) when `bf16` is set, the elements are f32 and the CPU has AMX or AVX512-BF16; otherwise in
/// the element type.
#[allow(clippy::too_many_arguments)]
pub fn gemm_mixed<T: Elem>(
    bf16: bool,
    dst: &mut [T],
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    b_rs: usize,
    b_cs: usize,
    acc: bool,
    par: Par,
) {
    if bf16 && super::bf16::available() {
        if let (Some(a32), Some(b32)) = (T::f32s(a), T::f32s(b)) {
            let d32 = T::f32s_mut(dst).expect("a, b and dst share one element type");
            super::bf16::gemm(d32, m, n, k, a32, a_rs, a_cs, b32, b_rs, b_cs, acc, par);
            return;
        }
    }
    gemm_strided(dst, m, n, k, a, a_rs, a_cs, b, b_rs, b_cs, acc, par)
}

/// `dst[m, n] (+)= a[m, k] · b[k, n]` with explicit (row, column) strides for `a` and `b`;
/// `dst` row-major contiguous; `acc` adds to `dst`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_strided<T: Elem>(
    dst: &mut [T],
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    b_rs: usize,
    b_cs: usize,
    acc: bool,
    par: Par,
) {
    assert!(dst.len() >= m * n);
    if m == 0 || n == 0 || k == 0 {
        if !acc {
            dst[..m * n].fill(T::zero());
        }
        return;
    }
    assert!(a.len() > (m - 1) * a_rs + (k - 1) * a_cs);
    assert!(b.len() > (k - 1) * b_rs + (n - 1) * b_cs);
    let threads = rayon::current_num_threads();
    let par = if threads > 1 && par == Par::Rayon {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts bound the largest index read from `a` and `b` and written to `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            acc,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        )
    }
}
