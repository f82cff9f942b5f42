#!/usr/bin/env python3
"""Makes verl's multi-turn GSM8K data (the rows verl's `examples/data_preprocess/
gsm8k_multiturn_w_tool.py` (b178a3c) and `gsm8k_tool_agent_loop.py` (1dda039) write) from
GSM8K in verl's plain parquet format (`../shared/data/gsm8k/{train,test}.parquet`, whose
`extra_info` keeps the raw question and answer), since no dataset hub is reachable here.

Each row: a system message asking for the `calc_gsm8k_reward` tool, the question with verl's
instruction, `reward_model.ground_truth`, and `extra_info.tools_kwargs.calc_gsm8k_reward.
create_kwargs.ground_truth` (what the tool's instances are created with). `--agent-loop` adds
`agent_name: tool_agent` as the 1dda039 script does; without it rows carry no agent_name (the
b178a3c script), and `rollout.multi_turn.enable=True` sends them through the tool loop.
`extra_info.interaction_kwargs` names verl's GSM8K interaction (`name: gsm8k`, which verl's
script leaves out), so the rows also serve `multi_turn.interaction_config_path=
configs/interaction_config/gsm8k_interaction_config.yaml`.

`--tools-in-system` is for models whose chat template does not render `tools` (SmolLM2,
Gemma 3; main_ppo warns about them at start): the system message then also lists the tools'
schemas (from `--tool-config`) and shows the hermes call format, which Qwen's template would
otherwise have added. verl's scripts do not do this; it changes only the prompt text.

    python3 scripts/preprocess_gsm8k_tool_agent.py --src ../shared/data/gsm8k --out ~/data/gsm8k_tool [--agent-loop] [--tools-in-system]
"""
import argparse
import os
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTION = "Let's think step by step and output the final answer after `####`."
SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)


def tools_block(tool_config):
    """The tools of a verl tool config as a system-message section: their schemas, one JSON
    object per line, and how to write a hermes call."""
    import yaml  # only this option reads the tool config

    with open(tool_config) as f:
        cfg = yaml.safe_load(f)
    schemas = [t["tool_schema"] for t in cfg.get("tools") or []]
    if not schemas:
        raise ValueError(f"{tool_config}: no tools[].tool_schema")
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "\n\n# Tools\n\nThese functions are available (JSON schemas):\n<tools>\n"
        + lines
        + "\n</tools>\n\nTo call one, write its name and arguments as a JSON object between "
        + "<tool_call> and </tool_call>:\n<tool_call>\n"
        + '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>'
    )


def solution_of(answer):
    m = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if m is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return m.group(0).split("#### ")[1].replace(",", "")


def convert(row, split, idx, agent_loop, system):
    info = row.get("extra_info") or {}
    question_raw = info.get("question")
    answer_raw = info.get("answer")
    if question_raw is None or answer_raw is None:
        raise ValueError(f"{split} row {idx}: extra_info has no raw question/answer")
    solution = solution_of(answer_raw)
    out = {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": system},
            {"role": "user", "content": question_raw + " " + INSTRUCTION},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {
            "split": split,
            "index": idx,
            "answer": answer_raw,
            "question": question_raw,
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}},
            # verl's script leaves out `name`, which its agent loop requires once an interaction
            # config is set; with it the rows work with configs/interaction_config/.
            "interaction_kwargs": {"name": "gsm8k", "query": question_raw + " " + INSTRUCTION, "ground_truth": solution},
        },
    }
    if agent_loop:
        out["agent_name"] = "tool_agent"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default="../shared/data/gsm8k")
    ap.add_argument("--out", default=os.path.expanduser("~/data/gsm8k_tool"))
    ap.add_argument("--agent-loop", action="store_true", help="add agent_name: tool_agent (verl 1dda039's script)")
    ap.add_argument(
        "--tools-in-system",
        action="store_true",
        help="list the tools and the call format in the system message (templates without tools)",
    )
    ap.add_argument("--tool-config", default="configs/tool_config/gsm8k_tool_config.yaml")
    args = ap.parse_args()
    system = SYSTEM + (tools_block(args.tool_config) if args.tools_in_system else "")
    os.makedirs(os.path.expanduser(args.out), exist_ok=True)
    for split in ("train", "test"):
        rows = pq.read_table(os.path.join(args.src, f"{split}.parquet")).to_pylist()
        out = [convert(r, split, i, args.agent_loop, system) for i, r in enumerate(rows)]
        path = os.path.join(os.path.expanduser(args.out), f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(out), path)
        print(f"{path}: {len(out)} rows")


if __name__ == "__main__":
    main()
