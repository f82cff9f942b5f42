//! The tracker bridge: each remote backend of `trainer.logger` (wandb, vemlp_wandb, swanlab,
//! mlflow, clearml, trackio, the names of verl's `Tracking`) runs in its own long-lived Python
//! worker process (`tracker_worker.py`, shipped in the binary) that calls the backend's own SDK,
//! as the reward functions run in theirs (`reward/python.rs`): started once, fed JSON lines over
//! a pipe, isolated from the trainer.
//!
//! Start-up is synchronous and strict: an interpreter that cannot import the SDK is an error
//! naming the backend and its pip package, before any compute. After that the trainer never
//! waits: [`RemoteTracker::log`] puts the step on a bounded queue that a sender thread delivers.
//! A worker that dies, errs or stops answering (network down, auth expired, a server that hangs)
//! is reported once; a dead or hung one is killed and its later steps are dropped (the run's
//! own `file`/`tensorboard` sinks keep everything). [`RemoteTracker::finish`] flushes within a
//! timeout. Each worker leads a process group of its own (`reward::python::GroupLeader`): it is
//! always killed with its group, so processes its SDK started end with it, and its script starts
//! with the reward workers' watch on main_ppo (`orphan_watch.py`), which ends the group when
//! main_ppo dies without ending it.
//!
//! Environment: `MAIN_PPO_TRACKER_TIMEOUT_S` (longest one call may take before the worker is
//! declared hung, default 120), `MAIN_PPO_TRACKER_FLUSH_S` (longest the final flush may take,
//! default 120), `MAIN_PPO_TRACKER_INIT_S` (longest opening the run may take, default 300),
//! `MAIN_PPO_TRACKER_CONNECT_S` (longest an http(s) MLflow server's address may take to accept a
//! connection before the run is opened, default 10: MLflow's own retries would wait minutes).

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::Metrics;
use crate::reward::python::GroupLeader;

/// The worker: the watch every Python worker of main_ppo starts with, then the tracker's own.
const WORKER: &str = concat!(
    include_str!("../reward/orphan_watch.py"),
    include_str!("tracker_worker.py")
);

/// The remote backends, each with the pip package its SDK comes in.
pub const BACKENDS: [(&str, &str); 6] = [
    ("wandb", "wandb"),
    ("vemlp_wandb", "volcengine-ml-platform"),
    ("swanlab", "swanlab"),
    ("mlflow", "mlflow"),
    ("clearml", "clearml"),
    ("trackio", "trackio"),
];

/// How long a worker that has closed its run may take to exit by itself before its process
/// group is killed.
const EXIT_GRACE: Duration = Duration::from_secs(10);

/// The pip package of a remote backend.
pub fn package(backend: &str) -> Option<&'static str> {
    BACKENDS
        .iter()
        .find(|(b, _)| *b == backend)
        .map(|(_, p)| *p)
}

/// The Python module a remote backend's SDK is imported as.
fn module(backend: &str) -> Option<&'static str> {
    package(backend).map(|p| match p {
        "volcengine-ml-platform" => "volcengine_ml_platform",
        other => other,
    })
}

/// The error for a backend whose SDK `python` cannot import (`error`: Python's words).
fn missing_sdk(backend: &str, pkg: &str, python: &str, error: &str) -> String {
    format!(
        "trainer.logger: `{backend}` needs the Python package `{pkg}`, which `{python}` (reward.python) cannot import ({error}): `pip install {pkg}` for that interpreter, or set reward.python to one that has it"
    )
}

/// The error for an interpreter that cannot start.
fn no_interpreter(backend: &str, pkg: &str, python: &str, e: &std::io::Error) -> String {
    format!(
        "trainer.logger: `{backend}` runs its SDK (pip package `{pkg}`) in a Python worker, but the interpreter `{python}` (reward.python) cannot start: {e}"
    )
}

/// How long [`probe_sdk`] waits for the import.
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);

