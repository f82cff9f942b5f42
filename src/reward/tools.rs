//! Tool execution for the multi-turn agent loop, in a pool of long-lived `python3` workers.
//!
//! Each worker runs the tool bridge shipped in this binary (`tool_bridge.py`) with the same
//! sandboxing as the reward workers (`python.rs`): a process group of its own, stdin /dev/null,
//! stdout and stderr into the log, requests and replies as JSON lines on descriptors 3 and 4,
//! and a watch that ends the group if main_ppo dies. The bridge instantiates the tools of
//! verl's tool config (`tool_config_path`) and the `@function_tool` functions of
//! `function_tool_path` once, then runs one call at a time as verl's `ToolAgentLoop._call_tool`
//! does.
//!
//! [`ToolPool::submit`] queues a call and returns; one thread per worker takes calls off the
//! queue, so up to `num_workers` calls run at once. A call that runs past the timeout, or a
//! worker that dies, costs that call only: the worker's group is killed, the call's outcome is
//! a named error, and a fresh worker takes the next call.
//!
//! Loading the tools may take `MAIN_PPO_WORKER_LOAD_S` seconds (default 120,
//! [`super::python::load_timeout`]). A tool whose reward is not a finite number (NaN, ±inf)
//! has it left out (verl would pass it on into `tool_rewards`): the call counts as a tool error
//! and the first such reward is logged as a warning.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::python::{load_timeout, BridgeProcess, Line, LOAD_TIMEOUT_VAR};
use crate::rollout::agent::{ToolCall, ToolOutcome, ToolRunner};

const TOOL_BRIDGE: &str = concat!(
    include_str!("orphan_watch.py"),
    include_str!("bridge_base.py"),
    include_str!("tool_bridge.py")
);

/// The largest tool text a worker sends back unless configured otherwise (1 MiB).
pub const DEFAULT_MAX_OUTPUT_BYTES: usize = 1 << 20;

/// How often a waiting worker thread checks whether the pool is being dropped.
const POLL: Duration = Duration::from_millis(50);

/// Where the tools are declared (verl's `tool_config_path` and `function_tool_path`), or the
/// interactions (`interaction_config_path`; a pool of its own, of one worker, so that each
/// conversation's interaction state stays in one process).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolSource {
    /// A YAML file with a top-level `tools:` list of `{class_name, config, tool_schema}`.
    pub tool_config_path: Option<PathBuf>,
    /// A Python file whose `@function_tool` functions become tools.
    pub function_tool_path: Option<PathBuf>,
    /// A YAML file with a top-level `interaction:` list of `{name, class_name, config}`.
    pub interaction_config_path: Option<PathBuf>,
}

/// Pool settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolPoolSettings {
    /// Interpreter (a user's virtualenv python works).
    pub python: String,
    /// Worker processes, and so the most calls that run at once.
    pub num_workers: usize,
    /// Longest a single call may take.
    pub timeout: Duration,
    /// A tool text longer than this (UTF-8 bytes) is replaced by an error; `None`: no limit.
    pub max_output_bytes: Option<usize>,
}

impl Default for ToolPoolSettings {
    fn default() -> Self {
        Self {
            python: "python3".into(),
            num_workers: 1,
            timeout: Duration::from_secs(60),
            max_output_bytes: Some(DEFAULT_MAX_OUTPUT_BYTES),
        }
    }
}

/// One queued call and where its outcome goes.
struct Job {
    call: ToolCall,
    done: Sender<ToolOutcome>,
}

/// What the worker threads share.
struct Shared {
    settings: ToolPoolSettings,
    /// The `load` message every worker gets.
    load: Value,
    /// Set when the pool is dropped: calls in flight end at once.
    stop: AtomicBool,
    /// Set once a non-finite tool reward has been logged.
    warned_non_finite: AtomicBool,
    queue: Mutex<Receiver<Job>>,
}

