# main_ppo tool worker: instantiates the configured tools once, then runs tool calls read as
# JSON lines on descriptor 3, writing one JSON line per call to descriptor 4. Shipped inside the
# main_ppo binary and run as `python3 -u -c <this file>`, with stdin /dev/null and stdout and
# stderr into main_ppo's log. main_ppo makes this process the leader of a process group of its
# own and kills that group when a call runs past its timeout.
#
# A call follows verl's ToolAgentLoop._call_tool: an unknown name, arguments that are not JSON or
# not a JSON object become a message for the model (reward 0.0); a function tool is called with the arguments; a
# BaseTool gets create / execute / release; an exception becomes "Error executing tool ...".
# An interaction turn follows verl b178a3c's ToolAgentLoop: the interaction named by the row's
# `interaction_kwargs` is started on the conversation's first such turn, then answers each
# model turn without tool calls with (end?, the user's text, the turn's score, metrics).
import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import typing
import urllib.error
import urllib.request
import uuid
from uuid import uuid4

# The parent watch (orphan_watch.py) and descriptors, _requests, _proto (bridge_base.py) run before this.


def finite(value):
    """`value` with every non-finite float written as the string Python prints for it."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(float(value))
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def encode(obj):
    return json.dumps(finite(obj), default=str, allow_nan=False, ensure_ascii=False)


def send_line(line):
    _proto.write(line + "\n")
    _proto.flush()


# ---------------------------------------------------------------------------------------------
# Stand-ins for the parts of verl that tool files import, used when verl itself is not
# importable in this interpreter. They behave like verl's modules without pydantic or
# transformers.
# ---------------------------------------------------------------------------------------------

_REQUIRED = object()


def _is_str(v, where):
    if not isinstance(v, str):
        raise ValueError(f"{where}: expected a string, got {type(v).__name__}")
    return v


def _is_opt_str(v, where):
    return None if v is None else _is_str(v, where)


def _is_type(v, where):
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return list(v)
    return _is_str(v, where)


def _is_opt_list(v, where):
    if v is not None and not isinstance(v, list):
        raise ValueError(f"{where}: expected a list, got {type(v).__name__}")
    return v


def _is_str_list(v, where):
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{where}: expected a list of strings")
    return list(v)


def _is_bool(v, where):
    if not isinstance(v, bool):
        raise ValueError(f"{where}: expected true or false, got {v!r}")
    return v


def _record(cls):
    return lambda v, where: cls.model_validate(v, where)


def _record_map(cls):
    def check(v, where):
        if not isinstance(v, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(v).__name__}")
        return {str(k): cls.model_validate(x, f"{where}.{k}") for k, x in v.items()}

    return check


def _dump(v, unset, none):
    if isinstance(v, _Record):
        return v.model_dump(exclude_unset=unset, exclude_none=none)
    if isinstance(v, dict):
        return {k: _dump(x, unset, none) for k, x in v.items()}
    if isinstance(v, list):
        return [_dump(x, unset, none) for x in v]
    return v


class _Record:
    """A small validated record in the manner of a pydantic model: FIELDS lists (name, check,
    default); unknown keys are dropped, and `model_dump(exclude_unset=True)` leaves out the
    fields that were never given."""

    FIELDS = ()

    def __init__(self, **values):
        self._init(values, type(self).__name__)

    def _init(self, values, where):
        given = set()
        for name, check, default in self.FIELDS:
            if name in values:
                object.__setattr__(self, name, check(values[name], f"{where}.{name}"))
                given.add(name)
            elif default is _REQUIRED:
                raise ValueError(f"{where}: the field `{name}` is required")
            else:
                object.__setattr__(self, name, default() if callable(default) else default)
        object.__setattr__(self, "_given", given)

    @classmethod
    def model_validate(cls, obj, where=None):
        if isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise ValueError(f"{where or cls.__name__}: expected a mapping, got {type(obj).__name__}")
        rec = cls.__new__(cls)
        rec._init({str(k): v for k, v in obj.items()}, where or cls.__name__)
        return rec

    def model_dump(self, exclude_unset=False, exclude_none=False, **_ignored):
        out = {}
        for name, _, _ in self.FIELDS:
            if exclude_unset and name not in self._given:
                continue
            value = getattr(self, name)
            if exclude_none and value is None:
                continue
            out[name] = _dump(value, exclude_unset, exclude_none)
        return out

    def __eq__(self, other):
        return type(self) is type(other) and self.model_dump() == other.model_dump()

    def __repr__(self):
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n, _, _ in self.FIELDS)
        return f"{type(self).__name__}({inner})"


class OpenAIFunctionPropertySchema(_Record):
    FIELDS = (("type", _is_type, _REQUIRED), ("description", _is_opt_str, None), ("enum", _is_opt_list, None))


class OpenAIFunctionParametersSchema(_Record):
    FIELDS = (
        ("type", _is_str, _REQUIRED),
        ("properties", _record_map(OpenAIFunctionPropertySchema), _REQUIRED),
        ("required", _is_str_list, list),
    )


class OpenAIFunctionSchema(_Record):
    FIELDS = (
        ("name", _is_str, _REQUIRED),
        ("description", _is_str, _REQUIRED),
        (
            "parameters",
            _record(OpenAIFunctionParametersSchema),
            lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]),
        ),
        ("strict", _is_bool, False),
    )


class OpenAIFunctionToolSchema(_Record):
    FIELDS = (("type", _is_str, _REQUIRED), ("function", _record(OpenAIFunctionSchema), _REQUIRED))


def _media_list(kind):
    def check(v, where):
        if v is not None and not isinstance(v, list):
            raise ValueError(f"{kind.capitalize()} must be a list, but got {type(v)}. For a single {kind}, wrap it in a list.")
        return v

    return check


class ToolResponse(_Record):
    FIELDS = (("text", _is_opt_str, None), ("image", _media_list("image"), None), ("video", _media_list("video"), None))

    def is_empty(self):
        return not self.text and not self.image and not self.video

    def is_text_only(self):
        return self.text and not self.image and not self.video


class BaseTool:
    """A stateful tool: `create` opens an instance for a trajectory, `execute` runs one call on
    it, `calc_reward` scores its state and `release` forgets it (verl's BaseTool contract)."""

    def __init__(self, config, tool_schema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        assert self.tool_schema is not None, "Tool schema is not set!"
        self.name = self.tool_schema.function.name
        print(json.dumps(self.tool_schema.model_dump(exclude_unset=True, exclude_none=True), indent=2))

    def get_openai_tool_schema(self):
        return self.tool_schema

    async def create(self, instance_id=None, **kwargs):
        return (str(uuid4()) if instance_id is None else instance_id), ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        pass


def _rollout_trace_op(fn):
    # verl records tool calls for its trace viewer; there is nothing to record here.
    return fn


# ---- function tools: @function_tool and its schema inference --------------------------------

FUNCTION_TOOL_REGISTRY = {}
_LOADED_FUNCTION_TOOL_PATHS = {}


class FunctionTool:
    """A registered function: its tool name, the callable and its schema."""

    def __init__(self, name, fn, tool_schema, is_async=False):
        self.name, self.fn, self.tool_schema, self.is_async = name, fn, tool_schema, is_async

    async def call(self, parameters):
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.to_thread(self.fn, **parameters)

    def __repr__(self):
        return f"FunctionTool(name={self.name!r})"


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _hint_schema(hint, where):
    """The JSON schema of a type hint (the subset OpenAI tool schemas use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Union or (origin is not None and origin is getattr(types, "UnionType", None)):
        parts = [_hint_schema(a, where) for a in args if a is not type(None)]
        if len(parts) == 1:
            out = parts[0]
        elif all(isinstance(p.get("type"), str) for p in parts):
            out = {"type": sorted(p["type"] for p in parts)}
        else:
            out = {"anyOf": parts}
        if type(None) in args:
            out["nullable"] = True
        return out
    if hint in (list, tuple, set) or origin in (list, tuple, set):
        out = {"type": "array"}
        if args and origin is not tuple:
            out["items"] = _hint_schema(args[0], where)
        return out
    if hint is dict or origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        kinds = sorted({_JSON_TYPES.get(type(a), "string") for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    raise TypeError(f"{where}: the type hint {hint!r} has no JSON schema type (use str, int, float, bool, list, dict or Optional of them)")


# Section headers start at the docstring's left margin (inspect.getdoc removes the indentation).
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?):")
_ARG = re.compile(r"^(\s*)(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def _parse_docstring(doc):
    """A Google-style docstring's summary and its `Args:` descriptions (continuation lines
    joined with single spaces)."""
    lines = doc.splitlines()
    heads = [i for i, line in enumerate(lines) if _SECTION.match(line)]
    first = heads[0] if heads else len(lines)
    summary = "\n".join(lines[:first]).strip()
    args = {}
    for k, start in enumerate(heads):
        if _SECTION.match(lines[start]).group(1) not in ("Args", "Arguments", "Parameters"):
            continue
        end = heads[k + 1] if k + 1 < len(heads) else len(lines)
        body = lines[start + 1 : end]
        indent = min((len(x) - len(x.lstrip()) for x in body if x.strip()), default=0)
        current = None
        for line in body:
            m = _ARG.match(line)
            if m and len(m.group(1)) == indent:
                current = m.group(2).lstrip("*")
                args[current] = [m.group(4).strip()]
            elif current is not None and line.strip():
                args[current].append(line.strip())
    return summary, {name: " ".join(p for p in parts if p) for name, parts in args.items()}


def _build_schema_from_fn(fn, tool_name):
    """The OpenAI tool schema of `fn`, from its signature and its Google-style docstring."""
    where = f"@function_tool '{tool_name}' ({fn.__module__}.{fn.__qualname__})"
    sig = inspect.signature(fn)
    variadic = [n for n, p in sig.parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"{where} declares variadic parameter(s) {variadic}, which an OpenAI tool schema cannot express")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"{where} has no docstring; the tool's description and an `Args:` block come from it")
    summary, described = _parse_docstring(doc)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # noqa: BLE001 - an unresolvable annotation
        raise TypeError(f"{where}: cannot resolve its type hints: {exc}") from exc
    properties, required = {}, []
    for name, p in sig.parameters.items():
        if name not in hints:
            raise TypeError(f"{where}: parameter `{name}` has no type hint")
        if name not in described:
            raise ValueError(f"{where}: the docstring's `Args:` block does not describe parameter `{name}`")
        prop = _hint_schema(hints[name], f"{where}, parameter `{name}`")
        desc = described[name]
        choices = _CHOICES.search(desc)
        if choices:
            prop["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            desc = desc[: choices.start()].strip()
        prop["description"] = desc
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    raw = {"type": "function", "function": {"name": tool_name, "description": summary, "parameters": parameters}}
    return OpenAIFunctionToolSchema.model_validate(raw, where)


def function_tool(name=None, *, schema=None):
    """Registers a function as a tool: `@function_tool`, `@function_tool("name")` or
    `@function_tool(schema={...})`. The function itself is returned unchanged."""

    def make(override):
        def decorator(fn):
            tool_name = override or fn.__name__
            if isinstance(schema, OpenAIFunctionToolSchema):
                built = schema
            elif isinstance(schema, dict):
                built = OpenAIFunctionToolSchema.model_validate(schema)
            else:
                built = _build_schema_from_fn(fn, tool_name)
            existing = FUNCTION_TOOL_REGISTRY.get(tool_name)
            if existing is not None and existing.fn is not fn:
                raise ValueError(
                    f"Function tool '{tool_name}' is already registered to "
                    f"{existing.fn.__module__}.{existing.fn.__qualname__}; "
                    f"refusing to overwrite with {fn.__module__}.{fn.__qualname__}."
                )
            FUNCTION_TOOL_REGISTRY[tool_name] = FunctionTool(tool_name, fn, built, inspect.iscoroutinefunction(fn))
            return fn

        return decorator

    if callable(name) and schema is None:
        return make(None)(name)
    return make(name)


def get_function_tool(name):
    if name not in FUNCTION_TOOL_REGISTRY:
        raise KeyError(f"Function tool '{name}' not found in registry. Is its file the rollout's `function_tool_path`?")
    return FUNCTION_TOOL_REGISTRY[name]


def load_function_tools_from_path(path):
    """Runs the Python file at `path` and returns the function tools it registered."""
    abs_path = os.path.abspath(path)
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"function_tool_path does not exist: {path}")
    if abs_path in _LOADED_FUNCTION_TOOL_PATHS:
        return _LOADED_FUNCTION_TOOL_PATHS[abs_path]
    before = set(FUNCTION_TOOL_REGISTRY)
    module_name = "_verl_function_tools_" + abs_path.replace(os.sep, "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, abs_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    tools = [FUNCTION_TOOL_REGISTRY[n] for n in sorted(set(FUNCTION_TOOL_REGISTRY) - before)]
    if not tools:
        print(f"function_tool_path {path} registered no @function_tool functions", file=sys.stderr)
    _LOADED_FUNCTION_TOOL_PATHS[abs_path] = tools
    return tools


def _coerce_response(value):
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))


def normalize_function_tool_return(ret):
    """A function tool's return value as (response, reward, metrics), as verl accepts it: a
    response alone, or a 1- to 3-tuple of response, reward (None = 0.0), metrics (None = {})."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(
                f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(ret)}: {ret!r}). "
                f"Use (response,), (response, reward), or (response, reward, metrics)."
            )
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _coerce_response(ret[0]), reward, metrics
    return _coerce_response(ret), 0.0, {}


