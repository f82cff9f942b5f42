//! The phases of [`Trainer::step`] that are not a model's own: taking the next prompts,
//! rollout, reward, ReMax's baseline, advantages, the after-update work (checkpoint,
//! validation) and the step's metrics. Each fills the step's [`StepBatch`].

use std::sync::Arc;

use super::batch::{Column, StepBatch, TurnStats};
use super::{advantage, step_metrics, Result, Trainer, TrainerError};
use crate::config::AgentLoopName;
use crate::control::ControlServer;
use crate::data::{PromptDataset, TokenizerBundle};
use crate::metrics::{Metrics, Timings};
use crate::model::CausalLm;
use crate::reward::ScoreRequest;
use crate::rollout::agent::{AgentContext, Conversation, Episode};
use crate::rollout::{generate_agent_rows, Rollout};
use crate::rollout::{
    generate_rows, generate_rows_from, repeat_rows, Sampler, SamplingParams, StopReason,
};

/// The rollout worker: `n` sampled responses per prompt, one group id per prompt.
pub struct RolloutWorker {
    /// The training sampler's stream (saved in checkpoints).
    pub sampler: Sampler,
    params: SamplingParams,
    n: usize,
    /// Keep the sampled tokens' log-probs (`rollout.calculate_log_probs`).
    log_probs: bool,
    /// The tool agent loop, when some row of the data runs it.
    pub agent: Option<Arc<AgentContext>>,
}

impl RolloutWorker {
    pub fn new(params: SamplingParams, n: usize, seed: u64, log_probs: bool) -> Self {
        Self {
            sampler: Sampler::new(seed),
            params,
            n: n.max(1),
            log_probs,
            agent: None,
        }
    }

    /// The worker with the tool agent loop for the rows that run it.
    pub fn with_agent(mut self, agent: Option<Arc<AgentContext>>) -> Self {
        self.agent = agent;
        self
    }

    /// The rows of a step: each prompt `n` times, consecutively, sampled from `model`.
    /// `first_prompt`: the step-wide index of `prompts[0]` (a data-parallel rank's share
    /// starts there), so that group ids and random streams are those of the whole step.
    pub fn generate(
        &mut self,
        model: &CausalLm,
        ds: &PromptDataset,
        prompts: &[usize],
        first_prompt: usize,
    ) -> Result<StepBatch> {
        let rows = repeat_rows(prompts, self.n);
        let first_row = first_prompt * self.n;
        let agent = self.agent.as_deref();
        let (out, episodes) = rollout_rows(
            model,
            ds,
            &rows,
            &self.params,
            &mut self.sampler,
            first_row,
            agent,
        )?;
        let mut batch = StepBatch::new(
            rows.iter().map(|&i| ds.prompt_ids[i].clone()).collect(),
            out.responses,
            rows.clone(),
            (0..rows.len())
                .map(|k| (first_prompt + k / self.n) as u64)
                .collect(),
            out.stop.iter().map(|s| *s == StopReason::Length).collect(),
        );
        batch.attach_images(ds, &model.args, model.device())?;
        if self.log_probs {
            batch.set(Column::RolloutLogProbs, out.log_probs)?;
        }
        if let Some(eps) = episodes {
            let mask = eps
                .iter()
                .map(|e| e.mask.iter().map(|&m| f32::from(m)).collect())
                .collect();
            batch.set(Column::ResponseMask, mask)?;
            batch.turns = Some(
                eps.iter()
                    .zip(&rows)
                    .map(|(e, &i)| turn_stats(e, ds.agents[i]))
                    .collect(),
            );
            // One line per step for the sanity check (the first conversation that differs, and
            // how many did): a template that cannot render the calls differs on every row;
            // the share is the step's agent/tokenization_mismatch_ratio.
            let mismatched: Vec<(&str, usize)> = eps
                .iter()
                .zip(&rows)
                .filter_map(|(e, &i)| Some((e.sanity_mismatch.as_deref()?, i)))
                .collect();
            if let Some(&(m, i)) = mismatched.first() {
                let s = &ds.samples[i];
                tracing::warn!("{} of {} conversations: the multi-turn token ids differ from the conversation tokenised at once (first: {}, row {}: {m}); check the chat template (actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode)", mismatched.len(), eps.len(), s.file, s.row);
            }
            for (e, &i) in eps.iter().zip(&rows) {
                let s = &ds.samples[i];
                if let Some(err) = &e.error {
                    tracing::warn!(
                        "{}, row {}: the conversation ended early: {err}",
                        s.file,
                        s.row
                    );
                }
            }
        }
        Ok(batch)
    }

