"""Sending updated parameters from their owners to every rank, in flat buckets the parameters live in.

Each owner's trainable parameters are grouped by device and dtype into buckets of at most ``bucket_bytes`` (a
tensor larger than that gets a bucket of its own). Every bucket is one flat buffer and its parameters' ``.data``
are views into it, as fairscale's OSS and torch's ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)``
do: the owner's optimizer updates the buffer in place and the other ranks receive straight into it, so a step
copies nothing. On the bench LM that saves packing and unpacking 56 MiB per step (about 20 ms on this
machine, most of it first-touch page faults of freshly allocated buffers).

Code that replaces a parameter's ``.data`` (``module.to(...)``, ``module.half()``) detaches it from its
bucket; :func:`buckets_intact` notices and the caller rebuilds the buckets from the current values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit.distributed import collectives
from shardkit.distributed.buckets import BROADCAST_BUCKET_BYTES
from shardkit.distributed.groups import GroupLike, global_rank, group_size, on_host_path
from shardkit.optim.zero1.partition import Partition
from shardkit.utils.tensors import runs_by_kind

_COMPRESSIBLE = (torch.float32, torch.float64)

#: Tag of the parameter messages: the receives are open during the step, when other point-to-point traffic
#: between the same ranks (ShardedDataParallel's gradient sends, for one) must not land in them.
EXCHANGE_TAG = 0x05D0


@dataclass(frozen=True)
class ParamBucket:
    """Parameters of ``owner`` stored in one flat buffer (same device and dtype), sent as ``wire_dtype``.

    ``offsets[i]`` is where ``params[i]`` starts in ``flat``, in elements.
    """

    owner: int
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    flat: torch.Tensor
    wire_dtype: torch.dtype

    def intact(self) -> bool:
        """True while every parameter's data is still its view into ``flat``."""
        base, itemsize = self.flat.data_ptr(), self.flat.element_size()
        return all(
            p.dtype == self.flat.dtype and p.device == self.flat.device and p.data_ptr() == base + offset * itemsize
            for p, offset in zip(self.params, self.offsets)
        )


def _plan(partition: Partition, bucket_bytes: int) -> list[tuple[int, list[torch.Tensor]]]:
    """(owner, parameters) of each bucket, the same list on every rank."""
    return [
        (owner, run)
        for owner in range(partition.world_size)
        for run in runs_by_kind(partition.owned(owner, trainable_only=True), bucket_bytes)
    ]


