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
    size_based_auto_wrap_policy,
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


def test_size_policy_takes_fairscale_positional_order_and_root_flag() -> None:
    seq = nn.Sequential(nn.Linear(2, 2))
    # fairscale order: (module, recurse, unwrapped_params, module_is_root, min_num_params, ...)
    assert not default_auto_wrap_policy(seq, False, 10, True, 60)
    assert default_auto_wrap_policy(seq, False, 10, True, 60, None, None, True)  # skip_params_check_for_root
    assert not default_auto_wrap_policy(seq, False, 10, False, 60, None, None, True)  # only for the root
    assert not default_auto_wrap_policy(nn.ModuleList(), False, 10, True, 60, None, None, True)  # still excluded
    assert default_auto_wrap_policy(seq, False, nonwrapped_numel=60, min_num_params=60)  # torch's keyword


def test_size_policy_exposes_its_default_sets_for_extension() -> None:
    force_leaf = default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    exclude = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    assert force_leaf == {nn.MultiheadAttention} and exclude == {nn.ModuleList, nn.ModuleDict}
    extended = force_leaf.union({nn.Linear})
    assert not default_auto_wrap_policy(nn.Linear(2, 2), True, 100, False, 1, force_leaf_modules=extended)
    assert default_auto_wrap_policy(nn.Linear(2, 2), True, 100, False, 1)


def test_torch_size_policy_keeps_torch_positional_order() -> None:
    # torch: (module, recurse, nonwrapped_numel, min_num_params, ...): the fourth argument is the threshold.
    assert size_based_auto_wrap_policy(nn.Linear(2, 2), False, 50, 50)
    assert not size_based_auto_wrap_policy(nn.Linear(2, 2), False, 49, 50)


def _fairscale_style_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
    # wraps only the root, whatever its size: needs module_is_root, which a 3-argument call cannot give
    return recurse or module_is_root


def test_auto_wrap_calls_policies_of_either_signature() -> None:
    calls: list[tuple[str, bool, int, Any]] = []

    def fairscale_kw(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
        calls.append(("fs", recurse, unwrapped_params, module_is_root))
        return recurse

    def torch_style(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        calls.append(("torch", recurse, nonwrapped_numel, None))
        return recurse

    def kwargs_only(module: nn.Module, recurse: bool, **kwargs: Any) -> bool:
        calls.append(("kw", recurse, kwargs["unwrapped_params"], kwargs["module_is_root"]))
        assert kwargs["nonwrapped_numel"] == kwargs["unwrapped_params"]
        return recurse

    def positional4(m: nn.Module, r: bool, n: int, root: bool) -> bool:  # fairscale's order, other names
        calls.append(("pos4", r, n, root))
        return r

    model = nn.Sequential(nn.Linear(2, 2))
    with enable_wrap(wrapper_cls=Wrapper):
        for policy in (fairscale_kw, torch_style, kwargs_only, positional4):
            auto_wrap(model, auto_wrap_policy=policy)
        root_only = auto_wrap(nn.Sequential(nn.Linear(2, 2)), auto_wrap_policy=_fairscale_style_policy)
    # each policy: recurse into the root (6 params), into the Linear, then the Linear's and the root's wrap question
    for kind in ("fs", "kw", "pos4"):
        assert [c[1:] for c in calls if c[0] == kind] == [
            (True, 6, True),
            (True, 6, False),
            (False, 6, False),
            (False, 6, True),
        ]
    assert [c[1:3] for c in calls if c[0] == "torch"] == [(True, 6), (True, 6), (False, 6), (False, 6)]
    assert isinstance(root_only, Wrapper) and type(root_only.module[0]) is nn.Linear


def test_auto_wrap_rejects_a_policy_it_cannot_call_before_wrapping() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with enable_wrap(wrapper_cls=Wrapper), pytest.raises(TypeError, match="module_is_root"):
        auto_wrap(model, auto_wrap_policy=lambda module: True)
    assert type(model[0]) is nn.Linear
    with pytest.raises(TypeError, match="auto_wrap_policy"), enable_wrap(lambda m, r: True, wrapper_cls=Wrapper):
        pass


def test_fairscale_docstring_cases_with_root_check() -> None:
    # fairscale's documented behaviour: 60-parameter threshold over Linear(5,5) + Sequential(Linear, Linear)
    policy = functools.partial(default_auto_wrap_policy, min_num_params=60)
    skip_root = functools.partial(default_auto_wrap_policy, min_num_params=60, skip_params_check_for_root=True)
    with enable_wrap(wrapper_cls=Wrapper):
        plain = auto_wrap(nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))), policy)
        rooted = auto_wrap(nn.Sequential(nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5))), skip_root)
    assert type(plain) is nn.Sequential and type(plain[0]) is nn.Linear and isinstance(plain[1], Wrapper)
    assert isinstance(rooted, Wrapper) and isinstance(rooted.module[1], Wrapper)
