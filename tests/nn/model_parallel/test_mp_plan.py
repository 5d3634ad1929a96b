"""``shardkit plan`` on the Llama-style model written against fairscale's names, at model-parallel 2: the all-reduces
it counts are the model's own, two per block forward and, with separate ``wq``/``wk``/``wv``/``w1``/``w3`` column
layers, five per block backward (plus one for the column-parallel output layer's input)."""

from __future__ import annotations

import pytest
import torch
from llama_mp import ModelArgs, Transformer
from torch import nn

from shardkit.plan import estimate

ARGS = ModelArgs()
BATCH, SEQ = 2, 8


class _Training(nn.Module):
    """The model's training path (no KV cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(ARGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, use_cache=False)


def _mean(output: torch.Tensor, batch: object) -> torch.Tensor:
    return output.mean()


@pytest.mark.single  # the planner's peerless world is a process group in this process
def test_plan_counts_llama_all_reduces_per_block_at_model_parallel_2() -> None:
    batch = (torch.randint(0, ARGS.vocab_size, (BATCH, SEQ)),)
    est = estimate(_Training, batch, loss_fn=_mean, strategy="fsdp", world_size=4, tensor_parallel=2, backend="gloo")
    one = 2 * (2 - 1) * BATCH * SEQ * ARGS.dim * 4 // 2  # one all-reduce of (batch, seq, dim) fp32 over 2 ranks
    assert est.comm_bytes_by_phase["forward"]["all_reduce"] == 2 * ARGS.n_layers * one
    assert est.comm_bytes_by_phase["backward"]["all_reduce"] == (5 * ARGS.n_layers + 1) * one
