//! verl's tool agent loop (`rollout.multi_turn.*`, `agent_name: tool_agent`): the model writes a
//! turn, the tool calls in it are parsed, the tools run, and their results come back as
//! tool-role turns rendered by the chat template, until a turn calls no tool or a limit ends
//! the conversation. Every token stays an id from generation to the loss: generated tokens are
//! kept exactly and carry mask 1, the template and tool tokens appended between turns carry 0.
//!
//! Interactions (verl b178a3c's `multi_turn.interaction_config_path`, gone from 1dda039): a
//! model turn without tool calls goes to the interaction the row's
//! `extra_info.interaction_kwargs.name` names, a scripted user whose answer becomes a user turn
//! (mask 0) and whose score is appended to the row's `turn_scores`; its answer may end the
//! conversation, in which case the user turn still ends the response (as verl appends it before
//! stopping). The interaction runs in a Python worker of its own, so that its per-conversation
//! state stays in one process.

use std::sync::mpsc::Sender;

use serde_json::Value;

/// One tool call to run (what the agent loop hands to a [`ToolRunner`]), or one turn of an
/// interaction.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The caller's tag, returned with the outcome.
    pub key: u64,
    /// The tool's name (an interaction turn: the interaction's).
    pub name: String,
    /// The arguments as the model wrote them (JSON text, not yet checked).
    pub arguments: String,
    /// The row's `tools_kwargs[name].create_kwargs` (`{}` when absent).
    pub create_kwargs: Value,
    /// `Some`: an interaction turn (or the end of its instance) instead of a tool call.
    pub interaction: Option<InteractionTurn>,
}

/// What an interaction needs for one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct InteractionTurn {
    /// The conversation's instance id (unique within the run).
    pub instance: String,
    /// The row's `extra_info.interaction_kwargs` (`name` among them), passed to the
    /// interaction's `start_interaction` and `generate_response` as keyword arguments.
    pub kwargs: Value,
    /// The conversation so far; `None`: the conversation is over (`finalize_interaction`).
    pub messages: Option<Vec<Value>>,
    /// The conversation's first turn with the interaction: its instance starts first.
    pub first: bool,
}

/// What a tool call gave back.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolOutcome {
    pub key: u64,
    /// The tool-role message's content (an error's text when the call failed, as verl shows
    /// the model).
    pub text: String,
    /// The tool's reward, when it gave one.
    pub reward: Option<f64>,
    /// Why the call failed (timeout, crash, exception, output too large), for metrics and logs.
    pub error: Option<String>,
    /// An interaction's answer ends the conversation (always so when the interaction failed);
    /// `false` for tool calls.
    pub terminate: bool,
}

/// Runs tool calls out of the trainer's process.
pub trait ToolRunner: Send + Sync {
    /// The tools' OpenAI function schemas (the chat template's `tools`).
    fn schemas(&self) -> Vec<Value>;
    /// Starts `call`; its outcome arrives on `done` (from another thread).
    fn submit(&self, call: ToolCall, done: Sender<ToolOutcome>);
}

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Map};

use super::scheduler::Turns;
use super::tool_parser::{self, ParsedCall};
use super::Rollout;
use crate::config::{MultiTurnConfig, SanityCheckMode, ToolFormat, TruncateSide};
use crate::data::{ChatTemplate, TokenizerBundle};

/// The loop's limits and formats (`rollout.multi_turn.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentSettings {
    pub format: ToolFormat,
    /// A conversation ends once its model (tool) turns reach this; `None`: no limit (see
    /// [`MultiTurnConfig::turn_limit`] for how verl's values read).
    pub max_assistant_turns: Option<usize>,
    pub max_user_turns: Option<usize>,
    pub max_parallel_calls: usize,
    pub max_tool_response_length: usize,
    pub truncate_side: TruncateSide,
    pub sanity: SanityCheckMode,
    /// How long the loop waits for a call's outcome before giving up on it (the runner's own
    /// timeout plus a margin: a runner always answers, this only guards against one that
    /// loses a call).
    pub answer_wait: Duration,
}

