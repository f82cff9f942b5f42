//! The 32×32 blocks of [`super`] for CPUs without AMX or AVX512-BF16: bf16 operands widened
//! to f32 in registers for f32 FMA (AVX2, NEON, a portable loop), and Arm's BFDOT.
//!
//! Every function here computes what `super::block` computes (the contract below), from the
//! same packed tiles:
//!
//! ```text
//! c[i, j] (+)= Σ_kb Σ_p  A[i, 2p+1]·B[p, j, 1]  then  + A[i, 2p]·B[p, j, 0]
//! ```
//!
//! A bf16 value is the upper half of an f32, so widening is a 16-bit shift (the pair's even
//! value, in the lower half of its 32 bits) or a mask (the odd value, in the upper half). The
//! product of two bf16 values is exact in f32, so `acc + a·b` rounded once (an FMA) equals a
//! multiplication followed by an addition: the AVX2, NEON and portable blocks agree bit for
//! bit, and with `vdpbf16ps` (which adds the odd product first too) on normal numbers.
//!
//! The widening blocks read A's tiles already widened (`super::ATiles::Wide`: the same layout,
//! f32 values), so each A value reaches every lane with one broadcast load; B's tile rows are
//! widened in registers as they are read.
//!
//! # Safety (every block)
//! `a0`, `a1` (A rows 0-15, 16-31) and `b0`, `b1` (B columns 0-15, 16-31) each address `kbs`
//! consecutive packed tiles (A's as f32 for the widening blocks, bf16 for BFDOT); `c` addresses
//! 32 rows of 32 f32, `stride` bytes apart, writable (and initialised when `load`: the block
//! adds to them; otherwise it overwrites them).

use super::{TILE, TK, TR};

/// `bits` (a bf16 in the upper half) as f32.
#[inline(always)]
fn widen(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Row `i` (0..32) of the block in A's tiles: its first value in the first k-block.
#[inline(always)]
fn a_row(a0: *const f32, a1: *const f32, i: usize) -> *const f32 {
    let t = if i < TR { a0 } else { a1 };
    t.wrapping_add((i % TR) * TK)
}

/// Row `i` of the block in `c`, from column `col`.
#[inline(always)]
fn c_row(c: *mut f32, stride: usize, i: usize, col: usize) -> *mut f32 {
    c.cast::<u8>()
        .wrapping_add(i * stride)
        .cast::<f32>()
        .wrapping_add(col)
}

/// The block as a plain loop (any CPU): per quarter of the block (16 rows × 16 columns), a
/// B tile row widened once, then every row's pair.
///
/// # Safety
/// See the module's documentation.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn portable(
    a0: *const f32,
    a1: *const f32,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    for (ai, a) in [a0, a1].into_iter().enumerate() {
        for (bi, b) in [b0, b1].into_iter().enumerate() {
            // SAFETY: rows ai·16.. of the block, columns bi·16..+16 (the contract).
            let row = |r: usize| unsafe {
                std::slice::from_raw_parts_mut(c_row(c, stride, ai * TR + r, bi * TR), TR)
            };
            let mut acc = [[0f32; TR]; TR];
            if load {
                for (r, a) in acc.iter_mut().enumerate() {
                    a.copy_from_slice(row(r));
                }
            }
            for kb in 0..kbs {
                // SAFETY: tile kb of each operand (the contract).
                let (at, bt) = unsafe {
                    (
                        std::slice::from_raw_parts(a.add(kb * TILE), TILE),
                        std::slice::from_raw_parts(b.add(kb * TILE), TILE),
                    )
                };
                for p in 0..TR {
                    let brow = &bt[p * TK..][..TK];
                    let mut be = [0f32; TR];
                    let mut bo = [0f32; TR];
                    for j in 0..TR {
                        be[j] = widen(brow[2 * j]);
                        bo[j] = widen(brow[2 * j + 1]);
                    }
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let (ae, ao) = (at[r * TK + 2 * p], at[r * TK + 2 * p + 1]);
                        for j in 0..TR {
                            acc[j] = (acc[j] + ao * bo[j]) + ae * be[j];
                        }
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                row(r).copy_from_slice(a);
            }
        }
    }
}

/// The block with AVX2 FMA, in passes of `R` rows × 16 columns (2R accumulators) walking all
/// of k: per k-pair, B's tile row is loaded and widened once (two 8-column halves, even and
/// odd values: 4 vectors) and each row's two A values are broadcast from memory. Rows are
/// taken 5, 5, 5, 5, 4, 4, 4: with 10 accumulators, each receiving two dependent FMAs per
/// k-pair, the 20 FMAs of a k-pair take longer than one accumulator's chain of two (4 cycles
/// each), so the FMA units never wait on a result; 4 rows (16 FMAs) were chain-bound.
///
/// # Safety
/// The CPU has AVX2 and FMA; see the module's documentation.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn avx2(
    a0: *const f32,
    a1: *const f32,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    for (half, b) in [b0, b1].into_iter().enumerate() {
        let mut i = 0;
        for r in [5, 5, 5, 5, 4, 4, 4] {
            let rows = (a0, a1, i);
            let out = (c, stride, i, 16 * half);
            // SAFETY: rows i..i+r < 32 of the block, columns half·16..+16 (the contract).
            unsafe {
                match r {
                    5 => avx2_pass::<5>(rows, b, kbs, out, load),
                    _ => avx2_pass::<4>(rows, b, kbs, out, load),
                }
            }
            i += r;
        }
    }
}

