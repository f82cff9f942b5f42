//! Policy losses (`actor.policy_loss.loss_mode`), ports of verl's `core_algos.compute_policy_loss_*`.
//! All inputs `[batch, len]`: `old_log_prob` (no gradient), `log_prob` (differentiable),
//! `advantages`, `mask`. Each returns the scalar loss and verl's metrics.

use candle_core::{DType, Tensor, D};

use super::agg::{agg_loss, scalar, AggNorm};
use super::masked::masked_mean;
use super::Result;
use crate::config::{ActorConfig, LossAggMode, PolicyLossMode};

/// The settings a policy loss reads (from `actor_rollout_ref.actor`).
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyLossParams {
    pub mode: PolicyLossMode,
    pub clip_low: f64,
    pub clip_high: f64,
    /// Dual-clip bound for negative advantages (vanilla).
    pub clip_ratio_c: f64,
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    /// dro: coefficient of the quadratic log-ratio penalty (`policy_loss.dro_beta`).
    pub dro_beta: Option<f64>,
    pub loss_agg_mode: LossAggMode,
    pub norm: AggNorm,
    /// Seed of clip_cov's random choice of tokens.
    pub seed: u64,
}

impl PolicyLossParams {
    pub fn from_actor(a: &ActorConfig) -> Self {
        Self {
            mode: a.policy_loss.loss_mode,
            clip_low: a.clip_low(),
            clip_high: a.clip_high(),
            clip_ratio_c: a.clip_ratio_c,
            tau_pos: a.tau_pos,
            tau_neg: a.tau_neg,
            clip_cov_ratio: a.policy_loss.clip_cov_ratio,
            clip_cov_lb: a.policy_loss.clip_cov_lb,
            clip_cov_ub: a.policy_loss.clip_cov_ub,
            kl_cov_ratio: a.policy_loss.kl_cov_ratio,
            ppo_kl_coef: a.policy_loss.ppo_kl_coef,
            dro_beta: a.policy_loss.dro_beta,
            loss_agg_mode: a.loss_agg_mode,
            norm: AggNorm {
                loss_scale_factor: a.loss_scale_factor,
                ..AggNorm::default()
            },
            seed: a.data_loader_seed,
        }
    }
}

/// A policy loss and its metrics (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`;
/// `None` where verl reports nothing for the mode).
#[derive(Debug, Clone)]
pub struct PolicyLossOutput {
    pub loss: Tensor,
    pub pg_clipfrac: Option<f64>,
    pub ppo_kl: Option<f64>,
    pub pg_clipfrac_lower: Option<f64>,
}

