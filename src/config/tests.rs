//! Loading, overriding and resolving configurations.

use std::path::PathBuf;

use super::*;

fn with(overrides: &[&str]) -> Result<Loaded, ConfigError> {
    load(
        &ConfigSource::Builtin,
        &overrides.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    )
}

fn cfg(overrides: &[&str]) -> Config {
    with(overrides)
        .unwrap_or_else(|e| panic!("{overrides:?}: {e}"))
        .config
}

fn err(overrides: &[&str]) -> String {
    match with(overrides) {
        Ok(_) => panic!("{overrides:?} should fail"),
        Err(e) => e.to_string(),
    }
}

/// A configuration that passes every rule (the GSM8K quickstart's batch sizes).
const VALID: &[&str] = &[
    "data.train_batch_size=256",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
];

fn resolved(extra: &[&str]) -> Result<Plan, String> {
    let mut all: Vec<&str> = VALID.to_vec();
    all.extend_from_slice(extra);
    resolve(&cfg(&all)).map_err(|e| e.to_string())
}

fn rule_error(extra: &[&str]) -> String {
    match resolved(extra) {
        Ok(_) => panic!("{extra:?} should break a rule"),
        Err(e) => e,
    }
}

#[test]
fn ppo_trainer_yaml_equals_defaults() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs/ppo_trainer.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let file: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    let defaults = serde_yaml_ng::to_value(Config::default()).unwrap();
    assert_eq!(file, defaults, "configs/ppo_trainer.yaml differs from the Rust defaults: run scripts/gen_ppo_trainer_yaml.py");
    let loaded = load(&ConfigSource::File(path), &[]).unwrap();
    assert_eq!(loaded.config, Config::default());
    // Every key carries a comment line above it.
    let mut prev = "";
    for line in text.lines() {
        let t = line.trim_start();
        if !t.is_empty() && !t.starts_with('#') && !t.starts_with('-') {
            assert!(
                prev.trim_start().starts_with('#'),
                "no comment above `{line}`"
            );
        }
        if !t.is_empty() {
            prev = line;
        }
    }
}

#[test]
fn verl_defaults_where_verl_has_them() {
    let c = Config::default();
    assert_eq!(c.data.train_batch_size, 1024);
    assert_eq!(c.actor_rollout_ref.actor.ppo_mini_batch_size, 256);
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 1e-6);
    assert_eq!(c.critic.optim.lr, 1e-5);
    assert_eq!(
        c.actor_rollout_ref.actor.kl_loss_type.to_string(),
        "low_var_kl"
    );
    assert_eq!(c.algorithm.kl_penalty.to_string(), "kl");
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::Gae);
    assert_eq!(c.actor_rollout_ref.rollout.val_kwargs.temperature, 0.0);
    assert!(!c.actor_rollout_ref.rollout.val_kwargs.do_sample);
    assert_eq!(
        c.reward.custom_reward_function.name.as_deref(),
        Some("compute_score")
    );
    assert_eq!(c.trainer.save_freq, None);
}

#[test]
fn set_override_and_value_types() {
    let c = cfg(&[
        "data.train_batch_size=256",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "trainer.val_before_train=False",
        "trainer.logger=['console']",
        "trainer.default_local_dir=null",
        "trainer.experiment_name=",
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.kl_loss_type=k3+",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "trainer.save_freq=-1",
        "trainer.test_freq=5",
    ]);
    assert_eq!(c.data.train_batch_size, 256);
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 1e-6);
    assert!(!c.trainer.val_before_train);
    assert_eq!(c.trainer.logger.to_vec(), vec!["console".to_string()]);
    assert_eq!(c.trainer.default_local_dir, None);
    assert_eq!(c.trainer.experiment_name, "");
    assert_eq!(c.algorithm.adv_estimator, AdvEstimator::Grpo);
    let k = c.actor_rollout_ref.actor.kl_loss_type;
    assert_eq!((k.kind, k.straight_through), (KlKind::K3, true));
    assert_eq!(
        c.actor_rollout_ref.actor.loss_agg_mode,
        LossAggMode::SeqMeanTokenSumNorm
    );
    assert_eq!(c.trainer.save_freq, None);
    assert_eq!(c.trainer.test_freq, Some(5));
    // A single string is accepted where verl accepts a string or a list.
    assert_eq!(
        cfg(&["trainer.logger=console"]).trainer.logger.to_vec(),
        vec!["console".to_string()]
    );
    assert_eq!(
        cfg(&["data.train_files=[a.parquet,b.parquet]"])
            .data
            .train_files
            .to_vec(),
        vec!["a.parquet", "b.parquet"]
    );
}

#[test]
fn add_force_add_and_delete() {
    // `+` into a free-form map (verl scripts use it for template and reward kwargs).
    let c = cfg(&[
        "+data.apply_chat_template_kwargs.enable_thinking=False",
        "++reward.reward_kwargs.max_resp_len=512",
    ]);
    assert_eq!(
        c.data.apply_chat_template_kwargs["enable_thinking"],
        serde_json::json!(false)
    );
    assert_eq!(
        c.reward.reward_kwargs["max_resp_len"],
        serde_json::json!(512)
    );
    // `+`/`++` on an existing key set it.
    assert_eq!(cfg(&["+data.train_batch_size=8"]).data.train_batch_size, 8);
    assert_eq!(cfg(&["++data.train_batch_size=8"]).data.train_batch_size, 8);
    // `~` resets a typed key to its default and removes a free-form entry.
    assert_eq!(
        cfg(&["data.train_batch_size=8", "~data.train_batch_size"])
            .data
            .train_batch_size,
        1024
    );
    let c = cfg(&["+reward.reward_kwargs.a=1", "~reward.reward_kwargs.a"]);
    assert!(c.reward.reward_kwargs.is_empty());
    // `~key=value` deletes only when the value matches.
    assert_eq!(
        cfg(&["data.train_batch_size=8", "~data.train_batch_size=8"])
            .data
            .train_batch_size,
        1024
    );
    let e = err(&["data.train_batch_size=8", "~data.train_batch_size=9"]);
    assert!(e.contains("is 8, not 9"), "{e}");
    // A mapping value merges into a section.
    let c = cfg(&["algorithm.kl_ctrl={type: adaptive, target_kl: 0.05}"]);
    assert_eq!(c.algorithm.kl_ctrl.kind, KlCtrlType::Adaptive);
    assert_eq!(c.algorithm.kl_ctrl.target_kl, 0.05);
    assert_eq!(
        c.algorithm.kl_ctrl.kl_coef, 0.001,
        "untouched keys keep their defaults"
    );
}

#[test]
fn reward_sources_inline() {
    let c = cfg(&["reward.sources=[{name: acc, type: builtin, scorer: gsm8k, kwargs: {method: flexible}}, {name: fmt, weight: 0.5, type: python, path: r.py, function: f}]"]);
    assert_eq!(c.reward.sources.len(), 2);
    assert_eq!(c.reward.sources[0].weight, 1.0);
    assert_eq!(
        c.reward.sources[0].kwargs["method"],
        serde_json::json!("flexible")
    );
    assert_eq!(c.reward.sources[1].kind, RewardSourceType::Python);
    let e = err(&["reward.sources=[{name: acc, type: builtin, scorer: gsm8k, wieght: 2}]"]);
    assert!(
        e.contains("reward.sources[0]") && e.contains("wieght"),
        "{e}"
    );
}

#[test]
fn unknown_keys_suggest_the_closest() {
    let e = err(&["data.train_batch_sise=4"]);
    assert!(
        e.contains("unknown key `data.train_batch_sise`") && e.contains("`data.train_batch_size`"),
        "{e}"
    );
    // A key under the wrong section points to where it lives.
    let e = err(&["actor_rollout_ref.ppo_mini_batch_size=4"]);
    assert!(
        e.contains("`actor_rollout_ref.actor.ppo_mini_batch_size`"),
        "{e}"
    );
    let e = err(&["trainr.total_epochs=1"]);
    assert!(e.contains("`trainer`"), "{e}");
    // No close match: the valid keys are listed.
    let e = err(&["algorithm.zzzz=1"]);
    assert!(
        e.contains("the keys under `algorithm` are:") && e.contains("adv_estimator"),
        "{e}"
    );
    // Inside a typed struct value.
    let e = err(&["algorithm.kl_ctrl={typ: fixed}"]);
    assert!(
        e.contains("algorithm.kl_ctrl.typ") && e.contains("algorithm.kl_ctrl.type"),
        "{e}"
    );
}

