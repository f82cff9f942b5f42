#!/usr/bin/env python3
"""Writes tests/fixtures/algo_verl_1dda039.json: inputs and the numbers verl's own
`verl/trainer/ppo/core_algos.py` (verl-project/verl 1dda039) gives for them, in PyTorch f64.
src/algo's `verl_1dda039` tests read it.

Covered: `agg_loss` in every mode with and without the global-batch arguments (`dp_size`,
`batch_num_tokens`, `global_batch_size`, `loss_scale_factor`); the policy losses vanilla, gspo,
gpg, sapo, cispo, geo_mean, kl_cov, dppo_tv, dppo_kl and dro in several aggregation modes, with
and without rollout importance-sampling weights and global-batch arguments; the clipped value
loss with global-batch arguments; the gdpo estimator with and without reward weights; the
optimal_token_baseline and tir_optimal_token_baseline estimators (with and without rollout IS
weights, on masks that are prefixes and on masks with tokens left out inside a response) and
`metric_utils.compute_variance_proxy_metrics` on the same inputs. Inputs hold a fully masked
row. (clip_cov draws its tokens with torch's generator and is left out.)

Usage:
  git -C <verl mirror> archive 1dda039 verl | tar -x -C /tmp/verl
  PYTHONPATH=/tmp/verl python scripts/verl_algo_fixtures.py
Needs torch, numpy and what verl's import chain wants (omegaconf, tensordict, ray, codetiming,
orjson: the bench venv of scripts/bench_vs_torch.sh plus those).
"""
import json
from pathlib import Path

import numpy as np
import torch
import verl.trainer.ppo.core_algos as ca
from verl_algo_check import Cfg, actor_cfg, num, t  # same directory

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/algo_verl_1dda039.json"
B, T = 5, 6


