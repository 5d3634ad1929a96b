"""Entry points other than ``forward`` (``generate()``, ``encode()``, ...) that run with a unit's forward logic.

Only ``forward`` of a wrapped unit gathers its full parameters. A method such as Hugging Face's ``generate()``
calls the module's own ``forward`` many times, below the wrapper, so the root unit's parameters are never
gathered and the first read of one (``wte.weight``) hits its placeholder. Registering the method makes
``fsdp_model.generate(...)`` run like ``fsdp_model(...)``: the unit gathers its parameters, the method runs
(nested units gather and free theirs on every call, as in any forward), and the unit frees them at the end.

Nothing is patched on the user's module: the wrapper answers ``fsdp_model.<name>`` itself (from
``FullyShardedDataParallel.__getattr__``), so the module keeps its own method and a copy of the wrapper
(``copy.deepcopy``) keeps the registration.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardkit.nn.fsdp.runtime import TrainingState, Unit


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


class ForwardMethods:
    """Registered forward methods of :class:`~shardkit.nn.fsdp.FullyShardedDataParallel` (mixed in before
    ``nn.Module``)."""

    module: nn.Module
    _unit: Unit
    _forward_with: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

    def register_forward_method(self, method_name: str) -> None:
        """Make ``self.<method_name>(...)`` run the wrapped module's method with this unit's forward logic.

        For entry points that call the module's ``forward`` from inside (Hugging Face's ``generate()``): the
        unit's parameters are gathered for the whole call and freed after it; nested units gather and free
        theirs at each of their forwards. Inside :meth:`summon_full_params` the method runs on the summoned
        parameters, without gradients. The wrapped module is not modified. Example::

            model.register_forward_method("generate")
            tokens = model.generate(input_ids, max_new_tokens=8)
        """
        assert isinstance(self, nn.Module)
        check_forward_method(self, method_name)
        registered = self.__dict__.get("_forward_methods", frozenset())
        self.__dict__["_forward_methods"] = registered | {method_name}

    def call_forward_method(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``self.module.<method_name>(*args, **kwargs)`` as this unit's forward (what ``self.<method_name>``
        does once registered)."""
        method = getattr(self.module, method_name)
        if self._unit.state == TrainingState.SUMMON_FULL_PARAMS:
            with torch.no_grad():  # inference on the summoned parameters: their gradients would be lost
                return method(*args, **kwargs)
        return self._forward_with(method, args, kwargs)


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