impl PolicyLossOutput {
    /// The clip and KL metrics the mode reports, named `names` (pg_clipfrac, ppo_kl,
    /// pg_clipfrac_lower under the caller's prefix).
    pub fn metrics(&self, names: [&'static str; 3]) -> Vec<(&'static str, f64)> {
        let [c, k, l] = names;
        [
            (c, self.pg_clipfrac),
            (k, self.ppo_kl),
            (l, self.pg_clipfrac_lower),
        ]
        .into_iter()
        .filter_map(|(n, v)| v.map(|v| (n, v)))
        .collect()
    }
}

/// 0/1 tensor in `like`'s dtype from a comparison result.
fn float(cond: &Tensor, like: &Tensor) -> Result<Tensor> {
    cond.to_dtype(like.dtype())
}

/// `logp − old` clamped to ±20 (verl's guard) and the importance ratio `exp` of it.
fn clamped_ratio(old: &Tensor, logp: &Tensor) -> Result<(Tensor, Tensor)> {
    let neg_kl = logp.sub(old)?.clamp(-20.0, 20.0)?;
    let ratio = neg_kl.exp()?;
    Ok((neg_kl, ratio))
}

/// PPO's two candidate losses: `−A·r` and `−A·clip(r, 1 − ε_low, 1 + ε_high)`.
fn clip_pair(ratio: &Tensor, adv: &Tensor, p: &PolicyLossParams) -> Result<(Tensor, Tensor)> {
    let l1 = ratio.mul(adv)?.neg()?;
    let l2 = ratio
        .clamp(1.0 - p.clip_low, 1.0 + p.clip_high)?
        .mul(adv)?
        .neg()?;
    Ok((l1, l2))
}

fn mean_m(x: &Tensor, mask: &Tensor) -> Result<f64> {
    scalar(&masked_mean(x, mask)?)
}

/// Computes the loss selected by `p.mode`.
pub fn policy_loss(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
) -> Result<PolicyLossOutput> {
    policy_loss_weighted(old_log_prob, log_prob, advantages, mask, p, None)
}

/// [`policy_loss`] with per-token weights `rollout_is_weights` `[batch, len]` (no gradient:
/// rollout correction's importance weights) multiplying each token's loss before
/// aggregation, as verl's losses take them; geo_mean, whose loss is per sequence, takes each
/// row's geometric mean of its valid tokens' weights.
pub fn policy_loss_weighted(
    old_log_prob: &Tensor,
    log_prob: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    rollout_is_weights: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let (old, logp, adv, w) = (old_log_prob, log_prob, advantages, rollout_is_weights);
    match p.mode {
        PolicyLossMode::Vanilla => vanilla(old, logp, adv, mask, p, w),
        PolicyLossMode::Gspo => gspo(old, logp, adv, mask, p, w),
        PolicyLossMode::Gpg => {
            let losses = logp.mul(adv)?.neg()?;
            let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
            Ok(PolicyLossOutput {
                loss,
                pg_clipfrac: None,
                ppo_kl: None,
                pg_clipfrac_lower: None,
            })
        }
        PolicyLossMode::ClipCov => clip_cov(old, logp, adv, mask, p, w),
        PolicyLossMode::KlCov => kl_cov(old, logp, adv, mask, p, w),
        PolicyLossMode::Sapo => sapo(old, logp, adv, mask, p, w),
        PolicyLossMode::Cispo => cispo(old, logp, adv, mask, p, w),
        PolicyLossMode::GeoMean => geo_mean(old, logp, adv, mask, p, w),
        PolicyLossMode::DppoTv => dppo(old, logp, adv, mask, p, w, Divergence::Tv),
        PolicyLossMode::DppoKl => dppo(old, logp, adv, mask, p, w, Divergence::BinaryKl),
        PolicyLossMode::Dro => dro(old, logp, adv, mask, p, w),
    }
}

/// `losses` times the rollout-correction weights, when there are any.
fn weighted(losses: Tensor, w: Option<&Tensor>) -> Result<Tensor> {
    match w {
        Some(w) => losses.mul(&w.detach()),
        None => Ok(losses),
    }
}

/// Which divergence between the old and the current token probability DPPO bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Divergence {
    /// `p − p_old` (total variation of the binary distribution {token, rest}).
    Tv,
    /// `KL(Bern(p_old) ‖ Bern(p))`.
    BinaryKl,
}

