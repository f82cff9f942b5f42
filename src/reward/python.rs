//! Python reward functions in a pool of long-lived `python3` worker processes.
//!
//! Each worker runs the bridge script shipped in this binary (`bridge.py`): it loads the user's
//! function once, then answers requests (JSON lines on stdin) with one JSON line per scored
//! response. A batch of responses is split over all workers at once. A call slower than the
//! timeout, or a worker that dies (segfault, `os._exit`), costs one response: the worker is
//! killed and replaced and the rest of its share continues on the new one.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use super::{RewardError, ScoreResult};

const BRIDGE: &str = include_str!("bridge.py");

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

enum Line {
    Msg(Value),
    Eof,
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    rx: Receiver<Line>,
    next_id: u64,
    /// The function is `async def` (its items run concurrently).
    is_async: bool,
}

impl Worker {
    fn spawn(
        settings: &PoolSettings,
        func: &PythonFunction,
        id: usize,
    ) -> Result<Self, RewardError> {
        let mut child = Command::new(&settings.python)
            .arg("-u")
            .arg("-c")
            .arg(BRIDGE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                RewardError::Config(format!(
                    "cannot start the Python interpreter `{}` (reward.python): {e}",
                    settings.python
                ))
            })?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
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
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                tracing::debug!(target: "main_ppo::reward", "[python worker {id}] {line}");
            }
        });
        let mut w = Worker {
            child,
            stdin,
            rx,
            next_id: 0,
            is_async: false,
        };
        let load = json!({"op": "load", "path": func.path, "name": func.name, "kwargs": func.kwargs, "batch": func.batch});
        w.send(&load).map_err(|e| {
            RewardError::Config(format!("the Python worker exited at start-up: {e}"))
        })?;
        match w.rx.recv_timeout(Duration::from_secs(120)) {
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
                let status = w.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(RewardError::Config(format!(
                    "the Python worker for {} exited while loading it ({status})",
                    func.path
                )))
            }
            Err(_) => Err(RewardError::Config(format!(
                "loading {} took more than 120 s",
                func.path
            ))),
        }
    }

    fn send(&mut self, msg: &Value) -> std::io::Result<()> {
        let mut line = serde_json::to_string(msg).map_err(std::io::Error::other)?;
        line.push('\n');
        self.stdin.write_all(line.as_bytes())?;
        self.stdin.flush()
    }

    fn kill(&mut self) -> String {
        let _ = self.child.kill();
        self.child
            .wait()
            .map(|s| s.to_string())
            .unwrap_or_else(|e| e.to_string())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.send(&json!({"op": "quit"}));
        let deadline = Instant::now() + Duration::from_millis(200);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.kill();
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
        self.workers.iter().map(|w| w.child.id()).collect()
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
        let sent = w.send(&json!({"op": "score", "id": req_id, "items": pending}));
        let mut failure: Option<CallError> = None;
        if let Err(e) = sent {
            failure = Some(CallError::Died {
                status: format!("stdin closed: {e}"),
            });
        }
        let mut done = 0;
        let mut deadline = Instant::now() + settings.timeout;
        while failure.is_none() && done < pending.len() {
            match w
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
