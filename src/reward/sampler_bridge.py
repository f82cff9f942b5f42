# main_ppo sampler worker: builds the user's sampler class (verl's `data.sampler.class_path` and
# `class_name`) over the training rows and answers requests read as JSON lines on descriptor 3
# with one JSON line each on descriptor 4. Shipped inside the main_ppo binary and run as
# `python3 -u -c <this file>` after orphan_watch.py and bridge_base.py (_requests, _proto), with
# stdin /dev/null and stdout and stderr into main_ppo's log.
#
# Requests: load (build the sampler), epoch (`iter(sampler)`), take (the next indices of the
# epoch), update (a curriculum sampler's `update(batch=...)` after a step), save and restore
# (the position a checkpoint keeps, torchdata's rules), quit.
import base64
import importlib
import importlib.util
import json
import operator
import os
import pickle
import sys
import traceback

_PKG = "pkg://"
_FILE = "file://"


def send(obj):
    _proto.write(json.dumps(obj, default=str) + "\n")
    _proto.flush()


def failure(exc):
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def load_module(path):
    # verl's `load_module`: `pkg://a.b.c` (or `pkg://a/b/c`) is imported by name; anything else
    # (optionally `file://`) is a file executed as a fresh module.
    if path.startswith(_PKG):
        return importlib.import_module(path[len(_PKG):].replace("/", "."))
    if path.startswith(_FILE):
        path = path[len(_FILE):]
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"sampler file not found: {path}")
    name = "main_ppo_sampler_" + str(abs(hash(path)))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # importable by name, so pickling its objects works
    sys.path.insert(0, os.path.dirname(path))
    spec.loader.exec_module(module)
    return module


def verl_bases():
    # verl's interfaces when verl is importable (with torch); otherwise None and any class with
    # __iter__ and __len__ is taken as a sampler.
    try:
        from verl.experimental.dataset.sampler import AbstractCurriculumSampler, AbstractSampler
    except Exception:  # noqa: BLE001 - verl, torch or omegaconf missing
        return None
    return AbstractSampler, AbstractCurriculumSampler


class RowDataset:
    """The training data as the sampler sees it: `len()` rows, `dataset[i]` the row's dict."""

    def __init__(self, rows):
        self._rows = rows

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, index):
        return self._rows[operator.index(index)]

    def __iter__(self):
        return iter(self._rows)


def data_config_of(data):
    # verl passes `config.data`, an OmegaConf DictConfig; a plain dict when omegaconf is missing.
    try:
        from omegaconf import OmegaConf

        return OmegaConf.create(data)
    except ImportError:
        return data


def is_stateful(obj):
    # torchdata's `Stateful` protocol: both methods present.
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def pickled(obj):
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def unpickled(text):
    return pickle.loads(base64.b64decode(text))


