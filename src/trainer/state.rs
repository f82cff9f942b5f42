//! Saving a step's complete state into the checkpoint layout (see [`crate::checkpoint`]) and
//! resuming from it: weights, optimizer moments, LR-scheduler position, loader cursor, sampler
//! RNG and KL controller, so a resumed run continues bit for bit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Result, Trainer, TrainerError};
use crate::algo::KlController;
use crate::checkpoint;
use crate::data::{BatchLoader, LoaderCursor};
use crate::model::hf;
use crate::reward::model_source::RunningStats;
use crate::rollout::{Sampler, SamplerState};

/// `trainer_state.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub global_step: u64,
    pub loader: LoaderCursor,
    /// Prompts in the training data when saved (a resumed run must see the same data).
    pub train_rows: usize,
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
}

/// Test hook `STEP:FILE`: the save of step STEP stops half-way (after the actor weights),
/// creates FILE and sleeps, so a test can kill the process in the middle of a save.
const PAUSE_ENV: &str = "MAIN_PPO_TEST_PAUSE_IN_SAVE";

fn other(e: impl std::fmt::Display) -> TrainerError {
    TrainerError::Other(e.to_string())
}

impl Trainer {
    /// Writes `global_step_N/` for the current step and prunes old ones.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let root = self.plan.default_local_dir.clone();
        let state = TrainerState {
            global_step: self.global_step,
            loader: self.loader.cursor(),
            train_rows: self.train.len(),
            sampler: self.sampler.state(),
            kl_ctrl: self.kl_ctrl,
            actor_updates: self.actor.updates,
            critic_updates: self.critic.as_ref().map(|c| c.updates),
            reward_weights: self.reward.weights(),
            reward_model_stats: self.reward.model_stats(),
        };
        let config_yaml = serde_yaml_ng::to_string(&self.cfg).map_err(other)?;
        let dir = checkpoint::save_atomic(&root, self.global_step, |dir: &Path| -> Result<()> {
            let actor_hf = dir.join("actor").join("huggingface");
            hf::save_dir(
                &self.actor.varmap,
                &self.actor.args,
                &actor_hf,
                &self.tokenizer.eos_token_ids,
                None,
                None,
            )?;
            self.tokenizer.save(&actor_hf)?;
            if let Some((at, marker)) = std::env::var(PAUSE_ENV)
                .ok()
                .as_deref()
                .and_then(|v| v.split_once(':'))
            {
                if at.parse() == Ok(self.global_step) {
                    std::fs::write(marker, self.global_step.to_string()).map_err(other)?;
                    std::thread::sleep(std::time::Duration::from_secs(60));
                }
            }
            self.actor.optimizer.save(&dir.join("actor"))?;
            if let Some(c) = &self.critic {
                let critic_hf = dir.join("critic").join("huggingface");
                hf::save_dir(
                    &c.varmap,
                    &c.args,
                    &critic_hf,
                    &self.tokenizer.eos_token_ids,
                    None,
                    None,
                )?;
                self.tokenizer.save(&critic_hf)?;
                c.optimizer.save(&dir.join("critic"))?;
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
        self.last_saved = Some(self.global_step);
        tracing::info!("checkpoint saved: {}", dir.display());
        Ok(dir)
    }

    /// Restores the state of the checkpoint `trainer.resume_mode` selects, if any.
    pub(super) fn resume(&mut self) -> Result<()> {
        let root = self.plan.default_local_dir.clone();
        checkpoint::remove_partials(&root);
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
        if t.del_local_ckpt_after_load {
            let _ = std::fs::remove_dir_all(&dir);
        }
        Ok(())
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
        let actor_hf = dir.join("actor").join("huggingface");
        hf::assign(&self.actor.varmap, &hf::read_weights(&actor_hf)?, &actor_hf)?;
        self.actor.optimizer.load(&dir.join("actor"))?;
        self.actor.updates = state.actor_updates;
        match (&mut self.critic, state.critic_updates) {
            (Some(c), Some(updates)) => {
                let critic_hf = dir.join("critic").join("huggingface");
                hf::assign(&c.varmap, &hf::read_weights(&critic_hf)?, &critic_hf)?;
                c.optimizer.load(&dir.join("critic"))?;
                c.updates = updates;
            }
            (Some(_), None) => {
                return Err(other(
                    "the run has a critic but the checkpoint holds none (was it saved by a critic-free run?)",
                ))
            }
            _ => {}
        }
        self.loader =
            BatchLoader::resume(self.train.len(), self.plan.train_batch_size, state.loader);
        self.sampler = Sampler::restore(state.sampler);
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
