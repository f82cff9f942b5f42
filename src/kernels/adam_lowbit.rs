//! Adam's moments kept block-quantised between steps, as `torchao.optim`'s low-bit classes keep
//! them (`AdamW8bit`, `AdamW4bit`, `AdamWFp8` and their Adam twins; Dettmers et al. 2021,
//! "8-bit Optimizers via Block-wise Quantization", and Li et al. 2023 for 4 bits).
//!
//! A moment of n values is cut into blocks of `block` values. Each block keeps one f32 scale,
//! `max|x|` over the block (floored at 1e-12; divided by 448, the largest E4M3 value, for FP8),
//! and one code per value for `x / scale`:
//!
//! - 8-bit: the nearest entry of a 256-entry dynamic-tree map (signed for the first moment,
//!   unsigned for the second), found by binary search, ties rounding up;
//! - 4-bit: the same with a 16-entry signed dynamic map for the first moment and the linear
//!   map k/16, k = 1..16 (no zero) for the second; two codes per byte, the first in the high
//!   nibble;
//! - FP8: the value rounded to E4M3 (round to nearest even).
//!
//! A step reads a block's codes back into f32 (`map[code] · scale`), updates the moments in f32,
//! stores their new codes, and updates the parameter from the f32 moments of this step:
//!
//! ```text
//! AdamW: p ← p − (lr·wd)·p          Adam: g ← g + wd·p
//! m ← lerp(m, g, 1−β1)   v ← lerp(v, g², 1−β2)        lerp(a, b, w) = a + w·(b − a) (w < ½)
//! p ← p − lr·(m / (1−β1ᵗ)) / (√v / √(1−β2ᵗ) + ε)
//! ```
//!
//! all in f32 with torchao's order of operations. [`TorchAoRule::apply`] is the same update for
//! moments torchao keeps in f32 (parameters under 4096 values, or not a multiple of the block).

use rayon::prelude::*;

use super::simd::vectorized;

/// How a block-quantised moment stores its codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// One byte per value, an index into a 256-entry map.
    Map8,
    /// Two values per byte (high nibble first), indices into a 16-entry map.
    Map4,
    /// One byte per value, an E4M3 float (`float8_e4m3fn`).
    Fp8,
}

/// The largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;

/// torchao's dynamic quantisation map (bitsandbytes' `create_dynamic_map` without its zero
/// padding): for each exponent e = 0..E, `2^(e+b) (signed) or 2^(e+b+1)` evenly spread means
/// between 0.1 and 1 scaled by 10^(e−E+1), mirrored for signed maps, plus 0 and 1, sorted.
/// Built in the reference's precisions: `torch.linspace` in f32, the means and their scaling in
/// f32.
fn dynamic_map(signed: bool, max_exponent_bits: i32, total_bits: i32) -> Vec<f32> {
    let non_sign_bits = total_bits - 1;
    let mut data: Vec<f32> = Vec::new();
    for i in 0..max_exponent_bits {
        let shift = i + non_sign_bits - max_exponent_bits + if signed { 0 } else { 1 };
        let items = (1usize << shift) + 1;
        let bounds = linspace_f32(0.1, 1.0, items);
        // A Python float times an f32 tensor: the power rounded to f32, the product in f32.
        let power: f32 = format!("1e{}", -(max_exponent_bits - 1) + i)
            .parse()
            .expect("a power of ten");
        for w in bounds.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(power * mean);
            if signed {
                data.push(-(power * mean));
            }
        }
    }
    // bitsandbytes' "additional items" are zero for these widths (non_sign_bits = E).
    data.push(0.0);
    data.push(1.0);
    debug_assert_eq!(data.len(), 1 << total_bits);
    data.sort_by(f32::total_cmp);
    data
}

/// `torch.linspace(start, end, n)` in f32 as ATen's CPU kernel computes it: the first half
/// counted up from `start`, the second down from `end`, with one f32 step and a fused
/// multiply-add (its vectorised loop's `fmadd`; one rounding, not two).
fn linspace_f32(start: f32, end: f32, n: usize) -> Vec<f32> {
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n)
        .map(|i| {
            if i < half {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((n - 1 - i) as f32, end)
            }
        })
        .collect()
}

/// The maps of torchao's 8-bit and 4-bit moments: (signed 8, unsigned 8, signed 4, unsigned 4).
pub fn maps() -> &'static [Vec<f32>; 4] {
    static MAPS: std::sync::OnceLock<[Vec<f32>; 4]> = std::sync::OnceLock::new();
    MAPS.get_or_init(|| {
        [
            dynamic_map(true, 7, 8),
            dynamic_map(false, 7, 8),
            dynamic_map(true, 3, 4),
            linspace_f32(0.0, 1.0, 17)[1..].to_vec(),
        ]
    })
}

