#!/usr/bin/env bash
# The tool quickstart: SmolLM2-135M-Instruct learns to use a calculator on GSM8K, on this
# machine's CPU, in three stages:
#   1. SFT (`main_ppo sft`, configs/gsm8k_tool_sft_smollm2.yaml) on GSM8K's training solutions
#      written as calculator conversations (scripts/preprocess_gsm8k_tool_sft.py: each
#      `<<48/2=24>>` annotation a hermes `<tool_call>` and a tool turn with the value);
#   2. tool-agent GRPO (configs/gsm8k_tool_grpo_smollm2.yaml) from the SFT checkpoint, the
#      calculator (configs/tool_config/calculator.py) run by the agent loop at every call;
#   3. the start model, the SFT checkpoint and the RL checkpoint answer the same held-out GSM8K
#      test prompts greedily (`trainer.val_only`, data.val_max_samples rows), with the
#      calculator offered and run, and on GSM8K's plain prompts without it. One line each:
#      responses that call the calculator, call blocks that parse and run, strict accuracy
#      (verl's gsm8k score without format credit), mean turns; written to
#      main_ppo_tool_quickstart/summary.tsv and charted (`main_ppo plot`) with both runs.
# Fetches the model when missing, makes the data once (pyarrow in a cached venv), builds the
# release binary, runs from the repository root. A second run resumes each stage from its
# newest checkpoint (a finished stage only re-saves nothing and goes on). Environment:
#   TOOL_QUICKSTART_STAGES   which stages to run (default "sft rl eval")
#   TOOL_QUICKSTART_EVAL_ROWS  held-out prompts per evaluation (default 128)
#   SFT_ARGS / RL_ARGS       extra overrides for each stage (space-separated key=value)
set -euo pipefail
cd "$(dirname "$0")/.."
stages="${TOOL_QUICKSTART_STAGES:-sft rl eval}"
rows="${TOOL_QUICKSTART_EVAL_ROWS:-128}"
read -r -a sft_args <<<"${SFT_ARGS:-}"
read -r -a rl_args <<<"${RL_ARGS:-}"
sft_config=configs/gsm8k_tool_sft_smollm2.yaml
rl_config=configs/gsm8k_tool_grpo_smollm2.yaml
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
bin="${CARGO_TARGET_DIR:-target}/release/main_ppo"
out=main_ppo_tool_quickstart
mkdir -p "$out"
say() { echo "[tool quickstart $(date -u +%H:%M:%S)] $*"; }

# The data: SFT conversations and the RL prompts of the same recipe (gitignored, made once).
if [[ ! -f data/gsm8k_tool_calc/test.parquet || ! -f data/gsm8k_tool_sft/train.parquet ]]; then
  venv="$HOME/.cache/main_ppo/pyarrow-venv"
  if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import pyarrow' 2>/dev/null; then
    say "a venv with pyarrow for the data script: $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet 'pyarrow>=15'
  fi
  "$venv/bin/python" scripts/preprocess_gsm8k_tool_sft.py --src data/gsm8k --out data/gsm8k_tool_sft \
    --calls-in-content --rl-out data/gsm8k_tool_calc
fi

sft_root=checkpoints/main_ppo_tool_quickstart/gsm8k_tool_sft_smollm2
rl_root=checkpoints/main_ppo_tool_quickstart/gsm8k_tool_grpo_smollm2
latest() { [[ -f "$1/latest_checkpointed_iteration.txt" ]] && echo "$1/global_step_$(cat "$1/latest_checkpointed_iteration.txt")"; }
seconds() { echo $(( $(date +%s) - $1 )); }

if [[ " $stages " == *" sft "* ]]; then
  say "stage 1: SFT ($sft_config)"
  t0=$(date +%s)
  "$bin" sft --config "$sft_config" "model.path=$model" "${sft_args[@]}"
  echo "sft_seconds	$(seconds "$t0")" >"$out/sft_time.tsv"
