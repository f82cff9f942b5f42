//! verl's custom sampler (`data.sampler.class_path`, `data.sampler.class_name`) in a Python
//! worker: the [`crate::data::IndexSampler`] the loader draws its batches from.
//!
//! It lives here, with the other Python workers (the reward functions' `python.rs`, the tools'
//! `tools.rs`), because it is one of them: the same bridge process (`BridgeProcess`: its own
//! process group, descriptors 3 and 4, the orphan watch), the same interpreter
//! (`reward.python`), the same load limit (`MAIN_PPO_WORKER_LOAD_S`). The data room defines
//! what a sampler must do and knows nothing of processes; the trainer builds this worker and
//! hands it to the loader.
//!
//! The worker (`sampler_bridge.py`) builds `cls(data_source=dataset, data_config=data)` once,
//! over the training rows as the loader indexes them (after filtering and `*_max_samples`), and
//! then answers one request at a time: `epoch` (`iter(sampler)`), `take` (the next indices),
//! `update` (a curriculum sampler's `update(batch=...)`), `save` and `restore` (a checkpoint's
//! position). A sampler cannot be restarted where it was, so a worker that dies, hangs past the
//! limit or breaks the protocol ends the run with an error naming the class (the worker is
//! killed with its process group).

use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use serde_json::{json, Value};

use super::python::{load_timeout, BridgeProcess, Line, LOAD_TIMEOUT_VAR};
use crate::data::{DataError, IndexSampler};

/// The sampler worker: the shared start, then `sampler_bridge.py`.
const BRIDGE: &str = concat!(
    include_str!("orphan_watch.py"),
    include_str!("bridge_base.py"),
    include_str!("sampler_bridge.py")
);

/// Which class to build, on which rows, with which `data` section.
#[derive(Debug, Clone)]
pub struct SamplerSpec {
    /// `data.sampler.class_path`: `pkg://module.path`, or a file (optionally `file://`).
    pub class_path: String,
    /// `data.sampler.class_name`.
    pub class_name: String,
    /// The interpreter (`reward.python`).
    pub python: String,
    /// `data_config`: the resolved `data` section.
    pub data_config: Value,
}

/// A user's sampler class running in its Python worker.
pub struct PySampler {
    proc: BridgeProcess,
    name: String,
    len: usize,
    curriculum: bool,
    stateful: bool,
    /// Longest a request may take.
    limit: Duration,
}

impl std::fmt::Debug for PySampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PySampler")
            .field("name", &self.name)
            .field("len", &self.len)
            .finish()
    }
}

impl PySampler {
    /// Starts the worker and builds the sampler over `rows` (the dataset items it sees, in the
    /// loader's index order). Errors name `data.sampler.class_path`, the module or file and the
    /// class, with the Python traceback.
    pub fn start(spec: &SamplerSpec, rows: Vec<Value>) -> Result<Self, DataError> {
        let name = format!(
            "data.sampler: `{}` from {}",
            spec.class_name, spec.class_path
        );
        let proc =
            BridgeProcess::start(&spec.python, BRIDGE, "sampler worker", 0).map_err(|e| {
                DataError::Other(format!(
                    "{name}: cannot start the Python interpreter `{}` (reward.python): {e}",
                    spec.python
                ))
            })?;
        let mut s = Self {
            proc,
            name,
            len: 0,
            curriculum: false,
            stateful: false,
            limit: load_timeout(),
        };
        let n = rows.len();
        let load = json!({"op": "load", "path": spec.class_path, "name": spec.class_name,
            "rows": rows, "data_config": spec.data_config});
        let reply = s.call(&load).map_err(|m| {
            DataError::Other(format!(
                "data.sampler.class_path = {}, data.sampler.class_name = {}: cannot build the sampler: {m}",
                spec.class_path, spec.class_name,
            ))
        })?;
        s.len = reply["len"].as_u64().unwrap_or(0) as usize;
        s.curriculum = reply["curriculum"] == json!(true);
        s.stateful = reply["stateful"] == json!(true);
        tracing::info!(
            "{}: len(sampler) = {} over {n} rows{}{}",
            s.name,
            s.len,
            if s.curriculum {
                "; a curriculum sampler (update(batch=...) after each step)"
            } else {
                ""
            },
            if reply["verl"] == json!(true) {
                ""
            } else {
                " (verl is not importable: the class was taken as a sampler for its __iter__ and __len__)"
            }
        );
        Ok(s)
    }

