//! Matrix products in bf16 with f32 sums, on every CPU: with the instructions that multiply
//! bf16 where the CPU has them (Intel AMX tiles, AVX512-BF16 dot products, Arm's BFDOT), and
//! elsewhere with bf16 operands widened to f32 in registers for f32 FMA (AVX2, NEON, portable
//! loops).
//!
//! This is the arithmetic of verl's default mixed precision (bf16 operands, f32 accumulation,
//! f32 master weights): both operands are rounded to bf16 (nearest, ties to even), every
//! product of two bf16 values is exact in f32 and the sums are f32. Each kernel computes it:
//! - **AMX**: one `tdpbf16ps` multiplies a 16×32 bf16 tile by a 32×16 bf16 tile into a 16×16
//!   f32 tile; a core sustains ~3.7 TFLOP/s with it on a 4th-generation Xeon, ~16× its f32
//!   AVX-512 peak.
//! - **AVX512-BF16**: one `vdpbf16ps` adds to each of 16 f32 lanes the two products of a bf16
//!   pair; on Zen 5 it runs twice the f32 FMA rate (~490 against ~220 GFLOP/s per core).
//! - **AVX2** (every x86-64 CPU since Haswell / Zen 1): the pair's two bf16 values become f32
//!   by a shift and a mask (a bf16 is the upper half of an f32), then two FMAs, odd value
//!   first, as `vdpbf16ps` orders them: the same sums, bit for bit, on normal numbers. The
//!   operands stay bf16 in memory (half the bytes of f32); the arithmetic runs at the f32
//!   FMA rate.
//! - **BFDOT** (aarch64 with FEAT_BF16: Graviton 3/4, Apple M2 and later, Neoverse V1/V2/N2):
//!   `bfdot` adds the two products of a pair into each of 4 f32 lanes, the AVX512-BF16 shape.
//!   Arm lets it round the pair's sum its own way (not IEEE), so its results are compared
//!   with a tolerance.
//! - **NEON** (aarch64 without BF16): widened to f32 and FMA, as AVX2.
//! - **Portable**: the widened sums as a plain loop the compiler vectorizes for the target
//!   (`MAIN_PPO_CPU=portable`, and other architectures); bit-identical to the AVX2 kernel.
//!
//! ```text
//! dst[m, n] (+)= a[m, k] · b[k, n]
//! A tile (16 rows × 32 k, 64 bytes a row)       row i: a[i, k0..k0+32]
//! B tile (16 k-pairs × 16 columns × 2, VNNI)    row p: (b[k0+2p, j], b[k0+2p+1, j]) for j in 0..16
//! C tile (16 × 16 f32)                          C[i, j] += Σ_p Σ_e A[i, 2p+e] · B[p, j, e]
//! ```
//!
//! Operands are packed into that tile layout first for all kernels (k padded with zeros to a
//! multiple of 32, rows and columns to multiples of 32); a block of 32×32 outputs walks k. On
//! AMX four C tiles hold the block; with `vdpbf16ps` the block is four passes of 8 rows × 32
//! columns (16 accumulators in registers), each broadcasting A's pair `(a[i, 2p], a[i, 2p+1])`
//! against B tile row `p`, the same VNNI layout; the AVX2, NEON and BFDOT kernels walk the
//! same pairs in passes sized to their registers. Packing reads any (row, column) strides: on
//! AVX-512 the contiguous cases (a's rows, b's rows) convert 16 values per instruction and
//! the transposed ones go through a 16×16 transpose; elsewhere the packers are plain loops
//! compiled for the CPU's vector width.
//!
//! Linux must grant the process AMX's tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! [`kernel`] decides once per process, within the instruction set [`super::cpu::isa`]
//! chose: AMX where CPU and kernel allow it, else AVX512-BF16, else AVX2 on x86-64; BFDOT,
//! else NEON on aarch64; the portable loop otherwise. The AMX, AVX512-BF16 and BFDOT
//! instructions flush subnormal inputs and outputs to zero, as they define; the widening
//! kernels keep subnormals (products too small for a normal f32 are the only place where they
//! can differ from the dot-product instructions).

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::cpu::Isa;
use super::simd::Par;

#[path = "bf16_widen.rs"]
mod widen;

/// Values in one tile row (bf16) and tile rows.
const TK: usize = 32;
const TR: usize = 16;
/// u16 values in one packed tile.
const TILE: usize = TR * TK;
/// Output columns one task walks (its B panel stays in the core's L2 cache).
const NC: usize = 256;

/// The instructions of this process's bf16 products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Intel AMX tiles (`tdpbf16ps`).
    Amx,
    /// AVX512-BF16 dot products (`vdpbf16ps`).
    Avx512Bf16,
    /// bf16 widened to f32, AVX2 FMA.
    Avx2,
    /// Arm BF16 dot products (`bfdot`).
    Bfdot,
    /// bf16 widened to f32, NEON FMA.
    Neon,
    /// bf16 widened to f32 in a plain loop.
    Portable,
}

impl Kernel {
    /// Every kernel, in the order [`kernel`] prefers them.
    const ALL: [Kernel; 6] = [
        Kernel::Amx,
        Kernel::Avx512Bf16,
        Kernel::Avx2,
        Kernel::Bfdot,
        Kernel::Neon,
        Kernel::Portable,
    ];

    /// The name `MAIN_PPO_BF16_KERNEL` takes.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "amx",
            Kernel::Avx512Bf16 => "avx512bf16",
            Kernel::Avx2 => "avx2",
            Kernel::Bfdot => "bfdot",
            Kernel::Neon => "neon",
            Kernel::Portable => "portable",
        }
    }

    /// Whether the kernel widens bf16 to f32 for f32 FMA, reading A's tiles as f32 values
    /// ([`PackedA`] holds them widened for it).
    fn widens(self) -> bool {
        matches!(self, Kernel::Avx2 | Kernel::Neon | Kernel::Portable)
    }

    /// Whether the kernel runs on this CPU (and kernel) within the instruction set `isa`.
    fn runs_under(self, isa: Isa) -> bool {
        match self {
            Kernel::Amx => isa == Isa::Avx512 && amx(),
            Kernel::Avx512Bf16 => isa == Isa::Avx512 && avx512_bf16(),
            Kernel::Avx2 => matches!(isa, Isa::Avx512 | Isa::Avx2),
            Kernel::Bfdot => isa == Isa::Neon && arm_bf16(),
            Kernel::Neon => isa == Isa::Neon,
            Kernel::Portable => true,
        }
    }
}

/// The kernels this process may run ([`super::cpu::isa`]'s instruction set on this CPU),
/// in [`kernel`]'s order of preference.
fn kernels_under(isa: Isa) -> Vec<Kernel> {
    Kernel::ALL
        .into_iter()
        .filter(|k| k.runs_under(isa))
        .collect()
}

/// The bf16 kernel of this process (decided once): the first this CPU runs of AMX,
/// AVX512-BF16, AVX2, BFDOT, NEON and the portable loop, within the instruction set of
/// [`super::cpu::isa`]. `MAIN_PPO_BF16_KERNEL` names one instead (to compare them), or
/// `none` (products stay in the model's dtype: `None`); unset or `auto` chooses.
/// [`check_choice`] refuses other values at start-up.
pub fn kernel() -> Option<Kernel> {
    static K: OnceLock<Option<Kernel>> = OnceLock::new();
    *K.get_or_init(|| {
        let forced = std::env::var("MAIN_PPO_BF16_KERNEL").ok();
        let here = kernels_under(super::cpu::isa());
        match forced.as_deref().map(str::trim) {
            Some("none") => None,
            Some(name) if !matches!(name, "" | "auto") => {
                match here.iter().find(|k| k.name() == name) {
                    Some(&k) => Some(k),
                    None => panic!(
                        "MAIN_PPO_BF16_KERNEL: {}",
                        check_choice(Some(name)).unwrap_err()
                    ),
                }
            }
            _ => here.first().copied(),
        }
    })
}

/// Whether `value` (of `MAIN_PPO_BF16_KERNEL`) names a choice this process can honour: unset,
/// `auto`, `none`, or a kernel this CPU runs under the instruction set in use; anything else
/// is an error naming the value and the choices (the caller names the variable).
pub fn check_choice(value: Option<&str>) -> Result<(), String> {
    check_choice_under(value, super::cpu::isa())
}

