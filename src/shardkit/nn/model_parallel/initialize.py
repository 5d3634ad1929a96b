"""fairscale's ``nn.model_parallel.initialize``: the model-, data-, pipeline- and context-parallel groups.

The groups are the dimensions of one device mesh built by :mod:`shardkit.tensor_parallel` from a
``(data, pipeline, context, model)`` rank grid, model-parallel ranks varying fastest: with 8 processes and
``initialize_model_parallel(2)`` the model-parallel groups are ``[0, 1], [2, 3], [4, 5], [6, 7]`` and the
data-parallel groups ``[0, 2, 4, 6], [1, 3, 5, 7]``, as in fairscale. Calling any getter before
:func:`initialize_model_parallel` raises a ``RuntimeError`` that says so.

Example::

    torch.distributed.init_process_group("nccl")
    initialize_model_parallel(2)
    get_model_parallel_rank(), get_model_parallel_world_size(), get_data_parallel_world_size()
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from shardkit import tensor_parallel as tp
from shardkit.tensor_parallel import ParallelState


def _state() -> ParallelState:
    return tp.current_state("the model-parallel API")


def initialize_model_parallel(
    model_parallel_size_: int,
    pipeline_length: int = 1,
    context_parallel_size: int = 1,
    *,
    model_parallel_backend: Optional[str] = None,
    pipeline_backend: Optional[str] = None,
    cp_backend: Optional[str] = None,
    ddp_backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
) -> None:
    """Split the world into model-parallel groups of ``model_parallel_size_`` consecutive ranks (at most the world
    size), with ``pipeline_length`` pipeline stages and ``context_parallel_size``; data parallelism takes the rest.

    Every rank calls it. A world size that is not ``data x pipeline x context x model`` raises the same
    ``ValueError`` on every rank before any group is created; a second call without
    :func:`destroy_model_parallel` raises ``RuntimeError``. The ``*_backend`` arguments name each group's backend
    (the default group's when None) and ``timeout`` their collective timeout.
    """
    if tp.has_current_state():
        raise RuntimeError(
            "initialize_model_parallel: the model-parallel groups are already initialized; call "
            "destroy_model_parallel() first to lay them out again"
        )
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    backends = {"tensor": model_parallel_backend, "pipeline": pipeline_backend, "context": cp_backend}
    backends["data"] = ddp_backend
    tp.init_parallel_state(
        tensor=int(min(model_parallel_size_, world_size)),
        pipeline=pipeline_length,
        context=context_parallel_size,
        backends={dim: backend for dim, backend in backends.items() if backend is not None},
        timeout=timeout,
    )


def model_parallel_is_initialized() -> bool:
    """Whether :func:`initialize_model_parallel` has run (and :func:`destroy_model_parallel` has not since)."""
    return tp.has_current_state()


def destroy_model_parallel() -> None:
    """Forget the groups (the process groups themselves stay until ``destroy_process_group``)."""
    tp.set_current_state(None)


def get_model_parallel_group() -> dist.ProcessGroup:
    """The model-parallel (tensor-parallel) group of this rank."""
    return _state().tp_group


def get_model_parallel_world_size() -> int:
    """The model-parallel degree."""
    return _state().tp_size


def get_model_parallel_rank() -> int:
    """This rank's index in its model-parallel group."""
    return _state().tp_rank


def get_model_parallel_src_rank() -> int:
    """The global rank of model-parallel rank 0 in this rank's group (the source of broadcasts to the group)."""
    return _state().ranks("tensor")[0]


def get_data_parallel_group() -> dist.ProcessGroup:
    """The data-parallel group of this rank (the replicas of its model-parallel shard)."""
    return _state().group("data")


def get_data_parallel_world_size() -> int:
    """The data-parallel degree."""
    return _state().layout.data


def get_data_parallel_rank() -> int:
    """This rank's index in its data-parallel group."""
    return _state().coords.data


def get_data_parallel_ranks() -> list[int]:
    """The global ranks of this rank's data-parallel group."""
    return _state().ranks("data")


def get_pipeline_parallel_group() -> dist.ProcessGroup:
    """The pipeline group of this rank (one rank per stage)."""
    return _state().group("pipeline")


def get_pipeline_parallel_ranks() -> list[int]:
    """The global ranks of this rank's pipeline group, stage order."""
    return _state().ranks("pipeline")


def get_context_parallel_group() -> dist.ProcessGroup:
    """The context-parallel group of this rank."""
    return _state().group("context")


def get_context_parallel_ranks() -> list[int]:
    """The global ranks of this rank's context-parallel group."""
    return _state().ranks("context")


def get_context_parallel_world_size() -> int:
    """The context-parallel degree."""
    return _state().layout.context


def get_context_parallel_rank() -> int:
    """This rank's index in its context-parallel group."""
    return _state().coords.context
