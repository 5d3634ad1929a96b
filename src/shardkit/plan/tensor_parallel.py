"""Planning a tensor-parallel model: the planned rank builds the model inside a ``tensor x data`` layout.

With ``tensor_parallel=t`` the planner lays the world out as :func:`shardkit.tensor_parallel.init_parallel_state`
does (tensor-parallel ranks consecutive, data parallelism over the rest), makes that state current while
``model_fn`` builds the model (its tensor-parallel layers then hold this rank's slices: the parameters, gradients
and optimizer state counted are ``1/t`` of the split layers'), and gives the strategy the data-parallel group.
The layers' all-reduces (or sequence parallelism's reduce-scatters and all-gathers) go through shardkit's
collectives, so the comm meter counts them as it counts every strategy's: nothing is taken from a formula.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch.distributed as dist

from shardkit import tensor_parallel as tp


def check_tensor_parallel(tensor_parallel: int, world_size: int, pipeline: bool) -> None:
    """Refuse a degree that is not a positive int dividing ``world_size``, or one given with a pipeline plan."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {tensor_parallel!r}")
    if world_size % tensor_parallel:
        fitting = tp.divisors(world_size)
        raise ValueError(
            f"tensor_parallel={tensor_parallel} does not divide world_size={world_size}: the world is data x "
            f"tensor ranks; degrees that fit: {fitting}"
        )
    if pipeline and tensor_parallel > 1:
        raise ValueError("tensor_parallel > 1 is not planned with the smp pipeline yet: plan it with 1")


@contextlib.contextmanager
def tensor_parallel_state(tensor_parallel: int) -> Iterator[Optional[tp.ParallelState]]:
    """The current tensor-parallel state of the planned world for the block (None and nothing done for 1)."""
    if tensor_parallel == 1:
        yield None
        return
    state = tp.init_parallel_state(tensor=tensor_parallel, device_type="cpu")
    try:
        yield state
    finally:
        tp.set_current_state(None)


def data_group() -> Optional[dist.ProcessGroup]:
    """The group a strategy shards or replicates over: the data-parallel one under tensor parallelism, else None
    (the default group)."""
    return tp.current_state().group("data") if tp.has_current_state() else None


__all__ = ["check_tensor_parallel", "data_group", "tensor_parallel_state"]
