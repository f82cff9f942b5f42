//! `main_ppo config check`: verl's validation rules, the files a run needs, and the batch
//! arithmetic of one training step in plain words. Loads no model.

use std::fmt::Write as _;

use std::path::PathBuf;

use crate::config::{Config, MicroBatching, Plan, RewardSourceType, UpdatePlan};
use crate::data::dataset::{load_samples, DatasetOptions};
use crate::data::TokenizerBundle;
use crate::trainer::setup;
use crate::util::expand_home;

use super::ConfigArgs;

/// What `config check` learns from the data files.
#[derive(Debug, Clone)]
pub struct DataSummary {
    /// Training prompts (after the sample limit and, when a tokenizer is at hand, the overlong filter).
    pub train_rows: usize,
    pub val_rows: Option<usize>,
    /// Prompts dropped by the overlong filter, when it ran.
    pub filtered: Option<usize>,
    /// Why the overlong filter / truncation check could not run, if it could not.
    pub tokenizer_note: Option<String>,
    /// Prompts that run the tool agent loop (training, validation), when the data was
    /// tokenised; and the names of the tools they may call.
    pub tool_rows: Option<(usize, Option<usize>)>,
    pub tools: Vec<String>,
    /// The custom sampler (`data.sampler.class_path`), built over the training prompts as
    /// training builds it: its name, `len(sampler)` and whether it is a curriculum sampler.
    pub sampler: Option<SamplerSummary>,
}

/// A custom sampler as `config check` reports it: its name, `len(sampler)`, whether it is a
/// curriculum sampler.
pub type SamplerSummary = (String, usize, bool);

/// Builds the custom sampler over `train` as training does (its class imported, its
/// constructor run; nothing drawn) and ends its worker; the rows an epoch has for the step count.
fn check_sampler(
    cfg: &Config,
    train: &[crate::data::Sample],
) -> anyhow::Result<(Option<SamplerSummary>, usize)> {
    use crate::data::IndexSampler;
    let built = crate::trainer::sampler::build(cfg, train).map_err(super::lift)?;
    Ok(match built {
        Some(s) => (
            Some((s.name().to_string(), s.len(), s.curriculum())),
            s.len(),
        ),
        None => (None, train.len()),
    })
}

impl DataSummary {
    /// Reads the data (and, when the tokenizer is at hand, tokenises the prompts as training
    /// does).
    pub fn load(cfg: &Config, plan: &Plan) -> anyhow::Result<Self> {
        let with_val = setup::wants_validation(cfg);
        let train_opts = DatasetOptions::train(&cfg.data, plan.prompt_length);
        let train = load_samples(&cfg.data.train_files.to_vec(), &train_opts)?;
        let val_files = cfg.data.val_files.to_vec();
        let val = if val_files.is_empty() || !with_val {
            None
        } else {
            Some(load_samples(
                &val_files,
                &DatasetOptions::val(&cfg.data, plan.prompt_length),
            )?)
        };
        let tok_dir = setup::tokenizer_override(cfg).unwrap_or(&cfg.actor_rollout_ref.model.path);
        let tok_dir = PathBuf::from(expand_home(tok_dir));
        let is_gguf = tok_dir.is_file() && tok_dir.extension().is_some_and(|e| e == "gguf");
        if !is_gguf && !tok_dir.join("tokenizer.json").is_file() {
            let (sampler, epoch_rows) = check_sampler(cfg, &train)?;
            setup::total_steps(cfg, plan, epoch_rows)?;
            return Ok(Self {
                train_rows: train.len(),
                val_rows: val.map(|v| v.len()),
                filtered: None,
                tokenizer_note: Some(format!(
                    "no tokenizer.json in {}: prompt lengths were not checked, counts are before overlong filtering",
                    tok_dir.display()
                )),
                tool_rows: None,
                tools: Vec::new(),
                sampler,
            });
        }
        let bundle = if is_gguf {
            // Only the metadata is read, not the weights.
            // (through the same header checks as loading, so a damaged file is an error).
            let (_, content) = crate::weights::gguf::open(&tok_dir)?;
            crate::weights::gguf::tokenizer(&content, &tok_dir)?
        } else {
            TokenizerBundle::from_dir(&tok_dir)?
        };
        let template =
            bundle.template(cfg.actor_rollout_ref.model.custom_chat_template.as_deref())?;
        // As training reads them (the raw rows above are only counted).
        // The tools are started (and stopped) too: a tool config that does not load fails here.
        // So are the interactions.
        let runner = setup::tool_runner(cfg).map_err(super::lift)?;
        let interactions = setup::interaction_runner(cfg).map_err(super::lift)?;
        let rendering = setup::agent_rendering(cfg, runner.as_ref(), interactions.as_ref());
        drop((runner, interactions));
        let (train, val) = setup::datasets(cfg, plan, &bundle, &template, with_val, &rendering)
            .map_err(super::lift)?;
        let tool_rows = |d: &crate::data::PromptDataset| {
            d.agents
                .iter()
                .filter(|&&a| a == crate::config::AgentLoopName::ToolAgent)
                .count()
        };
        let val_tool_rows = val.as_ref().map(tool_rows);
        let val_rows = val.map(|v| v.len());
        let (sampler, epoch_rows) = check_sampler(cfg, &train.samples)?;
        setup::total_steps(cfg, plan, epoch_rows)?;
        let tools = rendering
            .tools
            .iter()
            .map(|t| {
                t.pointer("/function/name")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("?")
                    .to_string()
            })
            .collect();
        Ok(Self {
            train_rows: train.len(),
            val_rows,
            filtered: Some(train.filtered_overlong),
            tokenizer_note: None,
            tool_rows: Some((tool_rows(&train), val_tool_rows)),
            tools,
            sampler,
        })
    }
}

