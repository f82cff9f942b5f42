//! Output files never replace a command's inputs: `--output` naming the same file as `--input`
//! (or the `--config` file) is refused before any work, however it is spelt (`./x`, a symlink,
//! a hard link), and a missing output folder is reported before hours of generation, not after.

use std::path::Path;

use crate::config::{Config, ConfigError, ConfigSource, ModelConfig, Plan};
use crate::model::ModelArgs;

use super::ConfigArgs;

/// Refuses `output` (from `--output`) when it is `input` (from `--input`) or the YAML file the
/// configuration flags name; see [`check_output`].
pub fn check_output_args(
    output: &Path,
    input: &Path,
    config: &ConfigArgs,
) -> Result<(), ConfigError> {
    let yaml = match config.source() {
        Ok(ConfigSource::File(f)) => Some(f),
        Ok(ConfigSource::Hydra { dir, name }) => {
            Some(dir.join(format!("{name}.yaml"))).filter(|f| f.is_file())
        }
        _ => None,
    };
    let mut inputs = vec![("--input", input)];
    if let Some(y) = &yaml {
        inputs.push(("the configuration file", y.as_path()));
    }
    check_output(output, "--output", &inputs)
}

/// Whether `a` and `b` are one file on disk. Both must exist; a path that does not exist is
/// never the same as anything.
pub fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(ma), Ok(mb)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        if ma.dev() == mb.dev() && ma.ino() == mb.ino() {
            return true;
        }
    }
    #[cfg(not(unix))]
    let _ = (ma, mb);
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(ca), Ok(cb)) => ca == cb,
        _ => false,
    }
}

/// Refuses `output` (given with `flag`) when it is the same file as one of `inputs` (each with
/// the flag or key that named it), or when the folder it would be written into does not exist.
pub fn check_output(
    output: &Path,
    flag: &str,
    inputs: &[(&str, &Path)],
) -> Result<(), ConfigError> {
    for (what, input) in inputs {
        if same_file(output, input) {
            return Err(ConfigError::Value {
                key: flag.into(),
                message: format!(
                    "{} is the same file as {what} ({}); writing it would destroy the input: choose another output file",
                    output.display(),
                    input.display()
                ),
            });
        }
    }
    if output.is_dir() {
        return Err(ConfigError::Value {
            key: flag.into(),
            message: format!("{} is a folder; name a file", output.display()),
        });
    }
    let parent = output.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(parent) = parent {
        if !parent.is_dir() {
            return Err(ConfigError::Value {
                key: flag.into(),
                message: format!(
                    "{}: the folder {} does not exist",
                    output.display(),
                    parent.display()
                ),
            });
        }
    }
    Ok(())
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

/// `config check`: prompt plus response must fit the context of the actor (and the critic, when
/// the run has one), read from the model's header or `config.json` without loading weights, and
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
                // The actor's tokenizer must not reach past its embedding rows.
                let tok = crate::trainer::setup::tokenizer_override(cfg).unwrap_or(path);
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
            if let Some(why) = crate::trainer::teacher::vocabulary_difference(ours, &theirs) {
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
        None => (crate::trainer::setup::lora_spec(m), None),
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
    crate::trainer::setup::check_lora_rank(&spec, adapter.as_deref(), group, projections)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_file_under_any_spelling_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.jsonl");
        std::fs::write(&input, "{}\n").unwrap();
        let inputs = [("--input", input.as_path())];
        // Same path, a `./` spelling, a `..` detour.
        let detour = dir.path().join("sub").join("..").join("in.jsonl");
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        for out in [input.clone(), dir.path().join(".").join("in.jsonl"), detour] {
            let e = check_output(&out, "--output", &inputs)
                .unwrap_err()
                .to_string();
            assert!(e.starts_with("--output") && e.contains("--input"), "{e}");
        }
        // A symlink and a hard link to it.
        #[cfg(unix)]
        {
            let link = dir.path().join("link.jsonl");
            std::os::unix::fs::symlink(&input, &link).unwrap();
            assert!(check_output(&link, "--output", &inputs).is_err());
            let hard = dir.path().join("hard.jsonl");
            std::fs::hard_link(&input, &hard).unwrap();
            assert!(same_file(&hard, &input));
            assert!(check_output(&hard, "--output", &inputs).is_err());
        }
        // The input is untouched by all of this.
        assert_eq!(std::fs::read_to_string(&input).unwrap(), "{}\n");
    }

    #[test]
    fn other_files_and_new_files_are_fine_missing_folders_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.jsonl");
        std::fs::write(&input, "{}\n").unwrap();
        let other = dir.path().join("out.jsonl");
        std::fs::write(&other, "old").unwrap();
        let inputs = [("--input", input.as_path())];
        check_output(&other, "--output", &inputs).unwrap();
        check_output(&dir.path().join("new.jsonl"), "--output", &inputs).unwrap();
        check_output(Path::new("relative-new.jsonl"), "--output", &inputs).unwrap();
        let e = check_output(&dir.path().join("no/such/out.jsonl"), "--output", &inputs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not exist"), "{e}");
        let e = check_output(dir.path(), "--output", &inputs)
            .unwrap_err()
            .to_string();
        assert!(e.contains("folder"), "{e}");
        assert!(!same_file(
            &dir.path().join("nope"),
            &dir.path().join("nope")
        ));
    }

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
            serde_json::json!({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"});
        std::fs::write(other.join("config.json"), config.to_string()).unwrap();
        let e = check(&other).unwrap_err();
        assert!(e.contains(key) && e.contains("GptOssForCausalLM"), "{e}");
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
