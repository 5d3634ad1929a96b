"""Call a wrap policy the way it was written: fairscale's four arguments or torch's three.

fairscale calls ``policy(module=, recurse=, unwrapped_params=, module_is_root=)``; torch calls
``policy(module=, recurse=, nonwrapped_numel=)``; shardkit used to pass ``(module, recurse, numel)`` by position.
:func:`policy_caller` inspects the policy once and returns a function :func:`auto_wrap` calls with all four values.
"""

from __future__ import annotations

import inspect
from typing import Callable

from torch import nn

from shardkit.nn.wrap.policies import AutoWrapPolicy

#: ``caller(module, recurse, unwrapped_numel, module_is_root) -> bool``
PolicyCaller = Callable[[nn.Module, bool, int, bool], bool]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_FAIRSCALE_NAMES = ("module", "recurse", "unwrapped_params", "module_is_root")


def policy_caller(policy: AutoWrapPolicy) -> PolicyCaller:
    """Decide once how to call ``policy``; raise ``TypeError`` (before anything is wrapped) if it fits neither form.

    - It names ``module_is_root``: fairscale's form, called by keyword as fairscale does (when it also names
      ``module``, ``recurse`` and ``unwrapped_params``), else the count third and the root flag by keyword.
    - It takes four required positional arguments (``lambda m, recurse, n, root: ...``): fairscale's, by position.
    - It takes three positional arguments (torch's ``nonwrapped_numel`` or any other name): torch's form.
    - It takes ``(module, recurse, **kwargs)``: every name of both forms is passed by keyword.
    """
    if not callable(policy):
        raise TypeError(f"auto_wrap_policy must be callable, got {policy!r}")
    try:
        params = list(inspect.signature(policy).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: keep shardkit's historical positional form
        return lambda module, recurse, numel, is_root: bool(policy(module, recurse, numel))
    positional = [p for p in params if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in params if p.kind != inspect.Parameter.POSITIONAL_ONLY}
    takes_varargs = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params)
    takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    if "module_is_root" in by_name:
        if all(name in by_name for name in _FAIRSCALE_NAMES) or takes_kwargs:
            # Exactly as fairscale calls it, so any parameter order fairscale accepts works here too.
            return lambda module, recurse, numel, is_root: bool(
                policy(module=module, recurse=recurse, unwrapped_params=numel, module_is_root=is_root)
            )
        if "module_is_root" not in [p.name for p in positional[:3]] and (len(positional) >= 3 or takes_varargs):
            return lambda module, recurse, numel, is_root: bool(policy(module, recurse, numel, module_is_root=is_root))
    if len(positional) >= 4 and positional[3].default is inspect.Parameter.empty:
        return lambda module, recurse, numel, is_root: bool(policy(module, recurse, numel, is_root))
    if len(positional) >= 3 or takes_varargs:
        return lambda module, recurse, numel, is_root: bool(policy(module, recurse, numel))
    if len(positional) == 2 and takes_kwargs:
        return lambda module, recurse, numel, is_root: bool(
            policy(module, recurse, unwrapped_params=numel, nonwrapped_numel=numel, module_is_root=is_root)
        )
    raise TypeError(
        f"auto_wrap_policy {getattr(policy, '__name__', policy)!r} has the signature {inspect.signature(policy)}; "
        "a wrap policy takes (module, recurse, unwrapped_params, module_is_root) as fairscale's do, or "
        "(module, recurse, nonwrapped_numel) as torch's do. Bind extra settings with functools.partial."
    )


__all__ = ["PolicyCaller", "policy_caller"]
