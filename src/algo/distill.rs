//! On-policy distillation's loss (verl 1dda039: `verl/trainer/distillation/losses.py`,
//! `distillation_loss` with the single-sample estimators): each response token's divergence
//! between the policy and a frozen teacher, from the log-probs both give the sampled token.
//!
//! ```text
//! d_t   = kl_penalty(log π(y_t), log π_T(y_t), loss_mode)        per token   [b, r]
//! d_t   ← clamp(d_t, −loss_max_clamp, loss_max_clamp)            when set
//! loss  = agg_loss(d, mask)                                       supervised (default)
//! loss  = vanilla PPO loss with advantages −sg(d_t)               use_policy_gradient
//! ```
//!
//! The metrics are verl's: `distillation/abs_loss` (mean |d| over the micro-batch's response
//! tokens), `distillation/loss_min` / `loss_max` (before the clamp), and with the policy
//! gradient `distillation/pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower`. How the result joins the
//! task's policy loss (`use_task_rewards`, `distillation_loss_coef`) is [`combine`].

use candle_core::{DType, Tensor};

use super::agg::{agg_loss, scalar, AggNorm};
use super::kl::kl_penalty;
use super::policy::{policy_loss_weighted, PolicyLossParams};
use super::Result;
use crate::config::{DistillLossMode, KlKind, KlPenalty, LossAggMode, PolicyLossMode};

/// The estimator a `loss_mode` names (verl hands the name to `kl_penalty`); `None` for the
/// top-k loss, which reads the teacher's top-k tokens instead.
pub fn estimator(mode: DistillLossMode) -> Option<KlKind> {
    Some(match mode {
        DistillLossMode::Kl | DistillLossMode::K1 => KlKind::K1,
        DistillLossMode::Abs => KlKind::Abs,
        DistillLossMode::Mse | DistillLossMode::K2 => KlKind::K2,
        DistillLossMode::LowVarKl | DistillLossMode::K3 => KlKind::K3,
        DistillLossMode::ForwardKlTopk => return None,
    })
}

/// The settings of [`distillation_loss`] (and [`distillation_loss_topk`]).
#[derive(Debug, Clone)]
pub struct DistillParams {
    /// The estimator (its `kind` is not read by the top-k loss).
    pub kind: KlKind,
    /// Each token's loss clamped to `[−c, c]`.
    pub loss_max_clamp: Option<f64>,
    /// `use_policy_gradient`: the vanilla PPO loss's settings (the distillation's own clip
    /// range, the actor's aggregation); `None` = backpropagate the aggregated loss.
    pub policy_gradient: Option<PolicyLossParams>,
    pub loss_agg_mode: LossAggMode,
}

impl DistillParams {
    /// verl's vanilla loss settings for the policy-gradient form: the actor's loss (`base`:
    /// its aggregation and normalisers) with the distillation's clip range and the dual-clip
    /// bound verl falls back to (3.0: `DistillationLossConfig` has no `clip_ratio_c`).
    pub fn policy_gradient_params(
        base: &PolicyLossParams,
        clip_low: f64,
        clip_high: f64,
    ) -> PolicyLossParams {
        PolicyLossParams {
            mode: PolicyLossMode::Vanilla,
            clip_low,
            clip_high,
            clip_ratio_c: 3.0,
            ..base.clone()
        }
    }
}

