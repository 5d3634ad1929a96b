"""Benchmarks: programs that run strategies side by side and print tables with measured ratios.

``shardkit bench [SUITE ...]`` runs the suites named in :data:`SUITES` (all by default). A suite is a module
with a ``run(argv: list[str]) -> None`` function that prints its own tables; it receives the common options
the user gave (``--world-size N``, ``--steps N``, ``--warmup N``, ``--quick``) as ``argv``. A suite whose module
does not exist yet is reported as not available and the others still run.

Pieces for writing suites: :mod:`shardkit.strategies.registry` (the strategy registry),
:mod:`shardkit.memory.meter` (per-rank bytes of parameters, gradients, optimizer state),
:mod:`shardkit.strategies.live` (train and measure a strategy inside a worker) and :mod:`shardkit.utils.report`
(the old ``shardkit.bench`` paths of these re-export them).
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Sequence
from typing import Callable, Optional

#: Suite name -> module defining ``run(argv)``. Suites owned by other capabilities land here by name.
SUITES: dict[str, str] = {
    "zero": "shardkit.bench.zero",
    "fsdp": "shardkit.bench.fsdp",
    "pipeline": "shardkit.bench.pipeline",
    "slowmo": "shardkit.bench.slowmo",
    "multinode": "shardkit.bench.multinode",
    "plan": "shardkit.bench.plan",
    "plan-time": "shardkit.bench.plan_time",
    "checkpoint": "shardkit.bench.checkpoint",
    "tp": "shardkit.bench.tp",
    "3d": "shardkit.bench.three_d",
}


class UnknownSuiteError(ValueError):
    """A suite name that is not in :data:`SUITES`."""


def check_suites(names: Sequence[str]) -> list[str]:
    """``names`` (all suites when empty), or :class:`UnknownSuiteError` listing the known suites."""
    unknown = [name for name in names if name not in SUITES]
    if unknown:
        raise UnknownSuiteError(
            f"unknown benchmark suite{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"available suites: {', '.join(SUITES)}"
        )
    return list(names) if names else list(SUITES)


def load_suite(name: str) -> Optional[Callable[[list[str]], None]]:
    """The suite's ``run`` function, or ``None`` when its module does not exist yet."""
    module_name = SUITES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise
    run: Callable[[list[str]], None] = module.run
    return run


def run_suites(names: Sequence[str], argv: list[str]) -> int:
    """Run the named suites (all when empty) with ``argv``; returns the number of suites that failed.

    A missing suite prints ``suite X not available yet``; a suite that raises prints its traceback and the
    remaining suites still run.

    Example::

        failures = run_suites(["zero"], ["--quick"])
    """
    failures = 0
    for name in check_suites(names):
        try:
            run = load_suite(name)
            if run is None:
                print(f"suite {name} not available yet ({SUITES[name]} does not exist)", flush=True)
                continue
            print(f"== suite {name} ==", flush=True)
            run(list(argv))
        except (Exception, SystemExit) as exc:
            if isinstance(exc, SystemExit) and exc.code in (0, None):
                continue
            failures += 1
            print(f"suite {name} FAILED:\n{traceback.format_exc()}", flush=True)
    return failures
