"""The slow-momentum (outer) step of SlowMo (Wang et al., ICLR 2020).

Every ``slowmo_frequency`` steps, with ``x_avg`` the exact average of the parameters over all ranks, ``gamma`` the base
optimizer's learning rate, ``beta`` the slow momentum and ``alpha`` the slow learning rate::

    u  <- beta*u + (x0 - x_avg) / gamma
    x0 <- x0 - alpha*gamma*u
    x  <- x0            (on every rank)

``x0`` is the synchronised point the outer iteration started from (the parameters before the first step for the
first one). Plain mode keeps ``u`` and ``x0`` (float32) whole on every rank and gets ``x_avg`` from an exact average
(skipped when LocalSGD averaged in the same step). Memory-efficient mode splits the flat parameter vector into
``num_shards`` equal chunks owned by ranks ``0..num_shards-1``: a reduce(-scatter) brings each owner the average
of its chunk, the owner updates its slice of ``u`` and ``x0``, and an all-gather (or broadcasts) returns the new
parameters to everyone. That exchange costs about one all-reduce and *is* the exact average.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from shardkit.nn.slowmo.collectives import average_over_nodes, gather_from_shards, reduce_to_shards
from shardkit.nn.slowmo.config import SlowMomentumConfig
from shardkit.nn.slowmo.flat import FlatParams, Segment
from shardkit.nn.slowmo.layout import ProcessLayout, SlowMoGroups


class SlowMomentum:
    """Holds ``u`` and ``x0`` (whole, or this rank's shard) and performs the outer step."""

    def __init__(
        self,
        config: SlowMomentumConfig,
        layout: ProcessLayout,
        groups: SlowMoGroups,
        flat: FlatParams,
        state_device: torch.device,
    ) -> None:
        self.config = config
        self.layout = layout
        self.groups = groups
        self.device = state_device
        self.numel = flat.numel
        self.sharded = config.memory_efficient and layout.world_size > 1
        self.num_shards = config.num_shards if self.sharded else 1
        self.shard_len = math.ceil(self.numel / self.num_shards)
        owns = layout.process_rank < self.num_shards if self.sharded else True
        #: First flat index of this rank's shard (None: this rank holds no slow-momentum state).
        self.shard_start: Optional[int] = layout.process_rank * self.shard_len if self.sharded and owns else None
        if not self.sharded:
            self.shard_start = 0
        size = self.shard_len if self.sharded else self.numel
        self.anchor: Optional[torch.Tensor] = None  # x0
        self.momentum: Optional[torch.Tensor] = None  # u
        if self.shard_start is not None:
            self.anchor = torch.zeros(size, dtype=torch.float32, device=state_device)
            self.momentum = torch.zeros_like(self.anchor)
        self.reset_anchor(flat)

    def reset_anchor(self, flat: FlatParams) -> None:
        """Take the current (synchronised) parameters as ``x0`` and clear ``u``."""
        if self.anchor is None or self.momentum is None or self.shard_start is None:
            return
        full = flat.copy_to(flat.new_buffer(torch.float32, self.device))
        stop = min(self.shard_start + self.anchor.numel(), self.numel)
        self.anchor.zero_()
        self.anchor[: stop - self.shard_start].copy_(full[self.shard_start : stop])
        self.momentum.zero_()

    def step(self, flat: FlatParams, segments: list[Segment], averaged_already: bool) -> None:
        """The outer step on ``flat`` (every rank calls it); ``segments`` give ``gamma`` per element."""
        if self.sharded:
            self._sharded_step(flat, segments)
        else:
            self._plain_step(flat, segments, averaged_already)

    def _plain_step(self, flat: FlatParams, segments: list[Segment], averaged_already: bool) -> None:
        average = flat.copy_to(flat.new_buffer(torch.float32, self.device))
        if not averaged_already:
            average_over_nodes(average, self.groups, self.layout)
        self._update(average, segments, 0)
        assert self.anchor is not None
        flat.copy_from(self.anchor)

    def _sharded_step(self, flat: FlatParams, segments: list[Segment]) -> None:
        group = self.groups.global_group
        padded = torch.zeros(self.shard_len * self.num_shards, dtype=torch.float32, device=self.device)
        flat.copy_to(padded)
        shard = (
            torch.empty(self.shard_len, dtype=torch.float32, device=self.device) if self.anchor is not None else None
        )
        reduce_to_shards(padded, shard, self.num_shards, group, self.layout.world_size)
        if shard is not None:
            assert self.shard_start is not None
            shard.div_(self.layout.world_size)
            self._update(shard, segments, self.shard_start)
            assert self.anchor is not None  # a shard exists exactly when this rank holds an anchor
            shard.copy_(self.anchor)
        gather_from_shards(padded, shard, self.num_shards, group, self.layout.world_size)
        flat.copy_from(padded)

    @torch.no_grad()
    def _update(self, average: torch.Tensor, segments: list[Segment], offset: int) -> None:
        """``u <- beta*u + (x0 - x_avg)/gamma`` and ``x0 <- x0 - alpha*gamma*u`` on ``[offset, offset + len)``."""
        assert self.anchor is not None and self.momentum is not None
        beta, alpha = self.config.momentum, self.config.lr
        for seg in segments:
            start, stop = max(seg.start, offset), min(seg.stop, offset + average.numel())
            if start >= stop:
                continue
            local = slice(start - offset, stop - offset)
            x0, u, xbar = self.anchor[local], self.momentum[local], average[local]
            u.copy_(beta * u + (x0 - xbar) / seg.lr)
            x0.copy_(x0 - alpha * seg.lr * u)