/// `R` rows from row `i` of the block, one 16-column half (`b`'s tiles, `c` from column
/// `col`); see [`avx2`].
///
/// # Safety
/// AVX2 and FMA; as [`avx2`], with rows `i..i + R` inside the block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn avx2_pass<const R: usize>(
    (a0, a1, i): (*const f32, *const f32, usize),
    b: *const u16,
    kbs: usize,
    (c, stride, _, col): (*mut f32, usize, usize, usize),
    load: bool,
) {
    use std::arch::x86_64::*;
    // SAFETY (whole body): per the contract.
    unsafe {
        let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let rows: [*const f32; R] = std::array::from_fn(|r| a_row(a0, a1, i + r));
        let out: [*mut f32; R] = std::array::from_fn(|r| c_row(c, stride, i + r, col));
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if load {
            for (a, &o) in acc.iter_mut().zip(&out) {
                a[0] = _mm256_loadu_ps(o);
                a[1] = _mm256_loadu_ps(o.add(8));
            }
        }
        for kb in 0..kbs {
            let bt = b.add(kb * TILE);
            for p in 0..TR {
                let lo = _mm256_loadu_si256(bt.add(p * TK) as *const __m256i);
                let hi = _mm256_loadu_si256(bt.add(p * TK + 16) as *const __m256i);
                let e0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(lo));
                let o0 = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
                let e1 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(hi));
                let o1 = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
                for (acc, &row) in acc.iter_mut().zip(&rows) {
                    let pair = row.add(kb * TILE + 2 * p);
                    let ao = _mm256_broadcast_ss(&*pair.add(1));
                    acc[0] = _mm256_fmadd_ps(ao, o0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(ao, o1, acc[1]);
                    let ae = _mm256_broadcast_ss(&*pair);
                    acc[0] = _mm256_fmadd_ps(ae, e0, acc[0]);
                    acc[1] = _mm256_fmadd_ps(ae, e1, acc[1]);
                }
            }
        }
        for (a, &o) in acc.iter().zip(&out) {
            _mm256_storeu_ps(o, a[0]);
            _mm256_storeu_ps(o.add(8), a[1]);
        }
    }
}

/// The block with NEON FMA: passes of 4 rows × 16 columns (16 accumulators of 4 lanes), B's
/// tile row widened once per k-pair (8 vectors), A's four values of two k-pairs loaded as one
/// vector per row and multiplied by lane (`fmla` by element).
///
/// # Safety
/// See the module's documentation (NEON is part of every aarch64 target).
#[cfg(target_arch = "aarch64")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn neon(
    a0: *const f32,
    a1: *const f32,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    use std::arch::aarch64::*;
    const R: usize = 4;
    for (half, b) in [b0, b1].into_iter().enumerate() {
        for g in 0..32 / R {
            // SAFETY (whole body): rows g·4..g·4+4 of the block, columns half·16..+16 (the
            // contract).
            unsafe {
                let high = vdupq_n_u32(0xffff_0000);
                let rows: [*const f32; R] = std::array::from_fn(|r| a_row(a0, a1, g * R + r));
                let out: [*mut f32; R] =
                    std::array::from_fn(|r| c_row(c, stride, g * R + r, 16 * half));
                let mut acc = [[vdupq_n_f32(0.0); 4]; R];
                if load {
                    for (a, &o) in acc.iter_mut().zip(&out) {
                        for (q, v) in a.iter_mut().enumerate() {
                            *v = vld1q_f32(o.add(4 * q));
                        }
                    }
                }
                for kb in 0..kbs {
                    let bt = b.add(kb * TILE);
                    for p0 in (0..TR).step_by(2) {
                        // Row r's values at k 2p0..2p0+4: pairs p0 (lanes 0, 1) and p0+1.
                        let av: [float32x4_t; R] =
                            std::array::from_fn(|r| vld1q_f32(rows[r].add(kb * TILE + 2 * p0)));
                        macro_rules! pair {
                            ($p:expr, $even:literal, $odd:literal) => {{
                                let mut be = [vdupq_n_f32(0.0); 4];
                                let mut bo = [vdupq_n_f32(0.0); 4];
                                for q in 0..4 {
                                    let raw = vld1q_u32(bt.add($p * TK + 8 * q) as *const u32);
                                    be[q] = vreinterpretq_f32_u32(vshlq_n_u32::<16>(raw));
                                    bo[q] = vreinterpretq_f32_u32(vandq_u32(raw, high));
                                }
                                for (acc, &a) in acc.iter_mut().zip(&av) {
                                    for q in 0..4 {
                                        acc[q] = vfmaq_laneq_f32::<$odd>(acc[q], bo[q], a);
                                        acc[q] = vfmaq_laneq_f32::<$even>(acc[q], be[q], a);
                                    }
                                }
                            }};
                        }
                        pair!(p0, 0, 1);
                        pair!(p0 + 1, 2, 3);
                    }
                }
                for (a, &o) in acc.iter().zip(&out) {
                    for (q, &v) in a.iter().enumerate() {
                        vst1q_f32(o.add(4 * q), v);
                    }
                }
            }
        }
    }
}

