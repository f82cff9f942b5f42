//! What a run sets up before its first step, shared by training, `config check` and
//! `generate` so that all three apply the same rules: the paths the configuration names
//! (inputs exist, output folders writable), the datasets, and the number of steps they allow.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device};

use super::actor::{Actor, Reference};
use super::critic::Critic;
use super::micro::Layout;
use super::trainable::LoraState;
use super::{Result, TrainerError};
use crate::config::reward::SourceKind;
use crate::config::AgentLoopName;
use crate::config::{Config, ConfigError, ModelConfig, Plan};
use crate::data::dataset::{load_samples, DatasetOptions};
use crate::data::AgentRendering;
use crate::data::{ChatTemplate, PromptDataset, TokenizerBundle};
use crate::metrics::Tracker;
use crate::model::{CausalLm, Exec};
use crate::reward::tools::{ToolError, ToolPool, ToolPoolSettings, ToolSetting, ToolSource};
use crate::reward::{ModelContext, NativeRegistry, RewardManager};
use crate::rollout::agent::{AgentContext, AgentSettings, NoTools, ToolRunner};
use crate::util::expand_home;
use crate::weights::hf::Loaded;
use crate::weights::peft::{self, LoraSpec};
use std::sync::Arc;

/// The data-parallel rules of a run on `comm`'s ranks: `trainer.nnodes ×
/// trainer.n_gpus_per_node` (when set) must be the number of processes the launcher started,
/// and `data.train_batch_size` must split into whole prompts per rank (each rank generates
/// all `rollout.n` responses of its prompts).
pub fn check_world(
    cfg: &Config,
    plan: &Plan,
    comm: &dyn crate::dist::Collective,
) -> std::result::Result<(), ConfigError> {
    let world = comm.world_size();
    let t = &cfg.trainer;
    let mut errors = Vec::new();
    if t.nnodes.is_some() || t.n_gpus_per_node.is_some() {
        let (nodes, per_node) = (t.nnodes.unwrap_or(1), t.n_gpus_per_node.unwrap_or(1));
        if nodes * per_node != world {
            errors.push(format!(
                "trainer.nnodes ({nodes}) × trainer.n_gpus_per_node ({per_node}) = {} must equal the number of processes started ({world}, backend `{}`): launch {} processes (mpirun -np {}), or set both keys to match (null = the launcher's count)",
                nodes * per_node,
                comm.backend(),
                nodes * per_node,
                nodes * per_node,
            ));
        }
    }
    if !plan.train_batch_size.is_multiple_of(world) {
        errors.push(format!(
            "data.train_batch_size ({}) must be divisible by the number of processes ({world}): each rank takes whole prompts",
            plan.train_batch_size
        ));
    }
    if !plan.gen_batch_size.is_multiple_of(world) {
        errors.push(format!(
            "data.gen_batch_size ({}) must be divisible by the number of processes ({world}): each rank generates whole prompts",
            plan.gen_batch_size
        ));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

/// Every path the configuration names, checked together: inputs must exist, and the folders
/// a run writes (checkpoints, sample dumps) must be creatable and writable, so a run never
/// finds out after its first step's compute.
pub fn check_paths(cfg: &Config, plan: &Plan) -> std::result::Result<(), ConfigError> {
    let mut problems = Vec::new();
    let mut need = |key: &str, p: &str| {
        let expanded = expand_home(p);
        if !Path::new(&expanded).exists() {
            problems.push(format!("`{key}`: {p} does not exist"));
        }
    };
    for f in cfg.data.train_files.to_vec() {
        need("data.train_files", &f);
    }
    for f in cfg.data.val_files.to_vec() {
        need("data.val_files", &f);
    }
    let model = &cfg.actor_rollout_ref.model;
    // A hub id (org/name) that is not a local path is fetched by the model loader.
    if !crate::weights::is_hub_id(&model.path) {
        need("actor_rollout_ref.model.path", &model.path);
    }
    if let Some(t) = &model.tokenizer_path {
        need("actor_rollout_ref.model.tokenizer_path", t);
    }
    if let Some(t) = &cfg.data.tokenizer {
        need("data.tokenizer", t);
    }
    if plan.need_critic && !crate::weights::is_hub_id(&cfg.critic.model.path) {
        need("critic.model.path", &cfg.critic.model.path);
    }
    if let Some(t) = cfg
        .critic
        .model
        .tokenizer_path
        .as_ref()
        .filter(|_| plan.need_critic)
    {
        if !crate::weights::is_hub_id(t) {
            need("critic.model.tokenizer_path", t);
        }
    }
    // Distillation's teachers load after the policy: a missing one is reported here, not
    // after minutes of loading.
    for t in plan.distillation.iter().flat_map(|d| &d.teachers) {
        if !crate::weights::is_hub_id(&t.model_path) {
            need(
                &format!("distillation.teacher_models.{}.model_path", t.name),
                &t.model_path,
            );
        }
    }
    let python_files = cfg
        .reward
        .custom_reward_function
        .path
        .iter()
        .map(|p| ("reward.custom_reward_function.path".to_string(), p))
        .chain(
            plan.reward
                .sources
                .iter()
                .filter_map(|s| match (&s.kind, s.index) {
                    (SourceKind::Python { path, .. }, Some(i)) => {
                        Some((format!("reward.sources[{i}].path"), path))
                    }
                    _ => None,
                }),
        );
    for (key, p) in python_files {
        if !p.starts_with("pkg://") {
            need(&key, p.trim_start_matches("file://"));
        }
    }
    // LoRA settings training reads before any weight: the adapter folder, the module patterns.
    let mut models = vec![("actor_rollout_ref.model", &cfg.actor_rollout_ref.model)];
    if plan.need_critic {
        models.push(("critic.model", &cfg.critic.model));
    }
    for (key, m) in &models {
        if let Some(p) = &m.lora_adapter_path {
            need(&format!("{key}.lora_adapter_path"), p);
        }
    }
    // (With an adapter folder its adapter_config.json sets the targets instead.)
    for (key, m) in models
        .iter()
        .filter(|(_, m)| m.is_lora() && m.lora_adapter_path.is_none())
    {
        let patterns = [
            ("target_modules", Some(&m.target_modules)),
            ("exclude_modules", m.exclude_modules.as_ref()),
        ];
        for (name, targets) in patterns {
            if let Some(Err(e)) = targets.map(crate::weights::peft::check_pattern) {
                problems.push(format!("`{key}.{name}`: {e}"));
            }
        }
    }
    // A hub id with HF_HUB_OFFLINE set must be in the cache already: nothing will download it;
    // a download timeout variable that is not a number of seconds refuses every download.
    let hub = crate::weights::hub::HubSettings::from_env();
    problems.extend(offline_hub_problems(cfg, plan, &hub));
    let models = [&cfg.actor_rollout_ref.model.path, &cfg.critic.model.path];
    if let Some(bad) = hub
        .invalid
        .as_ref()
        .filter(|_| models.iter().any(|p| crate::weights::is_hub_id(p)))
    {
        problems.push(format!("{bad}: a hub model would not download"));
    }
    problems.extend(output_problems(cfg, plan));
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(problems))
    }
}