# ---- verl.utils.reward_score.gsm8k -----------------------------------------------------------

_GSM8K_CLIP = 300


def gsm8k_extract_solution(solution_str, method="strict"):
    """The answer verl's GSM8K scorer reads: `#### <number>` (strict) or the last number that is
    more than a lone dot (flexible, commas kept); only the last 300 characters are searched."""
    assert method in ["strict", "flexible"]
    if len(solution_str) > _GSM8K_CLIP:
        solution_str = solution_str[-_GSM8K_CLIP:]
    if method == "strict":
        found = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        return found[-1].replace(",", "").replace("$", "") if found else None
    answer = None
    for answer in reversed(re.findall("(\\-?[0-9\\.\\,]+)", solution_str)):
        if answer not in ("", "."):
            break
    return answer


def gsm8k_compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    answer = gsm8k_extract_solution(solution_str=solution_str, method=method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def _module(name, package=False, **attrs):
    """A module made here, entered in sys.modules and in its parent package."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    if package:
        mod.__path__ = []  # so that its submodules can be imported from it
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


_VERL_MODULES = (
    "verl.tools.base_tool",
    "verl.tools.schemas",
    "verl.tools.function_tool",
    "verl.utils.reward_score.gsm8k",
)


def _real_verl_usable():
    """verl itself is importable here, with every module tool files import from it."""
    try:
        for name in _VERL_MODULES:
            importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - not installed, or installed without these modules
        return False


def _install_verl_shims():
    """Puts the stand-ins above in sys.modules under verl's module names."""
    for cls in (OpenAIFunctionPropertySchema, OpenAIFunctionParametersSchema, OpenAIFunctionSchema, OpenAIFunctionToolSchema, ToolResponse):
        cls.__module__ = "verl.tools.schemas"
    BaseTool.__module__ = "verl.tools.base_tool"
    FunctionTool.__module__ = "verl.tools.function_tool"
    for name in ("verl", "verl.tools", "verl.utils", "verl.utils.reward_score"):
        if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
            _module(name, package=True)
    schemas = _module(
        "verl.tools.schemas",
        OpenAIFunctionPropertySchema=OpenAIFunctionPropertySchema,
        OpenAIFunctionParametersSchema=OpenAIFunctionParametersSchema,
        OpenAIFunctionSchema=OpenAIFunctionSchema,
        OpenAIFunctionToolSchema=OpenAIFunctionToolSchema,
        ToolResponse=ToolResponse,
    )
    _module("verl.tools.base_tool", BaseTool=BaseTool, OpenAIFunctionToolSchema=schemas.OpenAIFunctionToolSchema, ToolResponse=ToolResponse)
    _module(
        "verl.tools.function_tool",
        FUNCTION_TOOL_REGISTRY=FUNCTION_TOOL_REGISTRY,
        FunctionTool=FunctionTool,
        function_tool=function_tool,
        get_function_tool=get_function_tool,
        load_function_tools_from_path=load_function_tools_from_path,
        normalize_function_tool_return=normalize_function_tool_return,
    )
    _module("verl.utils.reward_score.gsm8k", extract_solution=gsm8k_extract_solution, compute_score=gsm8k_compute_score)
    if "verl.utils.rollout_trace" not in sys.modules:
        _module("verl.utils.rollout_trace", rollout_trace_op=_rollout_trace_op)


# ---------------------------------------------------------------------------------------------
# The tools shipped with main_ppo. They subclass whichever BaseTool is in use (verl's or the
# stand-in), so defining them waits until that is decided.
# ---------------------------------------------------------------------------------------------

_GSM8K_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer to the question"}},
            "required": ["answer"],
        },
    },
}

