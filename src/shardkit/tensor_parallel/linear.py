"""Linear layers split across the tensor-parallel ranks: by output features (column) or input features (row).

``Y = X A^T + b`` with ``A`` of shape ``(out_features, in_features)``. A column-parallel layer holds rows
``A_r`` of ``A`` (``out_features / t`` of them): each rank computes its slice of ``Y`` from the whole ``X``. A
row-parallel layer holds columns of ``A`` (``in_features / t``): each rank multiplies its slice of ``X`` and the
partial results are summed. A column layer followed by a row layer (attention's QKV then output projection; the
feed-forward's up then down projection) communicates once per direction: an all-reduce after the row layer in
forward, one before the column layer in backward.

With ``sequence_parallel=True`` the activations outside the pair stay split along the sequence dimension: the column
layer all-gathers them first, and the row layer reduce-scatters its output instead of all-reducing it. A replicated
parameter applied to the split activations (a norm's weight between the pairs) then gets only this rank's tokens'
gradient: use it as ``copy_to_tp(norm.weight)`` so the gradient is summed over the ranks (the row layer does that
for its own bias).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.tensor_parallel.checks import once_check_same_input
from shardkit.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from shardkit.tensor_parallel.sharding import ShardSpec, TensorParallelModule, TPGroup, init_shard_, split_size

InitMethod = Callable[[torch.Tensor], Any]


def _master_weight(layer: TensorParallelModule) -> torch.Tensor:
    """The full weight of a split linear layer, in the orientation it stores (gathered from every rank)."""
    spec = layer.tp_specs["weight"]
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    shards = gather_from_tp(weight.detach(), layer.tp.group, dim=spec.dim)
    return spec.unshard(shards.chunk(layer.tp.size, spec.dim))


class ColumnParallelLinear(TensorParallelModule):
    """A linear layer whose output features are split across the tensor-parallel ranks.

    Args:
        in_features, out_features, bias: as ``nn.Linear`` (the bias is split with the outputs, and starts at zero).
        gather_output: all-gather the output so every rank holds all ``out_features`` (else each keeps its
            ``out_features / t`` slice, the input a row-parallel layer with ``input_is_parallel=True`` expects).
        init_method: fills the full weight; each rank keeps its part (the same weights at any degree).
        stride: interleaved parts per rank, for fused weights (see :mod:`shardkit.tensor_parallel.sharding`).
        keep_master_weight_for_test: keep the full initial weight in ``self.master_weight``.
        mesh: the 1-D tensor-parallel mesh (the current state's when None).
        sequence_parallel: the input is split along ``sequence_dim``; gather it first.

    Example::

        up = ColumnParallelLinear(512, 2048, bias=False, gather_output=False)
        down = RowParallelLinear(2048, 512, bias=False, input_is_parallel=True)
        y = down(F.silu(up(x)))   # one all-reduce in forward
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        *,
        mesh: Optional[DeviceMesh] = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> None:
        super().__init__()
        who = f"ColumnParallelLinear(in_features={in_features}, out_features={out_features})"
        self.tp = TPGroup.of(mesh, who)
        if sequence_parallel and gather_output:
            raise ValueError(f"{who}: sequence_parallel=True keeps the output split; pass gather_output=False")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.sequence_dim = gather_output, sequence_parallel, sequence_dim
        self.output_size_per_partition = split_size(who, "out_features", out_features, self.tp.size, stride)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None
        self.tp_specs = {"weight": ShardSpec(0, stride), "bias": ShardSpec(0, stride)}
        full_shape = (out_features, in_features)
        self.master_weight = init_shard_(
            self.weight, full_shape, self.tp_specs["weight"], init_method, self.tp, keep_master_weight_for_test
        )

    def get_master_weight(self) -> torch.Tensor:
        """The full ``(out_features, in_features)`` weight, gathered from every rank (a collective)."""
        return _master_weight(self)

    def linear_weight(self) -> torch.Tensor:
        """This rank's weight as ``F.linear`` takes it, ``(out, in)`` (subclasses storing it transposed override)."""
        return self.weight

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence(input_, self.tp.group, self.sequence_dim)
        else:
            once_check_same_input(self, input_)
            x = copy_to_tp(input_, self.tp.group)
        out = F.linear(x, self.linear_weight(), self.bias)
        return gather_from_tp(out, self.tp.group) if self.gather_output else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({self.output_size_per_partition} "
            f"on this rank of {self.tp.size}), gather_output={self.gather_output}"
        )


class RowParallelLinear(TensorParallelModule):
    """A linear layer whose input features are split across the tensor-parallel ranks; the outputs are summed.

    Args:
        in_features, out_features, bias: as ``nn.Linear`` (the bias is not split; it is added once, after the sum,
            and starts at zero).
        input_is_parallel: the input already holds this rank's ``in_features / t`` slice (a column-parallel
            layer's output with ``gather_output=False``); else the full input is split here.
        init_method, stride, keep_master_weight_for_test, mesh: as :class:`ColumnParallelLinear`.
        sequence_parallel: reduce-scatter the output along ``sequence_dim`` instead of all-reducing it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        init_method: InitMethod = nn.init.xavier_normal_,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        *,
        mesh: Optional[DeviceMesh] = None,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
    ) -> None:
        super().__init__()
        who = f"RowParallelLinear(in_features={in_features}, out_features={out_features})"
        self.tp = TPGroup.of(mesh, who)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{who}: sequence_parallel=True needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.sequence_dim = (
            input_is_parallel,
            sequence_parallel,
            sequence_dim,
        )
        self.input_size_per_partition = split_size(who, "in_features", in_features, self.tp.size, stride)
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.tp_specs = {"weight": ShardSpec(1, stride)}
        full_shape = (out_features, in_features)
        self.master_weight = init_shard_(
            self.weight, full_shape, self.tp_specs["weight"], init_method, self.tp, keep_master_weight_for_test
        )

    def get_master_weight(self) -> torch.Tensor:
        """The full ``(out_features, in_features)`` weight, gathered from every rank (a collective)."""
        return _master_weight(self)

    def linear_weight(self) -> torch.Tensor:
        """This rank's weight as ``F.linear`` takes it, ``(out, in)`` (subclasses storing it transposed override)."""
        return self.weight

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            once_check_same_input(self, input_)
        x = input_ if self.input_is_parallel else scatter_to_tp(input_, self.tp.group)
        partial = F.linear(x, self.linear_weight())
        if not self.sequence_parallel:
            out = reduce_from_tp(partial, self.tp.group)
            return out + self.bias if self.bias is not None else out
        out = reduce_scatter_to_sequence(partial, self.tp.group, self.sequence_dim)
        if self.bias is None:
            return out
        # Each rank adds the bias to its own tokens only, so its gradient is summed over the ranks in backward.
        return out + copy_to_tp(self.bias, self.tp.group)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.input_size_per_partition} on this rank of {self.tp.size}), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
        )
