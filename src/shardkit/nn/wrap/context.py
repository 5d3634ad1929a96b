"""``enable_wrap`` / ``wrap`` / ``auto_wrap``: wrap sub-modules with one shared configuration.

The active configuration lives in a :class:`contextvars.ContextVar`, not in class attributes: contexts nest (the
inner one replaces the outer one until it exits), a thread or asyncio task started elsewhere never sees another
one's context, and an exception inside the ``with`` block still restores the previous state. None of these
functions needs a process group; only the wrapper they build may (pass it ``process_group=``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Optional

import torch
from torch import nn

from shardkit.distributed.device import current_cuda_device
from shardkit.nn.wrap.policies import AutoWrapPolicy, default_auto_wrap_policy
from shardkit.nn.wrap.policy_call import policy_caller
from shardkit.nn.wrap.walk import wrap_tree

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
    #: fairscale's flag: move each module to the current CUDA device in float16 before wrapping it.
    move_module_cuda_half: bool = False

    def __post_init__(self) -> None:
        if not callable(self.wrapper_cls):
            raise TypeError(f"enable_wrap(wrapper_cls=...) must be a class or callable, got {self.wrapper_cls!r}")
        if self.auto_wrap_policy is not None:
            policy_caller(self.auto_wrap_policy)  # raises TypeError now if auto_wrap could not call it later
        if self.move_module_cuda_half and not torch.cuda.is_available():
            raise ValueError(
                "enable_wrap(move_module_cuda_half=True) moves every wrapped module to CUDA in float16, but CUDA is "
                "not available; drop the flag (and convert the model yourself, e.g. model.half(), if you meant to)"
            )

    def is_wrapped(self, module: nn.Module) -> bool:
        """True when ``module`` already is a wrapper of this context's class (so it must not be wrapped again)."""
        return isinstance(self.wrapper_cls, type) and isinstance(module, self.wrapper_cls)


_ACTIVE_CONFIG: ContextVar[Optional[WrapConfig]] = ContextVar("shardkit_wrap_config", default=None)

#: The wrapper :func:`enable_wrap` uses when it is given none. FSDP is built on this package, so instead of this
#: package importing FSDP, ``shardkit.nn.fsdp`` registers its class here when it is imported; importing
#: ``shardkit.nn.wrap`` always imports ``shardkit.nn`` first, which imports ``shardkit.nn.fsdp``. Set once at
#: import time and never changed by a wrap context (that state lives in ``_ACTIVE_CONFIG``).
_DEFAULT_WRAPPER: dict[str, WrapperFactory] = {}


def register_default_wrapper(wrapper_cls: WrapperFactory) -> None:
    """Make ``wrapper_cls`` the wrapper :func:`enable_wrap` uses when given none (``shardkit.nn.fsdp`` calls this)."""
    _DEFAULT_WRAPPER["cls"] = wrapper_cls


def _default_wrapper() -> WrapperFactory:
    try:
        return _DEFAULT_WRAPPER["cls"]
    except KeyError:
        raise RuntimeError(
            "enable_wrap() was given no wrapper_cls and no default wrapper is registered (shardkit.nn.fsdp registers "
            "FullyShardedDataParallel when it is imported); pass wrapper_cls=... or import shardkit.nn first"
        ) from None


def current_wrap_config() -> Optional[WrapConfig]:
    """The configuration of the innermost active :func:`enable_wrap` in this thread/task, or ``None``."""
    return _ACTIVE_CONFIG.get()


@contextlib.contextmanager
def enable_wrap(
    auto_wrap_policy: Optional[AutoWrapPolicy] = None,
    *,
    wrapper_cls: Optional[WrapperFactory] = None,
    **wrapper_kwargs: Any,
) -> Iterator[WrapConfig]:
    """Within this context :func:`wrap` and :func:`auto_wrap` wrap modules with ``wrapper_cls(module, **kwargs)``.

    Args:
        auto_wrap_policy: the policy :func:`auto_wrap` uses when it is given none (default
            :func:`default_auto_wrap_policy`, 100M parameters). First positional argument, as in fairscale.
        wrapper_cls: the wrapper class, by keyword (default :class:`~shardkit.nn.FullyShardedDataParallel`;
            fairscale requires it, shardkit does not).
        **wrapper_kwargs: passed to every wrapper built in the context. ``move_module_cuda_half=True``
            (fairscale's flag) is taken out and moves each module to the current CUDA device in float16 first.

    A nested ``enable_wrap`` replaces this configuration (it does not merge with it) until it exits; fairscale
    refuses nesting, shardkit allows it. The context is local to the current thread or asyncio task.

    Example::

        group = DummyProcessGroup(rank=0, size=1)
        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=group, mixed_precision=True):
            layer = wrap(torch.nn.Linear(5, 5))                    # a FullyShardedDataParallel
            tfmr = auto_wrap(torch.nn.Transformer(), min_num_params=10**6)
    """
    if wrapper_cls is None:
        wrapper_cls = _default_wrapper()
    move_module_cuda_half = bool(wrapper_kwargs.pop("move_module_cuda_half", False))
    config = WrapConfig(wrapper_cls, auto_wrap_policy, MappingProxyType(dict(wrapper_kwargs)), move_module_cuda_half)
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
    (100M parameters); it may follow fairscale's signature ``(module, recurse, unwrapped_params, module_is_root)``
    or torch's ``(module, recurse, nonwrapped_numel)``. ``min_num_params=N`` is a shortcut for the size policy
    with that threshold. Any other keyword is a wrapper override, as in :func:`wrap`.

    Children are replaced in place (``setattr`` on their parent) and the possibly wrapped ``module`` is returned.
    Modules that already are wrappers are kept as they are and their parameters count as wrapped; a sub-module
    reachable under several names is wrapped once. Tied parameters are never split: a module that shares a
    parameter (or a sub-module) with something outside it is not wrapped on its own, whatever the policy says,
    so the parameter stays in the unit of the smallest module around all its users (a warning names such
    modules). If building a wrapper fails, the model is restored as it was before the call and the error raised.

    Example (the fairscale documentation example)::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=DummyProcessGroup(0, 1)):
            tfmr = auto_wrap(nn.Transformer(num_encoder_layers=2, num_decoder_layers=2), min_num_params=1e6)
        # every encoder/decoder layer and its linear1/linear2 are wrapped; self_attn and tfmr itself are not
    """
    config = _ACTIVE_CONFIG.get()
    if config is None:
        return module
    policy = _resolve_policy(config, auto_wrap_policy, kwargs.pop("min_num_params", None))
    caller = policy_caller(policy)
    return wrap_tree(module, caller, config.is_wrapped, lambda m: _wrap_with(config, m, kwargs))


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
    if config.move_module_cuda_half:
        module = module.to(device=current_cuda_device(), dtype=torch.float16)
    return config.wrapper_cls(module, **{**config.wrapper_kwargs, **per_module, **overrides})


__all__ = ["WrapConfig", "auto_wrap", "current_wrap_config", "enable_wrap", "wrap"]
