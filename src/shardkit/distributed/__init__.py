"""Process groups and labelled collectives shared by every strategy."""

from shardkit.distributed.arrival import MissedCallError, every_rank_calls
from shardkit.distributed.collectives import CommMeter, comm_delay, count_comm_bytes
from shardkit.distributed.dummy import DummyProcessGroup
from shardkit.distributed.groups import (
    GroupLike,
    global_rank,
    group_rank,
    group_size,
    is_dummy,
    resolve_group,
    torch_group,
)
from shardkit.distributed.health import (
    CollectiveMismatchError,
    PeerLeftError,
    RankFailedError,
    check_collectives,
    install_failure_reporter,
    report_failure,
)
from shardkit.distributed.node_traffic import set_topology
from shardkit.distributed.objects import all_gather_objects, broadcast_object, gather_objects
from shardkit.distributed.topology import NodeLayout, Topology

__all__ = [
    "CollectiveMismatchError",
    "CommMeter",
    "DummyProcessGroup",
    "GroupLike",
    "MissedCallError",
    "NodeLayout",
    "PeerLeftError",
    "RankFailedError",
    "Topology",
    "all_gather_objects",
    "broadcast_object",
    "check_collectives",
    "comm_delay",
    "count_comm_bytes",
    "every_rank_calls",
    "gather_objects",
    "global_rank",
    "group_rank",
    "group_size",
    "install_failure_reporter",
    "is_dummy",
    "report_failure",
    "resolve_group",
    "set_topology",
    "torch_group",
]
