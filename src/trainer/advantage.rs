//! The `adv` phase (verl's `apply_kl_penalty` + `compute_advantage` in `ray_trainer.py`):
//! token-level rewards (the scores, minus the KL to the reference when
//! `algorithm.use_kl_in_reward`), then the configured estimator's advantages and returns.
//!
//! Rows left out of the update (`reward.on_error=skip`, a `skip_update` gate) are left out
//! here too: the estimator runs on the other rows only, so they enter no group baseline
//! (GRPO, RLOO, OPO, GPG, pass@k, REINFORCE++ baseline, the optimal token baselines and their
//! zero tail), no batch statistic (whitening, GPG's
//! scale, the KL controller's mean) and a group whose rows are all left out contributes
//! nothing. Left-out rows get advantage and return 0 and their scores as rewards.

use candle_core::{Device, Tensor};

use super::batch::{pad_rows, Column, Ragged, StepBatch};
use crate::algo::{advantages, apply_kl_penalty, HostInputs, KlController, Mat};
use crate::config::{AdvEstimator, AlgorithmConfig, PfPpoConfig};
use crate::metrics::Metrics;

/// PF-PPO (`algorithm.use_pf_ppo`, after GAE): `batch.len()` rows drawn with replacement from
/// `batch`, each with its weight from the sum of its `token_level_scores` (f32, as verl sums
/// them), every column travelling with its row; the rows' order is the draws' (verl's, which
/// balances the batch before). Rows left out of the update are never drawn; a batch of only
/// such rows stays as it is.
pub fn pf_ppo_resample(
    cfg: &PfPpoConfig,
    batch: &StepBatch,
    seed: u64,
    step: u64,
) -> candle_core::Result<StepBatch> {
    let scores: Vec<f64> = batch
        .column(Column::TokenLevelScores)?
        .iter()
        .map(|row| f64::from(row.iter().sum::<f32>()))
        .collect();
    let kept: Vec<bool> = batch.excluded.iter().map(|&e| !e).collect();
    let weights = crate::algo::pf_ppo::weights(&scores, &kept, cfg.reweight_method, cfg.weight_pow);
    Ok(
        match crate::algo::pf_ppo::resample(&weights, batch.len(), seed, step) {
            Some(rows) => batch.select(&rows),
            None => batch.clone(),
        },
    )
}