_SEARCH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches for relevant information based on queries.",
        "parameters": {
            "type": "object",
            "properties": {"query_list": {"type": "array", "items": {"type": "string"}, "description": "List of search queries"}},
            "required": ["query_list"],
        },
    },
}

_CODE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Runs Python 3 code in a sandbox and returns what it printed (standard output and standard error).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}

# Run inside the sandboxed interpreter before the user's code: sets the resource limits, blocks
# socket creation when asked to, then runs the code as __main__ with tracebacks that start at it.
_SANDBOX_PRELUDE = r'''
import resource, sys, traceback
_cpu, _mem, _fsize, _block = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
if _block:
    import socket as _socket

    class _NoNetwork(_socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in this sandbox")

    _socket.socket = _NoNetwork
_path = sys.argv[5]
sys.argv = sys.argv[5:]
with open(_path, encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
sys.excepthook = lambda t, v, tb: traceback.print_exception(t, v, tb.tb_next if tb else tb)
del _cpu, _mem, _fsize, _block, _f
exec(_code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
'''


def _unshare_works(unshare):
    try:
        done = subprocess.run([unshare, "-rn", sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30)
        return done.returncode == 0
    except Exception:  # noqa: BLE001 - not permitted here
        return False


def _positive(config, key, default, where):
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{where}: config `{key}` must be a positive number, got {value!r}")
    return value


def _search_api(url, queries, topk, timeout, retries):
    """POSTs the queries to a Search-R1 retrieval service, retrying server errors, connection
    errors and timeouts with a growing pause; returns (response JSON, error message)."""
    payload = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode("utf-8")
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    last_error = None
    for attempt in range(retries):
        retry = False
        try:
            req = urllib.request.Request(url, data=payload, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
            try:
                return json.loads(body), None
            except json.JSONDecodeError as exc:
                last_error = f"API Response JSON Decode Error: {exc}, Response: {body[:200]!r}"
                break
        except urllib.error.HTTPError as exc:
            if exc.code not in (500, 502, 503, 504):
                last_error = f"API Request Error: {exc}"
                break
            last_error = f"API Request Error: Server Error ({exc.code}) on attempt {attempt + 1}/{retries}"
            retry = True
        except (TimeoutError, urllib.error.URLError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            kind = "Timeout Error" if isinstance(reason, TimeoutError) else "Connection Error"
            last_error = f"{kind}: {exc}"
            retry = True
        except Exception as exc:  # noqa: BLE001
            last_error = f"Unexpected Error: {exc}"
            break
        if retry and attempt < retries - 1:
            time.sleep(attempt + 1)
    return None, ("API Call Failed: " + last_error) if last_error else "API Call Failed after retries"


def _passages_text(passages):
    """Retrieved passages as the model reads them; a passage's first line is its title."""
    out = ""
    for i, item in enumerate(passages):
        content = item["document"]["contents"]
        title, _, text = content.partition("\n")
        out += f"Doc {i + 1} (Title: {title})\n{text}\n\n"
    return out.strip()


def _search_batch(url, queries, topk, timeout, retries):
    """One retrieval request for all queries: (the JSON text the model sees, metadata)."""
    response, error = _search_api(url, queries, topk, timeout, retries)
    meta = {"query_count": len(queries), "api_request_error": error, "status": "unknown", "total_results": 0}
    if error:
        meta["status"] = "api_error"
        return json.dumps({"result": f"Search error: {error}"}, ensure_ascii=False), meta
    if not response:
        meta["status"] = "unknown_api_state"
        return json.dumps({"result": "Unknown API state (no response and no error message)."}, ensure_ascii=False), meta
    try:
        results = response.get("result", [])
        if not results:
            meta["status"] = "no_results"
            return json.dumps({"result": "No search results found."}, ensure_ascii=False), meta
        meta["total_results"] = sum(len(r) if isinstance(r, list) else 1 for r in results)
        meta["status"] = "success"
        text = "\n---\n".join(_passages_text(r) for r in results)
        return json.dumps({"result": text}, ensure_ascii=False), meta
    except Exception as exc:  # noqa: BLE001 - a response of an unexpected shape
        meta["status"] = "processing_error"
        meta["total_results"] = 0
        return json.dumps({"result": f"Error processing search results: {exc}"}, ensure_ascii=False), meta


def _define_shipped_tools():
    """Defines the shipped tool classes on the BaseTool in use; returns them by class_name."""
    Base = sys.modules["verl.tools.base_tool"].BaseTool
    schemas = sys.modules["verl.tools.schemas"]
    Schema, Response = schemas.OpenAIFunctionToolSchema, schemas.ToolResponse
    gsm8k = sys.modules["verl.utils.reward_score.gsm8k"]

    class Gsm8kTool(Base):
        """Scores a GSM8K answer against the row's ground truth (verl's demo tool): the reward
        text shows the parsed answer and its score; the step reward is 0.0 when the score went
        up within the instance and -0.05 otherwise."""

        def __init__(self, config, tool_schema=None):
            super().__init__(config, tool_schema or Schema.model_validate(_GSM8K_SCHEMA))
            self._instance_dict = {}

        async def create(self, instance_id=None, ground_truth=None, **kwargs):
            instance_id = instance_id or str(uuid4())
            if ground_truth is None:
                ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
            self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
            return instance_id, Response()

        async def execute(self, instance_id, parameters, **kwargs):
            answer = parameters.get("answer", "")
            if not isinstance(answer, str):
                answer = str(answer)
            state = self._instance_dict[instance_id]
            state["response"] = answer if answer.startswith("#### ") else "#### " + answer
            reward = await self.calc_reward(instance_id)
            tool_reward = 0.0 if reward > state["reward"] else -0.05
            state["reward"] = reward
            return Response(text=f"Current parsed {answer=} {reward=}"), tool_reward, {}

        async def calc_reward(self, instance_id, **kwargs):
            state = self._instance_dict[instance_id]
            return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0)

        async def release(self, instance_id, **kwargs):
            self._instance_dict.pop(instance_id, None)

    class SearchTool(Base):
        """Queries a Search-R1 style retrieval service (`retrieval_service_url`) and returns
        the top-k passages per query, formatted as verl's search tool does."""

        def __init__(self, config, tool_schema=None):
            super().__init__(config, tool_schema or Schema.model_validate(_SEARCH_SCHEMA))
            self.retrieval_service_url = config.get("retrieval_service_url")
            if not self.retrieval_service_url:
                raise ValueError(f"{type(self).__name__}: config `retrieval_service_url` is not set")
            self.topk = int(_positive(config, "topk", 3, "SearchTool"))
            self.timeout = _positive(config, "timeout", 30, "SearchTool")
            self.max_retries = int(_positive(config, "max_retries", 10, "SearchTool"))
            self._instance_dict = {}

        async def create(self, instance_id=None, **kwargs):
            instance_id = instance_id or str(uuid4())
            self._instance_dict[instance_id] = {"response": "", "reward": []}
            return instance_id, Response()

        async def execute(self, instance_id, parameters, **kwargs):
            queries = parameters.get("query_list")
            if not queries or not isinstance(queries, list):
                msg = "Error: 'query_list' is missing, empty, or not a list in parameters."
                return Response(text=json.dumps({"result": msg})), 0.0, {}
            try:
                text, meta = await asyncio.to_thread(
                    _search_batch, self.retrieval_service_url, queries, self.topk, self.timeout, self.max_retries
                )
            except Exception as exc:  # noqa: BLE001
                return Response(text=json.dumps({"result": f"Search execution failed: {exc}"})), 0.0, {"error": str(exc)}
            if instance_id in self._instance_dict:
                self._instance_dict[instance_id]["reward"].append(text.strip())
            return Response(text=text), 0.0, meta

        async def calc_reward(self, instance_id, **kwargs):
            return self._instance_dict.get(instance_id, {}).get("reward", [])

        async def release(self, instance_id, **kwargs):
            self._instance_dict.pop(instance_id, None)

    class CodeInterpreterTool(Base):
        """Runs the model's Python code in a fresh `python -I` process: CPU time, address space
        and file size limited (config `timeout_s`, `memory_mb`, `file_size_mb`), in a temporary
        working directory, without network (a user namespace with no network when `unshare -rn`
        works; otherwise creating a socket raises). Returns stdout and stderr together, with
        the exit status when the code failed."""

        def __init__(self, config, tool_schema=None):
            super().__init__(config, tool_schema or Schema.model_validate(_CODE_SCHEMA))
            name = type(self).__name__
            self.timeout_s = _positive(config, "timeout_s", 10, name)
            self.memory_mb = _positive(config, "memory_mb", 512, name)
            self.file_size_mb = _positive(config, "file_size_mb", 16, name)
            self.max_output_bytes = int(_positive(config, "max_output_bytes", 65536, name))
            mode = config.get("network_isolation", "auto")
            if mode not in ("auto", "unshare", "socket_shim"):
                raise ValueError(f"{name}: config `network_isolation` must be auto, unshare or socket_shim, got {mode!r}")
            unshare = shutil.which("unshare") if mode != "socket_shim" else None
            self._unshare = unshare if unshare and _unshare_works(unshare) else None
            if mode == "unshare" and self._unshare is None:
                raise ValueError(f"{name}: network_isolation is `unshare` but `unshare -rn` does not work on this machine")

        async def execute(self, instance_id, parameters, **kwargs):
            code = parameters.get("code")
            if not isinstance(code, str):
                return Response(text="Error: the `code` parameter must be a string."), 0.0, {}
            text, meta = await asyncio.to_thread(self._run, code)
            return Response(text=text), 0.0, meta

        def _run(self, code):
            with tempfile.TemporaryDirectory(prefix="main_ppo_code_") as work:
                with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                    f.write(code)
                prelude = os.path.join(work, ".prelude.py")
                with open(prelude, "w", encoding="utf-8") as f:
                    f.write(_SANDBOX_PRELUDE)
                out_path = os.path.join(work, ".output")
                rc, timed_out = self._spawn(work, prelude, out_path)
                with open(out_path, "rb") as f:
                    output = f.read(self.max_output_bytes + 1)
            return self._describe(output, rc, timed_out)

        def _spawn(self, work, prelude, out_path):
            cpu = max(1, math.ceil(self.timeout_s))
            limits = [str(cpu), str(int(self.memory_mb * 2**20)), str(int(self.file_size_mb * 2**20))]
            argv = [sys.executable, "-I", prelude, *limits, "0" if self._unshare else "1", os.path.join(work, "main.py")]
            if self._unshare:
                argv = [self._unshare, "-rn", *argv]
            env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8"}
            with open(out_path, "wb") as out:
                proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)
            try:
                return proc.wait(timeout=2 * self.timeout_s + 1), False
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait(), True

        def _describe(self, output, rc, timed_out):
            notes = []
            if len(output) > self.max_output_bytes:
                notes.append(f"[output truncated at {self.max_output_bytes} bytes]")
            if timed_out:
                notes.append(f"[killed: wall-clock limit of {2 * self.timeout_s + 1} s exceeded]")
            elif rc == -signal.SIGXCPU:
                notes.append(f"[killed: CPU time limit of {max(1, math.ceil(self.timeout_s))} s exceeded]")
            elif rc == -signal.SIGXFSZ:
                notes.append(f"[killed: file size limit of {self.file_size_mb} MB exceeded]")
            elif rc < 0:
                notes.append(f"[killed by signal {signal.Signals(-rc).name}]")
            elif rc != 0:
                notes.append(f"[exit status {rc}]")
            text = output[: self.max_output_bytes].decode("utf-8", errors="replace")
            if notes:
                text = "\n".join(([text.rstrip("\n")] if text else []) + notes)
            return text, {"exit_status": rc, "timed_out": timed_out}

    for cls in (Gsm8kTool, SearchTool, CodeInterpreterTool):
        cls.__module__ = "main_ppo.tools"
    _module("main_ppo", package=True)
    _module("main_ppo.tools", Gsm8kTool=Gsm8kTool, SearchTool=SearchTool, CodeInterpreterTool=CodeInterpreterTool)
    if "verl.tools.gsm8k_tool" not in sys.modules:
        _module("verl.tools.gsm8k_tool", Gsm8kTool=Gsm8kTool)
    if "verl.tools.search_tool" not in sys.modules:
        _module("verl.tools.search_tool", SearchTool=SearchTool)
    # verl's own GSM8K and search tool classes always resolve to these: verl 1dda039 no longer
    # ships them, and the older search tool needs Ray, which a tool worker does not run.
    return {
        "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool,
        "verl.tools.search_tool.SearchTool": SearchTool,
        "main_ppo.tools.Gsm8kTool": Gsm8kTool,
        "main_ppo.tools.SearchTool": SearchTool,
        "main_ppo.tools.CodeInterpreterTool": CodeInterpreterTool,
    }


# ---------------------------------------------------------------------------------------------
# Interactions: a scripted user (verl b178a3c's `verl.interactions`; gone from verl 1dda039).
# ---------------------------------------------------------------------------------------------


class BaseInteraction:
    """Stand-in for verl's `verl.interactions.base.BaseInteraction` when verl does not provide
    it: the config and name, and verl's defaults for each coroutine a subclass overrides."""

    def __init__(self, config):
        self.config = config
        self.name = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id=None, **kwargs):
        return uuid.uuid4().hex if instance_id is None else instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self):
        return 0.0

    async def finalize_interaction(self):
        return None


