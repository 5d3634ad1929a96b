"""The model-parallel random state: the tracker's stream per tensor-parallel rank, the default stream shared, and
activation checkpointing that recomputes dropout with the masks of the forward."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import shardkit.nn.model_parallel as mp
from shardkit import tensor_parallel as tp
from shardkit.nn import checkpoint_wrapper
from shardkit.testing import run_distributed


def test_the_tracker_runs_a_block_on_its_own_stream_and_leaves_the_default_one_alone() -> None:
    tracker = tp.RNGStatesTracker()
    tracker.add("mine", 99)
    torch.manual_seed(5)
    expected_default = torch.rand(4, generator=torch.Generator().manual_seed(5))
    with tracker.fork("mine"):
        first = torch.rand(3)
    with tracker.fork("mine"):
        second = torch.rand(3)  # continues the stream
    stream = torch.rand(6, generator=torch.Generator().manual_seed(99))
    assert torch.equal(torch.cat([first, second]), stream)
    assert torch.equal(torch.rand(4), expected_default)
    with pytest.raises(ValueError, match="seed 99 is already used"):
        tracker.add("other", 99)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("mine", 100)
    with pytest.raises(RuntimeError, match="model_parallel_cuda_manual_seed"), tracker.fork("missing"):
        pass


def test_the_model_parallel_seed_depends_on_the_tensor_rank_only() -> None:
    assert tp.model_parallel_seeds(1234, 0) == (1234, 1234 + 2718)
    assert tp.model_parallel_seeds(1234, 1) == (1234, 1234 + 2719)


class _DropoutBlock(nn.Module):
    """Dropout on the model-parallel stream, then on the default stream."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.weight
        with tp.get_rng_tracker().fork():
            h = F.dropout(h, 0.5, training=True)
        return F.dropout(torch.tanh(h), 0.3, training=True)


def _grad(run: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    tp.model_parallel_manual_seed(7, tp_rank=0)
    block = _DropoutBlock()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    run(block, x).pow(2).sum().backward()
    assert block.weight.grad is not None
    return block.weight.grad


def test_checkpointing_recomputes_with_the_forward_s_model_parallel_random_state() -> None:
    plain = _grad(lambda block, x: block(x))
    wrapped = checkpoint_wrapper(_DropoutBlock())
    assert torch.equal(_grad(lambda block, x: tp.checkpoint(block, x)), plain)
    assert torch.equal(_grad(lambda block, x: mp.checkpoint(block, x)), plain)

    tp.model_parallel_manual_seed(7, tp_rank=0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4), requires_grad=True)
    wrapped(x).pow(2).sum().backward()
    assert torch.equal(wrapped.weight.grad, plain)
    # torch's checkpoint alone replays the default generator but not the tracker: the masks differ.
    unreplayed = _grad(lambda block, x: torch_checkpoint(block, x, use_reentrant=False))
    assert not torch.equal(unreplayed, plain)


def _dropout_across_ranks(rank: int, world_size: int) -> dict[str, bool]:
    mp.initialize_model_parallel(2)
    mp.model_parallel_cuda_manual_seed(1234)
    ones = torch.ones(64)
    with mp.get_cuda_rng_tracker().fork():
        split_mask = F.dropout(ones, 0.5).ne(0)
    shared_mask = F.dropout(ones, 0.5).ne(0)
    masks = mp.gather_from_model_parallel_region(torch.stack([split_mask, shared_mask]).float())
    torch.manual_seed(1234 + 2718 + mp.get_model_parallel_rank())
    expected = F.dropout(ones, 0.5).ne(0)
    return {
        **_checkpointed_tp_block(),
        "model-parallel stream differs across ranks": not torch.equal(masks[0, :64], masks[0, 64:]),
        "default stream equal across ranks": torch.equal(masks[1, :64], masks[1, 64:]),
        "stream seeded per rank": torch.equal(split_mask, expected),
    }


class _TPBlock(nn.Module):
    """A tensor-parallel MLP: dropout on the split hidden activations (tracker), then on the replicated output."""

    def __init__(self) -> None:
        super().__init__()
        self.up = mp.ColumnParallelLinear(8, 16, gather_output=False)
        self.down = mp.RowParallelLinear(16, 8, input_is_parallel=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with mp.get_cuda_rng_tracker().fork():
            h = F.dropout(F.gelu(self.up(x)), 0.5)
        return F.dropout(self.down(h), 0.3)


def _checkpointed_tp_block() -> dict[str, bool]:
    torch.manual_seed(0)
    block = _TPBlock()
    wrapped = checkpoint_wrapper(block)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for run in (block, wrapped, lambda t: mp.checkpoint(block, t)):
        mp.model_parallel_cuda_manual_seed(99)
        block.zero_grad()
        run(x).pow(2).sum().backward()
        grads.append([p.grad.clone() for p in block.parameters() if p.grad is not None])
    return {
        "checkpoint_wrapper recomputes the TP block's masks": all(map(torch.equal, grads[0], grads[1])),
        "checkpoint recomputes the TP block's masks": all(map(torch.equal, grads[0], grads[2])),
        "every parameter has a gradient": len(grads[0]) == 4,
    }


def test_dropout_differs_across_tensor_parallel_ranks_on_the_tracker_and_agrees_outside_it() -> None:
    for checks in run_distributed(_dropout_across_ranks, 2):
        assert all(checks.values()), checks
