//! Hydra config groups, verl's engines and v1 keys, and verl's own config folder.

use std::path::{Path, PathBuf};

use super::model::Precision;
use super::*;

fn load_with(source: &ConfigSource, overrides: &[&str]) -> Result<Loaded, ConfigError> {
    load(
        source,
        &overrides.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    )
}

fn builtin(overrides: &[&str]) -> Result<Loaded, ConfigError> {
    load_with(&ConfigSource::Builtin, overrides)
}

fn write(root: &Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

/// A folder of config groups over real keys: `batch` (at `data`), `lr` (at the actor's optim,
/// its option named after the `batch` option chosen), `late` (after `_self_`), `glob` (a
/// `# @package _global_` file), `warm` (reached from `lr` by a relative group and an absolute
/// package).
fn group_folder() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let r = d.path();
    write(
        r,
        "main.yaml",
        "defaults:
  - ppo_trainer
  - batch@data: small
  - optional sched@actor_rollout_ref.actor.optim: none_such
  - lr@actor_rollout_ref.actor.optim: ${batch}_lr
  - glob: g
  - _self_
  - late@data: last
data:
  train_batch_size: 7
  max_prompt_length: 99
",
    );
    write(
        r,
        "batch/small.yaml",
        "train_batch_size: 16\nmax_prompt_length: 64\n",
    );
    write(r, "batch/big.yaml", "train_batch_size: 64\n");
    write(
        r,
        "lr/small_lr.yaml",
        "defaults:\n  - ../warm@_global_.data: three\n  - _self_\nlr: 0.25\n",
    );
    write(r, "lr/big_lr.yaml", "lr: 0.5\n");
    write(r, "warm/three.yaml", "val_batch_size: 3\n");
    write(r, "late/last.yaml", "max_response_length: 32\n");
    write(
        r,
        "glob/g.yaml",
        "# @package _global_\ntrainer:\n  total_epochs: 5\n",
    );
    write(
        r,
        "child.yaml",
        "defaults:\n  - main\n  - override batch@data: big\n  - _self_\n",
    );
    d
}

fn hydra(dir: &Path, name: &str) -> ConfigSource {
    ConfigSource::Hydra {
        dir: dir.to_path_buf(),
        name: name.into(),
    }
}

#[test]
fn defaults_lists_compose_like_hydra() {
    let d = group_folder();
    let l = load_with(&hydra(d.path(), "main"), &[]).unwrap();
    let c = &l.config;
    assert_eq!(
        c.data.train_batch_size, 7,
        "the file's own keys after its groups"
    );
    assert_eq!(c.data.max_prompt_length, 99);
    assert_eq!(c.data.max_response_length, 32, "an entry after _self_ wins");
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 0.25, "${{batch}}_lr");
    assert_eq!(c.data.val_batch_size, Some(3), "../warm@_global_.data");
    assert_eq!(c.trainer.total_epochs, 5, "# @package _global_");
    assert!(l.groups.contains(&("batch".into(), "small".into())));
    // The command line chooses another option; the interpolated option follows it.
    let l = load_with(&hydra(d.path(), "main"), &["batch@data=big"]).unwrap();
    assert_eq!(l.config.actor_rollout_ref.actor.optim.lr, 0.5);
    assert_eq!(
        l.config.data.val_batch_size, None,
        "big_lr has no warm entry"
    );
    // An `override` entry of a config that includes another.
    let l = load_with(&hydra(d.path(), "child"), &[]).unwrap();
    assert_eq!(l.config.actor_rollout_ref.actor.optim.lr, 0.5);
    // The command line wins over the file's override.
    let l = load_with(&hydra(d.path(), "child"), &["batch@data=small"]).unwrap();
    assert_eq!(l.config.actor_rollout_ref.actor.optim.lr, 0.25);
    // `~group` drops an entry, `+group=option` adds one.
    let l = load_with(&hydra(d.path(), "main"), &["~late@data"]).unwrap();
    assert_eq!(l.config.data.max_response_length, 512);
    write(d.path(), "extra/more.yaml", "max_response_length: 48\n");
    let l = load_with(&hydra(d.path(), "main"), &["+extra@data=more"]).unwrap();
    assert_eq!(l.config.data.max_response_length, 48);
    // Keys of the group files count as set by the user (they are not verl's).
    assert!(l.user_set.contains("data.train_batch_size"));
}

