"""fairscale's FSDP helpers and small arguments: auto_wrap_bn, get_fsdp_instances, shard consolidation,
no_broadcast_optim_state, force_input_to_fp32, clear_autocast_cache, verbose, reset_parameters, volatile."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_testlib import BATCH, LR, build_fsdp, build_reference, ddp_reference, step
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.data_parallel import auto_wrap_bn, get_fsdp_instances, no_pre_load_state_dict_hook
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.nn.fsdp import ProcessGroupName, TrainingState
from shardkit.testing import models as M
from shardkit.testing import run_distributed

ONE = DummyProcessGroup(rank=0, size=1)


class _Recorder(nn.Module):
    """Records the dtype of its input; a parameter so the unit has something to shard."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return x.float() * self.scale


def test_force_input_to_fp32_casts_half_inputs_and_keeps_their_gradient() -> None:
    model = FSDP(_Recorder(), process_group=ONE, force_input_to_fp32=True)
    x = torch.full((2, 4), 3.0, dtype=torch.float16, requires_grad=True)
    model(x).sum().backward()
    assert model.module.seen == [torch.float32] and model.force_input_to_fp32
    assert x.grad is not None and x.grad.dtype == torch.float16
    torch.testing.assert_close(x.grad, torch.ones(2, 4, dtype=torch.float16))
    plain = FSDP(_Recorder(), process_group=ONE)
    plain(x)
    assert plain.module.seen == [torch.float16]
    # Under mixed precision inputs get the compute dtype instead; the flag reads back False, as in fairscale.
    mixed = FSDP(_Recorder(), process_group=ONE, compute_dtype=torch.bfloat16, force_input_to_fp32=True)
    mixed(x)
    assert mixed.module.seen == [torch.bfloat16] and not mixed.force_input_to_fp32


def test_clear_autocast_cache_after_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "clear_autocast_cache", lambda: calls.append(1))
    FSDP(nn.Linear(4, 4), process_group=ONE)(torch.ones(1, 4))
    assert calls == []
    FSDP(nn.Linear(4, 4), process_group=ONE, clear_autocast_cache=True)(torch.ones(1, 4))
    assert calls == [1]


def test_verbose_repr_lists_every_setting() -> None:
    short = FSDP(nn.Linear(2, 2), process_group=ONE).extra_repr()
    long = FSDP(nn.Linear(2, 2), process_group=ONE, verbose=True, gradient_predivide_factor=1.0).extra_repr()
    assert "gradient_divide_factors" not in short
    for field in ("process_group_reduce_scatter=ProcessGroupName.reduce_scatter", "gradient_divide_factors=(1.0,"):
        assert field in long, long


