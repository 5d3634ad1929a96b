"""The one object holding a process's smp state, ``smp.init`` that builds it, and the rank helpers reading it.

Everything smp knows about the job (config, topology, process groups, the single :class:`DistributedModel`)
lives in one :class:`SMPState`, held by the process-wide :class:`ProcessState` (plain attributes behind a lock,
not a ``ContextVar``: ``smp.rank()`` must answer in every thread, including autograd's device threads and a
data loader's workers); :func:`reset` drops it (tests build several jobs in one process).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from shardkit import restarts
from shardkit.distributed import DummyProcessGroup, GroupLike, all_gather_objects
from shardkit.distributed import collectives as C
from shardkit.distributed.device import select_device
from shardkit.distributed.exit_release import release_at_exit
from shardkit.distributed.groups import torch_group
from shardkit.modelparallel.config import ConfigLike, ModelParallelConfig, config_differences, resolve_config
from shardkit.modelparallel.config_notes import log_notes
from shardkit.modelparallel.sdp.rules import check_sdp_layout
from shardkit.modelparallel.topology import Topology
from shardkit.tensor_parallel import ParallelState, build_parallel_state, set_current_state


@dataclass
class SMPState:
    """Config, topology and process groups of this process, plus its model and optimizer."""

    config: ModelParallelConfig
    topology: Topology
    world_group: GroupLike
    #: The pipeline group: this replica's stages (smp's ``PP_GROUP``; its ``MP_GROUP`` without tensor parallelism).
    mp_group: GroupLike
    #: smp's data-parallel group: the ranks holding this stage, tensor-parallel ranks included.
    dp_group: GroupLike
    p2p_group: GroupLike
    local_rank: int
    local_size: int
    #: Groups smp created (destroyed by :func:`reset`).
    owned_groups: list[Any] = field(default_factory=list)
    #: The one ``DistributedModel`` of this process.
    model: Optional[Any] = None
    #: The ``DistributedOptimizer`` wrapping the model's optimizer, if any.
    optimizer: Optional[Any] = None
    #: Undo actions run by :func:`reset` (the model gives its wrapped modules back), last registered first.
    on_reset: list[Callable[[], None]] = field(default_factory=list)
    #: Under tensor parallelism: the core's device mesh over the same layout (its groups are tensor, reduced data
    #: and pipeline), also made the tensor-parallel layers' current state.
    parallel_state: Optional[ParallelState] = None
    #: Under tensor parallelism: smp's model-parallel group (pipeline x tensor); ``mp_group`` without it.
    model_group: Optional[GroupLike] = None

    @property
    def tp_group(self) -> GroupLike:
        """The tensor-parallel group (this process alone, as a dummy group, at degree one)."""
        if self.parallel_state is None:
            return DummyProcessGroup(0, 1)
        return self.parallel_state.tp_group

    @property
    def rdp_group(self) -> GroupLike:
        """The reduced-data-parallel group: ranks of the same stage and tensor-parallel rank."""
        return self.dp_group if self.parallel_state is None else self.parallel_state.group("data")

    @property
    def distributed(self) -> bool:
        """True when real process groups exist (even of size one)."""
        return not isinstance(self.world_group, DummyProcessGroup)


class ProcessState:
    """The one holder of this process's :class:`SMPState`, visible from every thread.

    smp's state is process-wide by definition (one job, one model per process), so it is an ordinary
    attribute: any thread reads what :func:`init` set. The lock only orders ``init``/``reset`` against each
    other; reading is a plain attribute load.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: Optional[SMPState] = None
        #: True once smp.init created the default process group itself (from torchrun's environment).
        self.created_world = False

    def get(self) -> Optional[SMPState]:
        """The state, or None before :func:`init` / after :func:`reset`."""
        return self._state

    def install(self, state: SMPState) -> None:
        """Make ``state`` this process's smp state (an error if one is already installed)."""
        with self._lock:
            if self._state is not None:
                raise RuntimeError(
                    "smp.init() was already called in this process; call it once at the start of the script"
                )
            self._state = state

    def take(self) -> Optional[SMPState]:
        """Remove and return the state (None when there was none)."""
        with self._lock:
            state, self._state = self._state, None
            return state


