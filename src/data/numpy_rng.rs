//! NumPy's `np.random.default_rng(seed).choice(total, size=k, replace=False)`, bit for bit, so
//! `data.train_max_samples` / `data.val_max_samples` with `data.shuffle` keep exactly the rows
//! verl keeps (`verl/utils/dataset/rl_dataset.py`, `RLHFDataset.__init__`).
//!
//! The pieces, as NumPy (>= 1.17) defines them:
//! - `SeedSequence(seed)`: the seed's 32-bit words hashed into a pool of four words, then
//!   `generate_state(4, uint64)` (`numpy/random/bit_generator.pyx`);
//! - `PCG64`: a 128-bit LCG seeded with (state, increment) from those words, output XSL-RR
//!   (`numpy/random/src/pcg64/pcg64.h`); 32-bit draws use the low then the high half of one
//!   64-bit output;
//! - bounded integers in `[0, n]` by Lemire's multiply-shift with rejection on 32-bit draws
//!   (`random_bounded_uint64` → `buffered_bounded_lemire_uint32`, `distributions.c`);
//! - `Generator.choice` without replacement: Floyd's sampling then a Fisher-Yates shuffle of the
//!   picks, or (population > 10000 and k > population / 50) a partial Fisher-Yates of the tail
//!   (`numpy/random/_generator.pyx`).

use std::collections::HashSet;

const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
const POOL: usize = 4;
const PCG_MULT: u128 = (2_549_297_995_355_413_924u128 << 64) + 4_865_540_595_714_422_341u128;

fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// `SeedSequence(seed).generate_state(4, np.uint64)`.
fn seed_state(seed: u64) -> [u64; 4] {
    // The integer as little-endian 32-bit words (0 is one zero word).
    let mut entropy = vec![seed as u32];
    if seed >> 32 != 0 {
        entropy.push((seed >> 32) as u32);
    }
    let mut pool = [0u32; POOL];
    let mut hc = INIT_A;
    for (i, slot) in pool.iter_mut().enumerate() {
        *slot = hashmix(entropy.get(i).copied().unwrap_or(0), &mut hc);
    }
    for src in 0..POOL {
        for dst in 0..POOL {
            if src != dst {
                pool[dst] = mix(pool[dst], hashmix(pool[src], &mut hc));
            }
        }
    }
    for &word in entropy.iter().skip(POOL) {
        for slot in pool.iter_mut() {
            *slot = mix(*slot, hashmix(word, &mut hc));
        }
    }
    let mut words = [0u32; 8];
    let mut hc = INIT_B;
    for (i, w) in words.iter_mut().enumerate() {
        let mut v = pool[i % POOL] ^ hc;
        hc = hc.wrapping_mul(MULT_B);
        v = v.wrapping_mul(hc);
        *w = v ^ (v >> XSHIFT);
    }
    let mut out = [0u64; 4];
    for (i, o) in out.iter_mut().enumerate() {
        *o = words[2 * i] as u64 | ((words[2 * i + 1] as u64) << 32);
    }
    out
}

/// NumPy's `PCG64` bit generator (with its buffered 32-bit half-words).
pub struct Pcg64 {
    state: u128,
    inc: u128,
    spare: Option<u32>,
}

impl Pcg64 {
    /// `np.random.default_rng(seed)`'s bit generator.
    pub fn from_seed(seed: u64) -> Self {
        let s = seed_state(seed);
        let initstate = ((s[0] as u128) << 64) | s[1] as u128;
        let initseq = ((s[2] as u128) << 64) | s[3] as u128;
        let mut g = Self {
            state: 0,
            inc: (initseq << 1) | 1,
            spare: None,
        };
        g.step();
        g.state = g.state.wrapping_add(initstate);
        g.step();
        g
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        (((s >> 64) as u64) ^ (s as u64)).rotate_right((s >> 122) as u32)
    }

    pub fn next_u32(&mut self) -> u32 {
        if let Some(v) = self.spare.take() {
            return v;
        }
        let n = self.next_u64();
        self.spare = Some((n >> 32) as u32);
        n as u32
    }

