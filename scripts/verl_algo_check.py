#!/usr/bin/env python3
"""Runs verl's own loss functions and advantage estimators on the inputs of
tests/fixtures/algo_golden.json and lists the cases where verl's numbers differ from the values
the golden file holds (which src/algo is tested against).

The golden file is written by scripts/algo_reference.py, an independent NumPy implementation;
this script is the cross-check against verl itself: its `verl/trainer/ppo/core_algos.py`
(`agg_loss`, the registered policy losses, `compute_value_loss`, the registered advantage
estimators) imported from a checkout of verl and run in PyTorch, f64. Reported, not asserted
by CI: it needs PyTorch and a verl tree.

Usage:
  git -C <verl mirror> archive <commit> verl | tar -x -C /tmp/verl   # e.g. 1dda039
  PYTHONPATH=/tmp/verl python scripts/verl_algo_check.py [--tol 1e-6]
Python packages verl's import chain needs besides torch/numpy: omegaconf, tensordict, ray,
codetiming, orjson (installed into the bench venv of scripts/bench_vs_torch.sh, say).
Exit status 1 when a case differs by more than --tol.

Cases verl cannot express are listed as such: clip_cov draws its clipped tokens at random
(torch's generator, not ours), so its loss is not compared.
"""
import argparse
import inspect
import json
import sys
from pathlib import Path

import numpy as np
import torch
import verl.trainer.ppo.core_algos as ca
from verl.workers.config import ActorConfig

GOLDEN = Path(__file__).resolve().parent.parent / "tests/fixtures/algo_golden.json"


class Cfg(dict):
    """Attribute access plus `.get`, the part of verl's ActorConfig the losses read."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def actor_cfg(p, scale=None, info=None):
    """An ActorConfig (gspo checks the type) holding only the fields the losses read: made
    without __init__, whose validation wants a whole actor section. `info`: verl's
    global_batch_info (default: loss_scale_factor alone, when `scale` is given)."""
    if info is None:
        info = {} if scale is None else {"loss_scale_factor": scale}
    fields = dict(
        clip_ratio=p["clip_low"],
        clip_ratio_low=p["clip_low"],
        clip_ratio_high=p["clip_high"],
        clip_ratio_c=p["clip_ratio_c"],
        tau_pos=p["tau_pos"],
        tau_neg=p["tau_neg"],
        global_batch_info=dict(info),
        policy_loss=Cfg(
            clip_cov_ratio=p["clip_cov_ratio"],
            clip_cov_lb=p["clip_cov_lb"],
            clip_cov_ub=p["clip_cov_ub"],
            kl_cov_ratio=p["kl_cov_ratio"],
            ppo_kl_coef=p["ppo_kl_coef"],
            dro_beta=p.get("dro_beta"),
        ),
    )
    cfg = ActorConfig.__new__(ActorConfig)
    for k, v in fields.items():
        object.__setattr__(cfg, k, v)
    return cfg


def num(v):
    return float(v.item()) if torch.is_tensor(v) else float(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tol", type=float, default=1e-6)
    tol = ap.parse_args().tol
    g = json.loads(GOLDEN.read_text())
    rows = []  # (section, name, quantity, golden, verl)

    for c in g["agg"]:
        kw = {} if c["scale"] is None else {"loss_scale_factor": c["scale"]}
        got = ca.agg_loss(t(c["loss_mat"]), t(c["mask"]), c["mode"], **kw)
        rows.append(("agg", c["name"], "loss", c["loss"], num(got)))

    for c in g["policy"]:
        if c["mode"] == "clip_cov":
            print(f"policy {c['name']}: not compared (verl draws the clipped tokens with torch's generator)")
            continue
        fn = ca.get_policy_loss_fn(c["mode"])
        cfg = actor_cfg(c["params"])
        loss, metrics = fn(t(c["old"]), t(c["logp"]), t(c["adv"]), t(c["mask"]), c["params"]["agg"], cfg, None)
        rows.append(("policy", c["name"], "loss", c["loss"], num(loss)))
        for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
            if key in c and f"actor/{key}" in metrics:
                rows.append(("policy", c["name"], key, c[key], num(metrics[f"actor/{key}"])))

    for c in g["value"]:
        loss, clipfrac = ca.compute_value_loss(
            t(c["vpreds"]), t(c["returns"]), t(c["values"]), t(c["mask"]), c["cliprange"], c["mode"]
        )
        rows.append(("value", c["name"], "loss", c["loss"], num(loss)))
        rows.append(("value", c["name"], "vf_clipfrac", c["vf_clipfrac"], num(clipfrac)))

    for c in g["advantage"]:
        fn = ca.get_adv_estimator_fn(c["estimator"])
        mask = t(c["mask"])
        given = dict(
            token_level_rewards=t(c["rewards"]),
            response_mask=mask,
            index=np.array(c["index"], dtype=object),
            values=t(c.get("values", c["rewards"])),
            reward_baselines=t(c.get("baselines", [0.0] * len(c["rewards"]))),
            gamma=c["gamma"],
            lam=c["lam"],
            norm_adv_by_std_in_grpo=c["norm"],
            config=Cfg(gamma=c["gamma"], lam=c["lam"], norm_adv_by_std_in_grpo=c["norm"]),
        )
        params = inspect.signature(fn).parameters
        takes_any = any(v.kind == v.VAR_KEYWORD for v in params.values())
        adv, ret = fn(**{k: v for k, v in given.items() if takes_any or k in params})
        for q, want, got in (("adv", c["adv"], adv), ("ret", c["ret"], ret)):
            d = float(((t(want) - got.double()).abs() * mask).max())
            rows.append(("adv", c["name"], f"{q} (max |d|)", 0.0, d))

    bad = 0
    for sec, name, q, want, got in rows:
        d = abs(want - got)
        flag = "DIFFERS" if d > tol * max(1.0, abs(got)) else "ok"
        bad += flag != "ok"
        print(f"{flag:7} {sec:6} {name:34} {q:18} golden {want: .10g}  verl {got: .10g}  |d| {d:.2e}")
    print(f"\n{len(rows) - bad} of {len(rows)} quantities equal verl's within {tol:g}; {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
