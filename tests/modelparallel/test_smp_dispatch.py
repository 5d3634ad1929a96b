"""Unit modules are routed through their class, never by assigning ``forward`` on the user's instances."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardkit.modelparallel as smp
from testkit.smp import mse_step


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def test_units_keep_their_instances_untouched_and_get_their_class_back(single: None) -> None:
    net = _net()
    original = {name: type(m) for name, m in net.named_modules()}
    model = smp.DistributedModel(net)
    mse_step(model, torch.randn(4, 4), torch.randn(4, 1))
    assert model.placement is not None
    routed = [name for name, m in net.named_modules() if type(m) is not original[name]]
    assert routed, "the partition routed no module"
    for name, module in net.named_modules():
        assert "forward" not in vars(module), name
        assert isinstance(module, original[name])
        assert type(module).__name__ == original[name].__name__
    assert repr(net) == repr(_net())  # printing the model is unchanged
    smp.reset()
    assert all(type(m) is original[name] for name, m in net.named_modules())


def test_instance_level_forward_is_refused_before_anything_changes(single: None) -> None:
    net = _net()
    net.forward = net.forward  # what a library patching instances leaves behind (one stage: the root is the unit)
    model = smp.DistributedModel(net)
    with pytest.raises(ValueError, match="forward assigned on the instance"):
        mse_step(model, torch.randn(4, 4), torch.randn(4, 1))
    assert all(type(m).__module__.startswith("torch.nn") for m in net.modules())
    assert not model.partitioned and model.stage_execution is None
