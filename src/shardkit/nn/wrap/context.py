"""``enable_wrap`` / ``wrap`` / ``auto_wrap``: wrap sub-modules with one shared configuration.

The active configuration lives in a :class:`contextvars.ContextVar`, not in class attributes: contexts nest (the
inner one replaces the outer one until it exits), a thread or asyncio task started elsewhere never sees another
one's context, and an exception inside the ``with`` block still restores the previous state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Optional

from torch import nn

from shardkit.nn.wrap.policies import AutoWrapPolicy, default_auto_wrap_policy

WrapperFactory = Callable[..., nn.Module]


@dataclass(frozen=True)
class WrapConfig:
    """What :func:`enable_wrap` recorded: how :func:`wrap` and :func:`auto_wrap` build wrappers in its scope."""

    #: Called as ``wrapper_cls(module, **kwargs)``; usually :class:`~shardkit.nn.FullyShardedDataParallel`.
    wrapper_cls: WrapperFactory
    #: The policy :func:`auto_wrap` uses when it is given none (``None``: :func:`default_auto_wrap_policy`).
    auto_wrap_policy: Optional[AutoWrapPolicy]
    #: Keyword arguments passed to every wrapper built in the context (read-only).
    wrapper_kwargs: Mapping[str, Any]

    def is_wrapped(self, module: nn.Module) -> bool:
        """True when ``module`` already is a wrapper of this context's class (so it must not be wrapped again)."""
        return isinstance(self.wrapper_cls, type) and isinstance(module, self.wrapper_cls)


_ACTIVE_CONFIG: ContextVar[Optional[WrapConfig]] = ContextVar("shardkit_wrap_config", default=None)


def current_wrap_config() -> Optional[WrapConfig]:
    """The configuration of the innermost active :func:`enable_wrap` in this thread/task, or ``None``."""
    return _ACTIVE_CONFIG.get()


