//! The training loop: one [`Trainer::step`] is verl's PPO step, in verl's order.
//!
//! ```text
//! prompts ─► rollout (n per prompt, one uid per prompt) ─► reward ─► old log-probs (actor)
//!         ─► ref log-probs (use_kl_loss | use_kl_in_reward) ─► values (critic, gae)
//!         ─► KL in reward ─► advantages ─► critic update ─► actor update (after critic_warmup)
//!         ─► checkpoint (save_freq, last) ─► validation (test_freq, last) ─► metrics
//! ```
//!
//! Parts: `batch` (a step's rows and their tensors), `actor` (policy and reference log-probs,
//! policy update), `critic` (values, value update), `update` (the mini/micro-batch schedule),
//! `optim` (AdamW, LR schedules), `state` (checkpoint save and resume), `validate`
//! (validation metrics), `step_metrics` (verl's data metrics).

pub mod actor;
pub mod batch;
pub mod critic;
pub mod optim;
mod state;
mod step_metrics;
pub mod update;
mod validate;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use serde_json::{json, Value};

pub use optim::{clip_grad_norm, AdamW, LrSchedule};

use self::actor::{compute_log_prob, Actor, PolicyData, Reference};
use self::batch::{dense, Ragged, StepBatch};
use self::critic::{Critic, ValueData};
use crate::algo::{apply_kl_penalty, compute_advantage, AdvantageInputs, KlController};
use crate::checkpoint::CheckpointError;
use crate::config::{AdvEstimator, Config, ConfigError, Plan};
use crate::control::ControlServer;
use crate::data::dataset::{load_samples, DatasetOptions};
use crate::data::{BatchLoader, DataError, PromptDataset, TokenizerBundle};
use crate::metrics::{Metrics, Timings, Tracker};
use crate::model::ModelError;
use crate::reward::python::Item;
use crate::reward::{NativeRegistry, RewardError, RewardManager, SampleReward};
use crate::rollout::{generate_rows, repeat_rows, Sampler, SamplingParams, StopReason};

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
    #[error("{0}")]
    Tensor(#[from] candle_core::Error),
    #[error("{0}")]
    Other(String),
}

pub type Result<T> = std::result::Result<T, TrainerError>;

/// How a call to [`Trainer::fit`] ended.
#[derive(Debug, Clone, PartialEq)]
pub enum FitOutcome {
    /// All `total_training_steps` ran.
    Finished { steps: u64 },
    /// `trainer.val_only`: one validation, no training.
    ValidatedOnly,
    /// A stop was requested (Ctrl-C, SIGTERM): the step finished and a checkpoint was saved.
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
    /// Metric sinks; `None` = those of `trainer.logger`.
    pub tracker: Option<Tracker>,
}

