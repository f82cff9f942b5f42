//! Cross-key rules and derived sizes: verl's `validate_config` and the worker-side batch
//! normalisation (`verl/utils/config.py`, `ActorConfig`/`CriticConfig.__post_init__`,
//! `fsdp_workers.py`), plus the `${oc.select:...}` fallbacks resolved in code.
//! Every message names the keys involved and the rule.

use crate::util::expand_home;
use std::path::PathBuf;

use super::reward::RewardPlan;
use super::{AdvEstimator, Config, ConfigError, LossAggMode, PolicyLossMode};

/// How a pass over many sequences is cut into forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatching {
    /// A fixed number of sequences per forward pass.
    Sequences(usize),
    /// As many sequences as fit in a token budget.
    TokenBudget(usize),
}

impl MicroBatching {
    pub fn describe(&self) -> String {
        match self {
            MicroBatching::Sequences(n) => format!("{n} sequences per forward pass"),
            MicroBatching::TokenBudget(t) => {
                format!("up to {t} tokens per forward pass (use_dynamic_bsz)")
            }
        }
    }
}

/// The batch arithmetic of one model's PPO update.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdatePlan {
    /// Prompts per mini-batch (the configured ppo_mini_batch_size).
    pub mini_batch_prompts: usize,
    /// Responses per mini-batch (× rollout.n).
    pub mini_batch_responses: usize,
    /// Mini-batches (optimizer steps) per epoch over one training step's data.
    pub mini_batches_per_epoch: usize,
    pub micro: MicroBatching,
    /// Micro-batches accumulated per optimizer step (known for fixed micro-batches).
    pub grad_accum: Option<usize>,
    pub epochs: usize,
    pub loss_agg_mode: LossAggMode,
    pub shuffle: bool,
    pub grad_clip: f64,
    /// `trainer.use_legacy_worker_impl=disable`: micro-batch losses normalised by the whole
    /// mini-batch's counts (verl's engine workers); otherwise by their own counts and scaled by
    /// 1/gradient_accumulation (verl's default dp_actor/dp_critic).
    pub global_norm: bool,
}

impl UpdatePlan {
    /// Optimizer steps per training step.
    pub fn optimizer_steps_per_step(&self) -> usize {
        self.mini_batches_per_epoch * self.epochs
    }

    /// Whether an update over `rows` responses is on-policy as verl's `update_policy` decides
    /// it (default loss path, one epoch, one mini-batch): its only optimizer step comes after
    /// every forward, so the current log-probs are the old ones.
    pub fn on_policy(&self, rows: usize) -> bool {
        !self.global_norm
            && self.epochs == 1
            && rows.div_ceil(self.mini_batch_responses.max(1)) == 1
    }
}

/// Everything derived from a [`Config`] that the trainer needs and `config check` prints.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub prompt_length: usize,
    pub response_length: usize,
    /// Responses per prompt.
    pub n: usize,
    pub train_batch_size: usize,
    /// Prompts per generation batch (`data.gen_batch_size`, else train_batch_size): the
    /// loader's batch size.
    pub gen_batch_size: usize,
    /// DAPO's dynamic sampling (`algorithm.filter_groups.enable`); None = off.
    pub filter_groups: Option<FilterPlan>,
    /// Rollout correction and its diagnostics; None when the rollout keeps no log-probs
    /// (`actor_rollout_ref.rollout.calculate_log_probs=false`).
    pub rollout_correction: Option<RolloutCorrPlan>,
    pub actor: UpdatePlan,
    /// None when there is no critic.
    pub critic: Option<UpdatePlan>,
    /// Forward passes of the old-log-prob recomputation.
    pub log_prob_micro: MicroBatching,
    /// Forward passes of the reference model (None when there is no reference).
    pub ref_log_prob_micro: Option<MicroBatching>,
    /// Forward passes of the critic's value computation.
    pub critic_forward_micro: Option<MicroBatching>,
    pub need_reference: bool,
    pub need_critic: bool,
    /// Checkpoint root.
    pub default_local_dir: PathBuf,
    /// Every seed of the run.
    pub seeds: Seeds,
    /// The sampling temperatures and the one log-probs are computed at.
    pub temperatures: Temperatures,
    /// The reward stage, its rules checked.
    pub reward: RewardPlan,
    /// The token budgets of the passes cut by tokens (`use_dynamic_bsz`): the key and its value.
    /// verl checks each real micro-batch against them at run time; so does the trainer
    /// ([`Plan::check_token_budgets`]).
    pub token_budgets: Vec<(String, usize)>,
    /// On-policy distillation (`distillation.enabled`); None = off.
    pub distillation: Option<super::DistillPlan>,
    /// Non-fatal findings (printed as warnings).
    pub warnings: Vec<String>,
}

/// DAPO's dynamic sampling as the trainer runs it (`algorithm.filter_groups`).
#[derive(Debug, Clone, PartialEq)]
pub struct FilterPlan {
    /// The value a kept group's responses must differ in (`algorithm.filter_groups.metric`).
    pub metric: String,
    /// Generation batches one step may draw (`max_num_gen_batches`); None = no limit.
    pub max_num_gen_batches: Option<u64>,
}

/// `algorithm.rollout_correction` as the trainer applies it.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrPlan {
    /// IS weights and rejection (both off: the `rollout_corr/*` diagnostics only).
    pub correction: super::rollout_corr::Correction,
    /// `bypass_mode`: the rollout's log-probs are the old ones (no old-log-prob pass), with
    /// this loss.
    pub bypass: Option<BypassLoss>,
}

impl RolloutCorrPlan {
    /// Whether the update reads anything of it (IS weights, a rejection mask or bypass mode).
    pub fn corrects(&self) -> bool {
        self.correction.is.is_some() || !self.correction.rs.is_empty() || self.bypass.is_some()
    }
}

/// `algorithm.rollout_correction.loss_type` in bypass mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BypassLoss {
    /// The configured policy loss with the rollout's log-probs as the old ones.
    PpoClip,
    /// −w·log π·A with the IS weights w.
    Reinforce,
}

