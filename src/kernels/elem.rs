//! The element types of the hand-written CPU paths and the reductions they share.
//!
//! [`Elem`] is what the fast paths (the training layer, the fused LM head, the decode engine)
//! are generic over: f32 or f64 (half precision runs candle's composition instead). [`KvElem`]
//! is how a decode cache stores a `T`: as `T`, or as [`Bf16`] bits for f32 models with bf16
//! products. [`dot`], [`sum`] and [`max`] reduce in 16 interleaved lanes so that the compiler
//! keeps the partial results in vector registers (a single running sum is one long dependency
//! chain); [`dot_tree`] combines its lanes pairwise for short, head-sized products.

use std::mem::MaybeUninit;

use candle_core::WithDType;

/// Element types of the fast path.
pub trait Elem: WithDType + num_traits::Float + Send + Sync + 'static {
    /// The slice as f32 when the element type is f32 (bf16 products apply to f32 models only).
    fn f32s(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn f32s_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    /// [`Elem::f32s_mut`] for memory not yet initialised.
    fn f32s_uninit(_: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<f32>]> {
        None
    }
    /// `e^self`: libm's for f64; for f32 a polynomial the compiler can vectorize
    /// ([`exp_f32`]), for the softmax and log-softmax loops.
    #[inline(always)]
    fn exp_fast(self) -> Self {
        self.exp()
    }
}
impl Elem for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }
    fn f32s(s: &[f32]) -> Option<&[f32]> {
        Some(s)
    }
    fn f32s_mut(s: &mut [f32]) -> Option<&mut [f32]> {
        Some(s)
    }
    fn f32s_uninit(s: &mut [MaybeUninit<f32>]) -> Option<&mut [MaybeUninit<f32>]> {
        Some(s)
    }
}
impl Elem for f64 {}

/// `e^x` in f32 without a libm call, so that loops over slices vectorize: `x = n·ln 2 + r` with
/// `n = round(x·log₂e)`, `|r| ≤ ln 2 / 2` (ln 2 split in two constants so that `n·ln 2` is exact
/// enough), `e^r` by Cephes' degree-7 polynomial (relative error ≤ 2 ulp), times `2ⁿ` built in
/// the exponent bits. Below −87 (where f32 results turn subnormal) it returns 0, above 88.72
/// infinity; NaN stays NaN.
///
/// `n` as an integer is read from the bits of the rounding sum, not cast with `as i32`: Rust's
/// float→int cast saturates (and maps NaN to 0), which LLVM lowers lane by lane (16 scalar
/// conversions, compares and inserts per vector), and that made the function ~2 ns per
/// element inside otherwise 16-lane loops.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let xc = x.clamp(-87.0, 88.72);
    // Round to nearest by adding and subtracting 1.5·2²³ (no libm floor, which would stop
    // vectorization on the baseline target); |x·log₂e| < 2²² keeps it exact, and keeps the
    // sum's exponent that of 1.5·2²³, so its low mantissa bits hold n + 2²² (two's
    // complement offset): n = bits(sum) − bits(1.5·2²³).
    const MAGIC: f32 = 12_582_912.0;
    let rounded = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = rounded - MAGIC;
    let ni = (rounded.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = xc - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let y = p * r * r + r + 1.0;
    // 2ⁿ in two halves: n reaches 128 at the top of the range, beyond one exponent field.
    let h = ni >> 1;
    let s1 = f32::from_bits((h.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((ni.wrapping_sub(h).wrapping_add(127) as u32) << 23);
    let v = y * s1 * s2;
    if x.is_nan() {
        x
    } else if x < -87.0 {
        0.0
    } else if x > 88.72 {
        f32::INFINITY
    } else {
        v
    }
}

/// How the decode cache holds keys and values of a `T` model: as `T`, or as bf16 bits
/// ([`Bf16`], for f32 models with bf16 products: half the bytes read per decode step, as vLLM's
/// bf16 cache).
pub trait KvElem<T>: Copy + Send + Sync + 'static {
    fn store(x: T) -> Self;
    fn load(self) -> T;
    /// The cached elements as the AVX-512 decode attention reads them (f32 values or bf16
    /// bits); `None` for f64.
    fn rows(_: &[Self]) -> Option<KvRows<'_>> {
        None
    }
}