/// Whether `python` imports `backend`'s SDK, as the tracker worker does first when training
/// starts it; the error is the one the worker's start gives. Backends without an SDK pass.
pub fn probe_sdk(backend: &str, python: &str) -> Result<(), String> {
    let (Some(pkg), Some(module)) = (package(backend), module(backend)) else {
        return Ok(());
    };
    let mut child = Command::new(python)
        .arg("-c")
        .arg(format!("import {module}"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| no_interpreter(backend, pkg, python, &e))?;
    let stderr = child.stderr.take().expect("piped stderr");
    let reader = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let deadline = Instant::now() + PROBE_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                // SAFETY: a plain system call on the group this function started (the child is
                // not reaped yet, so its pid still names the group).
                unsafe { libc::killpg(child.id() as libc::pid_t, libc::SIGKILL) };
                let _ = child.wait();
                return Err(format!(
                    "trainer.logger: importing `{module}` (the `{backend}` SDK) with `{python}` (reward.python) took more than {} s",
                    PROBE_TIMEOUT.as_secs()
                ));
            }
        }
    };
    let lines = reader.join().unwrap_or_default();
    if status.success() {
        return Ok(());
    }
    let error = lines
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty())
        .cloned()
        .unwrap_or_else(|| status.to_string());
    Err(missing_sdk(backend, pkg, python, error.trim()))
}

/// How the workers run.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSettings {
    /// The interpreter (`reward.python`: the same rule as the reward workers).
    pub python: String,
    pub init_timeout: Duration,
    pub call_timeout: Duration,
    pub flush_timeout: Duration,
    /// Requests held while the worker is busy; the oldest is dropped beyond this.
    pub buffer: usize,
}

fn env_seconds(name: &str, default: f64) -> Duration {
    let s = std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(default);
    Duration::from_secs_f64(s)
}

impl RemoteSettings {
    /// `python`, the timeouts from the environment, a buffer of 10 000 requests.
    pub fn from_env(python: &str) -> Self {
        Self {
            python: python.to_string(),
            init_timeout: env_seconds("MAIN_PPO_TRACKER_INIT_S", 300.0),
            call_timeout: env_seconds("MAIN_PPO_TRACKER_TIMEOUT_S", 120.0),
            flush_timeout: env_seconds("MAIN_PPO_TRACKER_FLUSH_S", 120.0),
            buffer: 10_000,
        }
    }
}

/// What a run is: verl's conventions (project = `trainer.project_name`, run name =
/// `trainer.experiment_name`, the resolved configuration as the run's config).
#[derive(Debug, Clone, PartialEq)]
pub struct RunSpec {
    pub project: String,
    pub experiment: String,
    pub config: Value,
    /// The backend's run id saved by the run being resumed.
    pub resume_id: Option<String>,
}

enum Line {
    Msg(Value),
    Eof,
}

#[derive(Default)]
struct Queue {
    items: VecDeque<Value>,
    closing: bool,
    done: bool,
    /// Why the worker was given up on (dead or hung).
    failed: Option<String>,
    dropped: u64,
    errors: u64,
    delivered: u64,
}

type Shared = Arc<(Mutex<Queue>, Condvar)>;

/// One backend's worker.
pub struct RemoteTracker {
    pub backend: String,
    /// The run's id in the backend (wandb run id, MLflow run id, ...), when it has one.
    pub run_id: Option<String>,
    shared: Shared,
    /// The worker, leading a process group of its own (with whatever the SDK starts).
    child: Arc<Mutex<GroupLeader>>,
    thread: Option<JoinHandle<()>>,
    flush_timeout: Duration,
    buffer: usize,
    finished: bool,
}

fn lock(shared: &Shared) -> std::sync::MutexGuard<'_, Queue> {
    shared.0.lock().unwrap_or_else(|e| e.into_inner())
}

fn send_line(stdin: &mut ChildStdin, msg: &Value) -> std::io::Result<()> {
    let mut line = serde_json::to_string(msg).map_err(std::io::Error::other)?;
    line.push('\n');
    stdin.write_all(line.as_bytes())?;
    stdin.flush()
}

/// A number for the worker: JSON has no NaN or infinity, so those travel as Python spells them.
fn number(x: f64) -> Value {
    if x.is_finite() {
        json!(x)
    } else if x.is_nan() {
        json!("nan")
    } else if x > 0.0 {
        json!("inf")
    } else {
        json!("-inf")
    }
}

/// Kills the worker's process group: the worker and the processes its SDK started.
fn kill(child: &Mutex<GroupLeader>) {
    child.lock().unwrap_or_else(|e| e.into_inner()).kill();
}

