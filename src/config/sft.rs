//! The configuration of `main_ppo sft`, verl's SFT trainer (`python -m verl.trainer.sft_trainer`,
//! `verl/trainer/config/sft_trainer_engine.yaml` at 1dda039 with its `model/hf_model.yaml`,
//! `optim/fsdp.yaml` and `engine/fsdp.yaml` groups).
//!
//! The sections the RL trainer shares are the RL trainer's types: `model` is
//! `actor_rollout_ref.model`'s [`ModelConfig`] (path, LoRA keys, gradient checkpointing,
//! `use_remove_padding`) and `optim` is the actor's [`OptimConfig`] (verl's `optim/fsdp.yaml`
//! either way). A verl key without effect here gets the RL trainer's treatment: `model.X` and
//! `optim.X` are looked up in the compat table as `actor_rollout_ref.model.X` and
//! `actor_rollout_ref.actor.optim.X`, `engine.X` as `actor_rollout_ref.actor.fsdp_config.X`
//! (the FSDP engine section), `trainer.X` as itself.
//!
//! Loading: defaults → `--config FILE` → overrides (`engine=fsdp` selects verl's engine group:
//! one engine here) → `${...}` interpolations → no-effect keys set aside → typed tree (unknown
//! keys named with their closest matches) → [`resolve_sft`]'s cross-key rules.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_yaml_ng::Value;

use super::compat::{self, Compat};
use super::fields::{nonpositive_none, FreeMap, OneOrMany};
use super::interpolate::interpolate_tree;
use super::overrides::{parse_override, OverrideOp};
use super::schema::Schema;
use super::tree;
use super::{ConfigError, ModelConfig, OptimConfig, ResumeMode};
use crate::defaults;

/// `data.truncation` of the SFT dataset (verl's `MultiTurnSFTDataset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SftTruncation {
    /// A conversation longer than `max_length` stops the run naming its file and row.
    Error,
    /// Keep the last `max_length` tokens.
    Left,
    /// Keep the first `max_length` tokens.
    Right,
}

/// `data.pad_mode`: how verl batches SFT rows. Both train the same loss here: micro-batches
/// are packed end to end when `model.use_remove_padding` is on, padded otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PadMode {
    NoPadding,
    Right,
}

/// `trainer.save_freq` / `trainer.test_freq`: every N steps, or `after_each_epoch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Freq {
    Steps(i64),
    Named(String),
}

impl Freq {
    /// The period in steps (`None`: never), with `steps_per_epoch` for `after_each_epoch`.
    pub fn period(&self, key: &str, steps_per_epoch: u64) -> Result<Option<u64>, ConfigError> {
        match self {
            Freq::Steps(n) if *n > 0 => Ok(Some(*n as u64)),
            Freq::Steps(_) => Ok(None),
            Freq::Named(s) if s == "after_each_epoch" => Ok(Some(steps_per_epoch.max(1))),
            Freq::Named(s) => Err(ConfigError::Value {
                key: key.into(),
                message: format!("`{s}` is neither a number of steps nor `after_each_epoch`"),
            }),
        }
    }
}

/// `data.custom_cls`: a Python dataset class (refused: it cannot run here).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomCls {
    pub path: Option<String>,
    pub name: Option<String>,
}

