"""Methods every rank must call (they gather from every rank): refused at once when some ranks do not.

``state_dict()`` on rank 0 only is the classic mistake: rank 0 blocks in its first all-gather while the other
ranks go on, and both sides wait in mismatched collectives until the process group's timeout. The check itself
(each rank posts the method's name in the process group's store and waits for every rank's post) is
:func:`shardkit.distributed.call_checks.every_rank_calls`; see there for the timeout and the errors. Costs a few
store round trips per call, on calls that already move the whole model; never on the training step.
"""

from __future__ import annotations

from shardkit.distributed import call_checks
from shardkit.distributed.groups import GroupLike

_HINT = (
    "It gathers from every rank, so every rank must call it (for example call model.state_dict() on every rank "
    "and save the result on rank 0 only)"
)


def every_rank_calls(group: GroupLike, what: str) -> None:
    """Return once every rank of ``group`` has called the FSDP method ``what`` (e.g. ``"state_dict()"``) as its
    next such call; raises ``RuntimeError`` naming the missing ranks, or the differing calls, otherwise."""
    call_checks.every_rank_calls(group, what, _HINT, "FullyShardedDataParallel")