PROCESS = ProcessState()
"""This process's smp state holder."""


def current() -> SMPState:
    """The state built by :func:`init`; a clear error when ``smp.init()`` was not called."""
    state = PROCESS.get()
    if state is None:
        raise RuntimeError("smp is not initialised: call smp.init() (or smp.init(config)) at the start of the script")
    return state


def is_initialized() -> bool:
    """True once :func:`init` has run in this process (and :func:`reset` has not)."""
    return PROCESS.get() is not None


def init(config: ConfigLike = None) -> None:
    """Initialise smp from the environment torchrun sets, or from an already initialised process group.

    ``config`` holds smp's keys (``partitions``, ``microbatches``, ``pipeline``, ``auto_partition``,
    ``default_partition``, ``optimize``, ``memory_weight``, ``ddp``, ``placement_strategy``, ...); without it
    the JSON object in ``$SM_HP_MP_PARAMETERS`` (what SageMaker sets) is used, else ``$SHARDKIT_SMP_CONFIG``
    (a JSON object or a file path), else the defaults (see :mod:`~.config_sources`; each rank reads its own
    environment before any collective). Every rank must pass the same config: a difference is reported on
    every rank. Without torchrun's variables and without a process group, smp runs
    as a single process.

    Example::

        import shardkit.modelparallel as smp
        smp.init({"partitions": 2, "microbatches": 4, "ddp": True})
    """
    if is_initialized():
        raise RuntimeError("smp.init() was already called in this process; call it once at the start of the script")
    try:
        cfg: Optional[ModelParallelConfig] = resolve_config(config)
        problem: Optional[Exception] = None
    except (TypeError, ValueError) as exc:  # agreed on below, so a config bad on one rank fails on every rank
        cfg, problem = None, exc
    _ensure_process_group()
    cfg = _agreed_config(cfg, problem)
    if not dist.is_initialized():
        model = cfg.partitions * cfg.tensor_parallel_degree
        if model != 1:
            asked = f"partitions={cfg.partitions}" + (
                f" x tensor_parallel_degree={cfg.tensor_parallel_degree}" if cfg.tensor_parallel_degree > 1 else ""
            )
            raise ValueError(
                f"{asked} needs {model} processes: launch with torchrun --nproc-per-node {model} (or initialise "
                "torch.distributed first)"
            )
        check_sdp_layout(cfg.sharded_data_parallel_degree, 1, 1)
        dummy = DummyProcessGroup(0, 1)
        topo = Topology(1, 0, 1, cfg.placement_strategy)
        PROCESS.install(SMPState(cfg, topo, dummy, dummy, dummy, dummy, 0, 1))
        return
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # Every rank checks the same config against the same world size, so a bad layout fails everywhere, before
    # any group exists.
    topo = Topology(world_size, rank, cfg.partitions, cfg.placement_strategy, cfg.tensor_parallel_degree)
    check_sdp_layout(cfg.sharded_data_parallel_degree, topo.rdp_size, topo.tp_size)
    if topo.dp_size > 1 and not cfg.ddp:
        raise ValueError(
            f"{world_size} processes with partitions={cfg.partitions} make {topo.dp_size} model "
            "replicas: set 'ddp': True in the smp config so their gradients are averaged, or launch "
            f"{cfg.partitions} processes"
        )
    world = dist.group.WORLD
    assert world is not None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if topo.tp_size == 1:
        mp_group, dp_group, p2p_group, owned = _create_groups(topo)
        _groups_connected(world)
        PROCESS.install(SMPState(cfg, topo, world, mp_group, dp_group, p2p_group, local_rank, local_size, owned))
        return
    parallel = build_parallel_state(topo.layout)
    mp_group = parallel.group("pipeline")
    _, dp_group, p2p_group, owned = _create_groups(topo, pipelines=False)
    model_group = _create_model_groups(topo, owned)
    owned += [parallel.group(dim) for dim in ("data", "pipeline", "context", "tensor")]
    _groups_connected(world)
    set_current_state(parallel)
    state = SMPState(cfg, topo, world, mp_group, dp_group, p2p_group, local_rank, local_size, owned)
    state.parallel_state, state.model_group = parallel, model_group
    state.on_reset.append(lambda: set_current_state(None))
    PROCESS.install(state)


