"""The few object collectives a checkpoint needs, over the world group, labelled for profiles.

Every function also works without an initialised process group (a single process), where it is a no-op.
Checkpoint traffic is small (file names, digests, error messages), so it travels as pickled objects between the
job's own ranks; nothing read from disk is ever unpickled this way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from shardkit.checkpoint import errors
from shardkit.distributed import collectives
from shardkit.distributed.objects import all_gather_objects

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
    result: T = _agree(fn, label, group, share=False)[0]
    return result


def agreed_from_zero(fn: Callable[[], Any], label: str, group: Optional[dist.ProcessGroup] = None) -> Any:
    """:func:`agreed`, returning rank 0's result on every rank: it travels in the agreement's all-gather, so no
    broadcast follows (rank 0 prepares something, the others use it)."""
    return _agree(fn, label, group, share=True)[1]


def _agree(fn: Callable[[], T], label: str, group: Optional[dist.ProcessGroup], share: bool) -> tuple[T, Any]:
    """``fn``'s result here and (with ``share``) rank 0's, once every rank's ``fn`` returned."""
    own: Optional[BaseException] = None
    result: Any = None
    try:
        result = fn()
    except Exception as err:  # every failure must reach the agreement, whatever its type
        own = err
    report = None if own is None else (type(own).__name__, str(own))
    gathered = all_gather((report, result if share and own is None else None), label, group)
    reports = [r for r, _ in gathered]
    failures = [(rank, r) for rank, r in enumerate(reports) if r is not None]
    if not failures:
        return result, gathered[0][1]
    if len(reports) == 1 and isinstance(own, errors.CheckpointError):
        raise own
    kind = _ERROR_TYPES.get(failures[0][1][0], errors.CheckpointError)
    lines = [f"rank {rank}: {name}: {message}" for rank, (name, message) in failures]
    ranks = ", ".join(str(rank) for rank, _ in failures)
    raise kind(f"{label} failed on rank(s) {ranks}:\n" + "\n".join(lines)) from own


def refuse_launch_without_group(what: str) -> None:
    """Raise when the launcher started several processes (``WORLD_SIZE`` > 1, as torchrun sets it) but this one
    has no process group: each would act as a job of one, e.g. all saving into the same directory."""
    declared = os.environ.get("WORLD_SIZE", "")
    if not declared.isdigit() or int(declared) <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    rank = os.environ.get("RANK", "?")
    raise errors.CheckpointError(
        f"{what}: this process was launched as rank {rank} of WORLD_SIZE={declared} processes (torchrun and other "
        "launchers set RANK and WORLD_SIZE), but no process group is initialised, so every process would save a "
        "checkpoint of a one-process job into the same place. Call torch.distributed.init_process_group() at "
        "the start of the script, in every process; to run a single process, launch it without torchrun (or with "
        "--nproc-per-node 1). Nothing was written."
    )


def check_same_target(what: str, directory: Path, step: Optional[int] = None) -> None:
    """Raise on every rank unless all ranks passed the same directory (and ``step``; one small all-gather).

    Ranks that each computed their own step number would otherwise save into different directories: rank 0's
    would be written (by every rank), and the others told they saved one that does not exist; on load, every rank
    would silently load rank 0's.
    """
    mine = (os.path.abspath(directory), step)
    everyone = all_gather(mine, f"{what}: directory")
    if all(entry == everyone[0] for entry in everyone):
        return
    differs = "directories" if any(d != everyone[0][0] for d, _ in everyone) else "steps"
    listed = "; ".join(f"rank {r}: {d}" + ("" if s is None else f" (step {s})") for r, (d, s) in enumerate(everyone))
    same = "directory" if step is None else "directory and step"
    derive = "it" if step is None else "them"
    done = "loaded" if step is None else "written"
    raise errors.CheckpointError(
        f"{what}: the ranks passed different {differs} ({listed}). Every rank must pass the same {same}: derive "
        f"{derive} from a value all ranks share (the loop counter), or choose {derive} on rank 0 and broadcast "
        f"{derive} (torch.distributed.broadcast_object_list). Nothing was {done}."
    )
