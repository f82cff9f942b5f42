//! The tracker bridge (`trainer.logger` remote backends) end to end, on the tiny PPO run of
//! [`super::tiny_run`]. Two kinds of tests: with a fake SDK (a `wandb` module on PYTHONPATH that
//! records, dies or hangs; plain `python3`), which always run; and with the real SDKs from PyPI
//! (`scripts/fetch_trackers.sh`, exported by `.ci/run` as MAIN_PPO_TRACKERS_PYTHON), which say
//! why they did not run when that variable is unset.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

use super::{bin_in, text, tiny_run};

/// A fake `wandb` package (also used by the MPI tests): it appends what it is asked to `$FAKE_TRACKER_LOG`, and at step 2
/// kills itself (`FAKE_TRACKER_MODE=die`) or stops answering (`hang`), or refuses to import
/// (`missing`); with `helper` its run starts a helper process (as real SDKs start a service)
/// whose pid goes to `$FAKE_TRACKER_LOG.helper`.
const FAKE_WANDB: &str = r#"
import json, os, time
if os.environ.get("FAKE_TRACKER_MODE") == "missing":
    raise ImportError("No module named 'wandb'")
LOG = os.environ["FAKE_TRACKER_LOG"]
MODE = os.environ.get("FAKE_TRACKER_MODE", "")
def _w(obj):
    with open(LOG, "a") as f:
        f.write(json.dumps(obj) + "\n")
class Settings:
    def __init__(self, **kw): pass
class Run:
    id = "fake-run-id"
def init(**kw):
    _w({"init": kw.get("project"), "name": kw.get("name"), "pid": os.getpid()})
    if MODE == "helper":
        import subprocess
        p = subprocess.Popen(["sleep", "120"])
        with open(LOG + ".helper", "w") as f:
            f.write(str(p.pid))
    return Run()
def log(data, step=None):
    if step == 2 and MODE == "die":
        os.kill(os.getpid(), 9)
    if step == 2 and MODE == "hang":
        time.sleep(3600)
    _w({"step": step, "keys": len(data), "pid": os.getpid()})
class Table:
    def __init__(self, columns=None, data=None): pass
def finish():
    _w({"finish": True, "pid": os.getpid()})
"#;

pub(crate) fn fake_sdk(dir: &Path) -> PathBuf {
    let pkg = dir.join("fake_sdk/wandb");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), FAKE_WANDB).unwrap();
    dir.join("fake_sdk")
}

/// The file sink's rows: step → metrics (non-finite values are null there and left out).
fn file_rows(dir: &Path) -> BTreeMap<u64, BTreeMap<String, f64>> {
    let text = std::fs::read_to_string(dir.join("verl_examples/gsm8k.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            let m = v["data"]
                .as_object()
                .unwrap()
                .iter()
                .filter_map(|(k, x)| x.as_f64().map(|x| (k.clone(), x)))
                .collect();
            (v["step"].as_u64().unwrap(), m)
        })
        .collect()
}

/// Metrics that do not depend on wall-clock time.
fn timeless(rows: &BTreeMap<u64, BTreeMap<String, f64>>) -> BTreeMap<u64, BTreeMap<String, f64>> {
    rows.iter()
        .map(|(s, m)| {
            let m = m
                .iter()
                .filter(|(k, _)| !k.starts_with("timing_") && !k.starts_with("perf/"))
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            (*s, m)
        })
        .collect()
}

/// Every metric of the file sink (`want`) at every step equals the tracker's read-back
/// (`got["metrics"][step][key]`), the key as the tracker names it (`rename`: MLflow writes `@`
/// as `_at_`).
fn assert_same_metrics(
    name: &str,
    got: &Value,
    want: &BTreeMap<u64, BTreeMap<String, f64>>,
    rename: impl Fn(&str) -> String,
) {
    for (step, m) in want {
        for (k, v) in m {
            let key = rename(k);
            assert_eq!(
                got["metrics"][step.to_string()][&key].as_f64(),
                Some(*v),
                "{name} {key} at {step}: {}",
                got["metrics"][step.to_string()]
            );
        }
    }
}

