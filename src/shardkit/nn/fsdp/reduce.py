"""Gradient reduction of one flat parameter: start the reduce-scatter, and later fold its result into ``.grad``.

:func:`start_reduce` issues the reduce-scatter on the tree's reduce channel (on CUDA, on the reduce stream)
and returns a :class:`PendingReduce`. The root's :class:`ReduceQueue` keeps at most one of them in flight behind
the newest, so the full gradient it holds is freed one unit later instead of at the end of backward: each new
reduce-scatter is started first, then every older one is finished, so at most one full gradient waits on the
network while the next unit computes; one that completed earlier is finished (and its full gradient freed) as
soon as the next hook notices.

Averaging: in FP32 the *shard* of the sum is divided by the world size after the reduction, which touches
``1/world_size`` of the elements; in 16-bit the full gradient is divided first, so the sum cannot overflow.

Replicas (hybrid sharding, NO_SHARD): when the unit has a replica group, the reduced shard is then all-reduced
over it (the ranks holding the same shard on the other nodes), so only shard-sized messages cross nodes. The
node-local reduce-scatter is waited for at once (fast link; on CUDA only the reduce stream waits) and the
all-reduce started right behind it, so the slow part overlaps the next unit's backward, and every rank issues the
all-reduces in one order (the order the units' gradients are ready). The average runs over shard group x replica
group.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Optional

import torch
from torch import nn

from shardkit import memory
from shardkit.distributed.collectives import Handle
from shardkit.distributed.groups import GroupLike
from shardkit.memory.offload import to_host
from shardkit.nn.fsdp import _collectives
from shardkit.nn.fsdp.comm_context import CommContext, join


class PendingReduce:
    """A reduce-scatter in flight and what to do with its result."""

    def __init__(
        self,
        shard: nn.Parameter,
        grad_shard: torch.Tensor,
        work: Optional[Handle] = None,
        full_grad: Optional[torch.Tensor] = None,
        stream: Optional[torch.cuda.Stream] = None,
        post_divide: float = 1,
        replica: Optional[GroupLike] = None,
        label: str = "",
    ) -> None:
        self.shard = shard
        self.grad_shard = grad_shard
        self.work = work
        #: Kept alive until the reduction finished reading it.
        self.full_grad = full_grad
        self.stream = stream
        self.post_divide = post_divide
        #: Group the reduced shard is still to be all-reduced over (None: nothing more to do, or started).
        self.replica = replica
        self.label = label
        self._replica_work: Optional[Handle] = None

    @classmethod
    def ready(cls, shard: nn.Parameter, grad: torch.Tensor) -> PendingReduce:
        """A result that needs no communication (one rank): ``grad`` is already the shard's gradient."""
        return cls(shard, grad)

    def done(self) -> bool:
        """True when :meth:`finish` would not wait for communication; starts the replica all-reduce once the
        reduce-scatter it follows has finished."""
        if self.work is not None and not self.work.is_completed():
            return False
        if self.replica is not None:
            self.start_replica()
        return self._replica_work is None or self._replica_work.is_completed()

    def start_replica(self) -> None:
        """All-reduce the reduced shard over the replica group, after the reduce-scatter (on CUDA, queued behind
        it on the reduce stream, so the compute stream never waits for it here)."""
        replica, self.replica = self.replica, None
        assert replica is not None
        with contextlib.ExitStack() as stack:
            if self.stream is not None:
                stack.enter_context(torch.cuda.stream(self.stream))
            if self.work is not None:
                self.work.wait()
                self.work = None
            self.full_grad = None  # read by the reduce-scatter only: freed before the slow cross-node part
            self._replica_work = _collectives.all_reduce_replicas(self.grad_shard, replica, self.label)

    def finish(self) -> Optional[torch.cuda.Event]:
        """Wait for the reduction and add its result to the shard's ``.grad`` (in the shard's dtype and device).

        Returns an event when a copy to CPU may still be in flight (offload from CUDA into pinned memory): the
        caller synchronises on it before the optimizer reads the gradient.
        """
        if self.work is not None:
            self.work.wait()
            self.work = None
        join(self.stream)
        if self.stream is not None:
            # Allocated on the reduce stream, read from now on by the compute stream (the optimizer, as .grad):
            # without this, freeing it lets the reduce stream reuse the memory under queued compute kernels.
            self.grad_shard.record_stream(torch.cuda.current_stream(self.grad_shard.device))
        if self.replica is not None:
            self.start_replica()
        if self._replica_work is not None:
            self._replica_work.wait()
            self._replica_work = None
            join(self.stream)
        self.full_grad = None
        grad = self.grad_shard
        if self.post_divide != 1:
            grad.div_(self.post_divide)
        shard = self.shard
        copying: Optional[torch.cuda.Event] = None
        if shard.grad is None and grad.device != shard.device and shard.is_pinned():
            # Offloaded from CUDA: copy into pinned memory without blocking; synchronised at the end of backward.
            target = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=True)
            target.copy_(grad, non_blocking=True)
            copying = torch.cuda.Event()
            copying.record(torch.cuda.current_stream(grad.device))  # the stream the copy was queued on
            grad = target
        elif grad.device != shard.device and shard.device.type == "cpu":
            grad = to_host(grad, shard.dtype)  # the shard lives in host memory (CPU offload)
        elif grad.device != shard.device or grad.dtype != shard.dtype:
            grad = grad.to(shard.device, shard.dtype)
        if shard.grad is None:
            shard.grad = grad.view(shard.shape)
        else:
            shard.grad.add_(grad.view(shard.shape))
        memory.tag(shard.grad, memory.Category.GRADIENTS)
        return copying