#[test]
fn type_errors_name_key_value_and_type() {
    let e = err(&["data.train_batch_size=abc"]);
    assert!(
        e.contains("data.train_batch_size")
            && e.contains("abc")
            && e.contains("non-negative integer"),
        "{e}"
    );
    let e = err(&["trainer.val_before_train=maybe"]);
    assert!(
        e.contains("trainer.val_before_train") && e.contains("maybe") && e.contains("boolean"),
        "{e}"
    );
    let e = err(&["algorithm.adv_estimator=ppo"]);
    assert!(
        e.contains("algorithm.adv_estimator") && e.contains("`ppo`") && e.contains("grpo"),
        "{e}"
    );
    let e = err(&["actor_rollout_ref.actor.kl_loss_type=k9"]);
    assert!(
        e.contains("actor_rollout_ref.actor.kl_loss_type") && e.contains("k9"),
        "{e}"
    );
    let e = err(&["actor_rollout_ref.actor.optim.betas=[0.9]"]);
    assert!(e.contains("actor_rollout_ref.actor.optim.betas"), "{e}");
}

#[test]
fn sweeps_and_malformed_overrides_are_errors() {
    let e = err(&["trainer.logger=console,wandb"]);
    assert!(
        e.contains("override `trainer.logger=console,wandb`") && e.contains("[console,wandb]"),
        "{e}"
    );
    let e = err(&["trainer.logger"]);
    assert!(e.contains("key=value"), "{e}");
}

#[test]
fn legacy_reward_keys_map_onto_reward() {
    let l = with(&[
        "custom_reward_function.path=/x/r.py",
        "custom_reward_function.name=my_fn",
    ])
    .unwrap();
    assert_eq!(
        l.config.reward.custom_reward_function.path.as_deref(),
        Some("/x/r.py")
    );
    assert_eq!(
        l.config.reward.custom_reward_function.name.as_deref(),
        Some("my_fn")
    );
    assert!(l
        .notices
        .iter()
        .any(|n| n.contains("custom_reward_function.path")
            && n.contains("reward.custom_reward_function.path")));
    // Without a legacy name, the new key's default (compute_score) stays.
    let c = cfg(&["custom_reward_function.path=/x/r.py"]);
    assert_eq!(
        c.reward.custom_reward_function.name.as_deref(),
        Some("compute_score")
    );
    // Legacy reward kwargs move too.
    let c = cfg(&["+custom_reward_function.reward_kwargs.k=2"]);
    assert_eq!(
        c.reward.custom_reward_function.reward_kwargs["k"],
        serde_json::json!(2)
    );
    // Both spellings, same value: fine. Different: an error naming both.
    cfg(&[
        "custom_reward_function.path=/x/r.py",
        "reward.custom_reward_function.path=/x/r.py",
    ]);
    let e = err(&[
        "custom_reward_function.path=/x/a.py",
        "reward.custom_reward_function.path=/x/b.py",
    ]);
    assert!(
        e.contains("`custom_reward_function.path`")
            && e.contains("`reward.custom_reward_function.path`"),
        "{e}"
    );
    // The legacy reward-manager spelling.
    assert_eq!(
        cfg(&["reward_model.reward_manager=dapo"])
            .reward
            .reward_manager
            .name,
        RewardManagerName::Dapo
    );
}

#[test]
fn no_effect_keys_are_reported_and_unsupported_values_refused() {
    let l = with(&[
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "+actor_rollout_ref.actor.fsdp_config.anything.below=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "ray_kwargs.ray_init.num_cpus=4",
        "actor_rollout_ref.model.use_liger=False",
        "trainer.default_hdfs_dir=null",
    ])
    .unwrap();
    for k in [
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.rollout.nnodes",
        "ray_kwargs.ray_init.num_cpus",
        "actor_rollout_ref.model.use_liger",
    ] {
        assert!(
            l.no_effect.iter().any(|n| n == k),
            "{k} not in {:?}",
            l.no_effect
        );
    }
    assert!(
        !l.no_effect.iter().any(|n| n == "trainer.default_hdfs_dir"),
        "null is verl's unset value"
    );
    assert_eq!(l.config, Config::default(), "no-effect keys change nothing");
    // gpu_memory_utilization sizes generation's KV budget on CUDA: typed, checked.
    let l = with(&["actor_rollout_ref.rollout.gpu_memory_utilization=0.4"]).unwrap();
    assert_eq!(
        l.config.actor_rollout_ref.rollout.gpu_memory_utilization,
        0.4
    );
    assert!(l.no_effect.is_empty(), "{:?}", l.no_effect);
    let e = rule_error(&["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"]);
    assert!(
        e.contains("gpu_memory_utilization` (1.5) must be in (0, 1]"),
        "{e}"
    );
    let e = err(&["actor_rollout_ref.model.lora.rank=8"]);
    assert!(
        e.contains("actor_rollout_ref.model.lora.rank = 8") && e.contains("LoRA"),
        "{e}"
    );
    // use_remove_padding is a typed key now (packed sequences), on by default as in verl.
    assert!(Config::default().actor_rollout_ref.model.use_remove_padding);
    let c = cfg(&[
        "actor_rollout_ref.model.use_remove_padding=False",
        "critic.model.use_remove_padding=false",
    ]);
    assert!(!c.actor_rollout_ref.model.use_remove_padding && !c.critic.model.use_remove_padding);
    // So is use_prefix_grouper (shared prompts), off by default as in verl's actor.yaml.
    assert!(!Config::default().actor_rollout_ref.actor.use_prefix_grouper);
    let c = cfg(&["actor_rollout_ref.actor.use_prefix_grouper=True"]);
    assert!(c.actor_rollout_ref.actor.use_prefix_grouper);
    let e = err(&["actor_rollout_ref.actor.use_prefix_grouper=maybe"]);
    assert!(e.contains("use_prefix_grouper"), "{e}");
}

#[test]
fn interpolations_resolve() {
    let c = cfg(&[
        "trainer.project_name=p",
        "trainer.default_local_dir=/ck/${trainer.project_name}/${trainer.experiment_name}",
    ]);
    assert_eq!(c.trainer.default_local_dir.as_deref(), Some("/ck/p/gsm8k"));
    let c = cfg(&[
        "data.max_response_length=77",
        "actor_rollout_ref.rollout.response_length=${oc.select:data.max_response_length,512}",
    ]);
    assert_eq!(c.actor_rollout_ref.rollout.response_length, Some(77));
    let c = cfg(&["actor_rollout_ref.rollout.response_length=${oc.select:data.nope,33}"]);
    assert_eq!(c.actor_rollout_ref.rollout.response_length, Some(33));
    let e = err(&["trainer.default_local_dir=${oc.eval:1+1}"]);
    assert!(
        e.contains("trainer.default_local_dir") && e.contains("oc.eval"),
        "{e}"
    );
}

