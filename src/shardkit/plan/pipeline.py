"""Planning the smp pipeline: one run per stage, each as the first rank holding that stage.

A pipeline's ranks do not all hold the same thing: stage 0 keeps the embeddings and the most micro-batches in
flight, the last stage the output layer and the loss. So the planner runs the real smp code once per stage, each
time as the global rank smp places that stage on in the first model replica, and reports the stage with the
highest peak (the one that decides whether the job fits), naming every planned stage's peak in the notes. With
more than three stages, stage 1 stands for the middle ones (they hold the same kind of layers and fewer
micro-batches in flight than stage 0), which keeps an 8-stage plan at three runs. ``smp.init``
gets the strategy options as its config; ``ddp`` defaults to true when the world holds several replicas.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Optional, cast

import torch
from torch import nn

from shardkit.plan.peerless import Mailbox
from shardkit.plan.runner import Built, LossFn, RankRun, run_rank, warmup_steps
from shardkit.plan.strategies import PIPELINE, OptionError

#: smp's schedules with two chunks per rank in a V (``virtual_schedules.V_PIPELINES``, spelled here because a plan
#: without the pipeline must not import smp).
V_SCHEDULES = ("zbv", "dualpipev")


@functools.lru_cache(maxsize=8)
def _train_step(loss_fn: LossFn) -> Callable[..., Any]:
    """The ``@smp.step`` function for ``loss_fn``, made once: a script defines its step function once, and smp
    compares the stages' output layouts on a step function's first call only, so the planned step must not be a
    first call either."""
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    import shardkit.modelparallel as smp

    @smp.step
    def train_step(model: Any, *inputs: torch.Tensor, **named: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(*inputs, **named), named if named else inputs)
        model.backward(loss)
        return loss

    return cast(Callable[..., Any], train_step)


def pipeline_forward_backward(model: nn.Module, batch: Any, loss_fn: LossFn) -> None:
    """One ``@smp.step``: ``loss_fn(model(*micro_batch), micro_batch)`` and ``model.backward`` per micro-batch."""
    try:
        train_step = _train_step(loss_fn)
    except TypeError:  # an unhashable loss object: one step function per call (its first-call check is counted)
        train_step = _train_step.__wrapped__(loss_fn)
    if isinstance(batch, Mapping):
        train_step(model, **batch)
    else:
        train_step(model, *(batch if isinstance(batch, (tuple, list)) else (batch,)))


def pipeline_bubble(pipeline: str, partitions: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The fraction of a step each stage idles under smp's ``pipeline`` schedule, with equal forward,
    input-gradient and weight-gradient times: ``(p-1)/(m+p-1)`` for ``"interleaved"`` and ``"simple"``, less for
    the zero-bubble schedules once ``m >= p``, from their action lists run in simulation: ``"zero_bubble"`` (ZB-H1,
    every stage holding up to ``max(2, p-1)`` micro-batches) ``(p-1)/(3m+p-1)`` at 2 stages and ``p/(3m+p)`` from
    3, ``"zero_bubble_h2"`` (up to ``2p-1`` on the first stage) ``(p-1)/(3m+p-1)``. Over chunks (``virtual_stages``
    above 1, or ``"zbv"``'s and ``"dualpipev"``'s two per rank) from the schedule's tick grid, where a forward and
    a backward (ZBV, DualPipeV: each half of it) take one tick: ``(p-1)/(v*m+p-1)`` for interleaved 1F1B and
    ``(p-1)/(6m+p-1)`` for ZBV and DualPipeV (DualPipeV's forward/backward pairs run back to back, not
    overlapped)."""
    if pipeline in V_SCHEDULES or virtual_stages > 1:
        # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
        from shardkit.modelparallel.schedules.virtual_schedules import bubble_fraction, schedule_grid

        chunks_per_rank = 2 if pipeline in V_SCHEDULES else virtual_stages
        return bubble_fraction(schedule_grid(pipeline, partitions, chunks_per_rank, microbatches))
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    from shardkit.modelparallel.pipeline.pipeline_parallel import schedule_for

    # start-up cost: as above
    from shardkit.modelparallel.schedules.zb_schedules import simulate

    lists = [schedule_for(pipeline, s, partitions, microbatches) for s in range(partitions)]
    return simulate(lists).mean_bubble()


def model_blocks(model: nn.Module) -> Optional[int]:
    """How many blocks (layers) the model repeats: the length of its longest ``nn.ModuleList``, None without one."""
    lengths = [len(m) for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lengths) if lengths else None


def chunk_problem(pipeline: str, partitions: int, virtual_stages: int, microbatches: int, blocks: Optional[int]) -> str:
    """Why a schedule over chunks (``virtual_stages`` per rank, or a V) does not suit the model, or "":
    smp's own refusal (the V's ``m >= 2p``, the interleaved rounds of ``p`` micro-batches), or ``blocks`` layers
    that do not split into equal chunks (the longest chunk would pace every tick, and the predicted bubble
    would not hold)."""
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    from shardkit.modelparallel.schedules.virtual_schedules import check_virtual_config

    try:
        check_virtual_config(partitions, virtual_stages, microbatches, pipeline)
    except ValueError as exc:
        return str(exc)
    chunks = partitions * (2 if pipeline in V_SCHEDULES else virtual_stages)
    if blocks is not None and blocks % chunks:
        return (
            f"the model's {blocks} layers do not split into {chunks} equal chunks ({partitions} stages x "
            f"{chunks // partitions} per rank): the longest chunk would pace the schedule"
        )
    return ""


