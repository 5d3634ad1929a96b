"""Asynchronous saves: the writing, hashing and publishing of a staged checkpoint on a background thread.

Choice: the background part does need collectives (DCP's plan exchange, the digests, the agreement before
publishing), so it runs them over a dedicated gloo process group created up front, in the foreground, by every
rank at its first asynchronous save (``dist.new_group`` is itself collective). Training's collectives on the
default group never interleave with the checkpoint's, whatever the backend. At most one save is in flight per
process; the next ``save_checkpoint``/``load_checkpoint``, :func:`wait_for_checkpoint` and process exit (atexit)
wait for it, and a failure in the background is raised there (on every rank: the background agreements make
every rank's job fail together). Call :func:`wait_for_checkpoint` before ``destroy_process_group``.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import Optional

import torch.distributed as dist

from shardkit.checkpoint.errors import CheckpointError
from shardkit.distributed.exit_release import release_at_exit
from shardkit.distributed.instrumentation import INSTRUMENTATION

_WRITING = "it is still writing (a large model or a slow file system); this call goes on once the files are complete."

Job = Callable[[Optional[dist.ProcessGroup]], None]


class BackgroundSaves:
    """This process's in-flight asynchronous save and the process group it communicates over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._what = ""
        self._group: Optional[dist.ProcessGroup] = None
        self._group_of: object = None
        atexit.register(self._wait_at_exit)

    def group(self) -> Optional[dist.ProcessGroup]:
        """The checkpoint's own gloo group (created on first use, on every rank); None without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.group.WORLD
        if self._group is None or self._group_of is not world:
            self._group = dist.new_group(backend="gloo")
            self._group_of = world
        return self._group

    def forget_group(self) -> None:
        """Drop the checkpoint group (at exit, after :meth:`_wait_at_exit`; see
        :mod:`shardkit.distributed.exit_release`)."""
        self._group = None
        self._group_of = None

    def start(self, job: Job, what: str) -> None:
        """Run ``job(group)`` in the background; the previous job must be finished (call :meth:`wait` first)."""
        group = self.group()
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("an asynchronous checkpoint save is still running; wait_for_checkpoint() first")
            self._what = what
            self._thread = threading.Thread(
                target=self._run, args=(job, group), name="shardkit-checkpoint", daemon=True
            )
            self._thread.start()

    def _run(self, job: Job, group: Optional[dist.ProcessGroup]) -> None:
        try:
            job(group)
        except BaseException as err:  # kept for the caller's next checkpoint call
            self._error = err

    def wait(self) -> None:
        """Wait for the in-flight save; raise its failure, if any (once)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            with INSTRUMENTATION.waits.watching(f"the asynchronous save of {self._what}", _WRITING):
                thread.join()
        with self._lock:
            self._thread = None
            error, self._error = self._error, None
        if error is not None:
            kind = type(error) if isinstance(error, CheckpointError) else CheckpointError
            raise kind(f"the asynchronous save of {self._what} failed: {error}") from error

    def _wait_at_exit(self) -> None:
        try:
            self.wait()
        except CheckpointError as err:
            print(f"shardkit: {err}")


#: The process's asynchronous saves (one object; the atexit hook must find it).
BACKGROUND = BackgroundSaves()
release_at_exit("the asynchronous checkpoint group", BACKGROUND.forget_group)


def wait_for_checkpoint() -> None:
    """Wait until this process's asynchronous save (``save_checkpoint(..., async_save=True)``) is published.

    Raises the save's error if it failed (the previous complete checkpoint is then still in place). Call it on
    every rank, e.g. before ``destroy_process_group``; ``save_checkpoint`` and ``load_checkpoint`` call it too.

    Example::

        save_checkpoint(step_directory(root, step), step=step, model=model, optimizer=optimizer, async_save=True)
        train_more_steps()
        wait_for_checkpoint()
    """
    BACKGROUND.wait()