impl AgentSettings {
    pub fn new(m: &MultiTurnConfig) -> Self {
        Self {
            format: m.format,
            max_assistant_turns: MultiTurnConfig::turn_limit(m.max_assistant_turns),
            max_user_turns: MultiTurnConfig::turn_limit(m.max_user_turns),
            max_parallel_calls: m.max_parallel_calls.max(1),
            max_tool_response_length: m.max_tool_response_length,
            truncate_side: m.tool_response_truncate_side,
            sanity: m.tokenization_sanity_check_mode,
            answer_wait: Duration::from_secs_f64(m.tool_timeout_s * 2.0 + 30.0),
        }
    }
}

/// What the loop needs for every conversation of a run: the tokenizer and chat template the
/// prompts were rendered with, the tools, and the limits.
pub struct AgentContext {
    pub tokenizer: Arc<TokenizerBundle>,
    pub template: Arc<ChatTemplate>,
    /// `data.apply_chat_template_kwargs` with the tools' schemas as `tools`.
    pub template_kwargs: Map<String, Value>,
    pub runner: Arc<dyn ToolRunner>,
    /// The interactions (`multi_turn.interaction_config_path`), in a worker of their own.
    pub interactions: Option<Arc<dyn ToolRunner>>,
    pub settings: AgentSettings,
    /// The next interaction instance's number.
    next_instance: std::sync::atomic::AtomicU64,
    /// Tokens the template writes after a model turn's end-of-turn token (ChatML's newline
    /// after `<|im_end|>`): generation stops at the end-of-turn token, so they are inserted,
    /// with mask 0, before a tool turn (verl's Continuous Token boundary rule).
    turn_tail: Vec<u32>,
}

/// A synthetic conversation opening, for rendering tool turns on their own (verl's Continuous
/// Token builder renders deltas against the same kind of stand-in).
fn synthetic_opening() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "continuous token synthetic system"}),
        json!({"role": "user", "content": "continuous token synthetic user"}),
    ]
}

impl AgentContext {
    pub fn new(
        tokenizer: Arc<TokenizerBundle>,
        template: Arc<ChatTemplate>,
        mut template_kwargs: Map<String, Value>,
        runner: Arc<dyn ToolRunner>,
        settings: AgentSettings,
    ) -> Result<Self, String> {
        let schemas = runner.schemas();
        if !schemas.is_empty() {
            template_kwargs.insert("tools".into(), Value::Array(schemas));
        }
        let mut ctx = Self {
            tokenizer,
            template,
            template_kwargs,
            runner,
            interactions: None,
            settings,
            next_instance: std::sync::atomic::AtomicU64::new(0),
            turn_tail: Vec::new(),
        };
        ctx.turn_tail = ctx.find_turn_tail()?;
        Ok(ctx)
    }

    /// The same context with `runner` answering the model turns without tool calls of rows
    /// that name an interaction.
    pub fn with_interactions(mut self, runner: Arc<dyn ToolRunner>) -> Self {
        self.interactions = Some(runner);
        self
    }

    /// A fresh interaction instance id.
    fn instance_id(&self) -> String {
        let n = self
            .next_instance
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("main_ppo-interaction-{}-{n}", std::process::id())
    }

    /// The tokens after an assistant message's content in the template's rendering (e.g.
    /// `<|im_end|>`, `\n`).
    fn find_turn_tail(&self) -> Result<Vec<u32>, String> {
        const MARK: &str = "main_ppo_turn_content";
        let mut msgs = synthetic_opening();
        msgs.push(json!({"role": "assistant", "content": MARK}));
        let text = self.render(&msgs, false)?;
        let Some(at) = text.rfind(MARK) else {
            return Ok(Vec::new());
        };
        self.encode(&text[at + MARK.len()..])
    }

    fn render(&self, messages: &[Value], generation_prompt: bool) -> Result<String, String> {
        self.template
            .render(messages, generation_prompt, &self.template_kwargs)
            .map_err(|e| format!("the chat template fails on the conversation: {e}"))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer.encode(text)
    }