    /// A uniform integer in `[0, n]` (NumPy's `random_bounded_uint64(0, n, 0, use_masked=False)`).
    pub fn bounded(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        if n <= u32::MAX as u64 {
            if n == u32::MAX as u64 {
                return self.next_u32() as u64;
            }
            let excl = n as u32 + 1;
            let mut m = self.next_u32() as u64 * excl as u64;
            let mut leftover = m as u32;
            if leftover < excl {
                let threshold = (u32::MAX - n as u32) % excl;
                while leftover < threshold {
                    m = self.next_u32() as u64 * excl as u64;
                    leftover = m as u32;
                }
            }
            return m >> 32;
        }
        if n == u64::MAX {
            return self.next_u64();
        }
        // Lemire on 64-bit draws (populations beyond 2³² rows; NumPy's `bounded_lemire_uint64`).
        let excl = n + 1;
        let mut m = self.next_u64() as u128 * excl as u128;
        let mut leftover = m as u64;
        if leftover < excl {
            let threshold = (u64::MAX - n) % excl;
            while leftover < threshold {
                m = self.next_u64() as u128 * excl as u128;
                leftover = m as u64;
            }
        }
        (m >> 64) as u64
    }

    /// Fisher-Yates from the back over `data[first..n]` (NumPy's `Generator._shuffle_int`).
    fn shuffle_from(&mut self, data: &mut [u64], first: usize) {
        for i in (first..data.len()).rev() {
            let j = self.bounded(i as u64) as usize;
            data.swap(i, j);
        }
    }

    /// `Generator.choice(total, size=k, replace=False)` (shuffle=True): `k` distinct indices
    /// of `0..total` in NumPy's order. `k` must not exceed `total`.
    pub fn choice_without_replacement(&mut self, total: usize, k: usize) -> Vec<usize> {
        assert!(k <= total, "choice: sample larger than population");
        let (pop, size) = (total as u64, k as u64);
        if pop > 10_000 && size > pop / 50 {
            let mut idx: Vec<u64> = (0..pop).collect();
            self.shuffle_from(&mut idx, (total - k).max(1));
            return idx[total - k..].iter().map(|&v| v as usize).collect();
        }
        let mut picked = Vec::with_capacity(k);
        let mut seen = HashSet::with_capacity(k);
        for j in pop - size..pop {
            let val = self.bounded(j);
            if seen.insert(val) {
                picked.push(val);
            } else {
                seen.insert(j);
                picked.push(j);
            }
        }
        self.shuffle_from(&mut picked, 1);
        picked.into_iter().map(|v| v as usize).collect()
    }
}

/// NumPy's legacy `RandomState` (`np.random.seed(seed)` then `np.random.choice(n, size)` with
/// replacement), which verl's validation bootstrap uses: the MT19937 generator seeded by
/// `init_genrand` (`mt19937_seed`), and bounded integers by masked rejection on 32-bit draws
/// (`randint` → `random_bounded_uint64_fill(use_masked=True)` → `buffered_bounded_masked_uint32`).
pub struct RandomState {
    key: [u32; 624],
    pos: usize,
}

