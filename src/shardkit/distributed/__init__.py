"""Process groups and labelled collectives shared by every strategy."""

from shardkit.distributed.collectives import CommMeter, comm_delay, count_comm_bytes
from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.groups import (
    GroupLike,
    broadcast_object,
    global_rank,
    group_rank,
    group_size,
    is_dummy,
    resolve_group,
)

__all__ = [
    "CommMeter",
    "DummyProcessGroup",
    "GroupLike",
    "broadcast_object",
    "comm_delay",
    "count_comm_bytes",
    "global_rank",
    "group_rank",
    "group_size",
    "is_dummy",
    "resolve_group",
]
