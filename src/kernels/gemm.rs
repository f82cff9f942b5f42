//! Matrix products on host slices: `gemm`'s kernels (AVX-512 where the CPU has it) with
//! explicit strides, so that callers multiply transposed views without copying them, and the
//! mixed form that hands f32 operands to the bf16 kernels of [`super::bf16`] when asked.

use std::mem::MaybeUninit;

use super::elem::Elem;
use super::simd::Par;

/// `dst[m, n] (+)= a[m, k] · b[k, n]` as [`gemm_strided`], with bf16 operands and f32 sums
/// ([`super::bf16`]) when `bf16` is set, the elements are f32 and a bf16 kernel runs (any CPU unless MAIN_PPO_BF16_KERNEL=none); otherwise in
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

/// `a[m, k] · b[k, n]` into a fresh `[m, n]` buffer: [`gemm_mixed`] without `acc`, the output
/// written once by the product instead of zero-filled first (zero-filled outputs were ~6 % of
/// a forward+backward's time, in `memset`).
#[allow(clippy::too_many_arguments)]
pub fn gemm_new<T: Elem>(
    bf16: bool,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    b_rs: usize,
    b_cs: usize,
    par: Par,
) -> Vec<T> {
    // SAFETY: gemm_uninit writes all m·n values.
    unsafe {
        super::alloc::filled(m * n, |dst| {
            gemm_uninit(bf16, dst, m, n, k, a, a_rs, a_cs, b, b_rs, b_cs, par)
        })
    }
}

/// `dst[m, n] = a[m, k] · b[k, n]` (as [`gemm_mixed`] without `acc`) into memory not yet
/// initialised: every value of `dst[..m·n]` is written, none read.
#[allow(clippy::too_many_arguments)]
pub fn gemm_uninit<T: Elem>(
    bf16: bool,
    dst: &mut [MaybeUninit<T>],
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_rs: usize,
    a_cs: usize,
    b: &[T],
    b_rs: usize,
    b_cs: usize,
    par: Par,
) {
    assert!(dst.len() >= m * n);
    if bf16 && super::bf16::available() {
        if let (Some(a32), Some(b32)) = (T::f32s(a), T::f32s(b)) {
            let d32 = T::f32s_uninit(dst).expect("a, b and dst share one element type");
            super::bf16::gemm_uninit(d32, m, n, k, a32, a_rs, a_cs, b32, b_rs, b_cs, par);
            return;
        }
    }
    if m == 0 || n == 0 || k == 0 {
        dst[..m * n].fill(MaybeUninit::new(T::zero()));
        return;
    }
    // SAFETY: dst is valid for m·n writes; `gemm` with `read_dst` false writes every value of
    // dst[m, n] (alpha set to zero: its kernels store without loading) and reads none.
    unsafe {
        gemm_raw(
            dst.as_mut_ptr().cast(),
            m,
            n,
            k,
            (a, a_rs, a_cs),
            (b, b_rs, b_cs),
            false,
            par,
        )
    };
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
    // SAFETY: dst holds m·n initialised values.
    unsafe {
        gemm_raw(
            dst.as_mut_ptr(),
            m,
            n,
            k,
            (a, a_rs, a_cs),
            (b, b_rs, b_cs),
            acc,
            par,
        );
    }
}