/// The distillation loss of a micro-batch and its metrics.
#[derive(Debug, Clone)]
pub struct DistillOutput {
    /// Scalar, differentiable through `log_prob`.
    pub loss: Tensor,
    pub metrics: Vec<(&'static str, f64)>,
}

/// The loss of `log_prob` (`[b, r]`, the policy's, with gradient) against `teacher_log_prob`
/// (`[b, r]`) on `mask`'s tokens. `old_log_prob` and `is_weights` are read by the
/// policy-gradient form only (its ratio and rollout correction's weights). `norm`: the
/// micro-batch's `agg_loss` normalisers.
pub fn distillation_loss(
    log_prob: &Tensor,
    teacher_log_prob: &Tensor,
    old_log_prob: &Tensor,
    mask: &Tensor,
    p: &DistillParams,
    norm: AggNorm,
    is_weights: Option<&Tensor>,
) -> Result<DistillOutput> {
    let d = kl_penalty(log_prob, teacher_log_prob, KlPenalty::new(p.kind, false))?; // [b, r]
    finish(d, log_prob, old_log_prob, mask, p, norm, is_weights, true)
}

/// verl's `distillation_loss` after the per-token losses `d` (`[b, r]`): the range metrics
/// (and `abs_loss` for the estimators), the clamp, then the supervised aggregate or the vanilla
/// policy gradient on −sg(d).
#[allow(clippy::too_many_arguments)]
fn finish(
    d: Tensor,
    log_prob: &Tensor,
    old_log_prob: &Tensor,
    mask: &Tensor,
    p: &DistillParams,
    norm: AggNorm,
    is_weights: Option<&Tensor>,
    with_abs: bool,
) -> Result<DistillOutput> {
    let mut metrics = range_metrics(&d, mask, with_abs)?;
    let d = match p.loss_max_clamp {
        Some(c) => d.clamp(-c, c)?,
        None => d,
    };
    let loss = match &p.policy_gradient {
        Some(pg) => {
            let mut pg = pg.clone();
            pg.norm = norm;
            let out = policy_loss_weighted(
                old_log_prob,
                log_prob,
                &d.detach().neg()?,
                mask,
                &pg,
                is_weights,
            )?;
            metrics.extend(out.metrics([
                "distillation/pg_clipfrac",
                "distillation/ppo_kl",
                "distillation/pg_clipfrac_lower",
            ]));
            out.loss
        }
        None => agg_loss(&d, mask, p.loss_agg_mode, norm)?,
    };
    Ok(DistillOutput { loss, metrics })
}

/// The top-k loss's per-position values (verl's `compute_forward_kl_topk`, FSDP path), each
/// `[b, r]`.
#[derive(Debug, Clone)]
pub struct TopkTerms {
    /// `Σ_k p_T(k) (log p_T(k) − log π(k))` over the teacher's top-k tokens, with gradient
    /// through the student's log-probs (not yet floored at 0).
    pub losses: Tensor,
    /// `Σ_k π(k)` and `Σ_k p_T(k)`: the mass of the top-k tokens (before any clamp).
    pub student_mass: Tensor,
    pub teacher_mass: Tensor,
    /// How many of the teacher's top-k tokens are among the student's own top-k.
    pub overlap_count: Tensor,
    /// Mean of `−p_T(k) (log p_T(k) − log π(k))` over those tokens (0 without any).
    pub overlap_token_advantage: Tensor,
}

/// The top-k terms from the student's log-probs of the teacher's top-k tokens
/// (`student_lp`, `[b, r, k]`, with gradient), the teacher's (`teacher_lp`) and their ids
/// (`teacher_ids`, u32), and the ids of the student's own top-k (`student_ids`); both sides'
/// log-probs floored at `log_prob_min_clamp` before the divergence.
pub fn topk_terms(
    student_lp: &Tensor,
    teacher_lp: &Tensor,
    teacher_ids: &Tensor,
    student_ids: &Tensor,
    log_prob_min_clamp: Option<f64>,
) -> Result<TopkTerms> {
    let last = candle_core::D::Minus1;
    let student_mass = student_lp.detach().exp()?.sum(last)?;
    let teacher_mass = teacher_lp.exp()?.sum(last)?;
    let (s, t) = match log_prob_min_clamp {
        Some(c) => (student_lp.maximum(c)?, teacher_lp.maximum(c)?),
        None => (student_lp.clone(), teacher_lp.clone()),
    };
    let token_kl = (t.exp()? * (&t - &s)?)?; // [b, r, k]
    let losses = token_kl.sum(last)?;
    // Whether each teacher token is among the student's top-k: [b, r, k, 1] == [b, r, 1, k].
    let k = teacher_ids.dim(2)?;
    let (b, r) = (teacher_ids.dim(0)?, teacher_ids.dim(1)?);
    let hit = teacher_ids
        .unsqueeze(3)?
        .broadcast_as((b, r, k, k))?
        .eq(&student_ids.unsqueeze(2)?.broadcast_as((b, r, k, k))?)?
        .to_dtype(DType::F32)?
        .max(3)? // [b, r, k]
        .to_dtype(token_kl.dtype())?;
    let overlap_count = hit.sum(last)?;
    let summed = (token_kl.detach().neg()? * &hit)?.sum(last)?;
    let overlap_token_advantage = summed.div(&overlap_count.maximum(1.0)?)?;
    Ok(TopkTerms {
        losses,
        student_mass,
        teacher_mass,
        overlap_count,
        overlap_token_advantage,
    })
}

/// [`distillation_loss`] for `forward_kl_topk` (verl's `compute_forward_kl_topk` then
/// `distillation_loss`): the per-position losses floored at 0 (top-k masses do not sum to 1, so
/// the divergence can be negative), verl's mass and overlap metrics, then the same clamp,
/// range metrics and supervised or policy-gradient form. `topk`: k.
#[allow(clippy::too_many_arguments)]
pub fn distillation_loss_topk(
    terms: &TopkTerms,
    log_prob: &Tensor,
    old_log_prob: &Tensor,
    mask: &Tensor,
    topk: usize,
    p: &DistillParams,
    norm: AggNorm,
    is_weights: Option<&Tensor>,
) -> Result<DistillOutput> {
    let mut metrics = Vec::new();
    let count = masked_values(&terms.overlap_count, mask)?;
    if !count.is_empty() {
        let adv = masked_values(&terms.overlap_token_advantage, mask)?;
        metrics.push((
            "distillation/overlap_ratio",
            mean_min_max(&count).0 / topk as f64,
        ));
        let over: Vec<f64> = adv
            .iter()
            .zip(&count)
            .filter(|(_, &c)| c > 0.0)
            .map(|(&a, _)| a)
            .collect();
        let mean_adv = if over.is_empty() {
            0.0
        } else {
            mean_min_max(&over).0
        };
        metrics.push(("distillation/overlap_token_advantage", mean_adv));
        for (t, names) in [
            (
                &terms.student_mass,
                [
                    "distillation/student_mass",
                    "distillation/student_mass_min",
                    "distillation/student_mass_max",
                ],
            ),
            (
                &terms.teacher_mass,
                [
                    "distillation/teacher_mass",
                    "distillation/teacher_mass_min",
                    "distillation/teacher_mass_max",
                ],
            ),
        ] {
            let (mean, min, max) = mean_min_max(&masked_values(t, mask)?);
            metrics.extend(names.into_iter().zip([mean, min, max]));
        }
    }
    let d = terms.losses.maximum(0.0)?;
    let out = finish(d, log_prob, old_log_prob, mask, p, norm, is_weights, false)?;
    metrics.extend(out.metrics);
    Ok(DistillOutput {
        loss: out.loss,
        metrics,
    })
}

/// The values of `t` at `mask`'s tokens, row by row (host f64).
fn masked_values(t: &Tensor, mask: &Tensor) -> Result<Vec<f64>> {
    let host = |t: &Tensor| {
        t.detach()
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()
    };
    let m = host(mask)?;
    Ok(host(t)?
        .into_iter()
        .zip(m)
        .filter(|&(_, m)| m > 0.0)
        .map(|(v, _)| v)
        .collect())
}

/// Mean, minimum and maximum of `v` (not empty).
fn mean_min_max(v: &[f64]) -> (f64, f64, f64) {
    let (min, max) = v
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| {
            (a.min(x), b.max(x))
        });
    (v.iter().sum::<f64>() / v.len() as f64, min, max)
}