def main():
    rng = np.random.default_rng(20261204)
    mask = np.ones((B, T))
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    mask[3, :] = 0  # a row without a valid token
    mask[4, 5:] = 0
    loss_mat = rng.normal(size=(B, T))
    old = rng.uniform(-2.5, -0.1, size=(B, T))
    logp = old + rng.normal(scale=0.3, size=(B, T))
    logp = np.minimum(logp, -1e-3)
    adv = rng.normal(size=(B, T))
    # Tokens that move far: probability up by 0.33 with A > 0 and down by 0.35 with A < 0
    # (outside dppo's bounds 0.28 / 0.2), and a ratio e > clip_ratio_c 2 on a kept token.
    for (i, j), (o, lp, a) in {
        (0, 0): (-0.6, -0.1, 1.0),
        (1, 0): (-0.3, -1.0, -1.0),
        (0, 1): (-2.5, -1.5, 0.7),
        (4, 2): (-1.2, -2.4, -0.5),
    }.items():
        old[i, j], logp[i, j], adv[i, j] = o, lp, a
    weights = rng.uniform(0.5, 1.5, size=(B, T))
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    infos = {
        "none": {},
        "scale": {"loss_scale_factor": 4.0},
        # one of two ranks of a mini-batch 3× this one's tokens and 2× its sequences
        "global": {"dp_size": 2, "batch_num_tokens": 3 * tokens, "global_batch_size": 2 * seqs},
        "global_scale": {
            "dp_size": 2,
            "batch_num_tokens": 3 * tokens,
            "global_batch_size": 2 * seqs,
            "loss_scale_factor": 4.0,
        },
    }
    modes = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    out = {
        "source": "verl-project/verl 1dda039 verl/trainer/ppo/core_algos.py, torch f64 (scripts/verl_algo_fixtures.py)",
        "loss_mat": loss_mat.tolist(),
        "mask": mask.tolist(),
        "old": old.tolist(),
        "logp": logp.tolist(),
        "adv": adv.tolist(),
        "weights": weights.tolist(),
        "infos": infos,
        "agg": [],
        "policy": [],
        "value": [],
    }
    for mode in modes:
        for name, info in infos.items():
            got = ca.agg_loss(t(loss_mat), t(mask), mode, **info)
            out["agg"].append(dict(mode=mode, info=name, loss=num(got)))

    p = dict(
        clip_low=0.2, clip_high=0.28, clip_ratio_c=2.0, tau_pos=1.0, tau_neg=1.05,
        kl_cov_ratio=0.2, ppo_kl_coef=0.1, dro_beta=0.7,
        clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
    )
    out["params"] = p
    losses = ["vanilla", "gspo", "gpg", "sapo", "cispo", "geo_mean", "kl_cov", "dppo_tv", "dppo_kl", "dro"]
    for lm in losses:
        fn = ca.get_policy_loss_fn(lm)
        for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
            for info_name in ["none", "global_scale"]:
                for weighted in [False, True]:
                    cfg = actor_cfg(p, info=infos[info_name])
                    w = t(weights) if weighted else None
                    lp = t(logp).requires_grad_(True)
                    loss, metrics = fn(t(old), lp, t(adv), t(mask), agg, cfg, w)
                    (grad,) = torch.autograd.grad(loss, lp)
                    out["policy"].append(
                        dict(
                            mode=lm,
                            agg=agg,
                            info=info_name,
                            weighted=weighted,
                            loss=num(loss),
                            grad=grad.tolist(),
                            metrics={k.removeprefix("actor/"): num(v) for k, v in metrics.items()},
                        )
                    )
    values = old + 1.0
    vpreds = values + rng.normal(scale=0.6, size=(B, T))
    returns = values + rng.normal(scale=1.0, size=(B, T))
    out["vpreds"], out["values"], out["returns"] = vpreds.tolist(), values.tolist(), returns.tolist()
    for agg in modes:
        for name, info in infos.items():
            loss, clipfrac = ca.compute_value_loss(t(vpreds), t(returns), t(values), t(mask), 0.5, agg, **info)
            out["value"].append(dict(agg=agg, info=name, loss=num(loss), vf_clipfrac=num(clipfrac)))
    # gdpo: two reward components over groups [0, 0, 1, 1, 1]; "format" is all-equal in group 1.
    index = np.array(["a", "a", "b", "b", "b"], dtype=object)
    comps = {"accuracy": [1.0, 0.0, 1.0, 0.0, 0.0], "format": [0.5, 1.0, 1.0, 1.0, 1.0]}
    prompts = torch.zeros((B, 3), dtype=torch.long)
    attention = torch.cat([torch.ones((B, 3)), t(mask)], dim=1).long()
    out["gdpo"] = []
    for weights in [None, [1.0, 0.5]]:
        for norm in [True, False]:
            cfg = Cfg(gdpo_reward_keys=list(comps), gdpo_reward_weights=weights, norm_adv_by_std_in_grpo=norm)
            adv, ret = ca.compute_gdpo_outcome_advantage(
                token_level_rewards=torch.zeros((B, T), dtype=torch.float64),
                response_mask=t(mask),
                index=index,
                norm_adv_by_std_in_grpo=norm,
                config=cfg,
                non_tensor_batch={k: np.array(v) for k, v in comps.items()},
                batch={"prompts": prompts, "attention_mask": attention},
            )
            out["gdpo"].append(dict(weights=weights, norm=norm, adv=adv.double().tolist()))
    out["gdpo_components"] = comps
    out["gdpo_index"] = [0, 0, 1, 1, 1]
    out["otb"] = otb_cases()
    out["pf_ppo"] = pf_ppo_cases()
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"wrote {OUT}: {len(out['agg'])} agg, {len(out['policy'])} policy, {len(out['value'])} value, "
        f"{len(out['otb']['cases'])} optimal-token-baseline, {len(out['otb']['variance_proxy'])} variance-proxy cases"
    )


def pf_ppo_cases():
    """PF-PPO's resampling weights: verl's `compute_pf_ppo_reweight_data` on a DataProto whose
    float32 `token_level_scores` sum to ties at the maximum and the minimum, a zero and scores
    spread over several tokens. The weights are what verl hands `torch.multinomial` (caught
    here; the draws themselves come from torch's generator and are not compared)."""
    from verl import DataProto

    scores = torch.tensor(
        [
            [0.0, 0.0, 1.0, 0.0],
            [0.0, 0.0, 0.0, -2.0],
            [0.0, 0.0, 0.0, 0.0],
            [0.25, 0.25, 0.5, 0.0],
            [0.0, 0.5, 0.0, 0.0],
            [-1.5, 0.0, -0.5, 0.0],
            [0.1, 0.2, 0.0, 0.0],
        ],
        dtype=torch.float32,
    )
    caught = []
    real = torch.multinomial

    def catch(weights, n, replacement=False, **kw):
        caught.append(weights.double().tolist())
        return real(weights, n, replacement=replacement, **kw)

    torch.multinomial = catch
    cases = []
    try:
        for method, pw in [("pow", 2.0), ("pow", 1.5), ("pow", 0.0), ("max_min", 2.0), ("max_random", 2.0)]:
            data = DataProto.from_dict(tensors={"token_level_scores": scores.clone()})
            ca.compute_pf_ppo_reweight_data(data, method, pw)
            cases.append(dict(method=method, weight_pow=pw, weights=caught.pop()))
    finally:
        torch.multinomial = real
    return {"token_level_scores": scores.double().tolist(), "cases": cases}


