//! verl's per-step data metrics (`metric_utils.compute_data_metrics`): scores, rewards,
//! advantages, returns, values, lengths, entropy, and the reward sources' means.

use std::collections::BTreeMap;

use candle_core::Device;

use super::batch::{dense, Column, Ragged, StepBatch, TurnStats};
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

/// One row's part of the variance-proxy metrics.
#[derive(Default)]
struct RowProxy {
    /// Mean advantage over the row's tokens, `Ā`.
    adv: f64,
    /// `W = Σ m·w`.
    w: f64,
    /// Mean IS weight over the row's tokens, `ρ̄ₘ` (0 without weights).
    rho: f64,
    /// `W₀ = Σ m·w / max(ρ̄², 1e-10)` (0 without weights).
    w_unweighted: f64,
}

/// verl's `variance_proxy/*` metrics (`metric_utils.compute_variance_proxy_metrics`), logged when
/// the step has Σπ² (`actor.calculate_sum_pi_squared`), whatever the estimator. Over the rows
/// in the update, each row's mean advantage `Ā = Σ m·A / (Σ m + 1e-8)` and score-norm proxy
/// `W = Σ_t m_t·w_t`, `w_t = (1 − 2π_t + Σπ²_t)·ρ̄_t²` (`ρ̄` the rollout IS weights when the step
/// has them, else 1):
///
/// - `proxy2_total_power`: mean of `Ā²·max(W, 0)`; with IS weights mean of
///   `ρ̄ₘ²·Ā²·max(W₀, 0)`, `ρ̄ₘ` the row's mean weight and `W₀ = Σ m·w / max(ρ̄², 1e-10)`;
/// - `proxy1_signal_strength`: `grad_norm²` (`actor/grad_norm` of this step; 0 without one);
/// - `proxy3_pure_noise`: `max(0, (proxy2 − proxy1) / (N − 1))` over `N` rows (0 without a
///   gradient norm or with one row);
/// - `expected_a_squared`: mean of `Ā²`; `expected_w`: mean of `W`.
pub fn variance_proxy_metrics(m: &mut Metrics, b: &StepBatch) -> candle_core::Result<()> {
    if !b.has(Column::SumPiSquared) || !b.has(Column::Advantages) {
        return Ok(());
    }
    let (old, sq, adv) = (
        b.column(Column::OldLogProbs)?,
        b.column(Column::SumPiSquared)?,
        b.column(Column::Advantages)?,
    );
    let is_w = match b.has(Column::RolloutIsWeights) {
        true => Some(b.column(Column::RolloutIsWeights)?),
        false => None,
    };
    let mask = b.response_mask();
    let rows: Vec<usize> = (0..b.len()).filter(|&r| !b.excluded[r]).collect();
    if rows.is_empty() {
        return Ok(());
    }
    let per_row: Vec<RowProxy> = rows
        .iter()
        .map(|&r| {
            let mut p = RowProxy::default();
            let mut n = 0.0;
            for t in 0..b.response_len(r) {
                let mk = f64::from(mask[r][t]);
                if mk == 0.0 {
                    continue;
                }
                let base = 1.0 - 2.0 * f64::from(old[r][t]).exp() + f64::from(sq[r][t]);
                let rho2 = is_w.map_or(1.0, |iw| f64::from(iw[r][t]).powi(2));
                p.adv += f64::from(adv[r][t]) * mk;
                n += mk;
                p.w += base * rho2 * mk;
                if let Some(iw) = is_w {
                    p.rho += f64::from(iw[r][t]) * mk;
                    p.w_unweighted += base * rho2 / rho2.max(1e-10) * mk;
                }
            }
            p.adv /= n + 1e-8;
            p.rho /= n + 1e-8;
            p
        })
        .collect();
    let count = per_row.len() as f64;
    let mean = |f: fn(&RowProxy) -> f64| per_row.iter().map(f).sum::<f64>() / count;
    let proxy2 = match is_w {
        Some(_) => mean(|p| p.rho * p.rho * p.adv * p.adv * p.w_unweighted.max(0.0)),
        None => mean(|p| p.adv * p.adv * p.w.max(0.0)),
    };
    let proxy1 = m.get("actor/grad_norm").map(|g| g * g);
    let proxy3 = match proxy1 {
        Some(p1) if per_row.len() > 1 => ((proxy2 - p1) / (count - 1.0)).max(0.0),
        _ => 0.0,
    };
    for (k, v) in [
        ("proxy1_signal_strength", proxy1.unwrap_or(0.0)),
        ("proxy2_total_power", proxy2),
        ("proxy3_pure_noise", proxy3),
        ("expected_a_squared", mean(|p| p.adv * p.adv)),
        ("expected_w", mean(|p| p.w)),
    ] {
        m.insert(format!("variance_proxy/{k}"), v);
    }
    Ok(())
}