impl Default for TrainerOptions {
    fn default() -> Self {
        Self {
            natives: NativeRegistry::default(),
            stop: Arc::new(AtomicBool::new(false)),
            tracker: None,
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
    pub critic: Option<Critic>,
    reward: RewardManager,
    sampler: Sampler,
    pub kl_ctrl: KlController,
    tracker: Tracker,
    /// Steps completed (verl's `global_steps` − 1 during a step).
    pub global_step: u64,
    pub total_steps: u64,
    stop: Arc<AtomicBool>,
    params: SamplingParams,
    last_saved: Option<u64>,
    /// The live-weights HTTP API (`reward.control.enable`).
    pub control: Option<ControlServer>,
    /// Every step's metrics (also sent to the sinks).
    pub history: Vec<(u64, Metrics)>,
}

fn load_dataset(
    files: &[String],
    opts: &DatasetOptions,
    tok: &TokenizerBundle,
    template: &crate::data::ChatTemplate,
) -> Result<PromptDataset> {
    let samples = load_samples(files, opts)?;
    Ok(PromptDataset::build(samples, tok, template, opts)?)
}

impl Trainer {
    /// Loads everything a run needs, reward functions first (a broken reward file fails before
    /// any model is read), then resumes from a checkpoint as `trainer.resume_mode` says.
    pub fn new(cfg: Config, opts: TrainerOptions) -> Result<Self> {
        let plan = crate::config::resolve(&cfg)?;
        for w in &plan.warnings {
            tracing::warn!("{w}");
        }
        let reward = RewardManager::from_config_with(
            &cfg.reward,
            &opts.natives,
            &crate::reward::ModelContext {
                device: cfg.trainer.device.clone(),
                prompt_key: cfg.data.prompt_key.clone(),
            },
        )?;
        let sources: Vec<String> = reward
            .sources
            .iter()
            .map(|s| format!("{} = {} (weight {})", s.name, s.label, s.weight))
            .collect();
        tracing::info!("reward ready: {}", sources.join(", "));
        let device = crate::model::device(&cfg.trainer.device)?;
        let m = &cfg.actor_rollout_ref.model;
        // The policy's weights from `model.path`: the actor, and again the frozen reference.
        let load_policy = || {
            crate::model::load_model_and_tokenizer(
                &m.path,
                m.tokenizer_path.as_deref(),
                &m.override_config,
                DType::F32,
                &device,
                true,
            )
        };
        let t0 = Instant::now();
        let (loaded, tok) = load_policy()?;
        let fits = |key: &str, path: &str, limit: usize| {
            let (p, r) = (plan.prompt_length, plan.response_length);
            crate::config::data::check_model_context(p, r, limit, key, path)
        };
        fits(
            "actor_rollout_ref.model.path",
            &m.path,
            loaded.model.args.max_position_embeddings,
        )?;
        tracing::info!(
            "actor: {} loaded in {:.1} s",
            m.path,
            t0.elapsed().as_secs_f64()
        );
        let template = tok.template(m.custom_chat_template.as_deref())?;

        let train = load_dataset(
            &cfg.data.train_files.to_vec(),
            &DatasetOptions::train(&cfg.data, plan.prompt_length),
            &tok,
            &template,
        )?;
        let steps_per_epoch = plan.steps_per_epoch(train.len()) as u64;
        if steps_per_epoch == 0 {
            return Err(TrainerError::Other(format!(
                "data.train_files: {} prompts after filtering, fewer than data.train_batch_size ({}): not one step can run",
                train.len(),
                plan.train_batch_size
            )));
        }
        let wants_val =
            cfg.trainer.val_before_train || cfg.trainer.val_only || cfg.trainer.test_freq.is_some();
        let val_files = cfg.data.val_files.to_vec();
        let val = if wants_val && !val_files.is_empty() {
            Some(load_dataset(
                &val_files,
                &DatasetOptions::val(&cfg.data, plan.prompt_length),
                &tok,
                &template,
            )?)
        } else {
            None
        };
        let total_steps = cfg
            .trainer
            .total_training_steps
            .unwrap_or(steps_per_epoch * cfg.trainer.total_epochs as u64);
        let r = &cfg.actor_rollout_ref.rollout;
        let params = SamplingParams::train(r, plan.response_length, &tok.eos_token_ids);
        let temperature = if params.greedy { 1.0 } else { r.temperature };

        let actor = Actor::new(
            loaded.model,
            loaded.varmap,
            &cfg.actor_rollout_ref.actor,
            &plan.actor,
            total_steps,
            temperature,
            plan.response_length,
            tok.pad_token_id,
        );
        let reference = if plan.need_reference {
            let (l, _) = load_policy()?;
            Some(Reference::new(l.model, l.varmap))
        } else {
            None
        };
        let critic = match (&plan.critic, plan.need_critic) {
            (Some(cplan), true) => {
                let c = &cfg.critic.model;
                let (l, ctok) = crate::model::load_model_and_tokenizer(
                    &c.path,
                    c.tokenizer_path.as_deref().or(m.tokenizer_path.as_deref()),
                    &c.override_config,
                    DType::F32,
                    &device,
                    false,
                )?;
                fits(
                    "critic.model.path",
                    &c.path,
                    l.model.args.max_position_embeddings,
                )?;
                if ctok.tokenizer.get_vocab_size(true) != tok.tokenizer.get_vocab_size(true) {
                    return Err(TrainerError::Other(format!(
                        "critic.model.path={}: its tokenizer has {} tokens, the actor's {}: the critic must read the actor's token ids",
                        c.path,
                        ctok.tokenizer.get_vocab_size(true),
                        tok.tokenizer.get_vocab_size(true)
                    )));
                }
                Some(Critic::new(
                    l.model,
                    l.varmap,
                    &cfg.critic,
                    cplan,
                    total_steps,
                    plan.response_length,
                    tok.pad_token_id,
                    cfg.trainer.seed,
                )?)
            }
            _ => None,
        };
        let loader = BatchLoader::new(
            train.len(),
            plan.train_batch_size,
            cfg.data.shuffle,
            cfg.data.seed.unwrap_or(cfg.trainer.seed),
        );
        let tracker = match opts.tracker {
            Some(t) => t,
            None => {
                let (t, warnings) = Tracker::new(
                    &cfg.trainer.logger.to_vec(),
                    &cfg.trainer.project_name,
                    &cfg.trainer.experiment_name,
                )
                .map_err(TrainerError::Other)?;
                for w in warnings {
                    tracing::warn!("{w}");
                }
                t
            }
        };
        let mut t = Trainer {
            sampler: Sampler::new(r.seed),
            kl_ctrl: KlController::new(&cfg.algorithm.kl_ctrl),
            cfg,
            plan,
            tokenizer: tok,
            train,
            val,
            loader,
            actor,
            reference,
            critic,
            reward,
            tracker,
            global_step: 0,
            total_steps,
            stop: opts.stop,
            params,
            last_saved: None,
            control: None,
            history: Vec::new(),
        };
        t.resume()?;
        if t.cfg.reward.control.enable {
            let server =
                ControlServer::start(&t.cfg.reward.control, t.reward.weights(), t.total_steps)
                    .map_err(TrainerError::Other)?;
            t.control = Some(server);
        }
        Ok(t)
    }

    fn device(&self) -> Device {
        self.actor.device().clone()
    }

    /// Runs validation before training (`val_before_train`), then steps until
    /// `total_training_steps` or a stop request.
    pub fn fit(&mut self) -> Result<FitOutcome> {
        if self.val.is_some() && (self.cfg.trainer.val_before_train || self.cfg.trainer.val_only) {
            let m = self.validate()?;
            self.log(m, self.global_step);
            if self.cfg.trainer.val_only {
                return Ok(FitOutcome::ValidatedOnly);
            }
        }
        let bar = progress_bar(self.total_steps, self.global_step);
        while self.global_step < self.total_steps {
            if self.stop.load(Ordering::SeqCst) {
                return self.interrupted();
            }
            let m = self.step()?;
            self.log(m, self.global_step);
            bar.set_position(self.global_step);
        }
        bar.finish_and_clear();
        if self.stop.load(Ordering::SeqCst) && self.last_saved != Some(self.global_step) {
            return self.interrupted();
        }
        Ok(FitOutcome::Finished {
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
        self.history.push((step, m));
    }

    /// One PPO step; returns its metrics (also sent to the sinks by [`Trainer::fit`]).
    pub fn step(&mut self) -> Result<Metrics> {
        let step = self.global_step + 1;
        let t_step = Instant::now();
        // Weights posted to the control API apply from this step on.
        if let Some(w) = self.control.as_ref().and_then(ControlServer::take_changes) {
            self.reward.set_weights(&w)?;
            tracing::info!("step {step}: reward weights {w:?}");
        }
        let mut timing = Timings::default();
        let mut m = Metrics::new();
        let epoch = self.loader.cursor().epoch;
        let prompts = self
            .loader
            .next_batch()
            .ok_or_else(|| TrainerError::Other("the training data holds no full batch".into()))?;
        let epoch = epoch.max(self.loader.cursor().epoch);

        // Rollout: each prompt n times, consecutively; one uid per prompt.
        let mut batch = timing.time("gen", || self.rollout(&prompts))?;
        let responses: Vec<String> = self.decode(&batch.responses)?;

        // Reward.
        let rewards = timing.time("reward", || self.score(&batch, &responses))?;
        for (i, r) in rewards.iter().enumerate() {
            batch.excluded[i] = r.skipped || r.score.is_none() || r.gate_skip;
        }
        let scores: Vec<f64> = rewards.iter().map(|r| r.score.unwrap_or(0.0)).collect();
        let token_scores = place_scores(&batch, &scores);

        // ReMax's baseline: the reward of the greedy response to the same prompt.
        let baselines = if self.cfg.algorithm.adv_estimator == AdvEstimator::Remax {
            Some(timing.time("gen_max", || self.remax_baselines(&batch))?)
        } else {
            None
        };

        let pad = self.tokenizer.pad_token_id;
        let temperature = self.actor.temperature;
        let (old_log_prob, entropy) = timing.time("old_log_prob", || {
            compute_log_prob(
                self.actor.view(),
                &batch,
                self.plan.log_prob_micro,
                temperature,
                pad,
                true,
            )
        })?;
        let ref_log_prob = match (&self.reference, self.plan.ref_log_prob_micro) {
            (Some(r), Some(micro)) => Some(timing.time("ref", || {
                compute_log_prob(&r.model, &batch, micro, temperature, pad, false)
            })?),
            _ => None,
        }
        .map(|(lp, _)| lp);
        let values = match (&self.critic, self.plan.critic_forward_micro) {
            (Some(c), Some(micro)) => {
                Some(timing.time("values", || c.compute_values(&batch, micro))?)
            }
            _ => None,
        };

        // Advantages (KL in reward first).
        let adv_out = timing.time("adv", || {
            self.advantages(
                &batch,
                &token_scores,
                &old_log_prob,
                ref_log_prob.as_ref(),
                values.as_ref(),
                baselines.as_deref(),
                &mut m,
            )
        })?;
        let (token_rewards, advantages, returns) = adv_out;

        if let (Some(critic), Some(values)) = (self.critic.as_mut(), values.as_ref()) {
            let cm = timing.time("update_critic", || {
                critic.update(
                    &batch,
                    &ValueData {
                        values,
                        returns: &returns,
                    },
                    step,
                )
            })?;
            m.extend(cm);
        }
        if self.cfg.trainer.critic_warmup as u64 <= step {
            let am = timing.time("update_actor", || {
                self.actor.update(
                    &batch,
                    &PolicyData {
                        old_log_prob: &old_log_prob,
                        advantages: &advantages,
                        ref_log_prob: ref_log_prob.as_ref(),
                    },
                    step,
                )
            })?;
            m.extend(am);
        }
        self.global_step = step;

        let last = step == self.total_steps;
        if let Some(freq) = self.cfg.trainer.save_freq {
            if last || step % freq == 0 {
                timing.time("save_checkpoint", || self.save_checkpoint())?;
            }
        }
        if let (Some(freq), true) = (self.cfg.trainer.test_freq, self.val.is_some()) {
            if last || step % freq == 0 {
                let vm = timing.time("testing", || self.validate())?;
                m.extend(vm);
            }
        }

        step_metrics::data_metrics(
            &mut m,
            &step_metrics::StepData {
                batch: &batch,
                token_scores: &token_scores,
                token_rewards: &token_rewards,
                advantages: &advantages,
                returns: &returns,
                values: values.as_ref(),
                entropy: entropy.as_ref(),
                max_prompt_length: self.plan.prompt_length,
                max_response_length: self.plan.response_length,
                loss_agg_mode: self.cfg.actor_rollout_ref.actor.loss_agg_mode,
            },
        )?;
        step_metrics::reward_metrics(&mut m, &self.reward, &rewards);
        m.insert("training/global_step".into(), step as f64);
        m.insert("training/epoch".into(), epoch as f64);
        let elapsed = t_step.elapsed().as_secs_f64();
        timing.seconds.insert("step", elapsed);
        let response_tokens: usize = (0..batch.len()).map(|r| batch.response_len(r)).sum();
        let all_tokens: usize = (0..batch.len()).map(|r| batch.seq_len(r)).sum();
        timing.write(&mut m, response_tokens, all_tokens);
        m.insert("perf/total_num_tokens".into(), all_tokens as f64);
        m.insert("perf/time_per_step".into(), elapsed);
        m.insert(
            "perf/throughput".into(),
            all_tokens as f64 / elapsed.max(1e-9),
        );
        if let Some(b) = crate::metrics::peak_rss_bytes() {
            m.insert(
                "perf/max_memory_rss_gb".into(),
                b as f64 / (1u64 << 30) as f64,
            );
        }

        if let Some(dir) = self.cfg.trainer.rollout_data_dir.clone() {
            self.dump_rollouts(&dir, &batch, &responses, &rewards, &advantages)?;
        }
        Ok(m)
    }

    /// Generates `n` responses per prompt with the actor's current weights.
    fn rollout(&mut self, prompts: &[usize]) -> Result<StepBatch> {
        let n = self.plan.n.max(1);
        let rows = repeat_rows(prompts, n);
        let out = generate_rows(
            self.actor.view(),
            &self.train,
            &rows,
            self.tokenizer.pad_token_id,
            &self.params,
            &mut self.sampler,
        )?;
        Ok(StepBatch {
            prompts: rows
                .iter()
                .map(|&i| self.train.prompt_ids[i].clone())
                .collect(),
            truncated: out.stop.iter().map(|s| *s == StopReason::Length).collect(),
            excluded: vec![false; rows.len()],
            uid: (0..rows.len()).map(|k| (k / n) as u64).collect(),
            sample: rows,
            responses: out.responses,
        })
    }

    /// Responses as text, special tokens removed (what reward functions see).
    fn decode(&self, responses: &[Vec<u32>]) -> Result<Vec<String>> {
        responses
            .iter()
            .map(|r| {
                self.tokenizer
                    .tokenizer
                    .decode(r, true)
                    .map_err(|e| TrainerError::Other(format!("decoding a response: {e}")))
            })
            .collect()
    }

    fn items(&self, ds: &PromptDataset, rows: &[usize], responses: &[String]) -> Vec<Item> {
        rows.iter()
            .zip(responses)
            .map(|(&i, text)| {
                let s = &ds.samples[i];
                Item {
                    data_source: s.data_source.clone(),
                    solution_str: text.clone(),
                    ground_truth: s.ground_truth.clone(),
                    extra_info: s.extra_info.clone(),
                    row: s.raw.clone(),
                }
            })
            .collect()
    }

    fn score(&mut self, batch: &StepBatch, responses: &[String]) -> Result<Vec<SampleReward>> {
        let items = self.items(&self.train, &batch.sample, responses);
        let lens: Vec<usize> = batch.responses.iter().map(Vec::len).collect();
        let policy = self.reward.policy();
        Ok(self.reward.score(&items, &lens, policy)?)
    }

    /// ReMax: one greedy response per prompt, scored; each row gets its prompt's baseline.
    fn remax_baselines(&mut self, batch: &StepBatch) -> Result<Vec<f64>> {
        let n = self.plan.n.max(1);
        let firsts: Vec<usize> = batch.sample.iter().step_by(n).copied().collect();
        let mut greedy = self.params.clone();
        greedy.greedy = true;
        let out = generate_rows(
            self.actor.view(),
            &self.train,
            &firsts,
            self.tokenizer.pad_token_id,
            &greedy,
            &mut Sampler::new(0),
        )?;
        let texts = self.decode(&out.responses)?;
        let items = self.items(&self.train, &firsts, &texts);
        let lens: Vec<usize> = out.responses.iter().map(Vec::len).collect();
        let policy = self.reward.policy();
        let scored = self.reward.score(&items, &lens, policy)?;
        Ok((0..batch.len())
            .map(|row| scored[row / n].score.unwrap_or(0.0))
            .collect())
    }

    /// KL in reward (when configured) and the advantage estimator: returns token rewards,
    /// advantages and returns, `[rows][response_len]` each.
    #[allow(clippy::too_many_arguments)]
    fn advantages(
        &mut self,
        batch: &StepBatch,
        token_scores: &Ragged,
        old_log_prob: &Ragged,
        ref_log_prob: Option<&Ragged>,
        values: Option<&Ragged>,
        baselines: Option<&[f64]>,
        m: &mut Metrics,
    ) -> Result<(Ragged, Ragged, Ragged)> {
        let dev = self.device();
        let width = batch.max_response_len();
        let mask = dense(&batch.loss_mask_rows(), width, &dev)?; // [B, R]
        let scores = dense(token_scores, width, &dev)?; // [B, R]
        let alg = &self.cfg.algorithm;
        let rewards = if alg.use_kl_in_reward {
            let reference = ref_log_prob.ok_or_else(|| {
                TrainerError::Other("use_kl_in_reward needs the reference model".into())
            })?;
            let (r, kl, beta) = apply_kl_penalty(
                &scores,
                &dense(old_log_prob, width, &dev)?,
                &dense(reference, width, &dev)?,
                &mask,
                alg.kl_penalty,
                &mut self.kl_ctrl,
            )?;
            m.insert("actor/reward_kl_penalty".into(), kl);
            m.insert("actor/reward_kl_penalty_coeff".into(), beta);
            r
        } else {
            scores
        };
        let values_t = values.map(|v| dense(v, width, &dev)).transpose()?;
        let baselines_t = baselines
            .map(|b| {
                candle_core::Tensor::from_vec(
                    b.iter().map(|&x| x as f32).collect::<Vec<f32>>(),
                    b.len(),
                    &dev,
                )
            })
            .transpose()?;
        let (adv, ret) = compute_advantage(
            alg.adv_estimator,
            &AdvantageInputs {
                token_level_rewards: &rewards,
                response_mask: &mask,
                values: values_t.as_ref(),
                index: Some(&batch.uid),
                reward_baselines: baselines_t.as_ref(),
            },
            alg,
        )?;
        // Rows left out of the update carry no advantage either (mask is 1 on every other row).
        let adv = (adv * &mask)?;
        let lens: Vec<usize> = (0..batch.len()).map(|r| batch.response_len(r)).collect();
        let all: Vec<usize> = (0..batch.len()).collect();
        let mut out = (
            vec![Vec::new(); batch.len()],
            vec![Vec::new(); batch.len()],
            vec![Vec::new(); batch.len()],
        );
        batch::scatter_rows(&rewards, &all, &lens, &mut out.0)?;
        batch::scatter_rows(&adv, &all, &lens, &mut out.1)?;
        batch::scatter_rows(&ret, &all, &lens, &mut out.2)?;
        Ok(out)
    }

    /// `{dir}/{step}.jsonl`: prompt, response, ground truth, score, each source's score and the
    /// mean advantage of every response of the step.
    fn dump_rollouts(
        &self,
        dir: &str,
        batch: &StepBatch,
        responses: &[String],
        rewards: &[SampleReward],
        advantages: &Ragged,
    ) -> Result<()> {
        let rows: Vec<Value> = (0..batch.len())
            .map(|i| {
                let s = &self.train.samples[batch.sample[i]];
                let prompt = self
                    .tokenizer
                    .tokenizer
                    .decode(&batch.prompts[i], false)
                    .unwrap_or_default();
                let adv = &advantages[i];
                let mut o = json!({
                    "input": prompt,
                    "output": responses[i],
                    "gts": s.ground_truth,
                    "score": rewards[i].score,
                    "step": self.global_step,
                    "data_source": s.data_source,
                    "uid": batch.uid[i],
                    "advantage": if adv.is_empty() { Value::Null } else { json!(adv.iter().map(|&x| x as f64).sum::<f64>() / adv.len() as f64) },
                });
                let obj = o.as_object_mut().expect("object");
                for (name, v) in &rewards[i].per_source {
                    obj.insert(format!("reward/{name}"), json!(v));
                }
                for (k, v) in &rewards[i].extra {
                    obj.entry(k.clone()).or_insert(v.clone());
                }
                if let Some(e) = &rewards[i].error {
                    obj.insert("reward_error".into(), json!(e));
                }
                obj.insert("gated".into(), json!(rewards[i].gated));
                obj.insert("excluded".into(), json!(batch.excluded[i]));
                o
            })
            .collect();
        write_jsonl(
            &PathBuf::from(crate::config::resolve::expand_home(dir)),
            self.global_step,
            &rows,
        )
    }
}

/// Writes `{dir}/{step}.jsonl`.
fn write_jsonl(dir: &std::path::Path, step: u64, rows: &[Value]) -> Result<()> {
    let err = |e: std::io::Error| TrainerError::Other(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut text = String::new();
    for r in rows {
        text.push_str(&r.to_string());
        text.push('\n');
    }
    std::fs::write(dir.join(format!("{step}.jsonl")), text).map_err(err)
}

/// Each row's score on its last response token (verl's placement); rows without a response
/// get none.
fn place_scores(batch: &StepBatch, scores: &[f64]) -> Ragged {
    (0..batch.len())
        .map(|r| {
            let mut v = vec![0f32; batch.response_len(r)];
            if let Some(last) = v.last_mut() {
                *last = scores[r] as f32;
            }
            v
        })
        .collect()
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
