//! On-policy distillation end to end on the tiny model: a teacher equal to the student gives a
//! zero loss, a different teacher's k3 loss falls as the student learns it, a teacher whose
//! tokenizer differs is refused before its weights are read, and rows reach the teacher of
//! their `teacher_key`.

use super::*;

const DISTILL: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "distillation.enabled=True",
];

/// A teacher the student can learn in a few steps: the fixture's model after `steps` GRPO
/// steps on the share of `a`s at a high learning rate, saved in `dir`.
fn trained_teacher(fx: &Fixture, dir: &std::path::Path, steps: u64) -> PathBuf {
    let total = format!("trainer.total_training_steps={steps}");
    let mut t = trainer(
        fx,
        &[
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.optim.lr=3e-2",
            &total,
        ],
        None,
    );
    t.fit().unwrap();
    let tr = &t.actor.trainable;
    crate::weights::hf::save_dir(&tr.varmap, &tr.args, dir, &[258], Some(&fx.model), None).unwrap();
    dir.to_path_buf()
}

/// A second tiny model with the fixture's tokenizer and other weights (a larger init scale:
/// a sharper distribution than the student's), saved in `dir`.
fn other_teacher(dir: &std::path::Path) -> PathBuf {
    let args = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _) = tiny_model(&args, DType::F32, 0.4);
    write_tokenizer_dir(dir).unwrap();
    crate::weights::hf::save_dir(&vm, &args, dir, &[258], Some(dir), None).unwrap();
    dir.to_path_buf()
}

fn with_teacher(fx: &Fixture, teacher: &std::path::Path, extra: &[&str]) -> Trainer {
    let t = format!(
        "distillation.teacher_models.teacher_model.model_path={}",
        teacher.display()
    );
    let o: Vec<&str> = DISTILL
        .iter()
        .copied()
        .chain([t.as_str()])
        .chain(extra.iter().copied())
        .collect();
    trainer(fx, &o, None)
}

/// The student as its own teacher: on the first step (one mini-batch: the update's forward
/// sees the weights the teacher has) every estimator's loss is 0 within 1e-6; the metrics are
/// verl's names and `perf/teacher_memory_gb` is the teacher's weights.
#[test]
fn a_teacher_equal_to_the_student_gives_zero_loss() {
    let fx = fixture();
    for mode in ["k3", "low_var_kl", "mse", "abs"] {
        let key = format!("distillation.distillation_loss.loss_mode={mode}");
        let mut t = with_teacher(&fx, &fx.model, &[&key, "trainer.total_training_steps=1"]);
        let m = t.step().unwrap();
        for k in [
            "distillation/loss",
            "distillation/abs_loss",
            "distillation/loss_min",
            "distillation/loss_max",
        ] {
            assert!(m[k].abs() < 1e-6, "{mode}: {k} = {}", m[k]);
        }
        assert!(m.contains_key("timing_s/teacher") && m.contains_key("actor/pg_loss"));
        let bytes: usize = t
            .actor
            .trainable
            .varmap
            .all_vars()
            .iter()
            .map(|v| v.elem_count() * 4)
            .sum();
        let gb = bytes as f64 / (1u64 << 30) as f64;
        assert!(
            (m["perf/teacher_memory_gb"] - gb).abs() < 1e-12,
            "{} vs {gb}",
            m["perf/teacher_memory_gb"]
        );
    }
}

/// Distillation alone (`use_task_rewards=False`) from a teacher trained from the student (4
/// GRPO steps): the k3 loss falls over 5 steps (0.247 → 0.023 when written), and the actor
/// reports no policy loss (verl computes none then). With the policy-gradient form the
/// distillation's clip metrics appear.
#[test]
fn the_k3_loss_falls_as_the_student_learns_the_teacher() {
    let fx = fixture();
    let teacher = trained_teacher(&fx, &fx.dir.path().join("teacher"), 4);
    let mut t = with_teacher(
        &fx,
        &teacher,
        &[
            "distillation.distillation_loss.use_task_rewards=False",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.total_training_steps=5",
        ],
    );
    t.fit().unwrap();
    let losses: Vec<f64> = t
        .history
        .iter()
        .map(|(_, m)| m["distillation/loss"])
        .collect();
    println!("k3 loss over 5 steps: {losses:?}");
    assert!(losses[4] < 0.5 * losses[0], "the loss falls: {losses:?}");
    assert!(!t.history[0].1.contains_key("actor/pg_loss"));

    let mut t = with_teacher(
        &fx,
        &teacher,
        &[
            "distillation.distillation_loss.use_policy_gradient=True",
            "distillation.distillation_loss.loss_mode=k1",
            "trainer.total_training_steps=1",
        ],
    );
    let m = t.step().unwrap();
    for k in [
        "distillation/pg_clipfrac",
        "distillation/ppo_kl",
        "distillation/loss",
        "actor/pg_loss",
    ] {
        assert!(m.contains_key(k), "{k}: {:?}", m.keys());
    }
}

