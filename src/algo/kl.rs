//! KL estimators and their uses (verl's `core_algos.kl_penalty`, `AdaptiveKLController`,
//! `FixedKLController`, `ray_trainer.apply_kl_penalty`; the actor's KL loss).

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::agg::{agg_loss, scalar, AggNorm};
use super::masked::masked_mean_rows;
use super::Result;
use crate::config::algorithm::KlCtrlConfig;
use crate::config::{KlCtrlType, KlKind, KlPenalty, LossAggMode};

/// The estimator's value, per token: k1 `logp − ref`, abs `|logp − ref|`, k2 `½(logp − ref)²`,
/// k3 `exp(d) − d − 1` with `d = clamp(ref − logp, ±20)`, clamped to ±10.
pub fn kl_penalty_forward(logp: &Tensor, ref_logp: &Tensor, kind: KlKind) -> Result<Tensor> {
    let diff = logp.sub(ref_logp)?;
    match kind {
        KlKind::K1 => Ok(diff),
        // |d| with PyTorch's gradient sign(d), 0 at d = 0 (candle's abs backward gives 1
        // there): d · sg(sign d).
        KlKind::Abs => {
            let sign =
                (diff.gt(0.0)?.to_dtype(diff.dtype())? - diff.lt(0.0)?.to_dtype(diff.dtype())?)?;
            diff.mul(&sign.detach())
        }
        KlKind::K2 => diff.sqr()? * 0.5,
        KlKind::K3 => {
            let d = diff.neg()?.clamp(-20.0, 20.0)?;
            ((d.exp()? - &d)? - 1.0)?.clamp(-10.0, 10.0)
        }
    }
}

/// The estimator `penalty` per token; with a trailing `+` the value is the named estimator's
/// and the gradient is k2's (straight-through: `k2 − sg(k2) + sg(value)`).
pub fn kl_penalty(logp: &Tensor, ref_logp: &Tensor, penalty: KlPenalty) -> Result<Tensor> {
    let forward = kl_penalty_forward(logp, ref_logp, penalty.kind)?;
    if !penalty.straight_through || penalty.kind == KlKind::K2 {
        return Ok(forward);
    }
    let backward = (logp.sub(ref_logp)?.sqr()? * 0.5)?;
    (&backward - backward.detach())? + forward.detach()
}

/// The KL coefficient β and how it moves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct KlController {
    pub kind: KlCtrlType,
    /// Current β.
    pub value: f64,
    pub target_kl: f64,
    pub horizon: f64,
}

impl KlController {
    pub fn new(cfg: &KlCtrlConfig) -> Self {
        Self {
            kind: cfg.kind,
            value: cfg.kl_coef,
            target_kl: cfg.target_kl,
            horizon: cfg.horizon,
        }
    }

    /// Fixed: no change. Adaptive: `β ← β·(1 + clip(kl/target − 1, ±0.2)·n_steps/horizon)`.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if self.kind == KlCtrlType::Adaptive {
            let err = (current_kl / self.target_kl - 1.0).clamp(-0.2, 0.2);
            self.value *= 1.0 + err * n_steps as f64 / self.horizon;
        }
    }
}

/// Token rewards with the KL penalty (`algorithm.use_kl_in_reward`):
/// `rewards = scores − β·kl_penalty(old, ref)·mask`, then the controller is updated with the
/// batch mean of per-sequence masked KL means. Returns `(rewards, current_kl, β used)`, which
/// are the metrics `actor/reward_kl_penalty` and `actor/reward_kl_penalty_coeff`.
pub fn apply_kl_penalty(
    token_level_scores: &Tensor,
    old_log_prob: &Tensor,
    ref_log_prob: &Tensor,
    mask: &Tensor,
    penalty: KlPenalty,
    ctrl: &mut KlController,
) -> Result<(Tensor, f64, f64)> {
    let kld = (kl_penalty(old_log_prob, ref_log_prob, penalty)?.detach() * mask)?;
    let beta = ctrl.value;
    let rewards = token_level_scores.sub(&(&kld * beta)?)?;
    let current_kl = scalar(&masked_mean_rows(&kld, mask)?.mean_all()?)?;
    let batch = token_level_scores.dim(0)?;
    ctrl.update(current_kl, batch);
    Ok((rewards, current_kl, beta))
}

/// The actor's KL loss term (before `kl_loss_coef`): `agg(kl_penalty(logp, ref, type))`.
pub fn kl_loss(
    log_prob: &Tensor,
    ref_log_prob: &Tensor,
    mask: &Tensor,
    kl_loss_type: KlPenalty,
    mode: LossAggMode,
    norm: AggNorm,
) -> Result<Tensor> {
    agg_loss(
        &kl_penalty(log_prob, ref_log_prob, kl_loss_type)?,
        mask,
        mode,
        norm,
    )
}
