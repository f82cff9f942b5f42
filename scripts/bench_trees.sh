#!/usr/bin/env bash
# Our side of scripts/bench_vs_torch.sh (benches/vs_torch.rs) on two git revisions, back to
# back on this machine: forward+backward of SmolLM2-135M on 8 x 256 tokens (every activation
# kept, and with per-layer recomputation) and greedy generation of 32 x 128 tokens, with the same
# arguments the comparison script passes. Rounds alternate A, B, A, B, ... so that both trees see
# the same machine state; the table gives each tree's median and B/A. Numbers are reported, never
# asserted (timings on these VMs move about ±15 % between runs: compare within one run only).
#
# Usage: scripts/bench_trees.sh REV_A REV_B [--rounds N] [--precision fp32|bf16] [--only fwdbwd,gen]
#   e.g. scripts/bench_trees.sh cd900dc HEAD --rounds 3 --precision bf16
# Each revision is checked out with `git worktree` under target/bench-trees/ and built with
# `cargo bench --no-run` (release profile) into one shared target folder (the dependencies
# are built once). Needs the SmolLM2 GGUF (scripts/fetch_smollm2.sh fetches it).
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -ge 2 ] || { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 2; }
rev_a="$1" rev_b="$2"; shift 2
rounds=3 precision=bf16 only="fwdbwd,gen"
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="${2:?--rounds needs a number}"; shift 2 ;;
    --precision) precision="${2:?--precision needs fp32 or bf16}"; shift 2 ;;
    --only) only="${2:?--only needs a list}"; shift 2 ;;
    *) echo "bench_trees.sh: unknown argument \`$1\`" >&2; exit 2 ;;
  esac
done
case "$rounds" in ''|*[!0-9]*|0) echo "bench_trees.sh: --rounds must be a positive integer" >&2; exit 2 ;; esac
case "$precision" in fp32) bf16=0 ;; bf16) bf16=1 ;; *) echo "bench_trees.sh: --precision must be fp32 or bf16" >&2; exit 2 ;; esac

gguf="$(scripts/fetch_smollm2.sh)"
root="$PWD/target/bench-trees"
export CARGO_TARGET_DIR="$root/target"
mkdir -p "$root"

# A bench executable for each revision.
declare -A exe
for rev in "$rev_a" "$rev_b"; do
  sha="$(git rev-parse --short "$rev^{commit}")"
  tree="$root/$sha"
  if [ ! -d "$tree" ]; then
    git worktree add --detach "$tree" "$sha" >/dev/null
  fi
  echo "building $rev ($sha) ..." >&2
  exe[$rev]="$(cd "$tree" && cargo bench --locked --quiet --bench vs_torch --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "vs_torch":
        print(m["executable"])')"
  [ -x "${exe[$rev]}" ] || { echo "bench_trees.sh: no bench executable for $rev" >&2; exit 1; }
  # Each build overwrites the same file name: keep this revision's copy.
  cp "${exe[$rev]}" "$root/vs_torch-$sha"
  exe[$rev]="$root/vs_torch-$sha"
done

out="$root/results-$(date -u +%Y%m%dT%H%M%SZ).tsv"
printf 'round\trev\tmeasurement\ttokens_per_s\tpeak_rss_gib\n' > "$out"
run() { # rev name args...
  local rev="$1" name="$2"; shift 2
  local line
  line="$("${exe[$rev]}" "$@" --model "$gguf" --bf16 "$bf16" | grep '^RESULT ' | head -n 1)"
  python3 - "$line" "$r" "$rev" "$name" >> "$out" <<'PY'
import json, sys
line, r, rev, name = sys.argv[1:]
d = json.loads(line[len("RESULT "):])
rss = d.get("peak_rss_bytes") or 0
print(f"{r}\t{rev}\t{name}\t{d['tokens_per_s']:.1f}\t{rss / 2**30:.2f}")
PY
  tail -n 1 "$out" >&2
}
for r in $(seq 1 "$rounds"); do
  for rev in "$rev_a" "$rev_b"; do
    if [[ ",$only," == *",fwdbwd,"* ]]; then
      run "$rev" fwdbwd fwdbwd --checkpointing 0 --batch 8 --seq 256 --warmup 1 --reps 2
      run "$rev" fwdbwd_recompute fwdbwd --checkpointing 1 --batch 8 --seq 256 --warmup 1 --reps 2
    fi
    if [[ ",$only," == *",gen,"* ]]; then
      run "$rev" gen gen --batch 32 --new 128 --warmup-new 4
    fi
  done
done

python3 - "$out" "$rev_a" "$rev_b" <<'PY'
import csv, statistics, sys
path, a, b = sys.argv[1:]
rows = list(csv.DictReader(open(path), delimiter="\t"))
names = list(dict.fromkeys(r["measurement"] for r in rows))
print(f"\n{'measurement':<18} {a + ' (median)':>18} {b + ' (median)':>18} {'B/A':>6}   all rounds A | B")
for n in names:
    va = [float(r["tokens_per_s"]) for r in rows if r["measurement"] == n and r["rev"] == a]
    vb = [float(r["tokens_per_s"]) for r in rows if r["measurement"] == n and r["rev"] == b]
    ma, mb = statistics.median(va), statistics.median(vb)
    print(f"{n:<18} {ma:>18.1f} {mb:>18.1f} {mb / ma:>6.3f}   {' '.join(map(str, va))} | {' '.join(map(str, vb))}")
print(f"\n(tokens/s; rows in {path})")
PY
