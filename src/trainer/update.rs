//! The PPO update schedule of a [`Trainable`], shared by actor and critic (verl's `update_policy` /
//! `update_critic` loops): `ppo_epochs` passes over the step's rows, each cut into mini-batches
//! (one optimizer step each) and micro-batches (one forward/backward each, gradients summed).
//!
//! Two normalisations, as verl's two worker paths (`trainer.use_legacy_worker_impl`):
//! - default (`dp_actor` / `dp_critic`): each micro-batch's loss is aggregated over that
//!   micro-batch alone and multiplied by `1/gradient_accumulation` (by `rows_in_micro /
//!   mini-batch rows` with `use_dynamic_bsz`); with micro-batches of unequal token counts this is
//!   not the mini-batch loss's gradient (token-mean weighs a token of a short micro-batch more);
//! - `disable` (the engine workers): the normalisers are those of the whole mini-batch, so the
//!   summed micro-batch gradients are exactly the mini-batch loss's gradient.
//!
//! Metrics as verl's workers report them: a `*loss` scalar is `loss × scale` summed over every
//! micro-batch of every mini-batch and epoch; other micro-batch scalars are averaged over all
//! micro-batches; `grad_norm` over the mini-batches.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::batch::StepBatch;
use super::micro::MicroInputs;
use super::optim::grad_norm;
use super::trainable::{Network, Trainable, UpdateSettings};
use crate::algo::AggNorm;
use crate::config::{MicroBatching, UpdatePlan};
use crate::dist::grads::{all_reduce_grads, Summed};
use crate::dist::Collective;
use crate::kernels::storage::add_in_place;
use crate::metrics::{mean, Metrics};
use crate::model::grad_sink::GradSinks;
use crate::util::permutation;

/// What one micro-batch's loss reports: the loss to backpropagate (before the micro-batch
/// scale) and named scalars.
pub struct MicroLoss {
    pub loss: Tensor,
    pub scalars: Vec<(&'static str, f64)>,
    /// More averaged scalars, named at run time (bypass mode's `rollout_corr/*`).
    pub extra: BTreeMap<String, f64>,
}

/// How one micro-batch's loss is built.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroCtx {
    /// Normalisers of `agg_loss`.
    pub norm: AggNorm,
    /// verl's on-policy shortcut (default path, one mini-batch, one epoch): the old log-prob is
    /// the current one, detached.
    pub on_policy: bool,
}

/// Metric keys whose micro-batch values are summed (times the micro-batch scale) over the
/// whole update, as verl accumulates its losses; the others are averaged.
fn summed(key: &str) -> bool {
    // distillation/abs_loss is a mean |d| (verl aggregates it as a mean).
    key.ends_with("loss") && key != "distillation/abs_loss"
}

/// Scalars reduced by their extreme over micro-batches (and ranks) instead of a mean: `Some(true)`
/// a maximum, `Some(false)` a minimum, as verl's MIN / MAX metrics (`distillation/loss_max`,
/// `loss_min`; bypass mode's `rollout_corr/*_max` stay means of the micro-batches', as before).
fn extreme(key: &str) -> Option<bool> {
    if !key.starts_with("distillation/") {
        None
    } else if key.ends_with("_max") {
        Some(true)
    } else if key.ends_with("_min") {
        Some(false)
    } else {
        None
    }
}

/// The factor a micro-batch of `rows` rows multiplies its loss by (1 on the global path).
pub fn micro_scale(plan: &UpdatePlan, rows: usize) -> f64 {
    if plan.global_norm {
        return 1.0;
    }
    match plan.micro {
        MicroBatching::Sequences(_) => 1.0 / plan.grad_accum.unwrap_or(1).max(1) as f64,
        MicroBatching::TokenBudget(_) => rows as f64 / plan.mini_batch_responses.max(1) as f64,
    }
}

/// The micro-batch scalars of an update so far: summed losses and listed (averaged) values.
#[derive(Debug, Default)]
pub struct UpdateScalars {
    pub lists: BTreeMap<String, Vec<f64>>,
    pub totals: BTreeMap<String, f64>,
}