def _groups_connected(world: Any) -> None:
    """Wait until every rank has finished creating smp's groups. torch's ``new_group`` returns once this rank's
    side of a gloo group is connected (no barrier unless ``TORCH_DIST_INIT_BARRIER=1``): a rank that went on and
    destroyed its groups (``smp.reset()``, or leaving) could otherwise close a connection a slower peer was still
    opening, which fails there with gloo's "connectFullMesh ... Connection closed by peer"."""
    device = select_device()
    C.barrier(world, label="smp_groups_created", device=device if device.type == "cuda" else None)


def _create_groups(topo: Topology, pipelines: bool = True) -> tuple[Any, Any, Any, list[Any]]:
    """This rank's pipeline (when ``pipelines``), data-parallel and point-to-point groups, and every group created
    (to destroy on reset).

    ``new_group`` is collective over the whole world: every rank creates every group, in the same order.
    """
    owned: list[Any] = []
    mp_group = dp_group = None
    for dp_rank in range(topo.dp_size if pipelines else 0):
        group = dist.new_group(topo.mp_group_ranks(dp_rank))
        owned.append(group)
        mp_group = group if dp_rank == topo.dp_rank else mp_group
    for mp_rank in range(topo.mp_size):
        group = dist.new_group(topo.dp_group_ranks(mp_rank))
        owned.append(group)
        dp_group = group if mp_rank == topo.mp_rank else dp_group
    # Activations travel on their own group so user collectives on the world group never interleave with them.
    p2p_group = dist.new_group(list(range(topo.world_size)))
    owned.append(p2p_group)
    return mp_group, dp_group, p2p_group, owned


def _create_model_groups(topo: Topology, owned: list[Any]) -> Any:
    """smp's model-parallel groups (pipeline x tensor, one per reduced-data-parallel rank); returns this rank's."""
    mine = None
    seen: set[tuple[int, ...]] = set()
    for member in range(topo.world_size):
        ranks = tuple(
            Topology(topo.world_size, member, topo.mp_size, topo.placement, topo.tp_size).smp_mp_group_ranks()
        )
        if ranks in seen:
            continue
        seen.add(ranks)
        group = dist.new_group(list(ranks))
        owned.append(group)
        mine = group if topo.rank in ranks else mine
    return mine


def reset() -> None:
    """Forget this process's smp state and destroy the groups smp created (for tests; the world group stays)."""
    state = PROCESS.take()
    if state is None:
        return
    for undo in reversed(state.on_reset):
        undo()
    for group in state.owned_groups:
        if dist.is_initialized():
            dist.destroy_process_group(group)


def _ensure_process_group() -> None:
    """Initialise the default group from torchrun's environment when it is there and nobody did yet."""
    if dist.is_initialized() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    restarts.init_process_group(backend, timedelta(minutes=30))  # restart-safe under torchrun --max-restarts
    PROCESS.created_world = True


def _release_at_exit() -> None:
    """Destroy smp's groups at interpreter exit, and the default group when smp created it: smp scripts never call
    ``destroy_process_group()``, and a group left to finalisation can abort the exit
    (:mod:`shardkit.distributed.exit_release`)."""
    reset()
    if PROCESS.created_world and dist.is_initialized():
        dist.destroy_process_group()
    PROCESS.created_world = False


release_at_exit("smp's process groups", _release_at_exit)