    /// One greedy response to each of `prompts` (ReMax's baseline), with the training limits.
    pub fn greedy(
        &self,
        model: &CausalLm,
        ds: &PromptDataset,
        prompts: &[usize],
    ) -> Result<Vec<Vec<u32>>> {
        let mut greedy = self.params.clone();
        greedy.greedy = true;
        let out = generate_rows(model, ds, prompts, &greedy, &mut Sampler::new(0))?;
        Ok(out.responses)
    }
}

/// Rows `rows` of `ds` generated (the first being global row `first_row`), through the tool
/// agent loop when `agent` is given and some row of `ds` runs it (then with each row's
/// episode).
#[allow(clippy::too_many_arguments)]
pub(super) fn rollout_rows(
    model: &CausalLm,
    ds: &PromptDataset,
    rows: &[usize],
    params: &SamplingParams,
    sampler: &mut Sampler,
    first_row: usize,
    agent: Option<&AgentContext>,
) -> Result<(Rollout, Option<Vec<Episode>>)> {
    match agent.filter(|_| ds.agents.contains(&AgentLoopName::ToolAgent)) {
        None => Ok((
            generate_rows_from(model, ds, rows, params, sampler, first_row)?,
            None,
        )),
        Some(ctx) => {
            let convs = rows.iter().map(|&i| conversation(ds, i)).collect();
            let (out, eps) =
                generate_agent_rows(model, ds, rows, params, sampler, first_row, ctx, convs)?;
            Ok((out, Some(eps)))
        }
    }
}

/// verl's additions to a multi-turn row's `extra_info` (from the agent loop's
/// `tool_extra_fields` and `__num_turns__`): `turn_scores` (the interaction's score of each
/// user turn), `tool_rewards` and `num_turns`. An `extra_info` that is not a mapping becomes
/// one.
pub(super) fn add_turns_to_requests(reqs: &mut [ScoreRequest], turns: &[TurnStats]) {
    for (r, t) in reqs.iter_mut().zip(turns) {
        if !r.extra_info.is_object() {
            r.extra_info = serde_json::Value::Object(Default::default());
        }
        r.extra_info["turn_scores"] = serde_json::json!(t.turn_scores);
        r.extra_info["tool_rewards"] = serde_json::json!(t.tool_rewards);
        r.extra_info["num_turns"] = serde_json::json!(t.num_turns);
    }
}

/// Row `i`'s conversation as the agent loop starts it.
fn conversation(ds: &PromptDataset, i: usize) -> Conversation {
    let s = &ds.samples[i];
    Conversation {
        messages: s.prompt.clone(),
        tools_kwargs: s
            .extra_info
            .get("tools_kwargs")
            .cloned()
            .unwrap_or_else(|| serde_json::json!({})),
        tool_agent: ds.agents[i] == AgentLoopName::ToolAgent,
        interaction: s.extra_info.get("interaction_kwargs").cloned(),
    }
}

/// What the step keeps of an episode.
pub(super) fn turn_stats(e: &Episode, agent: AgentLoopName) -> TurnStats {
    TurnStats {
        num_turns: e.num_turns(),
        tool_agent: agent == AgentLoopName::ToolAgent,
        tool_calls: e.tool_calls,
        tool_errors: e.tool_errors,
        malformed_calls: e.malformed_calls,
        tool_rewards: e.tool_rewards.clone(),
        turn_scores: e.turn_scores.clone(),
        interaction_errors: e.interaction_errors,
        model_tokens: e.mask.iter().filter(|&&m| m == 1).count(),
        sanity_mismatch: e.sanity_mismatch.is_some(),
        tool_seconds: e.tool_seconds,
        spans: spans(&e.mask),
    }
}

