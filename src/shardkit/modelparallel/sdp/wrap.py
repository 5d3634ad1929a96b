"""Shard one stage's module over its sharding group, and point the script's optimizer at the shards.

Applied right after the first step's partition plan is applied (``building.build.build_stage``), so rank 0's solitary
tracing forward ran on the plain module. The stage's module is wrapped in
:class:`~shardkit.nn.FullyShardedDataParallel` units with hybrid sharding: shards over the sharding group, replicas
over the replica group (see :mod:`.groups`); each module held in an ``nn.ModuleList`` (a transformer's layers) is its
own unit, gathered only while it runs (not under tensor parallelism, where the split layers keep their names).
``flatten_parameters=False`` gives each original parameter exactly one shard, so an optimizer's parameter groups
(weight decay on some, not on others, as AWS's scripts build them) carry over one for one.

Under ``"fp16"``/``"bf16"`` the shards stay FP32 and are the masters themselves (no second copy): FSDP's mixed
precision gathers them cast to the low dtype for compute (buffers too, as smp casts the whole model), and casts
each gradient to FP32 before it is reduce-scattered, so the shards' gradients are FP32 (still multiplied by the
loss scale under fp16: the optimizer divides them and checks them, see :mod:`~..precision.fp16_optimizer`).
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn

from shardkit.distributed import collectives as C
from shardkit.distributed.topology import Topology as NodeTopology
from shardkit.modelparallel.precision.fp16_optimizer import low_precision_dtype
from shardkit.modelparallel.sdp.groups import create_sdp_groups
from shardkit.modelparallel.sdp.optim_state import shard_whole_state
from shardkit.modelparallel.sdp.rules import KEY_MEANINGS, SdpSettings, settings_of
from shardkit.modelparallel.sdp.sync import ShardedGradientSync
from shardkit.modelparallel.state import SMPState
from shardkit.modelparallel.tp.distribute import split_parameter_ids
from shardkit.nn.fsdp import FullyShardedDataParallel
from shardkit.nn.fsdp.flat_param import FlatParamMeta
from shardkit.nn.fsdp.shard_layout import layout

logger = logging.getLogger("shardkit.modelparallel")


class ShardedStage:
    """The stage's module sharded over its sharding group: the unit to call, the gradient completion, and the
    mapping from the script's parameters to their shards."""

    def __init__(self, module: nn.Module, state: SMPState, device: torch.device, backward_passes_per_step: int) -> None:
        settings = settings_of(state.config)
        topo = state.topology
        originals = dict(module.named_parameters())
        # Parameters of distributed modules (split or not) cover their tensor-parallel group's batches.
        covering = split_parameter_ids(module) if topo.tp_size > 1 else frozenset()
        shard_group, replica_group = create_sdp_groups(topo, settings.degree, state.owned_groups)
        groups: Any = shard_group
        if topo.rdp_size > settings.degree:  # sharding groups that replicate each other: hybrid sharding
            groups = NodeTopology.from_groups(shard_group, replica_group, state.rdp_group)
        self.settings: SdpSettings = settings
        #: Whether the stage computes in the config's fp16/bf16 (with its FP32 shards as the masters).
        self.low_precision = low_precision_dtype(state.config) is not None
        unit_args = {
            "process_group": groups,
            "flatten_parameters": False,
            "bucket_cap_mb": max(1, round(settings.bucket_cap_mb)),
            "compute_device": device,
            **_mixed_precision_args(state.config),
        }
        if self.low_precision:  # smp's masters are FP32 copies of the model cast to the low dtype: start from those
            _round_through(module, low_precision_dtype(state.config))
        if topo.tp_size == 1:  # under TP the split layers' names must stay as they are (their slices are merged)
            for parent, name, block in _blocks(module):
                setattr(parent, name, FullyShardedDataParallel(block, **unit_args))
        self.root = FullyShardedDataParallel(module, **unit_args)
        flats = layout(self.root).flats
        #: id of each original parameter (every name of a tied one) -> its shard.
        self.shard_of: dict[int, nn.Parameter] = {}
        #: Each shard, with its layout (names from the stage's module, padding, this rank's place).
        self.metas: dict[int, FlatParamMeta] = {id(flat.shard): flat.meta for flat in flats}
        for flat in flats:
            for fqn in flat.fqns:
                if fqn in originals:
                    self.shard_of[id(originals[fqn])] = flat.shard
        shards = [(flat.shard, any(id(originals.get(fqn)) in covering for fqn in flat.fqns)) for flat in flats]
        self.sync = ShardedGradientSync(
            shards,
            state.tp_group if topo.tp_size > 1 else None,
            topo.tp_size,
            state.config.prescaled_batch,
            backward_passes_per_step,
        )
        self._adopted: weakref.WeakSet[Any] = weakref.WeakSet()
        #: The pipeline's stages (the global norm sums over them), None without a pipeline.
        self._pipeline: Optional[Any] = state.mp_group if topo.mp_size > 1 else None
        if topo.rank == 0:
            lines = "; ".join(f"{key}: {text}" for key, text in KEY_MEANINGS.items())
            logger.info("smp sharded data parallelism (degree %d) on FSDP: %s", settings.degree, lines)
            if topo.mp_size > 1:
                logger.warning(
                    "sharded_data_parallel_degree=%d with pipeline_parallel_degree=%d is a shardkit extension: smp "
                    "itself refuses sharded data parallelism with a pipeline, so this script would not run on "
                    "SageMaker's smp",
                    settings.degree,
                    topo.mp_size,
                )

    def hook_backward_roots(self, tensors: Iterable[torch.Tensor]) -> None:
        """Have a micro-batch's backward gather the stage's outermost unit first when it starts from ``tensors``.

        Under a pipeline a stage that is not the last one starts its backward from the activations it sent on,
        not from its module's outputs (placeholders there, outside autograd), so the unit's own hook on those
        outputs never fires; its parameters (gathered for the forward and freed after it) are gathered again here
        before autograd needs them (an activation-checkpointed layer recomputing inside the unit, a layer whose
        backward reads its weight)."""
        unit = self.root.fsdp_unit
        for tensor in tensors:
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(_gather_first, unit))

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace the script's parameters in ``optimizer`` by their shards (once), and have its ``step()`` clip
        the gradients' global norm to ``sdp_gradient_clipping`` first, as smp's sharded data parallelism does.

        Its ``_global_grad_norm`` then holds the norm before clipping (smp's attribute, read by AWS's scripts)."""
        if optimizer in self._adopted:
            return
        for group in optimizer.param_groups:
            seen: set[int] = set()
            params = []
            for p in group["params"]:
                shard = self.shard_of.get(id(p), p)
                if id(shard) not in seen:
                    seen.add(id(shard))
                    params.append(shard)
            group["params"] = params
        optimizer.register_step_pre_hook(self._clip_before_step)
        self._adopted.add(optimizer)

    def _clip_before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        norm = self.clip(self.settings.gradient_clipping)
        optimizer.__dict__["_global_grad_norm"] = norm

    def cut_whole_state(self, state_dict: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """An optimizer state dict given whole (before the partition) cut to this rank's shards (see
        :mod:`.optim_state`); ``optimizer`` already steps the shards."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return shard_whole_state(state_dict, params, self.metas)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip every shard's gradient by the whole model's global 2-norm (collective over the stage's ranks, and
        over the pipeline's stages when there are several)."""
        if self._pipeline is None:
            return self.root.clip_grad_norm_(max_norm)
        # This stage's norm (an infinite bound leaves the gradients as they are), then the sum of the stages' squares.
        squares = self.root.clip_grad_norm_(math.inf).to(torch.float32) ** 2
        C.all_reduce(squares, group=self._pipeline, label="smp_sdp_pipeline_grad_norm")
        total = squares.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shard, _ in self.sync.shards:
            if shard.grad is not None:
                shard.grad.detach().mul_(coef.to(shard.grad.device, shard.grad.dtype))
        return total


