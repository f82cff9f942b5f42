//! The actor (policy) and the reference policy: log-probs of responses, and the PPO policy
//! update (verl's `DataParallelPPOActor.compute_log_prob` / `update_policy`).

use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use super::batch::{pad_rows, scatter_rows, Column, Ragged, StepBatch, TopkRows};
use super::micro::{Layout, MicroInputs};
use super::rollout_corr::bypass_loss;
use super::trainable::{forward_rows, LoraState, Trainable, UpdateSettings};
use super::update::MicroLoss;
use crate::algo::agg::scalar;
use crate::algo::distill::{self, DistillParams};
use crate::algo::rollout_corr::Correction;
use crate::algo::{agg_loss, kl_loss, policy_loss_weighted, AggNorm, PolicyLossParams};
use crate::config::{ActorConfig, MicroBatching, Plan};
use crate::config::{BypassLoss, KlKind};
use crate::metrics::Metrics;
use crate::model::{CausalLm, Exec, HeadOut, HeadStats};
use crate::weights::hf::Loaded;

/// Positions per chunk of the vocabulary projection: about 4 M logits alive at a time, and at
/// least 128 positions. Each chunk reads the whole (packed) output weight forward and adds its
/// part of the weight's gradient into all of it backward: with 16 positions per chunk (a
/// 248k-token vocabulary under the 4 M rule) the head's backward of 512 positions passed 32
/// times over a 1 GB gradient. 128 positions keep a large vocabulary's chunk at ~127 MB.
pub fn logit_chunk(vocab: usize) -> usize {
    ((1usize << 22) / vocab.max(1)).max(128)
}

/// Log-probs (and entropy) of a micro-batch's response tokens under `model`, with logits divided
/// by the rollout `temperature` as the sampler used them: `[m, r]` each.
pub fn response_logprobs(
    model: &CausalLm,
    mi: &MicroInputs,
    temperature: f64,
    with_entropy: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let stats = HeadStats {
        entropy: with_entropy,
        sum_pi_squared: false,
    };
    let out = response_stats(model, mi, temperature, stats)?;
    Ok((out.log_probs, out.entropy))
}

/// [`response_logprobs`] plus top-k distillation's student side from the same forward: the
/// log-probs of the teacher's tokens `teacher_ids` (`[m, r, k]` u32; with gradient) and the
/// ids of the student's own top-k, `[m, r, k]` each.
pub fn response_logprobs_topk(
    model: &CausalLm,
    mi: &MicroInputs,
    temperature: f64,
    with_entropy: bool,
    teacher_ids: &Tensor,
) -> candle_core::Result<(Tensor, Option<Tensor>, Tensor, Tensor)> {
    let h = mi.response_hidden(model)?; // [m, r, h] or [1, k, h]
    let h = if temperature > 0.0 && temperature != 1.0 {
        (h / temperature)?
    } else {
        h
    };
    let chunk = logit_chunk(model.args.vocab_size);
    let stats = HeadStats {
        entropy: with_entropy,
        sum_pi_squared: false,
    };
    let out = model.token_stats(&h, mi.response_targets(), chunk, stats)?;
    let ids = mi.from_rows_k(teacher_ids)?; // [positions, k]
    let (gathered, own) = model.gather_logprobs(&h, &ids, chunk)?;
    Ok((
        mi.to_rows(&out.log_probs)?,
        out.entropy.map(|e| mi.to_rows(&e)).transpose()?,
        mi.to_rows_k(&gathered)?,
        mi.to_rows_k(&own)?,
    ))
}