def _interaction_base():
    """verl's interaction base class when verl has it, else the stand-in above (entered under
    verl's module name so that user files importing it load)."""
    try:
        return importlib.import_module("verl.interactions.base").BaseInteraction
    except Exception:  # noqa: BLE001 - verl 1dda039 and later, or no verl
        pass
    BaseInteraction.__module__ = "verl.interactions.base"
    for name in ("verl", "verl.interactions"):
        if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
            _module(name, package=True)
    _module("verl.interactions.base", BaseInteraction=BaseInteraction)
    return BaseInteraction


def _define_shipped_interactions():
    """The shipped interaction classes by class_name (verl's GSM8K interaction always resolves
    to this one)."""
    Base = _interaction_base()
    gsm8k = sys.modules["verl.utils.reward_score.gsm8k"]

    class Gsm8kInteraction(Base):
        """A GSM8K user: the latest assistant message is scored strictly against the row's
        ground truth (`interaction_kwargs.ground_truth`); a score of 1.0 ends the conversation
        with "Your response is correct!", any other asks the model to reflect and try again."""

        def __init__(self, config):
            super().__init__(config)
            self._instance_dict = {}

        async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
            if instance_id is None:
                instance_id = uuid.uuid4().hex
            self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
            return instance_id

        async def generate_response(self, instance_id, messages, **kwargs):
            content = ""
            for m in reversed(messages):
                if m.get("role") == "assistant":
                    content = m.get("content")
                    break
            self._instance_dict[instance_id]["response"] = content
            reward = await self.calculate_score(instance_id)
            if reward == 1.0:
                return True, "Your response is correct!", reward, {}
            return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

        async def calculate_score(self, instance_id, **kwargs):
            state = self._instance_dict[instance_id]
            return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0, score=1.0)

        async def finalize_interaction(self, instance_id, **kwargs):
            self._instance_dict.pop(instance_id, None)

    Gsm8kInteraction.__module__ = "main_ppo.interactions"
    if "main_ppo" not in sys.modules:
        _module("main_ppo", package=True)
    _module("main_ppo.interactions", Gsm8kInteraction=Gsm8kInteraction)
    if "verl.interactions.gsm8k_interaction" not in sys.modules:
        _module("verl.interactions.gsm8k_interaction", Gsm8kInteraction=Gsm8kInteraction)
    return {
        "verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
        "main_ppo.interactions.Gsm8kInteraction": Gsm8kInteraction,
    }


