"""The partition, in two ordered steps: decide the plan (rank 0, shared with every rank), then build the stage.

:func:`decide_plan` checks that every rank holds the same model and inputs, broadcasts rank 0's weights, has
rank 0 trace and plan, and hands the plan to every rank (an error on rank 0 is raised on every rank).
:func:`build_stage` applies it on this rank and returns the
:class:`~shardkit.modelparallel.pipeline.execution.StageExecution` the pipeline schedule runs from then on.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import GroupLike, all_gather_objects, broadcast_object
from shardkit.distributed.device import current_cuda_device
from shardkit.distributed.model_check import check_same_model
from shardkit.distributed.rehearsal import local_rehearsal
from shardkit.modelparallel.activation_checkpointing import plan_checkpointing
from shardkit.modelparallel.building.delayed_init import check_delayable, is_delayed, materialize
from shardkit.modelparallel.building.holding import StageHolding
from shardkit.modelparallel.building.startup import broadcast_initial_state, check_same_inputs
from shardkit.modelparallel.config import ModelOptions
from shardkit.modelparallel.partitioning.auto_partition import Placement
from shardkit.modelparallel.partitioning.partitioner import check_plan, plan_partition
from shardkit.modelparallel.partitioning.plan import PipelinePlan
from shardkit.modelparallel.pipeline.execution import StageExecution
from shardkit.modelparallel.pipeline.grad_sync import GradientSync
from shardkit.modelparallel.pipeline.pp_communications import StageLink
from shardkit.modelparallel.pipeline.runtime import StageRuntime
from shardkit.modelparallel.pipeline.stage_groups import copy_groups
from shardkit.modelparallel.pipeline.virtual_stages import VirtualStageExecution, check_chunks, chunked_runtime
from shardkit.modelparallel.sdp.rules import check_no_stage_ties
from shardkit.modelparallel.sdp.sync import ShardedGradientSync
from shardkit.modelparallel.sdp.wrap import ShardedStage
from shardkit.modelparallel.state import SMPState
from shardkit.modelparallel.tp.distribute import split_reduction
from shardkit.modelparallel.tp.hf import whole_module_of
from shardkit.modelparallel.tp.layers import sliced_parameter_ids


def execution_device(state: SMPState, module: nn.Module) -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else where the parameters are (the CPU for
    a model built inside ``smp.delay_param_initialization``)."""
    if state.distributed and dist.get_backend() == "nccl":
        return current_cuda_device()  # cuda:LOCAL_RANK, selected now if the script did not
    if is_delayed(module):
        return torch.device("cpu")
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


