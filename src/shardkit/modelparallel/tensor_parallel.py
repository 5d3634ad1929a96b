"""smp's tensor-parallel face: the marking API, the registrations, and the error for what is not built yet.

``smp.tensor_parallelism()``, ``smp.set_tensor_parallelism()``, ``smp.tp_register`` and
``smp.tp_register_with_module`` live in :mod:`~.tp.registry`; ``smp.nn.DistributedLinear`` in :mod:`~.tp.layers`
and the transformer blocks in :mod:`~.tp.transformer` (over the core :mod:`shardkit.tensor_parallel`).
``DistributedEmbedding`` in :mod:`~.tp.embedding` and ``DistributedTransformerLMHead`` in :mod:`~.tp.lm_head`.
"""

from __future__ import annotations

from typing import NoReturn

from shardkit.modelparallel.tp.registry import (
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register,
    tp_register_with_module,
)

__all__ = [
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