/// `data.*` of verl's SFT trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftDataConfig {
    /// Conversations per training step (the global batch).
    pub train_batch_size: usize,
    /// Conversations per micro-batch (one forward/backward each) when use_dynamic_bsz is off;
    /// also the validation batch size.
    pub micro_batch_size_per_gpu: usize,
    /// Token budget of a micro-batch when use_dynamic_bsz is on.
    pub max_token_len_per_gpu: usize,
    /// Cut micro-batches by max_token_len_per_gpu instead of micro_batch_size_per_gpu.
    pub use_dynamic_bsz: bool,
    /// Training files (parquet, JSONL or JSON; a path or a list).
    pub train_files: OneOrMany,
    /// Validation files; null = no validation loss.
    pub val_files: Option<OneOrMany>,
    /// Keep only the first N training rows; -1 = all.
    pub train_max_samples: i64,
    /// Keep only the first N validation rows; -1 = all.
    pub val_max_samples: i64,
    /// Column holding each row's conversation (a list of {role, content[, tool_calls]}).
    pub messages_key: String,
    /// Column holding each row's tool schemas (OpenAI function format), shown to the chat
    /// template with the first message.
    pub tools_key: String,
    /// Column holding a per-row `enable_thinking` template variable.
    pub enable_thinking_key: String,
    /// `enable_thinking` for rows without that column; null = not passed. As in verl, any other
    /// value is passed as Python's bool() of it (verl's default, the string `none`, is True).
    pub enable_thinking_default: Option<serde_json::Value>,
    /// no_padding | right (both train the same loss here; see model.use_remove_padding).
    pub pad_mode: PadMode,
    /// The longest conversation in tokens.
    pub max_length: usize,
    /// error | left | right: what a conversation longer than max_length gets.
    pub truncation: SftTruncation,
    /// A Python dataset class; refused (only verl's MultiTurnSFTDataset is built).
    pub custom_cls: CustomCls,
    /// Extra chat-template variables.
    pub apply_chat_template_kwargs: FreeMap,
    /// Accept conversations whose message-by-message rendering differs from the whole
    /// conversation's (the message-by-message tokens are trained, as verl does).
    pub ignore_input_ids_mismatch: bool,
    /// Single-turn rows (verl's older fsdp_sft_trainer): the column holding the prompt (a string,
    /// or a list of messages). Used, with response_key, for rows without messages_key.
    pub prompt_key: Option<String>,
    /// Single-turn rows: the column holding the response text (trained as one assistant turn).
    pub response_key: Option<String>,
}

defaults!(SftDataConfig {
    train_batch_size: 256,
    micro_batch_size_per_gpu: 4,
    max_token_len_per_gpu: 8192,
    use_dynamic_bsz: true,
    train_files: OneOrMany::One("~/data/gsm8k/train.parquet".into()),
    val_files: None,
    train_max_samples: -1,
    val_max_samples: -1,
    messages_key: "messages".into(),
    tools_key: "tools".into(),
    enable_thinking_key: "enable_thinking".into(),
    enable_thinking_default: Some(serde_json::Value::String("none".into())),
    pad_mode: PadMode::NoPadding,
    max_length: 1024,
    truncation: SftTruncation::Error,
    custom_cls: CustomCls::default(),
    apply_chat_template_kwargs: FreeMap::new(),
    ignore_input_ids_mismatch: false,
    prompt_key: None,
    response_key: None,
});

/// `checkpoint.*`: what a checkpoint holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftCheckpointConfig {
    /// model, optimizer, extra (loader and counters), hf_model (with LoRA: also the merged
    /// model in huggingface/). model, optimizer and extra are always written (exact resume).
    pub save_contents: Vec<String>,
    /// What a resume reads; everything the checkpoint holds is read here.
    pub load_contents: Value,
}

defaults!(SftCheckpointConfig {
    save_contents: vec!["model".into(), "optimizer".into(), "extra".into()],
    load_contents: Value::String("${checkpoint.save_contents}".into()),
});

/// `trainer.*` of verl's SFT trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftTrainerConfig {
    /// Checkpoint root.
    pub default_local_dir: String,
    /// Project name (metrics).
    pub project_name: String,
    /// Experiment name (metrics).
    pub experiment_name: String,
    /// Passes over the training data.
    pub total_epochs: usize,
    /// Training steps; null = steps per epoch × total_epochs.
    #[serde(with = "nonpositive_none")]
    pub total_training_steps: Option<u64>,
    /// Metric sinks, as the RL trainer's trainer.logger.
    pub logger: OneOrMany,
    /// HTTPS proxy of the wandb tracker; null = none.
    pub wandb_proxy: Option<String>,
    /// Seed of the data order and fresh LoRA adapters.
    pub seed: u64,
    /// Save every N steps (and at the last step), or after_each_epoch; -1 = only the last.
    pub save_freq: Freq,
    /// Validation loss every N steps (and at the last step), or after_each_epoch; -1 = only
    /// the last (when val_files is set).
    pub test_freq: Freq,
    /// Keep at most this many checkpoints; null = all.
    pub max_ckpt_to_keep: Option<usize>,
    /// auto | disable | resume_path.
    pub resume_mode: ResumeMode,
    /// A global_step_N folder for resume_mode=resume_path (or auto).
    pub resume_from_path: Option<String>,
}

