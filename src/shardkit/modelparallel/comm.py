"""smp's communication API: Python objects between processes, named by smp's groups and rank kinds.

``smp.broadcast(obj, group)`` sends ``obj`` to every other member of ``group``; each of them receives it with
``smp.recv_from(src, rank_type)``, as it would a ``smp.send``. ``smp.allgather(obj, group)`` and
``smp.barrier(group)`` are collectives of the group. Objects travel pickled over the world process group
(:func:`shardkit.distributed.object_p2p.send_object`), with their own tag, so they never match the pipeline's
activations (which have a group of their own) or a script's own ``torch.distributed`` calls.

A collective made by some ranks of its group only would leave them waiting in mismatched collectives; so
``allgather`` and ``barrier`` first check, through the store, that every member makes the same call
(:func:`shardkit.distributed.arrival.every_rank_calls`): otherwise they warn, then fail on the calling ranks
(``$SHARDKIT_CALL_TIMEOUT``, capped below the process group's and ``check_collectives``' timeouts), naming the
missing ranks.

Example::

    metrics = smp.allgather({"loss": loss, "correct": correct}, smp.DP_GROUP)   # one entry per replica
    if smp.rank() == 0:
        smp.broadcast(config, smp.WORLD)
    else:
        config = smp.recv_from(0, smp.RankType.WORLD_RANK)
"""

from __future__ import annotations

from typing import Any, Optional

from shardkit.distributed import all_gather_objects
from shardkit.distributed import collectives as C
from shardkit.distributed.arrival import every_rank_calls
from shardkit.distributed.object_p2p import recv_object, send_object
from shardkit.modelparallel.groups import RANK_GROUP, CommGroup, RankType, group_ranks, process_group
from shardkit.modelparallel.state import current


def _group(group: Any, call: str) -> CommGroup:
    if not isinstance(group, CommGroup):
        raise TypeError(
            f"{call} takes an smp.CommGroup (smp.WORLD, smp.MP_GROUP, smp.PP_GROUP, smp.DP_GROUP, smp.RDP_GROUP, "
            f"smp.TP_GROUP), got {group!r}"
        )
    return group


def _peer(rank: Any, rank_type: Any, call: str) -> int:
    """The global rank of ``rank`` read as ``rank_type``; a clear error when it is not another member."""
    if not isinstance(rank_type, RankType):
        raise TypeError(
            f"{call} takes an smp.RankType (smp.RankType.WORLD_RANK, MP_RANK, DP_RANK, ...), got {rank_type!r}"
        )
    group = RANK_GROUP[rank_type]
    ranks = group_ranks(group)
    me = current().topology.rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(ranks):
        raise ValueError(
            f"{call}: rank {rank!r} ({rank_type.name}) is outside the {group.name} of rank {me}, which has "
            f"{len(ranks)} member(s), {rank_type.name} 0..{len(ranks) - 1} (global ranks {ranks})"
        )
    if ranks[rank] == me:
        raise ValueError(f"{call}: rank {rank} ({rank_type.name}) is this process (global rank {me}) itself")
    return ranks[rank]


def broadcast(obj: Any, group: CommGroup) -> None:
    """Send the picklable ``obj`` to every other member of ``group``; each receives it with :func:`recv_from`.

    Returns once every member's copy is on its way (smp documents it as synchronous).
    """
    group = _group(group, "smp.broadcast")
    state = current()
    me = state.topology.rank
    for peer in group_ranks(group):
        if peer != me:
            send_object(obj, peer, state.world_group, label=f"smp.broadcast:{group.name}")


def send(obj: Any, dest_rank: int, rank_type: RankType) -> None:
    """Send the picklable ``obj`` to the member ``dest_rank`` of this process's group of kind ``rank_type``
    (e.g. ``smp.send(x, 1, smp.RankType.MP_RANK)``: to stage 1 of this replica); it receives with
    :func:`recv_from`."""
    state = current()
    peer = _peer(dest_rank, rank_type, "smp.send")
    send_object(obj, peer, state.world_group, label="smp.send")


def recv_from(src_rank: int, rank_type: RankType) -> Any:
    """Receive the object that member ``src_rank`` (read as ``rank_type``) sent with :func:`send` or
    :func:`broadcast`; blocks until it arrives."""
    state = current()
    peer = _peer(src_rank, rank_type, "smp.recv_from")
    return recv_object(peer, state.world_group, label="smp.recv_from")


def allgather(obj: Any, group: CommGroup) -> list[Any]:
    """Every member's ``obj``, in the order of their rank in ``group``, on every member (collective)."""
    group = _group(group, "smp.allgather")
    pg = process_group(group)
    every_rank_calls(f"smp.allgather(obj, {group.name})", pg, _HINT)
    return all_gather_objects(obj, pg, f"smp.allgather:{group.name}")


def barrier(group: Optional[CommGroup] = None) -> None:
    """Wait until every member of ``group`` (default ``smp.WORLD``) reaches this call."""
    group = _group(CommGroup.WORLD if group is None else group, "smp.barrier")
    pg = process_group(group)
    every_rank_calls(f"smp.barrier({group.name})", pg, _HINT)
    C.barrier(pg, label=f"smp.barrier:{group.name}")


def dp_barrier() -> None:
    """``smp.barrier(smp.DP_GROUP)``."""
    barrier(CommGroup.DP_GROUP)


def mp_barrier() -> None:
    """``smp.barrier(smp.MP_GROUP)``."""
    barrier(CommGroup.MP_GROUP)


_HINT = (
    "smp.allgather and smp.barrier are collectives of their group: call them on every member, in the same order "
    "(for example gather metrics on every rank and print them on rank 0 only)."
)
