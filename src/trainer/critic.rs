//! The critic: a transformer backbone with a value head (one value per token, HF
//! `*ForTokenClassification` with one label), its value predictions and its clipped value-loss
//! update (verl's `DataParallelPPOCritic.compute_values` / `update_critic`).

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use rand::{Rng, SeedableRng};

use super::batch::{pad_rows, Column, StepBatch};
use super::micro::{Layout, MicroInputs};
use super::trainable::{assign_heads, LoraState, Network, Trainable, UpdateSettings, ValueModel};
use super::update::MicroLoss;
use crate::algo::agg::scalar;
use crate::algo::{masked_mean, value_loss};
use crate::config::critic::ValueHeadInit;
use crate::config::{CriticConfig, MicroBatching, Plan};
use crate::metrics::Metrics;
use crate::model::ValueHead;
use crate::weights::hf::Loaded;

pub struct Critic {
    pub trainable: Trainable<ValueModel>,
    cliprange_value: f64,
    /// Forward passes of the value computation.
    forward_micro: MicroBatching,
}

/// `n` draws of N(0, std²) from a seeded ChaCha stream (Box–Muller), so a run's initial value
/// head is the same every time for the same `trainer.seed`.
fn seeded_normal(n: usize, std: f64, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
            let u2: f64 = rng.random::<f64>();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * std) as f32
        })
        .collect()
}

/// Values of a micro-batch's response positions: `[m, r]` f32.
fn values(model: &ValueModel, mi: &MicroInputs) -> candle_core::Result<Tensor> {
    let v = model.head.forward(&mi.response_hidden(&model.backbone)?)?; // [m, r] or [1, k]
    mi.to_rows(&v)?.to_dtype(DType::F32)
}

impl Critic {
    /// The critic of a run over the `loaded` backbone, adding a value head initialised from
    /// `plan.seeds.value_head` (N(0, 0.02²) weight, zero bias) unless the weights already hold one.
    pub fn new(
        loaded: Loaded,
        cfg: &CriticConfig,
        plan: &Plan,
        total_steps: u64,
        inputs: Layout,
        mut lora: Option<LoraState>,
    ) -> candle_core::Result<Self> {
        let seed = plan.seeds.value_head;
        let (backbone, varmap) = (loaded.model, loaded.varmap);
        let (dtype, device) = (backbone.dtype(), backbone.device().clone());
        let hidden = backbone.args.hidden_size;
        let fresh = !varmap
            .data()
            .lock()
            .expect("varmap lock")
            .contains_key("score.weight");
        let head = ValueHead::new(hidden, VarBuilder::from_varmap(&varmap, dtype, &device))?;
        if fresh {
            let vars = varmap.data().lock().expect("varmap lock").clone();
            let w = match cfg.value_head_init {
                ValueHeadInit::Normal => seeded_normal(hidden, 0.02, seed),
                ValueHeadInit::Zero => vec![0.0; hidden],
            };
            let w = Tensor::from_vec(w, (1, hidden), &Device::Cpu)?;
            vars["score.weight"].set(&w.to_dtype(dtype)?.to_device(&device)?)?;
        }
        // A critic adapter saved with its value head (PEFT's modules_to_save) restores it too
        // (from the tensors `setup::attach_lora` kept of its one read of the folder).
        if let Some(l) = lora.as_mut() {
            let saved = std::mem::take(&mut l.saved_modules);
            if let (Some(dir), true) = (
                &l.source,
                saved.contains_key("base_model.model.score.weight"),
            ) {
                let msg = |e: crate::model::ModelError| candle_core::Error::Msg(e.to_string());
                assign_heads(&varmap, &saved, dir).map_err(msg)?;
            }
        }
        let (Some(update_plan), Some(forward_micro)) = (&plan.critic, plan.critic_forward_micro)
        else {
            return Err(candle_core::Error::Msg(
                "the resolved configuration plans no critic".into(),
            ));
        };
        let settings = UpdateSettings {
            prefix: "critic",
            plan: update_plan.clone(),
            seed: plan.seeds.critic,
            loss_scale_factor: UpdateSettings::loss_scale_factor(
                update_plan,
                cfg.loss_scale_factor,
                plan.response_length,
            ),
            inputs,
            shard: (0, 1),
        };
        let args = backbone.args.clone();
        Ok(Self {
            trainable: Trainable::new(
                ValueModel { backbone, head },
                varmap,
                lora,
                args,
                &cfg.optim,
                total_steps,
                settings,
            )?,
            cliprange_value: cfg.cliprange_value,
            forward_micro,
        })
    }

    /// The `values` phase: fills `values` (verl's `compute_values`).
    pub fn compute_values(&self, batch: &mut StepBatch) -> candle_core::Result<()> {
        let mut out = self
            .trainable
            .forward_rows(batch, self.forward_micro, 1, |m, mi| {
                Ok(vec![values(m, mi)?])
            })?;
        batch.set(Column::Values, out.pop().unwrap_or_default())
    }

    /// One clipped value-loss update (verl's `update_critic`); returns `critic/*` metrics.
    pub fn update(&mut self, batch: &StepBatch, step: u64) -> candle_core::Result<Metrics> {
        let cliprange = self.cliprange_value;
        let mode = self.trainable.settings.plan.loss_agg_mode;
        let old_values = batch.column(Column::Values)?;
        let returns = batch.column(Column::Returns)?;
        self.trainable.update(batch, step, |model, mi, rows, ctx| {
            let norm = ctx.norm;
            let device = model.device();
            let vpreds = values(model, mi)?;
            let r = mi.response_width;
            let old = pad_rows(old_values, rows, r, device)?;
            let ret = pad_rows(returns, rows, r, device)?;
            let mask = &mi.response_mask;
            let (loss, clipfrac) = value_loss(&vpreds, &ret, &old, mask, cliprange, mode, norm)?;
            let vpred_mean = scalar(&masked_mean(&vpreds.detach(), mask)?)?;
            Ok(MicroLoss {
                extra: Default::default(),
                scalars: vec![
                    ("critic/vf_loss", scalar(&loss)?),
                    ("critic/vf_clipfrac", clipfrac),
                    ("critic/vpred_mean", vpred_mean),
                ],
                loss,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_normal_is_reproducible_and_has_the_right_spread() {
        let a = seeded_normal(20_000, 0.02, 7);
        assert_eq!(a, seeded_normal(20_000, 0.02, 7));
        assert_ne!(a, seeded_normal(20_000, 0.02, 8));
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        // Sample moments of 20k draws: |mean| < 4σ/√n, std within 3 %.
        assert!(mean.abs() < 4.0 * 0.02 / n.sqrt(), "{mean}");
        assert!((var.sqrt() / 0.02 - 1.0).abs() < 0.03, "{}", var.sqrt());
    }
}
