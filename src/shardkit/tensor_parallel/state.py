"""The device mesh of one :class:`ParallelLayout`, its process groups, and the process's current one.

:func:`build_parallel_state` turns a layout into one ``torch.distributed.device_mesh.DeviceMesh`` whose dimensions
are named after :data:`~shardkit.tensor_parallel.layout.DIMS`; every group a strategy needs (tensor, data, pipeline,
context) is a dimension of that one mesh. Every rank of the world must call it, in the same order as its other
group creations (torch's rule for new groups).

Model code written against fairscale's API asks for "the" model-parallel group without naming it, so the process
holds one current state (:func:`set_current_state` / :func:`current_state`). It is process-wide on purpose, not a
``ContextVar``: the layers' autograd functions read it from backward, which on CUDA runs on autograd's own threads.

Example::

    state = build_parallel_state(ParallelLayout.for_world(dist.get_world_size(), tensor=2))
    set_current_state(state)
    state.tp_size, state.tp_rank, state.tp_mesh   # 2, 0 or 1, DeviceMesh((tensor=2), ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit.distributed.exit_release import release_at_exit
from shardkit.tensor_parallel.layout import DIMS, ParallelCoords, ParallelLayout


@dataclass(frozen=True)
class ParallelState:
    """One layout's mesh and this process's place in it. Build it with :func:`build_parallel_state`."""

    layout: ParallelLayout
    mesh: DeviceMesh
    rank: int

    @property
    def coords(self) -> ParallelCoords:
        """This process's rank in each kind of group."""
        return self.layout.coords(self.rank)

    def submesh(self, dim: str) -> DeviceMesh:
        """The 1-D mesh of this process's group along ``dim`` (``data``, ``pipeline``, ``context`` or ``tensor``)."""
        return self.mesh[dim]

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of this process along ``dim``."""
        return self.mesh.get_group(dim)

    def ranks(self, dim: str) -> list[int]:
        """The global ranks of this process's group along ``dim``, in group-rank order."""
        return self.layout.group_ranks(dim, self.rank)

    @property
    def tp_mesh(self) -> DeviceMesh:
        """The tensor-parallel mesh: the ranks that split one layer."""
        return self.submesh("tensor")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """The tensor-parallel process group."""
        return self.group("tensor")

    @property
    def tp_rank(self) -> int:
        """This process's rank in the tensor-parallel group."""
        return self.coords.tensor

    @property
    def tp_size(self) -> int:
        """The tensor-parallel degree."""
        return self.layout.tensor


def build_parallel_state(
    layout: ParallelLayout,
    device_type: Optional[str] = None,
    backends: Optional[dict[str, Optional[str]]] = None,
    timeout: Optional[timedelta] = None,
) -> ParallelState:
    """Create the process groups of ``layout`` and the mesh over them (a collective: every rank calls it).

    ``device_type`` is the mesh's device (``"cuda"`` on NCCL, else ``"cpu"``; guessed from the default group's
    backend when None). ``backends`` optionally names a backend per dimension (``{"tensor": "nccl"}``; the others
    use the default group's) and ``timeout`` the groups' collective timeout. Raises ``ValueError`` on every rank,
    before any group is created, when the layout does not cover the world.
    """
    _require_distributed()
    world_size = dist.get_world_size()
    if layout.world_size != world_size:
        raise ValueError(
            f"the parallel layout {dict(zip(DIMS, layout.shape))} covers {layout.world_size} ranks but the world has "
            f"{world_size}: data x pipeline x context x tensor must equal the world size"
        )
    unknown = set(backends or {}) - set(DIMS)
    if unknown:
        raise ValueError(f"backends: unknown dimensions {sorted(unknown)}; use {list(DIMS)}")
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    rank = dist.get_rank()
    groups = [_my_group(layout, dim, rank, (backends or {}).get(dim), timeout) for dim in DIMS]
    mesh = DeviceMesh.from_group(groups, device_type, mesh=layout.grid(), mesh_dim_names=DIMS)
    return ParallelState(layout, mesh, rank)


def _require_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tensor parallelism needs torch.distributed: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment for it)"
        )


def _my_group(
    layout: ParallelLayout, dim: str, rank: int, backend: Optional[str], timeout: Optional[timedelta]
) -> dist.ProcessGroup:
    """Create every group along ``dim`` (each rank creates all of them, in the same order, as torch requires) and
    return the one holding ``rank``."""
    mine = None
    seen: set[tuple[int, ...]] = set()
    for member in range(layout.world_size):
        ranks = tuple(layout.group_ranks(dim, member))
        if ranks in seen:
            continue
        seen.add(ranks)
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None
    return mine


class _Current:
    """The process's current :class:`ParallelState` (see the module docstring for why it is process-wide)."""

    state: Optional[ParallelState] = None


def _forget_current_state() -> None:
    _Current.state = None


release_at_exit("the tensor-parallel state", _forget_current_state)


def set_current_state(state: Optional[ParallelState]) -> None:
    """Make ``state`` the one layers and mappings use when given no mesh or group (None clears it)."""
    _Current.state = state


def current_state(who: str = "tensor parallelism") -> ParallelState:
    """The current :class:`ParallelState`; raises a clear error when none was set."""
    state = _Current.state
    if state is None:
        raise RuntimeError(
            f"{who} needs the model-parallel groups: call "
            "shardkit.nn.model_parallel.initialize.initialize_model_parallel(model_parallel_size) (or "
            "shardkit.tensor_parallel.set_current_state(build_parallel_state(...))) after "
            "torch.distributed.init_process_group() and before building or running model-parallel layers"
        )
    return state


def has_current_state() -> bool:
    """Whether a current :class:`ParallelState` is set."""
    return _Current.state is not None


def init_parallel_state(
    tensor: int,
    pipeline: int = 1,
    context: int = 1,
    device_type: Optional[str] = None,
    backends: Optional[dict[str, Optional[str]]] = None,
    timeout: Optional[timedelta] = None,
) -> ParallelState:
    """Lay the world out with these degrees (data parallelism takes the rest), build its mesh and make it current.

    A collective: every rank calls it with the same arguments. A layout that does not fit the world raises the
    same ``ValueError`` on every rank before any group is created.

    Example::

        state = init_parallel_state(tensor=2)        # 8 processes: 4 data-parallel replicas of a TP-2 model
    """
    _require_distributed()
    layout = ParallelLayout.for_world(dist.get_world_size(), tensor=tensor, pipeline=pipeline, context=context)
    state = build_parallel_state(layout, device_type, backends, timeout)
    set_current_state(state)
    return state
