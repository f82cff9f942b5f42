#!/usr/bin/env bash
# main_ppo next to PyTorch / transformers / TRL on this machine's CPU, back to back, one command:
#   (a) forward+backward of the model (SmolLM2-135M by default) on 8 x 256 tokens: tokens/s and peak RSS, both sides
#       keeping every activation; ours once more with per-layer recomputation (training's default)
#   (b) greedy generation, batch 32 x 128 new tokens (EOS ignored): tokens/s
#   (c) one AdamW step over every parameter (trainer::AdamW vs torch.optim.AdamW)
#   (d) one GRPO step with TRL's settings (8 prompts x 4 responses, <= 128 new tokens, beta 0,
#       lr 1e-6, per_device_train_batch_size 32, f32, GSM8K): main_ppo vs TRL's GRPOTrainer
# Each measurement runs in its own process, both sides with the same thread count; the table
# (metric, ours, theirs, ratio) is printed and written to results/bench_vs_torch/<time>/
# (results.md, results.json, logs/). Numbers are reported, never asserted.
#
# Set-up, cached after the first run: a venv with the pinned versions of
# scripts/bench/requirements.txt (PyPI; ~6 GB, torch's Linux wheel brings CUDA libraries),
# SmolLM2-135M-Instruct (scripts/fetch_smollm2.sh) and an f32 HF copy of it made by
# transformers from the same GGUF; the run first checks that both sides compute the same logits.
#
# Usage: scripts/bench_vs_torch.sh [--model smollm2|gemma3|qwen2.5-0.5b-shape] [--only fwdbwd,gen,adamw,grpo] [--quick] [--threads N]
#          [--micro-batch N] [--precision fp32|bf16] [--optim adamw|adamw8bit|adamw4bit] [--cpu auto|avx2]
#          [--data FILE.parquet] [--results DIR] [-- MAIN_PPO_OVERRIDE ...]
#   --model M       smollm2 (SmolLM2-135M-Instruct, default) or gemma3 (Gemma 3 270M base,
#                   scripts/fetch_gemma3.sh; prompts as "<bos>Question: ...\nAnswer:"; no grpo) or
#                   qwen2.5-0.5b-shape (Qwen2.5-0.5B's config, the model of verl's quickstart,
#                   random weights written by transformers, a GSM8K-trained BPE tokenizer with
#                   ChatML; both sides load that HF folder; responses run to the length limit)
#   --quick         fewer repetitions, 32 generated tokens, 2 GRPO steps (a few minutes)
#   --precision P   our matrix products: fp32 (default) or bf16 (verl's mixed precision: bf16
#                   operands, f32 sums and weights; AMX tiles). With bf16, PyTorch is measured
#                   twice for (a) and (b): in f32 (the table's baseline) and under
#                   torch.autocast(bfloat16) (extra rows); TRL in (d) stays f32.
#   --threads N     threads for both sides (default: all cores)
#   --micro-batch N main_ppo's ppo/log-prob micro-batch in (d) (default 8)
#   --optim O       the optimizer of (d) on both sides: adamw (torch's, default) or torchao's
#                   adamw8bit / adamw4bit (TRL: optim=adamw_torch_8bit / _4bit; main_ppo:
#                   optim.optimizer_impl=torchao.optim, optimizer=AdamW8bit / AdamW4bit)
#   --cpu C         instruction sets of both sides: auto (default, the CPU's widest) or avx2 (an
#                   AVX2-only CPU on an AVX-512 one: MAIN_PPO_CPU=avx2 for main_ppo;
#                   ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2
#                   for PyTorch). With bf16 on a CPU (or a forced set) without bf16 instructions,
#                   PyTorch's autocast rows are left out (emulated bf16, many times its f32 time).
#   -- ...          extra main_ppo overrides for (d)
# Environment: BENCH_VENV (default ~/.cache/main_ppo/bench-venv), PYTHON (to create the venv,
#   default python3), BENCH_LOCK=FILE (build and measure under `flock FILE`, so that nothing
#   else that takes the same lock, e.g. compiles, runs during the measurement).
set -euo pipefail
cd "$(dirname "$0")/.."

