#!/bin/sh
# A stand-in C compiler for type-checking a target whose C toolchain this machine lacks
# (aarch64-apple-darwin: ring, zstd-sys and onig_sys compile C with Apple's SDK). `cargo check`
# never links, so the C objects are never read: this answers the `cc` crate's compiler probe as
# clang, refuses cl-style flags, and writes an empty file wherever `-o` points. Used only by
# scripts/aarch64_check.sh; never for a build whose output runs.
case "$1" in
  -E) echo '#pragma message "clang"'; exit 0 ;;
  -\?) exit 1 ;;
esac
out=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  prev="$a"
done
[ -n "$out" ] && : >"$out"
exit 0
