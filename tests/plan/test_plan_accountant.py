"""The byte accountant on meta tensors: categories, frees, resizes and the peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.plan.accountant import Accountant, Category


def test_counts_meta_storages_by_role_and_forgets_freed_ones() -> None:
    with Accountant() as acct:
        with torch.device("meta"):
            model = nn.Linear(1000, 1000)
        acct.label(model.parameters(), Category.PARAMETERS)
        params = 4 * (1000 * 1000 + 1000)
        assert acct.device.total(Category.PARAMETERS) == params
        acct.phase = "forward"
        out = model(torch.empty(64, 1000, device="meta"))
        assert acct.device.total(Category.ACTIVATIONS) >= 64 * 1000 * 4  # the output, made inside Linear's forward
        acct.phase = "backward"
        out.sum().backward()
        del out
        acct.label((p.grad for p in model.parameters()), Category.GRADIENTS)
        assert acct.device.total(Category.GRADIENTS) == params
        assert acct.device.total(Category.ACTIVATIONS) == 0
        assert acct.peak.total >= 2 * params
        assert acct.state_bytes() == 2 * params


def test_follows_storage_resizes_and_reads_meta_values_as_known_or_ones() -> None:
    with Accountant() as acct:
        flat = torch.empty(1000, device="meta")
        assert acct.current == 4000
        flat.untyped_storage().resize_(0)
        assert acct.current == 0
        shapes = torch.tensor([3, 5]).to("meta")  # data that reached a meta tensor is remembered
        assert shapes.tolist() == [3, 5]
        assert torch.empty(2, device="meta").sum().item() == 1.0  # anything computed on meta reads as one


def test_resize_watch_is_undone_and_an_exclusive_one_refuses_a_second() -> None:
    from shardkit.memory.resize_watch import watch_resizes

    original = torch.UntypedStorage.resize_
    seen: list[int] = []
    undo = watch_resizes(lambda storage: seen.append(storage.nbytes()), mark="_test_mark")
    try:
        torch.empty(4).untyped_storage().resize_(8)
        with pytest.raises(RuntimeError, match="busy: one at a time"):
            watch_resizes(lambda storage: None, mark="_test_mark", busy="busy: one at a time")
    finally:
        undo()
    assert seen == [8] and torch.UntypedStorage.resize_ is original