fn check_choice_under(value: Option<&str>, isa: Isa) -> Result<(), String> {
    let here = kernels_under(isa);
    let offered = || {
        let names: Vec<&str> = here.iter().map(|k| k.name()).collect();
        format!("auto, none, {}", names.join(", "))
    };
    match value.map(str::trim) {
        None | Some("") | Some("auto") | Some("none") => Ok(()),
        Some(v) => match Kernel::ALL.into_iter().find(|k| k.name() == v) {
            Some(k) if here.contains(&k) => Ok(()),
            Some(k) => Err(format!(
                "`{v}`: this CPU (or its kernel) runs no {} products under the {} instruction \
                 set (MAIN_PPO_CPU); use {}",
                k.name(),
                isa.name(),
                offered()
            )),
            None => Err(format!(
                "`{v}` is not a choice: auto (the default), amx, avx512bf16, avx2, bfdot, neon, \
                 portable or none (here: {})",
                offered()
            )),
        },
    }
}

/// The bf16 kernel in use, in words (for the log).
pub fn describe() -> &'static str {
    match kernel() {
        Some(Kernel::Amx) => "AMX tiles",
        Some(Kernel::Avx512Bf16) => "AVX512-BF16 dot products",
        Some(Kernel::Avx2) => "bf16 operands widened to f32 for AVX2 FMA",
        Some(Kernel::Bfdot) => "BFDOT dot products",
        Some(Kernel::Neon) => "bf16 operands widened to f32 for NEON FMA",
        Some(Kernel::Portable) => "bf16 operands widened to f32 in portable loops",
        None => "none: MAIN_PPO_BF16_KERNEL=none, products stay f32",
    }
}

/// Whether this process runs bf16 products (any kernel; only `MAIN_PPO_BF16_KERNEL=none`
/// turns them off).
pub fn available() -> bool {
    kernel().is_some()
}

#[cfg(target_arch = "x86_64")]
fn avx512_bf16() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_bf16() -> bool {
    false
}

#[cfg(target_arch = "aarch64")]
fn arm_bf16() -> bool {
    std::arch::is_aarch64_feature_detected!("bf16")
}

#[cfg(not(target_arch = "aarch64"))]
fn arm_bf16() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        if !std::arch::is_x86_feature_detected!("avx512f")
            || !std::arch::is_x86_feature_detected!("avx512bw")
        {
            return false;
        }
        // CPUID leaf 7: EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE.
        let r = std::arch::x86_64::__cpuid_count(7, 0);
        if r.edx & (1 << 22) == 0 || r.edx & (1 << 24) == 0 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a syscall that only changes which register state the kernel lets this
        // process use.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    })
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx() -> bool {
    false
}

/// `x` rounded to bf16 (nearest, ties to even; NaN stays NaN).
#[inline(always)]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// `x` rounded to bf16 and back: what the AMX path multiplies.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// Tile count for `len` values padded to a multiple of 32 (two tiles of 16 per 32).
fn padded(len: usize) -> usize {
    len.div_ceil(2 * TR) * 2 * TR
}

/// The operand a tile feeds: A tiles hold 16 rows of 32 k-values each; B tiles 16 columns of
/// 32 k-values as VNNI pairs (tile row `q` = the pairs at k `2q`, `2q + 1` of every column).
#[derive(Clone, Copy)]
enum Side {
    A,
    B,
}

impl Side {
    /// Where run `i` (a row of A, a column of B) at k-position `kk` lies in a tile.
    fn at(self, i: usize, kk: usize) -> usize {
        match self {
            Side::A => i * TK + kk,
            Side::B => (kk / 2) * TK + 2 * i + kk % 2,
        }
    }
}

/// `runs` runs (rows of A or columns of B) of `k` values, value `kk` of run `i` at
/// `src[i·run_s + kk·k_s]`, as `side`'s tiles: tile `(t, kb)` at `(t·kbs + kb)·TILE` holds runs
/// `t·16..` and values `kb·32..`, zeros past the ends. Whole runs or whole k-columns in
/// contiguous memory go through the AVX-512 packers (edges included), others element by
/// element.
fn pack_tiles(
    src: &[f32],
    run_s: usize,
    k_s: usize,
    runs: usize,
    k: usize,
    side: Side,
    par: bool,
) -> Vec<u16> {
    let kbs = k.div_ceil(TK);
    // Where runs lie side by side in memory (`run_s == 1`), a tile reads one 64-byte line from
    // each of 32 source rows far apart; a task then packs several neighbouring panels together,
    // k-block by k-block, so that each source row is read in longer stretches.
    let group = if run_s == 1 { PANEL_GROUP } else { 1 };
    build_tiles(
        padded(runs) / TR * kbs * TILE,
        group * kbs * TILE,
        par,
        |g, panels| {
            let count = panels.len() / (kbs * TILE);
            for kb in 0..kbs {
                for j in 0..count {
                    let t = g * group + j;
                    let tile = &mut panels[(j * kbs + kb) * TILE..][..TILE];
                    let r = TR.min(runs.saturating_sub(t * TR));
                    if r == 0 {
                        zeroed(tile); // padding tiles
                        continue;
                    }
                    let (i0, k0) = (t * TR, kb * TK);
                    let len = TK.min(k - k0);
                    let base = i0 * run_s + k0 * k_s;
                    if k_s == 1 || run_s == 1 {
                        let packer = match side {
                            Side::A if k_s == 1 => Packer::Rows32,
                            Side::A => Packer::ColsPairsT,
                            Side::B if run_s == 1 => Packer::RowsPairs,
                            Side::B => Packer::Rows32T,
                        };
                        let stride = if k_s == 1 { run_s } else { k_s };
                        // SAFETY: runs i0..i0+r and values k0..k0+len are inside `src` (the
                        // callers assert the last run's last value); the packer reads nothing
                        // else and writes the tile's TILE values.
                        unsafe {
                            let (p, dst) = (src[base..].as_ptr(), tile.as_mut_ptr().cast());
                            packer.run(p, stride, r, len, dst);
                        }
                        continue;
                    }
                    let tile = zeroed(tile);
                    for i in 0..r {
                        for kk in 0..len {
                            tile[side.at(i, kk)] = bf16_bits(src[base + i * run_s + kk * k_s]);
                        }
                    }
                }
            }
        },
    )
}

/// Panels of 16 runs one packing task makes together when the runs lie side by side in memory
/// (see [`pack_tiles`]).
const PANEL_GROUP: usize = 4;

/// `b[k, n]` packed as B tiles for any number of products with it (a weight used by every
/// chunk of rows, every decode step).
pub struct PackedB {
    k: usize,
    n: usize,
    tiles: Vec<u16>,
}

impl PackedB {
    /// Tile `(ct, kb)` at `(ct·kbs + kb)·TILE` (VNNI pairs): element `(p, j, e)` =
    /// `b[kb·32 + 2p + e, ct·16 + j]`.
    pub fn new(b: &[f32], b_rs: usize, b_cs: usize, k: usize, n: usize, par: Par) -> Self {
        if k > 0 && n > 0 {
            assert!(b.len() > (k - 1) * b_rs + (n - 1) * b_cs);
        }
        let tiles = pack_tiles(b, b_cs, b_rs, n, k, Side::B, par == Par::Rayon);
        PackedB { k, n, tiles }
    }

    /// `B = [W_0; W_1; ...]ᵀ` packed from the parts as they are stored: part `i` holds `n_i`
    /// rows of `k` (a `[out, in]` weight, row-major), column `j` of `B` is row `j` of the
    /// parts stacked. The same tiles as [`PackedB::new`] on the stacked copy (`b_rs = 1`,
    /// `b_cs = k`), without making it: the decode engine packs every weight of the model at
    /// each step that changed them, and the copies (a concatenation, then a flat `Vec`) were
    /// twice the weights' f32 bytes in fresh pages.
    pub fn from_rows(parts: &[&[f32]], k: usize, par: Par) -> Self {
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut n = 0;
        for p in parts {
            assert_eq!(
                p.len() % k.max(1),
                0,
                "from_rows: a part is not whole rows of {k}"
            );
            starts.push(n);
            n += p.len() / k.max(1);
        }
        starts.push(n);
        let (cts, kbs) = (padded(n) / TR, k.div_ceil(TK));
        // Column j of B: (part, row) with starts[part] <= j < starts[part + 1].
        let locate = |j: usize| {
            let p = starts.partition_point(|&s| s <= j) - 1;
            (p, j - starts[p])
        };
        let tiles = build_tiles(
            cts * kbs * TILE,
            kbs * TILE,
            par == Par::Rayon,
            |ct, panel| {
                let c0 = ct * TR;
                let cols = TR.min(n.saturating_sub(c0));
                if cols == 0 {
                    zeroed(panel); // padding tiles
                    return;
                }
                let (p0, r0) = locate(c0);
                if r0 + cols <= starts[p0 + 1] - starts[p0] {
                    // The tile's columns are consecutive rows of one part.
                    let part = parts[p0];
                    for kb in 0..kbs {
                        let k0 = kb * TK;
                        // SAFETY: rows r0..r0+cols and inputs k0..k0+TK.min(k - k0) lie
                        // inside the part; the tile holds TILE values.
                        unsafe {
                            Packer::Rows32T.run(
                                part[r0 * k + k0..].as_ptr(),
                                k,
                                cols,
                                TK.min(k - k0),
                                panel[kb * TILE..][..TILE].as_mut_ptr().cast(),
                            )
                        };
                    }
                    return;
                }
                // Element by element, each column from its own part's row.
                let rows: Vec<&[f32]> = (c0..c0 + cols)
                    .map(|j| {
                        let (p, r) = locate(j);
                        &parts[p][r * k..][..k]
                    })
                    .collect();
                for kb in 0..kbs {
                    let tile = zeroed(&mut panel[kb * TILE..][..TILE]);
                    let k0 = kb * TK;
                    for (j, row) in rows.iter().enumerate() {
                        for kk in 0..TK.min(k - k0) {
                            tile[Side::B.at(j, kk)] = bf16_bits(row[k0 + kk]);
                        }
                    }
                }
            },
        );
        PackedB { k, n, tiles }
    }