/// Run lengths of `mask`, alternating, starting with a run of 1s (0 long when it starts with 0).
pub(super) fn spans(mask: &[u8]) -> Vec<u32> {
    let mut out = vec![0u32];
    let mut current = 1u8;
    for &m in mask {
        if m != current {
            out.push(0);
            current = m;
        }
        *out.last_mut().unwrap() += 1;
    }
    out
}

/// Responses as text, special tokens removed (what reward functions see).
pub fn decode(tok: &TokenizerBundle, responses: &[Vec<u32>]) -> Result<Vec<String>> {
    responses
        .iter()
        .map(|r| {
            tok.tokenizer
                .decode(r, true)
                .map_err(|e| TrainerError::Other(format!("decoding a response: {e}")))
        })
        .collect()
}

/// The reward requests of responses `texts` to dataset rows `rows` of `ds`. `experiment`: with
/// verl's `gdpo` reward manager, the experiment name it writes into each request's
/// `extra_info["experiment_name"]` (an `extra_info` that is not a mapping becomes one).
pub fn requests(
    ds: &PromptDataset,
    rows: &[usize],
    texts: &[String],
    experiment: Option<&str>,
) -> Vec<ScoreRequest> {
    rows.iter()
        .zip(texts)
        .map(|(&i, text)| {
            let mut r = ScoreRequest::new(&ds.samples[i], text.clone());
            if let Some(name) = experiment {
                if !r.extra_info.is_object() {
                    r.extra_info = serde_json::Value::Object(Default::default());
                }
                r.extra_info["experiment_name"] = name.into();
            }
            r
        })
        .collect()
}

/// Where a step's old log-probs come from (see [`Trainer::old_log_probs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OldLogProbs {
    /// The `old_log_prob` pass, in verl's place (after the reward).
    Pass,
    /// The on-policy update's first forward (`old_log_prob` pass skipped).
    FromUpdate,
    /// The rollout's own log-probs (`rollout_correction.bypass_mode`: no pass).
    Rollout,
}

impl Trainer {
    /// The experiment name verl's `gdpo` reward manager puts in `extra_info` (else `None`).
    pub(super) fn reward_experiment(&self) -> Option<&str> {
        (self.cfg.reward.reward_manager.name == crate::config::RewardManagerName::Gdpo)
            .then_some(self.cfg.trainer.experiment_name.as_str())
    }

    /// Weights posted to the control API apply from this step on.
    /// With data parallelism the API runs on rank 0, which sends the changes to every rank.
    pub(super) fn apply_weight_changes(&mut self, step: u64) -> Result<()> {
        let mut changes = self.control.as_ref().and_then(ControlServer::take_changes);
        if self.comm.world_size() > 1 && self.cfg.reward.control.enable {
            let mut bytes = serde_json::to_vec(&changes).unwrap_or_default();
            self.comm.broadcast_bytes(&mut bytes, 0)?;
            changes = serde_json::from_slice(&bytes)
                .map_err(|e| TrainerError::Other(format!("reward weights from rank 0: {e}")))?;
        }
        if let Some(w) = changes {
            self.reward.set_weights(&w)?;
            tracing::info!("step {step}: reward weights {w:?}");
        }
        Ok(())
    }

    /// The step's prompts and the epoch they belong to.
    pub(super) fn next_prompts(&mut self) -> Result<(Vec<usize>, u64)> {
        let epoch = self.loader.cursor().epoch;
        let prompts = self
            .loader
            .try_next_batch()?
            .ok_or_else(|| TrainerError::Other("the training data holds no full batch".into()))?;
        Ok((prompts, epoch.max(self.loader.cursor().epoch)))
    }

