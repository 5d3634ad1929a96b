"""Prefetch as the seed describes it, the reduce channel, the rate limit, and what prefetch costs in memory.

The order of events is recorded on a three-block LM wrapped per block: when each unit starts its forward /
backward, when each unit's gather is issued and when each reduce-scatter starts.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

import shardkit.nn.fsdp._collectives as fsdp_collectives
from shardkit.memory import MemoryTracker
from shardkit.nn.fsdp import BackwardPrefetch
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp.handle import FlatParamHandle
from shardkit.nn.fsdp.runtime import Unit
from shardkit.testing import models as M
from shardkit.testing import run_distributed

CFG = M.LMConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=3, seq_len=8)
PRE, POST = BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST


def _lm(cfg: M.LMConfig, **kwargs: Any) -> FSDP:
    torch.manual_seed(0)
    model = M.TransformerLM(cfg)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, **kwargs)
    return FSDP(model, **kwargs)


class _Recorder:
    """Patches the runtime (in this worker process only) to log ``(event, unit name)`` in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.max_prefetched = 0
        self.reduce_groups: list[Any] = []
        self.owner: dict[int, Unit] = {}
        self._install()

    def _install(self) -> None:
        rec = self
        pre_forward, pre_backward = Unit.pre_forward, Unit.pre_backward
        unshard, reduce_grad = FlatParamHandle.unshard, FlatParamHandle.reduce_grad
        reduce_scatter = fsdp_collectives.reduce_scatter_grads

        def unit_pre_forward(self: Unit, *a: Any) -> Any:
            rec.events.append(("pre_forward", self.name))
            return pre_forward(self, *a)

        def unit_pre_backward(self: Unit) -> None:
            if self.state.name != "BACKWARD_PRE":
                rec.events.append(("pre_backward", self.name))
            pre_backward(self)
            rec.max_prefetched = max(rec.max_prefetched, len(self.tree_schedule.prefetched))

        def handle_unshard(self: FlatParamHandle, *a: Any) -> None:
            if not self.is_unsharded:
                rec.events.append(("gather", rec.owner[id(self)].name))
            unshard(self, *a)

        def handle_reduce(self: FlatParamHandle, *a: Any) -> Any:
            rec.events.append(("reduce", rec.owner[id(self)].name))
            return reduce_grad(self, *a)

        def record_group(grad_shard: Any, full_grad: Any, group: Any, label: str) -> Any:
            rec.reduce_groups.append(group)
            return reduce_scatter(grad_shard, full_grad, group, label)

        Unit.pre_forward = unit_pre_forward  # type: ignore[method-assign]
        Unit.pre_backward = unit_pre_backward  # type: ignore[method-assign]
        FlatParamHandle.unshard = handle_unshard  # type: ignore[method-assign]
        FlatParamHandle.reduce_grad = handle_reduce  # type: ignore[method-assign]
        fsdp_collectives.reduce_scatter_grads = record_group

    def reset(self) -> None:
        self.events.clear()
        self.reduce_groups.clear()
        self.owner.clear()
        self.max_prefetched = 0

    def watch(self, model: FSDP) -> None:
        for unit in (m._unit for m in model.modules() if isinstance(m, FSDP)):
            for handle in unit.group.handles:
                self.owner[id(handle)] = unit

    def index(self, event: str, name: str, after: int = 0) -> int:
        return next(i for i in range(after, len(self.events)) if self.events[i] == (event, name))


