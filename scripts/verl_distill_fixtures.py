#!/usr/bin/env python3
"""Writes tests/fixtures/distill_verl_1dda039.json: inputs and what verl's own
`verl.trainer.distillation.losses.distillation_loss` (verl-project/verl 1dda039) gives for them,
in PyTorch f64. src/algo/distill.rs's `verl_1dda039` test reads it.

Each case runs verl's function on a micro-batch laid out as verl's engine hands it over: the
model's per-token log-probs of whole sequences (prompt + response, no padding, shifted by one)
for the student, the teacher's in the same layout, padded `old_log_probs` and `response_mask`,
and the global-batch numbers (`dp_size`, `batch_num_tokens`, `global_batch_size`). Covered:
every single-sample estimator name (kl, k1, abs, mse, k2, low_var_kl, k3), with and without
`loss_max_clamp`, supervised (k1 refused there, as in verl) and as a policy gradient (vanilla
PPO on −d with the distillation's clip range, with and without rollout IS weights), in the
aggregation modes, with and without global-batch numbers. One row has no response token.
`forward_kl_topk` (verl's FSDP `compute_forward_kl_topk` on student logits and the teacher's
top-k, then `distillation_loss` with its mass and overlap metrics): `topk_cases`, on logits
over a 12-token vocabulary with k = 4, with and without `log_prob_min_clamp` and
`loss_max_clamp`, supervised and as a policy gradient.

Usage:
  git -C <verl mirror> archive 1dda039 verl | tar -x -C /tmp/verl
  PYTHONPATH=/tmp/verl python scripts/verl_distill_fixtures.py
Needs torch, numpy, tensordict, datasets, pillow and what verl's import chain wants (see
verl_algo_fixtures.py).
"""
import json
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from verl.trainer.distillation.losses import distillation_loss
from verl.utils.metric import Metric
from verl.workers.config import DistillationLossConfig
from verl_algo_check import Cfg, num  # same directory

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/distill_verl_1dda039.json"
B, R, P = 5, 6, 2  # rows, response width, prompt length


def value(v):
    if isinstance(v, Metric):
        v = v.values[0] if hasattr(v, "values") else v.value
    return num(v)


def main():
    rng = np.random.default_rng(20261205)
    lens = [6, 4, 2, 0, 5]  # a row without a response token
    mask = np.zeros((B, R))
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    student = rng.uniform(-3.0, -0.05, size=(B, R))
    teacher = student + rng.normal(scale=0.8, size=(B, R))
    teacher = np.minimum(teacher, -1e-3)
    teacher[0, 0] = student[0, 0] - 14.0  # a far token: k3's clamp and loss_max_clamp act
    old = student + rng.normal(scale=0.2, size=(B, R))
    weights = rng.uniform(0.5, 1.5, size=(B, R))
    tokens, seqs = float(mask.sum()), float((mask.sum(-1) > 0).sum())
    infos = {
        "none": {"dp_size": 1, "batch_num_tokens": tokens, "global_batch_size": seqs},
        "global": {"dp_size": 2, "batch_num_tokens": 3 * tokens, "global_batch_size": 2 * seqs},
    }

    # verl's engine layout: per sequence P prompt tokens and its response; the model's output
    # at position j is the log-prob of token j + 1 (no_padding_2_padding shifts by one).
    def packed(x):
        vals = []
        for i, n in enumerate(lens):
            seq = np.zeros(P + n)
            seq[P - 1 : P - 1 + n] = x[i, :n]
            vals.append(seq)
        return torch.tensor(np.concatenate(vals), dtype=torch.float64)

    attention = np.zeros((B, P + R), dtype=np.int64)
    attention[:, :P] = 1
    attention[:, P:] = mask
    out = {
        "source": "verl-project/verl 1dda039 verl/trainer/distillation/losses.py distillation_loss, torch f64 (scripts/verl_distill_fixtures.py)",
        "mask": mask.tolist(),
        "student": student.tolist(),
        "teacher": teacher.tolist(),
        "old": old.tolist(),
        "weights": weights.tolist(),
        "infos": infos,
        "cases": [],
    }
    modes = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
    for loss_mode in modes:
        for pg in [False, True]:
            if loss_mode in ("kl", "k1") and not pg:
                continue  # verl refuses to backpropagate k1 directly
            for clamp in [None, 3.0]:
                for agg in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
                    for info_name in ["none", "global"]:
                        for weighted in [False, True] if pg else [False]:
                            info = infos[info_name]
                            loss_cfg = DistillationLossConfig(
                                loss_mode=loss_mode,
                                topk=None,
                                loss_max_clamp=clamp,
                                log_prob_min_clamp=None,
                                use_policy_gradient=pg,
                                clip_ratio=0.2,
                                clip_ratio_low=0.15,
                                clip_ratio_high=0.25,
                            )
                            dcfg = Cfg(distillation_loss=loss_cfg)
                            actor = Cfg(loss_agg_mode=agg, global_batch_info={}, loss_scale_factor=None)
                            data = TensorDict(
                                {
                                    "prompts": torch.ones((B, P), dtype=torch.int64),
                                    "responses": torch.ones((B, R), dtype=torch.int64),
                                    "attention_mask": torch.tensor(attention),
                                    "response_mask": torch.tensor(mask),
                                    "old_log_probs": torch.tensor(old),
                                    "teacher_logprobs": packed(teacher).unsqueeze(-1),
                                },
                                batch_size=[],
                            )
                            data["dp_size"] = info["dp_size"]
                            data["batch_num_tokens"] = info["batch_num_tokens"]
                            data["global_batch_size"] = info["global_batch_size"]
                            if weighted:
                                data["rollout_is_weights"] = torch.tensor(weights)
                            loss, metrics = distillation_loss(
                                actor, dcfg, {"log_probs": packed(student)}, data
                            )
                            out["cases"].append(
                                dict(
                                    loss_mode=loss_mode,
                                    policy_gradient=pg,
                                    clamp=clamp,
                                    agg=agg,
                                    info=info_name,
                                    weighted=weighted,
                                    loss=num(loss),
                                    metrics={k: value(v) for k, v in metrics.items()},
                                )
                            )
    out["topk"] = topk_cases(rng, lens, mask, old, infos, attention)
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}: {len(out['cases'])} cases, {len(out['topk']['cases'])} top-k cases")


