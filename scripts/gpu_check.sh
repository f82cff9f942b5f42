#!/usr/bin/env bash
# The CUDA checks, on a machine with an NVIDIA GPU (a few minutes once built):
#   1. the CUDA tests of the library: the model on CUDA (candle's composition) against the CPU's
#      hand-written layers, fused LM head and packed decoding on the same weights (log-probs,
#      entropies, every gradient; greedy tokens), and a 2-step GRPO and a 2-step PPO (gae) run
#      with every model on the GPU (src/model/cuda_tests.rs, trainer::tests::a_two_step_run_on_cuda_trains);
#   2. the model bench on the GPU (benches/model.rs with MAIN_PPO_BENCH_DEVICE=cuda: generation
#      at batch 1/8/32, forward+backward 8 x 256, an AdamW step), when SmolLM2 is at hand
#      (MAIN_PPO_SMOLLM2 or scripts/fetch_smollm2.sh's cache).
#
# Usage:
#   scripts/gpu_check.sh                 build (needs cargo and nvcc) and run, on the GPU machine
#   scripts/gpu_check.sh --build DIR     build only, here: the test and bench executables into DIR
#                                        (for a GPU machine without a Rust toolchain)
#   scripts/gpu_check.sh --run DIR       run the executables in DIR (built by --build), there
# Environment: CUDA_COMPUTE_CAP (default: read from nvidia-smi, else 90), CUDARC_CUDA_VERSION
# (default: from nvcc --version), RESULTS (a folder for the logs; default results/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=all dir=""
case "${1:-}" in
  --build) mode=build; dir="${2:?--build needs a folder}" ;;
  --run) mode=run; dir="${2:?--run needs a folder}" ;;
  "") ;;
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  *) echo "gpu_check.sh: unknown argument \`$1\` (see --help)" >&2; exit 2 ;;
esac
results="${RESULTS:-results/gpu_check}"

build() {
  local out="$1"
  command -v nvcc >/dev/null || { echo "gpu_check.sh: nvcc is not on PATH (candle's CUDA kernels need it)" >&2; exit 1; }
  if [ -z "${CUDA_COMPUTE_CAP:-}" ]; then
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d . || true)"
    export CUDA_COMPUTE_CAP="${cap:-90}"
  fi
  if [ -z "${CUDARC_CUDA_VERSION:-}" ]; then
    v="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
    read -r major minor <<<"$v"
    export CUDARC_CUDA_VERSION="$((major * 1000 + minor * 10))"
  fi
  echo "building with --features cuda (compute capability $CUDA_COMPUTE_CAP, CUDA $CUDARC_CUDA_VERSION) ..." >&2
  mkdir -p "$out"
  local exes
  exes="$(cargo test --release --locked --features cuda --lib --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])')"
  cp $exes "$out/lib_tests"
  exes="$(cargo bench --locked --features cuda --bench model --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "model":
        print(m["executable"])')"
  cp $exes "$out/model_bench"
  strip "$out/lib_tests" "$out/model_bench" 2>/dev/null || true
  echo "built: $out/lib_tests, $out/model_bench" >&2
}

run() {
  local in="$1"
  mkdir -p "$results"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$results/gpu.txt" || true
  echo "== CUDA tests" >&2
  "$in/lib_tests" --test-threads 1 cuda 2>&1 | tee "$results/cuda_tests.log"
  grep -q "test result: ok" "$results/cuda_tests.log"
  grep -q "skipped: no CUDA device" "$results/cuda_tests.log" && {
    echo "gpu_check.sh: the tests found no CUDA device" >&2; exit 1; }
  local model="${MAIN_PPO_SMOLLM2:-$HOME/.cache/main_ppo/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
  if [ -f "$model" ]; then
    echo "== model bench on the GPU" >&2
    MAIN_PPO_SMOLLM2="$model" MAIN_PPO_BENCH_DEVICE=cuda "$in/model_bench" 2>&1 | tee "$results/model_bench.log"
  else
    echo "model bench skipped: no $model (set MAIN_PPO_SMOLLM2)" >&2
  fi
  echo "logs in $results" >&2
}

case "$mode" in
  build) build "$dir" ;;
  run) run "$dir" ;;
  all) tmp="$(mktemp -d)"; build "$tmp"; run "$tmp" ;;
esac
