"""Batches for the tests: seeded regression batches for small nets, and batches for the harness's reference models."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
from shardkit.testing.models import make_batch

Batch = tuple[torch.Tensor, torch.Tensor]


def regression_batch(seed: int, rows: int = 8, inputs: int = 6, outputs: int = 3) -> Batch:
    """``(x, y)`` of shapes ``(rows, inputs)`` and ``(rows, outputs)``, both drawn from one generator seeded with
    ``seed`` (the global RNG is left alone, so dropout masks do not depend on how many batches were made)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, inputs, generator=gen), torch.randn(rows, outputs, generator=gen)


def data_parallel_rows(t: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Data-parallel rank ``dp_rank``'s contiguous share of a global batch (the batch divides evenly)."""
    per = t.shape[0] // dp_size
    return t[dp_rank * per : (dp_rank + 1) * per]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside torch DDP, ShardedDataParallel or FSDP wrappers (one ``.module`` per wrapper)."""
    while isinstance(model, (DDP, ShardedDataParallel, FullyShardedDataParallel)):
        model = model.module
    return model


def model_batch(name: str, model: nn.Module, seed: int, size: int = 4) -> Batch:
    """A batch for the harness reference model ``name`` (``shardkit.testing.models``), through any wrapper."""
    return make_batch(name, unwrap(model), size, seed=seed)


def rank_batch(name: str, model: nn.Module, rank: int, step: int, micro: int = 0) -> Batch:
    """:func:`model_batch` of 4 rows for one rank, step and micro-batch (up to 100 ranks and 10 micro-batches);
    ``branchy`` (:class:`testkit.models.BranchyNet`) takes the ``nested`` model's batches."""
    seed = 1000 * step + 10 * rank + micro
    return model_batch("nested" if name == "branchy" else name, model, seed)
