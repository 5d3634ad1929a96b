"""A small GPT-style LM whose attention and feed-forward are tensor-parallel, or plain ``nn.Linear`` for torch's TP.

Each block is pre-norm attention (separate ``q``, ``k``, ``v`` projections and an output ``o``) and a GELU
feed-forward (``up``, ``down``). With ``parallel=True`` (needs the current tensor-parallel state,
:func:`shardkit.tensor_parallel.init_parallel_state`) ``q``, ``k``, ``v`` and ``up`` are
:class:`~shardkit.tensor_parallel.ColumnParallelLinear` and ``o`` and ``down``
:class:`~shardkit.tensor_parallel.RowParallelLinear`; with ``parallel=False`` all six are ``nn.Linear`` and
:func:`torch_tp_plan` is the same split for ``torch.distributed.tensor.parallel.parallelize_module``. The embedding,
the norms and the head are replicated. ``shardkit bench tp`` and ``shardkit plan``'s TP accuracy checks use it.

Per block and step, the split model all-reduces ``batch x seq x dim`` activations twice in forward (after ``o`` and
``down``) and :data:`COLUMN_LAYERS` times in backward (the input gradient of each column layer): see
:func:`tp_comm_bytes`.

Example::

    tp.init_parallel_state(tensor=2)
    model = tp_lm(parallel=True, dim=256, heads=8, layers=2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear, current_state, split_size

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

#: Column-parallel layers per block (q, k, v, up): one backward all-reduce each.
COLUMN_LAYERS = 4
#: Column-parallel layers per block with ``fused=True`` (qkv, up): Megatron's two backward all-reduces.
FUSED_COLUMN_LAYERS = 2
#: Row-parallel layers per block (o, down): one forward all-reduce each.
ROW_LAYERS = 2


def _column(dim_in: int, dim_out: int, parallel: bool, stride: int = 1) -> nn.Module:
    if parallel:
        return ColumnParallelLinear(dim_in, dim_out, bias=False, gather_output=False, stride=stride)
    return nn.Linear(dim_in, dim_out, bias=False)


def _row(dim_in: int, dim_out: int, parallel: bool) -> nn.Module:
    if parallel:
        return RowParallelLinear(dim_in, dim_out, bias=False, input_is_parallel=True)
    return nn.Linear(dim_in, dim_out, bias=False)


class Block(nn.Module):
    """Pre-norm causal self-attention and a GELU feed-forward; the heads are split with the projections.

    ``fused``: one ``qkv`` projection (Megatron's layout: split with stride 3, so each rank holds its heads' part of
    ``q``, ``k`` and ``v``) instead of three; backward then all-reduces twice per block instead of four times.
    """

    def __init__(self, dim: int, heads: int, hidden: int, parallel: bool, tp_size: int, fused: bool = False) -> None:
        super().__init__()
        self.local_heads = split_size("tp_lm Block", "heads", heads, tp_size)
        self.head_dim = dim // heads
        self.attn_norm, self.ffn_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        if fused:
            self.qkv = _column(dim, 3 * dim, parallel, stride=3)
        else:
            self.q, self.k, self.v = (_column(dim, dim, parallel) for _ in range(3))
        self.fused = fused
        self.o = _row(dim, dim, parallel)
        self.up, self.down = _column(dim, hidden, parallel), _row(hidden, dim, parallel)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # -1: this rank's heads (all, under torch TP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_norm(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1) if self.fused else (self.q(h), self.k(h), self.v(h))
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).flatten(2))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class TPLM(nn.Module):
    """Embedding, ``layers`` blocks in an ``nn.ModuleList``, a final norm and a replicated head."""

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, hidden: int, parallel: bool, fused: bool = False
    ) -> None:
        super().__init__()
        tp_size = current_state("tp_lm(parallel=True)").tp_size if parallel else 1
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden, parallel, tp_size, fused) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tp_lm(
    parallel: bool = True,
    vocab: int = 512,
    dim: int = 128,
    heads: int = 4,
    layers: int = 2,
    hidden: int = 0,
    fused: bool = False,
) -> TPLM:
    """The LM (``hidden`` 0: ``4 * dim``); ``parallel`` builds its projections tensor-parallel, ``fused`` makes
    ``q``, ``k``, ``v`` one projection (see :class:`Block`)."""
    return TPLM(vocab, dim, heads, layers, hidden or 4 * dim, parallel, fused)


def torch_tp_plan(model: TPLM) -> dict[str, ParallelStyle]:
    """torch's ``parallelize_module`` plan splitting a ``parallel=False`` model as ``parallel=True`` splits it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.{name}": ColwiseParallel() for name in ("q", "k", "v", "up")})
        plan.update({f"blocks.{i}.{name}": RowwiseParallel() for name in ("o", "down")})
    return plan


def tp_comm_bytes(
    batch: int, seq: int, dim: int, layers: int, tp_size: int, element_size: int = 4, fused: bool = False
) -> dict[str, int]:
    """Bytes one rank sends per training step for the split blocks' all-reduces (ring: ``2 (t - 1) / t`` of the
    payload each), in forward and in backward (``fused``: one column layer for ``q``, ``k``, ``v``)."""
    if tp_size == 1:
        return {"forward": 0, "backward": 0}
    wire = 2 * (tp_size - 1) * batch * seq * dim * element_size // tp_size
    columns = FUSED_COLUMN_LAYERS if fused else COLUMN_LAYERS
    return {"forward": ROW_LAYERS * layers * wire, "backward": columns * layers * wire}


__all__ = [
    "COLUMN_LAYERS",
    "FUSED_COLUMN_LAYERS",
    "ROW_LAYERS",
    "TPLM",
    "Block",
    "torch_tp_plan",
    "tp_comm_bytes",
    "tp_lm",
]
