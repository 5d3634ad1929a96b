"""The :func:`~shardkit.nn.wrap.auto_wrap` walk: bottom-up over the module tree, all or nothing.

Children are wrapped before their parent, so a parent's policy question sees only the parameters its wrapped
children left. A module that would split a tie (see :mod:`shardkit.nn.wrap.tie_safety`) is never wrapped on its
own. If building any wrapper fails, every module touched by the walk gets its children and parameters back and the
error is re-raised: a failed ``auto_wrap`` leaves the model as it found it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from shardkit.nn.wrap.policy_call import PolicyCaller
from shardkit.nn.wrap.tie_safety import blocked_modules

WrapOne = Callable[[nn.Module], nn.Module]


@dataclass
class _Walk:
    policy: PolicyCaller
    is_wrapped: Callable[[nn.Module], bool]
    wrap_one: WrapOne
    blocked: Mapping[int, str]
    memo: dict[int, nn.Module] = field(default_factory=dict)
    #: Why modules the policy selected were left unwrapped (ties).
    kept_whole: list[str] = field(default_factory=list)


def wrap_tree(
    root: nn.Module, policy: PolicyCaller, is_wrapped: Callable[[nn.Module], bool], wrap_one: WrapOne
) -> nn.Module:
    """Wrap what ``policy`` selects under ``root`` (``root`` included) with ``wrap_one``; return the new root.

    A sub-module reachable under several names is wrapped once and every name points at the wrapper.
    """
    walk = _Walk(policy, is_wrapped, wrap_one, blocked_modules(root, is_wrapped))
    saved = _snapshot(root, is_wrapped)
    try:
        result = _visit(walk, root, is_root=True)
    except BaseException:
        _restore(saved)
        raise
    if walk.kept_whole:
        warnings.warn(
            "auto_wrap left these modules inside their parent's unit although the policy selected them, because "
            "wrapping them alone would split a tied parameter or a shared sub-module across units: "
            + "; ".join(walk.kept_whole),
            stacklevel=3,
        )
    return result


def _visit(walk: _Walk, module: nn.Module, is_root: bool) -> nn.Module:
    if id(module) in walk.memo:
        return walk.memo[id(module)]
    result = module
    if not walk.is_wrapped(module) and walk.policy(module, True, nonwrapped_numel(module, walk.is_wrapped), is_root):
        # Iterate _modules directly: named_children() hides a child registered under two names, and both names
        # must point at the same wrapped child.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            new_child = _visit(walk, child, is_root=False)
            if new_child is not child:
                setattr(module, name, new_child)
        if walk.policy(module, False, nonwrapped_numel(module, walk.is_wrapped), is_root):
            if id(module) in walk.blocked:
                walk.kept_whole.append(walk.blocked[id(module)])
            else:
                result = walk.wrap_one(module)
    walk.memo[id(module)] = result
    return result


def nonwrapped_numel(module: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> int:
    """Elements of the distinct parameters of ``module`` that no wrapper inside it owns (tied ones once)."""
    if is_wrapped(module):
        return 0
    seen: set[int] = set()
    total = 0
    for current in _unwrapped_modules(module, is_wrapped):
        for param in current._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
    return total


def _unwrapped_modules(root: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> Iterator[nn.Module]:
    """Each distinct module under ``root`` once, not descending into wrappers."""
    visited: set[int] = set()
    stack = [root]
    while stack:
        current = stack.pop()
        if id(current) in visited:
            continue
        visited.add(id(current))
        yield current
        stack.extend(c for c in current._modules.values() if c is not None and not is_wrapped(c))


Snapshot = list[tuple[nn.Module, dict[str, Any], dict[str, Any]]]


def _snapshot(root: nn.Module, is_wrapped: Callable[[nn.Module], bool]) -> Snapshot:
    """Each module's children and parameters as they are now (a wrapper moves both)."""
    return [(m, dict(m._modules), dict(m._parameters)) for m in _unwrapped_modules(root, is_wrapped)]


def _restore(saved: Snapshot) -> None:
    for module, children, params in saved:
        module._modules.clear()
        module._modules.update(children)
        module._parameters.clear()
        module._parameters.update(params)


__all__ = ["nonwrapped_numel", "wrap_tree"]
