//! `main_ppo sft`: verl's SFT trainer (`verl/trainer/sft_trainer.py`, 1dda039) as a second loop
//! beside the PPO one, on the same rooms: the model, LoRA adapters, optimizer, LR schedule and
//! update schedule of [`Trainable`], micro-batches (row counts or token budgets, packed or
//! padded) of [`StepBatch`], the loader, the checkpoint layout's atomic saves, the trackers.
//!
//! ```text
//! step: train_batch_size conversations (seeded shuffle per epoch, last partial batch dropped)
//!     ─► micro-batches ─► −Σ loss_mask·log p(token) / (loss tokens of the whole step), summed
//!     ─► clip, AdamW, LR schedule ─► val/loss (test_freq, last) ─► checkpoint (save_freq, last)
//! ```
//!
//! The loss is verl's `sft_loss` (`verl/workers/utils/losses.py`): each micro-batch's masked sum
//! of negative log-probs divided by `batch_num_tokens`, the loss-mask count of the whole global
//! batch, so the summed micro-batch gradients are the step's token-mean gradient whatever the
//! micro-batching. A conversation enters a [`StepBatch`] as a row whose prompt is everything
//! before its first trained token and whose response is the rest, with the loss mask as the
//! `response_mask` column: the log-prob of token t is computed from the tokens before it, as
//! verl's loss mask rolled left by one position pairs them.
//!
//! Metrics (verl's names): `train/loss`, `train/grad_norm`, `train/lr`, `train/global_tokens`
//! (tokens of the step's conversations), `train/total_tokens(B)`, `val/loss` (the mean over
//! validation batches of each batch's token-mean loss).
//!
//! Checkpoints use verl's SFT layout: `global_step_N/huggingface/` (an HF model folder, or with
//! LoRA the config and tokenizer beside `lora_adapter/`), `optim.*`, `trainer_state.json`
//! (step, loader position, updates, tokens seen), `config.yaml`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::actor::response_logprobs;
use super::batch::{Column, StepBatch};
use super::micro::{Layout, MicroInputs};
use super::setup;
use super::state::base_fingerprint;
use super::trainable::{Trainable, UpdateSettings};
use super::update::{MicroCtx, MicroLoss};
use super::{Result, TrainerError};
use crate::algo::agg::scalar;
use crate::algo::agg_loss;
use crate::checkpoint;
use crate::config::sft::SftConfig;
use crate::config::{LossAggMode, MicroBatching, SftPlan, UpdatePlan};
use crate::data::sft::{SftDataset, SftExample, SftOptions};
use crate::data::{BatchLoader, LoaderCursor, TokenizerBundle};
use crate::metrics::{Metrics, Tracker};
use crate::model::{CausalLm, Exec};

fn other(e: impl std::fmt::Display) -> TrainerError {
    TrainerError::Other(e.to_string())
}

/// `trainer_state.json` of an SFT checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SftState {
    pub global_step: u64,
    pub loader: LoaderCursor,
    /// Conversations in the training data when saved.
    pub train_rows: usize,
    /// data.train_batch_size when saved (the loader counts batches of it).
    pub train_batch_size: usize,
    /// Optimizer steps made (the LR scheduler's position).
    pub updates: u64,
    /// `train/total_tokens(B)`'s count so far.
    pub total_tokens: u64,
    /// The remote trackers' run ids, continued by a resumed run.
    #[serde(default)]
    pub tracker_runs: std::collections::BTreeMap<String, String>,
    /// With LoRA: the fingerprint of the frozen base the adapters were trained on.
    #[serde(default)]
    pub lora_base: Option<String>,
}

/// The SFT dataset options of `cfg.data` (`max_samples` from `limit`: -1 = all).
pub fn sft_options(cfg: &SftConfig, limit: i64) -> SftOptions {
    let d = &cfg.data;
    SftOptions {
        messages_key: d.messages_key.clone(),
        tools_key: d.tools_key.clone(),
        enable_thinking_key: d.enable_thinking_key.clone(),
        enable_thinking_default: d.enable_thinking_default.clone(),
        prompt_key: d.prompt_key.clone(),
        response_key: d.response_key.clone(),
        max_length: d.max_length,
        truncation: d.truncation,
        template_kwargs: d.apply_chat_template_kwargs.clone(),
        ignore_input_ids_mismatch: d.ignore_input_ids_mismatch,
        max_samples: (limit > 0).then_some(limit as usize),
    }
}

