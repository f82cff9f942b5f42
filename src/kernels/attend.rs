//! Decode attention: one new token's query heads over its sequence's cached keys and values,
//! `out[h] = Σ_j softmax_j(q_h·k_j·scale) v_j` (query head `h` reads KV head
//! `h / (heads / kv_heads)`).
//!
//! [`attend`] picks the path. [`portable`] is the reference: generic over the element type,
//! vectorized by the compiler. In f32 with head sizes 64, 128 or 256 on a CPU with AVX-512,
//! `fast` computes the same sums in the same order with explicit 16-lane vectors (tested bit
//! for bit against [`portable`]): the compiler kept `portable`'s 16 lane sums per dot product
//! in eight 2-lane registers, so each score cost ~4× its products, and the weighted sum of
//! values stored and reloaded the output per cached row. `fast` instead
//! - scores 16 cached positions per pass and combines their 16 lane sums with one transposing
//!   reduction (shuffles and adds on whole vectors: the same pairwise additions, lane for
//!   lane, as [`dot_tree`]'s, ~3 instructions per score instead of ~8);
//! - sums the values of up to four query heads sharing a KV head in registers;
//! - walks the cache in blocks of 16 whole rows, so that each block is read from memory once
//!   and reread from L1 by every head;
//! - asks for the next block's keys (into L1) and the block's values (into L2, for the second
//!   pass) while it scores, a share per head: without, the loads of each block waited on
//!   memory (greedy generation 32×128 +11 %).

#[cfg(target_arch = "x86_64")]
use super::elem::KvRows;
use super::elem::{dot_tree, max, sum, Elem, KvElem};
use super::simd::vectorized;

/// One sequence's cached keys and values: position `j`'s `[kv_heads, head_dim]` row at
/// `j·width`, positions `0..n`.
pub struct Kv<'a, C> {
    pub ks: &'a [C],
    pub vs: &'a [C],
    pub n: usize,
    pub width: usize,
}

/// Causal attention of one token's query heads `q [heads, hd]` over `kv` into `out
/// [heads, hd]`.
pub fn attend<T: Elem, C: KvElem<T>>(q: &[T], kv: &Kv<C>, hd: usize, scale: T, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(q32), Some(ks), Some(vs)) = (T::f32s(q), C::rows(kv.ks), C::rows(kv.vs)) {
        if let Some(o32) = T::f32s_mut(out) {
            let scale = scale.to_f64() as f32;
            if fast::attend(q32, (ks, vs), (kv.n, kv.width), hd, scale, o32) {
                return;
            }
        }
    }
    vectorized(
        #[inline(always)]
        || portable(q, kv, hd, scale, out),
    )
}

/// The reference loop: for each cached row (converted once to `T`), every head's score as a
/// [`dot_tree`]; a softmax per head ([`softmax_rows`]); then each row's values added into
/// every head's output in position order.
#[inline(always)]
pub fn portable<T: Elem, C: KvElem<T>>(q: &[T], kv: &Kv<C>, hd: usize, scale: T, out: &mut [T]) {
    let heads = q.len() / hd;
    let rep = heads / (kv.width / hd).max(1);
    let n = kv.n;
    // [heads, n] scores, then probabilities.
    let mut w = vec![T::zero(); heads * n];
    // One cached row of keys (then values) in T, converted once for all heads.
    let mut row = vec![T::zero(); kv.width];
    for j in 0..n {
        let k = &kv.ks[j * kv.width..][..kv.width];
        row.iter_mut().zip(k).for_each(|(r, &c)| *r = c.load());
        for (h, qh) in q.chunks_exact(hd).enumerate() {
            w[h * n + j] = dot_tree(qh, &row[h / rep * hd..][..hd]) * scale;
        }
    }
    softmax_rows(&mut w, n);
    out.fill(T::zero());
    for j in 0..n {
        let v = &kv.vs[j * kv.width..][..kv.width];
        row.iter_mut().zip(v).for_each(|(r, &c)| *r = c.load());
        for (h, oh) in out.chunks_exact_mut(hd).enumerate() {
            let p = w[h * n + j];
            let vh = &row[h / rep * hd..][..hd];
            oh.iter_mut().zip(vh).for_each(|(o, &vv)| *o += p * vv);
        }
    }
}

