"""``smp.model_creation``: the one context smp v1.6+ scripts build their model in.

It combines three things, as smp documents: the dtype the model is created in (``dtype``, else torch's default),
tensor parallelism for the modules created inside (``tensor_parallelism=True`` with its keyword options), and
delayed parameter initialisation when the config sets ``delayed_parameter_initialization``. Tensor parallelism
is not built in shardkit yet, so ``tensor_parallelism=True`` is refused before anything is created; with
``False`` the tensor-parallel options (``distribute_embedding``, ``fused_softmax``, ...) are unused, as smp says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.delayed_init import delay_param_initialization
from shardkit.modelparallel.tensor_parallel import refuse


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: Optional[torch.dtype] = None, **tensor_parallel_config: Any
) -> Iterator[None]:
    """Create the model inside: in ``dtype`` (floating point; torch's default when None), on the meta device
    when the smp config sets ``delayed_parameter_initialization`` (each stage creates its share after the
    partition, see :func:`~shardkit.modelparallel.delayed_init.delay_param_initialization`).

    ``tensor_parallelism=True`` raises :class:`~shardkit.modelparallel.tensor_parallel.TensorParallelismNotSupported`
    (not built yet); the other keyword arguments are smp's tensor-parallel options and are unused without it.

    Example::

        smp.init({"partitions": 2, "delayed_parameter_initialization": True})
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.bfloat16):
            model = AutoModelForCausalLM.from_config(config)
    """
    config = smp_state.current().config
    if tensor_parallelism:
        refuse("smp.model_creation(tensor_parallelism=True)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"smp.model_creation(dtype=...) takes a floating-point torch.dtype or None, got {dtype!r}")
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with delay_param_initialization(enabled=config.delayed_parameter_initialization):
            yield
    finally:
        torch.set_default_dtype(previous)
