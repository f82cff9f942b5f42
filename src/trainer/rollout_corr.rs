//! Rollout correction in the step (verl 1dda039's `compute_rollout_correction_and_add_to_batch`
//! and `calculate_debug_metrics`), between the rollout's own log-probs (`rollout_log_probs`,
//! kept with `rollout.calculate_log_probs`) and the trainer's old log-probs:
//!
//! - in the `adv` phase, after the KL penalty and before the estimator (verl's place): IS
//!   weights into `rollout_is_weights` (the policy loss multiplies each token by its weight),
//!   the rejection mask into `response_mask` (rejected tokens leave the estimator's mask, the
//!   losses and their token counts), and the `rollout_corr/*` metrics;
//! - with neither correction on, the same `rollout_corr/*` diagnostics are logged anyway, as
//!   verl does, and `training/rollout_probs_diff_*`: how far the rollout's token probabilities
//!   are from the trainer's (bf16 decode against the f32 forward here).
//!
//! Every row of the step takes part; a row left out of the update counts as an empty response.

use candle_core::{DType, Tensor};

use super::batch::{Column, Ragged, StepBatch};
use crate::algo::rollout_corr::{correct, Correction, Grid};
use crate::algo::{agg_loss, masked_mean, policy_loss, PolicyLossOutput, PolicyLossParams};
use crate::config::{BypassLoss, PolicyLossMode};
use crate::metrics::Metrics;

/// A column as a `[rows, max_len]` grid (0 past each response).
fn grid(values: &Ragged, width: usize) -> Grid {
    let mut data = vec![0.0; values.len() * width];
    for (r, v) in values.iter().enumerate() {
        for (t, &x) in v.iter().enumerate() {
            data[r * width + t] = f64::from(x);
        }
    }
    Grid::new(values.len(), width, data)
}

/// A grid's rows trimmed to the responses' lengths, in f32.
fn ragged(g: &Grid, lens: &[usize]) -> Ragged {
    (0..g.rows)
        .map(|r| g.row(r)[..lens[r]].iter().map(|&x| x as f32).collect())
        .collect()
}

/// Applies `correction` to the step: fills `rollout_is_weights` (with `rollout_is`) and
/// `response_mask` (with `rollout_rs`); returns the `rollout_corr/*` metrics. A step whose
/// rows are all left out of the update has nothing to correct (no metrics).
pub fn apply(correction: &Correction, b: &mut StepBatch) -> candle_core::Result<Metrics> {
    let width = b.max_response_len();
    let old = grid(b.column(Column::OldLogProbs)?, width);
    let rollout = grid(b.column(Column::RolloutLogProbs)?, width);
    let mask = grid(&b.response_mask(), width);
    if !mask.data.iter().any(|&x| x != 0.0) {
        return Ok(Metrics::new());
    }
    let out = correct(&old, &rollout, &mask, correction).map_err(candle_core::Error::Msg)?;
    let lens = b.response_lens();
    if let Some(w) = &out.weights {
        b.set(Column::RolloutIsWeights, ragged(w, &lens))?;
    }
    if !correction.rs.is_empty() {
        b.set(Column::ResponseMask, ragged(&out.mask, &lens))?;
    }
    Ok(out.metrics)
}

/// [`probs_diff_metrics`] (on the mask before rejection), then [`apply`]: what a step logs and
/// changes.
pub fn apply_with_diagnostics(
    correction: &Correction,
    b: &mut StepBatch,
) -> candle_core::Result<Metrics> {
    let mut m = probs_diff_metrics(b)?;
    m.extend(apply(correction, b)?);
    Ok(m)
}