/// Tools running in Python worker processes.
pub struct ToolPool {
    schemas: Vec<Value>,
    jobs: Option<Sender<Job>>,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ToolPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolPool")
            .field("tools", &self.schemas.len())
            .field("workers", &self.threads.len())
            .finish()
    }
}

/// Which setting a [`ToolError::Config`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSetting {
    /// [`ToolSource::tool_config_path`]: the file, an entry, a tool class.
    ToolConfigPath,
    /// [`ToolSource::function_tool_path`]: the file or one of its functions.
    FunctionToolPath,
    /// [`ToolSource::interaction_config_path`]: the file, an entry, an interaction class.
    InteractionConfigPath,
    /// [`ToolPoolSettings::python`]: the interpreter.
    Python,
}

/// Why the tools did not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolError {
    /// Fixed in the configuration or the files it names (a bad entry, a class that does not
    /// import, an interpreter that does not start); the message names the file and entry.
    #[error("{message}")]
    Config {
        setting: ToolSetting,
        message: String,
    },
    /// A worker ended while loading, or loading took too long.
    #[error("{0}")]
    Failed(String),
}

fn config_error(msg: String) -> ToolError {
    ToolError::Config {
        setting: ToolSetting::ToolConfigPath,
        message: msg,
    }
}

/// One entry of the tool config's `tools:` list, checked and reduced to what the worker needs.
fn tool_entry(path: &Path, i: usize, entry: &Value) -> Result<Value, ToolError> {
    let at = format!("{}: tools[{i}]", path.display());
    let obj = entry
        .as_object()
        .ok_or_else(|| config_error(format!("{at} is not a mapping")))?;
    let class_name = match obj.get("class_name") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        Some(other) if !other.is_null() => {
            return Err(config_error(format!("{at}: `class_name` must be a string")))
        }
        _ => {
            return Err(config_error(format!(
                "{at} has no `class_name` (the tool's Python class, e.g. verl.tools.gsm8k_tool.Gsm8kTool)"
            )))
        }
    };
    let at = format!("{at} ({class_name})");
    let config = match obj.get("config") {
        Some(Value::Object(c)) => c,
        _ => {
            return Err(config_error(format!(
                "{at} has no `config` mapping (at least `config: {{type: native}}`)"
            )))
        }
    };
    match config.get("type").and_then(Value::as_str) {
        Some("native") => {}
        Some(other) => {
            return Err(config_error(format!(
            "{at}: config.type is `{other}`; only native tools are supported (MCP tools are not)"
        )))
        }
        None => {
            return Err(config_error(format!(
                "{at}: `config.type` is missing (only `native` is supported)"
            )))
        }
    }
    let schema = match obj.get("tool_schema") {
        None | Some(Value::Null) => Value::Null,
        Some(s @ Value::Object(_)) => s.clone(),
        Some(_) => {
            return Err(config_error(format!(
                "{at}: `tool_schema` must be a mapping (an OpenAI function schema) or null"
            )))
        }
    };
    Ok(json!({"class_name": class_name, "config": config, "tool_schema": schema}))
}

/// The top-level list `key` of the YAML file at `path` (verl's tool or interaction config,
/// `what`), each entry checked by `entry`; errors are `setting`'s and name the file.
fn read_config_list(
    path: &Path,
    what: &str,
    key: &str,
    setting: ToolSetting,
    entry: impl Fn(&Path, usize, &Value) -> Result<Value, ToolError>,
) -> Result<Vec<Value>, ToolError> {
    let err = |message: String| ToolError::Config { setting, message };
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| err(format!("cannot read the {what} {shown}: {e}")))?;
    let doc: Value = serde_yaml_ng::from_str(&text).map_err(|e| {
        let e = crate::config::overrides::yaml_message(&e);
        err(format!("the {what} {shown} is not valid YAML: {e}"))
    })?;
    let list = match doc.get(key) {
        Some(Value::Array(list)) => list,
        Some(_) => return Err(err(format!("{shown}: `{key}` must be a list of entries"))),
        None => return Err(err(format!("{shown}: no top-level `{key}:` list"))),
    };
    list.iter()
        .enumerate()
        .map(|(i, e)| entry(path, i, e))
        .collect()
}