/// The map an 8-bit or (`four`) 4-bit code indexes.
fn map(four: bool, signed: bool) -> &'static [f32] {
    &maps()[usize::from(four) * 2 + usize::from(!signed)]
}

/// The code of `x` in a sorted `map`: the last entry not above `x` (entry 0 when `x` is below
/// all, or NaN), moved up one when `x` lies at least half way to the next entry
/// (torchao's branchless binary search and rounding).
#[inline(always)]
fn nearest(map: &[f32], x: f32) -> u8 {
    let n = map.len();
    let mut c = 0usize;
    let mut half = n / 2;
    while half >= 1 {
        if x >= map[c + half] {
            c += half;
        }
        half /= 2;
    }
    let up = (c + 1).min(n - 1);
    let (down, upv) = (map[c], map[up]);
    if x - down >= (upv - down) * 0.5 {
        c = up;
    }
    c as u8
}

/// f32 to E4M3 (`float8_e4m3fn`) bits, rounding to nearest even, as c10's conversion does:
/// magnitudes from 480 up, and NaN, give the NaN code 0x7f.
#[inline(always)]
pub fn e4m3_from_f32(f: f32) -> u8 {
    let bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    let mut b = bits ^ sign;
    let out: u8 = if b >= 1087 << 20 {
        0x7f
    } else if b < 121 << 23 {
        // Below 2⁻⁶ (E4M3's smallest normal): a subnormal. Adding 2^14 (bits 141 << 23) puts
        // the value's 2⁻⁹ steps in the low mantissa bits, rounded to nearest even by the f32
        // addition itself; subtracting the magic's bits leaves the code.
        let magic = 141u32 << 23;
        b = (f32::from_bits(b) + f32::from_bits(magic)).to_bits();
        (b - magic) as u8
    } else {
        let odd = (b >> 20) & 1;
        b = b.wrapping_add(((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7ffff));
        b = b.wrapping_add(odd);
        (b >> 20) as u8
    };
    out | (sign >> 24) as u8
}

/// E4M3 bits to f32 (0x7f and 0xff are NaN).
#[inline(always)]
pub fn e4m3_to_f32(c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((c >> 3) & 0xf);
    let m = f32::from(c & 7);
    if e == 15 && c & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * mag
}

/// One block-quantised moment.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockMoment {
    pub codec: Codec,
    /// The first moment's codes are signed, the second's unsigned.
    pub signed: bool,
    pub block: usize,
    /// One code per value (two per byte for [`Codec::Map4`]).
    pub codes: Vec<u8>,
    /// One per block.
    pub scale: Vec<f32>,
}

impl BlockMoment {
    /// Zeros for `n` values (`n` a multiple of `block`; `block` even for 4 bits). All-zero codes
    /// and scales read back as zeros in every codec.
    pub fn zeros(codec: Codec, signed: bool, block: usize, n: usize) -> Self {
        assert!(
            block > 0 && n.is_multiple_of(block),
            "{n} values in blocks of {block}"
        );
        Self {
            codec,
            signed,
            block,
            codes: vec![0; Self::code_bytes(codec, n)],
            scale: vec![0.0; n / block],
        }
    }

    /// Bytes of codes for `n` values.
    pub fn code_bytes(codec: Codec, n: usize) -> usize {
        match codec {
            Codec::Map4 => n / 2,
            _ => n,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.scale.len() * self.block
    }

    pub fn is_empty(&self) -> bool {
        self.scale.is_empty()
    }

    /// Every value in f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        for (k, o) in out.chunks_mut(self.block).enumerate() {
            decode_block(
                self.codec,
                self.signed,
                self.block_codes(k),
                self.scale[k],
                o,
            );
        }
        out
    }

    /// Quantises `x` (of this moment's length) into it.
    pub fn set_f32(&mut self, x: &[f32]) {
        assert_eq!(x.len(), self.len(), "values for a block moment");
        let (codec, signed, block) = (self.codec, self.signed, self.block);
        let per = Self::code_bytes(codec, block);
        for ((xb, cb), s) in x
            .chunks(block)
            .zip(self.codes.chunks_mut(per))
            .zip(self.scale.iter_mut())
        {
            *s = encode_block(codec, signed, xb, cb);
        }
    }

    fn block_codes(&self, k: usize) -> &[u8] {
        let per = Self::code_bytes(self.codec, self.block);
        &self.codes[k * per..(k + 1) * per]
    }
}

