#!/usr/bin/env python3
"""Writes tests/fixtures/rollout_corr_verl_1dda039.json: inputs and the outputs verl's own
`verl/trainer/ppo/rollout_corr_helper.py` (verl-project/verl 1dda039) gives for them, in
PyTorch f64. The Rust port of rollout correction is tested against it.

Every case runs `compute_rollout_correction_and_rejection_mask(old_log_prob, rollout_log_prob,
response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
rollout_rs_threshold)` and records the IS weights ("rollout_is_weights" of the returned
DataProto, null when rollout_is is null), the modified response mask and the metrics dict
(keys "rollout_corr/..."; non-finite values written as the strings "nan", "inf", "-inf").

Covered: rollout_is "token" / "sequence" with a TIS float threshold and an IcePop
"lower_upper" threshold, with and without batch normalisation (including a batch whose summed
log-ratios are all below -20, where the weights' mean is under 1e-8 and verl skips the
normalisation); metrics only (rollout_is and rollout_rs null); every rollout_rs option alone
(k1 options with a "lower_upper" string and with a single float, whose reciprocal verl takes
as the lower bound); combined options with one threshold per option, a duplicated option with
one broadcast threshold, and rollout_is together with rollout_rs; a case whose summed
log-ratios pass +-20 (verl's SAFETY_BOUND clamp) and holds a token with |log-ratio| > 20; a
batch with a single valid token. Inputs are right-padded with ragged lengths, several hold an
all-zero (empty) row; padded positions hold random log-probs too, so any leak of padding
shows. The top-level "errors" list holds the exception class name and message verl raises for
bad configurations on a small valid input, and for an IcePop band that zeroes every weight
(verl's effective-sample-size metric then divides by zero: a Python ZeroDivisionError).

For the port: verl computes some fractions as `(bool).float().mean()`, i.e. in float32 (e.g.
1/6 appears as 0.1666666716337204): rollout_is_ratio_fraction_* (sequence level),
rollout_is_seq_fraction_*, rollout_rs_seq_masked_fraction and the sequence-level
rollout_rs_<option>_(seq_)fraction_*. Compare those at float32 precision. The sequence-level
rollout_is_ratio_fraction_* also compare against log(threshold) taken in float32.

Inputs: old_log_prob = -U(0.05, 3), rollout_log_prob = old_log_prob + N(0, sigma) (not clipped
below 0), drawn from a torch.Generator seeded per input set (SEED + its index in INPUTS),
float64; several cases share one input set, e.g. the batch-normalize pairs. Nothing is rounded.

Usage:
  git -C <verl mirror> archive 1dda039 verl | tar -x -C /tmp/verl1dda
  PYTHONPATH=/tmp/verl1dda python scripts/verl_rollout_corr_fixtures.py
Needs torch, numpy and what verl's import chain wants (omegaconf, tensordict, ray: the bench
venv of scripts/bench_vs_torch.sh). No verl module is stubbed: the import works as is.
"""
import json
import math
from pathlib import Path

import torch
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/rollout_corr_verl_1dda039.json"
SEED = 20260115
SOURCE = (
    "verl-project/verl 1dda039, rollout_corr_helper.compute_rollout_correction_and_rejection_mask, "
    "torch float64 (scripts/verl_rollout_corr_fixtures.py)"
)


def cfg(rollout_is=None, is_thr=2.0, bn=False, rs=None, rs_thr=None):
    return {
        "rollout_is": rollout_is,
        "rollout_is_threshold": is_thr,
        "rollout_is_batch_normalize": bn,
        "rollout_rs": rs,
        "rollout_rs_threshold": rs_thr,
    }


