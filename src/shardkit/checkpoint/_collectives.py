"""The few object collectives a checkpoint needs, over the world group, labelled for profiles.

Every function also works without an initialised process group (a single process), where it is a no-op.
Checkpoint traffic is small (file names, digests, error messages), so it travels as pickled objects between the
job's own ranks; nothing read from disk is ever unpickled this way.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from shardkit.checkpoint import errors
from shardkit.distributed import collectives
from shardkit.distributed.objects import all_gather_objects, broadcast_object

T = TypeVar("T")

_ERROR_TYPES: dict[str, type[errors.CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        errors.CheckpointError,
        errors.CheckpointNotFoundError,
        errors.CorruptCheckpointError,
        errors.UnsafeCheckpointError,
        errors.IncompatibleCheckpointError,
    )
}


def _active(group: Optional[dist.ProcessGroup] = None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_size() -> tuple[int, int]:
    """This process's global rank and the world size (``(0, 1)`` without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier(label: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Wait for every rank (of ``group``, default the world)."""
    if _active(group):
        collectives.barrier(group, label=f"checkpoint.{label}")


def broadcast_from_zero(obj: Any, label: str, group: Optional[dist.ProcessGroup] = None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not _active(group):
        return obj
    return broadcast_object(obj, 0, group, label=f"checkpoint.{label}")


def all_gather(obj: Any, label: str, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if not _active(group):
        return [obj]
    return all_gather_objects(obj, group, f"checkpoint.{label}")


def agreed(fn: Callable[[], T], label: str, group: Optional[dist.ProcessGroup] = None) -> T:
    """Run ``fn`` on every rank, then raise on every rank if it raised on any.

    Keeps ranks in step: a rank whose file is bad must not leave the others waiting in the next collective. The
    error raised everywhere has the first failing rank's class (a :class:`CheckpointError` subclass) and names
    every failing rank with its message; a rank's own exception is chained as the cause.
    """
    own: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:  # every failure must reach the agreement, whatever its type
        own = err
    report = None if own is None else (type(own).__name__, str(own))
    reports = all_gather(report, label, group)
    failures = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failures:
        return result
    if len(reports) == 1 and isinstance(own, errors.CheckpointError):
        raise own
    kind = _ERROR_TYPES.get(failures[0][1][0], errors.CheckpointError)
    lines = [f"rank {rank}: {name}: {message}" for rank, (name, message) in failures]
    ranks = ", ".join(str(rank) for rank, _ in failures)
    raise kind(f"{label} failed on rank(s) {ranks}:\n" + "\n".join(lines)) from own
