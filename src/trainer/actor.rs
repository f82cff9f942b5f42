//! The actor (policy) and the reference policy: log-probs of responses, and the PPO policy
//! update (verl's `DataParallelPPOActor.compute_log_prob` / `update_policy`).

use candle_core::{Device, Tensor};
use candle_nn::VarMap;

use super::batch::{pad_rows, scatter_rows, MicroInputs, Ragged, StepBatch};
use super::optim::{AdamW, LrSchedule};
use super::update::{self, MicroLoss};
use crate::algo::{agg_loss, kl_loss, policy_loss, AggNorm, PolicyLossParams};
use crate::config::{ActorConfig, MicroBatching, UpdatePlan};
use crate::metrics::Metrics;
use crate::model::{CausalLm, ModelArgs};

/// Positions per chunk of the vocabulary projection: about 4 M logits alive at a time.
pub fn logit_chunk(vocab: usize) -> usize {
    ((1usize << 22) / vocab.max(1)).max(16)
}

/// Log-probs (and entropy) of a micro-batch's response tokens under `model`, with logits divided
/// by the rollout `temperature` as the sampler used them: `[m, r]` each.
pub fn response_logprobs(
    model: &CausalLm,
    mi: &MicroInputs,
    temperature: f64,
    with_entropy: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let hidden = model.forward_hidden(&mi.input_ids, &mi.position_ids, &mi.key_mask, None)?; // [m, p + r − 1, h]
    let h = mi.response_hidden(&hidden)?; // [m, r, h]
                                          // (h·W)/T = (h/T)·W: scaling the hidden state scales every logit.
    let h = if temperature > 0.0 && temperature != 1.0 {
        (h / temperature)?
    } else {
        h
    };
    model.token_logprobs(
        &h,
        &mi.targets,
        logit_chunk(model.args.vocab_size),
        with_entropy,
    )
}

/// Log-probs (and entropies) of every row's response, micro-batch by micro-batch, without
/// gradients (`model` should be a [`CausalLm::no_grad`] view).
pub fn compute_log_prob(
    model: &CausalLm,
    batch: &StepBatch,
    micro: MicroBatching,
    temperature: f64,
    pad_id: u32,
    with_entropy: bool,
) -> candle_core::Result<(Ragged, Option<Ragged>)> {
    let n = batch.len();
    let lens: Vec<usize> = (0..n).map(|r| batch.response_len(r)).collect();
    let mut lp: Ragged = vec![Vec::new(); n];
    let mut ent: Ragged = vec![Vec::new(); n];
    let rows: Vec<usize> = (0..n).collect();
    for mb in batch.micro_batches(&rows, micro) {
        let mi = batch.inputs(&mb, pad_id, model.device())?;
        let (l, e) = response_logprobs(model, &mi, temperature, with_entropy)?;
        scatter_rows(&l, &mb, &lens, &mut lp)?;
        if let Some(e) = e {
            scatter_rows(&e, &mb, &lens, &mut ent)?;
        }
    }
    Ok((lp, with_entropy.then_some(ent)))
}

/// The policy being trained.
pub struct Actor {
    /// Trainable weights (gradients flow).
    pub model: CausalLm,
    pub varmap: VarMap,
    pub args: ModelArgs,
    /// The same weights without autograd, for rollout and old log-probs.
    view: CausalLm,
    pub optimizer: AdamW,
    pub schedule: LrSchedule,
    /// Training steps that updated the actor (the LR scheduler's position).
    pub updates: u64,
    cfg: ActorConfig,
    plan: UpdatePlan,
    /// Rollout temperature (logits are divided by it in every log-prob).
    pub temperature: f64,
    /// Divisor of seq-mean-token-sum-norm when `loss_scale_factor` is unset.
    response_length: usize,
    pad_id: u32,
}

/// What the policy loss needs per row besides the batch: `[rows][response_len]` each.
pub struct PolicyData<'a> {
    pub old_log_prob: &'a Ragged,
    pub advantages: &'a Ragged,
    /// With `use_kl_loss`.
    pub ref_log_prob: Option<&'a Ragged>,
}

