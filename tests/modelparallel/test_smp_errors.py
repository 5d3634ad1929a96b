"""Bad input gets a clear error that says what to do, with nothing half-applied."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from smp_testlib import mlp, reference_run, smp_run
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit.smp import mse_step


@pytest.fixture
def single() -> Iterator[None]:
    smp.init({"partitions": 1, "microbatches": 4})
    try:
        yield
    finally:
        smp.reset()


def test_forward_and_backward_outside_step(single: None) -> None:
    model = smp.DistributedModel(mlp())
    with pytest.raises(RuntimeError, match=r"cannot call the DistributedModel outside an @smp.step function"):
        model(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=r"cannot call model.backward outside an @smp.step function"):
        model.backward(torch.ones((), requires_grad=True))
    assert not model.partitioned


def test_batch_not_divisible_by_microbatches_changes_nothing(single: None) -> None:
    model = smp.DistributedModel(mlp())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"argument 'x': size 6 along axis 0 is not divisible by microbatches=4"):
        mse_step(model, torch.randn(6, 8), torch.randn(6, 4))
    assert not model.partitioned and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    mse_step(model, torch.randn(8, 8), torch.randn(8, 4))  # the model still works after the error
    assert model.partitioned


def test_second_distributed_model(single: None) -> None:
    smp.DistributedModel(mlp())
    with pytest.raises(RuntimeError, match="already created in this process"):
        smp.DistributedModel(mlp())


def test_partition_index_out_of_range(single: None) -> None:
    with (
        pytest.raises(ValueError, match=r"smp.partition\(1\) is out of range: the config has partitions=1"),
        smp.partition(1),
    ):
        pass
    with pytest.raises(ValueError, match="partition index >= 0"), smp.partition(-1):
        pass


def test_marks_made_before_init_are_checked_at_partition() -> None:
    smp.reset()
    with smp.partition(3):  # not initialised yet: cannot know the number of partitions
        layer = nn.Linear(8, 4)
    smp.init({"partitions": 1, "auto_partition": False})
    try:
        model = smp.DistributedModel(nn.Sequential(nn.Linear(8, 8), layer))
        with pytest.raises(ValueError, match=r"created inside smp.partition\(3\), but the config has partitions=1"):
            mse_step(model, torch.randn(4, 8), torch.randn(4, 4))
    finally:
        smp.reset()


def test_smp_needs_init_and_a_model(single: None) -> None:
    smp.reset()
    with pytest.raises(RuntimeError, match=r"call smp.init\(\)"):
        smp.DistributedModel(mlp())
    smp.init({"microbatches": 4})
    with pytest.raises(RuntimeError, match=r"before smp.DistributedModel\(...\) was created"):
        mse_step(torch.randn(4, 8), torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"partitions=2 needs 2 processes"):
        smp.reset()
        smp.init({"partitions": 2})


def test_single_process_microbatches_match_plain_training(single: None) -> None:
    smp.reset()
    losses, state, _ = smp_run("residual", {"partitions": 1, "microbatches": 4}, 3, 8)
    ref_losses, ref_state = reference_run("residual", 3, 8)
    assert max(abs(a - b[0]) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert max((state[k] - ref_state[k]).abs().max().item() for k in state) <= 1e-5


def _different_configs(rank: int, world_size: int) -> str:
    try:
        smp.init({"partitions": 2, "microbatches": 2 + 2 * rank})
    except ValueError as exc:
        return str(exc)
    return "no error"


def _backward_edges(rank: int, world_size: int) -> str:
    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with smp.partition(1):
                self.first = nn.Linear(4, 4)
            with smp.partition(0):
                self.second = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Any:
            return self.second(self.first(x))

    smp.init({"partitions": 2, "auto_partition": False})
    model = smp.DistributedModel(Loop())
    try:
        mse_step(model, torch.randn(2, 4), torch.randn(2, 4))
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


def _different_inputs(rank: int, world_size: int) -> str:
    smp.init({"partitions": 2})
    model = smp.DistributedModel(mlp())
    try:
        mse_step(model, torch.full((2, 8), float(rank)), torch.zeros(2, 4))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_distributed_errors_are_raised_on_every_rank() -> None:
    for message in run_distributed(_different_configs, 2):
        assert "different config on different ranks" in message and "microbatches: rank 0: 2, rank 1: 4" in message
    for message in run_distributed(_backward_edges, 2):
        assert "sends activations backwards: outputs of 'first' (stage 1) are used on stage 0" in message
    for message in run_distributed(_different_inputs, 2):
        assert "the stages of one model replica got different inputs (stages [1] differ from stage 0)" in message