/// `gemm`'s product into `dst[m, n]` (row-major, contiguous), `(matrix, row stride, column
/// stride)` for each operand; `m`, `n` and `k` positive.
///
/// # Safety
/// `dst` must be valid for writes of `m·n` values nothing else touches during the call, and
/// hold initialised values when `acc` (without it every value is written, none read).
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_raw<T: Elem>(
    dst: *mut T,
    m: usize,
    n: usize,
    k: usize,
    (a, a_rs, a_cs): (&[T], usize, usize),
    (b, b_rs, b_cs): (&[T], usize, usize),
    acc: bool,
    par: Par,
) {
    assert!(a.len() > (m - 1) * a_rs + (k - 1) * a_cs);
    assert!(b.len() > (k - 1) * b_rs + (n - 1) * b_cs);
    let threads = rayon::current_num_threads();
    let par = if threads > 1 && par == Par::Rayon {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    #[cfg(target_arch = "x86_64")]
    if let Some(set) = forced::Set::of(super::cpu::isa()) {
        // SAFETY: as below; `forced::gemm` normalises the operands as `gemm::gemm` does.
        unsafe {
            forced::gemm(
                set,
                m,
                n,
                k,
                dst,
                (a.as_ptr(), a_rs, a_cs),
                (b.as_ptr(), b_rs, b_cs),
                acc,
                par,
            )
        };
        return;
    }
    // SAFETY: the asserts bound the largest index read from `a` and `b`; dst per this
    // function's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
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

/// `gemm`'s AVX2 + FMA kernels by name, for `MAIN_PPO_CPU=avx2` on a CPU with AVX-512:
/// `gemm::gemm` always takes its widest set, so the forced form would otherwise still run
/// AVX-512 products, and measure something no AVX2 machine runs. This calls the `fma` set of
/// `gemm-f32` / `gemm-f64` through `gemm_common::gemm::gemm_basic_generic`, after the operand
/// normalisation `gemm::gemm` does for a row-major destination (it works on the transpose,
/// `dstᵀ = bᵀ·aᵀ`, whose columns are contiguous). `MAIN_PPO_CPU=portable` leaves the `gemm`
/// crate its own choice: it switches off this crate's hand-written vector code, and the
/// crate's scalar kernel (one sequential sum per output) is not what any CPU users have runs.
#[cfg(target_arch = "x86_64")]
mod forced {
    use super::Elem;
    use candle_core::DType;
    use gemm_common::gemm::gemm_basic_generic;
    use gemm_common::simd::{MixedSimd, V3};

    /// A kernel set of the `gemm` crates.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Set {
        /// AVX2 + FMA (`gemm_f32::microkernel::fma`).
        Fma,
    }

    impl Set {
        /// The set to force for `isa`, `None` where `gemm::gemm`'s own choice is the one.
        pub fn of(isa: super::super::cpu::Isa) -> Option<Set> {
            use super::super::cpu::{detected, Isa};
            (isa == Isa::Avx2 && detected() != Isa::Avx2).then_some(Set::Fma)
        }
    }

    /// One product with a given set; `m, n, k > 0`, `dst [m, n]` row-major, operands as
    /// `(pointer, row stride, column stride)` with non-negative strides.
    ///
    /// # Safety
    /// As `gemm::gemm`: every index the strides reach lies inside its operand, `dst` holds
    /// `m·n` writable values (initialised when `acc`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm<T: Elem>(
        set: Set,
        m: usize,
        n: usize,
        k: usize,
        dst: *mut T,
        (a, a_rs, a_cs): (*const T, usize, usize),
        (b, b_rs, b_cs): (*const T, usize, usize),
        acc: bool,
        par: gemm::Parallelism,
    ) {
        // gemm::gemm's normalisation for dst_cs = 1 < dst_rs = n (n > 1): the transpose,
        // whose columns are dst's rows (column stride n, row stride 1), `bᵀ·aᵀ`. For n = 1
        // it keeps the product as it is.
        let (mm, nn, dst_cs, dst_rs, l, l_cs, l_rs, r, r_cs, r_rs) = if n > 1 {
            (n, m, n, 1, b, b_rs, b_cs, a, a_rs, a_cs)
        } else {
            (m, n, 1, n, a, a_cs, a_rs, b, b_cs, b_rs)
        };
        let i = |x: usize| x as isize;
        macro_rules! call {
            ($ty:ty, $simd:expr, $S:ty, $kernels:path, $lanes:expr) => {{
                use $kernels as ukr;
                // SAFETY: per this function's contract; T is $ty (checked by the caller's
                // match on the dtype).
                unsafe {
                    gemm_basic_generic::<
                        $S,
                        $ty,
                        $lanes,
                        { ukr::MR_DIV_N * $lanes },
                        { ukr::NR },
                        { ukr::MR_DIV_N },
                        { ukr::H_M },
                        { ukr::H_N },
                    >(
                        $simd,
                        mm,
                        nn,
                        k,
                        dst as *mut $ty,
                        i(dst_cs),
                        i(dst_rs),
                        acc,
                        l as *const $ty,
                        i(l_cs),
                        i(l_rs),
                        r as *const $ty,
                        i(r_cs),
                        i(r_rs),
                        1.0,
                        1.0,
                        false,
                        false,
                        false,
                        |a, b, c| a * b + c,
                        &ukr::UKR,
                        &ukr::H_UKR,
                        false,
                        par,
                    )
                }
            }};
        }
        let v3 = || {
            <V3 as MixedSimd<f32, f32, f32, f32>>::try_new()
                .expect("MAIN_PPO_CPU=avx2 is accepted only on a CPU with AVX2 and FMA")
        };
        match (T::DTYPE, set) {
            (DType::F32, Set::Fma) => call!(f32, v3(), V3, gemm_f32::microkernel::fma::f32, 8),
            (DType::F64, Set::Fma) => call!(f64, v3(), V3, gemm_f64::microkernel::fma::f64, 4),
            (d, _) => unreachable!("the hand-written paths take f32 and f64, not {d:?}"),
        }
    }
}

