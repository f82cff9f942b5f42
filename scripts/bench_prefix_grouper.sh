#!/usr/bin/env bash
# What `actor_rollout_ref.actor.use_prefix_grouper` saves: the quickstart recipe
# (configs/gsm8k_grpo_smollm2_quickstart.yaml: GSM8K, SmolLM2-135M-Instruct, 4 prompts x 8
# responses, LoRA, bf16 products) run for a few steps without and with the grouper, the runs
# interleaved (off, on, off, on, ...) so that drift of the machine hits both sides alike. Same
# seed, so the first step of every run samples the same responses. Prints, per run and summed
# over the steps after the first (the first pays for warming up), the time of the update
# (`timing_s/update_actor`) and of the old-log-prob pass (`timing_s/old_log_prob`), and the
# ratio grouped / alone of each.
#
# Usage: scripts/bench_prefix_grouper.sh [--steps N] [--pairs P] [override ...]
#   --steps N   training steps per run (default 3; steps 2..N are summed)
#   --pairs P   (off, on) pairs of runs (default 1)
#   overrides   extra key=value overrides for both sides (e.g. data.train_batch_size=8)
# Needs the release binary (built here) and SmolLM2 (scripts/fetch_smollm2.sh, fetched here).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=3
pairs=1
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --pairs) pairs="$2"; shift 2 ;;
    --help|-h) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "bench_prefix_grouper.sh: unknown option $1" >&2; exit 2 ;;
    *) extra+=("$1"); shift ;;
  esac
done
if ! [[ "$steps" =~ ^[0-9]+$ ]] || (( steps < 2 )); then
  echo "bench_prefix_grouper.sh: --steps must be an integer >= 2 (step 1 is not counted), got $steps" >&2
  exit 2
fi
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
bin=target/release/main_ppo
out="$(mktemp -d /tmp/bench_prefix_grouper.XXXXXX)"
data="data/gsm8k"
[[ -f "$data/train.parquet" ]] || data="../shared/data/gsm8k"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) threads; output in $out"

run() { # $1 = label, $2 = True|False
  local jsonl="$out/$1.jsonl"
  VERL_FILE_LOGGER_PATH="$jsonl" "$bin" --config configs/gsm8k_grpo_smollm2_quickstart.yaml \
    "actor_rollout_ref.model.path=$model" \
    "data.train_files=$data/train.parquet" "data.val_files=$data/test.parquet" \
    trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 \
    trainer.resume_mode=disable "trainer.total_training_steps=$steps" \
    "trainer.logger=['file']" "trainer.default_local_dir=$out/ckpt_$1" \
    "actor_rollout_ref.actor.use_prefix_grouper=$2" "${extra[@]}" > "$out/$1.log" 2>&1 \
    || { echo "run $1 failed: $out/$1.log" >&2; tail -n 20 "$out/$1.log" >&2; exit 1; }
}
for ((p = 1; p <= pairs; p++)); do
  run "alone_$p" False
  run "grouped_$p" True
done

python3 - "$out" "$pairs" <<'EOF'
import json, sys
from pathlib import Path
out, pairs = Path(sys.argv[1]), int(sys.argv[2])
keys = ["timing_s/update_actor", "timing_s/old_log_prob", "timing_s/gen", "timing_s/step"]
def load(label):
    rows = [json.loads(l)["data"] for l in (out / f"{label}.jsonl").read_text().splitlines() if l.strip()]
    return rows
tot = {"alone": {k: 0.0 for k in keys}, "grouped": {k: 0.0 for k in keys}}
for p in range(1, pairs + 1):
    for side in ["alone", "grouped"]:
        rows = load(f"{side}_{p}")
        later = rows[1:]
        sums = {k: sum(r.get(k, 0.0) for r in later) for k in keys}
        for k in keys:
            tot[side][k] += sums[k]
        lens = [(r.get("prompt_length/mean"), r.get("response_length/mean")) for r in rows]
        print(f"{side}_{p}: " + ", ".join(f"{k.split('/')[1]} {sums[k]:.2f} s" for k in keys)
              + f" (steps 2..{len(rows)}; prompt/response mean length per step: "
              + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in lens) + ")")
for k in keys[:2]:
    a, g = tot["alone"][k], tot["grouped"][k]
    print(f"{k}: alone {a:.2f} s, grouped {g:.2f} s, grouped/alone {g / a:.3f} ({(1 - g / a) * 100:.1f} % less)")
EOF
