# main_ppo tracker worker: one process per remote backend of `trainer.logger` (wandb,
# vemlp_wandb, swanlab, mlflow, clearml, trackio). It opens the backend's run with the SDK
# installed in this interpreter, then answers JSON-line requests on stdin (metrics of a step,
# validation generations, finish) with one JSON line each on the original stdout. Shipped inside
# the main_ppo binary and run as `python -u -c <this file>`; whatever the SDK prints goes to
# stderr. The SDKs read their own environment variables (WANDB_MODE, WANDB_DIR,
# MLFLOW_TRACKING_URI, SWANLAB_MODE, CLEARML_*, ...), which this process inherits.
import json
import math
import os
import sys
import tempfile
import traceback

_proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)
sys.stdout = sys.stderr


# The watch on main_ppo (orphan_watch.py, run before this) ends this worker's process group, with
# the processes the SDK started, when main_ppo goes away, even while the SDK is stuck.

# The module each backend imports and the pip package that provides it.
PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "vemlp_wandb": ("volcengine_ml_platform", "volcengine-ml-platform"),
    "swanlab": ("swanlab", "swanlab"),
    "mlflow": ("mlflow", "mlflow"),
    "clearml": ("clearml", "clearml"),
    "trackio": ("trackio", "trackio"),
}


def send(obj):
    _proto.write(json.dumps(obj, default=str) + "\n")
    _proto.flush()


def number(v):
    # Non-finite numbers travel as the strings "nan", "inf", "-inf" (JSON has none).
    if isinstance(v, str):
        return float(v)
    return v


def flat_params(value, prefix=""):
    """The configuration as MLflow parameters: nested keys joined by `/`, a list as its
    `list_len` and one entry per index (the layout verl's trainer gives MLflow)."""
    out = {}
    if isinstance(value, dict):
        for k, v in value.items():
            out.update(flat_params(v, f"{prefix}{k}/"))
        if not value and prefix:
            out[prefix[:-1]] = "{}"
    elif isinstance(value, list):
        out[prefix + "list_len"] = len(value)
        for i, v in enumerate(value):
            out.update(flat_params(v, f"{prefix}{i}/"))
    else:
        out[prefix[:-1]] = value
    return out


def mlflow_key(key):
    # MLflow accepts letters, digits, `_ - . / : ` and spaces; verl writes `@` as `_at_`.
    key = key.replace("@", "_at_")
    while "//" in key:
        key = key.replace("//", "/")
    return "".join(c if (c.isalnum() or c in "_-./: ") else "_" for c in key)


class WandbLike:
    def __init__(self, sdk, req, vemlp=False):
        self.sdk = sdk
        resume = req.get("resume_id")
        kwargs = dict(project=req["project"], name=req["experiment"], config=req["config"])
        if vemlp:
            kwargs["sync_tensorboard"] = True
        else:
            kwargs["entity"] = os.environ.get("WANDB_ENTITY")
            proxy = (req["config"].get("trainer") or {}).get("wandb_proxy")
            if proxy:
                kwargs["settings"] = sdk.Settings(https_proxy=proxy)
        if resume:
            kwargs["id"] = resume
            kwargs["resume"] = "allow"
        self.run = sdk.init(**kwargs)
        self.run_id = getattr(self.run, "id", None)
        self.table_rows = []
        self.columns = None

    def log(self, data, step):
        self.sdk.log(data, step=step)

    def generations(self, samples, step):
        # One row per validation: step, then input/output/score of each sample; the whole table
        # is logged again each time (a logged Table is immutable).
        columns = ["step"] + [c for i in range(len(samples)) for c in (f"input_{i + 1}", f"output_{i + 1}", f"score_{i + 1}")]
        if self.columns is not None and self.columns != columns:
            self.table_rows = []
        self.columns = columns
        row = [step]
        for s in samples:
            row.extend(s)
        self.table_rows.append(row)
        table = self.sdk.Table(columns=columns, data=[list(r) for r in self.table_rows])
        self.sdk.log({"val/generations": table}, step=step)

    def finish(self):
        self.sdk.finish()


