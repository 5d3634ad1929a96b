"""Reading smp's checkpoint files: the layouts, weights-only loading, and problems agreed on every rank.

Partial checkpoints come in two layouts: the seed's ``<f>_<mp_rank>`` and smp v1.10+'s ``<f>_<pp_rank>_<tp_rank>.pt``
(also inside ``smp.save_checkpoint``'s ``<tag>_partial`` folders, with ``user_content.pt``, beside a ``newest``
file; see :mod:`~.checkpoint_folders`); under tensor parallelism only the latter, one file per (stage, tensor-parallel
rank), each holding that rank's slices. Every rank reads its own stage's files, so each check's result is shared
over the world before anything is loaded: a file missing on one rank fails on every rank, naming it.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from typing import Any, Optional

import torch

from shardkit.distributed import all_gather_objects
from shardkit.distributed.arrival import every_rank_calls
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.checkpoints.user_content import decode

MISSING = "no file"
"""Words every missing-file problem contains (they make :func:`agree_on_problems` raise FileNotFoundError)."""
NEWEST = "newest"
USER_CONTENT = "user_content.pt"


def _stage_and_tp() -> tuple[int, int, int]:
    """This process's pipeline stage, tensor-parallel rank and degree (0, 0, 1 outside smp)."""
    if not smp_state.is_initialized():
        return 0, 0, 1
    topo = smp_state.current().topology
    return topo.mp_rank, topo.tp_rank, topo.tp_size


def stage_files(name: str) -> tuple[str, ...]:
    """This rank's file of a partial checkpoint ``name``: in the seed's layout (``<f>_<mp_rank>``) and in smp
    v1.10+'s (``<f>_<pp_rank>_<tp_rank>.pt``); under tensor parallelism only the latter (it names the slice)."""
    stage, _, tp_size = _stage_and_tp()
    if tp_size > 1 or sdp_shard_rank() is not None:  # the name says which slice (and shard) it holds
        return (stage_name(name),)
    return f"{name}_{stage}", f"{name}_{stage}_0.pt"


def partial_file_problem(name: str, files: Sequence[str], what: str) -> Optional[str]:
    """Why this rank cannot read the partial checkpoint whose files would be ``files`` (None if it can).

    ``files`` are this rank's candidate names; the checkpoint ``name`` is refused when it was written at a larger
    tensor-parallel degree (a ``_<tp_size>.pt`` sibling: slices of another layout) or with more pipeline stages than
    this run (a smaller layout shows as this rank's missing file).
    """
    stages = smp_state.pp_size() if smp_state.is_initialized() else 1
    stage, _, tp_size = _stage_and_tp()
    if os.path.exists(f"{name}_{stage}_{tp_size}.pt"):
        return (
            f"{what} {name!r} was saved with tensor parallelism at a larger degree ({name}_{stage}_{tp_size}.pt "
            f"exists; this run has tensor_parallel_degree={tp_size}): a partial checkpoint loads only at the layout it "
            "was saved with; load it with that tensor_parallel_degree, or save a full checkpoint (partial=False) and "
            "load that"
        )
    for extra in (f"{name}_{stages}", f"{name}_{stages}_0.pt"):
        if os.path.exists(extra):
            return (
                f"{what} {name!r} has a file for pipeline stage {stages} ({extra}) but this run has {stages} stages: "
                "load it with the number of partitions it was saved with, or save a full checkpoint (partial=False)"
            )
    if not any(os.path.exists(candidate) for candidate in files):
        return f"{what}: {MISSING} for pipeline stage {stage} (looked for {' and '.join(map(repr, files))})"
    return None


def agree_on_problems(problem: Optional[str], what: str) -> None:
    """Raise on every rank if any rank found a problem with its checkpoint files (collective over the world).

    Each rank reads its own stage's files; without this, a rank missing its file would fail alone and the others
    would wait for it in the next collective. The error is a ``FileNotFoundError`` when a file is missing, else
    a ``ValueError`` (a layout this run cannot load).
    """
    problems: list[Optional[str]] = [problem]
    if smp_state.is_initialized() and smp_state.current().distributed:
        world = smp_state.current().world_group
        every_rank_calls(what, world, "load a checkpoint on every rank: each stage reads its own file")
        problems = all_gather_objects(problem, world, "smp_checkpoint_files")
    found = [f"rank {rank}: {p}" for rank, p in enumerate(problems) if p is not None]
    if found:
        message = f"{what} cannot be loaded; " + "; ".join(found)
        if any(MISSING in p for p in found):
            raise FileNotFoundError(message)
        raise ValueError(message)


