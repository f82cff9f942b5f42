#!/usr/bin/env python3
"""A small local retrieval service for Search-R1-style tool agents, standard library only:
BM25 over a JSONL corpus, answering Search-R1's retrieval API, which verl's search tool
(`verl.tools.search_tool.SearchTool`, `retrieval_service_url`) calls:

    POST /retrieve  {"queries": ["...", ...], "topk": 3, "return_scores": true}
    ->  {"result": [[{"document": {"id": ..., "contents": "\\"Title\\"\\ntext"}, "score": s}, ...], ...]}

One list per query, best first (without `return_scores`, the documents alone). The corpus is
Search-R1's format: one JSON object per line with `id` and `contents` (title on the first line,
then the text); `--corpus` reads it, `scripts/make_search_toy_data.py` writes a toy one. BM25
with k1 = 0.9, b = 0.4 (Pyserini's defaults, which Search-R1's BM25 retriever uses) on
lower-cased alphanumeric tokens.

    python3 scripts/retrieval_server.py --corpus data/search_toy/corpus.jsonl --port 8000

`--port 0` picks a free port; the URL is printed as the first line on stdout either way.
"""
import argparse
import json
import math
import re
import sys
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = re.compile(r"[a-z0-9]+")


def tokens(text):
    return TOKEN.findall(text.lower())


class Bm25:
    def __init__(self, docs, k1=0.9, b=0.4):
        self.docs, self.k1, self.b = docs, k1, b
        self.lengths = []
        self.postings = defaultdict(list)  # term -> [(doc index, term frequency)]
        for i, d in enumerate(docs):
            tf = Counter(tokens(d["contents"]))
            self.lengths.append(sum(tf.values()))
            for term, n in tf.items():
                self.postings[term].append((i, n))
        self.avg = sum(self.lengths) / max(len(docs), 1)
        n_docs = len(docs)
        # Lucene's idf: log(1 + (N - df + 0.5) / (df + 0.5)), never negative.
        self.idf = {t: math.log(1 + (n_docs - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def search(self, query, k):
        scores = defaultdict(float)
        for term in set(tokens(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for i, tf in self.postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg)
                scores[i] += idf * tf * (self.k1 + 1) / (tf + norm)
        best = sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:k]
        return best


def load_corpus(path):
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{n}: not JSON: {exc}")
            if not isinstance(d, dict) or not isinstance(d.get("contents"), str):
                raise SystemExit(f"{path}:{n}: each line must be an object with a string `contents`")
            d.setdefault("id", str(len(docs)))
            docs.append(d)
    if not docs:
        raise SystemExit(f"{path}: no documents")
    return docs


def handler(index, opts):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status, body):
            data = json.dumps(body, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            if self.path.rstrip("/") != "/retrieve":
                return self._reply(404, {"error": f"no endpoint {self.path}; POST /retrieve"})
            try:
                n = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(n) or b"{}")
                queries = req["queries"]
                if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                    raise TypeError("`queries` must be a list of strings")
                topk = int(req.get("topk", opts.topk))
                if topk < 1:
                    raise ValueError("`topk` must be at least 1")
                with_scores = bool(req.get("return_scores", False))
            except (ValueError, KeyError, TypeError) as exc:
                return self._reply(400, {"error": f"bad request: {exc!r}; expected {{\"queries\": [str], \"topk\": int, \"return_scores\": bool}}"})
            result = []
            for q in queries:
                hits = index.search(q, topk)
                docs = [index.docs[i] for i, _ in hits]
                if with_scores:
                    result.append([{"document": d, "score": s} for d, (_, s) in zip(docs, hits)])
                else:
                    result.append(docs)
            self._reply(200, {"result": result})

        def log_message(self, fmt, *args):
            if opts.verbose:
                super().log_message(fmt, *args)

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", required=True, help="JSONL with `id` and `contents` per line")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--topk", type=int, default=3, help="when a request names none")
    ap.add_argument("--verbose", action="store_true")
    opts = ap.parse_args()
    index = Bm25(load_corpus(opts.corpus))
    server = ThreadingHTTPServer((opts.host, opts.port), handler(index, opts))
    host, port = server.server_address[:2]
    print(f"http://{host}:{port}/retrieve", flush=True)
    print(f"{len(index.docs)} documents indexed", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
