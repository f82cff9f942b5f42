//! The training loop: one [`Trainer::step`] is verl's PPO step, in verl's order.
//!
//! ```text
//! prompts ─► rollout (n per prompt, one uid per prompt) ─► reward ─► old log-probs (actor)
//!         ─► ref log-probs (use_kl_loss | use_kl_in_reward) ─► teacher log-probs (distillation)
//!         ─► values (critic, gae)
//!         ─► KL in reward ─► advantages ─► critic update ─► actor update (after critic_warmup)
//!         ─► custom sampler's update (data.sampler, curriculum)
//!         ─► validation (test_freq, last) ─► checkpoint (save_freq, last) ─► metrics
//! ```
//!
//! With `algorithm.filter_groups.enable` the rollout and reward repeat over generation
//! batches until enough groups differ in their reward (`dynamic`, DAPO's dynamic sampling).
//! Rollout correction (`rollout_corr`) weighs or rejects tokens in the `adv` phase, between the
//! KL penalty and the estimator, from the rollout's own log-probs; in bypass mode those are the
//! old log-probs and the `old_log_prob` pass does not run.
//!
//! Parts: `batch` (a step's rows and their tensors), `actor` (policy and reference log-probs,
//! policy update), `critic` (values, value update), `update` (the mini/micro-batch schedule),
//! `optim` (AdamW, LR schedules), `sampler` (verl's custom sampler: building it, the step's data
//! its `update` gets), `state` (checkpoint save and resume), `validate`
//! (validation metrics), `step_metrics` (verl's data metrics).

pub mod actor;
pub mod advantage;
pub mod batch;
pub mod critic;
mod dumps;
pub mod dynamic;
pub mod micro;
pub mod optim;
mod phases;
pub mod preflight;
pub mod rollout_corr;
pub mod sampler;
pub mod setup;
pub mod sft;
mod state;
mod step_metrics;
pub mod teacher;
pub mod trainable;
pub mod update;
mod validate;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use optim::{clip_grad_norm, AdamW, LrSchedule};

use self::actor::{Actor, Reference};
use self::critic::Critic;
use self::phases::{OldLogProbs, RolloutWorker};
use crate::algo::KlController;
use crate::checkpoint::CheckpointError;
use crate::config::{Config, ConfigError, Plan};
use crate::control::ControlServer;
use crate::data::{BatchLoader, DataError, PromptDataset, TokenizerBundle};
use crate::dist::Comm;
use crate::metrics::{Metrics, Timings, Tracker};
use crate::model::ModelError;
use crate::reward::{NativeRegistry, RewardError, RewardManager};
use crate::rollout::SamplingParams;

#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Reward(#[from] RewardError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Dist(#[from] crate::dist::DistError),
    #[error("{0}")]
    Tensor(#[from] candle_core::Error),
    #[error("{0}")]
    Other(String),
    /// Dynamic sampling used up the data of `trainer.total_epochs` before a step had its groups
    /// (the run ends there, as verl's does when its loader runs out).
    #[error("the training data of trainer.total_epochs = {epochs} epoch(s) ran out during step {step}: dynamic sampling (algorithm.filter_groups) had kept {kept} of data.train_batch_size = {needed} groups after {gen_batches} generation batch(es)")]
    DataExhausted {
        epochs: usize,
        step: u64,
        kept: usize,
        needed: usize,
        gen_batches: usize,
    },
    /// A stop was requested (Ctrl-C, SIGTERM) during `phase` of a step not yet updated: the
    /// step is abandoned ([`Trainer::fit`] puts the loader and sampler back, saves and ends).
    #[error("stopped on request during the {phase} at step {step}")]
    Stopped { step: u64, phase: &'static str },
}

pub type Result<T> = std::result::Result<T, TrainerError>;

/// How a call to [`Trainer::fit`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum FitOutcome {
    /// All `total_training_steps` ran.
    Finished { steps: u64 },
    /// `trainer.val_only`: one validation, no training.
    ValidatedOnly,
    /// Dynamic sampling ran out of training data (`trainer.total_epochs`) before
    /// `total_training_steps`: `steps` steps ran; the last is checkpointed when
    /// `trainer.save_freq` is set.
    DataExhausted { steps: u64 },
    /// A stop was requested (Ctrl-C, SIGTERM): the step under way finished (or, stopped in its
    /// rollout, tool, teacher or dynamic-sampling phase, was abandoned: the resumed run repeats
    /// it) and the newest finished step's checkpoint was saved.
    Interrupted {
        step: u64,
        checkpoint: Option<PathBuf>,
    },
}