/// Every seed a run draws from, resolved once: each stream of randomness reads its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seeds {
    /// The training prompts' shuffle: `data.seed`, else `trainer.seed`.
    pub data: u64,
    /// The training sampler (`actor_rollout_ref.rollout.seed`); validation mixes in the step.
    pub rollout: u64,
    /// The actor's mini-batch shuffle and clip_cov draws
    /// (`actor_rollout_ref.actor.data_loader_seed`).
    pub actor: u64,
    /// The critic's mini-batch shuffle (`critic.data_loader_seed`).
    pub critic: u64,
    /// A fresh critic value head's initial weights (`trainer.seed`).
    pub value_head: u64,
    /// PF-PPO's draws, with the step mixed in (`trainer.seed`).
    pub pf_ppo: u64,
}

/// Sampling temperatures (0 = greedy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Temperatures {
    /// Training rollouts (`actor_rollout_ref.rollout.temperature`).
    pub rollout: f64,
    /// What old, reference and update log-probs divide logits by: the rollout temperature the
    /// tokens were sampled at, or 1 for greedy rollouts (which sample from no distribution).
    pub log_prob: f64,
    /// Validation (`actor_rollout_ref.rollout.val_kwargs.temperature`).
    pub validation: f64,
}

/// [`Seeds`] and [`Temperatures`] from their keys.
fn seeds_and_temperatures(cfg: &Config) -> (Seeds, Temperatures) {
    let r = &cfg.actor_rollout_ref.rollout;
    let seeds = Seeds {
        data: cfg.data.seed.unwrap_or(cfg.trainer.seed),
        rollout: r.seed,
        actor: cfg.actor_rollout_ref.actor.data_loader_seed,
        critic: cfg.critic.data_loader_seed,
        value_head: cfg.trainer.seed,
        pf_ppo: cfg.trainer.seed,
    };
    let temperatures = Temperatures {
        rollout: r.temperature,
        log_prob: if r.temperature <= 0.0 {
            1.0
        } else {
            r.temperature
        },
        validation: r.val_kwargs.temperature,
    };
    (seeds, temperatures)
}

impl Plan {
    /// Responses per training step.
    pub fn responses_per_step(&self) -> usize {
        self.train_batch_size * self.n
    }

    /// Training steps per epoch for a data set of `rows` prompts: the loader's batches
    /// (`gen_batch_size` prompts each, the last partial one dropped), as verl counts them. With
    /// dynamic sampling a step may draw several batches, so an epoch then holds fewer steps.
    pub fn steps_per_epoch(&self, rows: usize) -> usize {
        rows / self.gen_batch_size.max(1)
    }

    /// A step's sequences (prompt + response tokens of each batch row) against the token
    /// budgets: one sequence longer than a budget cannot fit any micro-batch of that pass, which
    /// stops verl's run too (`rearrange_micro_batches`). The error names the row and the key.
    pub fn check_token_budgets(&self, seq_lens: &[usize]) -> Result<(), ConfigError> {
        for (key, budget) in &self.token_budgets {
            if let Some((row, len)) = seq_lens.iter().enumerate().find(|(_, l)| **l > *budget) {
                return Err(ConfigError::Value {
                    key: key.clone(),
                    message: format!(
                        "batch row {row} has {len} prompt + response tokens, more than `{key}` ({budget}): a micro-batch must hold one whole sequence; raise `{key}` to at least the longest sequence ({} tokens)",
                        self.prompt_length + self.response_length
                    ),
                });
            }
        }
        Ok(())
    }
}

/// The token budgets in use (see [`Plan::token_budgets`]), and a warning for each that is
/// below the longest possible sequence.
fn token_budgets(cfg: &Config, plan: &Plan, warnings: &mut Vec<String>) -> Vec<(String, usize)> {
    let (rollout, reference, critic) = (
        &cfg.actor_rollout_ref.rollout,
        &cfg.actor_rollout_ref.reference,
        &cfg.critic,
    );
    let own_or_actor = |own: Option<usize>, key: &str| match own {
        Some(_) => key.to_string(),
        None => format!("{A}.ppo_max_token_len_per_gpu"),
    };
    let mut passes = vec![
        (
            Some(plan.actor.micro),
            format!("{A}.ppo_max_token_len_per_gpu"),
        ),
        (
            Some(plan.log_prob_micro),
            own_or_actor(
                rollout.log_prob_max_token_len_per_gpu,
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            ),
        ),
        (
            plan.ref_log_prob_micro,
            own_or_actor(
                reference.log_prob_max_token_len_per_gpu,
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            ),
        ),
        (
            plan.critic.as_ref().map(|c| c.micro),
            "critic.ppo_max_token_len_per_gpu".to_string(),
        ),
    ];
    let forward_key = match critic.forward_max_token_len_per_gpu {
        Some(_) => "critic.forward_max_token_len_per_gpu",
        None => "critic.ppo_max_token_len_per_gpu",
    };
    passes.push((plan.critic_forward_micro, forward_key.to_string()));
    let longest = plan.prompt_length + plan.response_length;
    let mut out: Vec<(String, usize)> = Vec::new();
    for (micro, key) in passes {
        let Some(MicroBatching::TokenBudget(budget)) = micro else {
            continue;
        };
        if out.iter().any(|(k, _)| *k == key) {
            continue;
        }
        if budget < longest {
            warnings.push(format!(
                "`{key}` ({budget}) is below the longest possible sequence ({longest} = prompt + response budgets): a step whose sequence is longer than it stops with an error naming the row, as verl's does"
            ));
        }
        out.push((key, budget));
    }
    out
}

const A: &str = "actor_rollout_ref.actor";

/// Exactly one of a deprecated global micro-batch key and its `_per_gpu` form, unless dynamic.
fn one_micro_key(
    errors: &mut Vec<String>,
    global_key: &str,
    global: Option<usize>,
    per_gpu_key: &str,
    per_gpu: Option<usize>,
    dynamic: bool,
    budget: usize,
) -> MicroBatching {
    if dynamic {
        return MicroBatching::TokenBudget(budget);
    }
    match (global, per_gpu) {
        (Some(_), Some(_)) => {
            errors.push(format!(
                "`{global_key}` and `{per_gpu_key}` are both set; set only `{per_gpu_key}` (`{global_key}` is deprecated)"
            ));
            MicroBatching::Sequences(1)
        }
        (None, None) => {
            errors.push(format!(
                "set `{per_gpu_key}` (sequences per forward pass), or use_dynamic_bsz=True; neither it nor the deprecated `{global_key}` is set"
            ));
            MicroBatching::Sequences(1)
        }
        // One device: the global micro-batch size is the per-device one.
        (Some(n), None) | (None, Some(n)) => {
            if n == 0 {
                errors.push(format!(
                    "`{}` must be at least 1",
                    if global.is_some() {
                        global_key
                    } else {
                        per_gpu_key
                    }
                ));
                MicroBatching::Sequences(1)
            } else {
                MicroBatching::Sequences(n)
            }
        }
    }
}

