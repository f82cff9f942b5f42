//! Saving a step's complete state into the checkpoint layout (see [`crate::checkpoint`]) and
//! resuming from it: weights, optimizer moments, LR-scheduler position, loader cursor, sampler
//! RNG and KL controller, so a resumed run continues bit for bit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Result, Trainer, TrainerError};
use crate::algo::KlController;
use crate::checkpoint;
use crate::data::{LoaderCursor, SamplerCursor};
use crate::reward::model_source::RunningStats;
use crate::rollout::{Sampler, SamplerState};

/// `trainer_state.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub global_step: u64,
    pub loader: LoaderCursor,
    /// Prompts in the training data when saved (a resumed run must see the same data).
    pub train_rows: usize,
    /// Prompts per loader batch when saved (`data.gen_batch_size`, else `train_batch_size`):
    /// the cursor counts batches of this size. Absent in checkpoints of earlier versions.
    #[serde(default)]
    pub loader_batch_size: Option<usize>,
    pub sampler: SamplerState,
    pub kl_ctrl: KlController,
    pub actor_updates: u64,
    pub critic_updates: Option<u64>,
    /// Reward-source weights (changed through reward.control, kept across a resume).
    #[serde(default)]
    pub reward_weights: BTreeMap<String, f64>,
    /// Running statistics of normalising reward models.
    #[serde(default)]
    pub reward_model_stats: BTreeMap<String, RunningStats>,
    /// The remote trackers' run ids (`wandb` → run id, `mlflow` → run id, ...), so that a
    /// resumed run continues the same runs.
    #[serde(default)]
    pub tracker_runs: BTreeMap<String, String>,
    /// Of each model trained with LoRA (`actor`, `critic`): the fingerprint of the frozen base
    /// weights the adapters were trained on ([`base_fingerprint`]); a resumed run must load the
    /// same base. Absent in checkpoints of earlier versions.
    #[serde(default)]
    pub lora_bases: BTreeMap<String, String>,
    /// The custom sampler's position and state (`data.sampler.class_path`); absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_sampler: Option<SamplerCursor>,
}

/// What identifies the base weights under LoRA adapters: CRC-32C over every base tensor's f32
/// values (name order, little-endian) with its name and shape, as hex with the tensor count.
/// Independent of where and in which format the model is stored (a moved folder, a safetensors
/// copy of a GGUF's values give the same), different for any changed value.
/// Tensors that train (`trained`: a value head saved with the adapters) are left out.
pub fn base_fingerprint(
    varmap: &candle_nn::VarMap,
    trained: &[(String, candle_core::Var)],
) -> candle_core::Result<String> {
    let data = varmap.data().lock().expect("varmap lock");
    let trained: std::collections::HashSet<_> =
        trained.iter().map(|(_, v)| v.as_tensor().id()).collect();
    let mut names: Vec<&String> = data
        .keys()
        .filter(|n| !trained.contains(&data[*n].as_tensor().id()))
        .collect();
    names.sort();
    let mut crc = 0u32;
    let mut bytes = Vec::new();
    for name in &names {
        let t = data[*name].as_tensor();
        crc = crc32c::crc32c_append(crc, name.as_bytes());
        crc = crc32c::crc32c_append(crc, format!("{:?}", t.dims()).as_bytes());
        let values: Vec<f32> = t
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?;
        for chunk in values.chunks(1 << 16) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            crc = crc32c::crc32c_append(crc, &bytes);
        }
    }
    Ok(format!("crc32c:{crc:08x}/{}", names.len()))
}

/// The tracker run ids saved in the checkpoint `trainer.resume_mode` will resume from (read
/// before the trackers start; nothing when there is none or it cannot be read, which the
/// resume itself then reports).
/// The checkpoint of `step` under `root` as data-parallel ranks save one: rank 0 runs `write`
/// (every rank holds the same weights, optimizer moments and counters), the others wait for
/// it, so no rank runs ahead of a checkpoint it might resume from.
pub(super) fn save_on_rank0(
    comm: &dyn crate::dist::Collective,
    root: &Path,
    step: u64,
    write: impl FnOnce() -> Result<PathBuf>,
) -> Result<PathBuf> {
    if comm.rank() != 0 {
        comm.barrier()?;
        return Ok(checkpoint::step_dir(root, step));
    }
    let dir = write();
    comm.barrier()?;
    dir
}

