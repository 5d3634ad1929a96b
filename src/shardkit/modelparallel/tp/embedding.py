"""``smp.nn.DistributedEmbedding``: an embedding table split along ``embedding_dim`` across the tensor-parallel ranks
(smp's only split for it), over the core's mappings.

Each rank holds ``embedding_dim / tp_size`` columns of the table and looks up its columns. With ``prescaled_batch``
(the same ids on every rank) the columns are all-gathered, as the core's ``ParallelEmbedding`` does. Without it each
rank has its own batch: the group's ids are gathered, each rank places its columns for all of them at their offset in
a zero-filled full-width result, and a reduce-scatter over the batches leaves each rank the whole embedding of its
own batch (adding zeros is exact). Either way the output equals ``nn.Embedding``'s bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.partitioning.trace import is_tracing
from shardkit.modelparallel.tp.layers import (
    DistributedModule,
    check_prescaled_input,
    merge_from,
    tp_group_of_job,
)
from shardkit.tensor_parallel import ShardSpec, gather_from_sequence, gather_from_tp, split_size


class DistributedEmbedding(DistributedModule):
    """smp's tensor-parallel ``nn.Embedding`` (split along ``embedding_dim``): the output is what ``nn.Embedding``
    with the same table returns for this rank's ids.

    ``initializer_range``: the table starts as ``normal(0, initializer_range)`` (smp's default), or from ``_weight``
    (the full table) when given; ``padding_idx``'s row starts at zero and gets no gradient. ``_skip_allgather``:
    the ids given are already the tensor-parallel group's batches (the same on every rank; the output covers them
    all); ``_skip_scatter_and_merge``: return this rank's columns (``[..., embedding_dim / tp_size]``) unmerged.
    ``max_norm`` and ``sparse`` need whole rows and raise ``ValueError``.

    Example::

        smp.init({"tensor_parallel_degree": 2, "ddp": True})
        embed = smp.nn.DistributedEmbedding(1000, 64)    # weight (1000, 32) on each of the 2 ranks
        h = embed(ids)                                    # (N, S, 64) for this rank's ids (N, S)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[torch.Tensor] = None,
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
    ) -> None:
        super().__init__()
        who = f"smp.nn.DistributedEmbedding(num_embeddings={num_embeddings}, embedding_dim={embedding_dim})"
        if max_norm is not None or sparse:
            raise ValueError(f"{who}: max_norm and sparse need whole rows, which the split table does not hold")
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(
                f"{who}: _weight has shape {tuple(_weight.shape)}, not ({num_embeddings}, {embedding_dim})"
            )
        group = tp_group_of_job(who)
        size = group.size if group is not None else 1
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.local_embedding_dim = split_size(who, "embedding_dim", embedding_dim, size)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx, self.scale_grad_by_freq = padding_idx, scale_grad_by_freq
        self.skip_allgather, self.skip_merge = _skip_allgather, _skip_scatter_and_merge
        self.prescaled_batch = smp_state.current().config.prescaled_batch
        self.group = group
        full = _weight.detach().clone() if _weight is not None else torch.empty(num_embeddings, embedding_dim)
        if _weight is None:
            nn.init.normal_(full, std=initializer_range)
            if padding_idx is not None:
                full[padding_idx].zero_()
        spec = ShardSpec(1)
        self.declare_tp_slices({"weight": spec}, group)
        local = spec.shard(full, group.rank, group.size) if group is not None else full
        self.weight = nn.Parameter(local.contiguous())

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> DistributedEmbedding:
        """The distributed table holding this rank's columns of ``embedding``'s."""
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            max_norm=embedding.max_norm,
            norm_type=embedding.norm_type,
            scale_grad_by_freq=embedding.scale_grad_by_freq,
            sparse=embedding.sparse,
            _weight=embedding.weight.detach(),
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group is None or self.skip_merge:
            return self._lookup(input_)
        width = self.local_embedding_dim
        padding = (group.rank * width, (group.size - 1 - group.rank) * width)
        if is_tracing():  # rank 0 traces alone to partition: the right shapes, no collectives
            return F.pad(self._lookup(input_), padding)
        if self.prescaled_batch or self.skip_allgather:  # the same ids on every rank: gather the columns
            if self.prescaled_batch:
                check_prescaled_input(self, group, input_)
            return gather_from_tp(self._lookup(input_), group.group, dim=-1)
        partial = F.pad(self._lookup(gather_from_sequence(input_, group.group, 0)), padding)
        return merge_from(group, 0, partial, prescaled=False)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx, scale_grad_by_freq=self.scale_grad_by_freq)

    def extra_repr(self) -> str:
        size = self.group.size if self.group is not None else 1
        return f"{self.num_embeddings}, {self.embedding_dim} ({self.local_embedding_dim} on this rank of {size})" + (
            f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        )
