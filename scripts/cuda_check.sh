#!/usr/bin/env bash
# Type-checks the CUDA build (`cargo check --features cuda`) and the NCCL data-parallel build
# (`--features nccl,mpi`: NCCL over torchrun or bootstrapped over MPI) on a machine without a GPU, with
# nvcc from PyPI wheels (see docs/design.md). The wheels go into a cached virtual environment.
# Usage: scripts/cuda_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ver="${CUDA_WHEEL_VERSION:-13.2.86}"
venv="${MAIN_PPO_CUDA_VENV:-$HOME/.cache/main_ppo/cuda-$ver}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-cccl') == '$ver'" 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet "nvidia-cuda-nvcc==$ver" "nvidia-nvvm==$ver" "nvidia-cuda-crt==$ver" "nvidia-cuda-cccl==$ver" "nvidia-cuda-runtime==$ver"
fi
root="$("$venv/bin/python" - <<'PY'
import os, nvidia
for base in nvidia.__path__:
    for dirpath, dirnames, filenames in os.walk(base):
        if "nvcc" in filenames and dirpath.endswith("bin"):
            print(os.path.dirname(dirpath)); raise SystemExit
PY
)"
if [ -z "$root" ]; then
  echo "cuda_check.sh: nvcc not found in the wheels" >&2
  exit 1
fi
export PATH="$root/bin:$PATH"
export CUDA_ROOT="$root" CUDA_PATH="$root"
export CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13020}"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
cargo check --locked --features cuda --all-targets
# Type-checking links nothing, so libnccl is not needed here (a `cargo build --features nccl`
# links it: the PyPI wheel nvidia-nccl-cu13 ships libnccl.so).
cargo check --locked --features nccl,mpi --lib --bins
