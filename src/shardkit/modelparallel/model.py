"""``smp.DistributedModel``: the public wrapper. Documented arguments in, a frozen options object inside.

Life cycle: created (every rank holds the whole model) -> first ``model(...)`` inside an ``@smp.step``
partitions it (rank 0 traces and plans, every rank receives the plan, parameters and buffers are broadcast,
each stage keeps what it holds and releases the rest) -> every later forward runs the stage's share.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardkit.modelparallel import state as smp_state
from shardkit.modelparallel.building.build import build_stage, decide_plan
from shardkit.modelparallel.building.holding import StageHolding
from shardkit.modelparallel.checkpoints import checkpoint as ckpt
from shardkit.modelparallel.config import ModelOptions
from shardkit.modelparallel.partitioning.auto_partition import Placement
from shardkit.modelparallel.partitioning.trace import to_device
from shardkit.modelparallel.pipeline.execution import StageExecution
from shardkit.modelparallel.pipeline.pipeline_parallel import StepRun, StepStats
from shardkit.modelparallel.precision.fp16_optimizer import cast_inputs, cast_model, cast_outputs
from shardkit.modelparallel.sdp import state_dicts as sdp_state_dicts
from shardkit.modelparallel.sdp.wrap import ShardedStage
from shardkit.modelparallel.tp.distribute import distribute_marked
from shardkit.modelparallel.tp.state_dicts import cut_tp_slices, merge_tp_slices

__all__ = ["DistributedModel"]


class DistributedModel(nn.Module):
    """Split ``module`` into pipeline stages (and replicate it with ``ddp=True``); one per process.

    Call it and its :meth:`backward` only inside an ``@smp.step`` function. The partition happens on the first
    call: then parameters and buffers are broadcast from rank 0 and each stage keeps only what it holds
    (the others become empty tensors; use :meth:`local_parameters` for an optimizer built after that).
    Arguments as documented for smp: ``trace_device`` (``"cpu"``/``"gpu"``), ``trace_execution_times``,
    ``overlapping_allreduce``, ``backward_passes_per_step``, ``average_grads_across_microbatches``,
    ``bucket_cap_mb``, ``trace_memory_usage``, ``broadcast_buffers``, ``gradient_as_bucket_view``.

    What the tracing and bucketing options do here:

    - ``trace_device``: where rank 0 runs the tracing forward that decides the partition. ``"cpu"`` traces on
      the CPU (for a model too big for one accelerator; the model is copied there for the trace and left
      where it was); ``"gpu"`` traces on the device this rank computes on: CUDA under NCCL (a model built on
      the CPU is copied to it for the trace), else where the parameters are, so a CPU-only run traces on the
      CPU. ``model.placement.traced_on`` says where it ran.
    - ``trace_memory_usage``: measure, in one more forward with autograd recording, the memory each module
      leaves alive for backward, and balance stages with it (``placement.memory_measured``); without it the
      memory is estimated from the bytes each module's operators write.
    - ``gradient_as_bucket_view`` (``ddp=True`` with several replicas): gradients are views into the flat
      all-reduce buckets, as torch DDP's option, so no second copy of them exists.

    Every rank must build the same model (checked at the first step: a ``ValueError`` names the first
    differing parameter on every rank before anything is broadcast). Every rank of a replica must pass the
    same inputs to the step function (or, on the stages after the first, empty placeholder tensors, which take
    the first stage's: see :mod:`~.step_inputs`), and the forward's control flow must not depend on tensor
    values: the module call order of the first step is the plan for every later one (a different order raises).

    Example::

        smp.init({"partitions": 2, "microbatches": 4})
        model = smp.DistributedModel(Net())
        optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        @smp.step
        def train_step(model, x, y):
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        loss = train_step(model, x, y).reduce_mean()
        optimizer.step()
        print(model.placement)
    """

    def __init__(
        self,
        module: nn.Module,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        bucket_cap_mb: float = 25,
        trace_memory_usage: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
    ) -> None:
        state = smp_state.current()
        if state.model is not None:
            raise RuntimeError(
                "smp.DistributedModel was already created in this process: smp supports one DistributedModel per "
                "training script; wrap the top-level module that contains every part you train"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"smp.DistributedModel wraps a torch.nn.Module, got {type(module).__name__}")
        options = ModelOptions(
            trace_device,
            trace_execution_times,
            overlapping_allreduce,
            backward_passes_per_step,
            average_grads_across_microbatches,
            bucket_cap_mb,
            trace_memory_usage,
            broadcast_buffers,
            gradient_as_bucket_view,
        )
        if state.topology.tp_size > 1:
            distribute_marked(module, state)
        cast_model(module, state.config)  # "fp16"/"bf16": the model trains in that dtype (smp's FP16_Module)
        super().__init__()
        self.module = module
        self.options = options
        self.last_step_stats = StepStats()
        """Timing of the last step on this rank (step time, time blocked on receives, bytes sent)."""
        self._smp = state
        self._holding = StageHolding(module, state.mp_group)
        self._placement: Optional[Placement] = None
        self._execution: Optional[StageExecution] = None
        self._run: Optional[StepRun] = None
        self._hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._joining = False
        self._sdp_pending: Optional[Mapping[str, Any]] = None
        state.model = self
        state.on_reset.append(self._release)

    def get_module(self) -> nn.Module:
        """The module this model wraps (smp's ``model.get_module()``; the same object as ``model.module``)."""
        return self.module

    # ---- calls inside @smp.step ---------------------------------------------------------------------------

    @property
    def stage_execution(self) -> Optional[StageExecution]:
        """This rank's stage as the pipeline schedule runs it (None before the first step partitions)."""
        return self._execution

    @property
    def running_step(self) -> Optional[StepRun]:
        """The ``@smp.step`` call in progress on this model, else None."""
        return self._run

    @contextlib.contextmanager
    def running(self, run: StepRun) -> Iterator[None]:
        """Scope of one ``@smp.step`` call: ``model(...)`` and ``model.backward`` inside it belong to ``run``."""
        if self._run is not None:
            raise RuntimeError("an @smp.step function was called inside another @smp.step call")
        self._run = run
        try:
            yield
        finally:
            self._run = None

    def _active_run(self, what: str) -> StepRun:
        run = self._run
        if run is None or run.current is None:
            raise RuntimeError(
                f"cannot {what} outside an @smp.step function: smp runs the forward and backward once per "
                "micro-batch, so put model(...) and model.backward(loss) inside a function decorated with @smp.step"
            )
        return run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run this stage's share of the model on the current micro-batch (inside ``@smp.step`` only)."""
        run = self._active_run("call the DistributedModel")
        record = run.current
        assert record is not None
        args, kwargs = cast_inputs((args, kwargs), self._smp.config)  # "fp16"/"bf16": floating inputs in that dtype
        if self._execution is None:
            first = next(iter(self.module.parameters()), None)
            on = first.device if first is not None and not first.is_meta else torch.device("cpu")
            args, kwargs = to_device((args, kwargs), on)
            self._partition(args, kwargs)
        assert self._execution is not None
        args, kwargs = to_device((args, kwargs), self._holding.device)
        sharded = self._execution.sharded
        call = self.module if sharded is None else sharded.root  # gathers the shards around the module's forward
        with self._execution.runtime.invocation(record, (args, kwargs), first_microbatch=record.index == 0):
            return cast_outputs(call(*args, **kwargs), self._smp.config)

    def backward(
        self,
        tensors: Union[torch.Tensor, list[torch.Tensor], tuple[torch.Tensor, ...]],
        grad_tensors: Union[
            torch.Tensor, list[Optional[torch.Tensor]], tuple[Optional[torch.Tensor], ...], None
        ] = None,
    ) -> None:
        """Backward through the whole pipeline, like ``torch.autograd.backward(tensors, grad_tensors)``.

        Only inside ``@smp.step``; it runs when the schedule reaches this micro-batch's backward. Every stage
        runs the step function, but only the output stage (where the model's outputs are real) starts the
        backward from ``tensors``; the others start from the gradients later stages send them. So every rank
        must call it the same way. ``retain_graph``/``create_graph`` are not supported. Under ``"fp16": true``
        the tensors are multiplied (in FP32) by the optimizer's loss scale first.
        """
        run = self._active_run("call model.backward")
        record = run.current
        assert record is not None
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            gs: list[Optional[torch.Tensor]] = [None] * len(ts)
        else:
            gs = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors)
        if len(gs) != len(ts):
            raise ValueError(f"model.backward got {len(ts)} tensors but {len(gs)} grad_tensors")
        for t, g in zip(ts, gs):
            if g is None and t.numel() != 1:
                raise ValueError(f"model.backward needs grad_tensors for a non-scalar tensor of shape {tuple(t.shape)}")
        optimizer = self._smp.optimizer
        scale = optimizer.loss_scale if optimizer is not None else 1.0
        if scale != 1.0:  # in FP32: the scaled loss of an FP16 model would overflow
            ts = [t.float() * scale for t in ts]
            gs = [g if g is None else g.float() for g in gs]
        record.backward.append((ts, gs))
        record.backward_requested = True

    # ---- partition ----------------------------------------------------------------------------------------

    @property
    def placement(self) -> Optional[Placement]:
        """Which module runs on which stage and each stage's estimated cost (None before partitioning)."""
        return self._placement

    def _partition(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = self._smp
        plan, placement = decide_plan(self.module, args, kwargs, state, self.options)
        self._execution = build_stage(self._holding, plan, state, self.options, self._joining)
        self._placement = placement
        sharded = self._execution.sharded
        if sharded is not None:  # its shards are parameters of this model from now on
            self.sharded_module = sharded.root
            if self._sdp_pending is not None:
                pending, self._sdp_pending = self._sdp_pending, None
                self._load_sharded(sharded, pending)
        self._holding.load_pending()
        if state.optimizer is not None:
            state.optimizer.load_pending_state()
        for hook in list(self._hooks.values()):
            hook(self, state.optimizer)

    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle:
        """Run ``hook(model, optimizer)`` right after the partition (at once if it already happened)."""
        if self.partitioned:
            hook(self, self._smp.optimizer)
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def _release(self) -> None:
        """Undo the partition's changes to the wrapped modules (run by ``smp.reset``)."""
        if self._execution is not None:
            self._execution.close()

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Train with uneven inputs across replicas (``ddp=True``): wrap the training loop in it.

        A replica that runs out of batches keeps joining the others' gradient all-reduces with zeros until
        every replica is done; gradients stay divided by the full number of replicas (torch DDP's default).
        Every stage of a replica must run the same number of steps (they share the data).

        Example::

            with model.join():
                for x, y in loader:          # loaders of different lengths on different replicas
                    train_step(model, x, y)
                    optimizer.step()
        """
        state = self._smp
        if not state.config.ddp:
            raise ValueError("DistributedModel.join() is for uneven inputs across replicas: it needs ddp=True")
        if state.topology.dp_size == 1:
            yield
            return
        self._set_joining(True)
        try:
            yield
            execution = self._execution
            if execution is None:
                raise RuntimeError("join(): this replica ran no step, so the model was never partitioned")
            sync = execution.sync
            while sync.join_flag(0) > 0:  # another replica is still training: mirror its step
                execution.broadcast_buffers()
                if sync.join_flag(0) > 0:
                    sync.shadow_reduction()
        finally:
            self._set_joining(False)

    def _set_joining(self, joining: bool) -> None:
        self._joining = joining
        if self._execution is not None:
            self._execution.joining = joining
            self._execution.sync.joining = joining

    # ---- what this stage holds (see holding.py) -------------------------------------------------------------

    @property
    def partitioned(self) -> bool:
        """True once the first step has partitioned the model."""
        return self._execution is not None

    @property
    def execution_device(self) -> torch.device:
        """The device this stage computes on (where its held parameters live after the partition)."""
        return self._holding.device

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters this stage holds (all of them before the partition; under sharded
        data parallelism, this rank's shards after it)."""
        sharded = self._sharded()
        if sharded is not None:
            return sharded.root.named_parameters()
        return self._holding.local_named_parameters()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this stage holds."""
        return (param for _, param in self.local_named_parameters())

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, buffer) for the buffers this stage holds."""
        return self._holding.local_named_buffers()

    def local_buffers(self) -> Iterator[torch.Tensor]:
        """The buffers this stage holds."""
        return (buf for _, buf in self._holding.local_named_buffers())

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """(name, module) for the modules that run on this stage (all before the partition)."""
        return self._holding.local_named_modules()

    def local_modules(self) -> Iterator[nn.Module]:
        """The modules that run on this stage."""
        return (module for _, module in self._holding.local_named_modules())

    def first_holder_mask(self, params: Sequence[torch.Tensor]) -> list[bool]:
        """For each parameter, whether this stage is the lowest one holding it.

        Summing a per-parameter quantity (a squared gradient norm) over the stages only where this is True
        counts every parameter once, tied and replicated copies included. A tensor that is not one of the
        model's parameters counts here. Before the partition every parameter counts.
        """
        return self._holding.first_holder_mask(params)

    def holding_stages(self, name: str) -> Optional[tuple[int, ...]]:
        """The pipeline stages holding the parameter or buffer ``name`` (its first name if tied), in order; None
        before the partition, when every stage holds the whole model."""
        return self._holding.holding_stages(name)

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's parameters and buffers by their module names, marked ``_smp_is_partial`` (under sharded data
        parallelism, this rank's shards)."""
        sharded = self._sharded()
        if sharded is not None:
            return sdp_state_dicts.local_state_dict(sharded)
        return self._holding.local_state_dict()

    def _sharded(self) -> Optional[ShardedStage]:
        """The stage's sharded module once the partition applied sharded data parallelism, else None."""
        return None if self._execution is None else self._execution.sharded

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]  # gathered over stages
        """The whole model's state dict (keys of the unwrapped module), gathered from every stage.

        Collective over the replica's stages and tensor-parallel ranks: call it on every rank of the mp group. Under
        tensor parallelism the ranks' slices are merged into whole tensors (a plain model of the same class loads it).
        """
        sharded = self._sharded()
        if sharded is not None:
            stage = sdp_state_dicts.full_state_dict(sharded)
            if self._smp.topology.mp_size > 1:  # each stage's tensors, gathered over the pipeline
                stage = self._holding.merge_stages(stage)
            return merge_tp_slices(stage, self.module)
        if not self._holding.partitioned:
            return merge_tp_slices(self.module.state_dict(*args, **kwargs), self.module)
        return merge_tp_slices(self._holding.full_state_dict(), self.module)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a full or partial state dict (partial ones are first gathered from every stage: collective).

        Before the partition the model loads it whole; after it, each stage copies what it holds. Under tensor
        parallelism a full state dict's split tensors are cut to this rank's slices; a partial one holds them already.
        """
        if not ckpt.is_partial(state_dict):
            state_dict = cut_tp_slices(state_dict, self.module)
        if self._smp.config.sharded_data_parallel_degree > 1:  # the shards exist from the partition on
            sharded = self._sharded()
            if sharded is None:
                self._sdp_pending = state_dict
                return None
            return self._load_sharded(sharded, state_dict, strict)
        result = self._holding.load_state_dict(state_dict, strict)
        if self._smp.optimizer is not None:  # fp16/bf16: the FP32 masters take the loaded weights
            self._smp.optimizer.reload_model_params()
        return result

    def _load_sharded(self, sharded: ShardedStage, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load into the stage's shards; of a whole model's state dict, the part this stage holds."""
        if not ckpt.is_partial(state_dict) and self._smp.topology.mp_size > 1:
            state_dict = self._holding.as_stage_sees_it(state_dict)
        return sdp_state_dicts.load_into(sharded, state_dict, strict)

    def cpu(self) -> Any:
        """Gather every stage's parameters and buffers so this rank holds the whole model, on the CPU."""
        if self._sharded() is not None:
            raise ValueError(
                "model.cpu() under sharded data parallelism: the parameters are shards of the sharding group; take "
                "the whole model with model.state_dict() (gathered on every rank) and load it into a plain model"
            )
        self._holding.gather_to_cpu()
        if self._execution is not None:
            self._execution.runtime.device = self._holding.device
        return self
