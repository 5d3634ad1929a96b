"""FSDP's layers keep their contracts: policies refuse invalid settings, the state-dict layer reaches a unit through
``fsdp_unit`` only, the schedule and the reduce queue stand alone, a failed backward returns every unit to IDLE
through the transition table, and the gloo exchange equals the backend's collectives."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.distributed import collectives as c
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.fsdp import BackwardPrefetch, TrainingState
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp.policies import FSDPPolicies, MixedPrecisionPolicy, PrefetchPolicy, ReducePolicy
from shardkit.nn.fsdp.reduce import PendingReduce, ReduceQueue
from shardkit.nn.fsdp.unit_module import UnitModule, walk_modules
from shardkit.testing import run_distributed

ONE = DummyProcessGroup(rank=0, size=1)


def test_policies_refuse_invalid_settings_even_through_replace() -> None:
    policies = FSDPPolicies()
    with pytest.raises(ValueError, match="reduce_dtype"):
        MixedPrecisionPolicy(reduce_dtype=torch.float32)  # FP32 reduction without 16-bit compute
    with pytest.raises(ValueError, match="force_input_to_fp32"):
        MixedPrecisionPolicy(param_dtype=torch.float16, force_input_to_fp32=True)
    with pytest.raises(ValueError, match="int8"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="BackwardPrefetch"):
        PrefetchPolicy(backward="pre")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="predivide_factor"):
        dataclasses.replace(policies.reduce, predivide_factor=0.0)
    with pytest.raises(ValueError, match="postdivide_factor needs"):
        ReducePolicy(postdivide_factor=2.0)
    with pytest.raises(TypeError, match="bucket_cap_mb"):
        dataclasses.replace(policies, bucket_cap_mb="25")
    with pytest.raises(TypeError, match=r"FSDPPolicies\.prefetch"):
        dataclasses.replace(policies, prefetch=None)
    ok = dataclasses.replace(policies.prefetch, backward=BackwardPrefetch.BACKWARD_PRE)
    assert ok.backward is BackwardPrefetch.BACKWARD_PRE


def test_one_walker_names_modules_as_the_unwrapped_model() -> None:
    inner = FSDP(nn.Linear(2, 2), process_group=ONE)
    model = FSDP(nn.Sequential(checkpoint_wrapper(inner), nn.Linear(2, 1)), process_group=ONE)
    seen = {id(m): (clean, real) for clean, real, m in walk_modules(model)}
    # The wrapper levels add no segment to the clean path; the real path keeps them.
    assert seen[id(model.module[1])] == ("1", "module.1")
    assert seen[id(inner)][0] == "0" and seen[id(inner.wrapped_module)] == ("0", seen[id(inner)][1] + ".module")
    units = [m for _, _, m in walk_modules(model, into_units=False) if isinstance(m, UnitModule)]
    assert units == [model, inner]
    below_inner = [m for _, _, m in walk_modules(model, into_units=False) if m is inner.wrapped_module]
    assert below_inner == []  # a nested unit is yielded but not entered
    assert set(dict(model.named_parameters())) == {"0.flat_param_0", "flat_param_0"}


def test_fsdp_unit_is_the_run_time_state_the_layers_read() -> None:
    model = FSDP(nn.Linear(3, 2), process_group=ONE)
    unit = model.fsdp_unit
    assert [h.shard for h in unit.group.handles] == model.flat_params
    assert unit.state is TrainingState.IDLE and model.training_state is TrainingState.IDLE
    model.set_gradient_divide_factors(2.0, 0.5, recursive=True)
    # The one writer replaces the frozen policies on the unit and on its parameter group together.
    assert unit.policies.reduce.predivide_factor == 2.0 and unit.group.policies is unit.policies
    assert (model.gradient_predivide_factor, model.gradient_postdivide_factor) == (2.0, 0.5)


def test_reduce_queue_keeps_one_reduction_in_flight() -> None:
    queue = ReduceQueue()
    shard = nn.Parameter(torch.zeros(2))
    queue.add(PendingReduce.ready(shard, torch.ones(2)))
    assert shard.grad is None  # the newest stays in flight
    queue.add(PendingReduce.ready(shard, torch.full((2,), 2.0)))
    assert shard.grad is not None and shard.grad.tolist() == [1.0, 1.0]
    queue.finish_all()
    assert shard.grad.tolist() == [3.0, 3.0]
    queue.add(PendingReduce.ready(shard, torch.ones(2)))
    queue.abandon()
    queue.finish_all()
    assert shard.grad.tolist() == [3.0, 3.0]  # an abandoned reduction is never applied


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in backward")


def test_failed_backward_returns_every_unit_to_idle_and_training_goes_on() -> None:
    inner = FSDP(nn.Linear(4, 4), process_group=ONE)
    model = FSDP(nn.Sequential(nn.Linear(4, 4), inner), process_group=ONE)
    x = torch.randn(3, 4)
    out = model(_Boom.apply(x.requires_grad_()))
    with pytest.raises(RuntimeError, match="boom in backward"):
        out.sum().backward()
    assert inner.training_state is not TrainingState.IDLE  # the end-of-backward callback never ran
    model(torch.randn(3, 4)).sum().backward()  # the next forward drops the leftovers
    assert model.training_state is TrainingState.IDLE and inner.training_state is TrainingState.IDLE
    assert all(p.grad is not None for p in model.parameters())


def _exchange_equals_collectives(rank: int, world_size: int) -> None:
    group = dist.new_group(list(range(world_size)))
    full = torch.arange(world_size * 6, dtype=torch.float32) * (rank + 1)
    native, by_sends = torch.empty(6), torch.empty(6)
    c.reduce_scatter_tensor(native, full.clone(), group=group, label="test:native")
    c.reduce_scatter_tensor(by_sends, full.clone(), group=group, label="test:sends", by_sends=True).wait()
    assert torch.equal(native, by_sends)
    shard = torch.full((5,), float(rank))
    gathered_native, gathered_sends = torch.empty(5 * world_size), torch.empty(5 * world_size)
    c.all_gather_into_tensor(gathered_native, shard, group=group, label="test:native")
    c.all_gather_into_tensor(gathered_sends, shard, group=group, label="test:sends", by_sends=True).wait()
    assert torch.equal(gathered_native, gathered_sends)
    with pytest.raises(ValueError, match="only sums"):
        c.reduce_scatter_tensor(native, full, op=dist.ReduceOp.MAX, group=group, by_sends=True)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_exchange_equals_the_backend_collectives(world_size: int) -> None:
    run_distributed(_exchange_equals_collectives, world_size)
