//! The checks a run makes before it reads any weight, shared by training
//! ([`crate::trainer::Trainer::with_plan`]) and `main_ppo config check`, so that the check
//! refuses exactly what training would, naming the key: every path the configuration names
//! ([`super::setup::check_paths`]), each model's context and LoRA rank from its header, every
//! tokenizer (the actor's, the critic's, the teachers') against the model that reads its ids,
//! and the names of `trainer.logger`'s backends. A remote backend's SDK is imported by training
//! when its tracker starts, before any weight is read; `config check` imports it the same way
//! ([`tracker_sdks`]).

use crate::config::{Config, ConfigError, ModelConfig, Plan};
use crate::model::ModelArgs;

/// Everything training checks before it reads a weight (see the module's documentation).
pub fn run(cfg: &Config, plan: &Plan) -> Result<(), ConfigError> {
    super::setup::check_paths(cfg, plan)?;
    model_context(cfg, plan)?;
    critic_tokenizer(cfg, plan)?;
    loggers(cfg)
}

/// A local model folder with a `config.json`, or a `.gguf` file.
fn has_local_config(path: &str) -> bool {
    let p = std::path::PathBuf::from(crate::util::expand_home(path));
    p.join("config.json").is_file() || (p.is_file() && path.ends_with(".gguf"))
}

/// A LoRA adapter folder or part of a LoRA checkpoint, given as a model path.
fn is_adapter(path: &str) -> bool {
    let p = std::path::PathBuf::from(crate::util::expand_home(path));
    p.is_dir() && crate::weights::peft::adapter_behind(&p).is_some()
}

/// Prompt plus response must fit the context of the actor (and the critic, when the run has
/// one), read from the model's header or `config.json` without loading weights, and
/// a LoRA rank must fit the projections it adapts (`lora_rank`, or the `r` of
/// `lora_adapter_path`'s `adapter_config.json`; [`crate::weights::peft::rank_problem`]); a
/// model whose `config.json` names an architecture or feature not implemented is refused. A
/// model whose configuration cannot be read here (a hub id not in the cache, a folder without
/// `config.json`) is checked when training loads it.
pub fn model_context(cfg: &Config, plan: &Plan) -> Result<(), ConfigError> {
    let mut models = vec![("actor_rollout_ref.model", &cfg.actor_rollout_ref.model)];
    if plan.need_critic {
        models.push(("critic.model", &cfg.critic.model));
    }
    for (group, m) in models {
        let key = format!("{group}.path");
        let path = &m.path;
        match crate::weights::read_args(path, &m.override_config) {
            Ok(Some(args)) => {
                crate::config::data::check_model_context(
                    plan.prompt_length,
                    plan.response_length,
                    args.max_position_embeddings,
                    &key,
                    path,
                )?;
                lora_rank(group, m, &args)?;
                train_dropout(group, path, &args)?;
                if group == "actor_rollout_ref.model" {
                    vision_student(&args, plan)?;
                }
                // The actor's tokenizer must not reach past its embedding rows.
                let tok = super::setup::tokenizer_override(cfg).unwrap_or(path);
                if group == "actor_rollout_ref.model" && has_local_config(path) {
                    if let Ok(t) = crate::weights::load_tokenizer(tok) {
                        crate::weights::check_vocab(&args, &t, path).map_err(|e| {
                            ConfigError::Value {
                                key: key.clone(),
                                message: e.to_string(),
                            }
                        })?;
                    }
                }
            }
            Ok(None) => tracing::info!(
                "`{key}` = {path}: not readable without a download; its context is checked when training loads it"
            ),
            // A local model whose configuration says this implementation cannot run it
            // (another architecture, a feature of its config.json), or a LoRA adapter folder
            // given as a model: training would stop there.
            Err(e) if has_local_config(path) || is_adapter(path) => {
                return Err(ConfigError::Value {
                    key,
                    message: format!("{path}: {e}"),
                })
            }
            Err(e) => tracing::info!(
                "`{key}`: cannot read the model's configuration ({e}); its context is checked when training loads it"
            ),
        }
    }
    teachers(cfg, plan)
}

/// On-policy distillation of a vision-language student is refused: the teachers would read the
/// image placeholder tokens without the images.
pub(crate) fn vision_student(args: &ModelArgs, plan: &Plan) -> Result<(), ConfigError> {
    if args.vision.is_some() && plan.distillation.is_some() {
        return Err(ConfigError::Value {
            key: "distillation.enabled".into(),
            message: "on-policy distillation of a vision-language student is not supported: the teachers would read the image placeholder tokens without the images".into(),
        });
    }
    Ok(())
}