    /// Whether the sampler keeps its own state (`state_dict`/`load_state_dict`, torchdata's
    /// `Stateful`): a checkpoint then holds that state; otherwise its position only.
    pub fn stateful(&self) -> bool {
        self.stateful
    }

    /// Sends `msg` and waits for its reply; `what` names the request in errors.
    fn request(&mut self, msg: &Value, what: &str) -> Result<Value, DataError> {
        self.call(msg)
            .map_err(|m| DataError::Other(format!("{}: {what}: {m}", self.name)))
    }

    /// Sends `msg` and waits for its reply; the error's message (the Python exception with its
    /// traceback, or what happened to the worker).
    fn call(&mut self, msg: &Value) -> Result<Value, String> {
        if let Err(e) = self.proc.send(msg) {
            let status = self.proc.kill();
            return Err(format!("the Python worker is gone ({status}; {e})"));
        }
        match self.proc.rx.recv_timeout(self.limit) {
            Ok(Line::Msg(m)) if m["ok"] == json!(true) => Ok(m),
            Ok(Line::Msg(m)) if m.get("protocol_error").is_some() => {
                let status = self.proc.kill();
                Err(format!(
                    "the Python worker sent a malformed reply ({}); it was killed ({status})",
                    m["protocol_error"].as_str().unwrap_or("?")
                ))
            }
            Ok(Line::Msg(m)) => Err(format!(
                "{}\n{}",
                m["error"].as_str().unwrap_or("unknown error"),
                m["traceback"].as_str().unwrap_or("").trim_end()
            )
            .trim_end()
            .to_string()),
            Ok(Line::Eof) | Err(RecvTimeoutError::Disconnected) => {
                let status = self.proc.kill();
                Err(format!("the Python worker died ({status})"))
            }
            Err(RecvTimeoutError::Timeout) => {
                let status = self.proc.kill();
                Err(format!(
                    "no answer within {} s ({LOAD_TIMEOUT_VAR}); the worker was killed ({status})",
                    self.limit.as_secs_f64()
                ))
            }
        }
    }
}

impl IndexSampler for PySampler {
    fn name(&self) -> &str {
        &self.name
    }

    fn len(&self) -> usize {
        self.len
    }

    fn curriculum(&self) -> bool {
        self.curriculum
    }

    fn begin_epoch(&mut self) -> Result<(), DataError> {
        self.request(&json!({"op": "epoch"}), "iter(sampler)")
            .map(drop)
    }

    fn take(&mut self, n: usize) -> Result<Vec<i64>, DataError> {
        let m = self.request(&json!({"op": "take", "n": n}), "drawing indices")?;
        let indices = m["indices"].as_array().cloned().unwrap_or_default();
        indices
            .iter()
            .map(|v| {
                v.as_i64().ok_or_else(|| {
                    DataError::Other(format!(
                        "{}: it gave {v}, which is not a dataset index",
                        self.name
                    ))
                })
            })
            .collect()
    }

    fn update(&mut self, step: u64, batch: &Value) -> Result<(), DataError> {
        let mut msg = batch.clone();
        msg["op"] = json!("update");
        self.request(&msg, &format!("update(batch=...) after step {step}"))
            .map(drop)
    }

    fn save(&mut self) -> Result<Value, DataError> {
        let m = self.request(
            &json!({"op": "save"}),
            "saving its position for the checkpoint",
        )?;
        Ok(m["state"].clone())
    }

    fn restore(&mut self, saved: &Value) -> Result<(), DataError> {
        self.request(
            &json!({"op": "restore", "state": saved}),
            "restoring the checkpoint's position",
        )
        .map(drop)
    }
}

#[cfg(test)]
#[path = "sampler_tests.rs"]
mod tests;