/// Why a tracker could not start.
#[derive(Debug, Clone, PartialEq)]
pub enum StartError {
    /// The configuration cannot run here (an unknown backend, an SDK the interpreter cannot
    /// import, an interpreter that does not start): fixed in the configuration or the
    /// environment, refused as `config check` refuses it.
    Config(String),
    /// The backend could not open its run (a server that does not answer, credentials, a
    /// worker that died).
    Failed(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(m) | StartError::Failed(m) => f.write_str(m),
        }
    }
}

/// Where a backend sends its run, for messages: MLflow's tracking URI (the worker's default
/// when `MLFLOW_TRACKING_URI` is unset), nothing for the others.
fn target(backend: &str) -> String {
    match backend {
        "mlflow" => format!(
            " at MLFLOW_TRACKING_URI={}",
            std::env::var("MLFLOW_TRACKING_URI")
                .unwrap_or_else(|_| "sqlite:////tmp/mlruns.db".into())
        ),
        _ => String::new(),
    }
}

/// The last lines the worker wrote on stderr, for an error message (empty when none).
fn tail_text(tail: &Mutex<VecDeque<String>>) -> String {
    let t = tail.lock().unwrap_or_else(|e| e.into_inner());
    if t.is_empty() {
        String::new()
    } else {
        format!("\n{}", t.iter().cloned().collect::<Vec<_>>().join("\n"))
    }
}

/// Sends the `init` request and waits for the run to open: its run id, or why not.
fn open_run(
    backend: &str,
    pkg: &str,
    run: &RunSpec,
    settings: &RemoteSettings,
    stdin: &mut ChildStdin,
    rx: &Receiver<Line>,
    tail: &Mutex<VecDeque<String>>,
) -> Result<Option<String>, StartError> {
    let init = json!({
        "op": "init", "id": 0, "backend": backend, "project": run.project,
        "experiment": run.experiment, "config": run.config, "resume_id": run.resume_id,
    });
    let python = &settings.python;
    if let Err(e) = send_line(stdin, &init) {
        std::thread::sleep(Duration::from_millis(100));
        return Err(StartError::Failed(format!(
            "trainer.logger: the `{backend}` worker (`{python}`) exited at start-up: {e}{}",
            tail_text(tail)
        )));
    }
    match rx.recv_timeout(settings.init_timeout) {
        Ok(Line::Msg(m)) if m["ok"] == json!(true) => Ok(m["run_id"].as_str().map(str::to_string)),
        Ok(Line::Msg(m)) if m["missing"].is_string() => Err(StartError::Config(missing_sdk(
            backend,
            pkg,
            python,
            m["error"].as_str().unwrap_or("ImportError"),
        ))),
        Ok(Line::Msg(m)) => Err(StartError::Failed(format!(
            "trainer.logger: `{backend}` (pip package `{pkg}`) could not open the run (project `{}`, experiment `{}`){}: {}\n{}",
            run.project,
            run.experiment,
            target(backend),
            m["error"].as_str().unwrap_or("unknown error"),
            m["traceback"].as_str().unwrap_or("").trim_end()
        ))),
        Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
            std::thread::sleep(Duration::from_millis(100));
            Err(StartError::Failed(format!(
                "trainer.logger: the `{backend}` worker (`{python}`) exited while opening the run{}{}",
                target(backend),
                tail_text(tail)
            )))
        }
        Err(RecvTimeoutError::Timeout) => Err(StartError::Failed(format!(
            "trainer.logger: `{backend}` did not open its run{} within {} s (MAIN_PPO_TRACKER_INIT_S){}",
            target(backend),
            settings.init_timeout.as_secs_f64(),
            tail_text(tail)
        ))),
    }
}

