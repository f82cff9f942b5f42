#!/usr/bin/env python3
"""Reference numbers for `main_ppo sft`: verl's masked SFT loss and its gradients, from
transformers and PyTorch autograd in float64, on a tiny Qwen2 model with a multi-turn tool
conversation.

Writes tests/fixtures/sft_tool/:
  config.json, model.safetensors   a tiny random Qwen2 (float64), written by save_pretrained
  tokenizer.json, tokenizer_config.json, generation_config.json
                                   the byte-level test tokenizer with Qwen2.5's chat template
                                   (tools, tool calls, tool turns)
  data.jsonl                       the conversations (verl's `messages` / `tools` columns)
  reference.json                   per row: input_ids, loss_mask (verl's MultiTurnSFTDataset
                                   rules, on transformers' apply_chat_template), the trained
                                   spans decoded; the loss and batch_num_tokens
  grads.safetensors                d(loss)/d(parameter) for every parameter (float64)

The dataset rules are ported from verl 1dda039 (`verl/utils/dataset/multiturn_sft_dataset.py`,
`verl/utils/tokenizer/chat_template.py`): each message rendered alone (tools with the first),
the default system prompt cut from every later non-system message, an assistant message's
tokens trained except its generation-prompt header; the concatenation must equal the whole
conversation rendered at once. The loss is verl's `sft_loss` (`verl/workers/utils/losses.py`)
in its no-padding form: the rows packed end to end, log p of each next token (labels rolled
left by one), the loss mask rolled left by one, -masked_sum / batch_num_tokens (the unrolled
mask's sum over the batch). Each row's forward runs alone (as verl's varlen attention does).

Run with the pinned reference venv (torch 2.15, transformers 5.24):
    ~/.cache/main_ppo/bench-venv/bin/python scripts/sft_reference.py
The Rust test (src/trainer/tests_sft.rs) reads the fixtures; CI does not run this script.
"""
import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from family_reference import exact_f64, spread

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "sft_tool"
TOKENIZER = ROOT / "tests" / "fixtures" / "byte_tokenizer"

# Qwen2.5-Instruct's chat template (tools in the system turn, hermes <tool_call> blocks, tool
# results as <tool_response> in a user turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 48/2"}},
            "required": ["expression"],
        },
    },
}


def call(expr):
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}


ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "Half of 48?"},
            {"role": "assistant", "content": "", "tool_calls": [call("48/2")]},
            {"role": "tool", "content": "24"},
            {"role": "assistant", "content": "It is 24.\n#### 24"},
        ],
        "tools": [CALCULATOR],
    },
    {
        "messages": [
            {"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": "#### 5"},
            {"role": "user", "content": "and times 4?"},
            {"role": "assistant", "content": "#### 20"},
        ],
    },
]


def ids_of(tok, messages, tools=None, gen=False):
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, tokenize=True, return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) else out)


def verl_tokens(tok, messages, tools):
    """verl's MultiTurnSFTDataset.__getitem__ (text rows, no padding, no truncation)."""
    empty = [{"role": "user", "content": ""}]
    t1, t2 = ids_of(tok, empty), ids_of(tok, empty * 2)
    system_prompt = t1[: -(len(t2) - len(t1))]
    generation_prompt = ids_of(tok, empty, gen=True)[len(t1):]
    ids, mask = [], []
    for i, m in enumerate(messages):
        piece = ids_of(tok, [m], tools if i == 0 else None)
        if i != 0 and m["role"] != "system":
            piece = piece[len(system_prompt):]
        if m["role"] == "assistant":
            mk = [0] * len(generation_prompt) + [1] * (len(piece) - len(generation_prompt))
        else:
            mk = [0] * len(piece)
        ids += piece
        mask += mk
    assert ids == ids_of(tok, messages, tools), "per-message tokens differ from the whole rendering"
    return ids, mask


def spans(tok, ids, mask):
    """The trained tokens as text, one string per run of mask 1."""
    out, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def main():
    exact_f64()
    OUT.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "generation_config.json"):
        shutil.copy(TOKENIZER / f, OUT / f)
    tcfg = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = QWEN25_TEMPLATE
    (OUT / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (OUT / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tok = transformers.AutoTokenizer.from_pretrained(OUT)

    cfg = transformers.Qwen2Config(
        vocab_size=259, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=258, pad_token_id=256,
    )
    torch.manual_seed(2024)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float64).eval()
    spread(model, 55)
    model.save_pretrained(OUT, safe_serialization=True)

    rows = [verl_tokens(tok, r["messages"], r.get("tools")) for r in ROWS]
    # sft_loss, no padding: rows packed, labels and loss mask rolled left by one.
    log_probs = []
    for ids, _ in rows:
        logits = model(torch.tensor([ids])).logits[0]  # [len, vocab]
        log_probs.append(torch.log_softmax(logits, -1))
    packed_ids = torch.tensor([t for ids, _ in rows for t in ids])
    labels = torch.roll(packed_ids, -1)
    lp = torch.cat(log_probs).gather(-1, labels[:, None])[:, 0]
    loss_mask = torch.tensor([m for _, mask in rows for m in mask], dtype=torch.float64)
    batch_num_tokens = loss_mask.sum()
    loss = -(lp * torch.roll(loss_mask, -1)).sum() / batch_num_tokens
    loss.backward()
    grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
    save_file(grads, OUT / "grads.safetensors")
    ref = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "rows": [
            {"input_ids": ids, "loss_mask": mask, "trained": spans(tok, ids, mask)}
            for ids, mask in rows
        ],
        "batch_num_tokens": float(batch_num_tokens),
        "loss": float(loss.detach()),
    }
    (OUT / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"loss {float(loss):.12f} over {int(batch_num_tokens)} tokens; rows of {[len(r[0]) for r in rows]} tokens -> {OUT}")
    for r in ref["rows"]:
        print(r["trained"])


if __name__ == "__main__":
    main()
