//! The `adv` phase (verl's `apply_kl_penalty` + `compute_advantage` in `ray_trainer.py`):
//! token-level rewards (the scores, minus the KL to the reference when
//! `algorithm.use_kl_in_reward`), then the configured estimator's advantages and returns.

use candle_core::{Device, Tensor};

use super::batch::{dense, Column, StepBatch};
use crate::algo::{apply_kl_penalty, compute_advantage, AdvantageInputs, KlController};
use crate::config::AlgorithmConfig;
use crate::metrics::Metrics;

/// Fills `token_level_rewards`, `advantages` and `returns`; returns the KL-in-reward metrics.
pub fn compute(
    alg: &AlgorithmConfig,
    kl_ctrl: &mut KlController,
    batch: &mut StepBatch,
    device: &Device,
) -> candle_core::Result<Metrics> {
    let mut m = Metrics::new();
    let mask = dense(&batch.response_mask(), batch.max_response_len(), device)?; // [B, R]
    let scores = batch.dense(Column::TokenLevelScores, device)?; // [B, R]
    let rewards = if alg.use_kl_in_reward {
        let (r, kl, beta) = apply_kl_penalty(
            &scores,
            &batch.dense(Column::OldLogProbs, device)?,
            &batch.dense(Column::RefLogProb, device)?,
            &mask,
            alg.kl_penalty,
            kl_ctrl,
        )?;
        m.insert("actor/reward_kl_penalty".into(), kl);
        m.insert("actor/reward_kl_penalty_coeff".into(), beta);
        r
    } else {
        scores
    };
    let values = if batch.has(Column::Values) {
        Some(batch.dense(Column::Values, device)?) // [B, R]
    } else {
        None
    };
    let baselines = batch
        .reward_baselines
        .as_ref()
        .map(|b| Tensor::from_vec(b.iter().map(|&x| x as f32).collect(), b.len(), device)) // [B]
        .transpose()?;
    let (adv, ret) = compute_advantage(
        alg.adv_estimator,
        &AdvantageInputs {
            token_level_rewards: &rewards,
            response_mask: &mask,
            values: values.as_ref(),
            index: Some(&batch.uid),
            reward_baselines: baselines.as_ref(),
        },
        alg,
    )?;
    // Rows left out of the update carry no advantage either (mask is 1 on every other row).
    let adv = (adv * &mask)?;
    batch.set_dense(Column::TokenLevelRewards, &rewards)?;
    batch.set_dense(Column::Advantages, &adv)?;
    batch.set_dense(Column::Returns, &ret)?;
    Ok(m)
}
