//! What the actor and the critic share (verl's FSDP worker around one module): the model with
//! gradients, the same weights without autograd, its variables, optimizer and LR schedule, the
//! no-grad forward over a step's rows, the PPO update schedule (in `update.rs`) and
//! checkpoint save/load. The actor and the critic supply only their outputs and their loss.
//!
//! Seams for what comes next: the optimizer sees the variables [`trainable_variables`]
//! returns (adapters would narrow it), and the update sums each mini-batch's gradients in one
//! place (`update.rs`), where data parallelism would all-reduce them.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;

use super::batch::{scatter_rows, MicroInputs, Ragged, StepBatch};
use super::optim::{AdamW, LrSchedule};
use super::{Result, TrainerError};
use crate::config::{MicroBatching, OptimConfig, UpdatePlan};
use crate::data::TokenizerBundle;
use crate::model::{hf, CausalLm, ModelArgs, ValueHead};

/// A network a [`Trainable`] can hold: it gives a view of its weights without autograd.
pub trait Network: Sized {
    /// The same weights, detached (inference: no activations kept for a backward pass).
    fn no_grad(&self) -> Self;
    fn device(&self) -> &Device;
}

impl Network for CausalLm {
    fn no_grad(&self) -> Self {
        CausalLm::no_grad(self)
    }
    fn device(&self) -> &Device {
        CausalLm::device(self)
    }
}

/// The critic's network: a transformer backbone and a value head (one value per token).
pub struct ValueModel {
    pub backbone: CausalLm,
    pub head: ValueHead,
}

impl Network for ValueModel {
    fn no_grad(&self) -> Self {
        Self {
            backbone: self.backbone.no_grad(),
            head: self.head.no_grad(),
        }
    }
    fn device(&self) -> &Device {
        self.backbone.device()
    }
}

/// The variables the optimizer updates: every variable of the model.
pub fn trainable_variables(varmap: &VarMap) -> HashMap<String, Var> {
    varmap.data().lock().expect("varmap lock").clone()
}

/// How a [`Trainable`]'s updates run.
#[derive(Debug, Clone)]
pub struct UpdateSettings {
    /// `actor` or `critic`: the prefix of its metrics (`actor/grad_norm`, `critic/lr`).
    pub prefix: &'static str,
    pub plan: UpdatePlan,
    /// Seed of the mini-batch shuffles (`data_loader_seed`).
    pub seed: u64,
    /// Divisor of seq-mean-token-sum-norm (`loss_scale_factor`, else the response length).
    pub loss_scale_factor: Option<f64>,
    pub pad_id: u32,
}

/// A model being trained.
pub struct Trainable<N> {
    /// Trainable weights (gradients flow).
    pub model: N,
    /// The same weights without autograd: generation, log-probs and values see every update.
    view: N,
    pub varmap: VarMap,
    pub args: ModelArgs,
    pub optimizer: AdamW,
    pub schedule: LrSchedule,
    /// Training steps that updated the model (the LR scheduler's position).
    pub updates: u64,
    pub(super) settings: UpdateSettings,
}

impl<N: Network> Trainable<N> {
    pub fn new(
        model: N,
        varmap: VarMap,
        args: ModelArgs,
        optim: &OptimConfig,
        total_steps: u64,
        settings: UpdateSettings,
    ) -> Self {
        let vars = trainable_variables(&varmap);
        Self {
            view: model.no_grad(),
            model,
            varmap,
            args,
            optimizer: AdamW::new(vars, optim),
            schedule: LrSchedule::new(optim, total_steps),
            updates: 0,
            settings,
        }
    }

    /// The weights without autograd.
    pub fn view(&self) -> &N {
        &self.view
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// `outputs` per-token values of every row from the no-grad view (see [`forward_rows`]).
    pub fn forward_rows(
        &self,
        batch: &StepBatch,
        micro: MicroBatching,
        outputs: usize,
        f: impl Fn(&N, &MicroInputs) -> candle_core::Result<Vec<Tensor>>,
    ) -> candle_core::Result<Vec<Ragged>> {
        forward_rows(&self.view, batch, micro, self.settings.pad_id, outputs, f)
    }

    /// Writes `dir/huggingface/` (weights, config, tokenizer) and the optimizer state in `dir`.
    pub fn save(&self, dir: &Path, tokenizer: &TokenizerBundle) -> Result<()> {
        let hf_dir = dir.join("huggingface");
        hf::save_dir(
            &self.varmap,
            &self.args,
            &hf_dir,
            &tokenizer.eos_token_ids,
            None,
            None,
        )?;
        tokenizer.save(&hf_dir)?;
        self.optimizer.save(dir)?;
        Ok(())
    }

    /// Restores what [`Trainable::save`] wrote, and the number of updates made so far.
    pub fn load(&mut self, dir: &Path, updates: u64) -> Result<()> {
        let hf_dir = dir.join("huggingface");
        hf::assign(&self.varmap, &hf::read_weights(&hf_dir)?, &hf_dir)?;
        self.optimizer.load(dir).map_err(TrainerError::from)?;
        self.updates = updates;
        Ok(())
    }
}

/// Runs `f` over every row of `batch` without gradients, micro-batch by micro-batch, and
/// returns its `outputs` tensors (`[m, r]` each) as per-row values trimmed to each response.
pub fn forward_rows<N: Network>(
    model: &N,
    batch: &StepBatch,
    micro: MicroBatching,
    pad_id: u32,
    outputs: usize,
    f: impl Fn(&N, &MicroInputs) -> candle_core::Result<Vec<Tensor>>,
) -> candle_core::Result<Vec<Ragged>> {
    let n = batch.len();
    let lens = batch.response_lens();
    let mut out: Vec<Ragged> = vec![vec![Vec::new(); n]; outputs];
    let rows: Vec<usize> = (0..n).collect();
    for mb in batch.micro_batches(&rows, micro) {
        let mi = batch.inputs(&mb, pad_id, model.device())?;
        for (dst, t) in out.iter_mut().zip(f(model, &mi)?) {
            scatter_rows(&t, &mb, &lens, dst)?;
        }
    }
    Ok(out)
}
