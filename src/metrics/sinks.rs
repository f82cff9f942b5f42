//! Where metrics go (`trainer.logger`): `console` (verl's `step:N - key:value - ...` line on
//! stdout), `file` (one JSON object per step), `tensorboard` (event files), and the remote
//! backends (`wandb`, `vemlp_wandb`, `swanlab`, `mlflow`, `clearml`, `trackio`) through their own
//! SDKs in Python worker processes ([`super::remote`]). `rl_insight` is reported once and skipped.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::remote::{RemoteSettings, RemoteTracker, RunSpec, StartError};
use super::tensorboard::EventWriter;
use super::{py_float, Metrics};

/// A destination for each step's metrics.
pub trait MetricSink {
    fn log(&mut self, metrics: &Metrics, step: u64) -> std::io::Result<()>;
}

/// `step:N - key:value - ...`, numbers as Python prints them.
pub struct Console {
    out: Box<dyn Write + Send>,
}

impl Console {
    pub fn stdout() -> Self {
        Self {
            out: Box::new(std::io::stdout()),
        }
    }
    pub fn to(out: Box<dyn Write + Send>) -> Self {
        Self { out }
    }
}

/// The console line of one step.
pub fn console_line(metrics: &Metrics, step: u64) -> String {
    let mut line = format!("step:{step}");
    for (k, v) in metrics {
        line.push_str(" - ");
        line.push_str(k);
        line.push(':');
        line.push_str(&py_float(*v));
    }
    line
}

impl MetricSink for Console {
    fn log(&mut self, metrics: &Metrics, step: u64) -> std::io::Result<()> {
        writeln!(self.out, "{}", console_line(metrics, step))?;
        self.out.flush()
    }
}

/// JSON lines `{"step": N, "data": {...}}` (verl's file logger), non-finite numbers as null.
pub struct JsonFile {
    out: BufWriter<File>,
    pub path: PathBuf,
}

impl JsonFile {
    /// Appends to `path` (a resumed run continues the same file).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let f = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            out: BufWriter::new(f),
            path: path.to_path_buf(),
        })
    }
}

impl MetricSink for JsonFile {
    fn log(&mut self, metrics: &Metrics, step: u64) -> std::io::Result<()> {
        let data: serde_json::Map<String, serde_json::Value> = metrics
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
            .collect();
        let line = serde_json::json!({"step": step, "data": data});
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }
}

pub struct TensorBoard {
    writer: EventWriter,
}

impl MetricSink for TensorBoard {
    fn log(&mut self, metrics: &Metrics, step: u64) -> std::io::Result<()> {
        let scalars: Vec<(&str, f32)> = metrics
            .iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(k, v)| (k.as_str(), *v as f32))
            .collect();
        self.writer.scalars(step as i64, &scalars)
    }
}

/// Every sink of a run, with where each one writes.
pub struct Tracker {
    sinks: Vec<(String, Box<dyn MetricSink + Send>)>,
    /// `backend → path` for the sinks that write files.
    pub files: Vec<(String, PathBuf)>,
    /// The remote backends' workers.
    pub remotes: Vec<RemoteTracker>,
}

/// What the remote backends need: how to run their workers, the run's resolved configuration,
/// and the run ids a resumed run continues (`backend → id`, from `trainer_state.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteOptions {
    pub settings: RemoteSettings,
    pub config: serde_json::Value,
    pub resume_ids: std::collections::BTreeMap<String, String>,
}

/// Where the `file` sink writes: `$VERL_FILE_LOGGER_PATH`, else
/// `${VERL_FILE_LOGGER_ROOT:-.}/{project}/{experiment}.jsonl`.
pub fn file_logger_path(project: &str, experiment: &str) -> PathBuf {
    if let Ok(p) = std::env::var("VERL_FILE_LOGGER_PATH") {
        return PathBuf::from(p);
    }
    let root = std::env::var("VERL_FILE_LOGGER_ROOT").unwrap_or_else(|_| ".".into());
    Path::new(&root)
        .join(project)
        .join(format!("{experiment}.jsonl"))
}

