//! LoRA runs end to end: what trains, the reference by disabling adapters, PEFT-format
//! checkpoints, exact resume, and starting from a saved adapter.

use super::*;
use crate::trainer::trainable::{Network, Trainable};

const LORA: &[&str] = &[
    "algorithm.adv_estimator=gae",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "critic.model.lora_rank=2",
    "critic.model.target_modules=[q_proj,v_proj]",
];

fn adapters(t: &Trainable<impl Network>) -> Vec<(String, Vec<f32>)> {
    weights(&t.lora.as_ref().expect("LoRA run").adapters)
}

fn logits_of(m: &crate::model::CausalLm) -> Vec<f32> {
    let dev = Device::Cpu;
    let ids = Tensor::new(&[[72u32, 101, 108, 108, 111, 33]], &dev).unwrap();
    let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 5]], &dev).unwrap();
    let mask = Tensor::new(&[[1u32; 6]], &dev).unwrap();
    let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
    m.logits(&h)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Two PPO steps with LoRA on actor and critic: the base weights stay exactly as loaded, every
/// adapter matrix and the value head move, the optimizer holds only those; no reference model
/// is loaded and the reference (actor with adapters off) equals a separately loaded frozen copy.
#[test]
fn an_update_moves_only_adapters_and_the_reference_is_the_base() {
    let fx = fixture();
    let mut t = trainer(
        &fx,
        &[LORA, &["trainer.total_training_steps=2"]].concat(),
        None,
    );
    let base_actor = weights(&t.actor.trainable.varmap);
    let critic = t.critic.as_ref().unwrap();
    let base_critic = weights(&critic.trainable.varmap);
    let (a0, c0) = (adapters(&t.actor.trainable), adapters(&critic.trainable));
    assert_eq!(
        a0.len(),
        2 * 7 * 2,
        "all-linear: 7 projections x 2 layers, A and B"
    );
    assert_eq!(c0.len(), 2 * 2 * 2, "q_proj and v_proj only");
    let actor_vars: Vec<String> = t
        .actor
        .trainable
        .optimizer
        .vars()
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert!(
        actor_vars.iter().all(|n| n.contains(".lora_")),
        "{actor_vars:?}"
    );
    assert_eq!(actor_vars.len(), a0.len());
    let critic_vars: Vec<&String> = critic
        .trainable
        .optimizer
        .vars()
        .iter()
        .map(|(n, _)| n)
        .collect();
    assert!(critic_vars.iter().any(|n| *n == "score.weight"));
    assert_eq!(
        critic_vars.len(),
        c0.len() + 2,
        "adapters + score.weight/bias"
    );

    assert!(t.reference.is_some());
    assert_eq!(t.fit().unwrap(), FitOutcome::Finished { steps: 2 });
    assert_eq!(
        weights(&t.actor.trainable.varmap),
        base_actor,
        "actor base untouched"
    );
    let critic = t.critic.as_ref().unwrap();
    let after_critic = weights(&critic.trainable.varmap);
    for ((n, b), (_, a)) in base_critic.iter().zip(&after_critic) {
        assert_eq!(
            b != a,
            n.starts_with("score."),
            "{n}: only the value head moves"
        );
    }
    for (before, after) in [
        (a0, adapters(&t.actor.trainable)),
        (c0, adapters(&critic.trainable)),
    ] {
        for ((n, b), (_, a)) in before.iter().zip(&after) {
            assert_ne!(b, a, "{n} did not move");
        }
    }
    // Reference by disabling adapters = a frozen reference loaded from model.path.
    let (frozen, _) = setup::load_policy(&t.cfg, &Device::Cpu).unwrap();
    let r = t.reference.as_ref().unwrap();
    assert_eq!(logits_of(&r.model), logits_of(&frozen.model));
    assert_ne!(
        logits_of(t.actor.view()),
        logits_of(&frozen.model),
        "adapters trained"
    );
}