#[test]
fn yaml_files_with_a_defaults_list() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("base.yaml"),
        "data:\n  train_batch_size: 32\n  max_prompt_length: 128\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("exp.yaml"),
        "defaults:\n  - ppo_trainer\n  - base\n  - _self_\ndata:\n  max_prompt_length: 256\ntrainer:\n  total_epochs: 2\n",
    )
    .unwrap();
    let l = load(
        &ConfigSource::File(dir.path().join("exp.yaml")),
        &["trainer.total_epochs=3".into()],
    )
    .unwrap();
    assert_eq!(l.config.data.train_batch_size, 32, "from base.yaml");
    assert_eq!(
        l.config.data.max_prompt_length, 256,
        "the file's own keys win over its defaults"
    );
    assert_eq!(l.config.trainer.total_epochs, 3, "overrides win over files");
    assert!(l.user_set.contains("data.train_batch_size"));

    std::fs::write(dir.path().join("bad.yaml"), "data:\n  train_bach_size: 3\n").unwrap();
    let e = load(&ConfigSource::File(dir.path().join("bad.yaml")), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.yaml")
            && e.contains("data.train_bach_size")
            && e.contains("data.train_batch_size"),
        "{e}"
    );
    std::fs::write(dir.path().join("broken.yaml"), "data: [\n").unwrap();
    let e = load(&ConfigSource::File(dir.path().join("broken.yaml")), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("broken.yaml"), "{e}");
    let e = load(&ConfigSource::File(dir.path().join("missing.yaml")), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.yaml"), "{e}");
}

// ---- verl's validation rules (`verl/utils/config.py::validate_config` and the configs' own `validate`), one test each ----

#[test]
fn valid_plan_arithmetic() {
    let p = resolved(&[
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_epochs=2",
    ])
    .unwrap();
    assert_eq!(p.responses_per_step(), 1024);
    assert_eq!(p.actor.mini_batches_per_epoch, 4);
    assert_eq!(p.actor.mini_batch_responses, 256);
    assert_eq!(p.actor.grad_accum, Some(64));
    assert_eq!(p.actor.optimizer_steps_per_step(), 8);
    assert!(p.need_critic && !p.need_reference);
    assert_eq!(
        p.critic.as_ref().unwrap().epochs,
        2,
        "critic.ppo_epochs falls back to the actor's"
    );
    assert_eq!(p.steps_per_epoch(7473), 29);
    assert_eq!(p.response_length, 512);
}

#[test]
fn rule_train_batch_vs_mini_batch() {
    let e = rule_error(&["data.train_batch_size=32"]);
    assert!(e.contains("`data.train_batch_size` (32) must be >= `actor_rollout_ref.actor.ppo_mini_batch_size` (64)"), "{e}");
    let e = rule_error(&[
        "data.train_batch_size=6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_mini_batch_size=2",
    ]);
    assert!(e.contains("`data.train_batch_size` (6) must be divisible by `actor_rollout_ref.actor.ppo_mini_batch_size` (4)"), "{e}");
}

#[test]
fn rule_micro_batch_keys() {
    let e = rule_error(&["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"]);
    assert!(
        e.contains("set `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu`"),
        "{e}"
    );
    let e = rule_error(&["actor_rollout_ref.actor.ppo_micro_batch_size=8"]);
    assert!(e.contains("are both set"), "{e}");
    // The deprecated global key alone is accepted.
    let p = resolved(&[
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.actor.ppo_micro_batch_size=8",
    ])
    .unwrap();
    assert_eq!(p.actor.micro, MicroBatching::Sequences(8));
    // Dynamic batch size needs neither.
    let p = resolved(&[
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
    ])
    .unwrap();
    assert_eq!(p.actor.micro, MicroBatching::TokenBudget(16384));
    let e = rule_error(&["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"]);
    assert!(e.contains("64 × 1 = 64 responses per mini-batch must be divisible by `actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu` (6)"), "{e}");
    // A token budget below the longest possible sequence is verl's run-time rule: a warning
    // here, an error naming the row and the key when a step's sequence is longer.
    let p = resolved(&[
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100",
    ])
    .unwrap();
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("actor_rollout_ref.actor.ppo_max_token_len_per_gpu` (100)")),
        "{:?}",
        p.warnings
    );
    p.check_token_budgets(&[60, 100]).unwrap();
    let e = p
        .check_token_budgets(&[60, 100, 101])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("batch row 2")
            && e.contains("101")
            && e.starts_with("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
        "{e}"
    );
    // The old-log-prob pass follows the actor's budget unless it has its own.
    let p = resolved(&[
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=50",
    ])
    .unwrap();
    let e = p.check_token_budgets(&[51]).unwrap_err().to_string();
    assert!(
        e.contains("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu` (50)"),
        "{e}"
    );
    // Fixed micro-batches have no token budget.
    assert!(resolved(&[]).unwrap().token_budgets.is_empty());
}

