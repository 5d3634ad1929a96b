"""The SlowMo checkpoint's averages, computed into copies on two ranks: push-sum weighted parameters, averaged
momentum, rank 0's buffers, each rank keeping only its share; the live tensors and optimizer stay as they were."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardkit.checkpoint.adapters.slowmo_average import average_params, averaged_optimizer, broadcast_copies
from shardkit.testing import run_distributed


def _averages(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.group.WORLD
    cpu = torch.device("cpu")
    p = torch.nn.Parameter(torch.full((2, 3), float(rank + 1)))  # numerators x_0 = 1, x_1 = 2
    weight = [1.0, 3.0][rank]  # w_0 = 1, w_1 = 3: the estimate is (1 + 2) / (1 + 3)
    opt = torch.optim.SGD([p], lr=0.01, momentum=0.9)
    p.grad = torch.full_like(p, 10.0 * (rank + 1))
    opt.step()  # momentum_buffer = grad: 10 on rank 0, 20 on rank 1
    live = p.detach().clone()
    share = (3 * rank, 3 * rank + 3)  # rank 0 keeps elements 0-2, rank 1 elements 3-5
    (copy,) = average_params([p], [share], weight, numerators=True, group=group, device=cpu)
    (debiased,) = average_params([p.detach() / weight], [share], weight, numerators=False, group=group, device=cpu)
    shadow = averaged_optimizer(opt, {id(p): (copy, share)}, group, cpu)
    (buf,) = broadcast_copies([torch.arange(4.0) + rank], [(2 * rank, 2 * rank + 2)], group, cpu)
    return {
        "copy": copy.tolist(),
        "debiased": debiased.tolist(),
        "momentum": shadow.state[copy]["momentum_buffer"].tolist(),
        "own_momentum": opt.state[p]["momentum_buffer"].tolist(),
        "live_unchanged": torch.equal(p.detach(), live),
        "shadow_params_are_copies": shadow.param_groups[0]["params"][0] is copy
        and opt.param_groups[0]["params"][0] is p,
        "lr": shadow.param_groups[0]["lr"],
        "buffer": buf.tolist(),
    }


def test_slowmo_averages_go_into_copies() -> None:
    for rank, out in enumerate(run_distributed(_averages, 2, timeout_s=60)):
        assert out["live_unchanged"] and out["shadow_params_are_copies"] and out["lr"] == 0.01
        # after the step x_0 = 1 - 0.01 * 10 = 0.9 and x_1 = 2 - 0.01 * 20 = 1.8; weights 1 and 3
        expected = torch.full((3,), (0.9 + 1.8) / 4.0)
        assert torch.allclose(torch.tensor(out["copy"]), expected, rtol=1e-6)
        assert torch.allclose(torch.tensor(out["debiased"]), expected, rtol=1e-6)
        assert out["momentum"] == [15.0] * 3
        assert out["own_momentum"] == [[10.0 * (rank + 1)] * 3] * 2
        assert out["buffer"] == [[0.0, 1.0], [2.0, 3.0]][rank]  # rank 0's buffer, cut
