//! `actor_rollout_ref.rollout.*`: sampling settings and the log-prob pass over rollouts.
//! verl: `verl/trainer/config/rollout/rollout.yaml`, `RolloutConfig`, `SamplingConfig`.

use serde::{Deserialize, Serialize};

use super::fields::negative_none;
use super::model::Precision;
use crate::defaults;

/// `rollout.val_kwargs`: sampling for validation (greedy by default).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    /// Top-k cut-off; -1 (or 0) = off.
    pub top_k: i64,
    /// Nucleus cut-off in (0, 1].
    pub top_p: f64,
    /// Softmax temperature; 0 = greedy, > 0 samples (whatever do_sample says, as in verl).
    pub temperature: f64,
    /// Responses per prompt.
    pub n: usize,
    /// Accepted for verl's configs and not read by the rollout (verl's agent loop ignores it
    /// too): temperature alone decides between greedy and sampling.
    pub do_sample: bool,
}

defaults!(SamplingConfig {
    top_k: -1,
    top_p: 1.0,
    temperature: 0.0,
    n: 1,
    do_sample: false
});

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Softmax temperature of training rollouts (0 = greedy); old, reference and update
    /// log-probs divide the logits by it too, as verl does.
    pub temperature: f64,
    /// Top-k cut-off; -1 (or 0) = off.
    pub top_k: i64,
    /// Nucleus cut-off in (0, 1].
    pub top_p: f64,
    /// Accepted for verl's configs and not read by the rollout (verl's agent loop ignores it
    /// too): temperature alone decides between greedy and sampling.
    pub do_sample: bool,
    /// Responses per prompt.
    pub n: usize,
    /// Seed of the sampler.
    pub seed: u64,
    /// Prompt budget; null = data.max_prompt_length.
    #[serde(with = "negative_none")]
    pub prompt_length: Option<u64>,
    /// Response budget; null = data.max_response_length.
    #[serde(with = "negative_none")]
    pub response_length: Option<u64>,
    /// Keep generating past EOS up to response_length.
    pub ignore_eos: bool,
    /// Sequences generated at once at most (continuous batching: finished ones make room).
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled in one generation step at most.
    pub max_num_batched_tokens: usize,
    /// Key/value cache memory of the sequences in flight at most, in GB, on the CPU (ours; on CUDA gpu_memory_utilization sizes it).
    pub kv_cache_memory_gb: f64,
    /// On CUDA, the share of the GPU's memory that generation's keys and values may fill, less what the run already holds there (verl's vLLM setting); the CPU reads kv_cache_memory_gb.
    pub gpu_memory_utilization: f64,
    /// Deprecated global micro-batch size of the old-log-prob pass; use the _per_gpu key.
    pub log_prob_micro_batch_size: Option<usize>,
    /// Sequences per forward pass when recomputing old log-probs.
    pub log_prob_micro_batch_size_per_gpu: Option<usize>,
    /// Token-budget micro-batches for that pass; null = actor.use_dynamic_bsz.
    pub log_prob_use_dynamic_bsz: Option<bool>,
    /// Token budget for that pass; null = actor.ppo_max_token_len_per_gpu.
    pub log_prob_max_token_len_per_gpu: Option<usize>,
    /// Validation sampling.
    pub val_kwargs: SamplingConfig,
    /// Precision of generation's products: float32 (our default on the CPU) or bfloat16 (verl's default; AMX tiles or AVX512-BF16 on the CPU, cuBLAS on CUDA).
    pub dtype: Precision,
    /// Keep each sampled token's log-probability (`rollout_log_probs`): rollout correction
    /// needs them, and with them every step logs how far the rollout's numbers are from the
    /// trainer's (`training/rollout_probs_diff_*`, `rollout_corr/*` diagnostics).
    pub calculate_log_probs: bool,
    /// The tool agent loop.
    pub multi_turn: MultiTurnConfig,
    /// Which agent loop rows run, and the tool workers.
    pub agent: AgentConfig,
}

defaults!(RolloutConfig {
    temperature: 1.0,
    top_k: -1,
    top_p: 1.0,
    do_sample: true,
    n: 1,
    seed: 42,
    prompt_length: None,
    response_length: None,
    ignore_eos: false,
    max_num_seqs: 256,
    max_num_batched_tokens: 8192,
    kv_cache_memory_gb: 2.0,
    gpu_memory_utilization: 0.5,
    log_prob_micro_batch_size: None,
    log_prob_micro_batch_size_per_gpu: None,
    log_prob_use_dynamic_bsz: None,
    log_prob_max_token_len_per_gpu: None,
    val_kwargs: SamplingConfig::default(),
    dtype: Precision::Fp32,
    calculate_log_probs: true,
    multi_turn: MultiTurnConfig::default(),
    agent: AgentConfig::default(),
});