#[test]
fn defaults_list_errors_name_the_entry_and_the_file() {
    let d = group_folder();
    let e = load_with(&hydra(d.path(), "main"), &["batch@data=huge"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("batch@data=huge") && e.contains("batch/huge.yaml") && e.contains("main.yaml"),
        "{e}"
    );
    write(d.path(), "broken.yaml", "defaults:\n  - batch@data: nope\n");
    let e = load_with(&hydra(d.path(), "broken"), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&d.path().join("broken.yaml").display().to_string())
            && e.contains("defaults entry `batch@data: nope`")
            && e.contains("batch/nope.yaml"),
        "{e}"
    );
    write(d.path(), "late/typo.yaml", "train_bach_size: 3\n");
    let e = load_with(&hydra(d.path(), "main"), &["late@data=typo"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("late/typo.yaml") && e.contains("data.train_bach_size"),
        "{e}"
    );
    let e = load_with(&hydra(d.path(), "main"), &["nosuch@data=x"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("nosuch@data") && e.contains("+nosuch@data=OPTION"),
        "{e}"
    );
    write(d.path(), "loop.yaml", "defaults:\n  - loop\n");
    let e = load_with(&hydra(d.path(), "loop"), &[])
        .unwrap_err()
        .to_string();
    assert!(e.contains("nest more than"), "{e}");
    let e = load_with(&hydra(d.path(), "absent"), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("absent.yaml") && e.contains("no such config file"),
        "{e}"
    );
}

#[test]
fn verls_group_selections_on_the_built_in_defaults() {
    // verl's names without its folder: the built-in stand-ins.
    let l = builtin(&["model_engine=veomni"]).unwrap();
    for o in [
        &l.config.actor_rollout_ref.actor.optim,
        &l.config.critic.optim,
    ] {
        assert_eq!(
            o.scheduler(),
            LrSchedulerType::Cosine,
            "VeOmni's optimizer defaults to a cosine schedule"
        );
    }
    assert!(l.notices.iter().any(|n| n.contains("model_engine=veomni")));
    assert!(
        l.no_effect.is_empty(),
        "verl's own defaults are not reported: {:?}",
        l.no_effect
    );
    let mega = load_with(
        &hydra(Path::new("no/such/config"), "ppo_megatron_trainer"),
        &[],
    )
    .unwrap();
    assert!(mega
        .groups
        .contains(&("model_engine".into(), "megatron".into())));
    assert!(
        mega.notices.iter().any(|n| n.contains("built-in")),
        "{:?}",
        mega.notices
    );
    assert_eq!(mega.config.actor_rollout_ref.actor.optim.optimizer, "AdamW");
    assert!(mega
        .notices
        .iter()
        .any(|n| n.contains("adam is Megatron's Adam")));
    assert_eq!(
        mega.config,
        builtin(&["model_engine=megatron"]).unwrap().config
    );
    let e = builtin(&["actor@actor_rollout_ref.actor=mlite_actor"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("actor@actor_rollout_ref.actor=mlite_actor")
            && e.contains("actor/mlite_actor.yaml")
            && e.contains("dp_actor, megatron_actor"),
        "{e}"
    );
    let e = builtin(&[
        "actor@actor_rollout_ref.actor=mlite_actor",
        "hydra.searchpath=[pkg://verl_mlite.config]",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("pkg://verl_mlite.config (a Python package"),
        "{e}"
    );
    let e = builtin(&["model_engine=torchtitan"])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("model_engine = \"torchtitan\": not supported"),
        "{e}"
    );
}

#[test]
fn engine_keys_that_change_the_update_are_mapped_or_refused() {
    let a = "actor_rollout_ref.actor";
    let l = builtin(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
        "actor_rollout_ref.actor.optim.min_lr=1e-7",
        "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        "critic.model.fsdp_config.param_offload=True",
    ])
    .unwrap();
    let o = &l.config.actor_rollout_ref.actor.optim;
    assert_eq!(o.scheduler(), LrSchedulerType::Cosine);
    assert!((o.min_lr_ratio - 0.1).abs() < 1e-12, "{}", o.min_lr_ratio);
    for k in [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
        "critic.model.fsdp_config.param_offload",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method",
    ] {
        assert!(l.no_effect.iter().any(|n| n == k), "{k}: {:?}", l.no_effect);
    }
    // A floor with a constant schedule does nothing, in verl too: reported.
    let l = builtin(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.optim.min_lr=1e-7",
    ])
    .unwrap();
    assert!(l.no_effect.iter().any(|n| n.ends_with("optim.min_lr")));
    for (ov, key) in [
        ("optim.lr_decay_style=WSD", "optim.lr_decay_style"),
        ("optim.lr_warmup_init=1e-7", "optim.lr_warmup_init"),
        ("optim.lr_decay_steps=10", "optim.lr_decay_steps"),
        ("optim.exp_avg_dtype=bf16", "optim.exp_avg_dtype"),
        ("fsdp.model_dtype=bf16", "fsdp.model_dtype"),
        ("load_weight=False", "load_weight"),
        ("router_replay.mode=R3", "router_replay.mode"),
        (
            "megatron.router_replay.mode=R2",
            "megatron.router_replay.mode",
        ),
        (
            "megatron.override_transformer_config.normalization=LayerNorm",
            "megatron.override_transformer_config.normalization",
        ),
    ] {
        let e = builtin(&[&format!("+{a}.{ov}")]).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{a}.{key} = ")) && e.contains("not supported"),
            "{ov}: {e}"
        );
    }
    // Both the engine key and main_ppo's key, disagreeing.
    let e = builtin(&[
        "+actor_rollout_ref.actor.optim.lr_decay_style=cosine",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("lr_decay_style") && e.contains("lr_scheduler_type"),
        "{e}"
    );
    // verl 1dda039's precision key of the FSDP engine.
    let c = builtin(&[
        "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
        "+critic.fsdp.dtype=bfloat16",
    ])
    .unwrap()
    .config;
    assert_eq!(
        c.actor_rollout_ref
            .actor
            .fsdp_config
            .mixed_precision
            .param_dtype,
        Precision::Bf16
    );
    assert_eq!(
        c.critic.model.fsdp_config.mixed_precision.param_dtype,
        Precision::Bf16
    );
    let e = builtin(&["actor_rollout_ref.actor.fsdp_config.dtype=float16"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("param_dtype") && e.contains("float16"), "{e}");
}

#[test]
fn v1_trainer_keys() {
    let l = builtin(&["trainer.use_v1=True", "trainer.v1.trainer_mode=sync"]).unwrap();
    assert_eq!(l.config, Config::default(), "sync is main_ppo's loop");
    assert!(l.no_effect.iter().any(|k| k == "trainer.use_v1"));
    for mode in ["colocate_async", "separate_async"] {
        let e = builtin(&[&format!("trainer.v1.trainer_mode={mode}")])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "trainer.v1.trainer_mode = \"{mode}\": not supported"
            )) && e.contains("asynchronous")
                && !e.contains('\n'),
            "{e}"
        );
    }
    let e = builtin(&["trainer.v1.sampler.custom_sampler.path=my.py"])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("trainer.v1.sampler.custom_sampler.path"),
        "{e}"
    );
}

