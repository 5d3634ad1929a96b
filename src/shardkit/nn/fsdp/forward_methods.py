"""How a unit runs: its ``forward`` and the other entry points (``generate()``, ``encode()``, ...) that run with a
unit's forward logic, in :class:`ForwardRunner`, the collaborator a
:class:`~shardkit.nn.fsdp.FullyShardedDataParallel` holds and delegates to.

Only ``forward`` of a wrapped unit gathers its full parameters. A method such as Hugging Face's ``generate()``
calls the module's own ``forward`` many times, below the wrapper, so the root unit's parameters are never
gathered and the first read of one (``wte.weight``) hits its placeholder. Registering the method makes
``fsdp_model.generate(...)`` run like ``fsdp_model(...)``: the unit gathers its parameters, the method runs
(nested units gather and free theirs on every call, as in any forward), and the unit frees them at the end.

Nothing is patched on the user's module: the wrapper answers ``fsdp_model.<name>`` itself (from
``FullyShardedDataParallel.__getattr__``, which asks :meth:`ForwardRunner.attribute`), so the module keeps its own
method and a copy of the wrapper (``copy.deepcopy``) keeps the registration.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardkit.nn.fsdp import hf_models
from shardkit.nn.fsdp.root import init_root
from shardkit.nn.fsdp.runtime import TrainingState, eager
from shardkit.nn.fsdp.unit_module import UnitModule


class ForwardRunner:
    """Runs the wrapped module, or one of its registered methods, as one unit's forward: lazy root set-up,
    gather (pre-forward), run, free (post-forward).

    Example (what ``model(x)`` runs)::

        output = ForwardRunner(model).run(model.wrapped_module, (x,), {})
    """

    def __init__(self, owner: UnitModule) -> None:
        self.owner = owner
        #: Names of the wrapped module's methods that run as forwards (see :meth:`register`).
        self.registered: frozenset[str] = frozenset()

    @eager
    def init_root(self) -> None:
        """At the first forward of the outermost instance: mark it root, mark nested instances non-root."""
        init_root(self.owner)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``fn`` (the wrapped module or one of its registered methods) as the owner's forward."""
        unit = self.owner.fsdp_unit
        self.init_root()
        if unit.forward_inside_summon():
            return fn(*args, **kwargs)  # the summoned full parameters are in place: nothing to gather or free
        compiling = torch.compiler.is_compiling()
        args, kwargs = unit.pre_forward(args, kwargs, not compiling)  # guarded unless compiling
        if compiling:
            # No try block under torch.compile: dynamo cannot resume after a graph break inside one, and nested
            # units break the graph at their (eager) hooks. A forward that raises is undone at the next one.
            output = fn(*args, **kwargs)
        else:
            try:
                output = fn(*args, **kwargs)
            except BaseException:
                # e.g. a user error, or activation checkpointing stopping a recomputation early on purpose
                unit.forward_failed()
                raise
        output = unit.post_forward(output)
        if unit.policies.mixed_precision.clear_autocast_cache:
            torch.clear_autocast_cache()
        return output

    def register(self, method_name: str) -> None:
        """Make ``owner.<method_name>(...)`` run the wrapped module's method as a forward (checked first)."""
        check_forward_method(self.owner, method_name)
        self.registered = self.registered | {method_name}

    def call(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``wrapped_module.<method_name>(*args, **kwargs)`` as the owner's forward."""
        module = self.owner.wrapped_module
        method = getattr(module, method_name)
        self.init_root()
        listed: Any = contextlib.nullcontext()
        if hf_models.is_transformers_model(module):  # generate() reads self.device
            listed = hf_models.original_params_listed(self.owner)
        if self.owner.training_state == TrainingState.SUMMON_FULL_PARAMS:
            with torch.no_grad(), listed:  # inference on the summoned parameters: their gradients would be lost
                return method(*args, **kwargs)
        with listed:
            return self.run(method, args, kwargs)

    def attribute(self, module: nn.Module, name: str) -> Any:
        """``owner.<name>`` when the owner itself has no such attribute: a routed forward method, a transformers
        member read with the original parameters listed, or else ``module.<name>`` (``module``: the wrapped one)."""
        if name in self.registered or hf_models.routed_by_default(module, name):
            return functools.partial(self.call, name)
        if name in hf_models.READS_PARAMETERS and hf_models.is_transformers_model(module):
            return hf_models.read_with_params_listed(self.owner, module, name)  # model.device, num_parameters()
        return getattr(module, name)


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