    fn render_ids(&self, messages: &[Value], generation_prompt: bool) -> Result<Vec<u32>, String> {
        self.encode(&self.render(messages, generation_prompt)?)
    }

    /// The tokens `appended` adds after `prefix` in the template's rendering (`generation_prompt`
    /// on the longer one only); an error when the rendering of the prefix is not a prefix.
    fn delta(
        &self,
        prefix: &[Value],
        appended: &[Value],
        generation_prompt: bool,
    ) -> Result<Vec<u32>, String> {
        let a = self.render_ids(prefix, false)?;
        let full: Vec<Value> = prefix.iter().chain(appended).cloned().collect();
        let b = self.render_ids(&full, generation_prompt)?;
        if !b.starts_with(&a) {
            return Err("the chat template renders a conversation's start differently once more turns follow; its tool turns cannot be appended as tokens".into());
        }
        Ok(b[a.len()..].to_vec())
    }

    /// The tokens between a model turn that called tools and the next model turn: the
    /// template's end-of-turn tail when generation stopped before it, the tool messages, and
    /// the generation prompt.
    fn tool_turn_ids(
        &self,
        last_token: Option<u32>,
        conversation: &[Value],
        tool_msgs: &[Value],
    ) -> Result<Vec<u32>, String> {
        let calls: Vec<Value> = tool_msgs
            .iter()
            .enumerate()
            .map(|(i, m)| {
                json!({"id": m.get("tool_call_id").cloned().unwrap_or(json!(format!("call_{i}"))),
                       "type": "function",
                       "function": {"name": m.get("name").cloned().unwrap_or(json!("continuous_token_tool")), "arguments": {}}})
            })
            .collect();
        let stand_in = json!({"role": "assistant", "content": "", "reasoning_content": "reasoning", "tool_calls": calls});
        self.turn_ids(last_token, conversation, stand_in, tool_msgs)
    }

    /// The tokens of an interaction's user turn after a model turn, made as a tool turn's are
    /// (verl renders the message alone, system prompt removed, with the generation prompt).
    fn user_turn_ids(
        &self,
        last_token: Option<u32>,
        conversation: &[Value],
        user: &Value,
    ) -> Result<Vec<u32>, String> {
        let stand_in =
            json!({"role": "assistant", "content": "continuous token synthetic assistant"});
        self.turn_ids(
            last_token,
            conversation,
            stand_in,
            std::slice::from_ref(user),
        )
    }

    /// The tokens of `msgs` appended after a model turn: the end-of-turn tail when generation
    /// stopped before it, `msgs` rendered after a stand-in conversation ending in `stand_in`
    /// (the assistant message they answer), and the generation prompt of `conversation`.
    fn turn_ids(
        &self,
        last_token: Option<u32>,
        conversation: &[Value],
        stand_in: Value,
        msgs: &[Value],
    ) -> Result<Vec<u32>, String> {
        let mut ids = self.tail_after(last_token);
        let mut opening = synthetic_opening();
        opening.push(stand_in);
        ids.extend(self.delta(&opening, msgs, false)?);
        ids.extend(self.delta(conversation, &[], true)?);
        Ok(ids)
    }

    /// The rest of the template's end-of-turn tail when a turn ended with its first token
    /// (generation stops there).
    fn tail_after(&self, last_token: Option<u32>) -> Vec<u32> {
        match (last_token, self.turn_tail.split_first()) {
            (Some(t), Some((&first, rest))) if t == first => rest.to_vec(),
            _ => Vec::new(),
        }
    }
}