/// Applies verl's validation rules and derives the [`Plan`]. All violations are reported together.
pub fn resolve(cfg: &Config) -> Result<Plan, ConfigError> {
    let mut f = Findings::default();
    let l = lengths(&mut f.errors, cfg);
    let actor = actor_rules(&mut f, cfg, &l);
    let log_prob_micro = rollout_rules(&mut f.errors, cfg);
    let (need_reference, ref_log_prob_micro) = reference_rules(&mut f, cfg);
    algorithm_rules(&mut f, cfg, l.n);
    let (gen_batch_size, filter_groups) = filter_groups_rules(&mut f, cfg, &l);
    sampler_rules(&mut f, cfg);
    let rollout_correction = rollout_corr_rules(&mut f, cfg);
    let (need_critic, critic, critic_forward_micro) = critic_rules(&mut f.errors, cfg, &l);
    let reward = reward_rules(&mut f.errors, cfg);
    let context = l.prompt_length + l.response_length;
    let distillation = super::distillation::rules(&mut f.errors, &mut f.warnings, cfg, context);
    let default_local_dir = trainer_rules(&mut f, cfg);
    f.warnings
        .extend(cfg.actor_rollout_ref.rollout.multi_turn.warnings());
    let (seeds, temperatures) = seeds_and_temperatures(cfg);
    let (true, Some(reward)) = (f.errors.is_empty(), reward) else {
        return Err(ConfigError::Invalid(f.errors));
    };
    let mut plan = Plan {
        prompt_length: l.prompt_length,
        response_length: l.response_length,
        n: l.n,
        train_batch_size: l.train_batch_size,
        gen_batch_size,
        filter_groups,
        rollout_correction,
        actor,
        critic,
        log_prob_micro,
        ref_log_prob_micro,
        critic_forward_micro,
        need_reference,
        need_critic,
        default_local_dir,
        seeds,
        temperatures,
        reward,
        token_budgets: Vec::new(),
        distillation,
        warnings: f.warnings,
    };
    let mut warnings = std::mem::take(&mut plan.warnings);
    plan.token_budgets = token_budgets(cfg, &plan, &mut warnings);
    plan.warnings = warnings;
    Ok(plan)
}

/// Rule violations (fatal, reported together) and warnings found so far.
#[derive(Default)]
struct Findings {
    errors: Vec<String>,
    warnings: Vec<String>,
}

/// The step's sizes every section's rules read.
struct Lengths {
    prompt_length: usize,
    response_length: usize,
    /// Responses per prompt (at least 1).
    n: usize,
    train_batch_size: usize,
}

/// The prompt and response budgets alone (`data.max_prompt_length`/`max_response_length`,
/// the rollout's `prompt_length`/`response_length` winning), under the same rules as in
/// [`resolve`]: what `generate` needs of a configuration that need not be one training accepts.
pub fn sequence_budgets(cfg: &Config) -> Result<(usize, usize), ConfigError> {
    let mut errors = Vec::new();
    let budgets = budgets(&mut errors, cfg);
    if errors.is_empty() {
        Ok(budgets)
    } else {
        Err(ConfigError::Invalid(errors))
    }
}

/// The prompt and response budgets and their rules.
fn budgets(errors: &mut Vec<String>, cfg: &Config) -> (usize, usize) {
    let (data, rollout) = (&cfg.data, &cfg.actor_rollout_ref.rollout);
    let prompt_length = rollout
        .prompt_length
        .map(|v| v as usize)
        .unwrap_or(data.max_prompt_length);
    let response_length = rollout
        .response_length
        .map(|v| v as usize)
        .unwrap_or(data.max_response_length);
    if prompt_length == 0 {
        errors.push("`data.max_prompt_length` (or `actor_rollout_ref.rollout.prompt_length`) must be at least 1".into());
    }
    if response_length == 0 {
        errors.push("`data.max_response_length` (or `actor_rollout_ref.rollout.response_length`) must be at least 1".into());
    }
    errors.extend(super::data::length_errors(prompt_length, response_length));
    (prompt_length, response_length)
}

/// `data.*` lengths and batch size, `rollout.n`.
fn lengths(errors: &mut Vec<String>, cfg: &Config) -> Lengths {
    let (data, rollout) = (&cfg.data, &cfg.actor_rollout_ref.rollout);
    let (prompt_length, response_length) = budgets(errors, cfg);
    if rollout.n == 0 {
        errors.push("`actor_rollout_ref.rollout.n` must be at least 1".into());
    }
    errors.extend(rollout.multi_turn.check(&rollout.agent));
    if data.train_batch_size == 0 {
        errors.push("`data.train_batch_size` must be at least 1".into());
    }
    if cfg.actor_rollout_ref.model.fsdp_config != Default::default() {
        errors.push("`actor_rollout_ref.model.fsdp_config` is not read: the actor's mixed precision is `actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype`, the rollout's `actor_rollout_ref.rollout.dtype`".into());
    }
    Lengths {
        prompt_length,
        response_length,
        n: rollout.n.max(1),
        train_batch_size: data.train_batch_size,
    }
}

/// `loss_scale_factor` is read only by verl's engine workers (`use_legacy_worker_impl=disable`).
fn unread_loss_scale_factors(warnings: &mut Vec<String>, cfg: &Config) {
    if !cfg.trainer.use_legacy_worker_impl.global_norm() {
        for (key, set) in [
            (
                format!("{A}.loss_scale_factor"),
                cfg.actor_rollout_ref.actor.loss_scale_factor,
            ),
            (
                "critic.loss_scale_factor".to_string(),
                cfg.critic.loss_scale_factor,
            ),
        ] {
            if let Some(v) = set {
                warnings.push(format!(
                    "`{key}` ({v}) is read only with `trainer.use_legacy_worker_impl=disable` (as in verl); verl's default workers divide seq-mean-token-sum-norm losses by the response length"
                ));
            }
        }
    }
}