/// Conversations as [`StepBatch`] rows: the prompt is every token before the first trained
/// one (at least one token), the response the rest, its loss mask the `response_mask` column.
pub fn sft_batch(examples: &[&SftExample]) -> candle_core::Result<StepBatch> {
    let n = examples.len();
    let (mut prompts, mut responses, mut masks) = (Vec::new(), Vec::new(), Vec::new());
    for ex in examples {
        let len = ex.input_ids.len();
        let first = ex.loss_mask.iter().position(|&m| m != 0).unwrap_or(len);
        let cut = first.clamp(1, len.saturating_sub(1).max(1));
        prompts.push(ex.input_ids[..cut].to_vec());
        responses.push(ex.input_ids[cut..].to_vec());
        masks.push(ex.loss_mask[cut..].iter().map(|&m| f32::from(m)).collect());
    }
    let mut b = StepBatch::new(
        prompts,
        responses,
        (0..n).collect(),
        (0..n as u64).collect(),
        vec![false; n],
    );
    b.set(Column::ResponseMask, masks)?;
    Ok(b)
}

/// verl's `sft_loss` on one micro-batch: −Σ mask·log p / `batch_num_tokens` (the step's loss
/// tokens, from `ctx.norm`), reported as `train/loss` (summed over micro-batches: the step's
/// token-mean loss).
pub fn sft_micro_loss(
    model: &CausalLm,
    mi: &MicroInputs,
    ctx: MicroCtx,
) -> candle_core::Result<MicroLoss> {
    let (lp, _) = response_logprobs(model, mi, 1.0, false)?; // [m, r]
    let mask = mi.response_mask.to_dtype(lp.dtype())?; // [m, r]
    let loss = agg_loss(&lp.neg()?, &mask, LossAggMode::TokenMean, ctx.norm)?;
    Ok(MicroLoss {
        scalars: vec![("train/loss", scalar(&loss)?)],
        loss,
        extra: Default::default(),
    })
}

/// The update schedule of an SFT step: the whole step is one mini-batch (one optimizer step),
/// normalised by its own loss-token count (verl's engine path).
pub fn sft_update_plan(micro: MicroBatching, rows: usize, clip_grad: f64) -> UpdatePlan {
    UpdatePlan {
        mini_batch_prompts: rows,
        mini_batch_responses: rows,
        mini_batches_per_epoch: 1,
        micro,
        grad_accum: None,
        epochs: 1,
        loss_agg_mode: LossAggMode::TokenMean,
        shuffle: false,
        grad_clip: clip_grad,
        global_norm: true,
    }
}

/// An SFT run.
pub struct SftTrainer {
    pub cfg: SftConfig,
    pub plan: SftPlan,
    pub model: Trainable<CausalLm>,
    pub tokenizer: TokenizerBundle,
    pub train: SftDataset,
    pub val: Option<SftDataset>,
    loader: BatchLoader,
    pub global_step: u64,
    pub total_steps: u64,
    steps_per_epoch: u64,
    total_tokens: u64,
    tracker: Option<Tracker>,
    tracker_runs: std::collections::BTreeMap<String, String>,
    /// Set by Ctrl-C / SIGTERM: the run ends after the current step, saved.
    stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// The step of the newest checkpoint this run wrote.
    last_saved: Option<u64>,
    /// The data-parallel ranks (one process unless launched by MPI or torchrun): each
    /// computes its share of every step's conversations, the gradients are summed over all.
    comm: crate::dist::Comm,
}

/// How [`SftTrainer::fit`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum SftOutcome {
    /// Every step ran.
    Finished { steps: u64 },
    /// Stopped by a signal after `steps`; `checkpoint` holds them (none before the first step).
    Interrupted {
        steps: u64,
        checkpoint: Option<PathBuf>,
    },
}

impl SftTrainer {
    /// Loads the model (with adapters), the datasets and the trackers, and resumes from a
    /// checkpoint as `trainer.resume_mode` says; one process.
    pub fn new(cfg: SftConfig, plan: SftPlan, with_tracker: bool) -> Result<Self> {
        Self::on_ranks(cfg, plan, with_tracker, crate::dist::single())
    }