/// `pack(x)` where the products are bf16 (`bf16` asked, f32 elements, a CPU with a bf16
/// kernel), else `None`.
fn packed_if<T: Elem, P>(bf16: bool, x: &[T], pack: impl FnOnce(&[f32]) -> P) -> Option<P> {
    match T::f32s(x) {
        Some(x32) if bf16 && super::bf16::available() => Some(pack(x32)),
        _ => None,
    }
}

/// `A [m, k] · B [k, n]` from bf16 packs into a fresh buffer of the element type (f32: the
/// only type packs are made for).
fn packed_product<T: Elem>(
    ap: &super::bf16::PackedA,
    bp: &super::bf16::PackedB,
    m: usize,
    n: usize,
) -> Vec<T> {
    // SAFETY: product_uninit writes all m·n values.
    unsafe {
        super::alloc::filled(m * n, |dst| {
            let d32 = T::f32s_uninit(dst).expect("packs are made of f32 operands only");
            super::bf16::product_uninit(d32, ap, bp, Par::Rayon)
        })
    }
}

/// A left operand `a[m, k]` of several products `a·Bᵢ` (a layer's input read by its query, key
/// and value projections, or by an MLP's gate and up projections): packed once as bf16 tiles
/// where the products are bf16, else kept as it is.
pub struct SharedA<'a, T> {
    a: &'a [T],
    strides: (usize, usize),
    m: usize,
    k: usize,
    packed: Option<super::bf16::PackedA>,
}

impl<'a, T: Elem> SharedA<'a, T> {
    /// `a[i, kk]` at `a[i·a_rs + kk·a_cs]`; `bf16` as [`gemm_mixed`]'s.
    pub fn new(bf16: bool, a: &'a [T], (a_rs, a_cs): (usize, usize), m: usize, k: usize) -> Self {
        let packed = packed_if(bf16, a, |a32| {
            super::bf16::PackedA::new(a32, a_rs, a_cs, m, k, Par::Rayon)
        });
        SharedA {
            a,
            strides: (a_rs, a_cs),
            m,
            k,
            packed,
        }
    }

    /// `a · b[k, n]` into a fresh `[m, n]` buffer, as [`gemm_new`] (the same values: the
    /// packed tiles are what each product would have packed).
    pub fn product(&self, bf16: bool, b: &[T], (b_rs, b_cs): (usize, usize), n: usize) -> Vec<T> {
        let (m, k) = (self.m, self.k);
        if let (Some(ap), Some(b32), true) = (&self.packed, T::f32s(b), bf16) {
            let bp = super::bf16::PackedB::new(b32, b_rs, b_cs, k, n, Par::Rayon);
            return packed_product(ap, &bp, m, n);
        }
        let (a_rs, a_cs) = self.strides;
        gemm_new(bf16, m, n, k, self.a, a_rs, a_cs, b, b_rs, b_cs, Par::Rayon)
    }

