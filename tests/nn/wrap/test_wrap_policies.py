"""Size, class and tag policies, alone and driving auto_wrap over the reference models."""

import functools
from typing import Any

import pytest
from torch import nn

from shardkit.nn.wrap import (
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    transformer_auto_wrap_policy,
)
from shardkit.testing.models import Block, LMConfig, NestedWrappedModule, TransformerLM


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def test_size_policy_thresholds_force_leaf_and_exclude() -> None:
    linear, attn, mlist = nn.Linear(2, 2), nn.MultiheadAttention(4, 2), nn.ModuleList()
    assert default_auto_wrap_policy(linear, False, 100, min_num_params=100)
    assert not default_auto_wrap_policy(linear, False, 99, min_num_params=100)
    assert default_auto_wrap_policy(linear, True, 100, min_num_params=100)
    assert not default_auto_wrap_policy(attn, True, 10**9, min_num_params=1)  # never descend into attention
    assert default_auto_wrap_policy(attn, False, 10**9, min_num_params=1)
    assert not default_auto_wrap_policy(mlist, False, 10**9, min_num_params=1)  # containers are not wrapped
    assert default_auto_wrap_policy(mlist, True, 10**9, min_num_params=1)
    assert default_auto_wrap_policy(mlist, False, 10**9, min_num_params=1, exclude_wrap_modules=set())
    assert not default_auto_wrap_policy(linear, True, 10**9, min_num_params=1, force_leaf_modules={nn.Linear})
    assert not default_auto_wrap_policy(linear, False, int(1e8) - 1)  # default threshold is 100M


def test_size_policy_accepts_fairscale_keyword() -> None:
    assert default_auto_wrap_policy(module=nn.Linear(2, 2), recurse=False, unwrapped_params=5, min_num_params=5)
    with pytest.raises(TypeError, match="nonwrapped_numel"):
        default_auto_wrap_policy(nn.Linear(2, 2), False)


def test_size_policy_on_nested_wrapped_module() -> None:
    # Parameter counts: module.0=36, module.1 (a Sequential) = 80 + 272, module.2=68, module.4=40; total 496.
    model = NestedWrappedModule()
    with enable_wrap(wrapper_cls=Wrapper, tag="x"):
        model = auto_wrap(model, min_num_params=100)
    assert type(model) is NestedWrappedModule  # nothing left for the root: 496 - 496 wrapped
    outer = model.module
    assert isinstance(outer, Wrapper) and outer.kwargs == {"tag": "x"}
    inner_seq = outer.module[1]
    assert type(inner_seq) is nn.Sequential  # only 80 parameters remain once its 272-parameter Linear is wrapped
    assert isinstance(inner_seq[2], Wrapper)
    assert type(inner_seq[0]) is nn.Linear
    assert all(type(outer.module[i]) is nn.Linear for i in (0, 2, 4))


def test_class_policy_wraps_every_block_of_the_lm() -> None:
    model = TransformerLM(LMConfig(n_layers=3))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    with enable_wrap(wrapper_cls=Wrapper, auto_wrap_policy=policy):
        model = auto_wrap(model)
    assert type(model) is TransformerLM and type(model.blocks) is nn.ModuleList
    assert all(isinstance(b, Wrapper) and isinstance(b.module, Block) for b in model.blocks)
    assert sum(isinstance(m, Wrapper) for m in model.modules()) == 3
    assert model.head.weight is model.embed.weight  # tied weights untouched


def test_class_policy_needs_classes() -> None:
    with pytest.raises(ValueError, match="transformer_layer_cls"):
        transformer_auto_wrap_policy(nn.Linear(2, 2), False, 6)


def test_size_policy_on_lm_counts_tied_weights_once() -> None:
    cfg = LMConfig(n_layers=2)
    model = TransformerLM(cfg)
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    seen: list[int] = []

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if module is model and recurse:
            seen.append(nonwrapped_numel)
        if module is model and not recurse:
            seen.append(nonwrapped_numel)
        return default_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params=block_numel)

    with enable_wrap(wrapper_cls=Wrapper):
        auto_wrap(model, auto_wrap_policy=policy)
    total = sum(p.numel() for p in model.parameters())  # parameters() counts the tied weight once
    assert all(isinstance(b, Wrapper) for b in model.blocks)
    assert seen == [total, total - 2 * block_numel]


def test_config_policy_wraps_tagged_modules_with_their_settings() -> None:
    model = NestedWrappedModule()
    model.module[2].wrapper_config = {"reshard_after_forward": False}
    model.module[1][0].wrapper_config = {}
    with enable_wrap(wrapper_cls=Wrapper, auto_wrap_policy=config_auto_wrap_policy, reshard_after_forward=True):
        model = auto_wrap(model)
    assert isinstance(model.module[2], Wrapper) and model.module[2].kwargs == {"reshard_after_forward": False}
    assert isinstance(model.module[1][0], Wrapper) and model.module[1][0].kwargs == {"reshard_after_forward": True}
    assert sum(isinstance(m, Wrapper) for m in model.modules()) == 2
