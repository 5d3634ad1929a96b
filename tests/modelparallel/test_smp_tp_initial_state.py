"""smp under tensor parallelism starts every rank of a tensor-parallel group from the same replicated parameters.

A ``smp.nn`` block holds split parameters (each rank's slice of the query, key, value, ``dense1`` and ``dense2``
weights) beside whole ones (the layer norms, the row-parallel ``dense`` and ``dense2`` biases). smp broadcasts rank
0's initial state: the slices from the first rank of each reduced-data-parallel group, the whole parameters from
rank 0 of the world. Ranks whose random states differ when the model is built (seeded per rank, or after a partition
trace that only rank 0 ran) must still start their whole parameters equal, or each tensor-parallel rank trains a
different model without a word.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.modelparallel as smp
from shardkit.testing import run_distributed

#: Whole on every tensor-parallel rank, then sliced per rank.
WHOLE = ("layer.attention.dense.bias", "layer.attention.pre_layernorm.weight", "layer.output.dense2.bias")
SLICED = ("layer.attention.query.weight", "layer.output.dense1.weight")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = smp.nn.DistributedTransformerLayer(
            num_attention_heads=2, attention_head_size=4, hidden_size=8, intermediate_size=16,
            attention_dropout_prob=0.0, hidden_dropout_prob=0.0, pre_layernorm=True, post_layernorm=False,
        )  # fmt: skip
        with torch.no_grad():  # a norm that does not start at ones, so its broadcast is seen
            self.layer.attention.pre_layernorm.weight.uniform_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer((x, torch.zeros(x.shape[0], 1, 1, x.shape[1])))[0]


def _start(rank: int, world_size: int) -> dict[str, Any]:
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        torch.manual_seed(100 + rank)  # every rank draws its own initial weights
        model = smp.DistributedModel(_Net())

        @smp.step
        def forward(model: smp.DistributedModel, x: torch.Tensor) -> torch.Tensor:
            loss = F.mse_loss(model(x), torch.zeros_like(x))
            model.backward(loss)
            return loss

        forward(model, torch.randn(2, 3, 8))  # the first step partitions and broadcasts the initial state
        named = dict(model.named_parameters())
        found = {name: tensor for name, tensor in named.items() if name.endswith(WHOLE + SLICED)}
        return {"tp_rank": smp.tp_rank(), **{name: found[name].detach().clone() for name in found}}
    finally:
        smp.reset()


def test_whole_parameters_of_tensor_parallel_blocks_start_equal_on_every_tensor_rank() -> None:
    first, second = run_distributed(_start, 2)
    assert (first["tp_rank"], second["tp_rank"]) == (0, 1)
    whole = [name for name in first if name.endswith(WHOLE)]
    sliced = [name for name in first if name.endswith(SLICED)]
    assert len(whole) == len(WHOLE) and len(sliced) == len(SLICED), sorted(first)
    for name in whole:
        assert torch.equal(first[name], second[name]), name
    for name in sliced:  # each rank keeps its own slice
        assert not torch.equal(first[name], second[name]), name
