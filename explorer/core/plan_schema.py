"""The plan file's schema: the constants a plan may hold and the declarative checks that a
plan file, untrusted input, passes before anything else reads it (types, ranges and what a name
may be made of); a damaged or hostile file fails here with a :class:`PlanError`."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from explorer.core.errors import PlanError
from explorer.core.factory import FACTORY_PATTERN
from explorer.core.limits import MAX_BATCH_SIZE, MAX_DEVICES

#: bytes of optimizer state per byte of trainable parameters (torch.optim defaults)
OPTIMIZER_STATE = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

PLAN_FORMAT = "partition-explorer-plan"
#: 2 adds per-stage memory settings (``stage_settings``) and model factories, 3 the stages'
#: tensor-parallel degree (``tensor``); a plan is written with the lowest version that holds
#: what it uses, so files older explorers can read stay readable by them
PLAN_VERSION = 5
MEMORY_VERSION = 2
TENSOR_VERSION = 3
#: interleaved 1F1B: each stage holds several chunks of the layers (virtual stages)
INTERLEAVED = "interleaved-1f1b"
#: 4 adds the interleaved 1F1B schedule
INTERLEAVED_VERSION = 4
#: 5 adds async tensor parallelism (``async_tensor``) and context parallelism (``context``)
ASYNC_TENSOR_VERSION = 5
SCHEDULES = ("gpipe", "1f1b", INTERLEAVED)
#: ZeRO stages over a stage's replicas: 0 replicate everything, 1 shard the optimizer state,
#: 2 also the gradients, 3 also the weights (FSDP's full sharding)
ZERO_STAGES = (0, 1, 2, 3)
#: activation recomputation: none, selective (cheap ops recomputed, their outputs not kept),
#: full (only each module's inputs kept; its forward runs again in the backward)
RECOMPUTE = ("none", "selective", "full")
#: compute precision; bf16 and fp16 keep fp32 master weights, fp16 adds loss scaling
PRECISIONS = ("fp32", "bf16", "fp16")

#: device ids, the algorithm and the graph fingerprint: names, never text
NAME_PATTERN = r"[A-Za-z0-9_.:+/-]{1,128}"
#: the graph's name is a label ("layered-1200 (24 groups)"), possibly empty: one line of
#: printable text, never control characters
GRAPH_NAME_PATTERN = r"[^\x00-\x1f\x7f-\x9f]{0,256}"
MAX_MICRO_BATCHES = 1024
MAX_TEXT_CHARS = 100_000  # a node name, pin or note
MAX_JSON_DEPTH = 32  # nesting of the algorithm's options
MAX_PLAN_BYTES = 256 * 2**20

# -- the schema: each check takes (value, where) and returns the value or raises PlanError ----
Check = Callable[[Any, str], Any]
REQUIRED = object()


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(where: str, what: str, value: Any) -> PlanError:
    return PlanError(f"plan field {where} must be {what}, not {shown(value)}")


def whole(lo: int, hi: int) -> Check:
    def check(v: Any, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise _refuse(where, f"a whole number >= {lo} and <= {hi}", v)
        return v
    return check


def all_whole(lo: int, hi: int) -> Callable[[Collection[Any]], bool]:
    """Whether every value is a plain ``int`` from ``lo`` to ``hi``: a quick test that what
    ``whole(lo, hi)`` checks one by one holds for a large collection (False says nothing)."""
    def test(values: Collection[Any]) -> bool:
        return set(map(type, values)) <= {int} and (not values or (
            lo <= min(values) and max(values) <= hi))
    return test


def matching(pattern: str, what: str) -> Check:
    rx = re.compile(pattern)

    def check(v: Any, where: str) -> str:
        if not isinstance(v, str) or not rx.fullmatch(v):
            raise _refuse(where, what, v)
        return v
    return check


def one_of(choices: Iterable[str]) -> Check:
    choices = tuple(choices)

    def check(v: Any, where: str) -> str:
        if not isinstance(v, str) or v not in choices:
            raise PlanError(f"unknown {where} {shown(v)}; choose one of {', '.join(choices)}")
        return v
    return check


def boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise _refuse(where, "true or false", v)
    return v


def string(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) > MAX_TEXT_CHARS:
        raise _refuse(where, f"a string of at most {MAX_TEXT_CHARS} characters", v)
    return v


def json_value(v: Any, where: str, depth: int = 0) -> Any:
    """Any JSON value nested at most ``MAX_JSON_DEPTH`` deep (the algorithm's options)."""
    if depth > MAX_JSON_DEPTH:
        raise _refuse(where, f"nested at most {MAX_JSON_DEPTH} deep", "...")
    if isinstance(v, list):
        return [json_value(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {string(k, f"key of {where}"): json_value(x, f"{where}[{k!r}]", depth + 1)
                for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise _refuse(where, "a JSON value", v)


def list_of(item: Check, lo: int, hi: int) -> Check:
    def check(v: Any, where: str) -> list:
        if not isinstance(v, list) or not lo <= len(v) <= hi:
            raise _refuse(where, f"a list of {lo} to {hi} items", v)
        return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
    return check


def map_of(item: Check, items_pass: Callable[[Collection[Any]], bool] | None = None) -> Check:
    """An object of strings to ``item`` s. ``items_pass`` (a quick test of all the values at
    once, such as :func:`all_whole`) spares a large object the check of each item where
    every key is a plain short string and the test passes; otherwise each is checked."""
    def check(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise _refuse(where, "an object", v)
        if items_pass is not None and set(map(type, v)) <= {str} and items_pass(v.values()) \
                and max(map(len, v), default=0) <= MAX_TEXT_CHARS:
            return dict(v)
        return {string(k, f"a key of {where}"): item(x, f"{where}[{k!r}]") for k, x in v.items()}
    return check


def obj(fields: Mapping[str, tuple[Check, Any]]) -> Check:
    """An object with these fields (check, default or ``REQUIRED``); others are ignored."""
    def check(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise _refuse(where, "an object", v)
        out = {}
        for name, (item, default) in fields.items():
            inner = f"{where}.{name}" if where else name
            if name in v:
                out[name] = item(v[name], inner)
            elif default is REQUIRED:
                raise PlanError(f"the plan is damaged: field {inner!r} is missing; export the "
                                "plan again")
            else:
                out[name] = copy.deepcopy(default)  # never one shared {} or []
        return out
    return check


_name = matching(NAME_PATTERN, "a name of 1 to 128 letters, digits or _ . : + / -")

_builtin_record = obj({"builtin": (_name, REQUIRED), "size": (_name, REQUIRED),
                       "batch_size": (whole(1, MAX_BATCH_SIZE), REQUIRED)})
_factory_record = obj({"factory": (matching(FACTORY_PATTERN, "a function name of the form "
                                            "module:function"), REQUIRED)})


def model_record(v: Any, where: str) -> dict:
    """How a model is built: ``{"builtin", "size", "batch_size"}`` or ``{"factory"}``."""
    if isinstance(v, dict) and "factory" in v:
        if "builtin" in v:
            raise PlanError(f"plan field {where} names both a built-in model and a factory; "
                            "keep one")
        return _factory_record(v, where)
    return _builtin_record(v, where)


#: every field of a plan file (format and version are checked first, by ``from_dict``)
PLAN_SCHEMA = obj({
    "graph": (obj({"fingerprint": (_name, REQUIRED),
                   "name": (matching(GRAPH_NAME_PATTERN, "one line of at most 256 printable "
                                     "characters"), "")}), REQUIRED),
    "stages": (list_of(list_of(_name, 1, MAX_DEVICES), 1, MAX_DEVICES), REQUIRED),
    "placement": (map_of(whole(0, MAX_DEVICES - 1), all_whole(0, MAX_DEVICES - 1)), REQUIRED),
    "micro_batches": (whole(1, MAX_MICRO_BATCHES), 1),
    "schedule": (one_of(SCHEDULES), "gpipe"),
    "optimizer": (one_of(OPTIMIZER_STATE), "adam"),
    "algorithm": (_name, "manual"),
    "options": (map_of(json_value), {}),
    "pinned": (list_of(string, 0, 2**31), []),
    "notes": (list_of(string, 0, 2**31), []),
    # how the graph's model is built: a built-in one (``explorer plan``) or, version 2, the
    # user's factory function
    "model": (model_record, None),
    # version 2: memory settings per stage (absent: the defaults)
    "stage_settings": (list_of(obj({"zero": (whole(0, 3), 0),
                                    "recompute": (one_of(RECOMPUTE), "none"),
                                    "precision": (one_of(PRECISIONS), "fp32"),
                                    # version 3: the stage's tensor-parallel degree
                                    "tensor": (whole(1, MAX_DEVICES), 1),
                                    # version 3: sequence parallelism with it
                                    "sequence": (boolean, False),
                                    # version 5: async tensor parallelism with it
                                    "async_tensor": (boolean, False),
                                    # version 5: the stage's context-parallel degree
                                    "context": (whole(1, MAX_DEVICES), 1)}),
                               0, MAX_DEVICES), []),
})


