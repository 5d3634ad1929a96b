"""``smp.nn``'s distributed transformer blocks: the reference implementations of smp's tensor-parallel page
(its appendix), split Megatron-style over the core's mappings.

Each block computes what its reference computes on this rank's batch. Attention heads and the feed-forward's
intermediate features are split across the tensor-parallel ranks: the query/key/value and first feed-forward
projections hold ``1 / tp_size`` of their output features (column-parallel), the attention output and second
feed-forward projections ``1 / tp_size`` of their input features (row-parallel), one reduction per block. Without
``prescaled_batch`` a block runs on the tensor-parallel group's batches (all-gathered on entry, reduce-scattered on
exit, so each rank gets its own batch back); the replicated parameters (layer norms, the row-parallel biases)
then have their gradients summed over the group, so every parameter of a block covers the same batches and is
averaged over the reduced-data-parallel group (see :mod:`.layers`).

Parameter names follow the reference (``query``, ``key``, ``value``, ``dense``, ``dense1``, ``dense2``,
``pre_layernorm``, ``layernorm``), each holding this rank's slice. Dropout is applied as the reference does, with
torch's random state (not the core's model-parallel RNG tracker): training with dropout is not reproducible
across degrees.

One departure from the appendix's text: with ``post_layernorm=False`` a block returns ``input + output`` (the appendix
returns the output alone). The appendix's code is abridged there; the pre-norm stacks smp distributes with that
setting (GPT-2: ``pre_layernorm=True, post_layernorm=False``, the layout ``smp.nn.huggingface.gpt2`` translates to)
keep their residual connections, and without them a translated GPT-2 would not compute GPT-2.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.tp.layers import DistributedModule, tp_group_of_job
from shardkit.modelparallel.tp.region import Region
from shardkit.tensor_parallel import ShardSpec, split_size


def _split_linear(full: nn.Linear, dim: int, region: Region) -> nn.Linear:
    """A linear holding this rank's part of ``full``: output features (``dim`` 0, column-parallel, bias split too)
    or input features (``dim`` 1, row-parallel, bias whole)."""
    rank, size = region.rank_and_size
    spec = ShardSpec(dim)
    weight = spec.shard(full.weight.detach(), rank, size) if size > 1 else full.weight.detach()
    # skip_init: the random state stays where the reference left it, so the next layers match it too; on the
    # reference's device (skip_init's own default is the CPU, whatever device the model is built under)
    local = skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=full.bias is not None, device=weight.device)
    with torch.no_grad():
        local.weight.copy_(weight)
        if full.bias is not None and local.bias is not None:
            bias = spec.shard(full.bias.detach(), rank, size) if dim == 0 and size > 1 else full.bias.detach()
            local.bias.copy_(bias)
    return local


def _reference_linear(in_features: int, out_features: int, normal_std: Optional[float]) -> nn.Linear:
    full = nn.Linear(in_features, out_features)
    if normal_std is not None:
        nn.init.normal_(full.weight, std=normal_std)
        nn.init.zeros_(full.bias)
    return full


class _Block(DistributedModule):
    def _setup(self, who: str, pre_layernorm: bool, post_layernorm: bool, hidden_size: int, eps: float) -> None:
        self.region = Region(tp_group_of_job(who), smp_state.current().config.prescaled_batch)
        self.use_pre_layernorm, self.use_post_layernorm = pre_layernorm, post_layernorm
        self.pre_layernorm = nn.LayerNorm(hidden_size, eps=eps) if pre_layernorm else None
        self.layernorm = nn.LayerNorm(hidden_size, eps=eps) if post_layernorm else None

    def _pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.region.layer_norm(self.pre_layernorm, x) if self.pre_layernorm is not None else x

    def _post(self, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.layernorm is None:  # a pre-norm block (GPT-2's): the residual stream, not normalised here
            return residual + out
        return self.region.layer_norm(self.layernorm, residual + out)


class DistributedTransformerOutputLayer(_Block):
    """smp's feed-forward block: ``dense1`` (hidden -> intermediate), the activation, ``dense2`` (back to hidden),
    dropout, then the residual, and ``layernorm`` when ``post_layernorm``; the intermediate features are split.

    Example::

        ffn = smp.nn.DistributedTransformerOutputLayer(hidden_size=64, intermediate_size=256, hidden_dropout_prob=0.0)
        y = ffn(x)    # x: (N, S, 64)
    """

    def __init__(
        self,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
        fp32_residual_addition: bool = False,
    ) -> None:
        super().__init__()
        who = f"smp.nn.DistributedTransformerOutputLayer(intermediate_size={intermediate_size})"
        if activation not in ("gelu", "relu"):
            raise ValueError(f"{who}: activation must be 'gelu' or 'relu', got {activation!r}")
        self._setup(who, pre_layernorm, post_layernorm, hidden_size, layernorm_epsilon)
        split_size(who, "intermediate_size", intermediate_size, self.region.rank_and_size[1])
        std = initializer_range if use_normal_initialization else None
        self.dense1 = _split_linear(_reference_linear(hidden_size, intermediate_size, std), 0, self.region)
        self.dense2 = _split_linear(_reference_linear(intermediate_size, hidden_size, std), 1, self.region)
        column, row = ShardSpec(0), ShardSpec(1)
        sliced = {"dense1.weight": column, "dense1.bias": column, "dense2.weight": row}
        self.declare_tp_slices(sliced, self.region.tp_group)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.activation = activation
        self.fp32_residual_addition = fp32_residual_addition

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.region.enter(self._pre(inp), self)
        hidden = F.linear(x, self.dense1.weight, self.dense1.bias)
        hidden = F.gelu(hidden) if self.activation == "gelu" else F.relu(hidden)
        out = self.region.leave(F.linear(hidden, self.dense2.weight))
        out = self.dropout(self.region.add_bias(out, self.dense2.bias))
        if self.fp32_residual_addition:
            return self._post(inp.float(), out.float()).to(inp.dtype)
        return self._post(inp, out)


class DistributedAttentionLayer(_Block):
    """smp's self-attention block: ``query``/``key``/``value`` projections, scaled dot-product attention with the
    additive ``attention_mask`` (and a causal mask when ``causal_mask_size`` is set), ``dense``, dropout, then the
    residual, and ``layernorm`` when ``post_layernorm``; the heads are split. ``forward((hidden_states,
    attention_mask))`` with ``hidden_states`` ``(N, S, H)`` and ``attention_mask`` ``(N, 1, 1, S)``. Cross attention is
    not built yet."""

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        cross_attention: bool = False,
        causal_mask_size: Optional[int] = None,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
    ) -> None:
        super().__init__()
        who = f"smp.nn.DistributedAttentionLayer(num_attention_heads={num_attention_heads})"
        if cross_attention:
            raise NotImplementedError(f"{who}: cross_attention=True is not built yet")
        self._setup(who, pre_layernorm, post_layernorm, hidden_size, layernorm_epsilon)
        size = self.region.rank_and_size[1]
        self.local_heads = split_size(who, "num_attention_heads", num_attention_heads, size)
        self.attention_head_size = attention_head_size
        width = num_attention_heads * attention_head_size
        std = initializer_range if use_normal_initialization else None
        self.query = _split_linear(_reference_linear(hidden_size, width, std), 0, self.region)
        self.key = _split_linear(_reference_linear(hidden_size, width, std), 0, self.region)
        self.value = _split_linear(_reference_linear(hidden_size, width, std), 0, self.region)
        self.dense = _split_linear(_reference_linear(width, hidden_size, std), 1, self.region)
        sliced = {f"{name}.{kind}": ShardSpec(0) for name in ("query", "key", "value") for kind in ("weight", "bias")}
        self.declare_tp_slices({**sliced, "dense.weight": ShardSpec(1)}, self.region.tp_group)
        self.dropout1 = nn.Dropout(attention_dropout_prob)
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        self.causal_mask_size = causal_mask_size

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], self.local_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden_states, attention_mask = inp
        x = self.region.enter(self._pre(hidden_states), self)
        q, k, v = (self._heads(F.linear(x, lin.weight, lin.bias)) for lin in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.attention_head_size)
        if self.causal_mask_size is not None:
            length = scores.shape[-1]
            future = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        scores = scores + self.region.batches(attention_mask)
        context = self.dropout1(F.softmax(scores, dim=-1)) @ v
        context = context.permute(0, 2, 1, 3).reshape(*x.shape[:-1], self.local_heads * self.attention_head_size)
        out = self.region.leave(F.linear(context, self.dense.weight))
        out = self.dropout2(self.region.add_bias(out, self.dense.bias))
        return self._post(hidden_states, out)


_LAYER_ARGS = (
    "num_attention_heads",
    "attention_head_size",
    "hidden_size",
    "attention_dropout_prob",
    "hidden_dropout_prob",
    "layernorm_epsilon",
    "initializer_range",
    "use_normal_initialization",
    "causal_mask_size",
    "pre_layernorm",
    "post_layernorm",
)


class DistributedTransformerLayer(DistributedModule):
    """smp's transformer layer: a :class:`DistributedAttentionLayer` then a :class:`DistributedTransformerOutputLayer`.
    ``forward((hidden_states, attention_mask))`` returns ``(output, attention_mask)``."""

    def __init__(
        self,
        num_attention_heads: int = 32,
        attention_head_size: int = 32,
        hidden_size: int = 1024,
        intermediate_size: int = 4096,
        attention_dropout_prob: float = 0.1,
        hidden_dropout_prob: float = 0.1,
        activation: str = "gelu",
        layernorm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        use_normal_initialization: bool = False,
        causal_mask_size: Optional[int] = None,
        add_cross_attention: bool = False,
        pre_layernorm: bool = False,
        post_layernorm: bool = True,
    ) -> None:
        super().__init__()
        if add_cross_attention:
            raise NotImplementedError("smp.nn.DistributedTransformerLayer: add_cross_attention=True is not built yet")
        args: dict[str, Any] = {name: value for name, value in locals().items() if name in _LAYER_ARGS}
        self.attention = DistributedAttentionLayer(**args)
        self.output = DistributedTransformerOutputLayer(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            hidden_dropout_prob=hidden_dropout_prob,
            activation=activation,
            layernorm_epsilon=layernorm_epsilon,
            initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm,
        )

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states, attention_mask = inp
        return self.output(self.attention((hidden_states, attention_mask))), attention_mask


class DistributedTransformer(DistributedModule):
    """smp's transformer: ``num_layers`` :class:`DistributedTransformerLayer` s in ``seq_layers`` (the other
    arguments are theirs). ``forward((hidden_states, attention_mask))`` returns ``(output, attention_mask)``."""

    def __init__(self, num_layers: int = 12, **layer_args: Any) -> None:
        super().__init__()
        self.seq_layers = nn.Sequential(*(DistributedTransformerLayer(**layer_args) for _ in range(num_layers)))

    def forward(self, inp: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.seq_layers(inp)