class Swanlab:
    def __init__(self, sdk, req):
        self.sdk = sdk
        key = os.environ.get("SWANLAB_API_KEY")
        if key:
            sdk.login(key)
        kwargs = dict(
            project=req["project"],
            experiment_name=req["experiment"],
            config={"FRAMEWORK": "main_ppo", **req["config"]},
            logdir=os.environ.get("SWANLAB_LOG_DIR", "swanlog"),
            mode=os.environ.get("SWANLAB_MODE", "cloud"),
        )
        if req.get("resume_id"):
            kwargs["id"] = req["resume_id"]
            kwargs["resume"] = "allow"
        self.run = sdk.init(**kwargs)
        self.run_id = None
        for attr in ("id", "run_id"):
            v = getattr(self.run, attr, None) or getattr(getattr(self.run, "public", None), attr, None)
            if isinstance(v, str):
                self.run_id = v
                break

    def log(self, data, step):
        self.sdk.log(data, step=step)

    def generations(self, samples, step):
        table = self.sdk.echarts.Table()
        table.add(headers=["step", "input", "output", "score"], rows=[[step, *s] for s in samples])
        self.sdk.log({"val/generations": table}, step=step)

    def finish(self):
        self.sdk.finish()


# How long the MLflow server's address may take to accept a connection at start-up.
CONNECT_TIMEOUT_S = float(os.environ.get("MAIN_PPO_TRACKER_CONNECT_S", "10"))


def reachable(uri):
    """Raises naming `uri` when an http(s) tracking server does not accept a TCP connection
    within CONNECT_TIMEOUT_S. MLflow's client retries a refused request with growing pauses for
    minutes before it gives up; a server that is down or a mistyped port is said at once instead.
    Skipped for other stores and when a proxy serves the host (the SDK connects through it)."""
    import socket
    import urllib.parse
    import urllib.request

    u = urllib.parse.urlsplit(uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return
    if urllib.request.getproxies().get(u.scheme) and not urllib.request.proxy_bypass(u.hostname):
        return
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConnectionError(
            f"the MLflow tracking server at {uri} cannot be reached ({exc}; waited at most "
            f"{CONNECT_TIMEOUT_S:g} s, MAIN_PPO_TRACKER_CONNECT_S): start it, or set "
            "MLFLOW_TRACKING_URI to a server that answers or to a local store (sqlite:///<file>)"
        ) from None


class Mlflow:
    def __init__(self, sdk, req):
        self.sdk = sdk
        uri = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlruns.db")
        reachable(uri)
        sdk.set_tracking_uri(uri)
        run_id = req.get("resume_id") or os.environ.get("MLFLOW_RUN_ID")
        if run_id:
            self.run = sdk.start_run(run_id=run_id)
        else:
            experiment = sdk.set_experiment(req["project"])
            self.run = sdk.start_run(experiment_id=experiment.experiment_id, run_name=req["experiment"])
        self.run_id = self.run.info.run_id
        try:
            sdk.log_params(flat_params(req["config"]))
        except Exception:
            # A resumed run already holds its parameters (MLflow refuses changed values).
            if not run_id:
                raise

    def log(self, data, step):
        self.sdk.log_metrics({mlflow_key(k): v for k, v in data.items()}, step=step)

    def generations(self, samples, step):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, f"val_step{step}.json")
            with open(path, "w") as f:
                json.dump([{"input": s[0], "output": s[1], "score": s[2]} for s in samples], f)
            self.sdk.log_artifact(path)

    def finish(self):
        self.sdk.end_run()


