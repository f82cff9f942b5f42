#!/usr/bin/env python3
"""Qwen3.5 on this machine's CPU: main_ppo next to transformers/PyTorch, back to back, on a
random-weight model of Qwen3.5-0.8B's shape written by transformers (f32).

Measures, each in its own process with the same thread count:
  fwdbwd  forward + backward of the mean token log-probability of a [batch, seq] batch, at each
          --seqs length: seconds, tokens/s and peak RSS of both sides, like for like: with
          --checkpointing 0 (default) both keep every activation for backward; with 1 both
          recompute each layer in backward (verl's enable_gradient_checkpointing, training's
          default; transformers' gradient checkpointing on theirs), the mode in which a large
          batch fits in memory (keeping everything, 2048 tokens take 20 GB or more on each side).
          Peak memory against the sequence length shows whether the Gated DeltaNet layers keep
          it linear. Each side runs --warmup untimed passes first (default 1: a training update runs many micro-batches,
          and a process's first pass pays first-touch page faults for every block it allocates).
  gen     greedy generation of --new tokens for --gen-batch copies of a prompt (ours: the
          packed decode engine with continuous batching; theirs: model.generate).
Numbers are printed as a table and written to results/bench_qwen3_5/<time>/results.json; they
are reported, never asserted.

The shape (Qwen3.5-0.8B's published config): hidden 1024, 24 layers (every 4th full
attention), intermediate 3584, 8 query heads and 2 KV heads of 256 (rotary on 64), Gated
DeltaNet with 16 key and 16 value heads of 128, convolution width 4, vocabulary 248,320, tied
embeddings. --layers N keeps the first N layers (the pattern kept: 4 = three DeltaNet layers
and one attention layer) for a quicker run.

With --precision bf16, our side runs verl's mixed precision (bf16 products on AMX or
AVX512-BF16, f32 weights and sums) and PyTorch runs twice for fwdbwd: in f32 (the ratio's
baseline, as scripts/bench_vs_torch.sh) and under torch.autocast(bfloat16) (an extra column).

Usage: scripts/bench_qwen3_5.py [--layers 24] [--batch 1] [--seqs 512,1024]
         [--checkpointing 0|1] [--warmup 1] [--gen-batch 8] [--new 64] [--threads N] [--only fwdbwd,gen]
         [--precision f32|bf16]
Needs the reference venv of scripts/bench_vs_torch.sh (BENCH_VENV, default
~/.cache/main_ppo/bench-venv); the model is written once to ~/.cache/main_ppo/models/ (with the
byte-level tokenizer of tests/fixtures/byte_tokenizer); builds `cargo bench --bench vs_torch`.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("BENCH_VENV", Path.home() / ".cache/main_ppo/bench-venv"))
MODELS = Path.home() / ".cache/main_ppo/models"
TOKENIZER = ROOT / "tests/fixtures/byte_tokenizer"  # any tokenizer: the weights are random

SHAPE = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
)

MAKE = r"""
import sys, torch, transformers
out, layers = sys.argv[1], int(sys.argv[2])
shape = __SHAPE__
shape["num_hidden_layers"] = layers
torch.manual_seed(0)
cfg = transformers.Qwen3_5TextConfig(**shape)
model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32)
model.save_pretrained(out, safe_serialization=True)
"""


def model_dir(layers: int) -> Path:
    d = MODELS / f"qwen3_5-0.8b-shape-{layers}l"
    if (d / "config.json").is_file() and (d / "tokenizer.json").is_file():
        return d
    if not (TOKENIZER / "tokenizer.json").is_file():
        sys.exit(f"bench_qwen3_5.py: no tokenizer at {TOKENIZER}")
    d.mkdir(parents=True, exist_ok=True)
    code = MAKE.replace("__SHAPE__", repr(SHAPE))
    subprocess.run([str(VENV / "bin/python"), "-c", code, str(d), str(layers)], check=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (TOKENIZER / f).is_file():
            shutil.copy(TOKENIZER / f, d / f)
    return d


def bench_exe() -> str:
    out = subprocess.run(
        ["cargo", "bench", "--locked", "--quiet", "--bench", "vs_torch", "--no-run",
         "--message-format=json"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "vs_torch":
            return m["executable"]
    sys.exit("bench_qwen3_5.py: could not build benches/vs_torch.rs")


def run(argv, env) -> dict:
    t0 = time.time()
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-2000:] + p.stderr[-4000:])
        raise SystemExit(f"bench_qwen3_5.py: {' '.join(argv[:3])} ... failed ({p.returncode})")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            r["wall_s"] = time.time() - t0
            return r
    raise SystemExit(f"bench_qwen3_5.py: no RESULT line from {argv[0]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqs", default="512,1024")
    ap.add_argument("--checkpointing", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gen-batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="fwdbwd,gen")
    ap.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    a = ap.parse_args()
    bf16 = ["--bf16", "1" if a.precision == "bf16" else "0"]
    d = model_dir(a.layers)
    exe = bench_exe()
    env = {**os.environ, "RAYON_NUM_THREADS": str(a.threads), "OMP_NUM_THREADS": str(a.threads),
           "TQDM_DISABLE": "1"}
    py = [str(VENV / "bin/python"), "scripts/bench/vs_torch.py"]
    rows = []
    if "fwdbwd" in a.only:
        for s in [int(x) for x in a.seqs.split(",")]:
            common = ["--batch", str(a.batch), "--seq", str(s), "--warmup", str(a.warmup), "--reps", "1"]
            ours = run([exe, "fwdbwd", "--model", str(d), *common,
                        "--checkpointing", str(a.checkpointing), *bf16], env)
            torch_common = [*common, "--threads", str(a.threads), "--checkpointing", str(a.checkpointing)]
            theirs = run([*py, "fwdbwd", "--hf", str(d), *torch_common], env)
            if a.precision == "bf16":
                theirs["autocast_bf16"] = run([*py, "fwdbwd", "--hf", str(d), *torch_common,
                                               "--autocast-bf16"], env)
            rows.append(("fwdbwd", s, ours, theirs))
            auto = theirs.get("autocast_bf16")
            extra = (f" | torch bf16 autocast {auto['tokens_per_s']:.1f} tok/s, ratio "
                     f"{ours['tokens_per_s'] / auto['tokens_per_s']:.2f}x" if auto else "")
            print(f"fwdbwd {a.batch}x{s} ({a.precision}, checkpointing {a.checkpointing}): ours {ours['tokens_per_s']:.1f} tok/s "
                  f"{(ours.get('peak_rss_bytes') or 0) / 2**30:.2f} GiB | torch f32 "
                  f"{theirs['tokens_per_s']:.1f} tok/s {(theirs.get('peak_rss_bytes') or 0) / 2**30:.2f} GiB "
                  f"| ratio {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x{extra}", flush=True)
    if "gen" in a.only:
        common = ["--batch", str(a.gen_batch), "--new", str(a.new)]
        ours = run([exe, "gen", "--model", str(d), *common, *bf16], env)
        prompt = ROOT / "results" / "bench_qwen3_5_prompt.txt"
        prompt.parent.mkdir(exist_ok=True)
        prompt.write_text("<|im_start|>user\nNatalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?<|im_end|>\n<|im_start|>assistant\n")
        theirs = run([*py, "gen", "--hf", str(d), "--prompt", str(prompt), *common,
                      "--threads", str(a.threads)], env)
        rows.append(("gen", a.new, ours, theirs))
        print(f"gen {a.gen_batch}x{a.new}: ours {ours['tokens_per_s']:.1f} tok/s | torch "
              f"{theirs['tokens_per_s']:.1f} tok/s | ratio {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x",
              flush=True)
    out = ROOT / "results" / "bench_qwen3_5" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"model": str(d), "layers": a.layers, "threads": a.threads, "precision": a.precision,
         "warmup": a.warmup, "checkpointing": a.checkpointing,
         "rows": [{"what": w, "size": s, "ours": o, "theirs": t} for w, s, o, t in rows]}, indent=1))
    print(f"written {out / 'results.json'}")


if __name__ == "__main__":
    main()