def topk_cases(rng, lens, mask, old, infos, attention):
    import torch.nn.functional as F
    from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk

    V, K = 12, 4
    student_logits = rng.normal(scale=2.0, size=(B, R, V))
    teacher_logits = rng.normal(scale=2.0, size=(B, R, V))
    teacher_logits[1, 0] = student_logits[1, 0]  # a position where both agree
    t_lsm = F.log_softmax(torch.tensor(teacher_logits), dim=-1)
    t_lp, t_ids = torch.topk(t_lsm, K, dim=-1)  # [B, R, K]

    # The engine's packed layout: position P - 1 + i of a sequence predicts response token i.
    def packed_rows(x, fill):
        seqs = []
        for i, n in enumerate(lens):
            seq = np.array(fill(P + n), dtype=np.float64 if x.dtype != np.int64 else np.int64)
            seq[P - 1 : P - 1 + n] = x[i, :n]
            seqs.append(torch.tensor(seq))
        return seqs

    filler = lambda n: rng.normal(size=(n, V))  # noqa: E731
    logits = torch.cat(packed_rows(student_logits, filler)).unsqueeze(0)  # [1, total, V]
    nested_lp = torch.nested.as_nested_tensor(
        packed_rows(t_lp.numpy(), lambda n: np.zeros((n, K))), layout=torch.jagged
    )
    nested_ids = torch.nested.as_nested_tensor(
        packed_rows(t_ids.numpy().astype(np.int64), lambda n: np.zeros((n, K), dtype=np.int64)),
        layout=torch.jagged,
    )
    out = {
        "vocab": V,
        "k": K,
        "student_logits": student_logits.tolist(),
        "teacher_logits": teacher_logits.tolist(),
        "cases": [],
    }
    mean = lambda v: v.values[0] if hasattr(v, "values") else v  # noqa: E731
    for floor in [None, -3.0]:
        for clamp in [None, 0.5]:
            for pg in [False, True]:
                for agg in ["token-mean", "seq-mean-token-sum-norm"]:
                    info = infos["global"]
                    loss_cfg = DistillationLossConfig(
                        loss_mode="forward_kl_topk",
                        topk=K,
                        loss_max_clamp=clamp,
                        log_prob_min_clamp=floor,
                        use_policy_gradient=pg,
                        clip_ratio=0.2,
                        clip_ratio_low=0.15,
                        clip_ratio_high=0.25,
                    )
                    dcfg = Cfg(distillation_loss=loss_cfg)
                    terms = compute_forward_kl_topk(logits, nested_lp, nested_ids, dcfg, "thd")
                    model_output = {k: v.squeeze(0) for k, v in terms.items()}
                    # The student's log-prob of each sampled token (any: the supervised form
                    # does not read it; the policy gradient's ratio does).
                    model_output["log_probs"] = torch.tensor(
                        np.concatenate(
                            [np.concatenate([np.zeros(P - 1), old[i, :n] + 0.1, np.zeros(1)]) for i, n in enumerate(lens)]
                        )
                    )
                    actor = Cfg(loss_agg_mode=agg, global_batch_info={}, loss_scale_factor=None)
                    data = TensorDict(
                        {
                            "prompts": torch.ones((B, P), dtype=torch.int64),
                            "responses": torch.ones((B, R), dtype=torch.int64),
                            "attention_mask": torch.tensor(attention),
                            "response_mask": torch.tensor(mask),
                            "old_log_probs": torch.tensor(old),
                        },
                        batch_size=[],
                    )
                    for key in ["dp_size", "batch_num_tokens", "global_batch_size"]:
                        data[key] = info[key]
                    loss, metrics = distillation_loss(actor, dcfg, model_output, data)
                    out["cases"].append(
                        dict(
                            floor=floor,
                            clamp=clamp,
                            policy_gradient=pg,
                            agg=agg,
                            info="global",
                            loss=num(loss),
                            metrics={k: value(v) for k, v in metrics.items()},
                        )
                    )
    return out


if __name__ == "__main__":
    main()