/// The `tools:` entries of verl's tool config file at `path`.
fn read_tool_config(path: &Path) -> Result<Vec<Value>, ToolError> {
    read_config_list(
        path,
        "tool config",
        "tools",
        ToolSetting::ToolConfigPath,
        tool_entry,
    )
}

fn interaction_error(msg: String) -> ToolError {
    ToolError::Config {
        setting: ToolSetting::InteractionConfigPath,
        message: msg,
    }
}

/// One entry of the interaction config's `interaction:` list: its class, config and name (the
/// entry's `name`, else the class's name without a trailing `Interaction`, lower-cased, as
/// verl's registry names it).
fn interaction_entry(path: &Path, i: usize, entry: &Value) -> Result<Value, ToolError> {
    let at = format!("{}: interaction[{i}]", path.display());
    let obj = entry
        .as_object()
        .ok_or_else(|| interaction_error(format!("{at} is not a mapping")))?;
    let class_name = match obj.get("class_name") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        _ => {
            return Err(interaction_error(format!(
                "{at} has no `class_name` string (the interaction's Python class, e.g. verl.interactions.gsm8k_interaction.Gsm8kInteraction)"
            )))
        }
    };
    let config = match obj.get("config") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(c @ Value::Object(_)) => c.clone(),
        Some(_) => {
            return Err(interaction_error(format!(
                "{at} ({class_name}): `config` must be a mapping"
            )))
        }
    };
    let name = match obj.get("name") {
        None | Some(Value::Null) => {
            let simple = class_name.rsplit('.').next().unwrap_or(&class_name);
            simple
                .strip_suffix("Interaction")
                .unwrap_or(simple)
                .to_lowercase()
        }
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        Some(_) => {
            return Err(interaction_error(format!(
                "{at} ({class_name}): `name` must be a non-empty string"
            )))
        }
    };
    Ok(json!({"name": name, "class_name": class_name, "config": config}))
}

/// The `interaction:` entries of verl's interaction config file at `path`, names unique.
pub fn read_interaction_config(path: &Path) -> Result<Vec<Value>, ToolError> {
    let shown = path.display();
    let entries = read_config_list(
        path,
        "interaction config",
        "interaction",
        ToolSetting::InteractionConfigPath,
        interaction_entry,
    )?;
    for (i, e) in entries.iter().enumerate() {
        if entries[..i].iter().any(|o| o["name"] == e["name"]) {
            return Err(interaction_error(format!(
                "{shown}: interaction[{i}]: the name {} is used twice; each interaction needs its own name",
                e["name"]
            )));
        }
    }
    Ok(entries)
}

/// The names of the interactions in `entries` ([`read_interaction_config`]).
pub fn interaction_names(entries: &[Value]) -> Vec<String> {
    entries
        .iter()
        .filter_map(|e| e["name"].as_str().map(str::to_string))
        .collect()
}

/// The `load` message: the checked tool and interaction entries and where everything came from.
fn load_message(src: &ToolSource, s: &ToolPoolSettings) -> Result<Value, ToolError> {
    let tools = match &src.tool_config_path {
        Some(p) => read_tool_config(p)?,
        None => Vec::new(),
    };
    let interactions = match &src.interaction_config_path {
        Some(p) => read_interaction_config(p)?,
        None => Vec::new(),
    };
    let shown = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    Ok(json!({
        "op": "load",
        "tools": tools,
        "interactions": interactions,
        "tool_config_path": shown(&src.tool_config_path),
        "function_tool_path": shown(&src.function_tool_path),
        "interaction_config_path": shown(&src.interaction_config_path),
        "max_output_bytes": s.max_output_bytes,
    }))
}

