#!/usr/bin/env python3
"""GSM8K's solutions as multi-turn calculator conversations for `main_ppo sft`, in the shape of
verl's `examples/data_preprocess/gsm8k_multiturn_sft.py` (a `messages` column, plus `tools`).

Every `<<48/2=24>>` annotation of a solution becomes a calculator call and its result: the
assistant writes the solution up to the annotation and calls `calculator` with the expression,
a tool turn answers with the value, and the next assistant turn goes on from the result
(`24 clips in May. ...`), until the last turn ends in `#### <answer>`. The user turn is the
question with verl's instruction. The tool is `configs/tool_config/calculator.py`'s (its
schema below is the one `@function_tool` infers from it), the one the GSM8K tool-agent GRPO
recipe offers at rollout with `multi_turn.function_tool_path`, so SFT and RL see the same tool.
Rows whose annotation the calculator does not reproduce (GSM8K has a few arithmetic slips, and
annotations that are not arithmetic) are dropped and counted.

Templates that render `tools` and `tool_calls` (Qwen2.5, Qwen3) get them as columns. For
templates that render neither (SmolLM2, Gemma 3), `--calls-in-content` writes each call into the
assistant text in the hermes format the agent loop parses (`<tool_call>\\n{"name": ...,
"arguments": {...}}\\n</tool_call>`) and puts the tool schema and the call format in a system
message, as `preprocess_gsm8k_tool_agent.py --tools-in-system` does for RL prompts.

Held-out rows come from the test split (`test.parquet`), converted the same way.

`--rl-out DIR` also writes the RL prompts of the same recipe (`DIR/{train,test}.parquet`, every
row of both splits, in verl's order): the conversation's opening (the system message with the
tool when `--calls-in-content`, the user turn) as `prompt`, `reward_model.ground_truth` for
verl's gsm8k scorer, `agent_name: tool_agent`. The tool-agent GRPO recipe
(`configs/gsm8k_tool_grpo_smollm2.yaml`) trains on them and the tool quickstart evaluates on
them, so a model sees at rollout exactly the opening it saw in SFT.

    python3 scripts/preprocess_gsm8k_tool_sft.py --src ../shared/data/gsm8k --out ~/data/gsm8k_tool_sft [--calls-in-content] [--rl-out ~/data/gsm8k_tool_calc]
"""
import argparse
import json
import os
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tool_config"))
try:
    from calculator import evaluate  # noqa: E402
except ImportError:  # verl.tools is provided by main_ppo's tool workers only
    import types

    sys.modules.setdefault("verl", types.ModuleType("verl"))
    sys.modules.setdefault("verl.tools", types.ModuleType("verl.tools"))
    ft = types.ModuleType("verl.tools.function_tool")
    ft.function_tool = lambda *a, **k: (lambda f: f)
    sys.modules["verl.tools.function_tool"] = ft
    from calculator import evaluate  # noqa: E402

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression (+, -, *, /, parentheses) and returns its value.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The arithmetic expression to evaluate, e.g. 48/2."}
            },
            "required": ["expression"],
        },
    },
}
SYSTEM_TOOLS = (
    "You can use a calculator.\n\n# Tools\n\nThese functions are available (JSON schemas):\n<tools>\n"
    + json.dumps(CALCULATOR, ensure_ascii=False)
    + "\n</tools>\n\nTo call one, write its name and arguments as a JSON object between "
    + "<tool_call> and </tool_call>:\n<tool_call>\n"
    + '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
)
ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]*)>>")


def same_number(a, b):
    try:
        return abs(float(a) - float(b.replace(",", ""))) <= 1e-6 * max(1.0, abs(float(a)))
    except ValueError:
        return False


