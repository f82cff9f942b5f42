//! End-to-end tests of the loop on a tiny random Llama (byte tokenizer, CPU, seconds).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use serde_json::Map;

use super::*;
use crate::metrics::{MetricSink, Metrics};
use crate::model::{Arch, ModelArgs};
use crate::reward::{ScoreInput, ScoreResult};
use crate::testing::{tiny_model, verl_row, write_jsonl, write_tokenizer_dir};

struct Fixture {
    dir: tempfile::TempDir,
    model: PathBuf,
    data: PathBuf,
}

/// A tiny Llama (byte vocabulary) saved as an HF directory, and 16 short prompts.
fn fixture() -> Fixture {
    fixture_of(&ModelArgs::tiny(Arch::Llama, 259))
}

/// [`fixture`] with a model of `args` (byte vocabulary: 259).
fn fixture_of(args: &ModelArgs) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let args = args.clone();
    let (vm, _) = tiny_model(&args, DType::F32, 0.1);
    write_tokenizer_dir(&model).unwrap();
    crate::weights::hf::save_dir(&vm, &args, &model, &[258], Some(&model), None).unwrap();
    let data = dir.path().join("train.jsonl");
    let rows: Vec<_> = (0..16)
        .map(|i| verl_row(&format!("q{i}"), &i.to_string()))
        .collect();
    write_jsonl(&data, &rows).unwrap();
    Fixture { dir, model, data }
}