    /// Rows (`k`) and columns (`n`) of the packed matrix.
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }
}

/// `f(index, chunk)` over `out`'s chunks of `len`, on rayon's threads or on this one.
fn each_chunk<T: Send>(out: &mut [T], len: usize, par: bool, f: impl Fn(usize, &mut [T]) + Sync) {
    if len == 0 {
        return;
    }
    if par {
        super::team::chunks(out, len, f);
    } else {
        out.chunks_mut(len).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// `len` packed values made chunk by chunk (`chunk` values each, as [`each_chunk`]) without
/// clearing them first: `f(i, values)` writes every value of chunk `i` — a whole tile by a
/// packer of [`simd`], or [`zeroed`] and then filled. (Clearing first was ~3 % of a GRPO step's
/// CPU time, in `memset`.) Builds with debug assertions (the tests) fill the buffer with a bf16
/// NaN first, so a value left unwritten shows in every product that reads it.
fn build_tiles(
    len: usize,
    chunk: usize,
    par: bool,
    f: impl Fn(usize, &mut [MaybeUninit<u16>]) + Sync,
) -> Vec<u16> {
    // SAFETY: `f` writes every value of each chunk, and the chunks cover the buffer.
    unsafe { super::alloc::filled_with(len, 0x7fc1, |values| each_chunk(values, chunk, par, f)) }
}

/// `values` set to zero, as initialised values.
fn zeroed(values: &mut [MaybeUninit<u16>]) -> &mut [u16] {
    values.fill(MaybeUninit::new(0));
    // SAFETY: every value was just written; MaybeUninit<u16> has u16's layout.
    unsafe { &mut *(values as *mut [MaybeUninit<u16>] as *mut [u16]) }
}

/// Whole-tile packing with AVX-512 (see [`Packer`]): 16 values converted per instruction, the
/// strided layouts through a 16×16 transpose of 32-bit pairs.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// The first `n` of 16 lanes (`n` ≥ 16: all).
    #[inline]
    pub fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    /// The f32 at `p` in lanes `m` (the others 0, never read) → bf16 bits in the low half of
    /// each 32-bit lane (nearest even; NaN quiet).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn conv16(p: *const f32, m: __mmask16) -> __m512i {
        // SAFETY: the caller guarantees the lanes of `m` readable at p; a masked load does not
        // touch the others.
        let b = unsafe { _mm512_maskz_loadu_epi32(m, p as *const i32) };
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            b,
            _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)),
        ));
        let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        _mm512_mask_mov_epi32(r, nan, quiet)
    }

    /// The first `len` (≤ 32) contiguous f32 at `p` → 32 bf16 in order, zeros after `len` (16
    /// pairs `(p[2i], p[2i+1])` as u32 lanes).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn conv32(p: *const f32, len: usize) -> __m512i {
        // SAFETY: the caller guarantees `len` readable f32 at p; the upper half is read only
        // when it has any.
        let lo = unsafe { conv16(p, lanes(len)) };
        let hi = match len > 16 {
            true => unsafe { conv16(p.add(16), lanes(len - 16)) },
            false => _mm512_setzero_si512(),
        };
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
            _mm512_cvtepi32_epi16(hi),
        )
    }

    /// Lanes of `lo` with those of `hi` as the upper halves: 16 pairs (lo_j, hi_j).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn pair(lo: __m512i, hi: __m512i) -> __m512i {
        _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi))
    }

    /// Transposes 16×16 32-bit values in registers: `out[c][r] = r_[r][c]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn transpose(r: [__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // u[4g + c]: column 4L + c of rows 4g..4g+4 in each 128-bit lane L.
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_unpacklo_epi64(a, c);
            u[4 * g + 1] = _mm512_unpackhi_epi64(a, c);
            u[4 * g + 2] = _mm512_unpacklo_epi64(b, d);
            u[4 * g + 3] = _mm512_unpackhi_epi64(b, d);
        }
        let mut v = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            v[c] = _mm512_shuffle_i32x4::<0x88>(u[c], u[c + 4]);
            v[c + 4] = _mm512_shuffle_i32x4::<0xdd>(u[c], u[c + 4]);
            v[c + 8] = _mm512_shuffle_i32x4::<0x88>(u[c + 8], u[c + 12]);
            v[c + 12] = _mm512_shuffle_i32x4::<0xdd>(u[c + 8], u[c + 12]);
        }
        let mut o = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            o[c] = _mm512_shuffle_i32x4::<0x88>(v[c], v[c + 8]);
            o[c + 4] = _mm512_shuffle_i32x4::<0x88>(v[c + 4], v[c + 12]);
            o[c + 8] = _mm512_shuffle_i32x4::<0xdd>(v[c], v[c + 8]);
            o[c + 12] = _mm512_shuffle_i32x4::<0xdd>(v[c + 4], v[c + 12]);
        }
        o
    }

    // Each packer writes a whole tile (512 u16 at `dst`) from its first `r` rows (A) or
    // columns (B) of 16 and first `len` of 32 values along k, zeros elsewhere: full tiles and
    // the edges of a matrix alike. Nothing outside those `r × len` values is read.

    /// An A tile whose rows are contiguous: row `i` = the f32 at `p + i·rs`.
    ///
    /// # Safety
    /// `r` ≤ 16 rows of `len` ≤ 32 readable f32 at `p` with stride `rs`; 512 writable u16 at
    /// `dst`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn rows32(p: *const f32, rs: usize, r: usize, len: usize, dst: *mut u16) {
        for i in 0..16 {
            let v = match i < r {
                // SAFETY: per the contract.
                true => unsafe { conv32(p.add(i * rs), len) },
                false => _mm512_setzero_si512(),
            };
            // SAFETY: per the contract.
            unsafe { _mm512_storeu_si512(dst.add(i * 32) as *mut __m512i, v) };
        }
    }

    /// A B tile of 32-bit pairs, transposed: tile row `q` lane `j` = the pair at `p + j·cs +
    /// 2q` (k runs contiguously in the source).
    ///
    /// # Safety
    /// `r` ≤ 16 runs of `len` ≤ 32 readable f32 at `p` with stride `cs`; 512 writable u16 at
    /// `dst`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn rows32_t(p: *const f32, cs: usize, r: usize, len: usize, dst: *mut u16) {
        let mut rows = [_mm512_setzero_si512(); 16];
        for (j, rj) in rows.iter_mut().enumerate().take(r) {
            // SAFETY: per the contract.
            *rj = unsafe { conv32(p.add(j * cs), len) };
        }
        for (i, o) in transpose(rows).into_iter().enumerate() {
            // SAFETY: per the contract.
            unsafe { _mm512_storeu_si512(dst.add(i * 32) as *mut __m512i, o) };
        }
    }

    /// The f32 at `p` in lanes `m`, when `k < len` (else zeros, nothing read).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn conv16_if(p: *const f32, k: usize, len: usize, m: __mmask16) -> __m512i {
        match k < len {
            // SAFETY: the caller's contract covers k < len.
            true => unsafe { conv16(p, m) },
            false => _mm512_setzero_si512(),
        }
    }

    /// A B tile of pairs from two rows each: tile row `q` = (`p[2q·rs + j]`, `p[(2q+1)·rs +
    /// j]`) for j < 16 (the columns run contiguously in the source).
    ///
    /// # Safety
    /// `len` ≤ 32 rows of `r` ≤ 16 readable f32 at `p` with stride `rs`; 512 writable u16 at
    /// `dst`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn rows_pairs(p: *const f32, rs: usize, r: usize, len: usize, dst: *mut u16) {
        let m = lanes(r);
        for q in 0..16 {
            let (k0, k1) = (2 * q, 2 * q + 1);
            // SAFETY: per the contract (rows k0, k1 read only below len).
            unsafe {
                let lo = conv16_if(p.wrapping_add(k0 * rs), k0, len, m);
                let hi = conv16_if(p.wrapping_add(k1 * rs), k1, len, m);
                _mm512_storeu_si512(dst.add(q * 32) as *mut __m512i, pair(lo, hi));
            }
        }
    }

    /// The same pairs, transposed: A tile row `i` lane `q` = (`p[2q·cs + i]`, `p[(2q+1)·cs +
    /// i]`) (A's rows run contiguously down its columns in the source).
    ///
    /// # Safety
    /// `len` ≤ 32 runs of `r` ≤ 16 readable f32 at `p` with stride `cs`; 512 writable u16 at
    /// `dst`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn cols_pairs_t(p: *const f32, cs: usize, r: usize, len: usize, dst: *mut u16) {
        let m = lanes(r);
        let mut rows = [_mm512_setzero_si512(); 16];
        for (q, rq) in rows.iter_mut().enumerate() {
            let (k0, k1) = (2 * q, 2 * q + 1);
            // SAFETY: per the contract (runs k0, k1 read only below len).
            *rq = unsafe {
                pair(
                    conv16_if(p.wrapping_add(k0 * cs), k0, len, m),
                    conv16_if(p.wrapping_add(k1 * cs), k1, len, m),
                )
            };
        }
        for (i, o) in transpose(rows).into_iter().enumerate() {
            // SAFETY: per the contract.
            unsafe { _mm512_storeu_si512(dst.add(i * 32) as *mut __m512i, o) };
        }
    }
}