impl RemoteTracker {
    /// Starts the worker and opens the run; fails (naming `trainer.logger`, the backend and its
    /// pip package) when the SDK is missing or the run cannot be opened.
    pub fn start(
        backend: &str,
        run: &RunSpec,
        settings: &RemoteSettings,
    ) -> Result<Self, StartError> {
        let Some(pkg) = package(backend) else {
            return Err(StartError::Config(format!(
                "trainer.logger: `{backend}` is not a remote backend"
            )));
        };
        let mut child = GroupLeader::spawn(
            Command::new(&settings.python)
                .arg("-u")
                .arg("-c")
                .arg(WORKER)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped()),
        )
        .map_err(|e| StartError::Config(no_interpreter(backend, pkg, &settings.python, &e)))?;
        let pipes = child.child_mut();
        let mut stdin = pipes.stdin.take().expect("piped stdin");
        let stdout = pipes.stdout.take().expect("piped stdout");
        let stderr = pipes.stderr.take().expect("piped stderr");
        let (rx, tail) = read_worker(backend, stdout, stderr);
        let child = Arc::new(Mutex::new(child));
        let run_id = open_run(backend, pkg, run, settings, &mut stdin, &rx, &tail)
            .inspect_err(|_| kill(&child))?;
        let shared: Shared = Arc::new((Mutex::new(Queue::default()), Condvar::new()));
        let thread = {
            let (shared, child, name) = (shared.clone(), child.clone(), backend.to_string());
            let timeout = settings.call_timeout;
            std::thread::Builder::new()
                .name(format!("tracker-{backend}"))
                .spawn(move || deliver(&name, stdin, rx, &shared, &child, timeout))
                .map_err(|e| {
                    StartError::Failed(format!(
                        "trainer.logger: `{backend}`: cannot start a thread: {e}"
                    ))
                })?
        };
        tracing::info!(
            "trainer.logger: {backend} run open{}",
            run_id
                .as_ref()
                .map(|id| format!(" (run id {id})"))
                .unwrap_or_default()
        );
        Ok(Self {
            backend: backend.to_string(),
            run_id,
            shared,
            child,
            thread: Some(thread),
            flush_timeout: settings.flush_timeout,
            buffer: settings.buffer.max(1),
            finished: false,
        })
    }

    /// The worker's process id (tests kill it).
    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap_or_else(|e| e.into_inner()).id()
    }

    fn push(&self, msg: Value) {
        let (m, cv) = &*self.shared;
        let mut q = m.lock().unwrap_or_else(|e| e.into_inner());
        if q.failed.is_some() || q.closing {
            return;
        }
        if q.items.len() >= self.buffer {
            q.items.pop_front();
            q.dropped += 1;
            if q.dropped == 1 {
                tracing::warn!(
                    "trainer.logger: {} is behind by {} requests; the oldest are dropped (the file/tensorboard sinks keep them)",
                    self.backend,
                    self.buffer
                );
            }
        }
        q.items.push_back(msg);
        cv.notify_all();
    }

    /// Queues one step's metrics; never waits for the backend.
    pub fn log(&self, metrics: &Metrics, step: u64) {
        let data: serde_json::Map<String, Value> = metrics
            .iter()
            .map(|(k, v)| (k.clone(), number(*v)))
            .collect();
        self.push(json!({"op": "log", "step": step, "data": data}));
    }

    /// Queues validation generations `(input, output, score)`.
    pub fn generations(&self, samples: &[(String, String, f64)], step: u64) {
        let rows: Vec<Value> = samples
            .iter()
            .map(|(i, o, s)| json!([i, o, number(*s)]))
            .collect();
        self.push(json!({"op": "generations", "step": step, "samples": rows}));
    }

    /// Delivers what is queued and closes the run, within the flush timeout; a worker that
    /// does not finish in time is killed. Reports what was not delivered.
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let deadline = Instant::now() + self.flush_timeout;
        let (m, cv) = &*self.shared;
        let mut q = m.lock().unwrap_or_else(|e| e.into_inner());
        q.closing = true;
        cv.notify_all();
        while !q.done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            q = cv
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let timed_out = !q.done;
        let left = q.items.len() as u64;
        let (failed, dropped, errors) = (q.failed.is_some(), q.dropped, q.errors);
        drop(q);
        if timed_out {
            kill(&self.child);
            tracing::warn!(
                "trainer.logger: {} did not finish within {} s (MAIN_PPO_TRACKER_FLUSH_S): its worker was killed with {left} request(s) undelivered",
                self.backend,
                self.flush_timeout.as_secs_f64()
            );
        } else if !failed && (dropped > 0 || errors > 0) {
            tracing::warn!(
                "trainer.logger: {}: {errors} request(s) failed and {dropped} were dropped during the run",
                self.backend
            );
        }
        if let Some(t) = self.thread.take() {
            if !timed_out {
                let _ = t.join();
            }
        }
        if !timed_out && !failed {
            // The run is closed: the worker's exit handlers (the SDK's own teardown) may run
            // before its group goes.
            let left = deadline.saturating_duration_since(Instant::now());
            let child = self.child.lock().unwrap_or_else(|e| e.into_inner());
            child.wait_exit(left.min(EXIT_GRACE));
        }
        kill(&self.child);
    }
}

