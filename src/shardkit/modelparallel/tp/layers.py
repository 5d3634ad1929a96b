"""``smp.nn``'s distributed modules, as thin faces over the tensor-parallel core's layers and mappings.

smp's meaning of a distributed module: it computes what its reference module (``nn.Linear`` for
:class:`DistributedLinear`) computes on this rank's batch, while its parameters are split across the
tensor-parallel group. Without ``prescaled_batch`` each tensor-parallel rank holds its *own* batch: the module
all-gathers the group's batches, each rank applies its slice of the features to all of them, and the partial
results are reduce-scattered back, so rank ``r`` receives the full result for its own batch (smp's ``[tB, S, H/t]``
shuffle). With ``prescaled_batch`` the ranks hold the same batch and only the features are split.

Gradients: a split parameter's gradient then covers the batches of the whole tensor-parallel group (or the one
shared batch), so it is averaged over the reduced-data-parallel group only (see :func:`split_divisor`); the
other parameters are averaged over smp's whole data-parallel group.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.partitioning.trace import is_tracing
from shardkit.tensor_parallel import (
    ShardSpec,
    TensorParallelModule,
    TPGroup,
    check_same_input,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    register_split,
    scatter_to_tp,
    split_size,
    tp_sharding,
)


class DistributedModule(nn.Module):
    """Base of ``smp.nn``'s distributed modules (what ``smp.tp_register`` takes): their parameters are reduced
    over the reduced-data-parallel group (see the module docstring). :attr:`tp_slices` names the parameters
    (relative to the module) that hold a different slice on each tensor-parallel rank, with how each is split, for
    the modules that are not core layers themselves (a core layer, such as :class:`DistributedLinear`, names its own
    in ``tp_specs``); the others are equal there. The core's record (:func:`~shardkit.tensor_parallel.tp_sharding`)
    is what readers ask; this one lets a copy declare its slices again.
    """

    tp_slices: dict[str, ShardSpec] = {}  # noqa: RUF012 (read-only default; instances assign their own)

    def declare_tp_slices(self, slices: dict[str, ShardSpec], group: Optional[TPGroup]) -> None:
        """Set :attr:`tp_slices` (empty at degree one) and tell the core which of its children's parameters they
        are, so FSDP's and OSS's clipping and the checkpoints count each split parameter once (the core's layers
        name theirs themselves)."""
        self.tp_slices = dict(slices) if group is not None and group.size > 1 else {}
        self._tp_slice_group = group if self.tp_slices else None
        self._register_slices()

    def _register_slices(self) -> None:
        group = getattr(self, "_tp_slice_group", None)
        for name, spec in self.tp_slices.items():
            path, _, attr = name.rpartition(".")
            owner = self.get_submodule(path) if path else self
            if not isinstance(owner, TensorParallelModule):
                assert group is not None
                register_split(owner, attr, spec, group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``) declares its own children's slices to the core, as the original did."""
        super().__setstate__(state)
        self._register_slices()


def sliced_parameter_ids(root: nn.Module) -> frozenset[int]:
    """The parameters below ``root`` that hold a different slice on each tensor-parallel rank (a global norm sums
    them over the group and counts the others once)."""
    return frozenset(id(root.get_parameter(name)) for name in tp_sharding(root))


def split_divisor(topology_rdp: int, tp_size: int, prescaled_batch: bool) -> int:
    """What a distributed module's gradient sum over the reduced-data-parallel group is divided by: the number of
    batches it covers (each tensor-parallel rank's own, or the one they share)."""
    return topology_rdp if prescaled_batch else topology_rdp * tp_size


def tp_group_of_job(who: str) -> Optional[TPGroup]:
    """The smp job's tensor-parallel group, or None at degree one (the module then runs as its reference)."""
    state = smp_state.current()
    if state.parallel_state is None:
        return None
    return TPGroup.of(state.parallel_state.tp_mesh, who)


def check_prescaled_input(owner: nn.Module, columns: TPGroup, x: torch.Tensor) -> None:
    """With ``prescaled_batch`` the ranks of a tensor-parallel group must hold the same batch: compared once, at
    ``owner``'s first forward, on every rank of the group (a different one would train silently wrong)."""
    if getattr(owner, "_smp_input_checked", False):
        return
    try:
        check_same_input(x, columns, f"smp {type(owner).__name__}")
    except ValueError as exc:
        raise ValueError(
            f"{exc} With smp's prescaled_batch: true, shard the data by smp.rdp_rank() / smp.rdp_size(); with "
            "prescaled_batch: false, each tensor-parallel rank takes its own batch (smp.dp_rank() / smp.dp_size())."
        ) from None
    setattr(owner, "_smp_input_checked", True)  # noqa: B010 (nn.Module attributes are typed as tensors or modules)