/// What a run needs besides its configuration.
pub struct TrainerOptions {
    /// Native (Rust) reward functions the configuration may name.
    pub natives: NativeRegistry,
    /// Set to request a clean stop after the current step.
    pub stop: Arc<AtomicBool>,
    /// Metric sinks; `None` = those of `trainer.logger` (on rank 0; other ranks log nothing).
    pub tracker: Option<Tracker>,
    /// The data-parallel collectives (one process by default; see [`crate::dist`]).
    pub comm: Comm,
}

impl Default for TrainerOptions {
    fn default() -> Self {
        Self {
            natives: NativeRegistry::default(),
            stop: Arc::new(AtomicBool::new(false)),
            tracker: None,
            comm: crate::dist::single(),
        }
    }
}

pub struct Trainer {
    pub cfg: Config,
    pub plan: Plan,
    pub tokenizer: TokenizerBundle,
    train: PromptDataset,
    val: Option<PromptDataset>,
    loader: BatchLoader,
    pub actor: Actor,
    reference: Option<Reference>,
    /// On-policy distillation's frozen teachers (`distillation.enabled`).
    teachers: Option<teacher::Teachers>,
    pub critic: Option<Critic>,
    reward: RewardManager,
    rollout: RolloutWorker,
    pub kl_ctrl: KlController,
    tracker: Tracker,
    /// Steps completed (verl's `global_steps` − 1 during a step).
    pub global_step: u64,
    pub total_steps: u64,
    stop: Arc<AtomicBool>,
    last_saved: Option<u64>,
    /// The live-weights HTTP API (`reward.control.enable`).
    pub control: Option<ControlServer>,
    /// The metrics of the last [`HISTORY_LEN`] steps (all are sent to the sinks).
    pub history: VecDeque<(u64, Metrics)>,
    /// The data-parallel collectives: rank 0 writes checkpoints, metrics and dumps.
    pub comm: Comm,
}

/// Steps of metrics a [`Trainer`] keeps in memory.
pub const HISTORY_LEN: usize = 1000;

impl Trainer {
    /// Loads everything a run needs, reward functions first (a broken reward file fails before
    /// any model is read), then resumes from a checkpoint as `trainer.resume_mode` says.
    pub fn new(cfg: Config, opts: TrainerOptions) -> Result<Self> {
        let plan = crate::config::resolve(&cfg)?;
        Self::with_plan(cfg, plan, opts)
    }

    /// [`Trainer::new`] with `plan` already resolved from `cfg` (the command line resolves the
    /// configuration once and hands the plan over).
    pub fn with_plan(cfg: Config, plan: Plan, opts: TrainerOptions) -> Result<Self> {
        for w in &plan.warnings {
            tracing::warn!("{w}");
        }
        preflight::run(&cfg, &plan)?;
        setup::check_world(&cfg, &plan, opts.comm.as_ref())?;
        let reward = setup::reward_manager(&cfg, &plan, &opts.natives)?;
        // The trackers open their runs before any model is read: a missing SDK fails here.
        // Only rank 0 talks to them.
        let tracker = match opts.tracker {
            Some(t) => t,
            None if opts.comm.rank() == 0 => setup::tracker(
                &cfg,
                &state::saved_tracker_runs(&cfg, &plan.default_local_dir),
            )?,
            None => Tracker::with_sinks(Vec::new()),
        };
        // One GPU per rank of a node: `auto`/`cuda` take the local rank's.
        let device = crate::model::device_at(&cfg.trainer.device, opts.comm.local_rank())?;
        setup::say_cpu_kernels(&cfg, &device);
        let setup::Policy {
            mut actor,
            tokenizer,
            train,
            val,
            total_steps,
            agent,
            sampler,
        } = setup::policy(&cfg, &plan, &device)?;
        for ds in std::iter::once(&train).chain(val.as_ref()) {
            let rows = ds.samples.iter().map(|s| {
                let file = s.file.as_str();
                (file, s.row, s.data_source.as_str(), &s.ground_truth)
            });
            if let Some(w) = reward.numeric_ground_truth_warning(rows) {
                tracing::warn!("{w}");
            }
        }
        let pad = tokenizer.pad_token_id;
        let reference = setup::reference(&cfg, &plan, &actor, &device, pad)?;
        let teachers = setup::teachers(&cfg, &plan, &tokenizer, &device)?;
        let mut critic = match plan.need_critic {
            true => Some(setup::critic(
                &cfg,
                &plan,
                &device,
                &tokenizer,
                total_steps,
            )?),
            false => None,
        };
        setup::say_prefix_sharing(&cfg, &actor, reference.as_ref(), critic.as_ref());
        actor.trainable.set_comm(opts.comm.clone());
        if let Some(c) = critic.as_mut() {
            c.trainable.set_comm(opts.comm.clone());
        }
        let r = &cfg.actor_rollout_ref.rollout;
        let params = SamplingParams::train(r, plan.response_length, &tokenizer.eos_token_ids);
        let loader = sampler::loader(
            &cfg,
            train.len(),
            plan.gen_batch_size,
            plan.seeds.data,
            sampler,
            opts.comm.world_size(),
        )?;
        let mut t = Trainer {
            rollout: RolloutWorker::new(
                params,
                plan.n,
                plan.seeds.rollout,
                plan.rollout_correction.is_some(),
            )
            .with_agent(agent),
            kl_ctrl: KlController::new(&cfg.algorithm.kl_ctrl),
            cfg,
            plan,
            tokenizer,
            train,
            val,
            loader,
            actor,
            reference,
            teachers,
            critic,
            reward,
            tracker,
            global_step: 0,
            total_steps,
            stop: opts.stop,
            last_saved: None,
            control: None,
            history: VecDeque::new(),
            comm: opts.comm,
        };
        t.resume()?;
        if t.cfg.reward.control.enable && t.comm.rank() == 0 {
            let server =
                ControlServer::start(&t.cfg.reward.control, t.reward.weights(), t.total_steps)
                    .map_err(TrainerError::Other)?;
            t.control = Some(server);
        }
        Ok(t)
    }

