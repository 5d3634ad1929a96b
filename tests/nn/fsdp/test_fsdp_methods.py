"""clip_grad_norm_, summon_full_params, apply, CPU offload / prefetch hints, and bad input across ranks."""

from __future__ import annotations

import math

import pytest
import torch
from fsdp_testlib import BATCH, LR, build_fsdp, build_reference, ddp_reference, full_params, run_parity
from torch import nn

from shardkit.nn.fsdp import BackwardPrefetch, CPUOffload
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import models as M
from shardkit.testing import run_distributed


def _clip(rank: int, world_size: int, name: str) -> None:
    for norm_type in (2.0, math.inf):
        ref = build_reference(name, rank)
        ddp = ddp_reference(name, ref)
        fsdp = build_fsdp(name, rank, world_size, nested=True)
        for model in (ddp, fsdp):
            x, y = M.make_batch(name, ref, BATCH, seed=rank)
            M.loss_for(name, model(x), y).backward()
        # Torch on this rank's unwrapped model (DDP-averaged shared grads, local expert grads) is the truth.
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.01, norm_type=norm_type)
        got = fsdp.clip_grad_norm_(0.01, norm_type=norm_type)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert got > 0.01  # clipping really happened
        torch.optim.SGD(ref.parameters(), lr=LR).step()
        torch.optim.SGD(fsdp.parameters(), lr=LR).step()
        params = full_params(fsdp)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(params[n], p.detach(), atol=1e-5, rtol=1e-5)
        inner = next(m for m in fsdp.modules() if isinstance(m, FSDP) and m is not fsdp)
        with pytest.raises(RuntimeError, match="root"):
            inner.clip_grad_norm_(1.0)


@pytest.mark.parametrize("name", ["moe", "lm"])
def test_clip_grad_norm_equals_torch_on_unwrapped_model(name: str) -> None:
    run_distributed(_clip, 2, name)


def _summon(rank: int, world_size: int) -> None:
    fsdp = build_fsdp("nested", rank, world_size, nested=True)
    ref = build_reference("nested", rank)
    with fsdp.summon_full_params(), torch.no_grad():
        names = [n for n, _ in fsdp.named_parameters()]
        assert names == [n for n, _ in ref.named_parameters()]
        fsdp.module.module.module[0].weight.mul_(2.0)  # edited in place (root unit)
        inner = fsdp.module.module.module[1].module[0].module  # Linear inside a unit nested in a unit
        inner.bias = nn.Parameter(torch.full_like(inner.bias, 3.0))  # replaced, same shape
        with fsdp.summon_full_params():  # re-entering is a no-op
            assert fsdp.module.module.module[0].weight.shape == (4, 8)
    with fsdp.summon_full_params(writeback=False), torch.no_grad():
        fsdp.module.module.module[2].module.weight.zero_()  # discarded
    with torch.no_grad():
        ref.module[0].weight.mul_(2.0)
        ref.module[1][0].bias.fill_(3.0)
    params = full_params(fsdp)
    for n, p in ref.named_parameters():
        assert torch.equal(params[n], p), n
    # apply() sees full parameters and writes them back.
    for model in (ref, fsdp):
        model.apply(lambda m: nn.init.constant_(m.weight, 0.25) if isinstance(m, nn.Linear) else None)
    params = full_params(fsdp)
    assert all(torch.equal(params[n], p) for n, p in ref.named_parameters())
    # and training still matches afterwards
    x = torch.randn(4, 8)
    torch.testing.assert_close(fsdp(x), ref(x))


def test_summon_full_params_writeback_and_apply() -> None:
    run_distributed(_summon, 2)


def _offload_and_prefetch(rank: int, world_size: int) -> None:
    baseline = run_parity(rank, world_size, "lm", nested=True)
    variants: list[dict] = [
        {"cpu_offload": CPUOffload(offload_params=True)},
        {"move_params_to_cpu": True, "backward_prefetch": BackwardPrefetch.BACKWARD_PRE},
        {"backward_prefetch": BackwardPrefetch.BACKWARD_POST, "forward_prefetch": True},
    ]
    for kwargs in variants:
        assert run_parity(rank, world_size, "lm", nested=True, **kwargs) == baseline
    fsdp = build_fsdp("nested", rank, world_size, nested=True, cpu_offload=CPUOffload(offload_params=True))
    assert fsdp.cpu_offload == CPUOffload(offload_params=True)
    assert all(p.device.type == "cpu" for p in fsdp.parameters())


def test_cpu_offload_and_prefetch_hints_give_identical_results() -> None:
    run_distributed(_offload_and_prefetch, 2)


def _shape_mismatch(rank: int, world_size: int) -> str:
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4 + rank))
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"'1\.weight'") as info:
        FSDP(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before), "model was changed"
    return str(info.value)


def test_shape_mismatch_across_ranks_fails_on_every_rank() -> None:
    messages = run_distributed(_shape_mismatch, 2)
    assert all("rank" in m and "left unchanged" in m for m in messages)