#[test]
fn rule_rollout_and_ref_log_prob_micro() {
    let e = rule_error(&["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"]);
    assert!(
        e.contains("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
        "{e}"
    );
    // The reference's key matters only when a reference is needed.
    resolved(&[]).unwrap();
    let e = rule_error(&["actor_rollout_ref.actor.use_kl_loss=True"]);
    assert!(
        e.contains("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
        "{e}"
    );
    let p = resolved(&[
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    ])
    .unwrap();
    assert!(p.need_reference);
    let p = resolved(&[
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    ])
    .unwrap();
    assert!(p.warnings.iter().any(|w| w.contains("penalised twice")));
}

#[test]
fn rule_critic() {
    let e = rule_error(&["critic.ppo_micro_batch_size_per_gpu=null"]);
    assert!(e.contains("critic.ppo_micro_batch_size_per_gpu"), "{e}");
    let e = rule_error(&["critic.ppo_mini_batch_size=512"]);
    assert!(
        e.contains("`data.train_batch_size` (256) must be >= `critic.ppo_mini_batch_size` (512)"),
        "{e}"
    );
    let e = rule_error(&["critic.enable=False"]);
    assert!(e.contains("critic.enable") && e.contains("gae"), "{e}");
    // GRPO needs no critic, so its keys do not matter.
    let p = resolved(&[
        "algorithm.adv_estimator=grpo",
        "critic.ppo_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.rollout.n=2",
    ])
    .unwrap();
    assert!(!p.need_critic && p.critic.is_none());
    let p = resolved(&[
        "algorithm.adv_estimator=grpo",
        "critic.enable=True",
        "actor_rollout_ref.rollout.n=2",
    ])
    .unwrap();
    assert!(p.need_critic);
}

#[test]
fn rule_sampling() {
    let e = rule_error(&[
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.temperature=0",
    ]);
    assert!(
        e.contains("val_kwargs.do_sample=True")
            && e.contains("actor_rollout_ref.rollout.temperature"),
        "{e}"
    );
    assert!(rule_error(&["actor_rollout_ref.rollout.top_p=0"]).contains("top_p"));
    assert!(rule_error(&["actor_rollout_ref.rollout.n=0"]).contains("rollout.n"));
    assert!(rule_error(&["algorithm.adv_estimator=grpo_passk"]).contains("at least 2 responses"));
}

#[test]
fn rule_clip_kl_and_optim() {
    assert!(rule_error(&["actor_rollout_ref.actor.clip_ratio_c=1.0"]).contains("clip_ratio_c"));
    let e = rule_error(&[
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=0",
    ]);
    assert!(e.contains("algorithm.kl_ctrl.horizon"), "{e}");
    assert!(rule_error(&["actor_rollout_ref.actor.optim.optimizer=SGD"]).contains("AdamW"));
    assert!(rule_error(&["critic.optim.betas=[0.9, 1.5]"]).contains("critic.optim.betas[1]"));
    let e = rule_error(&[
        "actor_rollout_ref.actor.grad_clip=0.5",
        "actor_rollout_ref.actor.optim.clip_grad=2.0",
    ]);
    assert!(e.contains("grad_clip") && e.contains("clip_grad"), "{e}");
    // verl's actor.yaml: clip_ratio_low and clip_ratio_high are 0.2 of their own, so
    // clip_ratio alone moves neither side; a side follows clip_ratio only when nulled.
    let c = cfg(&["actor_rollout_ref.actor.clip_ratio=0.3"]);
    let a = &c.actor_rollout_ref.actor;
    assert_eq!((a.clip_low(), a.clip_high()), (0.2, 0.2));
    let c = cfg(&[
        "actor_rollout_ref.actor.clip_ratio=0.3",
        "actor_rollout_ref.actor.clip_ratio_low=null",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
    ]);
    let a = &c.actor_rollout_ref.actor;
    assert_eq!((a.clip_low(), a.clip_high()), (0.3, 0.28));
}

#[test]
fn rule_reward_and_trainer() {
    let e = rule_error(&[
        "reward.custom_reward_function.path=/r.py",
        "reward.custom_reward_function.name=",
    ]);
    assert!(e.contains("reward.custom_reward_function.name"), "{e}");
    let e = rule_error(&["reward.sources=[{name: a, type: builtin}, {name: a, type: python, path: x.py, weight: -1}]"]);
    assert!(
        e.contains("reward.sources[0]` has type builtin but no `scorer`"),
        "{e}"
    );
    assert!(
        e.contains("used by another source") && e.contains("reward.sources[1].weight"),
        "{e}"
    );
    assert!(
        rule_error(&["reward.reward_model.enable=True"]).contains("reward.reward_model.model_path")
    );
    let e = rule_error(&[
        "reward.sources=[{name: rm, type: model, micro_batch_size: 0, gate: {below: .inf, action: skip_update}}]",
        "reward.control.enable=True",
        "reward.control.token=",
    ]);
    for k in [
        "has type model but no `path`",
        "micro_batch_size` must be at least 1",
        "gate`: `below`",
        "reward.control.token",
    ] {
        assert!(e.contains(k), "{k}: {e}");
    }
    let e = rule_error(&[
        "trainer.resume_mode=resume_path",
        "trainer.resume_from_path=/ck/latest",
    ]);
    assert!(e.contains("global_step_"), "{e}");
    assert!(rule_error(&["trainer.resume_mode=resume_path"]).contains("trainer.resume_from_path"));
    assert!(rule_error(&["trainer.device=tpu"]).contains("trainer.device"));
    // Every violation is reported at once.
    let e = rule_error(&["trainer.device=tpu", "actor_rollout_ref.rollout.top_p=2"]);
    assert!(e.contains("trainer.device") && e.contains("top_p"), "{e}");
}

#[test]
fn checkpoint_dir_defaults_to_project_and_experiment() {
    let p = resolved(&["trainer.project_name=proj", "trainer.experiment_name=exp"]).unwrap();
    assert_eq!(p.default_local_dir, PathBuf::from("checkpoints/proj/exp"));
}

mod fuzz {
    use proptest::prelude::*;

    use super::super::overrides::parse_override;
    use super::super::tree;
    use super::*;

    fn leaf_keys() -> Vec<String> {
        let defaults = serde_yaml_ng::to_value(Config::default()).unwrap();
        let mut leaves = Vec::new();
        tree::leaves(&defaults, &mut Vec::new(), &mut leaves);
        leaves.iter().map(|l| tree::join(l)).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn override_parser_never_panics(s in "\\PC{0,60}") {
            let _ = parse_override(&s);
        }

        #[test]
        fn loader_never_panics_on_arbitrary_overrides(args in proptest::collection::vec("[~+]{0,2}[a-z_.]{0,24}(=\\PC{0,24})?", 0..4)) {
            if let Ok(l) = load(&ConfigSource::Builtin, &args) {
                let _ = resolve(&l.config);
            }
        }

        #[test]
        fn loader_never_panics_on_real_keys_with_arbitrary_values(
            picks in proptest::collection::vec((0usize..1000, "\\PC{0,30}"), 1..4),
            op in prop::sample::select(vec!["", "+", "++", "~"]),
        ) {
            let keys = leaf_keys();
            let args: Vec<String> = picks.iter().map(|(i, v)| format!("{op}{}={v}", keys[i % keys.len()])).collect();
            if let Ok(l) = load(&ConfigSource::Builtin, &args) {
                let _ = resolve(&l.config);
            }
        }

        #[test]
        fn yaml_files_never_panic(text in "\\PC{0,200}") {
            let dir = tempfile::tempdir().unwrap();
            let f = dir.path().join("c.yaml");
            std::fs::write(&f, &text).unwrap();
            let _ = load(&ConfigSource::File(f), &[]);
        }

        #[test]
        fn integers_round_trip(n in any::<i64>()) {
            let v = super::super::overrides::parse_value(&n.to_string()).unwrap();
            prop_assert_eq!(v.as_i64(), Some(n));
        }
    }
}

#[test]
fn check_refuses_what_training_refuses() {
    // `config check` used to call these valid; training then misbehaved or refused them.
    for bad in ["nan", "-1", "0"] {
        let e = rule_error(&[&format!("actor_rollout_ref.actor.grad_clip={bad}")]);
        assert!(
            e.contains("actor_rollout_ref.actor.grad_clip"),
            "{bad}: {e}"
        );
    }
    let e = rule_error(&["critic.grad_clip=inf"]);
    assert!(e.contains("critic.grad_clip"), "{e}");
    let public = ["reward.control.enable=True", "reward.control.host=0.0.0.0"];
    let e = rule_error(&public);
    assert!(e.contains("reward.control.token"), "{e}");
    let mut with_token = public.to_vec();
    with_token.push("reward.control.token=s3cret");
    assert!(resolved(&with_token).is_ok());
    assert!(
        resolved(&["reward.control.enable=True"]).is_ok(),
        "loopback needs no token"
    );
}

#[test]
fn interpolation_that_multiplies_itself_is_refused_early() {
    // Each level repeats the one below four times: 64 KiB × 4⁸ = 4 GiB if expanded.
    let base = "x".repeat(1 << 16);
    let key = "actor_rollout_ref.model.override_config";
    let mut o = vec![format!("+{key}.l0={base}")];
    for k in 1..=8 {
        let r = format!("${{{key}.l{}}}", k - 1);
        o.push(format!("+{key}.l{k}={r}{r}{r}{r}"));
    }
    let o: Vec<&str> = o.iter().map(String::as_str).collect();
    let t = std::time::Instant::now();
    let e = err(&o);
    assert!(
        e.contains("expands to more than 1048576 bytes"),
        "{}",
        &e[..e.len().min(300)]
    );
    assert!(
        e.contains(key),
        "the message names the key: {}",
        &e[..e.len().min(300)]
    );
    assert!(t.elapsed().as_secs_f64() < 5.0, "{:?}", t.elapsed());
}

#[test]
fn a_yaml_file_nested_too_deep_is_refused_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("deep.yaml");
    std::fs::write(
        &f,
        format!("trainer: {}1{}\n", "[".repeat(100_000), "]".repeat(100_000)),
    )
    .unwrap();
    let t = std::time::Instant::now();
    let e = load(&ConfigSource::File(f.clone()), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("deep.yaml") && e.contains("more than 128 levels"),
        "{}",
        &e[..e.len().min(300)]
    );
    assert!(t.elapsed().as_secs_f64() < 2.0, "{:?}", t.elapsed());
}

/// Seeds and temperatures are resolved once, into the plan, by the rules their keys document:
/// `data.seed` falls back to `trainer.seed`; log-probs use the rollout temperature, or 1 when
/// rollouts are greedy (temperature 0).
#[test]
fn seeds_and_temperatures_are_part_of_the_plan() {
    let p = resolved(&[
        "trainer.seed=7",
        "actor_rollout_ref.rollout.seed=11",
        "actor_rollout_ref.actor.data_loader_seed=13",
        "critic.data_loader_seed=17",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.2",
    ])
    .unwrap();
    assert_eq!(
        p.seeds,
        Seeds {
            data: 7,
            rollout: 11,
            actor: 13,
            critic: 17,
            value_head: 7,
            pf_ppo: 7,
        }
    );
    assert_eq!(
        p.temperatures,
        Temperatures {
            rollout: 0.7,
            log_prob: 0.7,
            validation: 0.2,
        }
    );
    let p = resolved(&["data.seed=3", "actor_rollout_ref.rollout.temperature=0"]).unwrap();
    assert_eq!((p.seeds.data, p.seeds.value_head), (3, 42));
    assert_eq!(
        p.temperatures.log_prob, 1.0,
        "greedy rollouts: log-probs at 1"
    );
}

/// Reward sources are typed once, in the plan: verl's default sources when none are listed,
/// each listed entry with the fields its type needs, and every broken rule named.
#[test]
fn reward_sources_become_typed_in_the_plan() {
    use super::reward::{CheckedSource, SourceKind};
    let p = resolved(&[]).unwrap();
    assert_eq!(p.reward.sources.len(), 1);
    assert_eq!(p.reward.sources[0].name, "default");
    assert!(
        matches!(&p.reward.sources[0].kind, SourceKind::Builtin { scorer, .. } if scorer == "default")
    );
    let p = resolved(&[
        "custom_reward_function.path=r.py",
        "custom_reward_function.name=f",
    ])
    .unwrap();
    assert!(
        matches!(&p.reward.sources[0].kind, SourceKind::Python { path, function, .. } if path == "r.py" && function == "f")
    );
    let p = resolved(&["reward.sources=[{name: a, type: builtin, scorer: gsm8k}, {name: b, weight: 0.5, type: python, path: r.py}, {name: c, type: model, path: rm, micro_batch_size: 2}]"]).unwrap();
    let kinds: Vec<(&str, Option<usize>)> = p
        .reward
        .sources
        .iter()
        .map(|s: &CheckedSource| (s.name.as_str(), s.index))
        .collect();
    assert_eq!(kinds, vec![("a", Some(0)), ("b", Some(1)), ("c", Some(2))]);
    assert!(
        matches!(&p.reward.sources[1].kind, SourceKind::Python { function, .. } if function == "compute_score")
    );
    assert!(matches!(
        &p.reward.sources[2].kind,
        SourceKind::Model {
            micro_batch_size: 2,
            device: None,
            ..
        }
    ));
    // Broken rules, all named at once, before anything starts.
    let e = rule_error(&[
        "reward.sources=[{name: a, type: builtin}, {name: a, type: native, function: f}]",
    ]);
    assert!(
        e.contains("`reward.sources[0]` has type builtin but no `scorer`")
            && e.contains("`reward.sources[1].name` (\"a\") is used by another source"),
        "{e}"
    );
    let e = rule_error(&["reward.reward_manager.name=batch"]);
    assert!(
        e.contains("reward.reward_manager.name=batch") && e.contains("custom_reward_function.path"),
        "{e}"
    );
    let e = rule_error(&[
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg={enable: true, len: 4}",
    ]);
    assert!(e.contains("reward.reward_kwargs.max_resp_len"), "{e}");
}

/// `trainer.use_legacy_worker_impl` picks the loss normalisation of both update plans; verl's
/// default workers never read `loss_scale_factor`, so setting it there is flagged.
#[test]
fn legacy_worker_impl_selects_the_normalisation() {
    let p = resolved(&[]).unwrap();
    assert!(!p.actor.global_norm);
    assert!(p.warnings.iter().all(|w| !w.contains("loss_scale_factor")));
    let p = resolved(&["actor_rollout_ref.actor.loss_scale_factor=64"]).unwrap();
    assert!(
        p.warnings.iter().any(|w| w
            .contains("actor_rollout_ref.actor.loss_scale_factor` (64) is read only with `trainer.use_legacy_worker_impl=disable")),
        "{:?}",
        p.warnings
    );
    let p = resolved(&[
        "trainer.use_legacy_worker_impl=disable",
        "actor_rollout_ref.actor.loss_scale_factor=64",
    ])
    .unwrap();
    assert!(p.actor.global_norm);
    assert!(p.warnings.iter().all(|w| !w.contains("loss_scale_factor")));
    let e = err(&["trainer.use_legacy_worker_impl=sometimes"]);
    assert!(e.contains("trainer.use_legacy_worker_impl"), "{e}");
}

#[test]
fn mixed_precision_keys_take_verls_spellings_and_refuse_fp16() {
    use crate::config::model::Precision;
    let c = cfg(&[
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=float32",
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "critic.model.fsdp_config.mixed_precision.param_dtype=bf16",
    ]);
    assert_eq!(
        c.critic.model.fsdp_config.mixed_precision.param_dtype,
        Precision::Bf16
    );
    let e = resolved(&["actor_rollout_ref.model.fsdp_config.mixed_precision.param_dtype=bf16"])
        .unwrap_err();
    assert!(e.contains("actor_rollout_ref.actor.fsdp_config"), "{e}");
    let a = &c.actor_rollout_ref;
    assert_eq!(
        a.actor.fsdp_config.mixed_precision.param_dtype,
        Precision::Bf16
    );
    assert_eq!(
        a.reference.fsdp_config.mixed_precision.param_dtype,
        Precision::Fp32
    );
    assert_eq!(a.rollout.dtype, Precision::Bf16);
    assert_eq!(
        Config::default().actor_rollout_ref.rollout.dtype,
        Precision::Fp32
    );
    let e = err(&["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16"]);
    assert!(
        e.contains("param_dtype") && e.contains("fp16"),
        "the error names the key and the value: {e}"
    );
}

/// Every config shipped in `configs/` loads, and every run config passes the rules (a broken
/// YAML or a renamed key there would otherwise only show when a user runs it); ppo_trainer.yaml
/// is the defaults, which leave the micro-batch sizes to the user as verl's do. SFT configs
/// (`*_sft_*.yaml`) are `main_ppo sft`'s and checked by its schema.
#[test]
fn every_shipped_config_loads_and_resolves() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut seen = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".yaml") && name.contains("_sft_") {
            // `main_ppo sft`'s configs: its schema and rules.
            let l = crate::config::load_sft(Some(&p), &[])
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            crate::config::resolve_sft(&l.config)
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            seen += 1;
        } else if p.extension().is_some_and(|x| x == "yaml") {
            let l = crate::config::load(&crate::config::ConfigSource::File(p.clone()), &[])
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            if !p.ends_with("ppo_trainer.yaml") {
                resolve(&l.config).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
            seen += 1;
        }
    }
    assert!(seen >= 4, "only {seen} configs in {}", dir.display());
}