/// The tool agent loop's metrics of a step that ran it: verl's `num_turns/{mean,max,min}`, and
/// ours under `agent/`: calls per tool-agent response, the share of those responses that
/// called a tool (parsed or not), the share of call blocks that parsed, the share of run calls
/// that failed, the tools' mean reward, the model's own tokens per response (verl's
/// `response_length` counts tool and template tokens too) and the share of conversations whose
/// turn-by-turn ids differ from tokenising them at once.
pub fn agent_metrics(m: &mut Metrics, turns: &[TurnStats]) {
    let num: Vec<f64> = turns.iter().map(|t| t.num_turns as f64).collect();
    add_stats(m, "num_turns", &num);
    let tool: Vec<&TurnStats> = turns.iter().filter(|t| t.tool_agent).collect();
    if tool.is_empty() {
        return;
    }
    // verl's per-sample tool time over the whole batch (single-turn rows wait 0 s).
    let waits: Vec<f64> = turns.iter().map(|t| t.tool_seconds).collect();
    add_stats(m, "timing_s/agent_loop/tool_calls", &waits);
    let n = tool.len() as f64;
    let calls: usize = tool.iter().map(|t| t.tool_calls).sum();
    let bad: usize = tool.iter().map(|t| t.malformed_calls).sum();
    let errors: usize = tool.iter().map(|t| t.tool_errors).sum();
    m.insert("agent/tool_calls/mean".into(), calls as f64 / n);
    let calling = tool
        .iter()
        .filter(|t| t.tool_calls + t.malformed_calls > 0)
        .count();
    m.insert("agent/tool_call_ratio".into(), calling as f64 / n);
    if calls + bad > 0 {
        m.insert(
            "agent/tool_call_parse_ratio".into(),
            calls as f64 / (calls + bad) as f64,
        );
    }
    if calls > 0 {
        m.insert(
            "agent/tool_error_ratio".into(),
            errors as f64 / calls as f64,
        );
    }
    let rewards: Vec<f64> = tool
        .iter()
        .flat_map(|t| t.tool_rewards.iter().copied())
        .collect();
    if !rewards.is_empty() {
        m.insert(
            "agent/tool_reward/mean".into(),
            rewards.iter().sum::<f64>() / rewards.len() as f64,
        );
    }
    // Interactions: the mean score of their user turns, and turns that failed (each ended its
    // conversation); only when some row talked to one.
    let scores: Vec<f64> = tool
        .iter()
        .flat_map(|t| t.turn_scores.iter().copied())
        .collect();
    let failed: usize = tool.iter().map(|t| t.interaction_errors).sum();
    if !scores.is_empty() || failed > 0 {
        let mean = scores.iter().sum::<f64>() / scores.len().max(1) as f64;
        m.insert("agent/interaction_score/mean".into(), mean);
        m.insert("agent/interaction_errors".into(), failed as f64);
    }
    let model: Vec<f64> = tool.iter().map(|t| t.model_tokens as f64).collect();
    add_stats(m, "agent/model_response_length", &model);
    let mismatched = tool.iter().filter(|t| t.sanity_mismatch).count();
    m.insert(
        "agent/tokenization_mismatch_ratio".into(),
        mismatched as f64 / n,
    );
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn rows(v: &Value) -> Vec<Vec<f64>> {
        serde_json::from_value(v.clone()).unwrap()
    }

    fn ragged(v: &[Vec<f64>]) -> Ragged {
        v.iter()
            .map(|r| r.iter().map(|&x| x as f32).collect())
            .collect()
    }

    /// verl's `compute_variance_proxy_metrics` (1dda039, torch f64; the `otb` part of
    /// tests/fixtures/algo_verl_1dda039.json, written by scripts/verl_algo_fixtures.py) on the
    /// optimal token baseline's advantages, with and without rollout IS weights and a gradient
    /// norm, on prefix masks and masks with holes, an empty response among the rows: the same
    /// five numbers within 1e-5 (relative above 1; the columns hold f32).
    #[test]
    fn variance_proxy_metrics_equal_verl() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/algo_verl_1dda039.json"
        );
        let f: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let o = &f["otb"];
        let old = rows(&o["old_log_probs"]);
        let (b, t) = (old.len(), old[0].len());
        let cases = o["variance_proxy"].as_array().unwrap();
        assert_eq!(cases.len(), 8);
        for c in cases {
            let mut batch = StepBatch::new(
                vec![vec![1]; b],
                vec![vec![7; t]; b],
                (0..b).collect(),
                (0..b as u64).collect(),
                vec![false; b],
            );
            batch.set(Column::OldLogProbs, ragged(&old)).unwrap();
            let spi2 = rows(&o["sum_pi_squared"]);
            batch.set(Column::SumPiSquared, ragged(&spi2)).unwrap();
            let adv = rows(&o["variance_proxy_advantages"]);
            batch.set(Column::Advantages, ragged(&adv)).unwrap();
            let mask = rows(&o["masks"][c["mask"].as_str().unwrap()]);
            batch.set(Column::ResponseMask, ragged(&mask)).unwrap();
            if c["weighted"].as_bool().unwrap() {
                let w = rows(&o["rollout_is_weights"]);
                batch.set(Column::RolloutIsWeights, ragged(&w)).unwrap();
            }
            let mut m = Metrics::new();
            if let Some(g) = c["grad_norm"].as_f64() {
                m.insert("actor/grad_norm".into(), g);
            }
            variance_proxy_metrics(&mut m, &batch).unwrap();
            let want = c["metrics"].as_object().unwrap();
            assert_eq!(want.len(), 5);
            for (k, v) in want {
                let (g, v) = (m[k.as_str()], v.as_f64().unwrap());
                assert!(
                    (g - v).abs() <= 1e-5 * (1.0 + v.abs()),
                    "{c}: {k} {g} vs {v}"
                );
            }
        }
        // Without Σπ² nothing is logged.
        let mut m = Metrics::new();
        variance_proxy_metrics(&mut m, &StepBatch::default()).unwrap();
        assert!(m.is_empty());
    }

    /// The agent metrics by hand: two tool-agent rows (one calling twice with one error, one
    /// unparsable block and rewards 1 and 0, waiting 0.5 s, interaction scores 0, 1, 1; one not
    /// calling, its interaction failing) and a single-turn row. Ratios count tool-agent rows only; turns and tool time count every row (verl's
    /// per-sample timing).
    #[test]
    fn agent_metrics_by_hand() {
        let turns = [
            TurnStats {
                num_turns: 4,
                tool_agent: true,
                tool_calls: 2,
                tool_errors: 1,
                malformed_calls: 1,
                tool_rewards: vec![1.0, 0.0],
                model_tokens: 10,
                sanity_mismatch: true,
                tool_seconds: 0.5,
                spans: vec![10],
                turn_scores: vec![0.0, 1.0, 1.0],
                interaction_errors: 0,
            },
            TurnStats {
                num_turns: 2,
                tool_agent: true,
                model_tokens: 4,
                interaction_errors: 1,
                ..Default::default()
            },
            TurnStats {
                num_turns: 2,
                model_tokens: 6,
                ..Default::default()
            },
        ];
        let mut m = Metrics::new();
        agent_metrics(&mut m, &turns);
        let want = [
            ("num_turns/mean", 8.0 / 3.0),
            ("num_turns/max", 4.0),
            ("num_turns/min", 2.0),
            ("timing_s/agent_loop/tool_calls/mean", 0.5 / 3.0),
            ("timing_s/agent_loop/tool_calls/max", 0.5),
            ("timing_s/agent_loop/tool_calls/min", 0.0),
            ("agent/tool_calls/mean", 1.0),
            ("agent/tool_call_ratio", 0.5),
            ("agent/tool_call_parse_ratio", 2.0 / 3.0),
            ("agent/tool_error_ratio", 0.5),
            ("agent/tool_reward/mean", 0.5),
            ("agent/model_response_length/mean", 7.0),
            ("agent/model_response_length/max", 10.0),
            ("agent/model_response_length/min", 4.0),
            ("agent/tokenization_mismatch_ratio", 0.5),
            ("agent/interaction_score/mean", 2.0 / 3.0),
            ("agent/interaction_errors", 1.0),
        ];
        for (k, v) in want {
            let got = m.get(k).unwrap_or_else(|| panic!("no {k}"));
            assert!((got - v).abs() < 1e-12, "{k}: {got} vs {v}");
        }
        assert_eq!(m.len(), want.len(), "{:?}", m.keys().collect::<Vec<_>>());

        // Single-turn rows only: turn counts, no agent/* and no tool time.
        let mut m = Metrics::new();
        agent_metrics(&mut m, &turns[2..]);
        assert_eq!(
            m.keys().collect::<Vec<_>>(),
            ["num_turns/max", "num_turns/mean", "num_turns/min"]
        );
    }
}
