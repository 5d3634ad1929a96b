"""fairscale's ``ConfigAutoWrap``, as a read-only view of shardkit's wrap context.

fairscale keeps the state of :func:`~shardkit.nn.wrap.enable_wrap` in class attributes of ``ConfigAutoWrap``, and
some user code reads them (``if ConfigAutoWrap.in_autowrap_context: ...``). shardkit keeps that state in a
context variable; this class exposes it under fairscale's names, read-only, and works as a context manager the
way ``enable_wrap`` does. fairscale's internal helpers (``enable_autowrap_context``, ``disable_autowrap_context``,
``recursive_wrap``) are not provided: use ``enable_wrap`` and ``auto_wrap``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any, Optional

from shardkit.nn.wrap.context import WrapConfig, WrapperFactory, current_wrap_config, enable_wrap
from shardkit.nn.wrap.policies import AutoWrapPolicy, default_auto_wrap_policy


class _ContextView(type):
    """Class-level properties: ``ConfigAutoWrap.wrapper_cls`` reads the active context at the time of the read."""

    @property
    def in_autowrap_context(cls) -> bool:
        """True inside an :func:`enable_wrap` block (of this thread or task)."""
        return current_wrap_config() is not None

    @property
    def wrapper_cls(cls) -> Optional[WrapperFactory]:
        """The active context's wrapper class, or None outside a context."""
        config = current_wrap_config()
        return config.wrapper_cls if config is not None else None

    @property
    def kwargs(cls) -> dict[str, Any]:
        """A copy of the active context's wrapper arguments (empty outside a context)."""
        config = current_wrap_config()
        return dict(config.wrapper_kwargs) if config is not None else {}

    @property
    def auto_wrap_policy(cls) -> Optional[AutoWrapPolicy]:
        """The policy ``auto_wrap`` uses by default in the active context (None outside a context)."""
        config = current_wrap_config()
        if config is None:
            return None
        return config.auto_wrap_policy or default_auto_wrap_policy

    @property
    def move_module_cuda_half(cls) -> bool:
        """The active context's ``move_module_cuda_half`` flag (False outside a context)."""
        config = current_wrap_config()
        return config.move_module_cuda_half if config is not None else False


class ConfigAutoWrap(metaclass=_ContextView):
    """fairscale's wrap-context holder: ``with ConfigAutoWrap(policy, wrapper_cls=FSDP, **kwargs):`` is
    ``with enable_wrap(policy, wrapper_cls=FSDP, **kwargs):``, and the class attributes ``in_autowrap_context``,
    ``wrapper_cls``, ``kwargs``, ``auto_wrap_policy`` and ``move_module_cuda_half`` read the active context
    (they cannot be assigned).

    Example::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=group):
            assert ConfigAutoWrap.in_autowrap_context
    """

    def __init__(self, auto_wrap_policy: Optional[AutoWrapPolicy] = None, **kwargs: Any) -> None:
        self._policy = auto_wrap_policy
        self._kwargs = kwargs
        self._scope: Optional[AbstractContextManager[WrapConfig]] = None

    def __enter__(self) -> None:
        if self._scope is not None:
            raise RuntimeError("this ConfigAutoWrap is already entered; create a new one for each with-block")
        scope = enable_wrap(self._policy, **self._kwargs)
        scope.__enter__()
        self._scope = scope

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(exc_type, exc, tb)


__all__ = ["ConfigAutoWrap"]