/// The folders a run writes (checkpoints, sample dumps) that cannot be created or written.
fn output_problems(cfg: &Config, plan: &Plan) -> Vec<String> {
    let t = &cfg.trainer;
    let outputs = [
        (
            "trainer.default_local_dir",
            Some(plan.default_local_dir.display().to_string()),
        ),
        ("trainer.rollout_data_dir", t.rollout_data_dir.clone()),
        ("trainer.validation_data_dir", t.validation_data_dir.clone()),
    ];
    outputs
        .into_iter()
        .filter_map(|(key, dir)| {
            let dir = dir?;
            let e = writable(Path::new(&expand_home(&dir))).err()?;
            Some(format!("`{key}`: {dir}: {e}"))
        })
        .collect()
}

/// The models named by hub id that are not in the cache while `hub` is offline
/// (HF_HUB_OFFLINE): nothing would download them, so training would stop at loading.
fn offline_hub_problems(
    cfg: &Config,
    plan: &Plan,
    hub: &crate::weights::hub::HubSettings,
) -> Vec<String> {
    if !hub.offline {
        return Vec::new();
    }
    let mut models = vec![(
        "actor_rollout_ref.model.path",
        &cfg.actor_rollout_ref.model.path,
    )];
    if plan.need_critic {
        models.push(("critic.model.path", &cfg.critic.model.path));
    }
    models
        .into_iter()
        .filter(|(_, p)| crate::weights::is_hub_id(p))
        .filter_map(|(key, p)| {
            let why = crate::weights::hub::cached_snapshot(p, &hub.cache).err()?;
            Some(format!(
                "`{key}` = {p}: {why}; HF_HUB_OFFLINE is set, so nothing is downloaded"
            ))
        })
        .collect()
}

/// Whether `dir` exists as a writable folder or can be created: the nearest existing
/// ancestor must be a folder a file can be created in. Creates nothing that stays.
fn writable(dir: &Path) -> std::result::Result<(), String> {
    let mut at = dir;
    while !at.exists() {
        match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => at = p,
            _ => {
                at = Path::new(".");
                break;
            }
        }
    }
    if !at.is_dir() {
        return Err(format!(
            "{} is not a folder, so this folder cannot be created",
            at.display()
        ));
    }
    let probe = at.join(format!(".main_ppo_write_check_{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| format!("cannot write in {}: {e}", at.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The training and (when `with_val` and files are named) validation prompts, read and
/// tokenised as the run will read them; their data sources checked against the reward's
/// default dispatch, and a warning when tool-agent rows meet a template that hides the tools.
pub fn datasets(
    cfg: &Config,
    plan: &Plan,
    tok: &TokenizerBundle,
    template: &ChatTemplate,
    with_val: bool,
    agents: &AgentRendering,
) -> Result<(PromptDataset, Option<PromptDataset>)> {
    let vision = vision_options(cfg, tok)?;
    let build = |files: &[String], opts: DatasetOptions| {
        let opts = DatasetOptions {
            agents: Some(agents.clone()),
            vision: vision.clone(),
            ..opts
        };
        read_prompts(files, &opts, tok, template)
    };
    let train = build(
        &cfg.data.train_files.to_vec(),
        DatasetOptions::train(&cfg.data, plan.prompt_length),
    )?;
    let val_files = cfg.data.val_files.to_vec();
    let val = if with_val && !val_files.is_empty() {
        Some(build(
            &val_files,
            DatasetOptions::val(&cfg.data, plan.prompt_length),
        )?)
    } else {
        None
    };
    check_data_sources(plan, &train, val.as_ref())?;
    let tool_rows = |d: &PromptDataset| d.agents.contains(&AgentLoopName::ToolAgent);
    if tool_rows(&train) || val.as_ref().is_some_and(tool_rows) {
        warn_if_tools_unseen(
            template,
            &agents.tools,
            &tok.chat_template_origin,
            cfg.actor_rollout_ref.rollout.multi_turn.format,
        );
    }
    Ok((train, val))
}

/// How a vision-language model's datasets read their images: the model is one when the
/// tokenizer's folder (the model's, unless `data.tokenizer` names another) holds a
/// vision-language `config.json`; its `preprocessor_config.json` sets the processor, with
/// `data.mm_processor_kwargs` (`min_pixels`, `max_pixels`) over it. `None` for text models.
pub fn vision_options(
    cfg: &Config,
    tok: &TokenizerBundle,
) -> Result<Option<crate::data::vision::VisionOptions>> {
    let dir = &tok.source;
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return Ok(None);
    };
    let vl = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            let arch = crate::model::config::arch_of(&v).ok()?;
            Some(crate::model::config::multimodal(&v, arch))
        })
        .unwrap_or(false);
    if !vl {
        return Ok(None);
    }
    let d = &cfg.data;
    let mut processor = crate::data::image::ImageProcessorConfig::from_model_dir(dir)?;
    for (k, v) in d.mm_processor_kwargs.iter() {
        let n = v.as_u64().filter(|&n| n > 0);
        match (k.as_str(), n) {
            ("min_pixels", Some(n)) => processor.min_pixels = n,
            ("max_pixels", Some(n)) => processor.max_pixels = n,
            ("min_pixels" | "max_pixels", None) => {
                return Err(TrainerError::Config(crate::config::ConfigError::Value {
                    key: format!("data.mm_processor_kwargs.{k}"),
                    message: format!("must be a positive integer (pixels), found {v:?}"),
                }))
            }
            _ => {
                return Err(TrainerError::Config(crate::config::ConfigError::Value {
                    key: format!("data.mm_processor_kwargs.{k}"),
                    message: "not a processor setting main_ppo reads (min_pixels, max_pixels)"
                        .into(),
                }))
            }
        }
    }
    processor.validate().map_err(|m| {
        TrainerError::Config(crate::config::ConfigError::Value {
            key: "data.mm_processor_kwargs".into(),
            message: format!("{}: {m}", dir.join("preprocessor_config.json").display()),
        })
    })?;
    if d.image_patch_size == 0 {
        return Err(TrainerError::Config(crate::config::ConfigError::Value {
            key: "data.image_patch_size".into(),
            message: "must be positive".into(),
        }));
    }
    Ok(Some(crate::data::vision::VisionOptions {
        image_key: d.image_key.clone(),
        video_key: d.video_key.clone(),
        processor,
        image_patch_size: d.image_patch_size,
        base_dir: None,
    }))
}

