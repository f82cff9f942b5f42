#!/usr/bin/env python3
"""Checks the crate's layering rules from its `use`/path references (non-test code only).

Usage: python3 scripts/layering.py [SRC]   (default: src; exit status 1 when a rule is broken)

Rules checked:
1. `src/kernels` names nothing of the crate (`crate::`), tests included: the ground floor.
2. `src/model` outside its tests names nothing of `data`, `config`, `util` or `weights`.
3. No import cycle between the files of `src/model` (a file `a` depends on `b` when it names
   `super::b`, `crate::model::b` or `crate::model::{..b..}`), outside tests.
4. No room names a room above it in `ROOMS` (outside tests; `testing` is test support).

A file's test code is what follows its first `#[cfg(test)]` item with a body, and files named `tests.rs`,
`props.rs`, `*_tests.rs` are test code whole (the project keeps tests at the end of a file or in
such files).
"""
import os
import re
import sys

# Lowest first: a room may name rooms at or below its own floor (same floor: neither above).
ROOMS = [
    ["util", "kernels"],
    ["config"],
    ["data", "dist"],
    ["model"],
    ["weights"],
    ["rollout", "algo"],
    ["reward"],
    ["metrics", "checkpoint", "control"],
    ["trainer"],
    ["cli"],
]
FLOOR = {room: i for i, rooms in enumerate(ROOMS) for room in rooms}


def code_of(path):
    text = open(path, encoding="utf-8").read()
    name = os.path.basename(path)
    if name in ("tests.rs", "props.rs") or name.endswith("_tests.rs") or name.startswith("tests_"):
        return ""
    # The first `#[cfg(test)]` item with a body (`mod tests {`); declarations such as
    # `#[cfg(test)] mod tests;` only name another (test) file.
    m = re.search(r"#\[cfg\(test\)\]\s*\n\s*(pub(\([a-z]+\))? )?(mod|fn|impl)\b[^;\n]*\{", text)
    code = text if m is None else text[: m.start()]
    # Comments and doc comments name rooms in prose: drop them.
    return "\n".join(re.sub(r"//.*", "", line) for line in code.split("\n"))


def files(src):
    for root, _, names in os.walk(src):
        for n in sorted(names):
            if n.endswith(".rs"):
                yield os.path.join(root, n)


def room_of(src, path):
    rel = os.path.relpath(path, src).split(os.sep)
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "src"
    problems = []
    # 1. kernels: nothing of the crate, tests included.
    for p in files(os.path.join(src, "kernels")):
        for i, line in enumerate(open(p, encoding="utf-8"), 1):
            if "crate::" in re.sub(r"//.*", "", line):
                problems.append(f"{p}:{i}: kernels names the crate: {line.strip()}")
    # 2 and 4: rooms named above one's floor.
    for p in files(src):
        room = room_of(src, p)
        if room not in FLOOR:
            continue
        code = code_of(p)
        for m in re.finditer(r"crate::(\w+)", code):
            other = m.group(1)
            if other in FLOOR and FLOOR[other] > FLOOR[room]:
                line = code[: m.start()].count("\n") + 1
                problems.append(f"{p}:{line}: {room} names {other}, a room above it")
        if room == "model":
            for m in re.finditer(r"crate::(data|config|util|weights)\b", code):
                line = code[: m.start()].count("\n") + 1
                problems.append(f"{p}:{line}: model names {m.group(1)}")
    # 3. cycles between the files of model/.
    mdir = os.path.join(src, "model")
    mods = {os.path.basename(p)[:-3]: p for p in files(mdir) if os.path.dirname(p) == mdir}
    deps = {}
    for name, p in mods.items():
        code = code_of(p)
        named = set(re.findall(r"super::(\w+)", code)) | set(re.findall(r"crate::model::(\w+)", code))
        for group in re.findall(r"crate::model::\{([^}]*)\}", code):
            named |= set(re.findall(r"\b(\w+)\b", group))
        if name == "mod":
            named = set()  # the room's index declares and re-exports; it is no layer
        deps[name] = sorted(n for n in named if n in mods and n not in (name, "mod"))
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in deps[n]:
            if state.get(d) == 1:
                cyc = stack[stack.index(d):] + [d]
                problems.append("model/ import cycle: " + " -> ".join(cyc))
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(deps):
        if n not in state:
            visit(n)
    for p in problems:
        print(p)
    if not problems:
        print("layering: kernels names nothing of the crate; model names only kernels; "
              f"no cycle among model/'s {len(mods)} files; no room names one above it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
