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

use super::batch::{scatter_rows, Ragged, StepBatch};
use super::micro::{Layout, MicroInputs};
use super::optim::{AdamW, LrSchedule};
use super::{Result, TrainerError};
use crate::config::{MicroBatching, OptimConfig, UpdatePlan};
use crate::data::TokenizerBundle;
use crate::dist::Comm;
use crate::model::{CausalLm, ModelArgs, ValueHead};
use crate::weights::hf;
use crate::weights::peft::{self, LoraSpec};

/// A network a [`Trainable`] can hold: it gives a view of its weights without autograd.
pub trait Network: Sized {
    /// The same weights, detached (inference: no activations kept for a backward pass).
    fn no_grad(&self) -> Self;
    fn device(&self) -> &Device;
    /// Whether packed sequences (`use_remove_padding`) save work here (see
    /// [`CausalLm::packs_without_padding`]); padded otherwise.
    fn packs_without_padding(&self) -> bool;
    /// Whether a group's shared prompt is computed once here (see
    /// [`CausalLm::shares_prefixes`]).
    fn shares_prefixes(&self) -> bool;
    /// Puts the adapter-dropout mask stream at `position` (see
    /// [`CausalLm::set_dropout_position`]); nothing without adapter dropout.
    fn set_dropout_position(&self, position: u64);
}

impl Network for CausalLm {
    fn no_grad(&self) -> Self {
        CausalLm::no_grad(self)
    }
    fn device(&self) -> &Device {
        CausalLm::device(self)
    }
    fn packs_without_padding(&self) -> bool {
        CausalLm::packs_without_padding(self)
    }
    fn shares_prefixes(&self) -> bool {
        CausalLm::shares_prefixes(self)
    }
    fn set_dropout_position(&self, position: u64) {
        CausalLm::set_dropout_position(self, position)
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
    fn packs_without_padding(&self) -> bool {
        self.backbone.packs_without_padding()
    }
    fn shares_prefixes(&self) -> bool {
        self.backbone.shares_prefixes()
    }
    fn set_dropout_position(&self, position: u64) {
        self.backbone.set_dropout_position(position)
    }
}

/// A model's LoRA adapters (see [`crate::weights::peft`]): what was added, and where from.
pub struct LoraState {
    pub spec: LoraSpec,
    /// The adapter variables, named as PEFT saves them.
    pub adapters: VarMap,
    /// Module names that carry an adapter.
    pub adapted: Vec<String>,
    /// `base_model_name_or_path` of the saved adapter config.
    pub base_model: String,
    /// PEFT's task type: `CAUSAL_LM` (actor) or `TOKEN_CLS` (critic).
    pub task_type: &'static str,
    /// The adapter folder it started from (`lora_adapter_path`), if any.
    pub source: Option<std::path::PathBuf>,
    /// That folder's heads saved whole (PEFT's `modules_to_save` outside the backbone,
    /// `base_model.model.score.*`: the critic's value head), kept from its one read for
    /// `Critic::new`; empty otherwise.
    pub saved_modules: HashMap<String, Tensor>,
}

/// Whether a variable of the model's own map belongs to the transformer or its vision tower
/// (frozen under LoRA) rather than a head (the critic's value head `score.*` stays fully trainable).
pub(super) fn is_backbone(name: &str) -> bool {
    name.starts_with("model.")
        || name.starts_with("lm_head.")
        || name.starts_with(crate::model::config::VISUAL)
}

/// The variables the optimizer updates: every variable of the model but MiMo's
/// multi-token-prediction layers (`model.mtp_layers.*`: kept as read and saved back, since
/// main_ppo does not train them with verl's MTP loss, and no other loss reaches them),
/// DeepSeek-V3's score-correction biases (not parameters in transformers either) and its own
/// multi-token-prediction layers (`ModelArgs::kept_as_read`); with
/// LoRA only the adapters and the heads (the frozen base keeps no gradient and no optimizer
/// state).
pub fn trainable_variables(
    varmap: &VarMap,
    lora: Option<&LoraState>,
    args: &ModelArgs,
) -> HashMap<String, Var> {
    let mut all = varmap.data().lock().expect("varmap lock").clone();
    all.retain(|k, _| !args.kept_as_read(k));
    match lora {
        None => all,
        Some(l) => {
            let mut vars: HashMap<String, Var> =
                all.into_iter().filter(|(k, _)| !is_backbone(k)).collect();
            vars.extend(l.adapters.data().lock().expect("varmap lock").clone());
            vars
        }
    }
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
    /// Padding id, and sequences packed end to end where the model supports it
    /// (`model.use_remove_padding`).
    pub inputs: Layout,
    /// (rank, world size): which micro-batches of each mini-batch this process computes.
    pub shard: (usize, usize),
}

impl UpdateSettings {
    /// How micro-batches reach `model`: packed when asked for and supported.
    pub fn layout<N: Network>(&self, model: &N) -> Layout {
        self.inputs
            .given(model.packs_without_padding(), model.shares_prefixes())
    }

