#!/usr/bin/env python3
"""A toy Search-R1 task that fits a laptop CPU and needs no dataset hub: a corpus of made-up
towns (one passage each: region, founding year, river, what it is known for) and questions
about them whose answers exist only in the corpus, so a policy scores by searching.

Writes, into `--out`:
- `corpus.jsonl`: Search-R1's corpus format (`id`, `contents` = "\\"Title\\"\\ntext"), for
  `scripts/retrieval_server.py --corpus`;
- `train.parquet`, `test.parquet`: rows as verl's `examples/data_preprocess/
  preprocess_search_r1_dataset.py` shapes them: `data_source` "searchR1_toy" (verl's scorer
  `search_r1_like_qa_em`: exact match inside `<answer>...</answer>`), a system and a user
  message, `reward_model.ground_truth = {"target": [answer]}`, and
  `extra_info.tools_kwargs.search.create_kwargs` (ground truth, question, data source).
  `--tools-in-system` also lists the search tool and the hermes call format in the system
  message, for chat templates that do not render `tools` (SmolLM2's).

    python3 scripts/make_search_toy_data.py --out data/search_toy [--towns 400] [--seed 0] [--tools-in-system]

Needs pyarrow. Deterministic for a given seed.
"""
import argparse
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq

ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gl", "h", "k", "l", "m", "n", "p", "r", "s", "st", "t", "th", "v", "w", "z"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
CODAS = ["", "n", "r", "l", "th", "nd", "rk", "st", "m", "x"]
SUFFIXES = ["holt", "wick", "ford", "mere", "stead", "by", "dale", "ton", "haven", "gate"]
REGIONS = ["Elsmere", "Quarrow", "Tessaly", "Hollin", "Varne", "Ostrel", "Dunmark", "Pellory"]
GOODS = ["copper bells", "blue salt", "glass lanterns", "walnut ink", "wool rugs", "clay pipes",
         "honey beer", "slate roofs", "paper kites", "iron nails", "river pearls", "linen sails"]

SYSTEM = "You are a helpful assistant that answers questions about places."
INSTRUCTION = (
    "Answer the question below. The answer is not common knowledge: look it up with the `search` "
    "tool (it returns passages from a small encyclopedia), then give only the answer inside "
    "<answer> and </answer>, for example <answer> 1834 </answer>. Question: "
)
SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the encyclopedia for passages relevant to each query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "item": {"type": "string"},
                    "description": "Queries, each a short phrase; one list of passages comes back per query.",
                }
            },
            "required": ["query_list"],
        },
    },
}


def town_names(rng, n):
    names = set()
    while len(names) < n:
        name = rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) + rng.choice(SUFFIXES)
        names.add(name.capitalize())
    return sorted(names)


def tools_block():
    return (
        "\n\n# Tools\n\nThese functions are available (JSON schemas):\n<tools>\n"
        + json.dumps(SEARCH_SCHEMA)
        + "\n</tools>\n\nTo call one, write its name and arguments as a JSON object between "
        + "<tool_call> and </tool_call>:\n<tool_call>\n"
        + '{"name": "search", "arguments": {"query_list": ["<query>"]}}\n</tool_call>'
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="data/search_toy")
    ap.add_argument("--towns", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-share", type=float, default=0.1)
    ap.add_argument("--tools-in-system", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    system = SYSTEM + (tools_block() if args.tools_in_system else "")
    corpus, qa = [], []
    for i, name in enumerate(town_names(rng, args.towns)):
        region, goods = rng.choice(REGIONS), rng.choice(GOODS)
        year = rng.randrange(1200, 1950)
        river = (rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) + rng.choice(["e", "a", "en", "ey"])).capitalize()
        corpus.append({
            "id": str(i),
            "contents": f"\"{name}\"\n{name} is a town in the {region} region, founded in {year} on the "
                        f"river {river}. It is known for its {goods}.",
        })
        qa += [
            (f"In which year was the town of {name} founded?", str(year)),
            (f"In which region is the town of {name}?", region),
            (f"On which river does the town of {name} stand?", river),
            (f"What is the town of {name} known for?", goods),
        ]
    with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for d in corpus:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    rng.shuffle(qa)
    n_test = max(1, int(len(qa) * args.test_share))
    for split, part in (("test", qa[:n_test]), ("train", qa[n_test:])):
        rows = []
        for idx, (question, answer) in enumerate(part):
            gt = {"target": [answer]}
            source = "searchR1_toy"
            rows.append({
                "data_source": source,
                "prompt": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": INSTRUCTION + question},
                ],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {
                    "index": idx,
                    "need_tools_kwargs": True,
                    "question": question,
                    "split": split,
                    "tools_kwargs": {
                        "search": {"create_kwargs": {"ground_truth": gt, "question": question, "data_source": source}}
                    },
                },
            })
        path = os.path.join(out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
        print(f"{path}: {len(rows)} rows")
    print(f"{os.path.join(out, 'corpus.jsonl')}: {len(corpus)} passages")


if __name__ == "__main__":
    main()
