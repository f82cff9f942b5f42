//! DAPO's dynamic sampling end to end: every step trains on `train_batch_size` groups whose
//! rewards differ, the counts add up, a resumed run equals an uninterrupted one, and the two
//! ways a step can fail to fill (the batch limit, the data running out) are reported.

use super::*;
use crate::data::BatchLoader;

/// Rows with an even ground truth score 1 whatever the response (their groups never vary);
/// the others score 1 for a response of even length (their groups usually do).
fn dapo_natives() -> NativeRegistry {
    let mut n = natives();
    n.register(
        "odd_rows_vary",
        |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            let gt: usize = inp.ground_truth.as_str().unwrap().parse().unwrap();
            let even_len = inp.solution_str.chars().count().is_multiple_of(2);
            let score = if gt.is_multiple_of(2) || even_len {
                1.0
            } else {
                0.0
            };
            Ok(ScoreResult {
                score,
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n
}

const DAPO: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "algorithm.filter_groups.enable=True",
    "algorithm.filter_groups.metric=acc",
    "data.gen_batch_size=4",
    "reward.sources=[{name: r, type: native, function: odd_rows_vary}]",
];

fn dapo_trainer(
    fx: &Fixture,
    extra: &[&str],
    stop: Arc<AtomicBool>,
    tracker: Tracker,
) -> Result<Trainer> {
    let o: Vec<&str> = DAPO.iter().chain(extra).copied().collect();
    Trainer::new(
        config(fx, &o),
        TrainerOptions {
            natives: dapo_natives(),
            stop,
            tracker: Some(tracker),
            ..TrainerOptions::default()
        },
    )
}

fn quiet() -> Tracker {
    Tracker::with_sinks(Vec::new())
}

#[test]
fn every_step_trains_on_train_batch_size_groups_whose_rewards_differ() {
    let fx = fixture();
    let dumps = fx.dir.path().join("rollouts");
    let dump_key = format!("trainer.rollout_data_dir={}", dumps.display());
    let mut t = dapo_trainer(&fx, &[&dump_key], Default::default(), quiet()).unwrap();
    assert_eq!(t.fit().unwrap(), FitOutcome::Finished { steps: 3 });
    // The loader's order, replayed: which prompts each generation batch drew.
    let mut loader = BatchLoader::new(16, 4, true, t.plan.seeds.data);
    for (step, m) in &t.history {
        let batches = m["train/num_gen_batches"] as usize;
        let evicted = m["training/filter_groups/evicted_samples"] as usize;
        let surplus = m["training/filter_groups/discarded_surplus_samples"] as usize;
        // Every drawn group is trained on, dropped for no spread, or surplus.
        assert_eq!(batches * 4, 4 + evicted + surplus, "step {step}");
        let drawn: Vec<usize> = (0..batches)
            .flat_map(|_| loader.next_batch().unwrap())
            .collect();
        let even = drawn.iter().filter(|&&i| i % 2 == 0).count();
        assert!(
            evicted >= even,
            "step {step}: {even} even prompts, {evicted} dropped"
        );
        // The dump holds the step's rows: 4 groups of 4, distinct odd prompts, rewards differing
        // in each group; uids unique although the batches' prompts are numbered from 0 each.
        let text = std::fs::read_to_string(dumps.join(format!("{step}.jsonl"))).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 16, "step {step}");
        let mut groups: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
        for r in &rows {
            let gt: usize = r["gts"].as_str().unwrap().parse().unwrap();
            assert!(
                gt % 2 == 1 && drawn.contains(&gt),
                "step {step}: prompt {gt}"
            );
            groups
                .entry(r["uid"].as_u64().unwrap())
                .or_default()
                .push(r["score"].as_f64().unwrap());
        }
        assert_eq!(groups.len(), 4, "step {step}: {groups:?}");
        for (uid, s) in &groups {
            assert_eq!(s.len(), 4);
            assert!(
                s.iter().any(|&x| x != s[0]),
                "step {step}: group {uid} = {s:?}"
            );
        }
        // GRPO advantages of a group with spread are not all 0.
        assert!(rows.iter().any(|r| r["advantage"].as_f64().unwrap() != 0.0));
    }
    assert!(
        t.history
            .iter()
            .any(|(_, m)| m["train/num_gen_batches"] > 1.0),
        "half the prompts never vary: some step must draw a second batch"
    );
}

#[test]
fn a_dynamic_sampling_run_resumes_bit_exact() {
    let extra: &[&str] = &["trainer.total_training_steps=4", "trainer.save_freq=2"];
    let fx = fixture();
    let mut a = dapo_trainer(&fx, extra, Default::default(), quiet()).unwrap();
    a.fit().unwrap();
    let straight: Vec<_> = a
        .history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    let straight_weights = weights(&a.actor.trainable.varmap);
    drop(a);

    let fx2 = fixture_like(&fx);
    let (history, c) = stopped_at_2_then_resumed(&fx2, |fx, stop, tracker| {
        dapo_trainer(fx, extra, stop, tracker).unwrap()
    });
    let resumed: Vec<_> = history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert_eq!(straight, resumed);
    assert!(
        straight_weights == weights(&c.actor.trainable.varmap),
        "actor weights differ"
    );
}

#[test]
fn a_step_that_cannot_fill_names_both_keys_or_ends_the_run_when_the_data_runs_out() {
    let fx = fixture();
    // Every response scores 1: no group ever varies.
    let constant = "reward.sources=[{name: r, type: native, function: one}]";
    let mut t = dapo_trainer(
        &fx,
        &[constant, "algorithm.filter_groups.max_num_gen_batches=3"],
        Default::default(),
        quiet(),
    )
    .unwrap();
    let e = t.step().unwrap_err().to_string();
    for part in [
        "max_num_gen_batches = 3",
        "data.train_batch_size (4)",
        "kept 0 groups",
        "`acc`",
    ] {
        assert!(e.contains(part), "{part}: {e}");
    }
    // Without a limit the data of total_epochs runs out (16 prompts: 4 batches an epoch); the
    // run ends after the steps it finished and says so.
    let mut t = dapo_trainer(
        &fx,
        &[
            constant,
            "trainer.total_epochs=2",
            "trainer.total_training_steps=null",
        ],
        Default::default(),
        quiet(),
    )
    .unwrap();
    assert_eq!(t.total_steps, 8);
    assert_eq!(t.fit().unwrap(), FitOutcome::DataExhausted { steps: 0 });
    assert_eq!(
        t.loader.cursor().epoch,
        0,
        "the loader is put back where the step found it"
    );
    assert_eq!(t.loader.cursor().batches_served, 0);
}

#[test]
fn a_metric_the_reward_does_not_report_names_the_row_and_the_keys() {
    let fx = fixture();
    let mut t = dapo_trainer(
        &fx,
        &[
            "algorithm.filter_groups.metric=share",
            "reward.sources=[{name: r, type: native, function: even_length}]",
        ],
        Default::default(),
        quiet(),
    )
    .unwrap();
    let e = t.step().unwrap_err().to_string();
    assert!(
        e.contains("`share`") && e.contains("training row") && e.contains("[acc]"),
        "{e}"
    );
    // A key the reward function returns works, as do seq_reward, reward (verl 0.9) and a bool.
    for metric in ["share", "even", "seq_reward", "reward", "score"] {
        let key = format!("algorithm.filter_groups.metric={metric}");
        let parts = "reward.sources=[{name: r, type: native, function: parts}]";
        let mut t = dapo_trainer(&fx, &[&key, parts], Default::default(), quiet()).unwrap();
        let m = t.step().unwrap_or_else(|e| panic!("{metric}: {e}"));
        assert!(m["train/num_gen_batches"] >= 1.0, "{metric}");
    }
}

/// A checkpoint's loader position counts batches of its size: resuming it with another
/// `data.gen_batch_size` is refused, naming the key and the saved size.
#[test]
fn resuming_with_another_generation_batch_size_is_refused() {
    let fx = fixture();
    let extra: &[&str] = &["trainer.total_training_steps=1", "trainer.save_freq=1"];
    let mut t = dapo_trainer(&fx, extra, Default::default(), quiet()).unwrap();
    t.fit().unwrap();
    drop(t);
    let other: Vec<&str> = extra
        .iter()
        .copied()
        .chain(["data.gen_batch_size=8"])
        .collect();
    let e = match dapo_trainer(&fx, &other, Default::default(), quiet()) {
        Ok(_) => panic!("resumed with another batch size"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("data.gen_batch_size") && e.contains("back to 4"),
        "{e}"
    );
    // The same size resumes.
    let t = dapo_trainer(&fx, extra, Default::default(), quiet()).unwrap();
    assert_eq!(t.global_step, 1);
}

/// A checkpoint whose loader position lies past the end of an epoch (an edited or damaged
/// `trainer_state.json`) is refused naming the file and the field; it used to be accepted.
#[test]
fn an_impossible_loader_position_is_refused() {
    let fx = fixture();
    let extra: &[&str] = &["trainer.total_training_steps=1", "trainer.save_freq=1"];
    let mut t = dapo_trainer(&fx, extra, Default::default(), quiet()).unwrap();
    t.fit().unwrap();
    let state =
        crate::checkpoint::step_dir(&t.plan.default_local_dir, 1).join("trainer_state.json");
    drop(t);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    v["loader"]["batches_served"] = serde_json::json!(999);
    std::fs::write(&state, v.to_string()).unwrap();
    let e = match dapo_trainer(&fx, extra, Default::default(), quiet()) {
        Ok(_) => panic!("resumed from loader position 999"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("trainer_state.json") && e.contains("batches_served = 999"),
        "{e}"
    );
}

/// [`dapo_natives`] plus `stopper`: the reward of `odd_rows_vary` (or 1 for every response
/// with `constant`), which raises `stop` at its call number `at` and at every call once `arm`
/// is set (a Ctrl-C at a known moment inside a step's dynamic sampling).
fn stopping_natives(
    stop: Arc<AtomicBool>,
    arm: Arc<AtomicBool>,
    at: usize,
    constant: bool,
) -> NativeRegistry {
    let mut n = dapo_natives();
    let calls = std::sync::atomic::AtomicUsize::new(0);
    n.register(
        "stopper",
        move |inp: &ScoreInput, _: &Map<String, serde_json::Value>| {
            let k = calls.fetch_add(1, Ordering::SeqCst) + 1;
            if k == at || arm.load(Ordering::SeqCst) {
                stop.store(true, Ordering::SeqCst);
            }
            let gt: usize = inp.ground_truth.as_str().unwrap().parse().unwrap();
            let even_len = inp.solution_str.chars().count().is_multiple_of(2);
            let varies = !constant && !gt.is_multiple_of(2) && !even_len;
            Ok(ScoreResult {
                score: if varies { 0.0 } else { 1.0 },
                extra: Map::new(),
            })
        },
    )
    .unwrap();
    n
}

fn stopping_trainer(
    fx: &Fixture,
    extra: &[&str],
    natives: NativeRegistry,
    stop: Arc<AtomicBool>,
    tracker: Tracker,
) -> Trainer {
    let o: Vec<&str> = DAPO
        .iter()
        .chain(extra)
        .chain(&["reward.sources=[{name: r, type: native, function: stopper}]"])
        .copied()
        .collect();
    Trainer::new(
        config(fx, &o),
        TrainerOptions {
            natives,
            stop,
            tracker: Some(tracker),
            ..TrainerOptions::default()
        },
    )
    .unwrap()
}

/// A step that cannot fill (no group ever varies, `max_num_gen_batches` 0 = no limit) keeps
/// drawing generation batches; a stop requested during its third batch ends the run after
/// that batch (it used to draw on until the data of every epoch ran out), with the loader put
/// back where the step found it.
#[test]
fn a_stop_during_dynamic_sampling_that_cannot_fill_ends_the_step_at_once() {
    let fx = fixture();
    let stop = Arc::new(AtomicBool::new(false));
    // 4 prompts of 4 responses a batch: call 40 falls in the third batch.
    let natives = stopping_natives(stop.clone(), Default::default(), 40, true);
    let mut t = stopping_trainer(
        &fx,
        &[
            "algorithm.filter_groups.max_num_gen_batches=0",
            "trainer.total_epochs=5",
            "trainer.total_training_steps=2",
        ],
        natives,
        stop,
        quiet(),
    );
    assert_eq!(
        t.fit().unwrap(),
        FitOutcome::Interrupted {
            step: 0,
            checkpoint: None
        }
    );
    assert_eq!(t.loader.cursor().epoch, 0);
    assert_eq!(t.loader.cursor().batches_served, 0);
}

/// A stop requested inside step 3's dynamic sampling abandons step 3 (step 2's checkpoint
/// stands); the same run resumed then equals an uninterrupted one, metrics and weights.
#[test]
fn a_run_stopped_inside_dynamic_sampling_resumes_bit_exact() {
    let extra: &[&str] = &["trainer.total_training_steps=4", "trainer.save_freq=2"];
    let fx = fixture();
    let quiet_natives = || stopping_natives(Default::default(), Default::default(), 0, false);
    let mut a = stopping_trainer(&fx, extra, quiet_natives(), Default::default(), quiet());
    assert_eq!(a.fit().unwrap(), FitOutcome::Finished { steps: 4 });
    let straight: Vec<_> = a
        .history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert!(
        straight[2].1["train/num_gen_batches"] > 1.0,
        "step 3 draws more than one batch"
    );
    let straight_weights = weights(&a.actor.trainable.varmap);
    drop(a);

    let fx2 = fixture_like(&fx);
    let (stop, arm) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let natives = stopping_natives(stop.clone(), arm.clone(), 0, false);
    let sink: Box<dyn MetricSink + Send> = Box::new(StopAt(2, arm));
    let mut b = stopping_trainer(
        &fx2,
        extra,
        natives,
        stop,
        Tracker::with_sinks(vec![("arm".into(), sink)]),
    );
    let out = b.fit().unwrap();
    assert!(
        matches!(out, FitOutcome::Interrupted { step: 2, .. }),
        "{out:?}"
    );
    let mut history = b.history.clone();
    drop(b);
    let mut c = stopping_trainer(&fx2, extra, quiet_natives(), Default::default(), quiet());
    assert_eq!(c.global_step, 2, "resumed from step 2");
    assert_eq!(c.fit().unwrap(), FitOutcome::Finished { steps: 4 });
    history.extend(c.history.iter().cloned());
    let resumed: Vec<_> = history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert_eq!(straight, resumed);
    assert!(
        straight_weights == weights(&c.actor.trainable.varmap),
        "actor weights differ"
    );
}
