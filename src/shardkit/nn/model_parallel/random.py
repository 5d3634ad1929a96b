"""fairscale's ``nn.model_parallel.random``: the model-parallel random state (on CPU too) and ``checkpoint``.

``model_parallel_cuda_manual_seed(seed)`` seeds the default generator with ``seed`` (the same on every rank) and the
tracker's ``"model-parallel-rng"`` stream with ``seed + 2718 + model_parallel_rank``; ``with
get_cuda_rng_tracker().fork():`` runs a block (dropout on split activations) on that stream. On a machine without
CUDA the CPU generator plays the CUDA generator's part, so dropout behaves the same.
"""

from typing import Any, Callable

from shardkit import tensor_parallel as tp
from shardkit.tensor_parallel import RNGStatesTracker

#: fairscale's class name for the tracker.
CudaRNGStatesTracker = RNGStatesTracker


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The process's model-parallel RNG tracker."""
    return tp.get_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default and model-parallel streams (call after ``initialize_model_parallel``)."""
    tp.model_parallel_manual_seed(seed, tp.current_state("model_parallel_cuda_manual_seed").tp_rank)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` with its activations recomputed in backward, replaying both random streams."""
    return tp.checkpoint(function, *args)


__all__ = ["CudaRNGStatesTracker", "checkpoint", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"]