def decide_plan(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], state: SMPState, options: ModelOptions
) -> tuple[PipelinePlan, Placement]:
    """Rank 0's partition plan for ``module`` called with ``(args, kwargs)``, on every rank (collective)."""
    cfg, topo = state.config, state.topology
    device = execution_device(state, module)
    delayed = is_delayed(module)
    if state.distributed and topo.world_size > 1:
        # Before the broadcast; a model that cannot be initialised late fails on every rank at once.
        check_same_model(module, state.world_group, "smp.DistributedModel", local_error=_delay_error(module))
        check_same_inputs((args, kwargs), state.mp_group)
        _check_same_delay(delayed, state)
        if not delayed:  # a delayed model is created from the same seeds on every rank instead
            broadcast_initial_state(module, state.world_group, device, split_by_tp(module, state))
    else:
        check_delayable(module)
    if delayed:
        device = torch.device("meta")  # plan on shapes alone: no process ever holds the whole model
    payload: tuple[Any, Any, Optional[str]] = (None, None, None)
    if topo.rank == 0:
        try:
            # Alone: tensor-parallel layers' collectives complete locally (their peers are not tracing).
            with local_rehearsal():
                plan, placement = plan_partition(
                    module,
                    args,
                    kwargs,
                    partitions=cfg.chunks,
                    auto_partition=cfg.auto_partition,
                    default_partition=cfg.default_partition,
                    memory_weight=cfg.effective_memory_weight,
                    measure_time=options.trace_execution_times,
                    measure_memory=options.trace_memory_usage,
                    # "gpu" traces where this rank computes: a CPU-only run (gloo, CPU parameters) on the CPU
                    trace_device=torch.device("cpu") if options.trace_device == "cpu" and not delayed else device,
                )
            check_plan(plan)
            if cfg.chunks > cfg.partitions:
                check_chunks(plan, cfg.partitions, cfg.chunks // cfg.partitions, cfg.auto_partition)
            payload = (plan, placement, None)
        except Exception as exc:
            if not (state.distributed and topo.world_size > 1):
                raise
            payload = (None, None, f"{type(exc).__name__}: {exc}")
            broadcast_object(payload, 0, state.world_group, "smp_partition_plan")
            raise
    if state.distributed and topo.world_size > 1:
        with warnings.catch_warnings():  # unpickling the outputs' tree specs warns about a torch deprecation
            warnings.simplefilter("ignore", FutureWarning)
            payload = broadcast_object(payload, 0, state.world_group, "smp_partition_plan")
    plan, placement, error = payload
    if error is not None:
        raise RuntimeError(f"smp could not partition the model (error on rank 0): {error}")
    return plan, placement


def split_by_tp(module: nn.Module, state: SMPState) -> Optional[tuple[frozenset[int], GroupLike]]:
    """The sliced parameters and the group whose first member they start from (this process's reduced-data-parallel
    group: each tensor-parallel rank keeps its own slice), None without tensor parallelism. The whole parameters of
    the same blocks (layer norms, row-parallel biases) start from rank 0's, like every other parameter: ranks
    whose random states differed when the model was built must not hold different copies of them."""
    if state.topology.tp_size == 1:
        return None
    return sliced_parameter_ids(module), state.rdp_group


def _check_same_delay(delayed: bool, state: SMPState) -> None:
    """Every rank built the model inside ``smp.delay_param_initialization``, or none did (else the initial
    broadcast would meet ranks that skip it)."""
    flags = all_gather_objects(delayed, state.world_group, "smp_delayed_init")
    if len(set(flags)) > 1:
        inside = [rank for rank, flag in enumerate(flags) if flag]
        raise ValueError(
            f"ranks {inside} built the model inside smp.delay_param_initialization and the others did not: build it "
            "the same way on every rank"
        )


def _agree_initialised(left: list[str], state: SMPState) -> None:
    """Raise on every rank when any rank's delayed initialisation left tensors uninitialised (NaN)."""
    every = all_gather_objects(left, state.world_group, "smp_delayed_init_check")
    found = sorted({name for names in every for name in names})
    if found:
        raise ValueError(
            "smp.delay_param_initialization: nothing initialised the parameters of these modules (neither their "
            f"reset_parameters() nor the Hugging Face model's _init_weights): {', '.join(found[:5])}"
            f"{'...' if len(found) > 5 else ''}; give them a reset_parameters() method, or build the model outside "
            "the context"
        )


def _delay_error(module: nn.Module) -> Optional[Exception]:
    try:
        check_delayable(module)
    except ValueError as exc:
        return exc
    return None


def build_stage(
    holding: StageHolding, plan: PipelinePlan, state: SMPState, options: ModelOptions, joining: bool
) -> StageExecution:
    """Apply ``plan`` on this rank: route the units, keep this stage's tensors, set up gradient reduction.

    Collective over the world (the groups for tied parameters are created on every rank).
    """
    topo = state.topology
    stage = topo.mp_rank
    device = execution_device(state, holding.module)
    runtime: StageRuntime
    if state.config.chunks > topo.mp_size:  # the runtime runs chunks; everything below sees this rank's share
        runtime = chunked_runtime(plan, topo, state.config.pipeline, state.p2p_group, state.mp_group, device)
        plan = runtime.rank_runtime.plan
    else:
        runtime = StageRuntime(plan, stage, StageLink(state.p2p_group, topo, state.mp_group), device)
    if state.config.sharded_data_parallel_degree > 1 and topo.mp_size > 1:  # before anything changes
        names = [name for name, _ in holding.module.named_parameters(remove_duplicate=False)]
        check_no_stage_ties(plan.holders, names)
    checkpointing = plan_checkpointing(holding.module, list(plan.units), manual=not state.config.auto_partition)
    # First: it refuses a module it cannot route before anything changes.
    runtime.install(holding.module, below=checkpointing)
    if is_delayed(holding.module):
        seed = all_gather_objects(torch.initial_seed(), state.world_group, "smp_delayed_init_seed")[0]
        holds = lambda name: stage in plan.holders.get(name, ())  # noqa: E731
        left = materialize(holding.module, holds, device, seed, whole_module_of)
        _agree_initialised(left, state)
    named = holding.take(plan, stage, device)
    sharded: Optional[ShardedStage] = None
    sync: Union[GradientSync, ShardedGradientSync]
    if state.config.sharded_data_parallel_degree > 1:  # after the plan: no sharded collective in rank 0's trace
        sharded = ShardedStage(holding.module, state, device, options.backward_passes_per_step)
        if sharded.low_precision:  # the trace ran in FP32: the first step finds the low-precision outputs
            runtime.forget_traced_shapes()
        sync = sharded.sync
    else:
        sync = _gradient_sync(holding, plan, named, state, options, device)
    make = VirtualStageExecution if state.config.chunks > topo.mp_size else StageExecution
    execution = make(
        runtime,
        sync,
        pipeline=state.config.pipeline,
        num_stages=topo.mp_size,
        mp_group=state.mp_group,
        dp_group=state.dp_group,
        average_grads=options.average_grads_across_microbatches,
        broadcast_buffers=state.config.ddp and topo.dp_size > 1 and options.broadcast_buffers,
        buffers=lambda: (buf for _, buf in holding.local_named_buffers()),
        joining=joining,
        checkpointed=_checkpointed_on(holding.module, checkpointing, plan, stage),
    )
    execution.sharded = sharded
    return execution


def _gradient_sync(
    holding: StageHolding,
    plan: PipelinePlan,
    named: dict[str, Any],
    state: SMPState,
    options: ModelOptions,
    device: torch.device,
) -> GradientSync:
    """The data-parallel (and tied-copy) gradient reduction of this rank's stage."""
    params = {n: t for n, t in named.items() if isinstance(t, nn.Parameter)}
    local_params = [p for n, p in params.items() if holding.holds(n)]
    return GradientSync(
        local_params,
        state.dp_group,
        state.topology.dp_size,
        copy_groups(plan, params, state),
        options.bucket_cap_mb,
        options.overlapping_allreduce,
        options.backward_passes_per_step,
        device,
        options.gradient_as_bucket_view,
        split_reduction(holding.module, state),
    )


def _checkpointed_on(
    root: nn.Module, swaps: list[tuple[nn.Module, Any]], plan: PipelinePlan, stage: int
) -> tuple[str, ...]:
    """Names of the activation-checkpointed modules that run on ``stage``."""
    swapped = {id(module) for module, _ in swaps}
    names = [name for name, module in root.named_modules() if id(module) in swapped]
    return tuple(
        name
        for name in names
        if any(s == stage and (u == "" or name == u or name.startswith(u + ".")) for u, s in plan.units.items())
    )
