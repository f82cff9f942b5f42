#!/usr/bin/env bash
# Checks our LoRA adapters against PEFT (not part of CI: it downloads torch, transformers and
# peft into its own virtual environment, and runs SmolLM2 on the CPU).
#
#   scripts/peft_check.sh [--f32] [HF_MODEL_DIR]  # default: ~/.cache/main_ppo/models/SmolLM2-135M-Instruct-f32-hf
#                                                # both sides in f64 unless --f32
#   scripts/peft_check.sh --make-fixture DIR    # writes the small PEFT fixture the Rust tests read
#
# Environment: PEFT_VENV (default ~/.cache/main_ppo/peft-venv), MAIN_PPO (the binary; default
# target/release/main_ppo, built if missing), MAIN_PPO_STAGES (our layer-by-layer forward;
# default target/release/examples/hidden_states, built if missing).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
venv="${PEFT_VENV:-$HOME/.cache/main_ppo/peft-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  # The CPU build of torch when its index is reachable, else PyPI's default wheel.
  "$venv/bin/pip" install -q torch --index-url https://download.pytorch.org/whl/cpu \
    || "$venv/bin/pip" install -q torch
  "$venv/bin/pip" install -q transformers peft safetensors
fi
if [ "${1:-}" = "--make-fixture" ]; then
  exec "$venv/bin/python" "$here/peft_check.py" make-fixture "$2"
fi
bin="${MAIN_PPO:-$root/target/release/main_ppo}"
if [ ! -x "$bin" ]; then
  (cd "$root" && cargo build --release --locked)
fi
stages="${MAIN_PPO_STAGES:-$root/target/release/examples/hidden_states}"
if [ ! -x "$stages" ]; then
  (cd "$root" && cargo build --release --locked --example hidden_states)
fi
extra=()
if [ "${1:-}" = "--f32" ]; then extra=(--f32); shift; fi
model="${1:-$HOME/.cache/main_ppo/models/SmolLM2-135M-Instruct-f32-hf}"
exec "$venv/bin/python" "$here/peft_check.py" check --model "$model" --main-ppo "$bin" --stages "$stages" "${extra[@]}"