/// Where the `tensorboard` sink writes: `$TENSORBOARD_DIR`, else
/// `tensorboard_log/{project}/{experiment}`.
pub fn tensorboard_dir(project: &str, experiment: &str) -> PathBuf {
    match std::env::var("TENSORBOARD_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => Path::new("tensorboard_log").join(project).join(experiment),
    }
}

const REMOTE: [&str; 7] = [
    "wandb",
    "vemlp_wandb",
    "swanlab",
    "mlflow",
    "clearml",
    "trackio",
    "rl_insight",
];

/// The backends main_ppo knows (`trainer.logger`).
fn known_backends() -> Vec<&'static str> {
    let mut all = vec!["console", "file", "tensorboard"];
    all.extend(REMOTE);
    all
}

/// Refuses a `trainer.logger` list naming a backend main_ppo does not know, naming the closest
/// known one (a misspelled `wandbb`); what [`Tracker::new`] and the pre-flight refuse.
pub fn check_backends(backends: &[String]) -> Result<(), String> {
    let known = known_backends();
    for b in backends {
        if known.contains(&b.as_str()) {
            continue;
        }
        let closest = known
            .iter()
            .map(|k| (strsim::jaro_winkler(b, k), *k))
            .filter(|(score, _)| *score >= 0.8)
            .max_by(|a, c| a.0.total_cmp(&c.0))
            .map(|(_, k)| format!("; did you mean `{k}`?"))
            .unwrap_or_default();
        return Err(format!(
            "trainer.logger: unknown backend `{b}`{closest} (known: {})",
            known.join(", ")
        ));
    }
    Ok(())
}

impl Tracker {
    /// The sinks named in `trainer.logger`; returns warnings for backends skipped here. The
    /// remote backends start their workers when `remote` is given (a missing SDK is an error
    /// here, before any compute), and are skipped with a warning without it.
    pub fn new(
        backends: &[String],
        project: &str,
        experiment: &str,
        remote: Option<&RemoteOptions>,
    ) -> Result<(Self, Vec<String>), StartError> {
        let mut t = Tracker {
            sinks: Vec::new(),
            files: Vec::new(),
            remotes: Vec::new(),
        };
        let mut skipped = Vec::new();
        let mut wanted: Vec<String> = Vec::new();
        check_backends(backends).map_err(StartError::Config)?;
        for b in backends {
            match b.as_str() {
                "console" => t.sinks.push((b.clone(), Box::new(Console::stdout()))),
                "file" => {
                    let p = file_logger_path(project, experiment);
                    let f = JsonFile::open(&p).map_err(|e| {
                        StartError::Failed(format!(
                            "trainer.logger=file: cannot open {}: {e}",
                            p.display()
                        ))
                    })?;
                    t.files.push((b.clone(), p));
                    t.sinks.push((b.clone(), Box::new(f)));
                }
                "tensorboard" => {
                    let d = tensorboard_dir(project, experiment);
                    let w = EventWriter::create(&d).map_err(|e| {
                        StartError::Failed(format!(
                            "trainer.logger=tensorboard: cannot write in {}: {e}",
                            d.display()
                        ))
                    })?;
                    t.files.push((b.clone(), w.path.clone()));
                    t.sinks
                        .push((b.clone(), Box::new(TensorBoard { writer: w })));
                }
                other if remote.is_some() && super::remote::package(other).is_some() => {
                    if !wanted.iter().any(|w| w == other) {
                        wanted.push(other.to_string());
                    }
                }
                other => skipped.push(other.to_string()),
            }
        }
        if let (Some(r), false) = (remote, wanted.is_empty()) {
            let run = RunSpec {
                project: project.to_string(),
                experiment: experiment.to_string(),
                config: r.config.clone(),
                resume_id: None,
            };
            t.remotes = super::remote::start_all(&wanted, &run, &r.resume_ids, &r.settings)?;
        }
        let warnings = if skipped.is_empty() {
            Vec::new()
        } else {
            vec![format!(
                "trainer.logger: {} not available here (rl_insight is not supported; remote backends are skipped where no tracker workers are started); metrics go to {}",
                skipped.join(", "),
                if t.sinks.is_empty() {
                    "no sink: add console, file or tensorboard".to_string()
                } else {
                    t.sinks.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
                }
            )]
        };
        Ok((t, warnings))
    }

