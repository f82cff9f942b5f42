//! Rollout correction end to end on the tiny model (f32 products on both sides, so the
//! rollout's log-probs and the trainer's agree to float rounding): IS weights of 1, rejection
//! that reaches the estimator and the losses, and bypass mode without the old-log-prob pass.

use super::*;

const GRPO: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=2",
];

fn run(extra: &[&str]) -> Trainer {
    let fx = fixture();
    let o: Vec<&str> = GRPO.iter().chain(extra).copied().collect();
    let mut t = trainer(&fx, &o, None);
    t.fit().unwrap();
    // The fixture's folder goes with it; the trainer keeps what the tests read.
    drop(fx);
    t
}

/// With f32 products the rollout computes the same log-probs as the trainer (to rounding): IS
/// weights are 1 within 1e-5 at either level, the KL between the two is ~0, and the
/// probabilities differ by less than 1e-5. The diagnostics are logged by default.
#[test]
fn identical_arithmetic_gives_unit_weights_and_no_mismatch() {
    for level in ["token", "sequence"] {
        let key = format!("algorithm.rollout_correction.rollout_is={level}");
        let t = run(&[
            &key,
            "algorithm.rollout_correction.rollout_is_threshold=5.0",
        ]);
        for (step, m) in &t.history {
            for k in ["rollout_is_mean", "rollout_is_max", "rollout_is_min"] {
                let v = m[&format!("rollout_corr/{k}")];
                assert!((v - 1.0).abs() < 1e-5, "{level} step {step}: {k} = {v}");
            }
            assert!(
                m["rollout_corr/kl"].abs() < 1e-6,
                "{level}: {}",
                m["rollout_corr/kl"]
            );
            assert!(m["training/rollout_probs_diff_max"] < 1e-5);
            assert!(m.contains_key("timing_s/old_log_prob"), "the pass runs");
        }
    }
    // Nothing configured: the diagnostics only (here from the on-policy update's own forward).
    let t = run(&[]);
    let m = &t.history[0].1;
    assert!(
        m.contains_key("rollout_corr/training_ppl")
            && !m.contains_key("rollout_corr/rollout_is_mean")
    );
    assert!(
        !m.contains_key("timing_s/old_log_prob"),
        "on-policy: no pass"
    );
    let off = run(&["actor_rollout_ref.rollout.calculate_log_probs=False"]);
    assert!(!off.history[0]
        .1
        .keys()
        .any(|k| k.starts_with("rollout_corr/")));
    // The diagnostics change nothing of the training.
    assert!(weights(&t.actor.trainable.varmap) == weights(&off.actor.trainable.varmap));
}

/// A k1 band no log-ratio falls in ([1 + 1e-3, 1 + 2e-3] for π_rollout/π_trainer, which agree
/// to ~1e-6) rejects every token: the mask reaches the estimator (all advantages 0 in the
/// dump) and the loss (no token to train on: the actor does not move), and the metrics say so.
#[test]
fn rejection_reaches_the_estimator_and_the_loss() {
    let fx = fixture();
    let dumps = fx.dir.path().join("rollouts");
    let o: Vec<String> = GRPO
        .iter()
        .map(|s| s.to_string())
        .chain([
            "algorithm.rollout_correction.rollout_rs=token_k1".into(),
            "algorithm.rollout_correction.rollout_rs_threshold=1.001_1.002".into(),
            format!("trainer.rollout_data_dir={}", dumps.display()),
            "trainer.total_training_steps=1".into(),
        ])
        .collect();
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    let mut t = trainer(&fx, &o, None);
    let before = weights(&t.actor.trainable.varmap);
    let m = t.step().unwrap();
    // verl's masked mean divides by the token count + 1e-8.
    assert!((m["rollout_corr/rollout_rs_masked_fraction"] - 1.0).abs() < 1e-6);
    assert_eq!(m["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0);
    // No token left in any mini-batch: no update at all.
    assert_eq!(m.get("actor/pg_loss").copied().unwrap_or(0.0), 0.0);
    assert!(
        before == weights(&t.actor.trainable.varmap),
        "the actor moved"
    );
    let text = std::fs::read_to_string(dumps.join("1.jsonl")).unwrap();
    for line in text.lines() {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(row["advantage"].as_f64().unwrap(), 0.0, "{row}");
    }
    // A band around 1 keeps everything: the same step as without rejection.
    let keep = [
        "algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k2'",
        "algorithm.rollout_correction.rollout_rs_threshold='0.999_1.001,0.01'",
    ];
    let (a, b) = (run(&keep), run(&[]));
    assert_eq!(
        a.history[1].1["rollout_corr/rollout_rs_masked_fraction"],
        0.0
    );
    let (wa, wb) = (
        weights(&a.actor.trainable.varmap),
        weights(&b.actor.trainable.varmap),
    );
    for ((k, x), (_, y)) in wa.iter().zip(&wb) {
        let d = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-5, "{k}: {d}");
    }
}

/// Bypass mode skips the old-log-prob pass; the rollout's log-probs are the old ones. With one
/// mini-batch the ratio starts at 1 (to rounding), so ppo_clip and reinforce (whose gradient
/// −A·∇log π is the clipped loss's at ratio 1) train as the run without bypass does; the
/// actor reports the correction it recomputed per micro-batch.
#[test]
fn bypass_mode_skips_the_pass_and_trains_alike() {
    let base = run(&["algorithm.rollout_correction.rollout_is=token"]);
    let wb = weights(&base.actor.trainable.varmap);
    for loss in ["ppo_clip", "reinforce"] {
        let lt = format!("algorithm.rollout_correction.loss_type={loss}");
        let t = run(&[
            "algorithm.rollout_correction.bypass_mode=True",
            "algorithm.rollout_correction.rollout_is=token",
            &lt,
        ]);
        for (step, m) in &t.history {
            assert!(
                !m.contains_key("timing_s/old_log_prob"),
                "{loss} step {step}"
            );
            let w = m["rollout_corr/rollout_is_mean"];
            assert!((w - 1.0).abs() < 1e-5, "{loss}: weights {w}");
        }
        let wt = weights(&t.actor.trainable.varmap);
        for ((k, x), (_, y)) in wt.iter().zip(&wb) {
            let d = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-4, "{loss}: {k} differs by {d}");
        }
    }
}
