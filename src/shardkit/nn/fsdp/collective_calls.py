"""FullyShardedDataParallel's methods that every rank must call, checked before their first collective.

``state_dict()``, ``load_state_dict()``, ``summon_full_params()``, the optimizer-state gathers and the sharded
state-dict calls gather from every rank; each first enters :func:`every_rank_calls`, which meets the other ranks
through the store (:mod:`shardkit.distributed.arrival`): a rank left waiting warns within 20 s naming the ranks
that have not called, and every rank that called raises after ``SHARDKIT_CALL_TIMEOUT`` seconds (180 by default).
"""

from __future__ import annotations

from shardkit.distributed import arrival
from shardkit.distributed.groups import GroupLike

_ADVICE = (
    "Call it on every rank and keep or save the result on rank 0 only, e.g. `sd = model.state_dict()` on every "
    "rank, then `if rank == 0: torch.save(sd, path)`."
)


def every_rank_calls(group: GroupLike, what: str) -> None:
    """Return once every rank of ``group`` has called the FSDP method ``what`` (e.g. ``"state_dict()"``).

    Raises :class:`~shardkit.distributed.arrival.MissedCallError` on every rank that called it when some ranks do
    not, and at once when ranks called different such methods. A dummy or single-rank group returns at once.
    """
    arrival.every_rank_calls(f"FullyShardedDataParallel.{what}", group, _ADVICE)
