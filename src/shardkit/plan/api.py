"""``shardkit.plan.estimate``: the memory and traffic of one rank of a real strategy, before a cluster exists.

Example::

    import torch, shardkit.plan
    from shardkit.models import LMConfig, TransformerLM

    cfg = LMConfig.bench()
    est = shardkit.plan.estimate(
        lambda: TransformerLM(cfg), (torch.randint(0, cfg.vocab_size, (8, cfg.seq_len)),),
        loss_fn=lambda logits, batch: logits.float().pow(2).mean(), strategy="fsdp", world_size=64,
    )
    print(est.format())
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from shardkit.plan.accountant import HostMemoryExceeded
from shardkit.plan.cost import DeviceSpec, LinkSpec, step_seconds, wire_bytes
from shardkit.plan.peerless import PLANNED_BACKENDS
from shardkit.plan.pipeline import pipeline_bubble, plan_stages, smp_config
from shardkit.plan.runner import PHASES, LossFn, PlanError, RankRun, default_loss, run_rank, warmup_steps
from shardkit.plan.strategies import PIPELINE, OptionError, get, offload_options
from shardkit.plan.tensor_parallel import check_tensor_parallel, data_group
from shardkit.strategies.registry import OptimizerSpec

#: Share of this machine's memory a CPU fallback run may use.
HOST_FRACTION = 0.25


@dataclass(frozen=True)
class HostMemory:
    """What one rank keeps in host (CPU) memory: state offloaded by the strategy (FSDP's ``cpu_offload``).

    Zero everywhere for a strategy that offloads nothing.
    """

    #: Highest host bytes alive over the planned steps, by category and phase at that peak (``"setup"``: the
    #: model is built and wrapped in host memory).
    peak_bytes: int = 0
    peak_breakdown: Mapping[str, int] = field(default_factory=dict)
    peak_phase: str = ""
    #: Parameters + gradients + optimizer state in host memory between steps.
    state_bytes: int = 0
    #: Bytes copied per step into host memory (gradient shards) and onto the device (parameter shards).
    to_host_bytes: int = 0
    to_device_bytes: int = 0


@dataclass(frozen=True)
class Estimate:
    """One rank of ``strategy`` at ``world_size``: memory, traffic and predicted time of one training step."""

    strategy: str
    world_size: int
    #: ``"meta"`` (nothing allocated) or ``"cpu"`` (a fallback run on real tensors; see ``notes``).
    device: str
    #: Highest device bytes alive over the planned steps (forward, backward and optimizer step).
    peak_bytes: int
    #: Parameters + gradients + optimizer state on the device after the step (what stays between steps).
    state_bytes: int
    #: Bytes by category at the peak: parameters, gradients, optimizer_state, activations, comm_buffers,
    #: temporaries.
    peak_breakdown: Mapping[str, int]
    #: The phase (forward, backward, optimizer) and innermost module running at the peak.
    peak_phase: str
    peak_module: str
    #: Bytes by category between steps.
    state_breakdown: Mapping[str, int]
    #: Bytes this rank sends per step, per collective kind (ring model; torch DDP's reductions included).
    comm_bytes: Mapping[str, int]
    #: The same per phase.
    comm_bytes_by_phase: Mapping[str, Mapping[str, int]]
    #: Ranks per node the plan assumed (None: no node layout, every byte at one link speed).
    nprocs_per_node: Optional[int]
    #: The part of ``comm_bytes`` that crosses nodes, per kind (empty without ``nprocs_per_node``); the rest stays
    #: inside a node.
    inter_node_bytes: Mapping[str, int]
    #: Predicted seconds of one step (see :mod:`shardkit.plan.cost`), and per phase.
    step_seconds: float
    phase_seconds: Mapping[str, float]
    #: FLOPs of one step on this rank.
    flops: float
    #: Host memory: offloaded state and the copies between host and device (zeros without offload).
    host: HostMemory = field(default_factory=HostMemory)
    #: The peak of device and host memory together (one memory, as in a CPU run; ``peak_bytes`` without offload).
    total_peak_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    #: The tensor-parallel degree planned (the strategy ran over ``world_size / tensor_parallel`` data ranks).
    tensor_parallel: int = 1

    def fits(self, memory_bytes: int, host_memory_bytes: Optional[int] = None) -> bool:
        """Whether the peak fits in ``memory_bytes`` per device (and the offloaded state in ``host_memory_bytes``
        of host memory per rank, when given)."""
        host_fits = host_memory_bytes is None or self.host.peak_bytes <= host_memory_bytes
        return self.peak_bytes <= memory_bytes and host_fits

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return asdict(self)

    def format(self) -> str:
        """A few lines for people."""
        gib = 2**30
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in self.peak_breakdown.items() if v)
        comm = ", ".join(f"{k} {v / gib:.3f}" for k, v in self.comm_bytes.items()) or "none"
        where = f"{self.peak_phase}" + (f" in {self.peak_module}" if self.peak_module else "")
        host = (
            f"; host peak {self.host.peak_bytes / gib:.2f} GiB, state {self.host.state_bytes / gib:.2f} GiB"
            if self.host.peak_bytes
            else ""
        )
        tensor = f" (tensor-parallel {self.tensor_parallel})" if self.tensor_parallel > 1 else ""
        return (
            f"{self.strategy} x{self.world_size}{tensor}: peak {self.peak_bytes / gib:.2f} GiB at {where} ({parts}); "
            f"state {self.state_bytes / gib:.2f} GiB{host}; sends {comm} GiB/step; "
            f"step {self.step_seconds * 1e3:.1f} ms"
        )


def _check_args(strategy: str, world_size: int, nprocs_per_node: Optional[int], options: Mapping[str, Any]) -> None:
    if strategy != PIPELINE:
        get(strategy)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if strategy == PIPELINE:
        smp_config(options, world_size)  # refuses partitions that do not divide the world
    if nprocs_per_node is not None and (
        not isinstance(nprocs_per_node, int) or nprocs_per_node < 1 or world_size % nprocs_per_node
    ):
        raise ValueError(
            f"nprocs_per_node must be a positive int that divides world_size ({world_size}), got {nprocs_per_node!r}"
        )


def _host_limit() -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return int(total * HOST_FRACTION)


def _plan_on(
    device: torch.device,
    model_fn: Callable[[], nn.Module],
    batch: Any,
    loss_fn: LossFn,
    strategy: str,
    world_size: int,
    optimizer: type,
    optimizer_options: Mapping[str, Any],
    strategy_options: Mapping[str, Any],
    nprocs_per_node: Optional[int],
    backend: str,
    tensor_parallel: int = 1,
) -> RankRun:
    limit = _host_limit() if device.type != "meta" else None
    if strategy == PIPELINE:
        return plan_stages(
            device, model_fn, batch, loss_fn, world_size, optimizer, optimizer_options, strategy_options, limit,
            nprocs_per_node, backend,
        )  # fmt: skip
    entry, spec = get(strategy), OptimizerSpec(optimizer, dict(optimizer_options))
    return run_rank(
        device,
        model_fn,
        lambda model, topology: entry.build(model, spec, data_group(), strategy_options, topology),
        batch,
        loss_fn,
        world_size,
        limit,
        nprocs_per_node,
        warmup=warmup_steps(strategy),
        backend=backend,
        # FSDP exists for models too big for one device: it is planned as built and wrapped in host memory, with
        # only this rank's shards then moved onto the device (unless offloaded, when they stay in host memory).
        build_in_host_memory=strategy == "fsdp",
        state_to_device=strategy == "fsdp" and not offload_options(strategy, strategy_options),
        tensor_parallel=tensor_parallel,
    )


def _run(*args: Any) -> RankRun:
    """Plan on meta; if the model or the strategy cannot run there, on CPU within :data:`HOST_FRACTION`."""
    try:
        return _plan_on(torch.device("meta"), *args)
    except (PlanError, OptionError):
        raise
    except Exception as exc:  # anything the model or strategy cannot do on meta: try real tensors
        meta_error = exc
    offloaded = offload_options(args[3], args[7])
    if offloaded:
        raise PlanError(
            f"CPU offload ({', '.join(offloaded)}) is planned on the meta device only (on CPU the offloaded state "
            f"and the device's would be one memory), and this model does not run there "
            f"({type(meta_error).__name__}: {meta_error}): make model_fn build under torch.device('meta'), or plan "
            "without offload"
        ) from meta_error
    try:
        run = _plan_on(torch.device("cpu"), *args)
    except HostMemoryExceeded as exc:
        raise PlanError(
            f"the model or strategy does not run on the meta device ({type(meta_error).__name__}: {meta_error}), "
            f"and on CPU it {exc}, past the {HOST_FRACTION:.0%} of this machine's host memory a plan may use: "
            "make model_fn build under "
            "torch.device('meta') (no data-dependent initialisation) or plan on a machine with more memory"
        ) from meta_error
    except Exception as cpu_error:
        raise PlanError(
            f"one training step did not run, on the meta device ({type(meta_error).__name__}: {meta_error}) nor on "
            f"CPU ({type(cpu_error).__name__}: {cpu_error}); check that batch is one rank's inputs (a tensor, a "
            "tuple passed as model(*batch) or a dict passed as model(**batch), with the dtypes the model expects) "
            "and that loss_fn(output, batch) returns a scalar"
        ) from cpu_error
    run.notes = (*run.notes, f"ran on CPU: not on meta ({type(meta_error).__name__}: {meta_error})")
    return run


def child_main() -> None:
    """Entry point of the planning child process: pickled arguments on stdin, pickled outcome on stdout."""
    args = pickle.load(sys.stdin.buffer)
    result_stream = sys.stdout.buffer
    sys.stdout = sys.stderr  # whatever the model prints must not corrupt the pickled result
    try:
        outcome: tuple[str, Any] = ("ok", _run(*args))
    except Exception as exc:  # sent back and re-raised in the caller
        outcome = ("error", exc)
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # an exception that does not pickle: its message is enough
        payload = pickle.dumps(("error", PlanError(f"{type(outcome[1]).__name__}: {outcome[1]}")))
    result_stream.write(payload)
    result_stream.flush()


def _in_child(args: tuple[Any, ...]) -> RankRun:
    """Plan in a fresh interpreter: this process has a default process group of its own.

    A plain subprocess rather than ``multiprocessing``: the caller may itself be a daemonic worker (launchers and
    test harnesses start ranks that way), and those may not start ``multiprocessing`` children.
    """
    try:
        payload = pickle.dumps(args)
    except Exception as exc:
        raise PlanError(
            "this process has a torch.distributed group, so estimate() plans in a child process and needs "
            f"model_fn, batch and loss_fn to be picklable (module-level functions, not lambdas): {exc}"
        ) from exc
    code = "from shardkit.plan.api import child_main; child_main()"
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, check=False)
    if done.returncode != 0 or not done.stdout:
        raise PlanError(f"the planning child process failed (exit {done.returncode}):\n{done.stderr.decode()[-2000:]}")
    status, value = pickle.loads(done.stdout)
    if status == "error":
        raise value
    result: RankRun = value
    return result


def estimate(
    model_fn: Callable[[], nn.Module],
    batch: Any,
    *,
    loss_fn: Optional[LossFn] = None,
    strategy: str,
    world_size: int,
    optimizer: type = torch.optim.AdamW,
    optimizer_options: Optional[Mapping[str, Any]] = None,
    strategy_options: Optional[Mapping[str, Any]] = None,
    nprocs_per_node: Optional[int] = None,
    device: Optional[DeviceSpec] = None,
    link: Optional[LinkSpec] = None,
    backend: str = "nccl",
    tensor_parallel: int = 1,
) -> Estimate:
    """Run one training step of ``strategy``'s real code for one rank of ``world_size`` and report its cost.

    ``model_fn()`` builds the unwrapped model (it is called under ``torch.device("meta")``: a 70B model plans on a
    laptop; a model that cannot be built there is built on CPU if it fits in a quarter of this machine's memory);
    ``batch`` is one rank's inputs (for ``smp``, one model replica's, which spans its ``partitions`` ranks),
    passed as ``model(*batch)`` for a tuple, ``model(**batch)`` for a dict; ``loss_fn(output, batch)`` gives
    the loss (default: the output if it is a scalar). ``strategy_options`` are
    the strategy constructor's keyword arguments (for FSDP also ``auto_wrap_policy``; default: one unit per
    block of the model's ``ModuleList``s; for ``oss_ddp``/``oss_sdp`` OSS's own under ``"oss"``; for ``smp`` the
    ``smp.init`` config, planned once per pipeline stage, reporting the stage with the highest peak). The process
    group has ``world_size`` ranks and no other process behind it (:mod:`shardkit.plan.peerless`); if the caller
    has a process group of its own the plan runs in a child process. ``nprocs_per_node`` lays the ranks out in
    nodes of that many consecutive ranks: the comm meter then splits intra- from inter-node bytes, hybrid options
    (FSDP's ``sharding_strategy="HYBRID_SHARD"``, ``hybrid=True`` for ``oss_ddp``/``oss_sdp``) shard inside a
    node, and SlowMo averages inside a node every step. ``device`` and ``link`` feed the step-time model
    (:mod:`shardkit.plan.cost`). ``backend`` is the planned run's: ``"nccl"`` (accelerators, the default) or
    ``"gloo"`` (a CPU run, where strategies exchange some tensors by direct sends whose receive buffers count).
    ``tensor_parallel=t`` plans a model whose ``model_fn`` builds :mod:`shardkit.tensor_parallel` layers: it is
    built inside a ``data x t`` layout (:mod:`shardkit.plan.tensor_parallel`) and the strategy runs over the
    ``world_size / t`` data-parallel ranks; the layers' collectives are counted with the strategy's.

    Example: see the module docstring.
    """
    _check_args(strategy, world_size, nprocs_per_node, strategy_options or {})
    check_tensor_parallel(tensor_parallel, world_size, strategy == PIPELINE)
    if backend not in PLANNED_BACKENDS:
        raise ValueError(
            f"backend must be one of {PLANNED_BACKENDS} (the planned run's: 'gloo' for a CPU run), got {backend!r}"
        )
    args = (
        model_fn, batch, loss_fn or default_loss, strategy, world_size, optimizer,
        dict(optimizer_options or {}), dict(strategy_options or {}), nprocs_per_node, backend, tensor_parallel,
    )  # fmt: skip
    run = _in_child(args) if dist.is_initialized() else _run(*args)
    stretch = 1.0
    if strategy == PIPELINE:
        config = smp_config(strategy_options or {}, world_size)
        micro, parts = int(config.get("microbatches", 1)), int(config["partitions"])
        schedule = str(config.get("pipeline", "interleaved"))
        virtual = int(config.get("virtual_stages", 1))
        idle = pipeline_bubble(schedule, parts, micro, virtual)
        stretch = 1.0 / (1.0 - idle)  # busy time / (1 - idle fraction) = the step
        shape = f"{parts} stages x {micro} mb" + (f", {virtual} virtual stages" if virtual > 1 else "")
        run.notes = (f"{schedule} pipeline bubble {idle:.1%} of the step ({shape})", *run.notes)
    est = _estimate_from(
        run, strategy, world_size, device or DeviceSpec(), link or LinkSpec(), nprocs_per_node, stretch, backend,
        tensor_parallel,
    )  # fmt: skip
    return est


def _sum_kinds(per_phase: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for per_kind in per_phase.values():
        for kind, nbytes in per_kind.items():
            total[kind] = total.get(kind, 0) + nbytes
    return total


def _estimate_from(
    run: RankRun,
    strategy: str,
    world_size: int,
    device: DeviceSpec,
    link: LinkSpec,
    nprocs_per_node: Optional[int],
    bubble: float = 1.0,
    backend: str = "nccl",
    tensor_parallel: int = 1,
) -> Estimate:
    # torch's own collectives (DDP's) span the strategy's group: the data-parallel ranks
    ring = world_size // tensor_parallel
    by_phase = {name: wire_bytes(run.phases[name], ring) for name in PHASES if name in run.phases}
    total = _sum_kinds(by_phase)
    with_nodes = nprocs_per_node is not None
    inter = _sum_kinds({name: run.phases[name].inter_node_bytes for name in by_phase}) if with_nodes else {}
    seconds = step_seconds(
        run.flops["total"], run.phases, run.state_bytes, ring, device, link, with_nodes, bubble,
        run.host_state_bytes, overlap=backend != "gloo",
    )  # fmt: skip
    copies = _sum_kinds({name: phase.host_copy_bytes for name, phase in run.phases.items()})
    host = HostMemory(
        run.host_peak_bytes, run.host_peak_by_category, run.host_peak_phase, run.host_state_bytes,
        copies.get("to_host", 0), copies.get("to_device", 0),
    )  # fmt: skip
    return Estimate(
        strategy=strategy,
        world_size=world_size,
        device=run.device,
        peak_bytes=run.peak_bytes,
        state_bytes=run.state_bytes,
        peak_breakdown=run.peak_by_category,
        peak_phase=run.peak_phase,
        peak_module=run.peak_module,
        state_breakdown=run.state_by_category,
        comm_bytes=total,
        comm_bytes_by_phase=by_phase,
        nprocs_per_node=nprocs_per_node,
        inter_node_bytes=inter,
        step_seconds=seconds["step"],
        phase_seconds={k: v for k, v in seconds.items() if k != "step"},
        flops=run.flops["total"],
        host=host,
        total_peak_bytes=run.total_peak_bytes or run.peak_bytes,
        notes=run.notes,
        tensor_parallel=tensor_parallel,
    )


__all__ = ["Estimate", "HostMemory", "estimate"]
