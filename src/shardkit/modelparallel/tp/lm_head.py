"""``smp.nn.DistributedTransformerLMHead``: embeddings, smp's distributed transformer, and one LM head tied to the word
embedding, as smp's tensor-parallel page describes it.

The word embedding is split by vocabulary rows over the core's :class:`~shardkit.tensor_parallel.VocabParallelEmbedding`
(rank ``r`` holds rows ``[r V/t, (r+1) V/t)``), so the tied LM head gives each rank the logits of its own vocabulary
slice, and the loss comes from the core's :func:`~shardkit.tensor_parallel.vocab_parallel_cross_entropy`: the logits
are never gathered for it. The position (and token-type) embeddings and the final layer norm are small and whole on
every rank.

Without ``prescaled_batch`` each tensor-parallel rank holds its own batch: the ids are gathered over the group,
each rank looks up its rows for all of them, and a reduce-scatter leaves each rank its own batch's embeddings; the
LM head runs on the group's batches and each rank keeps its own batch's logits or loss
(:meth:`~.region.Region.own_batch`). Every parameter's gradient then covers the group's batches, as the transformer
blocks' do (see :mod:`.layers` for how they are averaged). The vocabulary-split table is read, never called as a
module, so the forward rank 0 traces alone to partition a pipeline calls the same modules as the real one.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.tp.layers import DistributedModule, check_prescaled_input, tp_group_of_job
from shardkit.modelparallel.tp.region import Region
from shardkit.modelparallel.tp.transformer import DistributedTransformer
from shardkit.tensor_parallel import (
    ShardSpec,
    VocabParallelEmbedding,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    vocab_parallel_cross_entropy,
)

IGNORE_INDEX = -100
"""Labels equal to this take no part in the loss (as ``torch.nn.CrossEntropyLoss``'s default)."""

Inputs = tuple[Optional[torch.Tensor], ...]


class DistributedTransformerLMHead(DistributedModule):
    """smp's distributed transformer language model: ``word_embedding`` ``(vocab_size, hidden_size)`` plus
    ``position_embedding`` ``(num_positions, hidden_size)`` (plus ``token_type_embedding`` ``(num_token_types,
    hidden_size)`` when ``num_token_types > 0`` and token types are given), dropout, a :class:`DistributedTransformer`
    (``transformer``), a final ``layernorm`` when ``pre_layernorm`` (the pre-norm stack's output, GPT-2's ``ln_f``),
    and, with ``add_lm_head``, logits from a bias-free linear map tied to ``word_embedding.weight``. The other
    arguments are :class:`DistributedTransformerLayer`'s.

    ``forward(inputs)`` takes ``(input_ids, attention_mask, token_type_ids, position_ids, labels)`` (trailing entries
    may be left out, any may be None): ``input_ids`` ``[N, S]``; ``attention_mask`` ``[N, S]`` of 0 and 1, where 1
    marks a masked position (smp's convention, the opposite of Hugging Face's); ``position_ids`` default to
    ``0..S-1``. It returns the mean cross-entropy of the logits at ``[n, s]`` against ``labels[n, s]`` over the labels
    that are not ``-100`` (no shift: give a causal model its next tokens), the logits ``[N, S, vocab_size]`` when
    ``labels`` is None, or the hidden states ``[N, S, hidden_size]`` without ``add_lm_head``.

    Example::

        smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True})
        lm = smp.nn.DistributedTransformerLMHead(num_layers=2, num_attention_heads=4, attention_head_size=8,
                                                 hidden_size=32, intermediate_size=64, vocab_size=128,
                                                 num_positions=16, causal_mask_size=16, pre_layernorm=True,
                                                 post_layernorm=False)
        loss = lm((ids, None, None, None, next_ids))
    """

    def __init__(
        self,
        num_layers: int = 12,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        vocab_size: int = 30522,
        num_positions: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        num_token_types: int = 0,
        causal_mask_size: Optional[int] = None,
        add_cross_attention: bool = False,
        add_lm_head: bool = True,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
    ) -> None:
        super().__init__()
        who = f"smp.nn.DistributedTransformerLMHead(vocab_size={vocab_size})"
        if add_cross_attention:
            raise NotImplementedError(f"{who}: add_cross_attention=True is not built yet")
        group = tp_group_of_job(who)
        self.region = Region(group, smp_state.current().config.prescaled_batch)
        self.vocab_size, self.add_lm_head = vocab_size, add_lm_head
        self.word_embedding = _word_embedding(vocab_size, hidden_size, initializer_range, group is not None)
        self.declare_tp_slices({"word_embedding.weight": ShardSpec(0)}, group)
        self.position_embedding = _normal_embedding(num_positions, hidden_size, initializer_range)
        self.token_type_embedding = (
            _normal_embedding(num_token_types, hidden_size, initializer_range) if num_token_types > 0 else None
        )
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = DistributedTransformer(
            num_layers=num_layers,
            num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob,
            activation=activation,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            causal_mask_size=causal_mask_size,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
        )
        self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon) if pre_layernorm else None

    def forward(self, inputs: Inputs) -> torch.Tensor:
        if not isinstance(inputs, (tuple, list)) or not 1 <= len(inputs) <= 5:
            raise TypeError(
                "smp.nn.DistributedTransformerLMHead takes one tuple (input_ids, attention_mask, token_type_ids, "
                f"position_ids, labels), got {type(inputs).__name__}"
            )
        given: list[Optional[torch.Tensor]] = [*inputs, *[None] * (5 - len(inputs))]
        input_ids, attention_mask, token_type_ids, position_ids, labels = given
        if input_ids is None:
            raise ValueError("smp.nn.DistributedTransformerLMHead: input_ids (the first entry of the tuple) is None")
        hidden = self._embed(input_ids, token_type_ids, position_ids)
        hidden, _ = self.transformer((hidden, _additive_mask(attention_mask, hidden)))
        if self.layernorm is not None:
            hidden = self.region.layer_norm(self.layernorm, hidden)
        if not self.add_lm_head:
            return hidden
        return self._head(hidden, labels)

    def _embed(
        self, ids: torch.Tensor, token_types: Optional[torch.Tensor], positions: Optional[torch.Tensor]
    ) -> torch.Tensor:
        region, table = self.region, self.word_embedding
        if isinstance(table, VocabParallelEmbedding):
            words = self._split_lookup(table, ids)
        else:
            words = table(ids)
        if positions is None:
            positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
        hidden = words + F.embedding(positions, region.shared(self.position_embedding.weight))
        if self.token_type_embedding is not None and token_types is not None:
            hidden = hidden + F.embedding(token_types, region.shared(self.token_type_embedding.weight))
        return self.dropout(hidden)

    def _split_lookup(self, table: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
        """The vocabulary-split table's lookup of this rank's ``ids`` (the table is read, never called as a module,
        so the forward that rank 0 traces alone to partition calls the same modules as the real one)."""
        group = self.region.group
        if group is None:  # rank 0 tracing alone: this rank's rows only, no collectives
            return table.partial(ids)
        if self.region.prescaled:
            check_prescaled_input(self, group, ids)
            return reduce_from_tp(table.partial(ids), group.group)
        # each rank its own batch: look up the group's ids, sum the parts and keep this rank's batch
        return reduce_scatter_to_sequence(table.partial(self.region.batches(ids)), group.group, 0)

    def _head(self, hidden: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        region, weight = self.region, self.word_embedding.weight
        group = region.group
        if group is None:  # one rank holds the whole vocabulary (or traces alone: this rank's slice, padded)
            logits = F.linear(hidden, weight)
            if region.sliced:
                logits = F.pad(logits, (0, self.vocab_size - logits.shape[-1]))
            if labels is None:
                return logits
            return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)
        # every rank computes its vocabulary slice of the logits, for the group's batches (or the shared one)
        local = F.linear(region.enter(hidden, self), weight)
        if labels is None:
            return region.own_batch(gather_from_tp(local, group.group, dim=-1))
        targets = region.batches(labels)
        per_token = vocab_parallel_cross_entropy(local, targets.masked_fill(targets == IGNORE_INDEX, 0), group.group)
        per_token = region.own_batch(per_token)
        counted = (labels != IGNORE_INDEX).to(per_token.dtype)
        return (per_token * counted).sum() / counted.sum()


def _word_embedding(vocab: int, hidden: int, std: float, split: bool) -> Union[nn.Embedding, VocabParallelEmbedding]:
    if not split:
        return _normal_embedding(vocab, hidden, std)
    parallel = smp_state.current().parallel_state
    assert parallel is not None  # split only at a tensor-parallel degree above one
    return VocabParallelEmbedding(
        vocab, hidden, init_method=lambda full: nn.init.normal_(full, std=std), mesh=parallel.tp_mesh
    )


def _normal_embedding(rows: int, hidden: int, std: float) -> nn.Embedding:
    table = nn.Embedding(rows, hidden)
    nn.init.normal_(table.weight, std=std)
    return table


def _additive_mask(mask: Optional[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """smp's 0-1 ``[N, S]`` mask (1: masked) as the ``[N, 1, 1, S]`` scores offset the attention layers add."""
    if mask is None:
        return hidden.new_zeros(hidden.shape[0], 1, 1, hidden.shape[1])
    return mask[:, None, None, :].to(hidden.dtype) * torch.finfo(hidden.dtype).min