pub fn run(args: &ConfigArgs) -> anyhow::Result<()> {
    let loaded = args.load()?;
    if super::print_cfg(args, &loaded)? {
        return Ok(());
    }
    let cfg = &loaded.config;
    let plan = crate::config::resolve(cfg)?;
    crate::trainer::preflight::run(cfg, &plan)?;
    crate::trainer::preflight::tracker_sdks(cfg)?;
    let data = DataSummary::load(cfg, &plan)?;
    for w in &plan.warnings {
        tracing::warn!("{w}");
    }
    print!("{}", explain(cfg, &plan, &data));
    Ok(())
}

fn micro_words(m: MicroBatching) -> String {
    m.describe()
}

fn update_words(out: &mut String, who: &str, u: &UpdatePlan, n: usize, key: &str) {
    let _ = writeln!(
        out,
        "  {who} update: {} mini-batch(es) per step, each {} prompts × {n} = {} responses ({key}.ppo_mini_batch_size counts prompts)",
        u.mini_batches_per_epoch, u.mini_batch_prompts, u.mini_batch_responses
    );
    match (u.micro, u.grad_accum) {
        (MicroBatching::Sequences(m), Some(acc)) => {
            let _ = writeln!(
                out,
                "    each mini-batch runs as {acc} micro-batch(es) of {m} sequences, gradients accumulated over {acc} ({key}.ppo_micro_batch_size_per_gpu)"
            );
        }
        (m, _) => {
            let _ = writeln!(out, "    micro-batches: {}", micro_words(m));
        }
    }
    let norm = if u.global_norm {
        "each micro-batch's loss normalised by the whole mini-batch's tokens / sequences (trainer.use_legacy_worker_impl=disable)".to_string()
    } else {
        let scale = match u.micro {
            MicroBatching::Sequences(_) => format!("× 1/{}", u.grad_accum.unwrap_or(1)),
            MicroBatching::TokenBudget(_) => format!("× its rows / {}", u.mini_batch_responses),
        };
        format!("each micro-batch's loss normalised by its own tokens / sequences, {scale} (verl's default workers; trainer.use_legacy_worker_impl)")
    };
    let _ = writeln!(out, "    losses: {norm}");
    let _ = writeln!(
        out,
        "    optimizer steps per training step: {} mini-batch(es) × {} epoch(s) = {}",
        u.mini_batches_per_epoch,
        u.epochs,
        u.optimizer_steps_per_step()
    );
}

/// The report `config check` prints.
pub fn explain(cfg: &Config, plan: &Plan, data: &DataSummary) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "Configuration is valid.\n");
    data_section(&mut o, cfg, plan, data);
    step_section(&mut o, cfg, plan);
    schedule_section(&mut o, cfg, plan, data);
    models_section(&mut o, cfg, plan);
    agent_section(&mut o, cfg, plan, data);
    reward_section(&mut o, cfg);
    o
}