/// Starts a worker and loads the tools in it; returns it with the tools' schemas.
fn spawn_worker(
    s: &ToolPoolSettings,
    load: &Value,
    id: usize,
) -> Result<(BridgeProcess, Vec<Value>), ToolError> {
    let mut proc =
        BridgeProcess::start(&s.python, TOOL_BRIDGE, "tool worker", id).map_err(|e| {
            ToolError::Config {
                setting: ToolSetting::Python,
                message: format!(
                    "cannot start the Python interpreter `{}` for tools: {e}",
                    s.python
                ),
            }
        })?;
    proc.send(load)
        .map_err(|e| ToolError::Failed(format!("the tool worker exited at start-up: {e}")))?;
    let limit = load_timeout();
    match proc.rx.recv_timeout(limit) {
        Ok(Line::Msg(m)) if m["ok"] == json!(true) => {
            let schemas = m["schemas"].as_array().cloned().unwrap_or_default();
            Ok((proc, schemas))
        }
        Ok(Line::Msg(m)) => {
            let place = m["where"].as_str();
            // The function tools' file, or the tool config (an entry, or the shims before it).
            let setting = match place {
                Some(w) if w.starts_with("function_tool_path ") => ToolSetting::FunctionToolPath,
                Some(w) if w.contains(": interaction[") => ToolSetting::InteractionConfigPath,
                _ if !load["interaction_config_path"].is_null() => {
                    ToolSetting::InteractionConfigPath
                }
                _ if load["tool_config_path"].is_null() => ToolSetting::FunctionToolPath,
                _ => ToolSetting::ToolConfigPath,
            };
            Err(ToolError::Config {
                setting,
                message: format!(
                    "cannot load the tools{}: {}\n{}",
                    place.map(|w| format!(" ({w})")).unwrap_or_default(),
                    m["error"]
                        .as_str()
                        .or(m["protocol_error"].as_str())
                        .unwrap_or("unknown error"),
                    m["traceback"].as_str().unwrap_or("").trim_end()
                ),
            })
        }
        Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
            let status = proc.kill();
            Err(ToolError::Failed(format!(
                "the tool worker exited while loading the tools ({status})"
            )))
        }
        Err(RecvTimeoutError::Timeout) => {
            proc.kill();
            Err(ToolError::Failed(format!(
                "loading the tools took more than {} s ({LOAD_TIMEOUT_VAR})",
                limit.as_secs_f64()
            )))
        }
    }
}

impl ToolPool {
    /// Reads the tool config, starts the workers and loads the tools in each. A bad config, a
    /// class that cannot be imported or instantiated, an unusable function tool or a tool name
    /// used twice fails here, naming the file and entry.
    pub fn start(src: &ToolSource, s: ToolPoolSettings) -> Result<Self, ToolError> {
        let load = load_message(src, &s)?;
        let n = s.num_workers.max(1);
        // One first, so that a broken tool fails once, not n times.
        let (first, schemas) = spawn_worker(&s, &load, 0)?;
        let rest: Vec<Result<(BridgeProcess, Vec<Value>), ToolError>> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = (1..n)
                    .map(|id| {
                        let (s, load) = (&s, &load);
                        scope.spawn(move || spawn_worker(s, load, id))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(ToolError::Failed(
                                "a tool worker start-up thread panicked".into(),
                            ))
                        })
                    })
                    .collect()
            });
        let mut procs = vec![first];
        for r in rest {
            procs.push(r?.0);
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            settings: s,
            load,
            stop: AtomicBool::new(false),
            warned_non_finite: AtomicBool::new(false),
            queue: Mutex::new(rx),
        });
        let mut pool = ToolPool {
            schemas,
            jobs: Some(tx),
            shared,
            threads: Vec::with_capacity(n),
        };
        for (id, proc) in procs.into_iter().enumerate() {
            pool.spawn_thread(id, proc)?;
        }
        Ok(pool)
    }

    /// Starts the thread that feeds calls to worker `id`.
    fn spawn_thread(&mut self, id: usize, proc: BridgeProcess) -> Result<(), ToolError> {
        let shared = Arc::clone(&self.shared);
        let slot = Slot {
            id,
            proc: Some(proc),
            next_id: 0,
        };
        let handle = std::thread::Builder::new()
            .name(format!("tool-worker-{id}"))
            .spawn(move || worker_loop(slot, &shared))
            .map_err(|e| ToolError::Failed(format!("cannot start a tool worker thread: {e}")))?;
        self.threads.push(handle);
        Ok(())
    }

    /// The tools' OpenAI function schemas, in verl's order (the config's tools, then the
    /// function tools).
    pub fn schemas(&self) -> &[Value] {
        &self.schemas
    }

    /// Queues `call`; its outcome arrives on `done` once a worker has run it.
    pub fn submit(&self, call: ToolCall, done: Sender<ToolOutcome>) {
        let Some(jobs) = &self.jobs else {
            let _ = done.send(failed(&call, Failure::Shutdown));
            return;
        };
        if let Err(mpsc::SendError(job)) = jobs.send(Job { call, done }) {
            let _ = job.done.send(failed(&job.call, Failure::Shutdown));
        }
    }
}

