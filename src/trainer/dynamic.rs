//! DAPO's dynamic sampling (`algorithm.filter_groups`), the rollout of a step when it is on.
//!
//! ```text
//! loop: next gen batch (data.gen_batch_size prompts) ─► rollout ─► reward (─► ReMax baseline)
//!       ─► gather the ranks' rows ─► drop groups whose `metric` is the same for every response
//!       ─► enough groups (data.train_batch_size)? stop : next batch, unless
//!          max_num_gen_batches batches were drawn (an error naming both keys)
//! then: the first train_batch_size kept groups are the step (the surplus is discarded), each
//!       rank takes its share and the step goes on as without filtering (old log-probs, ...).
//! ```
//!
//! This is the DAPO trainer verl ran up to its v1 trainer (`recipe/dapo`): generation batches
//! one after another, the same rule and truncation. verl 1dda039's v1 trainer fetches single
//! prompts asynchronously and so trains on other prompts; its metric names are reported too.
//! Group ids stay unique over the step's batches, so the advantage estimators see each
//! prompt's responses as one group.

use super::batch::{Column, StepBatch};
use super::{Result, Trainer, TrainerError};
use crate::algo::filter::{filter, Precision};
use crate::config::FilterPlan;
use crate::metrics::{Metrics, Timings};
use crate::rollout::Sampler;

/// Each row's value of the filter `metric`, and the precision verl compares it in. The
/// summed token-level rewards for `reward` (verl 0.9's name: the reward before any KL
/// penalty, never read from the reward function's dict), `seq_reward` and `seq_final_reward`
/// (all the same here: the KL penalty is never in the reward with filtering); else the reward's value of that name (`acc`
/// and `score` always exist, any key the reward function returns; a bool counts 1 / 0). Rows
/// left out of the update give `None`. An error names the row's prompt and the keys it has.
pub fn metric_values(b: &StepBatch, metric: &str) -> Result<(Vec<Option<f64>>, Precision)> {
    if matches!(metric, "reward" | "seq_reward" | "seq_final_reward") {
        let scores = b.column(Column::TokenLevelScores)?;
        let v = (0..b.len())
            .map(|r| (!b.excluded[r]).then(|| scores[r].iter().sum::<f32>() as f64))
            .collect();
        return Ok((v, Precision::F32));
    }
    let mut out = Vec::with_capacity(b.len());
    for r in 0..b.len() {
        if b.excluded[r] {
            out.push(None);
            continue;
        }
        let reward = &b.rewards[r];
        let found = match metric {
            "score" => reward
                .extra
                .get("score")
                .cloned()
                .or(reward.score.map(Into::into)),
            _ => reward.extra.get(metric).cloned(),
        };
        let value = match &found {
            Some(serde_json::Value::Bool(x)) => Some(f64::from(u8::from(*x))),
            Some(serde_json::Value::Number(x)) => x.as_f64(),
            _ => None,
        };
        let Some(value) = value else {
            let keys: Vec<&str> = reward.extra.keys().map(String::as_str).collect();
            return Err(TrainerError::Other(format!(
                "algorithm.filter_groups.metric = `{metric}`: the response to training row {} {}; its reward holds [{}] (and reward, seq_reward, seq_final_reward)",
                b.sample[r],
                match found {
                    Some(v) => format!("has `{metric}` = {v}, not a number or bool"),
                    None => format!("has no `{metric}`"),
                },
                keys.join(", ")
            )));
        };
        out.push(Some(value));
    }
    Ok((out, Precision::F64))
}

/// What one step's dynamic sampling did (its metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SamplingCounts {
    /// Generation batches drawn (`train/num_gen_batches`).
    pub gen_batches: usize,
    /// Groups dropped for a metric without spread (`training/filter_groups/evicted_samples`).
    pub evicted: usize,
    /// Kept groups beyond train_batch_size, discarded
    /// (`training/filter_groups/discarded_surplus_samples`).
    pub surplus: usize,
}

impl SamplingCounts {
    pub fn write(&self, m: &mut Metrics) {
        m.insert("train/num_gen_batches".into(), self.gen_batches as f64);
        m.insert(
            "training/filter_groups/evicted_samples".into(),
            self.evicted as f64,
        );
        m.insert(
            "training/filter_groups/discarded_surplus_samples".into(),
            self.surplus as f64,
        );
    }
}