/// `actor_rollout_ref.actor.*`: batching, clipping, loss and optimizer rules; the actor's
/// update plan.
fn actor_rules(f: &mut Findings, cfg: &Config, l: &Lengths) -> UpdatePlan {
    let Findings { errors, warnings } = f;
    let actor = &cfg.actor_rollout_ref.actor;
    let (n, tbs) = (l.n, l.train_batch_size);
    let mini = actor.ppo_mini_batch_size;
    if mini == 0 {
        errors.push(format!("`{A}.ppo_mini_batch_size` must be at least 1"));
    } else if tbs < mini {
        errors.push(format!(
            "`data.train_batch_size` ({tbs}) must be >= `{A}.ppo_mini_batch_size` ({mini}); both count prompts"
        ));
    } else if !tbs.is_multiple_of(mini) {
        errors.push(format!(
            "`data.train_batch_size` ({tbs}) must be divisible by `{A}.ppo_mini_batch_size` ({mini}) so each step splits into whole mini-batches"
        ));
    }
    let actor_micro = one_micro_key(
        errors,
        &format!("{A}.ppo_micro_batch_size"),
        actor.ppo_micro_batch_size,
        &format!("{A}.ppo_micro_batch_size_per_gpu"),
        actor.ppo_micro_batch_size_per_gpu,
        actor.use_dynamic_bsz,
        actor.ppo_max_token_len_per_gpu,
    );
    let mini_resp = mini * n;
    let actor_accum = micro_divides(
        errors,
        &format!("{A}.ppo_mini_batch_size"),
        mini,
        n,
        actor_micro,
        &format!("{A}.ppo_micro_batch_size_per_gpu"),
    );
    if actor.ppo_epochs == 0 {
        errors.push(format!("`{A}.ppo_epochs` must be at least 1"));
    }
    if actor.clip_ratio_c <= 1.0 {
        errors.push(format!(
            "`{A}.clip_ratio_c` ({}) must be > 1 (dual-clip lower bound for negative advantages)",
            actor.clip_ratio_c
        ));
    }
    for (key, v) in [
        ("clip_ratio", actor.clip_ratio),
        ("clip_ratio_low", actor.clip_low()),
        ("clip_ratio_high", actor.clip_high()),
    ] {
        if !(v >= 0.0 && v.is_finite()) {
            errors.push(format!("`{A}.{key}` ({v}) must be a non-negative number"));
        }
    }
    if actor.loss_agg_mode == LossAggMode::SeqMeanTokenSumNorm {
        if let Some(f) = actor.loss_scale_factor {
            if f <= 0.0 {
                errors.push(format!("`{A}.loss_scale_factor` ({f}) must be > 0"));
            }
        }
    }
    unread_loss_scale_factors(warnings, cfg);
    if actor.policy_loss.loss_mode == PolicyLossMode::Dro
        && !actor
            .policy_loss
            .dro_beta
            .is_some_and(|b| b > 0.0 && b.is_finite())
    {
        errors.push(format!(
            "`{A}.policy_loss.loss_mode=dro` needs `{A}.policy_loss.dro_beta` > 0 (the weight of its quadratic log-ratio penalty); it is {}",
            actor.policy_loss.dro_beta.map_or("null".to_string(), |b| b.to_string())
        ));
    }
    if actor.policy_loss.loss_mode == PolicyLossMode::Gspo
        && actor.loss_agg_mode != LossAggMode::SeqMeanTokenMean
    {
        warnings.push(format!(
            "`{A}.policy_loss.loss_mode=gspo` always aggregates seq-mean-token-mean (as verl); `{A}.loss_agg_mode` ({}) is not used by the policy loss",
            actor.loss_agg_mode.as_str()
        ));
    }
    check_optim(errors, &format!("{A}.optim"), &actor.optim);
    if actor.optim.clip_grad != 1.0
        && actor.grad_clip != 1.0
        && actor.optim.clip_grad != actor.grad_clip
    {
        errors.push(format!(
            "`{A}.grad_clip` ({}) and `{A}.optim.clip_grad` ({}) disagree; they are two spellings of one setting",
            actor.grad_clip, actor.optim.clip_grad
        ));
    }
    let actor_clip = if actor.grad_clip != 1.0 {
        actor.grad_clip
    } else {
        actor.optim.clip_grad
    };
    if !(actor_clip.is_finite() && actor_clip > 0.0) {
        errors.push(format!(
            "`{A}.grad_clip` ({actor_clip}) must be a positive number (the largest gradient norm kept)"
        ));
    }

    UpdatePlan {
        mini_batch_prompts: mini,
        mini_batch_responses: mini_resp,
        mini_batches_per_epoch: tbs.checked_div(mini).unwrap_or(0),
        micro: actor_micro,
        grad_accum: actor_accum,
        epochs: actor.ppo_epochs,
        loss_agg_mode: actor.loss_agg_mode,
        shuffle: actor.shuffle,
        grad_clip: actor_clip,
        global_norm: cfg.trainer.use_legacy_worker_impl.global_norm(),
    }
}

