//! The critic: a transformer backbone with a value head (one value per token, HF
//! `*ForTokenClassification` with one label), its value predictions and its clipped value-loss
//! update (verl's `DataParallelPPOCritic.compute_values` / `update_critic`).

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rand::{Rng, SeedableRng};

use super::batch::{pad_rows, scatter_rows, MicroInputs, Ragged, StepBatch};
use super::optim::{AdamW, LrSchedule};
use super::update::{self, MicroLoss};
use crate::algo::{masked_mean, value_loss, AggNorm};
use crate::config::{CriticConfig, MicroBatching, UpdatePlan};
use crate::metrics::Metrics;
use crate::model::{CausalLm, ModelArgs, ValueHead};

pub struct Critic {
    pub backbone: CausalLm,
    pub head: ValueHead,
    pub varmap: VarMap,
    pub args: ModelArgs,
    view: (CausalLm, ValueHead),
    pub optimizer: AdamW,
    pub schedule: LrSchedule,
    pub updates: u64,
    cfg: CriticConfig,
    plan: UpdatePlan,
    response_length: usize,
    pad_id: u32,
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
fn values(backbone: &CausalLm, head: &ValueHead, mi: &MicroInputs) -> candle_core::Result<Tensor> {
    let hidden = backbone.forward_hidden(&mi.input_ids, &mi.position_ids, &mi.key_mask, None)?; // [m, p + r − 1, h]
    head.forward(&mi.response_hidden(&hidden)?)?
        .to_dtype(DType::F32) // [m, r]
}

/// What the value loss needs per row: `[rows][response_len]` each.
pub struct ValueData<'a> {
    pub values: &'a Ragged,
    pub returns: &'a Ragged,
}

impl Critic {
    /// A critic over `backbone` (its variables in `varmap`), adding a value head initialised
    /// from `seed` (N(0, 0.02²) weight, zero bias) unless `varmap` already holds one.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backbone: CausalLm,
        varmap: VarMap,
        cfg: &CriticConfig,
        plan: &UpdatePlan,
        total_steps: u64,
        response_length: usize,
        pad_id: u32,
        seed: u64,
    ) -> candle_core::Result<Self> {
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
            let w = Tensor::from_vec(seeded_normal(hidden, 0.02, seed), (1, hidden), &Device::Cpu)?;
            vars["score.weight"].set(&w.to_dtype(dtype)?.to_device(&device)?)?;
        }
        let vars = varmap.data().lock().expect("varmap lock").clone();
        Ok(Self {
            view: (backbone.no_grad(), head.no_grad()),
            args: backbone.args.clone(),
            backbone,
            head,
            varmap,
            optimizer: AdamW::new(vars, &cfg.optim),
            schedule: LrSchedule::new(&cfg.optim, total_steps),
            updates: 0,
            cfg: cfg.clone(),
            plan: plan.clone(),
            response_length,
            pad_id,
        })
    }

    /// Values of every row's response positions, without gradients.
    pub fn compute_values(
        &self,
        batch: &StepBatch,
        micro: MicroBatching,
    ) -> candle_core::Result<Ragged> {
        let n = batch.len();
        let lens: Vec<usize> = (0..n).map(|r| batch.response_len(r)).collect();
        let mut out: Ragged = vec![Vec::new(); n];
        let rows: Vec<usize> = (0..n).collect();
        for mb in batch.micro_batches(&rows, micro) {
            let mi = batch.inputs(&mb, self.pad_id, self.backbone.device())?;
            let v = values(&self.view.0, &self.view.1, &mi)?;
            scatter_rows(&v, &mb, &lens, &mut out)?;
        }
        Ok(out)
    }

    /// One clipped value-loss update; returns `critic/*` metrics.
    pub fn update(
        &mut self,
        batch: &StepBatch,
        data: &ValueData,
        step: u64,
    ) -> candle_core::Result<Metrics> {
        let lr = self.schedule.lr(self.updates);
        let device = self.backbone.device().clone();
        let (backbone, head) = (&self.backbone, &self.head);
        let cliprange = self.cfg.cliprange_value;
        let mode = self.plan.loss_agg_mode;
        let pad_id = self.pad_id;
        let scale = self
            .cfg
            .loss_scale_factor
            .or(Some(self.response_length as f64));
        let m = update::run(
            "critic",
            &self.plan,
            batch,
            self.cfg.data_loader_seed,
            step,
            scale,
            &mut self.optimizer,
            lr,
            |rows: &[usize], norm: AggNorm| {
                let mi = batch.inputs(rows, pad_id, &device)?;
                let vpreds = values(backbone, head, &mi)?;
                let r = mi.response_width;
                let old = pad_rows(data.values, rows, r, &device)?;
                let ret = pad_rows(data.returns, rows, r, &device)?;
                let mask = &mi.response_mask;
                let (loss, clipfrac) =
                    value_loss(&vpreds, &ret, &old, mask, cliprange, mode, norm)?;
                let vpred_mean = crate::algo::agg::scalar(&masked_mean(&vpreds.detach(), mask)?)?;
                Ok(MicroLoss {
                    scalars: vec![
                        ("critic/vf_loss", crate::algo::agg::scalar(&loss)?),
                        ("critic/vf_clipfrac", clipfrac),
                        ("critic/vpred_mean", vpred_mean),
                    ],
                    loss,
                })
            },
        )?;
        self.updates += 1;
        Ok(m)
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