/// Prompts from `files`, read and tokenised as `opts` say.
fn read_prompts(
    files: &[String],
    opts: &DatasetOptions,
    tok: &TokenizerBundle,
    template: &ChatTemplate,
) -> Result<PromptDataset> {
    let samples = load_samples(files, opts)?;
    Ok(PromptDataset::build(samples, tok, template, opts)?)
}

/// The prompts of one file as `generate` (verl's `main_generation`) reads them: the
/// validation options (`data.val_max_samples` limits the rows) with only `data.prompt_key`
/// required; every other column passes through to the output.
pub fn generation_prompts(
    cfg: &Config,
    prompt_length: usize,
    path: &Path,
    tok: &TokenizerBundle,
    template: &ChatTemplate,
) -> Result<PromptDataset> {
    let opts = DatasetOptions {
        prompts_only: true,
        vision: vision_options(cfg, tok)?,
        ..DatasetOptions::val(&cfg.data, prompt_length)
    };
    read_prompts(&[path.display().to_string()], &opts, tok, template)
}

/// Training steps of the run for `train_rows` prompts: `trainer.total_training_steps`, else
/// `trainer.total_epochs` × whole batches per epoch; an error when not one batch fits.
pub fn total_steps(
    cfg: &Config,
    plan: &Plan,
    train_rows: usize,
) -> std::result::Result<u64, ConfigError> {
    let steps_per_epoch = plan.steps_per_epoch(train_rows) as u64;
    if steps_per_epoch == 0 {
        return Err(ConfigError::Invalid(vec![format!(
            "data.train_files: {train_rows} prompts after filtering, fewer than {} ({}): not one step can run",
            if plan.filter_groups.is_some() { "data.gen_batch_size" } else { "data.train_batch_size" },
            plan.gen_batch_size
        )]));
    }
    Ok(cfg
        .trainer
        .total_training_steps
        .unwrap_or(steps_per_epoch * cfg.trainer.total_epochs as u64))
}

/// Whether the run validates at all (before training, only, or every `test_freq` steps).
pub fn wants_validation(cfg: &Config) -> bool {
    let t = &cfg.trainer;
    t.val_before_train || t.val_only || t.test_freq.is_some()
}

/// With verl's default dispatch (a built-in scorer chosen by each row's `data_source`), every
/// data source of the data must have one: an error naming the first row of a source without
/// one, before anything is generated (otherwise the first step's rollout would be lost to it).
pub fn check_data_sources(
    plan: &Plan,
    train: &PromptDataset,
    val: Option<&PromptDataset>,
) -> Result<()> {
    let dispatches = plan
        .reward
        .sources
        .iter()
        .any(|s| matches!(&s.kind, SourceKind::Builtin { scorer, .. } if scorer == "default"));
    if !dispatches {
        return Ok(());
    }
    let mut seen = std::collections::HashSet::new();
    for d in std::iter::once(train).chain(val) {
        for sample in &d.samples {
            if !seen.insert(sample.data_source.as_str()) {
                continue;
            }
            if let Err(e) = crate::reward::scorers::Builtin::for_source(&sample.data_source) {
                return Err(TrainerError::Other(format!(
                    "{}, row {}: {e}",
                    sample.file, sample.row
                )));
            }
        }
    }
    Ok(())
}

/// The reward stage, built first: a broken reward file fails before any model is read.
pub fn reward_manager(
    cfg: &Config,
    plan: &Plan,
    natives: &NativeRegistry,
) -> Result<RewardManager> {
    let ctx = ModelContext {
        device: cfg.trainer.device.clone(),
        prompt_key: cfg.data.prompt_key.clone(),
    };
    let reward = RewardManager::new(&plan.reward, natives, &ctx)?;
    let sources: Vec<String> = reward
        .sources
        .iter()
        .map(|s| format!("{} = {} (weight {})", s.name, s.label, s.weight))
        .collect();
    tracing::info!("reward ready: {}", sources.join(", "));
    Ok(reward)
}

/// The model of a run an execution setting is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Actor,
    /// Generation (rollouts, validation, `main_ppo generate`): the actor's weights.
    Rollout,
    Reference,
    Critic,
}