def load_interactions(msg, shipped):
    """Instantiates the configured interactions as verl's registry does (the name from the
    entry, else the class name without `Interaction`, lower-cased; `config` gets the name);
    returns {name: interaction}."""
    config_path = msg.get("interaction_config_path")
    dirs = [os.path.dirname(os.path.abspath(config_path))] if config_path else []
    sys.path.extend(d for d in dirs if d not in sys.path)
    out = {}
    for i, entry in enumerate(msg.get("interactions") or []):
        where = f"{config_path}: interaction[{i}] ({entry.get('class_name')})"
        name = entry["name"]
        if name in out:
            raise LoadError(where, ValueError(f"the interaction name '{name}' is used twice; each interaction needs its own name"))
        try:
            cls = tool_class(entry["class_name"], shipped, dirs)
            config = dict(entry.get("config") or {})
            config["name"] = name
            out[name] = cls(config=config)
        except Exception as exc:  # noqa: BLE001
            raise LoadError(where, exc) from exc
    return out


async def run_interaction(interactions, msg):
    """One interaction turn: (text, reward, metrics, error, end of the conversation). An
    exception, or an answer that is not (bool, text, number or None, dict), ends the
    conversation with the error named."""
    name, instance = msg.get("name", ""), msg.get("instance")
    kwargs = msg.get("kwargs") or {}
    if name not in interactions:
        return "", None, {}, f"no interaction named '{name}' (configured: {list(interactions)})", True
    it = interactions[name]
    try:
        if msg.get("first"):
            await it.start_interaction(instance, **kwargs)
        answer = await it.generate_response(instance, msg.get("messages") or [], **kwargs)
        end, text, reward, metrics = answer
        reward = None if reward is None else float(reward)
    except Exception as exc:  # noqa: BLE001 - the conversation ends, the error is reported
        traceback.print_exc()
        return "", None, {}, f"interaction '{name}' raised {type(exc).__name__}: {exc}", True
    return ("" if text is None else str(text)), reward, (metrics if isinstance(metrics, dict) else {}), None, bool(end)


