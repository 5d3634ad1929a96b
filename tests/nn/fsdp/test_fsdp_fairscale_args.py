"""fairscale's FullyShardedDataParallel arguments keep fairscale's meaning: parity with DDP where they touch training
(disable_reshard_on_root, gradient_predivide_factor, set_gradient_divide_factors, cpu_offload=True,
process_group_reduce_scatter) and the documented effect otherwise (state_dict_on_rank_0_only)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_testlib import BATCH, assert_same_params, build_fsdp, build_reference, ddp_reference, run_parity

from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import ProcessGroupName
from shardkit.testing import models as M
from shardkit.testing import run_distributed


def _root_after_forward(model: FSDP, rank: int) -> int:
    target = model.module
    x, y = M.make_batch("nested", target, BATCH, seed=rank)
    out = model(x)
    held = model.unsharded_bytes()
    M.loss_for("nested", out, y).backward()
    return held


def _training_args(rank: int, world_size: int) -> None:
    # The root frees its parameters after forward and gathers them again for backward: same training.
    run_parity(rank, world_size, "nested", nested=True, disable_reshard_on_root=False)
    kept = build_fsdp("nested", rank, world_size, nested=True)
    freed = build_fsdp("nested", rank, world_size, nested=True, disable_reshard_on_root=False)
    assert _root_after_forward(kept, rank) > 0
    assert _root_after_forward(freed, rank) == 0
    assert freed.disable_reshard_on_root is False and kept.disable_reshard_on_root is True
    # Dividing before and after the reduction still averages (a factor below, at and above the world size).
    for factor in (0.5, float(world_size), 3.0):
        run_parity(rank, world_size, "lm", nested=True, gradient_predivide_factor=factor)
    model = build_fsdp("nested", rank, world_size, nested=False, gradient_predivide_factor=2.0)
    assert (model.gradient_predivide_factor, model.gradient_postdivide_factor) == (2.0, world_size / 2.0)
    # fairscale's bool spelling of parameter offload.
    run_parity(rank, world_size, "nested", nested=True, cpu_offload=True)
    offloaded = build_fsdp("nested", rank, world_size, nested=False, cpu_offload=True)
    assert offloaded.move_params_to_cpu and offloaded.cpu_offload and offloaded.move_grads_to_cpu
    assert all(p.device.type == "cpu" for p in offloaded.parameters())
    # Reductions on the parameter group itself, or on a group the caller made over the same ranks.
    run_parity(rank, world_size, "nested", nested=True, process_group_reduce_scatter=ProcessGroupName.default)
    own = dist.new_group(list(range(world_size)))
    run_parity(rank, world_size, "moe", nested=True, flatten_parameters=False, process_group_reduce_scatter=own)


def test_training_arguments_match_ddp() -> None:
    run_distributed(_training_args, 2)


def _divide_factors(rank: int, world_size: int) -> None:
    # pre * post == world size: the average, as DDP computes it (one SGD step, then the same parameters).
    ref = build_reference("nested", rank)
    ddp = ddp_reference("nested", ref)
    model = build_fsdp("nested", rank, world_size, nested=True)
    model.set_gradient_divide_factors(1.0, float(world_size), recursive=True)
    assert all(m.gradient_postdivide_factor == world_size for m in model.modules() if isinstance(m, FSDP))
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = M.make_batch("nested", ref, BATCH, seed=rank)
    M.loss_for("nested", ddp(x), y).backward()
    M.loss_for("nested", model(x), y).backward()
    summed = build_fsdp("nested", rank, world_size, nested=True)
    summed.set_gradient_divide_factors(1.0, 1.0, recursive=True)  # no division at all: the sum over ranks
    M.loss_for("nested", summed(x), y).backward()
    for averaged, total in zip(model.parameters(), summed.parameters()):
        torch.testing.assert_close(total.grad, averaged.grad * world_size)
    opt_ref.step()
    opt.step()
    assert_same_params(ref, model, what="set_gradient_divide_factors(1, world_size)")


def test_set_gradient_divide_factors() -> None:
    run_distributed(_divide_factors, 2)


def _rank0_state_dict(rank: int, world_size: int) -> None:
    ref = build_reference("nested", rank)
    model = build_fsdp("nested", rank, world_size, nested=True, state_dict_on_rank_0_only=True)
    sd = model.state_dict()  # every rank calls: all take part in the gathers
    if dist.get_rank() == 0:
        assert sorted(sd) == sorted(ref.state_dict())
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(sd[key], value)
    else:
        assert sd == {}
    # The model still trains and loads a full state dict afterwards.
    plain = build_fsdp("nested", rank, world_size, nested=True)
    plain.load_state_dict(ref.state_dict())
    torch.testing.assert_close(plain.state_dict()["module.0.weight"], ref.module[0].weight)


def test_state_dict_on_rank_0_only() -> None:
    run_distributed(_rank0_state_dict, 2)


def _reduce_group_errors(rank: int, world_size: int) -> None:
    solo = [dist.new_group([r]) for r in range(world_size)][rank]
    with pytest.warns(UserWarning, match="reduce-scattered on process_group instead"):
        model = FSDP(M.build("nested"), process_group_reduce_scatter=solo)
    assert model.process_group_reduce_scatter is model.process_group
    # Units of one group that disagree on where to reduce are refused at the first forward, before any change.
    inner = FSDP(torch.nn.Linear(8, 8), process_group_reduce_scatter=ProcessGroupName.default)
    outer = FSDP(torch.nn.Sequential(inner, torch.nn.Linear(8, 8)))
    with pytest.raises(ValueError, match="different process_group_reduce_scatter"):
        outer(torch.ones(2, 8))
    assert outer.is_root is None and inner.is_root is None


def test_process_group_reduce_scatter_checks() -> None:
    run_distributed(_reduce_group_errors, 2)