    /// [`SftTrainer::new`] as one of `comm`'s data-parallel ranks: every rank reads the same
    /// batches and trains on its share of their conversations (`data.train_batch_size` must
    /// divide evenly); rank 0 alone logs to the trackers and writes checkpoints.
    pub fn on_ranks(
        cfg: SftConfig,
        plan: SftPlan,
        with_tracker: bool,
        comm: crate::dist::Comm,
    ) -> Result<Self> {
        let world = comm.world_size();
        if !cfg.data.train_batch_size.is_multiple_of(world) {
            return Err(TrainerError::Config(crate::config::ConfigError::Value {
                key: "data.train_batch_size".into(),
                message: format!(
                    "{} conversations per step must be divisible by the number of processes ({world}): each rank takes whole conversations",
                    cfg.data.train_batch_size
                ),
            }));
        }
        let device = candle_core::Device::Cpu;
        let m = &cfg.model;
        let (mut loaded, tok) = crate::weights::load_model_and_tokenizer(
            &m.path,
            m.tokenizer_path.as_deref(),
            &m.override_config,
            candle_core::DType::F32,
            &device,
            true,
        )?;
        // verl's SFT engine trains in train mode too: a model asking for dropout is refused.
        super::preflight::train_dropout("model", &m.path, &loaded.model.args)?;
        loaded.model.set_exec(Exec {
            recompute: m.enable_gradient_checkpointing,
            composed: false,
            bf16: m.fsdp_config.mixed_precision.param_dtype.is_bf16(),
            dense_experts: false,
        });
        let lora = setup::attach_lora(&mut loaded, m, "model", cfg.trainer.seed, "CAUSAL_LM")?;
        let template = tok.template(m.custom_chat_template.as_deref())?;
        let train = SftDataset::build(
            &plan.train_files,
            &sft_options(&cfg, cfg.data.train_max_samples),
            &tok,
            &template,
        )?;
        let val = if plan.val_files.is_empty() {
            None
        } else {
            let o = sft_options(&cfg, cfg.data.val_max_samples);
            Some(SftDataset::build(&plan.val_files, &o, &tok, &template)?)
        };
        let bsz = cfg.data.train_batch_size;
        let steps_per_epoch = (train.len() / bsz) as u64;
        if steps_per_epoch == 0 {
            return Err(other(format!(
                "the training data ({}) holds {} conversations, fewer than one batch (data.train_batch_size = {bsz}); the loader drops a partial batch as verl's does",
                plan.train_files.join(", "),
                train.len()
            )));
        }
        let total_steps = cfg
            .trainer
            .total_training_steps
            .unwrap_or(steps_per_epoch * cfg.trainer.total_epochs as u64);
        let settings = UpdateSettings {
            prefix: "train",
            plan: sft_update_plan(plan.micro, bsz, cfg.optim.clip_grad),
            seed: cfg.trainer.seed,
            loss_scale_factor: None,
            inputs: Layout::of(tok.pad_token_id, m),
            shard: (0, 1),
        };
        let args = loaded.model.args.clone();
        let mut optim = cfg.optim.clone();
        optim.total_training_steps = Some(total_steps);
        let mut model = Trainable::new(
            loaded.model,
            loaded.varmap,
            lora,
            args,
            &optim,
            total_steps,
            settings,
        )?;
        model.set_comm(comm.clone());
        tracing::info!(
            "sft: {} training conversations ({} truncated), {} validation; {steps_per_epoch} steps per epoch, {total_steps} steps",
            train.len(),
            train.truncated,
            val.as_ref().map_or(0, SftDataset::len)
        );
        let mut t = Self {
            loader: BatchLoader::new(train.len(), bsz, true, cfg.trainer.seed),
            cfg,
            plan,
            model,
            tokenizer: tok,
            train,
            val,
            global_step: 0,
            total_steps,
            steps_per_epoch,
            total_tokens: 0,
            tracker: None,
            tracker_runs: Default::default(),
            stop: None,
            last_saved: None,
            comm,
        };
        t.resume()?;
        if with_tracker && t.comm.rank() == 0 {
            t.tracker = Some(t.open_tracker()?);
        }
        Ok(t)
    }

    fn open_tracker(&mut self) -> Result<Tracker> {
        let tr = &self.cfg.trainer;
        let remote = crate::metrics::RemoteOptions {
            settings: crate::metrics::remote::RemoteSettings::from_env("python3"),
            config: serde_json::to_value(&self.cfg).map_err(other)?,
            resume_ids: self.tracker_runs.clone(),
        };
        let (tracker, warnings) = Tracker::new(
            &tr.logger.to_vec(),
            &tr.project_name,
            &tr.experiment_name,
            Some(&remote),
        )
        .map_err(super::setup::tracker_start_error)?;
        for w in warnings {
            tracing::warn!("{w}");
        }
        self.tracker_runs = tracker.run_ids();
        Ok(tracker)
    }

