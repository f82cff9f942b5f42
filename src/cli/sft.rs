//! `main_ppo sft` (verl's `python -m verl.trainer.sft_trainer`) and `main_ppo config check
//! --sft`: the SFT configuration loaded, checked and run.

use std::path::Path;

use super::ConfigArgs;
use crate::config::{load_sft, resolve_sft, ConfigError, LoadedSft, SftPlan};

/// verl's SFT config names; others must be a file `--config-path` holds.
const SFT_NAMES: &[&str] = &["sft_trainer_engine", "sft_trainer"];

/// Loads the SFT configuration these flags name and reports no-effect keys once.
pub fn load(args: &ConfigArgs) -> Result<LoadedSft, ConfigError> {
    let file = match (&args.config, &args.config_path, &args.config_name) {
        (Some(f), _, _) => Some(f.clone()),
        (None, _, None) => None,
        (None, dir, Some(name)) => {
            let stem = name.trim_end_matches(".yaml");
            let path = dir
                .clone()
                .unwrap_or_else(|| ".".into())
                .join(format!("{stem}.yaml"));
            if path.is_file() {
                Some(path)
            } else if SFT_NAMES.contains(&stem) {
                None
            } else {
                return Err(ConfigError::File {
                    file: path.display().to_string(),
                    message: "does not exist (--config-path / --config-name)".into(),
                });
            }
        }
    };
    let loaded = load_sft(file.as_ref(), &args.overrides)?;
    for n in &loaded.notices {
        tracing::info!("{n}");
    }
    if !loaded.no_effect.is_empty() {
        tracing::warn!(
            "these verl keys have no effect in main_ppo and are ignored: {}",
            loaded.no_effect.join(", ")
        );
    }
    Ok(loaded)
}

/// `main_ppo sft`: trains.
pub fn run(args: &ConfigArgs) -> anyhow::Result<()> {
    let loaded = load(args)?;
    if args.cfg.as_deref() == Some("job") {
        print!("{}", serde_yaml_ng::to_string(&loaded.config)?);
        return Ok(());
    }
    let plan = resolve_sft(&loaded.config)?;
    check_paths(&loaded.config, &plan)?;
    // verl's SFT config has no collective timeout; RL's default (actor_rollout_ref.nccl_timeout).
    super::on_launched_ranks(600, |comm| train_on(loaded.config, plan, comm))
}

fn train_on(
    cfg: crate::config::SftConfig,
    plan: SftPlan,
    comm: crate::dist::Comm,
) -> anyhow::Result<()> {
    let mut t =
        crate::trainer::sft::SftTrainer::on_ranks(cfg, plan, true, comm).map_err(super::lift)?;
    tracing::info!(
        "sft: steps {}..{} of {}, checkpoints in {}",
        t.global_step + 1,
        t.total_steps,
        t.total_steps,
        t.plan.default_local_dir.display()
    );
    t.stop_on(super::stop_on_signals());
    match t.fit()? {
        crate::trainer::sft::SftOutcome::Finished { steps } => {
            tracing::info!("sft finished after {steps} steps")
        }
        crate::trainer::sft::SftOutcome::Interrupted { steps, checkpoint } => tracing::info!(
            "sft interrupted after step {steps}{}",
            checkpoint
                .map(|c| format!(
                    "; resume with the same command (checkpoint {})",
                    c.display()
                ))
                .unwrap_or_default()
        ),
    }
    Ok(())
}

/// The inputs an SFT run reads exist and its checkpoint folder can be written.
fn check_paths(cfg: &crate::config::SftConfig, plan: &SftPlan) -> Result<(), ConfigError> {
    let mut problems = Vec::new();
    for (key, files) in [
        ("data.train_files", &plan.train_files),
        ("data.val_files", &plan.val_files),
    ] {
        for f in files {
            let p = crate::util::expand_home(f);
            if !Path::new(&p).is_file() {
                problems.push(format!("{key}: {p} does not exist"));
            }
        }
    }
    let m = crate::util::expand_home(&cfg.model.path);
    if !Path::new(&m).exists() && !crate::weights::is_hub_id(&cfg.model.path) {
        problems.push(format!(
            "model.path: {m} is neither a local model nor a hub id"
        ));
    }
    if let Some(a) = &cfg.model.lora_adapter_path {
        let a = crate::util::expand_home(a);
        if !Path::new(&a).exists() {
            problems.push(format!("model.lora_adapter_path: {a} does not exist"));
        }
    }
    let mut dir = plan.default_local_dir.as_path();
    while !dir.as_os_str().is_empty() && !dir.exists() {
        dir = dir.parent().unwrap_or(Path::new(""));
    }
    if dir.is_file() {
        problems.push(format!(
            "trainer.default_local_dir: {} lies below the file {}",
            plan.default_local_dir.display(),
            dir.display()
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::Invalid(problems))
    }
}

/// `main_ppo config check --sft`: the rules, the files, and one step's arithmetic in words.
pub fn check(args: &ConfigArgs) -> anyhow::Result<()> {
    let loaded = load(args)?;
    let plan = resolve_sft(&loaded.config)?;
    check_paths(&loaded.config, &plan)?;
    let c = &loaded.config;
    let d = &c.data;
    println!("configuration OK (verl's SFT trainer)");
    println!(
        "  step: {} conversations of at most {} tokens (data.max_length, truncation={}), one optimizer step",
        d.train_batch_size,
        d.max_length,
        serde_json::to_value(d.truncation)?.as_str().unwrap_or("?")
    );
    println!(
        "  micro-batches: {} ({}), loss = -sum(loss_mask * log p) / loss tokens of the step",
        plan.micro.describe(),
        if c.model.use_remove_padding {
            "packed"
        } else {
            "padded"
        }
    );
    let steps = match c.trainer.total_training_steps {
        Some(n) => format!("{n} steps (trainer.total_training_steps)"),
        None => format!("{} epochs (trainer.total_epochs)", c.trainer.total_epochs),
    };
    let lora = if c.model.is_lora() {
        format!(
            "LoRA rank {} alpha {}",
            c.model.lora_rank, c.model.lora_alpha
        )
    } else {
        "all weights".into()
    };
    println!(
        "  training: {steps}, {lora}, lr {} ({:?} schedule)",
        c.optim.lr, c.optim.lr_scheduler_type
    );
    println!(
        "  data: {}; validation: {}",
        plan.train_files.join(", "),
        if plan.val_files.is_empty() {
            "none".to_string()
        } else {
            plan.val_files.join(", ")
        }
    );
    println!("  checkpoints: {}", plan.default_local_dir.display());
    Ok(())
}
