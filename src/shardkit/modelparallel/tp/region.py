"""The communication of smp's distributed transformer modules with the tensor-parallel group, over the core's
mappings: one :class:`Region` per module, shared by the transformer blocks (:mod:`.transformer`) and the LM head
(:mod:`.lm_head`).

Without ``prescaled_batch`` each tensor-parallel rank holds its own batch: a module runs on the group's batches
(gathered on entry), and each rank keeps its own batch's result on exit. With it the ranks share one batch and only
the features are split. At degree one, and in the forward rank 0 traces alone to partition a pipeline (the right
shapes, partial values), every step is the identity.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.modelparallel.partitioning.trace import is_tracing
from shardkit.modelparallel.tp.layers import check_prescaled_input
from shardkit.tensor_parallel import (
    TPGroup,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)


class Region:
    """The communication of one block: entering (the group's batches, or the shared one), leaving (sum the
    partial results, keep this rank's batch) and using a replicated parameter (its gradient summed over the group
    when the ranks hold different batches). At degree one, and in the forward rank 0 traces alone to partition
    (the right shapes, partial values), every step is the identity."""

    def __init__(self, group: Optional[TPGroup], prescaled: bool) -> None:
        self._group, self.prescaled = group, prescaled

    @property
    def group(self) -> Optional[TPGroup]:
        return None if is_tracing() else self._group

    @property
    def tp_group(self) -> Optional[TPGroup]:
        """The block's tensor-parallel group, also while rank 0 traces alone (for naming its slices)."""
        return self._group

    @property
    def sliced(self) -> bool:
        """Whether the block's split parameters differ between ranks (degree above one)."""
        return self._group is not None and self._group.size > 1

    @property
    def rank_and_size(self) -> tuple[int, int]:
        return (self._group.rank, self._group.size) if self._group is not None else (0, 1)

    def enter(self, x: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        if self.group is None:
            return x
        if self.prescaled:
            check_prescaled_input(owner, self.group, x)
            return copy_to_tp(x, self.group.group)
        return gather_from_sequence(x, self.group.group, 0)

    def batches(self, x: torch.Tensor) -> torch.Tensor:
        """A tensor without gradient (a mask) over the same batches as :meth:`enter`."""
        if self.group is None or self.prescaled:
            return x
        return gather_from_sequence(x, self.group.group, 0).detach()

    def leave(self, partial: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return partial
        if self.prescaled:
            return reduce_from_tp(partial, self.group.group)
        return reduce_scatter_to_sequence(partial, self.group.group, 0)

    def shared(self, param: torch.Tensor) -> torch.Tensor:
        if self.group is None or self.prescaled:
            return param
        return copy_to_tp(param, self.group.group)

    def add_bias(self, out: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``out`` plus a row-parallel layer's whole bias (added once, after the sum)."""
        return out if bias is None else out + self.shared(bias)

    def layer_norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        weight = self.shared(norm.weight) if norm.weight is not None else None
        bias = self.shared(norm.bias) if norm.bias is not None else None
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)

    def own_batch(self, everyone: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor computed, the same on every rank, for the group's batches (the output of
        :meth:`batches` or :meth:`enter`, after a reduction over the group). Backward sums the ranks' gradients
        first, so every rank's copy receives the gradient of every rank's batch."""
        if self.group is None or self.prescaled:
            return everyone
        rows = everyone.shape[0] // self.group.size
        return copy_to_tp(everyone, self.group.group).narrow(0, self.group.rank * rows, rows)