    /// The divisor of seq-mean-token-sum-norm for an update with `plan`: verl's default workers
    /// never pass `loss_scale_factor` to agg_loss (the response length divides); the global
    /// path (`trainer.use_legacy_worker_impl=disable`) honours `configured`.
    pub fn loss_scale_factor(
        plan: &UpdatePlan,
        configured: Option<f64>,
        response_length: usize,
    ) -> Option<f64> {
        let width = response_length as f64;
        Some(if plan.global_norm {
            configured.unwrap_or(width)
        } else {
            width
        })
    }
}

/// A model being trained.
pub struct Trainable<N> {
    /// Trainable weights (gradients flow).
    pub model: N,
    /// The same weights without autograd: generation, log-probs and values see every update.
    view: N,
    pub varmap: VarMap,
    /// LoRA adapters (`model.lora_rank` > 0 or `model.lora_adapter_path`): only they (and heads) train.
    pub lora: Option<LoraState>,
    pub args: ModelArgs,
    pub optimizer: AdamW,
    pub schedule: LrSchedule,
    /// Training steps that updated the model (the LR scheduler's position).
    pub updates: u64,
    pub(super) settings: UpdateSettings,
    /// The data-parallel collectives (gradients are summed over ranks before clipping).
    pub(super) comm: Comm,
}

impl<N: Network> Trainable<N> {
    pub fn new(
        model: N,
        varmap: VarMap,
        lora: Option<LoraState>,
        args: ModelArgs,
        optim: &OptimConfig,
        total_steps: u64,
        settings: UpdateSettings,
    ) -> candle_core::Result<Self> {
        let vars = trainable_variables(&varmap, lora.as_ref(), &args);
        Ok(Self {
            view: model.no_grad(),
            model,
            varmap,
            lora,
            args,
            optimizer: AdamW::new(vars, optim)?,
            schedule: LrSchedule::new(optim, total_steps),
            updates: 0,
            settings,
            comm: crate::dist::single(),
        })
    }

    /// Trains as one of `comm`'s ranks: this process computes its share of each mini-batch's
    /// micro-batches and the gradients are summed over the ranks.
    pub fn set_comm(&mut self, comm: Comm) {
        self.settings.shard = (comm.rank(), comm.world_size());
        self.comm = comm;
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
        let layout = self.settings.layout(&self.view);
        forward_rows(&self.view, batch, micro, layout, outputs, f)
    }

    /// Writes `dir/huggingface/` (weights, config, tokenizer) and the optimizer state in `dir`.
    /// With LoRA the weights are the adapters alone, in PEFT's folder `dir/lora_adapter/`
    /// (heads such as the critic's `score` beside them, as PEFT's `modules_to_save`), and
    /// `huggingface/` holds the config and tokenizer: the frozen base is `model.path`.
    pub fn save(&self, dir: &Path, tokenizer: &TokenizerBundle) -> Result<()> {
        let hf_dir = dir.join("huggingface");
        match &self.lora {
            None => hf::save_dir(
                &self.varmap,
                &self.args,
                &hf_dir,
                &tokenizer.eos_token_ids,
                None,
                None,
            )?,
            Some(l) => {
                hf::save_dir(
                    &VarMap::new(),
                    &self.args,
                    &hf_dir,
                    &tokenizer.eos_token_ids,
                    None,
                    None,
                )?;
                // No weights file: an empty safetensors would read as a model without tensors.
                let _ = std::fs::remove_file(hf_dir.join("model.safetensors"));
                self.save_adapter(l, &dir.join("lora_adapter"))?;
            }
        }
        tokenizer.save(&hf_dir)?;
        self.optimizer.save(dir)?;
        Ok(())
    }

