"""State dicts use the wrapped model's own keys; single process with a one-rank DummyProcessGroup."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardkit.distributed import DummyProcessGroup
from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing.models import BatchNormNet, NestedWrappedModule


def _wrap(model: nn.Module) -> ShardedDataParallel:
    group = DummyProcessGroup(0, 1)
    return ShardedDataParallel(model, OSS(model.parameters(), lr=0.1, group=group))


def test_keys_are_the_wrapped_models_keys() -> None:
    model = NestedWrappedModule()  # its own child is called "module": the ambiguous case
    expected = model.state_dict()
    got = _wrap(model).state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert got._metadata[""] == expected._metadata[""]  # type: ignore[attr-defined]
    assert set(got._metadata) == set(expected._metadata)  # type: ignore[attr-defined]


def test_round_trip_between_wrapped_and_plain_models() -> None:
    torch.manual_seed(1)
    source = BatchNormNet()
    source(torch.randn(4, 8))  # non-trivial running statistics
    target = _wrap(BatchNormNet())
    target.load_state_dict(source.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.module.state_dict().values()))
    plain = BatchNormNet()
    plain.load_state_dict(target.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), plain.state_dict().values()))


def test_torch_ddp_checkpoints_with_module_prefix_load() -> None:
    source = NestedWrappedModule()
    ddp_style = {f"module.{k}": v.clone() + 1 for k, v in source.state_dict().items()}
    wrapped = _wrap(NestedWrappedModule())
    wrapped.load_state_dict(ddp_style)
    assert all(torch.equal(v + 1, w) for v, w in zip(source.state_dict().values(), wrapped.state_dict().values()))


def test_nested_inside_another_module_saves_and_loads_consistently() -> None:
    outer = nn.Sequential(nn.Linear(8, 8), _wrap(BatchNormNet()))
    saved = copy.deepcopy(outer.state_dict())
    assert "1.fc1.weight" in saved and not any(".module." in k for k in saved)
    with torch.no_grad():
        for p in outer.parameters():
            p.add_(1)
    outer.load_state_dict(saved)
    assert all(torch.equal(saved[k], v) for k, v in outer.state_dict().items())


def test_strict_errors_name_the_callers_keys() -> None:
    wrapped = _wrap(BatchNormNet())
    state = wrapped.state_dict()
    del state["fc2.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "fc2.bias"'):
        wrapped.load_state_dict(state)


def test_single_rank_dummy_group_trains_like_the_plain_model() -> None:
    torch.manual_seed(0)
    plain = NestedWrappedModule()
    model = copy.deepcopy(plain)
    group = DummyProcessGroup(0, 1)
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9, group=group)
    wrapped = ShardedDataParallel(model, oss)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for net, opt in ((plain, reference), (wrapped, oss)):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


def test_zero_grad_zeroes_by_default_as_fairscale_or_drops() -> None:
    wrapped = _wrap(NestedWrappedModule())
    wrapped(torch.randn(2, 8)).sum().backward()
    wrapped.zero_grad()  # fairscale's default: set_to_none=False
    assert all(p.grad is not None and not p.grad.any() for p in wrapped.parameters())
    wrapped.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in wrapped.parameters())