def _agreed_config(cfg: Optional[ModelParallelConfig], problem: Optional[Exception]) -> ModelParallelConfig:
    """``cfg`` once every rank has read the same valid config (one all-gather over the world); else an error on
    every rank: the failing ranks re-raise their own, the others name them. Rank 0 then logs the config's notes."""
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is not None and dist.get_world_size() > 1:
        report = (cfg.to_dict(), None) if cfg is not None else (None, f"{type(problem).__name__}: {problem}")
        gathered = all_gather_objects(report, world, "smp_init_config")
        failed = [(r, error) for r, (_, error) in enumerate(gathered) if error is not None]
        if failed and problem is None:
            raise ValueError(
                f"smp.init failed on rank(s) {', '.join(str(r) for r, _ in failed)} (every rank must read a valid "
                "config):\n" + "\n".join(f"  rank {r}: {error}" for r, error in failed)
            )
        diffs = [] if failed else config_differences([values for values, _ in gathered])
        if diffs:
            raise ValueError(
                "smp.init got a different config on different ranks; pass the same config everywhere:\n"
                + "\n".join(diffs)
            )
    if problem is not None:
        raise problem
    assert cfg is not None
    if world is None or dist.get_rank() == 0:
        log_notes(cfg, dist.get_backend() if world is not None else "none: one process")
    return cfg


# ---- rank helpers -------------------------------------------------------------------------------------------


def rank() -> int:
    """Global rank of this process."""
    return current().topology.rank


def size() -> int:
    """Number of processes in the job."""
    return current().topology.world_size


def local_rank() -> int:
    """Rank among the processes on this machine."""
    return current().local_rank


def local_size() -> int:
    """Number of processes on this machine."""
    return current().local_size


def mp_rank() -> int:
    """Rank in the model-parallel group (the pipeline stage without tensor parallelism; with it,
    ``pp_rank() * tp_size() + tp_rank()``)."""
    return current().topology.smp_mp_rank


def mp_size() -> int:
    """Processes holding one model replica: ``pp_size() * tp_size()``."""
    topo = current().topology
    return topo.mp_size * topo.tp_size


def dp_rank() -> int:
    """Rank among the processes holding the same pipeline stage (smp's data-parallel group, which includes the
    tensor-parallel ranks: ``rdp_rank() * tp_size() + tp_rank()``)."""
    return current().topology.dp_rank


def dp_size() -> int:
    """Processes holding the same pipeline stage: ``rdp_size() * tp_size()`` (each loads its own batch unless
    ``prescaled_batch``)."""
    return current().topology.dp_size


def pp_rank() -> int:
    """Pipeline stage (partition index) held by this process."""
    return current().topology.mp_rank


def pp_size() -> int:
    """Number of pipeline stages (``partitions`` / ``pipeline_parallel_degree``)."""
    return current().topology.mp_size


def get_mp_group() -> list[int]:
    """Global ranks holding this process's model replica (pipeline x tensor), in ``mp_rank`` order."""
    return current().topology.smp_mp_group_ranks()


def get_dp_group() -> list[int]:
    """Global ranks holding the same partition as this process."""
    topo = current().topology
    return topo.dp_group_ranks(topo.mp_rank)


def get_world_process_group() -> GroupLike:
    """The process group of all processes."""
    return current().world_group


def get_mp_process_group() -> GroupLike:
    """The process group of this process's model replica (its pipeline stages and tensor-parallel ranks)."""
    state = current()
    return state.model_group if state.model_group is not None else state.mp_group


def get_dp_process_group() -> GroupLike:
    """The process group of the processes holding the same partition (data-parallel peers)."""
    return current().dp_group


def barrier() -> None:
    """Wait until every process reaches this point (shardkit's internal world barrier; scripts' ``smp.barrier``
    is :func:`shardkit.modelparallel.comm.barrier`, per group and checked)."""
    state = current()
    if state.distributed:
        dist.barrier(group=torch_group(state.world_group, "smp.barrier"))