/// `map[code] · scale` (or the E4M3 value times scale) for one block.
#[inline(always)]
fn decode_block(codec: Codec, signed: bool, codes: &[u8], scale: f32, out: &mut [f32]) {
    match codec {
        Codec::Map8 => {
            let m = map(false, signed);
            for (o, &c) in out.iter_mut().zip(codes) {
                *o = m[c as usize] * scale;
            }
        }
        Codec::Map4 => {
            let m = map(true, signed);
            for (o, &c) in out.chunks_mut(2).zip(codes) {
                o[0] = m[(c >> 4) as usize] * scale;
                o[1] = m[(c & 15) as usize] * scale;
            }
        }
        Codec::Fp8 => {
            for (o, &c) in out.iter_mut().zip(codes) {
                *o = e4m3_to_f32(c) * scale;
            }
        }
    }
}

/// Codes for one block of values; returns its scale.
#[inline(always)]
fn encode_block(codec: Codec, signed: bool, x: &[f32], codes: &mut [u8]) -> f32 {
    // `abs().amax().clip(1e-12)`: NaN propagates through the maximum as in torch.
    let amax = x.iter().fold(0f32, |a, &v| {
        let v = v.abs();
        if v.is_nan() || a.is_nan() {
            f32::NAN
        } else {
            a.max(v)
        }
    });
    let floor = if amax.is_nan() { amax } else { amax.max(1e-12) };
    match codec {
        Codec::Map8 => {
            let m = map(false, signed);
            for (c, &v) in codes.iter_mut().zip(x) {
                *c = nearest(m, v / floor);
            }
            floor
        }
        Codec::Map4 => {
            let m = map(true, signed);
            for (c, v) in codes.iter_mut().zip(x.chunks(2)) {
                *c = (nearest(m, v[0] / floor) << 4) | nearest(m, v[1] / floor);
            }
            floor
        }
        Codec::Fp8 => {
            let scale = floor / E4M3_MAX;
            for (c, &v) in codes.iter_mut().zip(x) {
                *c = e4m3_from_f32(v / scale);
            }
            scale
        }
    }
}

/// The constants of one torchao-form Adam step, all f32 as torchao computes them.
#[derive(Debug, Clone, Copy)]
pub struct TorchAoRule {
    pub lr: f32,
    /// `lr · wd` for AdamW's decoupled decay; 0 for Adam.
    pub lr_wd: f32,
    /// `wd` for Adam's L2 term; 0 for AdamW.
    pub l2: f32,
    /// `1 − β1`, `1 − β2` (the interpolation weights).
    pub w1: f32,
    pub w2: f32,
    /// `1 − β1ᵗ` and `√(1 − β2ᵗ)`.
    pub bc1: f32,
    pub sqrt_bc2: f32,
    pub eps: f32,
    /// Multiplies each gradient before use (clipping's coefficient; 1 = none).
    pub grad_scale: f32,
}

/// torch's `lerp` for a weight below one half: `a + w·(b − a)`; from one half up,
/// `b − (b − a)·(1 − w)`.
#[inline(always)]
fn lerp(a: f32, b: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        a + w * (b - a)
    } else {
        b - (b - a) * (1.0 - w)
    }
}

impl TorchAoRule {
    /// The step over values whose moments are in f32 `m`, `v` (updated in place).
    #[inline(always)]
    fn values(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        let n = p.len().min(m.len()).min(v.len()).min(g.len());
        let (p, m, v, g) = (&mut p[..n], &mut m[..n], &mut v[..n], &g[..n]);
        for k in 0..n {
            let mut gk = g[k] * self.grad_scale;
            let mut pk = p[k];
            if self.l2 != 0.0 {
                gk += self.l2 * pk;
            } else {
                pk -= self.lr_wd * pk;
            }
            m[k] = lerp(m[k], gk, self.w1);
            v[k] = lerp(v[k], gk * gk, self.w2);
            let denom = v[k].sqrt() / self.sqrt_bc2 + self.eps;
            p[k] = pk - self.lr * (m[k] / self.bc1) / denom;
        }
    }