/// Cached keys or values seen as f32 values or bf16 bits (`kernels::attend`'s fast path).
#[derive(Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl<T: Elem> KvElem<T> for T {
    #[inline(always)]
    fn store(x: T) -> T {
        x
    }
    #[inline(always)]
    fn load(self) -> T {
        self
    }
    fn rows(s: &[T]) -> Option<KvRows<'_>> {
        T::f32s(s).map(KvRows::F32)
    }
}

/// A bf16 value (its bits), rounded to nearest even from f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl KvElem<f32> for Bf16 {
    #[inline(always)]
    fn store(x: f32) -> Bf16 {
        Bf16(super::bf16::bf16_bits(x))
    }
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
    fn rows(s: &[Bf16]) -> Option<KvRows<'_>> {
        // SAFETY: `Bf16` is a transparent `u16`: same size, alignment and valid values.
        let bits = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u16, s.len()) };
        Some(KvRows::Bf16(bits))
    }
}

/// `σ(z) = 1 / (1 + e^{−z})` with [`Elem::exp_fast`] (vectorizes in f32 loops; libm's exp in
/// f64).
#[inline(always)]
pub fn sigmoid<T: Elem>(z: T) -> T {
    T::one() / (T::one() + (-z).exp_fast())
}

/// `Σ a_i·b_i` in 16 lane sums combined pairwise (8 + 8, 4 + 4, ...): for the head-sized dot
/// products of decode attention, where [`dot`]'s sequential combination of the 16 lanes cost
/// more than the products.
#[inline(always)]
pub fn dot_tree<T: Elem>(a: &[T], b: &[T]) -> T {
    let (acc, tail) = lane_sums(a, b);
    pairwise(acc) + tail
}

/// The sum of 16 lanes combined pairwise (8 + 8, 4 + 4, ...): vector adds and shuffles, where
/// a sequential fold extracts the lanes one by one.
#[inline(always)]
pub fn pairwise<T: Elem>(mut acc: [T; 16]) -> T {
    let mut width = 8;
    while width > 0 {
        let (lo, hi) = acc.split_at_mut(width);
        for (x, &y) in lo.iter_mut().zip(hi.iter()) {
            *x += y;
        }
        width /= 2;
    }
    acc[0]
}

/// `Σ a_i·b_i` in 16 interleaved partial sums (so the compiler keeps them in vector lanes;
/// a single running sum is one long dependency chain).
#[inline(always)]
pub fn dot<T: Elem>(a: &[T], b: &[T]) -> T {
    dot_kv(a, b)
}

/// [`dot`] of a query and a cached key (any [`KvElem`], the model's type included).
#[inline(always)]
pub fn dot_kv<T: Elem, C: KvElem<T>>(a: &[T], b: &[C]) -> T {
    let (acc, tail) = lane_sums(a, b);
    acc.iter().fold(T::zero(), |s, &v| s + v) + tail
}

/// The products `a_i·b_i` of the first `16·⌊n/16⌋` pairs summed into 16 interleaved lanes
/// (lane `k` takes `i ≡ k mod 16`), and the rest summed in order: the shared part of the dot
/// products, which differ in how they combine the lanes.
#[inline(always)]
fn lane_sums<T: Elem, C: KvElem<T>>(a: &[T], b: &[C]) -> ([T; 16], T) {
    let mut acc = [T::zero(); 16];
    let n = a.len().min(b.len()) / 16 * 16;
    for (ca, cb) in a[..n].chunks_exact(16).zip(b[..n].chunks_exact(16)) {
        for ((s, &u), &v) in acc.iter_mut().zip(ca).zip(cb) {
            *s += u * v.load();
        }
    }
    let tail = a[n..]
        .iter()
        .zip(&b[n..])
        .fold(T::zero(), |s, (&u, &v)| s + u * v.load());
    (acc, tail)
}