#[test]
fn legacy_reward_kwargs_move_under_reward() {
    // DAPO's overlong penalty, as verl's b178a3c scripts set it.
    let c = builtin(&[
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward_model.reward_kwargs.max_resp_len=8192",
    ])
    .unwrap()
    .config;
    assert_eq!(
        c.reward.reward_kwargs["overlong_buffer_cfg"]["enable"],
        serde_json::json!(true)
    );
    assert_eq!(
        c.reward.reward_kwargs["max_resp_len"],
        serde_json::json!(8192)
    );
    assert_eq!(c.reward.reward_manager.name, RewardManagerName::Dapo);
}

#[test]
fn hydra_escapes_and_blank_arguments() {
    let l = builtin(&[
        r"+actor_rollout_ref.actor.fsdp_config.turbo_config.distributed.fsdp_plan.apply_modules={model.layers.\{*\}:{},lm_head:{}}",
        " ",
    ])
    .unwrap();
    assert!(l.notices.iter().any(|n| n.contains("blank")));
}

// ---- verl's own config folder (from the PyPI wheel; scripts/fetch_verl_config.sh) ----

/// verl's `verl/trainer/config` of a release (MAIN_PPO_VERL_CONFIG: 0.9.1, nearest 1dda039;
/// MAIN_PPO_VERL_CONFIG_OLD: 0.7.0, nearest b178a3c), when fetched.
fn verl_folders() -> Vec<(PathBuf, &'static [&'static str])> {
    let found: Vec<(PathBuf, &[&str])> = [
        ("MAIN_PPO_VERL_CONFIG", &[][..]),
        ("MAIN_PPO_VERL_CONFIG_OLD", OLDER_DEFAULTS),
    ]
    .iter()
    .filter_map(|(v, changed)| std::env::var_os(v).map(|p| (PathBuf::from(p), *changed)))
    .collect();
    if found.is_empty() {
        eprintln!("skipped: MAIN_PPO_VERL_CONFIG is not set (scripts/fetch_verl_config.sh fetches verl's config folder; .ci/run sets it)");
    }
    found
}

/// Keys whose value verl's folder spells as an interpolation of another key (`${oc.select:...}`)
/// where main_ppo's default is null meaning the same key: equal in effect (the plans agree).
const SAME_BY_INTERPOLATION: &[&str] = &[
    "actor_rollout_ref.actor.checkpoint.load_contents",
    "critic.checkpoint.load_contents",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "critic.ppo_mini_batch_size",
    "critic.use_dynamic_bsz",
    "critic.forward_max_token_len_per_gpu",
    "critic.ppo_epochs",
    "critic.shuffle",
    "critic.loss_agg_mode",
    "critic.forward_micro_batch_size_per_gpu",
    "critic.model.tokenizer_path",
    "trainer.default_local_dir",
    "distillation.teacher_models.teacher_model.inference.dtype",
];