impl UpdateScalars {
    fn add(&mut self, scalars: Vec<(&'static str, f64)>, scale: f64) {
        for (k, v) in scalars {
            if summed(k) {
                *self.totals.entry(k.to_string()).or_default() += v * scale;
            } else {
                self.lists.entry(k.to_string()).or_default().push(v);
            }
        }
    }
}

/// The normalisers of a mini-batch's micro-batch losses (`mini`: its rows).
pub fn mini_batch_norm(
    batch: &StepBatch,
    mini: &[usize],
    plan: &UpdatePlan,
    loss_scale_factor: Option<f64>,
) -> AggNorm {
    if plan.global_norm {
        let tokens: usize = mini.iter().map(|&r| batch.mask_len(r)).sum();
        let seqs = mini.iter().filter(|&&r| batch.mask_len(r) > 0).count();
        AggNorm {
            batch_num_tokens: Some(tokens as f64),
            global_batch_size: Some(seqs as f64),
            loss_scale_factor,
            // The ranks' gradients are summed, not averaged (see `all_reduce_grads`).
            dp_size: None,
            legacy_sum_norm: false,
        }
    } else {
        // b178a3c's dp_actor / dp_critic, with b178a3c's agg_loss.
        AggNorm {
            loss_scale_factor,
            legacy_sum_norm: true,
            ..AggNorm::default()
        }
    }
}

/// The gradient of one mini-batch (`(batch, mini)`: the step's batch and the mini-batch's rows)
/// with respect to `vars`: each micro-batch's loss times [`micro_scale`], backpropagated and
/// summed; `None` when the mini-batch has no micro-batch. `micro_loss` as in
/// [`Trainable::update`].
///
/// With data parallelism (`settings.shard` = (rank, world size)) the mini-batch is cut into
/// micro-batches exactly as one process cuts it, and rank `r` takes micro-batches `r`, `r + W`,
/// ...: the ranks' gradients add up to the one-process gradient (see [`all_reduce_grads`]),
/// whatever the normalisation path. A rank without a micro-batch returns an empty store.
pub fn mini_batch_grads<N: Network>(
    model: &N,
    vars: &[(String, candle_core::Var)],
    (batch, mini): (&StepBatch, &[usize]),
    settings: &UpdateSettings,
    ctx: MicroCtx,
    scalars: &mut UpdateScalars,
    micro_loss: &mut impl FnMut(&N, &MicroInputs, &[usize], MicroCtx) -> candle_core::Result<MicroLoss>,
) -> candle_core::Result<Option<GradStore>> {
    let (plan, prefix) = (&settings.plan, settings.prefix);
    let (rank, world) = settings.shard;
    let device = model.device().clone();
    let layout = settings.layout(model);
    let micros = batch.micro_batches_for(mini, plan.micro, layout);
    if micros.is_empty() {
        return Ok(None);
    }
    // Only the parameters' gradients are kept: `backward()` also returns gradients for constant
    // inputs of the graph (masks, rotary tables, ...), which would otherwise pile up across
    // micro-batches (measured: +2.3 GB per SmolLM2 micro-batch).
    let mut grads = GradStore::default();
    // Accumulators this function made (sums of two gradients): nothing else holds them, so
    // later micro-batches add into them in place. A gradient straight from `backward()` may
    // share its storage with another variable's, so the first one is never written to.
    let mut owned = std::collections::HashSet::new();
    // The ops that compute weight gradients themselves (embedding, layers, LM head) sum them
    // in place over the micro-batches, outside candle's store (model::grad_sink): one set of
    // gradients instead of a sum beside each backward's fresh set.
    let sinks = GradSinks::open(vars.iter().map(|(_, v)| v.as_tensor()));
    for micro in micros.into_iter().skip(rank).step_by(world.max(1)) {
        let mi = batch.inputs(&micro, layout, &device)?;
        let out = micro_loss(model, &mi, &micro, ctx)?;
        let scale = micro_scale(plan, micro.len());
        let loss = if scale == 1.0 {
            out.loss
        } else {
            (out.loss * scale)?
        };
        // Large blocks are recycled by the caller's `huge_pages` scope (`Trainable::update`).
        let mut g = loss.backward()?;
        drop(loss);
        for (_, var) in vars {
            if let Some(t) = g.remove(var.as_tensor()) {
                let sum = match grads.remove(var.as_tensor()) {
                    Some(acc) if owned.contains(&var.id()) && add_in_place(&acc, &t)? => acc,
                    Some(acc) => {
                        owned.insert(var.id());
                        (acc + t)?
                    }
                    None => t,
                };
                grads.insert(var.as_tensor(), sum);
            }
        }
        drop(g);
        tracing::debug!(
            "{prefix}: micro-batch of {} rows: resident {:.2} GB after backward",
            micro.len(),
            crate::metrics::rss_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64
        );
        scalars.add(out.scalars, scale);
        for (k, v) in out.extra {
            scalars.lists.entry(k).or_default().push(v);
        }
    }
    sinks.drain_into(&mut grads)?;
    Ok(Some(grads))
}

impl UpdateScalars {
    /// The scalars of every rank: listed values become (sum, count) pairs, totals add up. The
    /// same on every rank (merged in rank order).
    fn all_ranks(self, comm: &dyn Collective) -> candle_core::Result<BTreeMap<String, f64>> {
        let mut out: BTreeMap<String, f64> = BTreeMap::new();
        let reduced = |k: &str, v: &[f64]| match extreme(k) {
            Some(max) => Summed::extreme(v, max),
            None => Summed::mean(v),
        };
        if comm.world_size() == 1 {
            out.extend(self.lists.iter().map(|(k, v)| {
                let s = reduced(k, v);
                (k.clone(), if s.extreme.is_some() { s.sum } else { mean(v) })
            }));
            out.extend(self.totals);
            return Ok(out);
        }
        let mine: BTreeMap<String, Summed> = self
            .lists
            .iter()
            .map(|(k, v)| (k.clone(), reduced(k, v)))
            .chain(
                self.totals
                    .iter()
                    .map(|(k, &v)| (k.clone(), Summed::total(v))),
            )
            .collect();
        crate::dist::grads::merge_over_ranks(comm, mine)
    }
}

impl<N: Network> Trainable<N> {
    /// One PPO update over the step's rows; returns `{prefix}/*` metrics. `micro_loss(model,
    /// inputs, rows, ctx)` builds one micro-batch's loss from the model with gradients.
    ///
    /// Its forwards, backwards and optimizer steps allocate and free blocks of the same few
    /// sizes over and over: large ones are kept for reuse and on huge pages for the whole update
    /// (`kernels::alloc::huge_pages`), and go back to the system when it ends.
    pub fn update(
        &mut self,
        batch: &StepBatch,
        step: u64,
        micro_loss: impl FnMut(&N, &MicroInputs, &[usize], MicroCtx) -> candle_core::Result<MicroLoss>,
    ) -> candle_core::Result<Metrics> {
        crate::kernels::alloc::huge_pages(|| self.update_in_scope(batch, step, micro_loss))
    }