/// [`response_logprobs`] with the head statistics `stats` asks for (Σπ² among them, of the
/// tempered distribution as verl computes it): `[m, r]` each.
pub fn response_stats(
    model: &CausalLm,
    mi: &MicroInputs,
    temperature: f64,
    stats: HeadStats,
) -> candle_core::Result<HeadOut> {
    let h = mi.response_hidden(model)?; // [m, r, h] or [1, k, h]
                                        // (h·W)/T = (h/T)·W: scaling the hidden state scales every logit.
    let h = if temperature > 0.0 && temperature != 1.0 {
        (h / temperature)?
    } else {
        h
    };
    let out = model.token_stats(
        &h,
        mi.response_targets(),
        logit_chunk(model.args.vocab_size),
        stats,
    )?;
    let rows = |x: Option<Tensor>| x.map(|e| mi.to_rows(&e)).transpose();
    Ok(HeadOut {
        log_probs: mi.to_rows(&out.log_probs)?,
        entropy: rows(out.entropy)?,
        sum_pi_squared: rows(out.sum_pi_squared)?,
    })
}

/// The policy being trained.
pub struct Actor {
    pub trainable: Trainable<CausalLm>,
    cfg: ActorConfig,
    /// Rollout temperature (logits are divided by it in every log-prob).
    pub temperature: f64,
    /// Forward passes of the old-log-prob recomputation.
    log_prob_micro: MicroBatching,
    /// How generation runs (bf16 products from `actor_rollout_ref.rollout.dtype`).
    rollout_exec: Exec,
    /// Rollout correction's bypass mode: the loss and the correction each micro-batch
    /// recomputes (the old log-probs are then the rollout's).
    bypass: Option<(BypassLoss, Correction)>,
    /// On-policy distillation's loss term (`distillation.enabled`).
    distill: Option<Distill>,
}

/// How the distillation loss enters the actor's (verl's `distillation_ppo_loss`).
#[derive(Debug, Clone)]
pub struct Distill {
    pub params: DistillParams,
    /// `forward_kl_topk`: k and `log_prob_min_clamp` (None: a single-sample estimator).
    pub topk: Option<(usize, Option<f64>)>,
    /// Keep the task's policy loss (else the distillation loss alone).
    pub use_task_rewards: bool,
    /// `distillation_loss_coef` (with task rewards).
    pub coef: f64,
}

impl Distill {
    /// The term `plan` asks for (None with distillation off).
    pub fn of(plan: &Plan, actor: &ActorConfig) -> Option<Self> {
        let d = plan.distillation.as_ref()?;
        let (kind, topk) = match distill::estimator(d.loss.loss_mode) {
            Some(kind) => (kind, None),
            None => (KlKind::K3, Some((d.topk?, d.loss.log_prob_min_clamp))),
        };
        let base = PolicyLossParams::from_actor(actor);
        Some(Distill {
            topk,
            params: DistillParams {
                kind,
                loss_max_clamp: d.loss.loss_max_clamp,
                policy_gradient: d
                    .loss
                    .use_policy_gradient
                    .then(|| DistillParams::policy_gradient_params(&base, d.clip_low, d.clip_high)),
                loss_agg_mode: actor.loss_agg_mode,
            },
            use_task_rewards: d.loss.use_task_rewards,
            coef: d.loss.distillation_loss_coef,
        })
    }
}

impl Actor {
    /// The actor of a run: `loaded` weights trained as `cfg` and `plan` say, its LR schedule
    /// spanning `total_steps`.
    pub fn new(
        loaded: Loaded,
        cfg: &ActorConfig,
        plan: &Plan,
        total_steps: u64,
        inputs: Layout,
        lora: Option<LoraState>,
    ) -> candle_core::Result<Self> {
        let settings = UpdateSettings {
            prefix: "actor",
            plan: plan.actor.clone(),
            seed: plan.seeds.actor,
            loss_scale_factor: UpdateSettings::loss_scale_factor(
                &plan.actor,
                cfg.loss_scale_factor,
                plan.response_length,
            ),
            inputs,
            shard: (0, 1),
        };
        let mut loaded = loaded;
        if cfg.freeze_vision_tower {
            if let Some(v) = loaded.model.args.vision.as_mut() {
                v.frozen = true;
            }
            loaded.model.freeze_vision();
        }
        let args = loaded.model.args.clone();
        Ok(Self {
            trainable: Trainable::new(
                loaded.model,
                loaded.varmap,
                lora,
                args,
                &cfg.optim,
                total_steps,
                settings,
            )?,
            cfg: cfg.clone(),
            temperature: plan.temperatures.log_prob,
            log_prob_micro: plan.log_prob_micro,
            rollout_exec: Exec::default(),
            bypass: plan
                .rollout_correction
                .as_ref()
                .and_then(|c| c.bypass.map(|l| (l, c.correction.clone()))),
            distill: Distill::of(plan, cfg),
        })
    }