/// MLflow's name of a metric.
fn mlflow_key(k: &str) -> String {
    k.replace('@', "_at_")
}

fn mean_step_time(rows: &BTreeMap<u64, BTreeMap<String, f64>>) -> f64 {
    let t: Vec<f64> = rows.values().map(|m| m["timing_s/step"]).collect();
    t.iter().sum::<f64>() / t.len() as f64
}

fn train(dir: &Path, extra: &[&str], env: &[(&str, String)]) -> Output {
    let args = tiny_run(dir, 3, extra);
    let mut c = bin_in(dir);
    c.args(&args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn a_missing_tracker_sdk_fails_at_start_up_naming_the_package() {
    let dir = tempfile::tempdir().unwrap();
    let sdk = fake_sdk(dir.path());
    let out = train(
        dir.path(),
        &["trainer.logger=[console,file,wandb]"],
        &[
            ("PYTHONPATH", sdk.display().to_string()),
            ("FAKE_TRACKER_MODE", "missing".into()),
            (
                "FAKE_TRACKER_LOG",
                dir.path().join("log").display().to_string(),
            ),
        ],
    );
    let (stdout, stderr) = text(&out);
    // A configuration the environment cannot run: a usage error, as `config check` reports it.
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("trainer.logger")
            && stderr.contains("`wandb`")
            && stderr.contains("pip install wandb"),
        "{stderr}"
    );
    // Nothing was computed: no step, no checkpoint.
    assert!(!stdout.contains("step:"), "{stdout}");
    assert!(!dir.path().join("checkpoints").exists());
}

/// An MLflow tracking server that does not answer (nothing listens on its port): the run stops
/// at start-up within seconds, naming `MLFLOW_TRACKING_URI` and its value. The fake SDK waits
/// in `set_experiment` as MLflow's client does while it retries a refused connection (minutes);
/// before, the run waited out `MAIN_PPO_TRACKER_INIT_S` (300 s by default) and then named no URI.
#[test]
fn an_unreachable_mlflow_server_fails_at_once_naming_the_uri() {
    let dir = tempfile::tempdir().unwrap();
    let pkg = dir.path().join("fake_sdk/mlflow");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(
        pkg.join("__init__.py"),
        "import time\ndef set_tracking_uri(uri): pass\ndef set_experiment(name):\n    time.sleep(3600)\n",
    )
    .unwrap();
    // A port nothing listens on: bound, then released.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let uri = format!("http://127.0.0.1:{port}");
    let t0 = std::time::Instant::now();
    let out = train(
        dir.path(),
        &["trainer.logger=[console,mlflow]"],
        &[
            (
                "PYTHONPATH",
                dir.path().join("fake_sdk").display().to_string(),
            ),
            ("MLFLOW_TRACKING_URI", uri.clone()),
            ("MAIN_PPO_TRACKER_INIT_S", "60".into()),
        ],
    );
    let secs = t0.elapsed().as_secs_f64();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(secs < 40.0, "took {secs:.1} s: {stderr}");
    assert!(
        stderr.contains(&format!("MLFLOW_TRACKING_URI={uri}"))
            && stderr.contains("cannot be reached"),
        "{stderr}"
    );
    assert!(!stdout.contains("step:"), "{stdout}");
}

/// A tracker worker that dies (SIGKILL) or stops answering at step 2: training finishes with
/// the metrics of a run without trackers, one warning, and comparable step times.
#[test]
fn a_killed_or_hung_tracker_worker_leaves_training_unchanged() {
    // One folder (one tiny model) for every run; each run starts from scratch.
    let dir = tempfile::tempdir().unwrap();
    let fresh = |d: &Path| {
        let _ = std::fs::remove_dir_all(d.join("verl_examples"));
        let _ = std::fs::remove_dir_all(d.join("checkpoints"));
    };
    let out = train(dir.path(), &["trainer.logger=[console,file]"], &[]);
    assert!(out.status.success(), "{}", text(&out).1);
    let want = file_rows(dir.path());
    assert_eq!(want.len(), 3);
    let mut times = vec![("none".to_string(), mean_step_time(&want))];
    for (mode, warning) in [
        ("", None),
        ("die", Some("its worker process exited")),
        ("hang", Some("no answer within 2 s")),
    ] {
        fresh(dir.path());
        let sdk = fake_sdk(dir.path());
        let log = dir.path().join(format!("fake{mode}.jsonl"));
        let t = std::time::Instant::now();
        let out = train(
            dir.path(),
            &["trainer.logger=[console,file,wandb]"],
            &[
                ("PYTHONPATH", sdk.display().to_string()),
                ("FAKE_TRACKER_MODE", mode.into()),
                ("FAKE_TRACKER_LOG", log.display().to_string()),
                ("MAIN_PPO_TRACKER_TIMEOUT_S", "2".into()),
                ("MAIN_PPO_TRACKER_FLUSH_S", "10".into()),
            ],
        );
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{mode}: {stderr}");
        let got = file_rows(dir.path());
        assert_eq!(timeless(&got), timeless(&want), "{mode}");
        let warnings = stderr.matches("trainer.logger: wandb failed").count();
        let recorded = std::fs::read_to_string(&log).unwrap();
        match warning {
            None => {
                assert_eq!(warnings, 0, "{stderr}");
                assert_eq!(recorded.matches("\"step\"").count(), 3, "{recorded}");
                assert!(recorded.contains("\"finish\""), "{recorded}");
                assert!(
                    recorded.contains("\"init\": \"verl_examples\""),
                    "{recorded}"
                );
            }
            Some(w) => {
                assert_eq!(warnings, 1, "{stderr}");
                assert!(stderr.contains(w), "{stderr}");
                assert_eq!(recorded.matches("\"step\"").count(), 1, "{recorded}");
            }
        }
        println!(
            "fake wandb `{mode}`: whole run {:.2} s",
            t.elapsed().as_secs_f64()
        );
        times.push((format!("fake wandb `{mode}`"), mean_step_time(&got)));
    }
    for (what, t) in &times {
        println!("mean timing_s/step, trackers {what}: {t:.4} s");
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// main_ppo killed with SIGKILL mid-run: the tracker worker and the helper process its SDK
/// started end too (the worker leads a process group of its own, which its watch on main_ppo
/// kills; before, the worker exited alone and the helper lived on).
#[test]
fn a_tracker_sdks_helper_ends_when_main_ppo_is_killed() {
    let dir = tempfile::tempdir().unwrap();
    let sdk = fake_sdk(dir.path());
    let log = dir.path().join("fake.jsonl");
    let args = tiny_run(dir.path(), 200, &["trainer.logger=[console,wandb]"]);
    let mut child = bin_in(dir.path())
        .args(&args)
        .env("PYTHONPATH", sdk.display().to_string())
        .env("FAKE_TRACKER_MODE", "helper")
        .env("FAKE_TRACKER_LOG", log.display().to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid_file = dir.path().join("fake.jsonl.helper");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let helper = loop {
        if let Some(pid) = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the fake SDK never started its helper"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(alive(helper));
    child.kill().unwrap();
    child.wait().unwrap();
    let gone = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while alive(helper) && std::time::Instant::now() < gone {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let survived = alive(helper);
    if survived {
        let _ = std::process::Command::new("kill")
            .args(["-9", &helper.to_string()])
            .status();
    }
    assert!(!survived, "the SDK's helper outlived main_ppo");
}

/// The real SDKs' interpreter (`scripts/fetch_trackers.sh`), or `None` (printed).
fn trackers_python() -> Option<String> {
    match std::env::var("MAIN_PPO_TRACKERS_PYTHON") {
        Ok(p) if Path::new(&p).exists() => Some(p),
        _ => {
            println!("skipped: MAIN_PPO_TRACKERS_PYTHON is not set (run scripts/fetch_trackers.sh and export its output)");
            None
        }
    }
}

fn readback(python: &str, args: &[String]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/trackers/readback.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// wandb (offline) and MLflow (a local SQLite store): a 2-step run then a resume to step 3; the
/// metrics, config and validation generations read back with each SDK equal the file sink's,
/// and the resumed run continues the same run id.
#[test]
fn wandb_and_mlflow_read_back_equal_the_file_sink_and_resume_the_same_run() {
    let Some(python) = trackers_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let uri = format!("sqlite:///{}", d.join("mlflow.db").display());
    let env = [
        ("WANDB_MODE", "offline".to_string()),
        ("WANDB_DIR", d.display().to_string()),
        ("WANDB_SILENT", "true".to_string()),
        ("MLFLOW_TRACKING_URI", uri.clone()),
    ];
    let py = format!("reward.python={python}");
    for steps in [2, 3] {
        let total = format!("trainer.total_training_steps={steps}");
        let out = train(
            d,
            &[
                "trainer.logger=[console,file,wandb,mlflow]",
                "trainer.save_freq=1",
                "trainer.test_freq=1",
                "trainer.log_val_generations=2",
                &py,
                &total,
            ],
            &env,
        );
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(!stderr.contains("failed"), "{stderr}");
    }
    let want = file_rows(d);
    assert_eq!(want.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(
            d.join("checkpoints/verl_examples/gsm8k/global_step_3/trainer_state.json"),
        )
        .unwrap(),
    )
    .unwrap();

    let ml = readback(&python, &["mlflow".into(), uri, "verl_examples".into()]);
    assert_eq!(
        ml["runs"].as_array().unwrap().len(),
        1,
        "one MLflow run: {}",
        ml["runs"]
    );
    assert_eq!(ml["runs"][0], state["tracker_runs"]["mlflow"]);
    assert_eq!(ml["run_name"], "gsm8k");
    assert_eq!(ml["config"]["trainer/project_name"], "verl_examples");
    assert_same_metrics("mlflow", &ml, &want, mlflow_key);
    for step in 1..=3 {
        let g = &ml["generations"][format!("val_step{step}.json")];
        assert_eq!(g.as_array().map(Vec::len), Some(2), "{}", ml["generations"]);
        assert!(g[0]["input"].is_string() && g[0]["score"].is_number());
    }

    let wb = readback(&python, &["wandb".into(), d.display().to_string()]);
    let runs = wb["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "two offline segments: {runs:?}");
    assert_eq!(runs[0], runs[1], "the resume continues the same wandb run");
    assert_eq!(runs[0], state["tracker_runs"]["wandb"]);
    assert_eq!(wb["project"], "verl_examples");
    assert_eq!(wb["run_name"], "gsm8k");
    assert_eq!(wb["config"]["trainer"]["project_name"], "verl_examples");
    assert_same_metrics("wandb", &wb, &want, str::to_string);
    let tables = wb["generations"].as_array().unwrap();
    let last = tables.last().expect("a generations table");
    assert_eq!(last["columns"][0], "step");
    assert_eq!(last["columns"][1], "input_1");
    assert_eq!(last["columns"].as_array().unwrap().len(), 7);
}

/// SwanLab (offline mode), Trackio (its local SQLite store) and ClearML (offline mode): a
/// 2-step run then a resume to step 3; the metrics, configuration and validation generations
/// read back from each backend's own storage equal the file sink's. SwanLab's resume continues
/// the same run id (a second offline segment), Trackio's the same run, ClearML's the same
/// offline session (at the trainer's step numbers: a continued task's iteration offset is
/// reset, which verl's logger leaves).
#[test]
fn swanlab_trackio_and_clearml_read_back_equal_the_file_sink() {
    let Some(python) = trackers_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let env = [
        ("SWANLAB_MODE", "offline".to_string()),
        ("SWANLAB_LOG_DIR", d.join("swanlog").display().to_string()),
        ("TRACKIO_DIR", d.join("trackio").display().to_string()),
        ("CLEARML_OFFLINE_MODE", "1".to_string()),
        ("CLEARML_CACHE_DIR", d.join("clearml").display().to_string()),
        // Generous bounds for a 2-core machine busy with the rest of the suite. (ClearML's close
        // once took over 120 s and once over 600 s here, waiting without bound for its forked
        // reporting subprocess; the worker now reports from threads, and closes in about 1 s.)
        ("MAIN_PPO_TRACKER_TIMEOUT_S", "600".to_string()),
        ("MAIN_PPO_TRACKER_FLUSH_S", "600".to_string()),
    ];
    let py = format!("reward.python={python}");
    for steps in [2, 3] {
        let total = format!("trainer.total_training_steps={steps}");
        let out = train(
            d,
            &[
                "trainer.logger=[console,file,swanlab,trackio,clearml]",
                "trainer.save_freq=1",
                "trainer.test_freq=1",
                "trainer.log_val_generations=2",
                &py,
                &total,
            ],
            &env,
        );
        let (_, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        assert!(!stderr.contains("failed"), "{stderr}");
    }
    let want = file_rows(d);
    assert_eq!(want.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3]);
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(
            d.join("checkpoints/verl_examples/gsm8k/global_step_3/trainer_state.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let sw = readback(
        &python,
        &["swanlab".into(), d.join("swanlog").display().to_string()],
    );
    let runs = sw["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "two offline segments: {runs:?}");
    assert_eq!(
        runs[0], runs[1],
        "the resume continues the same SwanLab run"
    );
    assert_eq!(runs[0], state["tracker_runs"]["swanlab"]);
    assert_eq!(sw["project"], "verl_examples");
    assert_eq!(sw["run_name"], "gsm8k");
    assert_eq!(sw["config"]["trainer"]["project_name"], "verl_examples");
    assert_eq!(sw["config"]["FRAMEWORK"], "main_ppo");
    assert_same_metrics("swanlab", &sw, &want, str::to_string);
    let tables = sw["generations"].as_array().unwrap();
    assert_eq!(tables.len(), 3, "one table per validation: {tables:?}");
    let last = tables.last().unwrap();
    assert_eq!(last["step"], 3);
    assert_eq!(last["rowData"].as_array().map(Vec::len), Some(2), "{last}");
    assert!(last["rowData"][0]["output"].is_string() && last["rowData"][0]["score"].is_number());

    let tr = readback(
        &python,
        &[
            "trackio".into(),
            d.join("trackio").display().to_string(),
            "verl_examples".into(),
        ],
    );
    assert_eq!(tr["runs"], serde_json::json!(["gsm8k"]), "one Trackio run");
    assert_eq!(tr["config"]["trainer"]["project_name"], "verl_examples");
    assert_same_metrics("trackio", &tr, &want, str::to_string);
    let traces = tr["generations"].as_array().unwrap();
    assert_eq!(traces.len(), 6, "2 traces per validation: {traces:?}");
    assert!(traces
        .iter()
        .all(|t| t["key"] == "val/generations" && t["score"].is_number()));

    let cl = readback(
        &python,
        &["clearml".into(), d.join("clearml").display().to_string()],
    );
    assert_eq!(
        cl["runs"].as_array().map(Vec::len),
        Some(1),
        "{}",
        cl["runs"]
    );
    assert_eq!(cl["runs"][0], state["tracker_runs"]["clearml"]);
    assert_eq!(cl["project"], "verl_examples");
    assert_eq!(cl["run_name"], "gsm8k");
    assert_eq!(cl["config"]["trainer"]["project_name"], "verl_examples");
    assert_same_metrics("clearml", &cl, &want, str::to_string);
    let plots = cl["generations"].as_array().unwrap();
    assert!(
        plots.iter().any(|p| p["step"] == 3),
        "a generations table at step 3: {plots:?}"
    );
}

/// MLflow's file store (`file:` URI; MLflow 3 refuses it unless `MLFLOW_ALLOW_FILE_STORE=true`,
/// which the worker passes on as the SDK reads it): a 3-step run reads back equal to the file
/// sink.
#[test]
fn mlflow_file_store_reads_back_equal_the_file_sink() {
    let Some(python) = trackers_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let uri = format!("file://{}", d.join("mlruns").display());
    let env = [
        ("MLFLOW_TRACKING_URI", uri.clone()),
        ("MLFLOW_ALLOW_FILE_STORE", "true".to_string()),
    ];
    let py = format!("reward.python={python}");
    let out = train(d, &["trainer.logger=[console,file,mlflow]", &py], &env);
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("mlflow failed"), "{stderr}");
    let want = file_rows(d);
    assert_eq!(want.len(), 3);
    let ml = readback(&python, &["mlflow".into(), uri, "verl_examples".into()]);
    assert_eq!(ml["runs"].as_array().unwrap().len(), 1);
    assert_eq!(ml["config"]["trainer/experiment_name"], "gsm8k");
    assert_same_metrics("mlflow", &ml, &want, mlflow_key);
}

/// A free TCP port on 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A local `mlflow server` in its own process group (it serves from child processes), the
/// whole group killed when dropped.
struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let group = format!("-{}", self.0.id());
        for sig in ["-CONT", "-KILL"] {
            let _ = std::process::Command::new("kill")
                .args([sig, "--", &group])
                .status();
        }
        let _ = self.0.wait();
    }
}

/// MLflow through a local `mlflow server` on 127.0.0.1: a 3-step run reads back equal to the
/// file sink; then a run during which the server is stopped (SIGSTOP, from the reward function
/// at step 2's first call) finishes all 3 steps with one warning, the file sink complete.
#[test]
fn mlflow_server_run_reads_back_and_a_server_that_stops_answering_does_not_stop_training() {
    let Some(python) = trackers_python() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let port = free_port();
    let server = Server(
        std::process::Command::new(&python)
            .args(["-m", "mlflow", "server", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", d.join("server.db").display()))
            .arg("--default-artifact-root")
            .arg(d.join("artifacts"))
            .arg("--workers")
            .arg("1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap(),
    );
    let t = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed().as_secs() < 120, "mlflow server did not start");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let uri = format!("http://127.0.0.1:{port}");
    let env = [
        ("MLFLOW_TRACKING_URI", uri.clone()),
        ("MAIN_PPO_TRACKER_TIMEOUT_S", "3".to_string()),
        ("MAIN_PPO_TRACKER_FLUSH_S", "10".to_string()),
    ];
    let py = format!("reward.python={python}");
    let out = train(d, &["trainer.logger=[console,file,mlflow]", &py], &env);
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("mlflow failed"), "{stderr}");
    let want = file_rows(d);
    let ml = readback(
        &python,
        &["mlflow".into(), uri.clone(), "verl_examples".into()],
    );
    assert_eq!(ml["runs"].as_array().unwrap().len(), 1);
    assert_same_metrics("mlflow", &ml, &want, mlflow_key);

    // The same run again, the server stopped by the reward function at step 2.
    let _ = std::fs::remove_dir_all(d.join("verl_examples"));
    let _ = std::fs::remove_dir_all(d.join("checkpoints"));
    let calls = d.join("calls");
    std::fs::write(
        d.join("reward.py"),
        format!(
            "import os, signal\n\
             def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
                 p = {calls:?}\n    \
                 n = (int(open(p).read()) if os.path.exists(p) else 0) + 1\n    \
                 open(p, 'w').write(str(n))\n    \
                 if n == 9:\n        \
                     os.killpg({pid}, signal.SIGSTOP)\n    \
                 return float(len(solution_str) % 3) / 2\n",
            calls = calls.display().to_string(),
            pid = server.0.id()
        ),
    )
    .unwrap();
    let t = std::time::Instant::now();
    let out = train(
        d,
        &[
            "trainer.logger=[console,file,mlflow]",
            &py,
            "reward.num_workers=1",
        ],
        &env,
    );
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(
        stderr.matches("trainer.logger: mlflow failed").count(),
        1,
        "{stderr}"
    );
    assert!(stderr.contains("no answer within 3 s"), "{stderr}");
    let got = file_rows(d);
    assert_eq!(
        timeless(&got),
        timeless(&want),
        "the same metrics with a hung server"
    );
    println!(
        "stopped server: whole run {:.1} s; mean timing_s/step {:.3} s (server answering: {:.3} s)",
        t.elapsed().as_secs_f64(),
        mean_step_time(&got),
        mean_step_time(&want)
    );
    drop(server);
}