defaults!(SftTrainerConfig {
    default_local_dir: "checkpoints/${trainer.project_name}/${trainer.experiment_name}".into(),
    project_name: "gsm8k-sft".into(),
    experiment_name: "test".into(),
    total_epochs: 4,
    total_training_steps: None,
    logger: OneOrMany::Many(vec!["console".into(), "wandb".into()]),
    wandb_proxy: None,
    seed: 1,
    save_freq: Freq::Steps(-1),
    test_freq: Freq::Steps(-1),
    max_ckpt_to_keep: None,
    resume_mode: ResumeMode::Auto,
    resume_from_path: None,
});

/// The whole configuration of an SFT run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftConfig {
    pub data: SftDataConfig,
    /// The model (verl's `model/hf_model.yaml`, the RL trainer's `actor_rollout_ref.model`).
    pub model: ModelConfig,
    /// The optimizer (verl's `optim/fsdp.yaml`, the RL trainer's actor optim).
    pub optim: OptimConfig,
    pub checkpoint: SftCheckpointConfig,
    pub trainer: SftTrainerConfig,
}

defaults!(SftConfig {
    data: SftDataConfig::default(),
    model: ModelConfig::default(),
    optim: OptimConfig {
        lr: 1e-3,
        ..OptimConfig::default()
    },
    checkpoint: SftCheckpointConfig::default(),
    trainer: SftTrainerConfig::default(),
});

/// A loaded SFT configuration and what the user should be told about it.
#[derive(Debug, Clone)]
pub struct LoadedSft {
    pub config: SftConfig,
    /// verl keys the user set that have no effect here.
    pub no_effect: Vec<String>,
    pub notices: Vec<String>,
}

/// Keys of verl's SFT config with no effect here beyond the RL compat table's: data-loader
/// workers and shared memory, the profiler, DP token balancing, trainer sections of the
/// cluster.
pub const SFT_NO_EFFECT: &[&str] = &[
    "profiler",
    "data.num_workers",
    "data.use_shm",
    "data.balance_dp_token",
    "trainer.profile_interval",
    "trainer.balance_batch",
    "trainer.device",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
];

/// verl's engine groups, each run as main_ppo's single engine.
const ENGINES: &[&str] = &[
    "fsdp",
    "fsdp2",
    "megatron",
    "veomni",
    "automodel",
    "torchtitan",
];

/// Where an SFT key's treatment is found in the RL compat table.
fn rl_path(path: &[String]) -> Vec<String> {
    let head: &[&str] = match path.first().map(String::as_str) {
        Some("model") => &["actor_rollout_ref", "model"],
        Some("optim") => &["actor_rollout_ref", "actor", "optim"],
        Some("engine") => &["actor_rollout_ref", "actor", "fsdp_config"],
        _ => return path.to_vec(),
    };
    head.iter()
        .map(|s| s.to_string())
        .chain(path[1..].iter().cloned())
        .collect()
}

/// How a key outside the typed SFT tree is treated: `Some(compat)` when verl has it.
fn sft_compat(path: &[String]) -> Option<Compat> {
    let key = tree::join(path);
    // The RL trainer holds bf16 weights where a role's fsdp_config.model_dtype asks; the SFT
    // trainer keeps its weights in fp32.
    if key == "engine.model_dtype" {
        return Some(Compat::Unsupported {
            default: "fp32",
            why: "SFT keeps the weights and optimizer state in fp32 (the RL trainer reads a role's fsdp_config.model_dtype)",
        });
    }
    if SFT_NO_EFFECT
        .iter()
        .any(|p| key == *p || key.starts_with(&format!("{p}.")))
    {
        return Some(Compat::NoEffect);
    }
    let found = compat::lookup(&rl_path(path));
    match (found, path.first().map(String::as_str)) {
        (Some(f), _) => Some(match f.compat {
            Compat::MovedTo(_) => Compat::NoEffect,
            c => c,
        }),
        // The engine section is layout and parallelism throughout.
        (None, Some("engine")) => Some(Compat::NoEffect),
        _ => None,
    }
}