def make_inputs(seed, lengths, T, sigma, shift=None):
    """old ~ -U(0.05, 3), rollout = old + N(0, sigma); mask row i = 1 on its first lengths[i]
    positions. shift "big": rows 0 / 1 get log-ratios of about +4.5 / -4.5 on every token (sums
    past +-20), and token (2, 1) a log-ratio of -25 (past the token-level clamp); a float:
    every log-ratio (old - rollout) moved by it."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    old = -(0.05 + 2.95 * torch.rand((B, T), generator=g, dtype=torch.float64))
    noise = sigma * torch.randn((B, T), generator=g, dtype=torch.float64)
    rollout = old + noise
    if shift == "big":
        rollout[0] = old[0] - 4.5 + noise[0] * 0.1  # log_ratio = old - rollout ~ +4.5
        rollout[1] = old[1] + 4.5 + noise[1] * 0.1  # ~ -4.5
        rollout[2, 1] = old[2, 1] + 25.0  # log_ratio -25
    elif shift is not None:
        rollout = rollout - shift
    mask = torch.zeros((B, T), dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return old, rollout, mask


def run(old, rollout, mask, c):
    return compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        rollout_is=c["rollout_is"],
        rollout_is_threshold=c["rollout_is_threshold"],
        rollout_is_batch_normalize=c["rollout_is_batch_normalize"],
        rollout_rs=c["rollout_rs"],
        rollout_rs_threshold=c["rollout_rs_threshold"],
    )


def num(x):
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def mat(t):
    return [[num(v) for v in row] for row in t.tolist()]


# Inputs, by name: (lengths (one per row; 0 = an empty row), T, sigma, shift). shift None: plain
# draw; "big": see make_inputs; a float: every log-ratio moved by it.
L5 = [6, 4, 0, 6, 2]  # B=5, T=6, an empty row
L6 = [8, 5, 7, 0, 3, 8]  # B=6, T=8, an empty row
L4 = [5, 3, 5, 1]  # B=4, T=5, no empty row
INPUTS = {
    "b5_s0.3": (L5, 6, 0.3, None),
    "b5_s0.05": (L5, 6, 0.05, None),
    "b5_s1": (L5, 6, 1.0, None),
    "b6_s0.3": (L6, 8, 0.3, None),
    "b6_s1": (L6, 8, 1.0, None),
    "b4_s1": (L4, 5, 1.0, None),
    "b4_one_token": ([0, 1, 0, 0], 5, 0.3, None),
    "b6_big": (L6, 8, 0.3, "big"),
    "b5_all_low": ([6, 4, 0, 5, 6], 6, 0.3, -5.0),  # every summed log-ratio below -20
}
# (name, input name, config)
CASES = [
    # 1. IS weights: token / sequence x TIS / IcePop x batch-normalize
    ("is_token_tis2_bnF", "b5_s1", cfg("token", 2.0, False)),
    ("is_token_tis2_bnT", "b5_s1", cfg("token", 2.0, True)),
    ("is_token_icepop_0.5_5.0_bnF", "b6_s1", cfg("token", "0.5_5.0", False)),
    ("is_token_icepop_0.5_5.0_bnT", "b6_s1", cfg("token", "0.5_5.0", True)),
    ("is_seq_tis1.5_bnF", "b6_s0.3", cfg("sequence", 1.5, False)),
    ("is_seq_tis1.5_bnT", "b6_s0.3", cfg("sequence", 1.5, True)),
    ("is_seq_icepop_0.8_1.25_bnF", "b5_s0.3", cfg("sequence", "0.8_1.25", False)),
    ("is_seq_icepop_0.8_1.25_bnT", "b5_s0.3", cfg("sequence", "0.8_1.25", True)),
    ("is_token_tis_str2.0_bnT", "b4_s1", cfg("token", "2.0", True)),
    ("is_token_single_valid_token", "b4_one_token", cfg("token", 2.0, True)),
    ("is_seq_tis2_all_low_bnT", "b5_all_low", cfg("sequence", 2.0, True)),  # mean <= 1e-8: no normalising
    ("is_token_tis2_all_low_bnT", "b5_all_low", cfg("token", 2.0, True)),
    # 2. metrics only
    ("metrics_only_sigma0.05", "b5_s0.05", cfg(None, 2.0)),
    ("metrics_only_sigma1", "b6_s1", cfg(None, 2.0)),
    # 3. every rollout_rs option alone
    ("rs_token_k1_str", "b6_s0.3", cfg(rs="token_k1", rs_thr="0.6_1.5")),
    ("rs_token_k1_float", "b6_s0.3", cfg(rs="token_k1", rs_thr=1.3)),
    ("rs_token_k2", "b6_s0.3", cfg(rs="token_k2", rs_thr=0.05)),
    ("rs_token_k3", "b6_s0.3", cfg(rs="token_k3", rs_thr=0.05)),
    ("rs_seq_sum_k1_str", "b6_s0.3", cfg(rs="seq_sum_k1", rs_thr="0.5_2.0")),
    ("rs_seq_sum_k1_float", "b6_s0.3", cfg(rs="seq_sum_k1", rs_thr=2.0)),
    ("rs_seq_sum_k2", "b6_s0.3", cfg(rs="seq_sum_k2", rs_thr=0.3)),
    ("rs_seq_sum_k3", "b6_s0.3", cfg(rs="seq_sum_k3", rs_thr=0.3)),
    ("rs_seq_mean_k1_str", "b6_s0.3", cfg(rs="seq_mean_k1", rs_thr="0.9_1.1")),
    ("rs_seq_mean_k1_float", "b6_s0.3", cfg(rs="seq_mean_k1", rs_thr=1.1)),
    ("rs_seq_mean_k2", "b6_s0.3", cfg(rs="seq_mean_k2", rs_thr=0.05)),
    ("rs_seq_mean_k3", "b6_s0.3", cfg(rs="seq_mean_k3", rs_thr=0.05)),
    ("rs_seq_max_k2", "b6_s0.3", cfg(rs="seq_max_k2", rs_thr=0.1)),
    ("rs_seq_max_k3", "b6_s0.3", cfg(rs="seq_max_k3", rs_thr=0.1)),
    ("rs_token_k2_sigma1", "b5_s1", cfg(rs="token_k2", rs_thr=0.5)),
    ("rs_seq_mean_k3_sigma0.05", "b5_s0.05", cfg(rs="seq_mean_k3", rs_thr=0.001)),
    # 4. combined
    ("rs_token_k1+seq_mean_k3", "b6_s0.3", cfg(rs="token_k1,seq_mean_k3", rs_thr="0.5_2.0,0.05")),
    ("rs_seq_max_k2_dup_broadcast", "b6_s0.3", cfg(rs="seq_max_k2,seq_max_k2", rs_thr=0.1)),
    ("rs_seq_sum_k3+token_k2_broadcast", "b5_s0.3", cfg(rs="seq_sum_k3, token_k2", rs_thr="0.2")),
    ("is_seq+rs_seq_mean_k1", "b6_s0.3", cfg("sequence", 2.0, False, "seq_mean_k1", "0.9_1.1")),
    ("is_token_icepop_bnT+rs_token_k1,seq_max_k3", "b5_s0.3",
     cfg("token", "0.8_1.25", True, "token_k1,seq_max_k3", "0.7_1.5,0.1")),
    # large log-ratios: sums past +-20, one token past -20
    ("big_is_seq_tis2", "b6_big", cfg("sequence", 2.0, False)),
    ("big_is_token_tis2_bnT", "b6_big", cfg("token", 2.0, True)),
    ("big_is_seq_icepop_bnT+rs_seq_sum_k1", "b6_big", cfg("sequence", "0.5_5.0", True, "seq_sum_k1", "0.01_100")),
    ("big_rs_token_k3,seq_max_k2", "b6_big", cfg(rs="token_k3,seq_max_k2", rs_thr="1.0,5.0")),
]

ERRORS = [
    cfg(rs="token_k4", rs_thr=1.0),  # unknown option
    cfg(rs="seq_max_k1", rs_thr=2.0),  # no k1 for seq_max
    cfg(rs="token_k2", rs_thr="0.5_2.0"),  # k2 with lower_upper
    cfg(rs="token_k1,seq_mean_k3,seq_max_k2", rs_thr="0.5_2.0,0.1"),  # 2 thresholds, 3 options
    cfg(rs="token_k1", rs_thr=None),  # no threshold
    cfg(rollout_is="bogus", is_thr=2.0),
    cfg(rollout_is="token", is_thr="5.0_0.5"),  # IcePop lower > upper
    cfg(rollout_is="token", is_thr=0.0),  # non-positive
    cfg(rollout_is="sequence", is_thr="-1"),
    cfg(rs="seq_max_k3", rs_thr="-1"),
    cfg(rs="token_k1", rs_thr=0.0),
    cfg(rollout_is="token", is_thr=True),  # a bool
    cfg(rs="seq_sum_k1", rs_thr="0.5_abc"),
    cfg(rollout_is="sequence", is_thr="0.99_1.01"),  # valid, but zeroes every weight: ESS 1/0
]


def main():
    out = {"source": SOURCE, "cases": [], "errors": []}
    names = set()
    inputs = {key: make_inputs(SEED + k, *spec) for k, (key, spec) in enumerate(INPUTS.items())}
    for name, key, c in CASES:
        assert name not in names, name
        names.add(name)
        old, rollout, mask = inputs[key]
        proto, mask_out, metrics = run(old, rollout, mask, c)
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        assert weights is None or weights.dtype == torch.float64
        assert mask_out.dtype == torch.float64
        out["cases"].append(
            {
                "name": name,
                "old_log_prob": mat(old),
                "rollout_log_prob": mat(rollout),
                "response_mask": mat(mask),
                "config": c,
                "weights": None if weights is None else mat(weights),
                "response_mask_out": mat(mask_out),
                "metrics": {key: num(v) for key, v in metrics.items()},
            }
        )
        kept, valid = int(mask_out.sum()), int(mask.sum())
        nonfinite = [key for key, v in metrics.items() if not math.isfinite(float(v))]
        print(f"{name:44s} kept {kept:2d}/{valid:2d} tokens, {len(metrics):2d} metrics"
              + (f", non-finite: {nonfinite}" if nonfinite else ""))

    old, rollout, mask = make_inputs(SEED - 1, [4, 2, 0, 3], 5, 0.3)
    for c in ERRORS:
        try:
            run(old, rollout, mask, c)
        except Exception as e:  # noqa: BLE001 - recorded, not handled
            out["errors"].append({"config": c, "message": str(e), "type": type(e).__name__})
        else:
            raise SystemExit(f"verl accepted the bad config {c}")

    OUT.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    print(f"wrote {OUT}: {len(out['cases'])} cases, {len(out['errors'])} errors")


if __name__ == "__main__":
    main()