    /// Runs validation before training (`val_before_train`), then steps until
    /// `total_training_steps` or a stop request; then flushes and closes the remote trackers.
    pub fn fit(&mut self) -> Result<FitOutcome> {
        let out = self.fit_steps();
        self.tracker.finish();
        out
    }

    /// The remote trackers' run ids (saved in `trainer_state.json`).
    pub fn tracker_runs(&self) -> std::collections::BTreeMap<String, String> {
        self.tracker.run_ids()
    }

    fn fit_steps(&mut self) -> Result<FitOutcome> {
        if self.val.is_some() && (self.cfg.trainer.val_before_train || self.cfg.trainer.val_only) {
            let m = match self.validate() {
                Err(e @ TrainerError::Stopped { .. }) => {
                    tracing::warn!("{e}: validation before training ends unreported");
                    return self.interrupted();
                }
                m => m?,
            };
            self.log(m, self.global_step);
            if self.cfg.trainer.val_only {
                return Ok(FitOutcome::ValidatedOnly);
            }
        }
        let bar = progress_bar(self.total_steps, self.global_step);
        while self.global_step < self.total_steps {
            if self.stop_requested()? {
                return self.interrupted();
            }
            let (cursor, sampler) = (self.loader.cursor(), self.rollout.sampler.state());
            let m = match self.step() {
                Err(e @ TrainerError::DataExhausted { .. }) => return self.data_exhausted(e),
                Err(e @ TrainerError::Stopped { .. }) => {
                    // Nothing of the step is kept: its prompts and sampler go back, so the
                    // checkpoint is the previous step's and a resumed run repeats this one.
                    self.loader.rewind(cursor);
                    self.rollout.sampler = crate::rollout::Sampler::restore(sampler);
                    tracing::warn!("{e}: the step is abandoned (a resumed run repeats it)");
                    return self.interrupted();
                }
                m => m?,
            };
            self.log(m, self.global_step);
            bar.set_position(self.global_step);
        }
        bar.finish_and_clear();
        if self.stop_requested()? && self.last_saved != Some(self.global_step) {
            return self.interrupted();
        }
        Ok(FitOutcome::Finished {
            steps: self.global_step,
        })
    }

    /// Whether a stop was requested on any rank (all ranks then stop after the same step).
    fn stop_requested(&self) -> Result<bool> {
        let here = self.stop.load(Ordering::SeqCst);
        Ok(crate::dist::any(self.comm.as_ref(), here)?)
    }

    /// `Err(Stopped)` when a stop was requested (on any rank): called between the phases of a
    /// step before its update, and between generation and validation batches, where a step
    /// or a validation may run long (all ranks call it at the same points).
    pub(super) fn check_stop(&self, phase: &'static str, step: u64) -> Result<()> {
        match self.stop_requested()? {
            true => Err(TrainerError::Stopped { step, phase }),
            false => Ok(()),
        }
    }

    /// The end of a run whose data ran out mid-step: the completed steps' checkpoint (with
    /// `save_freq`, when the last one is not saved yet; the partial step left no trace in it).
    fn data_exhausted(&mut self, e: TrainerError) -> Result<FitOutcome> {
        tracing::warn!("{e}; the run ends after step {}", self.global_step);
        let unsaved = self.global_step > 0 && self.last_saved != Some(self.global_step);
        if self.cfg.trainer.save_freq.is_some() && unsaved {
            self.save_checkpoint()?;
        }
        Ok(FitOutcome::DataExhausted {
            steps: self.global_step,
        })
    }

