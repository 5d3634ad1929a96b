"""OSS as fairscale code calls it: its extra constructor arguments, frozen param groups added later, sharding over
a subgroup, and the refusal of ranks that hold different parameters (alone and under torch DDP)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.distributed import DummyProcessGroup
from shardkit.optim import OSS
from shardkit.optim.zero1.partition import Partition
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import average_grads, max_param_diff, rank_batch, tiny_model


def test_fairscale_arguments_are_accepted_and_never_reach_the_inner_optimizer() -> None:
    model = nn.Linear(3, 2)
    group = DummyProcessGroup(0, 1)
    # Positionally, in fairscale's order: params, optim, group, broadcast_buffer_size, broadcast_fp16,
    # force_broadcast_object.
    opt = OSS(model.parameters(), torch.optim.SGD, group, 2**20, False, True, lr=0.1, momentum=0.9)
    assert opt.force_broadcast_object is True and opt.broadcast_fp16 is False
    for key in ("broadcast_buffer_size", "force_broadcast_object", "broadcast_fp16"):
        assert key not in opt.optim.defaults and key not in opt.param_groups[0]
    assert opt.param_groups[0]["lr"] == 0.1 and opt.optim.defaults["momentum"] == 0.9
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.consolidate_state_dict()
    assert len(opt.state_dict()["state"]) == 2


def test_a_frozen_group_added_later_evens_out_the_ranks() -> None:
    """fairscale's promise: 15 trainable tensors plus a frozen one leave every one of 4 ranks 24 elements."""
    sizes = ([9, 7, 5, 3] * 4)[:-1]
    trainable = [torch.zeros(n, 1, requires_grad=True) for n in sizes]
    frozen = torch.zeros(3, 1)
    partition = Partition.build([{"params": trainable}, {"params": [frozen]}], 4)
    per_rank = [sum(p.numel() for g in groups for p in g["params"]) for groups in partition.rank_groups]
    assert per_rank == [24, 24, 24, 24]
    assert frozen not in partition.param_to_rank()  # it carries no optimizer work


