#!/usr/bin/env python3
"""A small image-question set in verl's geo3k layout, with answers known by construction, for
training a vision-language model on a CPU without the Geometry3K dataset.

Each row's image is drawn here (digits from a 5x7 bitmap font, lines, a white background; PNG
written with zlib, no imaging library) and asks one of three questions whose answer is an
integer:
- sum:        two or three numbers scattered over the image; "the sum of the numbers";
- hypotenuse: a right triangle whose legs are labelled with a Pythagorean triple's legs;
- area:       a rectangle whose sides are labelled.

Writes `train.parquet` and `test.parquet` into `--out` with the columns verl's
`examples/data_preprocess/geo3k.py` writes: `data_source`, `prompt` (one user message:
"<image>" + problem + " " + the instruction), `images` (a list of `{bytes, path}` structs, as
an HF `datasets` image column is stored), `ability` ("math"), `reward_model` (`{style: rule,
ground_truth}`) and `extra_info` (`{split, index, answer, question}`). The instruction is
verl's geo3k one (think inside <think> </think>, answer in \\boxed{}), or with `--short`
a shorter one saying the same, for models with a small context.

`data_source` is "geo3k_synthetic": score it with `scripts/geo3k_reward.py` (geo3k's formula,
0.9 x accuracy of the boxed answer + 0.1 x format, with an exact comparison instead of
mathruler's), as `reward.custom_reward_function.path`.

    python3 scripts/geo3k_synthetic.py --out ~/data/geo3k_synthetic [--train 512] [--test 64]
        [--size 112] [--seed 0] [--short]

Needs pyarrow. Deterministic for a given seed.
"""
import argparse
import os
import random
import struct
import zlib

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "geo3k_synthetic"

# verl's geo3k instruction (examples/data_preprocess/geo3k.py), and a shorter one.
INSTRUCTION = (
    r"You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    r"The reasoning process MUST BE enclosed within <think> </think> tags. "
    r"The final answer MUST BE put in \boxed{}."
)
SHORT_INSTRUCTION = r"Think inside <think> </think>, then put the answer in \boxed{}."

# 5x7 digits, one string of five bits per row.
FONT = {
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
}

# Pythagorean triples with legs up to 24.
TRIPLES = [(3, 4, 5), (6, 8, 10), (5, 12, 13), (9, 12, 15), (8, 15, 17), (12, 16, 20),
           (7, 24, 25), (15, 20, 25), (10, 24, 26), (20, 21, 29)]

INK = (20, 20, 20)
COLOURS = [(200, 40, 40), (30, 90, 200), (30, 140, 60), (150, 60, 160)]


