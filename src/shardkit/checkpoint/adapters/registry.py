"""Pick the adapter for a model and optimizer by their types, without importing strategies that are not in use."""

from __future__ import annotations

import sys
from typing import Any, Optional

from shardkit.checkpoint._torch_private import compiled_module


def loaded_class(module: str, name: str) -> Optional[type]:
    """``module.name`` if ``module`` is already imported, else ``None``.

    An object can only be an instance of a class whose module was imported, so type dispatch never needs to
    import a strategy (FSDP, smp, SlowMo ...) the program does not use.
    """
    found = sys.modules.get(module)
    value = getattr(found, name, None) if found is not None else None
    return value if isinstance(value, type) else None


def isinstance_of(obj: Any, module: str, name: str) -> bool:
    """``isinstance(obj, module.name)`` without importing ``module``."""
    cls = loaded_class(module, name)
    return cls is not None and isinstance(obj, cls)


#: The class of ``torch.compile(module)``'s wrapper (it keeps the module as ``_orig_mod``).
COMPILE_WRAPPER = ("torch._dynamo.eval_frame", "OptimizedModule")


def without_compile_wrapper(model: Any) -> Any:
    """The module ``torch.compile`` wrapped (through any number of wrappers), or ``model`` itself.

    A checkpoint is keyed by the model's own names, so ``torch.compile(model)`` and ``model`` save and load the
    same checkpoint; the wrapper holds no state of its own (its parameters are the module's).
    """
    while isinstance_of(model, *COMPILE_WRAPPER):
        model = compiled_module(model)
    return model