impl Drop for RemoteTracker {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The sender thread: delivers queued requests one at a time, each acknowledged within
/// `timeout`; gives up on a worker that dies or hangs (killing it), then discards.
fn deliver(
    backend: &str,
    mut stdin: ChildStdin,
    rx: Receiver<Line>,
    shared: &Shared,
    child: &Mutex<GroupLeader>,
    timeout: Duration,
) {
    let (m, cv) = &**shared;
    let mut next_id = 0u64;
    let mut closing_sent = false;
    loop {
        let msg = {
            let mut q = m.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if q.failed.is_some() {
                    q.items.clear();
                }
                if let Some(msg) = q.items.pop_front() {
                    break Some(msg);
                }
                if q.closing {
                    break None;
                }
                q = cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let failed = lock(shared).failed.is_some();
        let (mut msg, is_finish) = match msg {
            Some(msg) => (msg, false),
            None if failed || closing_sent => break,
            None => {
                closing_sent = true;
                (json!({"op": "finish"}), true)
            }
        };
        next_id += 1;
        msg["id"] = json!(next_id);
        let step = msg["step"].as_u64();
        let what = match step {
            Some(s) => format!("at step {s}"),
            None => "closing the run".to_string(),
        };
        let outcome: Result<(), (String, bool)> = match send_line(&mut stdin, &msg) {
            Err(e) => Err((format!("the worker is gone ({e})"), true)),
            Ok(()) => wait_reply(&rx, next_id, timeout),
        };
        match outcome {
            Ok(()) => lock(shared).delivered += 1,
            Err((why, fatal)) => {
                let mut q = lock(shared);
                q.errors += 1;
                if fatal {
                    q.failed = Some(why.clone());
                    q.items.clear();
                    drop(q);
                    kill(child);
                    tracing::warn!(
                        "trainer.logger: {backend} failed {what}: {why}; training goes on without it (the console/file/tensorboard sinks keep every step)"
                    );
                } else if q.errors == 1 {
                    drop(q);
                    tracing::warn!(
                        "trainer.logger: {backend} failed {what}: {why}; training goes on (later failures are counted, not shown)"
                    );
                }
            }
        }
        if is_finish {
            break;
        }
    }
    let mut q = lock(shared);
    q.done = true;
    cv.notify_all();
}

/// The acknowledgement of request `id`: `Err((why, fatal))` when the SDK raised (not fatal) or
/// the worker died or did not answer within `timeout` (fatal).
fn wait_reply(rx: &Receiver<Line>, id: u64, timeout: Duration) -> Result<(), (String, bool)> {
    let deadline = Instant::now() + timeout;
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(Line::Msg(m)) if m["id"].as_u64() == Some(id) => {
                return if m["ok"] == json!(true) {
                    Ok(())
                } else {
                    Err((
                        m["error"].as_str().unwrap_or("unknown error").to_string(),
                        false,
                    ))
                };
            }
            // A reply to an earlier request (cannot happen: one request at a time).
            Ok(Line::Msg(_)) => continue,
            Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
                return Err(("its worker process exited".into(), true))
            }
            Err(RecvTimeoutError::Timeout) => {
                return Err((
                    format!(
                        "no answer within {} s (MAIN_PPO_TRACKER_TIMEOUT_S); its worker was killed",
                        timeout.as_secs_f64()
                    ),
                    true,
                ))
            }
        }
    }
}