/// `distillation/loss_min` and `loss_max` over the masked tokens, and with `with_abs` (the
/// estimators) `abs_loss`, the mean |d|; none when the micro-batch has no response token
/// (verl's min of an empty selection would raise).
fn range_metrics(d: &Tensor, mask: &Tensor, with_abs: bool) -> Result<Vec<(&'static str, f64)>> {
    let kept = masked_values(d, mask)?;
    if kept.is_empty() {
        return Ok(Vec::new());
    }
    let (_, min, max) = mean_min_max(&kept);
    let mut out = vec![
        ("distillation/loss_min", min),
        ("distillation/loss_max", max),
    ];
    if with_abs {
        let abs: Vec<f64> = kept.iter().map(|x| x.abs()).collect();
        out.insert(0, ("distillation/abs_loss", mean_min_max(&abs).0));
    }
    Ok(out)
}

/// The actor's loss with distillation (verl's `distillation_ppo_loss`): the task's loss
/// (`task`: policy loss with its entropy and KL terms) kept when `use_task_rewards`, plus the
/// distillation loss times `distillation_loss_coef` (times 1 without task rewards).
pub fn combine(
    task: &Tensor,
    distill: &Tensor,
    use_task_rewards: bool,
    coef: f64,
) -> Result<Tensor> {
    if use_task_rewards {
        task + (distill * coef)?
    } else {
        Ok(distill.clone())
    }
}

