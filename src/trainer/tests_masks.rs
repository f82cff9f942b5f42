//! Tokens with `response_mask` 0 (what a tool turn appends to a conversation) take no part in
//! training: the same step run twice, once with every per-token input at those positions
//! perturbed (old, reference and rollout log-probs, values), gives the same advantages and
//! returns on the kept tokens, the same update metrics and bit-identical actor and critic
//! weights — for each loss family and aggregation whose arithmetic could let them in.

use super::*;
use crate::trainer::batch::{Ragged, StepBatch};
use crate::trainer::phases::OldLogProbs;

/// Mask 0 on response positions 1 and 2 of every row that has at least four tokens (a tool
/// turn in the middle of the response; the last token, which holds the score, stays in).
fn tool_mask(b: &StepBatch) -> Ragged {
    b.response_lens()
        .iter()
        .map(|&n| {
            (0..n)
                .map(|t| {
                    if n >= 4 && (1..=2).contains(&t) {
                        0.0
                    } else {
                        1.0
                    }
                })
                .collect()
        })
        .collect()
}

/// `b`'s column `c` moved by `by` (varying with the position) where `mask` is 0.
fn perturb(b: &mut StepBatch, c: batch::Column, mask: &Ragged, by: f32) {
    if !b.has(c) {
        return;
    }
    let moved: Ragged = b
        .column(c)
        .unwrap()
        .iter()
        .zip(mask)
        .map(|(row, m)| {
            row.iter()
                .zip(m)
                .enumerate()
                .map(|(t, (&x, &k))| {
                    if k == 0.0 {
                        x + by * (1.0 + t as f32)
                    } else {
                        x
                    }
                })
                .collect()
        })
        .collect();
    b.set(c, moved).unwrap();
}

fn flat(vars: &[(String, candle_core::Var)]) -> Vec<u32> {
    vars.iter()
        .flat_map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .map(f32::to_bits)
        .collect()
}

/// The per-token inputs of a step on `b` (generated and masked): rewards, old and reference
/// log-probs, values.
fn inputs(t: &mut Trainer, b: &mut StepBatch) {
    t.compute_rewards(b).unwrap();
    t.actor.compute_log_prob(b).unwrap();
    if let Some(r) = &t.reference {
        r.compute_ref_log_prob(b).unwrap();
    }
    if let Some(c) = &t.critic {
        c.compute_values(b).unwrap();
    }
}

/// The rest of the step: advantages, then the critic and actor updates (metrics of all three).
fn update(t: &mut Trainer, b: &mut StepBatch) -> Metrics {
    let mut m = t.compute_advantages(b, 1).unwrap();
    let (mut timings, mut um) = (Timings::default(), Metrics::new());
    t.update_models(b, 1, OldLogProbs::Pass, &mut timings, &mut um)
        .unwrap();
    m.extend(um);
    m
}

/// `column`'s values at the positions where `mask` is 1.
fn kept(b: &StepBatch, c: batch::Column, mask: &Ragged) -> Vec<u32> {
    b.column(c)
        .unwrap()
        .iter()
        .zip(mask)
        .flat_map(|(row, m)| {
            row.iter()
                .zip(m)
                .filter(|(_, &k)| k != 0.0)
                .map(|(x, _)| x.to_bits())
        })
        .collect()
}

#[test]
fn masked_tokens_change_nothing_in_training() {
    let variants: &[&[&str]] = &[
        // GRPO, KL loss, entropy bonus, token-mean; rollout correction reading the rollout's
        // log-probs (IS weights and token rejection).
        &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.rollout.calculate_log_probs=True",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
        ],
        // GAE with a critic, KL in the reward, dual-clip, seq-mean-token-sum.
        &[
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=True",
            "actor_rollout_ref.actor.clip_ratio_c=3.0",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
            "critic.loss_agg_mode=seq-mean-token-sum",
        ],
        // GSPO's sequence-level ratio (a mean of log-ratios over the kept tokens),
        // seq-mean-token-mean, a k3 KL loss.
        &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_type=k3",
        ],
    ];
    let fx = fixture();
    for extra in variants {
        let mut args = vec![
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "critic.ppo_micro_batch_size_per_gpu=4",
        ];
        args.extend_from_slice(extra);
        let mut a = trainer(&fx, &args, None);
        let mut b = trainer(&fx, &args, None);
        let (prompts, _) = a.next_prompts().unwrap();
        let mut ba = a.generate(&prompts).unwrap();
        let mask = tool_mask(&ba);
        assert!(
            mask.iter().any(|r| r.contains(&0.0)),
            "{extra:?}: no row long enough to mask"
        );
        ba.set(batch::Column::ResponseMask, mask.clone()).unwrap();
        let mut bb = ba.clone();
        inputs(&mut a, &mut ba);
        inputs(&mut b, &mut bb);
        for c in [
            batch::Column::OldLogProbs,
            batch::Column::RefLogProb,
            batch::Column::RolloutLogProbs,
            batch::Column::Values,
        ] {
            perturb(&mut bb, c, &mask, 0.37);
        }
        let all = |x: &StepBatch, c| -> Vec<u32> {
            x.column(c)
                .unwrap()
                .iter()
                .flatten()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_ne!(
            all(&ba, batch::Column::OldLogProbs),
            all(&bb, batch::Column::OldLogProbs),
            "{extra:?}: the perturbation moved nothing"
        );
        let before = flat(a.actor.trainable.optimizer.vars());
        let ma = update(&mut a, &mut ba);
        let mb = update(&mut b, &mut bb);
        let mask_after = ba.response_mask();
        assert_eq!(mask_after, bb.response_mask(), "{extra:?}: response_mask");
        for c in [batch::Column::Advantages, batch::Column::Returns] {
            assert_eq!(
                kept(&ba, c, &mask_after),
                kept(&bb, c, &mask_after),
                "{extra:?}: {c:?} on kept tokens"
            );
        }
        assert_eq!(ma.keys().collect::<Vec<_>>(), mb.keys().collect::<Vec<_>>());
        for (k, v) in &ma {
            if k.starts_with("timing") {
                continue;
            }
            assert_eq!(
                v.to_bits(),
                mb[k].to_bits(),
                "{extra:?}: {k}: {v} vs {}",
                mb[k]
            );
        }
        assert_eq!(
            flat(a.actor.trainable.optimizer.vars()),
            flat(b.actor.trainable.optimizer.vars()),
            "{extra:?}: actor weights"
        );
        assert_ne!(
            before,
            flat(a.actor.trainable.optimizer.vars()),
            "{extra:?}: no update"
        );
        if let (Some(ca), Some(cb)) = (&a.critic, &b.critic) {
            assert_eq!(
                flat(ca.trainable.optimizer.vars()),
                flat(cb.trainable.optimizer.vars()),
                "{extra:?}: critic weights"
            );
        }
    }
}
