"""The step-time model: FLOPs at the device's throughput, bytes at the link's bandwidth, overlap by phase.

For one planned rank the planner knows, per phase of the reported step (forward, backward, optimizer), the
collectives it issued (bytes each rank sends, ring model, and how many calls) and the FLOPs of the whole step
(torch's per-operator formulas, ``torch.utils.flop_counter``). The model:

- compute: forward = 1/3 of the FLOPs, backward = 2/3 (a matmul's backward is two matmuls), at
  ``DeviceSpec.flops_per_s`` (a sustained rate, not the datasheet peak);
- communication of a phase: ``sum(bytes) / LinkSpec.bytes_per_s + calls * LinkSpec.latency_s``; with a node
  layout, the bytes that stay inside a node go at ``LinkSpec.intra_bytes_per_s`` instead;
- on accelerators (``overlap=True``, the NCCL plan) forward and backward collectives overlap their phase's compute
  (every shardkit strategy and torch DDP issue them asynchronously: gathers are prefetched, reductions run while
  earlier layers compute), except one collective per phase that nothing can hide (the first gather of forward,
  the last reduction of backward), so a phase costs ``max(compute, communication) + one collective``;
- on CPUs (``overlap=False``, the gloo plan) communication and compute share the same cores, so a phase costs
  ``compute + communication``: measured on this project's 2-core machine (``shardkit bench plan-time``), steps
  followed the sum, not the maximum; nothing overlaps across phases either way;
- a pipeline (smp) runs one stage's FLOPs per rank, stretched by its bubble: with ``p`` partitions and ``m``
  micro-batches 1F1B leaves every stage idle ``p - 1`` micro-batch slots, so forward and backward take
  ``(m + p - 1) / m`` times their busy time; the zero-bubble schedules idle less (the fraction comes from
  simulating their action lists, :func:`shardkit.plan.pipeline.pipeline_bubble`);
- the optimizer phase is memory-bound: it reads and writes the rank's parameters, gradients and optimizer state
  once at ``DeviceSpec.memory_bytes_per_s``, then its collectives (OSS's parameter exchange) run exposed;
- CPU offload: state in host memory is stepped by the CPU, read and written once at
  ``DeviceSpec.host_memory_bytes_per_s`` (after the device's part); the copies between host and device cross
  ``DeviceSpec.host_link_bytes_per_s`` and, like collectives, overlap their phase's compute (FSDP uploads a shard
  on its gather stream and downloads a gradient on its reduce stream).

It is a first-order model for ranking strategies against each other, not a timing: measured steps also pay for
kernel launches, the first gather that nothing hides, and links shared by several ranks.

Example::

    seconds = step_seconds(flops=6.0e12, phases=run.phases, state_bytes=run.state_bytes,
                           device=DeviceSpec(), link=LinkSpec())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from shardkit.utils.checks import at_least


class PhaseBytes(Protocol):
    wire_bytes: dict[str, int]
    calls: dict[str, int]
    torch_payload_bytes: dict[str, int]
    torch_calls: dict[str, int]
    inter_node_bytes: dict[str, int]
    host_copy_bytes: dict[str, int]


@dataclass(frozen=True)
class DeviceSpec:
    """What one accelerator sustains."""

    #: Sustained FLOP/s of the training kernels (default 300 TFLOP/s: an H100 in bf16 at ~40% of peak).
    flops_per_s: float = 300e12
    #: Memory bandwidth in bytes/s (default 3 TB/s, an H100's HBM3).
    memory_bytes_per_s: float = 3e12
    #: Memory per device in bytes (default 80 GiB).
    memory_bytes: int = 80 * 2**30
    #: Bytes/s between host memory and the device, each way (default 25 GB/s: what a PCIe 4.0 x16 link sustains
    #: of its 32 GB/s).
    host_link_bytes_per_s: float = 25e9
    #: Host memory bandwidth one rank's CPU optimizer step gets (default 50 GB/s: a two-socket server's
    #: ~400 GB/s shared by eight ranks).
    host_memory_bytes_per_s: float = 50e9

    def __post_init__(self) -> None:
        for name in ("flops_per_s", "memory_bytes_per_s", "memory_bytes", "host_link_bytes_per_s",
                     "host_memory_bytes_per_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceSpec.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class LinkSpec:
    """The links a rank's collectives cross.

    Without a node layout every byte goes at ``bytes_per_s`` (the slowest link on the ring). With one
    (``nprocs_per_node``), bytes that cross nodes go at ``bytes_per_s`` and the rest at ``intra_bytes_per_s``.
    """

    #: Bytes per second one rank sends between nodes (default 25 GB/s: one 200 Gb/s network port per GPU).
    bytes_per_s: float = 25e9
    #: Bytes per second one rank sends inside its node (default 150 GB/s, NVLink-class).
    intra_bytes_per_s: float = 150e9
    #: Fixed cost of one collective in seconds (default 30 microseconds).
    latency_s: float = 30e-6

    def __post_init__(self) -> None:
        for name in ("bytes_per_s", "intra_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LinkSpec.{name} must be > 0, got {getattr(self, name)!r}")
        at_least(self, "latency_s", self.latency_s, 0)


def wire_bytes(phase: PhaseBytes, world_size: int) -> dict[str, int]:
    """Bytes this rank sends in ``phase`` per collective kind: shardkit's meter plus torch's own (ring model)."""
    out = dict(phase.wire_bytes)
    share = (world_size - 1) / world_size if world_size > 1 else 0.0
    for kind, payload in phase.torch_payload_bytes.items():
        factor = 2 * share if kind == "all_reduce" else share
        out[kind] = out.get(kind, 0) + int(payload * factor)
    return out


def comm_seconds(phase: PhaseBytes, world_size: int, link: LinkSpec, with_nodes: bool = False) -> float:
    """Time of ``phase``'s collectives if nothing overlapped them (``with_nodes``: split by the node layout)."""
    calls = sum(phase.calls.values()) + sum(phase.torch_calls.values())
    total = sum(wire_bytes(phase, world_size).values())
    if not with_nodes:
        return total / link.bytes_per_s + calls * link.latency_s
    inter = sum(phase.inter_node_bytes.values())
    return inter / link.bytes_per_s + (total - inter) / link.intra_bytes_per_s + calls * link.latency_s