pub fn saved_tracker_runs(cfg: &crate::config::Config, root: &Path) -> BTreeMap<String, String> {
    let t = &cfg.trainer;
    // A save cut short after its commit record is finished first (rank 0 only calls this):
    // its checkpoint is the one resumed. An error is the resume's to report.
    let _ = checkpoint::recover(root);
    let Ok(Some((_, dir))) =
        checkpoint::find_resume(root, t.resume_mode, t.resume_from_path.as_deref())
    else {
        return BTreeMap::new();
    };
    std::fs::read_to_string(dir.join("trainer_state.json"))
        .ok()
        .and_then(|text| serde_json::from_str::<TrainerState>(&text).ok())
        .map(|s| s.tracker_runs)
        .unwrap_or_default()
}

/// Test hook `STEP:FILE` (debug builds only, which is what tests run): the save of step STEP
/// stops half-way (after the actor), creates FILE and sleeps, so a test can kill the process
/// in the middle of a save.
#[cfg(debug_assertions)]
fn pause_in_save(step: u64) -> Result<()> {
    let var = std::env::var("MAIN_PPO_TEST_PAUSE_IN_SAVE").ok();
    if let Some((at, marker)) = var.as_deref().and_then(|v| v.split_once(':')) {
        if at.parse() == Ok(step) {
            std::fs::write(marker, step.to_string()).map_err(other)?;
            std::thread::sleep(std::time::Duration::from_secs(60));
        }
    }
    Ok(())
}

fn other(e: impl std::fmt::Display) -> TrainerError {
    TrainerError::Other(e.to_string())
}