/// `text` cut to `max` characters as verl cuts tool responses.
pub fn truncate_tool_text(text: &str, max: usize, side: TruncateSide) -> String {
    let n = text.chars().count();
    if n <= max {
        return text.to_string();
    }
    let head = |k: usize| text.chars().take(k).collect::<String>();
    // Python's `text[-k:]`, which for k = 0 is the whole text (verl cuts with it, so a limit
    // of 0, or 1 on the middle side, keeps the whole tail).
    let tail = |k: usize| {
        let k = if k == 0 { n } else { k };
        text.chars().skip(n - k).collect::<String>()
    };
    match side {
        TruncateSide::Left => format!("(truncated)...{}", tail(max)),
        TruncateSide::Right => format!("{}...(truncated)", head(max)),
        TruncateSide::Middle => format!("{}...(truncated)...{}", head(max / 2), tail(max / 2)),
    }
}

/// One row's conversation as the loop starts it.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// The prompt's messages.
    pub messages: Vec<Value>,
    /// `extra_info.tools_kwargs`: per tool name, `create_kwargs` for its instances.
    pub tools_kwargs: Value,
    /// `false`: a single-turn row (one generation, no tools).
    pub tool_agent: bool,
    /// `extra_info.interaction_kwargs` when the run has interactions (its `name` names one).
    pub interaction: Option<Value>,
}

/// How one row's conversation went.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Episode {
    /// 1 on every generated token, 0 on template and tool tokens; one per response token.
    pub mask: Vec<u8>,
    pub assistant_turns: usize,
    pub user_turns: usize,
    /// Tool calls run, and those that failed (unknown tool, bad arguments, exception, timeout,
    /// crash, output too large).
    pub tool_calls: usize,
    pub tool_errors: usize,
    /// Tool-call blocks the parser could not read.
    pub malformed_calls: usize,
    /// Each tool call's reward.
    pub tool_rewards: Vec<f64>,
    /// Seconds the row waited on its tools (from a turn's calls to their last answer, summed
    /// over turns; verl's `tool_calls` timing).
    pub tool_seconds: f64,
    /// The conversation as messages (prompt, assistant turns with their calls, tool turns).
    pub messages: Vec<Value>,
    /// Where the ids built turn by turn differ from the whole conversation tokenised at once
    /// (`tokenization_sanity_check_mode`).
    pub sanity_mismatch: Option<String>,
    /// Why the conversation ended early (a template that cannot render a tool turn, a failed
    /// interaction).
    pub error: Option<String>,
    /// Each interaction turn's score (verl's `turn_scores`).
    pub turn_scores: Vec<f64>,
    /// Interaction turns that failed (an exception, a lost worker): each ended its
    /// conversation.
    pub interaction_errors: usize,
}

impl Episode {
    /// verl's `num_turns`: tool turns + model turns + 1.
    pub fn num_turns(&self) -> usize {
        self.user_turns + self.assistant_turns + 1
    }
}

/// A row's state between turns.
struct RowState {
    conv: Conversation,
    ep: Episode,
    /// Where the current model turn starts in the response.
    turn_start: usize,
    /// Response length and last token when the row stopped for its tools.
    resp_len: usize,
    last_token: Option<u32>,
    /// The outcomes of the calls in flight (None until each arrives).
    pending: Vec<Option<ToolOutcome>>,
    asked_at: Option<Instant>,
    /// The call in flight is an interaction turn.
    interacting: bool,
    /// The row's interaction instance, once started.
    instance: Option<String>,
    /// A user turn that ended the conversation: appended after the response (mask 0), and
    /// whether it was cut by the length budget.
    tail: Vec<u32>,
    tail_cut: bool,
}

/// The tool agent loop over one generation call's rows, driven by the scheduler
/// ([`Turns`]).
pub struct ToolAgent<'a> {
    ctx: &'a AgentContext,
    budget: usize,
    eos_ids: Vec<u32>,
    prompts: Vec<Vec<u32>>,
    rows: Vec<RowState>,
    tx: std::sync::mpsc::Sender<ToolOutcome>,
    rx: Receiver<ToolOutcome>,
}

/// A call's tag: the row and the call's index in its turn.
fn key(row: usize, idx: usize) -> u64 {
    ((row as u64) << 16) | idx as u64
}

