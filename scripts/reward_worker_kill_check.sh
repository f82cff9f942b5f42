#!/usr/bin/env bash
# A reward worker killed from outside while idle costs no sample: runs the verl tutorial's
# command line at CPU size (the fixture's run_cpu_sized.sh: PPO with a critic, GSM8K, the
# tutorial's custom_rewards.py, SmolLM2-135M-Instruct, 12 steps) while a loop here kills one
# reward worker (a python3 child of main_ppo running the bridge) with SIGKILL after every logged
# step but the last, that is while the next step generates and the workers are idle. Reports main_ppo's exit
# status (0 passes: each killed worker was replaced and the request it never received re-sent),
# the kills, the replacements main_ppo logged, and any worker or process of one left running
# afterwards; exits with main_ppo's status (1 when something was left running).
# Usage: scripts/reward_worker_kill_check.sh [FIXTURE_DIR [OVERRIDE ...]]
#   FIXTURE_DIR: default $ARTICLE_REWARD_FIXTURE, else ../shared/fixtures/article_reward next to
#   the repository; overrides go to main_ppo (trainer.total_training_steps=3 for a short run).
#   WORK_DIR (environment): where the run writes (default: a fresh temporary folder).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fixture="${1:-${ARTICLE_REWARD_FIXTURE:-$root/../shared/fixtures/article_reward}}"
if (( $# > 0 )); then shift; fi
if [[ ! -f "$fixture/run_cpu_sized.sh" ]]; then
  echo "reward_worker_kill_check.sh: no run_cpu_sized.sh in $fixture (pass the fixture folder as the first argument or set ARTICLE_REWARD_FIXTURE)" >&2
  exit 2
fi
fixture="$(cd "$fixture" && pwd)"
cd "$root"
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
bin="$root/target/release/main_ppo"
work="${WORK_DIR:-$(mktemp -d)}"
mkdir -p "$work"
echo "running the tutorial's command line in $work (console: $work/stdout.log, log: $work/stderr.log)"

(cd "$work" && exec bash "$fixture/run_cpu_sized.sh" "$bin" "$model" "$root/data/gsm8k" "$@" \
  > "$work/stdout.log" 2> "$work/stderr.log") &
runner=$!

# main_ppo is the fixture script's child (or the script itself, where bash runs its last
# command in place).
main=""
until [[ -n "$main" ]]; do
  kill -0 "$runner" 2>/dev/null || break
  if [[ "$(cat "/proc/$runner/comm" 2>/dev/null)" == main_ppo ]]; then
    main=$runner
  else
    main="$(pgrep -P "$runner" -x main_ppo || true)"
  fi
  sleep 0.2
done

workers() { # the reward workers now running under main_ppo
  [[ -n "$main" ]] && pgrep -P "$main" -f "main_ppo reward worker" || true
}

seen=() killed=() step=-1
while kill -0 "$runner" 2>/dev/null; do
  mapfile -t now < <(workers)
  seen+=("${now[@]}")
  # The newest logged step, and the last one from main_ppo's "training: steps M..N of N".
  newest="$(grep '^step:' "$work/stdout.log" | tail -n 1 | sed 's/^step:\([0-9]*\).*/\1/' || true)"
  last="$(grep -o 'training: steps [0-9]*\.\.[0-9]*' "$work/stderr.log" | grep -o '[0-9]*$' || true)"
  if [[ -n "$newest" ]] && (( newest != step )); then
    step=$newest
    if (( ${#now[@]} > 0 )) && [[ -n "$last" ]] && (( step < last )); then
      victim="${now[0]}"
      # The worker's process group, to check afterwards that none of it outlived main_ppo.
      seen+=($(pgrep -g "$victim" || true))
      if kill -9 "$victim" 2>/dev/null; then
        killed+=("$victim")
        echo "  after step $step: killed reward worker $victim"
      fi
    fi
  fi
  sleep 0.5
done
status=0
wait "$runner" || status=$?

echo "main_ppo exited with status $status after $(grep -c '^step:' "$work/stdout.log" || true) logged steps;" \
  "${#killed[@]} idle reward worker(s) killed"
replaced="$(grep -c 'died while idle' "$work/stderr.log" || true)"
echo "replacements main_ppo logged (a worker that died while idle, its request re-sent): $replaced"
grep -E 'ERROR|error:|died' "$work/stderr.log" | grep -v 'died while idle' | tail -n 5 || true
left=()
for pid in $(printf '%s\n' "${seen[@]}" | sort -u); do
  if [[ -e "/proc/$pid" ]] && ! grep -q ') Z ' "/proc/$pid/stat" 2>/dev/null; then
    left+=("$pid")
  fi
done
if (( ${#left[@]} > 0 )); then
  echo "left running after main_ppo exited: ${left[*]}" >&2
  (( status == 0 )) && status=1
fi
if (( status != 0 )); then
  echo "--- last lines of $work/stderr.log" >&2
  tail -n 20 "$work/stderr.log" >&2
fi
exit "$status"