cpu=auto only="" quick="" model=smollm2 threads="$(nproc 2>/dev/null || echo 1)" micro=8 data="data/gsm8k/train.parquet" precision=fp32 optim=adamw
results="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only="${2:?--only needs a list, e.g. fwdbwd,gen}"; shift 2 ;;
    --only=*) only="${1#*=}"; shift ;;
    --quick) quick="--quick"; shift ;;
    --model) model="${2:?--model needs smollm2, gemma3 or qwen2.5-0.5b-shape}"; shift 2 ;;
    --threads) threads="${2:?--threads needs a number}"; shift 2 ;;
    --micro-batch) micro="${2:?--micro-batch needs a number}"; shift 2 ;;
    --precision) precision="${2:?--precision needs fp32 or bf16}"; shift 2 ;;
    --optim) optim="${2:?--optim needs adamw, adamw8bit or adamw4bit}"; shift 2 ;;
    --cpu) cpu="${2:?--cpu needs auto or avx2}"; shift 2 ;;
    --data) data="${2:?--data needs a file}"; shift 2 ;;
    --results) results="${2:?--results needs a folder}"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_vs_torch.sh: unknown argument \`$1\` (see --help)" >&2; exit 2 ;;
  esac
done
case "$threads" in ''|*[!0-9]*|0) echo "bench_vs_torch.sh: --threads must be a positive integer, got \`$threads\`" >&2; exit 2 ;; esac
case "$model" in smollm2|gemma3|qwen2.5-0.5b-shape) ;; *) echo "bench_vs_torch.sh: --model must be smollm2, gemma3 or qwen2.5-0.5b-shape, got \`$model\`" >&2; exit 2 ;; esac
if [ "$model" = gemma3 ]; then
  [ -n "$only" ] || only="fwdbwd,gen,adamw"
  case ",$only," in *,grpo,*) echo "bench_vs_torch.sh: --model gemma3 has no grpo measurement (TRL's side needs a chat model)" >&2; exit 2 ;; esac
fi
case "$cpu" in auto|avx2) ;; *) echo "bench_vs_torch.sh: --cpu must be auto or avx2, got \`$cpu\`" >&2; exit 2 ;; esac
case "$optim" in adamw|adamw8bit|adamw4bit) ;; *) echo "bench_vs_torch.sh: --optim must be adamw, adamw8bit or adamw4bit, got \`$optim\`" >&2; exit 2 ;; esac
case "$precision" in fp32|bf16) ;; *) echo "bench_vs_torch.sh: --precision must be fp32 or bf16, got \`$precision\`" >&2; exit 2 ;; esac
case "$micro" in ''|*[!0-9]*|0) echo "bench_vs_torch.sh: --micro-batch must be a positive integer, got \`$micro\`" >&2; exit 2 ;; esac
for m in ${only//,/ }; do
  case "$m" in fwdbwd|gen|adamw|grpo) ;; *) echo "bench_vs_torch.sh: --only: unknown measurement \`$m\` (expected fwdbwd, gen, adamw, grpo)" >&2; exit 2 ;; esac
done
[ -f "$data" ] || { echo "bench_vs_torch.sh: --data: no file $data" >&2; exit 2; }
[ -x /usr/bin/time ] || echo "bench_vs_torch.sh: /usr/bin/time missing (apt-get install time): only in-process peak RSS is recorded" >&2

locked() { if [ -n "${BENCH_LOCK:-}" ]; then flock "$BENCH_LOCK" "$@"; else "$@"; fi; }

# 1. The Python reference, from PyPI, pinned; reinstalled when requirements.txt changes.
venv="${BENCH_VENV:-$HOME/.cache/main_ppo/bench-venv}"
req="scripts/bench/requirements.txt"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [ "$(cat "$venv/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
  echo "setting up the Python reference in $venv (first run: a few minutes, ~6 GB) ..." >&2
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
  echo "$want" > "$venv/.requirements.sha256"
fi
py="$venv/bin/python"

# 2. The model: the GGUF for main_ppo, an f32 HF copy of the same weights for PyTorch (or, for
#    the random-weight shape, one HF folder for both).
if [ "$model" = qwen2.5-0.5b-shape ]; then
  hf="${MAIN_PPO_CACHE:-$HOME/.cache/main_ppo/models}/qwen2.5-0.5b-shape"
  TQDM_DISABLE=1 "$py" scripts/bench/vs_torch.py prepare-shape --data "$data" --out "$hf"
  gguf="$hf"
elif [ "$model" = gemma3 ]; then
  gguf="$(scripts/fetch_gemma3.sh)"
  hf="$(dirname "$gguf")/gemma-3-270m-f32-hf"
else
  gguf="$(scripts/fetch_smollm2.sh)"
  hf="$(dirname "$gguf")/SmolLM2-135M-Instruct-f32-hf"
fi
[ "$model" = qwen2.5-0.5b-shape ] || TQDM_DISABLE=1 "$py" scripts/bench/vs_torch.py prepare-hf --gguf "$gguf" --out "$hf"

# 3. Our side: the release binary and the bench executable (benches/vs_torch.rs).
echo "building main_ppo (release) and benches/vs_torch.rs ..." >&2
locked cargo build --release --locked --quiet --bin main_ppo
bench_exe="$(locked cargo bench --locked --quiet --bench vs_torch --no-run --message-format=json \
  | "$py" -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "vs_torch":
        print(m["executable"])')"
[ -x "$bench_exe" ] || { echo "bench_vs_torch.sh: could not build benches/vs_torch.rs" >&2; exit 1; }
rev="$(git describe --always --dirty 2>/dev/null || echo unknown)"

# 4. Measure, back to back.
if [ -z "$results" ]; then
  results="results/bench_vs_torch/$(date -u +%Y%m%dT%H%M%SZ)"
fi
mkdir -p "$results"
ln -sfn "$(basename "$results")" "$(dirname "$results")/latest" 2>/dev/null || true
ovr=()
for o in "${extra[@]+"${extra[@]}"}"; do ovr+=("--ours-override=$o"); done
locked "$py" scripts/bench/vs_torch.py run \
  --ours-bench "$bench_exe" --ours-bin target/release/main_ppo --ours-rev "$rev" \
  --model "$model" --gguf "$gguf" --hf "$hf" --data "$data" --results "$results" --threads "$threads" \
  --micro-batch "$micro" --precision "$precision" --optim "$optim" --cpu "$cpu" ${only:+--only "$only"} $quick "${ovr[@]+"${ovr[@]}"}"
