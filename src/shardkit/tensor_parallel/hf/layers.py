"""Split layers built from a Hugging Face model's existing modules, keeping their weights and state-dict layout.

Each builder takes the module a plan names and returns its tensor-parallel replacement holding this rank's slice of
the module's own weights (every rank slices the same full tensor, so the split model computes what the unsplit one
did). Parameter names stay ``weight`` / ``bias``, and HF's ``Conv1D`` (GPT-2: ``y = x W + b`` with ``W`` stored
``(in, out)``, the transpose of ``nn.Linear``) keeps that orientation: the split model's per-rank state dicts merge
(``merge_state_dicts``) into exactly the unsplit model's, which a transposed square weight would silently break.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.tensor_parallel.embedding import VocabParallelEmbedding
from shardkit.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from shardkit.tensor_parallel.sharding import ShardSpec, TensorParallelModule


class Conv1DColumnParallel(ColumnParallelLinear):
    """A column-parallel layer storing its weight as HF's ``Conv1D`` does, ``(in_features, out_features / t)``.

    With ``stride`` 3 (a fused ``[q | k | v]`` projection), rank ``r`` holds its heads' columns of each of q, k and
    v, in that order, so ``split(out_features / (3 t))`` of its output gives this rank's q, k and v.
    """

    def __init__(
        self, conv: nn.Module, stride: int = 1, gather_output: bool = False, *, mesh: Optional[DeviceMesh] = None
    ) -> None:
        source = _Conv1DSource.of(conv)
        super().__init__(
            *source.features,
            bias=source.bias,
            gather_output=gather_output,
            init_method=source.init_method,
            stride=stride,
            mesh=mesh,
        )
        source.store_transposed(self, {**self.tp_specs, "weight": ShardSpec(1, stride)}, bias_spec=ShardSpec(0, stride))

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class Conv1DRowParallel(RowParallelLinear):
    """A row-parallel layer storing its weight as HF's ``Conv1D`` does, ``(in_features / t, out_features)``."""

    def __init__(self, conv: nn.Module, *, mesh: Optional[DeviceMesh] = None) -> None:
        source = _Conv1DSource.of(conv)
        super().__init__(
            *source.features, bias=source.bias, input_is_parallel=True, init_method=source.init_method, mesh=mesh
        )
        source.store_transposed(self, {"weight": ShardSpec(0)}, bias_spec=None)

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()


@dataclass(frozen=True)
class _Conv1DSource:
    """An HF ``Conv1D`` being split: its ``(in, out)`` weight, seen by the layers as the ``(out, in)`` they fill."""

    conv: nn.Module
    weight: nn.Parameter

    @classmethod
    def of(cls, conv: nn.Module) -> _Conv1DSource:
        weight = conv.weight
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise TypeError(f"expected HF Conv1D with a 2-D weight (in, out), got {type(conv).__name__}")
        return cls(conv, weight)

    @property
    def features(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def bias(self) -> bool:
        return getattr(self.conv, "bias", None) is not None

    def init_method(self, full: torch.Tensor) -> torch.Tensor:
        return full.copy_(self.weight.detach().t())

    def store_transposed(
        self, layer: TensorParallelModule, specs: dict[str, ShardSpec], bias_spec: Optional[ShardSpec]
    ) -> None:
        """Store ``layer``'s ``(out, in)`` slice as ``(in, out)``, as the ``Conv1D`` did, and copy the bias."""
        local = layer.weight
        assert isinstance(local, torch.Tensor)
        layer.weight = nn.Parameter(local.detach().t().contiguous(), requires_grad=self.weight.requires_grad)
        layer.tp_specs = specs
        _copy_bias(layer, self.conv, bias_spec)


def column_from_linear(
    linear: nn.Linear, gather_output: bool = False, *, mesh: Optional[DeviceMesh] = None
) -> ColumnParallelLinear:
    """``linear`` split by output features (this rank's slice of its weight and bias)."""
    sizes, bias, init = _linear_source(linear)
    layer = ColumnParallelLinear(*sizes, bias, gather_output, init, mesh=mesh)
    _copy_bias(layer, linear, layer.tp_specs["bias"])
    return layer


def row_from_linear(
    linear: nn.Linear, input_is_parallel: bool = True, *, mesh: Optional[DeviceMesh] = None
) -> RowParallelLinear:
    """``linear`` split by input features; its input is a column-parallel layer's split output (or, with
    ``input_is_parallel=False``, the whole input, of which each rank keeps its slice)."""
    sizes, bias, init = _linear_source(linear)
    layer = RowParallelLinear(*sizes, bias, input_is_parallel, init, mesh=mesh)
    _copy_bias(layer, linear, None)
    return layer


def vocab_embedding_from(embedding: nn.Embedding, *, mesh: Optional[DeviceMesh] = None) -> VocabParallelEmbedding:
    """``embedding`` with its vocabulary (rows) split; ``padding_idx`` and the norm options carry over."""
    full_weight = embedding.weight.detach()
    layer = VocabParallelEmbedding(
        embedding.num_embeddings,
        embedding.embedding_dim,
        padding_idx=embedding.padding_idx,
        max_norm=embedding.max_norm,
        norm_type=embedding.norm_type,
        scale_grad_by_freq=embedding.scale_grad_by_freq,
        sparse=embedding.sparse,
        init_method=lambda full: full.copy_(full_weight),
        mesh=mesh,
    )
    layer.weight.requires_grad_(embedding.weight.requires_grad)
    return layer


def _linear_source(linear: nn.Linear) -> tuple[tuple[int, int], bool, Callable[[torch.Tensor], torch.Tensor]]:
    """``(in, out)``, whether it has a bias, and an ``init_method`` filling the full weight with ``linear``'s."""
    full_weight = linear.weight.detach()
    return (linear.in_features, linear.out_features), linear.bias is not None, lambda full: full.copy_(full_weight)


def _copy_bias(layer: TensorParallelModule, source: nn.Module, spec: Optional[ShardSpec]) -> None:
    """Give ``layer`` this rank's part of ``source.bias`` (all of it when ``spec`` is None: not split) and
    ``source``'s ``requires_grad`` flags."""
    weight, source_weight = getattr(layer, "weight", None), getattr(source, "weight", None)
    if isinstance(weight, torch.Tensor) and isinstance(source_weight, torch.Tensor):
        weight.requires_grad_(source_weight.requires_grad)
    bias, full = getattr(layer, "bias", None), getattr(source, "bias", None)
    if bias is None or full is None:
        return
    tp = layer.tp
    with torch.no_grad():
        bias.copy_(full if spec is None else spec.shard(full.detach(), tp.rank, tp.size))
    bias.requires_grad_(full.requires_grad)
