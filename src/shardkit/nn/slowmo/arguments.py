"""The constructor's arguments for :class:`~shardkit.nn.slowmo.api.SlowMoDistributedDataParallel`: checks, defaults.

:func:`checked_settings` runs this rank's checks of every argument without communicating and turns them into the
layout, the frozen configs and the gossip topology; the wrapper shares its outcome with the other ranks before it
builds anything. :func:`resolve_global_group` and :func:`default_comm_device` pick the defaults fairscale's
arguments leave open.

Example::

    group = resolve_global_group(None, process_world_size=None)
    layout, config, topology = checked_settings(group, model, 1, None, None, None, None, slowmo_frequency=12)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import DummyProcessGroup, GroupLike, is_dummy, resolve_group, torch_group
from shardkit.nn.slowmo.config import SlowMoConfig, configs_from_arguments
from shardkit.nn.slowmo.flat import FlatParams
from shardkit.nn.slowmo.graphs import GraphManager
from shardkit.nn.slowmo.layout import ProcessLayout, make_layout
from shardkit.nn.slowmo.mixing import MixingManager
from shardkit.nn.slowmo.topology import resolve_topology


def resolve_global_group(group: Optional[GroupLike], process_world_size: Optional[int]) -> GroupLike:
    """The group the wrapper spans: ``group`` when given, a one-rank dummy group for a single process without
    ``torch.distributed``, else the default group."""
    if group is not None:
        return group
    if process_world_size == 1 and not (dist.is_available() and dist.is_initialized()):
        return DummyProcessGroup(0, 1)
    return resolve_group(None, "SlowMoDistributedDataParallel")


def default_comm_device(group: GroupLike, param_device: torch.device) -> torch.device:
    """Where communication buffers live when ``comm_device`` is not given."""
    # gloo moves CPU tensors only for point-to-point work: stage through the CPU whatever the parameters' device.
    if not is_dummy(group) and dist.get_backend(torch_group(group, "SlowMoDistributedDataParallel")) == "gloo":
        return torch.device("cpu")
    return param_device


def check_params(params: list[nn.Parameter]) -> None:
    """Refuse parameters of more than one dtype (the flat buffers hold one)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise ValueError(
            f"SlowMo needs every parameter in one dtype, found {sorted(map(str, dtypes))}; cast the module (for "
            "fp16 training keep an fp32 master copy and pass it as perform_slowmo(..., fp32_params=...))"
        )


def checked_settings(
    group: GroupLike,
    module: nn.Module,
    nprocs_per_node: int,
    process_rank: Optional[int],
    process_world_size: Optional[int],
    graph: Optional[GraphManager],
    mixing: Optional[MixingManager],
    **arguments: Any,
) -> tuple[ProcessLayout, SlowMoConfig, Optional[tuple[GraphManager, MixingManager]]]:
    """This rank's checks of every argument (no communication): the layout, the configs and the topology."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"SlowMoDistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
    layout = make_layout(group, nprocs_per_node, process_rank, process_world_size)
    config = configs_from_arguments(world_size=layout.world_size, **arguments)
    topology = resolve_topology(config.wrapper.base_algorithm, layout, graph, mixing, config.gossip.push_sum)
    params = list(module.parameters())
    FlatParams(params)
    check_params(params)
    return layout, config, topology