def _subgroup(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks 0 and 2 shard over their own group, with either broadcast_buffer_size; rank 1 never joins."""
    sub = dist.new_group(ranks=[0, 2])
    out: dict[str, Any] = {}
    if rank == 1:
        return out
    for size in (2**20, 0):
        model, ref = tiny_model("nested"), tiny_model("nested")
        opt = OSS(model.parameters(), lr=0.1, momentum=0.9, group=sub, broadcast_buffer_size=size)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                x, y = rank_batch("nested", m, rank, step)
                loss_for("nested", m(x), y).backward()
                average_grads(m, group=sub)  # what DDP over the subgroup would do
                o.step()
        out[f"diff_{size}"] = max_param_diff(model, ref)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(gathered, flat, group=sub)
        out[f"same_{size}"] = torch.equal(gathered[0], gathered[1])
        out[f"owners_{size}"] = sorted(set(opt.param_to_rank.values()))
    return out


def test_subgroup_with_broadcast_buffer_size_matches_plain_sgd() -> None:
    results = run_distributed(_subgroup, 3)
    assert results[1] == {}
    for result in (results[0], results[2]):
        for size in (2**20, 0):
            assert result[f"diff_{size}"] < 1e-6 and result[f"same_{size}"]
            assert result[f"owners_{size}"] == [0, 1]  # ranks within the subgroup


def _attempt(build: Any) -> str:
    try:
        build()
    except ValueError as err:
        return str(err)
    return "no error"


def _different_params(rank: int, world_size: int) -> dict[str, Any]:
    """Each way ranks can disagree: every rank must raise the same error, none may hang or change anything."""
    out: dict[str, Any] = {}
    torch.manual_seed(rank)
    wider = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3 if rank == 1 else 2))
    before = [(p.data_ptr(), p.detach().clone()) for p in wider.parameters()]
    out["shape"] = _attempt(lambda: OSS(wider.parameters(), lr=0.1))
    out["untouched"] = all(p.data_ptr() == ptr and torch.equal(p, v) for p, (ptr, v) in zip(wider.parameters(), before))
    double = nn.Linear(4, 2).to(torch.float64 if rank == 1 else torch.float32)
    out["dtype"] = _attempt(lambda: OSS(double.parameters(), lr=0.1))
    frozen = nn.Linear(4, 2)
    frozen.bias.requires_grad_(rank == 0)
    out["frozen"] = _attempt(lambda: OSS(frozen.parameters(), lr=0.1))
    # Under DDP, which checks shapes only: same model, but the ranks split it into param groups differently.
    ddp = DDP(tiny_model("nested"))
    params = list(ddp.parameters())
    groups = [{"params": params}] if rank == 0 else [{"params": params[:2]}, {"params": params[2:], "lr": 0.2}]
    out["groups"] = _attempt(lambda: OSS(groups, lr=0.1))
    # A rank-specific argument error: rank 1's optimizer refuses its learning rate.
    out["refused"] = _attempt(lambda: OSS(nn.Linear(2, 2).parameters(), lr=-1.0 if rank == 1 else 0.1))
    # add_param_group with a different tensor on one rank.
    opt = OSS(nn.Linear(2, 2).parameters(), lr=0.1)
    out["added"] = _attempt(lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(3 + rank))]}))
    out["groups_after_refused_add"] = len(opt.param_groups)
    # The same model on every rank still trains in lockstep with DDP + plain SGD.
    ref = DDP(tiny_model("nested"))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    twin = DDP(copy.deepcopy(ref.module))
    twin_opt = OSS(twin.parameters(), lr=0.1)
    for m, o in ((ref, ref_opt), (twin, twin_opt)):
        x, y = rank_batch("nested", m, rank, 0)
        loss_for("nested", m(x), y).backward()
        o.step()
    out["ok_diff"] = max_param_diff(ref, twin)
    return out


def test_ranks_with_different_parameters_fail_on_every_rank() -> None:
    results = run_distributed(_different_params, 2, timeout_s=90)
    for result in results:
        assert "rank 0 has parameter 'param_groups[0][2]' [2, 8]" in result["shape"], result["shape"]
        assert "rank 1 has parameter 'param_groups[0][2]' [3, 8]" in result["shape"]
        assert "Nothing was broadcast or changed" in result["shape"] and result["untouched"]
        assert "torch.float32 where rank 1 has" in result["dtype"] and "torch.float64" in result["dtype"]
        assert "'param_groups[0][1]' [2] torch.float32 where" in result["frozen"] and "frozen" in result["frozen"]
        assert "param_groups[1][0]" in result["groups"], result["groups"]
        assert result["added"].startswith("OSS.add_param_group: the ranks hold different parameters")
        assert result["groups_after_refused_add"] == 1
        assert result["ok_diff"] == 0.0
    assert "Invalid learning rate" in results[1]["refused"]
    assert results[0]["refused"].startswith("OSS: rank 1 refused its arguments (ValueError: Invalid learning rate")


def _add_group_later(rank: int, world_size: int) -> dict[str, float]:
    """fairscale's add_param_group pattern: the optimizer starts without the last tensor, which is added later."""
    model, ref = tiny_model("nested"), tiny_model("nested")
    opt = OSS(list(model.parameters())[:-1], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(list(ref.parameters())[:-1], lr=0.1, momentum=0.9)
    last, ref_last = list(model.parameters())[-1], list(ref.parameters())[-1]
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": [last], "lr": 0.05})
            ref_opt.add_param_group({"params": [ref_last], "lr": 0.05})
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            x, y = rank_batch("nested", m, rank, step)
            loss_for("nested", m(x), y).backward()
            average_grads(m)
            o.step()
    local = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    return {"diff": max_param_diff(model, ref), "groups": len(opt.optim.param_groups), "local": local}


@pytest.mark.parametrize("world_size", [2])
def test_add_param_group_matches_plain_sgd(world_size: int) -> None:
    results = run_distributed(_add_group_later, world_size)
    for result in results:
        assert result["diff"] < 1e-6 and result["groups"] == 2
    total = sum(p.numel() for p in tiny_model("nested").parameters())
    assert sum(r["local"] for r in results) == total