/// LoRA on a Qwen3.5 actor (a Gated DeltaNet layer, then a gated-attention layer): `all-linear`
/// adapts the DeltaNet's five projections under PEFT's names (`linear_attn.in_proj_qkv`, ...,
/// `out_proj`) beside attention and MLP; two steps move every adapter and leave the base
/// (the DeltaNet's convolution, decay and norm weights included) exactly as loaded.
#[test]
fn a_qwen3_5_actor_trains_lora_on_its_deltanet_projections() {
    let fx = fixture_of(&ModelArgs::tiny(Arch::Qwen3_5, 259));
    let extra = [LORA, &["trainer.total_training_steps=2"]].concat();
    let mut t = trainer(&fx, &extra, None);
    let base = weights(&t.actor.trainable.varmap);
    let a0 = adapters(&t.actor.trainable);
    // Layer 0: 5 DeltaNet + 3 MLP projections; layer 1: 4 attention + 3 MLP; A and B each.
    assert_eq!(
        a0.len(),
        2 * (8 + 7),
        "{:?}",
        a0.iter().map(|x| &x.0).collect::<Vec<_>>()
    );
    for p in [
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
    ] {
        let name = format!("layers.0.linear_attn.{p}.lora_A");
        assert!(a0.iter().any(|(n, _)| n.contains(&name)), "no {name}");
    }
    assert_eq!(t.fit().unwrap(), FitOutcome::Finished { steps: 2 });
    assert_eq!(weights(&t.actor.trainable.varmap), base, "base untouched");
    for ((n, b), (_, a)) in a0.iter().zip(&adapters(&t.actor.trainable)) {
        assert_ne!(b, a, "{n} did not move");
    }
}

