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
from shardkit.distributed.health import (
    CollectiveMismatchError,
    RankFailedError,
    check_collectives,
    install_failure_reporter,
    report_failure,
)

__all__ = [
    "CollectiveMismatchError",
    "CommMeter",
    "DummyProcessGroup",
    "GroupLike",
    "RankFailedError",
    "broadcast_object",
    "check_collectives",
    "comm_delay",
    "count_comm_bytes",
    "global_rank",
    "group_rank",
    "group_size",
    "install_failure_reporter",
    "is_dummy",
    "report_failure",
    "resolve_group",
]
