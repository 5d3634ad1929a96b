"""The three test speeds, as pytest markers: ``unit`` (no processes), ``single`` (one process with a world of one
or a ``DummyProcessGroup``) and ``multi`` (real multi-process gloo through the harness or torchrun).

A test marked by hand (``@pytest.mark.single``, or a module's ``pytestmark``) keeps its mark. Every other test is
marked from what its code reaches: the test function, its fixtures, and the test-folder helpers (functions and
classes under ``tests/``) they name, followed name by name. Reaching the multi-process harness makes it ``multi``;
reaching a process group of one, a strategy wrapper (which runs over a world of one in one process), ``smp.init``
or a subprocess makes it ``single``; the rest are ``unit``. Library code is not walked: :data:`KNOWN` lists the tests
whose library calls start processes. A
``unit`` test that starts a process or a process group anyway is refused and fails (:func:`watch_unit`), so a wrong
guess is found by ``make unit`` rather than hidden in it.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import re
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.distributed as dist

SPEEDS = ("unit", "single", "multi")
TESTS_DIR = Path(__file__).resolve().parent.parent

#: Names that start several processes: the harness, the two-node launcher, torchrun and Lightning's own spawning.
MULTI = re.compile(
    r"\b(run_distributed|run_nodes|torchrun|start_processes|elastic_launch|mp\.spawn|ddp_spawn|launch_agent)\b"
)
#: Names that need a process group of one, a strategy wrapper over a world of one, or one extra process.
SINGLE = re.compile(
    r"\b(DummyProcessGroup|init_process_group|smp\.init|subprocess|sys\.executable|torch\.compile)\b"
    r"|\b(FSDP|FullyShardedDataParallel|OSS|ShardedDataParallel|SlowMoDistributedDataParallel|DistributedModel)\("
)
#: Tests whose library code starts processes or a process group, which the walk over ``tests/`` cannot see: a file
#: (every test in it) or one test, relative to ``tests/``.
KNOWN: dict[str, str] = {
    "bench/test_bench_checkpoint.py::test_quick_run_reports_every_rank": "multi",
    "bench/test_bench_multinode.py": "multi",
    "bench/test_bench_pipeline_schedules.py": "multi",
    "bench/test_bench_plan.py::test_quick_accuracy_table": "multi",
    "bench/test_bench_plan.py::test_a_group_that_cannot_run_is_a_row_saying_why": "multi",
    "bench/test_bench_plan_time.py::test_quick_suite_prints_a_row_per_strategy": "multi",
    "bench/test_cli_bench.py::test_zero_suite_quick_runs_every_available_strategy": "multi",
    "demo/test_demo_cli.py::test_demo_quick_trains_every_available_strategy": "multi",
    "modelparallel/test_smp_bench_pipeline.py": "multi",
    "nn/fsdp/test_fsdp_perf_bench.py::test_quick_fsdp_suite": "multi",
    "plan/test_plan_accuracy.py": "multi",
    "plan/test_plan_attention.py::test_sdpa_models_plan_within_5_percent_of_real_runs": "multi",
    # the planner's peerless world is a process group in this process
    "plan/test_plan_attention.py::test_the_estimate_names_the_attention_kernel_it_planned": "single",
    "plan/test_plan_cli.py": "single",
    "plan/test_plan_cli_outputs.py": "single",
    "plan/test_plan_estimate.py": "single",
    "plan/test_plan_offload.py": "single",
    "plan/test_plan_peerless.py": "single",
}
#: This file and the root conftest that calls it name the things they watch for without doing them.
_NOT_FOLLOWED = (Path(__file__).resolve(), TESTS_DIR / "conftest.py")
#: What a ``unit`` test tried to start (kept on the test's node, so a test of the refusal can clear it).
STARTED = pytest.StashKey[list[str]]()
_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


@cache
def _own_source(obj: Any) -> str:
    """The source of a function or class defined under ``tests/``, else empty (library code is not followed)."""
    try:
        path = inspect.getsourcefile(obj)
        where = Path(path).resolve() if path is not None else None
        if where is None or TESTS_DIR not in where.parents or where in _NOT_FOLLOWED:
            return ""
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


@cache
def _facts(obj: Any) -> tuple[int, tuple[Any, ...]]:
    """How fast ``obj``'s own source says it is (an index into :data:`SPEEDS`), and the test-folder functions and
    classes it names."""
    text = _own_source(obj)
    if not text:
        return 0, ()
    level = 2 if MULTI.search(text) else 1 if SINGLE.search(text) else 0
    scope = getattr(obj, "__globals__", None) or vars(inspect.getmodule(obj) or object)
    targets = []
    for name in sorted(set(_NAME.findall(text))):
        target = scope.get(name)
        if callable(target) and not inspect.isclass(target):
            target = inspect.unwrap(target)  # through functools.cache and other decorators
        if (inspect.isfunction(target) or inspect.isclass(target)) and target is not obj:
            targets.append(target)
    return level, tuple(targets)


@cache
def reached_speed(roots: tuple[Any, ...]) -> str:
    """The slowest speed that ``roots``' sources, or those of the test-folder functions and classes they name
    (transitively), call for."""
    seen: set[int] = set()
    todo = [inspect.unwrap(r) if callable(r) and not inspect.isclass(r) else r for r in roots]
    level = 0
    while todo and level < 2:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        own, targets = _facts(obj)
        level = max(level, own)
        todo.extend(targets)
    return SPEEDS[level]


def guess_speed(item: pytest.Item) -> str:
    """``multi``, ``single`` or ``unit`` for a test with no mark of its own: :data:`KNOWN`'s entry, else from the
    code it reaches."""
    path = Path(str(item.fspath)).resolve().relative_to(TESTS_DIR).as_posix()
    known = KNOWN.get(f"{path}::{getattr(item, 'originalname', item.name)}", KNOWN.get(path))
    if known is not None:
        return known
    roots: list[Any] = [getattr(item, "function", None), getattr(item, "cls", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info is not None else ():
        roots.extend(d.func for d in defs)
    return reached_speed(tuple(r for r in roots if r is not None))


def mark_speeds(items: list[pytest.Item]) -> None:
    """Give every test without a speed mark the one :func:`guess_speed` finds."""
    for item in items:
        if not any(item.get_closest_marker(speed) for speed in SPEEDS):
            item.add_marker(guess_speed(item))


def watch_unit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """For a ``unit`` test: refuse to start a process, a subprocess or a process group; fail the test if it tried."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    started: list[str] = request.node.stash.setdefault(STARTED, [])

    def refusing(what: str) -> Callable[..., Any]:
        # Refused at once (a multi-process run would take its whole length to fail) and recorded, in case the
        # code under test catches the error.
        def refuse(*args: Any, **kwargs: Any) -> Any:
            started.append(what)
            raise RuntimeError(f"a unit test may not start {what}")

        return refuse

    monkeypatch.setattr(subprocess.Popen, "__init__", refusing("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refusing("a process"))
    monkeypatch.setattr(dist, "init_process_group", refusing("a process group"))
    yield
    if started:
        pytest.fail(
            f"{request.node.nodeid} is marked unit but started {', '.join(sorted(set(started)))}: "
            "mark it @pytest.mark.single or @pytest.mark.multi",
            pytrace=False,
        )