/// Loads an SFT configuration: defaults, `file` (a YAML mapping) and the overrides.
pub fn load_sft(file: Option<&PathBuf>, overrides: &[String]) -> Result<LoadedSft, ConfigError> {
    let defaults =
        serde_yaml_ng::to_value(SftConfig::default()).map_err(|e| ConfigError::Value {
            key: "<defaults>".into(),
            message: e.to_string(),
        })?;
    let mut tree = defaults.clone();
    let mut user_set = BTreeSet::new();
    let mut notices = Vec::new();
    if let Some(f) = file {
        let text = std::fs::read_to_string(f).map_err(|e| ConfigError::File {
            file: f.display().to_string(),
            message: e.to_string(),
        })?;
        let mut value: Value = serde_yaml_ng::from_str(&text).map_err(|e| ConfigError::File {
            file: f.display().to_string(),
            message: super::overrides::yaml_message(&e),
        })?;
        if let Some(m) = value.as_mapping_mut() {
            m.remove("defaults");
        }
        let mut leaves = Vec::new();
        tree::leaves(&value, &mut Vec::new(), &mut leaves);
        for leaf in &leaves {
            check_key(&defaults, leaf).map_err(|e| ConfigError::File {
                file: f.display().to_string(),
                message: e.to_string(),
            })?;
            user_set.insert(tree::join(leaf));
        }
        tree::merge(&mut tree, value);
    }
    for raw in overrides.iter().filter(|o| !o.trim().is_empty()) {
        let ov = parse_override(raw).map_err(|message| ConfigError::Override {
            raw: raw.clone(),
            message,
        })?;
        let key = tree::join(&ov.key);
        if ov.key.len() == 1 && (ov.key[0] == "engine" || ov.key[0].starts_with("engine@")) {
            engine_group(&ov.value, raw, &mut notices)?;
            continue;
        }
        check_key(&defaults, &ov.key).map_err(|e| ConfigError::Override {
            raw: raw.clone(),
            message: e.to_string(),
        })?;
        match ov.op {
            OverrideOp::Delete => {
                match tree::get(&defaults, &ov.key) {
                    Some(d) => tree::set(&mut tree, &ov.key, d.clone()),
                    None => {
                        tree::remove(&mut tree, &ov.key);
                    }
                }
                user_set.remove(&key);
            }
            _ => {
                tree::set(&mut tree, &ov.key, ov.value.unwrap_or(Value::Null));
                user_set.insert(key);
            }
        }
    }
    let schema = Schema {
        defaults: &defaults,
    };
    interpolate_tree(&schema, &mut tree)?;
    let no_effect = strip_untyped(&defaults, &mut tree, &user_set)?;
    let config: SftConfig =
        serde_path_to_error::deserialize(tree).map_err(|e| ConfigError::Value {
            key: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
    Ok(LoadedSft {
        config,
        no_effect,
        notices,
    })
}

/// `engine=<option>`: verl's engine group; every engine runs as main_ppo's one.
fn engine_group(
    value: &Option<Value>,
    raw: &str,
    notices: &mut Vec<String>,
) -> Result<(), ConfigError> {
    let option = value.as_ref().and_then(Value::as_str).unwrap_or_default();
    if !ENGINES.contains(&option) {
        return Err(ConfigError::Override {
            raw: raw.into(),
            message: format!(
                "`engine` is verl's engine group: one of {}",
                ENGINES.join(", ")
            ),
        });
    }
    if option != "fsdp" && option != "fsdp2" {
        notices.push(format!(
            "engine={option}: verl's {option} engine runs as main_ppo's single engine; its parallelism and layout keys have no effect"
        ));
    }
    Ok(())
}

/// A key the SFT schema knows (typed, inside a free-form map, or a verl key of the compat
/// treatment), else an unknown-key error with close matches.
fn check_key(defaults: &Value, path: &[String]) -> Result<(), ConfigError> {
    if tree::get(defaults, path).is_some() || sft_compat(path).is_some() {
        return Ok(());
    }
    for i in (1..path.len()).rev() {
        if let Some(v) = tree::get(defaults, &path[..i]) {
            let free = v.as_mapping().is_some_and(|m| m.is_empty()) || v.is_null();
            let typed_struct = v.as_mapping().is_some_and(|m| !m.is_empty());
            if free || (!typed_struct && !v.is_sequence()) {
                // Inside a free-form map or a value that is not a section (`data.val_files`
                // given as a mapping is a type error, found when deserialising).
                return Ok(());
            }
            return Err(unknown(defaults, path, i));
        }
    }
    Err(unknown(defaults, path, 0))
}

fn unknown(defaults: &Value, path: &[String], depth: usize) -> ConfigError {
    let parent = &path[..depth];
    let siblings: Vec<String> = if parent.is_empty() {
        defaults
            .as_mapping()
            .map(|m| m.keys().map(tree::key_str).collect())
            .unwrap_or_default()
    } else {
        tree::get(defaults, parent)
            .and_then(Value::as_mapping)
            .map(|m| m.keys().map(tree::key_str).collect())
            .unwrap_or_default()
    };
    let name = &path[depth];
    let mut scored: Vec<(f64, &String)> = siblings
        .iter()
        .map(|s| (strsim::jaro_winkler(name, s), s))
        .filter(|(score, _)| *score >= 0.8)
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    let prefix = if parent.is_empty() {
        String::new()
    } else {
        format!("{}.", tree::join(parent))
    };
    let hint = match scored.first() {
        Some((_, s)) => format!("; did you mean `{prefix}{s}`?"),
        None => format!(
            " (verl's SFT trainer has no such key; `{}` holds: {})",
            if parent.is_empty() {
                "<root>".to_string()
            } else {
                tree::join(parent)
            },
            siblings.join(", ")
        ),
    };
    ConfigError::UnknownKey {
        key: tree::join(path),
        hint,
    }
}

/// Removes every key outside the typed tree; returns the no-effect ones the user set.
fn strip_untyped(
    defaults: &Value,
    tree: &mut Value,
    user_set: &BTreeSet<String>,
) -> Result<Vec<String>, ConfigError> {
    let mut leaves = Vec::new();
    tree::leaves(tree, &mut Vec::new(), &mut leaves);
    let mut no_effect = Vec::new();
    for leaf in leaves {
        let typed = (1..=leaf.len()).rev().any(|i| {
            tree::get(defaults, &leaf[..i]).is_some_and(|v| {
                i == leaf.len() || v.as_mapping().is_some_and(|m| m.is_empty()) || v.is_null()
            })
        });
        if typed {
            continue;
        }
        let value = tree::get(tree, &leaf).cloned().unwrap_or(Value::Null);
        let key = tree::join(&leaf);
        if let Some(Compat::Unsupported { default, why }) = sft_compat(&leaf) {
            if !compat::same_value(&value, &compat::default_value(default)) {
                return Err(ConfigError::Unsupported {
                    key,
                    value: tree::show(&value),
                    why: why.to_string(),
                });
            }
        }
        tree::remove(tree, &leaf);
        if user_set.contains(&key) && !value.is_null() && !leaf.iter().any(|s| s == "_target_") {
            no_effect.push(key);
        }
    }
    prune_empty(defaults, tree, &mut Vec::new());
    no_effect.sort();
    no_effect.dedup();
    Ok(no_effect)
}

/// Drops mappings left empty by the removals that the defaults do not hold.
fn prune_empty(defaults: &Value, node: &mut Value, path: &mut Vec<String>) {
    let Some(map) = node.as_mapping_mut() else {
        return;
    };
    let keys: Vec<Value> = map.keys().cloned().collect();
    for k in keys {
        path.push(tree::key_str(&k));
        if tree::get(defaults, path).is_none() {
            map.remove(&k);
        } else if let Some(child) = map.get_mut(&k) {
            prune_empty(defaults, child, path);
        }
        path.pop();
    }
}

/// What an SFT run derives from its configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct SftPlan {
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    pub default_local_dir: PathBuf,
    /// Micro-batches: a row count or a token budget.
    pub micro: super::MicroBatching,
    /// `hf_model` in `checkpoint.save_contents`: LoRA runs also write the merged model.
    pub save_hf_model: bool,
}

/// verl's rules for an SFT configuration, each message naming its keys.
pub fn resolve_sft(cfg: &SftConfig) -> Result<SftPlan, ConfigError> {
    let d = &cfg.data;
    let mut problems = Vec::new();
    if d.train_batch_size == 0 {
        problems.push("data.train_batch_size must be at least 1".to_string());
    }
    if !d.use_dynamic_bsz && d.micro_batch_size_per_gpu == 0 {
        problems.push("data.micro_batch_size_per_gpu must be at least 1".into());
    }
    if d.use_dynamic_bsz && d.max_token_len_per_gpu == 0 {
        problems.push("data.max_token_len_per_gpu must be at least 1".into());
    }
    if d.max_length < 2 {
        problems.push(format!(
            "data.max_length = {}: a conversation needs at least 2 tokens to train on",
            d.max_length
        ));
    }
    if d.custom_cls.path.is_some() {
        problems.push("data.custom_cls.path: a Python dataset class cannot run here; main_ppo builds verl's MultiTurnSFTDataset (data.messages_key, or data.prompt_key with data.response_key)".into());
    }
    if d.prompt_key.is_some() != d.response_key.is_some() {
        problems.push(
            "data.prompt_key and data.response_key go together (single-turn rows): set both or neither"
                .into(),
        );
    }
    if cfg.trainer.total_epochs == 0 && cfg.trainer.total_training_steps.is_none() {
        problems.push(
            "trainer.total_epochs = 0 and no trainer.total_training_steps: nothing to train".into(),
        );
    }
    let known = ["model", "optimizer", "extra", "hf_model"];
    for c in &cfg.checkpoint.save_contents {
        if !known.contains(&c.as_str()) {
            problems.push(format!(
                "checkpoint.save_contents: `{c}` is not one of {}",
                known.join(", ")
            ));
        }
    }
    if d.use_dynamic_bsz && d.max_token_len_per_gpu < d.max_length {
        problems.push(format!(
            "data.max_token_len_per_gpu = {} is below data.max_length = {}: a conversation of max_length tokens would fit no micro-batch",
            d.max_token_len_per_gpu, d.max_length
        ));
    }
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
    }
    let micro = if d.use_dynamic_bsz {
        super::MicroBatching::TokenBudget(d.max_token_len_per_gpu)
    } else {
        super::MicroBatching::Sequences(d.micro_batch_size_per_gpu)
    };
    Ok(SftPlan {
        train_files: d.train_files.to_vec(),
        val_files: d
            .val_files
            .as_ref()
            .map(OneOrMany::to_vec)
            .unwrap_or_default(),
        default_local_dir: PathBuf::from(crate::util::expand_home(&cfg.trainer.default_local_dir)),
        micro,
        save_hf_model: cfg.checkpoint.save_contents.iter().any(|c| c == "hf_model"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(o: &[&str]) -> Result<LoadedSft, ConfigError> {
        let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
        load_sft(None, &o)
    }

    #[test]
    fn defaults_are_verls_and_interpolate() {
        let l = load(&["trainer.project_name=p", "trainer.experiment_name=e"]).unwrap();
        let c = &l.config;
        assert_eq!(c.trainer.default_local_dir, "checkpoints/p/e");
        assert_eq!(c.data.train_batch_size, 256);
        assert_eq!(c.data.max_length, 1024);
        assert_eq!(c.data.truncation, SftTruncation::Error);
        assert_eq!(c.optim.lr, 1e-3);
        assert_eq!(
            c.checkpoint.load_contents,
            serde_yaml_ng::to_value(&c.checkpoint.save_contents).unwrap()
        );
    }

    #[test]
    fn engine_keys_have_no_effect_and_unknown_keys_are_named() {
        let l = load(&[
            "engine=fsdp",
            "engine.ulysses_sequence_parallel_size=2",
            "model.use_liger=True",
            "data.num_workers=2",
        ])
        .unwrap();
        assert_eq!(
            l.no_effect,
            vec![
                "data.num_workers",
                "engine.ulysses_sequence_parallel_size",
                "model.use_liger"
            ]
        );
        let e = load(&["data.max_lenght=4"]).unwrap_err().to_string();
        assert!(
            e.contains("data.max_lenght") && e.contains("data.max_length"),
            "{e}"
        );
        let e = load(&["engine.model_dtype=bf16"]).unwrap_err().to_string();
        assert!(e.contains("engine.model_dtype"), "{e}");
        let e = load(&["data.truncation=middle"]).unwrap_err().to_string();
        assert!(e.contains("data.truncation"), "{e}");
        let e = load(&["engine=deepspeed"]).unwrap_err().to_string();
        assert!(e.contains("engine group"), "{e}");
    }

    #[test]
    fn cross_key_rules_name_their_keys() {
        let c = load(&["data.prompt_key=q", "data.custom_cls.path=x.py"])
            .unwrap()
            .config;
        let e = resolve_sft(&c).unwrap_err().to_string();
        assert!(
            e.contains("data.response_key") && e.contains("data.custom_cls.path"),
            "{e}"
        );
        let c = load(&["data.max_token_len_per_gpu=100"]).unwrap().config;
        let e = resolve_sft(&c).unwrap_err().to_string();
        assert!(e.contains("data.max_token_len_per_gpu"), "{e}");
        let c = load(&["trainer.save_freq=after_each_epoch"])
            .unwrap()
            .config;
        assert_eq!(
            c.trainer.save_freq.period("trainer.save_freq", 7).unwrap(),
            Some(7)
        );
    }
}