impl Actor {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: CausalLm,
        varmap: VarMap,
        cfg: &ActorConfig,
        plan: &UpdatePlan,
        total_steps: u64,
        temperature: f64,
        response_length: usize,
        pad_id: u32,
    ) -> Self {
        let vars = varmap.data().lock().expect("varmap lock").clone();
        Self {
            view: model.no_grad(),
            args: model.args.clone(),
            model,
            varmap,
            optimizer: AdamW::new(vars, &cfg.optim),
            schedule: LrSchedule::new(&cfg.optim, total_steps),
            updates: 0,
            cfg: cfg.clone(),
            plan: plan.clone(),
            temperature,
            response_length,
            pad_id,
        }
    }

    /// The weights without autograd: generation and log-probs see every update.
    pub fn view(&self) -> &CausalLm {
        &self.view
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// One PPO update over the step's rows; returns `actor/*` metrics.
    pub fn update(
        &mut self,
        batch: &StepBatch,
        data: &PolicyData,
        step: u64,
    ) -> candle_core::Result<Metrics> {
        let lr = self.schedule.lr(self.updates);
        let device = self.model.device().clone();
        let model = &self.model;
        let cfg = &self.cfg;
        let (temperature, pad_id) = (self.temperature, self.pad_id);
        let base = PolicyLossParams::from_actor(cfg);
        let mode = cfg.loss_agg_mode;
        let scale = cfg.loss_scale_factor.or(Some(self.response_length as f64));
        let need_entropy = cfg.entropy_coeff != 0.0;
        let mut micro_index = 0u64;
        let m = update::run(
            "actor",
            &self.plan,
            batch,
            cfg.data_loader_seed,
            step,
            scale,
            &mut self.optimizer,
            lr,
            |rows: &[usize], norm: AggNorm| {
                let mi = batch.inputs(rows, pad_id, &device)?;
                let (lp, ent) = response_logprobs(model, &mi, temperature, need_entropy)?;
                let r = mi.response_width;
                let mask = &mi.response_mask;
                let old = pad_rows(data.old_log_prob, rows, r, &device)?;
                let adv = pad_rows(data.advantages, rows, r, &device)?;
                let mut params = base.clone();
                params.norm = norm;
                // clip_cov picks tokens at random: a different, reproducible draw per micro-batch.
                params.seed = cfg
                    .data_loader_seed
                    .wrapping_add(step.wrapping_mul(1 << 20))
                    .wrapping_add(micro_index);
                micro_index += 1;
                let out = policy_loss(&old, &lp, &adv, mask, &params)?;
                let mut scalars = vec![("actor/pg_loss", crate::algo::agg::scalar(&out.loss)?)];
                for (k, v) in [
                    ("actor/pg_clipfrac", out.pg_clipfrac),
                    ("actor/ppo_kl", out.ppo_kl),
                    ("actor/pg_clipfrac_lower", out.pg_clipfrac_lower),
                ] {
                    if let Some(v) = v {
                        scalars.push((k, v));
                    }
                }
                let mut loss = out.loss;
                if let Some(ent) = ent {
                    let e = agg_loss(&ent, mask, mode, norm)?;
                    scalars.push(("actor/entropy_loss", crate::algo::agg::scalar(&e)?));
                    loss = (loss - (e * cfg.entropy_coeff)?)?;
                }
                if cfg.use_kl_loss {
                    let reference = data.ref_log_prob.ok_or_else(|| {
                        candle_core::Error::Msg("use_kl_loss without reference log-probs".into())
                    })?;
                    let rl = pad_rows(reference, rows, r, &device)?;
                    let kl = kl_loss(&lp, &rl, mask, cfg.kl_loss_type, mode, norm)?;
                    scalars.push(("actor/kl_loss", crate::algo::agg::scalar(&kl)?));
                    scalars.push(("actor/kl_coef", cfg.kl_loss_coef));
                    loss = (loss + (kl * cfg.kl_loss_coef)?)?;
                }
                scalars.push(("actor/loss", crate::algo::agg::scalar(&loss)?));
                Ok(MicroLoss { loss, scalars })
            },
        )?;
        self.updates += 1;
        Ok(m)
    }
}

/// The frozen reference policy: the initial actor weights, never updated, holding no gradient
/// and no optimizer state.
pub struct Reference {
    pub model: CausalLm,
    /// Owns the weights the detached view reads.
    _varmap: VarMap,
}

impl Reference {
    pub fn new(model: CausalLm, varmap: VarMap) -> Self {
        Self {
            model: model.no_grad(),
            _varmap: varmap,
        }
    }
}
