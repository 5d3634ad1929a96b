"""Full state dicts of a tensor-parallel smp model: the tensor-parallel ranks' slices merged into whole tensors, and a
whole state dict cut back into this rank's slices, by the core's record of how each parameter is split
(:func:`~shardkit.tensor_parallel.tp_sharding`: its own layers', and those smp's distributed modules declared).
Partial state dicts stay per rank: each holds its own slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardkit.distributed import all_gather_objects
from shardkit.modelparallel import state as smp_state
from shardkit.tensor_parallel import tp_sharding
from shardkit.tensor_parallel.shard_files import merge_state_dicts
from shardkit.utils.tensors import to_cpu


def merge_tp_slices(local: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """The whole state dict from this rank's ``local`` one (keys of ``module``): collective over the
    tensor-parallel group, every rank gets the merged tensors (on the CPU). Unchanged without tensor parallelism."""
    state = smp_state.current()
    specs = tp_sharding(module)
    if state.topology.tp_size == 1 or not specs:
        return local
    shards = all_gather_objects(to_cpu(local), state.tp_group, "smp_tp_state_dict")
    return merge_state_dicts(shards, {key: spec for key, spec in specs.items() if key in local})


def cut_tp_slices(whole: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """This rank's slices of a whole state dict (the split tensors of full size are cut; the rest as given)."""
    state = smp_state.current()
    topo = state.topology
    specs = tp_sharding(module)
    if topo.tp_size == 1 or not specs:
        return dict(whole)
    out = dict(whole)
    for key, spec in specs.items():
        value, here = out.get(key), module.get_parameter(key)
        if isinstance(value, torch.Tensor) and value.shape[spec.dim] == here.shape[spec.dim] * topo.tp_size:
            out[key] = spec.shard(value, topo.tp_rank, topo.tp_size)
    return out