impl<'a> ToolAgent<'a> {
    /// `budget`: the response length (all turns and tool tokens together).
    pub fn new(
        ctx: &'a AgentContext,
        convs: Vec<Conversation>,
        prompts: Vec<Vec<u32>>,
        budget: usize,
        eos_ids: Vec<u32>,
    ) -> Self {
        let (tx, rx) = channel();
        let rows = convs
            .into_iter()
            .map(|mut conv| RowState {
                // The conversation grows in the episode; `conv` keeps the row's other inputs.
                ep: Episode {
                    messages: std::mem::take(&mut conv.messages),
                    ..Default::default()
                },
                conv,
                turn_start: 0,
                resp_len: 0,
                last_token: None,
                pending: Vec::new(),
                asked_at: None,
                interacting: false,
                instance: None,
                tail: Vec::new(),
                tail_cut: false,
            })
            .collect();
        Self {
            ctx,
            budget,
            eos_ids,
            prompts,
            rows,
            tx,
            rx,
        }
    }

    /// Every row's episode, its mask the length of `out`'s response. A user turn that ended a
    /// conversation is appended to its response here (log-prob 0, mask 0), and every
    /// interaction instance is ended.
    pub fn finish(mut self, out: &mut Rollout) -> Vec<Episode> {
        for (r, st) in self.rows.iter_mut().enumerate() {
            st.ep.mask.resize(out.responses[r].len(), 1);
            if !st.conv.tool_agent {
                st.ep.assistant_turns = 1;
            }
            let tail = std::mem::take(&mut st.tail);
            st.ep.mask.extend(std::iter::repeat_n(0, tail.len()));
            out.log_probs[r].extend(std::iter::repeat_n(0.0, tail.len()));
            out.responses[r].extend(tail);
        }
        self.finalize_instances();
        let ctx = self.ctx;
        let prompts = std::mem::take(&mut self.prompts);
        self.rows
            .into_iter()
            .enumerate()
            .map(|(r, mut st)| {
                // A conversation cut by the length budget ends mid-text, where tokenising the
                // rendered text at once may split differently: only finished ones are compared.
                let finished = out.stop[r] == super::StopReason::Eos && !st.tail_cut;
                if st.conv.tool_agent && finished && ctx.settings.sanity != SanityCheckMode::Disable
                {
                    // A user turn that ended the conversation ends with the generation prompt
                    // (a finished conversation ends with a user message only then).
                    let user_last = st.ep.messages.last().is_some_and(|m| m["role"] == "user");
                    st.ep.sanity_mismatch = sanity(
                        ctx,
                        &st.ep.messages,
                        &prompts[r],
                        &out.responses[r],
                        user_last,
                    );
                }
                st.ep
            })
            .collect()
    }

    /// Ends every started interaction instance (fire and forget: the answer is not awaited).
    fn finalize_instances(&self) {
        let Some(runner) = &self.ctx.interactions else {
            return;
        };
        let (tx, _rx) = channel();
        for (r, st) in self.rows.iter().enumerate() {
            let (Some(instance), Some(kwargs)) = (&st.instance, &st.conv.interaction) else {
                continue;
            };
            let turn = InteractionTurn {
                instance: instance.clone(),
                kwargs: kwargs.clone(),
                messages: None,
                first: false,
            };
            runner.submit(turn.into_call(key(r, 0)), tx.clone());
        }
    }

    /// Hands row `row`'s model turn `turn` (no tool calls) to its interaction; `false` when
    /// the row has none.
    fn ask_interaction(&mut self, row: usize, turn: &[u32]) -> bool {
        let Some(runner) = self.ctx.interactions.clone() else {
            return false;
        };
        let text = self
            .ctx
            .tokenizer
            .tokenizer
            .decode(turn, true)
            .unwrap_or_default();
        let st = &mut self.rows[row];
        let Some(kwargs) = st.conv.interaction.clone() else {
            return false;
        };
        // verl shows the interaction the turn decoded without special tokens.
        let mut messages = st.ep.messages.clone();
        if let Some(last) = messages.last_mut() {
            last["content"] = Value::String(text);
        }
        let first = st.instance.is_none();
        let instance = st
            .instance
            .get_or_insert_with(|| self.ctx.instance_id())
            .clone();
        st.interacting = true;
        st.pending = vec![None];
        st.asked_at = Some(Instant::now());
        let turn = InteractionTurn {
            instance,
            kwargs,
            messages: Some(messages),
            first,
        };
        runner.submit(turn.into_call(key(row, 0)), self.tx.clone());
        true
    }