/// `actor_rollout_ref.rollout.*`: sampling settings; the old-log-prob forward passes.
fn rollout_rules(errors: &mut Vec<String>, cfg: &Config) -> MicroBatching {
    let (actor, rollout) = (&cfg.actor_rollout_ref.actor, &cfg.actor_rollout_ref.rollout);
    if rollout.temperature < 0.0 || !rollout.temperature.is_finite() {
        errors.push(format!(
            "`actor_rollout_ref.rollout.temperature` ({}) must be >= 0",
            rollout.temperature
        ));
    }
    let util = rollout.gpu_memory_utilization;
    if !(util > 0.0 && util <= 1.0) {
        errors.push(format!(
            "`actor_rollout_ref.rollout.gpu_memory_utilization` ({util}) must be in (0, 1]: the share of a GPU's memory generation's keys and values may fill"
        ));
    }
    if !(rollout.top_p > 0.0 && rollout.top_p <= 1.0) {
        errors.push(format!(
            "`actor_rollout_ref.rollout.top_p` ({}) must be in (0, 1]",
            rollout.top_p
        ));
    }
    if rollout.top_k < -1 {
        errors.push(format!(
            "`actor_rollout_ref.rollout.top_k` ({}) must be -1 (off) or >= 0",
            rollout.top_k
        ));
    }
    let vk = &rollout.val_kwargs;
    if vk.do_sample && rollout.temperature <= 0.0 {
        errors.push("`actor_rollout_ref.rollout.val_kwargs.do_sample=True` requires `actor_rollout_ref.rollout.temperature` > 0 (verl's rule)".into());
    }
    if vk.n == 0 {
        errors.push("`actor_rollout_ref.rollout.val_kwargs.n` must be at least 1".into());
    }
    if !(vk.top_p > 0.0 && vk.top_p <= 1.0) {
        errors.push(format!(
            "`actor_rollout_ref.rollout.val_kwargs.top_p` ({}) must be in (0, 1]",
            vk.top_p
        ));
    }
    one_micro_key(
        errors,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size",
        rollout.log_prob_micro_batch_size,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        rollout.log_prob_micro_batch_size_per_gpu,
        rollout
            .log_prob_use_dynamic_bsz
            .unwrap_or(actor.use_dynamic_bsz),
        rollout
            .log_prob_max_token_len_per_gpu
            .unwrap_or(actor.ppo_max_token_len_per_gpu),
    )
}

/// `actor_rollout_ref.ref.*`: whether a reference is loaded, and its forward passes.
fn reference_rules(f: &mut Findings, cfg: &Config) -> (bool, Option<MicroBatching>) {
    let Findings { errors, warnings } = f;
    let (arr, algo) = (&cfg.actor_rollout_ref, &cfg.algorithm);
    let actor = &arr.actor;
    let need_reference = actor.use_kl_loss || algo.use_kl_in_reward;
    if actor.use_kl_loss && algo.use_kl_in_reward {
        warnings.push(format!(
            "both `algorithm.use_kl_in_reward` and `{A}.use_kl_loss` are on: the KL is penalised twice (in the reward and as a loss)"
        ));
    }
    let reference = &arr.reference;
    let ref_log_prob_micro = need_reference.then(|| {
        one_micro_key(
            errors,
            "actor_rollout_ref.ref.log_prob_micro_batch_size",
            reference.log_prob_micro_batch_size,
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            reference.log_prob_micro_batch_size_per_gpu,
            reference
                .log_prob_use_dynamic_bsz
                .unwrap_or(actor.use_dynamic_bsz),
            reference
                .log_prob_max_token_len_per_gpu
                .unwrap_or(actor.ppo_max_token_len_per_gpu),
        )
    });

    (need_reference, ref_log_prob_micro)
}

/// `algorithm.*`: the KL controller, GAE's factors, the estimator against `rollout.n`.
fn algorithm_rules(f: &mut Findings, cfg: &Config, n: usize) {
    otb_rules(f, cfg);
    let Findings { errors, warnings } = f;
    let algo = &cfg.algorithm;
    if algo.use_kl_in_reward
        && algo.kl_ctrl.kind == super::KlCtrlType::Adaptive
        && algo.kl_ctrl.horizon <= 0.0
    {
        errors.push(format!(
            "`algorithm.kl_ctrl.horizon` ({}) must be > 0 for the adaptive controller",
            algo.kl_ctrl.horizon
        ));
    }
    if algo.kl_ctrl.kl_coef < 0.0 {
        errors.push(format!(
            "`algorithm.kl_ctrl.kl_coef` ({}) must be >= 0",
            algo.kl_ctrl.kl_coef
        ));
    }
    if !(0.0..=1.0).contains(&algo.gamma) || !(0.0..=1.0).contains(&algo.lam) {
        errors.push(format!(
            "`algorithm.gamma` ({}) and `algorithm.lam` ({}) must be in [0, 1]",
            algo.gamma, algo.lam
        ));
    }
    if algo.adv_estimator == AdvEstimator::GrpoPassk && n < 2 {
        errors.push(format!(
            "`algorithm.adv_estimator=grpo_passk` needs at least 2 responses per prompt; `actor_rollout_ref.rollout.n` is {n}"
        ));
    }
    gdpo_rules(errors, algo);
    pf_ppo_rules(errors, algo);
    if matches!(
        algo.adv_estimator,
        AdvEstimator::Grpo
            | AdvEstimator::Rloo
            | AdvEstimator::RlooVectorized
            | AdvEstimator::Gdpo
            | AdvEstimator::OptimalTokenBaseline
            | AdvEstimator::TirOptimalTokenBaseline
    ) && n == 1
    {
        warnings.push(format!(
            "`algorithm.adv_estimator={}` compares responses to the same prompt, but `actor_rollout_ref.rollout.n` is 1",
            algo.adv_estimator.as_str()
        ));
    }
}

/// The optimal token baselines read Σπ² from the old-log-prob pass: verl asserts
/// `actor_rollout_ref.actor.calculate_sum_pi_squared` (here a configuration error, before
/// anything runs), and bypass mode has no such pass (verl fails at its first step).
fn otb_rules(f: &mut Findings, cfg: &Config) {
    const SPI2: &str = "actor_rollout_ref.actor.calculate_sum_pi_squared";
    let algo = &cfg.algorithm;
    let on = cfg.actor_rollout_ref.actor.calculate_sum_pi_squared;
    let bypass = algo.rollout_correction.bypass_mode;
    if matches!(
        algo.adv_estimator,
        AdvEstimator::OptimalTokenBaseline | AdvEstimator::TirOptimalTokenBaseline
    ) {
        let est = algo.adv_estimator.as_str();
        if !on {
            f.errors.push(format!(
                "`algorithm.adv_estimator={est}` needs `{SPI2}=True`: its baseline weighs each response by the path variance Σ(1 − 2π_t + Σπ²), and Σπ² comes from the old-log-prob pass"
            ));
        }
        if bypass {
            f.errors.push(format!(
                "`algorithm.adv_estimator={est}` cannot run with `algorithm.rollout_correction.bypass_mode=true`: bypass mode has no old-log-prob pass to compute Σπ² (`{SPI2}`) in"
            ));
        }
    } else if on && bypass {
        f.warnings.push(format!(
            "`{SPI2}=True` computes nothing with `algorithm.rollout_correction.bypass_mode=true` (no old-log-prob pass): no variance_proxy/* metrics"
        ));
    }
}

