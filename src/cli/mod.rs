//! The command line: `main_ppo [--config FILE | --config-path DIR --config-name NAME] [OVERRIDE ...]`
//! trains (verl's `python -m verl.trainer.main_ppo`); subcommands do the rest
//! (`config check`, ...). A first argument without `=` may be a subcommand, so plain overrides
//! still mean "train".

mod check;
mod generate;
mod guard;
pub mod logging;
mod merge;
mod plot;
mod reference;
mod reward;
mod sft;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::config::{self, ConfigError, ConfigSource, Loaded};

/// Exit status of usage errors (bad arguments, bad configuration), as clap and Hydra use.
pub const EXIT_USAGE: i32 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "main_ppo",
    version,
    about = "PPO / GRPO post-training of causal LMs, configured like verl's main_ppo",
    long_about = "PPO / GRPO post-training of causal LMs, configured like verl's `python -m verl.trainer.main_ppo`.\n\n\
                  Without a subcommand, trains. Configuration: built-in defaults (configs/ppo_trainer.yaml), then a YAML file, \
                  then Hydra-style overrides: key=value, +key=value, ++key=value, ~key.",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub config: ConfigArgs,
}

/// How the configuration is given; shared by every subcommand.
#[derive(Debug, Clone, Default, Args)]
pub struct ConfigArgs {
    /// A YAML file merged over the defaults.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["config_path"])]
    pub config: Option<PathBuf>,
    /// Hydra's config directory (with --config-name).
    #[arg(long = "config-path", value_name = "DIR")]
    pub config_path: Option<PathBuf>,
    /// Hydra's config name: DIR/NAME.yaml (`ppo_trainer` alone means the built-in defaults).
    #[arg(long = "config-name", value_name = "NAME")]
    pub config_name: Option<String>,
    /// `--cfg job` prints the resolved configuration as YAML and exits (Hydra's flag).
    #[arg(long = "cfg", value_name = "job")]
    pub cfg: Option<String>,
    /// Overrides: a.b=v, +a.b=v, ++a.b=v, ~a.b.
    #[arg(value_name = "OVERRIDE")]
    pub overrides: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train (the default when no subcommand is given).
    Train(ConfigArgs),
    /// Inspect a configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Run the configured reward on files of responses.
    #[command(subcommand)]
    Reward(RewardCommand),
    /// Score a file of generations: mean@n and best@n per data_source (verl's main_eval), the
    /// share of non-zero scores and the mean response length.
    Eval(reward::EvalArgs),
    /// Generate `rollout.n` responses per prompt of a dataset (verl's main_generation).
    Generate(generate::GenerateArgs),
    /// Write a checkpoint (LoRA adapters folded into their base model, or full weights), a LoRA
    /// adapter folder with its base model, or a model as one HF model folder (verl's
    /// `model_merger merge`).
    Merge(merge::MergeArgs),
    /// Chart metrics of runs (the `file` logger's JSONL or TensorBoard logs) against the step:
    /// PNG and/or SVG, one line per run.
    Plot(plot::PlotArgs),
    /// Supervised fine-tuning, configured like verl's `python -m verl.trainer.sft_trainer`
    /// (sft_trainer_engine.yaml): multi-turn conversations with tools, loss on assistant tokens.
    Sft(ConfigArgs),
}

#[derive(Debug, Subcommand)]
pub enum RewardCommand {
    /// Score each row; exit status 1 if any row failed.
    Score(reward::ScoreArgs),
    /// Compare each row's score with its `expected` value; exit status 1 on any mismatch.
    Test(reward::TestArgs),
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration, check that its files exist, and explain the batch arithmetic
    /// (loads no model).
    Check(CheckArgs),
    /// Print the resolved configuration as YAML.
    Show(ConfigArgs),
    /// Print the configuration reference (Markdown): every key main_ppo knows, with its type,
    /// default, meaning and status here (implemented, no effect, refused unless default, legacy
    /// spelling). The book's page docs/src/reference/config.md is this output.
    Reference,
}

/// `config check`'s flags: the configuration, and which trainer reads it.
#[derive(Debug, Clone, Default, Args)]
pub struct CheckArgs {
    /// Check a configuration of `main_ppo sft` (verl's SFT trainer) instead of the RL trainer's.
    #[arg(long)]
    pub sft: bool,
    #[command(flatten)]
    pub config: ConfigArgs,
}

impl ConfigArgs {
    /// The YAML source these flags name.
    pub fn source(&self) -> Result<ConfigSource, ConfigError> {
        if let Some(f) = &self.config {
            return Ok(ConfigSource::File(f.clone()));
        }
        match (&self.config_path, &self.config_name) {
            (None, None) => Ok(ConfigSource::Builtin),
            // Hydra's folder and name; verl's own names that the folder lacks (`ppo_trainer`,
            // `ppo_megatron_trainer`) come from the built-in defaults.
            (dir, Some(name)) => Ok(ConfigSource::Hydra {
                dir: dir.clone().unwrap_or_else(|| PathBuf::from(".")),
                name: name.trim_end_matches(".yaml").to_string(),
            }),
            (Some(dir), None) => Err(ConfigError::File {
                file: dir.display().to_string(),
                message: "--config-path needs --config-name".into(),
            }),
        }
    }

