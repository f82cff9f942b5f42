#!/usr/bin/env python3
"""transformers' tokens and greedy generations of Gemma 3 270M on GSM8K prompts, for the
parity test of our Gemma 3 path (tests/integration.rs `gemma3_*`).

Loads the GGUF that scripts/fetch_gemma3.sh assembles with transformers' own GGUF support
(dequantised to float32, tokenizer rebuilt from the file's vocabulary), renders the first 24
GSM8K test prompts as a base model reads them ("<bos>Question: ...\\nAnswer:"), and records for
each: the prompt's token ids (add_special_tokens=False on the rendered text), and 32 greedy tokens
with, at each step, the gap between the two best logits (a step whose gap is within rounding may
pick the other token on another implementation).

Run with the pinned reference venv (scripts/bench/requirements.txt):
  ~/.cache/main_ppo/bench-venv/bin/python scripts/gemma3_reference.py \\
      "$(scripts/fetch_gemma3.sh)" tests/fixtures/gemma3_270m_greedy.json
CI does not run it; the JSON is committed.
"""
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers

NEW = 32
PROMPTS = 24
TEMPLATE = "<bos>Question: {q}\nAnswer:"


def main():
    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    root = Path(__file__).resolve().parent.parent
    rows = pq.read_table(root / "data/gsm8k/test.parquet").slice(0, PROMPTS).to_pylist()
    cases = []
    with torch.no_grad():
        for r in rows:
            text = TEMPLATE.format(q=r["extra_info"]["question"])
            ids = tok(text, add_special_tokens=False)["input_ids"]
            seq, steps = list(ids), []
            cache = None
            feed = torch.tensor([seq])
            for _ in range(NEW):
                o = model(feed, past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                logits = o.logits[0, -1].double()
                top2 = torch.topk(logits, 2)
                t = int(top2.indices[0])
                steps.append({"token": t, "gap": float(top2.values[0] - top2.values[1])})
                seq.append(t)
                feed = torch.tensor([[t]])
            cases.append({"text": text, "prompt_ids": ids, "greedy": steps})
            print(f"{len(cases)}/{PROMPTS}: {tok.decode([s['token'] for s in steps])!r}", flush=True)
    out.write_text(json.dumps({
        "model": gguf.name,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "template": TEMPLATE,
        "new_tokens": NEW,
        "cases": cases,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
