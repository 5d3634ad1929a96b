"""``shardkit.modelparallel`` (smp): a ``DistributedModel`` and ``DistributedOptimizer``.

:class:`SMPSource` saves and loads the universal layout: every pipeline stage writes and reads only the tensors
it holds (data-parallel replicas split the writing), under the unwrapped module's names.

:class:`SMPAdapter` is the legacy ``full`` layout, still read: ``state_dict()`` of both gathers every pipeline
stage's part (a collective over the model-parallel group), so rank 0 holds and writes the whole model and
optimizer, with the unwrapped module's keys. Loading hands the full dicts to smp, which keeps what each stage
holds (or keeps them until the partition, if it has not happened yet); so a checkpoint loads under another
partition count or world size, and into the plain model.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

import shardkit.modelparallel as smp
from shardkit.checkpoint import validate
from shardkit.checkpoint.adapters.base import named_parameter_ids
from shardkit.checkpoint.adapters.fsdp import FSDPSource
from shardkit.checkpoint.adapters.full import FullStateAdapter
from shardkit.checkpoint.adapters.registry import isinstance_of
from shardkit.checkpoint.universal.source import Held, Span, UniversalSource
from shardkit.checkpoint.universal.split import Split, split_of, tp_splits
from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.checkpoints.checkpoint import state_key_map

_MODEL = ("shardkit.modelparallel.model", "DistributedModel")
_OPTIMIZER = ("shardkit.modelparallel.optimizer", "DistributedOptimizer")


def _refuse_sharded_state(optimizer: Optional[Any]) -> None:
    """The adapters read the optimizer's own ``state``, which ``shard_optimizer_state`` leaves empty (the state
    lives in the shards): saving would silently drop it."""
    if optimizer is not None and optimizer.is_state_sharded():
        raise ValueError(
            "shardkit checkpoints of an smp optimizer with 'shard_optimizer_state' are not supported yet: save "
            "optimizer.state_dict() (gathered from the shards, on every rank) with smp.save instead"
        )


def _refuse_master_weights(optimizer: Optional[Any]) -> None:
    """Under smp's ``fp16``/``bf16`` the inner optimizer steps FP32 masters, which are not the model's parameters:
    the universal layout would store the low-precision weights and silently drop the optimizer state."""
    if optimizer is None:
        return
    pairs = zip(optimizer.fp16_groups, optimizer.fp32_from_fp16_groups)
    if any(master is not param for params, masters in pairs for param, master in zip(params, masters)):
        raise ValueError(
            "shardkit universal checkpoints of an smp optimizer under 'fp16'/'bf16' are not supported yet: its FP32 "
            "master weights and their optimizer state are not the model's parameters, and would not be saved. Save "
            "with smp.save_checkpoint(path, tag, partial=True, model=model, optimizer=optimizer) instead, or pass "
            "only model= to save the model's low-precision weights"
        )


class SMPAdapter(FullStateAdapter):
    """smp model (and optimizer): gathered on save, each stage keeps its part on load."""

    strategy = "smp"

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        super().__init__(model, optimizer)
        if optimizer is not None and not isinstance_of(optimizer, *_OPTIMIZER):
            raise TypeError(
                f"an smp.DistributedModel is saved with its smp.DistributedOptimizer, got {type(optimizer).__name__};"
                " wrap it: smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), ...))"
            )
        _refuse_sharded_state(optimizer)

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An smp DistributedModel."""
        return isinstance_of(model, *_MODEL)

    def model_state(self) -> Mapping[str, Any]:
        return self.model.state_dict()  # gathered over the stages

    def expected_model(self) -> dict[str, validate.Shape]:
        # Tensors this stage released are empty: their shape is only known to the stage holding them.
        inner: nn.Module = self.model.module  # type: ignore[assignment]
        return {key: tuple(value.shape) if value.numel() else None for key, value in inner.state_dict().items()}

    def optimizer_groups(self) -> list[list[tuple[str, validate.Shape]]]:
        assert self.optimizer is not None
        inner: nn.Module = self.model.module  # type: ignore[assignment]
        return validate.optimizer_groups(self.optimizer.optimizer, named_parameter_ids(inner))

    def load_model(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(dict(state))  # held parts now, or at the partition


def stage_view(optimizer: torch.optim.Optimizer, held: set[int]) -> torch.optim.Optimizer:
    """A shallow copy of ``optimizer`` whose groups list only the parameters in ``held`` (by ``id``), sharing their
    state tensors: the optimizer a stage's checkpoint reads (a parameter another stage holds is empty here)."""
    view = copy.copy(optimizer)
    view.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in held]} for g in optimizer.param_groups]
    kept = {id(p) for g in view.param_groups for p in g["params"]}
    view.state = defaultdict(dict, {p: v for p, v in optimizer.state.items() if id(p) in kept})
    return view


