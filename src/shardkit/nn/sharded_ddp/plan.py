"""Planning the reduce collectives of one backward pass: which gradients travel together, to whom, in what order.

The plan is a pure function of the trainable parameters (their order, shapes, dtypes and owners), so every
rank computes the same list of :class:`ReduceUnit` without communicating; that agreement is what lets the
reducer issue asynchronous reduces in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardkit.nn.sharded_ddp.policy import ReducePolicy


@dataclass(frozen=True)
class ReduceUnit:
    """One reduce collective: the gradients of ``params``, all owned by rank ``owner`` of the group.

    A unit of a single gradient that needs no conversion is reduced in the gradient tensor itself; any other
    unit packs its gradients into one flat ``wire_dtype`` buffer, gradient ``i`` at element ``offsets[i]``.
    """

    owner: int
    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numel: int
    wire_dtype: torch.dtype

    @property
    def packed(self) -> bool:
        """True when the gradients go through a flat buffer (several of them, or a dtype conversion)."""
        return len(self.params) > 1 or self.params[0].dtype != self.wire_dtype

    @property
    def nbytes(self) -> int:
        """Bytes this unit puts on the wire."""
        return self.numel * self.wire_dtype.itemsize


def _make_unit(owner: int, params: Sequence[torch.Tensor], wire_dtype: torch.dtype) -> ReduceUnit:
    offsets = []
    total = 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    return ReduceUnit(owner, tuple(params), tuple(offsets), total, wire_dtype)


def plan_reduction(
    params: Sequence[torch.Tensor], owner_of: Mapping[torch.Tensor, int], policy: ReducePolicy
) -> list[ReduceUnit]:
    """Group ``params`` (given in the order their gradients are expected, usually reverse registration order)
    into reduce units.

    Small gradients (at most ``policy.small_bytes``) bound for the same owner, device and wire dtype are packed
    greedily, in that order, into buckets of at most ``policy.bucket_bytes``; larger ones travel alone, in
    place when no dtype conversion is needed. Each unit is placed at the position of its last member, so a
    bucket never delays the units whose gradients are ready before it is complete. Buckets are allocated only
    for the duration of a backward pass, so their size bounds transient memory, not what stays allocated
    between steps.
    """
    placed: list[tuple[int, ReduceUnit]] = []
    open_buckets: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}
    open_bytes: dict[tuple[int, torch.device, torch.dtype], int] = {}
    position_of = {p: i for i, p in enumerate(params)}

    def close(key: tuple[int, torch.device, torch.dtype]) -> None:
        members = open_buckets.pop(key)
        open_bytes.pop(key)
        placed.append((position_of[members[-1]], _make_unit(key[0], members, key[2])))

    for position, p in enumerate(params):
        owner = owner_of[p]
        wire = policy.wire_dtype(p.dtype)
        size = p.numel() * wire.itemsize
        if size > policy.small_bytes:
            placed.append((position, _make_unit(owner, [p], wire)))
            continue
        key = (owner, p.device, wire)
        if key in open_buckets and open_bytes[key] + size > policy.bucket_bytes:
            close(key)
        open_buckets.setdefault(key, []).append(p)
        open_bytes[key] = open_bytes.get(key, 0) + size
    for key in list(open_buckets):
        close(key)
    placed.sort(key=lambda item: item[0])
    return [unit for _, unit in placed]