    /// How generation runs (its precision is `actor_rollout_ref.rollout.dtype`, independent of
    /// the actor's own, as verl's rollout engine is).
    pub fn set_rollout_exec(&mut self, exec: Exec) {
        self.rollout_exec = exec;
    }

    /// The view generation runs on: the current weights, in the rollout's precision.
    pub fn rollout_view(&self) -> CausalLm {
        let mut v = self.view().no_grad();
        v.set_exec(self.rollout_exec);
        v
    }

    /// The weights without autograd: generation and log-probs see every update.
    pub fn view(&self) -> &CausalLm {
        self.trainable.view()
    }

    pub fn device(&self) -> &Device {
        self.trainable.device()
    }

    /// The `old_log_prob` phase: fills `old_log_probs` and `entropys` (verl's
    /// `compute_log_prob`), and `sum_pi_squared` with `calculate_sum_pi_squared`.
    pub fn compute_log_prob(&self, batch: &mut StepBatch) -> candle_core::Result<()> {
        let t = self.temperature;
        let stats = HeadStats {
            entropy: true,
            sum_pi_squared: self.cfg.calculate_sum_pi_squared,
        };
        let k = 2 + usize::from(stats.sum_pi_squared);
        let mut out = self
            .trainable
            .forward_rows(batch, self.log_prob_micro, k, |model, mi| {
                let out = response_stats(model, mi, t, stats)?;
                let ent = out
                    .entropy
                    .ok_or_else(|| candle_core::Error::Msg("no entropy".into()))?;
                Ok([Some(out.log_probs), Some(ent), out.sum_pi_squared]
                    .into_iter()
                    .flatten()
                    .collect())
            })?;
        if stats.sum_pi_squared {
            batch.set(Column::SumPiSquared, out.pop().unwrap_or_default())?;
        }
        batch.set(Column::Entropys, out.pop().unwrap_or_default())?;
        batch.set(Column::OldLogProbs, out.pop().unwrap_or_default())
    }

    /// Whether the update of a step of `rows` rows is on-policy (verl's shortcut: one
    /// mini-batch, one epoch, default path) with a forward that can stand in for the
    /// `old_log_prob` pass: no adapter dropout (the old log-probs are a pass without it).
    pub fn update_replaces_old_log_prob(&self, rows: usize) -> bool {
        self.trainable.settings.plan.on_policy(rows)
            && self.trainable.model.adapter_dropout() == 0.0
    }

    /// One PPO update over the step's rows (verl's `update_policy`); returns `actor/*` metrics:
    /// on the default path `actor/entropy` (with `calculate_entropy` or `entropy_coeff != 0`),
    /// and `actor/kl_loss` always (0 without `use_kl_loss`), as verl's `dp_actor`; on the
    /// global path `actor/entropy_loss` when the entropy enters the loss.
    pub fn update(&mut self, batch: &StepBatch, step: u64) -> candle_core::Result<Metrics> {
        self.update_capturing(batch, step, None)
    }

