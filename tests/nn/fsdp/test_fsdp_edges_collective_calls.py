"""A method every rank must call (state_dict, summon_full_params, ...) called by some ranks only fails everywhere,
within the timeout, naming the call, instead of hanging the ranks in mismatched collectives."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from shardkit.distributed import check_collectives
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import DistributedTestError, run_distributed

TIMEOUT_S = 6.0


def _model() -> FSDP:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    layers[0] = FSDP(layers[0])
    return FSDP(layers)


def _step(model: nn.Module) -> None:
    model(torch.randn(2, 8)).sum().backward()


def _state_dict_on_rank_zero_only(rank: int, world_size: int, then: str) -> str:
    model = _model()
    _step(model)
    checks = check_collectives(timeout_s=TIMEOUT_S / 2) if then == "train_checked" else contextlib.nullcontext()
    with checks:
        if rank == 0:
            model.state_dict()
        elif then.startswith("train"):
            _step(model)  # rank 1 goes on training
        else:
            model.summon_full_params().__enter__()  # rank 1 calls another collective method
    return "no error"


@pytest.mark.parametrize("then", ["train", "train_checked", "other_call"])
def test_state_dict_on_one_rank_fails_on_every_rank(then: str) -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_state_dict_on_rank_zero_only, 2, then, timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert "rank 0 raised" in message and "rank 1 raised" in message
    assert "did not finish" not in message  # reported by the ranks, not declared hung by the harness
    if then.startswith("train"):
        assert "FullyShardedDataParallel.state_dict() was called on rank(s) [0], but rank(s) [1]" in message
        assert "every rank must call it" in message
        assert "rank 0 failed first" in message  # rank 1's own error names the cause
    else:
        assert "rank 0 called FullyShardedDataParallel.state_dict() while rank 1 called" in message
        assert "FullyShardedDataParallel.summon_full_params()" in message


def _state_dict_everywhere(rank: int, world_size: int) -> list[str]:
    model = _model()
    _step(model)
    keys = list(model.state_dict())
    with model.summon_full_params():
        pass
    _step(model)
    return keys


def test_calls_on_every_rank_still_work() -> None:
    keys = run_distributed(_state_dict_everywhere, 2, timeout_s=60)
    assert keys[0] == keys[1] == ["0.weight", "0.bias", "2.weight", "2.bias"]