    /// The matrix as given.
    pub fn plain(&self) -> &'a [T] {
        self.a
    }
}

/// A right operand `b[k, n]` of several products `Aᵢ·b` (a layer's input in its projections'
/// weight gradients `∂Wᵢ = dyᵢᵀ·x`): packed once as bf16 tiles where the products are bf16,
/// else kept as it is.
pub struct SharedB<'a, T> {
    b: &'a [T],
    strides: (usize, usize),
    k: usize,
    n: usize,
    packed: Option<super::bf16::PackedB>,
}

impl<'a, T: Elem> SharedB<'a, T> {
    /// `b[kk, j]` at `b[kk·b_rs + j·b_cs]`; `bf16` as [`gemm_mixed`]'s. With `pack` false
    /// (no product will use it: frozen weights) nothing is packed.
    pub fn new(
        bf16: bool,
        b: &'a [T],
        (b_rs, b_cs): (usize, usize),
        k: usize,
        n: usize,
        pack: bool,
    ) -> Self {
        let packed = packed_if(pack && bf16, b, |b32| {
            super::bf16::PackedB::new(b32, b_rs, b_cs, k, n, Par::Rayon)
        });
        SharedB {
            b,
            strides: (b_rs, b_cs),
            k,
            n,
            packed,
        }
    }

    /// `a[m, k] · b` into a fresh `[m, n]` buffer, as [`gemm_new`].
    pub fn product(&self, bf16: bool, a: &[T], (a_rs, a_cs): (usize, usize), m: usize) -> Vec<T> {
        let (k, n) = (self.k, self.n);
        if let (Some(bp), Some(a32), true) = (&self.packed, T::f32s(a), bf16) {
            let ap = super::bf16::PackedA::new(a32, a_rs, a_cs, m, k, Par::Rayon);
            return packed_product(&ap, bp, m, n);
        }
        let (b_rs, b_cs) = self.strides;
        gemm_new(bf16, m, n, k, a, a_rs, a_cs, self.b, b_rs, b_cs, Par::Rayon)
    }