    /// [`Actor::update`] of an on-policy step whose `old_log_prob` pass was skipped (see
    /// [`Actor::update_replaces_old_log_prob`]): the update's forward, before its only optimizer
    /// step, sees the weights that pass would have seen, so its log-probs and entropies (kept
    /// detached) fill `old_log_probs` and `entropys` (for `actor/entropy` and dumps). One
    /// forward over the batch instead of two; same values to float rounding.
    pub fn update_filling_old_log_prob(
        &mut self,
        batch: &mut StepBatch,
        step: u64,
    ) -> candle_core::Result<Metrics> {
        let n = batch.len();
        let mut cols: [Ragged; 2] = [vec![Vec::new(); n], vec![Vec::new(); n]];
        let m = self.update_capturing(batch, step, Some(&mut cols))?;
        let [mut lp, mut ent] = cols;
        // With data parallelism each rank computed only its micro-batches: the other rows
        // arrive by a sum over the ranks, each row owned by exactly one rank (zeros elsewhere).
        let comm = self.trainable.comm.as_ref();
        if comm.world_size() > 1 {
            let lens = batch.response_lens();
            lp = crate::dist::grads::sum_rows_over_ranks(comm, lp, &lens)?;
            ent = crate::dist::grads::sum_rows_over_ranks(comm, ent, &lens)?;
        }
        batch.set(Column::OldLogProbs, lp)?;
        batch.set(Column::Entropys, ent)?;
        Ok(m)
    }

    /// The update; with `capture`, each micro-batch's log-probs and entropies are scattered
    /// into it (per row, trimmed to the response).
    fn update_capturing(
        &mut self,
        batch: &StepBatch,
        step: u64,
        mut capture: Option<&mut [Ragged; 2]>,
    ) -> candle_core::Result<Metrics> {
        let lens = batch.response_lens();
        let cfg = &self.cfg;
        let temperature = self.temperature;
        let seed = self.trainable.settings.seed;
        let base = PolicyLossParams::from_actor(cfg);
        let mode = cfg.loss_agg_mode;
        let global = self.trainable.settings.plan.global_norm;
        let bypass = &self.bypass;
        let need_entropy = cfg.entropy_coeff != 0.0 || (cfg.calculate_entropy && !global);
        let column = |on: bool, c: Column| on.then(|| batch.column(c)).transpose();
        let old_log_prob = column(capture.is_none(), Column::OldLogProbs)?;
        let advantages = batch.column(Column::Advantages)?;
        // Rollout correction's IS weights multiply each token's policy loss.
        let is_weights = column(
            batch.has(Column::RolloutIsWeights),
            Column::RolloutIsWeights,
        )?;
        let reference = column(cfg.use_kl_loss, Column::RefLogProb)?;
        let distill = self.distill.as_ref();
        let distill = distill
            .map(|d| d.teacher_data(batch).map(|t| (d, t)))
            .transpose()?;
        let mut micro_index = 0u64;
        let mut m = self.trainable.update(batch, step, |model, mi, rows, ctx| {
            let norm = ctx.norm;
            let device = model.device();
            let with_entropy = need_entropy || capture.is_some();
            let r = mi.response_width;
            let teacher = distill.map(|(_, t)| t);
            let (lp, ent, topk) =
                student_forward(model, mi, rows, temperature, with_entropy, teacher)?;
            let mask = &mi.response_mask;
            if let Some(cols) = capture.as_deref_mut() {
                if !ctx.on_policy {
                    return Err(candle_core::Error::Msg(
                        "old log-probs taken from an update that is not on-policy".into(),
                    ));
                }
                let e = ent.as_ref().expect("entropy asked for");
                scatter_rows(&lp.detach(), rows, &lens, &mut cols[0])?;
                scatter_rows(&e.detach(), rows, &lens, &mut cols[1])?;
            }
            let ent = if need_entropy { ent } else { None };
            // On-policy (one mini-batch, one epoch): the current log-prob, detached, is the old
            // one, so the ratio is exactly 1 (verl's `on_policy` in `update_policy`); never in
            // bypass mode, whose old log-probs are the rollout's.
            let old = match old_log_prob {
                Some(old) if !ctx.on_policy || bypass.is_some() => pad_rows(old, rows, r, device)?,
                _ => lp.detach(),
            };
            let adv = pad_rows(advantages, rows, r, device)?;
            let mut params = base.clone();
            params.norm = norm;
            // clip_cov picks tokens at random: a different, reproducible draw per micro-batch.
            params.seed = seed
                .wrapping_add(step.wrapping_mul(1 << 20))
                .wrapping_add(micro_index);
            micro_index += 1;
            let w = match is_weights {
                Some(w) => Some(pad_rows(w, rows, r, device)?),
                None => None,
            };
            let (out, corr_metrics) = match bypass {
                Some((loss, c)) => bypass_loss(*loss, c, &lp, &old, &adv, mask, &params)?,
                None => (
                    policy_loss_weighted(&old, &lp, &adv, mask, &params, w.as_ref())?,
                    Metrics::new(),
                ),
            };
            let mut scalars = vec![("actor/pg_loss", scalar(&out.loss)?)];
            scalars.extend(out.metrics([
                "actor/pg_clipfrac",
                "actor/ppo_kl",
                "actor/pg_clipfrac_lower",
            ]));
            let mut loss = out.loss;
            if let Some(ent) = ent {
                let e = agg_loss(&ent, mask, mode, norm)?;
                let key = if global {
                    "actor/entropy_loss"
                } else {
                    "actor/entropy"
                };
                scalars.push((key, scalar(&e)?));
                if cfg.entropy_coeff != 0.0 {
                    loss = (loss - (e * cfg.entropy_coeff)?)?;
                }
            }
            if let Some(reference) = reference {
                let rl = pad_rows(reference, rows, r, device)?;
                let kl = kl_loss(&lp, &rl, mask, cfg.kl_loss_type, mode, norm)?;
                scalars.push(("actor/kl_loss", scalar(&kl)?));
                scalars.push(("actor/kl_coef", cfg.kl_loss_coef));
                loss = (loss + (kl * cfg.kl_loss_coef)?)?;
            }
            if let Some((d, teacher)) = distill {
                let w = w.as_ref();
                let inputs = (&lp, &old, mask);
                let out = d.micro_loss(teacher, topk.as_ref(), inputs, rows, norm, w)?;
                loss = d.add_to(loss, &mut scalars, out)?;
            }
            loss = add_router_aux_loss(model, loss, rows.len(), norm, &mut scalars)?;
            scalars.push(("actor/loss", scalar(&loss)?));
            Ok(MicroLoss {
                loss,
                scalars,
                extra: corr_metrics,
            })
        })?;
        if !global {
            m.entry("actor/kl_loss".into()).or_insert(0.0);
        }
        Ok(m)
    }
}