def smp_config(options: Mapping[str, Any], world_size: int) -> dict[str, Any]:
    """The ``smp.init`` config: the options, with ``ddp`` on when there are several replicas."""
    config = {"partitions": 2, **options}
    try:
        partitions = int(config["partitions"])
    except (TypeError, ValueError):
        raise OptionError(f"smp partitions must be an int, got {config['partitions']!r}") from None
    if partitions < 1 or world_size % partitions:
        raise OptionError(f"smp partitions={partitions} must be at least 1 and divide world_size {world_size}")
    config.setdefault("ddp", world_size > partitions)
    return config


def builder(config: Mapping[str, Any], optimizer: type, optimizer_options: Mapping[str, Any]) -> Any:
    """``(model, topology) -> Built``: ``smp.init(config)``, the DistributedModel and DistributedOptimizer."""

    def build(model: nn.Module, topology: Optional[Any]) -> Built:
        # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
        import shardkit.modelparallel as smp

        if not smp.is_initialized():  # a model of smp.nn layers was built after smp.init (see initialised_build)
            smp.init(dict(config))
        wrapped = smp.DistributedModel(model, trace_device="gpu")  # "gpu": trace where the parameters are (meta)
        opt = smp.DistributedOptimizer(optimizer(wrapped.parameters(), **optimizer_options))
        # Not a torch Optimizer subclass, but it has what the runner uses: step, zero_grad, param_groups, state.
        return wrapped, cast(torch.optim.Optimizer, opt), lambda: None

    return build


def initialised_build(config: Mapping[str, Any], model_fn: Callable[[], nn.Module]) -> nn.Module:
    """``smp.init(config)``, then ``model_fn()``: smp's tensor-parallel layers (``smp.nn``) read the layout when
    they are built, so under ``tensor_parallel_degree`` a script builds its model after ``smp.init``."""
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    import shardkit.modelparallel as smp

    smp.init(dict(config))
    return model_fn()


def stage_rank(config: Mapping[str, Any], world_size: int, stage: int) -> int:
    """The global rank holding pipeline ``stage`` in the first model replica (tensor-parallel rank 0, reduced data
    rank 0), under the config's ``placement_strategy``."""
    # start-up cost: as above
    from shardkit.modelparallel.topology import Topology

    topology = Topology(
        world_size, 0, int(config["partitions"]), str(config.get("placement_strategy", "cluster")),
        int(config.get("tensor_parallel_degree", 1)),
    )  # fmt: skip
    return topology.rank_of(stage, 0)


def plan_stages(
    device: torch.device,
    model_fn: Callable[[], nn.Module],
    batch: Any,
    loss_fn: LossFn,
    world_size: int,
    optimizer: type,
    optimizer_options: Mapping[str, Any],
    options: Mapping[str, Any],
    host_limit: Optional[int],
    nprocs_per_node: Optional[int],
    backend: str = "nccl",
) -> RankRun:
    """Run every stage's first rank; the run of the stage with the highest peak, every stage's peak in its notes."""
    # start-up cost: smp imports shardkit.nn and torch._dynamo, which plans without the pipeline never need
    import shardkit.modelparallel as smp

    config = smp_config(options, world_size)
    partitions = int(config["partitions"])
    runs: list[RankRun] = []
    mailbox = Mailbox()  # stage s receives what stages before it sent (activation shapes, shared objects)
    stages = sorted({0, 1, partitions - 1}) if partitions > 3 else list(range(partitions))
    for stage in stages:
        try:
            runs.append(
                run_rank(
                    device,
                    functools.partial(initialised_build, config, model_fn),
                    builder(config, optimizer, optimizer_options),
                    batch,
                    loss_fn,
                    world_size,
                    host_limit,
                    nprocs_per_node,
                    rank=stage_rank(config, world_size, stage),
                    forward_backward=pipeline_forward_backward,
                    mailbox=mailbox,
                    warmup=warmup_steps(PIPELINE),
                    backend=backend,
                )
            )
        finally:
            smp.reset()
    worst = max(range(len(runs)), key=lambda i: runs[i].peak_bytes)
    peaks = ", ".join(f"stage {stage} {run.peak_bytes / 2**30:.2f} GiB" for stage, run in zip(stages, runs))
    chosen = runs[worst]
    chosen.notes = (*chosen.notes, f"pipeline stage {stages[worst]} has the highest peak ({peaks})")
    return chosen


__all__ = [
    "V_SCHEDULES",
    "builder",
    "chunk_problem",
    "initialised_build",
    "model_blocks",
    "pipeline_bubble",
    "pipeline_forward_backward",
    "plan_stages",
    "smp_config",
    "stage_rank",
]
