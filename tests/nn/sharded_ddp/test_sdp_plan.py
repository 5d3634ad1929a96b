"""Planning the reduce units: pure functions, no processes."""

from __future__ import annotations

import pytest
import torch

from shardkit.nn.sharded_ddp.plan import plan_reduction
from shardkit.nn.sharded_ddp.policy import ReducePolicy


def _params(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype, requires_grad=True) for n in numels]


def test_small_gradients_share_a_bucket_per_owner() -> None:
    params = _params(10, 10, 10, 10)
    owner_of = {params[0]: 0, params[1]: 1, params[2]: 0, params[3]: 1}
    units = plan_reduction(params, owner_of, ReducePolicy(bucket_bytes=1000))
    assert [(u.owner, len(u.params)) for u in units] == [(0, 2), (1, 2)]
    assert units[0].params == (params[0], params[2])
    assert units[0].offsets == (0, 10) and units[0].numel == 20 and units[0].packed


def test_buckets_respect_the_byte_cap_and_large_gradients_travel_alone() -> None:
    params = _params(*([30] * 10), 33)  # 120-byte gradients; small means <= 1024 / 8 = 128 bytes
    units = plan_reduction(params, dict.fromkeys(params, 0), ReducePolicy(bucket_bytes=1024))
    assert [[p.numel() for p in u.params] for u in units] == [[30] * 8, [30] * 2, [33]]
    assert all(u.nbytes <= 1024 for u in units)
    assert units[0].packed and not units[2].packed  # the large one is reduced in the gradient tensor itself


def test_unit_sits_at_its_last_member_so_earlier_ready_gradients_are_not_delayed() -> None:
    small_a, big, small_b = _params(4, 1000, 4)
    owner_of = {small_a: 0, big: 1, small_b: 0}
    units = plan_reduction([small_a, big, small_b], owner_of, ReducePolicy(bucket_bytes=256))
    assert [u.params for u in units] == [(big,), (small_a, small_b)]


def test_zero_bucket_size_reduces_every_gradient_alone_in_order() -> None:
    params = _params(3, 5, 7)
    units = plan_reduction(params, dict.fromkeys(params, 0), ReducePolicy(bucket_bytes=0))
    assert [u.params[0] for u in units] == params
    assert not any(u.packed for u in units)


def test_fp16_reduction_packs_fp32_gradients_as_fp16_only() -> None:
    fp32 = _params(8)
    half = _params(8, dtype=torch.float16)
    policy = ReducePolicy(bucket_bytes=0, reduce_fp16=True)
    units = plan_reduction(fp32 + half, dict.fromkeys(fp32 + half, 0), policy)
    assert [u.wire_dtype for u in units] == [torch.float16, torch.float16]
    assert units[0].packed and not units[1].packed  # the fp32 one needs a conversion buffer
    assert units[0].nbytes == 16


def test_different_dtypes_never_share_a_bucket() -> None:
    params = _params(4) + _params(4, dtype=torch.float64)
    units = plan_reduction(params, dict.fromkeys(params, 0), ReducePolicy(bucket_bytes=1024))
    assert [(u.wire_dtype, len(u.params)) for u in units] == [(torch.float32, 1), (torch.float64, 1)]


def test_negative_bucket_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="reduce_buffer_size"):
        ReducePolicy(bucket_bytes=-1)
