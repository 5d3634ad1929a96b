"""Tracing on the meta device with the inputs' values known (a delayed model's partition trace)."""

from __future__ import annotations

import pytest
import torch

from shardkit.modelparallel.partitioning.meta_values import VALUE, MetaValues, to_meta_with_values


def test_values_computed_from_inputs_stay_known_and_parameters_stay_meta() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    (meta_mask,) = to_meta_with_values((mask,))
    weight = torch.empty(3, 3, device="meta")
    with MetaValues():
        assert meta_mask.is_meta
        positions = torch.arange(3, device="meta")
        assert bool((meta_mask.sum(-1) >= 2).all())  # reads a value: known
        assert (meta_mask * positions).sum().item() == 4
        hidden = meta_mask.float() @ weight  # touches a parameter: meta, no value
        assert hidden.is_meta and not hasattr(hidden, VALUE)
        with pytest.raises(RuntimeError, match="meta"):
            hidden.sum().item()
        updated = meta_mask.float()
        updated.add_(weight[0])  # an in-place update from a parameter makes the target unknown
        assert not hasattr(updated, VALUE)
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]]  # the caller's tensor is untouched