/// Starts every backend's worker at once (opening a run takes seconds each).
pub fn start_all(
    backends: &[String],
    run: &RunSpec,
    resume_ids: &BTreeMap<String, String>,
    settings: &RemoteSettings,
) -> Result<Vec<RemoteTracker>, StartError> {
    let results: Vec<Result<RemoteTracker, StartError>> = std::thread::scope(|s| {
        let handles: Vec<_> = backends
            .iter()
            .map(|b| {
                let mut spec = run.clone();
                spec.resume_id = resume_ids.get(b).cloned();
                s.spawn(move || RemoteTracker::start(b, &spec, settings))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(StartError::Failed(
                        "trainer.logger: a tracker start-up panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut out = Vec::new();
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(t) => out.push(t),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        return Ok(out);
    }
    // A configuration error first: it is what needs fixing before the run can start.
    let config = errors.iter().any(|e| matches!(e, StartError::Config(_)));
    let text = errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    Err(match config {
        true => StartError::Config(text),
        false => StartError::Failed(text),
    })
}

/// Threads reading a tracker worker's output: its answers (one JSON object per stdout line,
/// then [`Line::Eof`]) on the returned channel, and the last 20 lines of its stderr (logged at
/// debug level) for start-up errors.
fn read_worker(
    backend: &str,
    stdout: std::process::ChildStdout,
    stderr: std::process::ChildStderr,
) -> (mpsc::Receiver<Line>, Arc<Mutex<VecDeque<String>>>) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let msg = serde_json::from_str(&line).unwrap_or_else(
                |e| json!({"ok": false, "error": format!("not JSON ({e}): {line}")}),
            );
            if tx.send(Line::Msg(msg)).is_err() {
                return;
            }
        }
        let _ = tx.send(Line::Eof);
    });
    let tail = Arc::new(Mutex::new(VecDeque::<String>::new()));
    let tail_w = tail.clone();
    let name = backend.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            tracing::debug!(target: "main_ppo::tracker", "[{name} worker] {line}");
            let mut t = tail_w.lock().unwrap_or_else(|e| e.into_inner());
            if t.len() == 20 {
                t.pop_front();
            }
            t.push_back(line);
        }
    });
    (rx, tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `wandb` SDK that starts a helper process when the run opens (writing its pid to
    /// `$HELPER_PID`) and hangs at step 2, run by a wrapper interpreter that puts it on the
    /// path (the test process's environment stays as it is).
    fn fake_sdk(dir: &std::path::Path) -> String {
        let pkg = dir.join("sdk/wandb");
        std::fs::create_dir_all(&pkg).unwrap();
        let helper = dir.join("helper.pid");
        std::fs::write(
            pkg.join("__init__.py"),
            format!(
                r#"
import subprocess, time
class Settings:
    def __init__(self, **kw): pass
class Run:
    id = "fake"
def init(**kw):
    p = subprocess.Popen(["sleep", "60"])
    open({helper:?}, "w").write(str(p.pid))
    return Run()
def log(data, step=None):
    if step == 2:
        time.sleep(3600)
def finish(): pass
"#,
                helper = helper.display().to_string()
            ),
        )
        .unwrap();
        let python = dir.join("python");
        std::fs::write(
            &python,
            format!(
                "#!/bin/sh\nexport PYTHONPATH={}\nexec python3 \"$@\"\n",
                dir.join("sdk").display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        python.display().to_string()
    }

    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
    }

    /// A worker that stops answering is killed with its process group: the helper process
    /// its SDK started goes with it (before, the worker was killed alone and the helper
    /// lived on).
    #[test]
    fn a_hung_worker_is_killed_with_the_processes_its_sdk_started() {
        let dir = tempfile::tempdir().unwrap();
        let settings = RemoteSettings {
            python: fake_sdk(dir.path()),
            init_timeout: Duration::from_secs(60),
            call_timeout: Duration::from_secs(1),
            flush_timeout: Duration::from_secs(5),
            buffer: 10,
        };
        let run = RunSpec {
            project: "p".into(),
            experiment: "e".into(),
            config: json!({}),
            resume_id: None,
        };
        let mut t = RemoteTracker::start("wandb", &run, &settings).unwrap();
        let helper: u32 = std::fs::read_to_string(dir.path().join("helper.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(alive(helper));
        let m: Metrics = [("x".to_string(), 1.0)].into_iter().collect();
        t.log(&m, 1);
        t.log(&m, 2);
        let deadline = Instant::now() + Duration::from_secs(15);
        while lock(&t.shared).failed.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let failed = lock(&t.shared).failed.clone();
        assert!(
            failed
                .as_deref()
                .is_some_and(|f| f.contains("no answer within 1 s")),
            "{failed:?}"
        );
        let gone = Instant::now() + Duration::from_secs(5);
        while alive(helper) && Instant::now() < gone {
            std::thread::sleep(Duration::from_millis(20));
        }
        let survived = alive(helper);
        if survived {
            // SAFETY: a plain system call on the helper this test started.
            unsafe { libc::kill(helper as libc::pid_t, libc::SIGKILL) };
        }
        assert!(!survived, "the SDK's helper outlived its killed worker");
        t.finish();
    }
}