/// Fills `token_level_rewards`, `advantages` and `returns`; returns the KL-in-reward metrics
/// and those of `correct`, which runs between the KL penalty and the estimator (verl's place
/// for rollout correction: the penalty sees the rollout's mask, the estimator the corrected
/// one). Everything runs on the host: the columns are read as padded `[K, R]` host matrices of
/// the kept rows, and only the KL penalty (shared with the actor's loss) goes through CPU
/// tensors.
pub fn compute(
    alg: &AlgorithmConfig,
    kl_ctrl: &mut KlController,
    batch: &mut StepBatch,
    correct: &mut dyn FnMut(&mut StepBatch) -> candle_core::Result<Metrics>,
) -> candle_core::Result<Metrics> {
    let mut m = Metrics::new();
    let kept: Vec<usize> = (0..batch.len()).filter(|&r| !batch.excluded[r]).collect();
    let lens = batch.response_lens();
    let zeros: Ragged = lens.iter().map(|&l| vec![0f32; l]).collect();
    let mut out = [
        batch.column(Column::TokenLevelScores)?.clone(),
        zeros.clone(),
        zeros,
    ];
    let width = batch.max_response_len();
    if alg.use_kl_in_reward && !kept.is_empty() {
        let (rewards, kl, beta) = kl_in_reward(alg, kl_ctrl, batch, &kept, width)?;
        m.insert("actor/reward_kl_penalty".into(), kl);
        m.insert("actor/reward_kl_penalty_coeff".into(), beta);
        for (i, &r) in kept.iter().enumerate() {
            out[0][r].copy_from_slice(&rewards[i][..lens[r]]);
        }
    }
    m.extend(correct(batch)?);
    if !kept.is_empty() {
        let b: &StepBatch = batch;
        let rows = |c: Column| -> candle_core::Result<Mat> {
            let col = b.column(c)?;
            Ok(Mat::from_rows(
                kept.iter().map(|&r| col[r].as_slice()),
                width,
            )) // [K, R]
        };
        let mask_rows = b.response_mask();
        let mask = Mat::from_rows(kept.iter().map(|&r| mask_rows[r].as_slice()), width);
        let rewards = Mat::from_rows(kept.iter().map(|&r| out[0][r].as_slice()), width);
        let values = if b.has(Column::Values) {
            Some(rows(Column::Values)?)
        } else {
            None
        };
        let index: Vec<u64> = kept.iter().map(|&r| b.uid[r]).collect();
        let baselines: Option<Vec<f64>> = b
            .reward_baselines
            .as_ref()
            // f32 on the way, as the tensor these were read from held them.
            .map(|base| kept.iter().map(|&r| f64::from(base[r] as f32)).collect());
        // The optimal token baselines: the old policy's log-probs and Σπ², and rollout
        // correction's IS weights when it made them (verl's `rollout_is_weights`).
        let otb = matches!(
            alg.adv_estimator,
            AdvEstimator::OptimalTokenBaseline | AdvEstimator::TirOptimalTokenBaseline
        );
        let (old, spi2, is_w) = if otb {
            if !b.has(Column::SumPiSquared) {
                return Err(candle_core::Error::Msg(format!(
                    "algorithm.adv_estimator={} needs `sum_pi_squared` from the old-log-prob pass: set actor_rollout_ref.actor.calculate_sum_pi_squared=True",
                    alg.adv_estimator.as_str()
                )));
            }
            let is_w = match b.has(Column::RolloutIsWeights) {
                true => Some(rows(Column::RolloutIsWeights)?),
                false => None,
            };
            (
                Some(rows(Column::OldLogProbs)?),
                Some(rows(Column::SumPiSquared)?),
                is_w,
            )
        } else {
            (None, None, None)
        };
        let components = match (alg.adv_estimator, &alg.gdpo_reward_keys) {
            (AdvEstimator::Gdpo, Some(keys)) => Some(reward_components(b, &kept, keys)?),
            _ => None,
        };
        if let (Some(comps), Some(keys)) = (&components, &alg.gdpo_reward_keys) {
            // verl's gdpo/<key>/{mean,std,max,min} (population std), over the kept rows.
            for (key, c) in keys.iter().zip(comps) {
                let n = c.len() as f64;
                let mean = c.iter().sum::<f64>() / n;
                let std = (c.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
                let max = c.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let min = c.iter().copied().fold(f64::INFINITY, f64::min);
                for (stat, v) in [("mean", mean), ("std", std), ("max", max), ("min", min)] {
                    m.insert(format!("gdpo/{key}/{stat}"), v);
                }
            }
        }
        let (adv, ret) = advantages(
            alg.adv_estimator,
            &HostInputs {
                token_level_rewards: &rewards,
                response_mask: &mask,
                values: values.as_ref(),
                index: Some(&index),
                reward_baselines: baselines.as_deref(),
                reward_components: components.as_deref(),
                old_log_probs: old.as_ref(),
                sum_pi_squared: spi2.as_ref(),
                rollout_is_weights: is_w.as_ref(),
            },
            alg,
        )?;
        // Stored in f32: advantages masked in f32, returns as they are.
        for (i, &r) in kept.iter().enumerate() {
            let (a, rt, mk) = (adv.row(i), ret.row(i), mask.row(i));
            out[1][r] = (0..lens[r]).map(|t| a[t] as f32 * mk[t] as f32).collect();
            out[2][r] = rt[..lens[r]].iter().map(|&x| x as f32).collect();
        }
    }
    let [rewards, adv, ret] = out;
    batch.set(Column::TokenLevelRewards, rewards)?;
    batch.set(Column::Advantages, adv)?;
    batch.set(Column::Returns, ret)?;
    Ok(m)
}

/// gdpo's reward components: for each of `keys`, the kept rows' values under that key of what the
/// reward function returned (a number or a bool), rounded to f32 as verl reads them. A row
/// without the key, or with a value that is not a number, is an error naming both.
fn reward_components(
    b: &StepBatch,
    kept: &[usize],
    keys: &[String],
) -> candle_core::Result<Vec<Vec<f64>>> {
    keys.iter()
        .map(|key| {
            kept.iter()
                .map(|&r| {
                    let extra = &b.rewards[r].extra;
                    let v = match extra.get(key) {
                        Some(serde_json::Value::Bool(x)) => Some(f64::from(u8::from(*x))),
                        Some(v) => v.as_f64(),
                        None => {
                            let have: Vec<&str> = extra.keys().map(String::as_str).collect();
                            return Err(candle_core::Error::Msg(format!(
                                "algorithm.gdpo_reward_keys: response {r} has no `{key}` among the values its reward returned ({have:?}); compute_score must return a dict holding every key"
                            )));
                        }
                    };
                    v.map(|x| f64::from(x as f32)).ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "algorithm.gdpo_reward_keys: response {r}'s `{key}` is {}, not a number",
                            extra[key]
                        ))
                    })
                })
                .collect()
        })
        .collect()
}

