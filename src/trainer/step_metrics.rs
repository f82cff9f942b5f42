//! verl's per-step data metrics (`metric_utils.compute_data_metrics`): scores, rewards,
//! advantages, returns, values, lengths, entropy, and the reward sources' means.

use std::collections::BTreeMap;

use candle_core::Device;

use super::batch::{dense, Column, Ragged, StepBatch};
use crate::algo::{agg_loss, AggNorm};
use crate::config::{LossAggMode, Plan};
use crate::metrics::{add_stats, Metrics};
use crate::reward::{RewardManager, SampleReward};

/// Values at the loss-mask positions of every row.
fn valid(values: &Ragged, batch: &StepBatch) -> Vec<f64> {
    (0..batch.len())
        .filter(|&r| !batch.excluded[r])
        .flat_map(|r| values[r].iter().map(|&x| x as f64))
        .collect()
}

fn variance(x: &[f64]) -> f64 {
    if x.len() < 2 {
        return f64::NAN;
    }
    let m = x.iter().sum::<f64>() / x.len() as f64;
    // Unbiased, as torch.var.
    x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (x.len() - 1) as f64
}

/// The data metrics of a step whose `adv` phase ran; lengths are clipped at `plan`'s limits,
/// `actor/entropy` is aggregated with `loss_agg_mode` (seq-mean-token-sum-norm divided by
/// `loss_scale_factor`, else the response length, as verl's trainer does; see
/// [`AggNorm::legacy_sum_norm`]), unless the update
/// already reported it (verl's update metrics overwrite the old-log-prob pass's).
pub fn data_metrics(
    m: &mut Metrics,
    b: &StepBatch,
    plan: &Plan,
    loss_agg_mode: LossAggMode,
    loss_scale_factor: Option<f64>,
) -> candle_core::Result<()> {
    let rows: Vec<usize> = (0..b.len()).filter(|&r| !b.excluded[r]).collect();
    let seq_sum = |v: &Ragged| -> Vec<f64> {
        rows.iter()
            .map(|&r| v[r].iter().map(|&x| x as f64).sum())
            .collect()
    };
    add_stats(
        m,
        "critic/score",
        &seq_sum(b.column(Column::TokenLevelScores)?),
    );
    add_stats(
        m,
        "critic/rewards",
        &seq_sum(b.column(Column::TokenLevelRewards)?),
    );
    add_stats(
        m,
        "critic/advantages",
        &valid(b.column(Column::Advantages)?, b),
    );
    let returns = valid(b.column(Column::Returns)?, b);
    add_stats(m, "critic/returns", &returns);
    if b.has(Column::Values) {
        let v = valid(b.column(Column::Values)?, b);
        add_stats(m, "critic/values", &v);
        let diff: Vec<f64> = returns.iter().zip(&v).map(|(r, v)| r - v).collect();
        let ev = 1.0 - variance(&diff) / (variance(&returns) + 1e-5);
        m.insert("critic/vf_explained_var".into(), ev);
    }
    let resp: Vec<f64> = (0..b.len()).map(|r| b.response_len(r) as f64).collect();
    add_stats(m, "response_length", &resp);
    let clip = |lens: &[f64], max: usize| {
        lens.iter().filter(|&&l| l as usize >= max).count() as f64 / lens.len().max(1) as f64
    };
    m.insert(
        "response_length/clip_ratio".into(),
        clip(&resp, plan.response_length),
    );
    let aborted = resp.iter().filter(|&&l| l == 0.0).count() as f64 / resp.len().max(1) as f64;
    m.insert("response/aborted_ratio".into(), aborted);
    let prompt: Vec<f64> = b.prompts.iter().map(|p| p.len() as f64).collect();
    add_stats(m, "prompt_length", &prompt);
    m.insert(
        "prompt_length/clip_ratio".into(),
        clip(&prompt, plan.prompt_length),
    );
    if b.has(Column::Entropys) && !m.contains_key("actor/entropy") {
        // verl's `actor/entropy`: the entropy of the rollout policy, aggregated like the loss.
        let width = b.max_response_len();
        // Over the whole batch; seq-mean-token-sum-norm as the agg_loss of the verl whose
        // workers the update follows (b178a3c's sum for the default path, 1dda039's mean).
        let norm = AggNorm {
            loss_scale_factor: loss_scale_factor.or(Some(plan.response_length as f64)),
            legacy_sum_norm: !plan.actor.global_norm,
            ..AggNorm::default()
        };
        let e = agg_loss(
            &dense(b.column(Column::Entropys)?, width, &Device::Cpu)?,
            &dense(&b.response_mask(), width, &Device::Cpu)?,
            loss_agg_mode,
            norm,
        )?;
        m.insert("actor/entropy".into(), crate::algo::agg::scalar(&e)?);
    }
    Ok(())
}

/// `reward/<source>/mean` per source, `reward/errors` and `reward/skipped` (samples left out of
/// the update) of this step, and
/// the means of numeric extra values scorers reported (`reward_extra/<key>/mean`).
pub fn reward_metrics(m: &mut Metrics, manager: &RewardManager, rewards: &[SampleReward]) {
    for (k, src) in manager.sources.iter().enumerate() {
        let vals: Vec<f64> = rewards
            .iter()
            .filter_map(|r| r.per_source.get(k).and_then(|(_, s)| *s))
            .collect();
        if !vals.is_empty() {
            m.insert(
                format!("reward/{}/mean", src.name),
                vals.iter().sum::<f64>() / vals.len() as f64,
            );
        }
        m.insert(format!("reward/weight/{}", src.name), src.weight);
        if src.gate.is_some() {
            let fired = rewards
                .iter()
                .filter(|r| r.gated.contains(&src.name))
                .count();
            m.insert(format!("reward/gated/{}", src.name), fired as f64);
        }
    }
    let errors = rewards.iter().filter(|r| r.error.is_some()).count();
    m.insert("reward/errors".into(), errors as f64);
    // Samples left out of the update: no score (`on_error=skip`) or a `skip_update` gate.
    let skipped = rewards
        .iter()
        .filter(|r| r.skipped || r.score.is_none() || r.gate_skip)
        .count();
    m.insert("reward/skipped".into(), skipped as f64);
    let mut extra: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in rewards {
        for (k, v) in &r.extra {
            let x = v
                .as_f64()
                .or_else(|| v.as_bool().map(|b| f64::from(u8::from(b))));
            if let Some(x) = x {
                extra.entry(k.as_str()).or_default().push(x);
            }
        }
    }
    for (k, v) in extra {
        m.insert(
            format!("reward_extra/{k}/mean"),
            v.iter().sum::<f64>() / v.len() as f64,
        );
    }
}
