"""estimate(): results that scale as sharding says they must, CPU fallback, and clear errors for bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardkit.plan
import shardkit.plan.api as plan_api
from shardkit.plan import PlanError, estimate
from shardkit.plan.cost import DeviceSpec, LinkSpec, step_seconds
from shardkit.plan.runner import PhaseTraffic
from shardkit.plan.workloads import Workload
from shardkit.testing.harness import run_distributed

WORK = Workload.demo_lm(batch_size=2)


def _plan(strategy: str, world_size: int, **kwargs: Any) -> shardkit.plan.Estimate:
    return estimate(WORK.build, WORK.batch(), loss_fn=WORK.loss, strategy=strategy, world_size=world_size, **kwargs)


def test_sharding_divides_state_and_fsdp_reports_where_the_peak_is() -> None:
    ddp, fsdp2, fsdp8 = _plan("ddp", 8), _plan("fsdp", 2), _plan("fsdp", 8)
    assert ddp.device == "meta" and ddp.comm_bytes["all_reduce"] > 0
    # Adam: parameters + gradients + two moments, all sharded by FSDP (up to padding and the unsharded root).
    assert fsdp8.state_bytes < fsdp2.state_bytes < ddp.state_bytes
    assert fsdp8.state_bytes <= ddp.state_bytes / 8 * 1.1
    assert fsdp8.peak_phase in ("forward", "backward", "optimizer")
    assert sum(fsdp8.peak_breakdown.values()) == fsdp8.peak_bytes
    assert set(fsdp8.comm_bytes) == {"all_gather", "reduce_scatter"}
    assert fsdp8.step_seconds > 0 and fsdp8.flops > 0


def test_a_gloo_plan_counts_the_receive_buffers_of_direct_sends() -> None:
    # At two ranks on gloo, ShardedDataParallel reduces each gradient by one send to its owner, which receives into
    # a buffer of its own: held while the transfer runs, so the owner's half of the gradients on top of the rest.
    nccl, gloo = _plan("oss_sdp", 2), _plan("oss_sdp", 2, backend="gloo")
    assert nccl.comm_bytes.keys() >= {"reduce"} and "send" not in nccl.comm_bytes
    assert gloo.comm_bytes["send"] > 0  # OSS's parameters go out by direct sends too
    param_bytes = sum(p.numel() * p.element_size() for p in WORK.build().parameters())
    assert gloo.peak_breakdown["comm_buffers"] - nccl.peak_breakdown["comm_buffers"] >= 0.4 * param_bytes
    assert gloo.peak_bytes > nccl.peak_bytes
    assert gloo.state_bytes == nccl.state_bytes


class _NeedsData(nn.Module):
    """Loads a table from host data (as models with pretrained tables do), which stays on the CPU under meta."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.from_numpy(np.ones((8, 8), dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) @ self.table).sum()


def test_model_that_needs_data_falls_back_to_cpu_and_says_so() -> None:
    est = estimate(_NeedsData, (torch.randn(4, 8),), strategy="ddp", world_size=4)
    assert est.device == "cpu" and "not on meta" in est.notes[0]
    assert est.state_bytes > 0


def test_model_too_big_for_the_cpu_fallback_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_api, "HOST_FRACTION", 1e-12)
    with pytest.raises(PlanError, match=r"does not run on the meta device.*host memory"):
        estimate(_NeedsData, (torch.randn(4, 8),), strategy="ddp", world_size=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"strategy": "zero9", "world_size": 2}, ValueError, "unknown strategy 'zero9'.*fsdp"),
        ({"strategy": "fsdp", "world_size": 2, "strategy_options": {"reshard": 1}}, ValueError, "no option 'reshard'"),
        ({"strategy": "oss_sdp", "world_size": 2, "strategy_options": {"oss": {"bad": 1}}}, ValueError, "'bad'"),
        ({"strategy": "ddp", "world_size": 0}, ValueError, "positive"),
        ({"strategy": "smp", "world_size": 3, "strategy_options": {"partitions": 2}}, ValueError, "divide world_size"),
        ({"strategy": "ddp", "world_size": 2, "backend": "mpi"}, ValueError, "backend must be one of.*gloo"),
        # FSDP's own check, before anything is planned: gradients must live beside their offloaded shards.
        ({"strategy": "fsdp", "world_size": 2, "strategy_options": {"move_grads_to_cpu": True}}, ValueError, "offload"),
    ],
)
def test_bad_arguments_name_what_to_change(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        estimate(WORK.build, WORK.batch(), loss_fn=WORK.loss, **kwargs)


def test_batch_that_does_not_run_and_missing_loss_are_clear_errors() -> None:
    with pytest.raises(PlanError, match="batch is one rank's inputs"):
        estimate(WORK.build, (torch.randn(2, 3),), loss_fn=WORK.loss, strategy="ddp", world_size=2)
    with pytest.raises(PlanError, match="pass loss_fn"):
        estimate(WORK.build, WORK.batch(), strategy="ddp", world_size=2)


def _plan_inside_a_job(rank: int, world_size: int) -> int:
    est = _plan("fsdp", 16)
    assert dist.get_world_size() == world_size  # the job's own group is untouched
    return est.state_bytes


def test_a_process_with_its_own_group_plans_in_a_child_process() -> None:
    inside = run_distributed(_plan_inside_a_job, 1)[0]
    assert inside == _plan("fsdp", 16).state_bytes


def test_step_time_overlaps_on_accelerators_and_adds_up_on_cpus() -> None:
    # Forward: 2 s of compute beside 1 s of all-gathers in 10 calls; backward: 4 s of compute, nothing sent.
    forward = PhaseTraffic(wire_bytes={"all_gather": 10 * 10**9}, calls={"all_gather": 10})
    device, link = DeviceSpec(flops_per_s=3e12), LinkSpec(bytes_per_s=10e9, latency_s=0.0)
    overlapped = step_seconds(18e12, {"forward": forward}, 0, 4, device, link)
    serial = step_seconds(18e12, {"forward": forward}, 0, 4, device, link, overlap=False)
    assert overlapped["forward"] == pytest.approx(2.0 + 0.1)  # hidden, except one gather that nothing can hide
    assert serial["forward"] == pytest.approx(2.0 + 1.0)  # compute and communication take turns on the cores
    assert overlapped["backward"] == serial["backward"] == pytest.approx(4.0)