    /// The step with f32 moments (torchao keeps small parameters' moments in f32), in parallel
    /// chunks; element-wise, so identical to one sequential loop.
    pub fn apply(&self, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        const CHUNK: usize = 1 << 15;
        p.par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK))
            .for_each(|(((p, m), v), g)| {
                vectorized(
                    #[inline(always)]
                    || self.values(p, m, v, g),
                )
            });
    }

    /// The step with block-quantised moments: each block's moments decoded to f32, updated,
    /// re-encoded, and the parameter updated from the f32 values (blocks in parallel).
    pub fn apply_blocks(&self, p: &mut [f32], m: &mut BlockMoment, v: &mut BlockMoment, g: &[f32]) {
        let n = p.len();
        assert!(
            m.len() == n
                && v.len() == n
                && g.len() == n
                && m.block == v.block
                && m.codec == v.codec,
            "block moments of {} and {} values for {n} parameters",
            m.len(),
            v.len()
        );
        let (codec, block) = (m.codec, m.block);
        let per = BlockMoment::code_bytes(codec, block);
        // Enough blocks per task to amortise the split (~32k values).
        let blocks_per_task = (32_768 / block).max(1);
        let (ms, vs) = (m.signed, v.signed);
        p.par_chunks_mut(block * blocks_per_task)
            .zip(g.par_chunks(block * blocks_per_task))
            .zip(m.codes.par_chunks_mut(per * blocks_per_task))
            .zip(m.scale.par_chunks_mut(blocks_per_task))
            .zip(v.codes.par_chunks_mut(per * blocks_per_task))
            .zip(v.scale.par_chunks_mut(blocks_per_task))
            .for_each(|(((((p, g), mc), msc), vc), vsc)| {
                let mut mf = vec![0f32; block];
                let mut vf = vec![0f32; block];
                vectorized(
                    #[inline(always)]
                    || {
                        for (k, (pb, gb)) in p.chunks_mut(block).zip(g.chunks(block)).enumerate() {
                            let (mcb, vcb) = (
                                &mut mc[k * per..(k + 1) * per],
                                &mut vc[k * per..(k + 1) * per],
                            );
                            decode_block(codec, ms, mcb, msc[k], &mut mf);
                            decode_block(codec, vs, vcb, vsc[k], &mut vf);
                            self.values(pb, &mut mf, &mut vf, gb);
                            msc[k] = encode_block(codec, ms, &mf, mcb);
                            vsc[k] = encode_block(codec, vs, &vf, vcb);
                        }
                    },
                )
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every E4M3 code decodes and encodes back to itself (NaN codes to the NaN code), and
    /// values half way between neighbours round to the even code: a hand-checked table of
    /// the format (1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities).
    #[test]
    fn e4m3_round_trips_and_rounds_to_even() {
        for c in 0..=255u8 {
            let f = e4m3_to_f32(c);
            if f.is_nan() {
                assert_eq!(c & 0x7f, 0x7f);
                assert_eq!(e4m3_from_f32(f) & 0x7f, 0x7f);
            } else if f != 0.0 {
                assert_eq!(e4m3_from_f32(f), c, "{c:#x} = {f}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        // 1 + 1/16 lies between 1 (0x38, even) and 1.125 (0x39): even wins; 1.1875 → 1.25 (0x3a).
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.1875), 0x3a);
        assert_eq!(e4m3_from_f32(-448.0), 0xfe);
        assert_eq!(e4m3_from_f32(500.0), 0x7f);
    }

    /// Encoding then decoding lands each value on its nearest map entry (checked against a
    /// linear scan over the map), for both 8-bit maps and both 4-bit maps.
    #[test]
    fn codes_are_the_nearest_map_entries() {
        for (codec, signed) in [
            (Codec::Map8, true),
            (Codec::Map8, false),
            (Codec::Map4, true),
            (Codec::Map4, false),
        ] {
            let m = map(codec == Codec::Map4, signed);
            let block = 64;
            let x: Vec<f32> = (0..block)
                .map(|i| {
                    let t = ((i * 37) % 64) as f32 / 63.0;
                    let t = t * t * t;
                    if signed && i % 2 == 1 {
                        -t
                    } else {
                        t
                    }
                })
                .collect();
            let mut b = BlockMoment::zeros(codec, signed, block, block);
            b.set_f32(&x);
            let back = b.to_f32();
            let scale = b.scale[0];
            for (i, (&xi, &yi)) in x.iter().zip(&back).enumerate() {
                let s = xi / scale;
                let best = m
                    .iter()
                    .map(|&q| (q - s).abs())
                    .fold(f32::INFINITY, f32::min);
                assert!(
                    ((yi / scale) - s).abs() <= best * (1.0 + 1e-6) + 1e-7,
                    "{codec:?} signed={signed} value {i}: {xi} decoded {yi}, nearest gap {best}"
                );
            }
        }
    }
}