/// A model that trains must not ask for dropout: verl's update runs it in train mode, where
/// transformers applies `attention_dropout` (and Seed-OSS's `residual_dropout`), while its
/// log-prob passes run in eval mode without; the model here has no dropout, so its updates
/// would not be verl's. Refused naming the key and how to train without it (the same setting
/// in verl gives the same computation). transformers' SeedOssConfig defaults both to 0.1.
pub(crate) fn train_dropout(group: &str, path: &str, args: &ModelArgs) -> Result<(), ConfigError> {
    for (key, p) in [
        ("attention_dropout", args.attention_dropout),
        ("residual_dropout", args.residual_dropout),
    ] {
        if p > 0.0 {
            return Err(ConfigError::Value {
                key: format!("{group}.path"),
                message: format!(
                    "{path}: config.json sets {key} {p}: verl trains with it (its update runs the model in train mode), and main_ppo's model has no dropout; set {group}.override_config.{key}=0.0 to train without it (verl then computes the same)"
                ),
            });
        }
    }
    Ok(())
}

/// Distillation's teachers, as [`model_context`] checks the actor: a local teacher's
/// configuration must name a supported architecture and fit prompt plus response (+1, verl's
/// rule), and its tokenizer must equal the student's (both read from local files only; a hub
/// teacher is checked when training loads it).
fn teachers(cfg: &Config, plan: &Plan) -> Result<(), ConfigError> {
    let Some(d) = &plan.distillation else {
        return Ok(());
    };
    let student_path = cfg
        .data
        .tokenizer
        .as_deref()
        .or(cfg.actor_rollout_ref.model.tokenizer_path.as_deref())
        .unwrap_or(&cfg.actor_rollout_ref.model.path);
    let student = has_local_config(student_path)
        .then(|| crate::weights::load_tokenizer(student_path).ok())
        .flatten();
    for t in &d.teachers {
        let key = format!("distillation.teacher_models.{}.model_path", t.name);
        let path = &t.model_path;
        if !has_local_config(path) {
            tracing::info!(
                "`{key}` = {path}: not a local model; it is checked when training loads it"
            );
            continue;
        }
        let args = crate::weights::read_args(path, &Default::default()).map_err(|e| {
            ConfigError::Value {
                key: key.clone(),
                message: format!("{path}: {e}"),
            }
        })?;
        if let Some(args) = args {
            crate::config::data::check_model_context(
                plan.prompt_length,
                plan.response_length + 1,
                args.max_position_embeddings,
                &key,
                path,
            )?;
        }
        if let (Some(ours), Ok(theirs)) = (&student, crate::weights::load_tokenizer(path)) {
            if let Some(why) = super::teacher::vocabulary_difference(ours, &theirs) {
                return Err(ConfigError::Value {
                    key,
                    message: format!(
                        "{path}: {why}; a teacher must read the student's token ids (same tokenizer)"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The LoRA rank `m` (the `group` of the configuration) asks for against the projections of a
/// model of `args`, as training checks it before allocating adapters; an adapter folder's
/// `adapter_config.json` is read (not its tensors). An adapter folder that cannot be read here
/// is left to training, which reads it whole.
fn lora_rank(group: &str, m: &ModelConfig, args: &ModelArgs) -> Result<(), ConfigError> {
    if !m.is_lora() {
        return Ok(());
    }
    let (spec, adapter) = match &m.lora_adapter_path {
        None => (super::setup::lora_spec(m), None),
        Some(p) => {
            let path = std::path::PathBuf::from(crate::util::expand_home(p));
            match crate::weights::peft::read_adapter_config(&path) {
                Ok((dir, spec, _)) => (spec, Some(dir)),
                Err(e) => {
                    tracing::info!(
                        "`{group}.lora_adapter_path` = {p}: {e}; the adapter is checked when training reads it"
                    );
                    return Ok(());
                }
            }
        }
    };
    let projections = crate::weights::peft::projections_of(args);
    super::setup::check_lora_rank(&spec, adapter.as_deref(), group, projections)
}

/// The critic must read the actor's token ids (training's rule when it loads the critic): the
/// tokenizer the critic is loaded with (`critic.model.tokenizer_path`, else the actor's
/// `tokenizer_path`, else the critic model's own; a `.gguf` file gives its own tokenizer) must
/// load and have as many tokens as the actor's. Read from local files only; a hub id is checked
/// when training loads it.
fn critic_tokenizer(cfg: &Config, plan: &Plan) -> Result<(), ConfigError> {
    if !plan.need_critic {
        return Ok(());
    }
    let c = &cfg.critic.model;
    let (key, path) = match (
        &c.tokenizer_path,
        &cfg.actor_rollout_ref.model.tokenizer_path,
    ) {
        (Some(t), _) => ("critic.model.tokenizer_path", t),
        (None, Some(t)) => ("actor_rollout_ref.model.tokenizer_path", t),
        (None, None) => ("critic.model.path", &c.path),
    };
    if !is_local(path) {
        return Ok(());
    }
    let folder = std::path::PathBuf::from(crate::util::expand_home(path));
    let actor_path =
        super::setup::tokenizer_override(cfg).unwrap_or(&cfg.actor_rollout_ref.model.path);
    if same_place(path, actor_path) {
        // The actor's own tokenizer (verl's older config folders set the critic's
        // tokenizer_path to the actor's model path): checked, or left to loading, as the
        // actor's.
        return Ok(());
    }
    if key == "critic.model.path" && folder.is_dir() && !folder.join("tokenizer.json").is_file() {
        // The model's own folder without a tokenizer: as for the actor's, left to loading
        // (`config check` says the prompt lengths were not checked).
        tracing::info!("`{key}` = {path}: no tokenizer.json; the critic's tokenizer is checked when training loads it");
        return Ok(());
    }
    let theirs = crate::weights::load_tokenizer(path).map_err(|e| ConfigError::Value {
        key: key.into(),
        message: format!("the critic's tokenizer: {e}"),
    })?;
    if !is_local(actor_path) {
        return Ok(());
    }
    let Ok(ours) = crate::weights::load_tokenizer(actor_path) else {
        return Ok(()); // the actor's own checks report it
    };
    let (theirs_n, ours_n) = (
        theirs.tokenizer.get_vocab_size(true),
        ours.tokenizer.get_vocab_size(true),
    );
    if theirs_n != ours_n {
        return Err(ConfigError::Value {
            key: key.into(),
            message: format!(
                "{path}: the critic's tokenizer has {theirs_n} tokens, the actor's ({actor_path}) {ours_n}: the critic must read the actor's token ids"
            ),
        });
    }
    Ok(())
}

/// Whether two configured paths name the same file or folder (after `~` and symlinks).
fn same_place(a: &str, b: &str) -> bool {
    let full = |p: &str| {
        let p = std::path::PathBuf::from(crate::util::expand_home(p));
        p.canonicalize().unwrap_or(p)
    };
    full(a) == full(b)
}

/// A local model folder or file (a `.gguf`), as opposed to a hub id.
fn is_local(path: &str) -> bool {
    std::path::Path::new(&crate::util::expand_home(path)).exists()
}

/// `trainer.logger`: every backend is one main_ppo knows (a misspelled name is refused naming
/// the closest), as the tracker's start refuses it.
fn loggers(cfg: &Config) -> Result<(), ConfigError> {
    crate::metrics::check_backends(&cfg.trainer.logger.to_vec())
        .map_err(|m| ConfigError::Invalid(vec![m]))
}

/// `config check`: each remote backend of `trainer.logger` (wandb, mlflow, ...) has its SDK
/// importable by `reward.python`, the interpreter its tracker worker runs on: the import
/// training's tracker start makes before any weight is read, with the same error.
pub fn tracker_sdks(cfg: &Config) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    for b in cfg.trainer.logger.to_vec() {
        if let Err(e) = crate::metrics::remote::probe_sdk(&b, &cfg.reward.python) {
            problems.push(e);
        }
    }
    match problems.is_empty() {
        true => Ok(()),
        false => Err(ConfigError::Invalid(problems)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigSource;
    use std::path::Path;

    /// `config check` on distillation's teachers, from local files only: a teacher whose
    /// tokenizer differs from the student's, one of an architecture not implemented and one
    /// too short for prompt + response + 1 are refused naming the teacher's key; the student's
    /// twin passes.
    #[test]
    fn config_check_reads_the_teachers_config_and_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let model = |name: &str, max_pos: usize| {
            let d = dir.path().join(name);
            crate::testing::write_tokenizer_dir(&d).unwrap();
            let mut args = crate::model::ModelArgs::tiny(crate::model::Arch::Llama, 259);
            args.max_position_embeddings = max_pos;
            std::fs::write(d.join("config.json"), args.to_hf().to_string()).unwrap();
            d
        };
        let student = model("student", 4096);
        let check = |teacher: &Path| {
            let o = vec![
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".to_string(),
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
                "algorithm.adv_estimator=grpo".into(),
                "data.max_prompt_length=128".into(),
                "data.max_response_length=6".into(),
                format!("actor_rollout_ref.model.path={}", student.display()),
                "distillation.enabled=True".into(),
                format!(
                    "distillation.teacher_models.teacher_model.model_path={}",
                    teacher.display()
                ),
            ];
            let cfg = crate::config::load(&ConfigSource::Builtin, &o)
                .unwrap()
                .config;
            let plan = crate::config::resolve(&cfg).unwrap();
            model_context(&cfg, &plan).map_err(|e| e.to_string())
        };
        let key = "distillation.teacher_models.teacher_model.model_path";
        check(&model("twin", 4096)).unwrap();
        let short = model("short", 134);
        let e = check(&short).unwrap_err();
        assert!(e.contains(key) && e.contains("134"), "{e}");
        let swapped = model("swapped", 4096);
        let path = swapped.join("tokenizer.json");
        let mut tok: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = (vocab["x"].clone(), vocab["y"].clone());
        vocab.insert("x".into(), b);
        vocab.insert("y".into(), a);
        std::fs::write(&path, tok.to_string()).unwrap();
        let e = check(&swapped).unwrap_err();
        assert!(e.contains(key) && e.contains("same tokenizer"), "{e}");
        let other = model("other", 4096);
        let config =
            serde_json::json!({"architectures": ["FalconForCausalLM"], "model_type": "falcon"});
        std::fs::write(other.join("config.json"), config.to_string()).unwrap();
        let e = check(&other).unwrap_err();
        assert!(e.contains(key) && e.contains("FalconForCausalLM"), "{e}");
    }

    /// `config check` refuses a LoRA rank larger than the projections it adapts from the
    /// model's `config.json` alone, naming the key, for the actor, the critic and an adapter
    /// folder's `r`; a rank that fits passes. (Training refuses the same ranks:
    /// `trainer::tests_lora`.)
    #[test]
    fn a_lora_rank_beyond_the_model_is_refused_from_its_config() {
        let dir = tempfile::tempdir().unwrap();
        let args = crate::model::ModelArgs::tiny(crate::model::Arch::Qwen3Moe, 259);
        std::fs::write(dir.path().join("config.json"), args.to_hf().to_string()).unwrap();
        let check = |extra: &[String]| {
            let mut o = vec![
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".to_string(),
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
                "critic.ppo_micro_batch_size_per_gpu=4".into(),
                "data.max_prompt_length=128".into(),
                "data.max_response_length=6".into(),
                format!("actor_rollout_ref.model.path={}", dir.path().display()),
                format!("critic.model.path={}", dir.path().display()),
            ];
            o.extend(extra.iter().cloned());
            let cfg = crate::config::load(&ConfigSource::Builtin, &o)
                .unwrap()
                .config;
            let plan = crate::config::resolve(&cfg).unwrap();
            model_context(&cfg, &plan).map_err(|e| e.to_string())
        };
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        // The widest adapted projections (q_proj, o_proj, the dense layer's MLP) have a smaller
        // side of 32: 32 fits all-linear (above k_proj's and the experts' 16, with a warning),
        // 33 does not; up_proj alone: the dense layer's [48, 32] allows 32 as well.
        check(&s(&["actor_rollout_ref.model.lora_rank=32"])).unwrap();
        for (extra, key) in [
            (
                s(&["actor_rollout_ref.model.lora_rank=10000000"]),
                "actor_rollout_ref.model.lora_rank",
            ),
            (
                s(&[
                    "algorithm.adv_estimator=gae",
                    "critic.model.lora_rank=33",
                    "critic.model.target_modules=[up_proj]",
                ]),
                "critic.model.lora_rank",
            ),
        ] {
            let e = check(&extra).unwrap_err();
            assert!(e.contains(key) && e.contains("32"), "{e}");
        }
        // The dense layer 1 (mlp_only_layers) has up_proj [48, 32]: 17 fits there alone, 33
        // does not.
        let layer_1 = "actor_rollout_ref.model.target_modules=model\\.layers\\.1\\.mlp\\.up_proj";
        check(&s(&["actor_rollout_ref.model.lora_rank=17", layer_1])).unwrap();
        let e = check(&s(&["actor_rollout_ref.model.lora_rank=33", layer_1])).unwrap_err();
        assert!(e.contains("33") && e.contains("[48, 32]"), "{e}");
        // An adapter folder that is not there (yet) is left to training.
        let adapter = dir.path().join("adapter");
        check(&[format!(
            "actor_rollout_ref.model.lora_adapter_path={}",
            adapter.display()
        )])
        .unwrap();
        std::fs::create_dir(&adapter).unwrap();
        let config = serde_json::json!({"peft_type": "LORA", "r": 10_000_000, "lora_alpha": 8, "target_modules": ["q_proj"]});
        std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
        let e = check(&[format!(
            "actor_rollout_ref.model.lora_adapter_path={}",
            adapter.display()
        )])
        .unwrap_err();
        assert!(
            e.contains("actor_rollout_ref.model.lora_adapter_path")
                && e.contains("adapter_config.json")
                && e.contains("10000000")
                && e.contains("32"),
            "{e}"
        );
    }
}