    /// The interaction has answered row `r`: its user turn's tokens, or `None` when the
    /// conversation ends (the interaction said so, the budget, a failure). A user turn that
    /// ends the conversation is kept as the row's tail.
    fn user_turn(&mut self, r: usize, outcome: Option<ToolOutcome>) -> Option<Vec<u32>> {
        let st = &mut self.rows[r];
        st.interacting = false;
        st.asked_at = None;
        st.ep.user_turns += 1;
        let o = outcome?;
        if let Some(e) = o.error {
            tracing::warn!(target: "main_ppo::reward", "the conversation of row {r} ends: {e}");
            st.ep.interaction_errors += 1;
            st.ep.error = Some(e);
            return None;
        }
        if let Some(score) = o.reward {
            st.ep.turn_scores.push(score);
        }
        let user = json!({"role": "user", "content": o.text});
        st.ep.messages.push(user.clone());
        let ids = match self
            .ctx
            .user_turn_ids(st.last_token, &st.ep.messages, &user)
        {
            Ok(ids) => ids,
            Err(e) => {
                st.ep.error = Some(e);
                return None;
            }
        };
        let room = self.budget.saturating_sub(st.resp_len);
        if o.terminate || ids.len() >= room {
            st.tail_cut = ids.len() > room;
            st.tail = ids[..ids.len().min(room)].to_vec();
            return None;
        }
        st.ep.mask.extend(std::iter::repeat_n(0, ids.len()));
        st.turn_start = st.resp_len + ids.len();
        Some(ids)
    }

    fn content_text(&self, turn: &[u32]) -> String {
        let body = match turn.split_last() {
            Some((last, rest)) if self.eos_ids.contains(last) => rest,
            _ => turn,
        };
        self.ctx
            .tokenizer
            .tokenizer
            .decode(body, false)
            .unwrap_or_default()
    }