/// How the `role` model's forwards run, read from its section in one place: per-layer
/// recomputation from `enable_gradient_checkpointing` (training roles), bf16 products from the
/// section's `fsdp_config.mixed_precision.param_dtype` (generation: `rollout.dtype`, as verl's
/// rollout engine has its own precision).
pub fn exec(cfg: &Config, role: Role) -> Exec {
    let a = &cfg.actor_rollout_ref;
    let (recompute, precision) = match role {
        Role::Actor => (
            a.model.enable_gradient_checkpointing,
            a.actor.fsdp_config.mixed_precision.param_dtype,
        ),
        Role::Rollout => (false, a.rollout.dtype),
        Role::Reference => (false, a.reference.fsdp_config.mixed_precision.param_dtype),
        Role::Critic => (
            cfg.critic.model.enable_gradient_checkpointing,
            cfg.critic.model.fsdp_config.mixed_precision.param_dtype,
        ),
    };
    Exec {
        recompute,
        composed: false,
        bf16: precision.is_bf16(),
        dense_experts: false,
    }
}

/// The policy's weights from `actor_rollout_ref.model.path` (the actor, and again the frozen
/// reference) and the tokenizer the run reads prompts with: `data.tokenizer`, else
/// `model.tokenizer_path`, else the model's own.
pub fn load_policy(cfg: &Config, device: &Device) -> Result<(Loaded, TokenizerBundle)> {
    load_policy_as(cfg, device, DType::F32)
}

/// [`load_policy`] with weights of `dtype` (`generate --dtype f64` for exact comparisons).
pub fn load_policy_as(
    cfg: &Config,
    device: &Device,
    dtype: DType,
) -> Result<(Loaded, TokenizerBundle)> {
    let m = &cfg.actor_rollout_ref.model;
    let t0 = Instant::now();
    let mut out = crate::weights::load_model_and_tokenizer(
        &m.path,
        tokenizer_override(cfg),
        &m.override_config,
        dtype,
        device,
        true,
    )?;
    out.0.model.set_exec(exec(cfg, Role::Actor));
    tracing::info!(
        "policy: {} loaded in {:.1} s",
        m.path,
        t0.elapsed().as_secs_f64()
    );
    Ok(out)
}

/// The fresh adapters `m`'s keys ask for (`lora_rank`, `lora_alpha`, `target_modules`,
/// `exclude_modules`), when no `lora_adapter_path` gives them.
pub fn lora_spec(m: &ModelConfig) -> LoraSpec {
    LoraSpec {
        rank: m.lora_rank,
        alpha: m.lora_alpha as f64,
        use_rslora: false,
        target_modules: m.target_modules.clone(),
        exclude_modules: m.exclude_modules.clone(),
        // verl's FSDP config has no dropout key: PEFT's default, 0.
        dropout: 0.0,
    }
}

/// Refuses adapters of `spec`'s rank on `projections` when [`peft::rank_problem`] does, naming
/// `{key}.lora_rank`, or the `adapter_config.json` in `adapter` (the folder of
/// `{key}.lora_adapter_path`) when the rank came from there.
pub fn check_lora_rank(
    spec: &LoraSpec,
    adapter: Option<&Path>,
    key: &str,
    projections: impl IntoIterator<Item = (String, usize, usize)>,
) -> std::result::Result<(), ConfigError> {
    let value = |key: String, message: String| ConfigError::Value { key, message };
    let why = peft::rank_problem(spec, projections).map_err(|e| value(key.into(), e))?;
    match (why, adapter) {
        (None, _) => Ok(()),
        (Some(why), None) => Err(value(format!("{key}.lora_rank"), why)),
        (Some(why), Some(dir)) => Err(value(
            format!("{key}.lora_adapter_path"),
            format!("{}: `r`: {why}", dir.join("adapter_config.json").display()),
        )),
    }
}

/// LoRA on `loaded` as `m` (`actor_rollout_ref.model` or `critic.model`, named by `key`) asks:
/// `None` when `lora_rank` is 0 and no `lora_adapter_path` is given (verl's rule). From an
/// adapter folder (ours or PEFT's) its `adapter_config.json` sets rank, alpha and targets and
/// its tensors the starting values; otherwise fresh adapters (A seeded from `seed`, B zero).
/// A rank the model's projections cannot take ([`peft::rank_problem`]) is refused naming the
/// key (or the adapter's config file) before any adapter is allocated.
pub fn attach_lora(
    loaded: &mut Loaded,
    m: &ModelConfig,
    key: &str,
    seed: u64,
    task_type: &'static str,
) -> Result<Option<LoraState>> {
    if !m.is_lora() {
        return Ok(None);
    }
    let adapters = candle_nn::VarMap::new();
    let (spec, mut source) = match &m.lora_adapter_path {
        Some(p) => {
            let path = std::path::PathBuf::from(expand_home(p));
            let file = peft::read_adapter(&path)
                .map_err(|e| TrainerError::Other(format!("{key}.lora_adapter_path={p}: {e}")))?;
            let dir = peft::adapter_dir(&path)?;
            (file.spec, Some((dir, file.tensors)))
        }
        None => (lora_spec(m), None),
    };
    let projections = peft::projections(&mut loaded.model)?;
    let adapter = source.as_ref().map(|(dir, _)| dir.as_path());
    check_lora_rank(&spec, adapter, key, projections)?;
    let adapted = peft::attach(&mut loaded.model, &spec, &adapters, seed, key)?;
    // PEFT's `lora_dropout` from the adapter's config (what `PeftModel.from_pretrained(...,
    // is_trainable=True)` applies in verl), in training forwards only.
    loaded
        .model
        .set_adapter_dropout(spec.dropout, seed ^ 0x6c6f_7261_5f64_726f)
        .map_err(|e| TrainerError::Other(format!("{key}: {e}")))?;
    let mut saved_modules = std::collections::HashMap::new();
    if let Some((dir, tensors)) = &mut source {
        peft::assign_adapter(&adapters, tensors, dir)
            .map_err(|e| TrainerError::Other(format!("{key}.lora_adapter_path: {e}")))?;
        // Heads only (the critic's `score.*`); the rest (adapters, an actor's saved
        // `lm_head` or embeddings, which are not read) is dropped now.
        saved_modules = std::mem::take(tensors);
        saved_modules.retain(|k, _| {
            k.strip_prefix("base_model.model.")
                .is_some_and(|name| !super::trainable::is_backbone(name))
        });
    }
    tracing::info!(
        "{key}: LoRA rank {} alpha {} dropout {} on {} projections",
        spec.rank,
        spec.alpha,
        spec.dropout,
        adapted.len()
    );
    Ok(Some(LoraState {
        spec,
        adapters,
        adapted,
        base_model: m.path.clone(),
        task_type,
        source: source.map(|(dir, _)| dir),
        saved_modules,
    }))
}