/// `algorithm.gdpo_reward_keys` / `gdpo_reward_weights`: needed by gdpo (as in verl), one weight
/// per key, and never set without it (they would change nothing).
fn gdpo_rules(errors: &mut Vec<String>, algo: &crate::config::AlgorithmConfig) {
    let keys = algo.gdpo_reward_keys.as_deref().unwrap_or_default();
    if algo.adv_estimator == AdvEstimator::Gdpo {
        if keys.is_empty() {
            errors.push("`algorithm.adv_estimator=gdpo` needs `algorithm.gdpo_reward_keys`: the keys of the dict your compute_score returns whose values are normalised one by one (e.g. [format_reward, accuracy_reward])".to_string());
        }
        if let Some(w) = &algo.gdpo_reward_weights {
            if w.len() != keys.len() {
                errors.push(format!(
                    "`algorithm.gdpo_reward_weights` has {} entries but `algorithm.gdpo_reward_keys` has {}: one weight per key",
                    w.len(),
                    keys.len()
                ));
            }
            if let Some(bad) = w.iter().find(|x| !x.is_finite()) {
                errors.push(format!(
                    "`algorithm.gdpo_reward_weights` holds {bad}: weights must be finite"
                ));
            }
        }
    } else if algo.gdpo_reward_keys.is_some() || algo.gdpo_reward_weights.is_some() {
        errors.push(format!(
            "`algorithm.gdpo_reward_keys` / `gdpo_reward_weights` are read only by `algorithm.adv_estimator=gdpo` (it is {})",
            algo.adv_estimator.as_str()
        ));
    }
}

/// `algorithm.use_pf_ppo`: verl resamples after GAE only and passes over the key for every
/// other estimator; here that pairing is refused rather than ignored. `weight_pow` must give
/// finite weights.
fn pf_ppo_rules(errors: &mut Vec<String>, algo: &crate::config::AlgorithmConfig) {
    if !algo.use_pf_ppo {
        return;
    }
    if algo.adv_estimator != AdvEstimator::Gae {
        errors.push(format!(
            "`algorithm.use_pf_ppo=True` resamples the batch after GAE only (verl applies it with `algorithm.adv_estimator=gae` and ignores it otherwise); `algorithm.adv_estimator` is {}: set use_pf_ppo=False or adv_estimator=gae",
            algo.adv_estimator.as_str()
        ));
    }
    let p = &algo.pf_ppo;
    if p.reweight_method == crate::config::PfPpoReweight::Pow
        && !(p.weight_pow.is_finite() && p.weight_pow >= 0.0)
    {
        errors.push(format!(
            "`algorithm.pf_ppo.weight_pow` ({}) must be a finite number >= 0",
            p.weight_pow
        ));
    }
}

/// `data.sampler`: a class needs its module and its name, and verl's rule that the loader has no
/// worker processes (they would draw batches before a curriculum sampler's update could shape
/// them). A class given without its module is refused too (verl ignores it silently).
fn sampler_rules(f: &mut Findings, cfg: &Config) {
    let s = &cfg.data.sampler;
    let path = s.class_path.as_deref().filter(|p| !p.is_empty());
    let name = s.class_name.as_deref().filter(|n| !n.is_empty());
    match (path, name) {
        (None, None) => return,
        (Some(p), None) => f.errors.push(format!(
            "`data.sampler.class_path` ({p}) needs `data.sampler.class_name`, the sampler class in it"
        )),
        (None, Some(n)) => f.errors.push(format!(
            "`data.sampler.class_name` ({n}) is set without `data.sampler.class_path` (pkg://module or a file holding the class): verl would ignore it and shuffle; set the path, or drop the name"
        )),
        (Some(_), Some(_)) => {}
    }
    if path.is_some() && cfg.data.dataloader_num_workers != 0 {
        f.errors.push(format!(
            "`data.dataloader_num_workers` ({}) must be 0 with a custom sampler (`data.sampler.class_path`), as verl requires: loader workers would draw batches before a curriculum sampler's update could reorder them",
            cfg.data.dataloader_num_workers
        ));
    }
}

/// `algorithm.filter_groups` and `data.gen_batch_size`: the generation batch size and DAPO's
/// dynamic sampling, under verl's rules (a metric is needed, at least one batch in flight) and
/// two of this implementation: verl computes the in-reward KL, and moves its adaptive
/// controller, on every generation batch including the groups it then drops, which is not
/// built here; and without filtering verl trains on every generated prompt, so a
/// `gen_batch_size` other than `train_batch_size` would silently change the step's size.
fn filter_groups_rules(f: &mut Findings, cfg: &Config, l: &Lengths) -> (usize, Option<FilterPlan>) {
    let (errors, fg) = (&mut f.errors, &cfg.algorithm.filter_groups);
    let gen_batch_size = cfg.data.gen_batch_size.unwrap_or(l.train_batch_size);
    if gen_batch_size == 0 {
        errors
            .push("`data.gen_batch_size` must be at least 1 (null = data.train_batch_size)".into());
    }
    if !fg.enable {
        if gen_batch_size != l.train_batch_size {
            errors.push(format!(
                "`data.gen_batch_size` ({gen_batch_size}) differs from `data.train_batch_size` ({}) but `algorithm.filter_groups.enable` is false: verl then trains each step on all {gen_batch_size} generated prompts; set data.train_batch_size to that, or enable filter_groups (DAPO's dynamic sampling)",
                l.train_batch_size
            ));
        }
        return (gen_batch_size, None);
    }
    let metric = fg.metric.clone().filter(|m| !m.is_empty());
    if metric.is_none() {
        errors.push("`algorithm.filter_groups.metric` must be set when `algorithm.filter_groups.enable` is true: the value a group's responses must differ in (reward, acc, score, seq_reward, seq_final_reward, or a key your compute_score returns)".into());
    }
    if fg.max_inflight_gen_batches <= 0 {
        errors.push(format!(
            "`algorithm.filter_groups.max_inflight_gen_batches` ({}) must be a positive integer",
            fg.max_inflight_gen_batches
        ));
    }
    if cfg.algorithm.use_kl_in_reward {
        errors.push("`algorithm.filter_groups.enable` with `algorithm.use_kl_in_reward=true` is not implemented: verl computes the KL penalty, and updates its KL controller, on every generation batch before filtering; DAPO itself runs without a KL term (use_kl_in_reward=false, or actor.use_kl_loss for a KL loss)".into());
    }
    if l.n == 1 {
        f.warnings.push("`algorithm.filter_groups.enable` with `actor_rollout_ref.rollout.n` = 1: a group of one response is always kept (as in verl), so nothing is filtered".into());
    }
    let plan = metric.map(|metric| FilterPlan {
        metric,
        max_num_gen_batches: (fg.max_num_gen_batches > 0).then_some(fg.max_num_gen_batches as u64),
    });
    (gen_batch_size, plan)
}