    /// The assistant message of a turn (verl's `_build_assistant_message`).
    fn assistant_message(content: &str, calls: &[ParsedCall]) -> Value {
        let mut m = json!({"role": "assistant", "content": content});
        if !calls.is_empty() {
            let tc: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let args = serde_json::from_str::<Value>(&c.arguments)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| Value::String(c.arguments.clone()));
                    json!({"type": "function", "function": {"name": c.name, "arguments": args}})
                })
                .collect();
            m["tool_calls"] = Value::Array(tc);
        }
        m
    }

    /// All outcomes of row `r` are in: its tool turn's tokens, or `None` when the
    /// conversation ends (the budget, or a template failure).
    fn continuation(&mut self, r: usize) -> Option<Vec<u32>> {
        if self.rows[r].interacting {
            let outcome = self.rows[r].pending.drain(..).flatten().next();
            return self.user_turn(r, outcome);
        }
        let s = &self.ctx.settings;
        let st = &mut self.rows[r];
        let outcomes: Vec<ToolOutcome> = st.pending.drain(..).flatten().collect();
        if let Some(t) = st.asked_at.take() {
            st.ep.tool_seconds += t.elapsed().as_secs_f64();
        }
        let mut tool_msgs = Vec::new();
        for o in &outcomes {
            st.ep.tool_calls += 1;
            if o.error.is_some() {
                st.ep.tool_errors += 1;
            }
            if let Some(rw) = o.reward {
                st.ep.tool_rewards.push(rw);
            }
            let text = truncate_tool_text(&o.text, s.max_tool_response_length, s.truncate_side);
            tool_msgs.push(json!({"role": "tool", "content": text}));
        }
        st.ep.messages.extend(tool_msgs.iter().cloned());
        let ids = match self
            .ctx
            .tool_turn_ids(st.last_token, &st.ep.messages, &tool_msgs)
        {
            Ok(ids) => ids,
            Err(e) => {
                st.ep.error = Some(e);
                return None;
            }
        };
        if st.resp_len + ids.len() >= self.budget {
            return None;
        }
        st.ep.user_turns += 1;
        st.ep.mask.extend(std::iter::repeat_n(0, ids.len()));
        st.turn_start = st.resp_len + ids.len();
        Some(ids)
    }

    /// Rows whose every call has answered, after taking in `o`.
    fn take(&mut self, o: ToolOutcome, done: &mut Vec<usize>) {
        let (r, i) = ((o.key >> 16) as usize, (o.key & 0xffff) as usize);
        let Some(st) = self.rows.get_mut(r) else {
            return;
        };
        if let Some(slot) = st.pending.get_mut(i) {
            *slot = Some(o);
            if st.pending.iter().all(Option::is_some) && !done.contains(&r) {
                done.push(r);
            }
        }
    }

    /// Calls that have waited past `answer_wait` get an error outcome (a runner that lost
    /// them must not hang the rollout).
    fn expire(&mut self, done: &mut Vec<usize>) {
        let wait = self.ctx.settings.answer_wait;
        let mut late = Vec::new();
        for (r, st) in self.rows.iter().enumerate() {
            if st.asked_at.is_some_and(|t| t.elapsed() > wait) {
                for (i, p) in st.pending.iter().enumerate() {
                    if p.is_none() {
                        late.push(key(r, i));
                    }
                }
            }
        }
        for k in late {
            let text = format!(
                "Error executing tool: no answer within {} s",
                wait.as_secs()
            );
            self.take(
                ToolOutcome {
                    key: k,
                    error: Some(text.clone()),
                    text,
                    reward: None,
                    terminate: true,
                },
                done,
            );
        }
    }
}

