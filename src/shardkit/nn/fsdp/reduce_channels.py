"""Where each unit reduce-scatters its gradients: ``process_group_reduce_scatter`` checked at construction, and the
separate reduce channels planned at the root's first forward.

A channel is a second process group over the parameter group's ranks, so reduce-scatters never queue behind
prefetching all-gathers; every unit sharing a parameter group must agree on it, and the channels are created on
every rank at one agreed point (:func:`~shardkit.nn.fsdp._collectives.create_reduce_channels`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch.distributed as dist

from shardkit.distributed.groups import GroupLike, group_size, is_dummy, resolve_group, torch_group
from shardkit.nn.fsdp._collectives import create_reduce_channels
from shardkit.nn.fsdp.policies import FSDPPolicies, ProcessGroupName
from shardkit.nn.fsdp.runtime import Unit
from shardkit.nn.fsdp.unit_module import choice_name


def resolve_reduce_group(policies: FSDPPolicies, group: GroupLike) -> FSDPPolicies:
    """Resolve an explicit ``process_group_reduce_scatter`` against the parameter group ``group``."""
    choice = policies.reduce.group
    if isinstance(choice, ProcessGroupName):
        return policies
    choice = resolve_group(choice, "FullyShardedDataParallel(process_group_reduce_scatter=...)")
    size, world_size = group_size(choice), group_size(group)
    if size != world_size:
        # fairscale's behaviour: a group of another size cannot reduce-scatter these shards; use the
        # parameter group instead.
        warnings.warn(
            f"process_group_reduce_scatter has {size} ranks but process_group has {world_size}: gradients are "
            "reduce-scattered on process_group instead",
            stacklevel=4,
        )
        choice = ProcessGroupName.default
    elif world_size > 1 and is_dummy(choice) != is_dummy(group):
        raise ValueError(
            "process_group_reduce_scatter and process_group must both be real process groups or both "
            "DummyProcessGroups: a dummy group cannot reduce gradients of real ranks"
        )
    elif world_size > 1 and not is_dummy(group):
        who = "FullyShardedDataParallel"
        ours = dist.get_process_group_ranks(torch_group(group, who))
        theirs = dist.get_process_group_ranks(torch_group(choice, who))
        if ours != theirs:
            raise ValueError(
                f"process_group_reduce_scatter holds ranks {theirs} but process_group holds {ours}: gradients "
                "must be reduced over the ranks that share the parameters; pass a group over the same ranks "
                "or ProcessGroupName.reduce_scatter"
            )
    return dataclasses.replace(policies, reduce=dataclasses.replace(policies.reduce, group=choice))


def plan_reduce_channels(units: list[tuple[str, Unit]]) -> Callable[[], dict[int, GroupLike]]:
    """Check that units sharing a parameter group agree on where it reduce-scatters (``units``: readable name and
    unit); return what creates the channels (keyed by ``id`` of the parameter group), to be called on every rank
    at the same point."""
    chosen: dict[int, tuple[GroupLike, Any, str]] = {}
    for name, unit in units:
        group, choice = unit.group.group, unit.policies.reduce.group
        earlier = chosen.setdefault(id(group), (group, choice, name))
        if earlier[1] is not choice:
            raise ValueError(
                f"units '{earlier[2]}' and '{name}' shard over the same process group but ask for different "
                f"process_group_reduce_scatter ({choice_name(earlier[1])} and {choice_name(choice)}); "
                "give every unit of one process group the same value"
            )

    def create() -> dict[int, GroupLike]:
        separate = [g for g, choice, _ in chosen.values() if choice is ProcessGroupName.reduce_scatter]
        channels = create_reduce_channels(separate)
        for key, (_, choice, _) in chosen.items():
            if not isinstance(choice, ProcessGroupName):
                channels[key] = choice
        return channels

    return create