/// The policy side of a run: the actor (with its adapters), the tokenizer prompts are read
/// with, the datasets, and the number of training steps.
pub struct Policy {
    pub actor: Actor,
    pub tokenizer: TokenizerBundle,
    pub train: PromptDataset,
    pub val: Option<PromptDataset>,
    pub total_steps: u64,
    /// The tool agent loop, when some row runs it.
    pub agent: Option<Arc<AgentContext>>,
    /// The custom sampler of `data.sampler.class_path`, built over `train`.
    pub sampler: Option<crate::reward::sampler::PySampler>,
}

/// How rows choose their agent loop (`multi_turn.enable`, `agent.default_agent_loop`), the
/// tools tool-agent prompts show and the interactions their rows must name.
pub fn agent_rendering(
    cfg: &Config,
    runner: &dyn ToolRunner,
    interactions: Option<&Interactions>,
) -> AgentRendering {
    AgentRendering {
        multi_turn: cfg.actor_rollout_ref.rollout.multi_turn.enable,
        default: cfg.actor_rollout_ref.rollout.agent.default_agent_loop,
        tools: runner.schemas(),
        interactions: interactions.map(|i| i.names.clone()).unwrap_or_default(),
    }
}

/// The interactions of `multi_turn.interaction_config_path`, running in their worker.
pub struct Interactions {
    pub runner: Arc<dyn ToolRunner>,
    pub names: Vec<String>,
}

/// The tool pool's start-up error as the trainer reports it: a usage error naming the key for
/// what the configuration or its files got wrong (as config check reports it, exit 2).
fn tool_start_error(e: ToolError, what: &str) -> TrainerError {
    match e {
        ToolError::Config { setting, message } => {
            let key = match setting {
                ToolSetting::ToolConfigPath => {
                    "actor_rollout_ref.rollout.multi_turn.tool_config_path"
                }
                ToolSetting::FunctionToolPath => {
                    "actor_rollout_ref.rollout.multi_turn.function_tool_path"
                }
                ToolSetting::InteractionConfigPath => {
                    "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
                }
                ToolSetting::Python => "reward.python",
            };
            TrainerError::Config(ConfigError::Value {
                key: key.into(),
                message,
            })
        }
        ToolError::Failed(m) => TrainerError::Other(format!(
            "starting the {what} of actor_rollout_ref.rollout.multi_turn: {m}"
        )),
    }
}

/// The interactions `rollout.multi_turn.interaction_config_path` names, started in one Python
/// worker (their state per conversation lives in it; `reward.python`'s interpreter, the tools'
/// time limit per turn); `None` when the key is null.
pub fn interaction_runner(cfg: &Config) -> Result<Option<Interactions>> {
    let mt = &cfg.actor_rollout_ref.rollout.multi_turn;
    let Some(path) = mt.interaction_config_path.as_deref() else {
        return Ok(None);
    };
    let path: std::path::PathBuf = crate::util::expand_home(path).into();
    let entries = crate::reward::tools::read_interaction_config(&path)
        .map_err(|e| tool_start_error(e, "interactions"))?;
    let src = ToolSource {
        interaction_config_path: Some(path),
        ..ToolSource::default()
    };
    let settings = ToolPoolSettings {
        python: cfg.reward.python.clone(),
        num_workers: 1,
        timeout: std::time::Duration::from_secs_f64(mt.tool_timeout_s),
        max_output_bytes: mt.tool_output_limit(),
    };
    let pool = ToolPool::start(&src, settings).map_err(|e| tool_start_error(e, "interactions"))?;
    Ok(Some(Interactions {
        runner: Arc::new(pool),
        names: crate::reward::tools::interaction_names(&entries),
    }))
}

/// A warning when the chat template does not show the tools to the model: it is then told
/// neither that they exist nor the call format, and tool calls come only from what the data's
/// prompts say.
fn warn_if_tools_unseen(
    template: &ChatTemplate,
    tools: &[serde_json::Value],
    origin: &str,
    format: crate::config::rollout::ToolFormat,
) {
    if !tools.is_empty() && !template.renders_tools(tools) {
        let f = serde_json::to_value(format).unwrap_or_default();
        tracing::warn!(
            "the chat template of {origin} does not render `tools`: the {} tool schema(s) and how to write a call (multi_turn.format={}) reach the model only if the prompts describe them (the --tools-in-system option of scripts/preprocess_gsm8k_tool_agent.py and scripts/make_search_toy_data.py writes them into the system message), or set actor_rollout_ref.model.custom_chat_template to a template that renders tools",
            tools.len(),
            f.as_str().unwrap_or("?"),
        );
    }
}

/// The tools `rollout.multi_turn.tool_config_path` / `function_tool_path` name, started in
/// their Python workers (`rollout.agent.num_workers` of them, `reward.python`'s interpreter);
/// none named: a runner that answers every call as a call to an unknown tool.
pub fn tool_runner(cfg: &Config) -> Result<Arc<dyn ToolRunner>> {
    let r = &cfg.actor_rollout_ref.rollout;
    let mt = &r.multi_turn;
    if mt.tool_config_path.is_none() && mt.function_tool_path.is_none() {
        return Ok(Arc::new(NoTools));
    }
    let src = ToolSource {
        tool_config_path: mt
            .tool_config_path
            .as_deref()
            .map(|p| crate::util::expand_home(p).into()),
        function_tool_path: mt
            .function_tool_path
            .as_deref()
            .map(|p| crate::util::expand_home(p).into()),
        interaction_config_path: None,
    };
    let settings = ToolPoolSettings {
        python: cfg.reward.python.clone(),
        num_workers: r.agent.num_workers.max(1),
        timeout: std::time::Duration::from_secs_f64(mt.tool_timeout_s),
        max_output_bytes: mt.tool_output_limit(),
    };
    let pool = ToolPool::start(&src, settings).map_err(|e| tool_start_error(e, "tools"))?;
    Ok(Arc::new(pool))
}

