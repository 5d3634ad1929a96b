"""fairscale's ``nn.model_parallel.mappings``: the four region functions over the model-parallel group."""

import torch

from shardkit import tensor_parallel as tp


def copy_to_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient over the model-parallel group."""
    return tp.copy_to_tp(input_)


def reduce_from_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the model-parallel group; identity backward."""
    return tp.reduce_from_tp(input_)


def scatter_to_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers it."""
    return tp.scatter_to_tp(input_)


def gather_from_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dimension (rank order); backward keeps this rank's slice."""
    return tp.gather_from_tp(input_)


__all__ = [
    "copy_to_model_parallel_region",
    "gather_from_model_parallel_region",
    "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region",
]
