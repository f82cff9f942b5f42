#!/usr/bin/env bash
# The aarch64 build and its tests on an x86-64 machine:
#   1. cross-compiles the library's tests for aarch64-unknown-linux-gnu (rustup's target; Debian's
#      gcc-aarch64-linux-gnu compiles the C dependencies and links),
#   2. runs a subset of them under qemu-aarch64 (Debian's qemu-user) two ways: on a CPU with
#      FEAT_BF16 (`-cpu max`: the BFDOT kernel chosen, the NEON kernels compared with it) and on a
#      Cortex-A72 (no BF16: NEON widening chosen). The portable loops are the same source on every
#      target and run forced on x86-64 (.ci/run); MAIN_PPO_AARCH64_PORTABLE=1 adds a third run
#      with MAIN_PPO_CPU=portable here,
#   3. with MAIN_PPO_APPLE_CHECK=1, type-checks and lints the library for aarch64-apple-darwin
#      (Apple silicon). Three C dependencies (ring via ureq's rustls, zstd-sys via parquet's zstd, onig_sys via tokenizers'
#      onig) compile C against Apple's SDK, which only a Mac has; `cargo check` never links, so
#      scripts/stub_cc.sh stands in for that C compiler and the Rust code is checked in full. On
#      a Mac (Xcode's command line tools) `cargo build --release` needs nothing of this.
# The subset under qemu: the kernels (every path against its reference; kernels::alloc reads
# /proc/self/smaps and re-runs the test binary, which qemu-user cannot show it, so it is
# skipped), the model's parity tests and the trainer's golden runs (names in `subset` below);
# the whole library under emulation takes over 25 minutes, too long for CI.
# MAIN_PPO_AARCH64_ALL=1 runs every library test instead.
# Usage: scripts/aarch64_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "[aarch64 $(date -u +%H:%M:%S)] $*"; }
target=aarch64-unknown-linux-gnu
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  step "installing gcc-aarch64-linux-gnu and qemu-user"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
fi
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"

step "clippy for $target"
cargo clippy --locked --target "$target" --lib --tests -- -D warnings
step "building the library's tests for $target"
cargo test --locked --target "$target" --lib --no-run

subset=(kernels:: model::tests:: model::decode::tests model::recompute::tests model::grad_sink::tests
        weights::family_tests:: trainer::tests::golden)
skip=(--skip kernels::alloc)
if [ -n "${MAIN_PPO_AARCH64_ALL:-}" ]; then subset=(); fi
run() {
  local what="$1"; shift
  step "tests under qemu: $what"
  env "$@" cargo test --locked --target "$target" --lib -- "${subset[@]}" "${skip[@]}"
}
run "-cpu max (FEAT_BF16: BFDOT)" QEMU_CPU=max
run "-cpu cortex-a72 (no BF16: NEON widening)" QEMU_CPU=cortex-a72
if [ -n "${MAIN_PPO_AARCH64_PORTABLE:-}" ]; then
  run "MAIN_PPO_CPU=portable" QEMU_CPU=max MAIN_PPO_CPU=portable
fi

# Apple silicon: the same aarch64 code (the Linux clippy above lints its NEON/BFDOT paths); no
# macOS-only code exists, so CI skips this type-check (4-5 min of dependency checking on a cold
# machine) and MAIN_PPO_APPLE_CHECK=1 runs it.
if [ -n "${MAIN_PPO_APPLE_CHECK:-}" ]; then
  apple=aarch64-apple-darwin
  rustup target list --installed | grep -qx "$apple" || rustup target add "$apple"
  step "clippy for $apple (C compiler stood in: see above)"
  CC_aarch64_apple_darwin="$PWD/scripts/stub_cc.sh" AR_aarch64_apple_darwin=ar \
    cargo clippy --locked --target "$apple" --lib -- -D warnings
fi
step "aarch64 done"