/// `algorithm.use_kl_in_reward`: the kept rows' token rewards, scores − β·KL(old ‖ ref), as
/// `[K][R]` f32 rows, with the step's KL and the β used (the controller moves).
fn kl_in_reward(
    alg: &AlgorithmConfig,
    kl_ctrl: &mut KlController,
    b: &StepBatch,
    kept: &[usize],
    width: usize,
) -> candle_core::Result<(Vec<Vec<f32>>, f64, f64)> {
    let cpu = &Device::Cpu;
    let rows = |c: Column| pad_rows(b.column(c)?, kept, width, cpu); // [K, R]
    let mask: Tensor = pad_rows(&b.response_mask(), kept, width, cpu)?;
    let (scores, old, reference) = (
        rows(Column::TokenLevelScores)?,
        rows(Column::OldLogProbs)?,
        rows(Column::RefLogProb)?,
    );
    let (r, kl, beta) =
        apply_kl_penalty(&scores, &old, &reference, &mask, alg.kl_penalty, kl_ctrl)?;
    Ok((r.to_vec2()?, kl, beta))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdvEstimator;

    /// Two prompts × four responses of 1–3 tokens; scores `scores`, row `skip` excluded
    /// (or none), critic values and ReMax baselines that differ per row.
    fn batch(scores: &[f64], skip: Option<usize>) -> StepBatch {
        let rows = scores.len();
        let lens: Vec<usize> = (0..rows).map(|r| 1 + r % 3).collect();
        let mut b = StepBatch::new(
            vec![vec![1, 2]; rows],
            lens.iter().map(|&l| vec![7; l]).collect(),
            (0..rows).collect(),
            (0..rows).map(|r| (r / 4) as u64).collect(),
            vec![false; rows],
        );
        let placed = crate::reward::placement::place_rows(scores, &lens).unwrap();
        b.set(Column::TokenLevelScores, placed).unwrap();
        let values: Ragged = lens
            .iter()
            .enumerate()
            .map(|(r, &l)| (0..l).map(|t| 0.1 * (r + t) as f32).collect())
            .collect();
        b.set(Column::Values, values.clone()).unwrap();
        // Old log-probs and Σπ² for the optimal token baselines: π = e^(−0.1·(r+t+1)).
        let old: Ragged = values
            .iter()
            .map(|r| r.iter().map(|v| -v - 0.1).collect())
            .collect();
        let sq: Ragged = old
            .iter()
            .map(|r| r.iter().map(|lp| (2.0 * lp).exp() + 0.05).collect())
            .collect();
        b.set(Column::OldLogProbs, old).unwrap();
        b.set(Column::SumPiSquared, sq).unwrap();
        b.reward_baselines = Some((0..rows).map(|r| 0.25 * (r / 4) as f64).collect());
        if let Some(s) = skip {
            b.excluded[s] = true;
        }
        b
    }

    /// `b` without row `r`, as if it had never been sampled.
    fn without(b: &StepBatch, r: usize, scores: &[f64]) -> StepBatch {
        let keep = |v: &Ragged| -> Ragged {
            v.iter()
                .enumerate()
                .filter(|(i, _)| *i != r)
                .map(|(_, x)| x.clone())
                .collect()
        };
        let pick = move |n: usize| (0..n).filter(move |&i| i != r);
        let mut out = StepBatch::new(
            pick(b.len()).map(|i| b.prompts[i].clone()).collect(),
            pick(b.len()).map(|i| b.responses[i].clone()).collect(),
            pick(b.len()).map(|i| b.sample[i]).collect(),
            pick(b.len()).map(|i| b.uid[i]).collect(),
            vec![false; b.len() - 1],
        );
        let lens = out.response_lens();
        let s: Vec<f64> = pick(b.len()).map(|i| scores[i]).collect();
        let placed = crate::reward::placement::place_rows(&s, &lens).unwrap();
        out.set(Column::TokenLevelScores, placed).unwrap();
        for c in [Column::Values, Column::OldLogProbs, Column::SumPiSquared] {
            out.set(c, keep(b.column(c).unwrap())).unwrap();
        }
        out.reward_baselines = b
            .reward_baselines
            .as_ref()
            .map(|v| pick(b.len()).map(|i| v[i]).collect());
        out
    }

    fn run(est: AdvEstimator, b: &mut StepBatch) -> Ragged {
        let alg = AlgorithmConfig {
            adv_estimator: est,
            ..Default::default()
        };
        let mut kl = KlController::new(&alg.kl_ctrl);
        compute(&alg, &mut kl, b, &mut |_| Ok(Metrics::new())).unwrap();
        b.column(Column::Advantages).unwrap().clone()
    }

    #[test]
    fn a_skipped_sample_enters_no_baseline_or_batch_statistic() {
        // Row 0 failed to score (its placed score is 0); rows 1–3 of its group all scored 1.
        let scores = [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0];
        let all = [
            AdvEstimator::Gae,
            AdvEstimator::Grpo,
            AdvEstimator::Rloo,
            AdvEstimator::RlooVectorized,
            AdvEstimator::ReinforcePlusPlus,
            AdvEstimator::ReinforcePlusPlusBaseline,
            AdvEstimator::Remax,
            AdvEstimator::Opo,
            AdvEstimator::GrpoPassk,
            AdvEstimator::Gpg,
            AdvEstimator::OptimalTokenBaseline,
            AdvEstimator::TirOptimalTokenBaseline,
        ];
        for est in all {
            let mut skipped = batch(&scores, Some(0));
            let got = run(est, &mut skipped);
            // Reference: the same batch with row 0 never sampled.
            let want = run(est, &mut without(&skipped, 0, &scores));
            assert!(got[0].iter().all(|&a| a == 0.0), "{est:?}: {:?}", got[0]);
            for r in 1..scores.len() {
                for (a, w) in got[r].iter().zip(&want[r - 1]) {
                    assert!((a - w).abs() < 1e-6, "{est:?} row {r}: {a} vs {w}");
                }
            }
        }
        // Hand value (issue #17's example): GRPO on [skipped, 1, 1, 1] gives 0, not 0.5.
        let mut b = batch(&scores, Some(0));
        let grpo = run(AdvEstimator::Grpo, &mut b);
        assert!(
            grpo[1..4].iter().flatten().all(|&a| a.abs() < 1e-6),
            "{grpo:?}"
        );
    }

    #[test]
    fn a_group_whose_samples_are_all_skipped_contributes_nothing() {
        let scores = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0];
        let mut b = batch(&scores, None);
        b.excluded[..4].fill(true);
        let got = run(AdvEstimator::Gpg, &mut b);
        // GPG's scale counts the rows with a non-zero score among the rows it sees (4 rows,
        // 2 non-zero: α = 2); the group mean is 0.5: advantages ±α·0.5 = ±1.
        for (r, row) in got.iter().enumerate() {
            let want = match r {
                0..=3 => 0.0,
                5 | 7 => 1.0,
                _ => -1.0,
            };
            assert!(
                row.iter().all(|&a| (a - want).abs() < 1e-6),
                "row {r}: {row:?}"
            );
        }
        let mut none = batch(&scores, None);
        none.excluded.fill(true);
        assert!(run(AdvEstimator::Grpo, &mut none)
            .iter()
            .flatten()
            .all(|&a| a == 0.0));
    }
}
