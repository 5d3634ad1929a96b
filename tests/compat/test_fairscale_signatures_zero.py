"""ZeRO-1/2 keeps fairscale 0.4.13's call signatures: OSS, ShardedDataParallel, ShardedGradScaler, GradScaler.

The expected signatures are written down here as data (from fairscale 0.4.13's API), so the test needs no
fairscale. A call written for fairscale must bind to ours with the same meaning: same parameter names in the
same positional order with the same defaults, ``*args``/``**kwargs`` where fairscale has them. Parameters we add
must come after fairscale's and be optional, so they can never capture a fairscale argument.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import pytest
import torch

REQUIRED = object()  # marks a parameter without default
ARGS, KWARGS = "*", "**"  # expected variadic parameters: ("*", "args") / ("**", "kwargs"), any name

Expected = list[tuple[str, Any]]

OSS_METHODS: dict[str, Expected] = {
    "__init__": [
        ("params", REQUIRED),
        ("optim", torch.optim.SGD),
        ("group", None),
        ("broadcast_buffer_size", -1),
        ("broadcast_fp16", False),
        ("force_broadcast_object", False),
        (KWARGS, "default"),
    ],
    "consolidate_state_dict": [("recipient_rank", 0)],
    "clip_grad_norm": [("max_norm", REQUIRED), ("norm_type", 2.0), ("filter_params_fn", None)],
    "step": [("closure", None), (KWARGS, "kwargs")],
    "add_param_group": [("param_group", REQUIRED)],
    "refresh_trainable": [],
    "load_state_dict": [("state_dict", REQUIRED)],
    "state_dict": [("all_ranks", False)],
    "partition_parameters": [],
    "zero_grad": [("set_to_none", True)],
}

SDP_METHODS: dict[str, Expected] = {
    "__init__": [
        ("module", REQUIRED),
        ("sharded_optimizer", REQUIRED),
        ("process_group", None),
        ("broadcast_buffers", True),
        ("sync_models_at_startup", True),
        ("reduce_buffer_size", 8388608),
        ("auto_refresh_trainable", True),
        ("reduce_fp16", False),
        ("warn_on_trainable_params_changed", True),
    ],
    "forward": [(ARGS, "inputs"), (KWARGS, "kwargs")],
    "reduce": [],
    "sync_buffers": [("blocking", False)],
    "no_sync": [],
    "refresh_trainable": [],
    "zero_grad": [("set_to_none", False)],
}

_SCALER_ARGS: Expected = [
    ("init_scale", 65536.0),
    ("growth_factor", 2.0),
    ("backoff_factor", 0.5),
    ("growth_interval", 2000),
    ("enabled", True),
]

SHARDED_SCALER_METHODS: dict[str, Expected] = {
    "__init__": [*_SCALER_ARGS, ("process_group", None)],
    "scale": [("outputs", REQUIRED)],
    "unscale_": [("optimizer", REQUIRED)],
    "step": [("optimizer", REQUIRED), (ARGS, "args"), (KWARGS, "kwargs")],
    "update": [("new_scale", None)],
}

GRAD_SCALER_METHODS: dict[str, Expected] = {"__init__": list(_SCALER_ARGS)}

#: fairscale import path -> (shardkit module, class name, expected methods).
CLASSES: dict[str, tuple[str, str, dict[str, Expected]]] = {
    "fairscale.optim.oss.OSS": ("shardkit.optim.oss", "OSS", OSS_METHODS),
    "fairscale.nn.data_parallel.sharded_ddp.ShardedDataParallel": (
        "shardkit.nn.data_parallel.sharded_ddp",
        "ShardedDataParallel",
        SDP_METHODS,
    ),
    "fairscale.optim.grad_scaler.ShardedGradScaler": (
        "shardkit.optim.grad_scaler",
        "ShardedGradScaler",
        SHARDED_SCALER_METHODS,
    ),
    "fairscale.optim.grad_scaler.GradScaler": ("shardkit.optim.grad_scaler", "GradScaler", GRAD_SCALER_METHODS),
}

#: Other paths fairscale users import the same classes from.
ALIASES = {
    ("shardkit.optim", "OSS"): ("shardkit.optim.oss", "OSS"),
    ("shardkit.optim", "GradScaler"): ("shardkit.optim.grad_scaler", "GradScaler"),
    ("shardkit.nn", "ShardedDataParallel"): ("shardkit.nn.data_parallel.sharded_ddp", "ShardedDataParallel"),
    ("shardkit.nn.data_parallel", "ShardedDataParallel"): (
        "shardkit.nn.data_parallel.sharded_ddp",
        "ShardedDataParallel",
    ),
}


def signature_problems(func: Callable[..., Any], expected: Expected) -> list[str]:
    """Every way ``func``'s signature fails to accept fairscale's calls with fairscale's meaning."""
    ours = [p for p in inspect.signature(func).parameters.values() if p.name != "self"]
    named = [(n, d) for n, d in expected if n not in (ARGS, KWARGS)]
    problems = []
    positional = [p for p in ours if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, (name, default) in enumerate(named):
        if index >= len(positional):
            problems.append(f"missing parameter {name!r} at position {index}")
            continue
        param = positional[index]
        if param.name != name or param.kind is not param.POSITIONAL_OR_KEYWORD:
            problems.append(f"position {index}: expected {name!r}, got {param.name!r} ({param.kind.description})")
        elif default is REQUIRED and param.default is not param.empty:
            problems.append(f"{name!r} should be required")
        elif default is not REQUIRED and (param.default is param.empty or param.default != default):
            shown = "required" if param.default is param.empty else repr(param.default)
            problems.append(f"{name!r} default: expected {default!r}, got {shown}")
    kinds = {p.kind for p in ours}
    for marker, kind in ((ARGS, inspect.Parameter.VAR_POSITIONAL), (KWARGS, inspect.Parameter.VAR_KEYWORD)):
        if any(n == marker for n, _ in expected) and kind not in kinds:
            problems.append(f"no {marker}{dict(expected)[marker]}")
    for param in positional[len(named) :]:
        if param.default is param.empty:
            problems.append(f"extra positional parameter {param.name!r} has no default")
    for param in ours:
        if param.kind is param.KEYWORD_ONLY and param.default is param.empty:
            problems.append(f"extra keyword-only parameter {param.name!r} has no default")
    return problems


def _resolve(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


@pytest.mark.parametrize("fairscale_path", sorted(CLASSES))
def test_signatures_match_fairscale(fairscale_path: str) -> None:
    module, name, methods = CLASSES[fairscale_path]
    cls = _resolve(module, name)
    problems = {
        method: found
        for method, expected in methods.items()
        if (found := signature_problems(getattr(cls, method), expected))
    }
    assert problems == {}, f"{fairscale_path} -> {module}.{name}: {problems}"


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_fairscale_import_paths_reach_the_same_classes(alias: tuple[str, str]) -> None:
    assert _resolve(*alias) is _resolve(*ALIASES[alias])


def test_the_checker_catches_what_breaks_a_fairscale_call() -> None:
    """The checker itself: each way a signature can break a fairscale call is reported."""

    def good(a, b=1, *args, c=None, **kwargs):  # type: ignore[no-untyped-def]
        return None

    def swapped(b=1, a=None):  # type: ignore[no-untyped-def]
        return None

    def new_default(a, b=2):  # type: ignore[no-untyped-def]
        return None

    def inserted(a, extra, b=1):  # type: ignore[no-untyped-def]
        return None

    def no_kwargs(a, b=1):  # type: ignore[no-untyped-def]
        return None

    expected: Expected = [("a", REQUIRED), ("b", 1), (KWARGS, "kwargs")]
    assert signature_problems(good, expected) == []
    assert any("position 0" in p for p in signature_problems(swapped, expected))
    assert any("default" in p for p in signature_problems(new_default, expected))
    assert any("position 1" in p for p in signature_problems(inserted, expected))
    assert signature_problems(no_kwargs, expected) == ["no **kwargs"]