impl Turns for ToolAgent<'_> {
    fn turn_ended(&mut self, row: usize, out: &Rollout) -> bool {
        let resp = &out.responses[row];
        let s = &self.ctx.settings;
        let st = &mut self.rows[row];
        if !st.conv.tool_agent {
            return false;
        }
        let turn = resp[st.turn_start..].to_vec();
        st.ep.mask.extend(std::iter::repeat_n(1, turn.len()));
        st.ep.assistant_turns += 1;
        let text = self.content_text(&turn);
        let parsed = tool_parser::parse(s.format, &text);
        let st = &mut self.rows[row];
        let calls: Vec<ParsedCall> = parsed
            .calls
            .into_iter()
            .take(s.max_parallel_calls)
            .collect();
        st.ep.malformed_calls += parsed.malformed;
        st.ep
            .messages
            .push(Self::assistant_message(&parsed.content, &calls));
        let over = resp.len() >= self.budget
            || s.max_assistant_turns
                .is_some_and(|m| st.ep.assistant_turns >= m)
            || s.max_user_turns.is_some_and(|m| st.ep.user_turns >= m);
        if over {
            return false;
        }
        st.resp_len = resp.len();
        st.last_token = resp.last().copied();
        if calls.is_empty() {
            return self.ask_interaction(row, &turn);
        }
        st.pending = vec![None; calls.len()];
        st.asked_at = Some(Instant::now());
        for (i, c) in calls.into_iter().enumerate() {
            let create_kwargs = st
                .conv
                .tools_kwargs
                .get(&c.name)
                .and_then(|k| k.get("create_kwargs"))
                .cloned()
                .unwrap_or_else(|| json!({}));
            self.ctx.runner.submit(
                ToolCall {
                    key: key(row, i),
                    name: c.name,
                    arguments: c.arguments,
                    create_kwargs,
                    interaction: None,
                },
                self.tx.clone(),
            );
        }
        true
    }

    fn ready(&mut self, wait: bool) -> Vec<(usize, Option<Vec<u32>>)> {
        let mut done = Vec::new();
        while let Ok(o) = self.rx.try_recv() {
            self.take(o, &mut done);
        }
        while wait && done.is_empty() {
            match self.rx.recv_timeout(Duration::from_millis(200)) {
                Ok(o) => self.take(o, &mut done),
                Err(RecvTimeoutError::Timeout) => self.expire(&mut done),
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        done.into_iter()
            .map(|r| (r, self.continuation(r)))
            .collect()
    }
}

/// `tokenization_sanity_check_mode`: where prompt + response differ from the conversation
/// rendered and tokenised at once (`None` when they agree; trailing template tokens the
/// rendering adds after the last turn are not a difference).
fn sanity(
    ctx: &AgentContext,
    messages: &[Value],
    prompt: &[u32],
    response: &[u32],
    generation_prompt: bool,
) -> Option<String> {
    let full = match ctx.render_ids(messages, generation_prompt) {
        Ok(ids) => ids,
        Err(e) => return Some(e),
    };
    let ours: Vec<u32> = prompt.iter().chain(response).copied().collect();
    let at = ours
        .iter()
        .zip(&full)
        .position(|(a, b)| a != b)
        .or_else(|| (full.len() < ours.len()).then_some(full.len()))?;
    let show = |ids: &[u32]| {
        let lo = at.saturating_sub(3);
        let hi = (at + 4).min(ids.len());
        ctx.tokenizer
            .tokenizer
            .decode(&ids[lo.min(hi)..hi], false)
            .unwrap_or_default()
    };
    let text = |ids: &[u32]| {
        ctx.tokenizer
            .tokenizer
            .decode(ids, false)
            .unwrap_or_default()
    };
    let (x, y) = (text(&ours), text(&full));
    // The rendering may end with template text after the last turn (ChatML's newline).
    if y.starts_with(&x) && y[x.len()..].trim().is_empty() {
        // The same text in other tokens: the model sampled a split the tokenizer would not make.
        let ids = |v: &[u32]| v[at.saturating_sub(3).min(v.len())..(at + 4).min(v.len())].to_vec();
        return Some(format!(
            "token {at}: the same text was generated as ids {:?} and is tokenised at once as {:?} ({:?})",
            ids(&ours),
            ids(&full),
            show(&full)
        ));
    }
    // verl's ignore_strippable passes a difference whose differing pieces are all whitespace.
    let bare = |t: &str| t.chars().filter(|c| !c.is_whitespace()).collect::<String>();
    if ctx.settings.sanity == SanityCheckMode::IgnoreStrippable && bare(&x) == bare(&y) {
        return None;
    }
    let (a, b) = (show(&ours), show(&full));
    Some(format!(
        "token {at}: generated {a:?}, the whole conversation tokenised {b:?}"
    ))
}

impl InteractionTurn {
    /// The request for this turn, tagged `key`, to the interaction the row's
    /// `interaction_kwargs.name` names (checked when the data is read).
    fn into_call(self, key: u64) -> ToolCall {
        ToolCall {
            key,
            name: self.kwargs["name"].as_str().unwrap_or_default().to_string(),
            arguments: String::new(),
            create_kwargs: Value::Null,
            interaction: Some(self),
        }
    }
}

/// The runner of a run that names no tools: every call is answered as verl answers a call to
/// a tool it does not have.
pub struct NoTools;

impl ToolRunner for NoTools {
    fn schemas(&self) -> Vec<Value> {
        Vec::new()
    }
    fn submit(&self, call: ToolCall, done: std::sync::mpsc::Sender<ToolOutcome>) {
        let text = format!("Unknown function '{}'. Available tools: []", call.name);
        let _ = done.send(ToolOutcome {
            key: call.key,
            error: Some(text.clone()),
            text,
            reward: Some(0.0),
            terminate: call.interaction.is_some(),
        });
    }
}

#[cfg(test)]
#[path = "agent_tests.rs"]
mod tests;