/// verl 1dda039's dro loss needs a positive `policy_loss.dro_beta` (verl raises when the loss
/// first runs; here the configuration is refused up front, naming both keys); dppo_tv and
/// dppo_kl take the clip keys as they are.
#[test]
fn dro_needs_a_positive_beta() {
    let mode = "actor_rollout_ref.actor.policy_loss.loss_mode=dro";
    for beta in [None, Some("0"), Some("-1.5")] {
        let mut extra = vec![mode.to_string()];
        if let Some(b) = beta {
            extra.push(format!("actor_rollout_ref.actor.policy_loss.dro_beta={b}"));
        }
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let e = rule_error(&extra);
        assert!(
            e.contains("policy_loss.loss_mode=dro") && e.contains("policy_loss.dro_beta"),
            "{beta:?}: {e}"
        );
    }
    let p = resolved(&[mode, "actor_rollout_ref.actor.policy_loss.dro_beta=0.5"]);
    assert!(p.is_ok(), "{p:?}");
    for m in ["dppo_tv", "dppo_kl"] {
        let c = cfg(&[&format!(
            "actor_rollout_ref.actor.policy_loss.loss_mode={m}"
        )]);
        assert_eq!(
            serde_yaml_ng::to_string(&c.actor_rollout_ref.actor.policy_loss.loss_mode)
                .unwrap()
                .trim(),
            m
        );
    }
}

/// gdpo's keys: required with gdpo, one weight per key, and refused without gdpo (they would
/// change nothing).
#[test]
fn gdpo_reward_keys_rules() {
    let g = "algorithm.adv_estimator=gdpo";
    let e = rule_error(&[g]);
    assert!(e.contains("algorithm.gdpo_reward_keys"), "{e}");
    let keys = "algorithm.gdpo_reward_keys=[a, b]";
    assert!(resolved(&[g, keys]).is_ok());
    let e = rule_error(&[g, keys, "algorithm.gdpo_reward_weights=[1.0]"]);
    assert!(e.contains("1 entries") && e.contains("has 2"), "{e}");
    let e = rule_error(&[keys]);
    assert!(
        e.contains("read only by `algorithm.adv_estimator=gdpo`"),
        "{e}"
    );
}

