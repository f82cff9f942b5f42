#!/usr/bin/env bash
# Makes a Python virtual environment with the tracking SDKs the tracker bridge is tested with
# (scripts/trackers/requirements.txt: wandb, mlflow, swanlab, trackio, clearml, pinned, from PyPI) and prints its
# python. Cached: the venv is keyed on the requirements file's sha256, so a second run only
# prints the path. `.ci/run` exports it as MAIN_PPO_TRACKERS_PYTHON for the SDK tests.
# Usage: scripts/fetch_trackers.sh   Environment: MAIN_PPO_CACHE (default ~/.cache/main_ppo),
#   PYTHON (the interpreter that creates the venv, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
req=scripts/trackers/requirements.txt
key="$(sha256sum "$req" | cut -c1-16)"
venv="${MAIN_PPO_CACHE:-$HOME/.cache/main_ppo}/trackers-venv-$key"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv/bin/python"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
"${PYTHON:-python3}" -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" >&2
"$venv/bin/python" -c "import wandb, mlflow, swanlab, trackio, clearml" >&2
touch "$venv/.complete"
echo "$venv/bin/python"