/// DPPO (dppo_tv / dppo_kl, arXiv 2602.04879): a policy-gradient loss `−A·sg(min(r, c))·logp`
/// kept only on tokens whose probability has not moved past the divergence bound in the
/// direction the advantage pushes (`clip_ratio_high` for A > 0, `clip_ratio_low` otherwise;
/// here they bound the divergence, not the ratio); `c` = `clip_ratio_c` truncates the ratio.
/// `pg_clipfrac`: the share of tokens masked out; `pg_clipfrac_lower`: kept tokens whose
/// ratio was truncated.
fn dppo(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
    div: Divergence,
) -> Result<PolicyLossOutput> {
    let (neg_kl, ratio) = clamped_ratio(old, logp)?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    let truncated = ratio.minimum(p.clip_ratio_c)?.detach();
    let (lp, lo) = (logp.detach(), old.detach());
    let (prob, old_prob) = (lp.exp()?, lo.exp()?);
    let (pos_ok, neg_ok) = match div {
        Divergence::Tv => {
            let moved = prob.sub(&old_prob)?;
            (moved.le(p.clip_high)?, moved.ge(-p.clip_low)?)
        }
        Divergence::BinaryKl => {
            // p_old·(log p_old − log p) + (1 − p_old)·log((1 − p_old + 1e-8) / (1 − p + 1e-8))
            let rest = |x: &Tensor| -> Result<Tensor> { (x.neg()? + (1.0 + 1e-8))?.log() };
            let kl = (old_prob.mul(&lo.sub(&lp)?)?
                + old_prob
                    .neg()?
                    .affine(1.0, 1.0)?
                    .mul(&rest(&old_prob)?.sub(&rest(&prob)?)?)?)?;
            let (up, down) = (prob.le(&old_prob)?, prob.ge(&old_prob)?);
            (
                or(&kl.le(p.clip_high)?, &up)?,
                or(&kl.le(p.clip_low)?, &down)?,
            )
        }
    };
    let valid = float(&adv.gt(0.0)?.where_cond(&pos_ok, &neg_ok)?, adv)?;
    let losses = adv.neg()?.mul(&truncated)?.mul(logp)?.mul(&valid)?;
    let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
    let pg_clipfrac = mean_m(&valid.neg()?.affine(1.0, 1.0)?, mask)?;
    let truncated_kept = float(&ratio.gt(p.clip_ratio_c)?, adv)?.mul(&valid)?;
    let pg_clipfrac_lower = mean_m(&truncated_kept, mask)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(pg_clipfrac),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: Some(pg_clipfrac_lower),
    })
}

/// Element-wise `a || b` of two u8 comparison results.
fn or(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.maximum(b)
}

/// DRO (Direct Reward Optimization): `−(A·logp − β/2·(logp − old)²)`, β = `policy_loss.dro_beta`
/// (> 0); no ratio clamp. Reports `actor/ppo_kl` only.
fn dro(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let beta = match p.dro_beta {
        Some(b) if b > 0.0 && b.is_finite() => b,
        other => {
            return super::bail(format!(
                "policy loss dro needs `actor_rollout_ref.actor.policy_loss.dro_beta` > 0 (got {other:?})"
            ))
        }
    };
    let log_ratio = logp.sub(old)?;
    let penalty = (log_ratio.sqr()? * (0.5 * beta))?;
    let losses = logp.mul(adv)?.sub(&penalty)?.neg()?;
    let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: None,
        ppo_kl: Some(mean_m(&log_ratio.neg()?, mask)?),
        pg_clipfrac_lower: None,
    })
}

/// Dual-clip PPO: `max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))`, and for A < 0 at most `−A·c`;
/// `r = exp(clamp(logp − old, ±20))`.
fn vanilla(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let (neg_kl, ratio) = clamped_ratio(old, logp)?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    let (l1, l2) = clip_pair(&ratio, adv, p)?;
    let clip1 = l1.maximum(&l2)?;
    let pg_clipfrac = mean_m(&float(&l2.gt(&l1)?, adv)?, mask)?;
    let l3 = (adv.neg()? * p.clip_ratio_c)?;
    let clip2 = l3.minimum(&clip1)?;
    let negative = adv.lt(0.0)?;
    let lower = (float(&clip1.gt(&l3)?, adv)? * float(&negative, adv)?)?;
    let pg_clipfrac_lower = mean_m(&lower, mask)?;
    let losses = negative.where_cond(&clip2, &clip1)?;
    let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(pg_clipfrac),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: Some(pg_clipfrac_lower),
    })
}

/// GSPO: the sequence ratio `exp(mean_M(logp − old))` carried by each token as
/// `sg(seq) + logp − sg(logp)` (clamped ≤ 10 in log space), PPO-clipped, always aggregated
/// seq-mean-token-mean.
fn gspo(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let neg_kl = logp.sub(old)?;
    let lens = mask.sum(D::Minus1)?.clamp(1.0, f64::INFINITY)?; // [batch]
    let seq = (&neg_kl * mask)?.sum(D::Minus1)?.div(&lens)?; // [batch]
    let log_ratio = logp
        .sub(&logp.detach())?
        .broadcast_add(&seq.detach().unsqueeze(1)?)?
        .minimum(10.0)?;
    let ratio = log_ratio.exp()?;
    let (l1, l2) = clip_pair(&ratio, adv, p)?;
    let losses = l1.maximum(&l2)?;
    let loss = agg_loss(
        &weighted(losses, w)?,
        mask,
        LossAggMode::SeqMeanTokenMean,
        p.norm,
    )?;
    let pg_clipfrac = mean_m(&float(&l2.gt(&l1)?, adv)?, mask)?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(pg_clipfrac),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: Some(0.0),
    })
}