def conversation(question, answer, in_content):
    """The messages of one solution, or None when an annotation does not compute."""
    messages = []
    if in_content:
        messages.append({"role": "system", "content": SYSTEM_TOOLS})
    messages.append({"role": "user", "content": question + " " + INSTRUCTION})
    pos = 0
    for m in ANNOTATION.finditer(answer):
        expr, written = m.group(1).strip(), m.group(2).strip()
        try:
            value = evaluate(expr)
        except Exception:
            return None
        if not same_number(value, written):
            return None
        text = answer[pos : m.start()].rstrip()
        call = {"name": "calculator", "arguments": {"expression": expr}}
        if in_content:
            body = json.dumps(call, ensure_ascii=False)
            content = (text + "\n" if text else "") + "<tool_call>\n" + body + "\n</tool_call>"
            messages.append({"role": "assistant", "content": content})
        else:
            messages.append({"role": "assistant", "content": text, "tool_calls": [{"type": "function", "function": call}]})
        messages.append({"role": "tool", "content": value})
        pos = m.end()
    messages.append({"role": "assistant", "content": answer[pos:].strip()})
    return messages


def solution_of(answer):
    m = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if m is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return m.group(1).replace(",", "")


def rl_prompts(rows, split, in_content):
    """verl's RL rows for the tool agent loop: the SFT conversation's opening as the prompt."""
    out = []
    for i, row in enumerate(rows):
        info = row.get("extra_info") or {}
        question, answer = info.get("question"), info.get("answer")
        if question is None or answer is None:
            raise ValueError(f"{split} row {i}: extra_info has no raw question/answer")
        prompt = [{"role": "system", "content": SYSTEM_TOOLS}] if in_content else []
        prompt.append({"role": "user", "content": question + " " + INSTRUCTION})
        out.append(
            {
                "data_source": "openai/gsm8k",
                "agent_name": "tool_agent",
                "prompt": prompt,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": solution_of(answer)},
                "extra_info": {"split": split, "index": i, "question": question, "answer": answer},
            }
        )
    return out


def convert(rows, split, in_content):
    out, dropped = [], 0
    for i, row in enumerate(rows):
        info = row.get("extra_info") or {}
        question, answer = info.get("question"), info.get("answer")
        if question is None or answer is None:
            raise ValueError(f"{split} row {i}: extra_info has no raw question/answer")
        messages = conversation(question, answer, in_content)
        if messages is None:
            dropped += 1
            continue
        rec = {"messages": messages, "extra_info": {"split": split, "index": i}}
        if not in_content:
            rec["tools"] = [CALCULATOR]
        out.append(rec)
    return out, dropped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="../shared/data/gsm8k", help="verl's GSM8K parquet (extra_info keeps question and answer)")
    ap.add_argument("--out", default=os.path.expanduser("~/data/gsm8k_tool_sft"))
    ap.add_argument("--calls-in-content", action="store_true", help="for chat templates that render no tools or tool_calls")
    ap.add_argument("--rl-out", help="also write the RL prompts (the conversations' openings) here")
    args = ap.parse_args()
    out_dir = os.path.expanduser(args.out)
    os.makedirs(out_dir, exist_ok=True)
    for split in ("train", "test"):
        rows = pq.read_table(os.path.join(args.src, f"{split}.parquet")).to_pylist()
        out, dropped = convert(rows, split, args.calls_in_content)
        # Messages as JSON text per field would lose the list shape: write them as lists of
        # structs; tool_calls is absent from most turns, so every message gets the key.
        if not args.calls_in_content:
            for r in out:
                for m in r["messages"]:
                    m.setdefault("tool_calls", None)
        path = os.path.join(out_dir, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(out), path)
        calls = sum(sum(m["role"] == "tool" for m in r["messages"]) for r in out)
        print(f"{path}: {len(out)} conversations, {calls} calculator calls ({dropped} rows dropped: an annotation the calculator does not reproduce)")
        if args.rl_out:
            rl_dir = os.path.expanduser(args.rl_out)
            os.makedirs(rl_dir, exist_ok=True)
            rl = rl_prompts(rows, split, args.calls_in_content)
            path = os.path.join(rl_dir, f"{split}.parquet")
            pq.write_table(pa.Table.from_pylist(rl), path)
            print(f"{path}: {len(rl)} RL prompts")


if __name__ == "__main__":
    main()