/// verl's `training/rollout_probs_diff_*` (`calculate_debug_metrics`): over the tokens in the
/// update, |p_trainer − p_rollout| of each sampled token's probability — its max, mean and
/// (Bessel-corrected) std — and the Pearson correlation of the two probabilities. With fewer
/// than two tokens the std is 0 and the correlation is left out (verl logs NaN), as it is when
/// either side is constant.
pub fn probs_diff_metrics(b: &StepBatch) -> candle_core::Result<Metrics> {
    let (old, rollout) = (
        b.column(Column::OldLogProbs)?,
        b.column(Column::RolloutLogProbs)?,
    );
    let mut pairs = Vec::new();
    for r in 0..b.len() {
        for t in 0..b.response_len(r) {
            if b.token_in_update(r, t) {
                pairs.push((f64::from(old[r][t]).exp(), f64::from(rollout[r][t]).exp()));
            }
        }
    }
    let mut m = Metrics::new();
    if pairs.is_empty() {
        m.insert("training/rollout_probs_diff_valid".into(), 0.0);
        return Ok(m);
    }
    let n = pairs.len() as f64;
    let diff: Vec<f64> = pairs.iter().map(|(a, r)| (a - r).abs()).collect();
    let mean = diff.iter().sum::<f64>() / n;
    let std = if pairs.len() > 1 {
        (diff.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    m.insert("training/rollout_probs_diff_valid".into(), 1.0);
    m.insert(
        "training/rollout_probs_diff_max".into(),
        diff.iter().copied().fold(0.0, f64::max),
    );
    m.insert("training/rollout_probs_diff_mean".into(), mean);
    m.insert("training/rollout_probs_diff_std".into(), std);
    let (ma, mr) = (
        pairs.iter().map(|p| p.0).sum::<f64>() / n,
        pairs.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let cov: f64 = pairs.iter().map(|(a, r)| (a - ma) * (r - mr)).sum();
    let va: f64 = pairs.iter().map(|(a, _)| (a - ma).powi(2)).sum();
    let vr: f64 = pairs.iter().map(|(_, r)| (r - mr).powi(2)).sum();
    if pairs.len() > 1 && va > 0.0 && vr > 0.0 {
        m.insert(
            "training/rollout_actor_probs_pearson_corr".into(),
            cov / (va * vr).sqrt(),
        );
    }
    Ok(m)
}

/// The policy loss of one micro-batch in bypass mode (verl's `compute_policy_loss_bypass_mode`):
/// the old log-probs are the rollout's (`rollout`, `[m, r]`), and rollout correction is
/// recomputed here from the current log-probs `lp` (detached): the rejection mask replaces
/// `mask` in the policy loss, and
/// - `ppo_clip`: verl's vanilla clipped loss with ratio π/π_rollout (whatever `loss_mode` is;
///   IS weights not applied, the ratio is the correction);
/// - `reinforce`: −w·A·log π aggregated by `loss_agg_mode`, w the IS weights (1 without
///   `rollout_is`); `actor/ppo_kl` = mean(rollout − log π).
///
/// Returns the loss and the micro-batch's `rollout_corr/*` metrics. A micro-batch with no token
/// in the update is not corrected.
pub fn bypass_loss(
    loss: BypassLoss,
    correction: &Correction,
    lp: &Tensor,
    rollout: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    params: &PolicyLossParams,
) -> candle_core::Result<(PolicyLossOutput, Metrics)> {
    let host = |t: &Tensor| -> candle_core::Result<Grid> {
        let (m, r) = t.dims2()?;
        let v: Vec<f32> = t.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        Ok(Grid::new(m, r, v.into_iter().map(f64::from).collect()))
    };
    let (m, r) = mask.dims2()?;
    let host_mask = host(mask)?;
    let (weights, eff_mask, metrics) = if host_mask.data.iter().any(|&x| x != 0.0) {
        let out = correct(&host(lp)?, &host(rollout)?, &host_mask, correction)
            .map_err(candle_core::Error::Msg)?;
        let to_t = |g: &Grid| {
            let v: Vec<f32> = g.data.iter().map(|&x| x as f32).collect();
            Tensor::from_vec(v, (m, r), mask.device())?.to_dtype(mask.dtype())
        };
        let w = out.weights.as_ref().map(to_t).transpose()?;
        (w, to_t(&out.mask)?, out.metrics)
    } else {
        (None, mask.clone(), Metrics::new())
    };
    let out = match loss {
        BypassLoss::PpoClip => {
            let vanilla = PolicyLossParams {
                mode: PolicyLossMode::Vanilla,
                ..params.clone()
            };
            policy_loss(rollout, lp, adv, &eff_mask, &vanilla)?
        }
        BypassLoss::Reinforce => {
            let mut pg = adv.mul(lp)?.neg()?; // [m, r]
            if let Some(w) = &weights {
                pg = pg.mul(w)?;
            }
            let loss = agg_loss(&pg, &eff_mask, params.loss_agg_mode, params.norm)?;
            let kl = masked_mean(&rollout.sub(&lp.detach())?, &eff_mask)?;
            PolicyLossOutput {
                loss,
                pg_clipfrac: None,
                ppo_kl: Some(kl.to_dtype(DType::F64)?.to_scalar::<f64>()?),
                pg_clipfrac_lower: None,
            }
        }
    };
    Ok((out, metrics))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::rollout_corr::build;
    use crate::config::Threshold;

    fn batch() -> StepBatch {
        let mut b = StepBatch::new(
            vec![vec![1]; 3],
            vec![vec![5, 6, 7], vec![5, 6], vec![5]],
            vec![0, 1, 2],
            vec![0, 0, 1],
            vec![false; 3],
        );
        b.set(
            Column::OldLogProbs,
            vec![vec![-0.5, -1.0, -2.0], vec![-0.2, -0.1], vec![-3.0]],
        )
        .unwrap();
        b.set(
            Column::RolloutLogProbs,
            vec![vec![-0.5, -1.5, -2.0], vec![-0.2, -0.3], vec![-1.0]],
        )
        .unwrap();
        b
    }

    /// Token IS weights are exp(old − rollout) truncated at 2; token_k2 with bound 0.5 rejects
    /// the token whose ½(log r)² = ½·2² = 2 (row 2), keeps the others (½·0.5² = 0.125,
    /// ½·0.2² = 0.02); the rejected token leaves the mask and the token counts; a row left
    /// out of the update has weight 0.
    #[test]
    fn weights_and_rejection_reach_the_batch() {
        let mut b = batch();
        b.excluded[1] = true;
        let c = build(
            Some("token"),
            Some(&Threshold::Number(2.0)),
            false,
            Some("token_k2"),
            Some(&Threshold::Number(0.5)),
        )
        .unwrap();
        let m = apply(&c, &mut b).unwrap();
        let w = b.column(Column::RolloutIsWeights).unwrap();
        assert_eq!(w[0], vec![1.0, 0.5f64.exp() as f32, 1.0]);
        assert_eq!(w[1], vec![0.0, 0.0]);
        assert_eq!(w[2], vec![(-2.0f64).exp() as f32]);
        assert_eq!(
            b.response_mask(),
            vec![vec![1.0; 3], vec![0.0; 2], vec![0.0]]
        );
        assert_eq!((b.mask_len(0), b.mask_len(2)), (3, 0));
        // 1 of the 4 tokens in the update rejected.
        let f = m["rollout_corr/rollout_rs_masked_fraction"];
        assert!((f - 0.25).abs() < 1e-8, "{f}");
    }

    /// By hand: probabilities e^-0.5, e^-1, e^-2, e^-3 (trainer) against e^-0.5, e^-1.5,
    /// e^-2, e^-1 (rollout) over the four tokens of rows 0 and 2.
    #[test]
    fn probability_differences() {
        let mut b = batch();
        b.excluded[1] = true;
        let m = probs_diff_metrics(&b).unwrap();
        let e = |x: f64| x.exp();
        let d = [0.0, e(-1.0) - e(-1.5), 0.0, e(-1.0) - e(-3.0)];
        let mean = d.iter().sum::<f64>() / 4.0;
        assert!((m["training/rollout_probs_diff_mean"] - mean).abs() < 1e-7);
        assert!((m["training/rollout_probs_diff_max"] - d[3]).abs() < 1e-7);
        let std = (d.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 3.0).sqrt();
        assert!((m["training/rollout_probs_diff_std"] - std).abs() < 1e-7);
        assert!(m["training/rollout_actor_probs_pearson_corr"] < 1.0);
        assert_eq!(m["training/rollout_probs_diff_valid"], 1.0);
    }
}