    /// One training step: the next batch of conversations, one optimizer step.
    pub fn step(&mut self) -> Result<Metrics> {
        let indices = self
            .loader
            .next_batch()
            .ok_or_else(|| other("the training data holds less than one batch"))?;
        let rows: Vec<&SftExample> = indices.iter().map(|&i| &self.train.examples[i]).collect();
        let batch = sft_batch(&rows)?;
        self.global_step += 1;
        let step = self.global_step;
        let mut m = self.model.update(&batch, step, |model, mi, _rows, ctx| {
            sft_micro_loss(model, mi, ctx)
        })?;
        let tokens: usize = rows.iter().map(|r| r.input_ids.len()).sum();
        self.total_tokens += tokens as u64;
        m.insert("train/global_tokens".into(), tokens as f64);
        m.insert(
            "train/total_tokens(B)".into(),
            self.total_tokens as f64 / 1e9,
        );
        m.insert("train/epoch".into(), self.loader.cursor().epoch as f64);
        Ok(m)
    }

    /// `val/loss`: the mean over validation batches (train_batch_size conversations; a last
    /// partial batch is dropped unless it is the only one) of each batch's token-mean loss.
    pub fn validate(&self) -> Result<Option<f64>> {
        let Some(val) = &self.val else {
            return Ok(None);
        };
        let bsz = self.cfg.data.train_batch_size;
        let all: Vec<&SftExample> = val.examples.iter().collect();
        let mut chunks: Vec<&[&SftExample]> = all.chunks(bsz).collect();
        if chunks.len() > 1 && chunks.last().is_some_and(|c| c.len() < bsz) {
            chunks.pop();
        }
        let mut losses = Vec::new();
        for chunk in chunks {
            let batch = sft_batch(chunk)?;
            let lps = self
                .model
                .forward_rows(&batch, self.plan.micro, 1, |m, mi| {
                    Ok(vec![response_logprobs(m, mi, 1.0, false)?.0])
                })?;
            let mask = batch.response_mask();
            let (mut sum, mut count) = (0f64, 0f64);
            for (lp, mk) in lps[0].iter().zip(&mask) {
                for (&l, &k) in lp.iter().zip(mk) {
                    sum -= f64::from(l) * f64::from(k);
                    count += f64::from(k);
                }
            }
            losses.push(sum / count.max(1.0));
        }
        Ok(Some(crate::metrics::mean(&losses)))
    }

    /// The flag a signal sets to end the run after the current step (with a checkpoint).
    pub fn stop_on(&mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) {
        self.stop = Some(flag);
    }