    /// Loads the configuration and reports no-effect keys and legacy mappings once.
    pub fn load(&self) -> Result<Loaded, ConfigError> {
        let loaded = config::load(&self.source()?, &self.overrides)?;
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
}

/// Rewrites Hydra's two-letter flags (`-cp`, `-cn`) into clap's long forms.
fn normalise_args(args: impl IntoIterator<Item = String>) -> Vec<String> {
    args.into_iter()
        .map(|a| {
            for (short, long) in [("-cp", "--config-path"), ("-cn", "--config-name")] {
                if a == short {
                    return long.to_string();
                }
                if let Some(rest) = a.strip_prefix(&format!("{short}=")) {
                    return format!("{long}={rest}");
                }
            }
            a
        })
        .collect()
}

/// Runs the program with `args` (argv[0] first, as the OS gives them) and returns the exit
/// status.
pub fn main_with_args<A: Into<OsString>>(args: impl IntoIterator<Item = A>) -> i32 {
    main_with(args, crate::reward::NativeRegistry::new())
}

/// The arguments as UTF-8 strings; a first one that is not names its position and shows its
/// bytes (lossily), since keys, values and paths are all read as text.
pub fn utf8_args<A: Into<OsString>>(
    args: impl IntoIterator<Item = A>,
) -> Result<Vec<String>, String> {
    args.into_iter()
        .enumerate()
        .map(|(i, a)| {
            a.into().into_string().map_err(|raw| {
                format!(
                    "argument {i} ({:?}) is not valid UTF-8: main_ppo reads keys, values and paths as UTF-8 text; rename the file or re-encode the value",
                    raw.to_string_lossy()
                )
            })
        })
        .collect()
}

/// As [`main_with_args`], with native reward functions registered by a binary built on this
/// library (selected with `{type: native, function: <name>}` in `reward.sources`).
pub fn main_with<A: Into<OsString>>(
    args: impl IntoIterator<Item = A>,
    natives: crate::reward::NativeRegistry,
) -> i32 {
    let args = match utf8_args(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let cli = match Cli::try_parse_from(normalise_args(args)) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    logging::init();
    // MAIN_PPO_GLIBC_MALLOC=1 keeps glibc's defaults (to measure what the settings save).
    if std::env::var_os("MAIN_PPO_GLIBC_MALLOC").is_none() {
        crate::kernels::alloc::keep_freed_memory();
    }
    match run(cli, &natives) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            if e.downcast_ref::<ConfigError>().is_some() {
                EXIT_USAGE
            } else {
                1
            }
        }
    }
}

/// Runs a command; `Ok(false)` is a completed run that found failures (exit status 1).
fn run(cli: Cli, natives: &crate::reward::NativeRegistry) -> anyhow::Result<bool> {
    // The instruction set first: which bf16 kernels exist depends on it.
    let choice = std::env::var("MAIN_PPO_CPU").ok();
    crate::kernels::cpu::check_choice(choice.as_deref()).map_err(|message| ConfigError::Value {
        key: "MAIN_PPO_CPU".into(),
        message,
    })?;
    let choice = std::env::var("MAIN_PPO_BF16_KERNEL").ok();
    crate::kernels::bf16::check_choice(choice.as_deref()).map_err(|message| {
        ConfigError::Value {
            key: "MAIN_PPO_BF16_KERNEL".into(),
            message,
        }
    })?;
    match cli.command {
        None => train(&cli.config, natives).map(|_| true),
        Some(Command::Train(args)) => train(&args, natives).map(|_| true),
        Some(Command::Config(ConfigCommand::Check(a))) if a.sft => {
            sft::check(&a.config).map(|_| true)
        }
        Some(Command::Config(ConfigCommand::Check(a))) => check::run(&a.config).map(|_| true),
        Some(Command::Sft(args)) => sft::run(&args).map(|_| true),
        Some(Command::Config(ConfigCommand::Show(args))) => {
            print!("{}", args.load()?.config.to_yaml());
            Ok(true)
        }
        Some(Command::Config(ConfigCommand::Reference)) => {
            print!("{}", reference::page());
            Ok(true)
        }
        Some(Command::Reward(RewardCommand::Score(args))) => reward::score(&args, natives),
        Some(Command::Reward(RewardCommand::Test(args))) => reward::test(&args, natives),
        Some(Command::Eval(args)) => reward::eval(&args, natives),
        Some(Command::Generate(args)) => generate::run(&args).map(|_| true),
        Some(Command::Plot(args)) => plot::run(&args).map(|_| true),
        Some(Command::Merge(args)) => merge::run(&args).map(|_| true),
    }
}

