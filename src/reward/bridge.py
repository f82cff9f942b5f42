# main_ppo reward worker: loads a user reward function and scores requests read as JSON lines
# on descriptor 3, writing one JSON line per scored item to descriptor 4. Shipped inside the
# main_ppo binary and run as `python3 -u -c <this file>`, with stdin /dev/null (a function that
# reads it gets end-of-file) and stdout and stderr into main_ppo's log (the user's own prints).
import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import os
import signal
import sys
import threading
import time
import traceback

# The parent watch (orphan_watch.py) and descriptors, _requests, _proto (bridge_base.py) run before this.

VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
ROW_NAMES = ("data", "row", "item")
TEXT_NAMES = ("generation", "response", "completion")
BATCH = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def send(obj):
    # JSON has no NaN or infinity; `finite` has replaced them, and a stray one is refused here
    # (before anything is written) so that it becomes that sample's error, not a broken line.
    _proto.write(json.dumps(obj, default=str, allow_nan=False) + "\n")
    _proto.flush()


def load_function(path, name):
    if path.startswith("pkg://"):
        module = importlib.import_module(path[len("pkg://"):])
    else:
        if path.startswith("file://"):
            path = path[len("file://"):]
        path = os.path.abspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"reward function file not found: {path}")
        mod_name = "main_ppo_reward_" + str(abs(hash(path)))
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # importable by name, so pickling works
        sys.path.insert(0, os.path.dirname(path))
        spec.loader.exec_module(module)
    if not hasattr(module, name):
        public = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise AttributeError(f"{path} has no function `{name}` (it defines: {', '.join(public) or 'nothing callable'})")
    return getattr(module, name)


class Binding:
    """How each request item becomes keyword arguments of the user's function."""

    def __init__(self, fn, name, kwargs, batch, positional=False):
        self.fn, self.name, self.kwargs, self.batch = fn, name, dict(kwargs), batch
        self.positional = positional
        self.is_async = inspect.iscoroutinefunction(fn)
        sig = inspect.signature(fn)
        if positional:
            # verl's PRIME manager: fn(data_source, solution_str, ground_truth, extra_info)
            # by position, the reward kwargs by keyword.
            try:
                sig.bind(*VERL, **self.kwargs)
            except TypeError as exc:
                raise TypeError(
                    f"{name}: the prime reward manager calls it with four positional arguments "
                    f"(data_source, solution_str, ground_truth, extra_info) and the configured reward kwargs: {exc}"
                ) from None
            self.plan, self.var_kw = [], False
            self.params = list(VERL) + list(self.kwargs)
            return
        params = list(sig.parameters.values())
        self.var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
        self.plan = []  # (parameter name, source)
        names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for p in params:
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if p.kind == p.POSITIONAL_ONLY:
                raise TypeError(f"{name}: parameter `{p.name}` is positional-only; reward functions are called by keyword")
            if p.name in self.kwargs:
                continue
            if batch:
                known = BATCH
                src = p.name if p.name in BATCH else None
            else:
                known = VERL + ROW_NAMES + TEXT_NAMES
                src = p.name if p.name in VERL else ("row" if p.name in ROW_NAMES else ("solution_str" if p.name in TEXT_NAMES else None))
            if src is not None:
                self.plan.append((p.name, src))
            elif p.default is p.empty:
                raise TypeError(
                    f"{name}: cannot bind parameter `{p.name}`; main_ppo passes {', '.join(known)}"
                    + ("" if batch else " (data/row/item receive the whole row, generation/response/completion the response text)")
                    + ", and the configured reward kwargs"
                )
        if self.var_kw:
            have = {n for n, _ in self.plan}
            for v in (BATCH if batch else VERL):
                if v not in have:
                    self.plan.append((v, v))
        for k in self.kwargs:
            if k not in names and not self.var_kw:
                raise TypeError(f"{name}: the configured reward kwarg `{k}` is not a parameter of the function")
        self.params = [n for n, _ in self.plan] + list(self.kwargs)

    def call(self, item):
        """The function's result for one request item (a coroutine for an async function)."""
        if self.positional:
            return self.fn(*(item[k] for k in VERL), **self.kwargs)
        return self.fn(**self.call_args(item))

    def result(self, value):
        """The score reply for what the function returned."""
        if self.positional:
            value = prime_value(self.name, value)
        return convert(self.name, value)

    def call_args(self, item):
        args = {n: item[src] for n, src in self.plan}
        args.update(self.kwargs)  # the configuration wins over call-time values
        return args


