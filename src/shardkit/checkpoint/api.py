"""``save_checkpoint`` and ``load_checkpoint``: the orchestration every strategy shares.

Saving: rank 0 creates a hidden sibling directory ``.<name>.tmp-<id>``; every rank writes its part there (its
share of the universal layout, or a legacy strategy's files; its RNG states and data position; rank 0 also the
scaler and ``extra``), fsyncing each file;
the ranks hash the files between them; rank 0 writes ``meta.json`` last, fsyncs the directories and renames the
directory to its final name. A crash at any point leaves either the old checkpoint or the new complete one.

Loading: the ranks agree on the directory, check ``meta.json`` against this run, verify every file's size and
SHA-256 (shared out between the ranks), read and validate everything, and only then write into the model,
optimizer and scaler. Any rank's error is raised on every rank, so none is left waiting in a collective.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

import shardkit
from shardkit.checkpoint import _collectives as comm
from shardkit.checkpoint import rng
from shardkit.checkpoint.adapters import Adapter, PendingLoad, adapter_for
from shardkit.checkpoint.checks import check_meta, held_and_names, optimizer_settings, warn_replaced_settings
from shardkit.checkpoint.checks import verify_checkpoint as verify_checkpoint  # re-exported: the public entry point
from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from shardkit.checkpoint.files import check_weights_only, fsync_dir, safe_load, write_json_atomic, write_torch
from shardkit.checkpoint.find import find_verified
from shardkit.checkpoint.metadata import (
    IMPORTED_STRATEGY,
    META_FILE,
    CheckpointInfo,
    CheckpointMeta,
    FileRecord,
    record_files,
)
from shardkit.checkpoint.sources import source_for
from shardkit.checkpoint.universal import load as universal_load
from shardkit.checkpoint.universal import save as universal_save
from shardkit.checkpoint.universal.background import BACKGROUND, wait_for_checkpoint
from shardkit.checkpoint.universal.layout import LAYOUT
from shardkit.checkpoint.universal.source import UniversalSource
from shardkit.distributed.arrival import every_rank_calls
from shardkit.utils.tensors import to_cpu

COMMON_FILE = "common.pt"
RANKS_DIR = "ranks"
PathLike = Union[str, Path]
_EVERY_RANK_ADVICE = (
    "Call it on every rank (each rank writes or reads its own share; rank 0 alone publishes), not under "
    "`if rank == 0:`."
)


def step_directory(root: PathLike, step: int) -> Path:
    """The conventional directory for ``step`` under ``root``: ``root/step_00000042``."""
    return Path(root) / f"step_{step:08d}"


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / RANKS_DIR / f"rank_{rank:05d}.pt"


def save_checkpoint(
    directory: PathLike,
    *,
    step: int,
    model: nn.Module,
    optimizer: Optional[Any] = None,
    scaler: Optional[Any] = None,
    data_position: Any = None,
    extra: Any = None,
    async_save: bool = False,
) -> Path:
    """Atomically save the training state of any shardkit strategy into ``directory``; call on every rank.

    Saves the model and optimizer state in the universal layout (every rank writes only what it holds, as DCP
    chunks keyed by the unwrapped model's names; any strategy loads it at any world size), the
    ``GradScaler``/``ShardedGradScaler`` state, ``step``, every rank's RNG states (torch CPU and CUDA, Python,
    NumPy) and ``data_position``, and ``extra`` (rank 0's). ``data_position`` and ``extra`` must be tensors and
    plain data (they are read back with ``torch.load(weights_only=True)``). An existing checkpoint in
    ``directory`` is replaced only once the new one is complete. Returns the directory.

    With ``async_save=True`` it returns once this rank's share is copied to host memory; writing, hashing and
    publishing go on in a background thread (over a gloo group of its own), atomic as ever. The next
    ``save_checkpoint``/``load_checkpoint``, :func:`wait_for_checkpoint` and process exit wait for it, and raise
    its error if it failed. Strategies without a universal source yet are saved synchronously in their old layout.

    Example::

        for step in range(start, steps):
            train_one_step(...)
            if step % 100 == 0:
                save_checkpoint(step_directory("runs/exp1", step), step=step, model=model,
                                optimizer=optimizer, scaler=scaler, data_position={"batch": step})
    """
    wait_for_checkpoint()
    final = Path(directory)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    check_weights_only(data_position, "data_position")
    check_weights_only(extra, "extra")
    source = source_for(model, optimizer)
    adapter = adapter_for(model, optimizer) if source is None else None
    return _save(final, step, source, adapter, optimizer is not None, scaler, data_position, extra, async_save)


def save_source(
    directory: PathLike,
    source: UniversalSource,
    *,
    step: int = 0,
    data_position: Any = None,
    extra: Any = None,
    async_save: bool = False,
) -> Path:
    """Save what ``source`` holds as a universal checkpoint (as :func:`save_checkpoint` does for a model).

    For tools that hold tensors without a training strategy (e.g. importing another format); call on every rank
    of the process group, or in a process without one.

    Example::

        held = [Held(t, (Span(name, t.shape, 0, t.numel()),)) for name, t in state_dict.items()]
        save_source("ckpt", StaticSource(held), step=0)
    """
    wait_for_checkpoint()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    check_weights_only(data_position, "data_position")
    check_weights_only(extra, "extra")
    has_optimizer = source.local_optimizer() is not None
    return _save(
        Path(directory), step, source, None, has_optimizer, None, data_position, extra, async_save, capture_rng=False
    )


def _save(
    final: Path,
    step: int,
    source: Optional[UniversalSource],
    adapter: Optional[Adapter],
    has_optimizer: bool,
    scaler: Any,
    data_position: Any,
    extra: Any,
    async_save: bool,
    capture_rng: bool = True,
) -> Path:
    every_rank_calls("save_checkpoint()", None, _EVERY_RANK_ADVICE)
    rank, world_size = comm.rank_and_size()
    # Before any work, so resuming continues the exact random streams. A tool's save (an import) has no training
    # streams to continue: storing its own would override the seed of whoever loads it.
    rng_state = rng.capture() if capture_rng else None
    made = comm.agreed(lambda: _make_temporary(final) if rank == 0 else None, "save_checkpoint: prepare")
    tmp = Path(comm.broadcast_from_zero(made, "save_checkpoint: directory"))
    fields: dict[str, Any] = {
        "step": step,
        "world_size": world_size,
        "has_optimizer": has_optimizer,
        "has_scaler": scaler is not None,
        "shardkit_version": shardkit.__version__,
        "torch_version": torch.__version__,
    }
    rank_state = {"rng": rng_state, "data_position": data_position}
    common = {"scaler": None if scaler is None else scaler.state_dict(), "extra": extra}
    try:
        if adapter is not None:
            fields.update(strategy=adapter.strategy, layout=adapter.layout, resizable=adapter.resizable)
            comm.agreed(lambda: _write_parts(tmp, adapter, rank, rank_state, common), "save_checkpoint: write")
            _finish(tmp, final, rank, world_size, fields, None)
            return final
        assert source is not None
        fields.update(strategy=source.strategy, layout=LAYOUT, resizable=True)
        if not async_save:
            try:
                staged = comm.agreed(lambda: _stage(source, tmp, rank, False), "save_checkpoint: stage")
                _write_universal(tmp, final, rank, world_size, fields, staged, rank_state, common, None)
            finally:
                source.after_save()
            return final
        staged = comm.agreed(lambda: _stage(source, tmp, rank, True), "save_checkpoint: stage")
        rank_state, common = to_cpu(copy.deepcopy(rank_state)), to_cpu(copy.deepcopy(common))
        job = functools.partial(_write_universal, tmp, final, rank, world_size, fields, staged, rank_state, common)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    BACKGROUND.start(job, str(final))
    return final


def _stage(source: UniversalSource, tmp: Path, rank: int, copy_now: bool) -> universal_save.Staged:
    """This rank's share (copied to host memory for an asynchronous save) and the source's extra files."""
    source.before_save()
    try:
        staged = universal_save.stage(source, copy=copy_now)
        source.save_extra(tmp, rank)
    finally:
        if copy_now:
            source.after_save()
    return staged


def _write_universal(
    tmp: Path,
    final: Path,
    rank: int,
    world_size: int,
    fields: dict[str, Any],
    staged: universal_save.Staged,
    rank_state: dict[str, Any],
    common: dict[str, Any],
    group: Optional[dist.ProcessGroup],
) -> None:
    """Write, hash and publish (the background part of an asynchronous save; collectives over ``group``)."""
    try:
        comm.agreed(lambda: _write_local(tmp, staged, rank, rank_state, common), "save_checkpoint: write", group)
        universal_save.write_staged(tmp, staged, group)
        _finish(tmp, final, rank, world_size, fields, group)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_local(tmp: Path, staged: universal_save.Staged, rank: int, rank_state: Any, common: Any) -> None:
    universal_save.write_local(tmp, staged, rank)
    write_torch(_rank_file(tmp, rank), rank_state)
    if rank == 0:
        write_torch(tmp / COMMON_FILE, common)


def _finish(
    tmp: Path, final: Path, rank: int, world_size: int, fields: dict[str, Any], group: Optional[dist.ProcessGroup]
) -> None:
    """Hash every file between the ranks, then rank 0 writes ``meta.json`` and renames into place."""
    meta = CheckpointMeta(files=_digests(tmp, rank, world_size, group), **fields)
    comm.agreed(lambda: _publish(tmp, final, meta) if rank == 0 else None, "save_checkpoint: publish", group)


def _make_temporary(final: Path) -> str:
    """Rank 0: check ``final`` may be (re)placed, clear interrupted saves of it, create the hidden sibling."""
    if final.exists() and not (final.is_dir() and ((final / META_FILE).exists() or not any(final.iterdir()))):
        raise CheckpointError(
            f"{final} exists and is not a shardkit checkpoint; refusing to replace it. Save into a new directory."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a save that crashed; never complete
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return str(tmp)


def _write_parts(tmp: Path, adapter: Adapter, rank: int, rank_state: Any, common: Any) -> None:
    adapter.save(tmp, rank)
    write_torch(_rank_file(tmp, rank), rank_state)
    if rank == 0:
        write_torch(tmp / COMMON_FILE, common)


def _digests(tmp: Path, rank: int, world_size: int, group: Optional[dist.ProcessGroup]) -> dict[str, FileRecord]:
    """Size and SHA-256 of every file, each rank hashing every ``world_size``-th one; all ranks get all."""

    mine = comm.agreed(lambda: record_files(tmp, rank, world_size), "save_checkpoint: hash", group)
    merged: dict[str, FileRecord] = {}
    for part in comm.all_gather(mine, "save_checkpoint: digests", group):
        merged.update(part)
    return dict(sorted(merged.items()))


def _publish(tmp: Path, final: Path, meta: CheckpointMeta) -> None:
    """Rank 0: write ``meta.json`` last, make everything durable, and rename into place."""
    write_json_atomic(tmp / META_FILE, meta.to_json())
    for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    directory_or_root: PathLike,
    *,
    model: nn.Module,
    optimizer: Optional[Any] = None,
    scaler: Optional[Any] = None,
    verify: bool = True,
    fall_back: bool = True,
) -> CheckpointInfo:
    """Restore what :func:`save_checkpoint` saved into ``model``, ``optimizer`` and ``scaler``; call on every rank.

    ``directory_or_root`` is a checkpoint directory or a folder of them (the newest intact one is used). With
    ``verify`` every file's size and SHA-256 is checked first; given a folder, a checkpoint that fails (a damaged
    file, an edited ``meta.json``) is skipped with a warning naming it and the next older one is loaded
    (``fall_back=False`` raises instead; ``info.path`` and ``info.step`` say which one loaded). Everything is read
    and validated on every rank before anything is written, so a bad checkpoint raises a :class:`CheckpointError`
    subclass on every rank and leaves the model, optimizer and scaler unchanged. RNG states are restored when the
    world size is the saved one (an imported checkpoint carries none: the caller's seed stands). Files are only
    ever read with ``torch.load(weights_only=True)`` or through a safe DCP reader.

    Example::

        if latest_checkpoint("runs/exp1") is not None:
            info = load_checkpoint("runs/exp1", model=model, optimizer=optimizer, scaler=scaler)
            start = info.step + 1
    """
    wait_for_checkpoint()
    every_rank_calls("load_checkpoint()", None, _EVERY_RANK_ADVICE)
    rank, world_size = comm.rank_and_size()
    adapter = adapter_for(model, optimizer)
    source = source_for(model, optimizer)
    path, meta = find_verified(
        directory_or_root, lambda p: check_meta(p, adapter, source, world_size, scaler), verify, fall_back
    )
    same_size = meta.world_size == world_size
    if meta.layout == LAYOUT:
        assert source is not None
        held, names = comm.agreed(lambda: held_and_names(source), "load_checkpoint: held")
        job_names = {name for part in comm.all_gather(names, "load_checkpoint: names") for name in part}

        def read() -> PendingLoad:
            assert source is not None
            return universal_load.plan_load(path, meta, source, held, job_names, rank)

    else:

        def read() -> PendingLoad:
            return adapter.read(path, meta, rank)

    pending, rank_state, common = comm.agreed(
        lambda: _read_all(path, read, rank if same_size else 0, scaler), "load_checkpoint: read"
    )
    comm.agreed(pending.fetch, "load_checkpoint: fetch")
    settings = optimizer_settings(optimizer)
    comm.agreed(pending.apply, "load_checkpoint: apply")  # a failure here still reaches every rank
    warn_replaced_settings(settings, optimizer, path)
    if scaler is not None:
        scaler.load_state_dict(common["scaler"])
    # An import has no run to continue (older imports stored the import command's RNG): the loader's seed stands.
    restore_rng = same_size and rank_state.get("rng") is not None and meta.strategy != IMPORTED_STRATEGY
    if restore_rng:
        rng.restore(rank_state["rng"])
    return CheckpointInfo(
        path=path,
        step=meta.step,
        data_position=rank_state["data_position"],
        world_size=meta.world_size,
        strategy=meta.strategy,
        extra=common["extra"],
        rng_restored=restore_rng,
        shardkit_version=meta.shardkit_version,
        torch_version=meta.torch_version,
    )


def _read_all(
    path: Path, read: Callable[[], PendingLoad], rank_to_read: int, scaler: Any
) -> tuple[PendingLoad, dict[str, Any], dict[str, Any]]:
    """Everything this rank needs, validated; ``rank_to_read``'s RNG and data position (rank 0's when resized)."""
    pending = read()
    rank_state = safe_load(_rank_file(path, rank_to_read), "rank state")
    common = safe_load(path / COMMON_FILE, "common state")
    if not isinstance(rank_state, dict) or not isinstance(common, dict):
        raise CorruptCheckpointError(f"{path}: the rank or common state is not a dict")
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)() and not common.get("scaler"):
        raise IncompatibleCheckpointError(
            f"{path} holds the state of a disabled scaler; load it with scaler=None or enabled=False"
        )
    return pending, rank_state, common