def _is_dense(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` covers a gap-free block of memory, in any dimension order (contiguous, channels-last)."""
    expected = 1
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


@torch.no_grad()
def _flatten(owner: int, params: list[torch.Tensor], wire_dtype: torch.dtype) -> ParamBucket:
    """Move ``params`` into one new flat buffer and make each parameter's ``.data`` a view of its slice.

    Dense parameters keep their strides (a channels-last weight stays channels-last); a parameter that is not
    dense (a strided view) becomes contiguous.
    """
    numel = sum(p.numel() for p in params)
    flat = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
    offsets = []
    offset = 0
    for p in params:
        if not p.is_contiguous() and _is_dense(p):
            view = flat.as_strided(p.size(), p.stride(), offset)
        else:
            view = flat[offset : offset + p.numel()].view(p.size())
        view.copy_(p.detach())
        p.data = view
        offsets.append(offset)
        offset += p.numel()
    return ParamBucket(owner, tuple(params), tuple(offsets), flat, wire_dtype)


def build_buckets(
    partition: Partition, broadcast_fp16: bool, bucket_bytes: int = BROADCAST_BUCKET_BYTES
) -> list[ParamBucket]:
    """Flat buckets for the trainable parameters of ``partition``, in the same order on every rank.

    With ``broadcast_fp16`` fp32/fp64 buckets travel as fp16, halving the bytes on the wire.
    """
    buckets = []
    for owner, params in _plan(partition, bucket_bytes):
        dtype = params[0].dtype
        wire = torch.float16 if broadcast_fp16 and dtype in _COMPRESSIBLE else dtype
        buckets.append(_flatten(owner, params, wire))
    return buckets


def buckets_intact(buckets: Sequence[ParamBucket]) -> bool:
    """False when some parameter's ``.data`` was replaced since the buckets were built."""
    return all(bucket.intact() for bucket in buckets)


class ParamExchange:
    """One step's exchange of updated parameters: started before the owners' optimizer step, finished after it.

    CPU buckets (gloo) travel as direct sends from each owner to every peer, which gloo runs concurrently (its
    broadcasts queue one after another on its worker threads). Every rank posts the receives of the buckets it
    does not own at construction, so a rank that finishes its shard early streams it into the others while
    they are still stepping; on the bench LM at world size 2 that took the optimizer phase from about 95 to
    73 ms. Between two ranks, messages match in the order they were posted, and every rank posts in bucket
    order, so buckets cannot be confused. Accelerator buckets (NCCL) are broadcast after the step instead: a
    collective must be issued in the same order everywhere, and a root cannot issue its own before its step.

    ``direct`` forces the choice (``True``: sends, ``False``: broadcasts) for every bucket. The owner keeps its
    own full-precision values; with fp16 buckets the other ranks receive them rounded.
    """

    def __init__(
        self, buckets: Sequence[ParamBucket], rank: int, group: GroupLike, direct: Optional[bool] = None
    ) -> None:
        self.buckets = list(buckets)
        self.rank = rank
        self.group = group
        on_cpu = [on_host_path(group, b.flat) for b in self.buckets]
        self._direct = [cpu if direct is None else direct for cpu in on_cpu]
        self._wires: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._handles: list[collectives.Handle] = []
        for index, bucket in enumerate(self.buckets):
            if self._direct[index] and bucket.owner != rank:
                wire = self._wire(bucket)
                self._wires[index] = wire
                src = global_rank(group, bucket.owner)
                self._handles.append(collectives.recv(wire, src, group, label=_label(bucket), tag=EXCHANGE_TAG))

    @staticmethod
    def _wire(bucket: ParamBucket) -> torch.Tensor:
        """What travels for ``bucket`` on this rank: its flat buffer itself, unless converted to ``wire_dtype``."""
        flat = bucket.flat
        if bucket.wire_dtype == flat.dtype:
            return flat
        return torch.empty(flat.numel(), dtype=bucket.wire_dtype, device=flat.device)

    @torch.no_grad()
    def finish(self) -> None:
        """Send this rank's updated buckets (after its step), complete every transfer, and unpack fp16 buckets."""
        peers = [global_rank(self.group, r) for r in range(group_size(self.group)) if r != self.rank]
        for index, bucket in enumerate(self.buckets):
            if bucket.owner == self.rank:
                flat = bucket.flat
                wire = flat if bucket.wire_dtype == flat.dtype else flat.to(bucket.wire_dtype)
                self._wires[index] = wire
            elif not self._direct[index]:
                self._wires[index] = wire = self._wire(bucket)
            else:
                continue
            if self._direct[index]:
                for peer in peers:
                    self._handles.append(
                        collectives.send(wire, peer, self.group, label=_label(bucket), tag=EXCHANGE_TAG)
                    )
            else:
                self._handles.append(
                    collectives.broadcast(wire, bucket.owner, self.group, async_op=True, label=_label(bucket))
                )
        collectives.wait_all(self._handles)
        self._handles = []
        for bucket, received in zip(self.buckets, self._wires):
            if bucket.owner != self.rank and received is not None and received is not bucket.flat:
                bucket.flat.copy_(received)
        self._wires = [None] * len(self.buckets)


def _label(bucket: ParamBucket) -> str:
    return f"oss.params.from{bucket.owner}"


def exchange_params(buckets: Sequence[ParamBucket], rank: int, group: GroupLike, direct: Optional[bool] = None) -> None:
    """Overwrite every rank's copy of each bucket with its owner's values (a :class:`ParamExchange` at once)."""
    ParamExchange(buckets, rank, group, direct).finish()
