"""Bad input: a clear error that says what to do, raised before anything is changed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import run_distributed


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("make", [lambda m: torch.optim.SGD(m.parameters(), lr=0.1), lambda m: torch.optim.SGD])
def test_plain_optimizer_asks_to_wrap_it_in_oss(make) -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"needs sharded optimizers .*got SGD.*Wrap your optimizer.*OSS\("):
        ShardedDataParallel(model, make(model))


def test_a_plain_optimizer_in_a_list_is_rejected_too() -> None:
    model = _model()
    oss = OSS(model[0].parameters(), lr=0.1, group=DummyProcessGroup(0, 1))
    with pytest.raises(TypeError, match="Adam"):
        ShardedDataParallel(model, [oss, torch.optim.Adam(model[2].parameters())])


def test_optimizers_sharing_a_parameter_are_rejected() -> None:
    model = _model()
    group = DummyProcessGroup(0, 1)
    first = OSS(model.parameters(), lr=0.1, group=group)
    second = OSS(model[2].parameters(), lr=0.1, group=group)
    with pytest.raises(ValueError, match="held by sharded optimizer 1 and an earlier one"):
        ShardedDataParallel(model, [first, second])


def test_process_group_must_match_the_optimizers_group() -> None:
    model = _model()
    oss = OSS(model.parameters(), lr=0.1, group=DummyProcessGroup(0, 2))
    with pytest.raises(ValueError, match=r"process_group holds ranks \[0\] but the OSS optimizers shard over ranks"):
        ShardedDataParallel(model, oss, process_group=DummyProcessGroup(0, 1))


def test_no_hooks_are_left_behind_by_a_rejected_model() -> None:
    model = _model()
    oss = OSS(model.parameters(), lr=0.1, group=DummyProcessGroup(0, 2))
    with pytest.raises(ValueError):
        ShardedDataParallel(model, oss, process_group=DummyProcessGroup(0, 1))
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def _different_models(rank: int, world_size: int) -> dict[str, str]:
    """Rank 1 builds a wider last layer, then a model with an extra layer; every rank must raise, none hang.

    The OSS holds only the first layer, identical everywhere, so its own check passes and the wrapper's is tested.
    """
    messages = {}
    variants = {
        "shape": lambda r: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2 if r == 0 else 3)),
        "extra": lambda r: nn.Sequential(*([nn.Linear(4, 4)] * 1 + ([nn.Linear(4, 4)] if r == 1 else []))),
    }
    for name, build in variants.items():
        torch.manual_seed(rank)  # different values per rank: a broadcast would be visible
        model = build(rank)
        before = copy.deepcopy(model.state_dict())
        oss = OSS(model[0].parameters(), lr=0.1)
        try:
            ShardedDataParallel(model, oss)
        except ValueError as err:
            messages[name] = str(err)
        else:
            messages[name] = "no error"
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        messages[name + "-unchanged"] = str(unchanged)
    return messages


def test_ranks_with_different_models_fail_at_construction_on_every_rank() -> None:
    results = run_distributed(_different_models, 2, timeout_s=60)
    for messages in results:
        assert "rank 0 has parameter '2.weight' [2, 8]" in messages["shape"], messages["shape"]
        assert "where rank 1 has parameter '2.weight' [3, 8]" in messages["shape"]
        assert "Build the same model on every rank" in messages["shape"]
        assert "parameter '1.weight' [4, 4] torch.float32 exists only on rank 1" in messages["extra"], messages["extra"]
        assert messages["shape-unchanged"] == messages["extra-unchanged"] == "True"