class Clearml:
    def __init__(self, sdk, req):
        # ClearML sends its reports from a forked reporting subprocess by default; this worker is
        # already a process of its own, so the reports go from threads here instead. The fork
        # (taken while ClearML's threads run) is what could leave `Task.close` waiting forever
        # for a child that never reports its queue empty.
        try:
            from clearml.backend_interface.task.task import Task as BackendTask

            BackendTask._report_subprocess_enabled = False
        except ImportError:
            pass
        self.task = sdk.Task.init(
            task_name=req["experiment"],
            project_name=req["project"],
            # verl continues the last task of this name (or the resumed run's task); the
            # integer 0 continues it without ClearML's iteration offset (last iteration + 1
            # added to every reported step), so steps stay the trainer's own numbers.
            continue_last_task=0,
            reuse_last_task_id=req.get("resume_id") or True,
            output_uri=False,
        )
        self.run_id = getattr(self.task, "id", None)
        self.task.connect_configuration(req["config"], name="Hyperparameters")

    def log(self, data, step):
        logger = self.task.get_logger()
        for k, v in data.items():
            title, _, series = k.partition("/")
            logger.report_scalar(title=title, series=series or title, value=v, iteration=step)

    def generations(self, samples, step):
        import pandas as pd

        rows = [{"step": step, "input": s[0], "output": s[1], "score": s[2]} for s in samples]
        self.task.get_logger().report_table(
            series="Validation generations", title="Validation", table_plot=pd.DataFrame.from_records(rows), iteration=step
        )

    def finish(self):
        self.task.close()


class Trackio:
    def __init__(self, sdk, req):
        self.sdk = sdk
        kwargs = dict(project=req["project"], name=req["experiment"], config=req["config"])
        if req.get("resume_id"):
            kwargs["resume"] = "allow"
        self.run = sdk.init(**kwargs)
        self.run_id = req["experiment"]

    def log(self, data, step):
        self.sdk.log(data, step=step)

    def generations(self, samples, step):
        traces = [
            self.sdk.Trace(
                messages=[{"role": "user", "content": str(s[0])}, {"role": "assistant", "content": str(s[1])}],
                metadata={"source": "validation_generations", "sample_index": i, "score": s[2]},
            )
            for i, s in enumerate(samples)
        ]
        if traces:
            self.sdk.log({"val/generations": traces}, step=step)

    def finish(self):
        self.sdk.finish()


def open_backend(req):
    backend = req["backend"]
    module, package = PACKAGES[backend]
    try:
        sdk = __import__(module)
    except ImportError as exc:
        send({"ok": False, "missing": package, "error": f"{type(exc).__name__}: {exc}"})
        return None
    if backend == "wandb":
        return WandbLike(sdk, req)
    if backend == "vemlp_wandb":
        sdk.init(
            ak=os.environ["VOLC_ACCESS_KEY_ID"],
            sk=os.environ["VOLC_SECRET_ACCESS_KEY"],
            region=os.environ["MLP_TRACKING_REGION"],
        )
        from volcengine_ml_platform import wandb as vemlp

        return WandbLike(vemlp, req, vemlp=True)
    if backend == "swanlab":
        return Swanlab(sdk, req)
    if backend == "mlflow":
        return Mlflow(sdk, req)
    if backend == "clearml":
        return Clearml(sdk, req)
    return Trackio(sdk, req)


def main():
    tracker = None
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        rid = req.get("id")
        try:
            if op == "init":
                tracker = open_backend(req)
                if tracker is None:
                    break
                send({"id": rid, "ok": True, "run_id": tracker.run_id})
                continue
            if op == "log":
                tracker.log({k: number(v) for k, v in req["data"].items()}, req["step"])
            elif op == "generations":
                samples = [(s[0], s[1], number(s[2]) if s[2] is not None else math.nan) for s in req["samples"]]
                tracker.generations(samples, req["step"])
            elif op == "finish":
                if tracker is not None:
                    tracker.finish()
                send({"id": rid, "ok": True})
                break
            send({"id": rid, "ok": True})
        except BaseException as exc:  # noqa: BLE001 - reported to main_ppo
            send({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
            if op == "init":
                break
    else:
        _orphaned()  # the requests ended without `finish`: main_ppo is gone


main()
