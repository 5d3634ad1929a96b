"""Which :class:`UniversalSource` saves and loads a model and optimizer.

It sits above both the universal engine and the adapters (it dispatches on the adapters' types), below the
orchestration in :mod:`shardkit.checkpoint.api`.

The strategy is recognised by the same type dispatch as the legacy adapters (:func:`adapter_for`); each
strategy's source lives beside its legacy adapter, one file per strategy, as a class with a ``(model, optimizer)``
constructor: ``FSDPSource`` in ``shardkit.checkpoint.adapters.fsdp``, ``SMPSource`` in ``.smp``, ``SlowMoSource``
in ``.slowmo``, ``OSSSource`` in ``.oss`` and ``PlainSource`` in ``.plain``. A strategy whose module does not
define its source (yet) is saved in its legacy layout: :func:`source_for` returns None.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from torch import nn

from shardkit.checkpoint.adapters import adapter_for
from shardkit.checkpoint.adapters.registry import without_compile_wrapper
from shardkit.checkpoint.universal.source import UniversalSource

#: Legacy adapter class name -> (module, class name) of the strategy's universal source.
STRATEGY_SOURCES: dict[str, tuple[str, str]] = {
    "FSDPAdapter": ("shardkit.checkpoint.adapters.fsdp", "FSDPSource"),
    "SMPAdapter": ("shardkit.checkpoint.adapters.smp", "SMPSource"),
    "SlowMoAdapter": ("shardkit.checkpoint.adapters.slowmo", "SlowMoSource"),
    "OSSAdapter": ("shardkit.checkpoint.adapters.oss", "OSSSource"),
    "PlainAdapter": ("shardkit.checkpoint.adapters.plain", "PlainSource"),
}


def source_for(model: nn.Module, optimizer: Optional[Any]) -> Optional[UniversalSource]:
    """The universal source for ``model`` and ``optimizer``, or None when their strategy has none yet.

    Example::

        source = source_for(ddp_model, optimizer)   # a PlainSource
        source_for(torch.compile(model), optimizer)  # the source of model itself: the same names
    """
    model = without_compile_wrapper(model)
    entry = STRATEGY_SOURCES.get(type(adapter_for(model, optimizer)).__name__)
    if entry is None:
        return None
    cls = getattr(importlib.import_module(entry[0]), entry[1], None)
    if cls is None:
        return None
    # A source class may pick another source for some states of its strategy (``for_model``).
    source: UniversalSource = getattr(cls, "for_model", cls)(model, optimizer)
    return source
