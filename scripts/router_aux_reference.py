#!/usr/bin/env python3
"""The router's load-balancing loss of the Qwen3-MoE fixtures, from transformers and PyTorch autograd.

For each Qwen3-MoE fixture written by scripts/family_reference.py (tests/fixtures/families/
qwen3_moe, qwen3_moe_step2) this loads the saved checkpoint with transformers, turns on
`output_router_logits`, runs the fixture's training sequences one at a time (no padding), and
hands every layer of experts' router logits, concatenated over the sequences, to transformers'
own `load_balancing_loss_func` (the function its Qwen3MoeForCausalLM adds, times
router_aux_loss_coef, to a loss from labels). It writes next to the fixture:
  router_aux.json                the loss (f64) and what it was computed on
  router_aux_grads.safetensors   d(loss)/d(parameter) for every parameter that gets one (f64)

Run with the pinned reference venv (scripts/bench/requirements.txt: torch 2.15, transformers
5.24):  ~/.cache/main_ppo/bench-venv/bin/python scripts/router_aux_reference.py
The Rust tests (src/weights/family_tests.rs) read the files; CI does not run this script.
"""
import json
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.qwen3_moe import modeling_qwen3_moe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from family_reference import OUT, exact_f64, per_expert  # noqa: E402


def make(name):
    d = OUT / name
    ref = json.loads((d / "reference.json").read_text())
    cfg = transformers.AutoConfig.from_pretrained(d)
    cfg.output_router_logits = True
    # transformers' own loop over experts (its grouped_mm kernels take no float64).
    cfg._experts_implementation = "eager"
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float64).eval()
    model.zero_grad()
    per_layer = None
    for s in ref["sequences"]:
        out = model(torch.tensor([s]), output_router_logits=True)
        logits = out.router_logits  # one [len, experts] per layer of experts
        per_layer = [[l] for l in logits] if per_layer is None else [p + [l] for p, l in zip(per_layer, logits)]
    gate_logits = tuple(torch.cat(p, 0) for p in per_layer)
    # The function sums its counts in float32 buffers and divides them there (count / tokens
    # rounded to float32, ~6e-8): in float64, as exact_f64() keeps the model's other casts.
    zeros = torch.zeros

    def zeros64(*args, dtype=None, **kw):
        return zeros(*args, dtype=torch.float64 if dtype is torch.float32 else dtype, **kw)

    torch.zeros = zeros64
    try:
        loss = modeling_qwen3_moe.load_balancing_loss_func(
            gate_logits, cfg.num_experts, cfg.num_experts_per_tok, None
        )
    finally:
        torch.zeros = zeros
    assert loss.dtype == torch.float64, loss.dtype
    loss.backward()
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters() if p.grad is not None}
    grads = per_expert(grads)
    save_file(grads, str(d / "router_aux_grads.safetensors"))
    info = {
        "family": name,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "function": "transformers.models.qwen3_moe.modeling_qwen3_moe.load_balancing_loss_func",
        "sequences": "reference.json's sequences, each alone, logits concatenated per layer",
        "layers_of_experts": len(gate_logits),
        "tokens": int(gate_logits[0].shape[0]),
        "aux_loss": float(loss.detach()),
        "parameters": sorted(grads),
    }
    (d / "router_aux.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{name}: aux loss {float(loss.detach()):.10f}, {len(grads)} gradients -> {d}")


def main():
    exact_f64()
    for name in sys.argv[1:] or ["qwen3_moe", "qwen3_moe_step2"]:
        make(name)


if __name__ == "__main__":
    main()
