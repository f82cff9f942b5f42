//! Validation (verl's `_validate`): `rollout.val_kwargs.n` responses per validation prompt
//! (greedy by default), scored by the reward stage, summarised per data source as
//! `val-core/<data_source>/<acc|reward>/mean@N` (+ `best@N/mean` when N > 1) and
//! `val-aux/...` for the rest.
//!
//! The core variable is `acc` when every scorer reported one (a plain-number score sets
//! `acc = score`), else `reward`. `best@N/mean` and `worst@N/mean` are the exact mean over
//! prompts of the best / worst of the N responses (verl estimates them by bootstrap).

use std::collections::BTreeMap;

use serde_json::json;

use super::dumps::write_jsonl;
use super::phases::{decode, requests};
use super::{Result, Trainer};
use crate::metrics::Metrics;
use crate::rollout::{generate_rows, repeat_rows, Sampler, SamplingParams};

/// Reads one variable (reward, acc) of a scored response.
type Getter = fn(&Scored) -> f64;

/// One validation response.
struct Scored {
    prompt: usize,
    data_source: String,
    reward: f64,
    acc: Option<f64>,
}

fn stats(groups: &BTreeMap<usize, Vec<f64>>) -> (f64, f64, f64, f64) {
    let k = groups.len().max(1) as f64;
    let (mut mean, mut best, mut worst, mut std) = (0.0, 0.0, 0.0, 0.0);
    for g in groups.values() {
        let n = g.len() as f64;
        let m = g.iter().sum::<f64>() / n;
        mean += m;
        best += g.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        worst += g.iter().copied().fold(f64::INFINITY, f64::min);
        std += (g.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n).sqrt();
    }
    (mean / k, best / k, worst / k, std / k)
}

impl Trainer {
    /// Generates for the validation set and returns the `val-core/*` and `val-aux/*` metrics.
    pub fn validate(&mut self) -> Result<Metrics> {
        let Some(ds) = self.val.as_ref() else {
            return Ok(Metrics::new());
        };
        let vk = &self.cfg.actor_rollout_ref.rollout.val_kwargs;
        let n = vk.n.max(1);
        let params = SamplingParams::validation(
            &self.cfg.actor_rollout_ref.rollout,
            self.plan.response_length,
            &self.tokenizer.eos_token_ids,
        );
        // Its own stream: validation never moves the training sampler.
        let mut sampler =
            Sampler::new(self.plan.seeds.rollout ^ self.global_step.wrapping_mul(0x9e37_79b9));
        let per_batch = self.cfg.data.val_batch_size.unwrap_or(ds.len()).max(1);
        let indices: Vec<usize> = (0..ds.len()).collect();
        let mut scored = Vec::new();
        let mut dumps = Vec::new();
        for chunk in indices.chunks(per_batch) {
            let rows = repeat_rows(chunk, n);
            let out = generate_rows(self.actor.view(), ds, &rows, &params, &mut sampler)?;
            let texts = decode(&self.tokenizer, &out.responses)?;
            let lens: Vec<usize> = out.responses.iter().map(Vec::len).collect();
            let rewards = self.reward.score(&requests(ds, &rows, &texts), &lens)?;
            for (k, r) in rewards.iter().enumerate() {
                let sample = &ds.samples[rows[k]];
                let acc = r.extra.get("acc").and_then(|v| {
                    v.as_f64()
                        .or_else(|| v.as_bool().map(|b| f64::from(u8::from(b))))
                });
                if let Some(score) = r.score {
                    scored.push(Scored {
                        prompt: rows[k],
                        data_source: sample.data_source.clone(),
                        reward: score,
                        acc,
                    });
                }
                dumps.push(json!({
                    "input": self.tokenizer.tokenizer.decode(&ds.prompt_ids[rows[k]], true).unwrap_or_default(),
                    "output": texts[k],
                    "gts": sample.ground_truth,
                    "score": r.score,
                    "step": self.global_step,
                    "data_source": sample.data_source,
                }));
            }
        }
        let mut m = Metrics::new();
        let mut by_source: BTreeMap<&str, Vec<&Scored>> = BTreeMap::new();
        for s in &scored {
            by_source.entry(s.data_source.as_str()).or_default().push(s);
        }
        for (src, list) in by_source {
            let has_acc = list.iter().all(|s| s.acc.is_some());
            let mut vars: Vec<(&str, Getter)> = vec![("reward", |s| s.reward)];
            if has_acc {
                vars.push(("acc", |s| s.acc.unwrap_or(0.0)));
            }
            let core = if has_acc { "acc" } else { "reward" };
            for (var, get) in &vars {
                let mut groups: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
                for s in &list {
                    groups.entry(s.prompt).or_default().push(get(s));
                }
                let (mean, best, worst, std) = stats(&groups);
                let section = |metric: &str| {
                    let core_metric =
                        *var == core && (metric.starts_with("mean") || metric.starts_with("best"));
                    format!(
                        "{}/{src}/{var}/{metric}",
                        if core_metric { "val-core" } else { "val-aux" }
                    )
                };
                m.insert(section(&format!("mean@{n}")), mean);
                if n > 1 {
                    m.insert(section(&format!("best@{n}/mean")), best);
                    m.insert(section(&format!("worst@{n}/mean")), worst);
                    m.insert(section(&format!("std@{n}")), std);
                }
            }
        }
        let show = self.cfg.trainer.log_val_generations.min(dumps.len());
        for d in dumps.iter().take(show) {
            tracing::info!(
                "validation sample (step {}):\n[prompt] {}\n[response] {}\n[ground truth] {}\n[score] {}",
                self.global_step,
                d["input"].as_str().unwrap_or_default(),
                d["output"].as_str().unwrap_or_default(),
                d["gts"],
                d["score"]
            );
        }
        if let Some(dir) = &self.cfg.trainer.validation_data_dir {
            let dir = std::path::PathBuf::from(crate::util::expand_home(dir));
            write_jsonl(&dir, self.global_step, &dumps)?;
        }
        Ok(m)
    }
}
