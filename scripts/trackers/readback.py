# Reads a run back from a tracker's own storage with its SDK and prints one JSON object:
#   {"runs": [run ids], "metrics": {step: {key: value}}, "config": {...}, "generations": [...]}
# Used by the tracker tests (tests/trackers/mod.rs) to compare with the file sink.
# Usage: python readback.py mlflow TRACKING_URI EXPERIMENT
#        python readback.py wandb WANDB_DIR
#        python readback.py swanlab SWANLAB_LOG_DIR       (offline mode's run files)
#        python readback.py trackio TRACKIO_DIR PROJECT
#        python readback.py clearml CLEARML_CACHE_DIR     (offline mode's sessions)
import glob
import json
import math
import os
import struct
import sys
import zlib


def clean(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def mlflow_run(uri, experiment):
    import mlflow
    from mlflow.tracking import MlflowClient

    if uri.startswith("file:"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 refuses the file store without it
    mlflow.set_tracking_uri(uri)
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    out = {"runs": [r.info.run_id for r in runs], "metrics": {}, "config": {}, "generations": {}}
    if not runs:
        return out
    run = runs[0]
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            out["metrics"].setdefault(str(m.step), {})[key] = clean(m.value)
    out["config"] = dict(run.data.params)
    out["run_name"] = run.info.run_name
    for a in client.list_artifacts(run.info.run_id):
        if a.path.startswith("val_step"):
            local = client.download_artifacts(run.info.run_id, a.path)
            with open(local) as f:
                out["generations"][a.path] = json.load(f)
    return out


def wandb_records(path):
    """The protobuf records of a `.wandb` transaction log (a LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of chunks, each with a crc32, a length and a type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", ident
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):  # full, last
            r = pb.Record()
            r.ParseFromString(pending)
            pending = b""
            yield r


def wandb_run(root):
    out = {"runs": [], "metrics": {}, "config": {}, "generations": []}
    for run_dir in sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*"))):
        for f in glob.glob(os.path.join(run_dir, "*.wandb")):
            for r in wandb_records(f):
                which = r.WhichOneof("record_type")
                if which == "run":
                    out["runs"].append(r.run.run_id)
                    out["project"] = r.run.project
                    out["run_name"] = r.run.display_name
                    for item in r.run.config.update:
                        out["config"][item.key] = json.loads(item.value_json)
                elif which == "history":
                    row = {}
                    for item in r.history.item:
                        key = item.key or "/".join(item.nested_key)
                        row[key] = json.loads(item.value_json)
                    step = row.pop("_step", None)
                    if step is None and r.history.HasField("step"):
                        step = r.history.step.num
                    for k in [k for k in row if k.startswith("_")]:
                        row.pop(k)
                    out["metrics"].setdefault(str(step), {}).update(row)
        for t in sorted(glob.glob(os.path.join(run_dir, "files", "media", "table", "**", "*.table.json"), recursive=True)):
            with open(t) as f:
                out["generations"].append(json.load(f))
    for step in out["metrics"].values():
        for k, v in list(step.items()):
            if k.startswith("val/generations/"):
                step.pop(k)
            else:
                step[k] = clean(v)
    return out


def swanlab_run(logdir):
    """SwanLab's offline runs under `logdir`, read with the SDK's own record reader (the one
    `swanlab sync` uploads from): one segment folder per start or resume."""
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    out = {"runs": [], "metrics": {}, "config": {}, "generations": []}
    for run_dir in sorted(glob.glob(os.path.join(logdir, "run-*"))):
        for f in glob.glob(os.path.join(run_dir, "run-*.swanlab")):
            reader = DataStoreReader()
            reader.open(f)
            for raw in reader:
                r = Record()
                r.ParseFromString(raw)
                which = r.WhichOneof("record_type")
                if which == "start":
                    out["runs"].append(r.start.id)
                    out["project"] = r.start.project
                    out["run_name"] = r.start.name
                elif which == "scalar":
                    out["metrics"].setdefault(str(r.scalar.step), {})[r.scalar.key] = clean(r.scalar.value.number)
                elif which == "media" and r.media.key == "val/generations":
                    for item in r.media.value.items:
                        with open(os.path.join(run_dir, "media", "echarts", item.filename)) as t:
                            out["generations"].append({"step": r.media.step, **json.load(t)})
            reader.close()
        config = os.path.join(run_dir, "files", "config.yaml")
        if os.path.exists(config):
            with open(config) as c:
                out["config"] = {k: v["value"] for k, v in (yaml.safe_load(c) or {}).items()}
    return out


def trackio_run(root, project):
    """Trackio's local SQLite store (`TRACKIO_DIR`), read with its storage API."""
    os.environ["TRACKIO_DIR"] = root
    from trackio.sqlite_storage import SQLiteStorage

    runs = SQLiteStorage.get_runs(project)
    out = {"runs": runs, "metrics": {}, "config": {}, "generations": []}
    if not runs:
        return out
    name = runs[0]
    for row in SQLiteStorage.get_logs(project, name):
        step = row.pop("step")
        row.pop("timestamp", None)
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out["metrics"].setdefault(str(step), {})[k] = clean(float(v))
    out["config"] = {k: v for k, v in (SQLiteStorage.get_run_config(project, name) or {}).items() if not k.startswith("_")}
    out["run_name"] = name
    for t in sorted(glob.glob(os.path.join(root, "traces", project, name, "*.jsonl"))):
        with open(t) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        session = next(x for x in lines if x["type"] == "session")["trackio"]
        texts = [x["message"]["content"][0]["text"] for x in lines if x["type"] == "message"]
        out["generations"].append({"step": session["step"], "key": session["key"], "messages": texts, **session["metadata"]})
    return out


def clearml_run(cache_dir):
    """ClearML's offline sessions under `CLEARML_CACHE_DIR` (what `Task.import_offline_session`
    uploads): task.json and the reported events; the configuration parsed with the SDK's HOCON
    reader."""
    from clearml.utilities.pyhocon import ConfigFactory

    out = {"runs": [], "metrics": {}, "config": {}, "generations": []}
    for folder in sorted(glob.glob(os.path.join(cache_dir, "offline", "offline-*"))):
        if not os.path.isdir(folder):
            continue
        with open(os.path.join(folder, "task.json")) as f:
            task = json.load(f)
        out["runs"].append(task["id"])
        out["project"] = task.get("project_name")
        out["run_name"] = task.get("name")
        hyper = task.get("configuration", {}).get("Hyperparameters")
        if hyper:
            out["config"] = ConfigFactory.parse_string(hyper["value"]).as_plain_ordered_dict()
        events = os.path.join(folder, "metrics.jsonl")
        if not os.path.exists(events):
            continue
        with open(events) as f:
            for line in f:
                for e in json.loads(line):
                    if e.get("type") == "training_stats_scalar":
                        key = e["metric"] if e["variant"] == e["metric"] else f"{e['metric']}/{e['variant']}"
                        out["metrics"].setdefault(str(e["iter"]), {})[key] = clean(e["value"])
                    elif e.get("type") == "plot":
                        out["generations"].append({"step": e["iter"], "metric": e["metric"], "variant": e["variant"], "plot": json.loads(e["plot_str"])})
    return out


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "mlflow":
        print(json.dumps(mlflow_run(sys.argv[2], sys.argv[3])))
    elif kind == "wandb":
        print(json.dumps(wandb_run(sys.argv[2])))
    elif kind == "swanlab":
        print(json.dumps(swanlab_run(sys.argv[2])))
    elif kind == "trackio":
        print(json.dumps(trackio_run(sys.argv[2], sys.argv[3])))
    elif kind == "clearml":
        print(json.dumps(clearml_run(sys.argv[2])))
    else:
        sys.exit(f"unknown tracker {kind}")