fi
sft="$(latest "$sft_root" || true)"
if [[ " $stages " == *" rl "* ]]; then
  [[ -n "$sft" ]] || { echo "no SFT checkpoint in $sft_root: run the sft stage first" >&2; exit 1; }
  say "stage 2: tool-agent GRPO from $sft ($rl_config)"
  t0=$(date +%s)
  "$bin" --config "$rl_config" "actor_rollout_ref.model.path=$sft" "${rl_args[@]}"
  echo "rl_seconds	$(seconds "$t0")" >"$out/rl_time.tsv"
fi
rl="$(latest "$rl_root" || true)"

# One evaluation: the model of "$@" on $rows held-out prompts, greedy; prints the metrics line.
#   $1 label, $2 tools|plain, rest: model overrides.
evaluate() {
  local label="$1" mode="$2"; shift 2
  local data=(data.val_files=data/gsm8k_tool_calc/test.parquet)
  if [[ "$mode" == plain ]]; then
    data=(data.val_files=data/gsm8k/test.parquet actor_rollout_ref.rollout.multi_turn.enable=false)
  fi
  "$bin" --config "$rl_config" trainer.val_only=true trainer.val_before_train=true \
    "data.val_max_samples=$rows" data.train_max_samples=8 "${data[@]}" \
    actor_rollout_ref.model.lora_rank=0 actor_rollout_ref.rollout.val_kwargs.temperature=0 \
    'reward.sources=[{name: gsm8k, weight: 1.0, type: builtin, scorer: gsm8k}]' \
    trainer.logger=[file] trainer.project_name=main_ppo_tool_quickstart \
    "trainer.experiment_name=eval_${label}_$mode" trainer.default_local_dir="$out/eval_scratch" \
    "$@" >"$out/eval_${label}_$mode.log" 2>&1 || { tail -n 20 "$out/eval_${label}_$mode.log" >&2; return 1; }
  local jsonl="main_ppo_tool_quickstart/eval_${label}_$mode.jsonl"
  tail -n 1 "$jsonl" | python3 -c '
import json, sys
m = json.loads(sys.stdin.read())
m = m.get("data", m)
def g(k):
    return m.get(k)
def f(v):
    return "-" if v is None else f"{v:.3f}"
parse, failed = g("val-aux/agent/tool_call_parse_ratio"), g("val-aux/agent/tool_error_ratio")
ran = None if parse is None else parse * (1.0 - (failed or 0.0))
print("\t".join([f(g("val-aux/agent/tool_call_ratio")), f(ran),
                 f(g("val-core/openai/gsm8k/acc/mean@1")), f(g("val-aux/num_turns/mean"))]))'
}

if [[ " $stages " == *" eval "* ]]; then
  say "stage 3: evaluations ($rows held-out prompts each, greedy)"
  summary="$out/summary.tsv"
  printf 'model\tprompts\tcalls calculator\tcalls parse and run\tstrict accuracy\tmean turns\n' >"$summary"
  row() { printf '%s\t%s\t%s\n' "$1" "$2" "$(evaluate "$1" "$2" "${@:3}")" >>"$summary"; }
  for mode in tools plain; do
    row start "$mode" "actor_rollout_ref.model.path=$model"
    if [[ -n "$sft" ]]; then row sft "$mode" "actor_rollout_ref.model.path=$sft"; fi
    if [[ -n "$rl" ]]; then
      row rl "$mode" "actor_rollout_ref.model.path=$sft" \
        "actor_rollout_ref.model.lora_adapter_path=$rl/actor/lora_adapter"
    fi
  done
  for run in "$out/gsm8k_tool_sft_smollm2.jsonl" "$out/gsm8k_tool_grpo_smollm2.jsonl"; do
    [[ -f "$run" ]] && echo "chart: $("$bin" plot "$run" --out "${run%.jsonl}.png")"
  done
  echo
  column -t -s $'\t' "$summary"
  cat "$out"/sft_time.tsv "$out"/rl_time.tsv 2>/dev/null || true
fi