/// The four whole-tile packers. Each writes a whole tile (512 u16 at `dst`) from its first
/// `r` rows (A) or columns (B) of 16 and first `len` of 32 values along k, zeros elsewhere:
/// full tiles and the edges of a matrix alike; nothing outside those `r × len` values is read.
/// With the AVX-512 instruction set they are [`simd`]'s (16 values per instruction), else
/// [`portable`]'s loops compiled for the CPU's vector width; the same bits either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Packer {
    /// An A tile whose rows are contiguous: row `i` = the f32 at `p + i·s`.
    Rows32,
    /// A B tile of pairs, transposed: tile row `q` lane `j` = the pair at `p + j·s + 2q` (k
    /// runs contiguously in the source).
    Rows32T,
    /// A B tile of pairs from two rows each: tile row `q` = (`p[2q·s + j]`, `p[(2q+1)·s +
    /// j]`) for j < 16 (the columns run contiguously in the source).
    RowsPairs,
    /// An A tile from columns: row `i` value `kk` = `p[kk·s + i]` (A's rows run contiguously
    /// down its columns in the source).
    ColsPairsT,
}

impl Packer {
    /// Packs one tile (see [`Packer`]).
    ///
    /// # Safety
    /// `r` ≤ 16 runs and `len` ≤ 32 values readable at `p` with the layout's stride `s`; 512
    /// writable u16 at `dst`.
    unsafe fn run(self, p: *const f32, s: usize, r: usize, len: usize, dst: *mut u16) {
        #[cfg(target_arch = "x86_64")]
        if super::cpu::isa() == Isa::Avx512 {
            // SAFETY: per this function's contract; AVX-512 F and BW are present.
            unsafe {
                match self {
                    Packer::Rows32 => simd::rows32(p, s, r, len, dst),
                    Packer::Rows32T => simd::rows32_t(p, s, r, len, dst),
                    Packer::RowsPairs => simd::rows_pairs(p, s, r, len, dst),
                    Packer::ColsPairsT => simd::cols_pairs_t(p, s, r, len, dst),
                }
            }
            return;
        }
        // SAFETY: the tile holds TILE values (this function's contract).
        let tile = unsafe { std::slice::from_raw_parts_mut(dst, TILE) };
        super::simd::vectorized(
            #[inline(always)]
            || {
                // SAFETY: per this function's contract.
                unsafe {
                    match self {
                        Packer::Rows32 => portable::rows32(p, s, r, len, tile),
                        Packer::Rows32T => portable::rows32_t(p, s, r, len, tile),
                        Packer::RowsPairs => portable::rows_pairs(p, s, r, len, tile),
                        Packer::ColsPairsT => portable::cols_pairs_t(p, s, r, len, tile),
                    }
                }
            },
        )
    }
}

/// The packers of [`Packer`] as plain loops: each reads its source in the order it lies in
/// memory, so that the compiler vectorizes the conversions.
mod portable {
    use super::{bf16_bits, TK};

    /// `len` f32 at `p` as a slice.
    ///
    /// # Safety
    /// `len` readable f32 at `p`.
    #[inline(always)]
    unsafe fn run<'a>(p: *const f32, len: usize) -> &'a [f32] {
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts(p, len) }
    }

    /// # Safety
    /// As [`super::Packer::run`].
    #[inline(always)]
    pub unsafe fn rows32(p: *const f32, s: usize, r: usize, len: usize, tile: &mut [u16]) {
        for (i, row) in tile.chunks_exact_mut(TK).enumerate() {
            row.fill(0);
            if i < r {
                // SAFETY: per the contract.
                let src = unsafe { run(p.add(i * s), len) };
                row.iter_mut()
                    .zip(src)
                    .for_each(|(d, &x)| *d = bf16_bits(x));
            }
        }
    }

    /// # Safety
    /// As [`super::Packer::run`].
    #[inline(always)]
    pub unsafe fn rows32_t(p: *const f32, s: usize, r: usize, len: usize, tile: &mut [u16]) {
        tile.fill(0);
        for j in 0..r {
            // SAFETY: per the contract.
            let src = unsafe { run(p.add(j * s), len) };
            for (kk, &x) in src.iter().enumerate() {
                tile[(kk / 2) * TK + 2 * j + kk % 2] = bf16_bits(x);
            }
        }
    }

    /// # Safety
    /// As [`super::Packer::run`].
    #[inline(always)]
    pub unsafe fn rows_pairs(p: *const f32, s: usize, r: usize, len: usize, tile: &mut [u16]) {
        for (q, row) in tile.chunks_exact_mut(TK).enumerate() {
            row.fill(0);
            for e in 0..2 {
                let kk = 2 * q + e;
                if kk < len {
                    // SAFETY: per the contract.
                    let src = unsafe { run(p.add(kk * s), r) };
                    for (j, &x) in src.iter().enumerate() {
                        row[2 * j + e] = bf16_bits(x);
                    }
                }
            }
        }
    }

    /// # Safety
    /// As [`super::Packer::run`].
    #[inline(always)]
    pub unsafe fn cols_pairs_t(p: *const f32, s: usize, r: usize, len: usize, tile: &mut [u16]) {
        tile.fill(0);
        for kk in 0..len {
            // SAFETY: per the contract.
            let src = unsafe { run(p.add(kk * s), r) };
            for (i, &x) in src.iter().enumerate() {
                tile[i * TK + kk] = bf16_bits(x);
            }
        }
    }
}

/// The tile configuration `ldtilecfg` reads: palette 1, tiles 0-7 all 16 rows × 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

#[cfg(target_arch = "x86_64")]
impl TileConfig {
    fn full() -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            c.colsb[t] = 64;
            c.rows[t] = TR as u8;
        }
        c
    }
}