impl Trainer {
    /// Writes `global_step_N/` for the current step and prunes old ones.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let root = self.plan.default_local_dir.clone();
        let comm = self.comm.clone();
        let dir = save_on_rank0(comm.as_ref(), &root, self.global_step, || {
            self.write_checkpoint(&root)
        })?;
        self.last_saved = Some(self.global_step);
        Ok(dir)
    }

    fn write_checkpoint(&mut self, root: &Path) -> Result<PathBuf> {
        let root = root.to_path_buf();
        let state = TrainerState {
            global_step: self.global_step,
            loader: self.loader.cursor(),
            train_rows: self.train.len(),
            loader_batch_size: Some(self.plan.gen_batch_size),
            sampler: self.rollout.sampler.state(),
            kl_ctrl: self.kl_ctrl,
            actor_updates: self.actor.trainable.updates,
            critic_updates: self.critic.as_ref().map(|c| c.trainable.updates),
            reward_weights: self.reward.weights(),
            reward_model_stats: self.reward.model_stats(),
            tracker_runs: self.tracker_runs(),
            lora_bases: self.lora_bases()?,
            data_sampler: self.loader.sampler_cursor()?,
        };
        let config_yaml = serde_yaml_ng::to_string(&self.cfg).map_err(other)?;
        let dir = checkpoint::save_atomic(&root, self.global_step, |dir: &Path| -> Result<()> {
            self.actor
                .trainable
                .save(&dir.join("actor"), &self.tokenizer)?;
            #[cfg(debug_assertions)]
            pause_in_save(self.global_step)?;
            crate::util::fault_point("actor_written", self.global_step);
            if let Some(c) = &self.critic {
                c.trainable.save(&dir.join("critic"), &self.tokenizer)?;
            }
            std::fs::write(
                dir.join("trainer_state.json"),
                serde_json::to_string_pretty(&state).map_err(other)?,
            )
            .map_err(other)?;
            std::fs::write(dir.join("config.yaml"), &config_yaml).map_err(other)?;
            Ok(())
        })?;
        checkpoint::prune(&root, "actor", self.cfg.trainer.max_actor_ckpt_to_keep)?;
        checkpoint::prune(&root, "critic", self.cfg.trainer.max_critic_ckpt_to_keep)?;
        crate::util::fault_point("pruned", self.global_step);
        self.last_saved = Some(self.global_step);
        tracing::info!("checkpoint saved: {}", dir.display());
        Ok(dir)
    }

    /// Restores the state of the checkpoint `trainer.resume_mode` selects, if any.
    pub(super) fn resume(&mut self) -> Result<()> {
        let root = self.plan.default_local_dir.clone();
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
            TrainerError::Other(format!(
                "resuming from {} (trainer.resume_mode={}): {e}; to start fresh, set trainer.default_local_dir to a new folder",
                dir.display(),
                serde_json::to_value(t.resume_mode)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            ))
        })?;
        tracing::info!("resumed from {} (step {step})", dir.display());
        // Every rank has read it before rank 0 may delete it.
        self.comm.barrier()?;
        if t.del_local_ckpt_after_load && self.comm.rank() == 0 {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok(())
    }

    /// [`base_fingerprint`] of each model that trains LoRA adapters.
    fn lora_bases(&self) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        let actor = &self.actor.trainable;
        let critic = self.critic.as_ref().map(|c| &c.trainable);
        let parts = [
            (
                "actor",
                actor
                    .lora
                    .is_some()
                    .then(|| (&actor.varmap, actor.optimizer.vars())),
            ),
            (
                "critic",
                critic
                    .filter(|c| c.lora.is_some())
                    .map(|c| (&c.varmap, c.optimizer.vars())),
            ),
        ];
        for (part, base) in parts {
            if let Some((varmap, trained)) = base {
                let f = base_fingerprint(varmap, trained).map_err(other)?;
                out.insert(part.to_string(), f);
            }
        }
        Ok(out)
    }

    fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let state_path = dir.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_path)
            .map_err(|e| other(format!("{}: {e}", state_path.display())))?;
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| other(format!("{}: {e}", state_path.display())))?;
        if state.train_rows != self.train.len() {
            return Err(other(format!(
                "the checkpoint was trained on {} prompts, the training data now has {}: the data order cannot continue",
                state.train_rows,
                self.train.len()
            )));
        }
        match state.loader_batch_size {
            Some(saved) if saved != self.plan.gen_batch_size => {
                return Err(other(format!(
                    "the checkpoint's loader served batches of {saved} prompts, this run's serve {} (data.gen_batch_size, else data.train_batch_size): its position counts batches, so the data order cannot continue; set the batch size back to {saved}",
                    self.plan.gen_batch_size
                )))
            }
            _ => {}
        }
        // A position past the end of an epoch cannot come from a run over this data: the file
        // was edited or damaged (the loader would serve an empty order).
        // (A custom sampler's epoch is as long as its iterator: no such bound.)
        let per_epoch = self.train.len() / self.plan.gen_batch_size.max(1);
        if !self.loader.has_sampler() && state.loader.batches_served as usize > per_epoch {
            return Err(other(format!(
                "{}: loader.batches_served = {} is past the end of an epoch ({} prompts in batches of {} make {per_epoch}): the file was edited or is damaged",
                state_path.display(),
                state.loader.batches_served,
                self.train.len(),
                self.plan.gen_batch_size
            )));
        }
        // LoRA adapters only make sense on the base they were trained on.
        let now = self.lora_bases()?;
        for (part, saved) in &state.lora_bases {
            match now.get(part) {
                Some(current) if current != saved => {
                    let key = match part.as_str() {
                        "critic" => "critic.model.path",
                        _ => "actor_rollout_ref.model.path",
                    };
                    return Err(other(format!(
                        "{}: the {part}'s LoRA adapters were trained on other base weights (fingerprint {saved}) than {key} loads now ({current}): resume with the base model the run started from",
                        state_path.display()
                    )));
                }
                _ => {}
            }
        }
        self.actor
            .trainable
            .load(&dir.join("actor"), state.actor_updates)?;
        match (&mut self.critic, state.critic_updates) {
            (Some(c), Some(updates)) => c.trainable.load(&dir.join("critic"), updates)?,
            (Some(_), None) => {
                return Err(other(
                    "the run has a critic but the checkpoint holds none (was it saved by a critic-free run?)",
                ))
            }
            _ => {}
        }
        if state.data_sampler.is_some() && !self.loader.has_sampler() {
            return Err(other(format!(
                "{}: the checkpoint's data order came from a custom sampler (data.sampler.class_path), which this run does not set: set the same data.sampler.class_path and class_name to continue its order, or start a new run (trainer.resume_mode=disable)",
                state_path.display()
            )));
        }
        self.loader
            .restore(state.loader, state.data_sampler.as_ref())?;
        self.rollout.sampler = Sampler::restore(state.sampler);
        self.kl_ctrl = state.kl_ctrl;
        // Weights of sources that still exist; a source added since keeps its configured weight.
        let known = self.reward.weights();
        let weights: BTreeMap<String, f64> = state
            .reward_weights
            .into_iter()
            .filter(|(k, _)| known.contains_key(k))
            .collect();
        self.reward.set_weights(&weights)?;
        self.reward.restore_model_stats(&state.reward_model_stats);
        self.global_step = state.global_step;
        self.last_saved = Some(state.global_step);
        Ok(())
    }
}
