"""smp's named process groups (``smp.CommGroup``), rank kinds (``smp.RankType``) and the helpers for each group.

Without tensor parallelism (shardkit has none yet) smp's groups reduce to three: the pipeline group ``PP_GROUP``
is the model-parallel group ``MP_GROUP`` (one model replica's stages), the reduced-data-parallel group
``RDP_GROUP`` is the data-parallel group ``DP_GROUP`` (the replicas of one stage), and the tensor-parallel group
``TP_GROUP`` holds only the calling process (``tp_rank() == 0``, ``tp_size() == 1``).

Example::

    smp.init({"partitions": 2, "ddp": True})      # 4 processes: 2 stages x 2 replicas
    assert smp.get_dp_group() == [smp.rank() % 2, smp.rank() % 2 + 2]   # placement "cluster"
    assert smp.rdp_rank() == smp.dp_rank() and smp.tp_size() == 1
"""

from __future__ import annotations

import enum

from shardkit.distributed import DummyProcessGroup, GroupLike
from shardkit.modelparallel.state import current, dp_rank, dp_size


class CommGroup(enum.Enum):
    """The groups smp's communication calls take (also ``smp.WORLD``, ``smp.MP_GROUP``, ...)."""

    #: Every process of the job.
    WORLD = 0
    #: The processes holding this process's model replica (its pipeline stages).
    MP_GROUP = 1
    #: The processes holding the same stage as this process (its data-parallel peers).
    DP_GROUP = 2
    #: The pipeline-parallel group: ``MP_GROUP`` without tensor parallelism.
    PP_GROUP = 3
    #: The tensor-parallel group: this process alone.
    TP_GROUP = 4
    #: The reduced-data-parallel group: ``DP_GROUP`` without tensor parallelism.
    RDP_GROUP = 5


class RankType(enum.Enum):
    """How ``smp.send``/``smp.recv_from`` read a rank: within the world, or within one of this process's groups."""

    WORLD_RANK = 0
    MP_RANK = 1
    DP_RANK = 2
    PP_RANK = 3
    TP_RANK = 4
    RDP_RANK = 5


#: The group a rank of each kind counts within.
RANK_GROUP = {
    RankType.WORLD_RANK: CommGroup.WORLD,
    RankType.MP_RANK: CommGroup.MP_GROUP,
    RankType.DP_RANK: CommGroup.DP_GROUP,
    RankType.PP_RANK: CommGroup.PP_GROUP,
    RankType.TP_RANK: CommGroup.TP_GROUP,
    RankType.RDP_RANK: CommGroup.RDP_GROUP,
}


def group_ranks(group: CommGroup) -> list[int]:
    """Global ranks of this process's ``group``, in group-rank order."""
    state = current()
    topo = state.topology
    if group is CommGroup.WORLD:
        return list(range(topo.world_size))
    if group in (CommGroup.MP_GROUP, CommGroup.PP_GROUP):
        return topo.mp_group_ranks(topo.dp_rank)
    if group in (CommGroup.DP_GROUP, CommGroup.RDP_GROUP):
        return topo.dp_group_ranks(topo.mp_rank)
    if group is CommGroup.TP_GROUP:
        return [topo.rank]
    raise TypeError(f"expected an smp.CommGroup (smp.WORLD, smp.MP_GROUP, smp.DP_GROUP, ...), got {group!r}")


def process_group(group: CommGroup) -> GroupLike:
    """The process group behind ``group`` (a one-process dummy group for ``TP_GROUP``)."""
    state = current()
    if group is CommGroup.WORLD:
        return state.world_group
    if group in (CommGroup.MP_GROUP, CommGroup.PP_GROUP):
        return state.mp_group
    if group in (CommGroup.DP_GROUP, CommGroup.RDP_GROUP):
        return state.dp_group
    if group is CommGroup.TP_GROUP:
        return DummyProcessGroup(0, 1)
    raise TypeError(f"expected an smp.CommGroup (smp.WORLD, smp.MP_GROUP, smp.DP_GROUP, ...), got {group!r}")


def tp_rank() -> int:
    """Rank within the tensor-parallel group: always 0 (no tensor parallelism)."""
    current()
    return 0


def tp_size() -> int:
    """Size of the tensor-parallel group: always 1 (no tensor parallelism)."""
    current()
    return 1


def rdp_rank() -> int:
    """Rank within the reduced-data-parallel group: :func:`dp_rank` without tensor parallelism."""
    return dp_rank()


def rdp_size() -> int:
    """Size of the reduced-data-parallel group: :func:`dp_size` without tensor parallelism."""
    return dp_size()


def get_tp_group() -> list[int]:
    """Global ranks of this process's tensor-parallel group (as ``smp.get_mp_group`` lists its own): ``[rank()]``
    without tensor parallelism (used by scripts as ``0 in smp.get_tp_group()``)."""
    return group_ranks(CommGroup.TP_GROUP)


def get_pp_group() -> list[int]:
    """Global ranks of this process's pipeline group, in stage order (= ``smp.get_mp_group()`` here)."""
    return group_ranks(CommGroup.PP_GROUP)


def get_rdp_group() -> list[int]:
    """Global ranks of this process's reduced-data-parallel group (= ``smp.get_dp_group()`` here)."""
    return group_ranks(CommGroup.RDP_GROUP)


def get_pp_process_group() -> GroupLike:
    """The pipeline-parallel process group: the model-parallel one without tensor parallelism."""
    return current().mp_group


def get_rdp_process_group() -> GroupLike:
    """The reduced-data-parallel process group: the data-parallel one without tensor parallelism."""
    return current().dp_group


def get_tp_process_group() -> GroupLike:
    """The tensor-parallel group: this process alone, as a one-rank ``DummyProcessGroup`` (shardkit's collectives
    treat it as the identity; ``torch.distributed`` calls do not accept it)."""
    current()
    return DummyProcessGroup(0, 1)


#: smp also names the groups at module level (``smp.WORLD``, ``smp.DP_GROUP``, ...).
WORLD = CommGroup.WORLD
MP_GROUP = CommGroup.MP_GROUP
DP_GROUP = CommGroup.DP_GROUP
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
