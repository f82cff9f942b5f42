#!/usr/bin/env python3
"""Lists functions longer than a limit: a `fn` line up to the first later line holding only
`}` at the same indentation. Usage: python3 scripts/long_functions.py LIMIT DIR...
(e.g. `python3 scripts/long_functions.py 120 src/config src/trainer`: nothing listed is the
issue-13 rule "no function over ~120 lines")"""
import os, re, sys
limit = int(sys.argv[1])
rows = []
for d in sys.argv[2:]:
    for root, _, files in os.walk(d):
        for f in files:
            if not f.endswith('.rs'):
                continue
            p = os.path.join(root, f)
            lines = open(p).read().split('\n')
            for i, l in enumerate(lines):
                m = re.match(r'^(\s*)(pub(\([a-z]+\))? )?(async )?fn (\w+)', l)
                if not m:
                    continue
                ind = m.group(1)
                for j in range(i + 1, len(lines)):
                    if lines[j] == ind + '}':
                        n = j - i + 1
                        if n > limit:
                            rows.append((n, f'{p}:{i+1}', m.group(5)))
                        break
for n, at, name in sorted(rows, reverse=True):
    print(f'{n:5} {at} {name}')