class SMPSource(UniversalSource):
    """smp in the universal layout: each pipeline stage saves and loads the parameters and buffers it holds, whole.

    Names are the unwrapped module's (``model.module``); a tensor several stages hold (tied or replicated glue
    parameters) is one key, its holders and the data-parallel replicas split the writing. Before the first step
    partitions the model every rank holds the whole module, so a load then fills the full local module (smp's
    own way with full state dicts) and the partition keeps each stage's part; the inner optimizer's state follows
    its parameters the same way.

    Example::

        smp.init({"partitions": 2, "microbatches": 4, "ddp": True})
        model = smp.DistributedModel(Net())
        optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
        load_checkpoint("ckpt/step_100", model=model, optimizer=optimizer)  # saved by FSDP at 8 ranks, say
    """

    strategy = "smp"

    def __init__(self, model: nn.Module, optimizer: Optional[Any]) -> None:
        if optimizer is not None and not isinstance_of(optimizer, *_OPTIMIZER):
            raise TypeError(
                f"an smp.DistributedModel is saved with its smp.DistributedOptimizer, got {type(optimizer).__name__};"
                " wrap it: smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), ...))"
            )
        _refuse_sharded_state(optimizer)
        _refuse_master_weights(optimizer)
        self.model: Any = model
        self.optimizer = optimizer
        self._stage_view: Optional[torch.optim.Optimizer] = None

    @staticmethod
    def handles(model: nn.Module, optimizer: Optional[Any]) -> bool:
        """An smp DistributedModel."""
        return isinstance_of(model, *_MODEL)

    @classmethod
    def for_model(cls, model: Any, optimizer: Optional[Any]) -> UniversalSource:
        """The source of ``model``: once sharded data parallelism has sharded its stage, FSDP's source over it (the
        shards and the optimizer stepping them, under the unwrapped module's names, with smp's tensor-parallel
        splits); else an :class:`SMPSource`."""
        execution = model.stage_execution
        sharded = execution.sharded if execution is not None else None
        if sharded is None:
            return cls(model, optimizer)
        if optimizer is not None and not isinstance_of(optimizer, *_OPTIMIZER):
            raise TypeError(f"an smp.DistributedModel is saved with its smp.DistributedOptimizer, got {optimizer!r}")
        if smp.pp_size() > 1:  # each stage's unit shards part of the model over part of the job
            raise ValueError(
                f"universal checkpoints of sharded data parallelism with a pipeline (pipeline degree {smp.pp_size()}) "
                "are not supported yet: use smp.save_checkpoint (partial=True resumes at the same layout; a full "
                "checkpoint, partial=False, loads into any layout) and smp.resume_from_checkpoint"
            )
        return FSDPSource(sharded.root, optimizer.optimizer if optimizer is not None else None)

    def _replicas(self, name: str, split: Optional[Split]) -> tuple[int, int]:
        """Which of the ranks holding the same elements of ``name`` this one is, and how many hold them.

        A whole tensor is held alike by its stages' whole data-parallel group (smp's, which includes the
        tensor-parallel ranks); a tensor-parallel slab only by the ranks of the same tensor-parallel rank, the
        reduced-data-parallel group. Before the partition every stage holds every tensor."""
        stages = self.model.holding_stages(name)
        if stages is None:  # not partitioned yet: every stage holds everything
            stages = tuple(range(smp.pp_size()))
        width, within = (smp.rdp_size(), smp.rdp_rank()) if split is not None else (smp.dp_size(), smp.dp_rank())
        return stages.index(smp.pp_rank()) * width + within, len(stages) * width

    def held(self) -> list[Held]:
        """The parameters and buffers this stage holds under their first names: whole, or (tensor parallelism) this
        rank's slab of the full tensor, which the checkpoint stores as boxes of the full tensor without gathering."""
        if self.model.running_step is not None:
            raise RuntimeError(
                "a checkpoint of an smp model was requested inside an @smp.step call: save and load between steps"
            )
        inner: nn.Module = self.model.module
        persistent = set(inner.state_dict(keep_vars=True))
        splits = tp_splits(inner)
        out: list[Held] = []
        for name, tensor in [*self.model.local_named_parameters(), *self.model.local_named_buffers()]:
            if name not in persistent:
                continue  # a non-persistent buffer is not part of the model's state
            shape, split = split_of(splits, name, tensor.shape)
            span = Span(name, shape, 0, tensor.numel(), 0, split)
            out.append(Held(tensor, (span,), *self._replicas(name, split)))
        return out

    def local_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer inside the DistributedOptimizer; after the partition, a view of it restricted to
        this stage's parameters (the others are released here), whose loaded state :meth:`after_load` hands back."""
        if self.optimizer is None:
            return None
        inner: torch.optim.Optimizer = self.optimizer.optimizer
        if not self.model.partitioned:
            return inner
        if self._stage_view is None:
            self._stage_view = stage_view(inner, {id(p) for p in self.model.local_parameters()})
        return self._stage_view

    def load_optimizer(self, state_dict: dict[str, Any]) -> None:
        """Before the partition hand the state to the DistributedOptimizer, which keeps it until the partition and
        then loads only this stage's part (as it does for full state dicts); after it, load the stage's view."""
        if self.optimizer is not None and not self.model.partitioned:
            self.optimizer.load_state_dict(state_dict)
            return
        super().load_optimizer(state_dict)

    def group_fqns(self) -> Optional[list[list[str]]]:
        """Per optimizer parameter group, the names of all its parameters (on every stage)."""
        if self.optimizer is None:
            return None
        inner: torch.optim.Optimizer = self.optimizer.optimizer
        names = {id(p): name for name, p in self.model.module.named_parameters()}
        return [[names[id(p)] for p in group["params"] if id(p) in names] for group in inner.param_groups]

    def after_load(self) -> None:
        """Give the inner optimizer the state and hyper-parameters loaded into the stage's view of it; under
        ``fp16``/``bf16`` (a model loaded without its optimizer) the FP32 masters take the loaded weights."""
        smp_optimizer = smp_state.current().optimizer
        if smp_optimizer is not None:
            smp_optimizer.reload_model_params()
        view = self._stage_view
        if view is None or self.optimizer is None:
            return
        inner: torch.optim.Optimizer = self.optimizer.optimizer
        for group, loaded in zip(inner.param_groups, view.param_groups):
            group.update({k: v for k, v in loaded.items() if k != "params"})
        for p in (p for g in view.param_groups for p in g["params"]):
            if p in view.state:
                inner.state[p] = view.state[p]
        self._stage_view = None

    def aliases(self) -> dict[str, str]:
        """Tied names of the unwrapped module -> the first name, which is stored."""

        return {key: first for key, first in state_key_map(self.model.module).items() if key != first}
