"""Resolving, querying and validating process groups (real or :class:`DummyProcessGroup`)."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist

from shardkit.distributed._torch_private import backend_timeout
from shardkit.distributed.dummy import DummyProcessGroup

GroupLike = Union[dist.ProcessGroup, DummyProcessGroup]

# torch 2.13 renamed the tensor-in/tensor-out collectives (``*_single``) and deprecated the old names; older
# releases (shardkit supports torch>=2.4) only have the old ones.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_dummy(group: Optional[GroupLike]) -> bool:
    """True for a :class:`DummyProcessGroup`."""
    return isinstance(group, DummyProcessGroup)


def resolve_group(group: Optional[GroupLike], who: str = "shardkit", argument: str = "process_group") -> GroupLike:
    """Return ``group``, or the default (world) group when it is None.

    Raises a clear error when no group is given and ``torch.distributed`` is not initialised; it names ``who``'s
    own group ``argument`` (OSS calls it ``group``).
    """
    if group is not None:
        return _adopt_foreign_dummy(group)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs a process group: call torch.distributed.init_process_group() first (torchrun sets "
            f"the environment for it), or pass {who}({argument}=DummyProcessGroup(rank=0, size=1), ...) to run in "
            "one process."
        )
    world = dist.group.WORLD
    assert world is not None
    return world


def _adopt_foreign_dummy(group: GroupLike) -> GroupLike:
    """Turn another library's ``DummyProcessGroup`` (fairscale's test helper: same name, ``rank()`` and ``size()``)
    into ours, so code written against fairscale's helper runs unchanged; any other group is returned as is."""
    if isinstance(group, (DummyProcessGroup, dist.ProcessGroup)) or type(group).__name__ != "DummyProcessGroup":
        return group
    rank, size = getattr(group, "rank", None), getattr(group, "size", None)
    if not callable(rank) or not callable(size):
        return group
    return DummyProcessGroup(rank=int(rank()), size=int(size()))


def group_rank(group: Optional[GroupLike]) -> int:
    """This process's rank inside ``group`` (the default group when None)."""
    group = resolve_group(group)
    if isinstance(group, DummyProcessGroup):
        return group.rank()
    return dist.get_rank(group)


def group_size(group: Optional[GroupLike]) -> int:
    """The number of ranks in ``group`` (the default group when None)."""
    group = resolve_group(group)
    if isinstance(group, DummyProcessGroup):
        return group.size()
    return dist.get_world_size(group)


def global_rank(group: Optional[GroupLike], rank_in_group: int) -> int:
    """The global rank of member ``rank_in_group`` of ``group``: what ``src``/``dst`` arguments expect."""
    group = resolve_group(group)
    if isinstance(group, DummyProcessGroup) or group is dist.group.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def planned_on_gloo(group: Optional[GroupLike], tensor: object) -> bool:
    """True for a meta ``tensor`` on a group that stands in for gloo in a planned run (nothing allocated).

    Strategies send CPU tensors by direct sends where gloo's collectives are slow; ``shardkit.plan`` runs their
    code on meta tensors against a group with no peers, which sets ``plans_backend = "gloo"`` when it plans a CPU
    run, so the plan takes the path the real run takes (:func:`on_host_path` is the usual test).
    """
    device = getattr(tensor, "device", None)
    if device is None or device.type != "meta" or is_dummy(group):
        return False
    pg = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    return getattr(pg, "plans_backend", None) == "gloo"


def on_host_path(group: Optional[GroupLike], tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` takes the CPU path of a strategy: it is on the CPU, or a planned gloo run stands in for one.

    Example::

        direct = dp_size == 2 and on_host_path(group, grad)
    """
    return tensor.device.type == "cpu" or planned_on_gloo(group, tensor)


def torch_group(group: Optional[GroupLike], who: str = "shardkit") -> dist.ProcessGroup:
    """``group`` (the world when None) as the ``torch.distributed.ProcessGroup`` torch's collectives take.

    Callers reach torch only for real groups (a ``DummyProcessGroup`` has nothing to communicate with), so a
    dummy here is a bug in the caller and raises rather than reaching the backend.
    """
    group = resolve_group(group, who)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{who}: a {type(group).__name__} cannot run torch.distributed collectives; this code path needs a real "
            "process group (one of world size 1 runs without communicating)"
        )
    return group


def group_timeout(group: Optional[GroupLike] = None) -> timedelta:
    """How long a collective of ``group`` (default: the world) waits before it fails: the timeout the group was
    created with (torch's default when it cannot be read)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):  # a group may run on either, or both
        with contextlib.suppress(Exception):
            timeout = backend_timeout(pg, device)
            if isinstance(timeout, timedelta):
                return timeout
    return dist.default_pg_timeout
