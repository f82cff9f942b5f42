//! Element-wise loops at the CPU's vector width.
//!
//! The crate is built for the baseline x86-64 target (SSE2), so a plain loop over f32 slices
//! runs 4 lanes wide at best, and one inside a rayon `par_iter().zip(..).map(..)` chain often
//! runs one element per call of the closure. [`vectorized`] runs a closure inside a function
//! compiled for the process's instruction set ([`super::cpu`]: AVX-512, or AVX2 + FMA): the
//! closure is inlined there, so its loops (the SiLU gate's exponentials, RMSNorm's sums, the
//! LM head's log-sum-exp) are vectorized 16 or 8 lanes wide. Elsewhere (aarch64, whose
//! baseline is NEON, and the portable form) the closure runs as compiled.
//!
//! The closure must really be inlined, or it keeps the baseline code: callers mark it
//! `#[inline(always)]` (and the functions it calls, e.g. `exp_f32`), since LLVM's size heuristic
//! declined to inline larger closures (measured: the attention softmax ran as a separate,
//! SSE2-only closure and took twice as long).
//!
//! [`Par`] tells a kernel whether to spread over rayon's threads or stay on the calling one.
//!
//! [`par_zip`] / [`par_zip2`] are the common shape: one output slice and one or two inputs of
//! the same length, cut into chunks processed in parallel, each chunk's loop vectorized.

use rayon::prelude::*;

/// Elements per parallel task of the element-wise helpers (64 KiB of f32: enough work per task
/// to hide rayon's overhead, small enough to spread over the threads).
pub const CHUNK: usize = 1 << 14;

/// Whether a product runs on rayon's threads or on the calling thread only (inside a task that
/// is already one of many parallel tasks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Par {
    Rayon,
    None,
}

/// Runs `f` compiled for this process's vector instructions ([`super::cpu::isa`]): AVX-512
/// (with AVX2 and FMA) or AVX2 with FMA on x86-64; elsewhere (NEON is aarch64's baseline, and
/// the portable form) the closure runs as compiled. Rust never fuses a multiply and an add
/// by itself, so each form computes the same values; only the vector width differs.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        match super::cpu::isa() {
            // SAFETY: `isa` answers a form only when the CPU has every feature it enables.
            super::cpu::Isa::Avx512 => return unsafe { avx512(f) },
            // SAFETY: as above.
            super::cpu::Isa::Avx2 => return unsafe { avx2(f) },
            _ => {}
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `out[i] = f(out[i], a[i])` for every `i`, in parallel chunks, vectorized.
pub fn par_zip<T: Copy + Send + Sync>(out: &mut [T], a: &[T], f: impl Fn(T, T) -> T + Sync) {
    assert_eq!(out.len(), a.len(), "par_zip: slices of different lengths");
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK))
        .for_each(|(o, a)| {
            vectorized(
                #[inline(always)]
                || {
                    for (o, &a) in o.iter_mut().zip(a) {
                        *o = f(*o, a);
                    }
                },
            )
        });
}

/// `out[i] = f(out[i], a[i], b[i])` for every `i`, in parallel chunks, vectorized.
pub fn par_zip2<T: Copy + Send + Sync>(
    out: &mut [T],
    a: &[T],
    b: &[T],
    f: impl Fn(T, T, T) -> T + Sync,
) {
    assert!(
        out.len() == a.len() && a.len() == b.len(),
        "par_zip2: slices of different lengths"
    );
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            vectorized(
                #[inline(always)]
                || {
                    for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                        *o = f(*o, a, b);
                    }
                },
            )
        });
}

/// `f(a[i], b[i])` for every `i` into a fresh vector (not zero-filled first: see
/// [`super::alloc::filled`]), in parallel chunks, vectorized.
pub fn par_map2<T: super::elem::Elem>(a: &[T], b: &[T], f: impl Fn(T, T) -> T + Sync) -> Vec<T> {
    assert_eq!(a.len(), b.len(), "par_map2: slices of different lengths");
    // SAFETY: the chunks of `out` cover it, and each chunk's loop writes every value of it.
    unsafe {
        super::alloc::filled(a.len(), |out| {
            out.par_chunks_mut(CHUNK)
                .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                .for_each(|(o, (a, b))| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                                o.write(f(a, b));
                            }
                        },
                    )
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_equal_the_plain_loops() {
        // Lengths around the chunk size and not multiples of a vector: every tail path runs.
        for n in [0, 1, 15, 17, CHUNK - 1, CHUNK, 3 * CHUNK + 5] {
            let a: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 12.0).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 31) as f32 * -0.5 + 3.0).collect();
            let mut o: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let want: Vec<f32> = o.iter().zip(&a).map(|(&o, &a)| o * 2.0 + a).collect();
            par_zip(&mut o, &a, |o, a| o * 2.0 + a);
            assert_eq!(o, want);
            let want: Vec<f32> = o
                .iter()
                .zip(a.iter().zip(&b))
                .map(|(&o, (&a, &b))| o - a * b)
                .collect();
            par_zip2(&mut o, &a, &b, |o, a, b| o - a * b);
            assert_eq!(o, want);
            let want: Vec<f32> = a.iter().zip(&b).map(|(&a, &b)| a * b - 1.0).collect();
            assert_eq!(par_map2(&a, &b, |a, b| a * b - 1.0), want);
            assert_eq!(
                vectorized(
                    #[inline(always)]
                    || a.iter().sum::<f32>()
                ),
                a.iter().sum::<f32>()
            );
        }
    }
}
