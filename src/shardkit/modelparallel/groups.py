"""smp's named process groups (``smp.CommGroup``), rank kinds (``smp.RankType``) and the helpers for each group.

With ``tensor_parallel_degree`` t and ``partitions`` p, one model replica is held by the model-parallel group
``MP_GROUP`` (p x t ranks); its ranks holding one stage form the tensor-parallel group ``TP_GROUP``, and its ranks
with one tensor-parallel rank the pipeline group ``PP_GROUP``. The data-parallel group ``DP_GROUP`` is every rank
holding the same stage (tensor-parallel ranks included, as in smp: ``dp_size() == rdp_size() * tp_size()``), and
the reduced-data-parallel group ``RDP_GROUP`` the ranks holding the same stage *and* tensor-parallel slice. With
t = 1, ``PP_GROUP`` is ``MP_GROUP``, ``RDP_GROUP`` is ``DP_GROUP`` and ``TP_GROUP`` holds only the calling process.

Example::

    smp.init({"partitions": 2, "ddp": True})      # 4 processes: 2 stages x 2 replicas
    assert smp.get_dp_group() == [smp.rank() % 2, smp.rank() % 2 + 2]   # placement "cluster"
    assert smp.rdp_rank() == smp.dp_rank() and smp.tp_size() == 1
    smp.init({"tensor_parallel_degree": 2, "ddp": True})   # 4 processes, "cluster" = "DPT"
    assert smp.get_tp_group() == [smp.rank() // 2 * 2, smp.rank() // 2 * 2 + 1]
    assert smp.get_rdp_group() == [smp.rank() % 2, smp.rank() % 2 + 2] and smp.dp_size() == 4
"""

from __future__ import annotations

import enum

from shardkit.distributed import GroupLike
from shardkit.modelparallel.state import current, get_mp_process_group


class CommGroup(enum.Enum):
    """The groups smp's communication calls take (also ``smp.WORLD``, ``smp.MP_GROUP``, ...)."""

    #: Every process of the job.
    WORLD = 0
    #: The processes holding this process's model replica (its pipeline stages and tensor-parallel ranks).
    MP_GROUP = 1
    #: The processes holding the same stage as this process (tensor-parallel ranks included).
    DP_GROUP = 2
    #: The pipeline-parallel group: this replica's stages at this tensor-parallel rank.
    PP_GROUP = 3
    #: The tensor-parallel group: the processes splitting this stage's distributed modules.
    TP_GROUP = 4
    #: The reduced-data-parallel group: the processes holding the same stage and tensor-parallel slice.
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
    topo = current().topology
    if group is CommGroup.WORLD:
        return list(range(topo.world_size))
    if group is CommGroup.MP_GROUP:
        return topo.smp_mp_group_ranks()
    if group is CommGroup.PP_GROUP:
        return topo.mp_group_ranks(topo.dp_rank)
    if group is CommGroup.DP_GROUP:
        return topo.dp_group_ranks(topo.mp_rank)
    if group is CommGroup.RDP_GROUP:
        return topo.group_ranks("data")
    if group is CommGroup.TP_GROUP:
        return topo.group_ranks("tensor")
    raise TypeError(f"expected an smp.CommGroup (smp.WORLD, smp.MP_GROUP, smp.DP_GROUP, ...), got {group!r}")


def process_group(group: CommGroup) -> GroupLike:
    """The process group behind ``group`` (a one-process dummy group for ``TP_GROUP`` at degree one)."""
    state = current()
    if group is CommGroup.WORLD:
        return state.world_group
    if group is CommGroup.MP_GROUP:
        return get_mp_process_group()
    if group is CommGroup.PP_GROUP:
        return state.mp_group
    if group is CommGroup.DP_GROUP:
        return state.dp_group
    if group is CommGroup.RDP_GROUP:
        return state.rdp_group
    if group is CommGroup.TP_GROUP:
        return state.tp_group
    raise TypeError(f"expected an smp.CommGroup (smp.WORLD, smp.MP_GROUP, smp.DP_GROUP, ...), got {group!r}")


def tp_rank() -> int:
    """Rank within the tensor-parallel group."""
    return current().topology.tp_rank


def tp_size() -> int:
    """Size of the tensor-parallel group (``tensor_parallel_degree``)."""
    return current().topology.tp_size


def rdp_rank() -> int:
    """Rank within the reduced-data-parallel group (:func:`dp_rank` without tensor parallelism)."""
    return current().topology.rdp_rank


def rdp_size() -> int:
    """Size of the reduced-data-parallel group: ``dp_size() // tp_size()``."""
    return current().topology.rdp_size


def get_tp_group() -> list[int]:
    """Global ranks of this process's tensor-parallel group (as ``smp.get_mp_group`` lists its own): ``[rank()]``
    without tensor parallelism (used by scripts as ``0 in smp.get_tp_group()``)."""
    return group_ranks(CommGroup.TP_GROUP)


def get_pp_group() -> list[int]:
    """Global ranks of this process's pipeline group, in stage order (= ``smp.get_mp_group()`` at TP degree 1)."""
    return group_ranks(CommGroup.PP_GROUP)


def get_rdp_group() -> list[int]:
    """Global ranks of this process's reduced-data-parallel group (= ``smp.get_dp_group()`` at TP degree 1)."""
    return group_ranks(CommGroup.RDP_GROUP)


def get_pp_process_group() -> GroupLike:
    """The pipeline-parallel process group."""
    return current().mp_group


def get_rdp_process_group() -> GroupLike:
    """The reduced-data-parallel process group."""
    return current().rdp_group


def get_tp_process_group() -> GroupLike:
    """The tensor-parallel process group: a real ``torch.distributed`` group under tensor parallelism; at degree one
    this process alone, as a one-rank ``DummyProcessGroup`` (shardkit's collectives treat it as the identity;
    ``torch.distributed`` calls do not accept it)."""
    return current().tp_group


#: smp also names the groups at module level (``smp.WORLD``, ``smp.DP_GROUP``, ...).
WORLD = CommGroup.WORLD
MP_GROUP = CommGroup.MP_GROUP
DP_GROUP = CommGroup.DP_GROUP
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