def otb_cases():
    """The optimal token baselines on 12 responses of 7 positions in five groups: a (lengths
    7, 4, 2: one strictly longest, so the zero tail applies; rewards on every token), b (three
    responses of 5 tokens scoring 1 each: all-equal), c (5 tokens and an empty response), d (a
    group of one), e (6, 6 and 5 tokens: a tie for the longest). "prefix" masks are each
    response's first tokens; "holes" leaves tokens out inside rows 0 and 11 (what rollout
    rejection does here, tool outputs in verl's multi-turn rollouts). Its own generator, so the
    inputs above stay as they were."""
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    rng = np.random.default_rng(20261205)
    b, tl = 12, 7
    groups = ["a", "a", "a", "b", "b", "b", "c", "c", "d", "e", "e", "e"]
    lens = [7, 4, 2, 5, 5, 5, 5, 0, 3, 6, 6, 5]
    scores = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 0.7, 0.0, 1.0, 1.0]
    prefix = np.zeros((b, tl))
    for i, n in enumerate(lens):
        prefix[i, :n] = 1
    holes = prefix.copy()
    holes[0, [2, 5]] = 0
    holes[11, :] = [1, 1, 0, 1, 1, 1, 0]
    rewards = np.zeros((b, tl))
    for i, n in enumerate(lens):
        if n:
            rewards[i, n - 1] = scores[i]
    rewards[:3] += rng.normal(scale=0.3, size=(3, tl)) * prefix[:3]
    old = rng.uniform(-3.0, -0.01, size=(b, tl))
    pi = np.exp(old)
    spi2 = pi**2 + rng.uniform(0.0, 1.0, size=(b, tl)) * (1 - pi**2) * 0.6
    weights = rng.uniform(0.5, 1.5, size=(b, tl))
    index = np.array(groups, dtype=object)
    fns = {
        "optimal_token_baseline": ca.compute_optimal_token_baseline_advantage,
        "tir_optimal_token_baseline": ca.compute_multi_turn_optimal_token_baseline_advantage,
    }
    masks = {"prefix": prefix, "holes": holes}
    out = {
        "index": [ord(g) - ord("a") for g in groups],
        "rewards": rewards.tolist(),
        "old_log_probs": old.tolist(),
        "sum_pi_squared": spi2.tolist(),
        "rollout_is_weights": weights.tolist(),
        "masks": {k: v.tolist() for k, v in masks.items()},
        "cases": [],
        "variance_proxy": [],
    }
    for name, fn in fns.items():
        for mask_name, mask in masks.items():
            for weighted in [False, True]:
                adv, ret = fn(
                    token_level_rewards=t(rewards),
                    response_mask=t(mask),
                    index=index,
                    old_log_probs=t(old),
                    sum_pi_squared=t(spi2),
                    rollout_is_weights=t(weights) if weighted else None,
                )
                out["cases"].append(
                    dict(estimator=name, mask=mask_name, weighted=weighted, adv=adv.tolist(), ret=ret.tolist())
                )
    # The W-score metrics on the optimal token baseline's advantages (prefix masks).
    adv, _ = ca.compute_optimal_token_baseline_advantage(
        token_level_rewards=t(rewards), response_mask=t(prefix), index=index,
        old_log_probs=t(old), sum_pi_squared=t(spi2),
    )
    out["variance_proxy_advantages"] = adv.tolist()
    for mask_name, mask in masks.items():
        for weighted in [False, True]:
            for grad_norm in [None, 0.3]:
                tensors = {
                    "old_log_probs": t(old), "sum_pi_squared": t(spi2), "advantages": adv,
                    "response_mask": t(mask),
                }
                if weighted:
                    tensors["rollout_is_weights"] = t(weights)
                batch = DataProto.from_dict(tensors=tensors)
                metrics = compute_variance_proxy_metrics(batch, gradient_norm=grad_norm)
                out["variance_proxy"].append(
                    dict(mask=mask_name, weighted=weighted, grad_norm=grad_norm,
                         metrics={k: num(v) for k, v in metrics.items()})
                )
    return out


if __name__ == "__main__":
    main()
