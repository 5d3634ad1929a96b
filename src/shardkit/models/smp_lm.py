"""A small GPT-style language model built of smp's tensor-parallel blocks (``smp.nn.DistributedTransformerLayer``).

What the 3-D planner (``shardkit plan --smp-layouts``) and ``shardkit bench 3d`` train: a token embedding, ``layers``
pre-norm causal :class:`~shardkit.modelparallel.nn.DistributedTransformerLayer` blocks in an ``nn.ModuleList`` (smp's
pipeline cuts between them), a final layer norm and an output projection. The blocks split their attention heads
and feed-forward features over smp's tensor-parallel group; the embedding, the norm and the head are replicated. Like
every ``smp.nn`` layer, it is built after ``smp.init`` (at tensor-parallel degree 1 it is a plain transformer).

Example::

    smp.init({"partitions": 2, "tensor_parallel_degree": 2, "ddp": True})
    model = smp.DistributedModel(smp_lm(dim=64, heads=4, layers=4))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


@dataclass(frozen=True)
class SMPLMConfig:
    """The model's sizes (``intermediate``: the feed-forward width, default four times ``dim``)."""

    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 64
    intermediate: Optional[int] = None

    @property
    def ffn(self) -> int:
        return self.intermediate if self.intermediate is not None else 4 * self.dim


class SMPLM(nn.Module):
    """See the module docstring; ``forward(tokens)`` with ``tokens`` ``(N, S)``, ``S <= seq``, gives the logits."""

    def __init__(self, cfg: SMPLMConfig) -> None:
        # start-up cost: smp (shardkit.nn, torch._dynamo) only when this model is built
        import shardkit.modelparallel as smp

        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"smp_lm: dim={cfg.dim} is not a multiple of heads={cfg.heads}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(
            smp.nn.DistributedTransformerLayer(
                num_attention_heads=cfg.heads,
                attention_head_size=cfg.dim // cfg.heads,
                hidden_size=cfg.dim,
                intermediate_size=cfg.ffn,
                attention_dropout_prob=0.0,
                hidden_dropout_prob=0.0,
                causal_mask_size=cfg.seq,
                pre_layernorm=True,
                post_layernorm=False,
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        # smp's blocks take an additive mask (N, 1, 1, S); the causal mask is theirs
        mask = torch.zeros(tokens.shape[0], 1, 1, tokens.shape[1], dtype=x.dtype, device=tokens.device)
        for block in self.blocks:
            x, mask = block((x, mask))
        return self.head(self.norm(x))


def smp_lm(
    vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 64, intermediate: Optional[int] = None
) -> SMPLM:
    """The model for these sizes (a factory: ``shardkit plan shardkit.models.smp_lm:smp_lm``)."""
    return SMPLM(SMPLMConfig(vocab, dim, heads, layers, seq, intermediate))


__all__ = ["SMPLM", "SMPLMConfig", "smp_lm"]
