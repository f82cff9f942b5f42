//! Python reward functions in a pool of long-lived `python3` worker processes.
//!
//! Each worker runs the bridge script shipped in this binary (`bridge.py`): it loads the user's
//! function once, then answers requests (JSON lines on descriptor 3) with one JSON line per
//! scored response (on descriptor 4). The worker's stdin is /dev/null and its stdout and stderr
//! go to the log, so a function that reads stdin gets end-of-file and one that prints cannot
//! disturb the replies. A batch of responses is split over all workers at once. A call slower
//! than the timeout, or a worker that dies (segfault, `os._exit`), costs one response: the
//! worker is killed and replaced and the rest of its share continues on the new one. A worker
//! that ends before accepting a request (the bridge accepts each one before the function runs;
//! say it was killed from outside while idle) costs nothing: the same request goes once to its
//! replacement.
//!
//! Each worker leads a process group of its own; killing a worker kills its group, so processes
//! the function started end with it (when it is replaced, and when the pool is dropped). If
//! main_ppo itself dies, the bridge notices within half a second and kills its group.
//!
//! Loading the user's code (the reward function's file here, the tools in `tools.rs`) may take
//! `MAIN_PPO_WORKER_LOAD_S` seconds (default 120; [`load_timeout`]): a file whose imports are
//! slower (a large library on a network file system) needs more.

use std::io::{BufRead, BufReader, PipeWriter, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::{RewardError, ScoreResult};

/// The reward worker: the shared start (`bridge_base.py`) then `bridge.py`.
const BRIDGE: &str = concat!(
    include_str!("orphan_watch.py"),
    include_str!("bridge_base.py"),
    include_str!("bridge.py")
);

/// A bridge's descriptors for requests (it reads) and replies (it writes); `bridge.py` and
/// `tool_bridge.py` open the same numbers.
const REQUEST_FD: RawFd = 3;
const REPLY_FD: RawFd = 4;

/// The variable that sets [`load_timeout`].
pub const LOAD_TIMEOUT_VAR: &str = "MAIN_PPO_WORKER_LOAD_S";

/// How long a Python worker may take to import and load the user's code (a reward function, the
/// tools): `MAIN_PPO_WORKER_LOAD_S` seconds when set to a positive number, else 120; an
/// unreadable value is said once.
pub fn load_timeout() -> Duration {
    static WARNED: std::sync::Once = std::sync::Once::new();
    let Ok(v) = std::env::var(LOAD_TIMEOUT_VAR) else {
        return Duration::from_secs(120);
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Duration::from_secs_f64(s),
        _ => {
            WARNED.call_once(|| {
                tracing::warn!(
                    "{LOAD_TIMEOUT_VAR}={v:?} is not a positive number of seconds; 120 s is used"
                )
            });
            Duration::from_secs(120)
        }
    }
}

/// Which function to run and how.
#[derive(Debug, Clone, PartialEq)]
pub struct PythonFunction {
    /// A file path (optionally `file://`) or `pkg://module.path`.
    pub path: String,
    pub name: String,
    /// Keyword arguments added to every call (they win over call-time values).
    pub kwargs: Map<String, Value>,
    /// verl's batch signature: lists in, a list of scores out.
    pub batch: bool,
    /// verl's PRIME manager's call: the four arguments by position (the reward kwargs by
    /// keyword), and a result that is a number or a sequence whose first item is the score.
    pub positional: bool,
}

/// Pool settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    /// Interpreter (a user's virtualenv python works).
    pub python: String,
    pub num_workers: usize,
    /// Longest a single call may take.
    pub timeout: Duration,
}

// One response to score: the manager's request type.
use super::ScoreRequest as Item;

