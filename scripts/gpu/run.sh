#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU and no Rust toolchain (the H200 device
# machine), from binaries built elsewhere by scripts/gpu/build.sh. Each stage has its own time
# limit and its own log; a failing stage does not stop the next. Results go to $OUT (the device
# tool's folder; results/gpu otherwise), at most 8 files:
#   run.log      everything, with each stage's start time and exit status
#   tests.log    the library's CUDA tests (CUDA against the CPU: sampling, AdamW, attention,
#                the LM head, bf16 products, recomputation, packed sequences, training runs)
#   parity.log   a Qwen2.5-0.5B-shaped model (random weights, written here by model.py): CUDA
#                f32 and bf16 against the CPU's f32 (log-probs, entropies, gradients)
#   bench.log    benches/gpu.rs on that model: generation, forward+backward, AdamW, memory
#   ppo.log, ppo.jsonl   two PPO (gae) steps of verl's quickstart shape on that model
#   gpu.csv      nvidia-smi's memory and utilisation every 0.5 s
# Usage: scripts/gpu/run.sh [BIN_DIR]   (default .gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
bin="${1:-.gpu}"
out="${OUT:-results/gpu}"
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
stage() { echo "== $(date -u +%T) $*"; }
ran() { echo "== $(date -u +%T) exit status $1"; }

stage "setup"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
# cuBLAS, cuRAND, NVRTC and the CUDA runtime from the image's PyTorch wheels; the driver's
# libcuda from its own folder.
libs="$(python3 - <<'PY'
import glob, os
import nvidia
dirs = set()
for base in nvidia.__path__:
    for p in glob.glob(os.path.join(base, "**", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(p))
print(":".join(sorted(dirs)))
PY
)"
export LD_LIBRARY_PATH="$libs:/usr/local/nvidia/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export CUDA_CACHE_MAXSIZE=4294967296 RUST_BACKTRACE=1
tmp="$(mktemp -d)"
for f in lib_tests main_ppo gpu_bench; do
  if command -v xz >/dev/null; then
    xz -dc "$bin/$f.xz" > "$tmp/$f"
  else
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$bin/$f.xz" "$tmp/$f"
  fi
  chmod +x "$tmp/$f"
done
if ldd "$tmp/main_ppo" | grep "not found"; then
  echo "run.sh: libraries missing (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"
  exit 1
fi
ldd "$tmp/main_ppo" | grep -E "cuda|cublas|curand|nvrtc"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -lms 500 > "$out/gpu.csv" &
smi=$!

stage "CUDA tests (limit 120 s)"
timeout 120 "$tmp/lib_tests" --test-threads 1 cuda > "$out/tests.log" 2>&1
ran $?
grep -E "^test |test result|panicked|skipped" "$out/tests.log" | head -n 80

stage "model (limit 60 s)"
model=/tmp/qwen25_05b_shape
timeout 60 python3 scripts/gpu/model.py "$model"
ran $?

stage "real-size parity (limit 90 s)"
MAIN_PPO_GPU_MODEL="$model" timeout 90 "$tmp/lib_tests" --ignored --test-threads 1 --nocapture real_size > "$out/parity.log" 2>&1
ran $?
grep -vE "^\s*$" "$out/parity.log" | tail -n 40

stage "bench (limit 120 s)"
MAIN_PPO_GPU_MODEL="$model" timeout 120 "$tmp/gpu_bench" > "$out/bench.log" 2>&1
ran $?
cat "$out/bench.log"

stage "PPO, verl quickstart shape (limit 180 s)"
# verl's quickstart (examples/ppo_trainer/run_qwen2.5-0.5b-gsm8k... on one GPU): 256 prompts,
# 512 prompt + 256 response tokens, n = 1, GAE with a critic, bf16 as verl runs it.
VERL_FILE_LOGGER_PATH="$out/ppo.jsonl" timeout 180 "$tmp/main_ppo" \
  algorithm.adv_estimator=gae \
  data.train_files=data/gsm8k/train.parquet data.val_files=data/gsm8k/test.parquet \
  data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=256 \
  data.filter_overlong_prompts=True \
  actor_rollout_ref.model.path="$model" critic.model.path="$model" \
  actor_rollout_ref.actor.optim.lr=1e-6 critic.optim.lr=1e-5 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
  critic.ppo_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.n=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 \
  actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16 \
  critic.model.fsdp_config.mixed_precision.param_dtype=bf16 \
  actor_rollout_ref.rollout.dtype=bfloat16 \
  trainer.device=cuda trainer.logger='[console,file]' \
  trainer.total_training_steps=2 trainer.val_before_train=False trainer.test_freq=-1 \
  trainer.save_freq=-1 trainer.default_local_dir=/tmp/ckpt > "$out/ppo.log" 2>&1
ran $?
grep -vE "^\s*$" "$out/ppo.log" | tail -n 30

kill "$smi" 2>/dev/null
stage "done"
