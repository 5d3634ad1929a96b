"""What completes a step's gradients under sharded data parallelism.

FullyShardedDataParallel reduce-scatters each gradient inside the sharding group and all-reduces the shard over
the replica group during every backward, averaging over the reduced-data-parallel ranks; gradients accumulate in
the shards across micro-batches and across ``backward_passes_per_step`` steps (a sum of reductions is the reduction
of the sum). Under tensor parallelism one more step is needed where the ranks of a tensor-parallel group trained
on different batches (``prescaled_batch`` False, smp's default), to give the same averages as smp's data parallelism
(:mod:`~shardkit.modelparallel.pipeline.grad_sync`): the shard of a parameter outside the distributed modules is
averaged over the tensor-parallel group too, and that of a distributed module's parameter (split or not), whose
gradient already covers the group's batches, is divided by its size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from shardkit.distributed import collectives as C


class ShardedGradientSync:
    """The stage's gradient completion: the interface of
    :class:`~shardkit.modelparallel.pipeline.grad_sync.GradientSync` that a step's schedule calls."""

    def __init__(
        self,
        shards: Sequence[tuple[Any, bool]],
        tp_group: Optional[Any],
        tp_size: int,
        prescaled: bool,
        backward_passes_per_step: int = 1,
    ) -> None:
        #: Every shard of the stage, and whether its parameter belongs to a distributed module.
        self.shards = list(shards)
        self.tp_group = tp_group
        self.tp_size = tp_size
        self.prescaled = prescaled
        self.joining = False
        self.backward_passes_per_step = backward_passes_per_step
        self._passes = 0

    def arm(self) -> None:
        """Nothing to arm: the shards' reductions run inside every backward."""

    def finish(self, had_backward: bool) -> None:
        """After the step's last backward: the tensor-parallel averages (see the module docstring), once per
        ``backward_passes_per_step`` steps, on the gradients accumulated over them."""
        if not had_backward:
            return
        self._passes += 1
        if self._passes % self.backward_passes_per_step or self.tp_group is None or self.prescaled:
            return
        for shard, is_split in self.shards:
            grad = shard.grad
            if grad is None:
                continue
            if not is_split:
                C.all_reduce(grad, group=self.tp_group, label="smp_sdp_tp_replicated_grads")
            grad.div_(self.tp_size)

    def join_flag(self, value: int) -> int:
        """``DistributedModel.join()`` is not supported with sharded data parallelism."""
        raise NotImplementedError(
            "model.join() (uneven inputs across replicas) is not supported with sharded_data_parallel_degree > 1: "
            "give every rank the same number of batches"
        )

    def shadow_reduction(self) -> None:
        """See :meth:`join_flag`."""
        self.join_flag(0)

    def close(self) -> None:
        """Nothing to remove (the wrapped unit stays as it is)."""