/// Each row of `w` (`n` wide) turned into its softmax: `e^(w − max) / Σ`.
#[inline(always)]
fn softmax_rows<T: Elem>(w: &mut [T], n: usize) {
    for wh in w.chunks_exact_mut(n) {
        let mx = max(wh);
        for v in wh.iter_mut() {
            *v = (*v - mx).exp_fast();
        }
        let inv = sum(wh).recip();
        for v in wh.iter_mut() {
            *v *= inv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod fast {
    use std::arch::x86_64::*;

    use super::KvRows;

    /// 16 consecutive cached values from element `at`, as f32 lanes.
    trait Lanes: Copy {
        /// # Safety
        /// `at..at + 16` lies inside the slice; the CPU has AVX-512F.
        unsafe fn load16(self, at: usize) -> __m512;
        fn len(self) -> usize;
        /// Element `at`'s address (for prefetching; `at` ≤ `len`).
        fn addr(self, at: usize) -> *const i8;
    }

    /// Asks for cached values `from..to` (clamped to the slice) to be brought into the cache
    /// level `HINT` names, one request per 64-byte line: a decode step's attention reads each
    /// sequence's cache once, and waited on those loads more than it computed (`perf
    /// annotate`: most samples on the instruction after each cache load).
    #[inline(always)]
    fn prefetch<L: Lanes, const HINT: i32>(c: L, from: usize, to: usize) {
        let (from, to) = (from.min(c.len()), to.min(c.len()));
        let (a, b) = (c.addr(from) as usize, c.addr(to) as usize);
        let mut line = a & !63;
        while line < b {
            // SAFETY: a prefetch never faults; the address lies inside the slice's lines.
            unsafe { _mm_prefetch::<HINT>(line as *const i8) };
            line += 64;
        }
    }

    impl Lanes for &[f32] {
        #[inline(always)]
        unsafe fn load16(self, at: usize) -> __m512 {
            // SAFETY: per the contract.
            unsafe { _mm512_loadu_ps(self.as_ptr().add(at)) }
        }
        fn len(self) -> usize {
            <[f32]>::len(self)
        }
        fn addr(self, at: usize) -> *const i8 {
            self[at..].as_ptr().cast()
        }
    }

    impl Lanes for &[u16] {
        #[inline(always)]
        unsafe fn load16(self, at: usize) -> __m512 {
            // SAFETY: per the contract; bf16 bits widened to the high half of f32 bits.
            unsafe {
                let h = _mm256_loadu_si256(self.as_ptr().add(at) as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
        fn len(self) -> usize {
            <[u16]>::len(self)
        }
        fn addr(self, at: usize) -> *const i8 {
            self[at..].as_ptr().cast()
        }
    }

    /// Runs the AVX-512 path when it applies (head size 64, 128 or 256, AVX-512F, sizes that
    /// agree); false leaves `out` to the portable loop.
    pub(super) fn attend(
        q: &[f32],
        (ks, vs): (KvRows, KvRows),
        (n, width): (usize, usize),
        hd: usize,
        scale: f32,
        out: &mut [f32],
    ) -> bool {
        let kv_heads = width / hd.max(1);
        let ok = matches!(hd, 64 | 128 | 256)
            && n > 0
            && width.is_multiple_of(hd)
            && kv_heads > 0
            && q.len().is_multiple_of(hd)
            && (q.len() / hd).is_multiple_of(kv_heads)
            && out.len() == q.len()
            && std::arch::is_x86_feature_detected!("avx512f");
        if !ok {
            return false;
        }
        // SAFETY: AVX-512F is present; `run` checks the cache lengths.
        unsafe {
            match (ks, vs) {
                (KvRows::F32(k), KvRows::F32(v)) => run(q, k, v, n, width, hd, scale, out),
                (KvRows::Bf16(k), KvRows::Bf16(v)) => run(q, k, v, n, width, hd, scale, out),
                _ => return false,
            }
        }
        true
    }

    /// # Safety
    /// The CPU has AVX-512F; `hd` is 64, 128 or 256 and divides `width` and `q.len()`; the
    /// query heads are a multiple of the KV heads; `out` is as long as `q`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn run<L: Lanes>(
        q: &[f32],
        ks: L,
        vs: L,
        n: usize,
        width: usize,
        hd: usize,
        scale: f32,
        out: &mut [f32],
    ) {
        assert!(ks.len() >= n * width && vs.len() >= n * width);
        let heads = q.len() / hd;
        let kv_heads = width / hd;
        let rep = heads / kv_heads;
        // [heads, n] scores, then probabilities.
        let mut w = vec![0f32; heads * n];
        // Both passes walk the cache in blocks of 16 positions (16 whole rows, contiguous),
        // so each block comes from memory once and is then reread from L1 by every head.
        // SAFETY (scores): every load reads positions < n of the cache (checked above) and
        // query head h's hd values; the masked store writes positions j0..j0+bn < n of row h.
        unsafe {
            for j0 in (0..n).step_by(16) {
                let bn = (n - j0).min(16);
                for h in 0..heads {
                    // The next block's keys to L1 and this block's values (read by the second
                    // pass) to L2, a share per head (a burst of requests stalls on the
                    // core's fill buffers).
                    let share = |i: usize| (j0 + i) * width + (h * 16 * width).div_ceil(heads);
                    prefetch::<L, _MM_HINT_T0>(
                        ks,
                        share(16),
                        share(16) + (16 * width).div_ceil(heads),
                    );
                    prefetch::<L, _MM_HINT_T1>(
                        vs,
                        share(0),
                        share(0) + (16 * width).div_ceil(heads),
                    );
                    let (g, qh) = (h / rep * hd, q.as_ptr().add(h * hd));
                    let mut acc = [_mm512_setzero_ps(); 16];
                    for c in (0..hd).step_by(16) {
                        let qc = _mm512_loadu_ps(qh.add(c));
                        for (p, a) in acc.iter_mut().enumerate() {
                            if p < bn {
                                let k = ks.load16((j0 + p) * width + g + c);
                                *a = _mm512_add_ps(*a, _mm512_mul_ps(qc, k));
                            }
                        }
                    }
                    // dot_tree's `pairwise(lanes) + tail` (the tail is 0.0: hd % 16 == 0).
                    let s = _mm512_add_ps(reduce16(&acc), _mm512_setzero_ps());
                    let s = _mm512_mul_ps(s, _mm512_set1_ps(scale));
                    let mask = ((1u32 << bn) - 1) as __mmask16;
                    _mm512_mask_storeu_ps(w.as_mut_ptr().add(h * n + j0), mask, s);
                }
            }
        }
        super::softmax_rows(&mut w, n);
        // Values: per block, the query heads of each KV head in passes of up to 16
        // accumulator vectors, carried in `out` from block to block.
        out.fill(0.0);
        let vc = hd / 16;
        let most = 16 / vc;
        for j0 in (0..n).step_by(16) {
            let rows = j0..(j0 + 16).min(n);
            for g in 0..kv_heads {
                let heads_of = g * rep..(g + 1) * rep;
                for h0 in heads_of.clone().step_by(most) {
                    let r = most.min(heads_of.end - h0);
                    let at = (&w[..], n, width, g * hd, h0);
                    // SAFETY: as `values` requires: heads h0..h0+r < heads, their rows of `w`
                    // and `out`, positions < n of the cache.
                    unsafe {
                        match (vc, r) {
                            (4, 1) => values::<L, 4, 1>(vs, rows.clone(), at, out),
                            (4, 2) => values::<L, 4, 2>(vs, rows.clone(), at, out),
                            (4, 3) => values::<L, 4, 3>(vs, rows.clone(), at, out),
                            (4, 4) => values::<L, 4, 4>(vs, rows.clone(), at, out),
                            (8, 1) => values::<L, 8, 1>(vs, rows.clone(), at, out),
                            (8, 2) => values::<L, 8, 2>(vs, rows.clone(), at, out),
                            (16, 1) => values::<L, 16, 1>(vs, rows.clone(), at, out),
                            _ => unreachable!("head size {hd} with {r} heads per pass"),
                        }
                    }
                }
            }
        }
    }

    /// `out[h] += Σ_{j ∈ rows} w[h, j]·v_j` for the `R` heads `h0..h0+R` of the KV head whose
    /// values start at column `g` of a cached row (`VC` vectors of 16), in position order,
    /// each product rounded before its sum (as the portable loop's `o += p·v`).
    ///
    /// # Safety
    /// AVX-512F; rows `h0..h0+R` of `w [heads, n]` and `out [heads, 16·VC]` exist; the cache
    /// holds rows `rows` (< n) of `width` with columns `g..g + 16·VC` inside each.
    #[inline(always)]
    unsafe fn values<L: Lanes, const VC: usize, const R: usize>(
        vs: L,
        rows: std::ops::Range<usize>,
        (w, n, width, g, h0): (&[f32], usize, usize, usize, usize),
        out: &mut [f32],
    ) {
        // SAFETY: per the contract.
        unsafe {
            // Head h0 + r's output values 16·c..16·c + 16.
            let base = out.as_mut_ptr();
            let o = |r: usize, c: usize| base.add((h0 + r) * 16 * VC + 16 * c);
            let mut acc = [[_mm512_setzero_ps(); VC]; R];
            for (r, a) in acc.iter_mut().enumerate() {
                for (c, x) in a.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(o(r, c));
                }
            }
            for j in rows {
                let mut v = [_mm512_setzero_ps(); VC];
                for (c, x) in v.iter_mut().enumerate() {
                    *x = vs.load16(j * width + g + 16 * c);
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let p = _mm512_set1_ps(*w.get_unchecked((h0 + r) * n + j));
                    for (a, &x) in a.iter_mut().zip(&v) {
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(p, x));
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (c, &x) in a.iter().enumerate() {
                    _mm512_storeu_ps(o(r, c), x);
                }
            }
        }
    }

    /// Lane `p` of the result is `acc[p]`'s 16 lanes combined pairwise, exactly as
    /// `elem::pairwise` does (8 + 8, then 4 + 4, 2 + 2, 1 + 1), for all 16 at once: each level
    /// pairs two vectors, moving the halves to add side by side with one shuffle each, so
    /// that after four levels lane `4q + i` holds position `q + 4i`; a permutation puts
    /// positions in order.
    ///
    /// # Safety
    /// AVX-512F.
    #[inline(always)]
    unsafe fn reduce16(acc: &[__m512; 16]) -> __m512 {
        // SAFETY: AVX-512F per the contract.
        unsafe {
            // Level 1 (x[i] + x[i+8]): 128-bit quarters 0,1 of a and b against quarters 2,3;
            // vector k holds positions 2k (lanes 0..8) and 2k+1 (lanes 8..16).
            let mut l1 = [_mm512_setzero_ps(); 8];
            for (k, o) in l1.iter_mut().enumerate() {
                let (a, b) = (acc[2 * k], acc[2 * k + 1]);
                let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
                let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
                *o = _mm512_add_ps(lo, hi);
            }
            // Level 2 (x[i] + x[i+4]): quarter q of vector k holds position 4k+q.
            let mut l2 = [_mm512_setzero_ps(); 4];
            for (k, o) in l2.iter_mut().enumerate() {
                let (a, b) = (l1[2 * k], l1[2 * k + 1]);
                let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
                let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
                *o = _mm512_add_ps(lo, hi);
            }
            // Level 3 (x[i] + x[i+2]) within quarters: vector m's quarter q holds positions
            // 8m+q (lanes 0, 1) and 8m+4+q (lanes 2, 3).
            let mut l3 = [_mm512_setzero_ps(); 2];
            for (m, o) in l3.iter_mut().enumerate() {
                let (a, b) = (l2[2 * m], l2[2 * m + 1]);
                let lo = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
                let hi = _mm512_shuffle_ps::<0b11_10_11_10>(a, b);
                *o = _mm512_add_ps(lo, hi);
            }
            // Level 4 (x[0] + x[1]): quarter q holds positions q, 4+q, 8+q, 12+q.
            let lo = _mm512_shuffle_ps::<0b10_00_10_00>(l3[0], l3[1]);
            let hi = _mm512_shuffle_ps::<0b11_01_11_01>(l3[0], l3[1]);
            let s = _mm512_add_ps(lo, hi);
            // Position p sits in lane 4·(p mod 4) + p / 4.
            let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            _mm512_permutexvar_ps(idx, s)
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::super::elem::{Bf16, KvElem};
    use super::{portable, Kv};

    /// `len` values drawn uniformly from `(-r, r)`.
    fn uniform(rng: &mut rand::rngs::StdRng, len: usize, r: f32) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-r..r)).collect()
    }

    /// The AVX-512 path against the portable loop, bit for bit: head sizes 64/128/256, one to
    /// four (and seven) query heads per KV head, positions from 1 to past several blocks of
    /// 16 (with a partial block), caches of f32 and of bf16 bits. The path is called directly
    /// and must accept every case (else the test would compare the portable loop with
    /// itself). Skipped (with a line) on a CPU without AVX-512F.
    #[test]
    fn avx512_path_equals_the_portable_loop_bit_for_bit() {
        #[cfg(target_arch = "x86_64")]
        {
            if !std::arch::is_x86_feature_detected!("avx512f") {
                eprintln!("skipped: this CPU has no AVX-512F");
                return;
            }
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            for hd in [64usize, 128, 256] {
                for (heads, kv_heads) in [(1usize, 1usize), (9, 3), (8, 2), (14, 2), (4, 4), (6, 2)]
                {
                    for n in [1usize, 5, 16, 17, 40, 113] {
                        let width = kv_heads * hd;
                        let q = uniform(&mut rng, heads * hd, 2.0);
                        let (ks, vs) = (
                            uniform(&mut rng, n * width, 2.0),
                            uniform(&mut rng, n * width, 2.0),
                        );
                        let scale = 1.0 / (hd as f32).sqrt();
                        let kb: Vec<Bf16> = ks.iter().map(|&x| Bf16::store(x)).collect();
                        let vb: Vec<Bf16> = vs.iter().map(|&x| Bf16::store(x)).collect();
                        let (f32_kv, bf16_kv) = (
                            Kv {
                                ks: &ks[..],
                                vs: &vs[..],
                                n,
                                width,
                            },
                            Kv {
                                ks: &kb[..],
                                vs: &vb[..],
                                n,
                                width,
                            },
                        );
                        let mut want = vec![0f32; q.len()];
                        let check = |fast_ran: bool, got: &[f32], want: &[f32], what: &str| {
                            assert!(fast_ran, "{what}: the AVX-512 path refused hd {hd}, {heads}/{kv_heads} heads, n {n}");
                            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                                assert_eq!(
                                    g.to_bits(),
                                    w.to_bits(),
                                    "{what}: hd {hd}, {heads}/{kv_heads} heads, n {n}, element {i}: {g} vs {w}"
                                );
                            }
                        };
                        let mut got = vec![0f32; q.len()];
                        portable(&q, &f32_kv, hd, scale, &mut want);
                        let rows = (f32::rows(&ks).unwrap(), f32::rows(&vs).unwrap());
                        let ran = super::fast::attend(&q, rows, (n, width), hd, scale, &mut got);
                        check(ran, &got, &want, "f32 cache");
                        portable(&q, &bf16_kv, hd, scale, &mut want);
                        let rows = (Bf16::rows(&kb).unwrap(), Bf16::rows(&vb).unwrap());
                        let ran = super::fast::attend(&q, rows, (n, width), hd, scale, &mut got);
                        check(ran, &got, &want, "bf16 cache");
                    }
                }
            }
        }
    }

    /// The portable loop against attention written out in f64 (scores, softmax, weighted
    /// values) for a GQA case: within f32 rounding.
    #[test]
    fn portable_loop_is_attention() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (hd, heads, kv_heads, n) = (16usize, 4usize, 2usize, 7usize);
        let width = kv_heads * hd;
        let q = uniform(&mut rng, heads * hd, 1.0);
        let (ks, vs) = (
            uniform(&mut rng, n * width, 1.0),
            uniform(&mut rng, n * width, 1.0),
        );
        let scale = 0.25f32;
        let mut got = vec![0f32; heads * hd];
        portable(
            &q,
            &Kv {
                ks: &ks[..],
                vs: &vs[..],
                n,
                width,
            },
            hd,
            scale,
            &mut got,
        );
        for h in 0..heads {
            let g = h / (heads / kv_heads) * hd;
            let s: Vec<f64> = (0..n)
                .map(|j| {
                    (0..hd)
                        .map(|d| q[h * hd + d] as f64 * ks[j * width + g + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                let want: f64 = (0..n)
                    .map(|j| e[j] / z * vs[j * width + g + d] as f64)
                    .sum();
                let x = got[h * hd + d] as f64;
                assert!((x - want).abs() < 1e-5, "head {h} dim {d}: {x} vs {want}");
            }
        }
    }
}
