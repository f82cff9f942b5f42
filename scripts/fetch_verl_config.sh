#!/usr/bin/env bash
# Fetches verl's own config folder (verl/trainer/config: ppo_trainer.yaml and its config groups)
# from the `verl` wheel on PyPI into a cache folder and prints its path. Idempotent.
# Usage: scripts/fetch_verl_config.sh [VERSION] [CACHE_DIR]
#   VERSION   verl release (default 0.9.1: the release nearest verl-project/verl 1dda039, August
#             2026; 0.7.0 is the one nearest volcengine/verl b178a3c, January 2026)
#   CACHE_DIR default ~/.cache/main_ppo/verl
# The tests that compose verl's folder read it from MAIN_PPO_VERL_CONFIG (see .ci/run).
set -euo pipefail
version="${1:-0.9.1}"
cache="${2:-${MAIN_PPO_CACHE:-$HOME/.cache/main_ppo}/verl}"
target="$cache/verl-$version/config"
if [ -s "$target/ppo_trainer.yaml" ]; then
  echo "$target"
  exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "verl==$version" >&2
wheel="$(ls "$tmp"/*.whl | head -n 1)"
python3 - "$wheel" "$tmp/unpacked" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith("verl/trainer/config/") and name.endswith(".yaml"):
            z.extract(name, sys.argv[2])
PY
if [ ! -s "$tmp/unpacked/verl/trainer/config/ppo_trainer.yaml" ]; then
  echo "fetch_verl_config.sh: no verl/trainer/config/ppo_trainer.yaml in $(basename "$wheel")" >&2
  exit 1
fi
mkdir -p "$(dirname "$target")"
rm -rf "$target.partial"
mv "$tmp/unpacked/verl/trainer/config" "$target.partial"
mv "$target.partial" "$target"
echo "$target"
