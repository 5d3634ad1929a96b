"""smp's tensor-parallel face: the marking API, the registrations, and the ``smp.nn`` modules not built yet.

``smp.tensor_parallelism()``, ``smp.set_tensor_parallelism()``, ``smp.tp_register`` and
``smp.tp_register_with_module`` live in :mod:`~.tp.registry`; ``smp.nn.DistributedLinear`` in :mod:`~.tp.layers`
and the transformer blocks in :mod:`~.tp.transformer` (over the core :mod:`shardkit.tensor_parallel`).
``DistributedEmbedding`` in :mod:`~.tp.embedding`. ``DistributedTransformerLMHead`` is not built yet: it is
importable, and constructing one raises :class:`TensorParallelismNotSupported` before anything is changed.
"""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn

from shardkit.modelparallel.tp.registry import (
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)

__all__ = [
    "DISTRIBUTED_MODULES",
    "TensorParallelismNotSupported",
    "refuse",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
]

_WHAT_INSTEAD = (
    "not built in shardkit yet: use smp.nn.DistributedLinear (or nn.Linear inside smp.tensor_parallelism()) for "
    "tensor parallelism, with pipeline and data parallelism for the rest"
)


class TensorParallelismNotSupported(NotImplementedError):
    """An smp tensor-parallel API that shardkit does not have yet was used."""


def refuse(name: str) -> NoReturn:
    """Raise :class:`TensorParallelismNotSupported` for the smp API ``name``."""
    raise TensorParallelismNotSupported(f"{name}: {_WHAT_INSTEAD}")


def _distributed_module(name: str) -> type[nn.Module]:
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        refuse(f"smp.nn.{name}")

    doc = f"smp's tensor-parallel ``{name}``: constructing it raises (not built in shardkit yet)."
    return type(name, (nn.Module,), {"__init__": __init__, "__doc__": doc, "__module__": "shardkit.modelparallel.nn"})


#: smp.nn's tensor-parallel modules not built yet (each refuses construction).
DISTRIBUTED_MODULES = {name: _distributed_module(name) for name in ("DistributedTransformerLMHead",)}
