"""join() with uneven inputs, the smp loss scaler's overflow agreement, post-partition hooks and cpu()."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp_testlib import batch, loss_of, mlp, train_step

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff

BATCHES = [3, 1]  # replica 0 has three batches, replica 1 one


def _reference() -> list[dict[str, torch.Tensor]]:
    """Single process: step s averages the gradients of the replicas that still have data, over both."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    states = []
    for s in range(max(BATCHES)):
        losses = [
            loss_of("mlp", model(x), y) for d in range(2) if s < BATCHES[d] for x, y in [batch("mlp", 8, 10 * s + d)]
        ]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _join_and_hooks(rank: int, world_size: int, keys: dict[str, Any]) -> dict[str, Any]:
    smp.init({"partitions": 2, "microbatches": 2, "ddp": True, **keys})
    model = smp.DistributedModel(mlp())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    calls = []
    model.register_post_partition_hook(lambda m, o: calls.append((m is model, o is opt, m.partitioned)))
    with model.join():
        for s in range(BATCHES[smp.dp_rank()]):
            x, y = batch("mlp", 8, 10 * s + smp.dp_rank())
            opt.zero_grad()
            train_step(model, "mlp", x, y)
            opt.step()
    full = model.state_dict()
    local_before = sum(p.numel() for p in model.module.parameters())
    model.cpu()
    whole = {k: v.clone() for k, v in model.module.state_dict().items()}
    result = {
        "diff": max_state_diff(full, _reference()[BATCHES[smp.dp_rank()] - 1]),
        "hook_calls": calls,
        "cpu_diff": max_state_diff(whole, full),
        "local_before": local_before,
        "total": sum(v.numel() for v in full.values()),
    }
    smp.reset()
    return result


@pytest.mark.parametrize(
    "keys",
    [{}, {"pipeline": "zero_bubble"}, {"pipeline": "zbv", "microbatches": 4}],
    ids=["1f1b", "zero_bubble", "zbv"],
)
def test_join_with_uneven_inputs_hooks_and_cpu(keys: dict[str, Any]) -> None:
    """The replica that runs out of data joins the others' all-reduces, under the split and the V schedules too."""
    for r in run_distributed(_join_and_hooks, 4, keys):
        assert r["diff"] <= 1e-5, r
        assert r["hook_calls"] == [(True, True, True)]
        assert r["cpu_diff"] == 0.0 and r["local_before"] < r["total"]


def _scaler(rank: int, world_size: int, pipeline: str = "interleaved") -> list[tuple[float, bool]]:
    smp.init({"partitions": 2, "microbatches": 2, "pipeline": pipeline})
    model = smp.DistributedModel(mlp())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = smp.amp.GradScaler(init_scale=1024.0)

    @smp.step
    def scaled_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    out = []
    for s, overflow_on_stage0 in enumerate([True, False]):
        x, y = batch("mlp", 8, s)
        opt.zero_grad()
        scaled_step(model, x, y)
        local = list(model.local_parameters())
        if overflow_on_stage0 and smp.mp_rank() == 0:
            local[0].grad[0, 0] = float("inf")  # only stage 0 overflows: stage 1 must skip its step too
        before = [p.detach().clone() for p in local]
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(a, p) for a, p in zip(before, local))
        out.append((scaler.get_scale(), moved))
    smp.reset()
    return out


@pytest.mark.parametrize("pipeline", ["interleaved", "zero_bubble", "zero_bubble_h2"])
def test_grad_scaler_agrees_on_overflow_across_stages(pipeline: str) -> None:
    for per_rank in run_distributed(_scaler, 2, pipeline):
        assert per_rank == [(512.0, False), (512.0, True)]


def test_step_options_split_axes_and_unsplit_inputs() -> None:
    """input_split_axes splits along another axis; non_split_inputs reach every micro-batch whole."""
    smp.init({"microbatches": 2})
    try:
        model = smp.DistributedModel(torch.nn.Linear(3, 1))
        seen = []

        @smp.step(non_split_inputs=["scale"], input_split_axes={"x": 1})
        def step(model: Any, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            seen.append((tuple(x.shape), tuple(scale.shape)))
            out = model(x.transpose(0, 1)) * scale
            model.backward(out.sum())
            return out

        x = torch.arange(12.0).view(3, 4)  # batch along axis 1
        result = step(model, x, torch.tensor([2.0]))
        assert seen == [((3, 2), (1,)), ((3, 2), (1,))]
        layer = model.module
        expected = F.linear(x.transpose(0, 1), layer.weight, layer.bias) * 2.0
        assert torch.allclose(result.concat(), expected.detach())
    finally:
        smp.reset()