/// Loads the policy (`actor_rollout_ref.model`), attaches its LoRA adapters, checks that
/// prompt plus response fit its context, and reads the datasets with its tokenizer.
pub fn policy(cfg: &Config, plan: &Plan, device: &Device) -> Result<Policy> {
    let m = &cfg.actor_rollout_ref.model;
    let dtype = cfg.actor_rollout_ref.actor.fsdp_config.weights_dtype();
    let (mut loaded, tok) = load_policy_as(cfg, device, dtype)?;
    let key = "actor_rollout_ref.model";
    let lora = attach_lora(&mut loaded, m, key, cfg.trainer.seed, "CAUSAL_LM")?;
    let context = loaded.model.args.max_position_embeddings;
    fits_context(plan, "actor_rollout_ref.model.path", &m.path, context)?;
    super::preflight::vision_student(&loaded.model.args, plan)?;
    let template = Arc::new(tok.template(m.custom_chat_template.as_deref())?);
    let runner = tool_runner(cfg)?;
    let interactions = interaction_runner(cfg)?;
    let rendering = agent_rendering(cfg, runner.as_ref(), interactions.as_ref());
    let (train, val) = datasets(
        cfg,
        plan,
        &tok,
        &template,
        wants_validation(cfg),
        &rendering,
    )?;
    let tool_rows = |d: &PromptDataset| d.agents.contains(&AgentLoopName::ToolAgent);
    let agent = if tool_rows(&train) || val.as_ref().is_some_and(tool_rows) {
        let mt = &cfg.actor_rollout_ref.rollout.multi_turn;
        let mut ctx = AgentContext::new(
            Arc::new(tok.clone()),
            template,
            cfg.data.apply_chat_template_kwargs.clone(),
            runner,
            AgentSettings::new(mt),
        )
        .map_err(|e| TrainerError::Other(format!("the tool agent loop (rows with agent_name tool_agent, or actor_rollout_ref.rollout.multi_turn.enable): {e}")))?;
        if let Some(i) = interactions {
            ctx = ctx.with_interactions(i.runner);
        }
        Some(Arc::new(ctx))
    } else {
        None
    };
    // An epoch is `len(sampler)` indices with a custom sampler (verl's len(train_dataloader)).
    let sampler = super::sampler::build(cfg, &train.samples)?;
    let epoch_rows = sampler
        .as_ref()
        .map_or(train.len(), crate::data::IndexSampler::len);
    let total_steps = total_steps(cfg, plan, epoch_rows)?;
    let a = &cfg.actor_rollout_ref.actor;
    let inputs = Layout::of(tok.pad_token_id, m)
        .sharing(a.use_prefix_grouper)
        .for_model(&loaded.model.args);
    let mut actor = Actor::new(loaded, a, plan, total_steps, inputs, lora)?;
    actor.set_rollout_exec(exec(cfg, Role::Rollout));
    Ok(Policy {
        actor,
        tokenizer: tok,
        train,
        val,
        total_steps,
        agent,
        sampler,
    })
}

/// The critic (`critic.model`, with its adapters), which must read the actor's token ids and
/// fit prompt plus response in its context.
pub fn critic(
    cfg: &Config,
    plan: &Plan,
    device: &Device,
    tok: &TokenizerBundle,
    total_steps: u64,
) -> Result<Critic> {
    let m = &cfg.critic.model;
    let mut l = load_critic(cfg, device, tok)?;
    let seed = cfg.trainer.seed.wrapping_add(1);
    let lora = attach_lora(&mut l, m, "critic.model", seed, "TOKEN_CLS")?;
    let context = l.model.args.max_position_embeddings;
    fits_context(plan, "critic.model.path", &m.path, context)?;
    let inputs = Layout::of(tok.pad_token_id, m)
        .sharing(shared_prompts(cfg))
        .for_model(&l.model.args);
    Ok(Critic::new(
        l,
        &cfg.critic,
        plan,
        total_steps,
        inputs,
        lora,
    )?)
}

/// With `actor.use_prefix_grouper`, says once which models compute a group's shared prompt
/// once and which cannot and compute each response with its own copy (same numbers).
pub fn say_prefix_sharing(
    cfg: &Config,
    actor: &Actor,
    reference: Option<&Reference>,
    critic: Option<&Critic>,
) {
    if !cfg.actor_rollout_ref.actor.use_prefix_grouper {
        return;
    }
    let models: [(&str, Option<&CausalLm>); 3] = [
        ("actor", Some(actor.view())),
        ("reference", reference.map(|r| &r.model)),
        ("critic", critic.map(|c| &c.trainable.view().backbone)),
    ];
    let (on, off): (Vec<_>, Vec<_>) = models
        .into_iter()
        .filter_map(|(name, m)| m.map(|m| (name, m.shares_prefixes())))
        .partition(|(_, shares)| *shares);
    let names = |v: &[(&str, bool)]| v.iter().map(|x| x.0).collect::<Vec<_>>().join(", ");
    if !on.is_empty() {
        tracing::info!(
            "use_prefix_grouper: each group's prompt computed once ({})",
            names(&on)
        );
    }
    if !off.is_empty() {
        tracing::warn!(
            "use_prefix_grouper: not available for {} (Gated DeltaNet layers, CUDA or half \
             precision): each response computed with its own copy of the prompt, same numbers",
            names(&off)
        );
    }
}

/// `actor.use_prefix_grouper`: every model that reads the step's rows (actor, reference,
/// critic, teachers) computes a group's shared prompt once where it can.
fn shared_prompts(cfg: &Config) -> bool {
    cfg.actor_rollout_ref.actor.use_prefix_grouper
}

/// Prompt plus response must fit a model's context (`max_position_embeddings`).
fn fits_context(plan: &Plan, key: &str, path: &str, limit: usize) -> Result<()> {
    let (p, r) = (plan.prompt_length, plan.response_length);
    Ok(crate::config::data::check_model_context(
        p, r, limit, key, path,
    )?)
}