class Canvas:
    """An RGB image on a white background."""

    def __init__(self, size):
        self.size = size
        self.px = [bytearray(b"\xff" * (3 * size)) for _ in range(size)]

    def dot(self, x, y, colour, width=1):
        for dy in range(width):
            for dx in range(width):
                xx, yy = x + dx, y + dy
                if 0 <= xx < self.size and 0 <= yy < self.size:
                    self.px[yy][3 * xx:3 * xx + 3] = bytes(colour)

    def line(self, x0, y0, x1, y1, colour, width=2):
        """Bresenham's line, `width` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, colour, width)
            if (x0, y0) == (x1, y1):
                return
            e2 = 2 * err
            if e2 >= dy:
                err, x0 = err + dy, x0 + sx
            if e2 <= dx:
                err, y0 = err + dx, y0 + sy

    def text(self, x, y, s, colour=INK, scale=2):
        """Digits with their top-left corner at (x, y), each 5 x 7 cells of `scale` pixels."""
        for i, ch in enumerate(s):
            for r, bits in enumerate(FONT[ch]):
                for c, bit in enumerate(bits):
                    if bit == "1":
                        self.dot(x + (6 * i + c) * scale, y + r * scale, colour, scale)

    def png(self):
        """The image as PNG bytes (8-bit RGB, no filter)."""
        raw = b"".join(b"\x00" + bytes(row) for row in self.px)

        def chunk(kind, data):
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.size, self.size, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def text_width(s, scale):
    return (6 * len(s) - 1) * scale


def sum_task(rng, size):
    """Two or three numbers in distinct cells of a 3 x 3 grid."""
    c = Canvas(size)
    numbers = [rng.randint(1, 20) for _ in range(rng.choice([2, 3]))]
    cells = rng.sample(range(9), len(numbers))
    cell = size // 3
    for n, at in zip(numbers, cells):
        s = str(n)
        scale = max(1, size // 56)
        w, h = text_width(s, scale), 7 * scale
        x = (at % 3) * cell + rng.randint(1, max(1, cell - w - 1))
        y = (at // 3) * cell + rng.randint(1, max(1, cell - h - 1))
        c.text(x, y, s, rng.choice(COLOURS), scale)
    return c, "What is the sum of the numbers in the image?", sum(numbers)


def hypotenuse_task(rng, size):
    """A right triangle (the right angle bottom-left) with its legs labelled."""
    a, b, hyp = rng.choice(TRIPLES)
    if rng.random() < 0.5:
        a, b = b, a
    c = Canvas(size)
    scale = max(1, size // 56)
    margin = 10 * scale + 4
    span = size - 2 * margin
    k = span / max(a, b)
    x0, y0 = margin, size - margin
    x1, y1 = x0 + round(a * k), y0 - round(b * k)
    c.line(x0, y0, x1, y0, INK)
    c.line(x0, y0, x0, y1, INK)
    c.line(x1, y0, x0, y1, INK)
    m = 3 * scale + 2  # the right-angle mark
    c.line(x0 + m, y0, x0 + m, y0 - m, INK, 1)
    c.line(x0, y0 - m, x0 + m, y0 - m, INK, 1)
    sa, sb = str(a), str(b)
    c.text((x0 + x1 - text_width(sa, scale)) // 2, y0 + 3, sa, COLOURS[1], scale)
    c.text(max(0, x0 - text_width(sb, scale) - 3), (y0 + y1) // 2 - 3 * scale, sb, COLOURS[0], scale)
    return c, "How long is the hypotenuse of the right triangle?", hyp


def area_task(rng, size):
    """A rectangle with its width and height labelled."""
    w, h = rng.randint(2, 12), rng.randint(2, 12)
    c = Canvas(size)
    scale = max(1, size // 56)
    margin = 10 * scale + 4
    k = (size - 2 * margin) / max(w, h)
    x0, y0 = margin, size - margin
    x1, y1 = x0 + round(w * k), y0 - round(h * k)
    colour = rng.choice(COLOURS)
    for p, q in [((x0, y0), (x1, y0)), ((x1, y0), (x1, y1)), ((x1, y1), (x0, y1)), ((x0, y1), (x0, y0))]:
        c.line(*p, *q, colour)
    sw, sh = str(w), str(h)
    c.text((x0 + x1 - text_width(sw, scale)) // 2, y0 + 3, sw, INK, scale)
    c.text(max(0, x0 - text_width(sh, scale) - 3), (y0 + y1) // 2 - 3 * scale, sh, INK, scale)
    return c, "What is the area of the rectangle?", w * h


TASKS = [sum_task, hypotenuse_task, area_task]

SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                              ("answer", pa.string()), ("question", pa.string())])),
])


def rows(split, n, rng, size, instruction):
    out = []
    for i in range(n):
        canvas, problem, answer = TASKS[i % len(TASKS)](rng, size)
        answer = str(answer)
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>" + problem + " " + instruction}],
            "images": [{"bytes": canvas.png(), "path": None}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i, "answer": answer, "question": problem},
        })
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    ap.add_argument("--train", type=int, default=512, help="training rows")
    ap.add_argument("--test", type=int, default=64, help="test rows")
    ap.add_argument("--size", type=int, default=112, help="image side in pixels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--short", action="store_true",
                    help="a shorter instruction, for models with a small context")
    args = ap.parse_args()
    if args.size < 56:
        ap.error("--size must be at least 56 pixels (labels and shapes need the room)")
    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    instruction = SHORT_INSTRUCTION if args.short else INSTRUCTION
    for split, n, seed in [("train", args.train, args.seed), ("test", args.test, args.seed + 1)]:
        table = pa.Table.from_pylist(rows(split, n, random.Random(seed), args.size, instruction),
                                     schema=SCHEMA)
        path = os.path.join(out, f"{split}.parquet")
        pq.write_table(table, path)
        print(f"{path}: {n} rows")


if __name__ == "__main__":
    main()
