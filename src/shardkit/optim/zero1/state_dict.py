"""Converting between the sharded optimizer state of OSS and a plain ``torch.optim`` state dict.

A plain state dict names parameters by their position in the global parameter order (all groups, in order), so
it is independent of the world size: saving consolidates every rank's shard under those positions, loading
keeps only the positions this rank owns under the current partition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from shardkit.distributed.groups import GroupLike
from shardkit.distributed.objects import broadcast_object
from shardkit.optim.zero1.partition import Partition
from shardkit.utils.tensors import to_cpu

_NOT_HYPERPARAMS = ("params", "param_names")


def hyperparams(group: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a param group: everything but its parameters (and their names)."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMS}


def shard_state(optim: Optimizer, partition: Partition) -> dict[int, Any]:
    """This rank's optimizer state keyed by global parameter position, on the CPU."""
    index_of = partition.index_of()
    return {index_of[p]: to_cpu(s) for p, s in optim.state.items() if isinstance(p, torch.Tensor) and s}


def pack_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups with each parameter replaced by its global position, as ``Optimizer.state_dict`` does."""
    packed, start = [], 0
    for group in param_groups:
        entry = hyperparams(group)
        if "param_names" in group:
            entry["param_names"] = list(group["param_names"])
        entry["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        packed.append(entry)
    return packed


def check_plain_state_dict(state_dict: Mapping[str, Any], param_groups: Sequence[dict[str, Any]]) -> None:
    """Raise a ValueError saying what is wrong if ``state_dict`` cannot be loaded into ``param_groups``."""
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(
            "OSS.load_state_dict expects a plain torch.optim state dict with 'state' and 'param_groups' entries, "
            "such as the one OSS.state_dict() returns after consolidate_state_dict()"
        )
    saved = state_dict["param_groups"]
    if len(saved) != len(param_groups):
        raise ValueError(
            f"the state dict has {len(saved)} param groups but this OSS has {len(param_groups)}; build OSS with "
            "the same param groups as the optimizer that was saved"
        )
    for i, (ours, theirs) in enumerate(zip(param_groups, saved)):
        if len(ours["params"]) != len(theirs["params"]):
            raise ValueError(
                f"param group {i} has {len(ours['params'])} parameters here but {len(theirs['params'])} in the "
                "state dict; build OSS with the same parameters, in the same order, as the saved optimizer"
            )
    known = {pid for g in saved for pid in g["params"]}
    unknown = [k for k in state_dict["state"] if k not in known]
    if unknown:
        raise ValueError(f"the state dict has state for parameter ids {unknown[:5]} that no param group lists")


def load_shard(
    optim: Optimizer,
    partition: Partition,
    rank: int,
    global_state: Mapping[int, Any],
) -> None:
    """Load into ``optim`` (built over ``partition.rank_groups[rank]``) the state of the parameters it owns.

    ``global_state`` is keyed by global parameter position. Going through ``optim.load_state_dict`` lets the
    optimizer cast each tensor to its parameter's device and dtype by its own rules.
    """
    index_of = partition.index_of()
    local_groups: list[dict[str, Any]] = []
    local_state: dict[int, Any] = {}
    for group in optim.param_groups:
        entry = hyperparams(group)
        start = sum(len(g["params"]) for g in local_groups)
        entry["params"] = list(range(start, start + len(group["params"])))
        for local_id, p in zip(entry["params"], group["params"]):
            if index_of[p] in global_state:
                local_state[local_id] = global_state[index_of[p]]
        local_groups.append(entry)
    optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def exchange_moved_state(
    optim: Optimizer, old: Partition, new: Partition, rank: int, group: GroupLike
) -> dict[int, Any]:
    """After a re-partition, hand each moved parameter's state from its old owner to its new one.

    Returns the state this rank keeps, keyed by global position under ``new``: what it already held for the
    parameters it still owns plus what it received. Only ranks that lose a parameter send, one object broadcast
    each; every rank derives that list from the two partitions, so all issue the same collectives.
    """
    new_index = new.index_of()
    kept = {new_index[p]: s for p, s in optim.state.items() if p in new.owner and new.owner[p] == rank and s}
    moved = [p for p in new.params if p in old.owner and old.owner[p] != new.owner[p]]
    for src in sorted({old.owner[p] for p in moved}):
        payload = None
        if src == rank:
            payload = {
                new_index[p]: to_cpu(optim.state[p]) for p in moved if old.owner[p] == rank and optim.state.get(p)
            }
        received = broadcast_object(payload, src, group, label="oss.migrate_state")
        for position, state in received.items():
            if new.owner[new.params[position]] == rank:
                kept[position] = state
    return kept