/// `algorithm.rollout_correction` under verl's rules (each error names its key), and the
/// rollout log-probs it needs.
fn rollout_corr_rules(f: &mut Findings, cfg: &Config) -> Option<RolloutCorrPlan> {
    const K: &str = "algorithm.rollout_correction";
    let rc = &cfg.algorithm.rollout_correction;
    let built = super::rollout_corr::build(
        rc.rollout_is.as_deref(),
        rc.rollout_is_threshold.as_ref(),
        rc.rollout_is_batch_normalize,
        rc.rollout_rs.as_deref(),
        rc.rollout_rs_threshold.as_ref(),
    );
    let correction = match built {
        Ok(c) => c,
        Err((key, e)) => {
            f.errors.push(format!("`{K}.{key}`: {e}"));
            return None;
        }
    };
    let bypass = match (rc.bypass_mode, rc.loss_type.as_str()) {
        (true, "ppo_clip") => Some(BypassLoss::PpoClip),
        (true, "reinforce") => Some(BypassLoss::Reinforce),
        (_, other) if other != "ppo_clip" && other != "reinforce" => {
            f.errors.push(format!(
                "`{K}.loss_type` is `{other}`: ppo_clip or reinforce"
            ));
            return None;
        }
        (false, "reinforce") => {
            f.warnings.push(format!(
                "`{K}.loss_type=reinforce` is read only with `{K}.bypass_mode=true` (as in verl)"
            ));
            None
        }
        _ => None,
    };
    let plan = RolloutCorrPlan { correction, bypass };
    if !cfg.actor_rollout_ref.rollout.calculate_log_probs {
        if plan.corrects() {
            f.errors.push(format!("`{K}` (rollout_is, rollout_rs or bypass_mode) needs the rollout's log-probs: set `actor_rollout_ref.rollout.calculate_log_probs=true`"));
        }
        return None;
    }
    Some(plan)
}

/// `critic.*`: whether there is a critic, its update plan and its forward passes.
fn critic_rules(
    errors: &mut Vec<String>,
    cfg: &Config,
    l: &Lengths,
) -> (bool, Option<UpdatePlan>, Option<MicroBatching>) {
    let (actor, algo, critic) = (&cfg.actor_rollout_ref.actor, &cfg.algorithm, &cfg.critic);
    let (n, tbs, mini) = (l.n, l.train_batch_size, actor.ppo_mini_batch_size);
    let need_critic = critic
        .enable
        .unwrap_or(algo.adv_estimator == AdvEstimator::Gae);
    if critic.enable == Some(false) && algo.adv_estimator == AdvEstimator::Gae {
        errors.push(
            "`critic.enable=False` but `algorithm.adv_estimator=gae` needs a critic's values"
                .into(),
        );
    }
    let (critic_plan, critic_forward_micro) = if need_critic {
        let cmini = critic.ppo_mini_batch_size.unwrap_or(mini);
        if cmini == 0 {
            errors.push("`critic.ppo_mini_batch_size` must be at least 1".into());
        } else if tbs < cmini {
            errors.push(format!("`data.train_batch_size` ({tbs}) must be >= `critic.ppo_mini_batch_size` ({cmini}); both count prompts"));
        } else if !tbs.is_multiple_of(cmini) {
            errors.push(format!("`data.train_batch_size` ({tbs}) must be divisible by `critic.ppo_mini_batch_size` ({cmini})"));
        }
        let dynamic = critic.use_dynamic_bsz.unwrap_or(actor.use_dynamic_bsz);
        let cmicro = one_micro_key(
            errors,
            "critic.ppo_micro_batch_size",
            critic.ppo_micro_batch_size,
            "critic.ppo_micro_batch_size_per_gpu",
            critic.ppo_micro_batch_size_per_gpu,
            dynamic,
            critic.ppo_max_token_len_per_gpu,
        );
        let accum = micro_divides(
            errors,
            "critic.ppo_mini_batch_size",
            cmini,
            n,
            cmicro,
            "critic.ppo_micro_batch_size_per_gpu",
        );
        check_optim(errors, "critic.optim", &critic.optim);
        if critic.cliprange_value < 0.0 {
            errors.push(format!(
                "`critic.cliprange_value` ({}) must be >= 0",
                critic.cliprange_value
            ));
        }
        let forward = if dynamic {
            MicroBatching::TokenBudget(
                critic
                    .forward_max_token_len_per_gpu
                    .unwrap_or(critic.ppo_max_token_len_per_gpu),
            )
        } else {
            match critic.forward_micro_batch_size_per_gpu {
                Some(m) if m > 0 => MicroBatching::Sequences(m),
                _ => cmicro,
            }
        };
        let epochs = critic.ppo_epochs.unwrap_or(actor.ppo_epochs);
        let plan = UpdatePlan {
            mini_batch_prompts: cmini,
            mini_batch_responses: cmini * n,
            mini_batches_per_epoch: tbs.checked_div(cmini).unwrap_or(0),
            micro: cmicro,
            grad_accum: accum,
            epochs,
            loss_agg_mode: critic.loss_agg_mode.unwrap_or(actor.loss_agg_mode),
            shuffle: critic.shuffle.unwrap_or(actor.shuffle),
            grad_clip: if critic.grad_clip != 1.0 {
                critic.grad_clip
            } else {
                critic.optim.clip_grad
            },
            global_norm: cfg.trainer.use_legacy_worker_impl.global_norm(),
        };
        if !(plan.grad_clip.is_finite() && plan.grad_clip > 0.0) {
            errors.push(format!(
                "`critic.grad_clip` ({}) must be a positive number (the largest gradient norm kept)",
                plan.grad_clip
            ));
        }
        (Some(plan), Some(forward))
    } else {
        (None, None)
    };

    (need_critic, critic_plan, critic_forward_micro)
}

