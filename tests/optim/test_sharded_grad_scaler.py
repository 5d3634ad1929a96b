"""ShardedGradScaler: every rank skips together on inf/NaN, and otherwise behaves like torch's GradScaler."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import DummyProcessGroup
from shardkit.optim import OSS, GradScaler, ShardedGradScaler
from shardkit.optim.grad_scaler import ShardedGradScaler as ScalerFromCompatPath
from shardkit.testing import run_distributed
from testkit import average_grads, max_param_diff, rank_batch, tiny_model


def _scaled_backward(
    model: nn.Module, scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype
) -> None:
    with torch.autocast(device_type="cpu", dtype=dtype):
        out = model(x)
    scaler.scale(F.mse_loss(out.float(), y)).backward()


def _free_unowned_grads(opt: OSS) -> None:
    """What ShardedDataParallel leaves behind: each rank holds only the gradients of its own shard."""
    for p, owner in opt.param_to_rank.items():
        if owner != opt.rank:
            p.grad = None


def _skip_together(rank: int, world_size: int) -> dict[str, float]:
    model = tiny_model("nested")
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    scaler = ShardedGradScaler()
    out = {}
    for step, inject in enumerate((True, False)):
        opt.zero_grad()
        _scaled_backward(model, scaler, *rank_batch("nested", model, rank, step), torch.bfloat16)
        average_grads(model)
        _free_unowned_grads(opt)
        if inject and rank == world_size - 1:
            owned = [p for p, r in opt.param_to_rank.items() if r == rank]
            owned[0].grad.view(-1)[0] = float("inf")  # only the last rank can see this
        before = copy.deepcopy(model)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        out[f"moved{step}"] = max_param_diff(before, model)
        out[f"scale_ratio{step}"] = scaler.get_scale() / scale
    out["device_is_cpu"] = float(scaler._device == "cpu")
    return out


def test_inf_in_one_shard_skips_every_rank() -> None:
    for result in run_distributed(_skip_together, 2, timeout_s=30):
        assert result["moved0"] == 0.0 and result["scale_ratio0"] == 0.5
        assert result["moved1"] > 1e-5 and result["scale_ratio1"] == 1.0
        assert result["device_is_cpu"] == 1.0


def _matches_gradscaler(rank: int, world_size: int) -> dict[str, float]:
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        base = tiny_model("nested")
        ref, test = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        test_opt = OSS(test.parameters(), optim=torch.optim.AdamW, lr=1e-2)
        # A scale large enough that fp16 overflows at first: both must skip the same early steps.
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
        test_scaler = ShardedGradScaler(init_scale=2.0**20, growth_interval=2)
        for step in range(4):
            for model, opt, scaler in ((ref, ref_opt, ref_scaler), (test, test_opt, test_scaler)):
                opt.zero_grad()
                _scaled_backward(model, scaler, *rank_batch("nested", model, rank, step), dtype)
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            if ref_scaler.get_scale() != test_scaler.get_scale():
                out[f"{dtype}-scale-mismatch"] = float(step)
        out[f"{dtype}"] = max_param_diff(ref, test)
        out[f"{dtype}-moved"] = max_param_diff(base, test.module)
    return out


def test_matches_unsharded_gradscaler() -> None:
    for result in run_distributed(_matches_gradscaler, 2):
        for dtype in ("torch.bfloat16", "torch.float16"):
            assert f"{dtype}-scale-mismatch" not in result, result
            assert result[dtype] <= 1e-6, result
            assert result[f"{dtype}-moved"] > 1e-4, result


def _rank_without_gradients(rank: int, world_size: int) -> float:
    model = nn.Linear(4, 1, bias=False)  # one tensor: the second rank owns nothing
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    assert list(opt.param_to_rank.values()) == [0]
    scaler = ShardedGradScaler()
    _scaled_backward(model, scaler, torch.ones(2, 4), torch.zeros(2, 1), torch.bfloat16)
    average_grads(model)
    _free_unowned_grads(opt)
    scaler.step(opt)
    scaler.update()
    return model.weight.sum().item()


def test_rank_with_no_gradients_still_steps() -> None:
    values = run_distributed(_rank_without_gradients, 2)
    assert values[0] == values[1]


def test_single_process_without_distributed() -> None:
    assert ScalerFromCompatPath is ShardedGradScaler
    model, ref = tiny_model("nested"), tiny_model("nested")
    opt = OSS(model.parameters(), group=DummyProcessGroup(0, 1), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = ShardedGradScaler(), torch.amp.GradScaler("cpu")
    for step in range(2):
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            _scaled_backward(m, s, *rank_batch("nested", m, 0, step), torch.bfloat16)
            s.step(o)
            s.update()
    assert max_param_diff(model, ref) == 0.0
    assert scaler.get_scale() == ref_scaler.get_scale()


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_explicit_device(device: object) -> None:
    scaler = ShardedGradScaler(init_scale=8.0, device=device)  # type: ignore[arg-type]
    assert scaler.scale(torch.ones(())).item() == 8.0


def test_first_positional_argument_is_init_scale_as_in_fairscale() -> None:
    scaler = ShardedGradScaler(1024.0, 3.0, 0.25, 7, True, None)
    assert scaler.scale(torch.ones(())).item() == 1024.0
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.25, 7)
    assert scaler.process_group is None and scaler.is_enabled()
    with pytest.raises(TypeError, match=r"first argument is init_scale.*device='cpu'"):
        ShardedGradScaler("cpu")  # type: ignore[arg-type]


def test_plain_grad_scaler_unscales_fp16_gradients() -> None:
    """fairscale's GradScaler: torch's refuses fp16 gradients, this one unscales them like any other."""
    model = nn.Linear(4, 1, bias=False).half()
    for scaler_cls, expect_error in ((torch.amp.GradScaler, True), (GradScaler, False)):
        model.zero_grad()
        scaler = scaler_cls(init_scale=64.0) if scaler_cls is GradScaler else scaler_cls("cpu", init_scale=64.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler.scale(model(torch.ones(2, 4, dtype=torch.float16)).sum()).backward()
        assert model.weight.grad is not None and torch.all(model.weight.grad == 128.0)  # 2 rows x scale 64
        if expect_error:
            with pytest.raises(ValueError, match="FP16"):
                scaler.unscale_(opt)
        else:
            scaler.unscale_(opt)
            assert torch.all(model.weight.grad == 2.0)