    /// A tracker over given sinks (tests, embedding).
    pub fn with_sinks(sinks: Vec<(String, Box<dyn MetricSink + Send>)>) -> Self {
        Tracker {
            sinks,
            files: Vec::new(),
            remotes: Vec::new(),
        }
    }

    /// Sends `metrics` to every sink; a sink that fails is reported and the others still run.
    /// Remote backends only queue the step (they never hold training up).
    pub fn log(&mut self, metrics: &Metrics, step: u64) {
        for (name, s) in &mut self.sinks {
            if let Err(e) = s.log(metrics, step) {
                tracing::warn!("metrics sink `{name}` failed at step {step}: {e}");
            }
        }
        for r in &self.remotes {
            r.log(metrics, step);
        }
    }

    /// Validation generations `(input, output, score)` for the backends that show them (a
    /// wandb Table, SwanLab text, an MLflow artifact, ...: verl's `ValidationGenerationsLogger`).
    pub fn log_generations(&mut self, samples: &[(String, String, f64)], step: u64) {
        if samples.is_empty() {
            return;
        }
        for r in &self.remotes {
            r.generations(samples, step);
        }
    }

    /// Whether any remote backend shows validation generations.
    pub fn wants_generations(&self) -> bool {
        !self.remotes.is_empty()
    }

    /// The remote runs' ids (`backend → id`), saved in `trainer_state.json` so that a resumed
    /// run continues them.
    pub fn run_ids(&self) -> std::collections::BTreeMap<String, String> {
        self.remotes
            .iter()
            .filter_map(|r| r.run_id.clone().map(|id| (r.backend.clone(), id)))
            .collect()
    }

    /// Flushes and closes the remote runs (each within its flush timeout).
    pub fn finish(&mut self) {
        for r in &mut self.remotes {
            r.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_line_is_verls_format() {
        let mut m = Metrics::new();
        m.insert("critic/score/mean".into(), 0.5);
        m.insert("actor/lr".into(), 1e-6);
        assert_eq!(
            console_line(&m, 3),
            "step:3 - actor/lr:1e-06 - critic/score/mean:0.5"
        );
    }

    #[test]
    fn unknown_backend_is_an_error_and_remote_ones_a_warning() {
        let err = Tracker::new(&["consol".into()], "p", "e", None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("unknown backend `consol`; did you mean `console`?"),
            "{err}"
        );
        let err = check_backends(&["console".into(), "wandbb".into()]).unwrap_err();
        assert!(err.contains("`wandbb`; did you mean `wandb`?"), "{err}");
        assert!(check_backends(&["xyz".into()])
            .unwrap_err()
            .contains("known: console"));
        let (t, w) = Tracker::new(&["console".into(), "wandb".into()], "p", "e", None).unwrap();
        assert_eq!(t.sinks.len(), 1);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("wandb") && w[0].contains("console"), "{w:?}");
    }

    #[test]
    fn json_file_appends_one_object_per_step() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a/b.jsonl");
        let mut f = JsonFile::open(&p).unwrap();
        let mut m = Metrics::new();
        m.insert("x".into(), 1.5);
        m.insert("nan".into(), f64::NAN);
        f.log(&m, 1).unwrap();
        drop(f);
        let mut f = JsonFile::open(&p).unwrap();
        f.log(&m, 2).unwrap();
        let text = std::fs::read_to_string(&p).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1]["step"], 2);
        assert_eq!(rows[0]["data"]["x"], 1.5);
        assert!(rows[0]["data"]["nan"].is_null());
    }
}
