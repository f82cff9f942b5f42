//! Sample dumps: `trainer.rollout_data_dir/{step}.jsonl` (every training response of a step)
//! and `trainer.validation_data_dir/{step}.jsonl` (written by validation).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::batch::{Column, StepBatch};
use super::{Result, Trainer, TrainerError};

impl Trainer {
    /// `{dir}/{step}.jsonl`: prompt, response, ground truth, score, each source's score and the
    /// mean advantage of every response of the step.
    pub(super) fn dump_rollouts(&self, dir: &str, batch: &StepBatch) -> Result<()> {
        let advantages = batch.column(Column::Advantages)?;
        let rows: Vec<Value> = (0..batch.len())
            .map(|i| {
                let s = &self.train.samples[batch.sample[i]];
                let reward = &batch.rewards[i];
                let prompt = self
                    .tokenizer
                    .tokenizer
                    .decode(&batch.prompts[i], true)
                    .unwrap_or_default();
                let adv = &advantages[i];
                let mean_adv = if adv.is_empty() {
                    Value::Null
                } else {
                    json!(adv.iter().map(|&x| x as f64).sum::<f64>() / adv.len() as f64)
                };
                let mut o = serde_json::Map::new();
                o.insert("input".into(), json!(prompt));
                o.insert("output".into(), json!(batch.texts[i]));
                o.insert("gts".into(), s.ground_truth.clone());
                o.insert("score".into(), json!(reward.score));
                o.insert("step".into(), json!(self.global_step));
                o.insert("data_source".into(), json!(s.data_source));
                o.insert("uid".into(), json!(batch.uid[i]));
                o.insert("advantage".into(), mean_adv);
                for (name, v) in &reward.per_source {
                    o.insert(format!("reward/{name}"), json!(v));
                }
                for (k, v) in &reward.extra {
                    o.entry(k.clone()).or_insert(v.clone());
                }
                if let Some(e) = &reward.error {
                    o.insert("reward_error".into(), json!(e));
                }
                o.insert("gated".into(), json!(reward.gated));
                o.insert("excluded".into(), json!(batch.excluded[i]));
                Value::Object(o)
            })
            .collect();
        write_jsonl(
            &PathBuf::from(crate::util::expand_home(dir)),
            self.global_step,
            &rows,
        )
    }
}

/// Writes `{dir}/{step}.jsonl`.
pub(super) fn write_jsonl(dir: &Path, step: u64, rows: &[Value]) -> Result<()> {
    let err = |e: std::io::Error| TrainerError::Other(format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut text = String::new();
    for r in rows {
        text.push_str(&r.to_string());
        text.push('\n');
    }
    std::fs::write(dir.join(format!("{step}.jsonl")), text).map_err(err)
}
