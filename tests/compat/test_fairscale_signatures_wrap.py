"""The wrap API takes fairscale 0.4.13's arguments: same names, same positions, same defaults.

fairscale is not imported: its signatures are written below as data, from fairscale 0.4.13's documentation of
``fairscale.nn.wrap``. ``NO_DEFAULT`` marks a parameter fairscale requires. Where shardkit gives such a
parameter a default (so torch's three-argument policy calls work too), ``RELAXED`` records it and why.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
from typing import Any, Callable

import pytest
from torch import nn

import shardkit.nn
from shardkit.nn.wrap import (
    ConfigAutoWrap,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    wrap,
)

NO_DEFAULT = object()

Expected = list[tuple[str, Any]]

ENABLE_WRAP: Expected = [("auto_wrap_policy", None), ("**wrapper_kwargs", None)]
WRAP: Expected = [("module", NO_DEFAULT), ("**wrap_overrides", None)]
AUTO_WRAP: Expected = [("module", NO_DEFAULT), ("auto_wrap_policy", None), ("**kwargs", None)]
DEFAULT_POLICY: Expected = [
    ("module", NO_DEFAULT),
    ("recurse", NO_DEFAULT),
    ("unwrapped_params", NO_DEFAULT),
    ("module_is_root", NO_DEFAULT),
    ("min_num_params", int(1e8)),
    ("force_leaf_modules", None),
    ("exclude_wrap_modules", None),
    ("skip_params_check_for_root", False),
]
CONFIG_POLICY: Expected = [
    ("module", NO_DEFAULT),
    ("recurse", NO_DEFAULT),
    ("unwrapped_params", NO_DEFAULT),
    ("module_is_root", NO_DEFAULT),
]
CONFIG_AUTO_WRAP_INIT: Expected = [("auto_wrap_policy", None), ("**kwargs", None)]

#: (function name, parameter) -> shardkit's default, for parameters fairscale requires.
RELAXED: dict[tuple[str, str], Any] = {
    # torch's policies get the count as nonwrapped_numel (a keyword-only alias here), so the fairscale name may
    # be absent from a call; a call with neither raises TypeError.
    ("default_auto_wrap_policy", "unwrapped_params"): None,
    ("config_auto_wrap_policy", "unwrapped_params"): None,
    # a three-argument call (torch's convention) means "not the root".
    ("default_auto_wrap_policy", "module_is_root"): False,
    ("config_auto_wrap_policy", "module_is_root"): False,
}

CASES: dict[str, tuple[Callable[..., Any], Expected]] = {
    "enable_wrap": (enable_wrap, ENABLE_WRAP),
    "wrap": (wrap, WRAP),
    "auto_wrap": (auto_wrap, AUTO_WRAP),
    "default_auto_wrap_policy": (default_auto_wrap_policy, DEFAULT_POLICY),
    "config_auto_wrap_policy": (config_auto_wrap_policy, CONFIG_POLICY),
    "ConfigAutoWrap": (ConfigAutoWrap, CONFIG_AUTO_WRAP_INIT),
}


def _compare(name: str, fn: Callable[..., Any], expected: Expected) -> list[str]:
    """Differences between our signature and fairscale's (empty when ours accepts every fairscale call)."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    kinds = {p.kind for p in params}
    problems = []
    named = [(n, d) for n, d in expected if not n.startswith("*")]
    for index, (pname, default) in enumerate(named):
        if index >= len(positional) or positional[index].name != pname:
            got = positional[index].name if index < len(positional) else "nothing"
            problems.append(f"position {index}: fairscale has '{pname}', ours {got}")
            continue
        ours = positional[index].default
        wanted = RELAXED.get((name, pname), inspect.Parameter.empty if default is NO_DEFAULT else default)
        if ours != wanted and not (ours is inspect.Parameter.empty and wanted is inspect.Parameter.empty):
            problems.append(f"'{pname}' defaults to {ours!r}, expected {wanted!r}")
    for pname, _ in expected:
        if pname.startswith("**") and inspect.Parameter.VAR_KEYWORD not in kinds:
            problems.append(f"fairscale takes {pname}, ours has no **kwargs")
    for extra in positional[len(named) :]:
        if extra.default is inspect.Parameter.empty:
            problems.append(f"our extra positional parameter '{extra.name}' has no default")
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is inspect.Parameter.empty:
            problems.append(f"our keyword-only parameter '{p.name}' has no default")
    return problems