impl ToolRunner for ToolPool {
    fn schemas(&self) -> Vec<Value> {
        self.schemas.clone()
    }

    fn submit(&self, call: ToolCall, done: Sender<ToolOutcome>) {
        ToolPool::submit(self, call, done);
    }
}

impl Drop for ToolPool {
    /// Ends the workers: calls in flight stop, queued calls get an error, and each worker is
    /// asked to quit and then killed with its process group.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Why a call produced no reply from its tool.
enum Failure {
    /// The call ran past the timeout (seconds); the worker was killed.
    Timeout(f64),
    /// The worker exited during the call (how it ended).
    Died(String),
    /// The worker sent a line that is not a reply to the call; it was killed.
    Protocol(String),
    /// No worker could be started for the call.
    NoWorker(String),
    /// The pool is being dropped.
    Shutdown,
}

/// The outcome of a call that failed outside the tool: the model sees verl's "Error executing
/// tool" text, the log and metrics the named cause; no reward.
fn failed(call: &ToolCall, why: Failure) -> ToolOutcome {
    let name = &call.name;
    let (short, error) = match why {
        Failure::Timeout(secs) => (
            format!("timed out after {secs} s"),
            format!("tool '{name}' timed out after {secs} s (its worker was killed and replaced)"),
        ),
        Failure::Died(status) => (
            "the tool's process died".to_string(),
            format!("tool '{name}': its worker process died ({status}); it was replaced"),
        ),
        Failure::Protocol(detail) => (
            "the tool's process sent a malformed reply".to_string(),
            format!("tool '{name}': its worker sent a malformed reply ({detail}); it was replaced"),
        ),
        Failure::NoWorker(e) => (
            "no tool process could be started".to_string(),
            format!("tool '{name}': no tool worker could be started: {e}"),
        ),
        Failure::Shutdown => (
            "the tool pool was shut down".to_string(),
            format!("tool '{name}': the tool pool was shut down"),
        ),
    };
    ToolOutcome {
        key: call.key,
        text: format!("Error executing tool '{name}': {short}"),
        reward: None,
        error: Some(error),
        terminate: call.interaction.is_some(),
    }
}

/// The outcome a worker's reply describes. A reward that is not a finite number is left out
/// and makes the call an error (the first one of the pool is logged as a warning: `warned`).
fn outcome(call: &ToolCall, m: &Value, warned: &AtomicBool) -> ToolOutcome {
    let mut reward = match &m["reward"] {
        Value::Number(n) => n.as_f64(),
        // A non-finite reward arrives as Python prints it ("nan", "inf", "-inf").
        Value::String(s) => s.parse::<f64>().ok(),
        _ => None,
    };
    let mut error = m["error"].as_str().map(str::to_string);
    if let Some(r) = reward.filter(|r| !r.is_finite()) {
        let why = format!(
            "tool '{}' returned the reward {r}, not a finite number: it is left out of tool_rewards and agent/tool_reward/mean, and the call counts as a tool error",
            call.name
        );
        if !warned.swap(true, Ordering::SeqCst) {
            tracing::warn!(target: "main_ppo::reward", "{why} (said once)");
        }
        reward = None;
        error = error.or(Some(why));
    }
    if let Some(metrics) = m["metrics"].as_object().filter(|m| !m.is_empty()) {
        let shown = Value::Object(metrics.clone());
        tracing::debug!(target: "main_ppo::reward", "tool '{}' metrics: {shown}", call.name);
    }
    ToolOutcome {
        key: call.key,
        text: m["text"].as_str().unwrap_or("").to_string(),
        reward,
        // An interaction that failed ends its conversation whatever it said.
        terminate: call.interaction.is_some()
            && (m["terminate"] != json!(false) || error.is_some()),
        error,
    }
}

/// What the next reply line (or its absence) was.
enum Event {
    Msg(Value),
    Eof,
    Timeout,
    Stopped,
}

/// One worker process and its request counter, owned by its thread.
struct Slot {
    id: usize,
    /// `None` after the worker was killed; the next call starts a fresh one.
    proc: Option<BridgeProcess>,
    next_id: u64,
}

/// Takes calls off the queue until the pool is dropped.
fn worker_loop(mut slot: Slot, shared: &Shared) {
    loop {
        let job = {
            let queue = shared.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.recv()
        };
        let Ok(job) = job else { return };
        let out = if shared.stop.load(Ordering::SeqCst) {
            failed(&job.call, Failure::Shutdown)
        } else {
            slot.run(&job.call, shared)
        };
        let _ = job.done.send(out);
    }
}

impl Slot {
    /// Runs `call` on this slot's worker.
    fn run(&mut self, call: &ToolCall, shared: &Shared) -> ToolOutcome {
        self.next_id += 1;
        let id = self.next_id;
        let kwargs = if call.create_kwargs.is_null() {
            Value::Object(Map::new())
        } else {
            call.create_kwargs.clone()
        };
        let request = match &call.interaction {
            None => {
                json!({"op": "call", "id": id, "name": call.name, "arguments": call.arguments, "create_kwargs": kwargs})
            }
            Some(t) => match &t.messages {
                Some(messages) => {
                    json!({"op": "interact", "id": id, "name": call.name, "instance": t.instance, "messages": messages, "kwargs": t.kwargs, "first": t.first})
                }
                None => {
                    json!({"op": "finalize", "id": id, "name": call.name, "instance": t.instance})
                }
            },
        };
        match self.exchange(&request, id, shared) {
            Ok(reply) => outcome(call, &reply, &shared.warned_non_finite),
            Err(why) => {
                let out = failed(call, why);
                tracing::warn!(target: "main_ppo::reward", "tool worker {}: {}", self.id, out.error.as_deref().unwrap_or(""));
                out
            }
        }
    }

