"""Run a function on N gloo processes and turn every rank's failure, or a hang, into one clear error.

Workers are forked from a ``forkserver`` that has already imported torch, so starting a 4-rank job costs a
fraction of a second instead of a fresh interpreter per rank. Ranks rendezvous through a file store in a
private temporary directory, so concurrent jobs never fight over ports.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from shardkit.distributed.health import report_failure

#: Default seconds a distributed test may run before it is declared hung.
DEFAULT_TIMEOUT_S = float(os.environ.get("SHARDKIT_TEST_TIMEOUT", "180"))
#: Seconds the surviving ranks get to report after one rank failed, before they are killed.
FAILURE_GRACE_S = 10.0


class DistributedTestError(AssertionError):
    """One or more ranks failed, died or hung; the message holds each rank's traceback or state."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    # torch._dynamo is imported by the first torch.optim optimizer a worker builds (about a second each);
    # importing it once in the server saves that in every worker.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "shardkit.distributed.spawn"])
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    timeout_s: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    env: Optional[dict[str, str]] = None,
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("SHARDKIT_TEST_PORT", "29533"),
    )
    os.environ.update(env or {})  # a test's per-rank overrides (e.g. a simulated node layout)
    # One intra-op thread per rank: ranks share the machine's cores, more threads only oversubscribe them.
    torch.set_num_threads(1)
    # A rank still running when the parent gives up writes where it is: the report of a hang then shows the call
    # each rank is blocked in instead of only "did not finish".
    stack_file = open(f"{init_file}.stack{rank}", "w")  # noqa: SIM115 (open for the whole run)
    faulthandler.dump_traceback_later(timeout_s + FAILURE_GRACE_S / 2, file=stack_file)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        value = fn(rank, world_size, *args, **kwargs)
        faulthandler.cancel_dump_traceback_later()
        # Pickled by value here: the queue would otherwise pass tensors through shared memory that dies with
        # this process before the parent reads it.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as err:
        report_failure(err)  # lets the other ranks' collective errors name this rank
        results.put((rank, "error", traceback.format_exc()))
        return  # exit at once, as a crashed rank would: its peers' collectives fail fast instead of timing out
    _wait_for_all_ranks(init_file + ".done", world_size, timeout_s)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _wait_for_all_ranks(path: str, world_size: int, timeout_s: float) -> None:
    """Stay alive until every rank has finished (or ``timeout_s`` passed).

    A rank that exits early closes its gloo connections, which can break a slower rank still setting up or
    finishing a collective. A separate file store, not the process group, keeps this off the ranks' own
    collective sequence (some tests desynchronise it on purpose).
    """
    with contextlib.suppress(Exception):
        store = dist.FileStore(path, world_size)
        store.add("finished", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("finished", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: Optional[float] = None,
    backend: str = "gloo",
    rank_env: Optional[Sequence[dict[str, str]]] = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes with an initialised group.

    ``fn`` must be importable (a module-level function) and its arguments and return value picklable.
    Returns every rank's return value, in rank order. Raises :class:`DistributedTestError` naming each rank
    that raised (with its traceback), died, or did not finish within ``timeout_s`` seconds: a hung
    collective fails the test instead of hanging the suite.

    Each rank sees ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (= ``world_size``: one node),
    as under torchrun; ``rank_env[rank]`` (one dict per rank) overrides or adds variables, e.g. to simulate two
    nodes with ``LOCAL_WORLD_SIZE=2`` and ``GROUP_RANK``.

    Example::

        def check_sum(rank, world_size):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t)
            return t.item()

        assert run_distributed(check_sum, 2) == [1.0, 1.0]
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if rank_env is not None and len(rank_env) != world_size:
        raise ValueError(f"rank_env needs one dict per rank ({world_size}), got {len(rank_env)}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="shardkit-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, init_file, backend, timeout_s, args, kwargs, results)
                + ((dict(rank_env[rank]),) if rank_env is not None else ()),
                name=f"shardkit-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            outcomes = _collect(procs, results, timeout_s)
            for rank in range(world_size):
                if rank not in outcomes:
                    outcomes[rank] = ("hung", _read_stack(f"{init_file}.stack{rank}"))
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
    return _report(fn, world_size, timeout_s, outcomes)


def _collect(procs: Sequence[Any], results: Any, timeout_s: float) -> dict[int, tuple[str, Any]]:
    outcomes: dict[int, tuple[str, Any]] = {}
    # Ranks time out of a blocked collective after timeout_s and report it themselves; the extra grace lets
    # those reports arrive before the stragglers are declared hung.
    deadline = time.monotonic() + timeout_s + FAILURE_GRACE_S
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in outcomes and not proc.is_alive() and proc.exitcode is not None:
                    # Give a just-finished rank's queued report a moment to arrive before calling it dead.
                    try:
                        r, status, value = results.get(timeout=1.0)
                        outcomes[r] = (status, value)
                    except queue.Empty:
                        outcomes[rank] = ("died", proc.exitcode)
            continue
        outcomes[rank] = (status, value)
        if status == "error":
            deadline = min(deadline, time.monotonic() + min(FAILURE_GRACE_S, timeout_s))
    return outcomes


def _read_stack(path: str) -> str:
    """What a hung rank's stack dump says ('' if it wrote none)."""
    with contextlib.suppress(OSError), open(path) as dump:
        return dump.read().strip()
    return ""


def _report(
    fn: Callable[..., Any], world_size: int, timeout_s: float, outcomes: dict[int, tuple[str, Any]]
) -> list[Any]:
    if all(outcomes.get(rank, ("", None))[0] == "ok" for rank in range(world_size)):
        return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]
    lines = [f"{getattr(fn, '__qualname__', fn)} failed at world size {world_size}:"]
    failed_first = sorted(range(world_size), key=lambda r: outcomes.get(r, ("hung",))[0] != "error")
    for rank in failed_first:
        status, value = outcomes.get(rank, ("hung", None))
        if status == "ok":
            continue
        if status == "error":
            lines.append(f"--- rank {rank} raised:\n{value}")
        elif status == "died":
            lines.append(f"--- rank {rank} died with exit code {value} before reporting")
        else:
            lines.append(
                f"--- rank {rank} did not finish within {timeout_s + FAILURE_GRACE_S:.0f}s: it is probably blocked "
                "in a collective that another rank skipped, failed before, or issued with different arguments"
            )
            if value:
                lines.append(f"its stack when it was given up on:\n{value}")
    raise DistributedTestError("\n".join(lines))
