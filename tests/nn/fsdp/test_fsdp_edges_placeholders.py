"""Between steps the original parameter attributes are placeholders: printing and metadata work, values do not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn.fsdp import FullyShardedDataParallel as FSDP
from shardkit.testing import run_distributed

ONE = DummyProcessGroup(rank=0, size=1)


def _model(group: object = ONE, **kwargs: object) -> tuple[nn.Module, FSDP]:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    wrapped = copy.deepcopy(plain)
    wrapped[0] = FSDP(wrapped[0], process_group=group, **kwargs)
    return plain, FSDP(wrapped, process_group=group, **kwargs)


def _train(model: nn.Module, steps: int = 2) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        torch.manual_seed(100 + i)
        loss = model(torch.randn(5, 4)).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def test_print_and_metadata_work_before_and_between_steps() -> None:
    _, model = _model()
    for _ in range(2):  # before the first forward, then after a step
        text = repr(model)
        assert "Linear(in_features=4, out_features=6, bias=True)" in text
        assert "Linear(in_features=6, out_features=3, bias=True)" in text
        head = model.module[2]
        assert head.weight.shape == (3, 6) and head.bias.shape == (3,)
        assert head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
        assert head.weight.requires_grad
        assert model.module[0].module.weight.shape == (6, 4)
        assert [n for n, _ in model.module.named_modules()] == ["", "0", "0.module", "1", "2"]
        _train(model, steps=1)


def test_values_of_a_placeholder_raise_a_clear_error() -> None:
    _, model = _model()
    _train(model, steps=1)
    weight = model.module[2].weight
    for use in (lambda: weight + 1, lambda: weight.sum(), lambda: weight.clone(), lambda: weight[0]):
        with pytest.raises(RuntimeError, match=r"'2\.weight'.*summon_full_params"):
            use()
    with pytest.raises(RuntimeError, match="summon_full_params"):
        torch.nn.functional.linear(torch.randn(2, 6), weight)
    assert "summon_full_params" in repr(weight)  # repr tells, never shows stale values


def test_placeholders_hold_no_memory_and_are_reused() -> None:
    _, model = _model()
    first = model.module[2].weight
    _train(model, steps=2)
    assert model.module[2].weight is first  # one object per parameter, nothing allocated per step
    assert first.data_ptr() == 0  # no storage behind it
    assert model.unsharded_bytes() == 0


def test_training_summon_and_state_dict_are_unchanged() -> None:
    plain, model = _model()
    assert _train(model) == pytest.approx(_train(plain), rel=1e-6)
    with model.summon_full_params():
        head = model.module[2]
        assert isinstance(head.weight, nn.Parameter)
        torch.testing.assert_close(head.weight, plain[2].weight)
        with torch.no_grad():
            head.weight.mul_(0.5)  # written back on exit
    assert not isinstance(model.module[2].weight, nn.Parameter)
    state = model.state_dict()
    torch.testing.assert_close(state["2.weight"], plain[2].weight.detach() * 0.5)
    assert [n for n, _ in model.named_parameters()] == ["flat_param_0", "0.flat_param_0"]


def test_tied_frozen_and_mixed_precision_placeholders() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model = FSDP(nn.ModuleDict({"embed": embed, "frozen": frozen, "head": head}), process_group=ONE)
    assert model.module["head"].weight is model.module["embed"].weight
    assert not model.module["frozen"].weight.requires_grad
    half = FSDP(nn.Linear(4, 4), process_group=ONE, mixed_precision=True, compute_dtype=torch.bfloat16)
    assert half.module.weight.dtype == torch.float32  # the FP32 master parameters' dtype, as state_dict gives


def test_deepcopy_of_a_wrapped_model_keeps_placeholders() -> None:
    _, model = _model()
    clone = copy.deepcopy(model)
    assert clone.module[2].weight.shape == (3, 6)
    assert clone.module[2].weight is not model.module[2].weight


def _world_two(rank: int, world_size: int) -> tuple[str, tuple[int, ...], list[float]]:
    _, model = _model(group=None)
    losses = _train(model)
    return repr(model), tuple(model.module[2].weight.shape), losses


def test_world_two_prints_full_shapes() -> None:
    for text, shape, losses in run_distributed(_world_two, 2, timeout_s=60):
        assert "Linear(in_features=6, out_features=3, bias=True)" in text and "world_size=2" in text
        assert shape == (3, 6)  # the full parameter's shape, not the shard's
        assert len(losses) == 2
