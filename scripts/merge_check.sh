#!/usr/bin/env bash
# `main_ppo merge` against transformers: trains LoRA adapters on SmolLM2-135M for two steps
# (the LoRA quickstart config, f32 products, a larger learning rate so the adapters move),
# merges the checkpoint into one HF folder, then loads that folder with transformers and
# compares its greedy generations on 4 GSM8K prompts with `main_ppo generate` on base + adapter
# (f32). Prints both and exits 1 when a generation differs.
# Usage: scripts/merge_check.sh [PYTHON]   (a Python with torch and transformers; default the
#        venv scripts/verl_algo_fixtures.py uses, ~/.cache/main_ppo/verl-fixtures-venv)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-$HOME/.cache/main_ppo/verl-fixtures-venv/bin/python}"
"$py" -c "import torch, transformers" || {
  echo "merge_check.sh: $py lacks torch or transformers" >&2
  exit 2
}
model="$(scripts/fetch_smollm2.sh)"
cargo build --release --locked --quiet
bin=target/release/main_ppo
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$bin" --config configs/gsm8k_grpo_smollm2_lora.yaml \
  actor_rollout_ref.model.path="$model" \
  actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32 \
  actor_rollout_ref.rollout.dtype=float32 \
  actor_rollout_ref.actor.optim.lr=1e-3 actor_rollout_ref.actor.entropy_coeff=0.01 \
  data.max_response_length=64 trainer.total_training_steps=2 trainer.save_freq=2 \
  trainer.val_before_train=False trainer.test_freq=-1 "trainer.logger=[console]" \
  trainer.default_local_dir="$work/ckpt" > "$work/train.log" 2>&1 || {
  tail -n 20 "$work/train.log" >&2
  exit 1
}
"$bin" merge --local_dir "$work/ckpt/global_step_2" --target_dir "$work/merged" --base "$model"
# Four GSM8K test prompts, main_ppo's chat template; 32 greedy tokens each, f32.
"$bin" generate --input data/gsm8k/test.parquet --output "$work/adapter.jsonl" \
  data.val_max_samples=4 actor_rollout_ref.model.path="$model" \
  actor_rollout_ref.model.lora_adapter_path="$work/ckpt/global_step_2/actor/lora_adapter" \
  actor_rollout_ref.rollout.temperature=0 data.max_response_length=32 \
  actor_rollout_ref.rollout.dtype=float32 > "$work/generate.log" 2>&1 || {
  tail -n 20 "$work/generate.log" >&2
  exit 1
}
"$py" - "$work/merged" "$work/adapter.jsonl" <<'PY'
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
merged, rows = sys.argv[1], [json.loads(l) for l in open(sys.argv[2])]
tok = AutoTokenizer.from_pretrained(merged)
model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
model.eval()
same = 0
for i, r in enumerate(rows):
    ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, return_tensors="pt")
    if not torch.is_tensor(ids):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    ours = r["responses"][0].replace("<|im_end|>", "")
    ok = text.strip() == ours.strip()
    same += ok
    print(f"prompt {i}: {'same' if ok else 'DIFFERENT'}\n  transformers: {text!r}\n  main_ppo:     {ours!r}")
print(f"{same} of {len(rows)} greedy generations identical (transformers on the merged folder vs main_ppo generate on base + adapter)")
sys.exit(0 if same == len(rows) else 1)
PY
