# Reads a run back from a tracker's own storage with its SDK and prints one JSON object:
#   {"runs": [run ids], "metrics": {step: {key: value}}, "config": {...}, "generations": [...]}
# Used by the tracker tests (tests/trackers/mod.rs) to compare with the file sink.
# Usage: python readback.py mlflow TRACKING_URI EXPERIMENT
#        python readback.py wandb WANDB_DIR
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


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "mlflow":
        print(json.dumps(mlflow_run(sys.argv[2], sys.argv[3])))
    elif kind == "wandb":
        print(json.dumps(wandb_run(sys.argv[2])))
    else:
        sys.exit(f"unknown tracker {kind}")
