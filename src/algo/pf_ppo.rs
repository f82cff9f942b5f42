//! PF-PPO (policy filtration, `algorithm.use_pf_ppo`): after GAE, the step's responses are
//! drawn again, with replacement, in proportion to a weight of each response's score, and the
//! update trains on the drawn batch (the same size; a response may appear several times or not
//! at all). verl: `compute_pf_ppo_reweight_data` in `core_algos.py`, called by
//! `compute_advantage` for `adv_estimator=gae` only.
//!
//! The weight of a response with score s (the sum of its `token_level_scores`, before any KL
//! penalty), over the batch's scores S:
//! - `pow`: |s|^weight_pow,
//! - `max_min`: 1 when s = max S or s = min S, else 0,
//! - `max_random`: 0.4 when s = max S, else 0.1,
//!
//! each then raised by 1e-8 (so that every response can be drawn) as verl does. verl draws
//! with `torch.multinomial(weights, n, replacement=True)` from torch's global generator; here
//! the draws come from a ChaCha stream of the run's seed and the step, so a resumed run draws
//! what the uninterrupted one did. Same distribution, not the same draws.

use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::SeedableRng;

use crate::config::PfPpoReweight;

/// verl's floor on every weight.
const FLOOR: f64 = 1e-8;

/// The resampling weight of each response from its score. `kept[i] = false` (a row left out of
/// the update: a failed reward with `on_error=skip`, a `skip_update` gate) gets weight 0 and
/// does not enter the batch's max/min: it is never drawn.
pub fn weights(scores: &[f64], kept: &[bool], method: PfPpoReweight, weight_pow: f64) -> Vec<f64> {
    let live = || scores.iter().zip(kept).filter(|(_, &k)| k).map(|(&s, _)| s);
    let max = live().fold(f64::NEG_INFINITY, f64::max);
    let min = live().fold(f64::INFINITY, f64::min);
    scores
        .iter()
        .zip(kept)
        .map(|(&s, &k)| {
            if !k {
                return 0.0;
            }
            let w = match method {
                PfPpoReweight::Pow => s.abs().powf(weight_pow),
                PfPpoReweight::MaxMin => f64::from(u8::from(s == max || s == min)),
                PfPpoReweight::MaxRandom => match s == max {
                    true => 0.4,
                    false => 0.1,
                },
            };
            (w + FLOOR).max(FLOOR)
        })
        .collect()
}

/// `n` indices drawn with replacement, index i with probability weights[i] / Σ weights, from
/// the ChaCha stream `(seed, step)`. `None` when no weight is positive (every row left out):
/// there is nothing to draw from and the batch stays as it is.
pub fn resample(weights: &[f64], n: usize, seed: u64, step: u64) -> Option<Vec<usize>> {
    let dist = WeightedIndex::new(weights).ok()?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x7066_5f70_706f);
    rng.set_stream(step);
    Some((0..n).map(|_| dist.sample(&mut rng)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// By hand from the rules in the module header.
    #[test]
    fn weights_follow_each_method() {
        let s = [1.0, -2.0, 0.0, 1.0, 0.5];
        let all = [true; 5];
        let w = weights(&s, &all, PfPpoReweight::Pow, 2.0);
        let want = [1.0 + 1e-8, 4.0 + 1e-8, 1e-8, 1.0 + 1e-8, 0.25 + 1e-8];
        for (g, e) in w.iter().zip(want) {
            assert!((g - e).abs() < 1e-15, "{w:?}");
        }
        let w = weights(&s, &all, PfPpoReweight::MaxMin, 2.0);
        assert_eq!(w, [1.0 + 1e-8, 1.0 + 1e-8, 1e-8, 1.0 + 1e-8, 1e-8]);
        let w = weights(&s, &all, PfPpoReweight::MaxRandom, 2.0);
        assert_eq!(
            w,
            [0.4 + 1e-8, 0.1 + 1e-8, 0.1 + 1e-8, 0.4 + 1e-8, 0.1 + 1e-8]
        );
        // A row left out is never drawn and does not set the maximum.
        let kept = [false, true, true, true, true];
        let w = weights(
            &[9.0, 1.0, 0.0, 1.0, 0.5],
            &kept,
            PfPpoReweight::MaxMin,
            2.0,
        );
        assert_eq!(w, [0.0, 1.0 + 1e-8, 1.0 + 1e-8, 1.0 + 1e-8, 1e-8]);
    }

    /// The draws' frequencies match weights / Σ weights: 200,000 draws, each count within
    /// 5 standard deviations of its binomial mean.
    #[test]
    fn draws_follow_the_weights() {
        let w = [4.0, 1.0, 0.0, 2.0, 1e-8, 1.0];
        let n = 200_000;
        let idx = resample(&w, n, 7, 3).unwrap();
        let total: f64 = w.iter().sum();
        for (i, &wi) in w.iter().enumerate() {
            let p = wi / total;
            let count = idx.iter().filter(|&&j| j == i).count() as f64;
            let sd = (n as f64 * p * (1.0 - p)).sqrt().max(1.0);
            assert!(
                (count - n as f64 * p).abs() <= 5.0 * sd,
                "index {i}: {count} draws, expected {}",
                n as f64 * p
            );
        }
        assert!(!idx.contains(&2), "a zero weight was drawn");
    }

    /// The same (seed, step) draws the same indices (an exact resume); another step differs.
    #[test]
    fn draws_are_a_function_of_seed_and_step() {
        let w = [1.0; 16];
        let a = resample(&w, 16, 1, 5).unwrap();
        assert_eq!(a, resample(&w, 16, 1, 5).unwrap());
        assert_ne!(a, resample(&w, 16, 1, 6).unwrap());
        assert_ne!(a, resample(&w, 16, 2, 5).unwrap());
        assert_eq!(resample(&[0.0, 0.0], 2, 1, 1), None);
    }
}