def start_reduce(
    shard: nn.Parameter,
    full_grad: torch.Tensor,
    dtype: torch.dtype,
    group: GroupLike,
    world_size: int,
    label: str,
    ctx: CommContext,
    divide: Optional[tuple[float, float]] = None,
    replica: Optional[GroupLike] = None,
    replica_size: int = 1,
) -> PendingReduce:
    """Issue the reduce-scatter of ``full_grad`` (ours to modify: autograd handed it over) over ``group``.

    ``divide``: the ``(before, after)`` factors of ``gradient_predivide_factor``; None chooses as described above.
    ``replica``: the group (of ``replica_size`` ranks) the reduced shard is then all-reduced over; with a shard
    group of one rank (NO_SHARD) the all-reduce is the only collective.
    """
    dp_size = world_size * replica_size
    with ctx.reduce.issue(full_grad.device) as stream:
        if stream is not None:
            full_grad.record_stream(stream)  # produced on the compute stream, read on the reduce stream
        grad = full_grad.to(dtype)
        pre_divide = dp_size > 1 and dtype != torch.float32
        before, after = divide if divide is not None else (dp_size if pre_divide else 1, 1 if pre_divide else dp_size)
        if before != 1:
            grad.div_(before)
        memory.tag(grad, memory.Category.GRADIENTS)
        if world_size == 1:
            grad_shard, work, kept = grad, None, None  # the full gradient is the shard's: only replicas to add
        else:
            grad_shard = torch.empty(grad.numel() // world_size, dtype=dtype, device=grad.device)
            work = _collectives.reduce_scatter_grads(grad_shard, grad, ctx.reduce_channel(group), label)
            kept = grad
    pending = PendingReduce(shard, grad_shard, work, kept, stream, after, replica if replica_size > 1 else None, label)
    if pending.replica is not None:
        pending.start_replica()  # the reduce-scatter stays in the node: wait for it, send the slow part now
    return pending


class ReduceQueue:
    """The reductions in flight of one unit tree, oldest first (owned by the root unit)."""

    def __init__(self) -> None:
        self._pending: deque[PendingReduce] = deque()
        # Host copies still in flight (offload from CUDA): the optimizer must not read those gradients before.
        self._copies: list[torch.cuda.Event] = []

    def add(self, pending: Optional[PendingReduce]) -> None:
        """Queue a started reduction, then finish every older one (one stays in flight behind the newest)."""
        if pending is None:
            return
        self._pending.append(pending)
        while len(self._pending) > 1:
            self._finish(self._pending.popleft())

    def poll(self) -> None:
        """Finish the reductions that already completed, oldest first, without waiting: their full gradients
        are freed now instead of at the next unit's post-backward."""
        while self._pending and self._pending[0].done():
            self._finish(self._pending.popleft())

    def finish_all(self) -> None:
        """Finish every reduction in flight; synchronise pending copies to pinned CPU memory."""
        while self._pending:
            self._finish(self._pending.popleft())
        # Waits for exactly the copies, on whatever stream each was queued (the end-of-backward callback may run
        # with another current stream than the hooks that queued them).
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    def _finish(self, pending: PendingReduce) -> None:
        copying = pending.finish()
        if copying is not None:
            self._copies.append(copying)

    def abandon(self) -> None:
        """Drop everything in flight after a failed backward (the collectives keep their tensors alive)."""
        self._pending.clear()
