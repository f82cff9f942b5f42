#!/usr/bin/env bash
# Builds the CUDA binaries on a machine WITHOUT a GPU, for a GPU machine without a Rust
# toolchain (the H200 device machine: CUDA 13.0 driver, no network), into one folder that
# travels: `lib_tests` (the library's tests, CUDA ones included), `main_ppo` and `gpu_bench`
# (benches/gpu.rs), stripped and compressed with xz (scripts/gpu/run.sh unpacks and runs them).
#
# The toolchain comes from PyPI wheels into a cached virtual environment: nvcc, the runtime,
# cuBLAS, cuRAND and NVRTC of CUDA 13.0 (PTX from a newer nvcc is refused by a 13.0 driver).
# candle links cudarc with `dynamic-linking`, so the link needs unversioned libcudart.so,
# libcublas.so, libcublasLt.so, libcurand.so, libnvrtc.so (symlinks made here to the wheels'
# versioned files) and a libcuda.so: the driver is not on a machine without a GPU, so a stub
# exporting the driver API's symbols (names read from cudarc's bindings) stands in at link time
# with the driver's soname, libcuda.so.1; the real driver is loaded at run time.
#
# Usage: scripts/gpu/build.sh [OUT_DIR]     (default .gpu, ignored by git through
#        .git/info/exclude; name it in the device tool's `carry`)
# Environment: CUDA_COMPUTE_CAP (default 90, the H100/H200), CUDA_WHEEL_VERSION (13.0.88).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-.gpu}"
ver="${CUDA_WHEEL_VERSION:-13.0.88}"
venv="${MAIN_PPO_CUDA_VENV:-$HOME/.cache/main_ppo/cuda-$ver}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import importlib.metadata as m; m.version('nvidia-cublas'); m.version('nvidia-cuda-nvrtc'); m.version('nvidia-curand'); assert m.version('nvidia-cuda-nvcc') == '$ver'" 2>/dev/null; then
  # cccl and cuBLAS are versioned apart from the compiler; these are CUDA 13.0's.
  "$venv/bin/python" -m pip install --quiet "nvidia-cuda-nvcc==$ver" "nvidia-nvvm==$ver" \
    "nvidia-cuda-crt==$ver" "nvidia-cuda-cccl==13.0.85" "nvidia-cuda-runtime==$ver" \
    "nvidia-cuda-nvrtc==$ver" "nvidia-cublas==13.0.2.14" "nvidia-curand==10.4.5.25"
fi
root="$("$venv/bin/python" - <<'PY'
import os, nvidia
for base in nvidia.__path__:
    for dirpath, dirnames, filenames in os.walk(base):
        if "nvcc" in filenames and dirpath.endswith("bin"):
            print(os.path.dirname(dirpath)); raise SystemExit
PY
)"
[ -n "$root" ] || { echo "build.sh: nvcc not found in the wheels" >&2; exit 1; }
lib="$root/lib"
for name in cudart cublas cublasLt curand nvrtc; do
  real="$(ls "$lib"/lib$name.so.* 2>/dev/null | grep -v -e alt -e builtins | head -n 1)"
  [ -n "$real" ] || { echo "build.sh: no lib$name.so.* in $lib" >&2; exit 1; }
  ln -sf "$(basename "$real")" "$lib/lib$name.so"
done
# The link-time stand-in for the driver (see the header).
stubs="$lib/stubs"
if [ ! -s "$stubs/libcuda.so" ]; then
  mkdir -p "$stubs"
  bindings="$(ls -d "$HOME"/.cargo/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs | head -n 1)"
  grep -o 'pub unsafe fn cu[A-Za-z0-9_]*' "$bindings" | awk '{print "void " $4 "(void) {}"}' \
    | sort -u > "$stubs/libcuda_stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda_stub.c"
fi
export PATH="$root/bin:$PATH" CUDA_ROOT="$root" CUDA_PATH="$root"
export CUDARC_CUDA_VERSION=13000 CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
mkdir -p "$out"
artifacts() {
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}
echo "build.sh: building with --features cuda (compute capability $CUDA_COMPUTE_CAP, CUDA 13.0) ..." >&2
cargo test --release --locked --features cuda --lib --no-run --message-format=json | artifacts \
  | while read -r name exe; do cp "$exe" "$out/lib_tests"; done
cargo build --release --locked --features cuda --bin main_ppo --message-format=json | artifacts \
  | while read -r name exe; do if [ "$name" = main_ppo ]; then cp "$exe" "$out/main_ppo"; fi; done
cargo bench --locked --features cuda --bench gpu --no-run --message-format=json | artifacts \
  | while read -r name exe; do if [ "$name" = gpu ]; then cp "$exe" "$out/gpu_bench"; fi; done
for f in lib_tests main_ppo gpu_bench; do
  strip "$out/$f"
  xz -f -6 -T0 "$out/$f"
done
ls -la "$out" >&2
total="$(du -cb "$out"/*.xz | tail -n 1 | cut -f1)"
echo "build.sh: $((total / 1048576)) MiB in $out" >&2