/// The frozen reference policy when the run needs one (`use_kl_loss` or `use_kl_in_reward`):
/// with LoRA the actor with its adapters off (nothing more is loaded), otherwise a second copy
/// of `actor_rollout_ref.model.path`.
pub fn reference(
    cfg: &Config,
    plan: &Plan,
    actor: &Actor,
    device: &Device,
    pad: u32,
) -> Result<Option<Reference>> {
    let inputs = Layout::of(pad, &cfg.actor_rollout_ref.model)
        .sharing(shared_prompts(cfg))
        .for_model(&actor.trainable.model.args);
    let mut r = match (plan.need_reference, plan.ref_log_prob_micro) {
        (true, Some(micro)) if actor.trainable.lora.is_some() => {
            Some(Reference::from_base(actor, micro, inputs))
        }
        (true, Some(micro)) => {
            let dtype = cfg.actor_rollout_ref.reference.fsdp_config.weights_dtype();
            let (l, _) = load_policy_as(cfg, device, dtype)?;
            Some(Reference::new(l, micro, plan.temperatures.log_prob, inputs))
        }
        _ => None,
    };
    if let Some(r) = &mut r {
        r.model.set_exec(exec(cfg, Role::Reference));
    }
    Ok(r)
}

/// On-policy distillation's teachers (`distillation.enabled`), each checked against the
/// student's tokenizer `tok` before its weights are read; `None` without distillation.
pub fn teachers(
    cfg: &Config,
    plan: &Plan,
    tok: &TokenizerBundle,
    device: &Device,
) -> Result<Option<super::teacher::Teachers>> {
    let Some(d) = &plan.distillation else {
        return Ok(None);
    };
    let inputs =
        Layout::of(tok.pad_token_id, &cfg.actor_rollout_ref.model).sharing(shared_prompts(cfg));
    super::teacher::Teachers::load(d, tok, device, plan.log_prob_micro, inputs).map(Some)
}

/// The tokenizer prompts are read with when it is not the policy model's own:
/// `data.tokenizer`, else `actor_rollout_ref.model.tokenizer_path`.
pub fn tokenizer_override(cfg: &Config) -> Option<&str> {
    let m = &cfg.actor_rollout_ref.model;
    cfg.data
        .tokenizer
        .as_deref()
        .or(m.tokenizer_path.as_deref())
}

/// The critic's backbone (`critic.model.path`), which must read the actor's token ids.
pub fn load_critic(cfg: &Config, device: &Device, tok: &TokenizerBundle) -> Result<Loaded> {
    let c = &cfg.critic.model;
    let tokenizer =
        c.tokenizer_path
            .as_deref()
            .or(cfg.actor_rollout_ref.model.tokenizer_path.as_deref());
    let (mut l, ctok) = crate::weights::load_model_and_tokenizer(
        &c.path,
        tokenizer,
        &c.override_config,
        c.fsdp_config.weights_dtype(),
        device,
        false,
    )?;
    l.model.set_exec(exec(cfg, Role::Critic));
    let (theirs, ours) = (
        ctok.tokenizer.get_vocab_size(true),
        tok.tokenizer.get_vocab_size(true),
    );
    if theirs != ours {
        return Err(TrainerError::Other(format!(
            "critic.model.path={}: its tokenizer has {theirs} tokens, the actor's {ours}: the critic must read the actor's token ids",
            c.path
        )));
    }
    Ok(l)
}

/// The metric sinks of `trainer.logger`; the remote backends' workers run on `reward.python`
/// and continue the runs of `resume_ids` (`backend → run id`).
pub fn tracker(
    cfg: &Config,
    resume_ids: &std::collections::BTreeMap<String, String>,
) -> Result<Tracker> {
    let t = &cfg.trainer;
    let remote = crate::metrics::RemoteOptions {
        settings: crate::metrics::remote::RemoteSettings::from_env(&cfg.reward.python),
        config: serde_json::to_value(cfg).map_err(|e| TrainerError::Other(e.to_string()))?,
        resume_ids: resume_ids.clone(),
    };
    let (tracker, warnings) = Tracker::new(
        &t.logger.to_vec(),
        &t.project_name,
        &t.experiment_name,
        Some(&remote),
    )
    .map_err(tracker_start_error)?;
    for w in warnings {
        tracing::warn!("{w}");
    }
    Ok(tracker)
}

/// Says at start-up, on the CPU, which vector instructions the kernels use and which kernel
/// serves the bf16 products of the roles that asked for them (`MAIN_PPO_BF16_KERNEL=none`
/// keeps f32).
pub(super) fn say_cpu_kernels(cfg: &Config, device: &Device) {
    if !device.is_cpu() {
        return;
    }
    tracing::info!(
        "CPU vector instructions: {}",
        crate::kernels::cpu::describe()
    );
    let bf16: Vec<&str> = [
        (Role::Actor, "actor"),
        (Role::Rollout, "rollout"),
        (Role::Reference, "reference"),
        (Role::Critic, "critic"),
    ]
    .into_iter()
    .filter(|(r, _)| exec(cfg, *r).bf16)
    .map(|(_, name)| name)
    .collect();
    if !bf16.is_empty() {
        let kernel = crate::kernels::bf16::describe();
        match crate::kernels::bf16::available() {
            true => tracing::info!("bf16 products ({}): {kernel}", bf16.join(", ")),
            false => tracing::warn!("bf16 products asked for ({}): {kernel}", bf16.join(", ")),
        }
    }
}