/// PF-PPO: verl's keys read (method, exponent) with GAE; with another estimator (which verl
/// would pass over) refused naming both keys; an unknown method names its key; a negative or
/// non-finite exponent is refused.
#[test]
fn pf_ppo_rules() {
    let on = "algorithm.use_pf_ppo=True";
    let method = "algorithm.pf_ppo.reweight_method=max_random";
    assert!(resolved(&[on, method]).is_ok());
    let c = cfg(&[on, method]);
    assert!(c.algorithm.use_pf_ppo);
    assert_eq!(
        c.algorithm.pf_ppo.reweight_method,
        crate::config::PfPpoReweight::MaxRandom
    );
    assert_eq!(c.algorithm.pf_ppo.weight_pow, 2.0);
    let e = rule_error(&[on, "algorithm.adv_estimator=grpo"]);
    assert!(
        e.contains("algorithm.use_pf_ppo") && e.contains("adv_estimator` is grpo"),
        "{e}"
    );
    let e = rule_error(&[on, "algorithm.pf_ppo.weight_pow=-1"]);
    assert!(e.contains("algorithm.pf_ppo.weight_pow"), "{e}");
    let e = err(&[on, "algorithm.pf_ppo.reweight_method=softmax"]);
    assert!(
        e.contains("reweight_method") && e.contains("max_min"),
        "{e}"
    );
}

/// The optimal token baselines need Σπ² from the old-log-prob pass: without
/// `actor.calculate_sum_pi_squared=True` (verl asserts it at the first step), or in bypass mode
/// (no such pass), the configuration is refused naming the keys; on its own the key is
/// accepted (it adds the variance_proxy/* metrics), with a warning in bypass mode.
#[test]
fn optimal_token_baseline_rules() {
    let spi2 = "actor_rollout_ref.actor.calculate_sum_pi_squared=True";
    let bypass = [
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "algorithm.rollout_correction.bypass_mode=True",
    ];
    for est in ["optimal_token_baseline", "tir_optimal_token_baseline"] {
        let a = format!("algorithm.adv_estimator={est}");
        let e = rule_error(&[&a]);
        assert!(
            e.contains(&format!("`algorithm.adv_estimator={est}`"))
                && e.contains("`actor_rollout_ref.actor.calculate_sum_pi_squared=True`"),
            "{e}"
        );
        assert!(resolved(&[&a, spi2]).is_ok());
        let e = rule_error(&[&a, spi2, bypass[0], bypass[1]]);
        assert!(e.contains("bypass_mode") && e.contains(est), "{e}");
    }
    let plan = resolved(&[spi2, bypass[0], bypass[1]]).unwrap();
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("calculate_sum_pi_squared")),
        "{:?}",
        plan.warnings
    );
    assert!(resolved(&[spi2, "algorithm.adv_estimator=grpo"]).is_ok());
}

/// DAPO's dynamic sampling: verl's rules (a metric, at least one batch in flight) and ours (no
/// KL in the reward; without filtering gen_batch_size must be the step's size); the plan.
#[test]
fn filter_groups_rules() {
    let on = "algorithm.filter_groups.enable=True";
    let acc = "algorithm.filter_groups.metric=acc";
    // verl 1dda039 spells the default null (refused with filtering on), verl 0.9 `reward`.
    let e = rule_error(&[on, "algorithm.filter_groups.metric=null"]);
    assert!(
        e.contains("algorithm.filter_groups.metric` must be set"),
        "{e}"
    );
    let p = resolved(&[on]).unwrap();
    assert_eq!(p.filter_groups.unwrap().metric, "reward");
    let e = rule_error(&[
        on,
        acc,
        "algorithm.filter_groups.max_inflight_gen_batches=0",
    ]);
    assert!(e.contains("max_inflight_gen_batches` (0)"), "{e}");
    let e = rule_error(&[on, acc, "algorithm.use_kl_in_reward=True"]);
    assert!(
        e.contains("use_kl_in_reward=true` is not implemented"),
        "{e}"
    );
    let e = rule_error(&["data.gen_batch_size=512"]);
    assert!(
        e.contains("`data.gen_batch_size` (512) differs from `data.train_batch_size` (256)"),
        "{e}"
    );
    let e = rule_error(&[on, acc, "data.gen_batch_size=0"]);
    assert!(
        e.contains("`data.gen_batch_size` must be at least 1"),
        "{e}"
    );
    // Off: the loader's batch is the step's.
    let p = resolved(&["data.gen_batch_size=256"]).unwrap();
    assert_eq!((p.gen_batch_size, p.filter_groups.is_none()), (256, true));
    assert_eq!(p.steps_per_epoch(7473), 29);
    let p = resolved(&[on, acc, "data.gen_batch_size=512"]).unwrap();
    assert_eq!(p.gen_batch_size, 512);
    assert_eq!(
        p.steps_per_epoch(7473),
        14,
        "epochs count generation batches"
    );
    assert_eq!(
        p.filter_groups,
        Some(FilterPlan {
            metric: "acc".into(),
            max_num_gen_batches: None
        })
    );
    let p = resolved(&[on, acc, "algorithm.filter_groups.max_num_gen_batches=10"]).unwrap();
    assert_eq!(p.filter_groups.unwrap().max_num_gen_batches, Some(10));
    assert_eq!(p.gen_batch_size, 256, "null = train_batch_size");
    let p = resolved(&[on, acc, "actor_rollout_ref.rollout.n=1"]).unwrap();
    assert!(
        p.warnings.iter().any(|w| w.contains("nothing is filtered")),
        "{:?}",
        p.warnings
    );
}

/// `algorithm.rollout_correction`: verl's rules, each error naming its key; the plan.
#[test]
fn rollout_correction_rules() {
    const K: &str = "algorithm.rollout_correction";
    let e = rule_error(&[&format!("{K}.rollout_is=bogus")]);
    assert!(e.contains(&format!("`{K}.rollout_is`: `bogus`")), "{e}");
    let e = rule_error(&[
        &format!("{K}.rollout_is=token"),
        &format!("{K}.rollout_is_threshold='5.0_0.5'"),
    ]);
    assert!(
        e.contains(&format!("`{K}.rollout_is_threshold`")) && e.contains("<= the upper"),
        "{e}"
    );
    let e = rule_error(&[
        &format!("{K}.rollout_rs=token_k2"),
        &format!("{K}.rollout_rs_threshold='0.5_2.0'"),
    ]);
    assert!(
        e.contains(&format!("`{K}.rollout_rs_threshold`")) && e.contains("one upper bound"),
        "{e}"
    );
    let e = rule_error(&[
        &format!("{K}.rollout_rs=seq_max_k1"),
        &format!("{K}.rollout_rs_threshold=2.0"),
    ]);
    assert!(
        e.contains(&format!("`{K}.rollout_rs`")) && e.contains("unknown option"),
        "{e}"
    );
    let e = rule_error(&[&format!("{K}.rollout_rs=token_k1")]);
    assert!(e.contains("rollout_rs_threshold"), "{e}");
    let e = rule_error(&[&format!("{K}.loss_type=pg")]);
    assert!(e.contains(&format!("`{K}.loss_type` is `pg`")), "{e}");
    let e = rule_error(&[
        &format!("{K}.rollout_is=sequence"),
        "actor_rollout_ref.rollout.calculate_log_probs=False",
    ]);
    assert!(e.contains("calculate_log_probs=true"), "{e}");
    let e = rule_error(&[
        &format!("{K}.rollout_is=token"),
        &format!("{K}.rollout_is_threshold=null"),
    ]);
    assert!(e.contains("must be set when rollout_is is"), "{e}");
    assert!(resolved(&[&format!("{K}.rollout_is_threshold=null")]).is_ok());
    // verl 0.7's keys: accepted at their null default, refused otherwise.
    assert!(resolved(&[&format!("{K}.rollout_token_veto_threshold=null")]).is_ok());
    let e = err(&[&format!("{K}.rollout_token_veto_threshold=1e-4")]);
    assert!(
        e.contains("rollout_token_veto_threshold") && e.contains("veto"),
        "{e}"
    );
    let e = err(&[&format!("{K}.rollout_is_threshold=True")]);
    assert!(e.contains("rollout_is_threshold"), "{e}");
    // Defaults: the diagnostics only; off without the rollout's log-probs.
    let p = resolved(&[]).unwrap();
    assert!(!p.rollout_correction.unwrap().corrects());
    let p = resolved(&["actor_rollout_ref.rollout.calculate_log_probs=False"]).unwrap();
    assert!(p.rollout_correction.is_none());
    let p = resolved(&[&format!("{K}.loss_type=reinforce")]).unwrap();
    assert!(
        p.warnings.iter().any(|w| w.contains("bypass_mode=true")),
        "{:?}",
        p.warnings
    );
    let p = resolved(&[
        &format!("{K}.bypass_mode=True"),
        &format!("{K}.loss_type=reinforce"),
        &format!("{K}.rollout_rs='token_k1,seq_mean_k3'"),
        &format!("{K}.rollout_rs_threshold='0.5_2.0,0.1'"),
    ])
    .unwrap();
    let c = p.rollout_correction.unwrap();
    assert_eq!(c.bypass, Some(BypassLoss::Reinforce));
    assert_eq!(c.correction.rs.len(), 2);
    assert_eq!(c.correction.rs[0].lower, Some(0.5));
}