    fn update_in_scope(
        &mut self,
        batch: &StepBatch,
        step: u64,
        mut micro_loss: impl FnMut(
            &N,
            &MicroInputs,
            &[usize],
            MicroCtx,
        ) -> candle_core::Result<MicroLoss>,
    ) -> candle_core::Result<Metrics> {
        let lr = self.schedule.lr(self.updates);
        let s = &self.settings;
        let (plan, prefix) = (&s.plan, s.prefix);
        let optimizer = &mut self.optimizer;
        let rows = batch.len();
        let mut scalars = UpdateScalars::default();
        let mut norms = Vec::new();
        let mut skipped = 0usize;
        let on_policy = plan.on_policy(rows);
        // Adapter-dropout masks from (step, forward number within the step): a resumed run
        // draws the same ones.
        self.model.set_dropout_position(step << 32);
        for epoch in 0..plan.epochs {
            let order: Vec<usize> = if plan.shuffle {
                // A fresh, reproducible order per (step, epoch): resuming needs no RNG state.
                permutation(
                    rows,
                    s.seed,
                    step.wrapping_mul(1_000_003).wrapping_add(epoch as u64),
                )
            } else {
                batch
                    .update_order
                    .clone()
                    .unwrap_or_else(|| (0..rows).collect())
            };
            for mini in order.chunks(plan.mini_batch_responses.max(1)) {
                // Every rank holds the whole step's rows: this test and the norm's below give
                // the same answer on all of them.
                if mini.iter().all(|&r| batch.mask_len(r) == 0) {
                    continue;
                }
                let norm = mini_batch_norm(batch, mini, plan, s.loss_scale_factor);
                let ctx = MicroCtx { norm, on_policy };
                let vars = optimizer.vars();
                let Some(mut grads) = mini_batch_grads(
                    &self.model,
                    vars,
                    (batch, mini),
                    s,
                    ctx,
                    &mut scalars,
                    &mut micro_loss,
                )?
                else {
                    continue;
                };
                all_reduce_grads(self.comm.as_ref(), vars, &mut grads)?;
                let norm = grad_norm(optimizer.vars(), &grads)?;
                norms.push(norm);
                if norm.is_finite() {
                    optimizer.step_scaled(
                        &grads,
                        lr,
                        optimizer.clip_scale(norm, plan.grad_clip),
                    )?;
                } else {
                    skipped += 1;
                    tracing::warn!(
                        "{prefix}: gradient norm is {norm} at step {step}; this mini-batch's update is skipped"
                    );
                }
            }
        }
        let mut m: Metrics = scalars.all_ranks(self.comm.as_ref())?.into_iter().collect();
        if !norms.is_empty() {
            m.insert(format!("{prefix}/grad_norm"), mean(&norms));
        }
        m.insert(format!("{prefix}/lr"), lr);
        if skipped > 0 {
            m.insert(format!("{prefix}/skipped_updates"), skipped as f64);
        }
        self.updates += 1;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::algo::agg::scalar;
    use crate::algo::agg_loss;
    use crate::config::{LossAggMode, OptimConfig};
    use crate::model::{Arch, ModelArgs};
    use crate::testing::tiny_model;
    use crate::trainer::actor::response_logprobs;

    /// Four rows whose responses hold 1, 3, 2 and 5 tokens (prompts of various lengths).
    fn batch() -> StepBatch {
        StepBatch::new(
            vec![vec![1, 2], vec![3], vec![4, 5, 6], vec![7]],
            vec![
                vec![8],
                vec![9, 10, 11],
                vec![12, 13],
                vec![14, 15, 16, 17, 18],
            ],
            vec![0, 1, 2, 3],
            vec![0, 1, 2, 3],
            vec![false; 4],
        )
    }

    fn plan(global_norm: bool, mini: usize, micro: usize, epochs: usize) -> UpdatePlan {
        UpdatePlan {
            mini_batch_prompts: mini,
            mini_batch_responses: mini,
            mini_batches_per_epoch: 4 / mini,
            micro: MicroBatching::Sequences(micro),
            grad_accum: Some(mini / micro),
            epochs,
            loss_agg_mode: LossAggMode::TokenMean,
            shuffle: false,
            grad_clip: 1e9,
            global_norm,
        }
    }

    /// Micro-batches padded to their longest prompt and response.
    const PADDED: crate::trainer::micro::Layout = crate::trainer::micro::Layout {
        pad_id: 0,
        packed: false,
        share_prefixes: false,
        image_token: None,
    };

    fn settings(plan: UpdatePlan) -> UpdateSettings {
        UpdateSettings {
            prefix: "actor",
            plan,
            seed: 0,
            loss_scale_factor: Some(5.0),
            inputs: PADDED,
            shard: (0, 1),
        }
    }

    /// The test loss: token-mean of −log p over the micro-batch's response tokens, reported as
    /// `actor/pg_loss`, with the micro-batch's row count as a listed (averaged) scalar.
    fn nll(
        model: &CausalLm,
        mi: &MicroInputs,
        rows: &[usize],
        ctx: MicroCtx,
    ) -> candle_core::Result<MicroLoss> {
        let (lp, _) = response_logprobs(model, mi, 1.0, false)?; // [m, r]
        let mask = mi.response_mask.to_dtype(lp.dtype())?;
        let loss = agg_loss(&lp.neg()?, &mask, LossAggMode::TokenMean, ctx.norm)?;
        Ok(MicroLoss {
            extra: Default::default(),
            scalars: vec![
                ("actor/pg_loss", scalar(&loss)?),
                ("actor/rows", rows.len() as f64),
            ],
            loss,
        })
    }

    use crate::model::CausalLm;

    fn model() -> (candle_nn::VarMap, CausalLm, Vec<(String, Var)>) {
        let args = ModelArgs::tiny(Arch::Llama, 32);
        let (vm, m) = tiny_model(&args, DType::F64, 0.3);
        let mut vars: Vec<(String, Var)> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        (vm, m, vars)
    }

    /// Each row alone: Σ_t −log p (its token sum) and that sum's gradient per variable.
    fn per_row(m: &CausalLm, vars: &[(String, Var)], b: &StepBatch) -> Vec<(f64, Vec<Vec<f64>>)> {
        (0..b.len())
            .map(|r| {
                let mi = b.inputs(&[r], PADDED, &Device::Cpu).unwrap();
                let (lp, _) = response_logprobs(m, &mi, 1.0, false).unwrap();
                let mask = mi.response_mask.to_dtype(lp.dtype()).unwrap();
                let s = (lp.neg().unwrap() * mask).unwrap().sum_all().unwrap();
                let g = s.backward().unwrap();
                (scalar(&s).unwrap(), flat_grads(&g, vars))
            })
            .collect()
    }

    /// Σ_r w_r g_r over the rows' gradients.
    /// Each variable's gradient in `g`, flattened (f64 model).
    fn flat_grads(g: &GradStore, vars: &[(String, Var)]) -> Vec<Vec<f64>> {
        vars.iter()
            .map(|(_, v)| {
                g.get(v.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            })
            .collect()
    }

    fn combine(rows: &[(f64, Vec<Vec<f64>>)], w: &[f64]) -> Vec<Vec<f64>> {
        let mut out: Vec<Vec<f64>> = rows[0].1.iter().map(|g| vec![0.0; g.len()]).collect();
        for ((_, g), &w) in rows.iter().zip(w) {
            for (o, gv) in out.iter_mut().zip(g) {
                for (a, b) in o.iter_mut().zip(gv) {
                    *a += w * b;
                }
            }
        }
        out
    }

    fn max_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// Mini-batch 4, micro-batch 2, token-mean, responses of 1, 3, 2, 5 tokens: micro-batches
    /// {0, 1} (4 tokens) and {2, 3} (7 tokens). By hand, with S_r the row's −log p token sum:
    /// - verl's default workers: ½·(S0 + S1)/4 + ½·(S2 + S3)/7, so the row weights are
    ///   1/8, 1/8, 1/14, 1/14;
    /// - `use_legacy_worker_impl=disable`: (S0 + S1 + S2 + S3)/11, weights 1/11 each.
    ///
    /// The reference gradients are those of each row's S_r alone (separate forward passes),
    /// weighted by hand; the update's accumulated gradient must equal them.
    #[test]
    fn micro_batch_gradients_follow_verls_two_paths() {
        let (_vm, m, vars) = model();
        let b = batch();
        let rows = per_row(&m, &vars, &b);
        for (global, w) in [
            (false, [1.0 / 8.0, 1.0 / 8.0, 1.0 / 14.0, 1.0 / 14.0]),
            (true, [1.0 / 11.0; 4]),
        ] {
            let s = settings(plan(global, 4, 2, 1));
            let ctx = MicroCtx {
                norm: mini_batch_norm(&b, &[0, 1, 2, 3], &s.plan, s.loss_scale_factor),
                on_policy: false,
            };
            let mut scalars = UpdateScalars::default();
            let g = mini_batch_grads(
                &m,
                &vars,
                (&b, &[0, 1, 2, 3]),
                &s,
                ctx,
                &mut scalars,
                &mut nll,
            )
            .unwrap()
            .unwrap();
            let got = flat_grads(&g, &vars);
            let want = combine(&rows, &w);
            let scale = want.iter().flatten().map(|x| x.abs()).fold(0.0, f64::max);
            let d = max_diff(&got, &want);
            assert!(d < 1e-9 * scale.max(1.0), "global={global}: {d}");
            // The loss metric: Σ micro loss × scale, the same weighted sum of the S_r.
            let loss: f64 = rows.iter().zip(&w).map(|((s, _), w)| s * w).sum();
            let got = scalars.totals["actor/pg_loss"];
            assert!(
                (got - loss).abs() < 1e-9,
                "global={global}: {got} vs {loss}"
            );
            assert_eq!(scalars.lists["actor/rows"], vec![2.0, 2.0]);
        }
        // The two paths really differ here (unequal token counts per micro-batch).
        let a = combine(&rows, &[1.0 / 8.0, 1.0 / 8.0, 1.0 / 14.0, 1.0 / 14.0]);
        let c = combine(&rows, &[1.0 / 11.0; 4]);
        assert!(max_diff(&a, &c) > 1e-4);
    }

    /// use_dynamic_bsz: a micro-batch of k rows scales its loss by k / mini-batch rows; fixed
    /// micro-batches by 1 / gradient_accumulation; the global path not at all.
    #[test]
    fn micro_scale_is_verls_loss_scale_factor() {
        let mut p = plan(false, 4, 2, 1);
        assert_eq!(micro_scale(&p, 2), 0.5);
        p.micro = MicroBatching::TokenBudget(100);
        p.grad_accum = None;
        assert_eq!(micro_scale(&p, 3), 0.75);
        assert_eq!(micro_scale(&p, 1), 0.25);
        p.global_norm = true;
        assert_eq!(micro_scale(&p, 3), 1.0);
    }

    /// Loss metrics add up over micro-batches, mini-batches and epochs (verl's
    /// `metrics["actor/pg_loss"] += pg_loss × loss_scale_factor`); others are averaged. Two
    /// epochs of two mini-batches of two one-row micro-batches with learning rate 0 (the model
    /// does not change): each micro-batch's loss is S_r / l_r, scaled by ½, so the metric is
    /// 2 epochs × ½ × Σ_r S_r / l_r = Σ_r S_r / l_r.
    #[test]
    fn loss_metrics_sum_over_mini_batches_and_epochs() {
        let (vm, m, vars) = model();
        let b = batch();
        let rows = per_row(&m, &vars, &b);
        let lens = [1.0, 3.0, 2.0, 5.0];
        let want: f64 = rows.iter().zip(lens).map(|((s, _), l)| s / l).sum();
        let optim = OptimConfig {
            lr: 0.0,
            weight_decay: 0.0,
            ..OptimConfig::default()
        };
        let args = ModelArgs::tiny(Arch::Llama, 32);
        let mut t = Trainable::new(
            m,
            vm,
            None,
            args,
            &optim,
            10,
            settings(plan(false, 2, 1, 2)),
        )
        .unwrap();
        let got = t.update(&b, 1, nll).unwrap();
        assert!(
            (got["actor/pg_loss"] - want).abs() < 1e-9,
            "{} vs {want}",
            got["actor/pg_loss"]
        );
        assert_eq!(got["actor/rows"], 1.0);
    }
}
