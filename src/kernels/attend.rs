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
//!
//! `avx2` is the same with 8-lane vectors (x86-64 CPUs without AVX-512): each of the 16 lane
//! sums of a score is one lane of a pair of vectors, four cached positions per pass (the 16
//! registers hold their eight sums), reduced with the same pairwise additions; the weighted
//! values run 64 columns of one head per pass. `neon` is the same on aarch64's 4-lane vectors.
//! Both are tested bit for bit against [`portable`] too.

#[cfg(target_arch = "x86_64")]
use super::cpu::Isa;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
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
            let rows = (ks, vs);
            let done = match super::cpu::isa() {
                Isa::Avx512 => fast::attend(q32, rows, (kv.n, kv.width), hd, scale, o32),
                Isa::Avx2 => avx2::attend(q32, rows, (kv.n, kv.width), hd, scale, o32),
                _ => false,
            };
            if done {
                return;
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    if let (Some(q32), Some(ks), Some(vs)) = (T::f32s(q), C::rows(kv.ks), C::rows(kv.vs)) {
        if let Some(o32) = T::f32s_mut(out) {
            let scale = scale.to_f64() as f32;
            if super::cpu::isa() == super::cpu::Isa::Neon
                && neon::attend(q32, (ks, vs), (kv.n, kv.width), hd, scale, o32)
            {
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

/// [`fast`] with AVX2: the same sums in the same order on 8-lane vectors (see the module's
/// documentation).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::KvRows;

    /// 8 consecutive cached values from element `at`, as f32 lanes.
    trait Lanes: Copy {
        /// # Safety
        /// `at..at + 8` lies inside the slice; the CPU has AVX2.
        unsafe fn load8(self, at: usize) -> __m256;
        fn len(self) -> usize;
    }

    impl Lanes for &[f32] {
        #[inline(always)]
        unsafe fn load8(self, at: usize) -> __m256 {
            // SAFETY: per the contract.
            unsafe { _mm256_loadu_ps(self.as_ptr().add(at)) }
        }
        fn len(self) -> usize {
            <[f32]>::len(self)
        }
    }

    impl Lanes for &[u16] {
        #[inline(always)]
        unsafe fn load8(self, at: usize) -> __m256 {
            // SAFETY: per the contract; bf16 bits widened to the high half of f32 bits.
            unsafe {
                let h = _mm_loadu_si128(self.as_ptr().add(at) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
        fn len(self) -> usize {
            <[u16]>::len(self)
        }
    }

    /// Runs the AVX2 path when it applies (head size 64, 128 or 256, AVX2 and FMA, sizes that
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
            && super::super::cpu::Isa::Avx2.here();
        if !ok {
            return false;
        }
        // SAFETY: AVX2 and FMA are present; `run` checks the cache lengths.
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
    /// The CPU has AVX2 and FMA; `hd` is 64, 128 or 256 and divides `width` and `q.len()`;
    /// the query heads are a multiple of the KV heads; `out` is as long as `q`.
    #[target_feature(enable = "avx2,fma")]
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
        // SAFETY (scores): every load reads positions < n of the cache (checked above) and
        // query head h's hd values; the stores write positions j0..j0+bn < n of row h.
        unsafe {
            for j0 in (0..n).step_by(16) {
                let block = (n - j0).min(16);
                for h in 0..heads {
                    let (g, qh) = (h / rep * hd, q.as_ptr().add(h * hd));
                    for p0 in (0..block).step_by(4) {
                        let bn = (block - p0).min(4);
                        // Lanes 0-7 and 8-15 of each position's 16 lane sums.
                        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                        for c in (0..hd).step_by(16) {
                            let (q0, q1) =
                                (_mm256_loadu_ps(qh.add(c)), _mm256_loadu_ps(qh.add(c + 8)));
                            for (p, a) in acc.iter_mut().enumerate().take(bn) {
                                let at = (j0 + p0 + p) * width + g + c;
                                a[0] = _mm256_add_ps(a[0], _mm256_mul_ps(q0, ks.load8(at)));
                                a[1] = _mm256_add_ps(a[1], _mm256_mul_ps(q1, ks.load8(at + 8)));
                            }
                        }
                        // dot_tree's `pairwise(lanes) + tail` (the tail is 0.0: hd % 16 == 0).
                        let s = _mm_add_ps(reduce4(&acc), _mm_setzero_ps());
                        let s = _mm_mul_ps(s, _mm_set1_ps(scale));
                        let mut four = [0f32; 4];
                        _mm_storeu_ps(four.as_mut_ptr(), s);
                        w[h * n + j0 + p0..][..bn].copy_from_slice(&four[..bn]);
                    }
                }
            }
        }
        super::softmax_rows(&mut w, n);
        // Values: per block of 16 positions, each query head's output in passes of 64
        // columns (8 accumulator vectors), carried in `out` from block to block.
        out.fill(0.0);
        for j0 in (0..n).step_by(16) {
            let rows = j0..(j0 + 16).min(n);
            for h in 0..heads {
                let g = h / rep * hd;
                for c0 in (0..hd).step_by(64) {
                    // SAFETY: head h < heads, its row of `w` and `out`, positions < n of the
                    // cache, columns g + c0..g + c0 + 64 inside each row.
                    unsafe {
                        values(
                            vs,
                            rows.clone(),
                            (&w[h * n..][..n], width, g + c0),
                            &mut out[h * hd + c0..][..64],
                        )
                    };
                }
            }
        }
    }

    /// `out[..64] += Σ_{j ∈ rows} w[j]·v_j[col..col + 64]`, in position order, each product
    /// rounded before its sum (as the portable loop's `o += p·v`).
    ///
    /// # Safety
    /// AVX2; `w` covers `rows`; the cache holds rows `rows` of `width` with columns
    /// `col..col + 64` inside each; `out` holds 64 values.
    #[inline(always)]
    unsafe fn values<L: Lanes>(
        vs: L,
        rows: std::ops::Range<usize>,
        (w, width, col): (&[f32], usize, usize),
        out: &mut [f32],
    ) {
        // SAFETY: per the contract.
        unsafe {
            let o = out.as_mut_ptr();
            let mut acc = [_mm256_setzero_ps(); 8];
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(o.add(8 * c));
            }
            for j in rows {
                let p = _mm256_set1_ps(*w.get_unchecked(j));
                for (c, a) in acc.iter_mut().enumerate() {
                    let v = vs.load8(j * width + col + 8 * c);
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(p, v));
                }
            }
            for (c, &a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(8 * c), a);
            }
        }
    }

    /// Lane `p` of the result is position `p`'s 16 lane sums (lanes 0-7 in `acc[p][0]`, 8-15
    /// in `acc[p][1]`) combined pairwise exactly as `elem::pairwise` does: 8 + 8 (the two
    /// vectors), 4 + 4 (the 128-bit halves), 2 + 2 and 1 + 1 (within halves), four positions
    /// at once.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn reduce4(acc: &[[__m256; 2]; 4]) -> __m128 {
        // Level 1: x[i] + x[i+8].
        let s: [__m256; 4] = std::array::from_fn(|p| _mm256_add_ps(acc[p][0], acc[p][1]));
        // Level 2: x[i] + x[i+4]; u0 = [s0 (4), s1 (4)], u1 = [s2, s3].
        let pair = |a: __m256, b: __m256| {
            let lo = _mm256_permute2f128_ps::<0x20>(a, b);
            let hi = _mm256_permute2f128_ps::<0x31>(a, b);
            _mm256_add_ps(lo, hi)
        };
        let (u0, u1) = (pair(s[0], s[1]), pair(s[2], s[3]));
        // Level 3: x[i] + x[i+2] within 128-bit halves: [s0 (2), s2 (2) | s1 (2), s3 (2)].
        let lo = _mm256_shuffle_ps::<0b01_00_01_00>(u0, u1);
        let hi = _mm256_shuffle_ps::<0b11_10_11_10>(u0, u1);
        let t = _mm256_add_ps(lo, hi);
        // Level 4: x[0] + x[1]: [s0, s2, s0, s2 | s1, s3, s1, s3].
        let lo = _mm256_shuffle_ps::<0b10_00_10_00>(t, t);
        let hi = _mm256_shuffle_ps::<0b11_01_11_01>(t, t);
        let r = _mm256_add_ps(lo, hi);
        // [s0, s1, s2, s3].
        _mm_unpacklo_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps::<1>(r))
    }
}