/// `LossAggMode::as_str` (used in messages) is the spelling the config reads.
#[test]
fn loss_agg_mode_names_are_the_config_spellings() {
    for name in [
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ] {
        let m: LossAggMode = serde_yaml_ng::from_str(name).unwrap();
        assert_eq!(m.as_str(), name);
    }
}

/// `distillation.*` (verl 1dda039's DistillationConfig rules): the plan of one teacher and of
/// several (verl drops `teacher_model` then, and routes by key); the errors name their keys.
#[test]
fn distillation_rules() {
    let on = "distillation.enabled=True";
    let path = "distillation.teacher_models.teacher_model.model_path=/m/teacher";
    let p = resolved(&[on, path]).unwrap();
    let d = p.distillation.expect("planned");
    assert_eq!(d.teachers.len(), 1);
    assert_eq!(
        (d.teachers[0].key.as_deref(), d.clip_low, d.clip_high),
        (None, 0.2, 0.2)
    );
    assert!(
        resolved(&[path]).unwrap().distillation.is_none(),
        "off by default"
    );
    let e = rule_error(&[on]);
    assert!(
        e.contains("distillation.teacher_models.teacher_model.model_path` must be set"),
        "{e}"
    );
    let e = rule_error(&[on, path, "distillation.distillation_loss.loss_mode=k1"]);
    assert!(
        e.contains("loss_mode=k1") && e.contains("use_policy_gradient=true"),
        "{e}"
    );
    assert!(resolved(&[
        on,
        path,
        "distillation.distillation_loss.loss_mode=k1",
        "distillation.distillation_loss.use_policy_gradient=True",
    ])
    .is_ok());
    let p = resolved(&[
        on,
        path,
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
    ])
    .unwrap();
    assert_eq!(p.distillation.unwrap().topk, Some(32));
    let e = rule_error(&[
        on,
        path,
        "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.topk=0",
    ]);
    assert!(e.contains("distillation.distillation_loss.topk"), "{e}");
    let e = rule_error(&[
        on,
        path,
        "distillation.distillation_loss.policy_loss_mode=gspo",
    ]);
    assert!(
        e.contains("policy_loss_mode") && e.contains("vanilla"),
        "{e}"
    );
    // A negative distillation_loss_coef is refused naming it (it was accepted silently); 0 is
    // fine.
    let e = rule_error(&[
        on,
        path,
        "distillation.distillation_loss.distillation_loss_coef=-5",
    ]);
    assert!(
        e.contains("distillation.distillation_loss.distillation_loss_coef` is -5")
            && e.contains(">= 0"),
        "{e}"
    );
    assert!(resolved(&[
        on,
        path,
        "distillation.distillation_loss.distillation_loss_coef=0"
    ])
    .is_ok());
    let e = err(&[on, path, "distillation.distillation_loss.loss_mode=k4"]);
    assert!(
        e.contains("distillation.distillation_loss.loss_mode"),
        "{e}"
    );
}

/// `distillation.*` with several teachers (verl 1dda039's DistillationConfig rules):
/// `teacher_model` is dropped, each other entry needs a key, keys are unique; verl's
/// inference-server keys have no effect.
#[test]
fn distillation_rules_for_several_teachers() {
    let on = "distillation.enabled=True";
    let path = "distillation.teacher_models.teacher_model.model_path=/m/teacher";
    let two = [
        on,
        path,
        "+distillation.teacher_models.math.model_path=/m/a",
        "+distillation.teacher_models.math.key=openai/gsm8k",
        "+distillation.teacher_models.code.model_path=/m/b",
        "+distillation.teacher_models.code.key=code",
        "+distillation.teacher_models.code.inference.dtype=bf16",
    ];
    let d = resolved(&two).unwrap().distillation.unwrap();
    let got: Vec<(&str, Option<&str>, bool)> = d
        .teachers
        .iter()
        .map(|t| (t.name.as_str(), t.key.as_deref(), t.bf16))
        .collect();
    assert_eq!(
        got,
        [
            ("code", Some("code"), true),
            ("math", Some("openai/gsm8k"), false)
        ]
    );
    let e = rule_error(&[
        on,
        "+distillation.teacher_models.math.model_path=/m/a",
        "+distillation.teacher_models.code.model_path=/m/b",
        "+distillation.teacher_models.code.key=code",
    ]);
    assert!(
        e.contains("distillation.teacher_models.math.key` must be set"),
        "{e}"
    );
    let e = rule_error(&[
        on,
        "+distillation.teacher_models.math.model_path=/m/a",
        "+distillation.teacher_models.math.key=x",
        "+distillation.teacher_models.code.model_path=/m/b",
        "+distillation.teacher_models.code.key=x",
    ]);
    assert!(e.contains("another teacher has this key"), "{e}");
    let e = rule_error(&[
        on,
        path,
        "distillation.teacher_models.teacher_model.inference.max_model_len=100",
    ]);
    assert!(e.contains("inference.max_model_len"), "{e}");
    // verl's inference-server keys are accepted as having no effect.
    let l = with(&[
        on,
        path,
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=4",
        "distillation.n_gpus_per_node=4",
    ])
    .unwrap();
    assert_eq!(l.no_effect.len(), 2, "{:?}", l.no_effect);
}