    /// The worker is killed: the call ran past its time (`Event::Timeout`) or the pool is
    /// stopping (`Event::Stopped`).
    fn abandon(&mut self, shared: &Shared, ev: &Event) -> Failure {
        self.kill();
        match ev {
            Event::Stopped => Failure::Shutdown,
            _ => Failure::Timeout(shared.settings.timeout.as_secs_f64()),
        }
    }

    /// Sends request `id` and returns the worker's reply to it.
    fn exchange(&mut self, request: &Value, id: u64, shared: &Shared) -> Result<Value, Failure> {
        self.live(shared)?;
        let deadline = Instant::now() + shared.settings.timeout;
        self.deliver(request, id, shared, deadline)?;
        loop {
            let ev = self.next_event(deadline, shared);
            match ev {
                Event::Msg(m) => match reply_id(&m) {
                    Ok(Some(rid)) if rid == id && m.get("accepted").is_none() => return Ok(m),
                    Ok(Some(rid)) if rid < id => continue,
                    Ok(_) => {
                        return Err(self.broken(format!("no reply to call {id} in {}", short(&m))))
                    }
                    Err(detail) => return Err(self.broken(detail)),
                },
                Event::Eof => return Err(Failure::Died(self.kill())),
                Event::Timeout | Event::Stopped => return Err(self.abandon(shared, &ev)),
            }
        }
    }

