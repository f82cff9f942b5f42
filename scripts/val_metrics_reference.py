#!/usr/bin/env python3
"""Reference values for `trainer::validate::tests` (verl's validation metrics).

Recomputes, with NumPy's legacy RandomState, what verl's `metric_utils.process_validation_metrics`
and `RayPPOTrainer._val_metrics_update` (volcengine/verl b178a3c) report for the fixed responses
below, and prints `name value` lines. Run with any Python that has NumPy:
`python3 scripts/val_metrics_reference.py`.
"""
from collections import defaultdict

import numpy as np

# (data_source, prompt, {variable: value}) per response, in response order.
SAMPLES = [
    ("ds_a", 0, {"reward": 1.0, "acc": True, "pred": "7"}),
    ("ds_a", 0, {"reward": 0.0, "acc": False, "pred": "3"}),
    ("ds_a", 0, {"reward": 0.5, "acc": False, "pred": "7"}),
    ("ds_a", 0, {"reward": 1.0, "acc": True, "pred": "3"}),
    ("ds_a", 0, {"reward": 0.25, "acc": False, "pred": "3"}),
    ("ds_a", 1, {"reward": 0.0, "acc": False, "pred": "1"}),
    ("ds_a", 1, {"reward": 0.0, "acc": False, "pred": "2"}),
    ("ds_a", 1, {"reward": 1.0, "acc": True, "pred": "2"}),
    ("ds_a", 1, {"reward": 0.0, "acc": False, "pred": "1"}),
    ("ds_a", 1, {"reward": 0.75, "acc": False, "pred": "2"}),
    ("ds_b", 2, {"reward": 0.2, "note": "x"}),
    ("ds_b", 2, {"reward": 0.9, "note": "y"}),
    ("ds_b", 2, {"reward": 0.4, "note": "z"}),
]
N_BOOT = 1000
SEED = 42


def sizes(n):
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out + [n] if n > 1 else []


def boot(n, k):
    np.random.seed(SEED)
    return np.random.choice(n, size=(N_BOOT, k), replace=True)


def majority(rows, vals, preds):
    counts, first = {}, {}
    for i in rows:
        counts[preds[i]] = counts.get(preds[i], 0) + 1
        first.setdefault(preds[i], vals[i])
    top = max(counts, key=counts.get)
    return first[top]


def per_prompt(vals, preds):
    n = len(vals)
    out = {f"mean@{n}": float(np.mean(vals))}
    if n < 2:
        return out
    out[f"std@{n}"] = float(np.std(vals))
    for k in sizes(n):
        idx = boot(n, k)
        best = [max(vals[i] for i in r) for r in idx]
        worst = [min(vals[i] for i in r) for r in idx]
        out[f"best@{k}/mean"], out[f"best@{k}/std"] = float(np.mean(best)), float(np.std(best))
        out[f"worst@{k}/mean"], out[f"worst@{k}/std"] = float(np.mean(worst)), float(np.std(worst))
        if preds is not None:
            maj = [majority(r, vals, preds) for r in idx]
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(np.mean(maj)), float(np.std(maj))
    return out


def main():
    groups = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for src, uid, vs in SAMPLES:
        for k, v in vs.items():
            groups[src][uid][k].append(v)
    result = {}
    for src, prompts in groups.items():
        coll = defaultdict(lambda: defaultdict(list))
        for var2vals in prompts.values():
            preds = var2vals.get("pred")
            for var, vals in var2vals.items():
                if isinstance(vals[0], str):
                    continue
                for name, v in per_prompt([float(x) for x in vals], preds).items():
                    coll[var][name].append(v)
        core = "acc" if "acc" in coll else "reward"
        for var, metrics in coll.items():
            n_max = max(int(name.split("@")[1].split("/")[0]) for name in metrics)
            for name, vals in metrics.items():
                is_core = var == core and name.split("@")[0] in ("mean", "maj", "best") and f"@{n_max}" in name
                sec = "val-core" if is_core else "val-aux"
                result[f"{sec}/{src}/{var}/{name}"] = float(np.mean(vals))
    for k in sorted(result):
        print(f"{k} {result[k]!r}")


if __name__ == "__main__":
    main()