/// A tracker that cannot start: a configuration the environment cannot run is refused as
/// `config check` refuses it (a usage error), a backend that failed to open its run is not.
pub(super) fn tracker_start_error(e: crate::metrics::remote::StartError) -> TrainerError {
    match e {
        crate::metrics::remote::StartError::Config(m) => {
            TrainerError::Config(ConfigError::Invalid(vec![m]))
        }
        crate::metrics::remote::StartError::Failed(m) => TrainerError::Other(m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_folder_below_a_file_is_refused_before_any_compute() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a_file");
        std::fs::write(&file, "x").unwrap();
        assert!(writable(&dir.path().join("new/deeper")).is_ok());
        assert!(
            !dir.path().join("new").exists(),
            "the check creates nothing"
        );
        let e = writable(&file.join("ckpt")).unwrap_err();
        assert!(e.contains("a_file") && e.contains("not a folder"), "{e}");

        let below = file.join("ckpt").display().to_string();
        let cfg = crate::config::load(
            &crate::config::ConfigSource::Builtin,
            &[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".to_string(),
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
                "critic.ppo_micro_batch_size_per_gpu=4".into(),
                format!("trainer.default_local_dir={below}"),
                format!("trainer.rollout_data_dir={below}/dumps"),
            ],
        )
        .unwrap()
        .config;
        let plan = crate::config::resolve(&cfg).unwrap();
        let e = check_paths(&cfg, &plan).unwrap_err().to_string();
        assert!(
            e.contains("trainer.default_local_dir") && e.contains("trainer.rollout_data_dir"),
            "{e}"
        );
    }

    /// `multi_turn.max_tool_output_bytes` null or 0 is no limit (as verl reads its limits),
    /// not a 1-byte one: a 2 MiB tool text comes back whole; a positive value still refuses a
    /// longer text with a named error.
    #[test]
    fn a_tool_output_limit_of_zero_or_null_is_no_limit() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("functions.py");
        std::fs::write(
            &f,
            "from verl.tools.function_tool import function_tool\n\n@function_tool\ndef big(n: int) -> str:\n    \"\"\"n letters.\n\n    Args:\n        n: How many.\n    \"\"\"\n    return 'x' * n\n",
        )
        .unwrap();
        let n = 2 << 20;
        for (value, whole) in [("0", true), ("null", true), ("1000", false)] {
            let cfg = crate::config::load(
                &crate::config::ConfigSource::Builtin,
                &[
                    format!(
                        "actor_rollout_ref.rollout.multi_turn.function_tool_path={}",
                        f.display()
                    ),
                    format!("actor_rollout_ref.rollout.multi_turn.max_tool_output_bytes={value}"),
                    "actor_rollout_ref.rollout.agent.num_workers=1".into(),
                ],
            )
            .unwrap()
            .config;
            let runner = tool_runner(&cfg).unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            runner.submit(
                crate::rollout::agent::ToolCall {
                    key: 0,
                    name: "big".into(),
                    arguments: format!("{{\"n\": {n}}}"),
                    create_kwargs: serde_json::json!({}),
                    interaction: None,
                },
                tx,
            );
            let out = rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap();
            if whole {
                assert_eq!((out.text.len(), &out.error), (n, &None), "{value}");
            } else {
                assert_eq!(
                    out.error.as_deref(),
                    Some("tool 'big' returned 2097152 bytes, over the 1000-byte limit")
                );
            }
        }
    }

    /// The pre-flight `config check` shares with training refuses what training would refuse
    /// before loading any weight (each was reported valid by `config check` before): a
    /// `target_modules` that is not a regular expression, a `lora_adapter_path` that does not
    /// exist, and a hub id that is not cached while HF_HUB_OFFLINE is set (an empty cache given
    /// through HubSettings: the process environment is not changed).
    #[test]
    fn the_pre_flight_refuses_what_training_would() {
        let base: Vec<String> = vec![
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4".into(),
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8".into(),
            "critic.ppo_micro_batch_size_per_gpu=4".into(),
        ];
        let plan_of = |extra: &[&str]| {
            let mut o = base.clone();
            o.extend(extra.iter().map(|s| s.to_string()));
            let cfg = crate::config::load(&crate::config::ConfigSource::Builtin, &o)
                .unwrap()
                .config;
            let plan = crate::config::resolve(&cfg).unwrap();
            (cfg, plan)
        };
        let check = |extra: &[&str]| {
            let mut all = vec![
                "data.train_files=Cargo.toml",
                "data.val_files=Cargo.toml",
                "actor_rollout_ref.model.path=src",
                "critic.model.path=src",
                "trainer.default_local_dir=/tmp/main_ppo_preflight",
            ];
            all.extend(extra);
            let (cfg, plan) = plan_of(&all);
            check_paths(&cfg, &plan).map_err(|e| e.to_string())
        };
        assert!(check(&[]).is_ok(), "{:?}", check(&[]));
        let bad = "actor_rollout_ref.model.target_modules=q_proj|(";
        let e = check(&["actor_rollout_ref.model.lora_rank=8", bad]).unwrap_err();
        assert!(
            e.contains("actor_rollout_ref.model.target_modules")
                && e.contains("not a regular expression"),
            "{e}"
        );
        // all-linear is not a pattern; without LoRA the key is not read.
        assert!(check(&["actor_rollout_ref.model.lora_rank=8"]).is_ok());
        assert!(check(&[bad]).is_ok());
        let e = check(&["actor_rollout_ref.model.lora_adapter_path=/no/such/adapter"]).unwrap_err();
        assert!(
            e.contains("lora_adapter_path") && e.contains("/no/such/adapter does not exist"),
            "{e}"
        );
        let empty = tempfile::tempdir().unwrap();
        let hub = crate::weights::hub::HubSettings::from_vars(|k| match k {
            "HF_HUB_OFFLINE" => Some("1".into()),
            "HF_HUB_CACHE" => Some(empty.path().display().to_string()),
            _ => None,
        });
        let (cfg, plan) = plan_of(&["actor_rollout_ref.model.path=org/not-cached"]);
        let e = offline_hub_problems(&cfg, &plan, &hub).join("; ");
        assert!(
            e.contains("actor_rollout_ref.model.path")
                && e.contains("org/not-cached")
                && e.contains("HF_HUB_OFFLINE"),
            "{e}"
        );
        let online = crate::weights::hub::HubSettings::from_vars(|_| None);
        assert!(offline_hub_problems(&cfg, &plan, &online).is_empty());
    }
}