/// A LoRA checkpoint is PEFT's adapter folder plus the adapters' optimizer state (no base
/// weights), and resuming from it continues bit for bit.
#[test]
fn lora_checkpoints_are_peft_folders_and_resume_exactly() {
    let extra: Vec<&str> = [
        LORA,
        &[
            "actor_rollout_ref.actor.shuffle=True",
            "trainer.total_training_steps=4",
            "trainer.save_freq=2",
        ],
    ]
    .concat();
    let fx = fixture();
    let mut a = trainer(&fx, &extra, None);
    a.fit().unwrap();
    let straight = (
        adapters(&a.actor.trainable),
        weights(&a.critic.as_ref().unwrap().trainable.varmap),
        optimizer_files(&crate::checkpoint::step_dir(&a.plan.default_local_dir, 4)),
        a.history
            .iter()
            .map(|(s, m)| (*s, deterministic(m)))
            .collect::<Vec<_>>(),
    );
    // The folder: PEFT names and shapes, config keys, no base weights.
    let step2 = crate::checkpoint::step_dir(&a.plan.default_local_dir, 2);
    let ad = step2.join("actor/lora_adapter");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ad.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["task_type"], "CAUSAL_LM");
    assert_eq!(cfg["r"], 4);
    assert_eq!(cfg["lora_alpha"], 8.0);
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!([
            "down_proj",
            "gate_proj",
            "k_proj",
            "o_proj",
            "q_proj",
            "up_proj",
            "v_proj"
        ])
    );
    let tensors =
        candle_core::safetensors::load(ad.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(tensors.len(), 28);
    let a_q = &tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
    let b_d = &tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"];
    assert_eq!(a_q.dims(), &[4, 32]); // [r, hidden]
    assert_eq!(b_d.dims(), &[32, 4]); // [hidden, r]
    assert!(!step2.join("actor/huggingface/model.safetensors").exists());
    assert!(step2.join("actor/huggingface/config.json").is_file());
    let ccfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(step2.join("critic/lora_adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(ccfg["task_type"], "TOKEN_CLS");
    assert_eq!(ccfg["modules_to_save"], serde_json::json!(["score"]));
    drop(a);

    let fx2 = fixture_like(&fx);
    let (c, history) = stopped_at_2_then_resumed(&fx2, &extra);
    assert!(
        straight.0 == adapters(&c.actor.trainable),
        "adapters differ after resume"
    );
    assert!(
        straight.1 == weights(&c.critic.as_ref().unwrap().trainable.varmap),
        "critic head differs after resume"
    );
    assert!(
        straight.2 == optimizer_files(&crate::checkpoint::step_dir(&c.plan.default_local_dir, 4)),
        "optimizer state differs after resume"
    );
    let resumed: Vec<_> = history
        .iter()
        .map(|(s, m)| (*s, deterministic(m)))
        .collect();
    assert!(straight.3 == resumed, "metrics differ after resume");
}

/// `lora_adapter_path` starts from a saved adapter: its config sets rank and targets (the
/// configured lora_rank is not used) and its tensors the starting values; the critic's value
/// head comes back from `modules_to_save`.
#[test]
fn lora_adapter_path_starts_from_a_saved_adapter() {
    let fx = fixture();
    let mut a = trainer(
        &fx,
        &[
            LORA,
            &["trainer.total_training_steps=1", "trainer.save_freq=1"],
        ]
        .concat(),
        None,
    );
    a.fit().unwrap();
    let step1 = crate::checkpoint::step_dir(&a.plan.default_local_dir, 1);
    let (saved_actor, saved_critic) = (
        adapters(&a.actor.trainable),
        weights(&a.critic.as_ref().unwrap().trainable.varmap),
    );
    drop(a);
    let fx2 = fixture_like(&fx);
    let actor_path = format!(
        "actor_rollout_ref.model.lora_adapter_path={}",
        step1.join("actor").display()
    );
    let critic_path = format!(
        "critic.model.lora_adapter_path={}",
        step1.join("critic/lora_adapter").display()
    );
    let b = trainer(
        &fx2,
        &[
            "algorithm.adv_estimator=gae",
            "critic.model.lora_rank=16",
            &actor_path,
            &critic_path,
        ],
        None,
    );
    assert_eq!(adapters(&b.actor.trainable), saved_actor);
    assert_eq!(b.actor.trainable.lora.as_ref().unwrap().spec.rank, 4);
    let critic = b.critic.as_ref().unwrap();
    assert_eq!(critic.trainable.lora.as_ref().unwrap().spec.rank, 2);
    assert_eq!(weights(&critic.trainable.varmap), saved_critic);
    // A broken adapter folder is an error naming the key.
    let bad = format!(
        "actor_rollout_ref.model.lora_adapter_path={}",
        fx2.dir.path().display()
    );
    let e = Trainer::new(
        config(&fx2, &[bad.as_str()]),
        TrainerOptions {
            natives: natives(),
            stop: Arc::new(AtomicBool::new(false)),
            tracker: Some(Tracker::with_sinks(Vec::new())),
            ..TrainerOptions::default()
        },
    )
    .err()
    .expect("no adapter there")
    .to_string();
    assert!(
        e.contains("lora_adapter_path") && e.contains("adapter_config.json"),
        "{e}"
    );
}

/// PEFT's `lora_dropout` from a loaded adapter's config (verl's FSDP route to dropout:
/// `PeftModel.from_pretrained(..., is_trainable=True)`): the actor trains with it (its adapters
/// end elsewhere than without dropout), checkpoints keep it in `adapter_config.json`, and an
/// interrupted run resumes onto exactly the straight run's adapters and metrics (the masks
/// depend on the step and the forward's order, not on how the process started).
#[test]
fn adapter_dropout_trains_saves_and_resumes_exactly() {
    let fx = fixture();
    let mut a = trainer(
        &fx,
        &[
            LORA,
            &["trainer.total_training_steps=1", "trainer.save_freq=1"],
        ]
        .concat(),
        None,
    );
    a.fit().unwrap();
    let start = crate::checkpoint::step_dir(&a.plan.default_local_dir, 1).join("actor");
    drop(a);
    // The same adapter, once as saved (dropout 0) and once with lora_dropout 0.3.
    let dropped = fx.dir.path().join("dropped_adapter");
    std::fs::create_dir_all(&dropped).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(start.join("lora_adapter").join(f), dropped.join(f)).unwrap();
    }
    let cfg_path = dropped.join("adapter_config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    assert_eq!(cfg["lora_dropout"], 0.0);
    cfg["lora_dropout"] = serde_json::json!(0.3);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let run_with = |adapter: &Path| -> Vec<String> {
        vec![
            "algorithm.adv_estimator=gae".into(),
            format!(
                "actor_rollout_ref.model.lora_adapter_path={}",
                adapter.display()
            ),
            "critic.model.lora_rank=2".into(),
            "trainer.total_training_steps=3".into(),
            "trainer.save_freq=1".into(),
        ]
    };
    let extra_owned = run_with(&dropped);
    let extra: Vec<&str> = extra_owned.iter().map(String::as_str).collect();
    let plain_owned = run_with(&start);
    let plain_extra: Vec<&str> = plain_owned.iter().map(String::as_str).collect();

    let fx2 = fixture_like(&fx);
    let mut s = trainer(&fx2, &extra, None);
    assert_eq!(s.actor.trainable.model.adapter_dropout(), 0.3);
    s.fit().unwrap();
    let saved: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            crate::checkpoint::step_dir(&s.plan.default_local_dir, 1)
                .join("actor/lora_adapter/adapter_config.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(saved["lora_dropout"], 0.3);
    let straight = (
        adapters(&s.actor.trainable),
        s.history
            .iter()
            .map(|(k, m)| (*k, deterministic(m)))
            .collect::<Vec<_>>(),
    );
    drop(s);

    let fx3 = fixture_like(&fx);
    let mut p = trainer(&fx3, &plain_extra, None);
    assert_eq!(p.actor.trainable.model.adapter_dropout(), 0.0);
    p.fit().unwrap();
    assert!(
        adapters(&p.actor.trainable) != straight.0,
        "dropout changes the training"
    );
    drop(p);

    let fx4 = fixture_like(&fx);
    let (c, history) = stopped_at_2_then_resumed(&fx4, &extra);
    assert!(
        straight.0 == adapters(&c.actor.trainable),
        "adapters differ after resume"
    );
    let resumed: Vec<_> = history
        .iter()
        .map(|(k, m)| (*k, deterministic(m)))
        .collect();
    assert!(straight.1 == resumed, "metrics differ after resume");
}

/// A run of `extra` on `fx` stopped after step 2 (as by Ctrl-C), then resumed to the end: the
/// resumed trainer and the metrics of both parts in step order.
fn stopped_at_2_then_resumed(fx: &Fixture, extra: &[&str]) -> (Trainer, VecDeque<(u64, Metrics)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let sink: Box<dyn MetricSink + Send> = Box::new(StopAt(2, stop.clone()));
    let mut b = Trainer::new(
        config(fx, extra),
        TrainerOptions {
            natives: natives(),
            stop,
            tracker: Some(Tracker::with_sinks(vec![("stop".into(), sink)])),
            ..TrainerOptions::default()
        },
    )
    .unwrap();
    assert!(matches!(
        b.fit().unwrap(),
        FitOutcome::Interrupted { step: 2, .. }
    ));
    let mut history = b.history.clone();
    drop(b);
    let mut c = trainer(fx, extra, None);
    assert_eq!(c.global_step, 2);
    c.fit().unwrap();
    history.extend(c.history.iter().cloned());
    (c, history)
}

/// A LoRA rank larger than the projections it adapts (`lora_rank=10000000` asked for tens of
/// gigabytes of adapters on this tiny model and aborted the process) is an error naming the
/// key, the rank and the limit, before any adapter is allocated: the configured rank of the
/// actor and of the critic, and the `r` of an adapter folder's `adapter_config.json`.
#[test]
fn a_lora_rank_beyond_the_model_is_refused_naming_the_key() {
    let fx = fixture();
    let new = |extra: &[&str]| {
        Trainer::new(
            config(&fx, extra),
            TrainerOptions {
                natives: natives(),
                stop: Arc::new(AtomicBool::new(false)),
                tracker: Some(Tracker::with_sinks(Vec::new())),
                ..TrainerOptions::default()
            },
        )
        .err()
        .expect("the rank is refused")
        .to_string()
    };
    // The tiny model's widest adapted projections (q_proj, o_proj, the MLP's) have a smaller
    // side of 32: the largest rank all-linear takes.
    for (extra, key) in [
        (
            vec!["actor_rollout_ref.model.lora_rank=10000000"],
            "actor_rollout_ref.model.lora_rank",
        ),
        (
            vec![
                "algorithm.adv_estimator=gae",
                "critic.model.lora_rank=10000000",
            ],
            "critic.model.lora_rank",
        ),
    ] {
        let e = new(&extra);
        assert!(
            e.contains(key) && e.contains("10000000") && e.contains("32"),
            "{e}"
        );
    }
    // An adapter folder whose config asks for such a rank.
    let dir = fx.dir.path().join("huge_adapter");
    let spec = crate::weights::peft::LoraSpec {
        rank: 10_000_000,
        alpha: 16.0,
        use_rslora: false,
        target_modules: crate::config::fields::OneOrMany::Many(vec!["v_proj".into()]),
        exclude_modules: None,
        dropout: 0.0,
    };
    let cfg = crate::weights::peft::adapter_config(&spec, &[], "base", "CAUSAL_LM", None);
    crate::weights::peft::save_adapter(&dir, &cfg, &std::collections::HashMap::new()).unwrap();
    let path = format!(
        "actor_rollout_ref.model.lora_adapter_path={}",
        dir.display()
    );
    let e = new(&[path.as_str()]);
    assert!(
        e.contains("lora_adapter_path")
            && e.contains("adapter_config.json")
            && e.contains("10000000")
            && e.contains("16"),
        "{e}"
    );
}

/// A LoRA checkpoint resumed on other base weights is refused naming trainer_state.json and
/// the key (the adapters were resumed on whatever model the path held, silently, before).
#[test]
fn a_lora_checkpoint_resumes_only_on_its_base_weights() {
    let fx = fixture();
    let extra = [
        LORA,
        &["trainer.total_training_steps=1", "trainer.save_freq=1"],
    ]
    .concat();
    let mut t = trainer(&fx, &extra, None);
    t.fit().unwrap();
    drop(t);
    // Another tiny model of the same shape written over the base folder.
    let args = ModelArgs::tiny(Arch::Llama, 259);
    let (vm, _) = tiny_model(&args, DType::F32, 0.35);
    crate::weights::hf::save_dir(&vm, &args, &fx.model, &[258], Some(&fx.model), None).unwrap();
    let opts = TrainerOptions {
        natives: natives(),
        tracker: Some(Tracker::with_sinks(Vec::new())),
        ..TrainerOptions::default()
    };
    let e = match Trainer::new(config(&fx, &extra), opts) {
        Ok(_) => panic!("resumed LoRA adapters on other base weights"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("trainer_state.json")
            && e.contains("other base weights")
            && e.contains("actor_rollout_ref.model.path"),
        "{e}"
    );
}

/// `main_ppo merge`'s work on a trained LoRA checkpoint (two PPO steps, LoRA on actor and
/// critic): `global_step_2/` merges into an actor folder with the trained actor's logits
/// (f32, 1e-5), `global_step_2/critic` into a backbone with the trained critic's hidden
/// states and its trained value head.
#[test]
fn a_trained_lora_checkpoint_merges_into_the_trained_models() {
    use crate::weights::merge;
    let fx = fixture();
    let extra = [
        LORA,
        &["trainer.total_training_steps=2", "trainer.save_freq=2"],
    ]
    .concat();
    let mut t = trainer(&fx, &extra, None);
    t.fit().unwrap();
    let step = crate::checkpoint::step_dir(&t.plan.default_local_dir, 2);
    let diff = |a: &[f32], b: &[f32]| {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).fold(0f32, |d, (x, y)| d.max((x - y).abs()))
    };
    let actor_out = fx.dir.path().join("merged_actor");
    let source = merge::resolve(&step, None).unwrap();
    let merged = merge::merge(&source).unwrap();
    assert_eq!(merged.projections, 2 * 7, "all-linear on 2 layers");
    merge::save(&merged, &actor_out).unwrap();
    let (actor, _) = crate::weights::load_model_and_tokenizer(
        &actor_out.display().to_string(),
        None,
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        true,
    )
    .unwrap();
    let d = diff(&logits_of(&actor.model), &logits_of(t.actor.view()));
    assert!(d <= 1e-5, "merged actor vs trained actor: {d}");

    let source = merge::resolve(&step.join("critic"), None).unwrap();
    assert!(matches!(source, merge::Source::Lora { critic: true, .. }));
    let critic_out = fx.dir.path().join("merged_critic");
    merge::save(&merge::merge(&source).unwrap(), &critic_out).unwrap();
    let (backbone, _) = crate::weights::load_model_and_tokenizer(
        &critic_out.display().to_string(),
        None,
        &Default::default(),
        DType::F32,
        &Device::Cpu,
        false,
    )
    .unwrap();
    let hidden = |m: &crate::model::CausalLm| -> Vec<f32> {
        let dev = Device::Cpu;
        let ids = Tensor::new(&[[72u32, 101, 108, 108, 111, 33]], &dev).unwrap();
        let pos = Tensor::new(&[[0u32, 1, 2, 3, 4, 5]], &dev).unwrap();
        let mask = Tensor::new(&[[1u32; 6]], &dev).unwrap();
        let h = m.forward_hidden(&ids, &pos, &mask, None).unwrap();
        h.flatten_all().unwrap().to_vec1().unwrap()
    };
    let critic = t.critic.as_ref().unwrap();
    let d = diff(
        &hidden(&backbone.model),
        &hidden(&critic.trainable.view().backbone),
    );
    assert!(d <= 1e-5, "merged critic backbone vs trained: {d}");
    let saved = crate::weights::hf::read_weights(&critic_out).unwrap();
    let trained = weights(&critic.trainable.varmap);
    for name in ["score.weight", "score.bias"] {
        let want = &trained.iter().find(|(n, _)| n == name).unwrap().1;
        let got: Vec<f32> = saved[name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&got, want, "{name}");
    }
}
