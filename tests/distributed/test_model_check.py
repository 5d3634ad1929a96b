"""The value checksums FSDP compares at wrap time: equal values give equal sums, a changed element changes them,
whatever the dtype, size, alignment or layout (no processes)."""

from __future__ import annotations

import pytest
import torch

from shardkit.distributed.model_check import value_checksums

TENSORS = {
    "float32 matrix": torch.randn(16, 8),
    "float32, odd size": torch.randn(7),
    "bfloat16, odd size": torch.randn(5).bfloat16(),
    "float64": torch.randn(3).double(),
    "misaligned view": torch.randn(11)[1:7],
    "transposed": torch.randn(4, 6).t(),
    "int64 buffer": torch.tensor([3, 4]),
    "bool buffer": torch.tensor([True, False, True]),
    "complex": torch.randn(4, dtype=torch.complex64),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_equal_values_agree_and_a_changed_element_does_not(name: str) -> None:
    tensor = TENSORS[name]
    copy = tensor.clone()
    assert value_checksums([tensor]) == value_checksums([copy])
    changed = tensor.clone()
    flat = changed.view(-1) if changed.is_contiguous() else changed.t().reshape(-1)
    if changed.dtype == torch.bool:
        changed[0] = not bool(changed[0])
    elif changed.is_contiguous():
        flat[-1] += 1
    else:
        changed[0, 0] += 1
    assert value_checksums([changed]) != value_checksums([tensor])


def test_meta_and_empty_tensors_sum_to_zero_and_keep_their_places() -> None:
    tensors = [torch.empty(3, device="meta"), torch.ones(4), torch.empty(0)]
    sums = value_checksums(tensors)
    assert sums[0] == 0 and sums[2] == 0 and sums[1] != 0