def _copy_seconds(phase: PhaseBytes | None, device: DeviceSpec) -> float:
    """Time of a phase's copies between host and device (the busier direction: the link is full-duplex)."""
    if phase is None or not phase.host_copy_bytes:
        return 0.0
    return max(phase.host_copy_bytes.values()) / device.host_link_bytes_per_s


def step_seconds(
    flops: float,
    phases: Mapping[str, PhaseBytes],
    state_bytes: int,
    world_size: int,
    device: DeviceSpec,
    link: LinkSpec,
    with_nodes: bool = False,
    bubble: float = 1.0,
    host_state_bytes: int = 0,
    overlap: bool = True,
) -> dict[str, float]:
    """Predicted seconds per phase and in total (``"step"``), by the model in the module docstring.

    ``bubble`` stretches forward and backward for a pipeline: ``1 / (1 - idle fraction)``, which is
    ``(microbatches + partitions - 1) / microbatches`` for 1F1B.
    ``host_state_bytes``: the part of the state offloaded to host memory (the CPU steps it). ``overlap``: whether
    communication runs beside compute (accelerators) or takes turns with it (CPUs).
    """
    compute = {"forward": flops / 3 / device.flops_per_s, "backward": 2 * flops / 3 / device.flops_per_s}
    out: dict[str, float] = {}
    for name in ("forward", "backward"):
        phase = phases.get(name)
        comm = comm_seconds(phase, world_size, link, with_nodes) if phase is not None else 0.0
        copies = _copy_seconds(phase, device)
        if overlap:
            calls = (sum(phase.calls.values()) + sum(phase.torch_calls.values())) if phase is not None else 0
            exposed = comm / calls if calls else 0.0  # one average collective, before or after all compute
            out[name] = (max(compute[name], comm, copies) + exposed) * bubble
        else:
            out[name] = (compute[name] + comm + copies) * bubble
    optimizer = phases.get("optimizer")
    optimizer_comm = comm_seconds(optimizer, world_size, link, with_nodes) if optimizer is not None else 0.0
    out["optimizer"] = (
        2 * state_bytes / device.memory_bytes_per_s
        + 2 * host_state_bytes / device.host_memory_bytes_per_s
        + optimizer_comm
        + _copy_seconds(optimizer, device)
    )
    out["step"] = out["forward"] + out["backward"] + out["optimizer"]
    return out


__all__ = ["DeviceSpec", "LinkSpec", "comm_seconds", "step_seconds", "wire_bytes"]