/// SAPO: a soft gate `sigmoid(τ(r − 1))·4/τ` instead of clipping (τ = tau_pos if A > 0 else
/// tau_neg); aggregated seq-mean-token-mean.
fn sapo(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let (neg_kl, ratio) = clamped_ratio(old, logp)?;
    let pos = adv.gt(0.0)?;
    let taus = pos.where_cond(
        &adv.ones_like()?.affine(p.tau_pos, 0.0)?,
        &adv.ones_like()?.affine(p.tau_neg, 0.0)?,
    )?;
    let z = (ratio - 1.0)?.mul(&taus)?;
    let sigmoid = (z.neg()?.exp()? + 1.0)?.recip()?;
    let gates = sigmoid.mul(&taus.recip()?.affine(4.0, 0.0)?)?;
    let losses = gates.mul(adv)?.neg()?;
    let loss = agg_loss(
        &weighted(losses, w)?,
        mask,
        LossAggMode::SeqMeanTokenMean,
        p.norm,
    )?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(0.0),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: Some(0.0),
    })
}

/// CISPO: `−sg(clip(r, 1−ε_low, 1+ε_high))·A·logp`.
fn cispo(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let (neg_kl, ratio) = clamped_ratio(old, logp)?;
    let clipped = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)?.detach();
    let losses = clipped.mul(adv)?.mul(logp)?.neg()?;
    let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
    let pg_clipfrac = mean_m(&float(&ratio.ne(&clipped)?, adv)?, mask)?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(pg_clipfrac),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: Some(0.0),
    })
}

/// GMPO (geo_mean): a per-sequence geometric-mean ratio of token ratios clipped in log space
/// on the side the advantage's sign selects; loss `−mean_seq(Ā·ratio)` over all rows.
fn geo_mean(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let neg_kl = logp.sub(old)?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    let sgn = (float(&adv.gt(0.0)?, adv)? - float(&adv.lt(0.0)?, adv)?)?;
    let clamped = neg_kl.clamp(-p.clip_low, p.clip_high)?;
    let min = sgn.mul(&neg_kl)?.minimum(&sgn.mul(&clamped)?)?.mul(&sgn)?;
    let lens = (mask.sum(D::Minus1)? + 1e-8)?;
    let ratio = (&min * mask)?.sum(D::Minus1)?.div(&lens)?.exp()?;
    let seq_adv = (adv * mask)?.sum(D::Minus1)?.div(&lens)?;
    let mut seq_losses = seq_adv.mul(&ratio)?.neg()?; // [batch]
    if let Some(w) = w {
        // Token weights become one per sequence: their geometric mean over the valid tokens.
        let seq_w = ((w + 1e-10)?.log()? * mask)?
            .sum(D::Minus1)?
            .div(&lens)?
            .exp()?;
        seq_losses = seq_losses.mul(&seq_w)?;
    }
    let loss = seq_losses.mean_all()?;
    let clipped = float(&neg_kl.ne(&clamped)?, adv)?;
    let pg_clipfrac = mean_m(&clipped.mul(&float(&adv.gt(0.0)?, adv)?)?, mask)?;
    let pg_clipfrac_lower = mean_m(&clipped.mul(&float(&adv.lt(0.0)?, adv)?)?, mask)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(pg_clipfrac),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: Some(pg_clipfrac_lower),
    })
}

/// Host copies of `[batch, len]` tensors for the token selections of clip_cov / kl_cov.
fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.detach()
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()
}