@pytest.mark.parametrize("name", sorted(CASES))
def test_signature_accepts_every_fairscale_call(name: str) -> None:
    fn, expected = CASES[name]
    assert _compare(name, fn, expected) == []


def test_the_checker_notices_a_wrong_signature() -> None:
    def shardkit_before(wrapper_cls: Any = None, auto_wrap_policy: Any = None, **wrapper_kwargs: Any) -> None:
        pass

    assert _compare("enable_wrap", shardkit_before, ENABLE_WRAP) == [
        "position 0: fairscale has 'auto_wrap_policy', ours wrapper_cls"
    ]


def test_enable_wrap_takes_wrapper_cls_by_keyword_only() -> None:
    param = inspect.signature(enable_wrap).parameters["wrapper_cls"]
    assert param.kind is param.KEYWORD_ONLY and param.default is None  # None: FullyShardedDataParallel


def test_policies_answer_fairscale_positional_calls() -> None:
    seq = nn.Sequential(nn.Linear(2, 2))
    assert default_auto_wrap_policy(seq, True, 100, False, 60)
    assert not default_auto_wrap_policy(seq, False, 10, True, 60)
    assert default_auto_wrap_policy(seq, False, 10, True, 60, None, None, True)
    assert not default_auto_wrap_policy(nn.MultiheadAttention(4, 1), True, 100, False, 60)
    assert not default_auto_wrap_policy(seq, True, 100, False, 60, {nn.Sequential})
    assert not default_auto_wrap_policy(seq, False, 100, False, 60, None, {nn.Sequential})
    assert config_auto_wrap_policy(seq, True, 0, True)
    assert not config_auto_wrap_policy(seq, False, 0, True)
    bound = functools.partial(default_auto_wrap_policy, min_num_params=60, skip_params_check_for_root=True)
    assert bound(module=seq, recurse=False, unwrapped_params=0, module_is_root=True)  # fairscale calls by keyword


def test_default_sets_are_attributes_of_the_default_policy() -> None:
    force_leaf = default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    exclude = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    assert force_leaf == {nn.MultiheadAttention}
    assert exclude == {nn.ModuleList, nn.ModuleDict}
    assert nn.Linear in force_leaf.union({nn.Linear})


def test_fairscale_import_paths() -> None:
    wrap_package = importlib.import_module("shardkit.nn.wrap")  # ``shardkit.nn.wrap`` the attribute is the function
    for name in ("auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap"):
        assert callable(getattr(shardkit.nn, name)), f"shardkit.nn.{name}"
        assert callable(getattr(wrap_package, name)), f"shardkit.nn.wrap.{name}"
    for attr in ("in_autowrap_context", "wrapper_cls", "kwargs", "auto_wrap_policy", "move_module_cuda_half"):
        assert hasattr(ConfigAutoWrap, attr), f"ConfigAutoWrap.{attr}"


def test_wrap_in_shardkit_nn_is_the_function_as_in_fairscale() -> None:
    """fairscale.nn binds ``wrap`` to the function, shadowing the submodule; shardkit.nn does the same, and the
    package stays an ordinary module (nothing replaces a module's class)."""
    wrap_package = importlib.import_module("shardkit.nn.wrap")
    assert shardkit.nn.wrap is wrap is wrap_package.wrap
    assert type(wrap_package) is types.ModuleType
    assert isinstance(wrap(nn.Linear(2, 2)), nn.Linear)  # outside enable_wrap: the module itself
