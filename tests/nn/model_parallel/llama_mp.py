"""A Llama-style model written against fairscale's model-parallel names, as Meta's reference model is: RMSNorm,
rotary embedding, grouped-query attention with a KV cache, a SwiGLU feed-forward, a ``ParallelEmbedding`` and a
column-parallel output layer. Only the import says ``shardkit``.

``parallel_output=True`` keeps the logits split over the vocabulary (for ``vocab_parallel_cross_entropy``).
``forward(tokens, start_pos)`` reads and fills the KV cache (inference); ``use_cache=False`` is the training path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import shardkit.nn.model_parallel.initialize as fs_init
from shardkit.nn.model_parallel.layers import ColumnParallelLinear, ParallelEmbedding, RowParallelLinear
from shardkit.tensor_parallel import split_size


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    multiple_of: int = 16
    norm_eps: float = 1e-5
    max_batch_size: int = 4
    max_seq_len: int = 16
    parallel_output: bool = False


def keep(x: torch.Tensor) -> torch.Tensor:
    """Llama's ``init_method``: leave the weight as allocated (the checkpoint fills it)."""
    return x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_table(head_dim: int, length: int, theta: float = 10000.0) -> torch.Tensor:
    """``(length, head_dim / 2)`` complex rotations, one per position and pair of channels."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), inverse)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Apply the rotations of ``table`` (seq, head_dim / 2) to ``x`` (batch, seq, heads, head_dim)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * table[None, :, None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        mp = fs_init.get_model_parallel_world_size()
        self.n_local_heads = split_size("Attention", "n_heads", args.n_heads, mp)
        self.n_local_kv_heads = split_size("Attention", "n_kv_heads", args.n_kv_heads, mp)
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = ColumnParallelLinear(args.dim, args.n_heads * self.head_dim, False, False, init_method=keep)
        self.wk = ColumnParallelLinear(args.dim, args.n_kv_heads * self.head_dim, False, False, init_method=keep)
        self.wv = ColumnParallelLinear(args.dim, args.n_kv_heads * self.head_dim, False, False, init_method=keep)
        self.wo = RowParallelLinear(args.n_heads * self.head_dim, args.dim, False, True, init_method=keep)
        cache_shape = (args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim)
        self.cache_k, self.cache_v = torch.zeros(cache_shape), torch.zeros(cache_shape)

    def _repeat(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.n_rep, dim=2) if self.n_rep > 1 else x

    def forward(
        self, x: torch.Tensor, start_pos: int, table: torch.Tensor, mask: Optional[torch.Tensor], use_cache: bool
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = rotate(xq, table), rotate(xk, table)
        if use_cache:
            self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk.detach()
            self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv.detach()
            xk, xv = self.cache_k[:bsz, : start_pos + seqlen], self.cache_v[:bsz, : start_pos + seqlen]
        q, k, v = (t.transpose(1, 2) for t in (xq, self._repeat(xk), self._repeat(xv)))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, multiple_of: int) -> None:
        super().__init__()
        hidden = multiple_of * ((int(2 * 4 * dim / 3) + multiple_of - 1) // multiple_of)
        self.w1 = ColumnParallelLinear(dim, hidden, bias=False, gather_output=False, init_method=keep)
        self.w2 = RowParallelLinear(hidden, dim, bias=False, input_is_parallel=True, init_method=keep)
        self.w3 = ColumnParallelLinear(dim, hidden, bias=False, gather_output=False, init_method=keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.multiple_of)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: torch.Tensor, start_pos: int, table: torch.Tensor, mask: Optional[torch.Tensor], use_cache: bool
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), start_pos, table, mask, use_cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = ParallelEmbedding(args.vocab_size, args.dim, init_method=keep)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = ColumnParallelLinear(
            args.dim, args.vocab_size, bias=False, gather_output=not args.parallel_output, init_method=keep
        )
        self.register_buffer("table", rotary_table(args.dim // args.n_heads, args.max_seq_len * 2), persistent=False)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, use_cache: bool = True) -> torch.Tensor:
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        table = self.table[start_pos : start_pos + seqlen]
        mask = None
        if seqlen > 1:
            causal = torch.full((seqlen, seqlen), float("-inf")).triu(1)
            mask = torch.hstack([torch.zeros(seqlen, start_pos), causal]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, table, mask, use_cache)
        return self.output(self.norm(h)).float()


def random_full_state(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Random full weights for ``model`` built at model-parallel size 1, the same on every rank (norms near 1)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in model.state_dict().items():
        noise = torch.randn(value.shape, generator=generator)
        state[key] = 1 + 0.1 * noise if key.endswith("norm.weight") else 0.2 * noise
    return state