def test_positional_arguments_keep_fairscale_meaning() -> None:
    # fairscale's third positional argument is process_group_reduce_scatter, the fourth reshard_after_forward.
    model = FSDP(nn.Linear(2, 2), ONE, ProcessGroupName.default, False, False)
    assert not model.reshard_after_forward and not model.disable_reshard_on_root
    assert model.process_group_reduce_scatter is model.process_group
    offloaded = FSDP(nn.Linear(2, 2), ONE, cpu_offload=True)
    assert offloaded.move_params_to_cpu and bool(offloaded.cpu_offload)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gradient_predivide_factor": 0.0}, ValueError, "gradient_predivide_factor"),
        ({"process_group_reduce_scatter": "bogus"}, ValueError, "ProcessGroupName"),
        ({"process_group_reduce_scatter": 3}, TypeError, "process_group_reduce_scatter"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload"),
        ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb"),
    ],
)
def test_bad_fairscale_arguments_are_rejected_before_any_change(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    linear = nn.Linear(2, 2)
    with pytest.raises(error, match=match):
        FSDP(linear, process_group=ONE, **kwargs)
    assert isinstance(linear.weight, nn.Parameter) and dict(linear.named_parameters()).keys() == {"weight", "bias"}


def test_reset_parameters_is_opt_in() -> None:
    with pytest.raises(RuntimeError, match="allow_reset_parameters=True"):
        FSDP(nn.Linear(3, 3), process_group=ONE).reset_parameters()
    ref = nn.Linear(3, 3)
    model = FSDP(nn.Linear(3, 3), process_group=ONE, allow_reset_parameters=True)
    torch.manual_seed(7)
    ref.reset_parameters()
    torch.manual_seed(7)
    model.reset_parameters()
    with model.summon_full_params(volatile=True):
        torch.testing.assert_close(model.module.weight, ref.weight)
        torch.testing.assert_close(model.module.bias, ref.bias)


def test_summon_full_params_volatile_does_not_write_back() -> None:
    model = FSDP(nn.Linear(3, 3), process_group=ONE)
    before = model.state_dict()["weight"].clone()
    with model.summon_full_params(True, True):  # fairscale's positional (recurse, volatile)
        model.module.weight.data.zero_()
    torch.testing.assert_close(model.state_dict()["weight"], before)
    with model.summon_full_params():
        model.module.weight.data.zero_()
    assert model.state_dict()["weight"].abs().sum() == 0
    with pytest.raises(ValueError, match="contradict"), model.summon_full_params(volatile=True, writeback=True):
        pass


def test_get_fsdp_instances_and_small_methods() -> None:
    inner = FSDP(nn.Linear(2, 2), process_group=ONE)
    empty = FSDP(nn.Sequential(inner, nn.ReLU()), process_group=ONE)
    root = FSDP(nn.Sequential(empty, nn.Linear(2, 2)), process_group=ONE)
    assert get_fsdp_instances(root) == [root, empty, inner]
    assert get_fsdp_instances(root, skip_empty=True) == [root, inner]
    assert get_fsdp_instances(nn.Linear(2, 2)) == []
    root.assert_state(TrainingState.IDLE)
    root.assert_state([TrainingState.FORWARD, TrainingState.IDLE])
    with pytest.raises(RuntimeError, match="expected FORWARD"):
        root.assert_state(TrainingState.FORWARD)
    with pytest.raises(NotImplementedError, match="one FullyShardedDataParallel unit"):
        root.append_shared_param(nn.Parameter(torch.ones(1)))
    root(torch.ones(1, 2)).sum().backward()
    assert len(root.params_with_grad) == 2 and root.non_shared_params() == root.flat_params
    with pytest.raises(ValueError, match="must be > 0"):
        root.set_gradient_divide_factors(0.0, 1.0, recursive=False)
    with no_pre_load_state_dict_hook():
        root.load_state_dict(root.state_dict())


def _bn_parity(rank: int, world_size: int) -> None:
    # Every BatchNorm in its own full-precision unit; the rest in the root: same training as DDP.
    ref = build_reference("batchnorm", rank)
    ddp = ddp_reference("batchnorm", ref)
    torch.manual_seed(0)
    body = auto_wrap_bn(M.build("batchnorm", seed=0))
    bn_units = [m for m in body.modules() if isinstance(m, FSDP)]
    assert len(bn_units) == 2 and all(isinstance(u.module, nn.BatchNorm1d) for u in bn_units)
    assert all(not u.flatten_parameters and not u.reshard_after_forward and not u.mixed_precision for u in bn_units)
    model = FSDP(body)
    opt_ref = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for i in range(3):
        ref_loss = step("batchnorm", ddp, opt_ref, rank, i)
        loss = step("batchnorm", model, opt, rank, i)
        assert abs(ref_loss - loss) < 1e-5, (i, ref_loss, loss)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert sorted(sd) == sorted(ref_sd)
    for key, value in ref_sd.items():
        torch.testing.assert_close(sd[key], value, atol=1e-5, rtol=1e-5)
    # Under a 16-bit root the BatchNorm units keep FP32 statistics.
    mixed = FSDP(auto_wrap_bn(M.build("batchnorm", seed=0)), compute_dtype=torch.bfloat16)
    x, _ = M.make_batch("batchnorm", mixed.module, BATCH, seed=rank)
    mixed(x).float().sum().backward()
    stats = {n: b.dtype for n, b in mixed.named_buffers() if "running" in n}
    assert stats and set(stats.values()) == {torch.float32}, stats
    # One-rank groups: each BatchNorm unit is its own rank's (fairscale marks them no_broadcast_optim_state).
    solo = FSDP(auto_wrap_bn(M.build("batchnorm", seed=0), single_rank_pg=True))
    solo(x).sum().backward()
    assert all(u.world_size == 1 and u.no_broadcast_optim_state for u in get_fsdp_instances(solo)[1:])
    # Tags only, and refusal to overwrite another policy's tag.
    tagged = auto_wrap_bn(M.build("batchnorm", seed=0), wrap_it=False)
    assert not get_fsdp_instances(tagged) and tagged.bn.wrapper_config["mixed_precision"] is False
    with pytest.raises(ValueError, match="already carry a wrapper_config"):
        auto_wrap_bn(tagged)


def test_auto_wrap_bn_trains_like_ddp() -> None:
    run_distributed(_bn_parity, 2)


def _consolidate_and_optim(rank: int, world_size: int) -> None:
    model = build_fsdp("nested", rank, world_size, nested=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step("nested", model, opt, rank, 0)
    shards: list[Any] = [None] * world_size
    dist.all_gather_object(shards, (model.local_state_dict(), model.local_metadata_dict()))
    full = FSDP.consolidate_shard_weights([s[0] for s in shards], [s[1] for s in shards])
    expected = model.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(full[key], value)
    with pytest.raises(ValueError, match="no shard"):
        FSDP.consolidate_shard_weights([shards[0][0]], [shards[0][1]])
    # A unit marked no_broadcast_optim_state is not gathered; its ids are listed for the caller.
    body = M.build("nested", seed=0)
    body.module[2] = FSDP(body.module[2], no_broadcast_optim_state=True)
    marked = FSDP(body)
    opt = torch.optim.Adam(marked.parameters(), lr=0.01)
    step("nested", marked, opt, rank, 0)
    osd = marked.gather_full_optim_state_dict(opt)
    if rank != 0:
        assert osd is None
        return
    names = osd["param_groups"][0]["param_names"]
    skipped = [names[i] for i in osd["uncollected_local_ids"]]
    assert skipped == ["module.2.weight", "module.2.bias"], skipped
    assert all(i not in osd["state"] for i in osd["uncollected_local_ids"])
    assert len(osd["state"]) == len(names) - 2


def test_consolidate_shard_weights_and_no_broadcast_optim_state() -> None:
    run_distributed(_consolidate_and_optim, 2)
