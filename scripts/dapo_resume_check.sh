#!/usr/bin/env bash
# DAPO's dynamic sampling survives a SIGKILL: SmolLM2-135M-Instruct, the DAPO recipe
# (configs/gsm8k_dapo_smollm2.yaml) shortened to 4 steps of 4 groups x 4 responses of at most
# 32 tokens, a checkpoint every step, and a reward whose groups often agree (the parity of the
# response's word count: a group of 4 agrees 1 time in 8), so steps draw extra batches.
#   run A: 4 steps straight;
#   run B: the same command, killed with SIGKILL once step 2's checkpoint is in place, then the
#          same command again, which resumes and finishes.
# Passes when B's step-4 checkpoint (adapters, optimizer state, trainer state) is byte-identical
# to A's and every logged step's metrics but times and memory are equal. Prints each step's
# generation batches and dropped groups. Usage: scripts/dapo_resume_check.sh [WORK_DIR]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
bin="$root/target/release/main_ppo"
work="${1:-$(mktemp -d)}"
mkdir -p "$work/a" "$work/b"
cat > "$work/reward.py" <<'EOF'
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str.split()) % 2)
EOF
args=(
  --config "$root/configs/gsm8k_dapo_smollm2.yaml"
  "actor_rollout_ref.model.path=$model"
  "data.train_files=$root/data/gsm8k/train.parquet"
  "data.val_files=$root/data/gsm8k/test.parquet"
  data.max_response_length=32
  actor_rollout_ref.rollout.n=4
  data.gen_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  algorithm.filter_groups.max_num_gen_batches=0
  reward.reward_kwargs.max_resp_len=32
  reward.reward_kwargs.overlong_buffer_cfg.len=8
  "reward.sources=[{name: parity, type: python, path: $work/reward.py, function: compute_score}]"
  trainer.total_training_steps=4
  trainer.save_freq=1
  trainer.test_freq=-1
  trainer.val_before_train=False
  "trainer.logger=[file]"
)
ckpt=checkpoints/main_ppo_quickstart/gsm8k_dapo_smollm2
log=main_ppo_quickstart/gsm8k_dapo_smollm2.jsonl

echo "run A: 4 steps straight in $work/a"
(cd "$work/a" && "$bin" "${args[@]}" 2> "$work/a.log")

echo "run B: killed after step 2's checkpoint, then resumed, in $work/b"
(cd "$work/b" && exec "$bin" "${args[@]}" 2> "$work/b1.log") &
pid=$!
until [[ -f "$work/b/$ckpt/latest_checkpointed_iteration.txt" ]] \
  && [[ "$(cat "$work/b/$ckpt/latest_checkpointed_iteration.txt")" -ge 2 ]]; do
  kill -0 "$pid" 2>/dev/null || { echo "run B ended before step 2" >&2; exit 1; }
  sleep 0.2
done
kill -9 "$pid"
wait "$pid" 2>/dev/null || true
echo "  killed after checkpoint $(cat "$work/b/$ckpt/latest_checkpointed_iteration.txt");" \
  "steps logged before the kill: $(wc -l < "$work/b/$log")"
(cd "$work/b" && "$bin" "${args[@]}" 2> "$work/b2.log")
grep -o "resumed from .*" "$work/b2.log" | head -n 1 || true

python3 - "$work" "$ckpt" "$log" <<'EOF'
import hashlib, json, pathlib, sys
work, ckpt, log = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def files(run):
    d = work / run / ckpt / "global_step_4"
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}
a, b = files("a"), files("b")
assert a and a.keys() == b.keys(), (sorted(a), sorted(b))
differ = [k for k in a if a[k] != b[k]]
assert not differ, f"step-4 checkpoint files differ: {differ}"
print(f"step-4 checkpoint: {len(a)} files byte-identical")
def steps(run):
    out = {}
    for line in (work / run / log).read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row["data"].items()
                            if not k.startswith(("timing", "perf/"))}
    return out
sa, sb = steps("a"), steps("b")
assert sorted(sa) == [1, 2, 3, 4] and sorted(sb) == [1, 2, 3, 4], (sorted(sa), sorted(sb))
for s in sa:
    assert sa[s] == sb[s], f"step {s} metrics differ: " + str(
        {k: (sa[s].get(k), sb[s].get(k)) for k in sa[s].keys() | sb[s].keys() if sa[s].get(k) != sb[s].get(k)})
    m = sa[s]
    print(f"step {s}: {m['train/num_gen_batches']:.0f} generation batch(es), "
          f"{m['training/filter_groups/evicted_samples']:.0f} group(s) dropped, "
          f"{m['training/filter_groups/discarded_surplus_samples']:.0f} surplus, "
          f"score {m['critic/score/mean']:.3f}, pg_loss {m['actor/pg_loss']:.5f}")
print("metrics of all 4 steps equal (times and memory aside): resume is exact")
EOF
