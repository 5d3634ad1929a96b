"""Embeddings split across the tensor-parallel ranks: by vocabulary rows or by embedding columns.

:class:`VocabParallelEmbedding` holds ``num_embeddings / t`` rows: a rank looks up the tokens in its range, writes
zeros for the others, and the ranks' results are summed (one all-reduce). :class:`ParallelEmbedding` holds every row
but ``embedding_dim / t`` columns: each rank looks up all tokens and the columns are all-gathered (Llama's token
embedding).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.tensor_parallel.checks import once_check_same_input
from shardkit.tensor_parallel.mappings import gather_from_tp, reduce_from_tp
from shardkit.tensor_parallel.sharding import ShardSpec, TensorParallelModule, TPGroup, init_shard_, split_size

InitMethod = Callable[[torch.Tensor], Any]


class _Embedding(TensorParallelModule):
    """What the two embeddings share: ``nn.Embedding``'s options and the master-weight helpers."""

    weight: nn.Parameter

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int],
        max_norm: Optional[float],
        norm_type: float,
        scale_grad_by_freq: bool,
        sparse: bool,
        mesh: Optional[DeviceMesh],
    ) -> None:
        super().__init__()
        self.who = f"{type(self).__name__}(num_embeddings={num_embeddings}, embedding_dim={embedding_dim})"
        self.tp = TPGroup.of(mesh, self.who)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = padding_idx, max_norm, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse

    def _lookup(self, ids: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
        return F.embedding(
            ids, self.weight, padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, split {self.tp.size} ways"

    def get_master_weight(self) -> torch.Tensor:
        """The full ``(num_embeddings, embedding_dim)`` weight, gathered from every rank (a collective)."""
        dim = self.tp_specs["weight"].dim
        return gather_from_tp(self.weight.detach(), self.tp.group, dim=dim)


class VocabParallelEmbedding(_Embedding):
    """An embedding whose vocabulary (rows) is split across the tensor-parallel ranks.

    Takes ``nn.Embedding``'s arguments plus ``init_method`` (fills the full table; each rank keeps its rows) and
    ``mesh`` (the 1-D tensor-parallel mesh; the current state's when None). ``padding_idx`` is a global token id.

    Example::

        emb = VocabParallelEmbedding(32000, 4096)   # rank r holds rows [r * 32000 / t, (r + 1) * 32000 / t)
        h = emb(tokens)                             # full (..., 4096) on every rank
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
        init_method: InitMethod = nn.init.xavier_normal_,
        *,
        mesh: Optional[DeviceMesh] = None,
    ) -> None:
        options = (padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        super().__init__(num_embeddings, embedding_dim, *options, mesh)
        rows = split_size(self.who, "num_embeddings", num_embeddings, self.tp.size)
        self.vocab_start_index = self.tp.rank * rows
        self.vocab_end_index = self.vocab_start_index + rows
        self.num_embeddings_per_partition = rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        self.tp_specs = {"weight": ShardSpec(0)}
        init_shard_(self.weight, (num_embeddings, embedding_dim), self.tp_specs["weight"], init_method, self.tp)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        once_check_same_input(self, input_)
        if self.tp.size == 1:
            return self._lookup(input_, self.padding_idx)
        return reduce_from_tp(self.partial(input_), self.tp.group)

    def partial(self, input_: torch.Tensor) -> torch.Tensor:
        """This rank's part of the lookup, no communication: the rows of the tokens in this rank's range, zeros for
        the others. The ranks' parts sum to the whole lookup (``forward`` all-reduces them; a caller whose ranks hold
        different batches can reduce-scatter them instead)."""
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        pad = self.padding_idx
        mine = pad is not None and self.vocab_start_index <= pad < self.vocab_end_index
        local_pad = pad - self.vocab_start_index if mine and pad is not None else None
        return self._lookup(local_ids, local_pad).masked_fill(outside.unsqueeze(-1), 0.0)


class ParallelEmbedding(_Embedding):
    """An embedding whose embedding dimension (columns) is split across the tensor-parallel ranks.

    Every rank holds the whole vocabulary and ``embedding_dim / t`` columns; the output is all-gathered, so every
    rank gets the full ``(..., embedding_dim)``. Arguments as :class:`VocabParallelEmbedding`, plus
    ``keep_master_weight_for_test`` (keep the full initial table in ``self.master_weight``).
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
        init_method: InitMethod = nn.init.xavier_normal_,
        keep_master_weight_for_test: bool = False,
        *,
        mesh: Optional[DeviceMesh] = None,
    ) -> None:
        options = (padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        super().__init__(num_embeddings, embedding_dim, *options, mesh)
        columns = split_size(self.who, "embedding_dim", embedding_dim, self.tp.size)
        self.embedding_dim_per_partition = columns
        self.weight = nn.Parameter(torch.empty(num_embeddings, columns))
        self.tp_specs = {"weight": ShardSpec(1)}
        self.master_weight = init_shard_(
            self.weight,
            (num_embeddings, embedding_dim),
            self.tp_specs["weight"],
            init_method,
            self.tp,
            keep_master_weight_for_test,
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        once_check_same_input(self, input_)
        found = self._lookup(input_, self.padding_idx)
        return gather_from_tp(found, self.tp.group)