/// `Σ a_i` in 16 interleaved partial sums (as [`dot`]).
#[inline(always)]
pub fn sum<T: Elem>(a: &[T]) -> T {
    let mut acc = [T::zero(); 16];
    let n = a.len() / 16 * 16;
    for c in a[..n].chunks_exact(16) {
        for (s, &v) in acc.iter_mut().zip(c) {
            *s += v;
        }
    }
    let tail = a[n..].iter().fold(T::zero(), |s, &v| s + v);
    acc.iter().fold(T::zero(), |s, &v| s + v) + tail
}

/// `max_i a_i` (−∞ for none) in 16 interleaved lanes; a NaN anywhere may or may not win.
#[inline(always)]
pub fn max<T: Elem>(a: &[T]) -> T {
    let mut acc = [T::neg_infinity(); 16];
    let n = a.len() / 16 * 16;
    for c in a[..n].chunks_exact(16) {
        for (s, &v) in acc.iter_mut().zip(c) {
            *s = if v > *s { v } else { *s };
        }
    }
    let m = a[n..]
        .iter()
        .fold(T::neg_infinity(), |s, &v| if v > s { v } else { s });
    acc.iter().fold(m, |s, &v| if v > s { v } else { s })
}

#[cfg(test)]
mod tests {
    /// The pairwise-combined dot product against f64 sums, for lengths with and without a
    /// tail past the 16 lanes.
    #[test]
    fn tree_dot_products_match_f64_sums() {
        for n in [0usize, 1, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 1.3).cos()).collect();
            let want: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
            let got = f64::from(super::dot_tree(&a, &b));
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{n}: {got} vs {want}"
            );
        }
    }

    /// Against f64's exp over [−87, 88.7] in steps of 1e-3 (and the edges): relative error
    /// ≤ 3e-7 (2.5 ulp); 0 below −87, infinity above 88.72, NaN stays NaN.
    #[test]
    fn exp_f32_is_within_three_ulp_of_f64() {
        let mut worst = 0f64;
        let mut x = -87.0f64;
        while x <= 88.7 {
            let got = super::exp_f32(x as f32) as f64;
            let want = (x as f32 as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 1e-3;
        }
        assert!(worst <= 3e-7, "worst relative error {worst:e}");
        assert_eq!(super::exp_f32(-100.0), 0.0);
        assert_eq!(super::exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(super::exp_f32(0.0), 1.0);
        assert_eq!(super::exp_f32(100.0), f32::INFINITY);
        assert!(super::exp_f32(f32::NAN).is_nan());
    }

    /// The earlier form of `exp_f32`, which read `n` with a saturating `as i32` cast (scalar
    /// per lane): the bit-read form gives the same bits for every f32 in [−90, 90] at steps of
    /// 2⁻¹² and at the edges, so no result computed with it changes.
    #[test]
    fn exp_f32_reads_n_as_the_cast_did() {
        fn with_cast(x: f32) -> f32 {
            let xc = x.clamp(-87.0, 88.72);
            const MAGIC: f32 = 12_582_912.0;
            let n = (xc * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
            let r = xc - n * 0.693_359_4 + n * 2.121_944_4e-4;
            let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r
                + 4.166_579_6e-2)
                * r
                + 1.666_666_5e-1)
                * r
                + 0.5;
            let y = p * r * r + r + 1.0;
            let ni = n as i32;
            let h = ni >> 1;
            let s1 = f32::from_bits(((h + 127) as u32) << 23);
            let s2 = f32::from_bits(((ni - h + 127) as u32) << 23);
            let v = y * s1 * s2;
            if x.is_nan() {
                x
            } else if x < -87.0 {
                0.0
            } else if x > 88.72 {
                f32::INFINITY
            } else {
                v
            }
        }
        let edges = [
            -87.0f32,
            88.72,
            -86.99999,
            88.71999,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
        ];
        let grid = (-90 * 4096..=90 * 4096).map(|i| i as f32 / 4096.0);
        for x in grid.chain(edges) {
            assert_eq!(
                super::exp_f32(x).to_bits(),
                with_cast(x).to_bits(),
                "x = {x}"
            );
        }
    }
}