/// `--cfg job`: print and stop. Returns true when it did.
fn print_cfg(args: &ConfigArgs, loaded: &Loaded) -> anyhow::Result<bool> {
    match args.cfg.as_deref() {
        None => Ok(false),
        Some("job") => {
            print!("{}", loaded.config.to_yaml());
            Ok(true)
        }
        Some(other) => Err(ConfigError::Value {
            key: "--cfg".into(),
            message: format!("`{other}`: only `--cfg job` is supported"),
        }
        .into()),
    }
}

fn train(args: &ConfigArgs, natives: &crate::reward::NativeRegistry) -> anyhow::Result<()> {
    let loaded = args.load()?;
    if print_cfg(args, &loaded)? {
        return Ok(());
    }
    let timeout = loaded.config.actor_rollout_ref.nccl_timeout;
    on_launched_ranks(timeout, |comm| train_on(loaded, natives, comm))
}

/// Runs `f` as this process's data-parallel rank of the launcher that started it (one process
/// when none did); `timeout_s`: how long a rank waits for its peers in one collective.
pub(crate) fn on_launched_ranks(
    timeout_s: u64,
    f: impl FnOnce(crate::dist::Comm) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let comm = crate::dist::from_env(std::time::Duration::from_secs(timeout_s.max(1)))?;
    if comm.world_size() > 1 {
        tracing::info!(
            "data parallel: rank {} of {} ({} backend, local rank {})",
            comm.rank(),
            comm.world_size(),
            comm.backend(),
            comm.local_rank()
        );
    }
    let result = f(comm.clone());
    if let Err(e) = &result {
        if comm.world_size() > 1 {
            // No orderly shutdown (MPI_Finalize would wait for ranks that wait for this one):
            // the process exits with its error and the launcher stops the other ranks.
            eprintln!("{}error: {e:#}", crate::dist::rank_prefix(comm.as_ref()));
            std::mem::forget(comm);
        }
    }
    result
}

fn train_on(
    loaded: crate::config::Loaded,
    natives: &crate::reward::NativeRegistry,
    comm: crate::dist::Comm,
) -> anyhow::Result<()> {
    use crate::trainer::{FitOutcome, Trainer, TrainerOptions};
    let plan = config::resolve(&loaded.config)?;
    let stop = stop_on_signals();
    let opts = TrainerOptions {
        natives: natives.clone(),
        stop,
        tracker: None,
        comm,
    };
    let mut trainer = Trainer::with_plan(loaded.config, plan, opts).map_err(lift)?;
    tracing::info!(
        "training: steps {}..{} of {}, checkpoints in {}",
        trainer.global_step + 1,
        trainer.total_steps,
        trainer.total_steps,
        trainer.plan.default_local_dir.display()
    );
    match trainer.fit().map_err(lift)? {
        FitOutcome::Finished { steps } => tracing::info!("training finished after {steps} steps"),
        FitOutcome::DataExhausted { steps } => {
            tracing::info!("training ended after {steps} steps: the training data ran out")
        }
        FitOutcome::ValidatedOnly => tracing::info!("validation done (trainer.val_only)"),
        FitOutcome::Interrupted { step, checkpoint } => tracing::info!(
            "stopped after step {step}{}",
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

/// A flag set by the first Ctrl-C or SIGTERM (the trainer finishes its step, saves and exits
/// 0; a hub download while the models load stops at once, see `weights::hub::request_stop`);
/// a second signal exits at once with status 130.
pub(crate) fn stop_on_signals() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, OnceLock};
    static FLAG: OnceLock<Arc<AtomicBool>> = OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicBool::new(false));
        let f = flag.clone();
        let installed = ctrlc::set_handler(move || {
            if f.swap(true, Ordering::SeqCst) {
                eprintln!("second interrupt: exiting without saving");
                std::process::exit(130);
            }
            // A model download under way ends now, with an error saying so: no step has begun.
            if crate::weights::hub::request_stop() {
                eprintln!("interrupt: stopping the model download (interrupt again to quit now)");
            } else {
                eprintln!("interrupt: finishing the current step, then saving a checkpoint (interrupt again to quit now)");
            }
        });
        if let Err(e) = installed {
            tracing::warn!("cannot install the Ctrl-C handler: {e}");
        }
        flag
    })
    .clone()
}

/// A trainer error for the CLI's edge: a configuration error keeps its own type (exit status 2,
/// as `config check` and training report it alike).
pub(crate) fn lift(e: crate::trainer::TrainerError) -> anyhow::Error {
    match e {
        crate::trainer::TrainerError::Config(c) => anyhow::Error::from(c),
        other => anyhow::Error::from(other),
    }
}
