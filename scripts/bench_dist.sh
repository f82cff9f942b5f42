#!/usr/bin/env bash
# Data parallelism on one machine: the same GRPO run (bench_vs_torch.sh's TRL settings: 8 prompts
# x 4 responses, <= 128 new tokens, no KL, lr 1e-6, SmolLM2-135M-Instruct, GSM8K) once as one
# process with N threads and once as N MPI ranks with one thread each, back to back. Prints the
# seconds of every step (`timing_s/step`), generation and update time, response length and score
# of both runs side by side, and whether the two runs' per-step metrics agree (they should to
# ~1e-6 in f32: the ranks split the batch, all-reduce the gradients and gather the rollout).
# A measurement, not a promise: on a 2-core machine the ranks compete with each other and with
# Open MPI's progress polling.
#
# Usage: scripts/bench_dist.sh [--ranks N] [--steps N] [--precision fp32|bf16] [-- OVERRIDE ...]
# Needs Open MPI (`apt-get install libopenmpi-dev openmpi-bin libclang-dev`); builds
# `main_ppo --features mpi` (release). Output and logs in results/bench_dist/<time>/.
set -euo pipefail
cd "$(dirname "$0")/.."

ranks="$(nproc 2>/dev/null || echo 2)" steps=3 precision=fp32 extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) ranks="${2:?--ranks needs a number}"; shift 2 ;;
    --steps) steps="${2:?--steps needs a number}"; shift 2 ;;
    --precision) precision="${2:?--precision needs fp32 or bf16}"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench_dist.sh: unknown argument \`$1\` (see --help)" >&2; exit 2 ;;
  esac
done
for v in "$ranks" "$steps"; do
  case "$v" in ''|*[!0-9]*|0) echo "bench_dist.sh: --ranks and --steps must be positive integers, got \`$v\`" >&2; exit 2 ;; esac
done
case "$precision" in fp32|bf16) ;; *) echo "bench_dist.sh: --precision must be fp32 or bf16, got \`$precision\`" >&2; exit 2 ;; esac
command -v mpirun >/dev/null || { echo "bench_dist.sh: mpirun not found (apt-get install openmpi-bin libopenmpi-dev libclang-dev)" >&2; exit 1; }

gguf="$(scripts/fetch_smollm2.sh)"
echo "building main_ppo --features mpi (release) ..." >&2
cargo build --release --locked --quiet --features mpi --bin main_ppo
out="results/bench_dist/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
rev="$(git describe --always --dirty 2>/dev/null || echo unknown)"

ovr=(
  data.train_files=data/gsm8k/train.parquet data.val_files=data/gsm8k/test.parquet
  data.train_batch_size=8 data.max_prompt_length=512 data.max_response_length=128
  "actor_rollout_ref.model.path=$gguf" actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=8 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
  actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  algorithm.adv_estimator=grpo algorithm.use_kl_in_reward=False
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable
  "trainer.total_training_steps=$steps" "trainer.logger=['console','file']"
  trainer.project_name=bench_dist trainer.device=cpu trainer.seed=1
)
if [ "$precision" = bf16 ]; then
  ovr+=(actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16 actor_rollout_ref.rollout.dtype=bfloat16)
fi
ovr+=("${extra[@]+"${extra[@]}"}")

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
echo "1 process x $ranks threads ..." >&2
RAYON_NUM_THREADS="$ranks" VERL_FILE_LOGGER_PATH="$out/one.jsonl" target/release/main_ppo \
  "${ovr[@]}" trainer.experiment_name=one "trainer.default_local_dir=$out/ckpt_one" >"$out/one.log" 2>&1
echo "$ranks ranks x 1 thread ..." >&2
mpirun --oversubscribe --bind-to none -np "$ranks" -x RAYON_NUM_THREADS=1 \
  -x VERL_FILE_LOGGER_PATH="$out/ranks.jsonl" target/release/main_ppo \
  "${ovr[@]}" trainer.experiment_name=ranks "trainer.default_local_dir=$out/ckpt_ranks" >"$out/ranks.log" 2>&1

python3 - "$out" "$ranks" "$rev" "$precision" <<'EOF' | tee "$out/results.md"
import json, sys
out, ranks, rev, precision = sys.argv[1:]
def load(name):
    steps = {}
    for line in open(f"{out}/{name}.jsonl"):
        r = json.loads(line)
        steps.setdefault(r["step"], {}).update(r["data"])
    return steps
one, many = load("one"), load("ranks")
keys = ["timing_s/step", "timing_s/gen", "timing_s/update_actor", "response_length/mean",
        "critic/score/mean", "actor/pg_loss"]
print(f"tree {rev}, {precision}: 1 process x {ranks} threads vs {ranks} ranks x 1 thread\n")
print("| step | metric | 1 process | ranks |")
print("|---|---|---|---|")
for s in sorted(one):
    for k in keys:
        a, b = one[s].get(k), many.get(s, {}).get(k)
        if a is not None and b is not None:
            print(f"| {s} | {k} | {a:.4g} | {b:.4g} |")
worst = 0.0
for s in one:
    for k, a in one[s].items():
        b = many.get(s, {}).get(k)
        if b is None or k.startswith(("timing", "perf/")) or not isinstance(a, (int, float)):
            continue
        worst = max(worst, abs(a - b) / max(abs(a), abs(b), 1e-8))
print(f"\nlargest relative difference of a non-timing metric: {worst:.3g}")
for name, d in (("1 process", one), ("ranks", many)):
    later = [d[s]["timing_s/step"] for s in sorted(d) if s >= 2]
    if later:
        print(f"{name}: mean timing_s/step of steps 2-{max(d)}: {sum(later) / len(later):.1f} s")
EOF
echo "written: $out/results.md" >&2