/// The tool agent loop, when prompts run it: how many, the tools, the limits.
fn agent_section(o: &mut String, cfg: &Config, plan: &Plan, data: &DataSummary) {
    let Some((train, val)) = data.tool_rows else {
        return;
    };
    if train == 0 && val.unwrap_or(0) == 0 {
        return;
    }
    let mt = &cfg.actor_rollout_ref.rollout.multi_turn;
    let _ = writeln!(o, "\nTool agent loop");
    let val = val.map(|v| format!(", {v} of {} validation", data.val_rows.unwrap_or(0)));
    let _ = writeln!(
        o,
        "  prompts: {train} of {} training{} (a row's agent_name, else tool_agent for all when actor_rollout_ref.rollout.multi_turn.enable, else rollout.agent.default_agent_loop)",
        data.train_rows,
        val.unwrap_or_default()
    );
    let tools = if data.tools.is_empty() {
        "none (every call is answered as a call to an unknown tool)".to_string()
    } else {
        data.tools.join(", ")
    };
    let _ = writeln!(
        o,
        "  tools: {tools}, in {} worker process(es), {} s per call",
        cfg.actor_rollout_ref.rollout.agent.num_workers, mt.tool_timeout_s
    );
    let turns = |n: Option<i64>| match crate::config::MultiTurnConfig::turn_limit(n) {
        None => "unlimited".to_string(),
        Some(0) => "1 (a negative limit ends every conversation after its first turn, as in verl)"
            .to_string(),
        Some(n) => n.to_string(),
    };
    let fmt = serde_json::to_value(mt.format).unwrap_or_default();
    let _ = writeln!(
        o,
        "  calls written as {}; up to {} per turn; assistant turns {}, tool turns {}; all turns within the {}-token response budget, tool texts cut to {} characters",
        fmt.as_str().unwrap_or("?"),
        mt.max_parallel_calls,
        turns(mt.max_assistant_turns),
        turns(mt.max_user_turns),
        plan.response_length,
        mt.max_tool_response_length
    );
}

