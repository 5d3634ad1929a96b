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


def test_keys_carry_the_wrapper_level_as_fairscale_and_torch_ddp() -> None:
    model = NestedWrappedModule()  # its own child is called "module": the ambiguous case
    expected = model.state_dict()
    got = _wrap(model).state_dict()
    assert list(got) == [f"module.{k}" for k in expected]
    assert all(torch.equal(got[f"module.{k}"], expected[k]) for k in expected)
    # The same keys as torch DDP's, so a shardkit checkpoint loads strictly into a DDP-wrapped model.
    ddp_like = nn.Module()
    ddp_like.module = NestedWrappedModule()
    assert list(ddp_like.state_dict()) == list(got)
    ddp_like.load_state_dict(got, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(ddp_like.state_dict().values(), got.values()))


def test_round_trip_between_wrapped_and_plain_models() -> None:
    torch.manual_seed(1)
    source = BatchNormNet()
    source(torch.randn(4, 8))  # non-trivial running statistics
    target = _wrap(BatchNormNet())
    target.load_state_dict(source.state_dict())  # the plain model's keys load too
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.module.state_dict().values()))
    plain = BatchNormNet()
    plain.load_state_dict(target.module.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), plain.state_dict().values()))


@pytest.mark.parametrize("model_cls", [NestedWrappedModule, BatchNormNet])
def test_both_key_forms_load_strictly(model_cls: type) -> None:
    source = model_cls()
    plain_keys = {k: v.clone() + 1 for k, v in source.state_dict().items()}
    ddp_keys = {f"module.{k}": v for k, v in plain_keys.items()}
    for form in (plain_keys, ddp_keys):
        wrapped = _wrap(model_cls())
        result = wrapped.load_state_dict(form, strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        assert all(torch.equal(v, w) for v, w in zip(plain_keys.values(), wrapped.module.state_dict().values()))


def test_nested_inside_another_module_saves_and_loads_consistently() -> None:
    outer = nn.Sequential(nn.Linear(8, 8), _wrap(BatchNormNet()))
    saved = copy.deepcopy(outer.state_dict())
    assert "1.module.fc1.weight" in saved and "1.fc1.weight" not in saved
    with torch.no_grad():
        for p in outer.parameters():
            p.add_(1)
    outer.load_state_dict(saved)
    assert all(torch.equal(saved[k], v) for k, v in outer.state_dict().items())
    # The plain model's keys under the parent's prefix load too.
    plain_form = {k.replace("1.module.", "1."): v for k, v in saved.items()}
    outer.load_state_dict(plain_form, strict=True)


def test_strict_errors_name_the_missing_key() -> None:
    wrapped = _wrap(BatchNormNet())
    state = wrapped.state_dict()
    del state["module.fc2.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "module.fc2.bias"'):
        wrapped.load_state_dict(state)


def test_keys_of_another_model_are_refused_naming_both_forms() -> None:
    wrapped = _wrap(BatchNormNet())
    with pytest.raises(RuntimeError, match=r"'module.<name>'.*'<name>'"):
        wrapped.load_state_dict({"encoder.weight": torch.zeros(1)})


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