    /// `prompts` rolled out and scored (`gen`, `reward`, ReMax's `gen_max`): this rank's rows.
    pub(super) fn rollout_and_reward(
        &mut self,
        prompts: &[usize],
        t: &mut Timings,
    ) -> Result<StepBatch> {
        let mut batch = t.time("gen", || self.generate(prompts))?;
        let seq_lens: Vec<usize> = (0..batch.len()).map(|r| batch.seq_len(r)).collect();
        self.plan.check_token_budgets(&seq_lens)?;
        t.time("reward", || self.compute_rewards(&mut batch))?;
        if self.cfg.algorithm.adv_estimator == crate::config::AdvEstimator::Remax {
            t.time("gen_max", || self.remax_baselines(&mut batch))?;
        }
        Ok(batch)
    }

    /// The `gen` phase: this rank's rows of the step, from the actor's current weights. Each
    /// rank takes an equal, contiguous share of the step's prompts (whole groups: all `n`
    /// responses of a prompt on one rank, as verl dispatches them).
    pub(super) fn generate(&mut self, prompts: &[usize]) -> Result<StepBatch> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        let share = prompts.len() / world.max(1);
        let mine = &prompts[rank * share..(rank + 1) * share];
        self.rollout
            .generate(&self.actor.rollout_view(), &self.train, mine, rank * share)
    }

    /// Every rank's rows, in rank order (= the step's order), on every rank: the later phases
    /// (advantages with their group and whitening statistics, the KL controller, the data
    /// metrics) then see the whole step, as verl's driver does after its workers return.
    pub(super) fn gather(&self, batch: StepBatch) -> Result<StepBatch> {
        if self.comm.world_size() == 1 {
            return Ok(batch);
        }
        let parts = crate::dist::all_gather_bytes(self.comm.as_ref(), batch.to_bytes())?;
        let parts = parts
            .iter()
            .map(|b| StepBatch::from_bytes(b))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut all = StepBatch::concat(parts)?;
        let view = self.actor.rollout_view();
        all.attach_images(&self.train, &view.args, view.device())?;
        Ok(all)
    }

    /// The `reward` phase: decodes, scores, places the scores on tokens and leaves out the
    /// rows the reward stage excluded.
    pub(super) fn compute_rewards(&mut self, batch: &mut StepBatch) -> Result<()> {
        batch.texts = decode(&self.tokenizer, &batch.responses)?;
        let mut reqs = requests(
            &self.train,
            &batch.sample,
            &batch.texts,
            self.reward_experiment(),
        );
        if let Some(turns) = &batch.turns {
            add_turns_to_requests(&mut reqs, turns);
        }
        let scored = self.reward.score_batch(&reqs, &batch.response_lens())?;
        Ok(batch.add_rewards(scored)?)
    }

    /// The `gen_max` phase (ReMax): one greedy response per prompt, scored; each row gets its
    /// prompt's baseline.
    pub(super) fn remax_baselines(&mut self, batch: &mut StepBatch) -> Result<()> {
        let n = self.plan.n.max(1);
        let firsts: Vec<usize> = batch.sample.iter().step_by(n).copied().collect();
        let responses = self
            .rollout
            .greedy(&self.actor.rollout_view(), &self.train, &firsts)?;
        let texts = decode(&self.tokenizer, &responses)?;
        let lens: Vec<usize> = responses.iter().map(Vec::len).collect();
        let scored = self.reward.score(
            &requests(&self.train, &firsts, &texts, self.reward_experiment()),
            &lens,
        )?;
        batch.reward_baselines = Some(
            (0..batch.len())
                .map(|row| scored[row / n].score.unwrap_or(0.0))
                .collect(),
        );
        Ok(())
    }

    /// Where this step's old log-probs come from. An on-policy update's own forward gives
    /// them (verl computes them in a pass of their own, whose values the on-policy update then
    /// ignores), so the pass is skipped when nothing reads them before the update: no KL in the
    /// reward, and the actor's rule for it holds (counting the step's rows over all ranks, as
    /// the reward may have left rows out).
    /// Rollout correction reads them before the update too; in bypass mode they are the
    /// rollout's. `actor.calculate_sum_pi_squared` asks the pass for Σπ² (read by the
    /// optimal token baselines before the update and by the variance-proxy metrics): the pass
    /// runs.
    pub(super) fn old_log_probs(&self, batch: &StepBatch) -> Result<OldLogProbs> {
        let corr = self.plan.rollout_correction.as_ref();
        if corr.is_some_and(|c| c.bypass.is_some()) {
            return Ok(OldLogProbs::Rollout);
        }
        let step_rows = crate::dist::sum_count(self.comm.as_ref(), batch.len())?;
        let from_update = !self.cfg.algorithm.use_kl_in_reward
            && !self.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
            && !corr.is_some_and(|c| c.corrects())
            && self.actor.update_replaces_old_log_prob(step_rows);
        Ok(if from_update {
            OldLogProbs::FromUpdate
        } else {
            OldLogProbs::Pass
        })
    }

    /// `trainer.balance_batch`: the update order that evens out the micro-batches' tokens, and
    /// verl's `global_seqlen/*` metrics. With `actor.use_prefix_grouper` the rows keep their
    /// order, each group together (verl balances whole groups across ranks and then leaves
    /// each rank's rows in order; with one rank that is the row order).
    pub(super) fn balance(&self, batch: &mut StepBatch) -> Vec<(String, f64)> {
        let seqlens: Vec<usize> = (0..batch.len()).map(|r| batch.seq_len(r)).collect();
        batch.update_order = match self.cfg.actor_rollout_ref.actor.use_prefix_grouper {
            true => None,
            false => Some(super::micro::balanced_order(&seqlens)),
        };
        super::micro::seqlen_metrics(&seqlens)
    }

    /// `update_critic`, then `update_actor` once `critic_warmup` steps have passed. Old
    /// log-probs the update was to give are computed by their pass when the actor does not
    /// update (critic warm-up).
    pub(super) fn update_models(
        &mut self,
        batch: &mut StepBatch,
        step: u64,
        old: OldLogProbs,
        t: &mut Timings,
        m: &mut Metrics,
    ) -> Result<()> {
        if let Some(c) = self.critic.as_mut() {
            m.extend(t.time("update_critic", || c.update(batch, step))?);
        }
        let from_update = old == OldLogProbs::FromUpdate;
        if self.cfg.trainer.critic_warmup as u64 <= step {
            m.extend(t.time("update_actor", || {
                if from_update {
                    self.actor.update_filling_old_log_prob(batch, step)
                } else {
                    self.actor.update(batch, step)
                }
            })?);
        } else if from_update {
            t.time("old_log_prob", || self.actor.compute_log_prob(batch))?;
        }
        Ok(())
    }

    /// The `adv` phase: token-level rewards, rollout correction (when the old log-probs are
    /// known by now, outside bypass mode), advantages and returns; then, with
    /// `algorithm.use_pf_ppo`, the batch drawn again from its rows (verl's place for it, inside
    /// `compute_advantage`).
    pub(super) fn compute_advantages(
        &mut self,
        batch: &mut StepBatch,
        step: u64,
    ) -> Result<Metrics> {
        let corr = self
            .plan
            .rollout_correction
            .as_ref()
            .filter(|c| c.bypass.is_none() && batch.has(Column::OldLogProbs));
        let mut correct = |b: &mut StepBatch| match corr {
            Some(c) => super::rollout_corr::apply_with_diagnostics(&c.correction, b),
            None => Ok(Metrics::new()),
        };
        let m = advantage::compute(&self.cfg.algorithm, &mut self.kl_ctrl, batch, &mut correct)?;
        if self.cfg.algorithm.use_pf_ppo {
            let seed = self.plan.seeds.pf_ppo;
            *batch = advantage::pf_ppo_resample(&self.cfg.algorithm.pf_ppo, batch, seed, step)?;
        }
        Ok(m)
    }

    /// The rollout-correction diagnostics of a step whose old log-probs came from the update
    /// (nothing corrected: the metrics only).
    pub(super) fn rollout_diagnostics_after_update(
        &self,
        batch: &mut StepBatch,
    ) -> Result<Metrics> {
        match &self.plan.rollout_correction {
            Some(c) if !c.corrects() && batch.has(Column::OldLogProbs) => Ok(
                super::rollout_corr::apply_with_diagnostics(&c.correction, batch)?,
            ),
            _ => Ok(Metrics::new()),
        }
    }

    /// After the updates, in verl's order (`RayPPOTrainer.fit`): validation every `test_freq`
    /// steps, then a checkpoint every `save_freq` steps (both at the last step).
    pub(super) fn validate_and_save(
        &mut self,
        step: u64,
        t: &mut Timings,
        m: &mut Metrics,
    ) -> Result<()> {
        let last = step == self.total_steps;
        if let (Some(freq), true) = (self.cfg.trainer.test_freq, self.val.is_some()) {
            if last || step.is_multiple_of(freq) {
                match t.time("testing", || self.validate()) {
                    // The step is complete: its checkpoint is saved (below, or by the stop
                    // that follows it); only the validation's metrics are missing.
                    Err(TrainerError::Stopped { .. }) => tracing::warn!(
                        "validation after step {step} stopped on request: its metrics are not reported"
                    ),
                    v => m.extend(v?),
                }
            }
        }
        if let Some(freq) = self.cfg.trainer.save_freq {
            if last || step.is_multiple_of(freq) {
                t.time("save_checkpoint", || self.save_checkpoint())?;
            }
        }
        Ok(())
    }

    /// verl's data, reward, timing and throughput metrics of the step; `elapsed`: the step's
    /// seconds without validation and checkpointing (verl's `step` timer).
    pub(super) fn step_metrics(
        &self,
        batch: &StepBatch,
        epoch: u64,
        elapsed: f64,
        mut timing: Timings,
        m: &mut Metrics,
    ) -> Result<()> {
        let actor = &self.cfg.actor_rollout_ref.actor;
        step_metrics::data_metrics(
            m,
            batch,
            &self.plan,
            actor.loss_agg_mode,
            actor.loss_scale_factor,
        )?;
        step_metrics::reward_metrics(m, &self.reward, &batch.rewards);
        step_metrics::variance_proxy_metrics(m, batch)?;
        if let Some(turns) = &batch.turns {
            step_metrics::agent_metrics(m, turns);
        }
        m.insert("training/global_step".into(), self.global_step as f64);
        m.insert("training/epoch".into(), epoch as f64);
        timing.seconds.insert("step", elapsed);
        let response_tokens: usize = batch.response_lens().iter().sum();
        let all_tokens: usize = (0..batch.len()).map(|r| batch.seq_len(r)).sum();
        timing.write(m, response_tokens, all_tokens);
        m.insert("perf/total_num_tokens".into(), all_tokens as f64);
        m.insert("perf/time_per_step".into(), elapsed);
        m.insert(
            "perf/throughput".into(),
            all_tokens as f64 / elapsed.max(1e-9),
        );
        if let Some(b) = crate::metrics::peak_rss_bytes() {
            m.insert(
                "perf/max_memory_rss_gb".into(),
                b as f64 / (1u64 << 30) as f64,
            );
        }
        // verl's device memory metrics (PyTorch's max_memory_allocated / _reserved since the
        // start, in GiB): the peaks of the memory pool every CUDA tensor is allocated from.
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(d) = self.actor.device() {
            let (used, reserved) = crate::kernels::cuda::memory::peaks(d)?;
            let gib = (1u64 << 30) as f64;
            m.insert("perf/max_memory_allocated_gb".into(), used as f64 / gib);
            m.insert("perf/max_memory_reserved_gb".into(), reserved as f64 / gib);
        }
        Ok(())
    }
}