    /// The matrix as given.
    pub fn plain(&self) -> &'a [T] {
        self.b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `gemm` crate's AVX2 + FMA set called by name ([`forced`]) against f64 sums of the
    /// same operands, f32 and f64, with and without accumulation, for row-major and
    /// transposed operands and the shapes `gemm::gemm` normalises differently (`n = 1` keeps
    /// the product, `n > 1` works on its transpose). Skipped without AVX2.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn forced_fma_set_is_the_product() {
        if !super::super::cpu::Isa::Avx2.here() {
            eprintln!("skipped: no AVX2 and FMA on this CPU");
            return;
        }
        fn run<T: Elem>(tol: f64) {
            for (m, n, k) in [
                (1, 1, 1),
                (7, 1, 33),
                (1, 9, 17),
                (33, 47, 70),
                (64, 96, 200),
            ] {
                let a: Vec<T> = values(m * k, 3);
                let b: Vec<T> = values(k * n, 4);
                let d0: Vec<T> = values(m * n, 5);
                for (a_rs, a_cs) in [(k, 1), (1, m)] {
                    for (b_rs, b_cs) in [(n, 1), (1, k)] {
                        for acc in [false, true] {
                            let mut got = d0.clone();
                            let f = |x: T| candle_core::WithDType::to_f64(x);
                            // SAFETY: the operands and dst hold the values the strides reach.
                            unsafe {
                                forced::gemm(
                                    forced::Set::Fma,
                                    m,
                                    n,
                                    k,
                                    got.as_mut_ptr(),
                                    (a.as_ptr(), a_rs, a_cs),
                                    (b.as_ptr(), b_rs, b_cs),
                                    acc,
                                    gemm::Parallelism::Rayon(2),
                                )
                            };
                            for i in 0..m {
                                for j in 0..n {
                                    let sum: f64 = (0..k)
                                        .map(|l| {
                                            f(a[i * a_rs + l * a_cs]) * f(b[l * b_rs + j * b_cs])
                                        })
                                        .sum();
                                    let want = sum + if acc { f(d0[i * n + j]) } else { 0.0 };
                                    let g = f(got[i * n + j]);
                                    assert!(
                                        (g - want).abs() <= tol * (1.0 + k as f64),
                                        "{m}x{n}x{k} a ({a_rs},{a_cs}) b ({b_rs},{b_cs}) acc {acc} \
                                         [{i},{j}]: {g} vs {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        run::<f32>(1e-6);
        run::<f64>(1e-14);
    }

    /// Values in [-1, 1) from a hash of the index (no two neighbours alike).
    fn values<T: Elem>(len: usize, seed: usize) -> Vec<T> {
        (0..len)
            .map(|i| T::from_f64(((i * 7919 + seed * 104_729) % 2000) as f64 / 1000.0 - 1.0))
            .collect()
    }

    /// Every way of getting a product into a fresh buffer ([`gemm_new`], [`SharedA`],
    /// [`SharedB`]) gives what [`gemm_mixed`] writes over a zeroed output, bit for bit — the
    /// bf16 kernel (where this CPU has one) and the `gemm` crate, f32 and f64 — for shapes
    /// with partial tiles, both operands row-major and transposed, and `k = 0` (zeros). Test
    /// builds fill fresh buffers with NaN first, so a value left unwritten fails here. What is
    /// checked is the plumbing (fresh buffers, packs made once and reused); the products'
    /// arithmetic is checked against f64 sums in `bf16::tests` and the model's parity tests.
    fn check<T: Elem>() {
        for (m, n, k) in [(1, 1, 1), (33, 47, 70), (64, 96, 576), (5, 3, 0), (0, 4, 2)] {
            let a: Vec<T> = values(m * k, 1);
            let b: Vec<T> = values(k * n, 2);
            for bf16 in [false, true] {
                for (a_rs, a_cs) in [(k, 1), (1, m)] {
                    for (b_rs, b_cs) in [(n, 1), (1, k)] {
                        let mut want = vec![T::zero(); m * n];
                        gemm_mixed(
                            bf16,
                            &mut want,
                            m,
                            n,
                            k,
                            &a,
                            a_rs,
                            a_cs,
                            &b,
                            b_rs,
                            b_cs,
                            false,
                            Par::Rayon,
                        );
                        let bits = |v: &[T]| {
                            v.iter()
                                .map(|&x| candle_core::WithDType::to_f64(x).to_bits())
                                .collect()
                        };
                        let want: Vec<u64> = bits(&want);
                        let what = format!(
                            "{m}x{n}x{k} bf16 {bf16} a ({a_rs}, {a_cs}) b ({b_rs}, {b_cs})"
                        );
                        let got =
                            gemm_new(bf16, m, n, k, &a, a_rs, a_cs, &b, b_rs, b_cs, Par::Rayon);
                        assert_eq!(bits(&got), want, "gemm_new {what}");
                        let sa = SharedA::new(bf16, &a, (a_rs, a_cs), m, k);
                        for _ in 0..2 {
                            let got = sa.product(bf16, &b, (b_rs, b_cs), n);
                            assert_eq!(bits(&got), want, "SharedA {what}");
                        }
                        let sb = SharedB::new(bf16, &b, (b_rs, b_cs), k, n, true);
                        for _ in 0..2 {
                            let got = sb.product(bf16, &a, (a_rs, a_cs), m);
                            assert_eq!(bits(&got), want, "SharedB {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fresh_outputs_and_shared_operands_equal_the_plain_product() {
        check::<f32>();
        check::<f64>();
    }
}
