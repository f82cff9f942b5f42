//! The PPO update schedule of a [`Trainable`], shared by actor and critic (verl's `update_policy` /
//! `update_critic` loops): `ppo_epochs` passes over the step's rows, each cut into mini-batches
//! (one optimizer step each) and micro-batches (one forward/backward each, gradients summed).
//! Loss normalisers are those of the whole mini-batch, so the summed micro-batch gradients are
//! exactly the mini-batch loss's gradient whatever the micro-batch size.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::batch::{MicroInputs, StepBatch};
use super::optim::clip_grad_norm;
use super::trainable::{Network, Trainable};
use crate::algo::AggNorm;
use crate::metrics::{mean, Metrics};
use crate::util::permutation;

/// What one micro-batch's loss reports: the loss to backpropagate and named scalars
/// (summed over a mini-batch's micro-batches when `summed`, else averaged).
pub struct MicroLoss {
    pub loss: Tensor,
    pub scalars: Vec<(&'static str, f64)>,
}

/// Metric keys whose micro-batch values add up to the mini-batch value (losses computed with
/// the mini-batch's normalisers); the others are averaged.
fn summed(key: &str) -> bool {
    key.ends_with("loss")
}

impl<N: Network> Trainable<N> {
    /// One PPO update over the step's rows; returns `{prefix}/*` metrics. `micro_loss(model,
    /// inputs, rows, norm)` builds one micro-batch's loss from the model with gradients.
    pub fn update(
        &mut self,
        batch: &StepBatch,
        step: u64,
        mut micro_loss: impl FnMut(
            &N,
            &MicroInputs,
            &[usize],
            AggNorm,
        ) -> candle_core::Result<MicroLoss>,
    ) -> candle_core::Result<Metrics> {
        let lr = self.schedule.lr(self.updates);
        let s = &self.settings;
        let (plan, prefix) = (&s.plan, s.prefix);
        let device = self.model.device().clone();
        let optimizer = &mut self.optimizer;
        let model = &self.model;
        let rows = batch.len();
        let mut lists: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut skipped = 0usize;
        for epoch in 0..plan.epochs {
            let order: Vec<usize> = if plan.shuffle {
                // A fresh, reproducible order per (step, epoch): resuming needs no RNG state.
                permutation(
                    rows,
                    s.seed,
                    step.wrapping_mul(1_000_003).wrapping_add(epoch as u64),
                )
            } else {
                (0..rows).collect()
            };
            for mini in order.chunks(plan.mini_batch_responses.max(1)) {
                let tokens: usize = mini.iter().map(|&r| batch.mask_len(r)).sum();
                if tokens == 0 {
                    continue;
                }
                let seqs = mini.iter().filter(|&&r| batch.mask_len(r) > 0).count();
                let norm = AggNorm {
                    batch_num_tokens: Some(tokens as f64),
                    global_batch_size: Some(seqs as f64),
                    loss_scale_factor: s.loss_scale_factor,
                };
                // Only the parameters' gradients are kept: `backward()` also returns gradients
                // for constant inputs of the graph (masks, rotary tables, ...), which would
                // otherwise pile up across micro-batches (measured: +2.3 GB per SmolLM2
                // micro-batch).
                let mut grads = GradStore::default();
                let mut any = false;
                let mut sums: BTreeMap<&'static str, Vec<f64>> = BTreeMap::new();
                for micro in batch.micro_batches(mini, plan.micro) {
                    let mi = batch.inputs(&micro, s.pad_id, &device)?;
                    let out = micro_loss(model, &mi, &micro, norm)?;
                    let mut g = out.loss.backward()?;
                    drop(out.loss);
                    for (_, var) in optimizer.vars() {
                        if let Some(t) = g.remove(var.as_tensor()) {
                            let sum = match grads.remove(var.as_tensor()) {
                                Some(acc) => (acc + t)?,
                                None => t,
                            };
                            grads.insert(var.as_tensor(), sum);
                        }
                    }
                    drop(g);
                    any = true;
                    tracing::debug!(
                        "{prefix}: micro-batch of {} rows: resident {:.2} GB after backward",
                        micro.len(),
                        crate::metrics::rss_bytes().unwrap_or(0) as f64 / (1u64 << 30) as f64
                    );
                    for (k, v) in out.scalars {
                        sums.entry(k).or_default().push(v);
                    }
                }
                if !any {
                    continue;
                }
                for (k, vs) in sums {
                    let v = if summed(k) {
                        vs.iter().sum()
                    } else {
                        mean(&vs)
                    };
                    lists.entry(k.to_string()).or_default().push(v);
                }
                // `grads` is this process's mini-batch gradient: data parallelism would
                // all-reduce it here, before clipping.
                let norm = clip_grad_norm(optimizer.vars(), &mut grads, plan.grad_clip)?;
                lists
                    .entry(format!("{prefix}/grad_norm"))
                    .or_default()
                    .push(norm);
                if norm.is_finite() {
                    optimizer.step(&grads, lr)?;
                } else {
                    skipped += 1;
                    tracing::warn!(
                        "{prefix}: gradient norm is {norm} at step {step}; this mini-batch's update is skipped"
                    );
                }
            }
        }
        let mut m: Metrics = lists.into_iter().map(|(k, v)| (k, mean(&v))).collect();
        m.insert(format!("{prefix}/lr"), lr);
        if skipped > 0 {
            m.insert(format!("{prefix}/skipped_updates"), skipped as f64);
        }
        self.updates += 1;
        Ok(m)
    }
}
