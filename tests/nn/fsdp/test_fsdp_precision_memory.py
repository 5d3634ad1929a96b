"""Mixed precision against DDP under CPU autocast, and the memory ZeRO-3 promises."""

from __future__ import annotations

import torch
from fsdp_testlib import BATCH, LR, build_fsdp, build_reference, ddp_reference, full_params
from torch import nn

from shardkit.distributed import count_comm_bytes
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import models as M
from shardkit.testing import run_distributed

#: bf16 keeps 8 bits of mantissa, so bf16 FSDP and DDP under bf16 autocast round differently. Measured worst
#: parameter difference after three SGD-momentum steps (world size 2): nested 7e-5, lm 3e-4, batchnorm 1.9e-2 --
#: the same size as DDP-autocast vs DDP-fp32 there (1.8e-2: BatchNorm over a batch of four amplifies rounding).
#: Asserted with a margin of about 3x.
MP_ATOL = {"nested": 3e-4, "lm": 1e-3, "batchnorm": 6e-2}


def _units(model: nn.Module) -> list[FSDP]:
    return [m for m in model.modules() if isinstance(m, FSDP)]


def _mixed_precision(rank: int, world_size: int, name: str, fp32_reduce_scatter: bool, no_sync: bool = False) -> float:
    ref = build_reference(name, rank)
    ddp = ddp_reference(name, ref)
    kwargs = dict(mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=fp32_reduce_scatter)
    fsdp = build_fsdp(name, rank, world_size, nested=True, **kwargs)
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=0.9)
    for i in range(3):
        x, y = M.make_batch(name, ref, BATCH, seed=1000 * i + rank)
        opt_ref.zero_grad()
        opt.zero_grad()
        if no_sync:  # an extra micro-batch whose unsharded gradients are summed locally (FP32 under bf16)
            with ddp.no_sync(), torch.autocast("cpu", dtype=torch.bfloat16):
                M.loss_for(name, ddp(y).float(), x).backward()
            with fsdp.no_sync():
                M.loss_for(name, fsdp(y).float(), x).backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_ref = ddp(x)
        M.loss_for(name, out_ref.float(), y).backward()
        opt_ref.step()
        with count_comm_bytes() as meter:
            out = fsdp(x)
        assert out.dtype == torch.bfloat16
        M.loss_for(name, out.float(), y).backward()
        opt.step()
        if world_size > 1:  # full parameters travel in bf16: 2 bytes per padded element
            gathered = sum(2 * m.padded_numel for u in _units(fsdp) for m in u.flat_param_metas)
            assert meter.payload_bytes["all_gather"] == gathered
    for p in fsdp.parameters():  # FP32 master shards and gradients
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    got = full_params(fsdp)
    worst = 0.0
    for n, p in ref.named_parameters():
        worst = max(worst, (got[n] - p.detach()).abs().max().item())
        torch.testing.assert_close(got[n], p.detach(), atol=MP_ATOL[name], rtol=0.0, msg=lambda m, n=n: f"{n}: {m}")
    for n, b in fsdp.named_buffers():
        if b.is_floating_point():
            assert b.dtype == torch.bfloat16, f"buffer {n} not cast to buffer_dtype"
    return worst


def _mp_all(rank: int, world_size: int) -> list[float]:
    return [
        _mixed_precision(rank, world_size, "nested", fp32_reduce_scatter=False, no_sync=True),
        _mixed_precision(rank, world_size, "lm", fp32_reduce_scatter=True),
        _mixed_precision(rank, world_size, "batchnorm", fp32_reduce_scatter=False),
    ]


def test_mixed_precision_bf16_matches_ddp_autocast() -> None:
    worst = run_distributed(_mp_all, 2)
    assert max(max(w) for w in worst) > 0.0  # bf16 really was used: results are not bit-identical to fp32


def _state_bytes(params: list[nn.Parameter], optim: torch.optim.Optimizer) -> int:
    total = 0
    for p in params:
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += value.numel() * value.element_size()
    return total


def _memory(rank: int, world_size: int) -> tuple[int, int]:
    name = "lm"
    ref = build_reference(name, rank)
    ddp = ddp_reference(name, ref)
    fsdp = build_fsdp(name, rank, world_size, nested=True)
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=0.9)
    for model, optim in ((ddp, opt_ref), (fsdp, opt)):
        x, y = M.make_batch(name, ref, BATCH, seed=rank)
        optim.zero_grad()
        M.loss_for(name, model(x), y).backward()
        optim.step()
    ddp_bytes = _state_bytes(list(ddp.parameters()), opt_ref)
    fsdp_bytes = _state_bytes(list(fsdp.parameters()), opt)
    # Shards, their gradients and momentum each carry at most the padding of every flat parameter.
    padding = sum(
        3 * (m.padded_numel - m.numel) // world_size * m.dtype.itemsize
        for u in _units(fsdp)
        for m in u.flat_param_metas
    )
    assert fsdp_bytes <= ddp_bytes // world_size + padding, (fsdp_bytes, ddp_bytes, padding)
    assert all(u.unsharded_bytes() == 0 for u in _units(fsdp)), "full parameters still allocated after the step"
    return fsdp_bytes, ddp_bytes


def test_memory_is_ddp_over_world_size() -> None:
    for world_size in (2, 4):
        per_rank = run_distributed(_memory, world_size)
        fsdp_bytes, ddp_bytes = per_rank[0]
        assert fsdp_bytes < ddp_bytes / world_size * 1.05
