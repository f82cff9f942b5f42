#!/usr/bin/env bash
# Rollout correction on the GRPO quickstart (configs/gsm8k_grpo_smollm2_quickstart.yaml:
# SmolLM2-135M-Instruct, bf16 decode and bf16 products in the update, 4 prompts x 8 responses):
# how far the rollout's log-probs are from the trainer's, and what bypass mode saves.
#   1. decoupled: token IS weights (rollout_is=token), the old-log-prob pass runs;
#   2. bypass: bypass_mode=true (the rollout's log-probs are the old ones: no pass);
#   3. f32: rollout.dtype=float32 and f32 products in the update, token IS weights.
# Each runs STEPS steps (default 2) without validation or checkpoints and prints, per step, the
# step time, the old-log-prob pass's time and the rollout_corr/* and training/rollout_probs_diff_*
# metrics. Usage: scripts/rollout_corr_mismatch.sh [STEPS] [WORK_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
steps="${1:-2}"
work="${2:-$(mktemp -d)}"
model="$(scripts/fetch_smollm2.sh)"
# bf16 products need AVX512-BF16 (AMD Zen 4/5) or AMX (Intel Xeon 4th gen on); elsewhere the
# config's bf16 runs as f32 and the decoupled run shows f32 rounding only.
if grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then
  echo "CPU: bf16 instructions present (bf16 decode against the trainer's forward)"
else
  echo "CPU: no bf16 instructions: both sides compute in f32 here"
fi
cargo build --release --locked --quiet
bin="$root/target/release/main_ppo"
common=(
  --config "$root/configs/gsm8k_grpo_smollm2_quickstart.yaml"
  "actor_rollout_ref.model.path=$model"
  "data.train_files=$root/data/gsm8k/train.parquet"
  "data.val_files=$root/data/gsm8k/test.parquet"
  "trainer.total_training_steps=$steps"
  trainer.val_before_train=False
  trainer.test_freq=-1
  trainer.save_freq=-1
  "trainer.logger=[file]"
)
declare -A extra=(
  [decoupled]="algorithm.rollout_correction.rollout_is=token"
  [bypass]="algorithm.rollout_correction.bypass_mode=True algorithm.rollout_correction.rollout_is=token"
  [f32]="algorithm.rollout_correction.rollout_is=token actor_rollout_ref.rollout.dtype=float32 actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32"
)
for run in decoupled bypass f32; do
  mkdir -p "$work/$run"
  # shellcheck disable=SC2086
  (cd "$work/$run" && "$bin" "${common[@]}" ${extra[$run]} 2> "$work/$run.log")
done
python3 - "$work" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
keys = ["timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
        "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_abs_diff",
        "rollout_corr/chi2_token", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_min",
        "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_ratio_fraction_high",
        "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "training/rollout_actor_probs_pearson_corr"]
for run in ["decoupled", "bypass", "f32"]:
    for line in (work / run / "main_ppo_quickstart/gsm8k_grpo_smollm2_quickstart.jsonl").read_text().splitlines():
        row = json.loads(line)
        d = row["data"]
        shown = ", ".join(f"{k.split('/', 1)[1]} {d[k]:.6g}" for k in keys if k in d)
        print(f"{run:9s} step {row['step']}: {shown}")
EOF