/// [`fast`] with NEON (aarch64): the same sums in the same order on 4-lane vectors: each of
/// the 16 lane sums of a score is one lane of four vectors, four cached positions per pass,
/// reduced with the same pairwise additions; the weighted values run 64 columns of one head
/// per pass (16 accumulator vectors).
#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::KvRows;

    /// 4 consecutive cached values from element `at`, as f32 lanes.
    trait Lanes: Copy {
        /// # Safety
        /// `at..at + 4` lies inside the slice.
        unsafe fn load4(self, at: usize) -> float32x4_t;
        fn len(self) -> usize;
    }

    impl Lanes for &[f32] {
        #[inline(always)]
        unsafe fn load4(self, at: usize) -> float32x4_t {
            // SAFETY: per the contract.
            unsafe { vld1q_f32(self.as_ptr().add(at)) }
        }
        fn len(self) -> usize {
            <[f32]>::len(self)
        }
    }

    impl Lanes for &[u16] {
        #[inline(always)]
        unsafe fn load4(self, at: usize) -> float32x4_t {
            // SAFETY: per the contract; bf16 bits widened to the high half of f32 bits.
            unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(self.as_ptr().add(at)))) }
        }
        fn len(self) -> usize {
            <[u16]>::len(self)
        }
    }

    /// Runs the NEON path when it applies (head size 64, 128 or 256, sizes that agree); false
    /// leaves `out` to the portable loop.
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
            && out.len() == q.len();
        if !ok {
            return false;
        }
        // SAFETY: NEON is part of the target; `run` checks the cache lengths.
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
    /// `hd` is 64, 128 or 256 and divides `width` and `q.len()`; the query heads are a
    /// multiple of the KV heads; `out` is as long as `q`.
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
        let mut w = vec![0f32; heads * n];
        // SAFETY (scores): every load reads positions < n of the cache (checked above) and
        // query head h's hd values; the stores write positions < n of row h.
        unsafe {
            for j0 in (0..n).step_by(16) {
                let block = (n - j0).min(16);
                for h in 0..heads {
                    let (g, qh) = (h / rep * hd, q.as_ptr().add(h * hd));
                    for p0 in (0..block).step_by(4) {
                        let bn = (block - p0).min(4);
                        // Lanes 0-3, 4-7, 8-11 and 12-15 of each position's 16 lane sums.
                        let mut acc = [[vdupq_n_f32(0.0); 4]; 4];
                        for c in (0..hd).step_by(16) {
                            let qc: [float32x4_t; 4] =
                                std::array::from_fn(|i| vld1q_f32(qh.add(c + 4 * i)));
                            for (p, a) in acc.iter_mut().enumerate().take(bn) {
                                let at = (j0 + p0 + p) * width + g + c;
                                for (i, a) in a.iter_mut().enumerate() {
                                    *a = vaddq_f32(*a, vmulq_f32(qc[i], ks.load4(at + 4 * i)));
                                }
                            }
                        }
                        // dot_tree's `pairwise(lanes) + tail` (the tail is 0.0: hd % 16 == 0).
                        let s = vaddq_f32(reduce4(&acc), vdupq_n_f32(0.0));
                        let s = vmulq_f32(s, vdupq_n_f32(scale));
                        let mut four = [0f32; 4];
                        vst1q_f32(four.as_mut_ptr(), s);
                        w[h * n + j0 + p0..][..bn].copy_from_slice(&four[..bn]);
                    }
                }
            }
        }
        super::softmax_rows(&mut w, n);
        out.fill(0.0);
        for j0 in (0..n).step_by(16) {
            let rows = j0..(j0 + 16).min(n);
            for h in 0..heads {
                let g = h / rep * hd;
                for c0 in (0..hd).step_by(64) {
                    // SAFETY: head h < heads, its row of `w` and `out`, positions < n of the
                    // cache, columns g + c0..g + c0 + 64 inside each row.
                    unsafe {
                        values(
                            vs,
                            rows.clone(),
                            (&w[h * n..][..n], width, g + c0),
                            &mut out[h * hd + c0..][..64],
                        )
                    };
                }
            }
        }
    }

    /// `out[..64] += Σ_{j ∈ rows} w[j]·v_j[col..col + 64]`, in position order, each product
    /// rounded before its sum (as the portable loop's `o += p·v`).
    ///
    /// # Safety
    /// `w` covers `rows`; the cache holds rows `rows` of `width` with columns `col..col + 64`
    /// inside each; `out` holds 64 values.
    #[inline(always)]
    unsafe fn values<L: Lanes>(
        vs: L,
        rows: std::ops::Range<usize>,
        (w, width, col): (&[f32], usize, usize),
        out: &mut [f32],
    ) {
        // SAFETY: per the contract.
        unsafe {
            let o = out.as_mut_ptr();
            let mut acc: [float32x4_t; 16] = std::array::from_fn(|c| vld1q_f32(o.add(4 * c)));
            for j in rows {
                let p = vdupq_n_f32(*w.get_unchecked(j));
                for (c, a) in acc.iter_mut().enumerate() {
                    let v = vs.load4(j * width + col + 4 * c);
                    *a = vaddq_f32(*a, vmulq_f32(p, v));
                }
            }
            for (c, &a) in acc.iter().enumerate() {
                vst1q_f32(o.add(4 * c), a);
            }
        }
    }

    /// Lane `p` of the result is position `p`'s 16 lane sums (`acc[p][i]` holds lanes
    /// 4i..4i+4) combined pairwise exactly as `elem::pairwise` does: 8 + 8 and 4 + 4 as
    /// vector adds, then 2 + 2 (the halves of each vector, two positions per vector) and
    /// 1 + 1 (adjacent pairs), four positions at once.
    ///
    /// # Safety
    /// NEON (always present on aarch64).
    #[inline(always)]
    unsafe fn reduce4(acc: &[[float32x4_t; 4]; 4]) -> float32x4_t {
        // SAFETY: NEON per the contract.
        unsafe {
            // x[i] + x[i+8], then x[i] + x[i+4]: one vector of 4 lanes per position.
            let s: [float32x4_t; 4] = std::array::from_fn(|p| {
                let l1 = [
                    vaddq_f32(acc[p][0], acc[p][2]),
                    vaddq_f32(acc[p][1], acc[p][3]),
                ];
                vaddq_f32(l1[0], l1[1])
            });
            // x[i] + x[i+2]: [s0 (2), s1 (2)] and [s2 (2), s3 (2)].
            let half = |a: float32x4_t, b: float32x4_t| {
                let lo = vcombine_f32(vget_low_f32(a), vget_low_f32(b));
                let hi = vcombine_f32(vget_high_f32(a), vget_high_f32(b));
                vaddq_f32(lo, hi)
            };
            // x[0] + x[1]: adjacent pairs, [s0, s1, s2, s3].
            vpaddq_f32(half(s[0], s[1]), half(s[2], s[3]))
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

    /// The AVX-512 and AVX2 paths against the portable loop, bit for bit: head sizes
    /// 64/128/256, one to four (and seven) query heads per KV head, positions from 1 to past
    /// several blocks of 16 (with a partial block), caches of f32 and of bf16 bits. Each path
    /// this CPU has is called directly and must accept every case (else the test would
    /// compare the portable loop with itself). Skipped (with a line) on a CPU with neither.
    #[test]
    fn vector_paths_equal_the_portable_loop_bit_for_bit() {
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        {
            use super::super::cpu::Isa;
            use super::super::elem::KvRows;
            type Path =
                fn(&[f32], (KvRows, KvRows), (usize, usize), usize, f32, &mut [f32]) -> bool;
            let paths: Vec<(&str, Path)> = [
                #[cfg(target_arch = "x86_64")]
                ("AVX-512", super::fast::attend as Path, Isa::Avx512),
                #[cfg(target_arch = "x86_64")]
                ("AVX2", super::avx2::attend as Path, Isa::Avx2),
                #[cfg(target_arch = "aarch64")]
                ("NEON", super::neon::attend as Path, Isa::Neon),
            ]
            .into_iter()
            .filter(|(_, _, isa)| isa.here())
            .map(|(name, path, _)| (name, path))
            .collect();
            if paths.is_empty() {
                eprintln!("skipped: this CPU has no AVX-512, AVX2 or NEON");
                return;
            }
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            for hd in [64usize, 128, 256] {
                for (heads, kv_heads) in [(1usize, 1usize), (9, 3), (8, 2), (14, 2), (4, 4), (6, 2)]
                {
                    for n in [1usize, 3, 5, 16, 17, 40, 113] {
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
                        let mut want_f32 = vec![0f32; q.len()];
                        portable(&q, &f32_kv, hd, scale, &mut want_f32);
                        let mut want_bf16 = vec![0f32; q.len()];
                        portable(&q, &bf16_kv, hd, scale, &mut want_bf16);
                        for (name, path) in &paths {
                            let case = format!("{name}: hd {hd}, {heads}/{kv_heads} heads, n {n}");
                            for (rows, want, cache) in [
                                (
                                    (f32::rows(&ks).unwrap(), f32::rows(&vs).unwrap()),
                                    &want_f32,
                                    "f32",
                                ),
                                (
                                    (Bf16::rows(&kb).unwrap(), Bf16::rows(&vb).unwrap()),
                                    &want_bf16,
                                    "bf16",
                                ),
                            ] {
                                let mut got = vec![0f32; q.len()];
                                let ran = path(&q, rows, (n, width), hd, scale, &mut got);
                                assert!(ran, "{case}: the path refused a {cache} cache");
                                for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                                    assert_eq!(
                                        g.to_bits(),
                                        w.to_bits(),
                                        "{case}, {cache} cache, element {i}: {g} vs {w}"
                                    );
                                }
                            }
                        }
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
