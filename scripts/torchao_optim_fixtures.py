#!/usr/bin/env python3
"""Writes tests/fixtures/optim_torchao_0.18.json: what torchao 0.18's low-bit Adam optimizers
(`torchao.optim`, the classes verl builds for `optim.optimizer_impl=torchao.optim`) do to a few
parameters over five steps, and their quantisation maps. `trainer::optim`'s tests read it.

Inputs are integer formulas both sides evaluate exactly in f32 (one correctly rounded division,
then a power-of-two factor), so the file holds only the outputs:
  p0[i]    = ((i·7919 mod 2001) − 1000) / 1000 · 0.5
  g_t[i]   = (((i·7919 + (t+1)·104729) mod 2001) − 1000) / 1000 · 2^(((i div 256) mod 8) − 4)
for t = 0..4, i over each parameter's flattened elements. Parameters: 16×256 (states quantised:
≥ 4096 elements and a multiple of the block), 4100 and 300 elements (f32 states, as torchao
keeps them). lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 (coupled for the
Adam classes, decoupled for AdamW).

Each optimizer runs as verl builds it (`optimizer_cls(params, lr=…, weight_decay=…, betas=…)`,
`step()` compiled by torch.compile as torchao does). Recorded: every parameter after the last step,
and the quantised parameter's moments as torchao holds them (codes and block scales). Arrays are
base64 of their little-endian bytes (f32, or u8 codes) to keep the file small.

Usage: python scripts/torchao_optim_fixtures.py   (bench venv of scripts/bench_vs_torch.sh plus
`pip install torchao==0.18.0`; torch.compile needs a C++ compiler)
"""
import base64
import json
from pathlib import Path

import numpy as np
import torch
import torchao
import torchao.optim as tao
from torchao.optim.subclass_4bit import OptimState4bit
from torchao.optim.subclass_8bit import OptimState8bit
from torchao.optim.subclass_fp8 import OptimStateFp8

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/optim_torchao_0.18.json"
SHAPES = {"a": (16, 256), "c": (4100,), "d": (300,)}
STEPS = 5


def formula(n, salt, scaled):
    i = np.arange(n, dtype=np.int64)
    ints = ((i * 7919 + salt) % 2001 - 1000).astype(np.float32)
    x = ints / np.float32(1000.0)
    if scaled:
        x = x * (2.0 ** (((i // 256) % 8) - 4)).astype(np.float32)
    else:
        x = x * np.float32(0.5)
    return x.astype(np.float32)


def b64(t):
    return base64.b64encode(t.detach().contiguous().numpy().tobytes()).decode()


def state_json(s):
    assert isinstance(s, (OptimState8bit, OptimState4bit, OptimStateFp8)), type(s)
    codes = s.codes.flatten()
    if isinstance(s, OptimStateFp8):
        codes = codes.view(torch.uint8)
    return {"codes": b64(codes), "scale": b64(s.scale.float())}


def run(name):
    params = {
        k: torch.nn.Parameter(torch.from_numpy(formula(int(np.prod(sh)), 0, False)).view(sh).clone())
        for k, sh in SHAPES.items()
    }
    cls = getattr(tao, name)
    opt = cls(list(params.values()), lr=1e-2, weight_decay=0.01, betas=(0.9, 0.999))
    for t in range(STEPS):
        for k, p in params.items():
            g = formula(p.numel(), (t + 1) * 104729, True)
            p.grad = torch.from_numpy(g).view(p.shape).clone()
        opt.step()
    out = {k: {"param": b64(p.flatten())} for k, p in params.items()}
    st = opt.state[params["a"]]
    if name != "_AdamW":
        out["a"]["exp_avg"] = state_json(st["exp_avg"])
        out["a"]["exp_avg_sq"] = state_json(st["exp_avg_sq"])
    for k in ("c", "d"):  # kept in f32 by torchao's rule
        assert not hasattr(opt.state[params[k]]["exp_avg"], "codes"), k
    return out


def main():
    from torchao.optim.subclass_4bit import get_qmap_signed as s4, get_qmap_unsigned as u4
    from torchao.optim.subclass_8bit import get_qmap_signed as s8, get_qmap_unsigned as u8

    f32 = lambda xs: torch.tensor(xs, dtype=torch.float32).tolist()
    doc = {
        "source": f"torchao {torchao.__version__}, torch {torch.__version__}: scripts/torchao_optim_fixtures.py",
        "shapes": {k: list(v) for k, v in SHAPES.items()},
        "steps": STEPS,
        "qmap": {
            "signed8": f32(s8()),
            "unsigned8": f32(u8()),
            "signed4": f32(s4()),
            "unsigned4": f32(u4()),
        },
        "runs": {n: run(n) for n in ["AdamW8bit", "Adam8bit", "AdamW4bit", "AdamWFp8"]},
    }
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