def prime_value(name, result):
    """What verl's PRIME manager reads from a result: a number or a bool as it is, otherwise its
    first item (a tuple or list of score and details)."""
    if isinstance(result, dict):
        raise TypeError(f"{name} returned a dict; the prime reward manager reads a number, a bool, or a sequence whose first item is the score")
    if isinstance(result, (bool, int, float)) or result is None:
        return result
    try:
        return result[0]
    except Exception:  # noqa: BLE001 - numbers of other types (numpy scalars) pass through
        return result


def convert(name, result):
    if isinstance(result, bool):
        return {"score": float(result), "extra": {}}
    if isinstance(result, (int, float)):
        score = float(result)
        extra = {}
    elif isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"{name} returned a dict without `score` (keys: {', '.join(map(str, result)) or 'none'})")
        score = result["score"]
        if isinstance(score, bool) or not isinstance(score, (int, float)):
            try:
                score = float(score)  # numpy scalars, tensors with .item()
            except Exception:
                raise TypeError(f"{name} returned `score` of type {type(score).__name__}, expected a number")
        score = float(score)
        extra = {k: v for k, v in result.items() if k != "score"}
    else:
        try:
            import numbers

            if isinstance(result, numbers.Number):
                return convert(name, float(result))
        except Exception:
            pass
        raise TypeError(f"{name} returned {type(result).__name__}, expected a number, a bool or a dict with `score`")
    if math.isnan(score) or math.isinf(score):
        raise ValueError(f"{name} returned a non-finite score ({score})")
    return {"score": score, "extra": finite(extra)}


def finite(value):
    """`value` with every non-finite float (NaN, +-infinity) written as the string Python
    prints for it ("nan", "inf", "-inf"): extras are reported as returned, and a metric that
    averages numbers leaves such strings out."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(float(value))
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def error_reply(req_id, index, exc):
    return {"id": req_id, "index": index, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def main():
    binding = None
    for line in _requests:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "load":
            try:
                fn = load_function(msg["path"], msg["name"])
                binding = Binding(fn, msg["name"], msg.get("kwargs") or {}, msg.get("batch", False), msg.get("positional", False))
                send({"ok": True, "params": binding.params, "async": binding.is_async})
            except BaseException as exc:  # noqa: BLE001 - reported to main_ppo
                send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        elif op == "score":
            req_id, items = msg["id"], msg["items"]
            # Accepted before the function runs: a worker that ends before this line never ran
            # the request, and main_ppo sends it again to a new worker.
            send({"id": req_id, "accepted": True})
            if binding.batch:
                try:
                    columns = {plural: [it[single] for it in items] for plural, single in zip(BATCH, VERL)}
                    args = binding.call_args(columns)
                    out = binding.fn(**args)
                    if binding.is_async:
                        out = asyncio.run(out)
                    out = list(out)
                    if len(out) != len(items):
                        raise ValueError(f"{binding.name} returned {len(out)} scores for {len(items)} responses")
                    for i, r in enumerate(out):
                        try:
                            send({"id": req_id, "index": i, **convert(binding.name, r)})
                        except Exception as exc:  # noqa: BLE001
                            send(error_reply(req_id, i, exc))
                except Exception as exc:  # noqa: BLE001
                    for i in range(len(items)):
                        send(error_reply(req_id, i, exc))
            elif binding.is_async:
                async def one(i, it):
                    try:
                        send({"id": req_id, "index": i, **binding.result(await binding.call(it))})
                    except Exception as exc:  # noqa: BLE001
                        send(error_reply(req_id, i, exc))

                async def all_items():
                    await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))

                asyncio.run(all_items())
            else:
                for i, it in enumerate(items):
                    try:
                        send({"id": req_id, "index": i, **binding.result(binding.call(it))})
                    except Exception as exc:  # noqa: BLE001
                        send(error_reply(req_id, i, exc))
        elif op == "quit":
            return  # main_ppo ends the process group once this worker has exited
    _orphaned()  # the requests ended without `quit`: main_ppo is gone


main()