    fn interrupted(&mut self) -> Result<FitOutcome> {
        let checkpoint = if self.global_step > 0 && self.last_saved != Some(self.global_step) {
            Some(self.save_checkpoint()?)
        } else if self.global_step > 0 {
            Some(crate::checkpoint::step_dir(
                &self.plan.default_local_dir,
                self.global_step,
            ))
        } else {
            None
        };
        tracing::warn!(
            "stopped after step {} on request{}",
            self.global_step,
            checkpoint
                .as_ref()
                .map(|p| format!("; checkpoint {}", p.display()))
                .unwrap_or_default()
        );
        Ok(FitOutcome::Interrupted {
            step: self.global_step,
            checkpoint,
        })
    }

    fn log(&mut self, m: Metrics, step: u64) {
        self.tracker.log(&m, step);
        if let Some(c) = &self.control {
            c.publish(step, &m);
        }
        if self.history.len() == HISTORY_LEN {
            self.history.pop_front();
        }
        self.history.push_back((step, m));
    }

    /// One PPO step, in verl's order (`RayPPOTrainer.fit`); returns its metrics (also sent
    /// to the sinks by [`Trainer::fit`]).
    pub fn step(&mut self) -> Result<Metrics> {
        let (step, started) = (self.global_step + 1, Instant::now());
        self.apply_weight_changes(step)?;
        let (mut t, mut m) = (Timings::default(), Metrics::new());
        let (mut batch, epoch) = match self.plan.filter_groups.clone() {
            None => {
                let (prompts, epoch) = self.next_prompts()?;
                crate::util::fault_point("rollout", step);
                let batch = self.rollout_and_reward(&prompts, &mut t)?;
                self.check_stop("rollout (and its tool calls)", step)?;
                (batch, epoch)
            }
            Some(f) => match self.dynamic_sampling(&f, &mut t, &mut m)? {
                Ok(rows) => rows,
                Err(e) => {
                    return Err(TrainerError::DataExhausted {
                        epochs: self.cfg.trainer.total_epochs,
                        step,
                        kept: e.kept,
                        needed: self.plan.train_batch_size,
                        gen_batches: e.gen_batches,
                    })
                }
            },
        };
        let old = self.old_log_probs(&batch)?;
        match old {
            OldLogProbs::Pass => {
                t.time("old_log_prob", || self.actor.compute_log_prob(&mut batch))?
            }
            OldLogProbs::Rollout => {
                let rollout = batch.column(batch::Column::RolloutLogProbs)?.clone();
                batch.set(batch::Column::OldLogProbs, rollout)?;
            }
            OldLogProbs::FromUpdate => {}
        }
        if let Some(r) = &self.reference {
            t.time("ref", || r.compute_ref_log_prob(&mut batch))?;
        }
        if let Some(teachers) = &self.teachers {
            crate::util::fault_point("teacher", step);
            t.time("teacher", || teachers.compute(&mut batch, &self.train))?;
            m.insert("perf/teacher_memory_gb".into(), teachers.memory_gb());
            self.check_stop("teacher log-probs", step)?;
        }
        if let Some(c) = &self.critic {
            t.time("values", || c.compute_values(&mut batch))?;
        }
        let mut batch = if self.comm.world_size() > 1 {
            t.time("gather", || self.gather(batch))?
        } else {
            batch
        };
        if self.cfg.trainer.balance_batch {
            m.extend(self.balance(&mut batch));
        }
        m.extend(t.time("adv", || self.compute_advantages(&mut batch, step))?);
        self.update_models(&mut batch, step, old, &mut t, &mut m)?;
        if old == OldLogProbs::FromUpdate {
            m.extend(self.rollout_diagnostics_after_update(&mut batch)?);
        }
        self.global_step = step;
        self.update_sampler(&batch, step)?;
        if let (Some(dir), 0) = (self.cfg.trainer.rollout_data_dir.clone(), self.comm.rank()) {
            self.dump_rollouts(&dir, &batch)?;
        }
        // verl's `timing_s/step` (and so perf/*) stops here: validation and saving are timed
        // on their own.
        let elapsed = started.elapsed().as_secs_f64();
        self.validate_and_save(step, &mut t, &mut m)?;
        self.step_metrics(&batch, epoch, elapsed, t, &mut m)?;
        Ok(m)
    }
}

/// A progress bar with ETA on a terminal; hidden otherwise (logs stay clean).
fn progress_bar(total: u64, done: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} step {pos}/{len} [{elapsed_precise} < {eta_precise}] {wide_bar}",
    ) {
        bar.set_style(style);
    }
    bar.set_position(done);
    bar
}

#[cfg(test)]
mod tests;