/// The share of `a` characters in the response: a reward a policy can learn by itself.
fn natives() -> NativeRegistry {
    let mut n = NativeRegistry::new();
    n.register(
        "share_of_a",
        |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            let chars: Vec<char> = inp.solution_str.chars().collect();
            let a = chars.iter().filter(|&&c| c == 'a').count();
            Ok(ScoreResult {
                score: if chars.is_empty() {
                    0.0
                } else {
                    a as f64 / chars.len() as f64
                },
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n.register(
        "length",
        |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            Ok(ScoreResult {
                score: inp.solution_str.chars().count() as f64,
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n.register(
        "even_length",
        |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            Ok(ScoreResult {
                score: if inp.solution_str.chars().count().is_multiple_of(2) {
                    1.0
                } else {
                    0.0
                },
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n.register(
        "parts",
        |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            let chars: Vec<char> = inp.solution_str.chars().collect();
            let a = chars.iter().filter(|&&c| c == 'a').count() as f64;
            let share = if chars.is_empty() {
                0.0
            } else {
                a / chars.len() as f64
            };
            let even = f64::from(u8::from(chars.len().is_multiple_of(2)));
            let mut extra = Map::new();
            extra.insert("share".into(), share.into());
            extra.insert("even".into(), chars.len().is_multiple_of(2).into());
            Ok(ScoreResult { score: even, extra })
        },
    )
    .unwrap();
    n.register(
        "in_experiment_x",
        |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            let named = inp
                .extra_info
                .get("experiment_name")
                .and_then(|v| v.as_str());
            Ok(ScoreResult {
                score: f64::from(u8::from(named == Some("x"))),
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n.register(
        "one",
        |_: &ScoreInput, _: &Map<String, serde_json::Value>| {
            Ok(ScoreResult {
                score: 1.0,
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n
}

fn config(fx: &Fixture, extra: &[&str]) -> Config {
    let m = fx.model.display().to_string();
    let d = fx.data.display().to_string();
    let ckpt = fx.dir.path().join("ckpt").display().to_string();
    let mut o: Vec<String> = vec![
        format!("data.train_files={d}"),
        format!("data.val_files={d}"),
        "data.train_batch_size=4".into(),
        "data.max_prompt_length=128".into(),
        "data.max_response_length=6".into(),
        format!("actor_rollout_ref.model.path={m}"),
        "actor_rollout_ref.actor.optim.lr=1e-3".into(),
        "actor_rollout_ref.actor.ppo_mini_batch_size=2".into(),
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2".into(),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4".into(),
        "actor_rollout_ref.rollout.n=2".into(),
        format!("critic.model.path={m}"),
        "critic.optim.lr=1e-3".into(),
        "critic.ppo_micro_batch_size_per_gpu=2".into(),
        "reward.sources=[{name: a, type: native, function: share_of_a}]".into(),
        "trainer.logger=[]".into(),
        format!("trainer.default_local_dir={ckpt}"),
        "trainer.total_training_steps=3".into(),
        "trainer.val_before_train=False".into(),
        "trainer.device=cpu".into(),
    ];
    o.extend(extra.iter().map(|s| s.to_string()));
    crate::config::load(&crate::config::ConfigSource::Builtin, &o)
        .unwrap_or_else(|e| panic!("{e}"))
        .config
}

fn trainer(fx: &Fixture, extra: &[&str], tracker: Option<Tracker>) -> Trainer {
    Trainer::new(
        config(fx, extra),
        TrainerOptions {
            natives: natives(),
            stop: Arc::new(AtomicBool::new(false)),
            tracker: Some(tracker.unwrap_or_else(|| Tracker::with_sinks(Vec::new()))),
            ..TrainerOptions::default()
        },
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn weights(vm: &candle_nn::VarMap) -> Vec<(String, Vec<f32>)> {
    let data = vm.data().lock().unwrap();
    let mut v: Vec<(String, Vec<f32>)> = data
        .iter()
        .map(|(k, v)| {
            // bf16 weights (model_dtype=bf16) read exactly as f32.
            let t = v.as_tensor().to_dtype(DType::F32).unwrap();
            (k.clone(), t.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn assert_finite(m: &Metrics, keys: &[&str], what: &str) {
    for k in keys {
        let v = m
            .get(*k)
            .unwrap_or_else(|| panic!("{what}: no {k} in {:?}", m.keys().collect::<Vec<_>>()));
        assert!(v.is_finite(), "{what}: {k} = {v}");
    }
}

#[test]
fn three_steps_with_each_estimator_and_kl_variant() {
    let fx = fixture();
    let cases: [(&str, &[&str]); 6] = [
        ("gae", &["algorithm.adv_estimator=gae"]),
        ("grpo", &["algorithm.adv_estimator=grpo"]),
        ("rloo", &["algorithm.adv_estimator=rloo"]),
        (
            "reinforce_plus_plus",
            &["algorithm.adv_estimator=reinforce_plus_plus"],
        ),
        (
            "grpo + use_kl_loss",
            &[
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.actor.use_kl_loss=True",
            ],
        ),
        (
            "gae + use_kl_in_reward",
            &[
                "algorithm.adv_estimator=gae",
                "algorithm.use_kl_in_reward=True",
            ],
        ),
    ];
    for (name, extra) in cases {
        let mut t = trainer(&fx, extra, None);
        let before = weights(&t.actor.trainable.varmap);
        let outcome = t.fit().unwrap();
        assert_eq!(outcome, FitOutcome::Finished { steps: 3 }, "{name}");
        assert_eq!(t.history.len(), 3, "{name}");
        let m = &t.history[2].1;
        assert_finite(
            m,
            &[
                "critic/score/mean",
                "critic/advantages/mean",
                "critic/returns/mean",
                "actor/pg_loss",
                "actor/grad_norm",
                "actor/entropy",
                "actor/lr",
                "response_length/mean",
                "response_length/clip_ratio",
                "prompt_length/mean",
                "timing_s/gen",
                "timing_s/update_actor",
                "timing_s/step",
                "perf/throughput",
                "reward/a/mean",
                "training/global_step",
            ],
            name,
        );
        assert_eq!(m["training/global_step"], 3.0);
        // trainer.balance_batch (default): one rank holds every token of the step.
        assert_eq!(
            m["global_seqlen/mean"], m["perf/total_num_tokens"],
            "{name}"
        );
        assert_eq!(m["global_seqlen/minmax_diff"], 0.0, "{name}");
        let critic = name.starts_with("gae");
        assert_eq!(m.contains_key("critic/vf_loss"), critic, "{name}");
        assert_eq!(m.contains_key("critic/vf_explained_var"), critic, "{name}");
        assert_eq!(t.critic.is_some(), critic, "{name}");
        // verl's dp_actor reports actor/kl_loss always (0 without use_kl_loss), kl_coef with it.
        assert_eq!(
            m["actor/kl_loss"] != 0.0,
            name.contains("kl_loss"),
            "{name}"
        );
        assert_eq!(
            m.contains_key("actor/kl_coef"),
            name.contains("kl_loss"),
            "{name}"
        );
        assert_eq!(
            m.contains_key("actor/reward_kl_penalty"),
            name.contains("kl_in_reward"),
            "{name}"
        );
        assert_eq!(t.reference.is_some(), name.contains("kl"), "{name}");
        let after = weights(&t.actor.trainable.varmap);
        let changed = before
            .iter()
            .zip(&after)
            .filter(|(a, b)| a.1 != b.1)
            .count();
        assert_eq!(changed, before.len(), "{name}: every actor parameter moves");
        assert!(m["actor/lr"] == 1e-3, "{name}");
    }
}

/// `use_remove_padding` (packed sequences, the default) against padded micro-batches over 3
/// steps: with a critic, a reference in the reward and mini-batches of several micro-batches
/// (gae), and with a KL loss against the reference (grpo; measured: every metric within 1e-5
/// relative), the deterministic metrics agree within 1e-4 relative and
/// the actor's and critic's weights within 1e-4 of each tensor's largest value (f32 rounding:
/// packing changes only the order of a few sums). Prompts and responses differ in length, so
/// the padded runs do compute padding the packed ones skip.
#[test]
fn packed_and_padded_runs_agree() {
    let fx = fixture();
    let cases: [(&str, &[&str]); 2] = [
        (
            "gae + use_kl_in_reward",
            &[
                "algorithm.adv_estimator=gae",
                "algorithm.use_kl_in_reward=True",
            ],
        ),
        (
            // The entropy bonus gives a real gradient from step 1: with equal rewards in every
            // group the policy gradient is zero, and AdamW turns a gradient of rounding noise
            // (1e-8) into full-size steps that differ between any two summation orders.
            "grpo + use_kl_loss + entropy_coeff",
            &[
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.entropy_coeff=0.01",
            ],
        ),
    ];
    let padded = [
        "actor_rollout_ref.model.use_remove_padding=False",
        "critic.model.use_remove_padding=False",
    ];
    for (name, extra) in cases {
        let mut packed_run = trainer(&fx, extra, None);
        packed_run.fit().unwrap();
        let mut with_pad: Vec<&str> = extra.to_vec();
        with_pad.extend(padded);
        let mut padded_run = trainer(&fx, &with_pad, None);
        padded_run.fit().unwrap();
        assert_runs_agree(name, &packed_run, &padded_run, ("packed", "padded"));
    }
}

/// `actor.use_prefix_grouper` (each group's prompt computed once, sequences packed although
/// `use_remove_padding=False` as in verl's PrefixGrouper example) against the same runs with
/// every response after its own prompt (packed), over 3 steps with a critic, a reference in
/// the reward and a KL loss: the deterministic metrics within 1e-4 relative, the actor's and
/// critic's weights within 1e-4 of each tensor's largest value (f32; sharing changes only the
/// order of a few sums). Both keep the row order (`balance_batch=False`: with the grouper the
/// order is kept, as in verl, and the unshared run is compared on the same mini-batches).
#[test]
fn prefix_grouper_runs_agree_with_unshared_runs() {
    let fx = fixture();
    let cases: [(&str, &[&str]); 2] = [
        (
            "gae + use_kl_in_reward",
            &[
                "algorithm.adv_estimator=gae",
                "algorithm.use_kl_in_reward=True",
                "trainer.balance_batch=False",
            ],
        ),
        (
            "grpo + use_kl_loss + entropy_coeff",
            &[
                "algorithm.adv_estimator=grpo",
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.entropy_coeff=0.01",
                "trainer.balance_batch=False",
            ],
        ),
    ];
    let grouped = [
        "actor_rollout_ref.actor.use_prefix_grouper=True",
        "actor_rollout_ref.model.use_remove_padding=False",
        "critic.model.use_remove_padding=False",
    ];
    for (name, extra) in cases {
        let mut alone = trainer(&fx, extra, None);
        alone.fit().unwrap();
        let mut with_grouper: Vec<&str> = extra.to_vec();
        with_grouper.extend(grouped);
        let mut shared = trainer(&fx, &with_grouper, None);
        let layout = shared.actor.trainable.settings.layout(shared.actor.view());
        assert!(layout.share_prefixes && layout.packed, "{name}: {layout:?}");
        assert!(
            !alone
                .actor
                .trainable
                .settings
                .layout(alone.actor.view())
                .share_prefixes
        );
        shared.fit().unwrap();
        assert_runs_agree(name, &shared, &alone, ("shared", "alone"));
    }
}

/// Two 3-step runs that differ only in how micro-batches are laid out (`labels` name them):
/// the deterministic metrics of every step within 1e-4 relative (the rollout-vs-trainer
/// diagnostics, which measure rounding differences, near 0 to 1e-5), and the actor's and
/// critic's weights within 1e-4 of each tensor's largest value.
fn assert_runs_agree(name: &str, a: &Trainer, b: &Trainer, (la, lb): (&str, &str)) {
    assert_eq!(a.history.len(), 3, "{name}");
    for ((step, ma), (_, mb)) in a.history.iter().zip(&b.history) {
        let (ma, mb) = (deterministic(ma), deterministic(mb));
        assert_eq!(
            ma.keys().collect::<Vec<_>>(),
            mb.keys().collect::<Vec<_>>(),
            "{name}"
        );
        for (k, x) in &ma {
            let y = mb[k];
            let tol = if k.starts_with("rollout_corr/") || k.starts_with("training/rollout_") {
                (1e-4 * x.abs().max(y.abs())).max(1e-5)
            } else {
                1e-4 * x.abs().max(y.abs()).max(1e-3)
            };
            assert!(
                (x - y).abs() <= tol,
                "{name} step {step}: {k} {la} {x}, {lb} {y}"
            );
        }
    }
    let mut models = vec![(
        "actor",
        weights(&a.actor.trainable.varmap),
        weights(&b.actor.trainable.varmap),
    )];
    if let (Some(ca), Some(cb)) = (&a.critic, &b.critic) {
        models.push((
            "critic",
            weights(&ca.trainable.varmap),
            weights(&cb.trainable.varmap),
        ));
    }
    for (model, wa, wb) in models {
        for ((tensor, x), (_, y)) in wa.iter().zip(&wb) {
            let scale = y.iter().fold(0f32, |s, v| s.max(v.abs()));
            for (u, v) in x.iter().zip(y) {
                assert!(
                    (u - v).abs() <= 1e-4 * scale,
                    "{name}: {model} {tensor}: {la} {u}, {lb} {v}"
                );
            }
        }
    }
}

/// Metrics that do not depend on the wall clock.
fn deterministic(m: &Metrics) -> Metrics {
    m.iter()
        .filter(|(k, _)| !k.starts_with("timing_") && !k.starts_with("perf/"))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

/// Sets a stop flag once a given step is logged (a Ctrl-C at a known moment).
struct StopAt(u64, Arc<AtomicBool>);
impl MetricSink for StopAt {
    fn log(&mut self, _: &Metrics, step: u64) -> std::io::Result<()> {
        if step == self.0 {
            self.1.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// The optimizer files of a checkpoint: the actor's, and the critic's where there is one.
fn optimizer_files(dir: &Path) -> Vec<Vec<u8>> {
    let critic = dir.join("critic").is_dir();
    [
        "actor/optim.safetensors",
        "critic/optim.safetensors",
        "actor/optim.json",
        "critic/optim.json",
    ]
    .iter()
    .filter(|f| critic || f.starts_with("actor/"))
    .map(|f| std::fs::read(dir.join(f)).unwrap())
    .collect()
}

/// PF-PPO with `max_min` (verl's weights: 1 + 1e-8 for the batch's highest and lowest score,
/// 1e-8 for the rest): after the `adv` phase the batch has as many rows as before, every one a
/// copy of a generated row with the highest or lowest score (the odds of another being drawn
/// are ~1e-7 here), its advantages, returns, values and old log-probs travelling with it; and
/// a run with it stopped after step 2 and resumed ends as the uninterrupted one (the draws are
/// a function of the seed and the step).
#[test]
fn pf_ppo_trains_on_the_rows_it_draws_and_resumes_exactly() {
    let fx = fixture();
    let args = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_pf_ppo=True",
        "algorithm.pf_ppo.reweight_method=max_min",
        "reward.sources=[{name: l, type: native, function: length}]",
    ];
    let mut t = trainer(&fx, &args, None);
    let (prompts, _) = t.next_prompts().unwrap();
    let mut batch = t.generate(&prompts).unwrap();
    t.compute_rewards(&mut batch).unwrap();
    t.actor.compute_log_prob(&mut batch).unwrap();
    t.critic
        .as_ref()
        .unwrap()
        .compute_values(&mut batch)
        .unwrap();
    let mut plain = batch.clone();
    let mut alg = t.cfg.algorithm.clone();
    alg.use_pf_ppo = false;
    super::advantage::compute(&alg, &mut t.kl_ctrl.clone(), &mut plain, &mut |_| {
        Ok(Metrics::new())
    })
    .unwrap();
    t.compute_advantages(&mut batch, 1).unwrap();
    assert_eq!(batch.len(), plain.len());
    let score = |b: &batch::StepBatch, r: usize| -> f32 {
        b.column(batch::Column::TokenLevelScores).unwrap()[r]
            .iter()
            .sum()
    };
    let scores: Vec<f32> = (0..plain.len()).map(|r| score(&plain, r)).collect();
    let max = scores.iter().cloned().fold(f32::MIN, f32::max);
    let min = scores.iter().cloned().fold(f32::MAX, f32::min);
    assert!(max > min, "the fixture's scores do not differ: {scores:?}");
    let cols = [
        batch::Column::Advantages,
        batch::Column::Returns,
        batch::Column::Values,
        batch::Column::OldLogProbs,
    ];
    let mut drawn = std::collections::BTreeSet::new();
    for r in 0..batch.len() {
        let s = score(&batch, r);
        assert!(
            s == max || s == min,
            "row {r} drawn with score {s} ({min}..{max})"
        );
        let src = (0..plain.len())
            .find(|&q| {
                plain.responses[q] == batch.responses[r]
                    && plain.prompts[q] == batch.prompts[r]
                    && cols
                        .iter()
                        .all(|&c| plain.column(c).unwrap()[q] == batch.column(c).unwrap()[r])
            })
            .unwrap_or_else(|| panic!("row {r} is no generated row with its columns"));
        drawn.insert(src);
    }
    assert!(drawn.len() >= 2, "a single row drawn {} times", batch.len());
    let resume: Vec<&str> = args
        .iter()
        .copied()
        .chain(["trainer.total_training_steps=4", "trainer.save_freq=2"])
        .collect();
    assert_resume_bit_exact(&fx, &resume);
}

#[test]
fn resume_is_bit_exact() {
    // PPO with a critic, shuffled mini-batches, sampling, KL loss and an adaptive KL in reward:
    // every piece of state a checkpoint must carry.
    let extra: &[&str] = &[
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.shuffle=True",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
    ];
    assert_resume_bit_exact(&fixture(), extra);
}

/// torchao's low-bit moments through the whole loop: a PPO run with its actor on `AdamW8bit`
/// and its critic on `AdamW4bit` (block 64), on a small model whose 64×64 matrices have 4096
/// values (torchao quantises from 4096 values up), stopped after step 2 and resumed, ends with
/// the uninterrupted run's weights, optimizer files and metrics; the checkpoints hold codes (not
/// f32 moments), in the format their optim.json names.
#[test]
fn low_bit_optimizers_resume_bit_exact() {
    let mut args = ModelArgs::tiny(Arch::Llama, 259);
    (args.hidden_size, args.intermediate_size, args.head_dim) = (64, 64, 16);
    let extra: &[&str] = &[
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.optim.optimizer_impl=torchao.optim",
        "actor_rollout_ref.actor.optim.optimizer=AdamW8bit",
        "critic.optim.optimizer_impl=torchao.optim",
        "critic.optim.optimizer=AdamW4bit",
        "+critic.optim.override_optimizer_config.block_size=64",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
    ];
    let fx = fixture_of(&args);
    let (_, root) = assert_resume_bit_exact(&fx, extra);
    let dir = crate::checkpoint::step_dir(&root, 4);
    for (role, format) in [("actor", "int8"), ("critic", "int4")] {
        let saved =
            candle_core::safetensors::load(dir.join(role).join("optim.safetensors"), &Device::Cpu)
                .unwrap();
        let codes = saved.keys().filter(|k| k.ends_with(".codes")).count();
        assert!(codes > 0, "{role}: no quantised moment saved");
        let meta = std::fs::read_to_string(dir.join(role).join("optim.json")).unwrap();
        assert!(meta.contains(&format!("\"{format}\"")), "{role}: {meta}");
    }
}

/// A Qwen3-MoE actor whose config asks for the router's load-balancing loss (GRPO, the
/// hand-written MoE layer, packed sequences), and a Qwen3.5-MoE one (DeltaNet and gated
/// attention as the composition, experts with a shared expert on every layer): stopped after
/// step 2 and resumed, each ends with the weights, optimizer state and metrics
/// (`actor/router_aux_loss` among them) of the uninterrupted run, and its saved config still
/// asks for the loss.
#[test]
fn a_moe_actor_with_the_router_loss_resumes_bit_exact() {
    for arch in [Arch::Qwen3Moe, Arch::Qwen3_5Moe] {
        let mut args = ModelArgs::tiny(arch, 259);
        args.moe.as_mut().unwrap().router_aux_loss_coef = Some(0.1);
        let fx = fixture_of(&args);
        let extra: &[&str] = &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.shuffle=True",
            "actor_rollout_ref.model.use_remove_padding=True",
            "trainer.total_training_steps=4",
            "trainer.save_freq=2",
        ];
        let (history, root) = assert_resume_bit_exact(&fx, extra);
        assert!(history
            .iter()
            .all(|(_, m)| m.get("actor/router_aux_loss").is_some_and(|v| *v > 0.0)));
        let saved = crate::checkpoint::step_dir(&root, 4).join("actor/huggingface/config.json");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(saved).unwrap()).unwrap();
        assert_eq!(
            cfg["output_router_logits"],
            serde_json::json!(true),
            "{arch:?}"
        );
        assert_eq!(
            cfg["router_aux_loss_coef"],
            serde_json::json!(0.1),
            "{arch:?}"
        );
    }
}

/// A Qwen3.5 actor (Gated DeltaNet and gated-attention layers, a critic of the same family:
/// GAE, packed sequences, recomputation): stopped after step 2 and resumed, it ends with the
/// weights, optimizer state and metrics of the uninterrupted run, and its exported config reads
/// back as the same Qwen3.5 layout.
#[test]
fn a_qwen3_5_actor_and_critic_resume_bit_exact() {
    actor_and_critic_resume_bit_exact(Arch::Qwen3_5, "Qwen3_5ForCausalLM");
}

/// A DeepSeek-V3 actor (latent attention, group-limited sigmoid routing, shared experts) and a
/// critic of the same family (GAE, packed sequences, recomputation): stopped after step 2 and
/// resumed, it ends with the weights, optimizer state and metrics of the uninterrupted run; its
/// exported config reads back as the same layout, and the saved weights keep the score-correction
/// biases as the model read them (not trained).
#[test]
fn a_deepseek_v3_actor_and_critic_resume_bit_exact() {
    let (fx, exported) =
        actor_and_critic_resume_bit_exact(Arch::DeepseekV3, "DeepseekV3ForCausalLM");
    let bias = "model.layers.1.mlp.gate.e_score_correction_bias";
    let read = |dir: &std::path::Path| -> Vec<f32> {
        let t =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        t[bias].to_vec1().unwrap()
    };
    let (before, after) = (read(&fx.model), read(&exported));
    assert!(before.iter().any(|&x| x != 0.0));
    assert_eq!(before, after);
}

/// GLM-4.5 (DeepSeek's routing beside grouped-query attention), Gemma 2 (soft-capped scores
/// and logits) and GPT-OSS (sinks, sliding layers, biased clamped experts saved back fused)
/// through the whole loop.
#[test]
fn glm4_moe_gemma2_and_gpt_oss_actors_and_critics_resume_bit_exact() {
    actor_and_critic_resume_bit_exact(Arch::Glm4Moe, "Glm4MoeForCausalLM");
    actor_and_critic_resume_bit_exact(Arch::Gemma2, "Gemma2ForCausalLM");
    let (_fx, exported) = actor_and_critic_resume_bit_exact(Arch::GptOss, "GptOssForCausalLM");
    let t =
        candle_core::safetensors::load(exported.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(t.contains_key("model.layers.0.mlp.experts.gate_up_proj"));
    assert!(t.contains_key("model.layers.1.self_attn.sinks"));
}

/// An actor and a critic of the tiny `arch` (GAE, shuffled mini-batches, packed sequences,
/// recomputation) stopped after step 2 and resumed end as the uninterrupted run, with finite
/// policy losses; the step-4 actor's exported config names `hf_arch` and reads back as the same
/// arguments. Returns the fixture and the exported actor folder.
fn actor_and_critic_resume_bit_exact(arch: Arch, hf_arch: &str) -> (Fixture, PathBuf) {
    let args = ModelArgs::tiny(arch, 259);
    let fx = fixture_of(&args);
    let extra: &[&str] = &[
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.shuffle=True",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
    ];
    let (history, root) = assert_resume_bit_exact(&fx, extra);
    assert!(history
        .iter()
        .all(|(_, m)| m.get("actor/pg_loss").is_some_and(|v| v.is_finite())));
    let exported = crate::checkpoint::step_dir(&root, 4).join("actor/huggingface");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exported.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["architectures"], serde_json::json!([hf_arch]));
    assert_eq!(ModelArgs::from_hf(&cfg).unwrap(), args);
    (fx, exported)
}

/// A model whose `vocab_size` is below its tokenizer's ids (the byte tokenizer's 259 on a
/// 200-row model) is refused when the trainer loads it, naming the model, the tokenizer and
/// both sizes, instead of at the first such token of a rollout.
#[test]
fn a_tokenizer_past_the_models_vocabulary_is_refused_at_load() {
    let fx = fixture_of(&ModelArgs::tiny(Arch::Llama, 200));
    let opts = TrainerOptions {
        natives: natives(),
        tracker: Some(Tracker::with_sinks(Vec::new())),
        ..TrainerOptions::default()
    };
    let e = match Trainer::new(config(&fx, &[]), opts) {
        Ok(_) => panic!("a tokenizer past the vocabulary was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("258") && e.contains("vocab_size is 200") && e.contains("tokenizer"),
        "{e}"
    );
}

/// Runs `extra` on `fx` for 4 steps straight, and again stopped after step 2 then resumed in a
/// new trainer: the actor's (and critic's) weights, the optimizer files of the step-4
/// checkpoint, every step's deterministic metrics and the KL controller are the same. Returns
/// the straight run's metrics and checkpoint folder.
fn assert_resume_bit_exact(fx: &Fixture, extra: &[&str]) -> (Vec<(u64, Metrics)>, PathBuf) {
    let critic = |t: &Trainer| t.critic.as_ref().map(|c| weights(&c.trainable.varmap));
    // Straight: 4 steps.
    let mut a = trainer(fx, extra, None);
    a.fit().unwrap();
    let root = a.plan.default_local_dir.clone();
    let straight_dir = crate::checkpoint::step_dir(&root, 4);
    let straight = (
        weights(&a.actor.trainable.varmap),
        critic(&a),
        optimizer_files(&straight_dir),
        a.history
            .iter()
            .map(|(s, m)| (*s, deterministic(m)))
            .collect::<Vec<_>>(),
        a.kl_ctrl,
    );
    let full_history: Vec<(u64, Metrics)> = a.history.iter().cloned().collect();
    drop(a);

    // Interrupted after step 2 (a fresh checkpoint folder), then resumed for steps 3 and 4.
    let fx2 = fixture_like(fx);
    let (history, c) = stopped_at_2_then_resumed(&fx2, |fx, stop, tracker| {
        Trainer::new(
            config(fx, extra),
            TrainerOptions {
                natives: natives(),
                stop,
                tracker: Some(tracker),
                ..TrainerOptions::default()
            },
        )
        .unwrap()
    });
    let resumed_dir = crate::checkpoint::step_dir(&c.plan.default_local_dir, 4);
    let resumed = (
        weights(&c.actor.trainable.varmap),
        critic(&c),
        optimizer_files(&resumed_dir),
        history
            .iter()
            .map(|(s, m)| (*s, deterministic(m)))
            .collect::<Vec<_>>(),
        c.kl_ctrl,
    );
    assert!(straight.0 == resumed.0, "actor weights differ after resume");
    assert!(
        straight.1 == resumed.1,
        "critic weights differ after resume"
    );
    assert!(
        straight.2 == resumed.2,
        "optimizer state differs after resume"
    );
    assert_eq!(straight.3.len(), 4);
    for (x, y) in straight.3.iter().zip(&resumed.3) {
        assert_eq!(x, y, "metrics of step {} differ", x.0);
    }
    assert_eq!(straight.4, resumed.4, "KL controller");
    (full_history, root)
}

/// A 4-step run on `fx` stopped after step 2 (a metric sink raises the stop flag), then resumed
/// from its checkpoint in a new trainer; both made by `make(fixture, stop flag, tracker)`.
/// Returns the two parts' metrics in order and the resumed trainer, finished.
fn stopped_at_2_then_resumed(
    fx: &Fixture,
    make: impl Fn(&Fixture, Arc<AtomicBool>, Tracker) -> Trainer,
) -> (VecDeque<(u64, Metrics)>, Trainer) {
    let stop = Arc::new(AtomicBool::new(false));
    let sink: Box<dyn MetricSink + Send> = Box::new(StopAt(2, stop.clone()));
    let mut b = make(fx, stop, Tracker::with_sinks(vec![("stop".into(), sink)]));
    let out = b.fit().unwrap();
    assert!(
        matches!(out, FitOutcome::Interrupted { step: 2, .. }),
        "{out:?}"
    );
    let mut history = b.history.clone();
    drop(b);
    let mut c = make(fx, Default::default(), Tracker::with_sinks(Vec::new()));
    assert_eq!(c.global_step, 2, "resumed from step 2");
    assert_eq!(c.fit().unwrap(), FitOutcome::Finished { steps: 4 });
    history.extend(c.history.iter().cloned());
    (history, c)
}

/// A stop requested during step 2's rollout (the phase that runs the tool calls; a fault hook
/// raises the flag as the rollout starts) abandons step 2: step 1 is saved and the loader is
/// back after step 1's batch; the resumed run then equals an uninterrupted one. Before, the
/// step ran to its end (update, validation, save) and the run stopped after step 2.
#[test]
fn a_stop_during_a_rollout_abandons_the_step_and_the_resumed_run_is_unchanged() {
    let fx = fixture();
    let extra: &[&str] = &["algorithm.adv_estimator=grpo"];
    let mut a = trainer(&fx, extra, None);
    a.fit().unwrap();
    let straight_weights = weights(&a.actor.trainable.varmap);
    let straight: Vec<_> = a
        .history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    drop(a);
    let fx2 = fixture_like(&fx);
    let mut b = trainer(&fx2, extra, None);
    let after_one = {
        let mut l = b.loader.clone();
        l.next_batch();
        l.cursor()
    };
    let stop = b.stop.clone();
    let out = crate::util::with_fault_hook(
        move |name, step| {
            if name == "rollout" && step == 2 {
                stop.store(true, Ordering::SeqCst);
            }
        },
        || b.fit().unwrap(),
    );
    let root = b.plan.default_local_dir.clone();
    assert_eq!(
        out,
        FitOutcome::Interrupted {
            step: 1,
            checkpoint: Some(crate::checkpoint::step_dir(&root, 1))
        }
    );
    assert_eq!(b.loader.cursor(), after_one);
    let mut history = b.history.clone();
    drop(b);
    let mut c = trainer(&fx2, extra, None);
    assert_eq!(c.global_step, 1);
    c.fit().unwrap();
    history.extend(c.history.iter().cloned());
    let resumed: Vec<_> = history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert_eq!(straight, resumed);
    assert!(straight_weights == weights(&c.actor.trainable.varmap));
}

/// A stop requested during a validation (raised as its second batch starts) ends it there:
/// the step's checkpoint is saved, the run stops after that step, and the step reports no
/// validation metrics. Before, the whole validation ran first.
#[test]
fn a_stop_during_validation_ends_it_and_saves_the_step() {
    let fx = fixture();
    let mut t = trainer(&fx, &["trainer.test_freq=1", "data.val_batch_size=2"], None);
    let stop = t.stop.clone();
    let batches = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = batches.clone();
    let out = crate::util::with_fault_hook(
        move |name, step| {
            if name == "validation" && step == 1 && seen.fetch_add(1, Ordering::SeqCst) == 1 {
                stop.store(true, Ordering::SeqCst);
            }
        },
        || t.fit().unwrap(),
    );
    let root = t.plan.default_local_dir.clone();
    assert_eq!(
        out,
        FitOutcome::Interrupted {
            step: 1,
            checkpoint: Some(crate::checkpoint::step_dir(&root, 1))
        }
    );
    assert_eq!(
        batches.load(Ordering::SeqCst),
        2,
        "validation stopped after its second batch"
    );
    let (_, m) = t.history.back().unwrap();
    assert!(!m.keys().any(|k| k.starts_with("val-")), "{m:?}");
    assert!(crate::checkpoint::step_dir(&root, 1).is_dir());
}

/// The same model and data as `fx` in a new folder (its own checkpoints).
fn fixture_like(fx: &Fixture) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for e in std::fs::read_dir(&fx.model).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), model.join(e.file_name())).unwrap();
    }
    let data = dir.path().join("train.jsonl");
    std::fs::copy(&fx.data, &data).unwrap();
    Fixture { dir, model, data }
}

#[test]
fn checkpoint_exports_an_actor_that_loads_with_identical_outputs() {
    let fx = fixture();
    let mut t = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=grpo",
            "trainer.save_freq=3",
            "trainer.max_actor_ckpt_to_keep=1",
        ],
        None,
    );
    t.fit().unwrap();
    let root = t.plan.default_local_dir.clone();
    assert_eq!(
        std::fs::read_to_string(root.join(crate::checkpoint::TRACKER)).unwrap(),
        "3"
    );
    let hf_dir = crate::checkpoint::step_dir(&root, 3).join("actor/huggingface");
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(hf_dir.join(f).is_file(), "{f} missing");
    }
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(crate::checkpoint::step_dir(&root, 3).join("trainer_state.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(state["global_step"], 3);
    let (loaded, tok) = crate::weights::load_model_and_tokenizer(
        &hf_dir.display().to_string(),
        None,
        &Map::new(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap();
    assert_eq!(tok.eos_token_ids, t.tokenizer.eos_token_ids);
    assert!(tok.chat_template.is_some());
    let ids = Tensor::new(&[[1u32, 5, 9, 200, 17]], &Device::Cpu).unwrap();
    let pos = Tensor::new(&[[0u32, 1, 2, 3, 4]], &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, 5), DType::U32, &Device::Cpu).unwrap();
    let logits = |m: &crate::model::CausalLm| -> Vec<f32> {
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        m.logits(&h)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    assert_eq!(
        logits(&loaded.model),
        logits(&t.actor.trainable.model),
        "bit-identical after export"
    );
}

#[test]
fn it_learns_a_native_reward() {
    // Reward: the share of `a` in the response. GRPO with a high learning rate; the mean
    // reward must climb from its initial level (about 1/259) to at least 0.6.
    let fx = fixture();
    let mut t = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
            "actor_rollout_ref.actor.optim.lr=3e-2",
            "trainer.total_training_steps=40",
        ],
        None,
    );
    let mut scores = Vec::new();
    while t.global_step < t.total_steps {
        let m = t.step().unwrap();
        scores.push(m["critic/score/mean"]);
        if scores.len() >= 3 && scores[scores.len() - 3..].iter().all(|&s| s >= 0.6) {
            break;
        }
    }
    eprintln!("scores: {scores:?}");
    let first = scores[0];
    let last = *scores.last().unwrap();
    assert!(first < 0.2, "initial score {first}");
    assert!(
        last >= 0.6,
        "mean reward after {} steps is {last}: {scores:?}",
        scores.len()
    );
}

#[test]
fn validation_metrics_and_sample_dumps() {
    let fx = fixture();
    let dumps = fx.dir.path().join("dumps");
    let vdumps = fx.dir.path().join("vdumps");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    struct Capture(Arc<Mutex<Vec<String>>>);
    impl MetricSink for Capture {
        fn log(&mut self, m: &Metrics, step: u64) -> std::io::Result<()> {
            self.0
                .lock()
                .unwrap()
                .push(crate::metrics::sinks::console_line(m, step));
            Ok(())
        }
    }
    let sink: Box<dyn MetricSink + Send> = Box::new(Capture(lines.clone()));
    let mut t = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=grpo",
            "trainer.val_before_train=True",
            "trainer.test_freq=2",
            "actor_rollout_ref.rollout.val_kwargs.n=2",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "data.val_max_samples=4",
            &format!("trainer.rollout_data_dir={}", dumps.display()),
            &format!("trainer.validation_data_dir={}", vdumps.display()),
        ],
        Some(Tracker::with_sinks(vec![("capture".into(), sink)])),
    );
    t.fit().unwrap();
    // Validation at step 0 (before training), 2 (test_freq) and 3 (the last step).
    let val_steps: Vec<u64> = t
        .history
        .iter()
        .filter(|(_, m)| m.contains_key("val-core/openai/gsm8k/acc/mean@2"))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(val_steps, vec![0, 2, 3]);
    let m = &t.history[0].1;
    for k in [
        "val-core/openai/gsm8k/acc/best@2/mean",
        "val-aux/openai/gsm8k/acc/worst@2/mean",
        "val-aux/openai/gsm8k/reward/mean@2",
    ] {
        assert!(
            m.contains_key(k),
            "{k} in {:?}",
            m.keys().collect::<Vec<_>>()
        );
    }
    assert!(m["val-core/openai/gsm8k/acc/best@2/mean"] >= m["val-core/openai/gsm8k/acc/mean@2"]);
    // One rollout dump per step with every response; one validation dump per validation.
    for s in 1..=3 {
        let text = std::fs::read_to_string(dumps.join(format!("{s}.jsonl"))).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 8, "4 prompts x n=2");
        for r in &rows {
            for k in ["input", "output", "gts", "score", "advantage", "reward/a"] {
                assert!(r.get(k).is_some(), "{k} in {r}");
            }
            // verl decodes prompts with skip_special_tokens=True: the ChatML markers
            // (<|im_start|>, <|im_end|>) and left padding (<|endoftext|>) are not in `input`.
            let input = r["input"].as_str().unwrap();
            assert!(
                input.contains("assistant") && !input.contains("<|"),
                "{input}"
            );
        }
    }
    let v0 = std::fs::read_to_string(vdumps.join("0.jsonl")).unwrap();
    assert_eq!(v0.lines().count(), 8, "4 validation prompts x 2");
    for l in v0.lines() {
        let r: serde_json::Value = serde_json::from_str(l).unwrap();
        let input = r["input"].as_str().unwrap();
        assert!(
            input.contains("assistant") && !input.contains("<|"),
            "{input}"
        );
    }
    let lines = lines.lock().unwrap();
    assert!(lines[0].starts_with("step:0 - val-"), "{}", lines[0]);
    assert!(lines.iter().any(|l| l.starts_with("step:1 - actor/")));
}

/// verl's on-policy shortcut (`dp_actor.update_policy`, default workers): with one mini-batch
/// and one epoch the old log-prob is the current one, detached, whatever the `old_log_probs`
/// column holds, so `ppo_kl` and the clip fractions are exactly 0; with `calculate_entropy` the
/// update reports `actor/entropy` as the mean over its micro-batches of each micro-batch's
/// token-mean entropy (computed here by hand from the old-log-prob pass's `entropys`, the same
/// weights).
#[test]
fn on_policy_update_ignores_old_log_probs_and_reports_its_entropy() {
    let fx = fixture();
    let mut t = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.calculate_entropy=True",
        ],
        None,
    );
    let (prompts, _) = t.next_prompts().unwrap();
    let mut batch = t.generate(&prompts).unwrap();
    let seqlens: Vec<usize> = (0..batch.len()).map(|r| batch.seq_len(r)).collect();
    batch.update_order = Some(crate::trainer::micro::balanced_order(&seqlens));
    t.compute_rewards(&mut batch).unwrap();
    t.actor.compute_log_prob(&mut batch).unwrap();
    t.compute_advantages(&mut batch, 1).unwrap();
    // Old log-probs far from the policy: a real ratio would clip and show a KL.
    let off: batch::Ragged = batch
        .column(batch::Column::OldLogProbs)
        .unwrap()
        .iter()
        .map(|r| r.iter().map(|x| x - 1.0).collect())
        .collect();
    batch.set(batch::Column::OldLogProbs, off).unwrap();
    let order = batch.update_order.clone().unwrap();
    let ent = batch.column(batch::Column::Entropys).unwrap();
    let micro_means: Vec<f64> = order
        .chunks(2)
        .map(|rows| {
            let vals: Vec<f64> = rows
                .iter()
                .flat_map(|&r| ent[r].iter().map(|&x| f64::from(x)))
                .collect();
            vals.iter().sum::<f64>() / vals.len() as f64
        })
        .collect();
    let want = micro_means.iter().sum::<f64>() / micro_means.len() as f64;
    let m = t.actor.update(&batch, 1).unwrap();
    assert_eq!(m["actor/ppo_kl"], 0.0);
    assert_eq!(m["actor/pg_clipfrac"], 0.0);
    assert_eq!(m["actor/pg_clipfrac_lower"], 0.0);
    assert!(
        (m["actor/entropy"] - want).abs() < 1e-5,
        "{} vs {want}",
        m["actor/entropy"]
    );
    assert_eq!(m["actor/kl_loss"], 0.0);
}

/// The on-policy update's forward stands in for the `old_log_prob` pass: on two copies of the
/// same step, (a) the pass then the update, (b) the update filling the columns give the same
/// old log-probs and entropies (≤ 1e-5: the training forward and the no-grad view round
/// differently at most), the same update metrics and the same weights; `step()` then skips
/// the pass (no `timing_s/old_log_prob`) but still logs `actor/entropy`. With two
/// mini-batches, with KL in the reward or with a second epoch the pass runs.
#[test]
fn on_policy_update_fills_the_old_log_probs_it_replaces() {
    let fx = fixture();
    let args = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ];
    let mut a = trainer(&fx, &args, None);
    let mut b = trainer(&fx, &args, None);
    let (prompts, _) = a.next_prompts().unwrap();
    let mut ba = a.generate(&prompts).unwrap();
    assert!(a.actor.update_replaces_old_log_prob(ba.len()));
    a.compute_rewards(&mut ba).unwrap();
    let mut bb = ba.clone();
    a.actor.compute_log_prob(&mut ba).unwrap();
    a.compute_advantages(&mut ba, 1).unwrap();
    b.compute_advantages(&mut bb, 1).unwrap();
    let ma = a.actor.update(&ba, 1).unwrap();
    let mb = b.actor.update_filling_old_log_prob(&mut bb, 1).unwrap();
    for c in [batch::Column::OldLogProbs, batch::Column::Entropys] {
        let (x, y) = (ba.column(c).unwrap(), bb.column(c).unwrap());
        assert_eq!(x.len(), y.len());
        for (rx, ry) in x.iter().zip(y) {
            assert_eq!(rx.len(), ry.len(), "{c:?}");
            for (p, q) in rx.iter().zip(ry) {
                assert!((p - q).abs() <= 1e-5, "{c:?}: {p} vs {q}");
            }
        }
    }
    assert_eq!(ma.keys().collect::<Vec<_>>(), mb.keys().collect::<Vec<_>>());
    for (k, v) in &ma {
        assert!(
            (v - mb[k]).abs() <= 1e-5 * v.abs().max(1.0),
            "{k}: {v} vs {}",
            mb[k]
        );
    }
    let w = |t: &Trainer| -> Vec<f32> {
        let mut all = Vec::new();
        for (_, v) in t.actor.trainable.optimizer.vars() {
            all.extend(
                v.as_tensor()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
        }
        all
    };
    let (wa, wb) = (w(&a), w(&b));
    assert!(wa.iter().zip(&wb).all(|(p, q)| (p - q).abs() <= 1e-6));

    // Whole steps: skipped on-policy, kept otherwise.
    let step_keys = |extra: &[&str]| {
        let mut args = vec![
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=1",
        ];
        args.extend_from_slice(extra);
        let mut t = trainer(&fx, &args, None);
        let m = t.step().unwrap();
        assert!(m.contains_key("actor/entropy"), "{extra:?}");
        m.contains_key("timing_s/old_log_prob")
    };
    assert!(!step_keys(&[
        "actor_rollout_ref.actor.ppo_mini_batch_size=4"
    ]));
    assert!(step_keys(&[
        "actor_rollout_ref.actor.ppo_mini_batch_size=2"
    ]));
    assert!(step_keys(&[
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_epochs=2"
    ]));
    assert!(step_keys(&[
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "algorithm.use_kl_in_reward=True",
    ]));
}

/// verl's default workers never pass `loss_scale_factor` to `agg_loss`: on the default path a
/// seq-mean-token-sum-norm update is the same with and without it (the divisor is the response
/// length, 6, either way); with `use_legacy_worker_impl=disable` the gradient shrinks by 6/1000
/// when it is 1000. One mini-batch, so every number comes from the initial weights.
#[test]
fn loss_scale_factor_is_read_only_by_the_global_path() {
    let fx = fixture();
    let run = |extra: &[&str]| {
        // gae: whitened advantages are never all zero.
        let mut args = vec![
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=1",
        ];
        args.extend_from_slice(extra);
        let mut t = trainer(&fx, &args, None);
        let m = t.step().unwrap();
        (m["actor/pg_loss"], m["actor/grad_norm"])
    };
    let scale = "actor_rollout_ref.actor.loss_scale_factor=1000";
    let disable = "trainer.use_legacy_worker_impl=disable";
    assert_eq!(run(&[]), run(&[scale]));
    let (loss, norm) = run(&[disable]);
    let (scaled_loss, scaled_norm) = run(&[disable, scale]);
    assert!(norm > 1e-3, "{norm}");
    // (The loss itself is ~0 here: on-policy, whitened advantages sum to about nothing.)
    assert!(
        (scaled_loss - loss * 0.006).abs() <= 1e-6,
        "{scaled_loss} vs {loss}"
    );
    assert!(
        (scaled_norm - norm * 0.006).abs() <= 1e-5 * norm * 0.006,
        "{scaled_norm} vs {norm}"
    );
}

/// seq-mean-token-sum-norm as each verl's workers aggregate it, against seq-mean-token-sum on
/// the same step (one mini-batch, so both gradients come from the initial weights):
/// - `use_legacy_worker_impl=disable` (verl 1dda039's engine workers): the mean over the
///   mini-batch's sequences divided by the response length 6, so the gradient is 1/6 of
///   seq-mean-token-sum's;
/// - the default path (b178a3c's dp_actor and agg_loss): each micro-batch's rows summed, not
///   averaged, then divided by 6: micro-batches of 2 rows give 2/6 of seq-mean-token-sum's.
#[test]
fn seq_mean_token_sum_norm_follows_the_workers_verl() {
    let fx = fixture();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.total_training_steps=1",
        ];
        args.extend_from_slice(extra);
        let mut t = trainer(&fx, &args, None);
        t.step().unwrap()["actor/grad_norm"]
    };
    let norm = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm";
    let sum = "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum";
    let disable = "trainer.use_legacy_worker_impl=disable";
    for (extra, ratio) in [(vec![], 2.0 / 6.0), (vec![disable], 1.0 / 6.0)] {
        let with = |mode: &'static str| {
            let mut a = extra.clone();
            a.push(mode);
            run(&a)
        };
        let (n, s) = (with(norm), with(sum));
        assert!(s > 1e-3, "{s}");
        assert!(
            (n - s * ratio).abs() <= 1e-5 * s * ratio,
            "{extra:?}: {n} vs {s} x {ratio}"
        );
    }
}

/// gdpo through the whole step, with the components a reward function returns as extra values
/// (`even`: 1 for an even response length, also the score; `share`: the share of `a`s).
/// Independent check: one component equal to the score, without std division, is
/// whiten(score − group mean) — exactly reinforce_plus_plus_baseline — so both runs give the
/// same advantages and update. With two components the update differs, verl's gdpo/<key>/*
/// metrics appear, and a key the reward does not return is an error naming it.
#[test]
fn gdpo_trains_on_the_reward_components() {
    let fx = fixture();
    let base = [
        "reward.sources=[{name: p, type: native, function: parts}]",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1",
    ];
    let run = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        trainer(&fx, &args, None).step()
    };
    let rpp = run(&["algorithm.adv_estimator=reinforce_plus_plus_baseline"]).unwrap();
    let one = run(&[
        "algorithm.adv_estimator=gdpo",
        "algorithm.norm_adv_by_std_in_grpo=False",
        "algorithm.gdpo_reward_keys=[even]",
    ])
    .unwrap();
    for k in [
        "critic/advantages/mean",
        "critic/advantages/max",
        "actor/grad_norm",
    ] {
        assert!(rpp[k].abs() > 0.0 || k.ends_with("mean"), "{k}: {}", rpp[k]);
        assert!(
            (rpp[k] - one[k]).abs() <= 1e-6 * (1.0 + rpp[k].abs()),
            "{k}: {} vs {}",
            rpp[k],
            one[k]
        );
    }
    let two = run(&[
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[even, share]",
        "algorithm.gdpo_reward_weights=[1.0, 0.5]",
    ])
    .unwrap();
    assert!((0.0..=1.0).contains(&two["gdpo/share/mean"]), "{two:?}");
    assert!((two["gdpo/even/mean"] - two["critic/score/mean"]).abs() < 1e-6);
    assert!(two["actor/grad_norm"] != one["actor/grad_norm"]);
    let e = run(&[
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[even, format]",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("`format`") && e.contains("gdpo_reward_keys"),
        "{e}"
    );
}

/// `algorithm.adv_estimator=optimal_token_baseline` / `tir_optimal_token_baseline` with
/// `actor.calculate_sum_pi_squared=True`: the old-log-prob pass fills `sum_pi_squared` (each
/// value in [π², 1] for the sampled token's π) and runs although the update is on-policy (one
/// mini-batch: the pass would otherwise be skipped); two steps train (every actor parameter
/// moves, finite metrics, verl's variance_proxy/* logged). Without the key the trainer is
/// refused before anything runs, naming both keys.
#[test]
fn optimal_token_baseline_trains_on_sum_pi_squared() {
    let fx = fixture();
    for est in ["optimal_token_baseline", "tir_optimal_token_baseline"] {
        let a = format!("algorithm.adv_estimator={est}");
        let args = [
            a.as_str(),
            "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=2",
        ];
        let mut t = trainer(&fx, &args, None);
        let (prompts, _) = t.next_prompts().unwrap();
        let mut batch = t.generate(&prompts).unwrap();
        t.compute_rewards(&mut batch).unwrap();
        t.actor.compute_log_prob(&mut batch).unwrap();
        let (old, sq) = (
            batch.column(batch::Column::OldLogProbs).unwrap(),
            batch.column(batch::Column::SumPiSquared).unwrap(),
        );
        for (lp, s) in old.iter().flatten().zip(sq.iter().flatten()) {
            let pi = lp.exp();
            assert!(
                *s >= pi * pi * (1.0 - 1e-5) && *s <= 1.0 + 1e-6,
                "{est}: Σπ² {s}, π {pi}"
            );
        }
        t.compute_advantages(&mut batch, 1).unwrap();
        let before = weights(&t.actor.trainable.varmap);
        assert_eq!(t.fit().unwrap(), FitOutcome::Finished { steps: 2 }, "{est}");
        let m = &t.history[1].1;
        assert_finite(
            m,
            &[
                "critic/advantages/mean",
                "critic/returns/mean",
                "actor/pg_loss",
                "actor/grad_norm",
                "timing_s/old_log_prob",
                "variance_proxy/proxy1_signal_strength",
                "variance_proxy/proxy2_total_power",
                "variance_proxy/proxy3_pure_noise",
                "variance_proxy/expected_a_squared",
                "variance_proxy/expected_w",
            ],
            est,
        );
        assert_eq!(
            m["variance_proxy/proxy1_signal_strength"],
            m["actor/grad_norm"].powi(2)
        );
        let after = weights(&t.actor.trainable.varmap);
        let moved = before
            .iter()
            .zip(&after)
            .filter(|(x, y)| x.1 != y.1)
            .count();
        assert_eq!(moved, before.len(), "{est}: every actor parameter moves");
    }
    let cfg = config(&fx, &["algorithm.adv_estimator=optimal_token_baseline"]);
    let options = TrainerOptions {
        natives: natives(),
        ..Default::default()
    };
    let e = Trainer::new(cfg, options).err().unwrap().to_string();
    assert!(
        e.contains("algorithm.adv_estimator=optimal_token_baseline")
            && e.contains("actor_rollout_ref.actor.calculate_sum_pi_squared=True"),
        "{e}"
    );
}

/// verl's `gdpo` reward manager is naive plus `extra_info["experiment_name"]`: a scorer that
/// checks for it scores 1 under gdpo and 0 under naive, in training and validation alike.
#[test]
fn the_gdpo_reward_manager_names_the_experiment() {
    let fx = fixture();
    for (manager, want) in [("gdpo", 1.0), ("naive", 0.0)] {
        let mut t = trainer(
            &fx,
            &[
                "reward.sources=[{name: x, type: native, function: in_experiment_x}]",
                &format!("reward.reward_manager.name={manager}"),
                "trainer.experiment_name=x",
                "trainer.total_training_steps=1",
                "trainer.test_freq=1",
            ],
            None,
        );
        let m = t.step().unwrap();
        assert_eq!(m["critic/score/mean"], want, "{manager}");
        let val = m
            .iter()
            .find(|(k, _)| k.starts_with("val-aux/") && k.contains("/reward/mean"))
            .map(|(k, v)| (k.clone(), *v));
        let (k, v) = val.unwrap_or_else(|| panic!("{manager}: no validation reward in {m:?}"));
        assert_eq!(v, want, "{manager}: {k}");
    }
}

/// verl's `fit`: validation, then the checkpoint, both after the `step` timer stopped, so
/// `timing_s/step` (and perf/*) leave them out: the step's wall time holds all three.
#[test]
fn validation_runs_before_the_checkpoint_and_outside_the_step_timer() {
    let fx = fixture();
    let vdumps = fx.dir.path().join("vdumps");
    let mut t = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=grpo",
            "trainer.test_freq=1",
            "trainer.save_freq=1",
            &format!("trainer.validation_data_dir={}", vdumps.display()),
        ],
        None,
    );
    let started = std::time::Instant::now();
    let m = t.step().unwrap();
    let wall = started.elapsed().as_secs_f64();
    let (step, testing, save) = (
        m["timing_s/step"],
        m["timing_s/testing"],
        m["timing_s/save_checkpoint"],
    );
    assert!(testing > 0.0 && save > 0.0, "{testing} {save}");
    assert!(
        step + testing + save <= wall + 1e-6,
        "step {step} + testing {testing} + save {save} > wall {wall}"
    );
    assert!((m["perf/time_per_step"] - step).abs() < 1e-12);
    // The validation dump is written before the checkpoint's tracker file.
    let modified = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
    let tracker = fx
        .dir
        .path()
        .join("ckpt")
        .join("latest_checkpointed_iteration.txt");
    assert!(modified(&vdumps.join("1.jsonl")) <= modified(&tracker));
}

#[test]
fn a_broken_setup_is_reported_before_training() {
    let fx = fixture();
    // More prompts per step than the data holds.
    let cfg = config(
        &fx,
        &[
            "data.train_batch_size=32",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        ],
    );
    let err = Trainer::new(
        cfg,
        TrainerOptions {
            natives: natives(),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert!(
        err.to_string()
            .contains("fewer than data.train_batch_size (32)"),
        "{err}"
    );
    // A checkpoint tracker that names a step with no folder.
    let root = fx.dir.path().join("ckpt");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join(crate::checkpoint::TRACKER), "5").unwrap();
    let err = Trainer::new(
        config(&fx, &["algorithm.adv_estimator=grpo"]),
        TrainerOptions {
            natives: natives(),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("resume_mode=disable"), "{err}");
    // verl's default dispatch with a data source it has no scorer for: the file and row are
    // named before any rollout.
    let bad = fx.dir.path().join("unknown_source.jsonl");
    let mut rows: Vec<_> = (0..8).map(|i| verl_row(&format!("q{i}"), "1")).collect();
    rows[5]["data_source"] = "my_dataset".into();
    write_jsonl(&bad, &rows).unwrap();
    let file = format!("data.train_files={}", bad.display());
    let err = Trainer::new(
        config(
            &fx,
            &[
                &file,
                "reward.sources=null",
                "trainer.total_training_steps=1",
            ],
        ),
        TrainerOptions {
            natives: natives(),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    let msg = err.to_string();
    assert!(
        msg.contains("unknown_source.jsonl, row 5") && msg.contains("`my_dataset`"),
        "{msg}"
    );
}

#[test]
fn a_skip_update_gate_zeroes_loss_mask_and_advantage_of_gated_samples() {
    let fx = fixture();
    let dumps = fx.dir.path().join("dumps");
    let mut t = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=grpo",
            "reward.sources=[{name: a, type: native, function: share_of_a}, {name: even, weight: 0.0, type: native, function: even_length, gate: {below: 0.5, action: skip_update}}]",
            &format!("trainer.rollout_data_dir={}", dumps.display()),
            "trainer.total_training_steps=2",
        ],
        None,
    );
    t.fit().unwrap();
    let mut gated_total = 0usize;
    for step in 1..=2u64 {
        let text = std::fs::read_to_string(dumps.join(format!("{step}.jsonl"))).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let mut gated = 0;
        for r in &rows {
            let odd = r["reward/even"].as_f64().unwrap() < 0.5;
            assert_eq!(r["excluded"].as_bool().unwrap(), odd, "{r}");
            if odd {
                gated += 1;
                assert_eq!(r["gated"], serde_json::json!(["even"]));
                assert_eq!(r["advantage"].as_f64().unwrap_or(0.0), 0.0, "{r}");
            }
        }
        let m = &t.history[(step - 1) as usize].1;
        assert_eq!(m["reward/gated/even"], gated as f64);
        assert_eq!(
            m["reward/skipped"], gated as f64,
            "gated samples are left out"
        );
        gated_total += gated;
    }
    assert!(gated_total > 0, "some responses have an odd length");

    // zero_reward / penalty: gated samples stay in the update with their total replaced/shifted.
    for (action, want) in [
        ("zero_reward", None),
        ("penalty, penalty: -3.0", Some(-3.0)),
    ] {
        let dumps = fx.dir.path().join(format!("dumps-{}", &action[..4]));
        let mut t = trainer(
            &fx,
            &[
                "algorithm.adv_estimator=grpo",
                &format!("reward.sources=[{{name: a, type: native, function: share_of_a}}, {{name: even, weight: 0.0, type: native, function: even_length, gate: {{below: 0.5, action: {action}}}}}]"),
                &format!("trainer.rollout_data_dir={}", dumps.display()),
                "trainer.total_training_steps=1",
                // A fresh run in its own folder (disable refuses to replace checkpoints).
                "trainer.resume_mode=disable",
                &format!(
                    "trainer.default_local_dir={}",
                    fx.dir.path().join(format!("ckpt-{}", &action[..4])).display()
                ),
            ],
            None,
        );
        t.fit().unwrap();
        let text = std::fs::read_to_string(dumps.join("1.jsonl")).unwrap();
        for l in text.lines() {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            let a = r["reward/a"].as_f64().unwrap();
            let odd = r["reward/even"].as_f64().unwrap() < 0.5;
            let expected = match (odd, want) {
                (false, _) => a,
                (true, None) => 0.0,
                (true, Some(p)) => a + p,
            };
            assert!(
                (r["score"].as_f64().unwrap() - expected).abs() < 1e-9,
                "{action}: {r}"
            );
            assert_eq!(r["excluded"], false, "{action}: {r}");
        }
    }
}

#[test]
fn control_api_changes_weights_between_steps_and_they_survive_resume() {
    let fx = fixture();
    let dump_arg = format!(
        "trainer.rollout_data_dir={}",
        fx.dir.path().join("ctl-dumps").display()
    );
    let extra: &[&str] = &[
        "algorithm.adv_estimator=grpo",
        "reward.sources=[{name: a, type: native, function: share_of_a}, {name: one, weight: 1.0, type: native, function: one}]",
        "reward.control.enable=True",
        "reward.control.port=0",
        "reward.control.token=tok",
        "trainer.total_training_steps=3",
        &dump_arg,
    ];
    let mut t = trainer(&fx, extra, None);
    let addr = t.control.as_ref().unwrap().addr;
    let m1 = t.step().unwrap();
    t.log(m1.clone(), 1);
    let http = crate::control::tests::http;
    let (st, body) = http(addr, "GET", "/api/v1/status", Some("tok"), b"");
    assert_eq!(st, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["step"], 1);
    assert_eq!(status["metrics"]["reward/weight/one"], 1.0);
    let (st, _) = http(
        addr,
        "POST",
        "/api/v1/reward/weights",
        None,
        br#"{"one": 0}"#,
    );
    assert_eq!(st, 401, "the token is required");
    let (st, body) = http(
        addr,
        "POST",
        "/api/v1/reward/weights",
        Some("tok"),
        br#"{"one": 0.25}"#,
    );
    assert_eq!(st, 200, "{body}");
    let m2 = t.step().unwrap();
    assert_eq!(m1["reward/weight/one"], 1.0);
    assert_eq!(m2["reward/weight/one"], 0.25);
    // The total is a + 0.25 · 1 for every response of step 2 (from its rollout dump; the
    // step's `critic/score/mean` would miss responses of length 0, which carry no token).
    let text = std::fs::read_to_string(fx.dir.path().join("ctl-dumps/2.jsonl")).unwrap();
    for l in text.lines() {
        let r: serde_json::Value = serde_json::from_str(l).unwrap();
        let want = r["reward/a"].as_f64().unwrap() + 0.25 * r["reward/one"].as_f64().unwrap();
        assert!((r["score"].as_f64().unwrap() - want).abs() < 1e-12, "{r}");
    }
    t.save_checkpoint().unwrap();
    drop(t);
    let r = trainer(&fx, extra, None);
    assert_eq!(r.global_step, 2);
    assert_eq!(r.reward.weights()["one"], 0.25, "weights survive resume");
    let (_, body) = http(
        r.control.as_ref().unwrap().addr,
        "GET",
        "/api/v1/reward/weights",
        Some("tok"),
        b"",
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["one"],
        0.25
    );
}

#[path = "tests_golden.rs"]
mod golden;

#[path = "tests_lora.rs"]
mod lora;

#[path = "tests_dapo.rs"]
mod dapo;

#[path = "tests_rollout_corr.rs"]
mod rollout_corr;

#[path = "tests_distill.rs"]
mod distill;

/// verl's mixed-precision keys reach every model of the run: actor (training and old
/// log-probs), rollout, reference and critic each take their own key, and a 3-step gae run with
/// all of them in bf16 trains (finite losses, weights move). Without the keys nothing is bf16.
#[test]
fn mixed_precision_keys_reach_actor_rollout_reference_and_critic() {
    let fx = fixture();
    let bf16_here = crate::kernels::bf16::available();
    let plain = trainer(
        &fx,
        &[
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=True",
        ],
        None,
    );
    assert!(!plain.actor.view().bf16_matmuls());
    assert!(!plain.actor.rollout_view().bf16_matmuls());
    let bf = [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16",
        "critic.model.fsdp_config.mixed_precision.param_dtype=bf16",
    ];
    let mut t = trainer(&fx, &bf, None);
    assert_eq!(t.actor.view().bf16_matmuls(), bf16_here);
    assert_eq!(t.actor.rollout_view().bf16_matmuls(), bf16_here);
    assert_eq!(
        t.reference.as_ref().unwrap().model.bf16_matmuls(),
        bf16_here
    );
    let critic = t.critic.as_ref().unwrap();
    assert_eq!(critic.trainable.view().backbone.bf16_matmuls(), bf16_here);
    // The rollout's key alone: the actor trains in f32.
    let r = trainer(&fx, &[bf[0], bf[1], bf[3]], None);
    assert!(!r.actor.view().bf16_matmuls());
    assert_eq!(r.actor.rollout_view().bf16_matmuls(), bf16_here);
    let before = weights(&t.actor.trainable.varmap);
    assert_eq!(t.fit().unwrap(), FitOutcome::Finished { steps: 3 });
    let m = &t.history[2].1;
    assert_finite(
        m,
        &["actor/pg_loss", "actor/grad_norm", "critic/vf_loss"],
        "bf16",
    );
    assert_ne!(
        before,
        weights(&t.actor.trainable.varmap),
        "bf16 training moved no weight"
    );
}

/// Three steps of GRPO and of PPO with a critic (gae) with every model on CUDA (cargo feature
/// `cuda`, a GPU present; `scripts/gpu/run.sh`) against the same runs on the CPU: in f32 every
/// step's losses, scores, lengths, entropies and gradient norms equal the CPU's within 1e-3
/// (relative to the metric's scale: both devices sample with the same uniforms, so the tokens
/// agree unless a uniform falls within rounding of a boundary); with bf16 products (verl's
/// mixed precision) the run trains and its first step's metrics agree within bf16 tolerance
/// (3e-2), before the sampled tokens part ways. The weights and the AdamW moments stay on the
/// GPU, the device memory metrics are reported, and the checkpoint of step 3 is written.
#[cfg(feature = "cuda")]
#[test]
fn three_step_runs_on_cuda_equal_the_cpu() {
    if let Err(e) = candle_core::Device::new_cuda(0) {
        eprintln!("skipped: no CUDA device ({e})");
        return;
    }
    const KEYS: &[&str] = &[
        "critic/score/mean",
        "response_length/mean",
        "actor/pg_loss",
        "actor/entropy",
        "actor/grad_norm",
        "actor/ppo_kl",
    ];
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * a.abs().max(b.abs()).max(1.0);
    for est in ["grpo", "gae"] {
        let est_arg = format!("algorithm.adv_estimator={est}");
        for bf16 in [false, true] {
            let mut runs: Vec<Vec<Metrics>> = Vec::new();
            for device in ["cpu", "cuda"] {
                let fx = fixture();
                let dev_arg = format!("trainer.device={device}");
                let mut args = vec![
                    est_arg.as_str(),
                    dev_arg.as_str(),
                    "trainer.total_training_steps=3",
                    "trainer.save_freq=3",
                ];
                if bf16 && device == "cuda" {
                    args.extend([
                        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                        "actor_rollout_ref.rollout.dtype=bfloat16",
                        "critic.model.fsdp_config.mixed_precision.param_dtype=bf16",
                    ]);
                }
                let mut t = trainer(&fx, &args, None);
                let on_gpu = t
                    .actor
                    .trainable
                    .optimizer
                    .vars()
                    .iter()
                    .all(|(_, v)| v.as_tensor().device().is_cuda());
                assert_eq!(on_gpu, device == "cuda", "{est} {device}: actor weights");
                let mut steps = Vec::new();
                for step in 1..=3 {
                    let m = t
                        .step()
                        .unwrap_or_else(|e| panic!("{est} {device} step {step}: {e}"));
                    for k in KEYS {
                        assert!(
                            m[*k].is_finite(),
                            "{est} {device} step {step}: {k} = {}",
                            m[*k]
                        );
                    }
                    if device == "cuda" {
                        let peak = m["perf/max_memory_allocated_gb"];
                        assert!(
                            peak > 0.0 && peak <= m["perf/max_memory_reserved_gb"],
                            "{peak}"
                        );
                    }
                    steps.push(m);
                }
                let dir = t.save_checkpoint().unwrap();
                assert!(dir.join("actor").is_dir(), "{est}: {}", dir.display());
                runs.push(steps);
            }
            let (cpu, gpu) = (&runs[0], &runs[1]);
            let (steps, tol) = if bf16 { (1, 3e-2) } else { (3, 1e-3) };
            for s in 0..steps {
                for k in KEYS {
                    let (a, b) = (cpu[s][*k], gpu[s][*k]);
                    assert!(
                        close(a, b, tol),
                        "{est} bf16={bf16} step {}: {k}: CPU {a}, CUDA {b}",
                        s + 1
                    );
                }
                if est == "gae" {
                    let (a, b) = (cpu[s]["critic/vf_loss"], gpu[s]["critic/vf_loss"]);
                    assert!(
                        close(a, b, tol),
                        "{est} bf16={bf16}: vf_loss CPU {a}, CUDA {b}"
                    );
                }
            }
        }
    }
}

/// `critic.value_head_init=zero`: a new value head predicts 0 everywhere, so the first step's
/// values are all 0 and GAE's advantages are the whitened returns; the default (normal) head
/// does not (transformers' N(0, 0.02²) init of `score`).
#[test]
fn a_zero_value_head_starts_every_value_at_zero() {
    let fx = fixture();
    let run = |init: &str| {
        let key = format!("critic.value_head_init={init}");
        let mut t = trainer(
            &fx,
            &[
                "algorithm.adv_estimator=gae",
                &key,
                "trainer.total_training_steps=1",
            ],
            None,
        );
        t.step().unwrap()
    };
    let m = run("zero");
    for k in [
        "critic/values/mean",
        "critic/values/max",
        "critic/values/min",
    ] {
        assert_eq!(m[k], 0.0, "{k}");
    }
    let m = run("normal");
    assert!(m["critic/values/max"] > m["critic/values/min"]);
}

/// A Qwen3-MoE actor whose config sets `output_router_logits` adds `router_aux_loss_coef` times
/// the router's load-balancing loss to its loss: `actor/router_aux_loss` is the mean over the
/// update's micro-batches of the model's loss on each (computed here from the same micro-batches
/// before the update), `actor/loss` is `actor/pg_loss` plus the coefficient times it, and the
/// term reaches the gradients (the weights after the update differ from those of the same run
/// without it, whose policy loss is the same).
#[test]
fn a_moe_actor_adds_the_router_loss_its_config_asks_for() {
    let coef = 0.5;
    let mut args = ModelArgs::tiny(Arch::Qwen3Moe, 259);
    args.moe.as_mut().unwrap().router_aux_loss_coef = Some(coef);
    let with = fixture_of(&args);
    args.moe.as_mut().unwrap().router_aux_loss_coef = None;
    let without = fixture_of(&args);
    let extra = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    ];
    let mut a = trainer(&with, &extra, None);
    let mut b = trainer(&without, &extra, None);
    assert_eq!(a.actor.trainable.model.router_aux_coef(), Some(coef));
    assert_eq!(b.actor.trainable.model.router_aux_coef(), None);
    assert_eq!(
        weights(&a.actor.trainable.varmap),
        weights(&b.actor.trainable.varmap)
    );
    let (prompts, _) = a.next_prompts().unwrap();
    let mut batch = a.generate(&prompts).unwrap();
    a.compute_rewards(&mut batch).unwrap();
    a.actor.compute_log_prob(&mut batch).unwrap();
    a.compute_advantages(&mut batch, 1).unwrap();
    // The model's router loss on each micro-batch the update will form (one mini-batch, in
    // order), from the same forward the update runs.
    let tr = &a.actor.trainable;
    let s = &tr.settings;
    assert!(!s.plan.shuffle);
    let order: Vec<usize> = (0..batch.len()).collect();
    let micros = batch.micro_batches(&order, s.plan.micro);
    assert!(micros.len() > 1, "{micros:?}");
    let mut auxes = Vec::new();
    for micro in &micros {
        let mi = batch
            .inputs(micro, s.layout(&tr.model), &Device::Cpu)
            .unwrap();
        mi.response_hidden(&tr.model).unwrap();
        let aux = tr
            .model
            .take_router_aux_loss()
            .unwrap()
            .expect("a router loss");
        auxes.push(f64::from(aux.to_scalar::<f32>().unwrap()));
    }
    let want = auxes.iter().sum::<f64>() / auxes.len() as f64;
    let ma = a.actor.update(&batch, 1).unwrap();
    let mb = b.actor.update(&batch, 1).unwrap();
    let got = ma["actor/router_aux_loss"];
    assert!(
        want > 0.0 && (got - want).abs() <= 1e-5 * want,
        "{got} vs {want}"
    );
    let term = ma["actor/loss"] - ma["actor/pg_loss"];
    assert!(
        (term - coef * got).abs() <= 1e-5,
        "{term} vs {coef} × {got}"
    );
    assert!(!mb.contains_key("actor/router_aux_loss"));
    assert!((ma["actor/pg_loss"] - mb["actor/pg_loss"]).abs() <= 1e-6);
    assert_ne!(
        weights(&a.actor.trainable.varmap),
        weights(&b.actor.trainable.varmap),
        "the router loss did not reach the gradients"
    );
}

#[path = "tests_masks.rs"]
mod masks;

#[path = "tests_optim_lowbit.rs"]
mod optim_lowbit;

#[path = "tests_bf16_params.rs"]
mod bf16_params;