/// `distillation/loss` as verl logs it: the distillation term before its coefficient.
pub fn loss_metric(distill: &Tensor) -> Result<f64> {
    scalar(distill)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f64], shape: (usize, usize)) -> Tensor {
        Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
    }

    /// The actor-side settings the policy-gradient form starts from (its clip range and dual
    /// clip are then the distillation's: [`DistillParams::policy_gradient_params`]).
    fn base_params(loss_agg_mode: LossAggMode, norm: AggNorm) -> PolicyLossParams {
        PolicyLossParams {
            mode: PolicyLossMode::Vanilla,
            clip_low: 0.0,
            clip_high: 0.0,
            clip_ratio_c: 0.0,
            tau_pos: 1.0,
            tau_neg: 1.0,
            clip_cov_ratio: 0.0,
            clip_cov_lb: 0.0,
            clip_cov_ub: 0.0,
            kl_cov_ratio: 0.0,
            ppo_kl_coef: 0.0,
            dro_beta: None,
            loss_agg_mode,
            norm,
            seed: 0,
        }
    }

    fn params(kind: KlKind) -> DistillParams {
        DistillParams {
            kind,
            loss_max_clamp: None,
            policy_gradient: None,
            loss_agg_mode: LossAggMode::TokenMean,
        }
    }

    /// The teacher equal to the student: every estimator is 0, and so is its gradient except
    /// k1's (whose gradient does not depend on the teacher: why verl refuses k1 without the
    /// policy gradient).
    #[test]
    fn a_teacher_equal_to_the_student_gives_zero_loss_and_gradient() {
        let lp = candle_core::Var::from_tensor(&t(&[-0.5, -1.2, -2.0, -0.1], (2, 2))).unwrap();
        let mask = t(&[1.0, 1.0, 1.0, 0.0], (2, 2));
        for kind in [KlKind::K1, KlKind::Abs, KlKind::K2, KlKind::K3] {
            let out = distillation_loss(
                lp.as_tensor(),
                &lp.as_tensor().detach(),
                &lp.as_tensor().detach(),
                &mask,
                &params(kind),
                AggNorm::default(),
                None,
            )
            .unwrap();
            assert_eq!(scalar(&out.loss).unwrap(), 0.0, "{kind:?}");
            let g = out.loss.backward().unwrap();
            let g = g.get(lp.as_tensor()).unwrap();
            // abs has a kink at 0: its subgradient there is sign(0) = 0 in candle.
            let gmax = g
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            if kind == KlKind::K1 {
                assert!((gmax - 1.0 / 3.0).abs() < 1e-12, "{gmax}");
            } else {
                assert!(gmax <= 1e-12, "{kind:?}: {gmax}");
            }
        }
    }

    /// k3 by hand: d = e^{T−L} − (T−L) − 1 per token, token-mean over the mask; the clamp
    /// bounds each token; the policy-gradient form on the step's own log-probs (ratio 1) is
    /// −mean(−d) = mean(d) in value.
    #[test]
    fn k3_clamp_and_policy_gradient_by_hand() {
        let lp = [-0.5, -1.2, -2.0, -0.1];
        let tl = [-0.7, -0.2, -4.0, -3.0];
        let mask = [1.0, 1.0, 1.0, 0.0];
        let k3 = |l: f64, t: f64| (t - l).exp() - (t - l) - 1.0;
        let d: Vec<f64> = lp.iter().zip(&tl).map(|(&l, &t)| k3(l, t)).collect();
        let want = (d[0] + d[1] + d[2]) / 3.0;
        let (lpt, tlt, mt) = (t(&lp, (2, 2)), t(&tl, (2, 2)), t(&mask, (2, 2)));
        let out = distillation_loss(
            &lpt,
            &tlt,
            &lpt,
            &mt,
            &params(KlKind::K3),
            AggNorm::default(),
            None,
        )
        .unwrap();
        assert!((scalar(&out.loss).unwrap() - want).abs() < 1e-12);
        let m: std::collections::BTreeMap<_, _> = out.metrics.into_iter().collect();
        assert!((m["distillation/loss_max"] - d[0].max(d[1]).max(d[2])).abs() < 1e-12);
        assert!((m["distillation/loss_min"] - d[0].min(d[1]).min(d[2])).abs() < 1e-12);
        assert!((m["distillation/abs_loss"] - want).abs() < 1e-12);

        let mut p = params(KlKind::K3);
        p.loss_max_clamp = Some(0.5);
        let out = distillation_loss(&lpt, &tlt, &lpt, &mt, &p, AggNorm::default(), None).unwrap();
        let clamped = d[..3].iter().map(|x| x.clamp(-0.5, 0.5)).sum::<f64>() / 3.0;
        assert!((scalar(&out.loss).unwrap() - clamped).abs() < 1e-12);

        let base = base_params(LossAggMode::TokenMean, AggNorm::default());
        let mut p = params(KlKind::K3);
        p.policy_gradient = Some(DistillParams::policy_gradient_params(&base, 0.2, 0.2));
        let out = distillation_loss(&lpt, &tlt, &lpt, &mt, &p, AggNorm::default(), None).unwrap();
        assert!((scalar(&out.loss).unwrap() - want).abs() < 1e-12);
    }

    /// verl's own `distillation_loss` (1dda039, PyTorch f64, scripts/verl_distill_fixtures.py):
    /// 228 cases over every estimator name, clamps, the supervised and policy-gradient forms,
    /// three aggregation modes, global-batch numbers and IS weights; loss and every metric
    /// within 1e-9.
    #[test]
    fn verl_1dda039() {
        use serde_json::Value;
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/distill_verl_1dda039.json"
        );
        let f: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let mat = |v: &Value| {
            let rows: Vec<Vec<f64>> = serde_json::from_value(v.clone()).unwrap();
            let (b, r) = (rows.len(), rows[0].len());
            Tensor::from_vec(rows.concat(), (b, r), &Device::Cpu).unwrap()
        };
        let (mask, student, teacher, old, w) = (
            mat(&f["mask"]),
            mat(&f["student"]),
            mat(&f["teacher"]),
            mat(&f["old"]),
            mat(&f["weights"]),
        );
        let close = |case: &str, got: f64, want: f64| {
            assert!(
                (got - want).abs() <= 1e-9 * (1.0 + want.abs()),
                "{case}: {got}, verl {want}"
            );
        };
        let cases = f["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 228);
        for c in cases {
            let name = c.to_string();
            let info = &f["infos"][c["info"].as_str().unwrap()];
            let norm = AggNorm {
                batch_num_tokens: info["batch_num_tokens"].as_f64(),
                global_batch_size: info["global_batch_size"].as_f64(),
                dp_size: info["dp_size"].as_f64(),
                loss_scale_factor: None,
                legacy_sum_norm: false,
            };
            let mode: DistillLossMode = serde_json::from_value(c["loss_mode"].clone()).unwrap();
            let agg: LossAggMode = serde_json::from_value(c["agg"].clone()).unwrap();
            let mut p = params(estimator(mode).unwrap());
            p.loss_agg_mode = agg;
            p.loss_max_clamp = c["clamp"].as_f64();
            if c["policy_gradient"].as_bool().unwrap() {
                let base = base_params(agg, norm);
                p.policy_gradient = Some(DistillParams::policy_gradient_params(&base, 0.15, 0.25));
            }
            let weights = c["weighted"].as_bool().unwrap().then_some(&w);
            let out =
                distillation_loss(&student, &teacher, &old, &mask, &p, norm, weights).unwrap();
            close(
                &name,
                scalar(&out.loss).unwrap(),
                c["loss"].as_f64().unwrap(),
            );
            let got: std::collections::BTreeMap<_, _> = out.metrics.into_iter().collect();
            let want = c["metrics"].as_object().unwrap();
            assert_eq!(got.len(), want.len(), "{name}: {got:?}");
            for (k, v) in want {
                close(&format!("{name} {k}"), got[k.as_str()], v.as_f64().unwrap());
            }
        }
    }

    /// verl's top-k loss (1dda039: FSDP `compute_forward_kl_topk` on student logits and the
    /// teacher's top-k from torch.topk, then `distillation_loss`; torch f64,
    /// scripts/verl_distill_fixtures.py): 16 cases over the log-prob floor, the loss clamp, the
    /// supervised and policy-gradient forms and two aggregations. Here the teacher's top-k
    /// comes from `host_topk` (its ids equal torch.topk's) and the student's log-probs from a
    /// log-softmax; loss and every metric within 1e-6 (verl's `kl_divergence` casts to f32).
    #[test]
    fn verl_1dda039_topk() {
        use candle_core::D;
        use serde_json::Value;
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/distill_verl_1dda039.json"
        );
        let f: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let tk = &f["topk"];
        let (v, k) = (
            tk["vocab"].as_u64().unwrap() as usize,
            tk["k"].as_u64().unwrap() as usize,
        );
        let cube = |x: &Value| {
            let rows: Vec<Vec<Vec<f64>>> = serde_json::from_value(x.clone()).unwrap();
            let (b, r) = (rows.len(), rows[0].len());
            let flat: Vec<f64> = rows.into_iter().flatten().flatten().collect();
            Tensor::from_vec(flat, (b, r, v), &Device::Cpu).unwrap()
        };
        let mat = |x: &Value| {
            let rows: Vec<Vec<f64>> = serde_json::from_value(x.clone()).unwrap();
            let (b, r) = (rows.len(), rows[0].len());
            Tensor::from_vec(rows.concat(), (b, r), &Device::Cpu).unwrap()
        };
        let (mask, old) = (mat(&f["mask"]), mat(&f["old"]));
        let (b, r) = mask.dims2().unwrap();
        let lsm = |x: &Tensor| candle_nn::ops::log_softmax(x, D::Minus1).unwrap();
        let (s_lsm, t_lsm) = (
            lsm(&cube(&tk["student_logits"])),
            lsm(&cube(&tk["teacher_logits"])),
        );
        let topk_ids = |x: &Tensor| {
            let (_, ids) =
                crate::model::transformer::host_topk(&x.reshape((b * r, v)).unwrap(), k).unwrap();
            Tensor::from_vec(ids, (b, r, k), &Device::Cpu).unwrap()
        };
        let (t_ids, s_ids) = (topk_ids(&t_lsm), topk_ids(&s_lsm));
        let gather = |x: &Tensor| x.contiguous().unwrap().gather(&t_ids, 2).unwrap();
        let (s_lp, t_lp) = (gather(&s_lsm), gather(&t_lsm));
        // The sampled tokens' log-probs the fixture gave verl: old + 0.1 on response tokens.
        let lp = ((&old + 0.1).unwrap() * &mask).unwrap();
        let info = &f["infos"]["global"];
        let norm = AggNorm {
            batch_num_tokens: info["batch_num_tokens"].as_f64(),
            global_batch_size: info["global_batch_size"].as_f64(),
            dp_size: info["dp_size"].as_f64(),
            loss_scale_factor: None,
            legacy_sum_norm: false,
        };
        let cases = tk["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 16);
        for c in cases {
            let name = c.to_string();
            let terms = topk_terms(&s_lp, &t_lp, &t_ids, &s_ids, c["floor"].as_f64()).unwrap();
            let agg: LossAggMode = serde_json::from_value(c["agg"].clone()).unwrap();
            let mut p = params(KlKind::K3);
            p.loss_agg_mode = agg;
            p.loss_max_clamp = c["clamp"].as_f64();
            if c["policy_gradient"].as_bool().unwrap() {
                let base = base_params(agg, norm);
                p.policy_gradient = Some(DistillParams::policy_gradient_params(&base, 0.15, 0.25));
            }
            let out = distillation_loss_topk(&terms, &lp, &old, &mask, k, &p, norm, None).unwrap();
            let close = |what: &str, got: f64, want: f64| {
                assert!(
                    (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{name} {what}: {got}, verl {want}"
                );
            };
            close(
                "loss",
                scalar(&out.loss).unwrap(),
                c["loss"].as_f64().unwrap(),
            );
            let got: std::collections::BTreeMap<_, _> = out.metrics.into_iter().collect();
            let want = c["metrics"].as_object().unwrap();
            assert_eq!(got.len(), want.len(), "{name}: {got:?}");
            for (key, v) in want {
                close(key, got[key.as_str()], v.as_f64().unwrap());
            }
        }
    }

    #[test]
    fn combine_keeps_or_drops_the_task_loss() {
        let task = Tensor::new(2.0f64, &Device::Cpu).unwrap();
        let d = Tensor::new(0.5f64, &Device::Cpu).unwrap();
        assert_eq!(
            scalar(&combine(&task, &d, true, 0.1).unwrap()).unwrap(),
            2.05
        );
        assert_eq!(
            scalar(&combine(&task, &d, false, 0.1).unwrap()).unwrap(),
            0.5
        );
    }
}