class Worker:
    def __init__(self):
        self.sampler = None
        self.curriculum = False
        self.iterator = None
        # `iter()` calls so far and indices taken from the newest iterator.
        self.epochs = 0
        self.yielded = 0

    def load(self, msg):
        module = load_module(msg["path"])
        name = msg["name"]
        if not hasattr(module, name):
            classes = [n for n in dir(module) if isinstance(getattr(module, n), type) and not n.startswith("_")]
            raise AttributeError(f"{msg['path']} has no class `{name}` (it defines: {', '.join(classes) or 'no class'})")
        cls = getattr(module, name)
        if not isinstance(cls, type):
            raise TypeError(f"`{name}` in {msg['path']} is a {type(cls).__name__}, not a class")
        rows = RowDataset(msg["rows"])
        sampler = cls(data_source=rows, data_config=data_config_of(msg["data_config"]))
        bases = verl_bases()
        if bases is not None:
            if not isinstance(sampler, bases[0]):
                raise TypeError(f"`{name}` is not a subclass of verl's AbstractSampler (verl.experimental.dataset.sampler), as verl requires")
            self.curriculum = isinstance(sampler, bases[1])
        else:
            missing = [m for m in ("__iter__", "__len__") if not callable(getattr(type(sampler), m, None))]
            if missing:
                raise TypeError(f"`{name}` is not a sampler: it has no {' and no '.join(missing)} (a sampler iterates over dataset indices and has a length)")
            self.curriculum = callable(getattr(sampler, "update", None))
        length = operator.index(len(sampler))
        self.sampler = sampler
        return {"ok": True, "len": length, "curriculum": self.curriculum, "stateful": is_stateful(sampler),
                "verl": bases is not None}

    def epoch(self, msg):
        self.iterator = iter(self.sampler)
        self.epochs += 1
        self.yielded = 0
        return {"ok": True}

    def take(self, msg):
        out = []
        for _ in range(msg["n"]):
            try:
                value = next(self.iterator)
            except StopIteration:
                return {"ok": True, "indices": out, "ended": True}
            self.yielded += 1
            if isinstance(value, bool):
                raise TypeError(f"the sampler yielded {value!r} (a bool) as index {self.yielded - 1} of epoch {self.epochs}; it must yield integer dataset indices")
            try:
                out.append(operator.index(value))
            except TypeError:
                # a 0-d tensor or array holding an integer
                item = getattr(value, "item", None)
                v = item() if callable(item) else value
                if isinstance(v, bool) or not isinstance(v, int):
                    raise TypeError(f"the sampler yielded {value!r} ({type(value).__name__}) as index {self.yielded - 1} of epoch {self.epochs}; it must yield integer dataset indices") from None
                out.append(v)
        return {"ok": True, "indices": out, "ended": False}

    def update(self, msg):
        self.sampler.update(batch=StepData(msg["batch"], msg["non_tensor_batch"], msg["meta_info"]))
        return {"ok": True}

    def save(self, msg):
        # torchdata's StatefulDataLoader: a Stateful sampler (and iterator) keeps its own state;
        # otherwise the position is the count of indices taken (and, here, of epochs begun).
        state = {"epochs": self.epochs, "yielded": self.yielded}
        if is_stateful(self.sampler):
            state["sampler_state"] = pickled(self.sampler.state_dict())
        if self.iterator is not None and is_stateful(self.iterator):
            state["iter_state"] = pickled(self.iterator.state_dict())
        return {"ok": True, "state": state}

    def restore(self, msg):
        state = msg["state"]
        epochs, yielded = state["epochs"], state["yielded"]
        if "sampler_state" in state:
            self.sampler.load_state_dict(unpickled(state["sampler_state"]))
        elif epochs > 1:
            # Not Stateful: the epochs before are drawn again so that a sampler whose order
            # depends on how many epochs it has served (a seeded generator it advances) continues
            # as the uninterrupted run did.
            for _ in range(epochs - 1):
                for _ in iter(self.sampler):
                    pass
        self.epochs, self.yielded, self.iterator = max(epochs - 1, 0), 0, None
        if epochs == 0:
            return {"ok": True}
        self.epoch({})
        if "iter_state" in state and is_stateful(self.iterator):
            self.iterator.load_state_dict(unpickled(state["iter_state"]))
        if not ("sampler_state" in state or "iter_state" in state):
            for _ in range(yielded):
                try:
                    next(self.iterator)
                except StopIteration:
                    break
        self.yielded = yielded
        return {"ok": True}


def _array(spec):
    # One tensor of the step: raw little-endian values (base64) of `dtype` and `shape`, as a
    # torch tensor when torch is importable, else a numpy array, else nested lists.
    raw = base64.b64decode(spec["data"])
    dtype, shape = spec["dtype"], spec["shape"]
    try:
        import numpy as np

        arr = np.frombuffer(raw, dtype={"int32": "<i4", "float32": "<f4"}[dtype]).reshape(shape)
        arr = arr.astype(np.int64) if dtype == "int32" else arr.copy()
        try:
            import torch

            return torch.from_numpy(arr)
        except ImportError:
            return arr
    except ImportError:
        import array

        flat = array.array("i" if dtype == "int32" else "f")
        flat.frombytes(raw)
        if sys.byteorder != "little":
            flat.byteswap()
        values = flat.tolist()
        width = shape[1] if len(shape) == 2 else len(values)
        return [values[r * width:(r + 1) * width] for r in range(shape[0])] if len(shape) == 2 else values


def _column(values):
    try:
        import numpy as np

        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    except ImportError:
        return list(values)


class StepData:
    """The step's data as verl's `DataProto` holds it when the trainer calls `update`: `batch`
    (tensors by name), `non_tensor_batch` (one object array per column), `meta_info`."""

    def __init__(self, batch, non_tensor_batch, meta_info):
        self.batch = {k: _array(v) for k, v in batch.items()}
        self.non_tensor_batch = {k: _column(v) for k, v in non_tensor_batch.items()}
        self.meta_info = meta_info

    def __len__(self):
        for v in self.non_tensor_batch.values():
            return len(v)
        return 0


def main():
    worker = Worker()
    for line in _requests:
        msg = json.loads(line)
        op = msg.get("op")
        if op == "quit":
            return  # main_ppo ends the process group once this worker has exited
        handler = getattr(worker, op, None) if op in ("load", "epoch", "take", "update", "save", "restore") else None
        if handler is None:
            send({"ok": False, "error": f"unknown request {op!r}", "traceback": ""})
            continue
        try:
            send(handler(msg))
        except BaseException as exc:  # noqa: BLE001 - reported to main_ppo
            send(failure(exc))
    _orphaned()  # the requests ended without `quit`: main_ppo is gone


main()