    /// A stop was asked for on some rank (every rank agrees, so all stop after the same step).
    fn stop_requested(&self) -> Result<bool> {
        let here = self
            .stop
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::SeqCst));
        Ok(crate::dist::any(self.comm.as_ref(), here)?)
    }

    /// Trains until `total_steps`, validating and saving as configured; a stop request ends the
    /// run after the step under way, saving it unless it was just saved (as RL's trainer does).
    pub fn fit(&mut self) -> Result<SftOutcome> {
        let save = self
            .cfg
            .trainer
            .save_freq
            .period("trainer.save_freq", self.steps_per_epoch)?;
        let test = self
            .cfg
            .trainer
            .test_freq
            .period("trainer.test_freq", self.steps_per_epoch)?;
        while self.global_step < self.total_steps {
            let mut m = self.step()?;
            let step = self.global_step;
            let last = step >= self.total_steps;
            if last || test.is_some_and(|f| step.is_multiple_of(f)) {
                if let Some(v) = self.validate()? {
                    m.insert("val/loss".into(), v);
                }
            }
            if let Some(t) = &mut self.tracker {
                t.log(&m, step);
            }
            if last || save.is_some_and(|f| step.is_multiple_of(f)) {
                self.save_checkpoint()?;
            }
            if !last && self.stop_requested()? {
                let checkpoint = match self.last_saved == Some(step) {
                    true => crate::checkpoint::step_dir(&self.plan.default_local_dir, step),
                    false => self.save_checkpoint()?,
                };
                if let Some(t) = &mut self.tracker {
                    t.finish();
                }
                return Ok(SftOutcome::Interrupted {
                    steps: step,
                    checkpoint: Some(checkpoint),
                });
            }
        }
        if let Some(t) = &mut self.tracker {
            t.finish();
        }
        Ok(SftOutcome::Finished {
            steps: self.global_step,
        })
    }

    fn lora_base(&self) -> Result<Option<String>> {
        match &self.model.lora {
            None => Ok(None),
            Some(_) => Ok(Some(
                base_fingerprint(&self.model.varmap, self.model.optimizer.vars()).map_err(other)?,
            )),
        }
    }

    /// Writes `global_step_N/` (verl's SFT layout) and prunes to `trainer.max_ckpt_to_keep`:
    /// rank 0 writes (every rank holds the same weights and state), the others wait for it.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let root = self.plan.default_local_dir.clone();
        let comm = self.comm.clone();
        let dir = super::state::save_on_rank0(comm.as_ref(), &root, self.global_step, || {
            self.write_checkpoint(&root)
        })?;
        self.last_saved = Some(self.global_step);
        Ok(dir)
    }

    fn write_checkpoint(&mut self, root: &Path) -> Result<PathBuf> {
        let root = root.to_path_buf();
        let state = SftState {
            global_step: self.global_step,
            loader: self.loader.cursor(),
            train_rows: self.train.len(),
            train_batch_size: self.cfg.data.train_batch_size,
            updates: self.model.updates,
            total_tokens: self.total_tokens,
            tracker_runs: self.tracker_runs.clone(),
            lora_base: self.lora_base()?,
        };
        let config_yaml = serde_yaml_ng::to_string(&self.cfg).map_err(other)?;
        let dir = checkpoint::save_atomic(&root, self.global_step, |dir: &Path| -> Result<()> {
            self.model.save(dir, &self.tokenizer)?;
            if self.plan.save_hf_model && self.model.lora.is_some() {
                self.write_merged(dir)?;
            }
            let state = serde_json::to_string_pretty(&state).map_err(other)?;
            std::fs::write(dir.join("trainer_state.json"), state).map_err(other)?;
            std::fs::write(dir.join("config.yaml"), &config_yaml).map_err(other)?;
            Ok(())
        })?;
        checkpoint::prune_steps(&root, self.cfg.trainer.max_ckpt_to_keep)?;
        tracing::info!("checkpoint saved: {}", dir.display());
        Ok(dir)
    }

    /// `checkpoint.save_contents` with `hf_model` under LoRA: the adapters folded into the
    /// base, saved as a whole HF model in `dir/huggingface/` (beside the adapters).
    fn write_merged(&self, dir: &Path) -> Result<()> {
        use crate::weights::merge;
        let source = merge::Source::Lora {
            adapter: dir.join("lora_adapter"),
            base: self.cfg.model.path.clone(),
            base_from: "model.path".into(),
            checkpoint: Some(dir.join("huggingface")),
            critic: false,
        };
        let merged = merge::merge(&source)?;
        merge::save(&merged, &dir.join("huggingface"))?;
        Ok(())
    }

    /// Restores the checkpoint `trainer.resume_mode` selects, if any.
    fn resume(&mut self) -> Result<()> {
        let root = self.plan.default_local_dir.clone();
        // A save cut short is finished (or dropped) by rank 0 alone, before any rank looks.
        let recovered = match self.comm.rank() {
            0 => checkpoint::recover(&root),
            _ => Ok(()),
        };
        self.comm.barrier()?;
        recovered?;
        let t = self.cfg.trainer.clone();
        let Some((step, dir)) =
            checkpoint::find_resume(&root, t.resume_mode, t.resume_from_path.as_deref())?
        else {
            return Ok(());
        };
        self.load_checkpoint(&dir).map_err(|e| {
            other(format!(
                "resuming from {}: {e}; to start fresh, set trainer.default_local_dir to a new folder or trainer.resume_mode=disable",
                dir.display()
            ))
        })?;
        tracing::info!("resumed from {} (step {step})", dir.display());
        Ok(())
    }

    fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| other(format!("{}: {e}", path.display())))?;
        let s: SftState =
            serde_json::from_str(&text).map_err(|e| other(format!("{}: {e}", path.display())))?;
        let bsz = self.cfg.data.train_batch_size;
        if s.train_rows != self.train.len() || s.train_batch_size != bsz {
            return Err(other(format!(
                "the checkpoint was trained on {} conversations in batches of {}; this run has {} in batches of {bsz} (data.train_batch_size): the data order cannot continue",
                s.train_rows,
                s.train_batch_size,
                self.train.len()
            )));
        }
        if s.lora_base.is_some() && s.lora_base != self.lora_base()? {
            return Err(other(format!(
                "its LoRA adapters were trained on other base weights than model.path = {}",
                self.cfg.model.path
            )));
        }
        self.model.load(dir, s.updates)?;
        self.loader = BatchLoader::resume(self.train.len(), bsz, s.loader);
        self.global_step = s.global_step;
        self.total_tokens = s.total_tokens;
        self.tracker_runs = s.tracker_runs;
        Ok(())
    }
}

#[cfg(test)]
#[path = "tests_sft.rs"]
mod tests_sft;
