#!/usr/bin/env python3
"""A local code-execution service for tool agents, standard library only: POST /run_code with
{"code": "...", "timeout": seconds (optional)} runs the code in a fresh `python3 -I` process and
answers in SandboxFusion's shape, which verl's code tools (and the sandbox tool of verl 1dda039's
examples/tutorial/agent_loop_get_started) read:

    {"status": "Success" | "Failed",
     "run_result": {"status": "Finished" | "TimeLimitExceeded", "stdout": ..., "stderr": ...,
                    "return_code": int | null, "execution_time": seconds}}

Each run gets an empty temporary directory as its working directory, a CPU-time, memory and
file-size limit (`--cpu-s`, `--memory-mb`, `--file-mb`), a wall-clock limit (the request's
`timeout`, at most `--max-timeout-s`) and output cut to `--max-output-bytes` per stream; the
process group is killed when the wall clock runs out. It is a convenience for local runs, not a
security boundary: run it as an unprivileged user or in a container.

    python3 scripts/code_sandbox_server.py --port 8080      # then sandbox_fusion_url: http://127.0.0.1:8080/run_code

`--port 0` picks a free port; the address is printed as the first line on stdout either way.
"""
import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def limits(cpu_s, memory_mb, file_mb):
    def apply():
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        size = file_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


def run_code(code, timeout, opts):
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sandbox_") as work:
        path = os.path.join(work, "main.py")
        with open(path, "w") as f:
            f.write(code)
        proc = subprocess.Popen(
            [opts.python, "-I", path],
            cwd=work,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=limits(opts.cpu_s, opts.memory_mb, opts.file_mb),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONIOENCODING": "utf-8"},
        )
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
    cut = opts.max_output_bytes

    def text(b):
        s = b[:cut].decode("utf-8", errors="replace")
        return s + ("\n[output truncated]" if len(b) > cut else "")

    code_ = None if timed_out else proc.returncode
    return {
        "status": "Success" if code_ == 0 else "Failed",
        "run_result": {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "stdout": text(out),
            "stderr": text(err),
            "return_code": code_,
            "execution_time": round(time.monotonic() - started, 3),
        },
    }


def handler(opts):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status, body):
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            if self.path.rstrip("/") != "/run_code":
                return self._reply(404, {"error": f"no endpoint {self.path}; POST /run_code"})
            try:
                n = int(self.headers.get("Content-Length", "0"))
                if n > opts.max_request_bytes:
                    return self._reply(413, {"error": f"request of {n} bytes is over {opts.max_request_bytes}"})
                req = json.loads(self.rfile.read(n) or b"{}")
                code = req["code"]
                if not isinstance(code, str):
                    raise TypeError("`code` must be a string")
                timeout = float(req.get("timeout", opts.max_timeout_s))
            except (ValueError, KeyError, TypeError) as exc:
                return self._reply(400, {"error": f"bad request: {exc!r}; expected {{\"code\": str, \"timeout\": number}}"})
            timeout = max(0.1, min(timeout, opts.max_timeout_s))
            self._reply(200, run_code(code, timeout, opts))

        def log_message(self, fmt, *args):
            if opts.verbose:
                super().log_message(fmt, *args)

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs the code")
    ap.add_argument("--cpu-s", type=int, default=10)
    ap.add_argument("--memory-mb", type=int, default=1024)
    ap.add_argument("--file-mb", type=int, default=16)
    ap.add_argument("--max-timeout-s", type=float, default=30.0)
    ap.add_argument("--max-output-bytes", type=int, default=64 * 1024)
    ap.add_argument("--max-request-bytes", type=int, default=1024 * 1024)
    ap.add_argument("--verbose", action="store_true")
    opts = ap.parse_args()
    server = ThreadingHTTPServer((opts.host, opts.port), handler(opts))
    host, port = server.server_address[:2]
    print(f"http://{host}:{port}/run_code", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