/// The training data of `trainer.total_epochs` ran out before a step had its groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Exhausted {
    pub kept: usize,
    pub gen_batches: usize,
}

impl Trainer {
    /// The rows of a step under dynamic sampling: this rank's share of the first
    /// `train_batch_size` kept groups, rewards filled (and ReMax baselines); `Err(Exhausted)`
    /// inside `Ok` when the epochs run out first, the loader and sampler then put back where
    /// the step found them (a checkpoint saved next equals one saved at the previous step).
    pub(super) fn dynamic_sampling(
        &mut self,
        f: &FilterPlan,
        t: &mut Timings,
        m: &mut Metrics,
    ) -> Result<std::result::Result<(StepBatch, u64), Exhausted>> {
        let (tbs, n) = (self.plan.train_batch_size, self.plan.n.max(1));
        let (cursor, sampler) = (self.loader.cursor(), self.rollout.sampler.state());
        let mut counts = SamplingCounts::default();
        let (mut parts, mut kept, mut epoch) = (Vec::new(), 0usize, cursor.epoch);
        while kept < tbs {
            if let Some(max) = f.max_num_gen_batches {
                if counts.gen_batches as u64 >= max {
                    return Err(TrainerError::Other(format!(
                        "step {}: {} generation batches (algorithm.filter_groups.max_num_gen_batches = {max}) kept {kept} groups whose `{}` differs, fewer than data.train_batch_size ({tbs}): the prompts are too hard or too easy for the model to tell its responses apart; raise max_num_gen_batches (0 = no limit) or data.gen_batch_size, or choose other data",
                        self.global_step + 1,
                        counts.gen_batches,
                        f.metric
                    )));
                }
            }
            if self.loader.next_epoch() >= self.cfg.trainer.total_epochs as u64 {
                self.loader.rewind(cursor);
                self.rollout.sampler = Sampler::restore(sampler);
                let gen_batches = counts.gen_batches;
                return Ok(Err(Exhausted { kept, gen_batches }));
            }
            let (prompts, e) = self.next_prompts()?;
            epoch = epoch.max(e);
            let batch = self.scored_gen_batch(&prompts, counts.gen_batches, t)?;
            counts.gen_batches += 1;
            let (values, precision) = metric_values(&batch, &f.metric)?;
            let groups = filter(&batch.uid, &values, precision);
            counts.evicted += groups.dropped;
            kept += groups.kept.len();
            parts.push(batch.select(&groups.rows));
            if kept < tbs {
                if self.comm.rank() == 0 {
                    tracing::info!(
                        "step {}: generation batch {} drawn, {kept} of data.train_batch_size = {tbs} groups kept so far ({} dropped: `{}` the same for every response)",
                        self.global_step + 1,
                        counts.gen_batches,
                        counts.evicted,
                        f.metric
                    );
                }
                self.check_stop("dynamic sampling", self.global_step + 1)?;
            }
        }
        counts.surplus = kept - tbs;
        counts.write(m);
        let all = StepBatch::concat(parts)?;
        // The kept groups' rows are consecutive, n per group: the step is the first tbs groups,
        // and this rank's share of them is a contiguous run, as without filtering.
        let (rank, world) = (self.comm.rank(), self.comm.world_size().max(1));
        let share = tbs / world;
        let rows: Vec<usize> = (rank * share * n..(rank + 1) * share * n).collect();
        Ok(Ok((all.select(&rows), epoch)))
    }

    /// One generation batch: rolled out on every rank, scored, gathered, its group ids moved
    /// past those of the step's earlier batches (batch `index` of the step).
    fn scored_gen_batch(
        &mut self,
        prompts: &[usize],
        index: usize,
        t: &mut Timings,
    ) -> Result<StepBatch> {
        let mut batch = self.rollout_and_reward(prompts, t)?;
        let offset = (index * self.plan.gen_batch_size) as u64;
        batch.uid.iter_mut().for_each(|u| *u += offset);
        self.gather(batch)
    }
}
