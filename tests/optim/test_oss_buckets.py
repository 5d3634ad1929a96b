"""OSS's flat parameter buckets: parameters live in them, survive replaced ``.data``, and both exchanges agree."""

from __future__ import annotations

import pytest
import torch
from oss_testlib import ddp_pair
from torch import nn

from shardkit.optim.zero1.broadcast import buckets_intact, build_buckets, exchange_params
from shardkit.optim.zero1.partition import Partition
from shardkit.testing import run_distributed
from shardkit.testing.models import loss_for
from testkit import max_param_diff, rank_batch, train_harness_model


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    conv = torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last)
    strided = torch.randn(6, 10)[:, ::2]  # not dense: becomes contiguous in its bucket
    return [nn.Parameter(t) for t in (torch.randn(64, 32), conv, strided, torch.randn(32), torch.randn(300, 10))]


def test_parameters_become_views_of_their_bucket_with_values_and_layout_kept() -> None:
    params = _params()
    before = [p.detach().clone() for p in params]
    partition = Partition.build([{"params": params}], world_size=2)
    buckets = build_buckets(partition, broadcast_fp16=False, bucket_bytes=8 * 1024)
    assert sorted(id(p) for b in buckets for p in b.params) == sorted(id(p) for p in params)
    for bucket in buckets:
        assert bucket.flat.numel() * 4 <= 8 * 1024 or len(bucket.params) == 1  # the cap, or a lone big tensor
        assert all(partition.owner[p] == bucket.owner for p in bucket.params)
        for p in bucket.params:
            assert p.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
    for p, value in zip(params, before):
        assert torch.equal(p, value)
    assert params[1].is_contiguous(memory_format=torch.channels_last)
    assert params[2].is_contiguous()
    assert buckets_intact(buckets)
    with torch.no_grad():
        params[0].mul_(2)  # in-place updates land in the bucket
    assert buckets_intact(buckets)
    params[3].data = params[3].data.clone()  # what module.to(...) does
    assert not buckets_intact(buckets)


def test_fp16_buckets_keep_full_precision_storage() -> None:
    params = _params()
    buckets = build_buckets(Partition.build([{"params": params}], 2), broadcast_fp16=True)
    assert all(b.flat.dtype == torch.float32 and b.wire_dtype == torch.float16 for b in buckets)


def _exchanges_agree(rank: int, world_size: int) -> dict[str, float]:
    out = {}
    for direct in (True, False):
        torch.manual_seed(rank)  # every rank starts from different values
        params = _params()
        partition = Partition.build([{"params": params}], world_size)
        buckets = build_buckets(partition, broadcast_fp16=False, bucket_bytes=4 * 1024)
        exchange_params(buckets, rank, None, direct=direct)
        gathered = torch.cat([p.detach().reshape(-1) for p in params])
        everyone = [torch.empty_like(gathered) for _ in range(world_size)]
        torch.distributed.all_gather(everyone, gathered)
        out[f"spread_{direct}"] = max((e - gathered).abs().max().item() for e in everyone)
        out[f"sum_{direct}"] = gathered.sum().item()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_direct_and_broadcast_exchanges_leave_every_rank_with_the_owners_values(world_size: int) -> None:
    for res in run_distributed(_exchanges_agree, world_size):
        assert res["spread_True"] == 0.0 and res["spread_False"] == 0.0
        assert res["sum_True"] == res["sum_False"]


def _replaced_data(rank: int, world_size: int) -> float:
    ref_model, oss_model, ref_opt, oss_opt = ddp_pair("lm", "adamw")
    train_harness_model("lm", ref_model, ref_opt, rank, [0])
    train_harness_model("lm", oss_model, oss_opt, rank, [0])
    oss_model.module._apply(lambda t: t.clone())  # replaces every parameter's .data, as module.to(...) does
    train_harness_model("lm", ref_model, ref_opt, rank, [1, 2])
    train_harness_model("lm", oss_model, oss_opt, rank, [1, 2])
    return max_param_diff(ref_model, oss_model)


def test_replacing_parameter_data_after_construction_keeps_parity() -> None:
    assert all(diff <= 1e-6 for diff in run_distributed(_replaced_data, 2))


def _closure_steps(rank: int, world_size: int) -> float:
    """step(closure) runs forward and backward inside the step: no parameter may change under it."""
    ref_model, oss_model, ref_opt, oss_opt = ddp_pair("lm", "adamw")
    for step in range(3):
        for model, opt in ((ref_model, ref_opt), (oss_model, oss_opt)):
            x, y = rank_batch("lm", model, rank, step)

            def closure(
                model: nn.Module = model, opt: torch.optim.Optimizer = opt, x: torch.Tensor = x, y: torch.Tensor = y
            ) -> float:
                opt.zero_grad()
                loss = loss_for("lm", model(x), y)
                loss.backward()
                return float(loss)

            opt.step(closure)
    return max_param_diff(ref_model, oss_model)


def test_step_with_a_closure_matches_ddp() -> None:
    assert all(diff <= 1e-6 for diff in run_distributed(_closure_steps, 2))