impl RandomState {
    /// `np.random.seed(seed)`.
    pub fn new(seed: u32) -> Self {
        let mut key = [0u32; 624];
        key[0] = seed;
        for i in 1..624 {
            let prev = key[i - 1];
            key[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Self { key, pos: 624 }
    }

    fn refill(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        for i in 0..624 {
            let y = (self.key[i] & UPPER) | (self.key[(i + 1) % 624] & LOWER);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            self.key[i] = self.key[(i + 397) % 624] ^ (y >> 1) ^ mag;
        }
        self.pos = 0;
    }

    /// The next tempered 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        if self.pos >= 624 {
            self.refill();
        }
        let mut y = self.key[self.pos];
        self.pos += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// A uniform integer in `[0, n)` as `randint(0, n)` draws it (`n` ≤ 2³²).
    pub fn below(&mut self, n: u64) -> u64 {
        let rng = n.saturating_sub(1);
        if rng == 0 {
            return 0;
        }
        if rng >= u32::MAX as u64 {
            return u64::from(self.next_u32());
        }
        let mut mask = rng;
        for shift in [1, 2, 4, 8, 16] {
            mask |= mask >> shift;
        }
        loop {
            let v = u64::from(self.next_u32()) & mask;
            if v <= rng {
                return v;
            }
        }
    }

    /// `choice(n, size=count, replace=True)`: `count` draws in `[0, n)`, in order.
    pub fn choice_with_replacement(&mut self, n: usize, count: usize) -> Vec<usize> {
        (0..count).map(|_| self.below(n as u64) as usize).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `np.random.default_rng(seed).bit_generator.random_raw(n)` in NumPy 2.4.6 (one word
    /// seed, and a seed of two 32-bit words).
    #[test]
    fn raw_stream_matches_numpy() {
        let mut g = Pcg64::from_seed(1);
        let got: Vec<u64> = (0..3).map(|_| g.next_u64()).collect();
        assert_eq!(
            got,
            [
                9441442522235856127,
                17532960557476522086,
                2659275481604167885
            ]
        );
        let mut g = Pcg64::from_seed((1 << 40) + 5);
        assert_eq!(
            [g.next_u64(), g.next_u64()],
            [87427594128977387, 6872972437549564694]
        );
    }

    /// Expected rows printed by NumPy 2.4.6 (run for this test):
    /// `np.random.default_rng(seed).choice(total, size=k, replace=False)`.
    /// The 30000/1000 case takes NumPy's tail-shuffle branch, the others Floyd's.
    #[test]
    fn choice_matches_numpy() {
        let full: [(u64, usize, usize, &[usize]); 4] = [
            (1, 10, 4, &[6, 4, 9, 3]),
            (42, 100, 7, &[99, 85, 42, 62, 8, 73, 97]),
            (0, 5, 3, &[3, 4, 2]),
            (
                123_456_789_012,
                1000,
                10,
                &[278, 281, 83, 561, 477, 494, 174, 262, 943, 670],
            ),
        ];
        for (seed, total, k, want) in full {
            let got = Pcg64::from_seed(seed).choice_without_replacement(total, k);
            assert_eq!(got, want, "seed {seed}, {k} of {total}");
        }
        let got = Pcg64::from_seed(7).choice_without_replacement(30_000, 1000);
        assert_eq!(
            got[..12],
            [29838, 2187, 29051, 15664, 9077, 6584, 25136, 6483, 2126, 3790, 19888, 27120]
        );
        assert_eq!(got[997..], [20524, 18752, 28347]);
        assert_eq!(got.iter().sum::<usize>(), 15_454_781);
    }

    /// Expected values printed by NumPy 2.4.6 (run for this test): `np.random.seed(42);
    /// np.random.choice(4, size=(2, 3), replace=True)`, `np.random.seed(7);
    /// np.random.choice(100000, size=4)`, `np.random.seed(5489); np.random.randint(0, 2**32,
    /// size=2, dtype=np.uint64)` (MT19937's raw outputs; 3499211612 is also the reference
    /// implementation's first output for its default seed).
    #[test]
    fn legacy_random_state_matches_numpy() {
        let mut r = RandomState::new(42);
        assert_eq!(r.choice_with_replacement(4, 6), [2, 3, 0, 2, 2, 3]);
        let mut r = RandomState::new(7);
        assert_eq!(
            r.choice_with_replacement(100_000, 4),
            [61615, 58564, 49689, 10742]
        );
        let mut r = RandomState::new(5489);
        assert_eq!([r.next_u32(), r.next_u32()], [3499211612, 581869302]);
        assert_eq!(
            RandomState::new(42).choice_with_replacement(1, 3),
            [0, 0, 0]
        );
        // Past the first 624 outputs (one refill): `np.random.seed(42); np.random.randint(0, 1000, size=1000)` ends in 250.
        let mut r = RandomState::new(42);
        let v: Vec<usize> = r.choice_with_replacement(1000, 1000);
        assert_eq!(v[..5], [102, 435, 860, 270, 106]);
        assert_eq!(v[999], 250);
    }
}