def split_into(columns: TPGroup, batch_dim: int, x: torch.Tensor, prescaled: bool) -> torch.Tensor:
    """This rank's slice of the last dimension of the group's batches (all-gathered along ``batch_dim`` unless
    ``prescaled``).

    Without ``prescaled`` the slice is a plain view: its gradient, zero outside the slice, is summed over the ranks by
    the gather's reduce-scatter, which leaves each rank the whole gradient of its own batch. (Slicing with
    ``scatter_to_tp`` would all-gather the gradient first and the sum would count it ``tp_size`` times.)
    """
    if prescaled:
        return scatter_to_tp(x, columns.group, dim=-1)
    gathered = gather_from_sequence(x, columns.group, batch_dim)
    width = split_size("smp tensor parallelism", "the input's last dimension", x.shape[-1], columns.size)
    return gathered.narrow(-1, columns.rank * width, width)


def merge_from(columns: TPGroup, batch_dim: int, partial: torch.Tensor, prescaled: bool) -> torch.Tensor:
    """Sum the ranks' partial results and keep this rank's batch (reduce-scatter), or all of it (``prescaled``)."""
    if prescaled:
        return reduce_from_tp(partial, columns.group)
    return reduce_scatter_to_sequence(partial, columns.group, batch_dim)


class DistributedLinear(TensorParallelModule, DistributedModule):
    """smp's tensor-parallel ``nn.Linear``: ``in_features`` and ``out_features`` are the global sizes; each rank
    holds ``in_features / tp_size`` input columns of the weight (and the whole bias, added once after the sum).

    Initialised as ``nn.Linear`` is from the same random state, so the split layer starts from the weights the
    unsplit one would. Inputs are ``[N, ..., in_features]`` with the batch first.

    Example::

        smp.init({"tensor_parallel_degree": 2, "ddp": True})
        layer = smp.nn.DistributedLinear(64, 32)     # weight (32, 32) on each of the 2 ranks
        y = layer(x)                                 # (N, 32): nn.Linear(64, 32)(x), for this rank's x
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        who = f"smp.nn.DistributedLinear(in_features={in_features}, out_features={out_features})"
        group = tp_group_of_job(who)
        size = group.size if group is not None else 1
        self.in_features, self.out_features = in_features, out_features
        self.prescaled_batch = smp_state.current().config.prescaled_batch
        self.local_in_features = split_size(who, "in_features", in_features, size)
        self.tp_specs = {"weight": ShardSpec(1)} if group is not None else {}
        if group is not None:
            self.tp = group
        full = nn.Linear(in_features, out_features, bias=bias)  # torch's initialisation, from this random state
        with torch.no_grad():
            weight = full.weight if group is None else ShardSpec(1).shard(full.weight, group.rank, group.size)
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> DistributedLinear:
        """The distributed layer holding this rank's share of ``linear``'s weights."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        spec = layer.tp_specs.get("weight")
        with torch.no_grad():
            weight = linear.weight if spec is None else spec.shard(linear.weight, layer.tp.rank, layer.tp.size)
            layer.weight.copy_(weight)
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if not self.tp_specs:
            return F.linear(input_, self.weight, self.bias)
        if is_tracing():  # rank 0 traces alone to partition: the right shapes and costs, no collectives
            local = input_.narrow(-1, self.tp.rank * self.local_in_features, self.local_in_features)
            return F.linear(local, self.weight, self.bias)
        if self.prescaled_batch:
            check_prescaled_input(self, self.tp, input_)
        x = split_into(self.tp, 0, input_, self.prescaled_batch)
        out = merge_from(self.tp, 0, F.linear(x, self.weight), self.prescaled_batch)
        if self.bias is None:
            return out
        # Each rank adds the bias to its own batch; summing its gradient over the group makes it cover the same
        # batches as the weight's (with prescaled_batch the ranks' gradients are already equal).
        return out + (self.bias if self.prescaled_batch else copy_to_tp(self.bias, self.tp.group))

    def extra_repr(self) -> str:
        size = self.tp.size if self.tp_specs else 1
        return (
            f"in_features={self.in_features} ({self.local_in_features} on this rank of {size}), "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
