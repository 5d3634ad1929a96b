"""A TP-unaware gradient clip must not silently split a tensor-parallel model's replicated parameters apart.

``torch.nn.utils.clip_grad_norm_`` on a tensor-parallel model sums each rank's own slices, so the ranks of one
tensor-parallel group find different norms and, once clipping acts, scale the gradients of the replicated
parameters (a layer norm, a bias) by different factors: each rank then holds a different model, and training goes
on without a word. Before the step check, after two steps the layer norm differed between the ranks and nothing was
said. Now the optimizer step is refused on every rank, naming the parameter and the fix; with shardkit's own
``clip_grad_norm_`` (each split parameter counted once) the ranks agree and training goes on.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from shardkit import tensor_parallel as tp
from shardkit.testing import run_distributed


def _model() -> nn.Module:
    tp.model_parallel_manual_seed(3, tp.current_state().tp_rank)
    return nn.Sequential(
        tp.ColumnParallelLinear(8, 16, bias=True, gather_output=False),
        nn.ReLU(),
        tp.RowParallelLinear(16, 8, bias=True, input_is_parallel=True),
        nn.LayerNorm(8),  # replicated: its gradient is the same on every tensor-parallel rank
        tp.ColumnParallelLinear(8, 4, bias=False, gather_output=True),
    )


def _train(clip: Callable[[nn.Module], Any]) -> dict[str, Any]:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    try:
        for _ in range(2):
            model(x).square().mean().backward()
            clip(model)
            optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as err:
        return {"error": str(err)}
    return {"norm": model[3].weight.detach().clone()}


def _both(rank: int, world_size: int) -> dict[str, Any]:
    tp.init_parallel_state(tensor=2)
    return {
        "torch": _train(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)),
        "shardkit": _train(lambda m: tp.clip_grad_norm_(m, 1e-3)),
    }


def test_a_tp_unaware_clip_is_refused_on_every_rank_and_the_aware_one_trains() -> None:
    results = run_distributed(_both, 2)
    for rank, result in enumerate(results):
        error = result["torch"].get("error", "")
        assert "different gradients on the tensor-parallel ranks" in error, (rank, result["torch"])
        assert "3.weight" in error or "shape (8,)" in error, error
        assert "shardkit.tensor_parallel.clip_grad_norm_" in error, error
        assert "norm" in result["shardkit"], (rank, result["shardkit"])
    assert torch.equal(results[0]["shardkit"]["norm"], results[1]["shardkit"]["norm"])


class _SequenceParallelBlock(nn.Module):
    """A norm on sequence-split activations before a sequence-parallel pair; ``summed`` applies the norm's weight
    through ``copy_to_tp`` (as the layer's docstring asks), so its gradient is summed over the ranks."""

    def __init__(self, summed: bool) -> None:
        super().__init__()
        tp.model_parallel_manual_seed(5, tp.current_state().tp_rank)
        self.summed = summed
        self.norm = nn.LayerNorm(8, elementwise_affine=True, bias=False)
        self.up = tp.ColumnParallelLinear(8, 16, gather_output=False, sequence_parallel=True)
        self.down = tp.RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel=True)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        weight = tp.copy_to_tp(self.norm.weight) if self.summed else self.norm.weight
        h = torch.nn.functional.layer_norm(x_local, (8,), weight)
        out: torch.Tensor = self.down(torch.relu(self.up(h)))
        return out


def _sequence_parallel(rank: int, world_size: int) -> dict[str, Any]:
    state = tp.init_parallel_state(tensor=2)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(2))
    x_local = x.chunk(2, dim=1)[state.tp_rank]  # this rank's half of the sequence
    out: dict[str, Any] = {}
    for summed in (False, True):
        block = _SequenceParallelBlock(summed)
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
        block(x_local).square().sum().backward()
        try:
            optimizer.step()
            out[summed] = block.norm.weight.detach().clone()
        except RuntimeError as err:
            out[summed] = str(err)
    return out


def test_a_sequence_parallel_norm_without_copy_to_tp_is_refused() -> None:
    results = run_distributed(_sequence_parallel, 2)
    for rank, result in enumerate(results):
        assert isinstance(result[False], str) and "copy_to_tp(param)" in result[False], (rank, result[False])
        assert isinstance(result[True], torch.Tensor), (rank, result[True])
    assert torch.equal(results[0][True], results[1][True])
