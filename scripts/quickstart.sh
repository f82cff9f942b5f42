#!/usr/bin/env bash
# The quickstart: GRPO on GSM8K with SmolLM2-135M-Instruct on this machine's CPU
# (configs/gsm8k_grpo_smollm2_quickstart.yaml; the settings and what they gave are in
# docs/quickstart-recipes.md). Fetches the model when missing, builds the release binary, runs
# from the repository root. Extra arguments are overrides for training and for the evaluations:
#   scripts/quickstart.sh trainer.total_training_steps=20
# Metrics: the console and main_ppo_quickstart/gsm8k_grpo_smollm2_quickstart.jsonl; checkpoints
# in checkpoints/main_ppo_quickstart/gsm8k_grpo_smollm2_quickstart (a second run resumes).
# At the end:
#   - `main_ppo plot` draws the learning curve from that JSONL and prints the PNG's path;
#   - the starting model and the last checkpoint answer the held-out prompts that validation
#     uses (greedy, `main_ppo generate`), `main_ppo eval` scores both, and one line each is
#     printed: format rate (responses with a `#### <number>` answer: a non-zero score under
#     gsm8k's format_score 0.1), accuracy (verl's strict gsm8k score) and mean response length.
# QUICKSTART_CONFIG=configs/gsm8k_ppo_smollm2.yaml runs the PPO-with-critic recipe instead.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${QUICKSTART_CONFIG:-configs/gsm8k_grpo_smollm2_quickstart.yaml}"
name="$(basename "$config" .yaml)"
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
bin="${CARGO_TARGET_DIR:-target}/release/main_ppo"
paths=("actor_rollout_ref.model.path=$model")
if grep -q '^critic:' "$config"; then
  paths+=("critic.model.path=$model")
fi
started=$(date +%s)
"$bin" --config "$config" "${paths[@]}" "$@"
trained=$(date +%s)

# The file logger's path for this config (trainer.project_name / experiment_name), as the
# trainer computes it; an override renaming the run needs `main_ppo plot <its .jsonl>` by hand.
metrics="${VERL_FILE_LOGGER_PATH:-${VERL_FILE_LOGGER_ROOT:-.}/main_ppo_quickstart/$name.jsonl}"
if [[ -f "$metrics" ]]; then
  chart="$("$bin" plot "$metrics" --out "${metrics%.jsonl}.png")"
  echo "learning curve: $chart"
else
  echo "no metrics at $metrics (renamed run?): chart it with $bin plot <run>.jsonl" >&2
fi

# Before/after on the validation prompts (data.val_files, data.val_max_samples: the same rows).
ckpts="checkpoints/main_ppo_quickstart/$name"
if [[ ! -f "$ckpts/latest_checkpointed_iteration.txt" ]]; then
  echo "no checkpoint in $ckpts (renamed run?): no before/after evaluation" >&2
  exit 0
fi
step="$(cat "$ckpts/latest_checkpointed_iteration.txt")"
actor="$ckpts/global_step_$step/actor"
if [[ -d "$actor/lora_adapter" ]]; then
  after=("actor_rollout_ref.model.path=$model" "actor_rollout_ref.model.lora_adapter_path=$actor/lora_adapter")
else
  after=("actor_rollout_ref.model.path=$actor/huggingface")
fi
val_file="$("$bin" --config "$config" "$@" --cfg job | sed -n 's/^ *val_files: *//p' | head -n 1)"
val_file="${val_file#[}"; val_file="${val_file%%[],]*}"
val_file="${val_file:-data/gsm8k/test.parquet}"
out="${metrics%.jsonl}_eval"
mkdir -p "$out"
# One line: format rate, accuracy, mean length of the generations in $1.
summarise() {
  local fmt acc
  fmt="$("$bin" eval --config "$config" --input "$1")"
  acc="$("$bin" eval --input "$1")"
  printf '%s  %s  %s' \
    "$(sed -n 's/.*nonzero@1 \([0-9.]*\).*/\1/p' <<<"$fmt" | head -n 1)" \
    "$(sed -n 's/.*mean@1 \([0-9.]*\).*/\1/p' <<<"$acc" | head -n 1)" \
    "$(sed -n 's/.*length \([0-9.]*\).*/\1/p' <<<"$fmt" | head -n 1)"
}
greedy=(actor_rollout_ref.rollout.temperature=0 actor_rollout_ref.rollout.n=1)
"$bin" generate --config "$config" --input "$val_file" --output "$out/before.jsonl" \
  "$@" "${greedy[@]}" "actor_rollout_ref.model.path=$model"
"$bin" generate --config "$config" --input "$val_file" --output "$out/after.jsonl" \
  "$@" "${greedy[@]}" "${after[@]}"
done_at=$(date +%s)
echo
echo "held-out prompts ($val_file, greedy): format rate  accuracy  mean length (tokens)"
printf '  %-22s %s\n' "start model:" "$(summarise "$out/before.jsonl")"
printf '  %-22s %s\n' "step $step checkpoint:" "$(summarise "$out/after.jsonl")"
echo "wall time: training $((trained - started)) s, with the evaluations $((done_at - started)) s"