/// A teacher whose tokenizer maps tokens to other ids is refused naming the key and the
/// difference, before its weights are read (its model.safetensors here is not one).
#[test]
fn a_teacher_with_another_tokenizer_is_refused_before_its_weights() {
    let fx = fixture();
    let teacher = fx.dir.path().join("teacher");
    write_tokenizer_dir(&teacher).unwrap();
    let path = teacher.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
    vocab.insert("a".into(), b);
    vocab.insert("b".into(), a);
    std::fs::write(&path, tok.to_string()).unwrap();
    // The student's configuration (the pre-flight reads it first), weights that are not any.
    std::fs::copy(fx.model.join("config.json"), teacher.join("config.json")).unwrap();
    std::fs::write(teacher.join("model.safetensors"), "not weights").unwrap();
    let key = format!(
        "distillation.teacher_models.teacher_model.model_path={}",
        teacher.display()
    );
    let o: Vec<&str> = DISTILL.iter().copied().chain([key.as_str()]).collect();
    let opts = TrainerOptions {
        natives: natives(),
        ..TrainerOptions::default()
    };
    let e = Trainer::new(config(&fx, &o), opts)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        e.contains("distillation.teacher_models.teacher_model.model_path")
            && e.contains("differs from the student's in 2 tokens")
            && e.contains("same tokenizer"),
        "{e}"
    );
}

/// Two teachers routed by `data_source`: rows of `openai/gsm8k` go to the student's twin (their
/// teacher log-probs are the old ones), the others to the other teacher; a row whose source no
/// teacher serves is an error naming the file, row and value.
#[test]
fn rows_reach_the_teacher_of_their_key() {
    let fx = fixture();
    let other = other_teacher(&fx.dir.path().join("teacher"));
    // Half the rows from another source.
    let rows: Vec<_> = (0..16)
        .map(|i| {
            let mut r = verl_row(&format!("q{i}"), &i.to_string());
            if i % 2 == 1 {
                r["data_source"] = "other".into();
            }
            r
        })
        .collect();
    write_jsonl(&fx.data, &rows).unwrap();
    let twin = format!(
        "+distillation.teacher_models.twin.model_path={}",
        fx.model.display()
    );
    let far = format!(
        "+distillation.teacher_models.far.model_path={}",
        other.display()
    );
    let o: Vec<&str> = DISTILL
        .iter()
        .copied()
        .chain([
            twin.as_str(),
            "+distillation.teacher_models.twin.key=openai/gsm8k",
            far.as_str(),
            "+distillation.teacher_models.far.key=other",
            "trainer.total_training_steps=1",
            "data.shuffle=False",
        ])
        .collect();
    let mut t = trainer(&fx, &o, None);
    let (prompts, _) = t.next_prompts().unwrap();
    let mut timings = Timings::default();
    let mut batch = t.rollout_and_reward(&prompts, &mut timings).unwrap();
    t.actor.compute_log_prob(&mut batch).unwrap();
    t.teachers
        .as_ref()
        .unwrap()
        .compute(&mut batch, &t.train)
        .unwrap();
    let old = batch.column(batch::Column::OldLogProbs).unwrap();
    let teacher = batch.column(batch::Column::TeacherLogProbs).unwrap();
    let (mut same, mut differ) = (0, 0);
    for r in 0..batch.len() {
        let source = &t.train.samples[batch.sample[r]].data_source;
        let diff = old[r]
            .iter()
            .zip(&teacher[r])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        if source == "openai/gsm8k" {
            assert!(diff < 1e-5, "row {r}: {diff}");
            same += 1;
        } else {
            assert!(diff > 1e-3, "row {r}: {diff}");
            differ += 1;
        }
    }
    assert!(same > 0 && differ > 0, "{same} {differ}");

    // A source no teacher serves.
    let rows: Vec<_> = (0..16)
        .map(|i| {
            let mut r = verl_row(&format!("q{i}"), &i.to_string());
            r["data_source"] = "elsewhere".into();
            r
        })
        .collect();
    write_jsonl(&fx.data, &rows).unwrap();
    let mut t = trainer(&fx, &o, None);
    let e = t.step().expect_err("no teacher").to_string();
    assert!(
        e.contains("distillation.teacher_key=data_source")
            && e.contains("\"elsewhere\"")
            && e.contains("openai/gsm8k")
            && e.contains("other"),
        "{e}"
    );
}

