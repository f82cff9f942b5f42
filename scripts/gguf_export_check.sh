#!/usr/bin/env bash
# `main_ppo merge --gguf` against llama.cpp itself: writes SmolLM2-135M-Instruct (its f32 HF
# folder when one is cached, else the GGUF scripts/fetch_smollm2.sh prints) as a GGUF file
# with `main_ppo merge --gguf TYPE`, then compares llama.cpp's greedy text (llama-cpp-python
# 0.3.36, temperature 0, the file's own chat template) with `main_ppo generate` greedy on that
# same file, for N GSM8K test questions (those `generate`'s data.val_max_samples=N picks, the
# same rows on both sides). Prints both texts and equal/not per prompt; exits 1 when any differs.
#
# Measured (SmolLM2-135M-Instruct from its f32 HF folder, 8 questions, 48 tokens): f32 and f16
# files 8/8 equal; bf16 7/8 (the eighth parts after ~27 tokens at a near-tie: llama.cpp's CPU
# products round the activations to the weights' bf16, main_ppo multiplies the dequantised
# weights in f32; the same bf16 file written again as f32 gives llama.cpp 8/8 equal).
#
# llama.cpp is llama-cpp-python 0.3.36 built from its PyPI sdist (checked against PyPI's
# SHA-256, the same file scripts/gguf_reference.sh reads) into a cached venv,
# ~/.cache/main_ppo/llama-cpp-venv-0.3.36: the first run compiles it (~6 min on 2 cores here),
# later runs reuse it. `--venv-only` builds that venv and stops.
# Run by hand: no test of the suite needs this venv, and CI does not run this script.
# Usage: scripts/gguf_export_check.sh [--venv-only] [TYPE (f32|f16|bf16; default f16)] [N (default 4)]
#   MAIN_PPO_BIN: a built main_ppo to use (default: target/release/main_ppo, built here)
#   MAIN_PPO_SMOLLM2_HF: the HF folder to merge (default ~/.cache/main_ppo/models/SmolLM2-135M-Instruct-f32-hf)
#   MAIN_PPO_GGUF_SOURCE: merge this instead (anything `main_ppo merge --local_dir` reads: a
#     checkpoint's global_step_N/, LoRA adapters, ...), with MAIN_PPO_GGUF_BASE as its --base
#     when set (e.g. the tool quickstart's RL checkpoint, LoRA on the SFT checkpoint)
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-$version.tar.gz"
venv="$HOME/.cache/main_ppo/llama-cpp-venv-$version"

build_venv() {
  if "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
    return
  fi
  local tmp
  tmp="$(mktemp -d)"
  # A venv without llama_cpp is one whose build did not finish: start again.
  rm -rf "$venv"
  python3 -m venv "$venv"
  curl -sfL -o "$tmp/llama_cpp_python-$version.tar.gz" "$url"
  echo "$sha256  $tmp/llama_cpp_python-$version.tar.gz" | sha256sum -c - >&2
  # CPU only; two build jobs.
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "$venv/bin/pip" install --quiet "$tmp/llama_cpp_python-$version.tar.gz" >&2
  rm -rf "$tmp"
  "$venv/bin/python" -c "import llama_cpp" >&2
}

if [ "${1:-}" = "--venv-only" ]; then
  build_venv
  echo "$venv"
  exit 0
fi

build_venv
py="$venv/bin/python"
type="${1:-f16}"
count="${2:-4}"
tokens=48
if [ -n "${MAIN_PPO_BIN:-}" ]; then
  bin="$MAIN_PPO_BIN"
else
  cargo build --release --locked --quiet
  bin="${CARGO_TARGET_DIR:-target}/release/main_ppo"
fi
hf="${MAIN_PPO_SMOLLM2_HF:-$HOME/.cache/main_ppo/models/SmolLM2-135M-Instruct-f32-hf}"
base=()
if [ -n "${MAIN_PPO_GGUF_SOURCE:-}" ]; then
  source_model="$MAIN_PPO_GGUF_SOURCE"
  if [ -n "${MAIN_PPO_GGUF_BASE:-}" ]; then base=(--base "$MAIN_PPO_GGUF_BASE"); fi
elif [ -f "$hf/config.json" ]; then
  source_model="$hf"
else
  source_model="$(scripts/fetch_smollm2.sh)"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "source: $source_model" >&2
"$bin" merge --local_dir "$source_model" "${base[@]}" --target_dir "$work/out" --gguf "$type" >&2
gguf="$work/out/model-$type.gguf"
# main_ppo's greedy responses on the file it wrote (its chat template, f32 products).
"$bin" generate --input data/gsm8k/test.parquet --output "$work/ours.jsonl" \
  data.val_max_samples="$count" actor_rollout_ref.model.path="$gguf" \
  actor_rollout_ref.rollout.temperature=0 data.max_response_length="$tokens" \
  actor_rollout_ref.rollout.dtype=float32 > "$work/generate.log" 2>&1 || {
  tail -n 20 "$work/generate.log" >&2
  exit 1
}
# llama.cpp's: the chat template from the file's metadata rendered as llama-cpp-python's chat
# completion renders it, tokenized as it tokenizes it, then greedy decoding (temperature 0,
# no repetition penalty) until an end-of-generation token or $tokens tokens.
"$py" - "$gguf" "$work/ours.jsonl" "$tokens" <<'PY'
import json, sys
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter
path, rows, n = sys.argv[1], [json.loads(l) for l in open(sys.argv[2])], int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=2, verbose=False, logits_all=False)
meta = llm.metadata
def tok(key):
    i = meta.get(key)
    return llm._model.token_get_text(int(i)) if i is not None else ""
fmt = Jinja2ChatFormatter(
    template=meta["tokenizer.chat_template"],
    eos_token=tok("tokenizer.ggml.eos_token_id"),
    bos_token=tok("tokenizer.ggml.bos_token_id"),
)
same = 0
for i, r in enumerate(rows):
    res = fmt(messages=r["prompt"])
    ids = llm.tokenize(res.prompt.encode("utf-8"), add_bos=not res.added_special, special=True)
    out = llm.create_completion(
        ids, max_tokens=n, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0,
        repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
    )
    theirs = out["choices"][0]["text"]
    ours = r["responses"][0]
    ok = theirs.strip() == ours.strip()
    same += ok
    print(f"--- prompt {i}: {'equal' if ok else 'NOT equal'} (prompt {len(ids)} tokens)")
    print(f"llama.cpp: {theirs!r}")
    print(f"main_ppo:  {ours!r}")
    if not ok:
        k = next((j for j, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        print(f"first difference at character {k}")
print(f"{same}/{len(rows)} greedy texts equal")
sys.exit(0 if same == len(rows) else 1)
PY