/// Clip-Cov: PPO-clip, but a random `clip_cov_ratio` share of the valid, unclipped tokens whose
/// covariance `(A − mean A)(logp − mean logp)` lies in `(clip_cov_lb, clip_cov_ub)` get no gradient.
fn clip_cov(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let neg_kl = logp.sub(old)?;
    let ratio = neg_kl.exp()?;
    let ppo_kl = mean_m(&neg_kl.neg()?, mask)?;
    let (l1, l2) = clip_pair(&ratio, adv, p)?;
    let (a, lp, m, h1, h2) = (host(adv)?, host(logp)?, host(mask)?, host(&l1)?, host(&l2)?);
    let mean = |x: &[f64]| -> f64 {
        let s: f64 = x
            .iter()
            .zip(&m)
            .filter(|(_, mk)| **mk != 0.0)
            .map(|(v, mk)| v * mk)
            .sum();
        s / (m.iter().sum::<f64>() + 1e-8)
    };
    let (ma, ml) = (mean(&a), mean(&lp));
    let mut candidates: Vec<usize> = Vec::new();
    for i in 0..a.len() {
        let clipped_by_origin = h2[i] > h1[i] && m[i] > 0.0;
        if m[i] == 0.0 || clipped_by_origin {
            continue;
        }
        let cov = (a[i] - ma) * (lp[i] - ml);
        if cov < p.clip_cov_ub && cov > p.clip_cov_lb {
            candidates.push(i);
        }
    }
    let clip_num = ((p.clip_cov_ratio * m.iter().sum::<f64>()) as usize).max(1);
    // A seeded random choice of `clip_num` candidates (the loader's portable shuffle).
    let order = crate::util::permutation(candidates.len(), p.seed, 0);
    let mut corr = vec![1.0; a.len()];
    for &k in order.iter().take(clip_num) {
        corr[candidates[k]] = 0.0;
    }
    let corr = Tensor::from_vec(corr, adv.shape(), adv.device())?.to_dtype(adv.dtype())?;
    let pg_clipfrac = mean_m(&float(&corr.eq(0.0)?, adv)?, mask)?;
    let losses = l1.maximum(&l2)?.mul(&corr)?;
    let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: Some(pg_clipfrac),
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: None,
    })
}

/// KL-Cov: `−A·r`, plus `ppo_kl_coef·|logp − old|` on the `kl_cov_ratio` share of valid tokens
/// with the largest covariance `(A − mean A)(logp − mean logp)` (ties: the earlier token).
fn kl_cov(
    old: &Tensor,
    logp: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
    p: &PolicyLossParams,
    w: Option<&Tensor>,
) -> Result<PolicyLossOutput> {
    let neg_kl = logp.sub(old)?;
    let abs_kl = neg_kl.abs()?;
    let ratio = neg_kl.exp()?;
    let ppo_kl = mean_m(&abs_kl, mask)?;
    let l1 = ratio.mul(adv)?.neg()?;
    let lkl = (&l1 + (&abs_kl * p.ppo_kl_coef)?)?;
    let (a, lp, m) = (host(adv)?, host(logp)?, host(mask)?);
    let valid: Vec<usize> = (0..a.len()).filter(|&i| m[i] > 0.0).collect();
    let mut pick = vec![0.0; a.len()];
    if !valid.is_empty() {
        let n = valid.len() as f64;
        let ma = valid.iter().map(|&i| a[i]).sum::<f64>() / n;
        let ml = valid.iter().map(|&i| lp[i]).sum::<f64>() / n;
        let k = ((n * p.kl_cov_ratio) as usize).max(1);
        let mut order: Vec<(f64, usize)> = valid
            .iter()
            .map(|&i| ((a[i] - ma) * (lp[i] - ml), i))
            .collect();
        order.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        for &(_, i) in order.iter().take(k) {
            pick[i] = 1.0;
        }
    }
    let pick = Tensor::from_vec(pick, adv.shape(), adv.device())?.to_dtype(DType::U8)?;
    let losses = pick.where_cond(&lkl, &l1)?;
    let loss = agg_loss(&weighted(losses, w)?, mask, p.loss_agg_mode, p.norm)?;
    Ok(PolicyLossOutput {
        loss,
        pg_clipfrac: None,
        ppo_kl: Some(ppo_kl),
        pg_clipfrac_lower: None,
    })
}
