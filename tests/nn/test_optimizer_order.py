"""An optimizer built in an order that cannot train (before FSDP wraps the model, or over another model than the
one given to ShardedDataParallel) is refused with a message that says which order works (issue 23, item 4)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed

ONE = DummyProcessGroup(rank=0, size=1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _adamw(model: nn.Module, group: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.1)


def _oss(model: nn.Module, group: Any) -> torch.optim.Optimizer:
    return OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, group=group)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()


@pytest.mark.parametrize("make", [_adamw, _oss], ids=["AdamW", "OSS"])
def test_an_optimizer_built_before_fsdp_is_refused_at_its_first_step(make: Callable[..., Any]) -> None:
    model = _model()
    optimizer = make(model, ONE)
    wrapped = FSDP(model, process_group=ONE)
    with pytest.raises(RuntimeError) as info:
        _step(wrapped, optimizer)
    message = str(info.value)
    assert f"{type(optimizer).__name__} was built before the model was wrapped in FullyShardedDataParallel" in message
    assert "'0.weight'" in message and "Build the optimizer after wrapping" in message


def test_an_optimizer_built_after_fsdp_trains() -> None:
    wrapped = FSDP(_model(), process_group=ONE)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=0.1)
    before = [p.detach().clone() for p in wrapped.parameters()]
    for _ in range(2):  # the second step takes the checked fast path
        _step(wrapped, optimizer)
    assert all(not torch.equal(a, b) for a, b in zip(before, wrapped.parameters()))


def _built_before_wrapping(rank: int, world_size: int) -> str:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    wrapped = FSDP(model)
    try:
        _step(wrapped, optimizer)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_every_rank_refuses_the_optimizer_built_before_fsdp() -> None:
    for message in run_distributed(_built_before_wrapping, 2, timeout_s=60):
        assert "AdamW was built before the model was wrapped in FullyShardedDataParallel" in message


def test_sharded_data_parallel_refuses_an_optimizer_over_another_model() -> None:
    model = _model()
    other = copy.deepcopy(model)
    optimizer = OSS(other.parameters(), optim=torch.optim.SGD, lr=0.1, group=ONE)
    with pytest.raises(ValueError) as info:
        ShardedDataParallel(model, optimizer, process_group=ONE)
    message = str(info.value)
    assert "the OSS optimizer holds 4 parameter(s)" in message
    assert "ShardedDataParallel does not have" in message and "OSS(model.parameters()" in message