/// Why one call produced no score.
#[derive(Debug, Clone, PartialEq)]
pub enum CallError {
    /// The function raised (message and Python traceback) or returned something unusable.
    Exception { message: String, traceback: String },
    /// The call took longer than the timeout; the worker was replaced.
    Timeout { seconds: f64 },
    /// The worker process exited during the call; it was replaced.
    Died { status: String },
    /// The worker answered with a line that is not a reply of the protocol (not JSON, no
    /// request id, an index out of range); it was replaced, since its replies can no longer be
    /// matched to requests.
    Protocol { function: String, detail: String },
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Exception { message, traceback } => {
                write!(f, "{message}")?;
                if !traceback.trim().is_empty() && traceback.trim() != "NoneType: None" {
                    write!(f, "\n{}", traceback.trim_end())?;
                }
                Ok(())
            }
            CallError::Timeout { seconds } => write!(
                f,
                "timed out after {seconds} s (worker killed and replaced)"
            ),
            CallError::Died { status } => {
                write!(f, "the Python worker died ({status}); it was replaced")
            }
            CallError::Protocol { function, detail } => write!(
                f,
                "protocol error: the Python worker running `{function}` sent a malformed reply ({detail}); it was replaced"
            ),
        }
    }
}

/// One event from a bridge process's reply descriptor.
pub(crate) enum Line {
    /// A reply line (a line that is not JSON arrives as `{"protocol_error": ...}`).
    Msg(Value),
    /// The replies ended: the process exited or closed its descriptor.
    Eof,
}

/// A running bridge script (`python3 -u -c <script>`) speaking the JSON-lines protocol: the
/// reward bridge here, the tool bridge in `tools.rs`. It leads a process group of its own;
/// dropping it asks it to quit, then kills the group.
pub(crate) struct BridgeProcess {
    child: GroupLeader,
    /// The write end of the process's request pipe.
    requests: PipeWriter,
    /// The replies as they arrive.
    pub(crate) rx: Receiver<Line>,
}

/// A child process that leads a process group of its own (the reward and tool bridges here,
/// the tracker workers in `metrics/remote.rs`): killing it kills its group, so whatever the
/// user's code or an SDK started ends with it. Its script starts with `orphan_watch.py`, so
/// the group also ends when main_ppo dies without killing it (SIGKILL included).
pub(crate) struct GroupLeader {
    child: Child,
    /// The process has been waited for (after its group was killed), so its pid no longer
    /// names its group.
    reaped: bool,
}

impl GroupLeader {
    /// Starts `cmd` as the leader of a new process group.
    pub(crate) fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        let child = cmd.process_group(0).spawn()?;
        Ok(Self {
            child,
            reaped: false,
        })
    }

    /// The process id (which is also its process group's id).
    pub(crate) fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child itself (its pipes).
    pub(crate) fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// The process has exited (looked at without reaping it, so that its pid keeps naming its
    /// process group until [`GroupLeader::kill`]).
    pub(crate) fn exited(&self) -> bool {
        if self.reaped {
            return true;
        }
        // SAFETY: waitid fills `info`, a plain C struct that all-zero bytes make valid.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                self.child.id() as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // An error means there is no such child left to wait for; no state change leaves
        // `info` zero.
        r != 0 || info.si_signo != 0
    }

    /// Waits up to `timeout` for the leader to exit by itself (not reaping it); whether it did.
    pub(crate) fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.exited() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// Kills the process group (the leader and whatever it started) and reaps the leader;
    /// returns how it ended. Killing again only reports it.
    pub(crate) fn kill(&mut self) -> String {
        if !self.reaped {
            // The leader leads its group, and its pid is not reused before it is reaped below,
            // so the group is still its own.
            // SAFETY: a plain system call.
            if unsafe { libc::killpg(self.child.id() as libc::pid_t, libc::SIGKILL) } != 0 {
                let _ = self.child.kill();
            }
            self.reaped = true;
        }
        self.child
            .wait()
            .map(|s| s.to_string())
            .unwrap_or_else(|e| e.to_string())
    }
}

struct Worker {
    proc: BridgeProcess,
    next_id: u64,
    /// The function is `async def` (its items run concurrently).
    is_async: bool,
}

