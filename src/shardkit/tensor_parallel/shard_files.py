"""Per-rank model-parallel shard files: the ``consolidated.0N.pth`` layout of Llama's released checkpoints.

File ``consolidated.{r:02d}.pth`` holds tensor-parallel rank ``r``'s state dict: each split parameter cut along its
:class:`~shardkit.tensor_parallel.sharding.ShardSpec` (column-parallel weights on dimension 0, row-parallel weights
and ``ParallelEmbedding`` on dimension 1), every other tensor whole. :func:`split_state_dict` and
:func:`merge_state_dicts` convert between one full state dict and the per-rank ones; :func:`load_shard_file` loads
this rank's file into a model after checking it fits: the number of files is the tensor-parallel degree, the file's
index is this rank, every tensor has this rank's shape, and the replicated tensors agree across the
tensor-parallel ranks. A file that does not fit raises the same ``ValueError``
on every rank, before any weight is changed.

Example::

    shards = split_state_dict(full_state_dict, tp_sharding(model), tp_size=2)
    save_shard_files("ckpt/", shards)              # consolidated.00.pth, consolidated.01.pth
    load_shard_file(model, "ckpt/")                 # on every rank: its own file
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed.objects import all_gather_objects
from shardkit.tensor_parallel.sharding import ShardSpec, TensorParallelModule, tp_sharding

_FILE = re.compile(r"^consolidated\.(\d+)\.pth$")
StateDict = Mapping[str, torch.Tensor]


def shard_file_name(tp_rank: int) -> str:
    """The file name of tensor-parallel rank ``tp_rank``'s shard: ``consolidated.00.pth`` for rank 0."""
    return f"consolidated.{tp_rank:02d}.pth"


def split_state_dict(full: StateDict, specs: Mapping[str, ShardSpec], tp_size: int) -> list[dict[str, torch.Tensor]]:
    """One state dict per tensor-parallel rank from a full one (split keys cut, the others copied to every rank)."""
    return [
        {key: (specs[key].shard(value, r, tp_size) if key in specs else value).clone() for key, value in full.items()}
        for r in range(tp_size)
    ]