/// `forward_kl_topk` end to end: the student as its own teacher gives 0 (the top-k masses are
/// equal), packed and padded micro-batches give the same loss and metrics, and from a trained
/// teacher the loss falls over 5 steps.
#[test]
fn the_top_k_loss_is_zero_for_the_student_and_falls_for_a_teacher() {
    let fx = fixture();
    let topk = [
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.topk=8",
    ];
    let mut by_layout = Vec::new();
    for packed in ["True", "False"] {
        let key = format!("actor_rollout_ref.model.use_remove_padding={packed}");
        let o: Vec<&str> = topk
            .iter()
            .copied()
            .chain([key.as_str(), "trainer.total_training_steps=1"])
            .collect();
        let mut t = with_teacher(&fx, &fx.model, &o);
        let m = t.step().unwrap();
        assert!(
            m["distillation/loss"].abs() < 1e-6,
            "{}",
            m["distillation/loss"]
        );
        assert!((m["distillation/overlap_ratio"] - 1.0).abs() < 1e-6);
        assert!((m["distillation/student_mass"] - m["distillation/teacher_mass"]).abs() < 1e-5);
        by_layout.push(m);
    }
    for k in [
        "distillation/student_mass",
        "distillation/teacher_mass_min",
        "actor/pg_loss",
    ] {
        let (a, b) = (by_layout[0][k], by_layout[1][k]);
        assert!(
            (a - b).abs() < 1e-5 * (1.0 + a.abs()),
            "{k}: packed {a}, padded {b}"
        );
    }

    let teacher = trained_teacher(&fx, &fx.dir.path().join("teacher"), 4);
    let o: Vec<&str> = topk
        .iter()
        .copied()
        .chain([
            "distillation.distillation_loss.use_task_rewards=False",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "trainer.total_training_steps=5",
        ])
        .collect();
    let mut t = with_teacher(&fx, &teacher, &o);
    t.fit().unwrap();
    let losses: Vec<f64> = t
        .history
        .iter()
        .map(|(_, m)| m["distillation/loss"])
        .collect();
    println!("forward_kl_topk loss over 5 steps: {losses:?}");
    assert!(losses[4] < 0.5 * losses[0], "the loss falls: {losses:?}");
}

/// Distillation with DAPO's dynamic sampling (teachers score the kept groups only) and top-k
/// tokens, stopped after step 2 and resumed (the frozen teacher is loaded again; nothing of it is
/// saved): the resumed run's metrics and actor equal an uninterrupted run's.
#[test]
fn a_distillation_run_with_dynamic_sampling_resumes_bit_exact() {
    let fx = fixture();
    let teacher = trained_teacher(&fx, &fx.dir.path().join("teacher"), 2);
    let t = format!(
        "distillation.teacher_models.teacher_model.model_path={}",
        teacher.display()
    );
    let o: Vec<&str> = DISTILL
        .iter()
        .copied()
        .chain([
            t.as_str(),
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=4",
            "distillation.distillation_loss.distillation_loss_coef=0.5",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=score",
            "trainer.total_training_steps=4",
            "trainer.save_freq=2",
        ])
        .collect();
    let make = |fx: &Fixture, stop: Arc<AtomicBool>, tracker: Tracker| {
        Trainer::new(
            config(fx, &o),
            TrainerOptions {
                natives: natives(),
                stop,
                tracker: Some(tracker),
                ..TrainerOptions::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let quiet = || Tracker::with_sinks(Vec::new());
    let fx2 = fixture_like(&fx);
    let mut a = make(&fx, Default::default(), quiet());
    a.fit().unwrap();
    let straight: Vec<_> = a
        .history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert!(straight
        .iter()
        .all(|(_, m)| m.contains_key("distillation/overlap_ratio")));
    let straight_weights = weights(&a.actor.trainable.varmap);
    drop(a);

    let (history, c) = stopped_at_2_then_resumed(&fx2, make);
    let resumed: Vec<_> = history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert_eq!(straight, resumed);
    assert!(straight_weights == weights(&c.actor.trainable.varmap));
}

/// A stop requested while the teachers compute step 2's log-probs (a fault hook raises the
/// flag as the phase starts) abandons step 2 after that phase: step 1 is saved and the run
/// stops there. Before, step 2 ran to its end.
#[test]
fn a_stop_during_the_teacher_phase_abandons_the_step() {
    let fx = fixture();
    let teacher = other_teacher(&fx.dir.path().join("teacher"));
    let mut t = with_teacher(&fx, &teacher, &[]);
    let stop = t.stop.clone();
    let out = crate::util::with_fault_hook(
        move |name, step| {
            if name == "teacher" && step == 2 {
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
    assert_eq!(t.history.len(), 1);
}