async def finalize_interaction(interactions, msg):
    """Ends an instance (verl's agent loop never does; its GSM8K interaction would keep every
    conversation's state). A finalize_interaction without parameters is called without the id."""
    it = interactions.get(msg.get("name", ""))
    if it is None:
        return None
    try:
        params = inspect.signature(it.finalize_interaction).parameters
        if params:
            await it.finalize_interaction(msg.get("instance"))
        else:
            await it.finalize_interaction()
    except Exception as exc:  # noqa: BLE001
        return f"interaction '{msg.get('name')}': finalize_interaction raised {type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------
# Loading the configured tools and running calls.
# ---------------------------------------------------------------------------------------------


class LoadError(Exception):
    def __init__(self, where, exc):
        super().__init__(f"{where}: {type(exc).__name__}: {exc}")
        self.where, self.exc = where, exc


def _load_file_module(path, dirs):
    """The module in the file `path` (relative paths: the working directory, then `dirs`)."""
    candidates = [path] if os.path.isabs(path) else [path] + [os.path.join(d, path) for d in dirs]
    found = next((p for p in candidates if os.path.isfile(p)), None)
    if found is None:
        raise FileNotFoundError(f"tool module file not found: {path} (looked in: {', '.join(map(os.path.abspath, candidates))})")
    found = os.path.abspath(found)
    mod_name = "main_ppo_tool_" + re.sub(r"\W", "_", found)
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, found)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def tool_class(class_name, shipped, dirs):
    """The class `class_name` names: a shipped tool, `package.module.Class` importable from
    sys.path, or `path/to/file.py.Class`."""
    if class_name in shipped:
        return shipped[class_name]
    module_name, _, attr = class_name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"class_name `{class_name}` is not of the form `package.module.Class`")
    if module_name.endswith(".py"):
        module = _load_file_module(module_name, dirs)
    else:
        module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise AttributeError(f"module `{module_name}` has no attribute `{attr}`")
    return getattr(module, attr)


