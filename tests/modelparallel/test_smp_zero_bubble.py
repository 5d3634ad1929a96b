"""``"pipeline": "zero_bubble"`` (ZB-H1) and ``"zero_bubble_h2"`` (ZB-H2), split backward, train exactly as one
process: 2 and 4 stages, tied weights, cross-stage residuals, fewer micro-batches than stages, data parallel
replicas (the overlapped all-reduce sees every W), and the documented fallbacks to the unsplit backward
(activation-checkpointed stage, custom autograd.Function)."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp_testlib import CKPT_MICROBATCHES as MICROBATCHES
from smp_testlib import CKPT_STEPS as STEPS
from smp_testlib import CkptNet as Net
from smp_testlib import check_parity, ckpt_batch, ckpt_reference, parity_results, reference_run, smp_run
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed
from testkit import max_state_diff as max_diff
from testkit.models import ScaleWithWeightGrad
from testkit.smp import mse_step

ZB = "zero_bubble"
H2 = "zero_bubble_h2"
MANUAL = {"auto_partition": False}


@pytest.mark.parametrize("pipeline", [ZB, H2])
def test_two_stages_match_single_process(pipeline: str) -> None:
    cases = [("mlp", {"partitions": 2, "microbatches": mb, "pipeline": pipeline}, {}) for mb in (1, 4, 8)] + [
        ("residual", {"partitions": 2, "microbatches": 4, "pipeline": pipeline, **MANUAL}, {"stages": 2}),
        ("lm", {"partitions": 2, "microbatches": 4, "pipeline": pipeline}, {}),  # embedding tied to the head
    ]
    check_parity(run_distributed(parity_results, 2, cases))


@pytest.mark.parametrize("pipeline", [ZB, H2])
def test_four_stages_match_single_process(pipeline: str) -> None:
    cases = [
        ("mlp", {"partitions": 4, "microbatches": 8, "pipeline": pipeline}, {}),
        ("mlp", {"partitions": 4, "microbatches": 2, "pipeline": pipeline}, {}),  # fewer micro-batches than stages
        ("mlp", {"partitions": 4, "microbatches": 1, "pipeline": pipeline}, {}),
        ("residual", {"partitions": 4, "microbatches": 4, "pipeline": pipeline, **MANUAL}, {"stages": 4}),
        ("lm", {"partitions": 4, "microbatches": 8, "pipeline": pipeline}, {}),
    ]
    check_parity(run_distributed(parity_results, 4, cases))


def _hybrid(rank: int, world_size: int, pipeline: str) -> dict[str, Any]:
    """2 stages x 2 replicas; counts the all-reduces the overlap launched from W's gradient hooks."""
    out: dict[str, Any] = {}
    for name, options in (("mlp", {"bucket_cap_mb": 0.0001}), ("lm", {"gradient_as_bucket_view": True})):
        config = {"partitions": 2, "microbatches": 4, "pipeline": pipeline, "ddp": True}
        ref_losses, ref_state = reference_run(name, 3, 8, replicas=2)
        losses, state, model = smp_run(name, config, 3, 8, **options)
        execution = model.stage_execution
        assert execution is not None
        out[name] = {
            "loss_diff": max(abs(a - b[smp.dp_rank()]) for a, b in zip(losses, ref_losses)),
            "param_diff": max_diff(state, ref_state),
            "unsplit": execution.unsplit_reason,
        }
        smp.reset()
    return out


@pytest.mark.parametrize("pipeline", [ZB, H2])
def test_data_parallel_replicas_match_single_process(pipeline: str) -> None:
    for per_rank in run_distributed(_hybrid, 4, pipeline):
        for name, r in per_rank.items():
            assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, (name, r)
            assert r["unsplit"] is None, r  # the backward really was split


def _checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    smp.init({"partitions": 2, "microbatches": MICROBATCHES, "auto_partition": False, "pipeline": ZB})
    net = Net(manual=True)
    for block in net.blocks:
        smp.set_activation_checkpointing(block)
    calls: Counter[str] = Counter()
    for name, module in net.named_modules():
        module.register_forward_pre_hook(lambda m, a, name=name: calls.update([name]))
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):
            x, y = ckpt_batch(s)
            opt.zero_grad()
            losses.extend(t.item() for t in mse_step(model, x, y).outputs)
            opt.step()
            if s == 0:  # the first step also traced and planned: count the later ones
                calls.clear()
    smp.reset()
    mine = ["blocks.0.lin", "blocks.1.lin"] if rank == 0 else ["blocks.2.lin", "blocks.3.lin"]
    return {
        "losses": losses,
        "per_microbatch": [calls[n] / ((STEPS - 1) * MICROBATCHES) for n in mine],
        "warnings": [str(w.message) for w in caught if "unsplit" in str(w.message)],
    }


def test_checkpointed_stage_falls_back_to_the_unsplit_backward() -> None:
    """A checkpointed block is recomputed once per micro-batch (not again in W), with one warning per stage."""
    reference = ckpt_reference()
    for r in run_distributed(_checkpointed, 2):
        assert max(abs(a - b) for a, b in zip(r["losses"], reference)) <= 1e-5
        assert r["per_microbatch"] == [2.0, 2.0], r  # forward + one recomputation
        assert len(r["warnings"]) == 1 and "activation-checkpointed" in r["warnings"][0], r["warnings"]


class _CustomLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return ScaleWithWeightGrad.apply(h, self.w)


def _custom_net() -> nn.Module:
    torch.manual_seed(4)
    with smp.partition(0):
        first = nn.Linear(8, 16)
    with smp.partition(1):
        layers = [_CustomLayer(), nn.Linear(16, 4)]
    return nn.Sequential(first, *layers)


def _custom(rank: int, world_size: int, pipeline: str) -> dict[str, Any]:
    smp.init({"partitions": 2, "microbatches": 2, "auto_partition": False, "pipeline": pipeline})
    model = smp.DistributedModel(_custom_net())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(2):
            gen = torch.Generator().manual_seed(s)
            opt.zero_grad()
            step(model, torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
            opt.step()
    state = model.state_dict()
    smp.reset()
    return {"state": state, "warnings": [str(w.message) for w in caught if "unsplit" in str(w.message)]}


def test_custom_function_on_both_gradient_paths_runs_unsplit() -> None:
    split = run_distributed(_custom, 2, ZB)
    plain = run_distributed(_custom, 2, "interleaved")
    for rank, (a, b) in enumerate(zip(split, plain)):
        assert max_diff(a["state"], b["state"]) == 0.0
        if rank == 1:
            assert len(a["warnings"]) == 1 and "ScaleWithWeightGradBackward" in a["warnings"][0], a["warnings"]
        else:
            assert a["warnings"] == []


def test_gradient_accumulation_over_steps_with_replicas() -> None:
    """backward_passes_per_step=2: W's gradients accumulate locally and are all-reduced every other step."""
    cases = [("lm", {"partitions": 2, "microbatches": 2, "ddp": True, "pipeline": ZB}, {})]
    check_parity(run_distributed(parity_results, 4, cases, {"backward_passes_per_step": 2, "bucket_cap_mb": 0.01}))
