"""Letting go of shardkit's process groups before the interpreter finalises.

Why: a gloo worker thread drops a finished collective's tensors only after the caller's ``wait()`` has returned, and
with torch 2.13 dropping the last C++ reference to a tensor that has a Python object takes the GIL (c10's
``decref_pyobject``). Once the interpreter has started finalising, a thread that asks for the GIL is ended with
``pthread_exit``; unwinding through that ``noexcept`` destructor calls ``std::terminate``: "terminate called
without an active exception", SIGABRT, after all of the script's work (pytorch/pytorch#190489). A process group
destroyed while the interpreter is alive joins its worker threads first, which closes the race, and torch's
``destroy_process_group()`` destroys every group nobody else holds. shardkit's process-wide holders (a
:class:`~shardkit.distributed.Topology`'s node groups, the tensor-parallel state, smp's groups) kept theirs alive
past ``destroy_process_group()`` into finalisation; measured on the 2-core CI machine, 1 torchrun run in 16 of
``examples/tensor_parallel_mlp.py`` aborted that way.

What: each holder registers a function that forgets its groups (:func:`release_at_exit`). One ``atexit`` hook,
registered when this module is imported (before any holder's, so it runs after theirs: ``atexit`` runs in reverse
order), calls them and then collects garbage, so the groups nobody else holds are destroyed, and their workers
joined, before finalisation.

Groups still alive after that (the script holds them, or a model that holds them sits in a reference cycle through
autograd hooks, which the collector cannot see through) cannot be destroyed from here. For those the hook only lets
their workers finish: it sleeps, without the GIL, until every gloo worker thread has been seen asleep in
:data:`SETTLED_CHECKS` checks in a row (a worker waiting for the GIL gets it while the exit sleeps, drops its tensors
and goes back to sleep), at most :data:`SETTLE_S` seconds; Linux only (thread states from ``/proc``). That is a
wait, not a proof: ``del`` the script's models and optimizers before ``destroy_process_group()`` to be sure.

torch pins the default group too: ``torch.distributed.nn.functional`` writes ``group=group.WORLD`` as its functions'
default arguments, so when it is first imported after ``init_process_group`` (torch imports it lazily, through
``torch._dynamo``, the first time a compiled-code check runs) those defaults hold the world group until
finalisation. It is imported here, with shardkit, so its defaults read None.

Cost: destroying a group waits for the collectives queued on it. One that a peer never entered would hold the exit
until the group's timeout, so the release runs in a helper thread and the exit waits for it at most
:data:`EXIT_RELEASE_S` seconds, then says so on stderr and goes on.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist

if dist.is_available():  # imported before init_process_group, so its defaults read None (see above)
    import torch.distributed.nn.functional  # noqa: F401

#: The longest the interpreter's exit waits for shardkit's groups to be destroyed.
EXIT_RELEASE_S = 20.0
#: Checks in a row, :data:`SETTLE_STEP_S` apart, in which every gloo worker thread must be asleep.
SETTLED_CHECKS = 3
SETTLE_STEP_S = 0.005
#: The longest the exit waits for live groups' workers to settle.
SETTLE_S = 1.0
#: The name torch gives each gloo process group's worker threads.
GLOO_WORKER = "pt_gloo_runloop"

_RELEASERS: list[tuple[str, Callable[[], None]]] = []
_LOCK = threading.Lock()


def release_at_exit(name: str, release: Callable[[], None]) -> None:
    """Call ``release`` at interpreter exit, before finalisation, to drop the process groups ``name`` holds.

    ``release`` must only forget references (or destroy groups it created itself); it must not start a collective:
    the other ranks may have exited already. Registering the same ``name`` twice keeps the last function.
    """
    with _LOCK:
        _RELEASERS[:] = [(n, f) for n, f in _RELEASERS if n != name]
        _RELEASERS.append((name, release))


def release_now() -> list[str]:
    """Run every registered release, then a garbage collection; returns ``name: error`` for each that raised.

    The exit hook runs this in a helper thread; tests call it directly.
    """
    with _LOCK:
        releasers = list(_RELEASERS)
    problems = []
    for name, release in releasers:
        try:
            release()
        except Exception as error:  # one holder's failure must not keep the others' groups alive
            problems.append(f"{name}: {type(error).__name__}: {error}")
    gc.collect()
    return problems


def gloo_worker_states() -> list[str]:
    """The scheduler state (``R`` running or runnable, ``S`` asleep, ...) of each gloo worker thread of this
    process; empty where ``/proc`` is not there."""
    states = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as stat:
                fields = stat.read()
        except OSError:  # the thread ended between the listing and the read
            continue
        name_end = fields.rfind(")")
        name = fields[fields.find("(") + 1 : name_end]
        if name == GLOO_WORKER:
            states.append(fields[name_end + 2 : name_end + 3])
    return states


def settle_gloo_workers(limit_s: float = SETTLE_S) -> bool:
    """Sleep until every gloo worker thread has been asleep in :data:`SETTLED_CHECKS` checks in a row (True), or
    ``limit_s`` passed (False)."""
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < SETTLED_CHECKS:
        if time.monotonic() > deadline:
            return False
        time.sleep(SETTLE_STEP_S)  # without the GIL: a worker waiting for it gets it now
        quiet = quiet + 1 if all(state != "R" for state in gloo_worker_states()) else 0
    return True


def _at_exit() -> None:
    problems: list[str] = []
    worker = threading.Thread(target=lambda: problems.extend(release_now()), name="shardkit-exit-release", daemon=True)
    try:
        worker.start()
    except RuntimeError:  # Python 3.12+ refuses new threads once shutdown began: release here, without the bound
        problems.extend(release_now())
    else:
        worker.join(EXIT_RELEASE_S)
    if worker.is_alive():
        print(
            f"shardkit: process groups were still busy {EXIT_RELEASE_S:g} s into the exit (a collective some peer "
            "never entered?); exiting without waiting for them",
            file=sys.stderr,
        )
    for problem in problems:
        print(f"shardkit: releasing process groups at exit failed for {problem}", file=sys.stderr)
    if gloo_worker_states():
        settle_gloo_workers()


atexit.register(_at_exit)
