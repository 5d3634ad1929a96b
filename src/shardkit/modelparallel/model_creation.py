"""``smp.model_creation``: the one context smp v1.6+ scripts build their model in.

It combines three things, as smp documents: the dtype the model is created in (``dtype``, else torch's default),
tensor parallelism for the modules created inside (``tensor_parallelism=True`` with its keyword options), and
delayed parameter initialisation when the config sets ``delayed_parameter_initialization``. With
``tensor_parallelism=True`` the modules created inside are marked as ``smp.tensor_parallelism()`` marks them (the
keyword options override the distributed modules' arguments); with ``False`` the options are unused, as smp says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.building.delayed_init import delay_param_initialization
from shardkit.modelparallel.tp.registry import tensor_parallelism as mark_tensor_parallel


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: Optional[torch.dtype] = None, **tensor_parallel_config: Any
) -> Iterator[None]:
    """Create the model inside: in ``dtype`` (floating point; torch's default when None), on the meta device
    when the smp config sets ``delayed_parameter_initialization`` (each stage creates its share after the
    partition, see :func:`~shardkit.modelparallel.building.delayed_init.delay_param_initialization`).

    ``tensor_parallelism=True`` marks the modules created inside for tensor parallelism (``smp.DistributedModel``
    replaces them); the other keyword arguments are smp's tensor-parallel options, unused without it.

    Example::

        smp.init({"partitions": 2, "delayed_parameter_initialization": True})
        with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.bfloat16):
            model = AutoModelForCausalLM.from_config(config)
    """
    config = smp_state.current().config
    if not isinstance(tensor_parallelism, bool):
        raise TypeError(f"smp.model_creation(tensor_parallelism=...) takes True or False, got {tensor_parallelism!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"smp.model_creation(dtype=...) takes a floating-point torch.dtype or None, got {dtype!r}")
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        with contextlib.ExitStack() as stack:
            if tensor_parallelism:  # False leaves the marks of any enclosing smp.tensor_parallelism() in force
                stack.enter_context(mark_tensor_parallel(True, **tensor_parallel_config))
            stack.enter_context(delay_param_initialization(enabled=config.delayed_parameter_initialization))
            yield
    finally:
        torch.set_default_dtype(previous)