def load_tools(msg, shipped):
    """Instantiates the configured tools, then the function tools; returns {name: tool} in
    that order."""
    config_path = msg.get("tool_config_path")
    dirs = [os.path.dirname(os.path.abspath(config_path))] if config_path else []
    sys.path.extend(d for d in dirs if d not in sys.path)
    Schema = sys.modules["verl.tools.schemas"].OpenAIFunctionToolSchema
    tools, origin = {}, {}
    for i, entry in enumerate(msg.get("tools") or []):
        where = f"{config_path}: tools[{i}] ({entry.get('class_name')})"
        try:
            cls = tool_class(entry["class_name"], shipped, dirs)
            raw = entry.get("tool_schema")
            schema = None if raw is None else Schema.model_validate(raw)
            tool = cls(config=entry.get("config") or {}, tool_schema=schema)
            name = tool.name
        except Exception as exc:  # noqa: BLE001
            raise LoadError(where, exc) from exc
        if name in tools:
            raise LoadError(where, ValueError(f"the tool name '{name}' is already used by {origin[name]}; tool names must be unique"))
        tools[name], origin[name] = tool, where
    path = msg.get("function_tool_path")
    if path:
        try:
            loaded = sys.modules["verl.tools.function_tool"].load_function_tools_from_path(path)
        except Exception as exc:  # noqa: BLE001
            raise LoadError(f"function_tool_path {path}", exc) from exc
        collisions = sorted(t.name for t in loaded if t.name in tools)
        if collisions:
            raise LoadError(
                f"function_tool_path {path}",
                ValueError(
                    f"Function tool name(s) {collisions} collide with tools already declared in "
                    f"'{config_path}'. Each tool name must be unique across `tool_config_path` "
                    f"and `function_tool_path`; rename one of them."
                ),
            )
        for t in loaded:
            tools[t.name] = t
    return tools


