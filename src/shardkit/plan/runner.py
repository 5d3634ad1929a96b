"""Run one rank of a real strategy for a few training steps and record what it held, sent and computed.

The first steps are warm-up (:func:`warmup_steps`: optimizers create their state lazily in the first; torch DDP
rebuilds its buckets in the order gradients arrived, with a broadcast, in the second, so strategies built on it
warm up twice); the next is the one reported: the state left after it, its collectives per phase and its FLOPs.
The peak is the highest over all steps (in practice the reported one, which runs with the optimizer state already
allocated). The run happens inside :func:`~shardkit.plan.peerless.peerless_world` and under one
:class:`~shardkit.plan.accountant.Accountant` opened before the model is built, so every byte the model and the
strategy create is seen.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.distributed import CommMeter, NodeLayout, Topology, count_comm_bytes, set_topology
from shardkit.distributed.node_traffic import active_layout, inter_node_share
from shardkit.memory.meter import optimizer_state_tensors
from shardkit.plan.accountant import STATE, Accountant, Category
from shardkit.plan.attention import DeviceAttention, attention_note, attention_target
from shardkit.plan.peerless import Mailbox, TorchTraffic, peerless_world
from shardkit.plan.strategies import Built
from shardkit.plan.tensor_parallel import tensor_parallel_state
from shardkit.tensor_parallel import step_check

PHASES = ("forward", "backward", "optimizer")
#: Strategies that warm up for two steps (torch DDP's bucket rebuild; SlowMo's averaging every third step);
#: the others are in their steady state from the second step on.
TWO_WARMUP_STEPS = ("ddp", "oss_ddp", "slowmo")


def warmup_steps(strategy: str) -> int:
    """Steps run before the reported one for ``strategy`` (the planner and the real-run measurement agree)."""
    return 2 if strategy in TWO_WARMUP_STEPS else 1


LossFn = Callable[[Any, Any], torch.Tensor]


class PlanError(ValueError):
    """The model, batch or options cannot be planned; the message says what to change."""


@dataclass
class PhaseTraffic:
    """One phase's collectives: shardkit's (from its comm meter) and torch-internal ones (from the group)."""

    #: Estimated bytes this rank sends, per collective kind (meter's ring model), shardkit collectives.
    wire_bytes: dict[str, int] = field(default_factory=dict)
    #: Payload bytes per kind, shardkit collectives.
    payload_bytes: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    #: Payload bytes per kind of collectives torch issued itself (DDP's buckets), not seen by the meter.
    torch_payload_bytes: dict[str, int] = field(default_factory=dict)
    torch_calls: dict[str, int] = field(default_factory=dict)
    #: The part of ``wire_bytes`` that crosses nodes, per kind (empty without a node layout).
    inter_node_bytes: dict[str, int] = field(default_factory=dict)
    #: Bytes copied into host memory (``"to_host"``) and back onto the device (``"to_device"``): CPU offload.
    host_copy_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class RankRun:
    """What one planned rank did in its reported step."""

    device: str
    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_phase: str
    peak_module: str
    state_bytes: int
    state_by_category: dict[str, int]
    phases: dict[str, PhaseTraffic]
    flops: dict[str, float]
    #: Host memory (state offloaded to the CPU): its peak, by category at that peak, and what stays between steps.
    host_peak_bytes: int = 0
    host_peak_by_category: dict[str, int] = field(default_factory=dict)
    host_peak_phase: str = ""
    host_state_bytes: int = 0
    #: The peak of device and host memory together (one memory, as in a CPU run).
    total_peak_bytes: int = 0
    #: How the run went where it differs from the plan (a CPU fallback).
    notes: tuple[str, ...] = ()


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device) if batch.device != device else batch
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def call_model(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """The output itself when it is a scalar (or has a scalar ``.loss``, as transformers' models return)."""
    loss = getattr(output, "loss", None) if not isinstance(output, torch.Tensor) else output
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    raise PlanError(
        "the model's output is not a scalar loss; pass loss_fn=lambda output, batch: ... to estimate() "
        "(for example the cross-entropy of the logits against the batch's targets)"
    )


def _diff(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


@contextlib.contextmanager
def _phase(acct: Accountant, name: str, traffic: TorchTraffic, out: dict[str, PhaseTraffic]) -> Iterator[None]:
    gc.collect(1)  # garbage from the phase before goes now, not whenever the collector happens to run (see _run_steps)
    acct.phase = name
    before_payload, before_calls = dict(traffic.payload_bytes), dict(traffic.calls)
    before_copies = dict(acct.transfers)
    with count_comm_bytes(CommMeter()) as meter, step_check.suspended():  # the algorithm's traffic alone
        yield
    torch_payload = _diff(traffic.payload_bytes, before_payload)
    torch_calls = _diff(traffic.calls, before_calls)
    # The group sees every collective; the ones shardkit issued are the meter's, the rest are torch's own.
    for kind, nbytes in meter.payload_bytes.items():
        left = torch_payload.get(kind, 0) - nbytes
        torch_payload[kind] = max(0, left)
        torch_calls[kind] = max(0, torch_calls.get(kind, 0) - meter.calls.get(kind, 0))
    torch_payload = {k: v for k, v in torch_payload.items() if v and k != "send"}
    inter = {k: v for k, v in meter.inter_node_bytes.items() if v}
    if active_layout() is not None:  # torch's own collectives span the world: a ring over every rank
        world = dist.get_world_size()
        share = inter_node_share(list(range(world)), "ring")
        for kind, payload in torch_payload.items():
            wire = payload * (2 if kind == "all_reduce" else 1) * (world - 1) / world
            inter[kind] = inter.get(kind, 0) + int(wire * share)
    out[name] = PhaseTraffic(
        dict(meter.wire_bytes),
        dict(meter.payload_bytes),
        dict(meter.calls),
        torch_payload,
        {k: v for k, v in torch_calls.items() if v and k != "send"},
        inter,
        _diff(acct.transfers, before_copies),
    )


def _label_state(acct: Accountant, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    acct.label(model.parameters(), Category.PARAMETERS)
    acct.label(model.buffers(), Category.PARAMETERS)
    acct.label((p.grad for p in model.parameters()), Category.GRADIENTS)
    for group in optimizer.param_groups:
        acct.label((p.grad for p in group["params"]), Category.GRADIENTS)
    acct.label(optimizer_state_tensors(optimizer), Category.OPTIMIZER_STATE)


#: A pipeline's forward and backward over every micro-batch, interleaved: ``(model, batch, loss_fn) -> None``.
ForwardBackward = Callable[[nn.Module, Any, LossFn], None]


def _step(
    acct: Accountant,
    built: Built,
    batch: Any,
    loss_fn: LossFn,
    traffic: TorchTraffic,
    phases: dict[str, PhaseTraffic],
    forward_backward: Optional[ForwardBackward],
) -> None:
    model, optimizer, after_step = built
    if forward_backward is not None:
        # The schedule interleaves micro-batches' forwards and backwards: one phase, counted as backward (the
        # cost model overlaps its traffic with the whole step's compute, as a pipeline does).
        with _phase(acct, "backward", traffic, phases):
            acct.phase = "pipeline forward/backward"
            forward_backward(model, batch, loss_fn)
            _label_state(acct, model, optimizer)
        phases.setdefault("forward", PhaseTraffic())
    else:
        _forward_backward(acct, model, optimizer, batch, loss_fn, traffic, phases)
    with _phase(acct, "optimizer", traffic, phases):
        optimizer.step()
        after_step()
        acct.phase = "optimizer"
        _label_state(acct, model, optimizer)
    acct.phase = "between steps"


def _forward_backward(
    acct: Accountant,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    loss_fn: LossFn,
    traffic: TorchTraffic,
    phases: dict[str, PhaseTraffic],
) -> None:
    with _phase(acct, "forward", traffic, phases):
        # The output is not kept: like ``loss_fn(model(x), y)`` in a training loop, only what autograd saved
        # stays alive through backward.
        loss = loss_fn(call_model(model, batch), batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise PlanError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    with _phase(acct, "backward", traffic, phases):
        loss.backward()
        del loss
        _label_state(acct, model, optimizer)


def run_rank(
    device: torch.device,
    build_model: Callable[[], nn.Module],
    wrap: Callable[[nn.Module, Optional[Topology]], Built],
    batch: Any,
    loss_fn: LossFn,
    world_size: int,
    host_limit_bytes: Optional[int] = None,
    nprocs_per_node: Optional[int] = None,
    rank: int = 0,
    forward_backward: Optional[ForwardBackward] = None,
    mailbox: Optional[Mailbox] = None,
    warmup: int = 2,
    backend: str = "nccl",
    build_in_host_memory: bool = False,
    state_to_device: bool = False,
    tensor_parallel: int = 1,
) -> RankRun:
    """Build, wrap and train ``rank`` of ``world_size`` on ``device`` for a few steps; see the module docstring.

    ``forward_backward`` replaces ``loss_fn(model(*batch), batch).backward()`` (a pipeline's schedule);
    ``backend`` is the planned run's (see :func:`~shardkit.plan.peerless.peerless_world`);
    ``build_in_host_memory``: the model is built and wrapped in host memory, so none of it counts as device memory
    until the strategy moves it there (CPU offload) or, with ``state_to_device``, until the wrapped model's
    parameters and buffers (FSDP: only this rank's shards) are moved to the device right after wrapping.
    ``tensor_parallel``: the model is built inside that tensor-parallel layout (:mod:`shardkit.plan.tensor_parallel`).
    """
    with (
        peerless_world(world_size, rank, mailbox, backend) as traffic,
        _nodes(nprocs_per_node) as topology,
        tensor_parallel_state(tensor_parallel),
    ):
        return _run_steps(
            device, build_model, wrap, batch, loss_fn, traffic, topology, host_limit_bytes, forward_backward, warmup,
            build_in_host_memory, state_to_device, backend,
        )  # fmt: skip


@contextlib.contextmanager
def _collector_at_phase_boundaries() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block: it frees storages caught in reference cycles at
    moments that depend on everything the process did before, so the same plan could differ from run to run;
    :func:`_phase` collects the young generations (what the run made) at each phase boundary instead. Cycles that
    hold tensors are rare in training code (torch's module trackers make them with gradient hooks, which is why the
    runner counts FLOPs itself rather than under ``FlopCounterMode``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _nodes(nprocs_per_node: Optional[int]) -> Iterator[Optional[Topology]]:
    """The world's node layout for strategies (hybrid sharding) and the comm meter, for the block; None without."""
    if nprocs_per_node is None:
        yield None
        return
    # Topology.from_env agrees on the layout by gathering every rank's environment, which mirrored peers cannot
    # answer; the planned layout is given, so its groups are made here (every node, then every cross-node group,
    # as every rank of a real job would make them).
    world = dist.group.WORLD
    assert world is not None
    rank = dist.get_rank()
    layout = NodeLayout.contiguous(dist.get_world_size(), nprocs_per_node)
    mine = [dist.new_group(list(ranks)) for ranks in (*layout.nodes, *layout.inter_node_ranks()) if rank in ranks]
    topology = Topology.planned(layout, rank, world, mine[0], mine[1])
    set_topology(topology)
    try:
        yield topology
    finally:
        set_topology(None)


def _run_steps(
    device: torch.device,
    build_model: Callable[[], nn.Module],
    wrap: Callable[[nn.Module, Optional[Topology]], Built],
    batch: Any,
    loss_fn: LossFn,
    traffic: TorchTraffic,
    topology: Optional[Topology],
    host_limit_bytes: Optional[int],
    forward_backward: Optional[ForwardBackward],
    warmup: int,
    build_in_host_memory: bool = False,
    state_to_device: bool = False,
    backend: str = "nccl",
) -> RankRun:
    phases: dict[str, PhaseTraffic] = {}
    # On meta, attention is answered as the planned device runs it (fused kernels), not by meta's math fallback.
    attention = DeviceAttention(attention_target(backend)) if device.type == "meta" else contextlib.nullcontext()
    with _collector_at_phase_boundaries(), Accountant(limit_bytes=host_limit_bytes) as acct, attention:
        traffic.on_buffer = acct.comm_buffer
        with acct.in_host_memory() if build_in_host_memory else contextlib.nullcontext():
            with torch.device(device):
                model = build_model()
            acct.name_modules(model)
            built = wrap(model, topology)
        if state_to_device:
            acct.move_to_device([*built[0].parameters(), *built[0].buffers()])
        acct.name_modules(built[0])
        batch = _to_device(batch, device)
        for _ in range(warmup):
            _step(acct, built, batch, loss_fn, traffic, {}, forward_backward)
            built[1].zero_grad()
        # FLOPs by the accountant itself (torch's formulas per operator): torch's FlopCounterMode would also track
        # modules with gradient hooks whose reference cycles keep activations alive until a garbage collection.
        acct.count_flops = True
        _step(acct, built, batch, loss_fn, traffic, phases, forward_backward)
        acct.count_flops = False
        flops: dict[str, float] = {"total": float(acct.flops)}
        state_bytes = acct.state_bytes()
        state: dict[str, int] = {c.value: acct.device.total(c) for c in STATE}
        peak, host_peak = acct.peak, acct.host_peak
        host_state = acct.host_state_bytes()
        built[1].zero_grad()
    notes: tuple[str, ...] = ()
    if isinstance(attention, DeviceAttention) and attention.calls:
        notes = (attention_note(attention),)
    return RankRun(
        device.type, peak.total, peak.by_category, peak.phase, peak.module, state_bytes, state, phases, flops,
        host_peak.total, host_peak.by_category if host_peak.total else {}, host_peak.phase, host_state,
        acct.total_peak, notes,
    )  # fmt: skip


__all__ = [
    "PHASES",
    "ForwardBackward",
    "PhaseTraffic",
    "PlanError",
    "RankRun",
    "call_model",
    "default_loss",
    "run_rank",
    "warmup_steps",
]