@contextlib.contextmanager
def enable_wrap(
    wrapper_cls: Optional[WrapperFactory] = None,
    auto_wrap_policy: Optional[AutoWrapPolicy] = None,
    **wrapper_kwargs: Any,
) -> Iterator[WrapConfig]:
    """Within this context :func:`wrap` and :func:`auto_wrap` wrap modules with ``wrapper_cls(module, **kwargs)``.

    ``wrapper_cls`` defaults to :class:`~shardkit.nn.FullyShardedDataParallel`; ``auto_wrap_policy`` is the policy
    :func:`auto_wrap` uses when it is given none. A nested ``enable_wrap`` replaces this configuration (it does not
    merge with it) until it exits. The context is local to the current thread or asyncio task.

    Example::

        group = DummyProcessGroup(rank=0, size=1)
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=group, mixed_precision=True):
            layer = wrap(torch.nn.Linear(5, 5))                    # a FullyShardedDataParallel
            tfmr = auto_wrap(torch.nn.Transformer(), min_num_params=10**6)
    """
    if wrapper_cls is None:
        from shardkit.nn.fsdp import FullyShardedDataParallel

        wrapper_cls = FullyShardedDataParallel
    if not callable(wrapper_cls):
        raise TypeError(f"enable_wrap(wrapper_cls=...) must be a class or callable, got {wrapper_cls!r}")
    if auto_wrap_policy is not None and not callable(auto_wrap_policy):
        raise TypeError(
            f"auto_wrap_policy must be callable as policy(module, recurse, nonwrapped_numel), got {auto_wrap_policy!r}"
        )
    config = WrapConfig(wrapper_cls, auto_wrap_policy, MappingProxyType(dict(wrapper_kwargs)))
    token = _ACTIVE_CONFIG.set(config)
    try:
        yield config
    finally:
        _ACTIVE_CONFIG.reset(token)


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the active :func:`enable_wrap` configuration; outside any context return it unchanged.

    The wrapper gets the context's keyword arguments, then the module's own ``wrapper_config`` dict if it has
    one, then ``wrap_overrides`` (later ones win). A module that already is an instance of the context's wrapper
    class is returned as is.

    Example::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, reshard_after_forward=True):
            head = wrap(nn.Linear(512, 10), reshard_after_forward=False)
        plain = wrap(nn.Linear(5, 5))  # no context: still an nn.Linear
    """
    config = _ACTIVE_CONFIG.get()
    if config is None:
        return module
    return _wrap_with(config, module, wrap_overrides)


def auto_wrap(module: nn.Module, auto_wrap_policy: Optional[AutoWrapPolicy] = None, **kwargs: Any) -> nn.Module:
    """Wrap the sub-modules of ``module`` that the policy selects, innermost first; a no-op outside a context.

    The policy is ``auto_wrap_policy`` if given, else the context's, else :func:`default_auto_wrap_policy`
    (100M parameters). ``min_num_params=N`` is a shortcut for the size policy with that threshold. Any other
    keyword is a wrapper override, as in :func:`wrap`. Children are replaced in place (``setattr`` on their
    parent) and the possibly wrapped ``module`` is returned. Modules that already are wrappers are kept as they
    are and their parameters count as wrapped; a sub-module reachable under several names is wrapped once.

    Example (the fairscale documentation example)::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=DummyProcessGroup(0, 1)):
            tfmr = auto_wrap(nn.Transformer(num_encoder_layers=2, num_decoder_layers=2), min_num_params=1e6)
        # every encoder/decoder layer and its linear1/linear2 are wrapped; self_attn and tfmr itself are not
    """
    config = _ACTIVE_CONFIG.get()
    if config is None:
        return module
    policy = _resolve_policy(config, auto_wrap_policy, kwargs.pop("min_num_params", None))
    memo: dict[int, nn.Module] = {}
    return _recursive_wrap(module, policy, config, kwargs, memo)


def _resolve_policy(
    config: WrapConfig, explicit: Optional[AutoWrapPolicy], min_num_params: Optional[float]
) -> AutoWrapPolicy:
    if min_num_params is not None:
        if explicit is not None:
            raise ValueError(
                "auto_wrap got both auto_wrap_policy and min_num_params; min_num_params is a shortcut for "
                "default_auto_wrap_policy, so pass one or the other"
            )
        return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)
    if explicit is not None:
        return explicit
    return config.auto_wrap_policy or default_auto_wrap_policy


def _wrap_with(config: WrapConfig, module: nn.Module, overrides: Mapping[str, Any]) -> nn.Module:
    if config.is_wrapped(module):
        return module
    per_module = getattr(module, "wrapper_config", None) or {}
    if not isinstance(per_module, Mapping):
        raise TypeError(
            f"{type(module).__name__}.wrapper_config must be a dict of wrapper arguments, got {per_module!r}"
        )
    return config.wrapper_cls(module, **{**config.wrapper_kwargs, **per_module, **overrides})


def _recursive_wrap(
    module: nn.Module,
    policy: AutoWrapPolicy,
    config: WrapConfig,
    overrides: Mapping[str, Any],
    memo: dict[int, nn.Module],
) -> nn.Module:
    """Bottom-up wrap: children first, then the module itself on what its children left unwrapped."""
    if id(module) in memo:
        return memo[id(module)]
    result = module
    if not config.is_wrapped(module) and policy(module, True, _nonwrapped_numel(module, config)):
        # Iterate _modules directly: named_children() hides a child registered under two names, and both names
        # must point at the same wrapped child.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            new_child = _recursive_wrap(child, policy, config, overrides, memo)
            if new_child is not child:
                setattr(module, name, new_child)
        if policy(module, False, _nonwrapped_numel(module, config)):
            result = _wrap_with(config, module, overrides)
    memo[id(module)] = result
    return result


def _nonwrapped_numel(module: nn.Module, config: WrapConfig) -> int:
    """Elements of the distinct parameters of ``module`` that no wrapper inside it owns (tied ones once)."""
    if config.is_wrapped(module):
        return 0
    seen: set[int] = set()
    total = 0
    stack = [module]
    visited: set[int] = set()
    while stack:
        current = stack.pop()
        if id(current) in visited:
            continue
        visited.add(id(current))
        for param in current._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
        stack.extend(c for c in current._modules.values() if c is not None and not config.is_wrapped(c))
    return total


__all__ = ["WrapConfig", "auto_wrap", "current_wrap_config", "enable_wrap", "wrap"]