def _train(model: FSDP, rec: _Recorder, steps: int) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = M.make_batch("lm", model.module, 2, seed=10 * step + dist.get_rank())
        rec.events.append(("step", str(step)))
        loss = M.loss_for("lm", model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _order(rec: _Recorder, prefetch: Optional[BackwardPrefetch], forward: bool) -> list[float]:
    rec.reset()
    model = _lm(CFG, backward_prefetch=prefetch, forward_prefetch=forward)
    rec.watch(model)
    losses = _train(model, rec, steps=2)
    second = rec.index("step", "1")
    bw = rec.index("pre_backward", model._unit.name, after=second)
    root, b2, b1, b0 = model._unit.name, "blocks.2", "blocks.1", "blocks.0"
    gather_b1, gather_b2 = rec.index("gather", b1, after=bw), rec.index("gather", b2, after=bw)
    if prefetch == PRE:  # issued in the pre-backward hook of the unit before it in backward order
        assert rec.index("pre_backward", root, after=second) < gather_b2 < rec.index("pre_backward", b2, after=bw)
        assert rec.index("pre_backward", b2, after=bw) < gather_b1 < rec.index("reduce", b2, after=bw)
    elif prefetch == POST:  # issued once the previous unit's gradient is out, before the unit's own hook
        assert rec.index("reduce", b2, after=bw) < gather_b1 < rec.index("pre_backward", b1, after=bw)
    else:
        assert gather_b1 > rec.index("pre_backward", b1, after=bw)
    assert rec.max_prefetched <= 1, "more than one unit gathered ahead of its use"
    # Forward prefetch starts at the second step: block 1 is gathered before its forward begins.
    first_gather = rec.index("gather", b1)
    assert first_gather > rec.index("pre_forward", b1)
    fw_gather = rec.index("gather", b1, after=second)
    assert (fw_gather < rec.index("pre_forward", b1, after=second)) == forward
    assert rec.index("gather", b0, after=bw) > rec.index("reduce", b1, after=bw) or prefetch is not None
    # Reductions ran on a second group over the same ranks, never on the parameter group.
    assert rec.reduce_groups and all(g is not model.process_group for g in rec.reduce_groups)
    ranks = dist.get_process_group_ranks(model.process_group)
    assert all(dist.get_process_group_ranks(g) == ranks for g in rec.reduce_groups)
    return losses


def _all_orders(rank: int, world_size: int) -> list[list[float]]:
    rec = _Recorder()  # patches once per worker process
    return [_order(rec, p, f) for p, f in [(None, False), (PRE, False), (POST, False), (PRE, True)]]


def test_prefetch_issues_gathers_where_the_seed_says_one_unit_ahead_and_changes_nothing() -> None:
    per_rank = run_distributed(_all_orders, 2)
    for losses in per_rank:
        assert all(variant == losses[0] for variant in losses), "prefetch changed the results"


def _peak(prefetch: Optional[BackwardPrefetch], cfg: M.LMConfig) -> tuple[int, int]:
    """Peak tracked bytes of the second training step, and one block's full (padded) parameter bytes."""
    with MemoryTracker() as tracker:
        model = _lm(cfg, backward_prefetch=prefetch, forward_prefetch=prefetch is not None)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker.watch(model, optim)
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
            tokens, targets = M.make_batch("lm", model.module, 1, seed=step + dist.get_rank())
            M.loss_for("lm", model(tokens), targets).backward()
            optim.step()
            optim.zero_grad()
        block = model.module.blocks[0]
        assert isinstance(block, FSDP)
        full = sum(m.padded_numel * 4 for m in block.flat_param_metas)
        return tracker.peak.total, full


def _prefetch_memory(rank: int, world_size: int) -> tuple[int, int, int]:
    # Wide and short: parameters, not activations, decide the peak, so the extra gathered block shows.
    cfg = M.LMConfig(vocab_size=32, d_model=64, n_heads=2, n_layers=4, seq_len=4)
    without, block = _peak(None, cfg)
    with_prefetch, _ = _peak(PRE, cfg)
    return without, with_prefetch, block


def test_prefetch_raises_peak_memory_by_at_most_one_layer() -> None:
    for without, with_prefetch, block in run_distributed(_prefetch_memory, 2):
        assert 0 < with_prefetch - without <= block, (without, with_prefetch, block)


def _subgroups(rank: int, world_size: int) -> list[float]:
    # Hybrid sharding: ranks {0, 1} and {2, 3} each shard their own replica; channels are made for both pairs.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    model = _lm(CFG, process_group=group, backward_prefetch=PRE, forward_prefetch=True)
    rec = _Recorder()
    rec.watch(model)
    losses = _train(model, rec, steps=2)
    channel = model._unit.comm.reduce_channel(group)
    assert channel is not group and dist.get_process_group_ranks(channel) == dist.get_process_group_ranks(group)
    assert rec.reduce_groups and all(g is channel for g in rec.reduce_groups)
    return losses


def _world_pair(rank: int, world_size: int) -> list[float]:
    rec = _Recorder()
    model = _lm(CFG, backward_prefetch=PRE, forward_prefetch=True)
    rec.watch(model)
    return _train(model, rec, steps=2)


def test_reduce_channels_for_ranks_sharding_over_different_subgroups() -> None:
    hybrid = run_distributed(_subgroups, 4)
    # The pair {0, 1} trains exactly like the same two ranks sharding over a world of two.
    assert hybrid[:2] == run_distributed(_world_pair, 2)