/// The block with Arm's BFDOT (FEAT_BF16): passes of 4 rows × 16 columns (16 accumulators of
/// 4 lanes); B's tile row `p` is 4 vectors of 4 columns' pairs as stored; a row's pairs
/// `p..p+4` are one vector, and `bfdot` by element takes pair `i` of it. BFDOT rounds each
/// pair's sum as Arm defines it (round-to-odd inside, subnormals flushed without FEAT_EBF16),
/// so results differ from the widening kernels in the last bits.
///
/// # Safety
/// The CPU has FEAT_BF16; see the module's documentation.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon,bf16")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn bfdot(
    a0: *const u16,
    a1: *const u16,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    use std::arch::aarch64::*;
    use std::arch::asm;
    const R: usize = 4;
    /// `acc += b · (pair LANE of a)`, lane by lane: `bfdot acc.4s, b.8h, a.2h[LANE]`.
    macro_rules! dot {
        ($acc:expr, $b:expr, $a:expr, $lane:literal) => {
            asm!(
                concat!("bfdot {acc:v}.4s, {b:v}.8h, {a:v}.2h[", $lane, "]"),
                acc = inout(vreg) $acc,
                b = in(vreg) $b,
                a = in(vreg) $a,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
    }
    for half in 0..2 {
        let b = if half == 0 { b0 } else { b1 };
        for g in 0..32 / R {
            // SAFETY (whole body): as the AVX2 block's; FEAT_BF16 per the contract.
            unsafe {
                let at = if g < 16 / R { a0 } else { a1 }.add((g % (16 / R)) * R * TK);
                let row = |r: usize| {
                    (c as *mut u8)
                        .add((g * R + r) * stride)
                        .cast::<f32>()
                        .add(16 * half)
                };
                let mut acc = [[vdupq_n_f32(0.0); 4]; R];
                if load {
                    for (r, a) in acc.iter_mut().enumerate() {
                        for (q, v) in a.iter_mut().enumerate() {
                            *v = vld1q_f32(row(r).add(4 * q));
                        }
                    }
                }
                for kb in 0..kbs {
                    let a = at.add(kb * TILE);
                    let bt = b.add(kb * TILE);
                    for p0 in (0..TR).step_by(4) {
                        let mut ar = [vdupq_n_u16(0); R];
                        for (r, v) in ar.iter_mut().enumerate() {
                            *v = vld1q_u16(a.add(r * TK + 2 * p0));
                        }
                        macro_rules! step {
                            ($lane:literal) => {{
                                let p = p0 + $lane;
                                let mut bv = [vdupq_n_u16(0); 4];
                                for (q, v) in bv.iter_mut().enumerate() {
                                    *v = vld1q_u16(bt.add(p * TK + 8 * q));
                                }
                                for (r, acc) in acc.iter_mut().enumerate() {
                                    for q in 0..4 {
                                        dot!(acc[q], bv[q], ar[r], $lane);
                                    }
                                }
                            }};
                        }
                        step!(0);
                        step!(1);
                        step!(2);
                        step!(3);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    for (q, &v) in a.iter().enumerate() {
                        vst1q_f32(row(r).add(4 * q), v);
                    }
                }
            }
        }
    }
}
