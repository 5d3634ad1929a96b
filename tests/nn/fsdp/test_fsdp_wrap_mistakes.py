"""Issue 32, items 1, 2, 5 and 12: wrapping habits that trained the wrong model without a word.

1. Pretrained weights loaded on rank 0 only, then FSDP: half the model was rank 1's random initialisation.
2. ``torch.manual_seed(rank)`` before building the model, then FSDP: the model was a patchwork of both ranks'.
   Now, as DDP does, every rank starts from rank 0's values (parameters and buffers), whatever each built.
5, 12. ``FSDP(model).to(torch.bfloat16)``: float32 inputs trained on silently in float32, bfloat16 inputs failed
   with torch's bare dtype error. Now the next forward refuses, saying the model was cast after wrapping.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import ShardingStrategy
from shardkit.testing import run_distributed


def _net(seed: int) -> nn.Sequential:
    """Linear - BatchNorm - ReLU - Linear (the BatchNorm's running statistics are buffers that must agree too)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        net[1].running_mean.normal_()  # not the default zeros: a buffer that really was loaded
    return net


def _full_state(model: FSDP) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _wrap(net: nn.Sequential, strategy: str) -> FSDP:
    kwargs: dict[str, Any] = {"sharding_strategy": ShardingStrategy[strategy]}
    net[0] = FSDP(net[0], **kwargs)  # a nested unit, wrapped before the root
    return FSDP(net, **kwargs)


def _pretrained_on_rank_zero(rank: int, world_size: int, strategy: str) -> dict[str, torch.Tensor]:
    net = _net(seed=100 + rank)  # every rank's own random initialisation
    if rank == 0:
        net.load_state_dict(_net(seed=7).state_dict())  # the "pretrained" weights, on rank 0 only
    return _full_state(_wrap(net, strategy))


def _seeded_by_rank(rank: int, world_size: int, strategy: str) -> dict[str, torch.Tensor]:
    return _full_state(_wrap(_net(seed=rank), strategy))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_weights_loaded_on_rank_zero_only_reach_every_rank(strategy: str) -> None:
    want = _net(seed=7).state_dict()
    for state in run_distributed(_pretrained_on_rank_zero, 2, strategy, timeout_s=60):
        assert state.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(state[key], value), key


def test_a_model_seeded_by_rank_starts_as_rank_zeros_model() -> None:
    want = _net(seed=0).state_dict()
    for state in run_distributed(_seeded_by_rank, 2, "FULL_SHARD", timeout_s=60):
        for key, value in want.items():
            assert torch.equal(state[key], value), key


def _cast_after_wrapping(rank: int, world_size: int, input_dtype: torch.dtype) -> str:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 2))).to(torch.bfloat16)
    try:
        model(torch.randn(3, 4, dtype=input_dtype)).sum().backward()
    except RuntimeError as err:
        return str(err)
    return "trained"


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_a_cast_after_wrapping_is_refused_at_the_next_forward(input_dtype: torch.dtype) -> None:
    for message in run_distributed(_cast_after_wrapping, 2, input_dtype, timeout_s=60):
        assert "cast to torch.bfloat16 after it was wrapped" in message
        assert "before wrapping" in message and "compute_dtype=torch.bfloat16" in message


def test_a_cast_before_wrapping_still_trains() -> None:
    torch.manual_seed(0)
    model = FSDP(nn.Linear(4, 2).to(torch.bfloat16), process_group=DummyProcessGroup(rank=0, size=1))
    out = model(torch.randn(3, 4, dtype=torch.bfloat16))
    out.sum().backward()
    assert out.dtype == torch.bfloat16 and next(model.parameters()).grad is not None


def _buffer_shaped_by_rank(rank: int, world_size: int) -> str:
    net = _net(seed=0)
    net.register_buffer("stats", torch.zeros(2 + rank))  # what could not be copied from rank 0
    try:
        FSDP(net)
    except ValueError as err:
        return str(err)
    return "wrapped"


def test_buffers_of_other_shapes_are_refused_on_every_rank_before_any_copy() -> None:
    for message in run_distributed(_buffer_shaped_by_rank, 2, timeout_s=60):
        assert "ranks hold different parameters" in message and "'stats (buffer)' (2,)" in message