/// Defaults verl 0.7.0 (the release before b178a3c) had and later verl changed: rollout's
/// `max_num_seqs` was 1024 (256 from b178a3c on), and the rollout kept no log-probs of its
/// own (`calculate_log_probs: False`; True in 0.9.1 and 1dda039, which rollout correction
/// reads).
const OLDER_DEFAULTS: &[&str] = &[
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.calculate_log_probs",
];

/// b178a3c's critic (and Megatron's actor) is padded by default (`use_remove_padding: False`):
/// packed and padded sequences give the same results here.
const SAME_RESULTS: &[&str] = &[
    "critic.model.use_remove_padding",
    "actor_rollout_ref.model.use_remove_padding",
];

fn differing_leaves(a: &Config, b: &Config) -> Vec<String> {
    let (a, b) = (
        serde_yaml_ng::to_value(a).unwrap(),
        serde_yaml_ng::to_value(b).unwrap(),
    );
    let mut leaves = Vec::new();
    tree::leaves(&a, &mut Vec::new(), &mut leaves);
    leaves
        .into_iter()
        .filter(|p| tree::get(&a, p) != tree::get(&b, p))
        .map(|p| tree::join(&p))
        .collect()
}

const VALID: &[&str] = &[
    "data.train_batch_size=256",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "critic.ppo_micro_batch_size_per_gpu=4",
];

#[test]
fn verls_folder_composes_to_the_built_in_defaults() {
    for (dir, changed) in verl_folders() {
        for (name, groups) in [
            ("ppo_trainer", vec![]),
            ("ppo_megatron_trainer", vec![]),
            ("ppo_trainer", vec!["model_engine=veomni"]),
        ] {
            if !groups.is_empty() && !dir.join("model_engine").is_dir() {
                continue; // b178a3c's folder has no model_engine group
            }
            let mut ovs: Vec<&str> = VALID.to_vec();
            ovs.extend(groups.iter());
            let from_verl = load_with(&hydra(&dir, name), &ovs)
                .unwrap_or_else(|e| panic!("{} {name} {groups:?}: {e}", dir.display()));
            assert!(
                from_verl.no_effect.is_empty(),
                "verl's own defaults are not reported: {:?}",
                from_verl.no_effect
            );
            let same = load_with(&hydra(Path::new("/nonexistent"), name), &ovs).unwrap();
            let differ: Vec<String> = differing_leaves(&from_verl.config, &same.config)
                .into_iter()
                .filter(|k| {
                    !SAME_BY_INTERPOLATION.contains(&k.as_str())
                        && !SAME_RESULTS.contains(&k.as_str())
                        && !changed.contains(&k.as_str())
                })
                .collect();
            assert!(
                differ.is_empty(),
                "{} {name} {groups:?}: verl's folder and the built-in defaults differ at {differ:?}",
                dir.display()
            );
            // The plans agree once the built-in defaults take the folder's older values.
            let tree_of = |c: &Config| serde_yaml_ng::to_value(c).unwrap();
            let theirs = tree_of(&from_verl.config);
            let older: Vec<String> = changed
                .iter()
                .filter_map(|k| {
                    let path: Vec<String> = k.split('.').map(String::from).collect();
                    let v = tree::get(&theirs, &path)?;
                    let text = serde_yaml_ng::to_string(v).unwrap();
                    Some(format!("{k}={}", text.trim()))
                })
                .collect();
            let mut ovs2 = ovs.clone();
            ovs2.extend(older.iter().map(String::as_str));
            let same = load_with(&hydra(Path::new("/nonexistent"), name), &ovs2).unwrap();
            let (p, q) = (
                resolve(&from_verl.config).unwrap(),
                resolve(&same.config).unwrap(),
            );
            assert_eq!(p, q, "{} {name}: the plans differ", dir.display());
        }
    }
}

#[test]
fn every_key_of_verls_generated_trees_is_known() {
    for (dir, _) in verl_folders() {
        let mut seen = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if !name.starts_with("_generated_ppo") {
                continue;
            }
            seen += 1;
            // verl's whole tree, every key at verl's default, as a user file.
            match load_with(&ConfigSource::File(p.clone()), &[]) {
                Ok(_) => {}
                Err(e) if name.contains("torchtitan") => {
                    let e = e.to_string();
                    assert!(
                        e.contains("torchtitan") && e.contains("not supported"),
                        "{e}"
                    );
                }
                Err(e) => panic!("{}: {e}", p.display()),
            }
        }
        assert!(seen >= 2, "{}: no _generated_ppo*.yaml", dir.display());
    }
}