/// Which side of an overlong tool response `multi_turn.tool_response_truncate_side` keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TruncateSide {
    /// Keep the end: `(truncated)...` + the last `max_tool_response_length` characters.
    Left,
    /// Keep both ends: the first and last `max_tool_response_length / 2` characters around
    /// `...(truncated)...`.
    Middle,
    /// Keep the start: the first `max_tool_response_length` characters + `...(truncated)`.
    Right,
}

/// How tool calls are written in the model's text (`multi_turn.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes, SmolLM2).
    Hermes,
    /// Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    /// `<|python_tag|>`, several separated by `;`.
    Llama3Json,
}

/// What `multi_turn.tokenization_sanity_check_mode` does at the end of a conversation: the
/// ids built turn by turn are compared with the whole conversation rendered and tokenised at
/// once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SanityCheckMode {
    /// Every difference is reported.
    Strict,
    /// Differences in whitespace only are not reported.
    IgnoreStrippable,
    /// No comparison.
    Disable,
}

/// `rollout.multi_turn.*`: the tool agent loop (verl: `MultiTurnConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MultiTurnConfig {
    /// Rows without an `agent_name` run the tool agent loop (as verl's SGLang multi-turn
    /// rollout ran every row); otherwise `agent.default_agent_loop` decides.
    pub enable: bool,
    /// Model turns per conversation at most; null or 0 = no limit; a negative value ends every
    /// conversation after its first turn (as verl reads it).
    pub max_assistant_turns: Option<i64>,
    /// YAML of `BaseTool`-style tool classes (verl's `tools:` list).
    pub tool_config_path: Option<String>,
    /// A Python file of `@function_tool` functions.
    pub function_tool_path: Option<String>,
    /// Tool (user-side) turns per conversation at most; null or 0 = no limit; a negative value
    /// ends every conversation after its first turn (as verl reads it).
    pub max_user_turns: Option<i64>,
    /// Tool calls of one model turn that run (the rest are dropped, as verl).
    pub max_parallel_calls: usize,
    /// Characters of a tool's text kept (longer ones are cut as `tool_response_truncate_side` says).
    pub max_tool_response_length: usize,
    /// Which part of an overlong tool text is kept: left (its end), middle (both ends) or right (its start).
    pub tool_response_truncate_side: TruncateSide,
    /// YAML of verl's interaction agents (`interaction:` list of `{name, class_name, config}`):
    /// a scripted user answering each model turn without tool calls; rows name theirs in
    /// `extra_info.interaction_kwargs.name`.
    pub interaction_config_path: Option<String>,
    /// Accepted for verl's configs; verl's agent loop does not read it either: the training ids
    /// are always the ones generated.
    pub use_inference_chat_template: bool,
    /// Compare the ids built turn by turn with the whole conversation tokenised at once: strict, ignore_strippable (whitespace-only differences pass) or disable.
    pub tokenization_sanity_check_mode: SanityCheckMode,
    /// How the model writes tool calls: hermes (`<tool_call>` JSON) or llama3_json.
    pub format: ToolFormat,
    /// Must stay null (repeating a conversation's rollouts is not implemented).
    #[serde(with = "negative_none")]
    pub num_repeat_rollouts: Option<u64>,
    /// Ours: the longest one tool call may run, in seconds; the worker running a longer one is
    /// killed and replaced and the call's text says it timed out.
    pub tool_timeout_s: f64,
    /// Ours: the most bytes of text one tool call may return before truncation (a larger
    /// result is an error for that call, never read into the trainer); null or 0 = no limit,
    /// as verl reads its limits.
    pub max_tool_output_bytes: Option<u64>,
}

defaults!(MultiTurnConfig {
    enable: false,
    max_assistant_turns: None,
    tool_config_path: None,
    function_tool_path: None,
    max_user_turns: None,
    max_parallel_calls: 1,
    max_tool_response_length: 256,
    tool_response_truncate_side: TruncateSide::Middle,
    interaction_config_path: None,
    use_inference_chat_template: false,
    tokenization_sanity_check_mode: SanityCheckMode::Strict,
    format: ToolFormat::Hermes,
    num_repeat_rollouts: None,
    tool_timeout_s: 60.0,
    max_tool_output_bytes: Some(1 << 20),
});

