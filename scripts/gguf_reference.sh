#!/usr/bin/env bash
# GGUF files of the hybrid chat fixtures written by llama.cpp's own converter, for the tests
# that read GGUF (src/weights/family_tests.rs, tests/families): for each of qwen3_5, qwen3_5_moe
# and qwen3_next, tests/fixtures/families/<name>/chat/model-f32.gguf from that directory
# (transformers' float64 checkpoint, written by scripts/family_reference.py), tensors in float32.
#
# The converter is llama.cpp's convert_hf_to_gguf.py (with its conversion/ package and gguf-py)
# as vendored in the llama-cpp-python 0.3.36 sdist on PyPI (checked against PyPI's SHA-256),
# run with the pinned reference venv (scripts/bench/requirements.txt). One change from running
# it by hand: the chat fixtures' toy byte-level tokenizer is not among the tokenizers whose
# pre-tokenizer the converter recognises by hash, and it is named `default` (GPT-2's split;
# with one token per byte and no merges, any split tokenizes alike).
# CI does not run this script; the GGUF files are committed.
# Usage: scripts/gguf_reference.sh [PYTHON]   (default ~/.cache/main_ppo/bench-venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${1:-$HOME/.cache/main_ppo/bench-venv/bin/python}"
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
url="https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-$version.tar.gz"
curl -sfL -o "$tmp/src.tar.gz" "$url"
echo "$sha256  $tmp/src.tar.gz" | sha256sum -c - >&2
tar xzf "$tmp/src.tar.gz" -C "$tmp" "llama_cpp_python-$version/vendor/llama.cpp"
llama="$tmp/llama_cpp_python-$version/vendor/llama.cpp"
cat > "$tmp/convert.py" <<'PY'
import runpy, sys
from pathlib import Path
llama = Path(sys.argv[1])
sys.argv = [str(llama / "convert_hf_to_gguf.py")] + sys.argv[2:]
sys.path[:0] = [str(llama / "gguf-py"), str(llama)]
from conversion import base
recognised = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return recognised(self, tokenizer)
    except NotImplementedError:
        return "default"
base.TextModel.get_vocab_base_pre = pre
runpy.run_path(sys.argv[0], run_name="__main__")
PY
for name in qwen3_5 qwen3_5_moe qwen3_next; do
  dir="tests/fixtures/families/$name/chat"
  # The converter reads every file of the directory it is given: a copy without the GGUF.
  mkdir -p "$tmp/$name"
  cp "$dir"/config.json "$dir"/model.safetensors "$dir"/tokenizer.json "$dir"/tokenizer_config.json "$dir"/generation_config.json "$tmp/$name/"
  "$python" "$tmp/convert.py" "$llama" "$tmp/$name" --no-mtp --outtype f32 --outfile "$dir/model-f32.gguf" 2>&1 | grep -E "^INFO:hf-to-gguf:Model successfully|Error" >&2
done