/// verl's optimizer selection (`optim.optimizer_impl` + `optim.optimizer`, imported by
/// `build_optimizer`) and `override_optimizer_config`: torchao's low-bit classes resolve to
/// their moment formats and default blocks; the override's update arguments land on the keys
/// the optimizer reads (the override wins, as verl passes it last); implementation switches are
/// reported as without effect. (Refusals: the next test.)
#[test]
fn optimizer_classes_and_their_keyword_arguments() {
    let a = "actor_rollout_ref.actor.optim";
    let c = cfg(&[
        &format!("{a}.optimizer_impl=torchao.optim"),
        &format!("{a}.optimizer=AdamW4bit"),
    ]);
    let ch = c.actor_rollout_ref.actor.optim.choice().unwrap();
    assert_eq!(
        (ch.decoupled, ch.moments, ch.block_size, ch.torchao_form),
        (true, MomentFormat::Int4, 128, true)
    );
    let c = cfg(&[
        &format!("{a}.optimizer_impl=torchao.optim"),
        &format!("{a}.optimizer=Adam8bit"),
        &format!("+{a}.override_optimizer_config.block_size=512"),
    ]);
    let ch = c.actor_rollout_ref.actor.optim.choice().unwrap();
    assert_eq!(
        (ch.decoupled, ch.moments, ch.block_size),
        (false, MomentFormat::Int8, 512)
    );

    let l = with(&[
        &format!("{a}.lr=1e-6"),
        &format!("+{a}.override_optimizer_config.lr=3e-6"),
        &format!("+{a}.override_optimizer_config.eps=1e-5"),
        &format!("+{a}.override_optimizer_config.betas=[0.8,0.95]"),
        &format!("+{a}.override_optimizer_config.weight_decay=0.1"),
        &format!("+{a}.override_optimizer_config.foreach=False"),
        &format!("+{a}.override_optimizer_config.bf16_stochastic_round=True"),
    ])
    .unwrap();
    let o = &l.config.actor_rollout_ref.actor.optim;
    assert_eq!(
        (o.lr, o.eps, o.betas, o.weight_decay),
        (3e-6, 1e-5, [0.8, 0.95], 0.1)
    );
    assert!(
        l.notices
            .iter()
            .any(|n| n.contains("override_optimizer_config.lr")),
        "{:?}",
        l.notices
    );
    for k in ["foreach", "bf16_stochastic_round"] {
        let key = format!("{a}.override_optimizer_config.{k}");
        assert!(l.no_effect.contains(&key), "{key}: {:?}", l.no_effect);
    }

    // Adam's L2 weight decay through torch's (and Megatron's) decoupled_weight_decay switch.
    let c = cfg(&[&format!(
        "+{a}.override_optimizer_config.decoupled_weight_decay=False"
    )]);
    assert_eq!(c.actor_rollout_ref.actor.optim.optimizer, "Adam");
    assert!(!c.actor_rollout_ref.actor.optim.choice().unwrap().decoupled);
}

/// Optimizer classes and arguments that change the update and are not implemented are refused
/// naming the key; an unknown argument names the keys that exist; a config built in code whose
/// override and key disagree is refused, not half-read.
#[test]
fn optimizer_classes_and_arguments_not_implemented_are_refused() {
    let a = "actor_rollout_ref.actor.optim";
    let e = rule_error(&[
        &format!("{a}.optimizer_impl=torchao.optim"),
        &format!("{a}.optimizer=AdamW8bit"),
        &format!("+{a}.override_optimizer_config.decoupled_weight_decay=False"),
    ]);
    assert!(e.contains("decoupled_weight_decay"), "{e}");

    for (arg, key) in [
        ("amsgrad=True", "override_optimizer_config.amsgrad"),
        ("maximize=True", "override_optimizer_config.maximize"),
        (
            "fp8_recipe=blockwise",
            "override_optimizer_config.fp8_recipe",
        ),
    ] {
        let e = err(&[&format!("+{a}.override_optimizer_config.{arg}")]);
        assert!(e.contains(&format!("{a}.{key}")), "{arg}: {e}");
    }
    let e = err(&[&format!("+{a}.override_optimizer_config.betaz=[0.9,0.9]")]);
    assert!(
        e.contains("override_optimizer_config.betaz") && e.contains("betas"),
        "{e}"
    );

    for (extra, want) in [
        (
            vec![
                format!("{a}.optimizer_impl=bitsandbytes.optim"),
                format!("{a}.optimizer=AdamW8bit"),
            ],
            "torchao",
        ),
        (
            vec![
                format!("{a}.optimizer_impl=torchao.optim"),
                format!("{a}.optimizer=AdamW2bit"),
            ],
            "AdamW8bit",
        ),
        (
            vec![format!("{a}.optimizer_impl=apex.optimizers")],
            "optimizer_impl",
        ),
        (
            vec![format!("+{a}.override_optimizer_config.block_size=64")],
            "block_size",
        ),
        (
            vec![
                format!("{a}.optimizer_impl=torchao.optim"),
                format!("{a}.optimizer=AdamW4bit"),
                format!("+{a}.override_optimizer_config.block_size=3"),
            ],
            "even",
        ),
    ] {
        let refs: Vec<&str> = extra.iter().map(String::as_str).collect();
        let e = rule_error(&refs);
        assert!(e.contains(a) && e.contains(want), "{extra:?}: {e}");
    }
    // A config built in code whose override and key disagree is refused, not half-read.
    let mut c = cfg(VALID);
    c.critic.optim.override_optimizer_config.eps = Some(1e-3);
    let e = resolve(&c).unwrap_err().to_string();
    assert!(
        e.contains("critic.optim.override_optimizer_config.eps"),
        "{e}"
    );
}

/// A negative `multi_turn` turn limit is taken as verl takes it (reached at once), with a
/// warning naming the key; a negative tool output limit is refused naming its key.
#[test]
fn negative_turn_limits_warn_and_a_negative_output_limit_is_refused() {
    let mt = "actor_rollout_ref.rollout.multi_turn";
    for key in ["max_assistant_turns", "max_user_turns"] {
        let plan = resolved(&[&format!("{mt}.{key}=-1")]).unwrap();
        let w = plan.warnings.join("\n");
        assert!(w.contains(&format!("{mt}.{key}` (-1)")), "{w}");
        let plan = resolved(&[&format!("{mt}.{key}=0")]).unwrap();
        assert!(!plan.warnings.join("\n").contains(key));
    }
    let e = err(&[&format!("{mt}.max_tool_output_bytes=-1")]);
    assert!(e.contains("max_tool_output_bytes"), "{e}");
}

/// A YAML "alias bomb" (each anchor's list repeats the previous one nine times: 9^12 values
/// from a few hundred bytes) is refused, in a config file and in a tool config, saying what it
/// is and naming the file. Before, the parser's words alone: "repetition limit exceeded".
#[test]
fn a_yaml_alias_bomb_is_refused_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x]\n");
    for i in 1..12u8 {
        let (name, prev) = ((b'a' + i) as char, (b'a' + i - 1) as char);
        let refs = vec![format!("*{prev}"); 9].join(", ");
        text.push_str(&format!("{name}: &{name} [{refs}]\n"));
    }
    let path = dir.path().join("bomb.yaml");
    std::fs::write(&path, &text).unwrap();
    let e = load(&ConfigSource::File(path.clone()), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bomb.yaml") && e.contains("alias bomb") && e.contains("`*name`"),
        "{e}"
    );
    let tools = dir.path().join("tools.yaml");
    std::fs::write(&tools, format!("{text}tools: []\n")).unwrap();
    let e = crate::reward::tools::ToolPool::start(
        &crate::reward::tools::ToolSource {
            tool_config_path: Some(tools),
            function_tool_path: None,
            interaction_config_path: None,
        },
        Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("tools.yaml is not valid YAML") && e.contains("alias bomb"),
        "{e}"
    );
}

/// `data.sampler`: a module needs its class and the other way round, and verl's rule that a
/// custom sampler runs without loader workers (its default is 8).
#[test]
fn rule_custom_sampler() {
    let p = "data.sampler.class_path=pkg://my.samplers";
    assert!(resolved(&[
        p,
        "data.sampler.class_name=S",
        "data.dataloader_num_workers=0"
    ])
    .is_ok());
    let e = rule_error(&[p, "data.sampler.class_name=S"]);
    assert!(
        e.contains("`data.dataloader_num_workers` (8) must be 0 with a custom sampler"),
        "{e}"
    );
    let e = rule_error(&[p, "data.dataloader_num_workers=0"]);
    assert!(
        e.contains("`data.sampler.class_path` (pkg://my.samplers) needs `data.sampler.class_name`"),
        "{e}"
    );
    let e = rule_error(&["data.sampler.class_name=S"]);
    assert!(
        e.contains("`data.sampler.class_name` (S) is set without `data.sampler.class_path`"),
        "{e}"
    );
    // Without a sampler the worker count has no effect.
    assert!(resolved(&["data.dataloader_num_workers=4"]).is_ok());
}