impl MultiTurnConfig {
    /// A turn limit as verl's agent loop reads it (`if limit and turns >= limit`): null and 0
    /// mean no limit; a negative value is reached at once, so every conversation ends after
    /// its first model turn. `Some(n)`: the conversation ends once the count reaches `n`.
    pub fn turn_limit(limit: Option<i64>) -> Option<usize> {
        match limit {
            None | Some(0) => None,
            Some(n) if n < 0 => Some(0),
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
        }
    }

    /// `max_tool_output_bytes` as a limit: null and 0 mean none.
    pub fn tool_output_limit(&self) -> Option<usize> {
        self.max_tool_output_bytes
            .filter(|&n| n > 0)
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
    }
}

/// The agent loops a row can name in its `agent_name` column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentLoopName {
    /// One generation per prompt (the default).
    SingleTurnAgent,
    /// Generation, tool calls and tool results until no call or a limit.
    ToolAgent,
}

impl AgentLoopName {
    pub const ALL: [AgentLoopName; 2] = [AgentLoopName::SingleTurnAgent, AgentLoopName::ToolAgent];

    /// verl's name.
    pub fn name(self) -> &'static str {
        match self {
            AgentLoopName::SingleTurnAgent => "single_turn_agent",
            AgentLoopName::ToolAgent => "tool_agent",
        }
    }

    /// The loop named `s`, if it is one of ours.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// `rollout.agent.*` (verl: `AgentLoopConfig`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Python worker processes running tool calls (verl: agent loop workers).
    pub num_workers: usize,
    /// The loop of rows without `agent_name` (when `multi_turn.enable` is off).
    pub default_agent_loop: AgentLoopName,
    /// Custom agent loop classes; must stay null (only verl's two loops are built in).
    pub agent_loop_config_path: Option<String>,
    /// A custom inference server class; must stay unset (generation runs in this process).
    pub custom_async_server: CustomAsyncServerConfig,
}

/// `rollout.agent.custom_async_server.*` (verl: `CustomAsyncServerConfig`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CustomAsyncServerConfig {
    /// File holding the server class.
    pub path: Option<String>,
    /// The server class's name.
    pub name: Option<String>,
}

defaults!(AgentConfig {
    num_workers: 8,
    default_agent_loop: AgentLoopName::SingleTurnAgent,
    agent_loop_config_path: None,
    custom_async_server: CustomAsyncServerConfig::default(),
});

impl MultiTurnConfig {
    /// Every rule `multi_turn.*` and `agent.*` break, each naming its key.
    pub fn check(&self, agent: &AgentConfig) -> Vec<String> {
        let key = "actor_rollout_ref.rollout";
        let mut errors = Vec::new();
        if let Some(n) = self.num_repeat_rollouts {
            errors.push(format!("`{key}.multi_turn.num_repeat_rollouts` ({n}): repeated conversation rollouts are not implemented; leave it null"));
        }
        if let Some(p) = &agent.agent_loop_config_path {
            errors.push(format!("`{key}.agent.agent_loop_config_path` ({p}): custom agent loop classes are not supported; rows choose between single_turn_agent and tool_agent with `agent_name`"));
        }
        let server = &agent.custom_async_server;
        if let Some(v) = server.path.as_ref().or(server.name.as_ref()) {
            errors.push(format!("`{key}.agent.custom_async_server` ({v}): custom inference servers are not supported; generation runs in this process"));
        }
        if self.max_parallel_calls == 0 {
            errors.push(format!(
                "`{key}.multi_turn.max_parallel_calls` must be at least 1"
            ));
        }
        if !(self.tool_timeout_s > 0.0 && self.tool_timeout_s.is_finite()) {
            errors.push(format!(
                "`{key}.multi_turn.tool_timeout_s` ({}) must be a positive number of seconds",
                self.tool_timeout_s
            ));
        }
        if agent.num_workers == 0 {
            errors.push(format!("`{key}.agent.num_workers` must be at least 1"));
        }
        errors
    }

    /// Values verl accepts that are likely mistakes: a negative turn limit, which verl (and
    /// so main_ppo) reads as reached at once.
    pub fn warnings(&self) -> Vec<String> {
        let key = "actor_rollout_ref.rollout.multi_turn";
        [
            ("max_assistant_turns", self.max_assistant_turns),
            ("max_user_turns", self.max_user_turns),
        ]
        .into_iter()
        .filter_map(|(name, v)| v.filter(|&n| n < 0).map(|n| (name, n)))
        .map(|(name, n)| format!("`{key}.{name}` ({n}) is negative: as in verl, every conversation ends after its first model turn and no tool runs (null or 0 means no limit)"))
        .collect()
    }
}
