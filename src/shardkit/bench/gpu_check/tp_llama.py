"""A small Llama-style model for gpu-check's ``tp`` part, written against fairscale's model-parallel names
(``shardkit.nn.model_parallel``) as Meta's reference model is: RMS norms, rotary positions, grouped-query
attention, a SwiGLU feed-forward, a ``ParallelEmbedding`` and a column-parallel output layer.

It lives in the package because the lent GPU machine imports the check from ``src`` only (``tests/`` is not on its
path). Built at model-parallel size 1 it is the unsplit reference; at size 2 each rank holds half the heads, half
the feed-forward width, half the embedding columns and half the vocabulary rows of the output layer.

Dropout (``dropout > 0``) is drawn where Megatron draws it: on the attention probabilities of this rank's heads
from the model-parallel stream of the RNG tracker (a different mask on each tensor-parallel rank), and on the
replicated block outputs from the default generator (the same mask on every rank, or the replicas drift apart).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.nn.model_parallel as mp
from shardkit.tensor_parallel import split_size

#: Every split weight starts from this (each rank draws the full tensor from the same seed and keeps its part).
INIT = functools.partial(nn.init.normal_, std=0.02)


@dataclass(frozen=True)
class LlamaConfig:
    """The model's sizes. ``hidden`` is the feed-forward width; ``dropout`` applies in training mode only."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden: int
    seq_len: int
    dropout: float = 0.0


def llama_config(small: bool) -> LlamaConfig:
    """A model with real work for one H200 over two ranks, or a toy one for ``--small``."""
    if small:
        return LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=64, seq_len=16)
    return LlamaConfig(vocab_size=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, hidden=1408, seq_len=256)


def rotary_tables(head_dim: int, length: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(length, 1, head_dim / 2)``: the angle of every position for every channel pair."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), frequencies)[:, None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the adjacent channel pairs of ``x`` (batch, seq, heads, head_dim) by their position's angles."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal grouped-query attention; this rank's heads only (query, key and value projections column-parallel,
    the output projection row-parallel: one all-reduce in forward)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        mp_size = mp.get_model_parallel_world_size()
        self.local_heads = split_size("Attention", "n_heads", cfg.n_heads, mp_size)
        self.local_kv_heads = split_size("Attention", "n_kv_heads", cfg.n_kv_heads, mp_size)
        self.head_dim, self.dropout = cfg.dim // cfg.n_heads, cfg.dropout
        kv_width = cfg.n_kv_heads * self.head_dim
        self.wq = mp.ColumnParallelLinear(cfg.dim, cfg.dim, bias=False, gather_output=False, init_method=INIT)
        self.wk = mp.ColumnParallelLinear(cfg.dim, kv_width, bias=False, gather_output=False, init_method=INIT)
        self.wv = mp.ColumnParallelLinear(cfg.dim, kv_width, bias=False, gather_output=False, init_method=INIT)
        self.wo = mp.RowParallelLinear(cfg.dim, cfg.dim, bias=False, input_is_parallel=True, init_method=INIT)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, seq, _ = x.shape
        q = rotate(self.wq(x).view(rows, seq, self.local_heads, self.head_dim), cos, sin)
        k = rotate(self.wk(x).view(rows, seq, self.local_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(rows, seq, self.local_kv_heads, self.head_dim)
        group = self.local_heads // self.local_kv_heads  # query heads sharing one key/value head
        q, k, v = q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2)
        probs = (q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + mask).softmax(-1)
        if self.training and self.dropout > 0:
            with mp.get_cuda_rng_tracker().fork():  # this rank's heads: a mask of their own
                probs = F.dropout(probs, self.dropout)
        out = (probs @ v.transpose(1, 2)).transpose(1, 2).reshape(rows, seq, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, the hidden width split (one all-reduce in forward)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = mp.ColumnParallelLinear(cfg.dim, cfg.hidden, bias=False, gather_output=False, init_method=INIT)
        self.w3 = mp.ColumnParallelLinear(cfg.dim, cfg.hidden, bias=False, gather_output=False, init_method=INIT)
        self.w2 = mp.RowParallelLinear(cfg.hidden, cfg.dim, bias=False, input_is_parallel=True, init_method=INIT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm attention and feed-forward, each added to the residual after a replicated dropout."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5), nn.RMSNorm(cfg.dim, eps=1e-5)
        self.attention, self.feed_forward = Attention(cfg), FeedForward(cfg)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # default generator: seeded alike on every tensor-parallel rank, so every rank drops the same elements
        h = x + F.dropout(self.attention(self.attention_norm(x), cos, sin, mask), self.dropout, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.dropout, self.training)


class TinyLlama(nn.Module):
    """Token ids ``(batch, seq)`` to logits ``(batch, seq, vocab_size)``, the full vocabulary on every rank."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = mp.ParallelEmbedding(cfg.vocab_size, cfg.dim, init_method=INIT)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = mp.ColumnParallelLinear(cfg.dim, cfg.vocab_size, bias=False, init_method=INIT)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = torch.full((seq, seq), float("-inf"), device=tokens.device).triu(1)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos[:seq], self.sin[:seq], mask)
        return self.output(self.norm(h))


def expected_comm_per_step(cfg: LlamaConfig, rows: int, seq: int, mp_size: int) -> dict[str, dict[str, int]]:
    """The collectives one fp32 training step of :class:`TinyLlama` issues at model-parallel ``mp_size``, per op:
    ``calls`` and ``wire_bytes`` (what one rank sends, as shardkit's comm meter counts: a ring all-reduce sends
    ``2(n-1)/n`` of its buffer, an all-gather ``(n-1)/n`` of its output).

    Per block, forward: the all-reduce after each row-parallel layer (``wo``, ``w2``); backward: the all-reduce of
    the input gradient of each column-parallel layer (``wq``, ``wk``, ``wv``, ``w1``, ``w3``). Once per step: the
    output layer's input gradient (all-reduce), the embedding's columns and the output's logits (all-gathers).
    Not counted: each layer's one-time input check at the model's first forward (a few bytes per layer)."""
    n = mp_size
    activation = rows * seq * cfg.dim * 4
    reduces = 7 * cfg.n_layers + 1
    gathered = activation + rows * seq * cfg.vocab_size * 4
    return {
        "all_reduce": {"calls": reduces, "wire_bytes": int(reduces * activation * 2 * (n - 1) / n)},
        "all_gather": {"calls": 2, "wire_bytes": int(gathered * (n - 1) / n)},
    }