/// `fd` duplicated to a number above the worker's protocol descriptors (close-on-exec, like
/// every descriptor of main_ppo), so that moving the two pipe ends onto 3 and 4 in the child
/// cannot overwrite one with the other, nor with stdin, stdout or stderr.
fn above_protocol_fds(fd: OwnedFd) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor this function owns; the duplicate is owned by the result.
    let raised = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, REPLY_FD + 1) };
    if raised < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raised` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raised) })
}

/// Starts `<python> -u -c <script>` in a process group of its own, with stdin /dev/null,
/// stdout and stderr into the log (each line tagged `[<label> <id>]`), requests on descriptor 3
/// and replies on descriptor 4. Returns the child, the request pipe and the replies as they
/// arrive.
fn launch(
    python: &str,
    script: &str,
    label: &'static str,
    id: usize,
) -> std::io::Result<(GroupLeader, PipeWriter, Receiver<Line>)> {
    let (req_read, requests) = std::io::pipe()?;
    let (replies, reply_write) = std::io::pipe()?;
    let (log, log_write) = std::io::pipe()?;
    let req_read = above_protocol_fds(req_read.into())?;
    let reply_write = above_protocol_fds(reply_write.into())?;
    let (r, w) = (req_read.as_raw_fd(), reply_write.as_raw_fd());
    let mut cmd = Command::new(python);
    cmd.arg("-u")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(log_write.try_clone()?)
        .stderr(log_write);
    // SAFETY: only dup2 runs between fork and exec (async-signal-safe); `r` and `w` stay open
    // in the parent until the child has been started. dup2's copies are not close-on-exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(r, REQUEST_FD) < 0 || libc::dup2(w, REPLY_FD) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = GroupLeader::spawn(&mut cmd)?;
    // The child's ends are the child's alone now: the replies end when it exits.
    drop((cmd, req_read, reply_write));
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(replies).lines() {
            let Ok(line) = line else { break };
            let msg = serde_json::from_str(&line).unwrap_or_else(|e| {
                let shown: String = line.chars().take(200).collect();
                json!({"protocol_error": format!("not JSON ({e}): {shown}")})
            });
            if tx.send(Line::Msg(msg)).is_err() {
                return;
            }
        }
        let _ = tx.send(Line::Eof);
    });
    std::thread::spawn(move || {
        for line in BufReader::new(log).lines().map_while(Result::ok) {
            tracing::debug!(target: "main_ppo::reward", "[{label} {id}] {line}");
        }
    });
    Ok((child, requests, rx))
}

impl BridgeProcess {
    /// Starts `script` (see [`launch`]).
    pub(crate) fn start(
        python: &str,
        script: &str,
        label: &'static str,
        id: usize,
    ) -> std::io::Result<Self> {
        let (child, requests, rx) = launch(python, script, label, id)?;
        Ok(Self {
            child,
            requests,
            rx,
        })
    }

    /// The process id (which is also its process group's id).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Writes `msg` as one request line.
    pub(crate) fn send(&mut self, msg: &Value) -> std::io::Result<()> {
        let mut line = serde_json::to_string(msg).map_err(std::io::Error::other)?;
        line.push('\n');
        self.requests.write_all(line.as_bytes())?;
        self.requests.flush()
    }

    /// The process has exited (looked at without reaping it, so that its pid keeps naming its
    /// process group until [`BridgeProcess::kill`]).
    pub(crate) fn exited(&self) -> bool {
        self.child.exited()
    }

    /// Kills the process group (the bridge and whatever the user's code started) and reaps the
    /// bridge; returns how it ended.
    pub(crate) fn kill(&mut self) -> String {
        self.child.kill()
    }
}

impl Drop for BridgeProcess {
    fn drop(&mut self) {
        if self.child.reaped {
            return;
        }
        // Asked to quit first, so that the user code's exit handlers run; then its group goes,
        // with anything the user's code left running.
        let _ = self.send(&json!({"op": "quit"}));
        self.child.wait_exit(Duration::from_millis(200));
        self.kill();
    }
}

impl Worker {
    fn spawn(
        settings: &PoolSettings,
        func: &PythonFunction,
        id: usize,
    ) -> Result<Self, RewardError> {
        let proc =
            BridgeProcess::start(&settings.python, BRIDGE, "python worker", id).map_err(|e| {
                RewardError::Config(format!(
                    "cannot start the Python interpreter `{}` (reward.python): {e}",
                    settings.python
                ))
            })?;
        let mut w = Worker {
            proc,
            next_id: 0,
            is_async: false,
        };
        let load = json!({"op": "load", "path": func.path, "name": func.name, "kwargs": func.kwargs, "batch": func.batch, "positional": func.positional});
        w.send(&load).map_err(|e| {
            RewardError::Config(format!("the Python worker exited at start-up: {e}"))
        })?;
        let limit = load_timeout();
        match w.proc.rx.recv_timeout(limit) {
            Ok(Line::Msg(m)) if m["ok"] == json!(true) => {
                w.is_async = m["async"] == json!(true);
                Ok(w)
            }
            Ok(Line::Msg(m)) => Err(RewardError::Config(format!(
                "cannot load reward function `{}` from {}: {}\n{}",
                func.name,
                func.path,
                m["error"].as_str().unwrap_or("unknown error"),
                m["traceback"].as_str().unwrap_or("").trim_end()
            ))),
            Ok(Line::Eof) => {
                let status = w.kill();
                Err(RewardError::Config(format!(
                    "the Python worker for {} exited while loading it ({status})",
                    func.path
                )))
            }
            Err(_) => Err(RewardError::Config(format!(
                "loading {} took more than {} s ({LOAD_TIMEOUT_VAR})",
                func.path,
                limit.as_secs_f64()
            ))),
        }
    }

    fn send(&mut self, msg: &Value) -> std::io::Result<()> {
        self.proc.send(msg)
    }

    fn exited(&self) -> bool {
        self.proc.exited()
    }

    fn kill(&mut self) -> String {
        self.proc.kill()
    }
}

/// Counters of failed calls since the pool started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub errors: usize,
    pub timeouts: usize,
    pub restarts: usize,
}

/// A pool of workers running one function.
pub struct PythonPool {
    func: PythonFunction,
    settings: PoolSettings,
    workers: Vec<Worker>,
    pub stats: PoolStats,
}

impl std::fmt::Debug for PythonPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PythonPool")
            .field("func", &self.func)
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl PythonPool {
    /// Starts the workers and loads the function in each; a missing file or function, an import
    /// error or an unbindable parameter fails here, with the Python traceback.
    pub fn start(func: PythonFunction, settings: PoolSettings) -> Result<Self, RewardError> {
        let n = settings.num_workers.max(1);
        // Start one first so a broken function fails once, not n times.
        let mut workers = vec![Worker::spawn(&settings, &func, 0)?];
        let rest: Vec<Result<Worker, RewardError>> = std::thread::scope(|s| {
            let (settings, func) = (&settings, &func);
            let handles: Vec<_> = (1..n)
                .map(|id| s.spawn(move || Worker::spawn(settings, func, id)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("spawn thread"))
                .collect()
        });
        for w in rest {
            workers.push(w?);
        }
        Ok(Self {
            func,
            settings,
            workers,
            stats: PoolStats::default(),
        })
    }

    /// Process ids of the workers (for tests that check nothing is left behind).
    pub fn pids(&self) -> Vec<u32> {
        self.workers.iter().map(|w| w.proc.pid()).collect()
    }

    /// Scores `items` on all workers at once; one result per item, in order.
    pub fn score(&mut self, items: &[Item]) -> Vec<Result<ScoreResult, CallError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let n = self.workers.len().min(items.len());
        let chunk = items.len().div_ceil(n);
        let (func, settings) = (&self.func, &self.settings);
        let outcomes: Vec<(Vec<Result<ScoreResult, CallError>>, PoolStats)> =
            std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .workers
                    .iter_mut()
                    .zip(items.chunks(chunk))
                    .enumerate()
                    .map(|(id, (w, part))| s.spawn(move || run_share(w, part, func, settings, id)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("worker thread"))
                    .collect()
            });
        let mut out = Vec::with_capacity(items.len());
        for (results, st) in outcomes {
            self.stats.errors += st.errors;
            self.stats.timeouts += st.timeouts;
            self.stats.restarts += st.restarts;
            out.extend(results);
        }
        out
    }
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

/// One reply line of request `req_id` over `pending` items: the item it answers and its
/// result; `None` for a late line of an abandoned request (a replaced worker's ids are all
/// older); a protocol error for anything else.
#[allow(clippy::type_complexity)]
fn reply(
    m: &Value,
    req_id: u64,
    pending: usize,
    func: &PythonFunction,
) -> Result<Option<(usize, Result<ScoreResult, CallError>)>, CallError> {
    let protocol = |detail: String| CallError::Protocol {
        function: format!("{} from {}", func.name, func.path),
        detail,
    };
    if let Some(p) = m.get("protocol_error").and_then(Value::as_str) {
        return Err(protocol(p.to_string()));
    }
    match m["id"].as_u64() {
        Some(id) if id == req_id => {}
        Some(id) if id < req_id => return Ok(None),
        _ => return Err(protocol(format!("no id {req_id} in {}", short(m)))),
    }
    let Some(i) = m["index"]
        .as_u64()
        .map(|i| i as usize)
        .filter(|i| *i < pending)
    else {
        return Err(protocol(format!(
            "no index below {pending} in {}",
            short(m)
        )));
    };
    let r = if let Some(err) = m["error"].as_str() {
        Err(CallError::Exception {
            message: err.to_string(),
            traceback: m["traceback"].as_str().unwrap_or("").to_string(),
        })
    } else {
        let extra = m["extra"].as_object().cloned().unwrap_or_default();
        Ok(ScoreResult {
            score: m["score"].as_f64().unwrap_or(f64::NAN),
            extra,
        })
    };
    Ok(Some((i, r)))
}

/// Gives `err` to the unanswered items from `start`: only the first (the one in flight) unless
/// the items ran `together`. Returns where the next attempt starts.
fn blame(
    results: &mut [Option<Result<ScoreResult, CallError>>],
    mut start: usize,
    err: &CallError,
    together: bool,
    stats: &mut PoolStats,
) -> usize {
    let mut blamed = false;
    for (k, slot) in results.iter_mut().enumerate().skip(start) {
        if slot.is_none() && (!blamed || together) {
            *slot = Some(Err(err.clone()));
            blamed = true;
            if matches!(err, CallError::Died { .. } | CallError::Protocol { .. }) {
                stats.errors += 1;
            }
            start = k + 1;
        } else if slot.is_none() {
            break;
        } else {
            start = k + 1;
        }
    }
    start
}

/// Whether `m` is the bridge's acceptance of request `req_id` (it accepts a request when it
/// reads it, before the function runs): `false` for a late line of an abandoned request, a
/// protocol error for anything else.
fn accepted(m: &Value, req_id: u64, func: &PythonFunction) -> Result<bool, CallError> {
    let protocol = |detail: String| CallError::Protocol {
        function: format!("{} from {}", func.name, func.path),
        detail,
    };
    if let Some(p) = m.get("protocol_error").and_then(Value::as_str) {
        return Err(protocol(p.to_string()));
    }
    match m["id"].as_u64() {
        Some(id) if id == req_id && m["accepted"] == json!(true) => Ok(true),
        Some(id) if id < req_id => Ok(false),
        _ => Err(protocol(format!(
            "no acceptance of request {req_id} in {}",
            short(m)
        ))),
    }
}

/// Why a request did not reach the function.
enum Undelivered {
    /// The worker had ended, or ended before accepting it: the request never ran.
    Gone(String),
    /// The worker broke the protocol or did not accept within the timeout (it was killed).
    Failed(CallError),
}

/// Sends request `msg` (id `req_id`) to `w` and waits until the worker accepts it.
fn offer(
    w: &mut Worker,
    msg: &Value,
    req_id: u64,
    func: &PythonFunction,
    settings: &PoolSettings,
) -> Result<(), Undelivered> {
    if w.exited() {
        return Err(Undelivered::Gone("it had exited".into()));
    }
    w.send(msg)
        .map_err(|e| Undelivered::Gone(format!("request pipe closed: {e}")))?;
    let deadline = Instant::now() + settings.timeout;
    loop {
        match w
            .proc
            .rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok(Line::Msg(m)) => match accepted(&m, req_id, func) {
                Ok(true) => return Ok(()),
                Ok(false) => continue,
                Err(e) => {
                    w.kill();
                    return Err(Undelivered::Failed(e));
                }
            },
            Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
                return Err(Undelivered::Gone(
                    "its replies ended before it accepted the request".into(),
                ))
            }
            Err(RecvTimeoutError::Timeout) => {
                w.kill();
                return Err(Undelivered::Failed(CallError::Timeout {
                    seconds: settings.timeout.as_secs_f64(),
                }));
            }
        }
    }
}

/// Sends request `msg` (id `req_id`) to `w`. A worker that ends before accepting the request
/// (killed from outside while idle: it has exited, its request pipe is closed, or its replies
/// end first) never ran it, so it is replaced and the same request goes once to the
/// replacement, costing no sample. Errors: the request could not be delivered even then, the
/// worker broke the protocol, or it did not accept the request within the timeout.
fn deliver(
    w: &mut Worker,
    msg: &Value,
    req_id: u64,
    func: &PythonFunction,
    settings: &PoolSettings,
    id: usize,
    stats: &mut PoolStats,
) -> Result<(), CallError> {
    let mut resent = false;
    loop {
        let why = match offer(w, msg, req_id, func, settings) {
            Ok(()) => return Ok(()),
            Err(Undelivered::Failed(e)) => {
                if matches!(e, CallError::Timeout { .. }) {
                    stats.timeouts += 1;
                }
                return Err(e);
            }
            Err(Undelivered::Gone(why)) => why,
        };
        let status = w.kill();
        if resent {
            return Err(CallError::Died {
                status: format!("{status}; {why}"),
            });
        }
        tracing::warn!(
            target: "main_ppo::reward",
            "the Python worker {id} running `{}` died while idle ({status}; {why}); replaced, and the request it never received sent to the new one",
            func.name
        );
        stats.restarts += 1;
        *w = Worker::spawn(settings, func, id).map_err(|e| CallError::Died {
            status: format!("died while idle ({status}) and could not restart: {e}"),
        })?;
        // Replies carry the request id, and older ids are ignored as late lines.
        w.next_id = req_id;
        resent = true;
    }
}

/// Scores one worker's share, replacing the worker after a timeout or a crash.
fn run_share(
    w: &mut Worker,
    items: &[Item],
    func: &PythonFunction,
    settings: &PoolSettings,
    id: usize,
) -> (Vec<Result<ScoreResult, CallError>>, PoolStats) {
    let mut results: Vec<Option<Result<ScoreResult, CallError>>> = vec![None; items.len()];
    let mut stats = PoolStats::default();
    let mut start = 0;
    while start < items.len() {
        let pending = &items[start..];
        w.next_id += 1;
        let req_id = w.next_id;
        let request = json!({"op": "score", "id": req_id, "items": pending});
        let mut failure = deliver(w, &request, req_id, func, settings, id, &mut stats).err();
        let mut done = 0;
        let mut deadline = Instant::now() + settings.timeout;
        while failure.is_none() && done < pending.len() {
            match w
                .proc
                .rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(Line::Msg(m)) => {
                    let (i, r) = match reply(&m, req_id, pending.len(), func) {
                        Ok(Some(answer)) => answer,
                        // A late line of an abandoned request.
                        Ok(None) => continue,
                        Err(e) => {
                            failure = Some(e);
                            break;
                        }
                    };
                    if matches!(r, Err(CallError::Exception { .. })) {
                        stats.errors += 1;
                    }
                    if results[start + i].is_none() {
                        done += 1;
                    }
                    results[start + i] = Some(r);
                    deadline = Instant::now() + settings.timeout;
                }
                Ok(Line::Eof) => {
                    let status = w.kill();
                    failure = Some(CallError::Died { status });
                }
                Err(RecvTimeoutError::Timeout) => {
                    stats.timeouts += 1;
                    w.kill();
                    failure = Some(CallError::Timeout {
                        seconds: settings.timeout.as_secs_f64(),
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = w.kill();
                    failure = Some(CallError::Died { status });
                }
            }
        }
        let Some(err) = failure else { break };
        if matches!(err, CallError::Protocol { .. }) {
            w.kill();
        }
        // Sequential functions: the first unanswered item is the one in flight; it takes the
        // failure and the rest go to a fresh worker. Batch and async calls run together, so
        // every unanswered item takes it.
        let together = func.batch || w.is_async;
        start = blame(&mut results, start, &err, together, &mut stats);
        stats.restarts += 1;
        match Worker::spawn(settings, func, id) {
            Ok(fresh) => *w = fresh,
            Err(e) => {
                for slot in results.iter_mut().skip(start).filter(|s| s.is_none()) {
                    *slot = Some(Err(CallError::Died {
                        status: format!("could not restart: {e}"),
                    }));
                }
                break;
            }
        }
    }
    let results = results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(CallError::Died {
                    status: "no answer".into(),
                })
            })
        })
        .collect();
    (results, stats)
}

#[cfg(test)]
#[path = "python_tests.rs"]
mod tests;