def _gather_first(unit: Any, grad: torch.Tensor) -> torch.Tensor:
    unit.pre_backward()
    return grad


def _round_through(module: nn.Module, low: Any) -> None:
    """Round the floating-point parameters' values to ``low`` in place, keeping their FP32 dtype."""
    with torch.no_grad():
        for param in module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(low).to(param.dtype)


def _mixed_precision_args(config: Any) -> dict[str, Any]:
    """FSDP's arguments for the config's low dtype: compute in it, FP32 shards, FP32 gradient reductions."""
    low = low_precision_dtype(config)
    if low is None:
        return {}
    return {"mixed_precision": True, "compute_dtype": low, "buffer_dtype": low, "fp32_reduce_scatter": True}


def _blocks(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """``(parent, name, block)`` for each module held in an ``nn.ModuleList`` that has parameters, outermost only
    (a transformer's layers): each becomes its own sharded unit, gathered only while it runs."""
    found: list[tuple[nn.Module, str, nn.Module]] = []
    inside: set[int] = set()
    for parent in module.modules():
        if id(parent) in inside or not isinstance(parent, nn.ModuleList):
            continue
        for name, block in parent.named_children():
            if any(True for _ in block.parameters()):
                found.append((parent, name, block))
                inside.update(id(m) for m in block.modules())
    return found
