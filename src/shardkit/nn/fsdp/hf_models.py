"""What a wrapped Hugging Face ``transformers`` model needs beyond ``forward``.

transformers reads a model's parameters to answer ``model.device``, ``model.dtype`` and ``num_parameters()``
(``next(self.parameters())``), and ``generate()`` asks ``self.device`` and runs the encoder of an
encoder-decoder model directly, below the wrapper. Under FullyShardedDataParallel the original parameters are
not registered anywhere (the unit holds flat shards; the attributes are placeholders or, during forward, views),
so a root unit that owns every parameter leaves transformers an empty ``parameters()``: a bare
``StopIteration``, or a count of 0.

Two remedies, both answered by the wrapper, never by patching the user's module:

- :func:`original_params_listed`: for the duration of a read, every unit below the wrapper lists its original
  parameters' placeholders in the modules' ``_parameters`` (and its flat shards leave the unit's), so
  ``parameters()`` reports what the unwrapped model would: full shapes, dtype, device, ``requires_grad``, names.
  Placeholders hold no values; nothing is gathered, so a read on one rank alone is fine.
- ``generate`` of a transformers model is routed through the unit's forward logic without registering it
  (:func:`routed_by_default`), and runs with the original parameters listed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from shardkit.nn.fsdp.unit_module import UnitModule

#: Members of a transformers model that read ``self.parameters()``; the wrapper answers them with the original
#: parameters listed (properties are read, methods are called, inside :func:`original_params_listed`).
READS_PARAMETERS = frozenset({"device", "dtype", "num_parameters", "get_memory_footprint"})


def is_transformers_model(module: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers when it is not loaded)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return isinstance(base, type) and isinstance(module, base)


def routed_by_default(module: nn.Module, name: str) -> bool:
    """True when ``wrapper.<name>`` runs as a forward method without registering: transformers' ``generate``."""
    return name == "generate" and is_transformers_model(module) and callable(getattr(module, name, None))


@contextlib.contextmanager
def original_params_listed(root: nn.Module) -> Iterator[None]:
    """List the original parameters (as placeholders) in their modules' ``_parameters`` for the block, in place
    of the flat shards of every unit below ``root``; afterwards the dictionaries are exactly as before.

    During a forward inside the block the units' views are still what attribute reads see (the instance dict
    wins over ``_parameters``). A unit inside ``summon_full_params`` already lists real parameters and is left
    alone. Not for training: the optimizer's parameters (the shards) are not listed inside the block.
    """
    saved: dict[int, tuple[nn.Module, dict[str, Any]]] = {}

    def keep(module: nn.Module) -> None:
        saved.setdefault(id(module), (module, dict(module._parameters)))

    try:
        for unit in [m for m in root.modules() if isinstance(m, UnitModule)]:
            group = unit.fsdp_unit.group
            if group.is_summoned():
                continue
            for handle in group.handles:
                keep(unit)
                unit._parameters.pop(handle.name, None)
                placeholders = handle.placeholders()
                for (module, attr), placeholder in zip(handle.locations, placeholders):
                    keep(module)
                    _parameters_of(module)[attr] = placeholder
                for (module, attr), info in zip(handle.alias_locations, handle.meta.shared):
                    keep(module)
                    _parameters_of(module)[attr] = placeholders[info.primary]
        yield
    finally:
        for module, parameters in saved.values():
            module._parameters.clear()
            module._parameters.update(parameters)


def _parameters_of(module: nn.Module) -> dict[str, Any]:
    """The module's parameter dictionary, typed to take a placeholder (torch types it for parameters only)."""
    parameters: dict[str, Any] = module._parameters
    return parameters


def read_with_params_listed(wrapper: nn.Module, module: nn.Module, name: str) -> Any:
    """``module.<name>`` as the unwrapped model answers it: a property is read, a method is returned as a
    function that runs with the original parameters listed (see :func:`original_params_listed`)."""
    if isinstance(inspect.getattr_static(type(module), name, None), property):
        with original_params_listed(wrapper):
            return getattr(module, name)
    method: Callable[..., Any] = getattr(module, name)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with original_params_listed(wrapper):
            return method(*args, **kwargs)

    return call
