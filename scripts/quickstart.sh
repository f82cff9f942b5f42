#!/usr/bin/env bash
# The quickstart: PPO with a critic on GSM8K with SmolLM2-135M-Instruct on this machine's CPU
# (configs/gsm8k_ppo_smollm2.yaml: 10 steps of 8 prompts, validation on 32 test prompts before
# training and every 5 steps, checkpoints every 5 steps).
# Fetches the model when missing, builds the release binary, runs from the repository root.
# Extra arguments are overrides: scripts/quickstart.sh trainer.total_training_steps=20
# Metrics: the console and main_ppo_quickstart/gsm8k_ppo_smollm2.jsonl; checkpoints in
# checkpoints/main_ppo_quickstart/gsm8k_ppo_smollm2 (a second run resumes from the newest).
# At the end, `main_ppo plot` draws the learning curve from that JSONL and prints the PNG's path.
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
target/release/main_ppo --config configs/gsm8k_ppo_smollm2.yaml \
  "actor_rollout_ref.model.path=$model" "critic.model.path=$model" "$@"
# The file logger's path for this config (trainer.project_name / experiment_name), as the
# trainer computes it; an override renaming the run needs `main_ppo plot <its .jsonl>` by hand.
metrics="${VERL_FILE_LOGGER_PATH:-${VERL_FILE_LOGGER_ROOT:-.}/main_ppo_quickstart/gsm8k_ppo_smollm2.jsonl}"
if [[ -f "$metrics" ]]; then
  chart="$(target/release/main_ppo plot "$metrics" --out "${metrics%.jsonl}.png")"
  echo "learning curve: $chart"
else
  echo "no metrics at $metrics (renamed run?): chart it with target/release/main_ppo plot <run>.jsonl" >&2
fi