/// `loss` plus `router_aux_loss_coef` times the router's load-balancing loss of the
/// micro-batch's forward where the model's config asks for it (a Qwen3-MoE actor with
/// `output_router_logits`), as transformers adds it to a loss from labels; reported as
/// `actor/router_aux_loss`; `loss` as it is otherwise. On the global-normalisation path, where
/// micro-batch losses are summed unscaled, each micro-batch's term is weighted by its share of
/// the mini-batch's sequences, so that the mini-batch carries the mean of its micro-batches'.
fn add_router_aux_loss(
    model: &CausalLm,
    loss: Tensor,
    rows: usize,
    norm: AggNorm,
    scalars: &mut Vec<(&'static str, f64)>,
) -> candle_core::Result<Tensor> {
    let Some(coef) = model.router_aux_coef() else {
        return Ok(loss);
    };
    let Some(aux) = model.take_router_aux_loss()? else {
        return Err(candle_core::Error::Msg(
            "the model's config asks for the router's load-balancing loss (output_router_logits), \
             but the training forward computed none"
                .into(),
        ));
    };
    let share = norm
        .global_batch_size
        .map_or(1.0, |g| rows as f64 / g.max(1.0));
    let aux = (aux.to_dtype(loss.dtype())? * share)?;
    scalars.push(("actor/router_aux_loss", scalar(&aux)?));
    loss + (aux * coef)?
}

/// What a micro-batch's distillation term reads from the step's batch.
#[derive(Clone, Copy)]
enum TeacherData<'a> {
    /// The teacher's log-prob of each sampled token (the single-sample estimators).
    LogProbs(&'a Ragged),
    /// The teacher's top-k tokens per position (`forward_kl_topk`).
    Topk(&'a TopkRows),
}

/// The student's side of top-k distillation on one micro-batch, `[m, r, k]` each: its
/// log-probs of the teacher's tokens (with gradient), its own top-k ids, and the teacher's ids
/// and log-probs.
struct TopkSide {
    gathered: Tensor,
    own: Tensor,
    ids: Tensor,
    teacher_lp: Tensor,
}

impl Distill {
    /// The data of `batch` this term reads; an error names the phase that should have
    /// filled it.
    fn teacher_data<'a>(&self, batch: &'a StepBatch) -> candle_core::Result<TeacherData<'a>> {
        match self.topk {
            None => Ok(TeacherData::LogProbs(
                batch.column(Column::TeacherLogProbs)?,
            )),
            Some(_) => batch
                .teacher_topk
                .as_ref()
                .map(TeacherData::Topk)
                .ok_or_else(|| {
                    candle_core::Error::Msg(
                        "no teacher top-k tokens: the teacher phase did not run".into(),
                    )
                }),
        }
    }

    /// The term on one micro-batch (`rows`): `(log_prob, old_log_prob, mask)` `[m, r]` each,
    /// `topk` the student's side from [`student_forward`] with top-k teacher tokens.
    fn micro_loss(
        &self,
        teacher: TeacherData,
        topk: Option<&TopkSide>,
        (lp, old, mask): (&Tensor, &Tensor, &Tensor),
        rows: &[usize],
        norm: AggNorm,
        w: Option<&Tensor>,
    ) -> candle_core::Result<distill::DistillOutput> {
        match (teacher, topk, self.topk) {
            (TeacherData::LogProbs(t), _, _) => {
                let tl = pad_rows(t, rows, lp.dim(1)?, lp.device())?;
                distill::distillation_loss(lp, &tl, old, mask, &self.params, norm, w)
            }
            (TeacherData::Topk(_), Some(s), Some((k, floor))) => {
                let terms = distill::topk_terms(&s.gathered, &s.teacher_lp, &s.ids, &s.own, floor)?;
                distill::distillation_loss_topk(&terms, lp, old, mask, k, &self.params, norm, w)
            }
            _ => Err(candle_core::Error::Msg(
                "top-k distillation without the student's top-k forward".into(),
            )),
        }
    }

    /// `task` (the policy loss with its entropy and KL terms; its metrics in `scalars`) with the
    /// term `out` added as verl's `distillation_ppo_loss` adds it.
    fn add_to(
        &self,
        task: Tensor,
        scalars: &mut Vec<(&'static str, f64)>,
        out: distill::DistillOutput,
    ) -> candle_core::Result<Tensor> {
        if !self.use_task_rewards && self.params.policy_gradient.is_none() {
            // verl computes no policy loss then, and reports none.
            scalars.retain(|(k, _)| !k.starts_with("actor/"));
        }
        scalars.extend(out.metrics);
        scalars.push(("distillation/loss", scalar(&out.loss)?));
        distill::combine(&task, &out.loss, self.use_task_rewards, self.coef)
    }
}

/// A micro-batch's log-probs and entropies (`[m, r]`), and with top-k teacher tokens the
/// student's side of that loss from the same forward.
fn student_forward(
    model: &CausalLm,
    mi: &MicroInputs,
    rows: &[usize],
    temperature: f64,
    with_entropy: bool,
    teacher: Option<TeacherData>,
) -> candle_core::Result<(Tensor, Option<Tensor>, Option<TopkSide>)> {
    let Some(TeacherData::Topk(tk)) = teacher else {
        let (lp, ent) = response_logprobs(model, mi, temperature, with_entropy)?;
        return Ok((lp, ent, None));
    };
    let (ids, teacher_lp) = tk.padded(rows, mi.response_width, model.device())?; // [m, r, k]
    let (lp, ent, gathered, own) =
        response_logprobs_topk(model, mi, temperature, with_entropy, &ids)?;
    let side = TopkSide {
        gathered,
        own,
        ids,
        teacher_lp,
    };
    Ok((lp, ent, Some(side)))
}

/// The frozen reference policy: the initial actor weights, never updated, holding no gradient
/// and no optimizer state.
pub struct Reference {
    pub model: CausalLm,
    /// Owns the weights the detached view reads.
    _varmap: VarMap,
    micro: MicroBatching,
    temperature: f64,
    /// Padding id and whether to pack (`actor_rollout_ref.model.use_remove_padding`).
    inputs: Layout,
}

impl Reference {
    /// The reference of a run: `loaded` weights read through `micro`-sized forward passes.
    pub fn new(loaded: Loaded, micro: MicroBatching, temperature: f64, inputs: Layout) -> Self {
        Self {
            model: loaded.model.no_grad(),
            _varmap: loaded.varmap,
            micro,
            temperature,
            inputs,
        }
    }

    /// The reference of a LoRA run: the actor's own base weights with its adapters switched off
    /// (verl computes ref log-probs under `disable_adapter()`), no second model loaded.
    pub fn from_base(actor: &Actor, micro: MicroBatching, inputs: Layout) -> Self {
        Self {
            // Precision: the actor's until the caller sets the reference's own.
            model: actor.view().without_adapters(),
            _varmap: VarMap::new(),
            micro,
            temperature: actor.temperature,
            inputs,
        }
    }

    /// The `k` most likely tokens at every response position of `batch` and their log-probs
    /// (top-k distillation's teacher side), at this model's temperature.
    pub fn compute_topk(&self, batch: &StepBatch, k: usize) -> candle_core::Result<TopkRows> {
        let t = self.temperature;
        let layout = self.inputs.given(
            self.model.packs_without_padding(),
            self.model.shares_prefixes(),
        );
        let chunk = logit_chunk(self.model.args.vocab_size);
        // 2k outputs of [m, r]: the k log-probs, then the k ids (as f32: exact below 2^24).
        let out = forward_rows(&self.model, batch, self.micro, layout, 2 * k, |m, mi| {
            let h = mi.response_hidden(m)?;
            let h = if t > 0.0 && t != 1.0 { (h / t)? } else { h };
            let (lp, ids) = m.topk_logprobs(&h, k, chunk)?; // [positions, k]
            let lp = mi.to_rows_k(&lp)?; // [m, r, k]
            let ids = mi.to_rows_k(&ids.to_dtype(candle_core::DType::F32)?)?;
            let mut cols = Vec::with_capacity(2 * k);
            for x in [&lp, &ids] {
                for j in 0..k {
                    cols.push(x.narrow(2, j, 1)?.squeeze(2)?);
                }
            }
            Ok(cols)
        })?;
        let rows = batch.len();
        let mut topk = TopkRows {
            k,
            ids: vec![Vec::new(); rows],
            log_probs: vec![Vec::new(); rows],
        };
        for (r, (ids, lps)) in topk.ids.iter_mut().zip(&mut topk.log_probs).enumerate() {
            for pos in 0..out[0][r].len() {
                let (lp_cols, id_cols) = out.split_at(k);
                for (lp, id) in lp_cols.iter().zip(id_cols) {
                    lps.push(lp[r][pos]);
                    ids.push(id[r][pos] as u32);
                }
            }
        }
        Ok(topk)
    }

    /// The `ref` phase: fills `ref_log_prob` (verl's `compute_ref_log_prob`).
    pub fn compute_ref_log_prob(&self, batch: &mut StepBatch) -> candle_core::Result<()> {
        let t = self.temperature;
        let layout = self.inputs.given(
            self.model.packs_without_padding(),
            self.model.shares_prefixes(),
        );
        let mut out = forward_rows(&self.model, batch, self.micro, layout, 1, |m, mi| {
            Ok(vec![response_logprobs(m, mi, t, false)?.0])
        })?;
        batch.set(Column::RefLogProb, out.pop().unwrap_or_default())
    }
}