/// `reward.*`: sources, workers, the control API.
fn reward_rules(errors: &mut Vec<String>, cfg: &Config) -> Option<RewardPlan> {
    let reward = &cfg.reward;
    if reward.reward_manager.source != "register" {
        errors.push(format!(
            "`reward.reward_manager.source` ({:?}) must be `register`; Python reward-manager classes cannot run here",
            reward.reward_manager.source
        ));
    }
    let ctl = &reward.control;
    if ctl.enable {
        if ctl.max_body_bytes == 0 {
            errors.push("`reward.control.max_body_bytes` must be at least 1".into());
        }
        if ctl.token.as_deref() == Some("") {
            errors.push("`reward.control.token` is empty: set a secret or null".into());
        }
        // Hostnames are resolved at start-up, which applies the same rule to what they name.
        let public = ctl
            .host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| !ip.is_loopback());
        if public && ctl.token.is_none() {
            errors.push(format!(
                "`reward.control.host` ({}) is reachable from other machines and `reward.control.token` is not set: set a token, or bind 127.0.0.1",
                ctl.host
            ));
        }
    }
    reward.plan().map_err(|e| errors.extend(e)).ok()
}

/// `trainer.*`: schedule, resume, device; the checkpoint root.
fn trainer_rules(f: &mut Findings, cfg: &Config) -> PathBuf {
    let Findings { errors, warnings } = f;
    let tr = &cfg.trainer;
    if tr.total_epochs == 0 && tr.total_training_steps.is_none() {
        errors.push(
            "`trainer.total_epochs` must be at least 1 (or set `trainer.total_training_steps`)"
                .into(),
        );
    }
    if tr.resume_mode == super::ResumeMode::ResumePath {
        match &tr.resume_from_path {
            None => errors.push("`trainer.resume_mode=resume_path` needs `trainer.resume_from_path`".into()),
            Some(p) if !p.contains("global_step_") => errors.push(format!(
                "`trainer.resume_from_path` ({p:?}) must name a `global_step_N` checkpoint folder (`trainer.resume_mode=resume_path`)"
            )),
            _ => {}
        }
    }
    if tr.val_only && !tr.val_before_train {
        warnings.push("`trainer.val_only=True` validates once before training; `trainer.val_before_train=False` is ignored".into());
    }
    let device = tr.device.as_str();
    if !(device == "auto"
        || device == "cpu"
        || device == "cuda"
        || device
            .strip_prefix("cuda:")
            .is_some_and(|i| i.parse::<usize>().is_ok()))
    {
        let what = if device.starts_with("npu") {
            "Ascend NPUs are not supported; "
        } else {
            ""
        };
        errors.push(format!(
            "`trainer.device` ({device:?}): {what}it must be auto, cpu, cuda or cuda:N"
        ));
    }
    let default_local_dir =
        PathBuf::from(expand_home(&tr.default_local_dir.clone().unwrap_or_else(
            || format!("checkpoints/{}/{}", tr.project_name, tr.experiment_name),
        )));

    default_local_dir
}

/// verl's worker rule: the mini-batch in responses (mini × n) must split into whole micro-batches.
fn micro_divides(
    errors: &mut Vec<String>,
    mini_key: &str,
    mini: usize,
    n: usize,
    micro: MicroBatching,
    micro_key: &str,
) -> Option<usize> {
    match micro {
        MicroBatching::Sequences(m) if mini > 0 && m > 0 => {
            let responses = mini * n;
            if !responses.is_multiple_of(m) {
                errors.push(format!(
                    "`{mini_key}` × rollout.n = {mini} × {n} = {responses} responses per mini-batch must be divisible by `{micro_key}` ({m})"
                ));
                None
            } else {
                Some(responses / m)
            }
        }
        _ => None,
    }
}

fn check_optim(errors: &mut Vec<String>, prefix: &str, o: &super::OptimConfig) {
    if let Err(e) = o.choice() {
        errors.push(format!("`{prefix}`: {e}"));
    }
    // Loading copies the override's arguments onto the section's keys; a config built in code
    // must do the same (never one value read and the other ignored).
    let ov = &o.override_optimizer_config;
    for (name, over, field) in [
        ("lr", ov.lr, o.lr),
        ("eps", ov.eps, o.eps),
        ("weight_decay", ov.weight_decay, o.weight_decay),
        ("betas[0]", ov.betas.map(|b| b[0]), o.betas[0]),
        ("betas[1]", ov.betas.map(|b| b[1]), o.betas[1]),
    ] {
        if over.is_some_and(|v| v != field) {
            errors.push(format!(
                "`{prefix}.override_optimizer_config.{name}` ({}) and `{prefix}.{name}` ({field}) disagree: loading a config copies the override onto the key",
                over.unwrap_or_default()
            ));
        }
    }
    if !(o.eps >= 0.0 && o.eps.is_finite()) {
        errors.push(format!(
            "`{prefix}.eps` ({}) must be a non-negative number",
            o.eps
        ));
    }
    if !(o.lr >= 0.0 && o.lr.is_finite()) {
        errors.push(format!(
            "`{prefix}.lr` ({}) must be a non-negative number",
            o.lr
        ));
    }
    if !(0.0..=1.0).contains(&o.lr_warmup_steps_ratio) {
        errors.push(format!(
            "`{prefix}.lr_warmup_steps_ratio` ({}) must be in [0, 1]",
            o.lr_warmup_steps_ratio
        ));
    }
    if !(0.0..=1.0).contains(&o.min_lr_ratio) {
        errors.push(format!(
            "`{prefix}.min_lr_ratio` ({}) must be in [0, 1]",
            o.min_lr_ratio
        ));
    }
    for (i, b) in o.betas.iter().enumerate() {
        if !(0.0..1.0).contains(b) {
            errors.push(format!("`{prefix}.betas[{i}]` ({b}) must be in [0, 1)"));
        }
    }
    if o.weight_decay < 0.0 {
        errors.push(format!(
            "`{prefix}.weight_decay` ({}) must be >= 0",
            o.weight_decay
        ));
    }
}
