#!/usr/bin/env python3
"""Writes a Qwen2.5-0.5B-shaped model directory with random weights, for the GPU checks
(scripts/gpu/run.sh): no hub is reachable from the GPU machine and real weights are too large to
carry there. transformers writes the config and the safetensors (bf16, as the hub stores
Qwen2.5-0.5B); the tokenizer is main_ppo's byte-level test tokenizer (tests/fixtures/
byte_tokenizer, written by main_ppo::testing::write_tokenizer_dir), whose ids all lie inside the
model's vocabulary.

Usage: scripts/gpu/model.py OUT_DIR [--layers N] [--device cuda|cpu]
"""
import argparse
import pathlib
import shutil
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--layers", type=int, default=24)
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
a = ap.parse_args()
t0 = time.time()
# Qwen2.5-0.5B's shape (its config.json on the hub).
cfg = Qwen2Config(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=a.layers,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=151643,
    eos_token_id=151643,
)
torch.manual_seed(0)
with torch.device(a.device):
    model = Qwen2ForCausalLM(cfg)
model = model.to(torch.bfloat16)
out = pathlib.Path(a.out)
model.save_pretrained(out, safe_serialization=True)
fixture = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "byte_tokenizer"
for f in fixture.iterdir():
    shutil.copy(f, out / f.name)
n = sum(p.numel() for p in model.parameters())
print(f"model.py: {n} parameters, {a.layers} layers, written to {out} in {time.time() - t0:.1f} s")