/// One 32×32 block: `c[32, 32]` (row stride `stride` bytes) (+)= A tiles `a0`, `a1` (rows
/// 0-15, 16-31) times B tiles `b0`, `b1` (columns 0-15, 16-31), over `kbs` k-blocks; with
/// `load` the accumulators start from `c`, else from zero.
///
/// Each k-step also asks for the B tiles two steps ahead (16 lines of each stream, 2 KiB
/// ahead): with one row block (a decode step's 32 rows) B is read once from memory, and the
/// tile loads waited on it — decode's products went from 0.72 to 1.00 of a plain parallel read
/// with it (`cargo bench --bench decode_products`; 1 KiB or 4 KiB ahead did less).
///
/// # Safety
/// The tile configuration must be loaded on this thread; each pointer must address `kbs`
/// consecutive packed tiles, and `c` 32 rows of 32 f32 at `stride` bytes apart, writable.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    a0: *const u16,
    a1: *const u16,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    // SAFETY: per this function's contract.
    unsafe {
        let c2 = (c as *mut u8).add(16 * stride) as *mut f32;
        std::arch::asm!(
            "test {load}, {load}",
            "jz 3f",
            "tileloadd tmm0, [{c} + {st}]",
            "tileloadd tmm1, [{c1} + {st}]",
            "tileloadd tmm2, [{c2} + {st}]",
            "tileloadd tmm3, [{c3} + {st}]",
            "jmp 2f",
            "3:",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {s64}]",
            "tileloadd tmm5, [{a1} + {s64}]",
            "tileloadd tmm6, [{b0} + {s64}]",
            "tileloadd tmm7, [{b1} + {s64}]",
            "prefetcht0 [{b0} + 2048]",
            "prefetcht0 [{b1} + 2048]",
            "prefetcht0 [{b0} + 2112]",
            "prefetcht0 [{b1} + 2112]",
            "prefetcht0 [{b0} + 2176]",
            "prefetcht0 [{b1} + 2176]",
            "prefetcht0 [{b0} + 2240]",
            "prefetcht0 [{b1} + 2240]",
            "prefetcht0 [{b0} + 2304]",
            "prefetcht0 [{b1} + 2304]",
            "prefetcht0 [{b0} + 2368]",
            "prefetcht0 [{b1} + 2368]",
            "prefetcht0 [{b0} + 2432]",
            "prefetcht0 [{b1} + 2432]",
            "prefetcht0 [{b0} + 2496]",
            "prefetcht0 [{b1} + 2496]",
            "prefetcht0 [{b0} + 2560]",
            "prefetcht0 [{b1} + 2560]",
            "prefetcht0 [{b0} + 2624]",
            "prefetcht0 [{b1} + 2624]",
            "prefetcht0 [{b0} + 2688]",
            "prefetcht0 [{b1} + 2688]",
            "prefetcht0 [{b0} + 2752]",
            "prefetcht0 [{b1} + 2752]",
            "prefetcht0 [{b0} + 2816]",
            "prefetcht0 [{b1} + 2816]",
            "prefetcht0 [{b0} + 2880]",
            "prefetcht0 [{b1} + 2880]",
            "prefetcht0 [{b0} + 2944]",
            "prefetcht0 [{b1} + 2944]",
            "prefetcht0 [{b0} + 3008]",
            "prefetcht0 [{b1} + 3008]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 1024",
            "add {a1}, 1024",
            "add {b0}, 1024",
            "add {b1}, 1024",
            "dec {kbs}",
            "jnz 2b",
            "tilestored [{c} + {st}], tmm0",
            "tilestored [{c1} + {st}], tmm1",
            "tilestored [{c2} + {st}], tmm2",
            "tilestored [{c3} + {st}], tmm3",
            a0 = inout(reg) a0 => _,
            a1 = inout(reg) a1 => _,
            b0 = inout(reg) b0 => _,
            b1 = inout(reg) b1 => _,
            kbs = inout(reg) kbs => _,
            load = in(reg) load as usize,
            s64 = in(reg) 64usize,
            st = in(reg) stride,
            c = in(reg) c,
            c1 = in(reg) c.add(16),
            c2 = in(reg) c2,
            c3 = in(reg) c2.add(16),
            options(nostack),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    _: *const u16,
    _: *const u16,
    _: *const u16,
    _: *const u16,
    _: usize,
    _: *mut f32,
    _: usize,
    _: bool,
) {
    unreachable!("AMX products are only called when bf16::kernel() is AMX")
}

