"""Entry points other than ``forward`` (``generate()``, ``encode()``, ...) that run with a unit's forward logic.

Only ``forward`` of a wrapped unit gathers its full parameters. A method such as Hugging Face's ``generate()``
calls the module's own ``forward`` many times, below the wrapper, so the root unit's parameters are never
gathered and the first read of one (``wte.weight``) hits its placeholder. Registering the method makes
``fsdp_model.generate(...)`` run like ``fsdp_model(...)``: the unit gathers its parameters, the method runs
(nested units gather and free theirs on every call, as in any forward), and the unit frees them at the end.

Nothing is patched on the user's module: the wrapper answers ``fsdp_model.<name>`` itself (from
``FullyShardedDataParallel.__getattr__``), so the module keeps its own method and a copy of the wrapper
(``copy.deepcopy``) keeps the registration. The methods themselves are
``FullyShardedDataParallel.register_forward_method`` and ``call_forward_method``.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def check_forward_method(wrapper: nn.Module, method_name: str) -> None:
    """Raise, naming what to do, unless ``method_name`` is a method of the wrapped module that can be routed."""
    if not isinstance(method_name, str) or not method_name.isidentifier() or method_name.startswith("__"):
        raise ValueError(f"register_forward_method needs the name of a method, got {method_name!r}")
    module = wrapper.__dict__["_modules"]["module"]
    if method_name == "forward":
        raise ValueError("forward already runs with the unit's forward logic; register other methods (generate)")
    if hasattr(type(wrapper), method_name) or method_name in wrapper.__dict__:
        raise ValueError(
            f"'{method_name}' is an attribute of {type(wrapper).__name__} itself, which would hide the wrapped "
            f"module's; call model.module.{method_name}(...) inside summon_full_params() instead"
        )
    if not callable(getattr(module, method_name, None)):
        raise AttributeError(
            f"the wrapped {type(module).__name__} has no method '{method_name}' to register as a forward method"
        )


def register_fsdp_forward_method(module: Any, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run with the unit's forward logic (gather, run, free), as torch's
    FSDP2 function of that name does; ``module`` is a :class:`~shardkit.nn.fsdp.FullyShardedDataParallel`.

    Example::

        model = FullyShardedDataParallel(GPT2LMHeadModel(config))
        register_fsdp_forward_method(model, "generate")
        tokens = model.generate(input_ids, max_new_tokens=8)

    Every rank must call the method the same number of times with the same number of forward passes inside
    (give ``generate`` the same ``max_new_tokens`` and ``min_new_tokens`` on every rank, or ``synced_gpus=True``
    when ranks may finish at different lengths), as for forward.
    """
    register = getattr(module, "register_forward_method", None)
    if register is None:
        raise TypeError(
            f"register_fsdp_forward_method needs a FullyShardedDataParallel instance, got {type(module).__name__}"
        )
    register(method_name)
