"""smp's tensor-parallel names, present so scripts import, and refusing with one clear error when used.

shardkit has no tensor parallelism yet. A script that only *names* these (``smp.tp_size() > 1`` checks, an
``import``) works; one that calls them, or sets ``tensor_parallel_degree`` above 1, gets
:class:`TensorParallelismNotSupported` saying what to use instead. Nothing is half-applied: the error comes before
any module is touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NoReturn

from torch import nn

_WHAT_INSTEAD = (
    "shardkit does not support tensor parallelism yet: train with pipeline parallelism ('partitions') and data "
    "parallelism ('ddp': true), with tensor_parallel_degree 1"
)


class TensorParallelismNotSupported(NotImplementedError):
    """A tensor-parallel smp API was used; shardkit has no tensor parallelism yet."""


def refuse(name: str) -> NoReturn:
    """Raise :class:`TensorParallelismNotSupported` for the smp API ``name``."""
    raise TensorParallelismNotSupported(f"{name}: {_WHAT_INSTEAD}")


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tp_config: Any) -> Iterator[None]:
    """smp's context that marks modules for tensor parallelism: ``enabled=False`` is accepted (a no-op), else an
    error."""
    if enabled:
        refuse("smp.tensor_parallelism()")
    yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **tp_config: Any) -> None:
    """smp's per-module tensor-parallel switch: ``enabled=False`` is accepted (a no-op), else an error."""
    if enabled:
        refuse("smp.set_tensor_parallelism()")


def tp_register(dist_module: Any, init_hook: Any = None, forward_hook: Any = None, return_hook: Any = None) -> Any:
    """smp's decorator registering a distributed module for tensor parallelism: an error."""
    refuse("smp.tp_register()")


def tp_register_with_module(module_cls: Any, dist_module: Any, *args: Any, **kwargs: Any) -> None:
    """smp's registration of a distributed counterpart of a module class: an error."""
    refuse("smp.tp_register_with_module()")


def _distributed_module(name: str) -> type[nn.Module]:
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        refuse(f"smp.nn.{name}")

    doc = f"smp's tensor-parallel ``{name}``: constructing it raises (no tensor parallelism in shardkit yet)."
    return type(name, (nn.Module,), {"__init__": __init__, "__doc__": doc, "__module__": "shardkit.modelparallel.nn"})


#: smp.nn's tensor-parallel modules (each refuses construction).
DISTRIBUTED_MODULES = {
    name: _distributed_module(name)
    for name in (
        "DistributedLinear",
        "DistributedEmbedding",
        "DistributedAttentionLayer",
        "DistributedTransformer",
        "DistributedTransformerLayer",
        "DistributedTransformerLMHead",
        "DistributedTransformerOutputLayer",
    )
}