/// The data: prompts kept, where from, the budgets.
fn data_section(o: &mut String, cfg: &Config, plan: &Plan, data: &DataSummary) {
    let _ = writeln!(o, "Data");
    let _ = writeln!(
        o,
        "  training prompts: {} (from {})",
        data.train_rows,
        cfg.data.train_files.to_vec().join(", ")
    );
    if let Some(v) = data.val_rows {
        let _ = writeln!(
            o,
            "  validation prompts: {v} (from {})",
            cfg.data.val_files.to_vec().join(", ")
        );
    }
    if let Some(f) = data.filtered {
        if cfg.data.filter_overlong_prompts {
            let _ = writeln!(
                o,
                "  dropped as longer than {} prompt tokens: {f}",
                plan.prompt_length
            );
        }
    }
    if let Some(note) = &data.tokenizer_note {
        let _ = writeln!(o, "  note: {note}");
    }
    if let Some((name, len, curriculum)) = &data.sampler {
        let _ = writeln!(
            o,
            "  order: {name}, len(sampler) = {len}{}",
            if *curriculum {
                ", update(batch=...) after each step"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(
        o,
        "  prompt budget {} tokens, response budget {} tokens",
        plan.prompt_length, plan.response_length
    );
}

/// One training step: its batch sizes and passes.
fn step_section(o: &mut String, cfg: &Config, plan: &Plan) {
    let n = plan.n;
    let _ = writeln!(o, "\nOne training step");
    let _ = writeln!(
        o,
        "  prompts per step: {} (data.train_batch_size)",
        plan.train_batch_size
    );
    let _ = writeln!(
        o,
        "  responses per step: {} prompts × {n} (actor_rollout_ref.rollout.n) = {}",
        plan.train_batch_size,
        plan.responses_per_step()
    );
    if let Some(f) = &plan.filter_groups {
        let _ = writeln!(
            o,
            "  dynamic sampling (algorithm.filter_groups): batches of {} prompts (data.gen_batch_size) until {} groups whose `{}` differs are kept; {}",
            plan.gen_batch_size,
            plan.train_batch_size,
            f.metric,
            f.max_num_gen_batches
                .map(|k| format!("at most {k} batches a step (max_num_gen_batches)"))
                .unwrap_or_else(|| "no limit on batches a step".into())
        );
    }
    let _ = writeln!(o, "  old log-probs: {}", micro_words(plan.log_prob_micro));
    if let Some(r) = plan.ref_log_prob_micro {
        let _ = writeln!(o, "  reference log-probs: {}", micro_words(r));
    }
    if let Some(c) = plan.critic_forward_micro {
        let _ = writeln!(o, "  critic values: {}", micro_words(c));
    }
    if let Some(c) = &plan.critic {
        update_words(o, "critic", c, n, "critic");
    }
    update_words(o, "actor", &plan.actor, n, "actor_rollout_ref.actor");
    if cfg.trainer.critic_warmup > 0 {
        let _ = writeln!(
            o,
            "    (the actor starts updating after {} critic-only step(s))",
            cfg.trainer.critic_warmup
        );
    }
}

/// Steps, checkpoints and validation.
fn schedule_section(o: &mut String, cfg: &Config, plan: &Plan, data: &DataSummary) {
    let _ = writeln!(o, "\nSchedule");
    let spe = plan.steps_per_epoch(data.train_rows);
    let (rows, g) = (data.train_rows, plan.gen_batch_size);
    let _ = match plan.filter_groups {
        Some(_) => writeln!(
            o,
            "  steps per epoch: {rows} prompts / {g} per generation batch (data.gen_batch_size) = at most {spe}: a step draws one or more batches (the last partial batch is dropped)"
        ),
        None => writeln!(
            o,
            "  steps per epoch: {rows} prompts / {g} per step = {spe} (the last partial batch is dropped)"
        ),
    };
    let total = match cfg.trainer.total_training_steps {
        Some(t) => {
            let _ = writeln!(
                o,
                "  total training steps: {t} (trainer.total_training_steps)"
            );
            t as usize
        }
        None => {
            let t = spe * cfg.trainer.total_epochs;
            let _ = writeln!(
                o,
                "  total training steps: {spe} × {} epoch(s) (trainer.total_epochs) = {t}",
                cfg.trainer.total_epochs
            );
            t
        }
    };
    if total == 0 {
        let _ = writeln!(
            o,
            "  warning: no training step will run (fewer prompts than data.train_batch_size?)"
        );
    }
    let every = |f: Option<u64>| {
        f.map(|f| format!("every {f} step(s) and at the last step"))
            .unwrap_or_else(|| "never".into())
    };
    let _ = writeln!(
        o,
        "  checkpoints: {} into {}",
        every(cfg.trainer.save_freq),
        plan.default_local_dir.display()
    );
    let _ = writeln!(
        o,
        "  validation: {}{}",
        every(cfg.trainer.test_freq),
        if cfg.trainer.val_before_train {
            ", and once before training"
        } else {
            ""
        }
    );
}

/// Which models load, and why.
fn models_section(o: &mut String, cfg: &Config, plan: &Plan) {
    let _ = writeln!(o, "\nModels");
    let _ = writeln!(
        o,
        "  actor (policy, also generates the rollouts; trained): {}",
        cfg.actor_rollout_ref.model.path
    );
    if plan.need_reference {
        let why = match (
            cfg.actor_rollout_ref.actor.use_kl_loss,
            cfg.algorithm.use_kl_in_reward,
        ) {
            (true, true) => "use_kl_loss and use_kl_in_reward",
            (true, false) => "actor_rollout_ref.actor.use_kl_loss",
            _ => "algorithm.use_kl_in_reward",
        };
        match cfg.actor_rollout_ref.model.is_lora() {
            // With LoRA the reference is the actor with its adapters switched off (PEFT's
            // disable_adapter): nothing more is loaded.
            true => {
                let _ = writeln!(
                    o,
                    "  reference (for {why}): the actor's base weights with the LoRA adapters off; no second copy is loaded"
                );
            }
            false => {
                let _ = writeln!(
                    o,
                    "  reference (frozen copy of the actor, for {why}): loaded"
                );
            }
        }
    } else {
        let _ = writeln!(o, "  reference: not loaded (neither actor.use_kl_loss nor algorithm.use_kl_in_reward is on)");
    }
    if plan.need_critic {
        let _ = writeln!(
            o,
            "  critic (value model, trained): {}",
            cfg.critic.model.path
        );
    } else {
        let _ = writeln!(
            o,
            "  critic: not loaded (adv_estimator={} needs none)",
            cfg.algorithm.adv_estimator.as_str()
        );
    }
}

/// The reward stage.
fn reward_section(o: &mut String, cfg: &Config) {
    let _ = writeln!(o, "\nReward");
    let r = &cfg.reward;
    if !r.sources.is_empty() {
        for s in &r.sources {
            let what = match s.kind {
                RewardSourceType::Builtin => {
                    format!("built-in scorer {}", s.scorer.as_deref().unwrap_or("?"))
                }
                RewardSourceType::Python => {
                    format!(
                        "Python {} from {}",
                        s.function.as_deref().unwrap_or("compute_score"),
                        s.path.as_deref().unwrap_or("?")
                    )
                }
                RewardSourceType::Native => {
                    format!("native function {}", s.function.as_deref().unwrap_or("?"))
                }
                RewardSourceType::Model => {
                    format!("reward model {}", s.path.as_deref().unwrap_or("?"))
                }
            };
            let gate = s
                .gate
                .map(|g| {
                    format!(
                        "; gate: below {} -> {}",
                        g.below,
                        serde_json::to_value(g.action)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                            .unwrap_or_default()
                    )
                })
                .unwrap_or_default();
            let _ = writeln!(o, "  {} (weight {}): {what}{gate}", s.name, s.weight);
        }
    } else if let Some(p) = &r.custom_reward_function.path {
        let _ = writeln!(
            o,
            "  custom function {} from {p}, in {} Python worker(s)",
            r.custom_reward_function
                .name
                .as_deref()
                .unwrap_or("compute_score"),
            r.num_workers
        );
    } else {
        let _ = writeln!(
            o,
            "  built-in scorers chosen by each row's data_source (verl's default_compute_score)"
        );
    }
}