def load_weights(path: str, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with weights-only unpickling (tensors, containers, numbers, strings: no code runs)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        raise pickle.UnpicklingError(
            f"{path!r} holds objects that weights-only loading refuses (only tensors, containers, numbers and "
            f"strings load without running code): {str(exc).splitlines()[0]}"
        ) from exc


def stage_name(prefix: str) -> str:
    """``<prefix>_<pp_rank>_<tp_rank>.pt`` for this rank (smp's partial file of one stage's tensor-parallel slice);
    under sharded data parallelism ``<prefix>_<pp_rank>_<tp_rank>_<shard>.pt``, one file per shard."""
    stage, tp_rank, _ = _stage_and_tp()
    shard = sdp_shard_rank()
    return f"{prefix}_{stage}_{tp_rank}.pt" if shard is None else f"{prefix}_{stage}_{tp_rank}_{shard}.pt"


def sdp_shard_rank() -> Optional[int]:
    """This rank's place in its sharding group under sharded data parallelism, else None."""
    if not smp_state.is_initialized():
        return None
    state = smp_state.current()
    degree = state.config.sharded_data_parallel_degree
    return state.topology.rdp_rank % degree if degree > 1 else None


def newest_tag(path: str) -> Optional[str]:
    """The tag in ``path/newest``, or None when there is none."""
    try:
        with open(os.path.join(path, NEWEST), encoding="utf-8") as src:
            return src.read().strip() or None
    except FileNotFoundError:
        return None


def read_checkpoint(
    path: str, tag: Optional[str], partial: bool, optimizer: Optional[bool], what: str, map_location: Any = "cpu"
) -> dict[str, Any]:
    """What :func:`save_checkpoint` wrote under ``path`` for ``tag`` (None: ``path/newest``), for this stage:
    ``{"model": ..., "optimizer": ... or None, "user_content": ...}`` (the model and optimizer partial for a
    partial checkpoint, full otherwise), read weights-only.

    ``optimizer``: True needs the optimizer's state (a partial checkpoint without it is an error), False skips
    it, None takes it when the checkpoint has it. Collective over every rank: when any rank lacks a file it
    needs, every rank raises a ``FileNotFoundError`` naming the ranks and files; ``what`` names the caller.
    """
    tag = tag if tag is not None else newest_tag(path)
    if tag is None:
        agree_on_problems(f"no tag given and {MISSING} {os.path.join(path, NEWEST)!r}", what)
    assert tag is not None
    files: dict[str, Optional[str]]
    if partial:
        folder = os.path.join(path, f"{tag}_partial")
        if optimizer is None:  # every stage must agree on whether the checkpoint has optimizer state
            optimizer = os.path.isfile(stage_name(os.path.join(folder, "optimizer")))
            if smp_state.is_initialized() and smp_state.current().distributed:
                world = smp_state.current().world_group
                optimizer = any(all_gather_objects(optimizer, world, "smp_checkpoint_optimizer"))
        agree_on_problems(_partial_problem(folder, optimizer, what), what)
        files = {"model": stage_name(os.path.join(folder, "model")), "optimizer": None}
        if optimizer:
            files["optimizer"] = stage_name(os.path.join(folder, "optimizer"))
        user_content = os.path.join(folder, USER_CONTENT)
    else:
        model_file, optimizer_file = os.path.join(path, tag), os.path.join(path, f"optimizer_{tag}")
        user_content = os.path.join(path, f"user_content_{tag}")
        missing = [f for f in (model_file, user_content) if not os.path.isfile(f)]
        agree_on_problems(f"{MISSING} {missing}" if missing else None, what)
        files = {"model": model_file, "optimizer": optimizer_file if optimizer is not False else None}
        if files["optimizer"] is not None and not os.path.isfile(optimizer_file):
            files["optimizer"] = None  # a full checkpoint saved without an optimizer (resume warns)
    loaded = {name: load_weights(f, map_location) if f else None for name, f in files.items()}
    return {**loaded, "user_content": decode(load_weights(user_content, map_location))}


def _partial_problem(folder: str, optimizer: bool, what: str) -> Optional[str]:
    what = f"{what}: partial checkpoint folder {folder!r}"
    if not os.path.isdir(folder):
        return f"{what}: {MISSING} (the folder does not exist)"
    if not os.path.isfile(os.path.join(folder, USER_CONTENT)):
        return f"{what}: {MISSING} {USER_CONTENT}"
    for name in ["model"] + (["optimizer"] if optimizer else []):
        prefix = os.path.join(folder, name)
        problem = partial_file_problem(prefix, [stage_name(prefix)], what)
        if problem is not None:
            return problem
    return None


def load_folder(f: str, partial: bool, map_location: Any = None) -> Optional[dict[str, Any]]:
    """``smp.load`` of a folder :func:`save_checkpoint` wrote (``path``, read through ``newest``, or one
    ``<tag>_partial`` folder): this stage's ``{"model", "optimizer", "user_content"}``; None for other paths."""
    if os.path.isfile(os.path.join(f, NEWEST)):
        return read_checkpoint(f, None, partial, None, "smp.load", map_location)
    name = os.path.basename(os.path.normpath(f))
    if name.endswith("_partial") and os.path.isfile(os.path.join(f, USER_CONTENT)):
        parent = os.path.dirname(os.path.normpath(f))
        return read_checkpoint(parent, name[: -len("_partial")], True, None, "smp.load", map_location)
    return None
