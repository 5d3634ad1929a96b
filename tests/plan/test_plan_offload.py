"""CPU offload in a plan: the offloaded state counted as host memory, apart from the device's, and nothing allocated."""

from __future__ import annotations

import functools
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch import nn

from shardkit.memory.offload import to_host
from shardkit.nn.checkpoint.apply import apply_activation_checkpointing
from shardkit.nn.checkpoint.offload import ActivationOffload
from shardkit.plan import Estimate, PlanError, estimate
from shardkit.plan.accountant import Accountant, Category
from shardkit.plan.host import HostTensor
from shardkit.plan.strategies import block_classes
from shardkit.plan.workloads import Workload

WORK = Workload.demo_lm(batch_size=2)
OFFLOAD = {"cpu_offload": True}


def _fsdp(world_size: int, **options: Any) -> Estimate:
    return estimate(
        WORK.build, WORK.batch(), loss_fn=WORK.loss, strategy="fsdp", world_size=world_size, strategy_options=options
    )


def test_to_host_copies_real_tensors_and_refuses_meta_ones_outside_a_plan() -> None:
    x = torch.randn(5, requires_grad=True)
    y = to_host(x, torch.float64)
    assert y.dtype == torch.float64 and not y.requires_grad and torch.equal(y, x.detach().double())
    y.add_(1)
    assert not torch.equal(y, x.detach().double())  # a copy, not a view
    with pytest.raises(NotImplementedError, match="materialise the model"):
        to_host(torch.empty(3, device="meta"))


def test_host_tensors_report_the_cpu_allocate_nothing_and_are_booked_apart() -> None:
    with Accountant() as acct:
        device = torch.empty(1000, device="meta")
        host = to_host(device)
        assert isinstance(host, HostTensor) and host.device.type == "cpu" and host.shape == (1000,)
        moments = torch.zeros_like(host)  # what a CPU optimizer step creates: host memory too
        assert isinstance(moments, HostTensor)
        assert moments.mul_(2) is moments  # an in-place result is the same tensor
        upload = host.to("meta", torch.bfloat16)
        assert type(upload) is torch.Tensor and upload.device.type == "meta"
        assert acct.host_current == 2 * 4000 and acct.current == 4000 + 2000
        assert acct.transfers == {"to_host": 4000, "to_device": 2000}
        acct.label([host], Category.PARAMETERS)
        assert acct.host.total(Category.PARAMETERS) == 4000 and acct.device.total(Category.PARAMETERS) == 0
        del host, moments
        assert acct.host_current == 0 and acct.host_peak.total == 8000


def test_offload_moves_the_sharded_state_to_host_memory_and_keeps_the_traffic() -> None:
    plain, off = _fsdp(4), _fsdp(4, **OFFLOAD)
    # Parameters, gradients and Adam's moments of the shard live on the host; only the optimizer's step counters
    # (CPU scalars in either run) stay where they were.
    assert off.state_bytes < 64 and off.host.state_bytes + off.state_bytes == plain.state_bytes
    assert off.host.peak_bytes >= off.host.state_bytes
    assert off.peak_bytes <= plain.peak_bytes - plain.state_bytes / 2
    # Every step: each FP32 gradient shard goes down once; parameter shards come up for forward and again for
    # backward's re-gather of every resharded unit.
    shard_bytes = plain.state_breakdown["parameters"]
    assert off.host.to_host_bytes == shard_bytes
    assert shard_bytes < off.host.to_device_bytes <= 2 * shard_bytes
    assert off.comm_bytes == plain.comm_bytes  # offload changes where state lives, not what is sent
    assert off.phase_seconds["optimizer"] > plain.phase_seconds["optimizer"]  # the CPU steps it
    assert plain.host.state_bytes == 0  # built in host memory too, but its shards then moved to the device


def test_mixed_precision_uploads_half_the_bytes() -> None:
    full, half = _fsdp(2, **OFFLOAD), _fsdp(2, mixed_precision=True, **OFFLOAD)
    assert half.host.to_device_bytes * 2 == full.host.to_device_bytes
    assert half.host.state_bytes == full.host.state_bytes  # FP32 master shards either way


class _Wide(nn.Module):
    """Parameters far larger than anything a step creates: the build dominates the device peak without offload."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def test_fsdp_models_are_built_and_wrapped_in_host_memory_and_never_whole_on_the_device() -> None:
    model_bytes = sum(p.numel() * 4 for p in _Wide().parameters())
    batch = (torch.randn(2, 256),)
    ddp = estimate(_Wide, batch, strategy="ddp", world_size=8)
    plain = estimate(_Wide, batch, strategy="fsdp", world_size=8)
    off = estimate(_Wide, batch, strategy="fsdp", world_size=8, strategy_options=OFFLOAD)
    assert ddp.peak_bytes >= model_bytes and ddp.host.peak_bytes == 0  # a replica lives on the device
    assert off.peak_bytes < model_bytes / 2  # a few blocks gathered or reduced at a time, on the device
    assert plain.peak_bytes < model_bytes  # the same, beside this rank's shards and their Adam state
    for est in (plain, off):
        assert est.host.peak_bytes >= model_bytes and est.host.peak_phase == "setup"
    # Without offload only this rank's shards go to the device after wrapping; with it they stay in host memory.
    assert plain.host.state_bytes == 0 and plain.state_bytes == off.host.state_bytes + off.state_bytes


class _NeedsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.from_numpy(np.ones((8, 8), dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.table).sum()


def test_offload_of_a_model_that_only_runs_on_cpu_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match="planned on the meta device only"):
        estimate(_NeedsData, (torch.randn(4, 8),), strategy="fsdp", world_size=2, strategy_options=OFFLOAD)


def _checkpointed_lm(offload: bool) -> nn.Module:
    model = WORK.build()
    blocks = tuple(block_classes(model))
    apply_activation_checkpointing(model, blocks, offload_to_cpu=offload)
    return model


def test_offloaded_activation_checkpoints_go_down_in_forward_and_come_back_in_backward() -> None:
    kept, offloaded = (
        estimate(functools.partial(_checkpointed_lm, off), WORK.batch(), loss_fn=WORK.loss, strategy="ddp",
                 world_size=2)
        for off in (False, True)
    )  # fmt: skip
    assert kept.host.peak_bytes == 0
    host = offloaded.host
    # Every checkpoint's saved inputs: copied down during forward, back up during backward, nothing kept.
    assert host.to_host_bytes == host.to_device_bytes == host.peak_bytes > 0
    assert host.peak_phase == "forward" and host.state_bytes == 0
    assert offloaded.state_bytes == kept.state_bytes and offloaded.comm_bytes == kept.comm_bytes
    batch, seq = WORK.batch()[0].shape
    model = WORK.build()
    blocks, width = len(list(model.get_submodule("blocks").children())), cast(Any, model).cfg.d_model
    assert host.to_host_bytes == blocks * batch * seq * width * 4  # one block input per checkpoint


def test_saved_tensors_round_trip_through_host_memory() -> None:
    x = torch.randn(3, 4)
    offload = ActivationOffload(pin=False)
    packed = offload.pack(x)  # a CPU tensor: the synchronous shardkit::to_host copy
    assert packed.device == x.device and packed.host.data_ptr() != x.data_ptr() and packed.done is None
    assert torch.equal(offload.unpack(packed), x)