    /// Sends the request and waits until the worker accepts it (the bridge accepts a call
    /// before the tool runs). A worker that ends before accepting never ran the call, so a
    /// fresh one gets it, once.
    fn deliver(
        &mut self,
        request: &Value,
        id: u64,
        shared: &Shared,
        deadline: Instant,
    ) -> Result<(), Failure> {
        let mut gone = String::new();
        for attempt in 0..2 {
            if attempt > 0 {
                tracing::warn!(target: "main_ppo::reward", "tool worker {} ended before taking a call ({gone}); starting a new one", self.id);
                self.live(shared)?;
            }
            let sent = match self.proc.as_mut() {
                Some(p) => p.send(request).is_ok(),
                None => false,
            };
            if !sent {
                gone = format!("request pipe closed; {}", self.kill());
                continue;
            }
            loop {
                let ev = self.next_event(deadline, shared);
                match ev {
                    Event::Msg(m) => match reply_id(&m) {
                        Ok(Some(rid)) if rid == id && m["accepted"] == json!(true) => return Ok(()),
                        Ok(Some(rid)) if rid < id => continue,
                        Ok(_) => {
                            return Err(
                                self.broken(format!("no acceptance of call {id} in {}", short(&m)))
                            )
                        }
                        Err(detail) => return Err(self.broken(detail)),
                    },
                    Event::Eof => {
                        gone = self.kill();
                        break;
                    }
                    Event::Timeout | Event::Stopped => return Err(self.abandon(shared, &ev)),
                }
            }
        }
        Err(Failure::Died(gone))
    }

    /// Makes sure a worker is running: one that exited while idle is reaped and replaced.
    fn live(&mut self, shared: &Shared) -> Result<(), Failure> {
        if self.proc.as_ref().is_some_and(BridgeProcess::exited) {
            let status = self.kill();
            tracing::warn!(target: "main_ppo::reward", "tool worker {} had exited while idle ({status}); replacing it", self.id);
        }
        if self.proc.is_none() {
            let (proc, _) = spawn_worker(&shared.settings, &shared.load, self.id)
                .map_err(|e| Failure::NoWorker(e.to_string()))?;
            self.proc = Some(proc);
        }
        Ok(())
    }

    /// The next reply line, waiting until `deadline` in short slices so that dropping the pool
    /// is noticed.
    fn next_event(&mut self, deadline: Instant, shared: &Shared) -> Event {
        let Some(proc) = self.proc.as_mut() else {
            return Event::Eof;
        };
        loop {
            if shared.stop.load(Ordering::SeqCst) {
                return Event::Stopped;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Event::Timeout;
            }
            match proc.rx.recv_timeout(left.min(POLL)) {
                Ok(Line::Msg(m)) => return Event::Msg(m),
                Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => return Event::Eof,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Kills the worker's group and forgets the worker; returns how it ended.
    fn kill(&mut self) -> String {
        match self.proc.take() {
            Some(mut p) => p.kill(),
            None => "no worker".into(),
        }
    }

    /// A protocol failure: the worker's replies can no longer be matched to calls.
    fn broken(&mut self, detail: String) -> Failure {
        self.kill();
        Failure::Protocol(detail)
    }
}

/// The request id a reply line carries; an error for a line that is not a reply.
fn reply_id(m: &Value) -> Result<Option<u64>, String> {
    if let Some(p) = m.get("protocol_error").and_then(Value::as_str) {
        return Err(p.to_string());
    }
    Ok(m["id"].as_u64())
}

/// A reply for a message, cut to a readable length.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 200 {
        format!("{}…", s.chars().take(200).collect::<String>())
    } else {
        s
    }
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
