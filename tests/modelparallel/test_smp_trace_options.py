"""trace_memory_usage and trace_device: what the trace measures, where it runs, and what the partition does."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.modelparallel.partitioning.partitioner import plan_partition
from shardkit.modelparallel.partitioning.trace import trace_costs
from shardkit.testing import run_distributed
from testkit import regression_batch
from testkit.smp import mse_step


class Scratch(nn.Module):
    """Writes a 64 times wider temporary, but backward keeps only narrow tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-1).expand(*x.shape, 64).clone().sum(-1) * self.scale


class Keep(nn.Module):
    """``tanh(x @ w)``: backward keeps the tanh output; the product is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.devices: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.devices.append(str(x.device))
        return torch.tanh(x @ self.w)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Scratch(), Keep(), Keep(), Keep(), Keep())


def test_measured_memory_is_what_backward_keeps() -> None:
    x = torch.randn(32, 16)
    estimated = trace_costs(_model(), (x,), {})
    measured = trace_costs(_model(), (x,), {}, measure_memory=True)
    tanh_out = 32 * 16 * 4
    assert all(c.measured_bytes is None for c in estimated.values())
    # Keep writes the product and the tanh (the estimate) but only the tanh output stays alive.
    assert measured["1"].activation_bytes == 2 * tanh_out and measured["1"].measured_bytes == tanh_out
    assert measured["1"].memory_bytes == 16 * 16 * 4 + tanh_out
    # Scratch writes a 64x wider temporary and keeps three narrow tensors.
    assert measured["0"].activation_bytes > 20 * measured["0"].measured_bytes > 0
    # The model's own figure covers its children's.
    assert measured[""].measured_bytes == sum(measured[str(i)].measured_bytes for i in range(5))
    assert all(p.grad is None for p in _model().parameters())


def test_measured_memory_changes_the_partition() -> None:
    x = torch.randn(32, 16)
    _, guessed = plan_partition(_model(), (x,), partitions=2, memory_weight=1.0)
    _, measured = plan_partition(_model(), (x,), partitions=2, memory_weight=1.0, measure_memory=True)
    assert not guessed.memory_measured and measured.memory_measured
    assert guessed.modules_on(0) == ["0"]  # the estimate thinks Scratch alone is most of the memory
    assert measured.modules_on(0) == ["0", "1"]  # it is not: one Keep joins it and the stages even out
    assert measured.imbalance < guessed.imbalance
    assert "measured memory" in str(measured) and "estimated memory" in str(guessed)


def test_trace_device_cpu_traces_on_the_cpu() -> None:
    model = _model()
    _, placement = plan_partition(model, (torch.randn(4, 16),), partitions=1, trace_device="cpu")
    assert placement.traced_on == "cpu" and set(model[1].devices) == {"cpu"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moving the trace to another device needs CUDA")
def test_trace_device_moves_the_trace_and_leaves_the_model() -> None:
    for home, trace in (("cuda", "cpu"), ("cpu", "cuda")):
        model = _model().to(home)
        params = list(model.parameters())
        _, placement = plan_partition(
            model, (torch.randn(4, 16, device=home),), partitions=2, trace_device=trace, measure_memory=True
        )
        assert placement.traced_on.startswith(trace)
        assert model[1].devices and all(d.startswith(trace) for d in model[1].devices)
        assert list(model.parameters()) == params and all(p.device.type == home for p in params)


#: Each step's batch: 32 rows of 16 features in and out.
_batch = functools.partial(regression_batch, rows=32, inputs=16, outputs=16)


def _train(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for measure in (False, True):
        smp.init({"partitions": 2, "microbatches": 2, "memory_weight": 1.0})
        model = smp.DistributedModel(_model(), trace_device="cpu", trace_memory_usage=measure)
        opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(2):
            opt.zero_grad()
            mse_step(model, *_batch(step))
            opt.step()
        assert model.placement is not None
        out[str(measure)] = {
            "stage0": model.placement.modules_on(0),
            "measured": model.placement.memory_measured,
            "traced_on": model.placement.traced_on,
            "state": model.state_dict(),
        }
        smp.reset()
    return out


def test_distributed_model_uses_the_measurement() -> None:
    reference = _model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        F.mse_loss(reference(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
    for out in run_distributed(_train, 2):
        assert out["False"]["stage0"] == ["0"] and not out["False"]["measured"]
        assert out["True"]["stage0"] == ["0", "1"] and out["True"]["measured"]
        assert out["True"]["traced_on"] == out["False"]["traced_on"] == "cpu"
        for run in ("False", "True"):  # a different placement, the same training
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(out[run]["state"][key], value, atol=1e-6, rtol=1e-5)


def test_gpu_trace_device_on_a_cpu_run_traces_where_the_model_runs() -> None:
    smp.init({"partitions": 1})
    try:
        model = smp.DistributedModel(_model())  # trace_device="gpu", the default
        mse_step(model, *_batch(0))
        assert model.placement is not None and model.placement.traced_on == "cpu"
        assert model.module[1].devices[0] == "cpu"
    finally:
        smp.reset()


def test_a_trace_inside_autocast_leaves_the_next_forward_its_gradients() -> None:
    # smp traces on the first step, inside the script's autocast region and under no_grad; the step's own forward
    # follows in the same region. Torch before 2.10 cached the trace's grad-less parameter casts and the forward
    # reused them: its parameters got no gradient (the bf16 smp script then trained wrongly on torch 2.8).
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(model(x).float().sum(), list(model.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trace_costs(model, (x,), {}, measure_time=True, measure_memory=True)
        got = torch.autograd.grad(model(x).float().sum(), list(model.parameters()), allow_unused=True)
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