    /// PEFT's adapter folder of `l` (plus fully trained heads) in `dir`.
    fn save_adapter(&self, l: &LoraState, dir: &Path) -> Result<()> {
        let mut tensors = peft::adapter_tensors(&l.adapters);
        let mut heads = Vec::new();
        for (name, var) in self.varmap.data().lock().expect("varmap lock").iter() {
            if !is_backbone(name) {
                tensors.insert(format!("base_model.model.{name}"), var.as_tensor().clone());
                heads.push(name.split('.').next().unwrap_or(name).to_string());
            }
        }
        heads.sort();
        heads.dedup();
        let config = peft::adapter_config(
            &l.spec,
            &l.adapted,
            &l.base_model,
            l.task_type,
            (!heads.is_empty()).then_some(heads),
        );
        peft::save_adapter(dir, &config, &tensors)?;
        Ok(())
    }

    /// Restores what [`Trainable::save`] wrote, and the number of updates made so far.
    pub fn load(&mut self, dir: &Path, updates: u64) -> Result<()> {
        match &self.lora {
            None => {
                let hf_dir = dir.join("huggingface");
                hf::assign(&self.varmap, &hf::read_weights(&hf_dir)?, &hf_dir)?;
            }
            Some(l) => {
                let path = dir.join("lora_adapter");
                let file = peft::read_adapter(&path)?;
                peft::assign_adapter(&l.adapters, &file.tensors, &path)?;
                assign_heads(&self.varmap, &file.tensors, &path)?;
            }
        }
        self.optimizer.load(dir).map_err(TrainerError::from)?;
        self.updates = updates;
        Ok(())
    }
}

/// Sets the head variables of `varmap` (not the frozen backbone) from an adapter file's
/// `base_model.model.<name>` tensors (PEFT's `modules_to_save`); a head missing from the file
/// is an error naming it.
pub fn assign_heads(
    varmap: &VarMap,
    tensors: &HashMap<String, Tensor>,
    source: &Path,
) -> std::result::Result<(), crate::model::ModelError> {
    let heads: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .expect("varmap lock")
        .keys()
        .filter(|k| !is_backbone(k))
        .filter_map(|k| {
            tensors
                .get(&format!("base_model.model.{k}"))
                .map(|t| (k.clone(), t.clone()))
        })
        .collect();
    let sub = VarMap::new();
    {
        let data = varmap.data().lock().expect("varmap lock");
        let mut s = sub.data().lock().expect("varmap lock");
        for (k, v) in data.iter().filter(|(k, _)| !is_backbone(k)) {
            s.insert(k.clone(), v.clone());
        }
    }
    hf::assign(&sub, &heads, source)
}

/// Runs `f` over every row of `batch` without gradients, micro-batch by micro-batch, and
/// returns its `outputs` tensors (`[m, r]` each) as per-row values trimmed to each response.
pub fn forward_rows<N: Network>(
    model: &N,
    batch: &StepBatch,
    micro: MicroBatching,
    layout: Layout,
    outputs: usize,
    f: impl Fn(&N, &MicroInputs) -> candle_core::Result<Vec<Tensor>>,
) -> candle_core::Result<Vec<Ragged>> {
    let n = batch.len();
    let lens = batch.response_lens();
    let mut out: Vec<Ragged> = vec![vec![Vec::new(); n]; outputs];
    let rows: Vec<usize> = (0..n).collect();
    for mb in batch.micro_batches_for(&rows, micro, layout) {
        let mi = batch.inputs(&mb, layout, model.device())?;
        for (dst, t) in out.iter_mut().zip(f(model, &mi)?) {
            scatter_rows(&t, &mb, &lens, dst)?;
        }
    }
    Ok(out)
}
