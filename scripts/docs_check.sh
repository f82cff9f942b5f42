#!/usr/bin/env bash
# Builds the book (docs/book.toml, chapters in docs/src) with mdBook, as CI does. mdBook comes
# from crates.io (`cargo install`, the version pinned below, without its `serve`/`watch`
# features) into a cached folder, so a second run only builds. The book's commands, keys,
# links and generated configuration reference are checked by the test `docs::` of
# tests/integration.rs; this script checks that mdBook renders it.
# Usage: scripts/docs_check.sh   Environment: MAIN_PPO_CACHE (default ~/.cache/main_ppo),
#   MDBOOK (an mdbook binary to use instead of the cached one).
# The HTML goes to target/book (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.5.4
root="${MAIN_PPO_CACHE:-$HOME/.cache/main_ppo}/mdbook-$version"
mdbook="${MDBOOK:-$root/bin/mdbook}"
if [ ! -x "$mdbook" ]; then
  cargo install mdbook --locked --version "$version" --no-default-features --features search \
    --root "$root" --quiet
fi
"$mdbook" --version
"$mdbook" build docs --dest-dir "$PWD/target/book"
