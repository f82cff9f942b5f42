//! Small helpers used by layers that do not import each other: paths written with `~`
//! (config, data, model, trainer) and the seeded permutation (the data loader's shuffles,
//! the update's mini-batch order, `clip_cov`'s token draw).

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `~/x` → `$HOME/x` (verl's paths are written with `~`).
pub fn expand_home(p: &str) -> String {
    if let Some(rest) = p.strip_prefix("~/") {
        if let Some(home) = std::env::var_os("HOME") {
            return format!("{}/{rest}", home.to_string_lossy());
        }
    } else if p == "~" {
        if let Some(home) = std::env::var_os("HOME") {
            return home.to_string_lossy().into_owned();
        }
    }
    p.to_string()
}

/// A permutation of `0..len` fixed by `(seed, stream)`: Fisher–Yates over ChaCha8, whose output
/// is fixed by its specification (so orders stay the same across releases and platforms).
pub fn permutation(len: usize, seed: u64, stream: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    let mut p: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        // Multiply-shift bounded draw in [0, i].
        let j = ((rng.next_u64() as u128 * (i as u128 + 1)) >> 64) as usize;
        p.swap(i, j);
    }
    p
}