/// The block [`block`] computes, with AVX512-BF16 dot products instead of tiles: four passes
/// of 8 rows × 32 columns, each keeping its 16 accumulators in registers while it walks k. For
/// k-pair `p` of a k-block, B tile row `p` of `b0` and `b1` (16 columns each, VNNI pairs) is
/// loaded once and multiplied by A's pair `(a[i, 2p], a[i, 2p+1])` broadcast to every lane.
///
/// # Safety
/// The CPU must have avx512f, avx512bw and avx512bf16; the pointers as for [`block`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_dp(
    a0: *const u16,
    a1: *const u16,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    const R: usize = 8;
    for pass in 0..4 {
        // SAFETY (whole body): per this function's contract, rows pass·8..pass·8+8 of the
        // block lie in tile `a0` (passes 0, 1) or `a1` (2, 3), each `kbs` tiles long, and the
        // block's rows of `c` are writable.
        unsafe {
            let at = if pass < 2 { a0 } else { a1 }.add((pass % 2) * R * TK);
            let row = |r: usize| (c as *mut u8).add((pass * R + r) * stride) as *mut f32;
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            if load {
                for (r, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm512_loadu_ps(row(r));
                    a[1] = _mm512_loadu_ps(row(r).add(16));
                }
            }
            for kb in 0..kbs {
                let a = at.add(kb * TILE);
                let (bl, bh) = (b0.add(kb * TILE), b1.add(kb * TILE));
                for p in 0..TR {
                    let vl: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(bl.add(p * TK) as *const __m512i));
                    let vh: __m512bh =
                        std::mem::transmute(_mm512_loadu_si512(bh.add(p * TK) as *const __m512i));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let pair = (a.add(r * TK + 2 * p) as *const i32).read_unaligned();
                        let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                        acc[0] = _mm512_dpbf16_ps(acc[0], av, vl);
                        acc[1] = _mm512_dpbf16_ps(acc[1], av, vh);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(row(r), a[0]);
                _mm512_storeu_ps(row(r).add(16), a[1]);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn block_dp(
    _: *const u16,
    _: *const u16,
    _: *const u16,
    _: *const u16,
    _: usize,
    _: *mut f32,
    _: usize,
    _: bool,
) {
    unreachable!("bf16 products are only called when bf16::available()")
}

/// One 32×32 block with `kernel` (see [`block`]); `a0`, `a1` address A's tiles in the form
/// the kernel reads ([`ATiles`]).
///
/// # Safety
/// As [`block`]; `kernel` must run on this CPU, A's tiles must be in its form, and for AMX
/// the tile configuration loaded on this thread.
#[allow(clippy::too_many_arguments)]
unsafe fn block_with(
    kernel: Kernel,
    a0: *const u8,
    a1: *const u8,
    b0: *const u16,
    b1: *const u16,
    kbs: usize,
    c: *mut f32,
    stride: usize,
    load: bool,
) {
    // SAFETY: per this function's contract: `kernel` runs on this CPU.
    unsafe {
        // A's tiles: bf16 for the dot-product kernels, f32 for the widening ones.
        let (h0, h1) = (a0.cast::<u16>(), a1.cast::<u16>());
        let (w0, w1) = (a0.cast::<f32>(), a1.cast::<f32>());
        match kernel {
            Kernel::Amx => block(h0, h1, b0, b1, kbs, c, stride, load),
            Kernel::Avx512Bf16 => block_dp(h0, h1, b0, b1, kbs, c, stride, load),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => widen::avx2(w0, w1, b0, b1, kbs, c, stride, load),
            #[cfg(target_arch = "aarch64")]
            Kernel::Bfdot => widen::bfdot(h0, h1, b0, b1, kbs, c, stride, load),
            #[cfg(target_arch = "aarch64")]
            Kernel::Neon => widen::neon(w0, w1, b0, b1, kbs, c, stride, load),
            Kernel::Portable => super::simd::vectorized(
                #[inline(always)]
                || widen::portable(w0, w1, b0, b1, kbs, c, stride, load),
            ),
            #[allow(unreachable_patterns)]
            k => unreachable!("the {} kernel does not run on this architecture", k.name()),
        }
    }
}

/// A raw pointer that may cross to rayon's threads: tasks write disjoint blocks.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so that closures capture the whole `SendPtr`).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// With AMX: loads the tile configuration on the calling thread, runs `f`, releases the tile
/// state. With any other kernel only runs `f`.
fn with_tiles<R>(kernel: Kernel, f: impl FnOnce() -> R) -> R {
    if kernel != Kernel::Amx {
        return f();
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the configuration is valid (palette 1, 8 tiles of 16×64 bytes) and AMX was
    // granted (callers check `available`).
    unsafe {
        let cfg = TileConfig::full();
        std::arch::asm!("ldtilecfg [{}]", in(reg) &cfg, options(nostack, readonly));
    }
    let r = f();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: drops the tile state of this thread.
    unsafe {
        std::arch::asm!("tilerelease", options(nostack, nomem));
    }
    r
}

/// `dst[m, n] (+)= a[m, k] · b[k, n]` with bf16 operands and f32 sums, strides as
/// [`super::gemm::gemm_strided`]. Callers check [`available`] first.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    dst: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    b_rs: usize,
    b_cs: usize,
    acc: bool,
    par: Par,
) {
    let bp = PackedB::new(b, b_rs, b_cs, k, n, par);
    gemm_packed(dst, m, a, a_rs, a_cs, &bp, acc, par);
}

/// `dst[m, n] = a[m, k] · b[k, n]` into memory not yet initialised (see
/// [`product_uninit`]), strides as [`gemm`]. Callers check [`available`] first.
#[allow(clippy::too_many_arguments)]
pub fn gemm_uninit(
    dst: &mut [MaybeUninit<f32>],
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    b: &[f32],
    b_rs: usize,
    b_cs: usize,
    par: Par,
) {
    let bp = PackedB::new(b, b_rs, b_cs, k, n, par);
    product_uninit(dst, &PackedA::new(a, a_rs, a_cs, m, k, par), &bp, par)
}

/// `dst[m, n] (+)= a[m, k] · B` with `B [k, n]` packed once by [`PackedB::new`].
#[allow(clippy::too_many_arguments)]
pub fn gemm_packed(
    dst: &mut [f32],
    m: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    bp: &PackedB,
    acc: bool,
    par: Par,
) {
    let kernel = kernel().expect("bf16 product called with MAIN_PPO_BF16_KERNEL=none");
    gemm_packed_on(kernel, dst, m, a, a_rs, a_cs, bp, acc, par)
}

/// The kernels this CPU (and its kernel) can run under any instruction set it has, for tests
/// that compare them.
#[cfg(test)]
fn kernels_here() -> Vec<Kernel> {
    Kernel::ALL
        .into_iter()
        .filter(|k| {
            super::cpu::available()
                .into_iter()
                .any(|isa| k.runs_under(isa))
        })
        .collect()
}

/// [`gemm_packed`] on a given kernel (which this CPU must run).
#[allow(clippy::too_many_arguments)]
fn gemm_packed_on(
    kernel: Kernel,
    dst: &mut [f32],
    m: usize,
    a: &[f32],
    a_rs: usize,
    a_cs: usize,
    bp: &PackedB,
    acc: bool,
    par: Par,
) {
    assert!(dst.len() >= m * bp.n);
    let ap = PackedA::for_kernel(kernel, a, a_rs, a_cs, m, bp.k, par);
    // SAFETY: dst holds m·n initialised values.
    unsafe { product_into(kernel, dst.as_mut_ptr(), &ap, bp, acc, par) }
}

/// `a[m, k]` packed as A tiles (16 rows × 32 k-values each, see [`pack_tiles`]), for several
/// products with the same left operand: a layer's input read by its query, key and value
/// projections, or by an MLP's gate and up projections.
pub struct PackedA {
    m: usize,
    k: usize,
    tiles: ATiles,
}

/// A's tiles as the kernel reads them: bf16 values (AMX, AVX512-BF16, BFDOT), or the same
/// values widened to f32 in the same places (the widening kernels: each A value is broadcast
/// to every lane, which a load of an f32 does alone, where a bf16 needed a shift or a mask
/// per broadcast. Measured on Zen 4 with the AVX2 path forced, the products of a 32-row decode
/// step (`cargo bench --bench decode_products`) went from 103 to 156 GFLOP/s, 70 % of the
/// machine's f32 FMA peak, with this and the five-row passes of `bf16_widen` together).
enum ATiles {
    Bf16(Vec<u16>),
    Wide(Vec<f32>),
}

impl PackedA {
    /// Value `a[i, kk]` at `a[i·a_rs + kk·a_cs]`, for this process's kernel.
    pub fn new(a: &[f32], a_rs: usize, a_cs: usize, m: usize, k: usize, par: Par) -> Self {
        let kernel = kernel().expect("bf16 product called with MAIN_PPO_BF16_KERNEL=none");
        Self::for_kernel(kernel, a, a_rs, a_cs, m, k, par)
    }

    /// [`PackedA::new`] for `kernel`.
    fn for_kernel(
        kernel: Kernel,
        a: &[f32],
        a_rs: usize,
        a_cs: usize,
        m: usize,
        k: usize,
        par: Par,
    ) -> Self {
        if m > 0 && k > 0 {
            assert!(a.len() > (m - 1) * a_rs + (k - 1) * a_cs);
        }
        // A decode step's 32 rows (~18k values at 576 inputs) pack faster here than a pool
        // thread wakes up.
        let par = par == Par::Rayon && padded(m) * k.div_ceil(TK) * TK >= 1 << 16;
        let tiles = pack_tiles(a, a_rs, a_cs, m, k, Side::A, par);
        let tiles = match kernel.widens() {
            false => ATiles::Bf16(tiles),
            true => ATiles::Wide(widened(&tiles, par)),
        };
        PackedA { m, k, tiles }
    }

    /// Tile `t`'s first value, as the kernel reads it (bf16 or f32 tiles).
    fn tile(&self, t: usize) -> *const u8 {
        match &self.tiles {
            ATiles::Bf16(v) => v[t * TILE..].as_ptr().cast(),
            ATiles::Wide(v) => v[t * TILE..].as_ptr().cast(),
        }
    }
}

/// bf16 values as f32 (each the upper half of its f32), in parallel chunks when `par`.
fn widened(tiles: &[u16], par: bool) -> Vec<f32> {
    // SAFETY: every chunk's loop writes each of its values.
    unsafe {
        super::alloc::filled(tiles.len(), |out| {
            let chunk = if par { 1 << 15 } else { tiles.len().max(1) };
            each_chunk(out, chunk, par, |i, o| {
                let src = &tiles[i * chunk..][..o.len()];
                super::simd::vectorized(
                    #[inline(always)]
                    || {
                        for (o, &b) in o.iter_mut().zip(src) {
                            o.write(f32::from_bits((b as u32) << 16));
                        }
                    },
                )
            })
        })
    }
}

/// `dst[m, n] = A · B` into memory not yet initialised: every value written once by the
/// product, none read. Callers check [`available`] first.
pub fn product_uninit(dst: &mut [MaybeUninit<f32>], ap: &PackedA, bp: &PackedB, par: Par) {
    assert!(dst.len() >= ap.m * bp.n);
    let kernel = kernel().expect("bf16 product called with MAIN_PPO_BF16_KERNEL=none");
    // SAFETY: dst is valid for m·n writes; without `acc` the product reads none of them.
    unsafe { product_into(kernel, dst.as_mut_ptr().cast(), ap, bp, false, par) }
}

/// `out[m, n] (+)= A · B` on `kernel`.
///
/// # Safety
/// `out` must be valid for writes of `m·n` f32 (row-major, contiguous) that nothing else
/// touches during the call, and hold initialised values when `acc`; without `acc` every value
/// is written and none read.
unsafe fn product_into(
    kernel: Kernel,
    out: *mut f32,
    ap: &PackedA,
    bp: &PackedB,
    acc: bool,
    par: Par,
) {
    let (k, n, m) = (bp.k, bp.n, ap.m);
    assert_eq!(ap.k, k, "bf16 product: A has {} columns, B {k} rows", ap.k);
    if m == 0 || n == 0 || k == 0 {
        if !acc {
            // SAFETY: out is valid for m·n writes (this function's contract).
            unsafe { std::ptr::write_bytes(out, 0, m * n) };
        }
        return;
    }
    assert_eq!(
        kernel.widens(),
        matches!(ap.tiles, ATiles::Wide(_)),
        "bf16 product: A was packed for another kernel than {}",
        kernel.name()
    );
    let bp = &bp.tiles;
    let kbs = k.div_ceil(TK);
    let (mb, nb) = (padded(m) / 32, padded(n) / 32);
    let threads = if par == Par::Rayon {
        rayon::current_num_threads()
    } else {
        1
    };
    // Column chunks of NC (B's panel reused by every row block of a task), narrower when
    // there are too few row blocks and chunks to give each thread several tasks: with one
    // row block (a decode step's 32 rows) nothing is reused, and 3 chunks on 2 threads
    // would leave one idle a third of the time. Each block sums over all of k either way, so
    // the split never changes a result.
    let nc = match (nb * 32).div_ceil(NC) * mb >= 4 * threads {
        true => NC,
        false => 32 * nb.div_ceil((4 * threads).div_ceil(mb)).max(1),
    };
    let chunks = n.div_ceil(nc);
    let out = SendPtr(out);
    // One task: the column chunk `cc` for the row blocks `rows`.
    let task = |cc: usize, rows: std::ops::Range<usize>| {
        with_tiles(kernel, || {
            let mut cbuf = Buf([0f32; 1024]);
            for bi in rows {
                let a0 = ap.tile((2 * bi) * kbs);
                let a1 = ap.tile((2 * bi + 1) * kbs);
                for bj in cc * nc / 32..((cc + 1) * nc / 32).min(nb) {
                    let b0 = bp[(2 * bj) * kbs * TILE..].as_ptr();
                    let b1 = bp[(2 * bj + 1) * kbs * TILE..].as_ptr();
                    let (r0, c0) = (bi * 32, bj * 32);
                    let (rn, cn) = (32.min(m - r0), 32.min(n - c0));
                    if rn == 32 && cn == 32 {
                        // A whole block: the tiles read and write dst in place.
                        // SAFETY: rows r0..r0+32, columns c0..c0+32 lie inside dst[m, n] and
                        // belong to this task alone; the packs hold kbs tiles per pointer.
                        unsafe {
                            let c = out.get().add(r0 * n + c0);
                            block_with(kernel, a0, a1, b0, b1, kbs, c, n * 4, acc);
                        }
                        continue;
                    }
                    // An edge block: through a 32×32 buffer, then the part inside dst. With
                    // `acc` the buffer starts from dst's values, so that every output is
                    // `dst + Σ` summed in the same order as in a whole block: a row's result
                    // must not depend on which block of the batch it falls in (batch-invariant
                    // decoding).
                    // SAFETY: row r0+i < m and columns c0..c0+cn < n of out[m, n]; no other
                    // task touches this block.
                    let dst_row = |i: usize| unsafe { out.get().add((r0 + i) * n + c0) };
                    if acc {
                        for i in 0..rn {
                            // SAFETY: as dst_row; with acc the values are initialised.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    dst_row(i),
                                    cbuf.0[i * 32..].as_mut_ptr(),
                                    cn,
                                )
                            };
                        }
                    }
                    // SAFETY: the packs hold kbs tiles from each pointer; cbuf holds 1,024 f32.
                    unsafe {
                        block_with(kernel, a0, a1, b0, b1, kbs, cbuf.0.as_mut_ptr(), 128, acc)
                    };
                    for i in 0..rn {
                        // SAFETY: as dst_row.
                        unsafe {
                            std::ptr::copy_nonoverlapping(cbuf.0[i * 32..].as_ptr(), dst_row(i), cn)
                        };
                    }
                }
            }
        })
    };
    // Split rows too when there are fewer column chunks than a few per thread.
    let row_parts = (4 * threads).div_ceil(chunks).clamp(1, mb);
    let per = mb.div_ceil(row_parts);
    let tasks: Vec<(usize, std::ops::Range<usize>)> = (0..chunks)
        .flat_map(|cc| {
            (0..mb)
                .step_by(per)
                .map(move |r| (cc, r..(r + per).min(mb)))
        })
        .collect();
    if threads > 1 {
        super::team::for_each(tasks.len(), |i| task(tasks[i].0, tasks[i].1.clone()));
    } else {
        tasks.into_iter().for_each(|(cc, r)| task(cc, r));
    }
}

#[repr(align(64))]
struct Buf([f32; 1024]);

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Each packer (the AVX-512 ones where the CPU has them, and the portable loops) against
    /// the tile layout [`Packer`]'s documentation gives, written out here element by element:
    /// full and edge tiles (rows or columns 1, 7, 16; k-lengths 1, 2, 17, 31, 32). Every source
    /// value outside the `r × len` block is NaN: a packer that read one would leave a NaN
    /// where the layout has a zero.
    #[test]
    fn tile_packers_write_their_layout_and_read_only_their_block() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        const S: usize = 40; // the source's stride between the 16 (or 32) runs
        type Pack = Box<dyn Fn(*const f32, usize, usize, usize, &mut [u16])>;
        // (name, packer, source index of (run-major position `i` of 16, k position `kk` of 32)
        // and the tile index it lands on).
        #[allow(clippy::type_complexity)]
        let mut packers: Vec<(
            String,
            Pack,
            fn(usize, usize) -> usize,
            fn(usize, usize) -> usize,
        )> = Vec::new();
        for (packer, src, dst) in [
            (
                Packer::Rows32,
                (|i, kk| i * S + kk) as fn(usize, usize) -> usize,
                (|i, kk| i * TK + kk) as fn(usize, usize) -> usize,
            ),
            (
                Packer::Rows32T,
                |j, kk| j * S + kk,
                |j, kk| (kk / 2) * TK + 2 * j + kk % 2,
            ),
            (
                Packer::RowsPairs,
                |j, kk| kk * S + j,
                |j, kk| (kk / 2) * TK + 2 * j + kk % 2,
            ),
            (Packer::ColsPairsT, |i, kk| kk * S + i, |i, kk| i * TK + kk),
        ] {
            // SAFETY (both closures): the test's source and tile sizes meet the contract.
            let portable: Pack = Box::new(move |p, s, r, len, t: &mut [u16]| unsafe {
                match packer {
                    Packer::Rows32 => portable::rows32(p, s, r, len, t),
                    Packer::Rows32T => portable::rows32_t(p, s, r, len, t),
                    Packer::RowsPairs => portable::rows_pairs(p, s, r, len, t),
                    Packer::ColsPairsT => portable::cols_pairs_t(p, s, r, len, t),
                }
            });
            packers.push((format!("portable {packer:?}"), portable, src, dst));
            #[cfg(target_arch = "x86_64")]
            if Isa::Avx512.here() {
                let simd: Pack = Box::new(move |p, s, r, len, t: &mut [u16]| unsafe {
                    let t = t.as_mut_ptr();
                    match packer {
                        Packer::Rows32 => simd::rows32(p, s, r, len, t),
                        Packer::Rows32T => simd::rows32_t(p, s, r, len, t),
                        Packer::RowsPairs => simd::rows_pairs(p, s, r, len, t),
                        Packer::ColsPairsT => simd::cols_pairs_t(p, s, r, len, t),
                    }
                });
                packers.push((format!("AVX-512 {packer:?}"), simd, src, dst));
            }
        }
        for (name, pack, src, dst) in packers {
            for r in [1, 7, 16] {
                for len in [1, 2, 17, 31, 32] {
                    let mut a = vec![f32::NAN; S * S];
                    let mut want = vec![0u16; TILE];
                    for i in 0..r {
                        for kk in 0..len {
                            let v: f32 = rng.random_range(-2.0..2.0);
                            a[src(i, kk)] = v;
                            want[dst(i, kk)] = bf16_bits(v);
                        }
                    }
                    let mut got = vec![0xffffu16; TILE];
                    pack(a.as_ptr(), S, r, len, &mut got);
                    assert_eq!(got, want, "{name}: {r} runs × {len}");
                }
            }
        }
    }

    /// `from_rows` on separate parts gives the tiles `new` gives on their stacked copy, bit
    /// for bit: parts whose row counts are and are not multiples of a tile's 16 columns, k
    /// with and without a partial k-block.
    #[test]
    fn packing_from_parts_equals_packing_the_stacked_copy() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (k, rows) in [
            (64usize, vec![32usize, 16, 48]),
            (576, vec![576, 192, 192]),
            (40, vec![7, 30, 1, 16]),
            (96, vec![100]),
        ] {
            let parts: Vec<Vec<f32>> = rows
                .iter()
                .map(|&r| (0..r * k).map(|_| rng.random_range(-2.0..2.0)).collect())
                .collect();
            let stacked: Vec<f32> = parts.concat();
            let n: usize = rows.iter().sum();
            let want = PackedB::new(&stacked, 1, k, k, n, Par::Rayon);
            let refs: Vec<&[f32]> = parts.iter().map(|p| &p[..]).collect();
            for par in [Par::Rayon, Par::None] {
                let got = PackedB::from_rows(&refs, k, par);
                assert_eq!(got.dims(), (k, n));
                assert!(got.tiles == want.tiles, "k {k}, rows {rows:?}");
            }
        }
    }

    /// MAIN_PPO_BF16_KERNEL's values under each instruction set this CPU has: the kernels
    /// that run there pass, a kernel that does not and an unknown spelling are errors naming
    /// the value and what to use (they were ignored silently). The widening kernel of the
    /// instruction set is always offered, so bf16 keeps its meaning on every CPU.
    #[test]
    fn kernel_choices_are_checked() {
        for isa in super::super::cpu::available() {
            for ok in [None, Some(""), Some("auto"), Some("none"), Some("portable")] {
                assert!(check_choice_under(ok, isa).is_ok(), "{isa:?} {ok:?}");
            }
            let e = check_choice_under(Some("avx3"), isa).unwrap_err();
            assert!(
                e.contains("`avx3` is not a choice") && e.contains("portable"),
                "{e}"
            );
            for k in Kernel::ALL {
                match check_choice_under(Some(k.name()), isa) {
                    Ok(()) => assert!(k.runs_under(isa), "{isa:?}: {k:?} accepted"),
                    Err(e) => {
                        assert!(!k.runs_under(isa), "{isa:?}: {k:?} refused: {e}");
                        assert!(e.contains("runs no") && e.contains(isa.name()), "{e}");
                    }
                }
            }
            let widening = match isa {
                Isa::Avx512 | Isa::Avx2 => Kernel::Avx2,
                Isa::Neon => Kernel::Neon,
                Isa::Portable => Kernel::Portable,
            };
            assert!(kernels_under(isa).contains(&widening), "{isa:?}");
        }
        assert!(!describe().is_empty());
    }

    /// The widening kernels (AVX2, NEON, the portable loop) against each other, bit for bit,
    /// and against AVX512-BF16's `vdpbf16ps` where the CPU has it (normal numbers: the widened
    /// sums add the odd product first, as `vdpbf16ps` does), with and without accumulation,
    /// on whole and edge blocks.
    #[test]
    fn widening_kernels_sum_as_the_dot_product_instructions_do() {
        let same: Vec<Kernel> = kernels_here()
            .into_iter()
            .filter(|k| {
                matches!(
                    k,
                    Kernel::Avx2 | Kernel::Neon | Kernel::Portable | Kernel::Avx512Bf16
                )
            })
            .collect();
        assert!(same.contains(&Kernel::Portable));
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for &(m, n, k) in &[(32, 32, 64), (40, 70, 300), (3, 33, 31)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let d0: Vec<f32> = (0..m * n).map(|_| rng.random_range(-3.0..3.0)).collect();
            let bp = PackedB::new(&b, n, 1, k, n, Par::None);
            for acc in [false, true] {
                let run = |kernel| {
                    let mut d = d0.clone();
                    gemm_packed_on(kernel, &mut d, m, &a, k, 1, &bp, acc, Par::Rayon);
                    d.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                let want = run(Kernel::Portable);
                for &kernel in &same {
                    assert!(
                        run(kernel) == want,
                        "{kernel:?} differs from the portable loop: {m}x{n}x{k} acc={acc}"
                    );
                }
            }
        }
    }

    /// The reference: f64 sums of the bf16-rounded operands (independent of tiles and packing).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        ars: usize,
        acs: usize,
        b: &[f32],
        brs: usize,
        bcs: usize,
    ) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|l| {
                        round_bf16(a[i * ars + l * acs]) as f64
                            * round_bf16(b[l * brs + j * bcs]) as f64
                    })
                    .sum();
            }
        }
        c
    }

    #[test]
    fn bf16_rounding_is_nearest_even() {
        // 1 + 2⁻⁸ lies halfway between bf16 1 and 1 + 2⁻⁷: ties go to the even mantissa (1).
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2⁻⁸ lies halfway between 1 + 2⁻⁷ and 1 + 2⁻⁶: even is 1 + 2⁻⁶.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
    }

    /// A row's result does not depend on the rest of the batch, bit for bit, also when the
    /// product adds to `dst` (the decode path's fused residual): rows 32-39 of a 40-row product
    /// (an edge block) equal rows 0-7 of an 8-row product of the same rows, and rows 0-7 of the
    /// 40-row product (a whole block) equal those of a 16-row one. Before the edge block
    /// started from dst's values it summed `dst + (Σ)` instead of `(dst + Σ)`, so greedy bf16
    /// decoding changed with `max_num_seqs`.
    #[test]
    fn rows_are_batch_invariant_with_and_without_accumulation() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (n, k) = (48, 200);
        let a: Vec<f32> = (0..40 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let d0: Vec<f32> = (0..40 * n).map(|_| rng.random_range(-3.0..3.0)).collect();
        let bp = PackedB::new(&b, n, 1, k, n, Par::None);
        for kernel in kernels_here() {
            for acc in [false, true] {
                let run = |rows: std::ops::Range<usize>| {
                    let m = rows.len();
                    let mut d = d0[rows.start * n..rows.end * n].to_vec();
                    let a = &a[rows.start * k..rows.end * k];
                    gemm_packed_on(kernel, &mut d, m, a, k, 1, &bp, acc, Par::None);
                    d
                };
                let all = run(0..40);
                assert_eq!(
                    &all[32 * n..],
                    &run(32..40)[..],
                    "{kernel:?} acc={acc}: edge rows"
                );
                assert_eq!(
                    &all[..8 * n],
                    &run(0..16)[..8 * n],
                    "{kernel:?} acc={acc}: block rows"
                );
            }
        }
    }

    /// Every kernel this CPU runs against f64 sums of the bf16-rounded operands, for A and B
    /// row- and column-major, on rayon's threads and on this one.
    #[test]
    fn products_equal_f64_sums_of_bf16_operands_for_all_layouts() {
        let kernels = kernels_here();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(m, n, k) in &[
            (1, 1, 1),
            (17, 33, 31),
            (32, 32, 32),
            (70, 300, 65),
            (5, 600, 100),
            (64, 40, 577),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
            // a row-major and column-major, b row-major and column-major.
            for (ars, acs) in [(k, 1), (1, m)] {
                for (brs, bcs) in [(n, 1), (1, k)] {
                    let want = reference(m, n, k, &a, ars, acs, &b, brs, bcs);
                    let bp = PackedB::new(&b, brs, bcs, k, n, Par::Rayon);
                    for (&kernel, par) in kernels
                        .iter()
                        .flat_map(|kn| [Par::Rayon, Par::None].into_iter().map(move |p| (kn, p)))
                    {
                        let mut got = vec![0.5f32; m * n];
                        gemm_packed_on(kernel, &mut got, m, &a, ars, acs, &bp, true, par);
                        for (g, w) in got.iter().zip(&want) {
                            // f32 sums of exact products: |error| ≤ k·2⁻²⁴·Σ|terms| ≤ k²·2⁻²⁴.
                            let tol = (k * k) as f64 * 6e-8 + 1e-6;
                            assert!(
                                (*g as f64 - 0.5 - w).abs() <= tol,
                                "{kernel:?} {m}x{n}x{k} {ars},{acs} {brs},{bcs}: {g} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Throughput at SmolLM2-135M's shapes, each bf16 kernel this CPU runs vs the f32 `gemm`
/// crate, same run: `cargo test --release --lib bf16::speed -- --ignored --nocapture`.
#[cfg(test)]
mod speed {
    use super::super::gemm::gemm_strided;
    use super::*;
    use std::time::Instant;

    fn time(mut f: impl FnMut()) -> f64 {
        f();
        let t = Instant::now();
        let reps = 5;
        for _ in 0..reps {
            f();
        }
        t.elapsed().as_secs_f64() / reps as f64
    }

    #[test]
    #[ignore]
    fn speed() {
        // (name, m, n, k, a_rs, a_cs, b_rs, b_cs)
        let (r, h, it) = (2048, 576, 1536);
        let cases = [
            ("fwd x·Wqᵀ", r, h, h, h, 1, 1, h),
            ("fwd x·Wgᵀ", r, it, h, h, 1, 1, h),
            ("fwd a·Wdᵀ", r, h, it, it, 1, 1, it),
            ("dX dy·Wd", r, it, h, h, 1, it, 1),
            ("dW dyᵀ·x", h, it, r, 1, h, it, 1),
            ("decode 32", 32, it, h, h, 1, 1, h),
            ("lm head", 256, 49152, h, h, 1, 1, h),
        ];
        for (name, m, n, k, ars, acs, brs, bcs) in cases {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
                .collect();
            let b: Vec<f32> = (0..k * n)
                .map(|i| ((i * 104729) % 1000) as f32 * 1e-3)
                .collect();
            let mut c = vec![0f32; m * n];
            let fl = 2.0 * (m * n * k) as f64 / 1e9;
            let t32 = time(|| {
                gemm_strided(
                    &mut c,
                    m,
                    n,
                    k,
                    &a,
                    ars,
                    acs,
                    &b,
                    brs,
                    bcs,
                    false,
                    Par::Rayon,
                )
            });
            let mut line = format!("{name:12} {m}x{n}x{k}: f32 {:.0} GFLOP/s", fl / t32);
            for kn in kernels_here() {
                let tpack = time(|| {
                    let bp = PackedB::new(&b, brs, bcs, k, n, Par::Rayon);
                    gemm_packed_on(kn, &mut c, m, &a, ars, acs, &bp, false, Par::Rayon)
                });
                let bp = PackedB::new(&b, brs, bcs, k, n, Par::Rayon);
                let tp =
                    time(|| gemm_packed_on(kn, &mut c, m, &a, ars, acs, &bp, false, Par::Rayon));
                line += &format!(
                    "; {kn:?} {:.0} GFLOP/s ({:.2}x), b packed once {:.0} ({:.2}x)",
                    fl / tpack,
                    t32 / tpack,
                    fl / tp,
                    t32 / tp
                );
            }
            println!("{line}");
        }
    }
}