def schema_of(tool):
    return tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)


async def run_call(tools, function_tool_cls, name, arguments, create_kwargs):
    """One tool call as verl's agent loop makes it: (text, reward, metrics, error)."""
    if name not in tools:
        return f"Unknown function '{name}'. Available tools: {list(tools)}", 0.0, {}, None
    try:
        args = json.loads(arguments)
    except (json.JSONDecodeError, TypeError) as exc:
        return f"Invalid JSON in arguments for '{name}': {exc}", 0.0, {}, None
    if not isinstance(args, dict):
        # An array or a bare value: said as such to the model, where calling the tool with it
        # would show the model a Python error about mappings.
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(args), "a number")
        return (
            f"Invalid arguments for '{name}': expected a JSON object of parameter names and values, got {kind}",
            0.0,
            {},
            None,
        )
    tool = tools[name]
    try:
        if isinstance(tool, function_tool_cls):
            normalize = sys.modules["verl.tools.function_tool"].normalize_function_tool_return
            response, reward, metrics = normalize(await tool.call(args))
        else:
            instance_id = None
            try:
                instance_id, _ = await tool.create(create_kwargs=create_kwargs)
                response, reward, metrics = await tool.execute(instance_id, args)
            finally:
                if instance_id:
                    await tool.release(instance_id)
        text = response if isinstance(response, str) else getattr(response, "text", None)
        reward = None if reward is None else float(reward)
    except Exception as exc:  # noqa: BLE001 - shown to the model, as verl does
        traceback.print_exc()
        return f"Error executing tool '{name}': {exc}", 0.0, {}, f"tool '{name}' raised {type(exc).__name__}: {exc}"
    text = "" if text is None else str(text)
    return text, reward, (metrics if isinstance(metrics, dict) else {}), None


def call_reply(req_id, name, result, limit):
    """The reply line for a call's result, or an error line when the text is over `limit`
    bytes (UTF-8)."""
    text, reward, metrics, error = result
    size = len(text.encode("utf-8", errors="replace"))
    if limit is None:
        return encode({"id": req_id, "text": text, "reward": reward, "metrics": metrics, "error": error})
    if size > limit:
        return encode(
            {
                "id": req_id,
                "text": f"Error executing tool '{name}': output too large",
                "reward": None,
                "metrics": {},
                "error": f"tool '{name}' returned {size} bytes, over the {limit}-byte limit",
            }
        )
    line = encode({"id": req_id, "text": text, "reward": reward, "metrics": metrics, "error": error})
    if len(line) > limit + 65536:  # the metrics, then
        return encode(
            {
                "id": req_id,
                "text": f"Error executing tool '{name}': output too large",
                "reward": None,
                "metrics": {},
                "error": f"tool '{name}' returned metrics of {len(line) - size} bytes, over the limit",
            }
        )
    return line


def main():
    tools, limit, interactions = None, 1 << 20, {}
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    for line in _requests:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "load":
            try:
                if not _real_verl_usable():
                    _install_verl_shims()
                shipped = _define_shipped_tools()
                interactions = load_interactions(msg, _define_shipped_interactions()) if msg.get("interactions") else {}
                # null: no limit (multi_turn.max_tool_output_bytes null or 0, as verl reads limits)
                limit = msg.get("max_output_bytes", limit)
                limit = None if limit is None else int(limit)
                tools = load_tools(msg, shipped)
                schemas = [schema_of(t) for t in tools.values()]
                send_line(encode({"ok": True, "schemas": schemas, "names": list(tools), "interactions": list(interactions)}))
            except BaseException as exc:  # noqa: BLE001 - reported to main_ppo
                where = exc.where if isinstance(exc, LoadError) else None
                cause = exc.exc if isinstance(exc, LoadError) else exc
                send_line(encode({"ok": False, "where": where, "error": f"{type(cause).__name__}: {cause}", "traceback": traceback.format_exc()}))
        elif op == "call":
            req_id, name = msg["id"], msg.get("name", "")
            # Accepted before the tool runs: a worker that ends before this line never ran the
            # call, and main_ppo sends it again to a new worker.
            send_line(encode({"id": req_id, "accepted": True}))
            fn_cls = sys.modules["verl.tools.function_tool"].FunctionTool
            kwargs = msg.get("create_kwargs") or {}
            result = loop.run_until_complete(run_call(tools or {}, fn_cls, name, msg.get("arguments"), kwargs))
            send_line(call_reply(req_id, name, result, limit))
        elif op == "interact":
            req_id = msg["id"]
            send_line(encode({"id": req_id, "accepted": True}))
            text, reward, metrics, error, end = loop.run_until_complete(run_interaction(interactions, msg))
            if limit is not None and len(text.encode("utf-8", errors="replace")) > limit:
                text, error, end = "", f"interaction '{msg.get('name')}' answered with over {limit} bytes", True
            send_line(encode({"id": req_id, "text": text, "reward": reward, "metrics": metrics, "error": error, "terminate": end}))
        elif op == "finalize":
            req_id = msg["id"]
            send_line(encode({"id": req_id, "accepted": True}))
            error = loop.run_until_complete(finalize_interaction(interactions, msg))
            send_line(encode({"id": req_id, "text": "", "reward": None, "metrics": {}, "error": error, "terminate": True}))
        elif op == "quit":
            return  # main_ppo ends the process group once this worker has exited
    _orphaned()  # the requests ended without `quit`: main_ppo is gone


main()