def merge_state_dicts(shards: Sequence[StateDict], specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """The full state dict from every rank's (the inverse of :func:`split_state_dict`)."""
    return {
        key: specs[key].unshard([shard[key] for shard in shards]) if key in specs else value
        for key, value in shards[0].items()
    }


def save_shard_files(directory: Union[str, os.PathLike[str]], shards: Sequence[StateDict]) -> list[Path]:
    """Write ``shards[r]`` to ``directory/consolidated.{r:02d}.pth``; returns the paths."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / shard_file_name(r) for r in range(len(shards))]
    for path, shard in zip(paths, shards):
        torch.save(dict(shard), path)
    return paths


def _tp_place(model: nn.Module) -> tuple[int, int, tuple[int, ...]]:
    """This rank's tensor-parallel rank, the degree, and the global ranks of its group."""
    for module in model.modules():
        if isinstance(module, TensorParallelModule):
            ranks = dist.get_process_group_ranks(module.tp.group) if module.tp.size > 1 else [dist.get_rank()]
            return module.tp.rank, module.tp.size, tuple(ranks)
    return 0, 1, (dist.get_rank(),)


def _digests(loaded: StateDict, specs: Mapping[str, ShardSpec]) -> dict[str, str]:
    """A short digest of every replicated tensor: the tensor-parallel ranks must load the same values."""
    return {
        key: hashlib.sha1(_bytes(value)).hexdigest()[:16]
        for key, value in loaded.items()
        if key not in specs and isinstance(value, torch.Tensor)
    }


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _replica_errors(reports: list[tuple[Optional[str], tuple[int, ...], dict[str, str]]]) -> list[str]:
    """Ranks of one tensor-parallel group whose files disagree on a replicated tensor (files of two checkpoints)."""
    errors = []
    for rank, (_, group, digests) in enumerate(reports):
        first = reports[group[0]][2]
        differing = [key for key, digest in digests.items() if key in first and first[key] != digest]
        if rank != group[0] and differing:
            errors.append(
                f"rank {rank}'s file and rank {group[0]}'s hold different values of the replicated "
                f"{differing[:3]} (every model-parallel rank's file must come from the same checkpoint)"
            )
    return errors


def _choose_file(path: Path, tp_rank: int, tp_size: int) -> tuple[Optional[Path], Optional[str]]:
    """The file this rank loads, or why there is none."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if _FILE.match(p.name))
        if len(files) != tp_size:
            return None, (
                f"{path} holds {len(files)} shard files (a checkpoint for model-parallel size {len(files)}) but the "
                f"model is split across {tp_size} ranks: load it with initialize_model_parallel({len(files)}), or "
                "reshard it with split_state_dict(merge_state_dicts(...), ...)"
            )
        return files[tp_rank], None
    match = _FILE.match(path.name)
    if match and int(match.group(1)) != tp_rank:
        return None, f"{path.name} is the shard of model-parallel rank {int(match.group(1))}, not of rank {tp_rank}"
    return path, None


def _shape_errors(model: nn.Module, loaded: StateDict, specs: Mapping[str, ShardSpec], tp_size: int) -> list[str]:
    """Tensors whose shape is not this rank's, saying which degree the file was cut for where it can tell."""
    own = model.state_dict()
    errors = []
    for key, value in loaded.items():
        if key not in own or tuple(value.shape) == tuple(own[key].shape):
            continue
        spec = specs.get(key)
        degree = ""
        if spec is not None and value.dim() == own[key].dim() and value.shape[spec.dim]:
            full = own[key].shape[spec.dim] * tp_size
            if full % value.shape[spec.dim] == 0:
                degree = f" (cut for model-parallel size {full // value.shape[spec.dim]})"
        errors.append(f"'{key}' has shape {list(value.shape)}, this rank's is {list(own[key].shape)}{degree}")
    return errors


def load_shard_file(
    model: nn.Module,
    path: Union[str, os.PathLike[str]],
    strict: bool = True,
    map_location: Union[str, torch.device] = "cpu",
) -> None:
    """Load this tensor-parallel rank's shard into ``model`` (a collective over the world: every rank calls it).

    ``path`` is a directory of ``consolidated.NN.pth`` files (this rank's is chosen) or one file. Checked on every
    rank before anything is loaded: the number of files equals the model's tensor-parallel degree, a file's index
    equals this rank, every tensor has this rank's shape, and the ranks of a tensor-parallel group load the same
    values for every replicated tensor (a digest each: files of two checkpoints mixed are refused). Any failure
    raises the same ``ValueError`` on every rank, naming the ranks and what is wrong. Loads with ``weights_only=True``.
    """
    tp_rank, tp_size, tp_ranks = _tp_place(model)
    specs = tp_sharding(model)
    chosen, error = _choose_file(Path(path), tp_rank, tp_size)
    loaded: dict[str, torch.Tensor] = {}
    if chosen is not None:
        loaded = torch.load(chosen, map_location=map_location, weights_only=True)
        shape_errors = _shape_errors(model, loaded, specs, tp_size)
        if shape_errors:
            error = f"{chosen.name} does not fit this rank's model: " + "; ".join(shape_errors[:3])
    reports = all_gather_objects((error, tp_ranks, _digests(loaded, specs)), None, "load_shard_file")
    by_message: dict[str, list[int]] = {}
    for rank, (message, _, _) in enumerate(reports):
        if message:
            by_message.setdefault(message, []).append(rank)
    failed = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}" for m, r in by_message.items()]
    failed = failed or _replica_errors(reports)
    if failed:
        raise ValueError("load_shard_file: nothing was loaded. " + " | ".join(failed))
    model.load_state_dict(loaded, strict=strict)
