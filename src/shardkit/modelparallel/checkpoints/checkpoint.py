"""State dicts across stages, and ``smp.save`` / ``smp.load``.

A *partial* state dict holds what one stage holds (marked ``_smp_is_partial``); a *full* one is the model's
ordinary ``state_dict`` (same keys and order as the unwrapped module), so it loads into a plain torch model.
Full dicts are built by gathering the partial ones over the replica's stages; a tensor several stages hold
(tied or replicated) is taken from the lowest stage holding it.

``smp.load`` reads partial checkpoints in both layouts smp v1 has written: the seed's ``<f>_<mp_rank>`` and
v1.10+'s ``<f>_<pp_rank>_<tp_rank>.pt``; ``smp.save`` writes the seed's. Folders of ``smp.save_checkpoint`` are
:mod:`~.checkpoint_folders`'s; reading the files is :mod:`~.checkpoint_files`'s.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from shardkit.distributed import GroupLike, all_gather_objects
from shardkit.distributed.arrival import every_rank_calls
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.checkpoints.checkpoint_files import (
    MISSING,
    agree_on_problems,
    load_folder,
    load_weights,
    partial_file_problem,
    stage_files,
)
from shardkit.utils.tensors import to_cpu

PARTIAL_KEY = "_smp_is_partial"
#: The call a user made, by the label of the gather it leads to (for the every-rank check's messages).
_GATHER_CALLS = {
    "smp_model_state_dict": "DistributedModel.state_dict()",
    "smp_model_load_state_dict": "DistributedModel.load_state_dict()",
    "smp_optimizer_state_dict": "DistributedOptimizer.state_dict()",
    "smp_optimizer_load_state_dict": "DistributedOptimizer.load_state_dict()",
}
_GATHER_ADVICE = "Call it on every rank (every stage of the pipeline), then save on one rank (smp.save does that)."


def state_key_map(module: nn.Module) -> dict[str, str]:
    """Every ``state_dict`` key of ``module`` -> the canonical name of its tensor (tied names share one)."""
    canonical: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        canonical.setdefault(id(tensor), name)
        alias[name] = canonical[id(tensor)]
    return {key: alias.get(key, key) for key in module.state_dict()}


def is_partial(state_dict: Mapping[str, Any]) -> bool:
    """True for a dict made by ``local_state_dict()``."""
    return bool(state_dict.get(PARTIAL_KEY, False))


def gather_partials(partial: Mapping[str, Any], mp_group: GroupLike, label: str) -> list[dict[str, Any]]:
    """Every stage's partial state dict (moved to the CPU first), in stage order (collective over the replica).

    Every rank of the replica must call it: checked first (:func:`~shardkit.distributed.arrival.every_rank_calls`).
    """
    every_rank_calls(_GATHER_CALLS.get(label, f"smp {label}"), mp_group, _GATHER_ADVICE)
    return all_gather_objects(to_cpu(dict(partial)), mp_group, label)


def merge_model_partials(partials: Sequence[Mapping[str, Any]], key_order: list[str]) -> OrderedDict[str, Any]:
    """One full model state dict from every stage's partial one (lowest stage wins for shared keys)."""
    merged: OrderedDict[str, Any] = OrderedDict()
    missing = []
    for key in key_order:
        for partial in partials:
            if key in partial:
                merged[key] = partial[key]
                break
        else:
            missing.append(key)
    if missing:
        raise KeyError(f"no stage's partial state dict holds {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return merged


def merge_optimizer_partials(partials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One full optimizer state dict (torch format) from every stage's partial one."""
    state: dict[int, Any] = {}
    for partial in partials:
        for index, value in partial["state"].items():
            state.setdefault(int(index), value)
    return {"state": dict(sorted(state.items())), "param_groups": partials[0]["param_groups"]}


def _checked_name(f: Any) -> str:
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"smp.save/smp.load take a file name (str), got {type(f).__name__}")
    return os.fspath(f)


def _save_path(f: str, partial: bool) -> str:
    name = _checked_name(f)
    return stage_files(name)[0] if partial else name  # under tensor parallelism, smp v1.10+'s name of the slice


def save(
    obj: Any, f: str, partial: bool = True, pickle_module: Any = None, pickle_protocol: int = 2, **kwargs: Any
) -> None:
    """Save ``obj`` like ``torch.save``; with ``partial=True`` each stage writes its own ``f"{f}_{mp_rank}"`` (under
    tensor parallelism each rank its ``f"{f}_{pp_rank}_{tp_rank}.pt"``).

    With ``partial=False`` only stage 0 writes ``f`` (the stages hold the same full object). Call it on the
    ranks with ``dp_rank() == 0``.

    Example::

        if smp.dp_rank() == 0:
            smp.save({"model": model.local_state_dict()}, "ckpt.pt", partial=True)
    """
    path = _save_path(f, partial)
    if not partial and smp_state.is_initialized() and smp_state.pp_rank() != 0:
        return
    extra: dict[str, Any] = {"pickle_protocol": pickle_protocol, **kwargs}
    if pickle_module is not None:
        extra["pickle_module"] = pickle_module
    torch.save(to_cpu(obj), path, **extra)


def load(
    f: str,
    map_location: Any = None,
    pickle_module: Any = None,
    partial: bool = True,
    weights_only: bool = True,
    **pickle_load_args: Any,
) -> Any:
    """Load what :func:`save` (or smp) wrote; with ``partial=True`` each stage reads its own file.

    A partial checkpoint is read in the seed's layout (``f"{f}_{mp_rank}"``) or in smp v1.10+'s
    (``f"{f}_{pp_rank}_{tp_rank}.pt"``, the only one under tensor parallelism: each rank reads its slices); one saved
    at a larger tensor-parallel degree, or with more stages than this run, is refused. Collective over every rank
    (call it on all of them): when any rank lacks its file, every rank raises a ``FileNotFoundError`` naming the
    ranks and files. Loading is weights-only unless
    ``weights_only=False`` is passed for a file you trust.

    ``f`` may also be a folder ``smp.save_checkpoint`` wrote (the checkpoint in its ``newest`` file) or one of
    its ``<tag>_partial`` folders: this stage's ``{"model": ..., "optimizer": ..., "user_content": ...}`` comes
    back (``optimizer`` None when the checkpoint has none).

    Example::

        checkpoint = smp.load("ckpt.pt", partial=True)
        model.load_state_dict(checkpoint["model"])
    """
    name = _checked_name(f)
    if os.path.isdir(name):
        loaded = load_folder(name, partial, map_location)
        if loaded is not None:
            return loaded
    if partial:
        files = stage_files(name)
        agree_on_problems(partial_file_problem(name, files, "smp.load: partial checkpoint"), "smp.load")
        path = next(candidate for candidate in files if os.path.exists(candidate))
    else:
        problem = None if os.path.exists(name) else f"smp.load: {MISSING} {name!r}"
        agree_on_problems(problem, "smp.load")
        path = name
    if weights_only:
        return load_weights(path, map_location, **pickle_load_args)
    extra: dict[str, Any] = dict(pickle_load_args)
    if pickle_module is not None:
        extra["pickle_module"] = pickle_module
    return torch.load(path, map_location=map_location, weights_only=False, **extra)
